"""Tier 4 (CUDA only): the attention-dropout seed follows Megatron's RNG rule on the GPU, without a host sync.

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
