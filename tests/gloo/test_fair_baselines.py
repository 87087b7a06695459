"""Tier 2 (2 gloo processes): every slicing baseline computes as fast as its idea allows, on any input strides.

Not a timed test (a loaded 2-core box makes timings flaky): the kernels each baseline runs are recorded
below autograd (tests/gloo/mp_fair.py) and checked for the property that makes its compute match the
unsplit GEMM: only plain 2-D GEMMs on operands BLAS reads directly, no batched GEMM (the strided
[P, c, b, k/P] chunk of the old reduce-scatter baseline took a bmm path, 605 ms against 45 ms for the same
GEMM on a contiguous copy), FLOPs equal to the unsplit GEMM's (expected from the shapes, 2 s b k n), and
copies of at most the operator's input and output once (linear time, h-times cheaper than the GEMM).
"""
import pytest

OPS = ["all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"]
S, B, K, N = 64, 2, 48, 40  # s b k n: chunks of 64/2/4 = 8 rows x b = 16 GEMM rows per rank-block


@pytest.mark.parametrize("strided", [False, True])
@pytest.mark.parametrize("chunks", [2, 4])
@pytest.mark.parametrize("op", OPS)
def test_slicing_baseline_runs_the_unsplit_gemm_in_pieces(pools, op, chunks, strided):
    for r in pools(2).run("tests.gloo.mp_fair:record", op, S, B, K, N, chunks, strided=strided):
        assert r["batched"] == 0, "a batched GEMM: the chunk's operands were not made contiguous"
        assert r["strided"] == 0, "a GEMM operand BLAS cannot read directly"
        assert r["flops"] == 2 * S * B * K * N, "the pieces' FLOPs must add up to the unsplit GEMM's exactly"
        assert r["copied"] <= S * B * K + S * B * N, "copies beyond the input and output once"
