"""Core attention on torch.nn.functional.scaled_dot_product_attention, for the local spec without TE.

    SdpaDotProductAttention(config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                            softmax_scale=None, cp_comm_type=None, pg_collection=None, kernels=None)
        query [sq, b, np/tp, hn], key / value [sk, b, ng/tp, hn] -> ctx [sq, b, np/tp * hn]
        ctx = softmax(scale * q k^T + mask) v, the constructor and forward contract of Megatron's local
        DotProductAttention. On GPU SDPA runs flash attention (no mask / causal) or memory-efficient
        attention (a mask) instead of DotProductAttention's unfused baddbmm + softmax + bmm.

Semantics kept from DotProductAttention:
    mask        Megatron's bool convention, True = masked out (SDPA's is the inverse: passed as ~mask). A
                given mask wins over the causal type; with no mask, causal means SDPA's is_causal (sq == sk).
                A row with every key masked is the plain mean of v, as DotProductAttention's softmax of
                all -10000 scores gives (SDPA alone would give NaN or 0 there).
    GQA         ng < np: SDPA's enable_gqa without a mask (flash), k/v repeated per head with one (the
                memory-efficient kernel takes no enable_gqa), as DotProductAttention repeats them.
    scale       softmax_scale, default 1/sqrt(kv_channels); apply_query_key_layer_scaling changes nothing
                (DotProductAttention divides by the layer number and multiplies it back in the fp32 softmax).
    dropout     keep-probability 1 - p on the attention probabilities, kept ones scaled by 1/(1 - p); drawn
                inside the model-parallel RNG tracker's fork without SP (the block forks it under SP), so
                activation recompute replays it. The masks are SDPA's own, not DotProductAttention's.
Not supported (ValueError naming the fix): attention bias, packed sequences, sliding windows,
softmax_type != "vanilla", context parallelism (the spec picks Ulysses for cp > 1), non-bool masks.

`--attention-backend` (Megatron's AttnBackend) -> `core_attention_for(config, backend_name)`:
    local                      Megatron's DotProductAttention (what the flag asks for, TE or not)
    auto / flash / fused /     Transformer Engine installed: TEDotProductAttention (TE picks its kernel from
    unfused                    the NVTE_* variables Megatron sets from the flag).
                               Without TE: SdpaDotProductAttention with SDPA kernels
                               auto -> torch's choice, flash -> flash, fused -> memory-efficient / cuDNN,
                               unfused -> math (torch's unfused reference).
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from torch.nn.attention import SDPBackend, sdpa_kernel

KERNELS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
           "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
BACKEND_KERNELS = {"auto": None, "flash": ("flash",), "fused": ("efficient", "cudnn"), "unfused": ("math",)}


def check_sdpa_config(config) -> None:
    """What SdpaDotProductAttention does not implement: say the fix where the config is first seen."""
    op = "SdpaDotProductAttention"
    if getattr(config, "softmax_type", "vanilla") != "vanilla":
        raise ValueError(f"{op}: softmax_type={config.softmax_type!r} is not supported; use 'vanilla', or "
                         f"install Transformer Engine")
    if getattr(config, "window_size", None) is not None:
        raise ValueError(f"{op}: sliding-window attention is not supported; unset window_size, or install "
                         f"Transformer Engine")
    if getattr(config, "context_parallel_size", 1) > 1:
        raise ValueError(f"{op}: context parallelism is not supported; flashoverlap_layer_spec selects "
                         f"UlyssesDotProductAttention for cp > 1 (--cp-comm-type a2a)")


def _kernels(kernels) -> tuple | None:
    if kernels is None:
        return None
    unknown = [k for k in kernels if k not in KERNELS]
    if unknown or not kernels:
        raise ValueError(f"SdpaDotProductAttention: unknown SDPA kernels {unknown or kernels}; choose from "
                         f"{tuple(KERNELS)} or None (torch's choice)")
    return tuple(kernels)


def _tp_size(pg_collection) -> int:
    tp = getattr(pg_collection, "tp", None) or parallel_state.get_tensor_model_parallel_group()
    return tp.size()


class SdpaDotProductAttention(MegatronModule):
    """DotProductAttention's contract on scaled_dot_product_attention; drop-in for `core_attention`."""

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, kernels=None, **kwargs):
        super().__init__(config=config)
        check_sdpa_config(config)
        tp = _tp_size(pg_collection)
        if config.num_attention_heads % tp or config.num_query_groups % tp:
            raise ValueError(f"SdpaDotProductAttention: {config.num_attention_heads} heads and "
                             f"{config.num_query_groups} query groups must both divide by TP={tp}")
        self.layer_number, self.attn_mask_type, self.attention_type = max(1, layer_number), attn_mask_type, attention_type
        self.hidden_size_per_partition = config.kv_channels * config.num_attention_heads // tp
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        self.kernels = _kernels(kernels)

    def _rng(self):
        """DotProductAttention's dropout RNG: the tracker's fork without SP (under SP the block forks)."""
        if not (self.training and self.dropout_p > 0) or self.config.sequence_parallel:
            return contextlib.nullcontext()
        return tensor_parallel.get_cuda_rng_tracker().fork()

    def _sdpa(self, q, k, v, keep, causal: bool):
        """q [b, np, sq, hn], k / v [b, ng|np, sk, hn], keep [.., sq, sk] True = attend -> [b, np, sq, hn]."""
        p = self.dropout_p if self.training else 0.0
        gqa = k.shape[1] != q.shape[1]
        kernels = contextlib.nullcontext() if self.kernels is None else sdpa_kernel([KERNELS[n] for n in self.kernels])
        try:
            with self._rng(), kernels:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=p, is_causal=causal,
                                                      scale=self.softmax_scale, enable_gqa=gqa)
        except RuntimeError as err:
            if self.kernels is None or "kernel" not in str(err).lower():
                raise
            raise ValueError(f"SdpaDotProductAttention: SDPA kernels {self.kernels} cannot run this call "
                             f"({err}); use --attention-backend auto (torch picks a kernel that can)") from err

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        """query [sq, b, np/tp, hn], key/value [sk, b, ng/tp, hn] -> [sq, b, np/tp*hn]."""
        if packed_seq_params is not None or attention_bias is not None:
            raise ValueError("SdpaDotProductAttention: packed sequences and attention bias are not supported; "
                             "install Transformer Engine (TEDotProductAttention) for them")
        sq, b, heads = query.shape[0], query.shape[1], query.shape[2]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [s, b, n, hn] -> [b, n, s, hn]
        if attention_mask is None:
            mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
            causal = mask_type == AttnMaskType.causal and sq > 1  # as Megatron: no mask for one query
            if causal and sq != k.shape[2]:
                raise ValueError(f"SdpaDotProductAttention: causal attention without a mask needs sq == sk "
                                 f"(got {sq} vs {k.shape[2]}); pass an explicit attention_mask")
            ctx = self._sdpa(q, k, v, None, causal)
        else:
            ctx = self._masked(q, k, v, attention_mask)
        return ctx.permute(2, 0, 1, 3).reshape(sq, b, heads * q.shape[3])  # [b, np, sq, hn] -> [sq, b, np*hn]

    def _masked(self, q, k, v, mask):
        """Megatron mask [b|1, np|1, sq, sk], True = masked out; fully masked rows -> mean of v."""
        if mask.dtype != torch.bool:
            raise ValueError(f"SdpaDotProductAttention: attention_mask must be bool (True = masked out, "
                             f"Megatron's convention), got {mask.dtype}")
        if k.shape[1] != q.shape[1]:  # the memory-efficient kernel takes no enable_gqa: repeat, as Megatron
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        full = mask.all(dim=-1, keepdim=True)  # [.., sq, 1] rows with no key left
        ctx = self._sdpa(q, k, v, ~mask | full, False)
        return torch.where(full, v.mean(dim=2, keepdim=True), ctx)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        return {}  # no parameters (softmax_type 'vanilla' only), as DotProductAttention then


def _backend_name(backend_name) -> str:
    name = getattr(backend_name, "name", backend_name)  # AttnBackend.flash or "flash"
    if name != "local" and name not in BACKEND_KERNELS:
        raise ValueError(f"core_attention_for: unknown attention backend {backend_name!r}; choose one of "
                         f"{('local', *BACKEND_KERNELS)} (Megatron's --attention-backend)")
    return name


def _te_attention():
    from megatron.core.extensions import transformer_engine as te_ext

    return te_ext.TEDotProductAttention if te_ext.HAVE_TE else None


def core_attention_for(config, backend_name="auto"):
    """--attention-backend value -> the core_attention class or ModuleSpec (see the module docstring).
    `config` (Megatron's TransformerConfig, or None) is checked here for what SDPA does not support."""
    name = _backend_name(backend_name)
    if name == "local":
        return DotProductAttention
    te = _te_attention()
    if te is not None:
        return te
    if config is not None:
        check_sdpa_config(config)
    kernels = BACKEND_KERNELS[name]
    return SdpaDotProductAttention if kernels is None else ModuleSpec(module=SdpaDotProductAttention,
                                                                      params={"kernels": kernels})
