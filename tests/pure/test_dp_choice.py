"""Tier: pure. The one DP cost model (plan/dp.py) as the automatic DP-fusion choice feeds it (per-element rates
measured on the group), checked against timelines worked out by hand (no processes, no torch)."""
import pytest

from megatron_flashoverlap.plan import dp
from megatron_flashoverlap.plan.dp import Link, Rates


def simulate(params, fused, bucket_size, rates, asynchronous=False):
    return dp.simulate(rates.grads(params), fused, bucket_size, rates.link(), asynchronous)


def choose(params, bucket_size, rates, asynchronous=False):
    return dp.choose(rates.grads(params), bucket_size, rates.link(), asynchronous)


def worker_pays(params, bucket_size, rates):
    return dp.worker_pays(rates.grads(params), bucket_size, rates.link(), rates.ring_lat_s)

# exact float comparisons are fine below: every time is a small integer count of 1.0-second units


def _layers(n, weight=10):
    """n layers of one linear weight + one norm each, in backward order (last layer first): (numel, linear)."""
    return [p for _ in range(n) for p in ((weight, True), (1, False))]


def test_one_bucket_exposes_all_of_its_communication():
    # 3 layers, bucket holds all: compute 3 x 2 x 10 = 60; RS of 33 elements starts at 60, lasts 33
    out = simulate(_layers(3), set(), None, Rates(comm_s=1.0, ring_s=1.0, gemm_s=1.0))
    assert (out.compute, out.exposed, out.step) == (60.0, 33.0, 93.0)


def test_small_buckets_hide_all_but_the_last():
    # bucket_size 11: buckets [w, n] per layer; bucket i ready at 20 i, 11 long: the link keeps up; only the
    # last (ready at 60) is exposed
    out = simulate(_layers(3), set(), 11, Rates(comm_s=1.0, ring_s=1.0, gemm_s=1.0))
    assert (out.compute, out.exposed) == (60.0, 11.0)


def test_a_fused_ring_hides_under_its_own_wgrad_and_waits_for_a_busy_link():
    rates = Rates(comm_s=1.0, ring_s=1.0, gemm_s=1.0)
    # fuse the first layer's weight (index 4, reduced last): buckets [w2 n2] ready 20 (runs 20-31), [w1 n1]
    # ready 40 (40-51); layer 0's dgrad ends at 50, the link is busy to 51, so its ring runs 51-61; the wgrad
    # ends at 60 without waiting (its one hop is the deferred last hop); the last bucket [n0] (1 element)
    # runs 61-62
    out = simulate(_layers(3), {4}, 11, rates)
    assert (out.compute, out.exposed) == (60.0, 2.0)


def test_choose_fuses_only_the_last_bucket_where_stock_hides_the_rest():
    # comm 100x cheaper than compute: stock exposes 0.11 s; fusing layer 0's weight trades 0.1 of it for a
    # ring that hides fully under its wgrad (0.1 <= 10): still better, so k = 1; never more than the tail
    k, best, stock = choose(_layers(3), 11, Rates(comm_s=0.01, ring_s=0.01, gemm_s=1.0))
    assert k == 1 and best.step < stock.step


def test_choose_fuses_the_tail_when_the_link_is_the_bottleneck():
    # stock's collective 2 s per element (each layer's 22 > its 20 of backward): buckets run 20-42, 42-64,
    # 64-86, 86-108: 28 exposed. Our ring at 1 s per element (10 s, one hop): fusing all 4, each ring runs
    # under its wgrad, compute 80, the norms' bucket (4 elements) 80-88: step 88. Fusing layers 1 and 0 only:
    # [w3 n3] 20-42, [w2 n2] 42-64; layer 1's ring waits for the link (64-74), layer 0's dgrad (60-70)
    # then waits on that ring's last hop (to 74), its ring 74-84 under its wgrad (74-84); [n1 n0] 84-88:
    # also 88, and a tie goes to the smaller k
    k, best, stock = choose(_layers(4), 11, Rates(comm_s=2.0, ring_s=1.0, gemm_s=1.0))
    assert (k, best.step, best.compute, stock.step, stock.exposed, best.exposed) == (2, 88.0, 84.0, 108.0, 28.0, 4.0)
    assert simulate(_layers(4), {0, 2, 4, 6}, 11, Rates(comm_s=2.0, ring_s=1.0, gemm_s=1.0)).step == 88.0


def test_a_ring_slower_than_its_wgrad_holds_the_next_layer_not_its_own():
    # ring 2 s per element (20 s), one hop, deferred: layer 3's ring 10-30 (wgrad to 20); layer 2's dgrad
    # ends at 30, its ring's wait is over, ring 30-50 (wgrad to 40); layer 1: dgrad 40-50, ring 50-70; layer
    # 0: dgrad 60-70, ring 70-90, wgrad to 80; the norms' bucket 90-98: compute 80, exposed 18, step 98 < 108
    rates = Rates(comm_s=2.0, ring_s=2.0, gemm_s=1.0)
    out = simulate(_layers(4), {0, 2, 4, 6}, 11, rates)
    assert (out.compute, out.exposed) == (80.0, 18.0)
    assert choose(_layers(4), 11, rates)[0] == 4


def test_the_hops_before_the_last_are_waited_in_the_wgrad():
    # 3 ranks (2 hops), ring 3 s per element (30 s): the first hop (15 s) is waited in the wgrad: layer 3:
    # dgrad 0-10, ring 10-40, wgrad waits to 25; layer 2: dgrad 25-35, waits on layer 3's last hop to 40,
    # ring 40-70, first hop to 55; layer 1: dgrad 55-65, wait to 70, ring 70-100, to 85; layer 0: dgrad 85-95,
    # wait to 100, ring 100-130, to 115; norms 130-138: worse than stock's 108, so nothing is fused
    rates = Rates(comm_s=2.0, ring_s=3.0, gemm_s=1.0, hops=2)
    out = simulate(_layers(4), {0, 2, 4, 6}, 11, rates)
    assert (out.compute, out.exposed) == (115.0, 23.0)
    assert choose(_layers(4), 11, rates)[0] == 0
    with pytest.raises(ValueError, match="hops"):
        Rates(comm_s=1.0, ring_s=1.0, gemm_s=1.0, hops=0)
    with pytest.raises(ValueError, match="hops"):
        Link(lambda n: 0.0, hops=0)


def test_choose_keeps_stock_where_fusing_cannot_help():
    # no linear candidates: k = 0 and the stock outcome
    params = [(5, False), (5, False)]  # (numel, a TP linear's weight)
    k, best, stock = choose(params, None, Rates(1.0, 1.0, 1.0))
    assert k == 0 and best == stock and dp.tail_candidates(Rates(1.0, 1.0, 1.0).grads(params)) == []


def test_rates_must_be_non_negative():
    with pytest.raises(ValueError, match=">= 0"):
        Rates(comm_s=-1.0, ring_s=1.0, gemm_s=1.0)


def test_the_ring_latency_keeps_small_weights_stock():
    # stock exposes its last bucket [w0 n0] (0.11 s). Fusing w0 at 5 s a call: its ring (50-55.1) hides under
    # its wgrad (50-60), the [n0] bucket exposes 0.01: 60.01 < 60.11, k = 1. At 50 s a call: 100.1, k = 0
    k_fast = choose(_layers(3), 11, Rates(comm_s=0.01, ring_s=0.01, gemm_s=1.0, ring_lat_s=5.0))[0]
    k_slow = choose(_layers(3), 11, Rates(comm_s=0.01, ring_s=0.01, gemm_s=1.0, ring_lat_s=50.0))[0]
    assert (k_fast, k_slow) == (1, 0)


def test_an_asynchronous_ring_does_not_stall_the_backward():
    # the rings of test_a_ring_slower_than_its_wgrad... : off the compute thread the backward ends at
    # 80; the rings of layers 3..0 start after their dgrads (10, 30, 50, 70) and queue on the link: 10-30,
    # 30-50, 50-70, 70-90, then the norms' bucket 90-98: exposed 18 (stock: 28)
    rates = Rates(comm_s=2.0, ring_s=2.0, gemm_s=1.0)
    out = simulate(_layers(4), {0, 2, 4, 6}, 11, rates, asynchronous=True)
    assert (out.compute, out.exposed) == (80.0, 18.0)
    assert choose(_layers(4), 11, rates, asynchronous=True)[0] == 4


def test_the_worker_only_where_rings_in_backward_would_stall():
    # comm 100x cheaper than compute (test_choose_fuses_only_the_last_bucket_...): layer 0's ring (0.1 s) hides
    # under its 10-s wgrad in backward as on the worker, both model 80.01: a tie goes to the backward (the
    # worker's own host time is not in the model). Ring at 2 s per element, one hop: in backward the deferred
    # last hop holds only the next layer, 98 as on the worker (test_a_ring_slower_...): no worker. With 3
    # hops the first two (13.3 s) are waited in each 10-s wgrad: the best in backward is stock's 108, the
    # worker's 98: it pays
    fast = Rates(comm_s=0.01, ring_s=0.01, gemm_s=1.0)
    assert choose(_layers(4), 11, fast, True)[1].step == choose(_layers(4), 11, fast, False)[1].step
    assert not worker_pays(_layers(4), 11, fast)
    slow = Rates(comm_s=2.0, ring_s=2.0, gemm_s=1.0)
    assert (choose(_layers(4), 11, slow, True)[1].step, choose(_layers(4), 11, slow, False)[1].step) == (98.0, 98.0)
    assert not worker_pays(_layers(4), 11, slow)
    hops = Rates(comm_s=2.0, ring_s=2.0, gemm_s=1.0, hops=3)
    assert (choose(_layers(4), 11, hops, True)[1].step, choose(_layers(4), 11, hops, False)[1].step) == (98.0, 108.0)
    assert worker_pays(_layers(4), 11, hops)
