"""Megatron-facing Ulysses core attention for the local spec (context parallelism, cp_comm_type a2a).

    UlyssesDotProductAttention   q, k, v [s/cp, b, np/tp, hn] -> ctx [s/cp, b, np/tp*hn]
        the same constructor and forward contract as Megatron's local `DotProductAttention` (which asserts
        context_parallel_size == 1: this is the separate class a spec selects for cp > 1,
        cp_comm_type="a2a"). The a2a exchanges sequence shards for head shards over the CP group
        (ops/attention/ulysses.py): flash = pairwise steps on our executor, reference = all_to_all_single.
        Megatron's zigzag CP split (get_batch_on_this_cp_rank) is handled by positions, not reorders:
        causal masks and the already applied RoPE stay right. With cp == 1 it is plain local attention.

Numerics follow DotProductAttention's unfused path (baddbmm with the softmax scale, mask fill -10000, the
softmax in fp32 for bf16/fp16 where --attention-softmax-in-fp32 asks it). Dropout keep-masks are a
counter-based hash of (seed, head, row, key) (ops/attention/core.py keep_mask): no rank holds the whole
sequence's heads before the all-to-all. The seed is drawn on the device from the RNG Megatron's dropout uses
(inside get_cuda_rng_tracker().fork() without SP, the current RNG with SP), so a recompute reproduces the
masks and TP ranks differ where stock's do.
Not supported (ValueError naming the fix): packed sequences, attention bias; the flags are rows of
config/refusals.py (--apply-query-key-layer-scaling, --cp-comm-type other than a2a, softmax_type other than
vanilla, sliding windows: DotProductAttention implements those, at CP 1 only).
The query-split pair (TP with SP): megatron/query_split_pair.py.
"""
from __future__ import annotations

import contextlib
import math

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from ..config import active
from ..config.refusals import refuse
from ..ops.all_reduce.all_reduce import resolve_local_world_size
from ..ops.choose import group_layout
from ..ops.attention.choose import ulysses_key, ulysses_pick
from ..ops.attention.core import Attend
from ..ops.attention.ulysses import check_ulysses_heads, ulysses_attention
from ..plan.chooser import chooser_of
from ..runtime import group_info, shared_context


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


def _model_parallel_replicas():
    """Megatron's tensor + data + context parallel group of this pipeline stage (every rank whose auto choice
    should agree), None where Megatron's parallel state is not up (the CP group alone decides)."""
    if not parallel_state.model_parallel_is_initialized():
        return None
    return parallel_state.get_tensor_and_data_parallel_group(with_context_parallel=True)
