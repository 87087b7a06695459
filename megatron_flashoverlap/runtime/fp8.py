"""FP8 recipe math: the formats, the recipe, amax, the scale, the saturating cast, the delayed recipe's state.

    FORMATS                      "e4m3" torch.float8_e4m3fn, max 448; "e5m2" torch.float8_e5m2, max 57344
    Fp8Recipe                    the recipe (config/plan.py: Megatron's --fp8-* flags), re-exported here
    fmt(recipe, role)            a role's format: e4m3, but e5m2 for "grad_output" under "hybrid"
    amax(x)                      max |x| -> 0-dim fp32
    scale_for(amax, fmt_max, margin, prev)
                                 fmt_max / amax / 2^margin; `prev` where amax is 0 or not finite (nothing to
                                 learn from it); fp32's max where amax is so small that the scale overflows
    quantize(x, scale, fmt)      Quantized(data = x * scale clamped to +-fmt.max, cast to fmt; scale_inv =
                                 1 / scale; dtype = x's): the cast saturates on every device
    cast(x, role, recipe, scales)         the one cast of a tensor per call, by the recipe (below)
    cast_shared(x, role, recipe, scales, group)  the same with one scale for the whole group (a gathered shard)
    DelayedScales(recipe)        the delayed recipe's state: amax history [L, roles], scales [roles]
    probe_state(recipe)          a throwaway DelayedScales for timing a delayed call (None otherwise)
    save_fp8(ctx, x, weight, plan, call, group, octx) -> (xq, wq)
                                 an FP8 autograd forward's cast of x and w (each from its own amax), their
                                 bytes and scales saved on ctx for the backward; saved_fp8(ctx) reads them back

Tensor roles: "input" (the activation x), "weight", "grad_output" (dy).
Recipes:
    tensorwise  each tensor scaled from its own amax as it is cast (Megatron's "tensorwise", Transformer
                Engine's current scaling); `cast_shared` all-reduces the amax MAX over the group first, so every
                rank of a sequence-parallel group casts its shard with one scale (every slice of the gather uses it)
    delayed     the scale comes from earlier steps' amaxes (`DelayedScales.scale`); this cast only records its
                amax (`record`); `update(group)` after the step reduces the recorded amaxes MAX over the group,
                picks the amax (max of the window, or the most recent), rolls the window and recomputes the
                scales every `interval` updates (Transformer Engine's delayed scaling)
_scaled_mm multiplies by the dequantization scale: a Quantized carries scale_inv, not the scale.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from ..config.plan import AMAX_ALGOS, FP8_FORMATS, FP8_RECIPES, Fp8Recipe  # noqa: F401  (re-exported)
from .group import group_info


class Fp8Format(NamedTuple):
    name: str
    dtype: torch.dtype
    max: float


FORMATS = {"e4m3": Fp8Format("e4m3", torch.float8_e4m3fn, 448.0),
           "e5m2": Fp8Format("e5m2", torch.float8_e5m2, 57344.0)}
ROLES = ("input", "weight", "grad_output")
_FP32_MAX = torch.finfo(torch.float32).max


def fmt(recipe: Fp8Recipe, role: str) -> Fp8Format:
    """The format tensors of `role` are cast to under `recipe` (config/plan.py Fp8Recipe.format_of)."""
    return FORMATS[recipe.format_of(role)]


class Quantized(NamedTuple):
    """An FP8 tensor: data [*] in an fp8 dtype, scale_inv (0-dim fp32, data * scale_inv ~ the original),
    dtype (the original's: what a GEMM of it writes)."""
    data: torch.Tensor
    scale_inv: torch.Tensor
    dtype: torch.dtype


def amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a 0-dim fp32 tensor (0 for an empty x)."""
    if x.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    return x.detach().abs().amax().float()


def scale_for(amax_: torch.Tensor, fmt_max: float | torch.Tensor, margin: int, prev: torch.Tensor) -> torch.Tensor:
    """fmt_max / amax / 2^margin (fp32, amax's shape; fmt_max a number or one per element); prev where amax is
    0 or not finite; fp32's max where the quotient overflows (a tiny amax)."""
    fmax = torch.as_tensor(fmt_max, dtype=torch.float32, device=amax_.device)  # a tensor: `float / t` is
    sf = fmax / amax_.float() / 2.0 ** margin  # t.reciprocal() * float in torch, one rounding more than a division
    sf = torch.where((amax_ > 0) & torch.isfinite(amax_), sf, prev)
    return torch.where(torch.isinf(sf), torch.full_like(sf, _FP32_MAX), sf)


def quantize(x: torch.Tensor, scale: torch.Tensor, fmt: Fp8Format) -> Quantized:
    """x [*] -> Quantized: data [*] = x * scale, clamped to +-fmt.max (saturating), in fmt.dtype."""
    data = (x.detach().float() * scale).clamp_(-fmt.max, fmt.max).to(fmt.dtype)
    return Quantized(data, torch.reciprocal(scale.float()), x.dtype)


def group_amax(x: torch.Tensor, group) -> torch.Tensor:
    """amax(x) all-reduced MAX over `group` (no collective in a group of one)."""
    a = amax(x)
    if group_info(group)[1] > 1:
        dist.all_reduce(a, op=dist.ReduceOp.MAX, group=group)
    return a


def cast(x: torch.Tensor, role: str, recipe: Fp8Recipe, scales: "DelayedScales | None" = None) -> Quantized:
    """x cast once by the recipe, its scale its own (tensorwise) or the state's (delayed: x's amax recorded)."""
    return _cast(x, role, recipe, scales, amax(x))


def cast_shared(x: torch.Tensor, role: str, recipe: Fp8Recipe, scales: "DelayedScales | None", group) -> Quantized:
    """cast, with one scale for every rank of `group` (None: the default group): tensorwise reduces the amax
    MAX over it first; delayed records the local amax (the state's `update(group)` reduces it)."""
    if recipe.recipe == "delayed":
        return _cast(x, role, recipe, scales, amax(x))
    return _cast(x, role, recipe, scales, group_amax(x, group))


def _cast(x, role, recipe, scales, amax_):
    form = fmt(recipe, role)
    if recipe.recipe == "tensorwise":
        return quantize(x, scale_for(amax_, form.max, recipe.margin, torch.ones_like(amax_)), form)
    scales.record(role, amax_)
    return quantize(x, scales.scale(role), form)


class DelayedScales:
    """The delayed recipe's state of one layer: history [amax_history_len, roles] (row 0: this step's amax,
    max-accumulated over the casts of the step), scales [roles] (1 until the first update), in fp32."""

    def __init__(self, recipe: Fp8Recipe, device=None):
        if recipe.recipe != "delayed":
            raise ValueError(f"DelayedScales: the recipe is {recipe.recipe!r}; only 'delayed' keeps a state (pass "
                             f"no scales for 'tensorwise')")
        self.recipe, self.updates = recipe, 0
        self.history = torch.zeros(recipe.amax_history_len, len(ROLES), dtype=torch.float32, device=device)
        self.scales = torch.ones(len(ROLES), dtype=torch.float32, device=device)
        self.maxes = torch.tensor([fmt(recipe, r).max for r in ROLES], dtype=torch.float32, device=device)

    def scale(self, role: str) -> torch.Tensor:
        """The 0-dim scale `role` is cast with this step."""
        return self.scales[ROLES.index(role)]

    def record(self, role: str, amax_: torch.Tensor) -> None:
        """This step's amax of `role` becomes max(it, amax_)."""
        now = self.history[0, ROLES.index(role)]
        now.copy_(torch.maximum(now, amax_.to(now.device)))

    def update(self, group=None) -> None:
        """After a step: this step's amaxes reduced MAX over `group`, the amax picked, the window rolled (row 0
        to the end, a fresh zero row 0), the scales recomputed every `interval`-th update."""
        if group_info(group)[1] > 1:
            dist.all_reduce(self.history[0], op=dist.ReduceOp.MAX, group=group)
        picked = self.history.amax(dim=0) if self.recipe.amax_compute_algo == "max" else self.history[0].clone()
        self.history.copy_(torch.roll(self.history, -1, dims=0))
        self.history[0].zero_()
        self.updates += 1
        if self.updates % self.recipe.interval == 0:
            self.scales.copy_(scale_for(picked, self.maxes, self.recipe.margin, self.scales))


def probe_state(recipe: Fp8Recipe | None) -> DelayedScales | None:
    """A throwaway state for timing a call of `recipe` (None unless it is delayed): a probe's amaxes never reach
    a layer's history."""
    return DelayedScales(recipe) if recipe is not None and recipe.recipe == "delayed" else None


def save_fp8(ctx, x, weight, plan, call, group, octx):
    """x and weight cast once per call, each from this rank's own amax (neither is gathered); their FP8 bytes and
    scales saved for the backward, not x. -> (xq, wq)."""
    xq, wq = cast(x, "input", plan.fp8, call.scales), cast(weight, "weight", plan.fp8, call.scales)
    ctx.save_for_backward(weight, xq.data, xq.scale_inv, wq.data, wq.scale_inv)
    ctx.plan, ctx.call, ctx.group, ctx.octx, ctx.x_dtype = plan, call, group, octx, x.dtype
    return xq, wq


def saved_fp8(ctx):
    """-> (weight, xq, wq) as an FP8 autograd forward saved them (save_fp8)."""
    weight, x8, x_inv, w8, w_inv = ctx.saved_tensors
    return weight, Quantized(x8, x_inv, ctx.x_dtype), Quantized(w8, w_inv, weight.dtype)
