"""The query-split pair for the local spec (TP with SP): core attention + output projection + reduce-scatter as
one operator (ops/attention/query_split.py), where proj chooses it.

    QuerySplitDotProductAttention  (core_attention)  q [s, b, np/tp, hn], k, v [s, b, ng/tp, hn]
        -> PendingAttention: a shape-only stand-in for ctx [s, b, np/tp*hn] carrying q, k, v, how to attend,
           Megatron's DotProductAttention on the call (held here) and stock's dropout draw
    QuerySplitRowParallelLinear    (linear_proj)     given the stand-in -> (y [s/tp, b, h], bias)
        either query_split_attention with its own weight (each query block's attention + GEMM while the previous
        block's partial flies), or Megatron's DotProductAttention, then its GEMM + RS; given a real tensor,
        FlashRowParallelLinear. Same parameters, checkpoint keys and return as RowParallelLinear.

Which runs: proj's auto at a training step (the chooser: reference, flash, flash_c2, query_split, timed with the
attention; megatron/train_choice.py query_split_plan); other steps by attention.query_split: auto (the
default: Megatron's attention, then proj as without the pair), true (the site's algo: flash / flash_bidir =
query split; slicing / reference = stock's attention, then that GEMM + RS). attention.query_split auto builds the
pair wherever query split can run (`query_split_cannot_run`); true asks for it (what cannot run it is refused,
config/refusals.py).

Numerics: query split's attention is DotProductAttention's unfused arithmetic per block of rows (the softmax in
fp32 for bf16/fp16 where --attention-softmax-in-fp32 asks it). Its dropout is stock's draw: the whole sequence's
bool mask [b, np/tp, s, s], drawn as DotProductAttention's attention_dropout draws it for its probs
(ops/attention/core.py draw_keep: the same generator, shape and dtype, the same numbers consumed; inside
get_cuda_rng_tracker().fork() without SP, the current RNG with SP). Each query block applies its rows as dropout
does (apply_keep), and the backward goes through the graph that applied it: the masks are stock's, and what the RNG
gives after attention is what it gives after stock's. The stand-in draws only once proj has chosen, so exactly
one of stock's attention and the draw runs per call.
softmax_type != "vanilla" (learnable / off-by-one) and sliding windows: the core attention builds Megatron's
DotProductAttention instead (logged once; linear_proj then runs as FlashRowParallelLinear), equal to stock.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import torch
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel import RowParallelLinear
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from ..config import active
from ..config.refusals import refuse, unhonoured
from ..ops.attention.core import Attend, draw_keep
from ..ops.attention.query_split import query_split_attention
from ..ops.registry import OpPlan
from ..runtime import group_info
from .attention import _groups
from .linear import FlashRowParallelLinear
from .sdpa import megatron_instead, unsupported_by_ours
from .train_choice import query_split_key, query_split_plan


class PendingAttention(torch.Tensor):
    """What QuerySplitDotProductAttention returns under TP+SP: a shape-only stand-in for ctx [s, b, np/tp*hn]
    carrying (q, k, v), how to attend without dropout (`attend`), the dropout rate `p`, and two calls that
    linear_proj makes once it has chosen: `stock(q, k, v)` (Megatron's DotProductAttention on the call's mask:
    stock's ctx, its dropout drawn there) and `draw(q, k)` (the keep-mask stock's dropout would draw, for query
    split; None without dropout). Exactly one of them runs per call, so the RNG moves as stock's. Only
    QuerySplitRowParallelLinear (linear_proj) may consume it; any other use raises, so a spec that pairs the
    query-split core attention with another linear_proj fails loudly instead of projecting garbage."""

    _SHAPE_OPS = ("size", "dim", "numel", "__get__", "__repr__", "__format__")

    @staticmethod
    def __new__(cls, q, k, v, attend: Attend, p: float, stock, draw):
        shape = (q.shape[0], q.shape[1], q.shape[2] * q.shape[3])
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=q.dtype, device=q.device)
        t.qkv, t.attend, t.p, t.stock, t.draw = (q, k, v), attend, p, stock, draw
        return t

    def attend_with(self, keep) -> Attend:
        """`attend` with the drawn keep-mask (no dropout where keep is None)."""
        return self.attend if keep is None else dataclasses.replace(self.attend, dropout_p=self.p, keep=keep)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in cls._SHAPE_OPS:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        raise ValueError(f"the query-split core attention's output was used by {func!r}: with "
                         f"QuerySplitDotProductAttention as core_attention, linear_proj must be "
                         f"QuerySplitRowParallelLinear and nothing may transform the attention output in between "
                         f"(gated attention, packed sequences, offloading are not supported)")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise ValueError(f"the query-split core attention's output reached {func}; see PendingAttention")


def query_split_cannot_run(config, flash_config, tp_size: int, cp_size: int) -> str | None:
    """Why query split is not a candidate of proj's auto in this model (attention.query_split: auto), None where
    it is: it needs TP > 1 with SP at CP 1, proj's algo auto, and nothing that the query-split check
    refuses (config/refusals.py) or that our core attention does not implement (stock_attention rows), or that
    reads the core attention's output before linear_proj (the output gate, activation offloading of core_attn or
    attn_proj)."""
    if not config.sequence_parallel or tp_size == 1 or cp_size > 1:
        return "it needs TP > 1 with sequence parallelism at CP 1"
    if flash_config.plan("proj").algo != "auto":
        return f"proj's algo is {flash_config.plan('proj').algo} (the chooser weighs query split under auto)"
    why = unsupported_by_ours(config) or unhonoured("query_split", config, context_parallel_size=cp_size)
    if why is not None:
        return why
    if getattr(config, "attention_output_gate", False):
        return "the attention output gate reads the core attention's output before linear_proj"
    offloaded = set(getattr(config, "offload_modules", None) or ()) & {"core_attn", "attn_proj"}
    if getattr(config, "fine_grained_activation_offloading", False) and offloaded:
        return f"activation offloading of {sorted(offloaded)} reads the core attention's output"
    return None


class QuerySplitDotProductAttention(MegatronModule):
    """Core attention that, under TP with SP, defers to linear_proj: attention + proj + RS then run as one
    operator (query_split_attention), block by block in the reduce-scatter's order, where proj chooses it;
    otherwise linear_proj runs Megatron's DotProductAttention (held here as `stock`) and then its own GEMM + RS.
    Without SP, with TP 1 or with CP it is Megatron's DotProductAttention. `flash_config.attention.query_split`
    (None: config.active()): true, asked (what cannot run it is refused); auto, a candidate of proj's auto where
    `query_split_cannot_run` finds nothing, else Megatron's DotProductAttention is built instead; false, Megatron's
    DotProductAttention. A model our attention does not implement (`unsupported_by_ours`) gets Megatron's
    DotProductAttention, logged once."""

    def __new__(cls, config, *args, flash_config=None, **kwargs):
        flash_config = active() if flash_config is None else flash_config
        mode = flash_config.attention.query_split
        tp_group, cp_group = _groups(kwargs.get("pg_collection"))
        if mode == "auto":
            why = query_split_cannot_run(config, flash_config, group_info(tp_group)[1], group_info(cp_group)[1])
            if why is not None:
                return DotProductAttention(config, *args, **kwargs)  # as stock's local spec: nothing to log
        elif not mode:
            return DotProductAttention(config, *args, **kwargs)
        why = unsupported_by_ours(config)
        if why is not None:
            return megatron_instead(cls.__name__, why, config, *args, **kwargs)
        return super().__new__(cls)

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, flash_config=None, **kwargs):
        super().__init__(config=config)
        self.tp_group, self.cp_group = _groups(pg_collection)
        # config/refusals.py, the query_split check: --apply-query-key-layer-scaling, --recompute-modules
        # core_attn, and a CP group of more than one rank (under auto, query_split_cannot_run found none)
        refuse("query_split", config, "QuerySplitDotProductAttention",
               context_parallel_size=group_info(self.cp_group)[1])
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        flash_config = active() if flash_config is None else flash_config
        self.asked = flash_config.attention.query_split is True  # else auto: a call query split cannot run is stock's
        self.stock = DotProductAttention(config, layer_number, attn_mask_type, attention_type,
                                         attention_dropout=attention_dropout, softmax_scale=softmax_scale,
                                         cp_comm_type=cp_comm_type, pg_collection=pg_collection, **kwargs)

    def _keep(self, query, key) -> torch.Tensor | None:
        """Stock's dropout mask for this call, bool [b, np/tp, sq, sk], drawn as DotProductAttention's
        attention_dropout draws it for its probs [b, np/tp, sq, sk] in the query's dtype (draw_keep): inside
        get_cuda_rng_tracker().fork() without SP, from the current RNG with SP (TransformerBlock forks it for the
        whole block). None where no dropout runs."""
        if not (self.training and self.dropout_p > 0):
            return None
        fork = (contextlib.nullcontext() if self.config.sequence_parallel
                else tensor_parallel.get_cuda_rng_tracker().fork())
        with fork:
            return draw_keep((query.shape[1], query.shape[2], query.shape[0], key.shape[0]), query.dtype,
                             self.dropout_p, query.device)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        """query [s, b, np/tp, hn], key/value [s, b, ng/tp, hn] -> ctx [s, b, np/tp*hn] (or its stand-in)."""
        stock = functools.partial(self.stock, attention_mask=attention_mask, attn_mask_type=attn_mask_type,
                                  attention_bias=attention_bias, packed_seq_params=packed_seq_params, **kwargs)
        if not (self.config.sequence_parallel and group_info(self.tp_group)[1] > 1):
            return stock(query, key, value)
        if (packed_seq_params is not None or attention_bias is not None) and self.asked:
            raise ValueError("QuerySplitDotProductAttention: packed sequences and attention bias are not supported; "
                             "turn attention.query_split off (or auto: such a call then runs Megatron's attention)")
        if packed_seq_params is not None or attention_bias is not None:
            return stock(query, key, value)
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        attend = Attend(causal=attention_mask is None and mask_type == AttnMaskType.causal, mask=attention_mask,
                        softmax_scale=self.softmax_scale, softmax_in_fp32=self.config.attention_softmax_in_fp32)
        return PendingAttention(query, key, value, attend, self.dropout_p, stock, self._keep)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        return {}


class QuerySplitRowParallelLinear(FlashRowParallelLinear):
    """linear_proj for QuerySplitDotProductAttention: given its stand-in, runs query split, or Megatron's core
    attention followed by a GEMM + RS of this layer (same parameters, checkpoint keys and (output, bias) return
    as RowParallelLinear); given a real tensor, it is FlashRowParallelLinear.

    What a call runs (`_pending_pick`):
        a training step under proj's auto: the chooser's pick for proj/train/<bucket> (megatron/train_choice.py
            query_split_plan): reference (stock's attention, then Megatron's forward), flash or flash_c2 (stock's
            attention, then our GEMM + RS) or query_split
        any other step, attention.query_split auto: stock's attention, then FlashRowParallelLinear's forward for
            that step kind
        any other step, attention.query_split true: the site's algo: flash / flash_bidir (auto: flash) run query
            split; slicing runs stock's attention, then our sliced GEMM + RS; reference, Megatron's forward"""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        site = self.flash_plan
        self.query_split_auto = self.flash_config.attention.query_split == "auto"
        algo = None if site is None else ("flash" if site.algo == "auto" else site.algo)
        self.query_split_plan = OpPlan("reference") if site is None else OpPlan(algo, site.num_chunks)
        self._query_split_trained: dict = {}  # (q, k shapes, dtype) -> (the chooser's pick, its plan)

    def flash_ran(self) -> str:
        """For the GEMM sites line: under attention.query_split true "query_split (<algo>)" where the pair runs
        (SP, TP > 1, a model our core attention implements: the test QuerySplitDotProductAttention makes); under
        auto "auto (query_split a candidate)" where query_split_cannot_run finds nothing; else what the linear
        runs."""
        tp = group_info(self.tp_group)[1]
        if self.query_split_auto:
            why = query_split_cannot_run(self.config, self.flash_config, tp, 1)
            return super().flash_ran() if why is not None else "auto (query_split a candidate)"
        if (self.flash_plan is None or self.flash_fp8 is not None or not self.sequence_parallel or tp == 1
                or unsupported_by_ours(self.config) is not None):
            return super().flash_ran()
        return f"query_split ({self.flash_plan.algo if self.flash_auto else self.query_split_plan.algo})"

    def _pending_pick(self, pending) -> tuple[str, OpPlan | None]:
        """(what runs, its plan) for this call (class docstring): "query_split", "stock" (Megatron's forward),
        "ours" (our GEMM + RS with the plan) or "step" (FlashRowParallelLinear's forward for the step kind); the
        last three after stock's attention."""
        if self.flash_auto and self.flash_step_kind == "train":
            q, k, _ = pending.qkv
            shape = (tuple(q.shape), tuple(k.shape), q.dtype)
            if shape not in self._query_split_trained:  # the chooser decides a key once; asked once per shape
                key = query_split_key(q, k, self.weight, *self._layout(q))
                self._query_split_trained[shape] = query_split_plan(self, key, pending, self.flash_sp_plan,
                                                                    self.query_split_plan)
            pick, plan = self._query_split_trained[shape]
            return {"reference": "stock", "query_split": "query_split"}.get(pick, "ours"), plan
        if self.query_split_auto:
            return "step", None
        plan = self.query_split_plan
        return ("query_split" if plan.algo in ("flash", "flash_bidir") else
                "stock" if plan.is_reference else "ours"), plan

    def forward(self, input_):
        if not isinstance(input_, PendingAttention):
            return super().forward(input_)
        what, plan = self._pending_pick(input_)
        q, k, v = input_.qkv
        if what == "query_split":
            attend = input_.attend_with(input_.draw(q, k))
            output = query_split_attention(q, k, v, self.weight, self.tp_group, attend=attend, plan=plan,
                                           context=self.flash_context)
            if self.skip_bias_add:
                return output, self.bias
            return (output + self.bias if self.bias is not None else output), None
        ctx = input_.stock(q, k, v)  # Megatron's DotProductAttention: stock's ctx, stock's dropout
        if what == "step":
            return super().forward(ctx)
        if what == "stock":
            return RowParallelLinear.forward(self, ctx)
        return self._sp_forward(ctx, plan)
