"""Tier 4 (CUDA only): the operators' numerics on CUDA tensors at P = 1 (a real NCCL group of one process:
no transfers, every handler and GEMM on the GPU), and the fp32-output GEMM of the reduce-scatter partials.

Tolerances: `partial_linear` / `wgrad` write fp32 straight from bf16 operands, so their error against fp64 is
the fp32 accumulation's (~1e-6 relative), far below one bf16 rounding (2^-9 relative RMS): asserted < 1/10
of the bf16-output GEMM's error. Ring functions at P = 1 round the fp32 partial once to bf16, as cuBLAS does
inside its bf16 GEMM: equal to F.linear within one bf16 ulp (2^-7 relative to the largest output).
"""
import os
import socket

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (tier 4: GPU only)")

BF16_ULP = 2.0 ** -7


@pytest.fixture(scope="module")
def world1():
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield None
    dist.destroy_process_group()


def _rms(a, ref):
    return ((a.double() - ref).pow(2).mean() / ref.pow(2).mean()).sqrt().item()


def _bf16(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) / shape[-1] ** 0.25).to("cuda", torch.bfloat16)


def test_partial_linear_writes_fp32_from_bf16():
    from megatron_flashoverlap.runtime import partial_linear

    x, w = _bf16(64, 2, 512), _bf16(256, 512, seed=1)
    ref = x.double() @ w.double().t()
    y = partial_linear(x, w)
    assert y.dtype == torch.float32 and y.shape == (64, 2, 256)
    assert _rms(y, ref) < 0.1 * _rms(F.linear(x, w), ref)


def test_wgrad_writes_fp32_from_bf16():
    from megatron_flashoverlap.runtime import wgrad

    dy, x = _bf16(64, 2, 128), _bf16(64, 2, 512, seed=1)
    ref = dy.double().reshape(-1, 128).t() @ x.double().reshape(-1, 512)
    dw = wgrad(dy, x)
    assert dw.dtype == torch.float32
    assert _rms(dw, ref) < 0.1 * _rms(torch.mm(dy.reshape(-1, 128).t(), x.reshape(-1, 512)), ref)


@pytest.mark.parametrize("wire", ["input", "fp32"])
@pytest.mark.parametrize("algo", ["flash", "flash_bidir", "slicing", "reference"])
def test_rs_plain_functions_at_p1_match_the_gemm(world1, algo, wire):
    from megatron_flashoverlap import OverlapContext
    from megatron_flashoverlap.ops.registry import OpPlan, plain

    x, w = _bf16(64, 2, 256), _bf16(128, 256, seed=1)
    plan = OpPlan(algo, num_chunks=2 if algo == "slicing" else None, wire_dtype=wire)
    y = plain("matmul_reduce_scatter", algo)(x, w, None, OverlapContext(), plan)
    ref = F.linear(x, w)
    assert y.dtype == torch.bfloat16 and y.is_cuda and y.shape == ref.shape
    assert (y.double() - ref.double()).abs().max().item() <= BF16_ULP * ref.double().abs().max().item()


def test_public_operators_at_p1_are_the_local_gemm(world1):
    import megatron_flashoverlap as fo

    x, w = _bf16(64, 2, 256), _bf16(128, 256, seed=1)
    ref = F.linear(x, w)
    for op in (fo.all_gather_matmul, fo.matmul_reduce_scatter, fo.matmul_all_reduce, fo.matmul_allreduce_dgrad):
        assert torch.equal(op(x, w), ref), op.__name__  # a group of one is the plain GEMM: the same kernel
