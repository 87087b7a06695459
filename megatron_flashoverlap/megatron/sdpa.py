"""Core attention on torch.nn.functional.scaled_dot_product_attention, and which core attention a spec builds.

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
Numerics against DotProductAttention (the same function, not the same roundings; never bitwise): fp32 within
1e-5 of max |reference| (the products summed in another order); bf16 / fp16 within one epsilon of the type times
max |ctx| (DotProductAttention rounds the scores and the probabilities to the 16-bit type, SDPA's kernels keep
them in fp32). Measured: docs/attention.md. For a model equal to stock to the bit keep the default core attention.
CPU (the proxy for a GPU): a requested kernel that has no CPU implementation for the call (memory-efficient,
cuDNN; flash with dropout) runs torch's math kernel, logged once. On CUDA it is a ValueError naming the
choices that can run.
Not supported (ValueError naming the fix): attention bias, packed sequences, context parallelism (the spec
picks Ulysses for cp > 1), non-bool masks. softmax_type != "vanilla" (learnable / off-by-one) and sliding
windows build Megatron's DotProductAttention instead (`megatron_instead`, logged once): it implements them.

The core attention a spec builds, `core_attention_for(core, backend, transformer_impl)` (core: the YAML's
attention.core; backend: Megatron's --attention-backend; TE's = stock builds Transformer Engine's spec:
--transformer-impl transformer_engine with TE installed; our spec is a local spec either way):
    --attention-backend  stock builds               core: auto (default)         megatron  sdpa
    auto                 TE's / DotProductAttention  = stock                      = stock   SDPA, torch's choice
    flash                TE's / DotProductAttention  TE's / SDPA flash            = stock   SDPA flash
    fused                TE's / DotProductAttention  TE's / SDPA efficient+cuDNN  = stock   SDPA efficient+cuDNN
    unfused              TE's / DotProductAttention  = stock                      = stock   SDPA math
    local                DotProductAttention         = stock                      = stock   ValueError
("TE's" = TEDotProductAttention, TE picking its kernel from the NVTE_* variables Megatron sets from the flag;
stock's local spec ignores the flag. Stock's `--attention-backend local` is GPTModelBuilder's override.)
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from torch.nn.attention import SDPBackend, sdpa_kernel

from ..config import CORE_ATTENTIONS
from ..config.refusals import refuse, unhonoured
from ..runtime.once import LogOnce

log = logging.getLogger(__name__)
_LOGGED = LogOnce(log)  # one warning per key and process: a legitimate fallback says what runs and why, once

KERNELS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
           "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
BACKEND_KERNELS = {"auto": None, "flash": ("flash",), "fused": ("efficient", "cudnn"), "unfused": ("math",)}
SDPA_BACKENDS = ("flash", "fused")  # what core: auto turns into SDPA where stock would not use TE


def unsupported_by_ours(config) -> str | None:
    """What our core attentions (SDPA, query split, Ulysses) do not implement and Megatron's
    DotProductAttention does (config/refusals.py, the stock_attention rows): the reason, else None."""
    return unhonoured("stock_attention", config)


def megatron_instead(op: str, why: str, config, *args, **kwargs):
    """Megatron's DotProductAttention, built from the arguments Megatron passed `op`, for a model `op` cannot run
    as stock does (`why`); logged once."""
    _LOGGED((op, why), f"{op}: {why}; Megatron's DotProductAttention runs instead (as stock's local spec)")
    return DotProductAttention(config, *args, **kwargs)


def check_sdpa_config(config) -> None:
    """What SdpaDotProductAttention refuses (config/refusals.py, the sdpa check): say the fix where the config is
    first seen."""
    refuse("sdpa", config, "SdpaDotProductAttention")


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


def _no_kernel(err: RuntimeError) -> bool:
    """torch's errors for a kernel set that cannot run a call (no viable backend / no available kernel)."""
    text = str(err).lower()
    return "no viable backend" in text or "no available kernel" in text


class SdpaDotProductAttention(MegatronModule):
    """DotProductAttention's contract on scaled_dot_product_attention; drop-in for `core_attention`."""

    def __new__(cls, config, *args, **kwargs):
        why = unsupported_by_ours(config)
        if why is not None:  # equal to stock rather than refused: Megatron's own module implements it
            kwargs.pop("kernels", None)  # ours (the spec's), not DotProductAttention's
            return megatron_instead(cls.__name__, why, config, *args, **kwargs)
        return super().__new__(cls)

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
        which = self.kernels or "of torch's choice"
        _LOGGED(("built", self.kernels), f"core attention: SdpaDotProductAttention, SDPA kernels {which} (stock's "
                 f"local spec runs Megatron's DotProductAttention, which rounds 16-bit types differently; "
                 f"attention.core megatron keeps it)")

    def _rng(self):
        """DotProductAttention's dropout RNG: the tracker's fork without SP (under SP the block forks)."""
        if not (self.training and self.dropout_p > 0) or self.config.sequence_parallel:
            return contextlib.nullcontext()
        return tensor_parallel.get_cuda_rng_tracker().fork()

    def _sdpa(self, q, k, v, keep, causal: bool):
        """q [b, np, sq, hn], k / v [b, ng|np, sk, hn], keep [.., sq, sk] True = attend -> [b, np, sq, hn]."""
        p = self.dropout_p if self.training else 0.0
        call = functools.partial(F.scaled_dot_product_attention, q, k, v, attn_mask=keep, dropout_p=p,
                                 is_causal=causal, scale=self.softmax_scale, enable_gqa=k.shape[1] != q.shape[1])
        with self._rng():
            if self.kernels is None:
                return call()
            try:
                with sdpa_kernel([KERNELS[n] for n in self.kernels]):
                    return call()
            except RuntimeError as err:
                if not _no_kernel(err):
                    raise
                self._no_kernel_here(q.device, err)
            with sdpa_kernel([SDPBackend.MATH]):
                return call()

    def _no_kernel_here(self, device, err) -> None:
        """CPU (the GPU's stand-in): math runs, logged once. CUDA: the choices that can run."""
        if device.type != "cpu":
            raise ValueError(f"SdpaDotProductAttention: SDPA kernels {self.kernels} cannot run this call on "
                             f"{device} ({err}); choose --attention-backend auto (torch picks a kernel that can) or "
                             f"unfused (SDPA's math kernel), or attention.core megatron (Megatron's own core "
                             f"attention)") from err
        _LOGGED(("cpu", self.kernels), f"SdpaDotProductAttention: SDPA kernels {self.kernels} have no CPU "
                 f"implementation for this call ({str(err).splitlines()[0]}); the math kernel runs (on a GPU the "
                 f"requested kernel does)")

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


def _backend_name(backend) -> str:
    """Megatron's AttnBackend (or its name; None: Megatron's default, auto) -> its name, checked."""
    name = "auto" if backend is None else getattr(backend, "name", backend)  # AttnBackend.flash or "flash"
    if name != "local" and name not in BACKEND_KERNELS:
        raise ValueError(f"core_attention_for: unknown attention backend {backend!r}; choose one of "
                         f"{('local', *BACKEND_KERNELS)} (Megatron's --attention-backend)")
    return name


def _te_attention():
    from megatron.core.extensions import transformer_engine as te_ext

    return te_ext.TEDotProductAttention if te_ext.HAVE_TE else None


def stock_core_attention(backend="auto", transformer_impl="local"):
    """The core attention stock Megatron builds: TEDotProductAttention in Transformer Engine's spec
    (--transformer-impl transformer_engine, TE installed), DotProductAttention in the local spec and for
    --attention-backend local (GPTModelBuilder puts it into any layer spec)."""
    te = _te_attention() if transformer_impl == "transformer_engine" else None
    return te if te is not None and _backend_name(backend) != "local" else DotProductAttention


def core_attention_for(core: str = "auto", backend="auto", transformer_impl="local"):
    """attention.core x --attention-backend x --transformer-impl -> the core_attention class or ModuleSpec
    (the module docstring's table)."""
    if core not in CORE_ATTENTIONS:
        raise ValueError(f"core_attention_for: attention.core {core!r}: choose one of {CORE_ATTENTIONS}")
    name = _backend_name(backend)
    stock = stock_core_attention(name, transformer_impl)
    if core == "sdpa" and name == "local":
        raise ValueError("attention.core sdpa and --attention-backend local ask for different core attentions "
                         "(SdpaDotProductAttention, Megatron's DotProductAttention); drop one of them")
    if core == "megatron" or (core == "auto" and (stock is not DotProductAttention or name not in SDPA_BACKENDS)):
        return stock
    kernels = BACKEND_KERNELS[name]
    return SdpaDotProductAttention if kernels is None else ModuleSpec(module=SdpaDotProductAttention,
                                                                      params={"kernels": kernels})
