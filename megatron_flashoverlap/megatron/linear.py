"""Drop-in Megatron-Core linears that run the overlap operators under sequence parallelism.

    FlashColumnParallelLinear   x_shard_s [s/P, b, h] -> (y [s, b, n/P], bias or None)
        forward  y = AG(x) @ w^T (+ b)        all_gather_matmul: Flash-AG, local shard first
        dgrad    dx = RS(dy @ w)              the dual Flash-RS, own block last
        wgrad    dw = AG(x)^T dy              re-gathered on the same ring walk (or kept: keep_gathered)
    FlashRowParallelLinear      x [s, b, k/P] -> (y_s [s/P, b, h], bias or None)
        forward  y = RS(x @ w^T)              matmul_reduce_scatter: Flash-RS; bias added after (or returned)
        dgrad    dx = AG(dy) @ w              Flash-AG of dy
        wgrad    dw = AG(dy)^T x

Same constructor, parameters, attributes, sharded_state_dict, backward_dw and (output, bias) return as
the stock classes (they ARE the stock classes, only `forward` differs). The site (`tp_comm_buffer_name`:
qkv, proj, fc1, fc2) picks its OpPlan from the `flash_config` the spec passes in (None: `config.active()`),
and the layer resolves it ONCE, at construction, into the OpPlan its operator runs (ops/registry.py): one for the
SP operator, one for the all-reduce operator without SP; a forward hands that object down with a WgradRoute
(where this call's dW goes: main_grad, the fused DP reduce-scatter, or returned).
Where the overlap does not apply (TP=1, algo `reference`, another buffer name, gather_output, an explicit
weight, experts) the stock forward runs, logged once per layer kind and reason. Without SP the all-reduce
runs decomposed (matmul_all_reduce / matmul_allreduce_dgrad) with the config's `all_reduce.num_chunks`
sequence chunks for the flash algos in training; an inference step (megatron/step_kind.py) takes the chooser's plan
(plan/chooser.py: the decode all-reduce's algorithm, or stock vs decomposed for prefill and mixed steps).
The config's `timeout_s` bounds every P2P wait of these layers.

Data parallel (megatron/ddp/wrap.py, wrap_with_dp_overlap): a weight marked for the fused DP reduce-scatter
hands its complete wgrad operands to `ddp.dp_wgrad` from inside the TP walk (`wgrad_fn`), which produces dW
shard by shard inside the reduce-scatter of its bucket into main_grad, on the last micro-batch.

gradient_accumulation_fusion (Megatron-LM's default): the overlap operators add dW slice by slice straight
into the fp32 `weight.main_grad` (pure torch, no apex: runtime/accumulate.py), set `grad_added_to_main_grad`
and hand autograd Megatron's dummy gradient, as the stock fused path does. The stock constructor, which
raises without apex's fused_weight_gradient_mlp_cuda, is given a copy of the config with the flag off;
the flag is restored on the layer. Where the layer runs the stock forward (reference, TP=1, ...), that
forward takes Megatron's fused path when apex is there, and otherwise runs with the fusion off (logged
once): its dW goes to `.grad` and Megatron's DDP hook adds it into main_grad, the sum
--no-gradient-accumulation-fusion gives.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
import logging

import torch
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel import layers as megatron_layers

from ..config import LAYERS, FlashOverlapConfig, active
from ..config.refusals import refuse
from ..ops.all_reduce.all_reduce import resolve_local_world_size
from ..ops.all_reduce.choose import decode_key, decode_pick
from ..ops.choose import group_layout
from ..ops.all_reduce.select import is_decode_shaped
from ..ops.tp_nosp.choose import inference_plan, prefill_key
from ..plan.chooser import chooser_of
from ..ops import all_gather_matmul, matmul_reduce_scatter
from ..ops.tp_nosp.autograd import matmul_all_reduce, matmul_allreduce_dgrad, runs_stock_collective
from ..ops.checks import check_peers_agree
from ..ops.registry import OpPlan, WgradRoute
from ..runtime import group_info, shared_context
from ..runtime.once import LogOnce
from .ddp.grad_sync import dp_wgrad
from .fp8 import Fp8LayerState, LayerScales, recipe_of, run
from .train_choice import train_key, train_plan

log = logging.getLogger(__name__)
_LOGGED = LogOnce(log, logging.INFO)
def _stock_config(config):
    """The config the stock constructor sees: a shallow copy with gradient_accumulation_fusion off (the
    stock ColumnParallelLinear raises without apex); Megatron's own config object is left as it is."""
    if not config.gradient_accumulation_fusion:
        return config
    stock = copy.copy(config)
    stock.gradient_accumulation_fusion = False
    return stock


def _apex_fused_wgrad() -> bool:
    """Whether Megatron's own fused-wgrad path can run (apex's fused_weight_gradient_mlp_cuda imported)."""
    return bool(getattr(megatron_layers, "_grad_accum_fusion_available", False))


def _site_plan(flash_config: FlashOverlapConfig, buffer_name: str | None) -> OpPlan | None:
    """The plan of this layer's site, or None when the name is not one of qkv/proj/fc1/fc2."""
    return flash_config.plan(buffer_name) if buffer_name in LAYERS else None


def _op_plans(site: OpPlan | None, flash_config: FlashOverlapConfig, column: bool, fp8=None):
    """(the SP operator's OpPlan, the all-reduce operator's OpPlan) of a layer, made once; None where the site
    runs stock (no site, or algo 'reference'). Without SP the flash algos take the config's all_reduce.num_chunks
    (the all-reduce operators have no hop sub-chunks and keep nothing gathered); keep_gathered is a column's.
    Under FP8 (`fp8`, megatron/fp8.py) both carry the recipe."""
    if site is None or site.is_reference:
        return None, None
    algo = "flash" if site.algo == "auto" else site.algo  # auto: flash is the candidate against stock
    sp = OpPlan(algo, site.num_chunks, site.hop_chunks, site.keep_gathered and column, fp8=fp8)
    chunks = site.num_chunks if site.num_chunks is not None else flash_config.all_reduce.num_chunks
    return sp, OpPlan(algo, chunks, fp8=fp8)


@functools.lru_cache(maxsize=64)
def _decode_plan(plan: OpPlan, algo: str) -> OpPlan:
    """The plan of a decode-only step: `plan` with decode_step=True and the decode all-reduce's algorithm."""
    return dataclasses.replace(plan, decode_step=True, decode_all_reduce=algo)


class _FlashMixin(Fp8LayerState):
    """Shared set-up and the stock/overlap decision; the subclasses keep Megatron's own ctor."""

    def _flash_init(self, config, flash_config, tp_comm_buffer_name) -> None:
        if flash_config is not None and not isinstance(flash_config, FlashOverlapConfig):
            raise ValueError(f"flash_config must be a FlashOverlapConfig (see megatron_flashoverlap.config), "
                             f"got {type(flash_config).__name__}")
        refuse("linear", config, type(self).__name__)  # FP8/FP4: a model built from layer_spec alone
        self.flash_config = active() if flash_config is None else flash_config
        self.flash_site = tp_comm_buffer_name
        self.flash_plan = _site_plan(self.flash_config, tp_comm_buffer_name)
        self.flash_fp8 = recipe_of(config)  # FP8: our operators run it, stock's forward would not (megatron/fp8.py)
        self.flash_sp_plan, self.flash_nosp_plan = _op_plans(self.flash_plan, self.flash_config,
                                                             isinstance(self, ColumnParallelLinear), self.flash_fp8)
        self.flash_fp8_reference = None if self.flash_fp8 is None else OpPlan("reference", fp8=self.flash_fp8)
        delayed = self.flash_fp8 is not None and self.flash_fp8.recipe == "delayed"
        self.flash_fp8_state = LayerScales(self.flash_fp8, self.weight.device, config, self.tp_group) if delayed \
            else None  # the delayed recipe's amax history and scales: updated per training forward, checkpointed
        self.flash_context = shared_context("layer", self.flash_config.timeout_s)
        self.flash_chooser = chooser_of(self.flash_config)  # the config's: every layer of it shares the decisions
        self.flash_auto = self.flash_plan is not None and self.flash_plan.algo == "auto"
        self._flash_checked: set = set()
        self._flash_trained: dict = {}  # (input shape, dtype) -> the auto layer's training plan, once decided
        self.flash_step_kind = "train"  # set per forward by megatron/step_kind.py (train, prefill, decode, mixed)
        self.config = config  # the stock ctor saw _stock_config(config)
        self.flash_fuse_wgrad = bool(config.gradient_accumulation_fusion)  # our operators: dW into main_grad
        self.gradient_accumulation_fusion = self.flash_fuse_wgrad and _apex_fused_wgrad()  # the stock forward's

    def _wgrad_into(self):
        """The buffer the operators add dW into under gradient_accumulation_fusion: weight.main_grad (None
        when the fusion is off or no weight gradient is taken)."""
        if not (self.flash_fuse_wgrad and torch.is_grad_enabled() and self.weight.requires_grad):
            return None
        name = f"{type(self).__name__} ({self.flash_site})"
        if hasattr(self.weight, "__fsdp_param__"):
            raise ValueError(f"{name}: gradient_accumulation_fusion with Megatron-FSDP is not supported by the "
                             f"overlap layers; pass --no-gradient-accumulation-fusion")
        main_grad = getattr(self.weight, "main_grad", None)
        if main_grad is None:
            raise ValueError(f"{name}: gradient_accumulation_fusion=True adds the weight gradient into "
                             f"weight.main_grad, which this weight lacks; wrap the model in Megatron's "
                             f"DistributedDataParallel (it allocates main_grad) or set "
                             f"gradient_accumulation_fusion=False (--no-gradient-accumulation-fusion)")
        return main_grad

    def _log_stock(self, why: str) -> None:
        """The one log line of a stock forward, saying where its dW goes under the fusion."""
        if self.flash_fuse_wgrad and not self.gradient_accumulation_fusion:
            why += ("; gradient_accumulation_fusion off for this forward (apex's fused_weight_gradient_mlp_cuda "
                    "is missing): dW goes to .grad and Megatron's DDP adds it into main_grad")
        _LOGGED((type(self).__name__, why), "%s: stock Megatron forward (%s)", type(self).__name__, why)

    def _stock_reason(self) -> str | None:
        """Why this layer runs the stock forward, or None when it runs an overlap operator (with SP the ring,
        without SP the decomposed all-reduce)."""
        if self.flash_plan is None:
            return f"tp_comm_buffer_name={self.flash_site!r} is not a site {LAYERS}"
        if self.flash_plan.is_reference:
            return f"layer {self.flash_site} runs algo 'reference'"
        if group_info(self.tp_group)[1] == 1:
            return "tensor-parallel size 1"
        shared_overlap = not self.is_expert and getattr(self.config, "moe_shared_expert_overlap", False)
        if self.explicit_expert_comm and shared_overlap:
            return ("--moe-shared-expert-overlap: Megatron's shared expert runs its own all-gather and "
                    "reduce-scatter, on a side stream beside the token dispatch")
        if self.explicit_expert_comm or getattr(self, "gtp_remat_size", 1) != 1:
            return "expert / GTP-remat layer"
        return None if self.sequence_parallel else self._no_sp_reason()

    def flash_ran(self) -> str:
        """What the forward runs, for the GEMM sites line: the site's algo (without SP: the decomposed
        all-reduce, "<algo> (all-reduce, no SP)"), or "stock (why)"; under FP8 "<algo> (FP8 <format>)", the FP8
        reference where stock's reason is algo reference or TP 1."""
        why = self._stock_reason()
        fp8 = "" if self.flash_fp8 is None else f"FP8 {self.flash_fp8.format} {self.flash_fp8.recipe}"
        if why is not None:
            return f"reference ({fp8}; {why})" if fp8 else f"stock ({why})"
        if self.sequence_parallel:
            return f"{self.flash_plan.algo} ({fp8})" if fp8 else self.flash_plan.algo
        return f"{self.flash_plan.algo} (all-reduce, no SP{'; ' + fp8 if fp8 else ''})"

    def _fp8_gathers(self) -> bool:
        """Under FP8, whether the stock path runs the SP operator (with SP, or at TP 1 where it is one GEMM) rather
        than the all-reduce one (TP > 1 without SP)."""
        return self.sequence_parallel or group_info(self.tp_group)[1] == 1

    def _fp8_stock(self, why: str) -> OpPlan:
        """Under FP8, the plan of a layer stock would run (`why`): the FP8 reference (the collective, then one FP8
        GEMM; at TP 1 one FP8 GEMM) for algo reference and TP 1. Any other reason would run Megatron's forward
        without FP8, a silently different model: refused."""
        benign = self.flash_plan is not None and (self.flash_plan.is_reference or group_info(self.tp_group)[1] == 1)
        if benign and why == self._stock_reason():
            return self.flash_fp8_reference
        raise ValueError(f"{type(self).__name__} ({self.flash_site}) under --fp8-format: {why} runs Megatron's "
                         f"forward, which has no FP8 GEMM (it would train this layer without FP8, silently); "
                         f"drop --fp8-format, or build this layer with a qkv/proj/fc1/fc2 site of our spec")

    def _flash_route(self, input_, ours: bool = True) -> WgradRoute:
        """Where this call's dW goes (the fused DP reduce-scatter, main_grad, or returned); where the call runs
        a P2P walk of ours (`ours`), checks once per input shape that all TP peers agree on it (a stock
        collective checks nothing more than stock: an inference engine meets a new token count almost every
        step, and each check is one small collective per layer)."""
        shape = tuple(input_.shape)
        if ours and shape not in self._flash_checked:
            world = group_info(self.tp_group)[1]
            check_peers_agree(f"{type(self).__name__}({self.flash_site})", self.tp_group, world, input_.device,
                              *shape, *self.weight.shape)
            self._flash_checked.add(shape)
        fused = self._dp_wgrad_fn()
        return WgradRoute(fn=fused) if fused is not None else WgradRoute(into=self._wgrad_into())

    def _dp_wgrad_fn(self):
        """The fused DP reduce-scatter of dW (ddp.dp_wgrad) for a weight marked by wrap_with_dp_overlap, on the
        last micro-batch (the others accumulate through wgrad_into as usual); None otherwise."""
        site = getattr(self.weight, "_flashoverlap_dp", None)
        if site is None or not (torch.is_grad_enabled() and self.weight.requires_grad):
            return None
        return functools.partial(dp_wgrad, self.weight) if site.bucket_group.is_last_microbatch else None

    def _layout(self, x):
        """(layout word, members) of this layer's group for x's dtype; ranks per node kept (None: not
        node-contiguous)."""
        if not hasattr(self, "_flash_layout"):
            world = group_info(self.tp_group)[1]
            self._flash_per_node = resolve_local_world_size(world, None, self.tp_group, strict=False)
            self._flash_layout = group_layout(self.tp_group, self._flash_per_node, x.dtype)
        return self._flash_layout

    def _trained(self, x, op, plan: OpPlan) -> OpPlan | None:
        """The plan of a call: `plan`, except at a training step of an auto layer, where the chooser picks flash
        (`plan`) or stock (None: Megatron's own forward) at x's shape (megatron/train_choice.py)."""
        if not (self.flash_auto and self.flash_step_kind == "train"):
            return plan
        shape = (tuple(x.shape), x.dtype)
        if shape not in self._flash_trained:  # the chooser decides a key once; the layer asks once per shape
            key = train_key(self.flash_site, op, x, self.weight, *self._layout(x))
            picked = train_plan(self, key, op, x, plan)
            self._flash_trained[shape] = picked if picked is not None else self.flash_fp8_reference
        return self._flash_trained[shape]


def _column_op(sequence_parallel: bool):
    return all_gather_matmul if sequence_parallel else matmul_allreduce_dgrad


class FlashColumnParallelLinear(_FlashMixin, ColumnParallelLinear):
    """ColumnParallelLinear whose SP forward is all_gather_matmul (Flash-AG + GEMM) with the site's plan."""

    def __init__(self, input_size, output_size, *, config, init_method, flash_config=None,
                 tp_comm_buffer_name=None, **kwargs):
        super().__init__(input_size, output_size, config=_stock_config(config), init_method=init_method,
                         tp_comm_buffer_name=tp_comm_buffer_name, **kwargs)
        self._flash_init(config, flash_config, tp_comm_buffer_name)

    def forward(self, input_, weight=None, runtime_gather_output=None):
        """input_ [s/P, b, h] -> (output [s, b, n/P], bias [n/P] if skip_bias_add else None)."""
        self._fp8_step()
        why = self._stock_reason()
        gather = self.gather_output if runtime_gather_output is None else runtime_gather_output
        if self.flash_fp8 is not None and (why is not None or weight is not None or gather):
            extra = "an explicit weight argument" if weight is not None else "gather_output" if gather else None
            plan = self._fp8_stock(extra or why)
            return self._sp_forward(input_, plan) if self._fp8_gathers() else self._forward_without_sp(input_, plan)
        if why is None and weight is not None:
            why = "explicit weight argument"
        if why is None and gather:
            why = "gather_output"
        if why is not None:
            self._log_stock(why)
            return super().forward(input_, weight, runtime_gather_output)
        plan = self._trained(input_, _column_op(self.sequence_parallel), self._column_plan())
        if plan is None:  # auto picked stock at this shape
            return super().forward(input_, weight, runtime_gather_output)
        if not self.sequence_parallel:
            return self._forward_without_sp(input_, plan)
        return self._sp_forward(input_, plan)

    def _sp_forward(self, input_, plan: OpPlan):
        """all_gather_matmul with `plan` (at TP 1, under FP8: one FP8 GEMM)."""
        bias = None if self.skip_bias_add else self.bias
        output = run(all_gather_matmul, input_, self.weight, self.tp_group, plan, self._fp8_scales, bias=bias,
                     wgrad=self._flash_route(input_), context=self.flash_context)
        return output, (self.bias if self.skip_bias_add else None)

    def _column_plan(self) -> OpPlan:
        return self.flash_sp_plan if self.sequence_parallel else self.flash_nosp_plan

    def _no_sp_reason(self) -> str | None:
        """Without SP: stock where Megatron would not all-reduce the dgrad either."""
        return None if self.allreduce_dgrad else "no sequence parallel and no dgrad all-reduce"

    def _forward_without_sp(self, input_, plan: OpPlan):
        """No SP: identity forward; the dgrad all-reduce runs decomposed (Flash-RS + Flash-AG, wgrad in its
        tail) by matmul_allreduce_dgrad."""
        bias = None if self.skip_bias_add else self.bias
        route = self._flash_route(input_, ours=torch.is_grad_enabled())  # the forward alone runs no collective
        output = run(matmul_allreduce_dgrad, input_, self.weight, self.tp_group, plan, self._fp8_scales, bias=bias,
                     wgrad=route, context=self.flash_context)
        return output, (self.bias if self.skip_bias_add else None)


class FlashRowParallelLinear(_FlashMixin, RowParallelLinear):
    """RowParallelLinear whose SP forward is matmul_reduce_scatter (GEMM + Flash-RS) with the site's plan."""

    def __init__(self, input_size, output_size, *, config, init_method, flash_config=None,
                 tp_comm_buffer_name=None, **kwargs):
        super().__init__(input_size, output_size, config=_stock_config(config), init_method=init_method,
                         tp_comm_buffer_name=tp_comm_buffer_name, **kwargs)
        self._flash_init(config, flash_config, tp_comm_buffer_name)

    if not hasattr(RowParallelLinear, "backward_dw"):  # megatron-core 0.16 lacks it on the row layer
        def backward_dw(self) -> None:
            """Delayed weight-gradient hook: a no-op, as in the stock layer of 0.17+ (wgrad runs in backward)."""

    def forward(self, input_):
        """input_ [s, b, k/P] -> (output [s/P, b, h], bias [h] if skip_bias_add else None).

        The bias stays outside the reduce-scatter (added once, after it), as in the stock layer; it is
        tagged `sequence_parallel` by the stock ctor so finalize_model_grads all-reduces its grad."""
        self._fp8_step()
        why = self._stock_reason()
        if why is not None and self.flash_fp8 is not None:
            plan = self._fp8_stock(why)
            return self._sp_forward(input_, plan) if self._fp8_gathers() else self._forward_without_sp(input_, plan)
        if why is not None:
            self._log_stock(why)
            return super().forward(input_)
        if not self.sequence_parallel:
            return self._forward_without_sp(input_)
        plan = self._trained(input_, matmul_reduce_scatter, self.flash_sp_plan)
        if plan is None:  # auto picked stock at this shape
            return super().forward(input_)
        return self._sp_forward(input_, plan)

    def _sp_forward(self, input_, plan: OpPlan):
        """matmul_reduce_scatter with `plan` (at TP 1, under FP8: one FP8 GEMM); the bias after it."""
        output = run(matmul_reduce_scatter, input_, self.weight, self.tp_group, plan, self._fp8_scales,
                     wgrad=self._flash_route(input_), context=self.flash_context)
        if self.skip_bias_add:
            return output, self.bias
        return (output + self.bias if self.bias is not None else output), None

    def _inference_plan(self, x) -> OpPlan:
        """A decode step (or any x [1, b, k/P]): the GEMM, then the whole all-reduce of its tokens [1, s * b, h]
        (whatever the engine's layout) by the chooser's algorithm; a prefill or mixed step: stock or decomposed,
        the chooser's (plan/chooser.py; measured once per token bucket on this group)."""
        layout = self._layout(x)
        g, kind = self._flash_per_node, self.flash_step_kind
        if kind == "decode" or is_decode_shaped(x):  # one new token per sequence, whatever the context says
            key = decode_key(x.shape[0] * x.shape[1], self.weight.shape[0], x.dtype, *layout)
            algo = "reference" if g is None else decode_pick(self.flash_chooser, key, x.dtype, x.device,
                                                             self.tp_group, self.flash_context, g)
            return _decode_plan(self.flash_nosp_plan, algo)
        key = prefill_key(self.flash_site, kind, x, self.weight, *layout)
        return inference_plan(self.flash_chooser, key, x, self.weight, self.tp_group, self.flash_context,
                              self.flash_nosp_plan)

    def _no_sp_reason(self) -> str | None:
        """Without SP: stock where the input is not TP-split (Megatron scatters it first)."""
        return None if self.input_is_parallel else "input_is_parallel=False"

    def _forward_without_sp(self, input_, plan: OpPlan | None = None):
        """No SP: the output all-reduce runs decomposed (chunked Flash-RS + Flash-AG) by matmul_all_reduce in
        training; an inference step runs the chooser's plan (`_inference_plan`); the bias is added after it, as
        in the stock layer. `plan`: given (under FP8, the FP8 reference of a site stock would run)."""
        if plan is None and self.flash_step_kind == "train":
            plan = self._trained(input_, matmul_all_reduce, self.flash_nosp_plan)
            if plan is None:  # auto picked stock at this shape
                return RowParallelLinear.forward(self, input_)
        elif plan is None:
            plan = self._inference_plan(input_)
        route = self._flash_route(input_, ours=not runs_stock_collective(input_, plan))
        output = run(matmul_all_reduce, input_, self.weight, self.tp_group, plan, self._fp8_scales, wgrad=route,
                     context=self.flash_context)
        if self.skip_bias_add:
            return output, self.bias
        return (output + self.bias if self.bias is not None else output), None
