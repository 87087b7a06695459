"""Rank side of benchmarks/serving/run.py: the project's server or offline entry on one rank, timed.

    run_ranks(["benchmarks.serving.rank", "serve", STOP, *serve_argv], world, ns=ns, ...)
        rank 0 -> [engine record per finished request]; the server stops when the file STOP appears
    run_ranks(["benchmarks.serving.rank", "generate", "-", *generate_argv], world, ns=ns, ...)
        rank 0 -> {"seconds", "tokens", "requests"}: the MegatronLLM generate call alone, timed after one untimed
        generate of the first prompt (the warm-up: engine set-up and the start-up all-reduce calibration)

Engine records (rank 0): Megatron 0.19's completions endpoint does not stream, so the first and last token
times come from the engine itself: every finished request passes DynamicInferenceRequestRecord.merge on its
way to the coordinator, and this module wraps it to keep {"prompt", "tokens", "added", "first", "finish"}:
the ADD_ENGINE event's time, that plus the engine's `ttft`, the FINISH event's time (time.time(), the clock the
client stamps `sent` and `done` with). The stop: a thread polls for STOP, then sends this rank SIGTERM, which
megatron/cli/serve.py turns into its orderly shutdown (every rank ends, rank 0 saves the records).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time

from benchmarks.harness.launch import save_result

RECORDS: list = []


def _event_time(request, name: str):
    return next((e.timestamp for e in request.events or [] if e.type.name == name), None)


def keep_records() -> None:
    """Wrap DynamicInferenceRequestRecord.merge: every merged (finished) request's times land in RECORDS."""
    from megatron.core.inference.inference_request import DynamicInferenceRequestRecord

    original = DynamicInferenceRequestRecord.merge

    def merge(self, *args, **kwargs):
        request = original(self, *args, **kwargs)
        added = _event_time(request, "ADD_ENGINE")
        RECORDS.append({"prompt": [int(t) for t in request.prompt_tokens.tolist()],
                        "tokens": [int(t) for t in request.generated_tokens], "added": added,
                        "first": None if request.ttft is None or added is None else added + request.ttft,
                        "finish": _event_time(request, "FINISH")})
        return request
    DynamicInferenceRequestRecord.merge = merge


def stop_when(path: str) -> None:
    """A daemon thread: once `path` exists, SIGTERM to this process (the server's orderly stop)."""
    def watch() -> None:
        while not os.path.exists(path):
            time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGTERM)
    threading.Thread(target=watch, daemon=True).start()


def serve(stop: str, argv: list[str]) -> None:
    from megatron_flashoverlap.megatron.cli import serve as entry

    if os.environ.get("RANK", "0") == "0":
        keep_records()
        stop_when(stop)
    entry.main(argv)
    if os.environ.get("RANK", "0") == "0":
        save_result(RECORDS)


def generate(argv: list[str]) -> None:
    from megatron_flashoverlap.megatron.cli import generate as entry

    timed, original = {}, entry.generate

    def generate_timed(args, model, prompts):
        original(args, model, prompts[:1])  # warm-up, not timed: the first decode's start-up all-reduce calibration
        t0 = time.perf_counter()
        results = original(args, model, prompts)
        timed.update(seconds=time.perf_counter() - t0, tokens=sum(len(r["tokens"]) for r in results),
                     requests=[r["tokens"] for r in results])
        return results
    entry.generate = generate_timed  # run() calls it by its module-global name
    entry.main(argv)
    if os.environ.get("RANK", "0") == "0":
        save_result(timed)


def main(argv: list[str]) -> None:
    mode, stop, entry_argv = argv[0], argv[1], argv[2:]
    if mode == "serve":
        serve(stop, entry_argv)
    elif mode == "generate":
        generate(entry_argv)
    else:
        raise SystemExit(f"benchmarks.serving.rank: mode {mode!r} is not serve or generate")


if __name__ == "__main__":
    main(sys.argv[1:])
