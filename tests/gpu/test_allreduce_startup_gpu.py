"""Tier 4 (CUDA only): the decode all-reduce's measurement (ops/all_reduce/choose.py decode_pick) on CUDA
tensors, on torch's fake process group (P = 4 as 2 nodes x 2; every transfer completes at once, so the times
mean nothing and the test asserts none): it times every candidate of the layout with CUDA events (one decision
with a median per candidate), and once the bucket is decided, a decode-shaped auto call runs without a host sync
under torch.cuda.set_sync_debug_mode("error").
"""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (tier 4: GPU only)")


def test_decode_measurement_on_cuda_then_no_host_sync(monkeypatch):
    import megatron_flashoverlap as fo
    from benchmarks.gpu_check.ops import fake_group, first_sync
    from megatron_flashoverlap.ops.all_reduce import choose
    from megatron_flashoverlap.plan.chooser import chooser_of
    from tests.support.chooser import active

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with fake_group(4, rank=1), active() as cfg:
        ctx = fo.OverlapContext(check_peers=False)
        x = torch.randn(1, 4, 1024, device="cuda", dtype=torch.bfloat16)
        fo.all_reduce(x, algo="auto", context=ctx)  # measures here: CUDA events, one sync after the last round
        (key, choice), = chooser_of(cfg).decided.items()
        assert key.word == "all_reduce/decode/4" and choice.source == "measured"
        assert sorted(dict(choice.medians_us)) == sorted(choose.candidates(4, 2))
        assert first_sync(lambda: fo.all_reduce(x, algo="auto", context=ctx)) is None
