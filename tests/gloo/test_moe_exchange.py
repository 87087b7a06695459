"""Tier 2 (2-4 gloo processes): the MoE expert-parallel all-to-all-v (ops/moe/exchange.py).

Tolerance: none. The exchange moves rows and sums nothing, so forward and backward are bitwise equal to the
expected blocks (built from the split sizes alone) and to the stock all_to_all_single.
"""
import pytest

BODY = "tests.gloo.mp_moe_exchange"


@pytest.mark.parametrize("p", [2, 3, 4])
@pytest.mark.parametrize("order", ["dispatch", "combine"])
@pytest.mark.parametrize("algo", ["flash", "reference"])
def test_exchange_uneven_splits_exact(pools, p, order, algo):
    for res in pools(p).run(f"{BODY}:exchange", algo, order, seed=p):
        assert res["fwd_equal"], "every row must land in the block of its source rank, in order"
        assert res["grad_equal"], "backward is the reverse exchange: bitwise the reference's"
        if algo == "flash":
            assert "all_to_all" not in res["ops"], res["ops"]
            sends, recvs = res["peers"]  # one P2P op per peer with rows to move: empty blocks are not posted
            assert (res["ops"].get("send", 0), res["ops"].get("recv", 0)) == (sends, recvs), res
        else:
            assert res["ops"].get("all_to_all") == 1 and "send" not in res["ops"], res["ops"]


def test_exchange_zero_rows_everywhere(pools):
    """Every split zero (no rank routed a token to another): nothing is posted, the walk still completes."""
    for res in pools(3).run(f"{BODY}:exchange", "flash", "dispatch", seed=3, zeros="all"):
        assert res["fwd_equal"] and res["grad_equal"] and "send" not in res["ops"]


@pytest.mark.parametrize("p", [2, 4])
def test_dispatch_own_first_combine_own_last(pools, p):
    for rank, res in enumerate(pools(p).run(f"{BODY}:dispatch_order")):
        assert res["used"] == [((rank - s) % p, True) for s in range(p)], "own block first, then r-1, r-2, ..."
        assert res["made"] == [(rank + s) % p for s in range(1, p + 1)], "peers' blocks first, the own block last"


def test_bad_splits_name_the_fix(pools):
    for msg in pools(2).run(f"{BODY}:bad_splits"):
        assert msg is not None and "input_splits" in msg and "sum to" in msg
