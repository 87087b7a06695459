"""Rank side of benchmarks/pretrain/run.py: the project entry on one rank, its output kept and parsed.

    run_ranks(["benchmarks.pretrain.rank", LOG, RS, *entry_argv], 2, ns=ns) -> [parse per rank]
        LOG: a path prefix for this rank's whole output (LOG.rank<r>.log), or "-" for none
        RS: "ring" (stock's reduce-scatters as P2P rings at line rate, benchmarks/harness/line_rate_rs.py) or "gloo"
        entry_argv: `python -m megatron_flashoverlap.pretrain_gpt`'s per-rank argv (no --nproc-per-node)

stdout and stderr are replaced before Megatron is imported (so its logging handlers write through them
too) by one tee that keeps the text in write order; the rank's own console stays quiet (Megatron prints
its whole argument table), except the tail of the output when the run fails.
"""
from __future__ import annotations

import os
import sys

from benchmarks.harness.launch import save_result
from benchmarks.pretrain.rows import parse_log


class _Tee:
    """A text stream that appends every write to a shared list (and echoes nothing)."""

    def __init__(self, stream, parts: list):
        self.stream, self.parts = stream, parts

    def write(self, s: str) -> int:
        self.parts.append(s)
        return len(s)

    def flush(self) -> None:
        pass

    def __getattr__(self, name):
        return getattr(self.stream, name)


def _keep(log: str, text: str) -> None:
    if log != "-":
        with open(f"{log}.rank{os.environ.get('RANK', '0')}.log", "w") as f:
            f.write(text)


def main(argv: list[str]) -> None:
    log, stock_rs, entry = argv[0], argv[1], argv[2:]
    parts: list = []
    real_out, real_err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Tee(real_out, parts), _Tee(real_err, parts)
    try:
        from benchmarks.harness.line_rate_rs import stock_reduce_scatter
        from megatron_flashoverlap.megatron.cli.pretrain_gpt import main as pretrain_main

        with stock_reduce_scatter(stock_rs):
            pretrain_main(entry)
    except BaseException:
        real_err.write("".join(parts)[-6000:])
        raise
    finally:
        sys.stdout, sys.stderr = real_out, real_err
        _keep(log, "".join(parts))
    save_result(parse_log("".join(parts)))


if __name__ == "__main__":
    main(sys.argv[1:])
