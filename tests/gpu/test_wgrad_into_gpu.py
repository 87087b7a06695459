"""Tier 4 (CUDA only): runtime.numerics.add_wgrad on a GPU, bf16/fp16 slices into an fp32 main_grad.

It must take the out_dtype GEMM (torch.addmm(..., out_dtype=float32, out=into)): in place, no [n, h]
temporary, no fp32 copy of the operands. The CPU path (slice-sized fp32 casts) is covered by
tests/gloo/test_wgrad_into.py.
Tolerance: 1e-5 of max |dW| against float64: cuBLAS multiplies the 16-bit values exactly and sums in
fp32 (a sum of 4096 products; it may split the sum, so not bitwise).
"""
import pytest
import torch

from megatron_flashoverlap.runtime.numerics import _out_dtype_gemm, add_wgrad

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_add_wgrad_accumulates_in_place_without_temporaries(dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    r, n, h = 4096, 1024, 2048  # one slice: [r, n] dy and [r, h] x; the buffer [n, h]
    dy = torch.randn(r, 1, n, generator=g, device="cuda").to(dtype)
    x = torch.randn(r, 1, h, generator=g, device="cuda").to(dtype)
    into = torch.randn(n, h, generator=g, device="cuda")
    base = into.double()
    assert _out_dtype_gemm(dy, into)
    add_wgrad(torch.zeros_like(into), dy, x)  # warm-up: cuBLAS takes its workspace from the allocator once
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    ptr = into.data_ptr()
    add_wgrad(into, dy, x)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - before
    assert into.data_ptr() == ptr and into.dtype == torch.float32
    assert extra < n * h * 2, f"{extra} bytes allocated: add_wgrad made a temporary of the buffer's size"
    dw64 = dy.double().reshape(r, n).t() @ x.double().reshape(r, h)
    err = (into.double() - base - dw64).abs().max().item() / dw64.abs().max().item()
    assert err <= 1e-5, err
