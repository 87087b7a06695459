"""Tier 4 (CUDA only): attention dropout on the GPU. Ulysses' seed follows Megatron's RNG rule without a host
sync; query split's drawn mask is torch's fused dropout's draw, applied as that kernel applies it.

On CUDA, Megatron's `get_cuda_rng_tracker().fork()` swaps the CUDA generator only; a seed drawn on the host
would read the CPU generator, the same on every TP rank. One process plays two TP ranks by seeding the
tracker as `model_parallel_cuda_manual_seed(seed, tp_rank=r)` does on rank r.
"""
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _seed_on_tp_rank(tp_rank, sequence_parallel=False):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from megatron_flashoverlap.megatron.attention import UlyssesDotProductAttention

    model_parallel_cuda_manual_seed(1234, tp_rank=tp_rank, ep_rank=0, etp_rank=0)
    config = SimpleNamespace(sequence_parallel=sequence_parallel)
    layer = SimpleNamespace(training=True, dropout_p=0.1, config=config)
    torch.cuda.set_sync_debug_mode("error")  # a host sync raises
    try:
        return UlyssesDotProductAttention._seed(layer)
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_seed_is_a_device_tensor_distinct_per_tp_rank():
    s0, s1, again = _seed_on_tp_rank(0), _seed_on_tp_rank(1), _seed_on_tp_rank(0)
    assert s0.is_cuda and s0.dim() == 0
    assert s0.item() != s1.item()  # the model-parallel RNG differs per TP rank (no SP)
    assert s0.item() == again.item()  # same RNG state, same seed: a recompute reproduces the masks


def test_with_sp_the_seed_follows_the_current_rng():
    assert _seed_on_tp_rank(0, True).item() == _seed_on_tp_rank(1, True).item()  # default RNG: seed on all ranks


def test_keep_mask_on_cuda_is_the_cpu_mask_bit_for_bit_without_a_host_sync():
    # keep_mask hashes in int32 with wrapping products (ops/attention/core.py): one pass on CUDA, tiles on CPU;
    # both must give the documented hash's bits, the CPU's checked against it in tests/megatron
    from megatron_flashoverlap.ops.attention.core import AttnSpec, keep_mask

    seed = torch.tensor(2 ** 40 + 3, dtype=torch.int64, device="cuda")
    spec_gpu, spec_cpu = AttnSpec(scale=1.0, dropout_p=0.1, seed=seed), AttnSpec(scale=1.0, dropout_p=0.1,
                                                                                  seed=2 ** 40 + 3)
    torch.cuda.set_sync_debug_mode("error")  # a host sync raises
    try:
        gpu = keep_mask(spec_gpu, 2, 4, 96, 300, 1000, "cuda")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(gpu.cpu(), keep_mask(spec_cpu, 2, 4, 96, 300, 1000, "cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_a_drawn_mask_is_the_fused_dropouts_draw_and_output_without_a_host_sync(dtype):
    # the reference is F.dropout on CUDA (native_dropout's fused kernel) from the same generator state: its
    # output bit for bit, its gradient, and what the generator gives after it
    from megatron_flashoverlap.ops.attention.core import apply_keep, draw_keep

    p, shape = 0.1, (2, 4, 96, 333)  # 333 keys: rows not a multiple of the kernel's vector width
    probs = torch.rand(shape, device="cuda").to(dtype).requires_grad_()
    grad = torch.rand(shape, device="cuda").to(dtype)
    torch.cuda.manual_seed(5)
    stock = torch.nn.functional.dropout(probs, p, training=True)
    stock_next = torch.rand(7, device="cuda")
    (stock_grad,) = torch.autograd.grad(stock, probs, grad)
    torch.cuda.manual_seed(5)
    torch.cuda.set_sync_debug_mode("error")  # a host sync raises
    try:
        keep = draw_keep(shape, dtype, p, probs.device)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(torch.rand(7, device="cuda"), stock_next)
    ours = apply_keep(probs, keep, p)
    assert torch.equal(ours, stock)
    (ours_grad,) = torch.autograd.grad(ours, probs, grad)
    assert torch.equal(ours_grad, stock_grad)  # native_dropout_backward's grad * mask * scale
