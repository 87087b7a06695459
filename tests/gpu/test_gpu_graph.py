"""Tier 4 (CUDA only): one Flash MLP layer forward (all_gather_matmul, gelu, matmul_reduce_scatter) is
captured in a CUDA graph on the fake process group and its replay gives eager's bits, for the captured
input and for new values copied into the static input.

Exact (no tolerance): replay runs the same kernels on the same buffers as eager. The fake group's receives
write nothing, so both read the same stale receive buffers; NaN/inf there are mapped alike (nan_to_num).
"""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (tier 4: GPU only)")


@pytest.mark.parametrize("p", [2, 4])
def test_layer_forward_captures_and_replays(p):
    import megatron_flashoverlap as fo
    from benchmarks.gpu_check.ops import fake_group, layer_forward

    with fake_group(p, rank=p - 1):
        xs, forward = layer_forward(p, "cuda", torch.bfloat16, fo.OverlapContext(check_peers=False), 512 * p, 256)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                forward()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = forward()
        for trial in range(2):
            if trial:
                xs.copy_(torch.randn_like(xs))
            graph.replay()
            eager = forward()
            torch.cuda.synchronize()
            assert y.shape == (512, 1, 256)
            assert torch.equal(torch.nan_to_num(y), torch.nan_to_num(eager)), trial
