"""Tier 4 (CUDA only): every public operator and one Flash layer on CUDA tensors on torch's fake process
group (P = 2, 4, 8; shapes only, no data exchange): the expected output and gradient shapes and dtypes, and
no host sync in a steady-state forward + backward under torch.cuda.set_sync_debug_mode("error").

The operators run with OverlapContext(check_peers=False): the default peer check reads a small all-gather
on the host, one deliberate sync per call. The fake group cannot show ProcessGroupNCCL's timed wait (a host
poll without a CUDA sync call): benchmarks/gpu_check/run.py part (f) checks host run-ahead on real NCCL.
"""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (tier 4: GPU only)")


@pytest.mark.parametrize("p", [2, 4, 8])
@pytest.mark.parametrize("algo", ["flash", "flash_bidir", "reference"])
def test_every_operator_runs_without_a_host_sync(p, algo):
    import megatron_flashoverlap as fo
    from benchmarks.gpu_check.ops import fake_group, first_sync, flash_layer, operator_calls

    with fake_group(p, rank=p - 1):
        ctx = fo.OverlapContext(check_peers=False)
        calls = operator_calls(p, "cuda", torch.bfloat16, ctx, algo)
        calls["flash_layer"] = flash_layer(p, "cuda", torch.bfloat16, ctx, algo=algo)
        for name, call in calls.items():
            outs = call.fn()  # warm-up: the context's buffers and cuBLAS handles exist from here on
            assert tuple(tuple(o.shape) for o in outs) == tuple(tuple(s) for s in call.shapes), name
            assert all(o.dtype == torch.bfloat16 and o.is_cuda for o in outs), name
            assert first_sync(call.fn) is None, (name, first_sync(call.fn))
