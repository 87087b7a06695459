"""Tier 4 (CUDA only): SdpaDotProductAttention on a GPU runs SDPA's fused kernels and matches Megatron's
DotProductAttention in bf16; SequenceParallelNorm builds under SP. One process, TP=1 over NCCL.

Tolerance: bf16 inputs, 2e-2 of max |reference|: DotProductAttention rounds the probabilities to bf16
before the value GEMM, flash attention keeps them in fp32 (about 2^-8 relative per element).
"""
import os
import socket

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def tp1():
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    torch.cuda.set_device(0)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    model_parallel_cuda_manual_seed(1)
    yield
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _config(**kw):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=512, num_attention_heads=8, num_query_groups=2,
                             bf16=True, params_dtype=torch.bfloat16, attention_dropout=0.0, **kw)


@pytest.mark.parametrize("mask", [False, True], ids=["causal_flash", "padding_efficient"])
def test_sdpa_matches_dpa_in_bf16(tp1, mask):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_flashoverlap.megatron.sdpa import SdpaDotProductAttention

    cfg, s, b = _config(), 256, 2
    kind = AttnMaskType.padding if mask else AttnMaskType.causal
    kw = dict(layer_number=1, attn_mask_type=kind, attention_type="self")
    kernels = ("efficient",) if mask else ("flash",)  # the kernel must exist for this call: no math fallback
    dpa, ours = DotProductAttention(cfg, **kw), SdpaDotProductAttention(cfg, **kw, kernels=kernels)
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(s, b, 8, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(s, b, 2, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    m = None
    if mask:
        m = torch.zeros(b, 1, 1, s, dtype=torch.bool, device="cuda")
        m[1, ..., s // 2:] = True
    ref, got = dpa(q, k, v, m).float(), ours(q, k, v, m).float()
    assert (ref - got).abs().max().item() <= 2e-2 * ref.abs().max().item()


def test_norm_builds_under_sp_on_gpu(tp1):
    from megatron_flashoverlap.megatron.norm import SequenceParallelNorm

    cfg = _config(normalization="RMSNorm", sequence_parallel=False)
    cfg.sequence_parallel = True  # TP=1 here; the norm must not refuse SP (WrappedTorchNorm asserts)
    norm = SequenceParallelNorm(cfg, 512, 1e-5).cuda()
    assert all(p.sequence_parallel for p in norm.parameters())
    x = torch.randn(16, 2, 512, device="cuda")
    assert norm(x).shape == x.shape
