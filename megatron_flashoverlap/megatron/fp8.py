"""Megatron's FP8 settings as the recipe our linears run (runtime/fp8.py), and a layer's delayed-scaling state.

    recipe_of(config) -> Fp8Recipe | None
        config.fp8          --fp8-format e4m3 | hybrid (None: no FP8)
        config.fp8_recipe   --fp8-recipe tensorwise (Transformer Engine's Float8CurrentScaling: each tensor scaled
                            from its own amax as it is cast; Megatron passes it no margin, so neither do we) or
                            delayed (Megatron's default; --fp8-margin, --fp8-amax-history-len,
                            --fp8-amax-compute-algo, --fp8-interval as Megatron's flags give them); the other
                            recipes are refused before a layer is built (config/refusals.py)
    run(op, x, weight, group, plan, scales, **kw)   a TP operator call; with a delayed state, its FP8 twin's
    LayerScales(recipe, device, config, tp_group)   one linear's delayed state (runtime/fp8.py DelayedScales)
        .scales             what the layer's operator calls get as `scales=` (they record each cast's amax)
        .before_training_forward()   from the second training forward on: the amaxes the earlier forwards and
                            backwards recorded, reduced MAX over Megatron's amax reduction group (tensor + data
                            (+ context) parallel, or tensor (+ context) with --tp-only-amax-red: every replica
                            takes the same scales), then the window rolled and the scales recomputed
        .state() / .load(state)      its checkpoint form, Megatron's `_extra_state` of the linear (a bf16
                            checkpoint's None leaves the fresh state; a checkpoint of ours resumes the scales);
                            state() is collective over the amax group, as Megatron's save is
What an FP8 layer runs: every GEMM of its operator (forward, dgrad, wgrad) as an FP8 torch._scaled_mm with fp32
accumulation and the activation dtype out (ops/); its "stock" is the same operator's FP8 reference (the
collective, then one FP8 GEMM), never Megatron's forward, which would run without FP8 (Megatron's local layers
have none: FP8 is Transformer Engine's there).
"""
from __future__ import annotations

import enum

import torch
import torch.distributed as dist

from ..ops import all_gather_matmul, matmul_reduce_scatter
from ..ops.tp_nosp.autograd import (matmul_all_reduce, matmul_all_reduce_fp8, matmul_allreduce_dgrad,
                                             matmul_allreduce_dgrad_fp8)
from ..ops.tp_sp.autograd import all_gather_matmul_fp8, matmul_reduce_scatter_fp8
from ..runtime import group_info
from ..runtime.fp8 import DelayedScales, Fp8Recipe

# a TP operator -> its FP8 twin, the one that takes the delayed recipe's state (the public operators take none)
FP8_TWINS = {all_gather_matmul: all_gather_matmul_fp8, matmul_reduce_scatter: matmul_reduce_scatter_fp8,
             matmul_all_reduce: matmul_all_reduce_fp8, matmul_allreduce_dgrad: matmul_allreduce_dgrad_fp8}


def _word(value) -> str | None:
    return value.name if isinstance(value, enum.Enum) else value


def recipe_of(config) -> Fp8Recipe | None:
    """The recipe of Megatron's TransformerConfig (module docstring); None without --fp8-format."""
    fmt = _word(getattr(config, "fp8", None))
    if not fmt:
        return None
    recipe = _word(getattr(config, "fp8_recipe", None)) or "delayed"
    if recipe != "delayed":
        return Fp8Recipe(format=fmt, recipe=recipe)
    return Fp8Recipe(format=fmt, recipe="delayed", margin=config.fp8_margin,
                     amax_history_len=config.fp8_amax_history_len,
                     amax_compute_algo=_word(config.fp8_amax_compute_algo), interval=config.fp8_interval)


def run(op, x, weight, group, plan, scales, **kw):
    """op(x, weight, group, plan=plan, **kw); with a delayed recipe's state (`scales`), op's FP8 twin given it."""
    if scales is None:
        return op(x, weight, group, plan=plan, **kw)
    return FP8_TWINS[op](x, weight, group, plan=plan, scales=scales, **kw)


def amax_group(config, tp_group):
    """Megatron's FP8 amax reduction group (as Transformer Engine's autocast takes it); `tp_group` where
    Megatron's parallel state is not up (a layer built by hand)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return tp_group
    return ps.get_amax_reduction_group(with_context_parallel=True,
                                       tp_only_amax_red=bool(getattr(config, "tp_only_amax_red", False)))


class LayerScales:
    """One linear's delayed-scaling state (module docstring)."""

    def __init__(self, recipe: Fp8Recipe, device, config, tp_group):
        self.scales = DelayedScales(recipe, device)
        self._config, self._tp_group, self.forwards = config, tp_group, 0

    def before_training_forward(self) -> None:
        if self.forwards:
            self.scales.update(amax_group(self._config, self._tp_group))
        self.forwards += 1

    def state(self) -> dict:
        """The checkpoint form. Collective over the amax group (Megatron's save calls every rank's
        sharded_state_dict): the amaxes recorded since the last update are local until the next update reduces
        them, so they are reduced here first (MAX twice is MAX: the training numbers do not change), and every
        rank saves, and a resumed run loads, the same state."""
        s = self.scales
        group = amax_group(self._config, self._tp_group)
        if dist.is_initialized() and group_info(group)[1] > 1:
            dist.all_reduce(s.history[0], op=dist.ReduceOp.MAX, group=group)
        return {"history": s.history.detach().cpu().clone(), "scales": s.scales.detach().cpu().clone(),
                "updates": s.updates, "forwards": self.forwards}

    def load(self, state) -> None:
        if state is None:  # a checkpoint without FP8 state (bf16, or Megatron's own layers): start fresh
            return
        s = self.scales
        if tuple(state["history"].shape) != tuple(s.history.shape):
            raise ValueError(f"the checkpoint's FP8 amax history has {state['history'].shape[0]} rows, this run "
                             f"{s.history.shape[0]}; set --fp8-amax-history-len {state['history'].shape[0]} to "
                             f"resume its scales")
        s.history.copy_(state["history"].to(s.history.device))
        s.scales.copy_(state["scales"].to(s.scales.device))
        s.updates, self.forwards = int(state["updates"]), int(state["forwards"])


class Fp8LayerState:
    """The delayed FP8 state's side of our linears (megatron/linear.py's mixin): `flash_fp8_state` (a LayerScales
    or None), `flash_step_kind`. Megatron's stock linears define get/set_extra_state too (None, ignored): these
    take their place, so a checkpoint keeps stock's format where no delayed FP8 runs."""

    @property
    def _fp8_scales(self):
        """What this layer's operator calls get as `scales=`: the delayed recipe's state, else None."""
        return None if self.flash_fp8_state is None else self.flash_fp8_state.scales

    def _fp8_step(self) -> None:
        """Before a training forward: the delayed scales take what the earlier steps recorded."""
        if self.flash_fp8_state is not None and self.flash_step_kind == "train" and torch.is_grad_enabled():
            self.flash_fp8_state.before_training_forward()

    def get_extra_state(self):
        """Megatron's `_extra_state` of the linear: None, as stock's, except the delayed FP8 state."""
        state = getattr(self, "flash_fp8_state", None)
        return None if state is None else state.state()

    def set_extra_state(self, state) -> None:
        """A checkpoint's `_extra_state`: the delayed FP8 state resumes from it (None, stock's: a fresh state)."""
        mine = getattr(self, "flash_fp8_state", None)
        if mine is not None:
            mine.load(state)


__all__ = ["FP8_TWINS", "Fp8LayerState", "LayerScales", "amax_group", "recipe_of", "run"]
