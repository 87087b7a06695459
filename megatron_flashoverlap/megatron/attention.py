"""Megatron-facing core attention for the local spec: Ulysses context parallelism and query-split attention.

    UlyssesDotProductAttention   q, k, v [s/cp, b, np/tp, hn] -> ctx [s/cp, b, np/tp*hn]
        the same constructor and forward contract as Megatron's local `DotProductAttention` (which asserts
        context_parallel_size == 1: this is the separate class a spec selects for cp > 1,
        cp_comm_type="a2a"). The a2a exchanges sequence shards for head shards over the CP group
        (ops/attention/ulysses.py): flash = pairwise steps on our executor, reference = all_to_all_single.
        Megatron's zigzag CP split (get_batch_on_this_cp_rank) is handled by positions, not reorders:
        causal masks and the already applied RoPE stay right. With cp == 1 it is plain local attention.

    QuerySplitDotProductAttention + QuerySplitRowParallelLinear (core_attention + linear_proj, TP with SP)
        core attention + output projection + reduce-scatter as one operator (ops/attention/query_split.py):
        the core attention returns a shape-only stand-in carrying q, k, v (`PendingAttention`); linear_proj
        runs query_split_attention with its own weight, so the RS hides behind attention. The linear keeps
        RowParallelLinear's parameters, checkpoint keys and return; its site plan ('proj') picks the algo
        (flash / flash_bidir = query split; slicing / reference = attention, then that GEMM+RS).

Numerics follow DotProductAttention's unfused path (baddbmm with the softmax scale, mask fill -10000, the
softmax in fp32 for bf16/fp16 where --attention-softmax-in-fp32 asks it).
Dropout: query-split attention draws stock's mask. It draws the whole sequence's bool mask [b, np/tp, s, s] as
DotProductAttention's attention_dropout draws it for its probs (ops/attention/core.py draw_keep: the same
generator, shape and dtype, the same numbers consumed). Each query block applies its rows as dropout does
(apply_keep), and the backward's recompute reads the same mask: the masks are stock's, and what the RNG gives
after attention is what it gives after stock's.
Ulysses' keep-masks are a counter-based hash of (seed, head, row, key) (keep_mask): no rank holds the whole
sequence's heads before its all-to-all. The seed is drawn on the device from the RNG Megatron's dropout uses
(the model-parallel one without SP), so a recompute reproduces the masks and TP ranks differ where stock's do.
Both draw inside get_cuda_rng_tracker().fork() without SP and from the current RNG with SP, as stock.
Not supported (ValueError naming the fix): packed sequences, attention bias; the flags are rows of
config/refusals.py (--apply-query-key-layer-scaling, --cp-comm-type other than a2a, ...).
softmax_type != "vanilla" (learnable / off-by-one) and sliding windows: the query-split core attention builds
Megatron's DotProductAttention instead (logged once; linear_proj then runs as FlashRowParallelLinear), equal
to stock; Ulysses refuses them (DotProductAttention cannot run cp > 1).
"""
from __future__ import annotations

import contextlib
import math

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec

from ..config import ENV_VARS, active
from ..config.refusals import refuse
from ..ops.all_reduce.all_reduce import resolve_local_world_size
from ..ops.choose import group_layout
from ..ops.attention.choose import ulysses_key, ulysses_pick
from ..ops.attention.core import Attend, attention_rows, draw_keep, make_spec
from ..ops.attention.query_split import query_split_attention
from ..ops.registry import OpPlan
from ..ops.attention.ulysses import check_ulysses_heads, ulysses_attention
from ..plan.chooser import chooser_of
from ..runtime import group_info, shared_context
from .linear import FlashRowParallelLinear
from .train_choice import query_split_key, query_split_plan
from .sdpa import megatron_instead, unsupported_by_ours


def _groups(pg_collection):
    """(tp group, cp group) from the collection Megatron passes, else from parallel_state."""
    tp = getattr(pg_collection, "tp", None) or parallel_state.get_tensor_model_parallel_group()
    cp = getattr(pg_collection, "cp", None) or parallel_state.get_context_parallel_group()
    return tp, cp


class UlyssesDotProductAttention(MegatronModule):
    """Ulysses (a2a) context-parallel core attention; drop-in for the local spec's `core_attention`. Its a2a is
    `flash_config.attention.ulysses_algo` (None: config.active()); auto (the default): stock's all-to-all or
    ours, measured at the first training-mode forward per shape (ops/attention/choose.py); an eval-mode forward
    before that runs stock's."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, flash_config=None, **kwargs):
        super().__init__(config=config)
        # config/refusals.py, the ulysses check: --cp-comm-type other than a2a, what only Megatron's
        # DotProductAttention implements (it runs at CP 1 only), --apply-query-key-layer-scaling
        refuse("ulysses", config, "UlyssesDotProductAttention", cp_comm_type=cp_comm_type)
        flash_config = active() if flash_config is None else flash_config
        self.tp_group, self.cp_group = _groups(pg_collection)
        tp, cp = group_info(self.tp_group)[1], group_info(self.cp_group)[1]
        check_ulysses_heads("UlyssesDotProductAttention", config.num_attention_heads // tp,
                            max(config.num_query_groups or config.num_attention_heads, tp) // tp, cp, tp)
        self.layer_number, self.attn_mask_type, self.attention_type = max(1, layer_number), attn_mask_type, attention_type
        self.algo = flash_config.attention.ulysses_algo  # checked by the config (ULYSSES_SITE_ALGOS)
        self.flash_chooser, self._chosen = chooser_of(flash_config), {}
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def _seed(self) -> int | torch.Tensor:
        """The dropout seed, a 0-dim int64 tensor drawn by Megatron's rule for DotProductAttention's dropout:
        without SP inside `get_cuda_rng_tracker().fork()` (the model-parallel RNG: distinct per TP rank), with
        SP from the current RNG (TransformerBlock forks it for the whole block). Drawn on the CUDA generator
        where there is one (on the host, torch.randint would read the CPU generator, identical on every TP
        rank), and kept on the device: no host sync."""
        if not (self.training and self.dropout_p > 0):
            return 0
        cuda = torch.cuda.is_available()
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        fork = (contextlib.nullcontext() if self.config.sequence_parallel
                else tensor_parallel.get_cuda_rng_tracker().fork())
        with fork:  # the same stream Megatron's DotProductAttention dropout draws from
            return torch.randint(0, 2 ** 62, (), device=device, dtype=torch.int64)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        """query [s/cp, b, np/tp, hn], key/value [s/cp, b, ng/tp, hn] -> [s/cp, b, np/tp*hn]."""
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("UlyssesDotProductAttention: packed sequences and attention bias are not supported")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        causal = attention_mask is None and mask_type == AttnMaskType.causal  # as Megatron: a mask wins
        attend = Attend(causal=causal, mask=attention_mask, softmax_scale=self.softmax_scale,
                        dropout_p=self.dropout_p if self.training else 0.0, seed=self._seed(), zigzag=True,
                        softmax_in_fp32=self.config.attention_softmax_in_fp32)
        return ulysses_attention(query, key, value, self.cp_group, attend=attend,
                                 algo=self._algo(query, key, value, attend), context=shared_context("layer"))

    def _algo(self, query, key, value, attend) -> str:
        """The a2a of this call: the configured word, or under auto the chooser's pick for this shape (decided at
        the first training-mode forward; stock's before it)."""
        if self.algo != "auto":
            return self.algo
        shape = (tuple(query.shape), tuple(key.shape), query.dtype)
        if shape not in self._chosen:
            if not self.training:
                return "reference"
            world = group_info(self.cp_group)[1]
            g = resolve_local_world_size(world, None, self.cp_group, strict=False)
            key_ = ulysses_key(query, key, *group_layout(self.cp_group, g, query.dtype))
            self._chosen[shape] = ulysses_pick(self.flash_chooser, key_, (query, key, value), attend, self.cp_group,
                                               shared_context("layer"), _model_parallel_replicas())
        return self._chosen[shape]

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        return {}  # no parameters (softmax_type 'vanilla' only)


class PendingAttention(torch.Tensor):
    """What QuerySplitDotProductAttention returns under TP+SP: a shape-only stand-in for ctx [s, b, np/tp*hn]
    carrying (q, k, v, how to attend). Only QuerySplitRowParallelLinear (linear_proj) may consume it; any
    other use raises, so a spec that pairs the query-split core attention with another linear_proj fails
    loudly instead of projecting garbage."""

    _SHAPE_OPS = ("size", "dim", "numel", "__get__", "__repr__", "__format__")

    @staticmethod
    def __new__(cls, q, k, v, attend: Attend):
        shape = (q.shape[0], q.shape[1], q.shape[2] * q.shape[3])
        t = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=q.dtype, device=q.device)
        t.qkv, t.attend = (q, k, v), attend
        return t

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


class QuerySplitDotProductAttention(MegatronModule):
    """Core attention that, under TP with SP, defers to linear_proj: attention + proj + RS then run as one
    operator (query_split_attention), block by block in the reduce-scatter's order. Without SP, with TP=1
    or with CP it is plain local attention (numerically Megatron's DotProductAttention). A model it does not
    implement (`unsupported_by_ours`) gets Megatron's DotProductAttention, logged once."""

    def __new__(cls, config, *args, **kwargs):
        why = unsupported_by_ours(config)
        if why is not None:
            return megatron_instead(cls.__name__, why, config, *args, **kwargs)
        return super().__new__(cls)

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, **kwargs):
        super().__init__(config=config)
        self.tp_group, self.cp_group = _groups(pg_collection)
        # config/refusals.py, the query_split check: --apply-query-key-layer-scaling, --recompute-modules
        # core_attn, and a CP group of more than one rank
        refuse("query_split", config, "QuerySplitDotProductAttention",
               context_parallel_size=group_info(self.cp_group)[1])
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

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
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("QuerySplitDotProductAttention: packed sequences and attention bias are not supported")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        keep = self._keep(query, key)
        attend = Attend(causal=attention_mask is None and mask_type == AttnMaskType.causal, mask=attention_mask,
                        softmax_scale=self.softmax_scale, dropout_p=self.dropout_p if keep is not None else 0.0,
                        keep=keep, softmax_in_fp32=self.config.attention_softmax_in_fp32)
        if self.config.sequence_parallel and group_info(self.tp_group)[1] > 1:
            return PendingAttention(query, key, value, attend)
        return attention_rows(query, key, value, make_spec(query, attend, attention_mask, keep=keep), 0)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        return {}


class QuerySplitRowParallelLinear(FlashRowParallelLinear):
    """linear_proj for QuerySplitDotProductAttention: given its stand-in, runs query_split_attention with
    this layer's weight (same parameters, checkpoint keys and (output, bias) return as RowParallelLinear);
    given a real tensor, it is FlashRowParallelLinear. Its query-split OpPlan (the site's algo and slicing's
    chunks) is made once, at construction."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        site = self.flash_plan
        # attention.query_split is the user's word for this site's operator; under proj's auto (the default) the
        # chooser picks its algo at a training step: reference or flash (megatron/train_choice.py
        # query_split_plan); any other step runs flash's
        algo = None if site is None else ("flash" if site.algo == "auto" else site.algo)
        self.query_split_plan = OpPlan("reference") if site is None else OpPlan(algo, site.num_chunks)
        self._query_split_trained: dict = {}  # (q, k shapes, dtype) -> the training plan the chooser picked

    def flash_ran(self) -> str:
        """For the GEMM sites line: "query_split (<algo>)" where the pair runs (SP, TP > 1, a model our core
        attention implements: the same test QuerySplitDotProductAttention makes), else what the linear runs."""
        if (self.flash_plan is None or self.flash_fp8 is not None or not self.sequence_parallel
                or group_info(self.tp_group)[1] == 1 or unsupported_by_ours(self.config) is not None):
            return super().flash_ran()
        return f"query_split ({self.flash_plan.algo if self.flash_auto else self.query_split_plan.algo})"

    def _query_split_step_plan(self, q, k, v, attend) -> OpPlan:
        """query_split_attention's plan for this call: the chooser's at a training step of an auto proj, else the
        one made at construction."""
        if not (self.flash_auto and self.flash_step_kind == "train"):
            return self.query_split_plan
        shape = (tuple(q.shape), tuple(k.shape), q.dtype)
        if shape not in self._query_split_trained:
            key = query_split_key(q, k, self.weight, *self._layout(q))
            self._query_split_trained[shape] = query_split_plan(self, key, q, k, v, attend, self.query_split_plan)
        return self._query_split_trained[shape]

    def forward(self, input_):
        if not isinstance(input_, PendingAttention):
            return super().forward(input_)
        q, k, v = input_.qkv
        plan = self._query_split_step_plan(q, k, v, input_.attend)
        output = query_split_attention(q, k, v, self.weight, self.tp_group, attend=input_.attend,
                                       plan=plan, context=self.flash_context)
        if self.skip_bias_add:
            return output, self.bias
        return (output + self.bias if self.bias is not None else output), None


def select_attention(attn_submodules, flash_config, *, context_parallel_size: int,
                     sequence_parallel: bool | None) -> None:
    """Spec hook: choose core_attention / linear_proj of SelfAttentionSubmodules from `flash_config.attention`.

    - context_parallel_size > 1: UlyssesDotProductAttention (the local DotProductAttention refuses CP),
      its a2a algo = attention.ulysses_algo;
    - else, with attention.query_split: the query-split pair (needs SP: `sequence_parallel` must be True;
      None = unknown to the caller, a ValueError that says where to pass it);
    - else: unchanged (Megatron's DotProductAttention, our FlashRowParallelLinear for proj)."""
    settings = flash_config.attention
    if context_parallel_size > 1:
        attn_submodules.core_attention = ModuleSpec(module=UlyssesDotProductAttention,
                                                    params={"flash_config": flash_config})
        return
    if not settings.query_split:
        return
    if sequence_parallel is None:
        raise ValueError("query-split attention needs sequence parallelism, which get_gpt_layer_flashoverlap_spec "
                         "cannot see (get_gpt_layer_local_spec's arguments do not carry it): pass "
                         "sequence_parallel=True, or turn attention.query_split off")
    if not sequence_parallel:
        raise ValueError("query-split attention needs sequence parallelism (its reduce-scatter is what it hides); "
                         "set --sequence-parallel, or turn attention.query_split off (YAML attention: "
                         f"{{query_split: false}}, or {ENV_VARS['query_split']}=0)")
    attn_submodules.core_attention = QuerySplitDotProductAttention
    attn_submodules.linear_proj = ModuleSpec(module=QuerySplitRowParallelLinear,
                                             params={"flash_config": flash_config})


def _model_parallel_replicas():
    """Megatron's tensor + data + context parallel group of this pipeline stage (every rank whose auto choice
    should agree), None where Megatron's parallel state is not up (the CP group alone decides)."""
    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
