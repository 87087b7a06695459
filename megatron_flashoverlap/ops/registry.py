"""The one registry of the overlap operators: what each operator accepts and how one call is resolved.

    ALLOWED        op -> its algorithm words (defined once in `megatron_flashoverlap.config`: ALGOS,
                   ALL_REDUCE_ALGOS, ULYSSES_ALGOS, MOE_ALGOS); `reference` is the one name of the unfused
                   path (the stock collective, then the GEMM)
    TABLES         op -> algo -> plain function, filled by `register` where the functions are defined
    KNOBS          GEMM op -> the OpPlan knobs it reads besides algo and wire_dtype
    OpPlan         the settings object of one GEMM operator call: the algorithm and its knobs, checked once
                   when made (a Megatron layer makes its plan once, at construction: megatron/linear.py; a
                   caller passes one as `plan=`; a wrapper's `algo=` is the shorthand for OpPlan(algo))
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

The OpPlan knobs:
    algo               flash, flash_bidir (the ring both ways), slicing (the baseline), reference
    num_chunks         slicing: its chunk count (required); the all-reduce operators' flash algos: sequence
                       chunks (None: their default); refused elsewhere
    hop_chunks         flash only: row sub-chunks per ring hop (None: automatic, ops/tp_sp/hops.py)
    keep_gathered      all_gather_matmul: keep AG(x) from forward for the weight gradient (memory for time)
    wire_dtype         what reduce-scatter partials travel in: "input" (stock's bytes) or "fp32"
    decode_all_reduce  matmul_all_reduce on decode-shaped x [1, b, k/P]: the all_reduce algo ("auto": the
                       calibrated choice; None: run `algo` on decode inputs too)
    fp8                the TP GEMM operators (all_gather_matmul, matmul_reduce_scatter, matmul_all_reduce,
                       matmul_allreduce_dgrad): an Fp8Recipe (runtime/fp8.py): every GEMM slice of the call,
                       forward and backward, is an FP8 torch._scaled_mm, every all-gather of an operand carries
                       FP8 bytes (the column's x, the row's dy) and every reduce-scatter or all-reduce bf16 /
                       fp32 partials (wire_dtype) (None: no FP8); refused by the operators that have no FP8
                       path, never run without it
    decode_step        matmul_all_reduce: the caller knows this call belongs to a decode-only step (one new
                       token per sequence in any layout, e.g. the dynamic engine's [n, 1, k/P]): the decode
                       all-reduce runs whatever x's shape (False: decode-shaped x [1, b, k/P] only)
Per call a wrapper only resolves its plan (`resolve`, cached per operator and plan: a knob the operator does
not read is refused, not ignored; force_reference() gives the reference plan; the all-reduce operators' flash
chunks are filled in); the TP/SP operators then fix hop_chunks for the shard (tp_sp/hops.py
`sized`, cached too). WgradRoute(into=None, fn=None): dW returned to autograd (both None), added into `into`
slice by slice (e.g. Megatron's fp32 main_grad: runtime/accumulate.py), or handed to fn(dy_full, x_full) once
(e.g. the data-parallel reduce-scatter of dW inside its GEMM, megatron/ddp/grad_sync.py). A backward is given the route,
or None when autograd wants no dW.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass, fields, replace
from typing import Callable, NamedTuple

import torch

from ..config import ALGOS, ALL_REDUCE_ALGOS, MOE_ALGOS, ULYSSES_ALGOS, _positive_int_or_none
from ..runtime import Ring, check_wire
from ..runtime.fp8 import DelayedScales, Fp8Recipe

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


@dataclass(frozen=True)
class OpPlan:
    """One GEMM operator call's algorithm and knobs (module docstring), checked once when made."""
    algo: str = "flash"
    num_chunks: int | None = None
    hop_chunks: int | None = None
    keep_gathered: bool = False
    wire_dtype: str = "input"
    decode_all_reduce: str | None = "auto"
    decode_step: bool = False
    fp8: Fp8Recipe | None = None

    def __post_init__(self):
        if self.algo not in ALGOS:
            hint = f" ({self.algo!r} is now called {RENAMED[self.algo]!r})" if self.algo in RENAMED else ""
            raise ValueError(f"unknown algo {self.algo!r}{hint}; choose one of {ALGOS}")
        _positive_int_or_none(self.num_chunks, "num_chunks")
        if self.algo == "slicing" and self.num_chunks is None:
            raise ValueError("algo 'slicing' needs num_chunks >= 1 (e.g. OpPlan('slicing', num_chunks=4))")
        _positive_int_or_none(self.hop_chunks, "hop_chunks (sub-chunks per hop; None: automatic)")
        if self.hop_chunks is not None and self.algo != "flash":
            raise ValueError(f"hop_chunks is a knob of algo 'flash' only (got algo {self.algo!r}); remove it or "
                             f"use algo 'flash'")
        if not isinstance(self.keep_gathered, bool):
            raise ValueError(f"keep_gathered must be True or False, got {self.keep_gathered!r}")
        check_wire("OpPlan", self.wire_dtype)
        if self.decode_all_reduce is not None and self.decode_all_reduce not in ALL_REDUCE_ALGOS:
            raise ValueError(f"decode_all_reduce {self.decode_all_reduce!r}: choose one of {ALL_REDUCE_ALGOS} "
                             f"or None (decode inputs run `algo` too)")
        if not isinstance(self.decode_step, bool):
            raise ValueError(f"decode_step must be True or False, got {self.decode_step!r}")
        if self.fp8 is not None and not isinstance(self.fp8, Fp8Recipe):
            raise ValueError(f"fp8 must be an Fp8Recipe (megatron_flashoverlap.runtime.fp8) or None, got "
                             f"{type(self.fp8).__name__}")
        object.__setattr__(self, "_hash", hash(tuple(getattr(self, f.name) for f in fields(self))))
        object.__setattr__(self, "_rings", {})  # (name, tag) -> Ring: made once per plan

    def __hash__(self) -> int:  # hashed once: the per-call plan caches (resolve, sized) look plans up by it
        return self._hash

    @property
    def bidirectional(self) -> bool:
        """The ring runs both ways (half of each shard each way)."""
        return self.algo == "flash_bidir"

    @property
    def hops(self) -> int:
        """Row sub-chunks per hop of the ring that runs (1 where the plan leaves it open or has no ring)."""
        return self.hop_chunks or 1

    def ring(self, name: str, tag: int = 0) -> Ring:
        """The runtime's option object of one ring pass of this plan (runtime/options.py), made once."""
        ring = self._rings.get((name, tag))
        if ring is None:
            ring = self._rings[(name, tag)] = Ring(self.bidirectional, self.hops, name, tag)
        return ring


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

