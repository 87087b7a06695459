"""Tier 2 (2 gloo processes): the transport each backend gets, dead peers named at post and at wait time
(never a hang: every job runs under the pool's timeout), a steady state of point-to-point traffic only,
and the context's buffer cap over many sequence lengths."""
import concurrent.futures

import pytest

from tests.support import Pool

BODY = "tests.gloo.mp_transport:"
CHECKED_OPS = 9  # public operators whose first call checks the peers (all_reduce "auto" runs stock: none)


def test_gloo_is_timed_and_fake_is_stream_ordered(pools):
    for r in pools(2).run(BODY + "kinds"):
        assert r == {"gloo": "timed", "fake": "stream", "fake_shape": (4, 1, 3)}


def _on_own_pool(body: str, timeout: float) -> dict:
    """Rank 0's result of `body` on a pool of its own (the cases break subgroups of its workers on purpose)."""
    pool = Pool(2)
    try:
        return pool.run(BODY + body, timeout=timeout)[0]
    finally:
        pool.close()


@pytest.fixture(scope="module")
def own_pools():
    """{body: future of rank 0's result}: the two cases that wait out deadlines run side by side, each on its own
    pool (they mostly sleep)."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        yield {body: pool.submit(_on_own_pool, body, limit) for body, limit in
               (("dead_peers", 180), ("group_timeouts", 120))}


@pytest.fixture(scope="module")
def dead(own_pools):
    return own_pools["dead_peers"].result()


def test_peer_gone_before_post_names_rank_and_step(dead):
    r = dead["post"]
    assert r["kind"] == "lost", r
    assert "step 0" in r["message"] and "posting" in r["message"] and "global rank 1" in r["message"]
    assert "restart" in r["message"] and r["seconds"] < 30


def test_peer_gone_during_wait_is_not_called_a_timeout(dead):
    r = dead["wait"]
    assert r["kind"] == "lost", r
    assert "failed while waiting (not a timeout)" in r["message"] and "global rank 1" in r["message"]
    assert "within" not in r["message"]


def test_absent_peer_times_out_with_its_rank(dead):
    r = dead["timeout"]
    assert r["kind"] == "timeout", r
    assert "did not complete" in r["message"] and "global rank 1" in r["message"] and "restart" in r["message"]
    assert 1.5 < r["seconds"] < 30  # the context's 2 s deadline, not the pool's


@pytest.fixture(scope="module")
def timeouts(own_pools):
    return own_pools["group_timeouts"].result()


def test_our_waits_end_at_the_groups_own_timeout_as_stocks_do(timeouts):
    """init_process_group / new_group(timeout=3 s): stock's all-gather and ours give up at about 3 s; a bound of
    ours only shortens that (60 s does not lengthen it, 1 s shortens it); the error names the group and peer."""
    stock, ours = timeouts["stock"], timeouts["ours"]
    assert stock["kind"] == "stock" and "Timed out" in stock["message"] and 2.5 < stock["seconds"] < 6, stock
    assert ours["kind"] == "timeout" and 2.5 < ours["seconds"] < 6, ours
    assert "CASE_OURS" in ours["message"] and "global rank 1" in ours["message"] and "0:00:03" in ours["message"]
    larger, smaller = timeouts["ours_larger_bound"], timeouts["ours_smaller_bound"]
    assert larger["kind"] == "timeout" and 2.5 < larger["seconds"] < 6, larger
    assert smaller["kind"] == "timeout" and 0.8 < smaller["seconds"] < 2.5 and "0:00:01" in smaller["message"]


def test_slicing_baseline_waits_through_the_transport(dead):
    r = dead["slicing_timeout"]
    assert r["kind"] == "timeout", r
    assert "all-gather chunk 0" in r["message"] and r["seconds"] < 30


def test_deferred_last_hop_of_an_absent_peer_times_out_at_finish(dead):
    r = dead["deferred_timeout"]
    assert r["kind"] == "timeout", r
    assert "did not complete" in r["message"] and "global rank 1" in r["message"] and 1.5 < r["seconds"] < 30
    assert r["message"].startswith("matmul_wgrad_reduce_scatter: step 1: "), r  # the operator named at finish()


def test_the_first_peer_error_of_the_process_is_kept(dead):
    """first_peer_error(): the first case's error (a lost peer at post), as raised, operator named."""
    assert dead["first"] == dead["post"]["message"] and dead["first"].startswith("AllGatherMatmul.forward: step 0: ")


@pytest.mark.parametrize("world", [2, 4])
def test_second_call_issues_only_the_operators_traffic(pools, world):
    for r in pools(world).run(BODY + "steady_state_traffic", timeout=300):
        assert r["first"].get("all_gather") == CHECKED_OPS, r["first"]  # one peer check per operator
        assert set(r["second"]) <= {"send", "recv", "all_reduce"}, r["second"]
        assert r["second"].get("all_reduce") == 1 and r["second"]["send"] == r["second"]["recv"] > 0
        assert r["always_second"].get("all_gather") == CHECKED_OPS, r["always_second"]
        assert "all_gather" not in r["never_first"], r["never_first"]


def test_buffers_over_many_lengths_stay_under_the_cap(pools):
    lengths = [2 * k for k in range(10, 75)]  # 65 distinct sequence lengths (multiples of the group size)
    names = 10  # ring slots and receive buffers of AG + RS forward and their backward walks, each <= one shard
    for r in pools(2).run(BODY + "buffer_cap", lengths, 2, 8, 12):
        assert r["held"] <= names * (r["shard"] * 9 / 8 + 64), r  # the cap stated in runtime/context.py


@pytest.mark.parametrize("world", [2, 3])
def test_gloo_posts_run_on_the_communication_thread(pools, world):
    for r in pools(world).run(BODY + "posted_off_thread"):
        assert r == {"deferred": True, "received": True}


def test_two_groups_post_without_blocking_each_other(pools):
    # one FIFO per group (runtime/commthread.py): a held thread of group A leaves group B's hops free, and a ring
    # on each group from two threads at once brings every hop's value (exact: copies, no arithmetic)
    for r in pools(2).run(BODY + "two_groups", timeout=120):
        assert r["stuck"]["kind"] is None and r["stuck"]["seconds"] < 5, r["stuck"]  # not behind A's job (10 s)
        assert r["concurrent"] == {1000: True, 2000: True}, r["concurrent"]
        assert r["threads"] == [True, True]
