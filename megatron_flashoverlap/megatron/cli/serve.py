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

Stopping: SIGTERM (to the launcher, to torchrun or to the ranks) or SIGINT. Rank 0 then has its frontends answer
503 "the server is stopping" to what is in flight (engine_watch.py), stops the frontends, the engines of every
rank and the coordinator (`MegatronAsyncLLM.shutdown`) and prints `server stopped`; the other ranks end when rank 0
stops their engines. The stop is bounded by what can take long, not by a fixed time (`stop_server`): the engines
pause after their current step, which no collective lets outlast the process group's timeout
(--distributed-timeout-minutes), then Megatron's pause and stop barriers and the coordinator get STOP_SLACK_S.
Past either bound the coordinator is killed and rank 0 exits 1 naming the phase (a rank has ended or hangs), with
no interpreter teardown around the engine thread still inside Megatron's loop (that aborted the process). Under
the launcher torchrun's own shutdown grace (its SIGKILL after SIGTERM) is set past that bound
(`torchrun_grace_s`). torchrun signals each rank's whole process group, and Ctrl-C reaches every process of the
terminal: the coordinator process is started with both signals ignored, so the orderly shutdown still finds it
alive (its faulthandler prints its stack on SIGTERM, then carries on); the frontends (hypercorn) stop on the
signal themselves. A start that fails once the engines run (the port taken) stops them the same way, then raises.

Faults: an engine loop that ends on an error (Megatron logs it and stops only that loop: a peer rank died, a
collective timed out) ends its rank non-zero; on rank 0 the frontends first answer every request 503 naming the
cause and are stopped. A rank 0 that dies (kill -9) is seen by its frontends, which answer 503 "rank 0 (pid N)
ended" and report it to the launcher (engine_watch.py); the launcher ends what a dead rank leaves (launch.py)
and the ranks still running (failures.py), so no server answers without its engines.

With one expert-parallel rank, Megatron's engine consensus is refreshed every loop (`serving_config`): with its
default (every 20 loops) an engine whose requests drained kept a stale "work pending" and ran a dummy forward per
loop (a whole forward, its all-reduces included) until the next refresh, not yielding its event loop: a stop, or
a request, waited for up to 20 of them.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import signal
import sys
import time
from typing import Optional, Sequence

from . import engine_watch, launch, request_checks

STOP_SLACK_S = 30.0  # an orderly stop's time beyond the engines' current step: the frontends (Megatron gives each
#                      3 s), its pause and stop barriers and the coordinator's teardown; again once the step ended
EXIT_SLACK_S = 30.0  # after the stop: the ranks' own exit (process groups, interpreter), within torchrun's grace
MEGATRON_TIMEOUT_MIN = 10  # Megatron's --distributed-timeout-minutes default (DistributedInitConfig)
TORCHRUN_GRACE_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"  # torchrun's SIGTERM-to-SIGKILL grace, read by torchrun


def add_serve_args(parser):
    """Megatron's argparse parser + this entry's flags (launch_inference_server.py's names)."""
    group = parser.add_argument_group(title="megatron_flashoverlap.serve")
    group.add_argument("--host", default="127.0.0.1", help="HTTP bind address")
    group.add_argument("--port", type=int, default=5000, help="HTTP port")
    group.add_argument("--frontend-replicas", type=int, default=1, help="HTTP frontend processes on rank 0")
    group.add_argument("--coordinator-host", default=None, help="the coordinator's ZMQ address (default: Megatron's)")
    group.add_argument("--coordinator-port", type=int, default=None)
    return parser


def serving_config(config, args):
    """Megatron's InferenceConfig for serving: with one expert-parallel rank its consensus is local (no collective),
    so it is refreshed every engine loop instead of every `ep_consensus_interval` (module docstring)."""
    if getattr(args, "expert_model_parallel_size", 1) == 1:
        config.ep_consensus_interval = 1
    return config


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


class StopStuck(SystemExit):
    """The orderly stop ran past its bound while the engine thread is still inside Megatron's loop: `main` ends the
    rank without the interpreter's teardown, which aborted around that thread (SIGABRT)."""


def _engine_state(llm) -> str:
    return getattr(getattr(getattr(llm, "engine", None), "state", None), "name", "RUNNING")


async def stop_server(llm, step_s: float) -> None:
    """Rank 0: `llm.shutdown()` (the frontends, every rank's engine, the coordinator) in two bounded phases: until
    this rank's engine leaves RUNNING (its current step ends; `step_s`, the process group's timeout, plus
    STOP_SLACK_S), then STOP_SLACK_S for the pause and stop barriers and the coordinator. An engine that fails
    meanwhile, or a phase past its bound, kills the coordinator and exits non-zero naming it."""
    shutdown, down = asyncio.ensure_future(llm.shutdown()), asyncio.ensure_future(engine_down(llm))
    stepping, deadline = True, time.monotonic() + step_s + STOP_SLACK_S
    while True:
        await asyncio.wait([shutdown, down], timeout=ENGINE_POLL_S, return_when=asyncio.FIRST_COMPLETED)
        if shutdown.done():
            down.cancel()
            return shutdown.result()
        if down.done():
            kill_coordinator(llm)
            raise SystemExit(f"the inference engine on this rank stopped on an error during the orderly stop "
                             f"({down.result()}); the server ends without it (restart it)")
        if stepping and _engine_state(llm) != "RUNNING":  # the step ended: the rest is barriers and teardown
            stepping, deadline = False, time.monotonic() + STOP_SLACK_S
        if time.monotonic() > deadline:
            kill_coordinator(llm)
            raise StopStuck(_stuck(stepping, step_s))


def _stuck(stepping: bool, step_s: float) -> str:
    if stepping:
        what = (f"rank 0's engine was still in its step {step_s + STOP_SLACK_S:.0f} s after the stop began (the "
                f"process group's timeout, --distributed-timeout-minutes, plus {STOP_SLACK_S:.0f} s)")
    else:
        what = (f"the engines did not pause and stop within {STOP_SLACK_S:.0f} s of rank 0's engine ending its "
                f"step (Megatron's pause and stop barriers wait for every rank: one has ended or hangs)")
    return (f"the orderly stop did not end: {what}; the coordinator was killed and the server ends without its "
            f"orderly stop")


async def serve(args, model, tokenizer, config) -> None:
    """Coordinator-mode MegatronAsyncLLM serving HTTP on rank 0 until a signal (module docstring)."""
    import torch.distributed as dist
    from megatron.core.inference.apis import MegatronAsyncLLM, ServeConfig

    primary, watch = dist.get_rank() == 0, None
    if primary:  # before the frontends fork from this process
        positions = min(getattr(config, "max_sequence_length", None) or args.max_position_embeddings,
                        args.max_position_embeddings)
        request_checks.install(request_checks.Limits(vocab=tokenizer.vocab_size, positions=positions))
        engine_watch.install(watch := engine_watch.EngineWatch())
    step_s = 60.0 * args.distributed_timeout_minutes
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
                await stop_server(llm, step_s)
        raise
    stop = stop_event()
    engine, down = asyncio.ensure_future(llm.wait_for_shutdown()), asyncio.ensure_future(engine_down(llm))
    if not primary:  # rank 0 stops this rank's engine; an engine that failed ends this rank
        await asyncio.wait([engine, down], return_when=asyncio.FIRST_COMPLETED)
        _raise_if_down(down, llm, None)
        return
    print(f"serving on http://{args.host}:{args.port}", flush=True)
    await asyncio.wait([engine, down, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    if not down.done():
        await failing_step(llm)
    _raise_if_down(down, llm, watch)
    watch.stopping("the server is stopping (an orderly stop: SIGTERM or SIGINT); requests in flight are not "
                   "completed")
    await stop_server(llm, step_s)
    print("server stopped", flush=True)


ENGINE_POLL_S = 0.5  # how often each rank looks at its engine's loop
STOP_CAUSE_S = 2.0  # a stop signal while requests run: how long rank 0 waits for its engine's step to fail first


async def failing_step(llm) -> None:
    """On a stop signal: while this rank's engine has requests, wait up to STOP_CAUSE_S for its loop to fail. torchrun
    SIGTERMs rank 0 as soon as it sees a peer die, which can come before the engine's collective reports the lost
    peer; the requests in flight then get the engine's error as their 503, not "the server is stopping"."""
    engine = getattr(llm, "engine", None)
    deadline = time.monotonic() + STOP_CAUSE_S
    while engine is not None and engine.has_unfinished_requests() and engine_failure(llm) is None \
            and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


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


def _raise_if_down(down: asyncio.Future, llm, watch) -> None:
    """An engine that failed (seen by `down`, or now: a SIGTERM torchrun sends because a peer died comes before
    the next poll): on rank 0 the frontends answer 503 naming it, then stop (Megatron's stop: SIGTERM, 3 s,
    SIGKILL each); Megatron's coordinator (rank 0's child; it ignores SIGTERM) is killed and the rank exits
    non-zero, so torchrun ends the job and the launcher ends what the rank leaves."""
    import torch.distributed as dist

    failed = down.result() if down.done() else engine_failure(llm)
    if failed is None:
        down.cancel()
        return
    why = f"the inference engine on rank {dist.get_rank()} stopped on an error ({failed})"
    if watch is not None:
        from megatron.core.inference.text_generation_server.dynamic_text_gen_server.text_generation_server import (
            stop_text_gen_server)

        watch.stopping(f"{why}; the server is shutting down")
        stop_text_gen_server()  # their requests in flight are answered first (hypercorn waits for them)
    kill_coordinator(llm)
    raise SystemExit(f"{why}; the server ends (restart it)")


def torchrun_grace_s(argv: Sequence[str]) -> float:
    """torchrun's grace for the ranks to end after its SIGTERM, past the longest orderly stop (`stop_server`: a step
    within the process group's timeout, two slacks) and the ranks' exit: from --distributed-timeout-minutes."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--distributed-timeout-minutes", type=int, default=MEGATRON_TIMEOUT_MIN)
    minutes = p.parse_known_args(list(argv))[0].distributed_timeout_minutes
    return 60.0 * minutes + 2 * STOP_SLACK_S + EXIT_SLACK_S


def run() -> None:
    """One rank, `sys.argv` prepared (launch.prepare)."""
    import torch.distributed as dist
    from megatron.core.tokenizers.utils.build_tokenizer import build_tokenizer

    from .. import sites
    from .generate import inference_config, loaded_model

    args, model = loaded_model(add_serve_args)
    if dist.get_rank() == 0:
        print(sites.sites_line([model]), flush=True)
    config = serving_config(inference_config(args, model), args)
    asyncio.run(serve(args, model, build_tokenizer(args), config))


def main(argv: Optional[Sequence[str]] = None) -> None:
    """`argv` = [--cpu] [--nproc-per-node N] <megatron args and this entry's flags> (launch.run_entry); under the
    launcher torchrun gets `torchrun_grace_s` (a grace the user set in its environment variable stays)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if launch.launcher_options(argv)[1] is not None:
        os.environ.setdefault(TORCHRUN_GRACE_ENV, str(math.ceil(torchrun_grace_s(argv))))
    try:
        launch.run_entry("megatron_flashoverlap.serve", "serve", run, argv)
    except StopStuck as stuck:  # reported (launch.run_entry); the engine thread is still in Megatron's loop
        print(stuck.code, file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)


if __name__ == "__main__":
    main()
