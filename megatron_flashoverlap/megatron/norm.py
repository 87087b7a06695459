"""Sequence-parallel LayerNorm / RMSNorm for the local spec, without apex or Transformer Engine.

    SequenceParallelNorm(config, hidden_size, eps=1e-5, persist_layer_norm=..., zero_centered_gamma=...,
                         normalization=...)                        Megatron's norm constructor contract
        x [s/tp, b, h] (SP) or [s, b, h] -> y, the same shape; `config.normalization` picks the math:
        "LayerNorm"  y = (x - mean) / sqrt(var + eps) * gamma + beta     params weight [h], bias [h]
        "RMSNorm"    y = x / sqrt(mean(x^2) + eps) * gamma               param  weight [h]
        gamma = weight + 1 with config.layernorm_zero_centered_gamma (weight starts at 0), as apex's
        FusedLayerNorm and TENorm do; else gamma = weight (starts at 1).

Why: the local spec's norm under SP is WrappedTorchNorm, which asserts `not sequence_parallel` unless apex
provides FusedLayerNorm, and RMSNorm has no apex path there, so a Llama-style model cannot build on GPU.
A norm is per token: under SP each rank normalizes its own s/tp tokens with the replicated weight; what
SP needs is the `sequence_parallel` tag on the params, so finalize_model_grads all-reduces their grads
over TP (FusedLayerNorm and TENorm set the same tag). The modules are torch.nn.LayerNorm / RMSNorm
subclasses: the same kernels (bitwise the stock WrappedTorchNorm's output) and the same state_dict and
sharded_state_dict keys, so stock local-spec checkpoints load unchanged.

Where Transformer Engine is installed (import guarded by Megatron's HAVE_TE), the builder returns
Megatron's TENorm instead. Config flags without TE:
    persist_layer_norm          accepted, logged once: it picks apex's persistent kernel (same math);
                                Megatron-LM turns it on by default and FusedLayerNorm drops it silently
                                where the kernel is missing. torch's fused kernel runs here.
    memory_efficient_layer_norm ValueError: an apex-only memory saving (backward from the output).
    normalization "L2Norm"...   ValueError: LayerNorm and RMSNorm only.

`decoder_block_spec(layers, config, vp_stage)`: this pipeline stage's layers of the model's per-layer specs (sliced
as Megatron's get_gpt_decoder_block_spec slices them), with the same norm as the TransformerBlock's final norm (the
block otherwise builds its module-level default, WrappedTorchNorm without TE/apex, which asserts under SP).
"""
from __future__ import annotations

import dataclasses
import logging

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import LayerType
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

from ..config.refusals import refuse
from ..runtime.once import LogOnce

log = logging.getLogger(__name__)
_LOGGED = LogOnce(log)


def _te_norm():
    """Megatron's TENorm where Transformer Engine is importable, else None."""
    from megatron.core.extensions import transformer_engine as te_ext

    return te_ext.TENorm if te_ext.HAVE_TE else None


def check_norm_config(config) -> None:
    """What the torch path does not implement (config/refusals.py, the norm check): say the fix up front."""
    refuse("norm", config, "SequenceParallelNorm")
    if getattr(config, "persist_layer_norm", False):
        _LOGGED("persist", "persist_layer_norm asks for apex's persistent LayerNorm kernel (same math); without "
                    "apex/Transformer Engine torch's fused kernel runs instead")


class _SequenceParallelMixin:
    """Tags params `sequence_parallel` and adds the zero-centered gamma (weight + 1) option."""

    def _setup(self, config) -> None:
        self.zero_centered_gamma = bool(config.layernorm_zero_centered_gamma)
        self.sequence_parallel = bool(config.sequence_parallel)
        self.reset_parameters()
        for p in self.parameters():
            p.sequence_parallel = self.sequence_parallel

    def reset_parameters(self) -> None:
        super().reset_parameters()
        if getattr(self, "zero_centered_gamma", False):
            torch.nn.init.zeros_(self.weight)

    def _gamma(self) -> torch.Tensor:
        return self.weight + 1 if self.zero_centered_gamma else self.weight


class TorchLayerNorm(_SequenceParallelMixin, torch.nn.LayerNorm):
    """x [..., h] -> LayerNorm(x) [..., h]; weight, bias [h] tagged `sequence_parallel`."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__(normalized_shape=hidden_size, eps=eps)
        self._setup(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.normalized_shape, self._gamma(), self.bias, self.eps)


class TorchRMSNorm(_SequenceParallelMixin, torch.nn.RMSNorm):
    """x [..., h] -> RMSNorm(x) [..., h]; weight [h] tagged `sequence_parallel`."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5):
        super().__init__(normalized_shape=hidden_size, eps=eps)
        self._setup(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, self.normalized_shape, self._gamma(), self.eps)


class SequenceParallelNorm:
    """Norm builder for input_layernorm / pre_mlp_layernorm / q,k layernorm / the final norm: TENorm where
    TE is installed, else TorchLayerNorm / TorchRMSNorm by `config.normalization`. As WrappedTorchNorm and
    FusedLayerNorm, the config decides; the keyword arguments are accepted for the shared signature."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm", **kwargs):
        te_norm = _te_norm()
        if te_norm is not None:
            return te_norm(config=config, hidden_size=hidden_size, eps=eps)
        check_norm_config(config)
        norm_cls = TorchRMSNorm if config.normalization == "RMSNorm" else TorchLayerNorm
        return norm_cls(config, hidden_size, eps)


@dataclasses.dataclass
class LayerBlockSpec(TransformerBlockSubmodules):
    """TransformerBlockSubmodules (layer_specs, layer_norm) whose `.submodules` is its `layer`'s (the model's
    first layer spec), so code written for a layer ModuleSpec (Megatron's `--attention-backend local` override
    in its GPT builder, `spec.submodules.self_attention` introspection) keeps working: every layer kind
    (dense, MoE) shares that one self_attention spec and its norms, so such an override reaches every layer."""

    layer: object = None

    @property
    def submodules(self):
        return self.layer.submodules


def stage_layer_ids(config, vp_stage: int | None = None) -> list[int]:
    """0-based ids (in the model) of the decoder layers this pipeline stage builds, sliced as Megatron's
    get_gpt_decoder_block_spec slices: the --pipeline-model-parallel-layout's ids, else Megatron's offset and
    count (--num-layers-in-first/last-pipeline-stage, account_for_embedding/loss, vp_stage). No parallel state
    is read without pipelining."""
    layout = getattr(config, "pipeline_model_parallel_layout", None)
    if config.pipeline_model_parallel_size == 1 and layout is None:
        return list(range(config.num_layers))
    if layout is not None:
        return list(layout.get_layer_id_list(layer_type=LayerType.decoder, vp_stage=vp_stage))
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage)
    return list(range(offset, offset + get_num_layers_to_build(config, vp_stage=vp_stage)))


def decoder_block_spec(layers: list, config, vp_stage: int | None = None) -> LayerBlockSpec:
    """`layers`: one layer spec per decoder layer of the model -> this stage's layers (stage_layer_ids), with
    SequenceParallelNorm as the block's final norm."""
    return LayerBlockSpec(layer_specs=[layers[i] for i in stage_layer_ids(config, vp_stage)],
                          layer_norm=SequenceParallelNorm, layer=layers[0])
