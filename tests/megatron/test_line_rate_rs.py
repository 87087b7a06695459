"""Tier: the benchmarks' line-rate reduce-scatter (benchmarks/harness/line_rate_rs.py: stock's reduce-scatters on gloo as
P2P rings, because gloo's moves an all-reduce's bytes) computes what torch's computes, sync, async, averaged,
coalesced as Megatron's bucket groups call it, and stock Megatron trains to the same parameters with it.
Bodies: mp_line_rate_rs.py.

Exactness: at 2 ranks each element is one sum a + b in both (IEEE addition commutes): equal. At 3 ranks the
ring adds in ring order, gloo's all-reduce in its own: 1e-6 relative (fp32, 3 terms)."""
import pytest

BODY = "tests.megatron.mp_line_rate_rs:"


@pytest.mark.parametrize("world", [2, 3])
def test_shim_reduce_scatters_like_torch(pools, world):
    tol = 0.0 if world == 2 else 1e-6
    for r in pools(world).run(BODY + "ops", timeout=120):
        assert r["sync_ret"] is None, "a synchronous call returns None, as torch's"
        assert r["async_type"] == "Handle", "the async call did not take the ring"
        for case in ("sync", "async_sbh", "avg", "coalesced"):
            assert r[case] <= tol, (case, r)
        assert r["cm_works"] == 2, "the coalescing manager must hold both buckets' handles"
        assert r["calls"]["dp_bucket"] == 2 and r["calls"]["other"] == 3, r["calls"]
        assert r["restored"], "torch's and Megatron's functions must come back on exit"


@pytest.mark.parametrize("tp,sp", [(1, False), (2, True)])
def test_stock_megatron_trains_the_same_with_the_ring(pools, tp, sp):
    res = pools(2 * tp).run(BODY + "gpt", tp=tp, sp=sp, timeout=600)
    for r in res:
        assert r["dp"] == 2
        assert r["calls"]["dp_bucket"] >= 2, r["calls"]  # one bucket group, reduced at every step
        if sp:  # SP: the row linears' forward reduce-scatter (mappings) and the column dgrad's (layers)
            assert r["calls"]["other"] > 0, r["calls"]
        diffs = {n: (r["ring"][n] - p).abs().max().item() for n, p in r["native"].items()}
        assert max(diffs.values()) == 0.0, {n: d for n, d in diffs.items() if d}  # 2-rank sums: module doc
        assert r["moved"] > 1e-5
