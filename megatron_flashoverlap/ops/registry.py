"""The one registry of the overlap operators: algorithm words per operator, the dispatch tables
(op -> algo -> plain function), `resolve()`, and `force_reference()` that reaches every public operator.

The words are data defined once in `megatron_flashoverlap.config` (ALGOS, ALL_REDUCE_ALGOS, ULYSSES_ALGOS);
`reference` is the one name of the unfused path (the stock collective, then the GEMM). Each family
module fills its rows of `TABLES` where its functions are defined:

    @register("matmul_reduce_scatter", "flash")
    @register("matmul_reduce_scatter", "flash_bidir", bidirectional=True)
    def rs_matmul_ring(x, weight, group, ctx, *, num_chunks, bidirectional=False): ...

and a wrapper runs `plain(op, algo)(...)`; the operator's algorithm is never compared as a string there.
Ops named "<op>.<pass>" (e.g. "all_gather_matmul.backward") are the passes one public operator runs.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from typing import Callable

from ..config import ALGOS, ALL_REDUCE_ALGOS, MOE_ALGOS, ULYSSES_ALGOS

# the public operators and the algorithm words each takes (all_reduce's "auto" is resolved by the op)
ALLOWED = {
    "all_gather_matmul": ALGOS,
    "matmul_reduce_scatter": ALGOS,
    "matmul_all_reduce": ALGOS,
    "matmul_allreduce_dgrad": ALGOS,
    "all_reduce": ALL_REDUCE_ALGOS,
    "query_split_attention": ALGOS,
    "ulysses_attention": ULYSSES_ALGOS,
    "ulysses_fused_attention": ULYSSES_ALGOS,
    "matmul_wgrad_reduce_scatter": ("flash", "flash_bidir", "reference"),
    "expert_all_to_all": MOE_ALGOS,
}
RENAMED = {"stock": "reference", "off": "reference"}  # old words for the unfused path
TABLES: dict[str, dict[str, Callable]] = {}
_state = threading.local()


def register(op: str, algo: str, /, **fixed) -> Callable:
    """Decorator: `fn` (with `fixed` keyword arguments bound) is the plain function of `algo` for `op`."""
    def put(fn: Callable) -> Callable:
        row = TABLES.setdefault(op, {})
        if algo in row:
            raise ValueError(f"register: {op!r} already has a function for algo {algo!r}")
        row[algo] = functools.partial(fn, **fixed) if fixed else fn
        return fn
    return put


def plain(op: str, algo: str) -> Callable:
    """The plain function of `algo` for `op` (an algo that `resolve` accepted)."""
    try:
        return TABLES[op][algo]
    except KeyError:
        raise ValueError(f"{op}: no function registered for algo {algo!r}; registered: "
                         f"{sorted(TABLES.get(op, {}))}") from None


@contextlib.contextmanager
def force_reference():
    """Inside this block every public operator runs its unfused reference (collective, then GEMM)."""
    prev = getattr(_state, "forced", False)
    _state.forced = True
    try:
        yield
    finally:
        _state.forced = prev


def forced() -> bool:
    return getattr(_state, "forced", False)


def check_algo(op: str, algo: str) -> None:
    """ValueError naming the words `op` accepts (and the new name of a renamed word)."""
    allowed = ALLOWED[op]
    if algo in allowed:
        return
    hint = f" ({algo!r} is now called {RENAMED[algo]!r})" if algo in RENAMED else ""
    raise ValueError(f"{op}: unknown algo {algo!r}{hint}; choose one of {allowed}")


def resolve(op: str, algo: str, num_chunks: int | None = None, *, default_chunks: int | None = None
            ) -> tuple[str, int]:
    """-> (the algorithm to run, its chunk count): the forced reference wins; "slicing" needs num_chunks;
    with `default_chunks`, flash/flash_bidir also take num_chunks (sequence chunks, default default_chunks)."""
    check_algo(op, algo)
    if forced():
        return "reference", 1
    if algo == "slicing":
        return algo, _chunks(op, algo, num_chunks)
    if default_chunks is not None and algo in ("flash", "flash_bidir"):
        return algo, _chunks(op, algo, default_chunks if num_chunks is None else num_chunks)
    return algo, 1


def _chunks(op: str, algo: str, num_chunks) -> int:
    if num_chunks is None or int(num_chunks) < 1:
        raise ValueError(f"{op}: algo={algo!r} needs num_chunks >= 1 (e.g. num_chunks=4)")
    return int(num_chunks)
