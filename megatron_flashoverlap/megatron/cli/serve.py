"""The project's server entry: Megatron's OpenAI-compatible HTTP server (the megatron-core wheel's
`MegatronAsyncLLM.serve`, what Megatron-LM's `examples/inference/launch_inference_server.py` drives) on a model
built and loaded as megatron/cli/generate.py does, `--flash-overlap` understood.

    python -m megatron_flashoverlap.serve [--cpu] [--nproc-per-node N] <megatron model args> --load CKPT
        [--host 127.0.0.1] [--port 5000] [--frontend-replicas 1] [--flash-overlap [--flash-overlap-config F]]
    curl http://127.0.0.1:5000/v1/completions -d '{"prompt": [[0, 5, 9]], "max_tokens": 8, "temperature": 0}'

Per rank: the launcher's steps (`launch.prepare`), `initialize_megatron`, generate.load_model (our spec under
--flash-overlap), the GEMM sites line (rank 0), then `MegatronAsyncLLM` in coordinator mode (Megatron's
coordinator process, rank 0's HTTP frontend processes: needs the `serve` extra, pyzmq msgpack quart hypercorn).
Rank 0 prints `serving on http://HOST:PORT` once the frontend is up. Every completion and chat request is
checked first (request_checks.py: token ids, sampling ranges, max_tokens, logprobs): out of range, a 400 naming
the field and its range, and the engine never sees it.

Stopping: SIGTERM (to the launcher, to torchrun or to the ranks) or SIGINT. Rank 0 then stops the frontends,
the engines of every rank and the coordinator (`MegatronAsyncLLM.shutdown`; past SHUTDOWN_S seconds the
coordinator is killed) and prints `server stopped`; the other ranks end when rank 0 stops their engines.
torchrun signals each rank's whole process group, and Ctrl-C reaches every process of the terminal: the
coordinator process is started with both signals ignored, so the orderly shutdown still finds it alive (its
faulthandler prints its stack on SIGTERM, then carries on); the frontends (hypercorn) stop on the signal
themselves. A start that fails once the engines run (the port taken) stops them the same way, then raises.
An engine loop that ends on an error (Megatron logs it and stops only that loop) ends its rank non-zero: torchrun
ends the job and the launcher (launch.py) ends what the rank leaves, so no server answers without its engines.
"""
from __future__ import annotations

import asyncio
import contextlib
import signal
from typing import Optional, Sequence

from . import launch, request_checks

SHUTDOWN_S = 20.0  # seconds rank 0 waits for the engines and the coordinator to stop: under torchrun's 30 s
#                    between its SIGTERM and its SIGKILL, so a stuck stop still kills the coordinator


def add_serve_args(parser):
    """Megatron's argparse parser + this entry's flags (launch_inference_server.py's names)."""
    group = parser.add_argument_group(title="megatron_flashoverlap.serve")
    group.add_argument("--host", default="127.0.0.1", help="HTTP bind address")
    group.add_argument("--port", type=int, default=5000, help="HTTP port")
    group.add_argument("--frontend-replicas", type=int, default=1, help="HTTP frontend processes on rank 0")
    group.add_argument("--coordinator-host", default=None, help="the coordinator's ZMQ address (default: Megatron's)")
    group.add_argument("--coordinator-port", type=int, default=None)
    return parser


@contextlib.contextmanager
def signals_ignored():
    """SIGTERM and SIGINT ignored while the coordinator and the frontends start: they inherit it (fork; exec keeps
    an ignored signal), so the signal torchrun sends to each rank's process group stops the ranks only."""
    old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def stop_event() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT (the running loop's handlers; main thread)."""
    event, loop = asyncio.Event(), asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, event.set)
    return event


def kill_coordinator(llm) -> None:
    """SIGKILL to Megatron's coordinator process (it ignores SIGTERM by design), where it still runs."""
    coordinator = getattr(llm.engine, "inference_coordinator_process", None)
    if coordinator is not None and coordinator.is_alive():
        coordinator.kill()


async def stop_server(llm) -> None:
    """Rank 0: `llm.shutdown()` (frontends, every rank's engine, the coordinator) within SHUTDOWN_S; past it the
    coordinator process, which ignores SIGTERM, is killed and SystemExit says so."""
    try:
        await asyncio.wait_for(llm.shutdown(), SHUTDOWN_S)
    except asyncio.TimeoutError as err:
        kill_coordinator(llm)
        raise SystemExit(f"the server did not stop within {SHUTDOWN_S:.0f} s (engines or coordinator stuck); "
                         f"its coordinator process was killed") from err


async def serve(args, model, tokenizer, config) -> None:
    """Coordinator-mode MegatronAsyncLLM serving HTTP on rank 0 until a signal (module docstring)."""
    import torch.distributed as dist
    from megatron.core.inference.apis import MegatronAsyncLLM, ServeConfig

    primary = dist.get_rank() == 0
    if primary:  # before the frontends fork from this process
        positions = min(getattr(config, "max_sequence_length", None) or args.max_position_embeddings,
                        args.max_position_embeddings)
        request_checks.install(request_checks.Limits(vocab=tokenizer.vocab_size, positions=positions))
    with signals_ignored():
        llm = MegatronAsyncLLM(model=model, tokenizer=tokenizer, inference_config=config, use_coordinator=True,
                               coordinator_host=args.coordinator_host, coordinator_port=args.coordinator_port)
    try:
        with signals_ignored():
            await llm.serve(ServeConfig(host=args.host, port=args.port, frontend_replicas=args.frontend_replicas),
                            blocking=False)
    except BaseException:  # e.g. the port is taken: stop what started (every rank's engine, the coordinator)
        if primary:
            with contextlib.suppress(SystemExit):
                await stop_server(llm)
        raise
    stop = stop_event()
    engine, down = asyncio.ensure_future(llm.wait_for_shutdown()), asyncio.ensure_future(engine_down(llm))
    if not primary:  # rank 0 stops this rank's engine; an engine that failed ends this rank
        await asyncio.wait([engine, down], return_when=asyncio.FIRST_COMPLETED)
        _raise_if_down(down, llm)
        return
    print(f"serving on http://{args.host}:{args.port}", flush=True)
    await asyncio.wait([engine, down, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    _raise_if_down(down, llm)
    await stop_server(llm)
    print("server stopped", flush=True)


ENGINE_POLL_S = 0.5  # how often each rank looks at its engine's loop


def engine_failure(llm) -> str | None:
    """Why this rank's engine loop ended on an error (None: it runs, or it stopped in order). Megatron's loop
    logs its exception and ends its own thread (trace_async_exceptions: sys.exit), leaving the process up."""
    task = getattr(getattr(llm, "engine", None), "engine_loop_task", None)
    if task is None or not task.done() or task.cancelled():
        return None
    error = task.exception()
    if error is None:
        return None
    cause = error.__context__ if isinstance(error, SystemExit) and error.__context__ is not None else error
    return f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"


async def engine_down(llm) -> str:
    while True:
        await asyncio.sleep(ENGINE_POLL_S)
        why = engine_failure(llm)
        if why is not None:
            return why


def _raise_if_down(down: asyncio.Future, llm) -> None:
    """An engine that failed: Megatron's coordinator (rank 0's child; it ignores SIGTERM) is killed and the rank
    exits non-zero, so torchrun ends the job and the launcher ends what the rank leaves (the frontends)."""
    if not down.done():
        down.cancel()
        return
    kill_coordinator(llm)
    raise SystemExit(f"the inference engine on this rank stopped on an error ({down.result()}); the server "
                     f"ends (restart it)")


def run() -> None:
    """One rank, `sys.argv` prepared (launch.prepare)."""
    import torch.distributed as dist
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

    from .. import sites
    from .generate import inference_config, loaded_model

    args, model = loaded_model(add_serve_args)
    if dist.get_rank() == 0:
        print(sites.sites_line([model]), flush=True)
    asyncio.run(serve(args, model, build_tokenizer(args), inference_config(args, model)))


def main(argv: Optional[Sequence[str]] = None) -> None:
    """`argv` = [--cpu] [--nproc-per-node N] <megatron args and this entry's flags> (launch.run_entry)."""
    launch.run_entry("megatron_flashoverlap.serve", "serve", run, argv)


if __name__ == "__main__":
    main()
