"""Tier 4 (CUDA only): the start-up calibration of all_reduce(algo="auto") on CUDA tensors, on torch's fake
process group (P = 4 as 2 nodes x 2; every transfer completes at once, so the times mean nothing and the test
asserts none): it times with CUDA events (table rows for every size and candidate), and once it has measured,
a decode-shaped auto call runs without a host sync under torch.cuda.set_sync_debug_mode("error").
"""
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (tier 4: GPU only)")


def test_startup_calibration_on_cuda_then_no_host_sync(monkeypatch):
    import megatron_flashoverlap as fo
    from benchmarks.gpu_check.ops import fake_group, first_sync
    from megatron_flashoverlap.ops.all_reduce import calibrate, select

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with fake_group(4, rank=1):
        select.set_calibration(None)
        try:
            ctx = fo.OverlapContext(check_peers=False)
            x = torch.randn(1, 4, 1024, device="cuda", dtype=torch.bfloat16)
            fo.all_reduce(x, algo="auto", context=ctx)  # measures here: CUDA events, one sync per size
            t = select.table_for(4, 2, "fake", "bfloat16")
            assert t is not None and [r["bytes"] for r in t["rows"]] == list(calibrate.SIZES)
            for r in t["rows"]:
                assert all(len(r[f"{a}_rounds_us"]) == calibrate.ROUNDS for a in calibrate.candidates(4, 2))
            assert first_sync(lambda: fo.all_reduce(x, algo="auto", context=ctx)) is None
        finally:
            select.set_calibration(None)
