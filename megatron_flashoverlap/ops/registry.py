"""The one registry of the overlap operators: what each operator accepts and how one call is resolved.

    ALLOWED        op -> its algorithm words (defined once in `megatron_flashoverlap.config`: ALGOS,
                   ALL_REDUCE_ALGOS, ULYSSES_ALGOS, MOE_ALGOS); `reference` is the one name of the unfused
                   path (the stock collective, then the GEMM)
    TABLES         op -> algo -> plain function, filled by `register` where the functions are defined
    KNOBS          GEMM op -> the OpPlan knobs it reads besides algo and wire_dtype
    OpPlan         the settings object of one GEMM operator call (config/plan.py; a Megatron layer makes its
                   plans once, at construction: megatron/linear.py; a caller passes one as `plan=`; a
                   wrapper's `algo=` is the shorthand for OpPlan(algo))
    ring_of(plan, name, tag)  the runtime's option object of one ring pass of a plan, made once
    WgradRoute     where a GEMM operator's dW goes: returned, added into a buffer, or handed to a function
    Fp8Call        what an FP8 call carries besides its OpPlan: its WgradRoute and the delayed recipe's state
    resolve(op, plan) -> the plan the call runs (cached): words and knobs checked, force_reference() applied
    resolve_algo(op, algo) -> the word the call runs (the operators without an OpPlan)
    reference_plan(plan) -> the plan's unfused path (force_reference(), a group of one under FP8)
    force_reference()  every public operator runs its reference inside the block

Each family module fills its rows of `TABLES`:

    @register("matmul_reduce_scatter", "flash")
    @register("matmul_reduce_scatter", "flash_bidir")
    def rs_matmul_ring(x, weight, group, ctx, plan): ...

and a wrapper runs `plain(op, plan.algo)(...)`; the operator's algorithm is never compared as a string there:
a plain function gets the plan and reads the knobs it uses (a ring's direction is `plan.bidirectional`, so
flash and flash_bidir share a function). Ops named "<op>.<pass>" (e.g. "all_gather_matmul.backward") are the
passes one public operator runs.

OpPlan (config/plan.py, its knobs' legend there) is the settings object of a call; KNOBS below says which
knobs each GEMM operator reads (fp8: the four TP GEMM operators, every GEMM slice in FP8, every all-gather of an
operand in FP8 bytes, every reduce-scatter or all-reduce in bf16 / fp32 partials; refused by the others).
Per call a wrapper only resolves its plan (`resolve`, cached per operator and plan: a knob the operator does
not read is refused, not ignored; force_reference() gives the reference plan; the all-reduce operators' flash
chunks are filled in); the TP/SP operators then fix hop_chunks for the shard (tp_sp/plain.py hop_chunks_for
`sized`, cached too). WgradRoute(into=None, fn=None): dW returned to autograd (both None), added into `into`
slice by slice (e.g. Megatron's fp32 main_grad: runtime/accumulate.py), or handed to fn(dy_full, x_full) once
(e.g. the data-parallel reduce-scatter of dW inside its GEMM, megatron/ddp/grad_sync.py). A backward is given the route,
or None when autograd wants no dW.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import fields, replace
from typing import Callable, NamedTuple

import torch

from ..config import ALGOS, ALL_REDUCE_ALGOS, MOE_ALGOS, ULYSSES_ALGOS
from ..config.plan import RENAMED, OpPlan
from ..runtime import Ring
from ..runtime.fp8 import DelayedScales

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
TABLES: dict[str, dict[str, Callable]] = {}
_state = threading.local()


def register(op: str, algo: str, /) -> Callable:
    """Decorator: `fn` is the plain function of `algo` for `op`."""
    def put(fn: Callable) -> Callable:
        row = TABLES.setdefault(op, {})
        if algo in row:
            raise ValueError(f"register: {op!r} already has a function for algo {algo!r}")
        row[algo] = fn
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
    if algo == "auto" and "auto" not in allowed:
        raise ValueError(f"{op}: algo 'auto' is a layer's word (the chooser picks per call shape, "
                         f"plan/chooser.py); an operator call runs one of {allowed}")
    hint = f" ({algo!r} is now called {RENAMED[algo]!r})" if algo in RENAMED else ""
    raise ValueError(f"{op}: unknown algo {algo!r}{hint}; choose one of {allowed}")


def resolve_algo(op: str, algo: str) -> str:
    """The algorithm word to run for `op` (checked): "reference" inside force_reference(). The GEMM operators
    resolve an OpPlan instead (`resolve`)."""
    check_algo(op, algo)
    return "reference" if forced() else algo


# ---------------------------------------------------------------- the settings object of a GEMM operator call

RINGS = ("flash", "flash_bidir")  # the algos that walk a decomposed ring
# The knobs each GEMM operator reads besides algo and wire_dtype; a plan that sets another one (away from its
# default) is refused when resolved, never ignored. num_chunks is read by slicing only, except where the
# operator chunks its sequence for the rings too (CHUNKED).
KNOBS = {
    "all_gather_matmul": ("num_chunks", "hop_chunks", "keep_gathered", "fp8"),
    "matmul_reduce_scatter": ("num_chunks", "hop_chunks", "fp8"),
    "matmul_all_reduce": ("num_chunks", "decode_all_reduce", "decode_step", "fp8"),
    "matmul_allreduce_dgrad": ("num_chunks", "fp8"),
    "query_split_attention": ("num_chunks",),
    "matmul_wgrad_reduce_scatter": ("hop_chunks",),
}
CHUNKED = ("matmul_all_reduce", "matmul_allreduce_dgrad")


@functools.lru_cache(maxsize=1024)
def ring_of(plan: OpPlan, name: str, tag: int = 0) -> Ring:
    """The runtime's option object of one ring pass of `plan` (runtime/options.py), made once per plan and pass."""
    return Ring(plan.bidirectional, plan.hops, name, tag)


class WgradRoute:
    """Where dW goes (module docstring): into [weight's shape] or fn(dy_full, x_full), at most one of them."""

    __slots__ = ("into", "fn")

    def __init__(self, into: torch.Tensor | None = None, fn=None):
        self.into, self.fn = into, fn


RETURNED = WgradRoute()  # dW returned to autograd, as a plain linear's


class Fp8Call(NamedTuple):
    """What an FP8 call carries besides its plan: where dW goes, the delayed recipe's state (None: tensorwise)."""
    route: WgradRoute
    scales: DelayedScales | None


def plan_of(op: str, algo: str | None, plan: OpPlan | None, default: str = "flash") -> OpPlan:
    """The plan a wrapper was given: `plan`, or the shorthand OpPlan(algo) (not both, unless they agree)."""
    if plan is None:
        return _shorthand(op, default if algo is None else algo)
    if not isinstance(plan, OpPlan):
        raise ValueError(f"{op}: plan must be an OpPlan (megatron_flashoverlap.OpPlan), got {type(plan).__name__}")
    if algo is not None and algo != plan.algo:
        raise ValueError(f"{op}: algo={algo!r} and plan=OpPlan(algo={plan.algo!r}) disagree; pass the algorithm "
                         f"once (plan= carries it)")
    return plan


@functools.lru_cache(maxsize=256)
def _shorthand(op: str, algo: str) -> OpPlan:
    try:
        return OpPlan(algo)
    except ValueError as err:
        raise ValueError(f"{op}: {err}") from None


def resolve(op: str, plan: OpPlan, default_chunks: int | None = None) -> OpPlan:
    """The plan this call runs: `op`'s words checked, force_reference() applied (the reference plan: same
    wire_dtype and keep_gathered, no ring knobs); with default_chunks, the flash algos' sequence chunks filled in."""
    return _resolve(op, plan, forced(), default_chunks)


@functools.lru_cache(maxsize=1024)
def _resolve(op: str, plan: OpPlan, is_forced: bool, default_chunks: int | None) -> OpPlan:
    check_algo(op, plan.algo)
    _check_knobs(op, plan)
    if is_forced:
        return reference_plan(plan)
    if default_chunks is not None and plan.num_chunks is None and plan.algo in RINGS:
        return replace(plan, num_chunks=default_chunks)
    return plan


def _check_knobs(op: str, plan: OpPlan) -> None:
    """ValueError for a knob `op` does not read (KNOBS), naming the ones it does."""
    reads = ("algo", "wire_dtype") + KNOBS[op]
    for f in fields(OpPlan):
        if f.name not in reads and getattr(plan, f.name) != f.default:
            raise ValueError(f"{op}: {f.name} is not a knob of this operator (it reads {reads}); remove "
                             f"{f.name}={getattr(plan, f.name)!r} from its OpPlan")
    chunking = ("slicing",) + (RINGS if op in CHUNKED else ())
    if plan.num_chunks is not None and plan.algo not in chunking:
        raise ValueError(f"{op}: num_chunks is a knob of algo {' / '.join(map(repr, chunking))} here; remove it for "
                         f"algo {plan.algo!r}")


def reference_plan(plan: OpPlan) -> OpPlan:
    """The plan's unfused path: algo "reference", the same wire_dtype, keep_gathered and fp8, no ring knobs."""
    return replace(plan, algo="reference", num_chunks=None, hop_chunks=None)


@functools.lru_cache(maxsize=256)
def keeping(plan: OpPlan) -> OpPlan:
    """The plan with keep_gathered on (a backward that needs the gathered operand back)."""
    return plan if plan.keep_gathered else replace(plan, keep_gathered=True)

