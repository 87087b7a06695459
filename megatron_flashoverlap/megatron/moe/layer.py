"""MoE layers with our exchange: Megatron's MoELayer whose alltoall dispatcher runs ops/moe's exchange,
or (moe.algo = flash, expert-TP 1) the fused expert pipeline of ops/moe/fused.py.

    flash_moe_spec(mlp_spec, flash_config) -> the MoE spec with FlashMoELayer in place of MoELayer
        (0.19: functools.partial(MoELayer, submodules=...); 0.16: ModuleSpec(module=MoELayer, ...)); routed
        experts stay Megatron's (SequentialMLP / grouped GEMM), shared experts take our TP linears.
    FlashMoELayer                 MoELayer; dispatcher "alltoall" -> FlashAlltoAllTokenDispatcher; with
                                  moe.algo = flash its dispatch / routed_experts_compute / combine run the
                                  fused pipeline: each source block through the SAME SequentialMLP (that
                                  block's counts, its probs applied where stock applies them) as it arrives;
                                  moe.algo = auto (the default): stock, or the fused pipeline where it fuses
                                  and wins, measured at the layer's first training-mode forward
                                  (ops/moe/choose.py; an eval-mode forward before that runs stock: it is not
                                  measured inside a request)
    FlashAlltoAllTokenDispatcher  MoEAlltoAllTokenDispatcher; token_dispatch / token_combine run
                                  expert_all_to_all (exchange = pairwise steps, reference = stock a2a)

    dispatch   tokens [sum(input_splits), h] -> [sum(output_splits), h]   own tokens first
    combine    expert outputs [sum(output_splits), h] -> [sum(input_splits), h]   own tokens last
Routing, permutation, expert-TP all-gather / reduce-scatter, sort by local expert and unpermute stay
Megatron's, so every sum that decides a route is in stock's order. The split sizes are the ones stock
copies to the host (its one sync per layer); nothing else syncs.

Refused at build, with the fix: the flex dispatcher (DeepEP / HybridEP / NCCL-EP bring their own fused
all-to-all kernels) and --overlap-moe-expert-parallel-comm (Megatron's 1F1B a2a overlap on two streams;
not composed with ours). The allgather dispatcher has no all-to-all: it runs as stock (logged once).
Where flash cannot fuse it runs "exchange", one log line per reason (`fusion_blocker`: expert-TP > 1, experts
other than SequentialMLP, the shared expert on the dispatcher's side stream, fp8/fp4, delayed expert wgrad,
inference-optimized experts, EP = 1).

The fused call (`fused_experts`): ops/moe expert_pipeline with the layer's SequentialMLP on each source block;
rows from source s are grouped by local expert with counts[s] = num_global_tokens_per_local_expert[s] (stock's
sort is not needed: a block is already in local-expert order), probs applied by the experts where stock applies
them (per_token_scale after the activation, or on the input with moe_apply_probs_on_input).
"""
from __future__ import annotations

import functools
import logging

import torch
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
from megatron.core.transformer.spec_utils import ModuleSpec

from ...config import FlashOverlapConfig, active
from ...config.refusals import refuse
from ...ops.all_reduce.all_reduce import resolve_local_world_size
from ...ops.choose import group_layout
from ...ops.moe import COMBINE, DISPATCH, LocalExperts, expert_all_to_all, expert_pipeline
from ...ops.moe.choose import moe_key, moe_pick
from ...ops.registry import forced
from ...plan.chooser import chooser_of
from ...runtime import group_info, shared_context
from ...runtime.once import LogOnce

log = logging.getLogger(__name__)
_LOGGED = LogOnce(log)


def check_moe_config(config) -> None:
    """ValueError for the MoE settings our layer does not run, naming the fix (config/refusals.py, the moe
    check); the allgather dispatcher runs as stock, said once."""
    refuse("moe", config, "flash-overlap MoE")
    if getattr(config, "moe_token_dispatcher_type", "allgather") == "allgather":
        _LOGGED("allgather", "flash-overlap MoE: moe_token_dispatcher_type='allgather' has no all-to-all; it runs as "
                "stock. Use --moe-token-dispatcher-type alltoall for the overlapped exchange")


class FlashAlltoAllTokenDispatcher(MoEAlltoAllTokenDispatcher):
    """Megatron's alltoall dispatcher with the EP exchange of ops/moe (same attributes, same split sizes).
    Made from the stock one MoELayer built (`adopt`): its groups, buffers and shared experts stay as they are."""

    flash_algo: str = "flash"
    flash_ctx = None

    @classmethod
    def adopt(cls, stock: MoEAlltoAllTokenDispatcher, flash_config: FlashOverlapConfig, algo: str):
        """The stock dispatcher, now running our exchange `algo` (the class changes, nothing else)."""
        stock.__class__ = cls
        stock.flash_algo, stock.flash_ctx = algo, shared_context("layer", flash_config.timeout_s)
        return stock

    def _exchange(self, x, output_splits, input_splits, order):
        return expert_all_to_all(x, output_splits, input_splits, self.ep_group, self.flash_ctx,
                                 algo=self.flash_algo, order=order)

    def token_dispatch(self, permutated_local_input_tokens, permuted_probs):
        """tokens [sum(input_splits), h], probs [sum(input_splits)] -> by source rank, own block first."""
        if self.shared_experts is not None:
            self.shared_experts.wait_current_stream()
        self.tokens_per_expert = self._maybe_dtoh_and_synchronize("before_ep_alltoall", self.tokens_per_expert)
        tokens = self._exchange(permutated_local_input_tokens, self.output_splits, self.input_splits, DISPATCH)
        if self.shared_experts is not None:
            self.shared_experts.linear_fc1_forward_and_act(tokens)
        probs = self._exchange(permuted_probs.unsqueeze(-1), self.output_splits, self.input_splits, DISPATCH)
        return tokens, probs.squeeze(-1)

    def token_combine(self, hidden_states, async_finish: bool = True, allocate_on_comm_stream: bool = True):
        """expert outputs [sum(output_splits), h] -> [sum(input_splits), h], own block last."""
        if self.shared_experts is not None:
            self.shared_experts.wait_current_stream()
        tokens = self._exchange(hidden_states, self.input_splits, self.output_splits, COMBINE)
        if self.shared_experts is not None:
            self.shared_experts.linear_fc2_forward(tokens)
            self.shared_experts.post_forward_comm()
        return tokens


class FlashMoELayer(MoELayer):
    """MoELayer (same constructor, parameters, state_dict) whose alltoall dispatcher is ours; `flash_fused`:
    dispatch -> routed_experts_compute -> combine is the fused pipeline (dispatch and combine pass through)."""

    flash_fused = False
    flash_not_fused = None  # moe.algo = flash (or auto) that cannot fuse: why (fused.fusion_blocker)
    flash_auto = False  # moe.algo = auto, not decided yet: stock until the first training forward decides

    def __init__(self, config, submodules=None, *args, flash_config: FlashOverlapConfig | None = None, **kwargs):
        check_moe_config(config)
        super().__init__(config, submodules, *args, **kwargs)
        flash_config = active() if flash_config is None else flash_config
        if type(self.token_dispatcher) is MoEAlltoAllTokenDispatcher:
            algo = flash_config.moe.algo
            self.flash_not_fused = fusion_blocker(self) if algo in ("flash", "auto") else None
            if algo == "auto":  # nothing to measure where flash cannot fuse: the exchange alone hides nothing
                self.flash_auto = not _logged_blocker(self.flash_not_fused, "moe.algo=auto keeps stock's all-to-all")
                algo = "reference"
            self.flash_fused = algo == "flash" and not _logged_blocker(self.flash_not_fused)
            FlashAlltoAllTokenDispatcher.adopt(self.token_dispatcher, flash_config,
                                               "exchange" if algo == "flash" else algo)
            self.flash_chooser = chooser_of(flash_config)

    def flash_ran(self) -> dict:
        """{site: what ran} for the GEMM sites line: the EP exchange ("ep_a2a") and the routed experts."""
        algo = getattr(self.token_dispatcher, "flash_algo", None)
        experts = f"Megatron's {type(self.experts).__name__}"
        if self.flash_auto:
            return {"ep_a2a": "auto (stock, or flash fused with the experts: measured at the first training step)",
                    "experts": f"stock ({experts})"}
        if self.flash_fused:
            return {"ep_a2a": "flash (fused with the experts)",
                    "experts": f"stock ({experts}, run per arriving block inside the fused exchange)"}
        if algo is None:
            a2a = f"stock ({type(self.token_dispatcher).__name__}: no all-to-all of ours to run)"
        elif algo == "reference" and self.flash_not_fused:
            a2a = f"stock (moe.algo 'auto': flash cannot fuse: {self.flash_not_fused})"
        elif algo == "reference":
            a2a = "stock (moe.algo 'reference': all_to_all_single)"
        else:
            a2a = algo + (f" (flash cannot fuse: {self.flash_not_fused})" if self.flash_not_fused else "")
        return {"ep_a2a": a2a, "experts": f"stock ({experts}, after the exchange)"}

    def _fused_now(self) -> bool:
        return self.flash_fused and not forced()

    def dispatch(self, hidden_states, probs):
        """Fused: tokens stay where they are (the split sizes reach the host here, as before stock's a2a).
        auto: the first training-mode forward decides first (`_choose`; under activation recompute that is the
        no-grad forward, so its recompute runs the same path)."""
        if self.flash_auto and self.training:
            self._choose(hidden_states, probs)
        if not self._fused_now():
            return super().dispatch(hidden_states, probs)
        d = self.token_dispatcher
        d.tokens_per_expert = d._maybe_dtoh_and_synchronize("before_ep_alltoall", d.tokens_per_expert)
        return hidden_states, probs

    def _choose(self, tokens, probs) -> None:
        """moe.algo auto: stock or the fused pipeline for this layer, the chooser's (ops/moe/choose.py), on the
        routed tokens [sum(input_splits), h] of this forward; every EP rank and expert replica decides alike."""
        d = self.token_dispatcher
        world = group_info(d.ep_group)[1]
        layout, members = group_layout(d.ep_group, resolve_local_world_size(world, None, d.ep_group, strict=False),
                                       tokens.dtype)
        key = moe_key(tokens.shape[0], tokens.shape[-1], d.num_local_experts * world, layout, members)
        pick = moe_pick(self.flash_chooser, key, tokens.detach(), probs.detach(), pipeline_inputs(self, tokens),
                        d.ep_group, d.flash_ctx, _expert_replicas(d.ep_group))
        self.flash_auto, self.flash_fused = False, pick == "flash"

    def routed_experts_compute(self, hidden_states, probs):
        """Fused: [sum(input_splits), h] tokens -> expert outputs back in the same rows (ops/moe/fused.py)."""
        if not self._fused_now():
            return super().routed_experts_compute(hidden_states, probs)
        return fused_experts(self, hidden_states, probs), None

    def combine(self, output):
        return output if self._fused_now() else super().combine(output)


def _logged_blocker(reason: str | None, what: str = "moe.algo=flash runs 'exchange' (pairwise steps, experts "
                                                      "after)") -> bool:
    """True where flash cannot fuse: the reason is logged once per process."""
    if reason is not None:
        _LOGGED(f"flash-overlap MoE: {what}: {reason}")
    return reason is not None


def _expert_replicas(ep_group):
    """Megatron's expert-data-parallel group where `ep_group` is its expert-model-parallel group (the replicas
    whose auto choices must agree); None otherwise (the EP group alone decides)."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized() or ep_group is not ps.get_expert_model_parallel_group():
        return None
    return ps.get_expert_data_parallel_group()


def flash_moe_spec(mlp_spec, flash_config: FlashOverlapConfig):
    """Megatron's MoE spec (a partial of MoELayer, or a ModuleSpec of it) with FlashMoELayer in its place."""
    if isinstance(mlp_spec, functools.partial):
        return functools.partial(FlashMoELayer, *mlp_spec.args, **mlp_spec.keywords, flash_config=flash_config)
    if isinstance(mlp_spec, ModuleSpec):
        return ModuleSpec(module=FlashMoELayer, params={**(mlp_spec.params or {}), "flash_config": flash_config},
                          submodules=mlp_spec.submodules)
    raise ValueError(f"flash_moe_spec: unexpected MoE spec {type(mlp_spec).__name__}; megatron-core 0.16-0.19 give "
                     f"a functools.partial or a ModuleSpec of MoELayer")


def fusion_blocker(layer) -> str | None:
    """Why this MoE layer cannot run the fused pipeline (None: it can), with what to change."""
    d, cfg = layer.token_dispatcher, layer.config
    checks = (
        (d.ep_size == 1, "expert_model_parallel_size = 1: no exchange to hide"),
        (d.tp_size > 1, "expert_tensor_parallel_size > 1: the experts' own TP collectives would run inside each "
                        "block; set --expert-tensor-parallel-size 1 to fuse"),
        (not isinstance(layer.experts, SequentialMLP), f"{type(layer.experts).__name__} experts (grouped GEMM) "
                                                       f"run all rows in one kernel; --moe-grouped-gemm off fuses"),
        (bool(getattr(layer, "shared_expert_overlap", False)), "moe_shared_expert_overlap runs the shared expert "
                                                               "inside the dispatcher on a side stream"),
        (bool(cfg.fp8 or getattr(cfg, "fp4", None)), "fp8/fp4 experts pad and scale per call"),
        (bool(getattr(cfg, "overlap_dispatch_backward_with_experts_wgrad", False)),
         "overlap_dispatch_backward_with_experts_wgrad delays the experts' wgrad"),
        (getattr(cfg, "transformer_impl", "") == "inference_optimized", "inference-optimized experts"),
    )
    return next((why for blocked, why in checks if blocked), None)


def _source_counts(d) -> torch.Tensor:
    """[ep, local experts]: rows from each source rank per local expert (host ints; one copy if on device)."""
    if d.num_local_experts > 1 or d.drop_and_pad:
        return d.num_global_tokens_per_local_expert.reshape(d.ep_size, d.num_local_experts).cpu()
    return torch.as_tensor(d.output_splits).reshape(d.ep_size, 1)


def pipeline_inputs(layer, tokens: torch.Tensor) -> tuple[LocalExperts, torch.Tensor, list]:
    """(the layer's experts as LocalExperts, counts [P][E], input_splits [P]) for ops/moe's expert_pipeline."""
    d = layer.token_dispatcher
    ins = d.input_splits if d.input_splits is not None else [tokens.shape[0] // d.ep_size] * d.ep_size

    def experts(x, rows_per_expert, p):
        out, bias = layer.experts(x, torch.tensor(rows_per_expert, dtype=torch.long), p)
        assert bias is None, "SequentialMLP adds the expert bias itself when probs are passed"
        return out

    params = [p for p in layer.experts.parameters() if p.requires_grad]
    return LocalExperts(experts, params), _source_counts(d), ins


def fused_experts(layer, tokens: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """The fused dispatch -> experts -> combine of one MoE layer call (module docstring)."""
    d = layer.token_dispatcher
    for point in ("before_permutation_2", "before_finish"):  # stock's host syncs of the split sizes
        d.tokens_per_expert = d._maybe_dtoh_and_synchronize(point, d.tokens_per_expert)
    d.tokens_per_expert = None
    experts, counts, ins = pipeline_inputs(layer, tokens)
    return expert_pipeline(tokens, probs, experts, counts, ins, d.ep_group, d.flash_ctx, algo="flash")
