"""Tier 2 (2 gloo processes): `force_reference()` reaches every public operator.

For each operator, a call with a fused algo inside `force_reference()` must issue the stock collective(s)
and no point-to-point send/recv (testing.profile.comm_ops), exactly as algo="reference" does, and give
bitwise its outputs (the same code path: no tolerance). The same call outside the block must use
send/recv, so the check can fail.
"""
import pytest

from megatron_flashoverlap.ops.registry import ALLOWED

STOCK = {  # op -> the stock collectives its reference issues (forward and backward)
    "all_gather_matmul": {"all_gather", "reduce_scatter"},
    "matmul_reduce_scatter": {"reduce_scatter", "all_gather"},
    "matmul_all_reduce": {"all_reduce"},
    "matmul_all_reduce_decode": {"all_reduce"},
    "matmul_allreduce_dgrad": {"all_reduce"},
    "all_reduce": {"all_reduce"},
    "query_split_attention": {"reduce_scatter", "all_gather"},
    "ulysses_attention": {"all_to_all"},
    "ulysses_fused_attention": {"all_to_all"},
    "matmul_wgrad_reduce_scatter": {"reduce_scatter"},
    "expert_all_to_all": {"all_to_all"},
}
P2P = ("send", "recv")


def test_every_public_operator_is_covered():
    assert set(ALLOWED) <= set(STOCK)


@pytest.mark.parametrize("op", sorted(STOCK))
def test_forced_call_runs_the_reference(pools, op):
    for r in pools(2).run("tests.gloo.mp_force_reference:case", op):
        assert all(r["free"].get(k, 0) > 0 for k in P2P), f"unforced {op} used no send/recv: {r['free']}"
        for kind in ("forced", "reference"):
            counts = r[kind]
            assert not any(counts.get(k, 0) for k in P2P), f"{kind} {op} used send/recv: {counts}"
            assert all(counts.get(k, 0) > 0 for k in STOCK[op]), f"{kind} {op}: {counts}, wanted {STOCK[op]}"
        assert r["same_as_reference"], f"forced {op} differs from algo='reference'"
