"""The planner's performance model, checked against numbers derived by hand.

Tier: pure (no processes; seconds). Most cases use a machine built to make the arithmetic exact: a GEMM that
costs `UNIT` seconds per row (so slices add up to the whole GEMM), no kernel overhead, free adds, no
contention, and links whose hop costs a stated latency plus bytes / bandwidth. Every expected value is worked
out in the comment beside it; comparisons allow 1e-9 relative (float sums of a few terms).
"""
import math

import pytest

from megatron_flashoverlap.plan import collectives, ops
from megatron_flashoverlap.plan.gemm import GemmModel, tile_utilisation
from megatron_flashoverlap.plan.hardware import Cluster, Gpu, Link
from megatron_flashoverlap.plan.links import Group, place
from megatron_flashoverlap.plan.price import Env
from megatron_flashoverlap.plan.walk import stretch

UNIT = 1e-6  # seconds per GEMM row in the row-linear model
GPU = Gpu("test", {"bf16": 1000.0}, hbm_gbps=1e9, sms=100, gemm_efficiency=1.0, kernel_us=0.0)


class RowsGemm(GemmModel):
    """time = UNIT x rows: linear in m, so any row slicing sums to the whole GEMM."""

    def time(self, m, k, n):
        return UNIT * m if m > 0 else 0.0

    def elementwise(self, nbytes, passes=3.0):
        return 0.0


class FlopsGemm(RowsGemm):
    """time = 1e-15 s per multiply-add: linear in every dimension, so every slicing (rows of dgrad, the K of
    wgrad) sums to the whole GEMM."""

    def time(self, m, k, n):
        return 1e-15 * m * k * n if min(m, k, n) > 0 else 0.0


def link(p2p_us: float, gbps: float = 1e9, name: str = "l") -> Link:
    return Link(name, gbps, 1.0, 1.0, (0.0, 0.0, 0.0), (1.0, 1.0, 1.0), p2p_us)


def env(p2p_us: float = 0.0, gbps: float = 1e9, slowdown: float = 0.0, gpn: int = 8, nodes: int = 1,
        gemm=RowsGemm) -> Env:
    cluster = Cluster(GPU, link(p2p_us, gbps), link(p2p_us, gbps, "inter"), gpn, nodes, gpn, slowdown)
    return Env(cluster, "bf16", gemm(GPU, "bf16"))


def close(a, b):
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-15)


def test_p2_flash_on_a_free_link_is_the_gemm():
    # P=2, zero latency, (almost) infinite bandwidth: slice 0 (local) then slice 1 (arrived at once)
    e = env(p2p_us=0.0, gbps=1e12)
    t = ops.column_fwd(e, Group(2, 2), 4096, 1024, 2048)
    assert close(t.times["flash:1"], t.compute)  # = UNIT * 4096, the whole GEMM
    assert close(t.compute, UNIT * 4096)


@pytest.mark.parametrize("fn", [ops.column_fwd, ops.row_fwd])
def test_no_exposure_when_a_hop_is_shorter_than_a_slice(fn):
    # P=4, M=4000: a slice is 1000 rows = 1 ms; a hop costs 100 us latency (+ ~0 bytes): hidden under each slice
    e = env(p2p_us=100.0, gbps=1e12)
    t = fn(e, Group(4, 4), 4000, 512, 512)
    assert close(t.times["flash:1"], t.compute)  # exposed = 0: the walk ends with the compute
    assert close(t.compute, 4e-3)


def test_link_bound_ring_by_hand_and_the_bound():
    # P=4, slice 1 ms (1000 rows), hop 3 ms. AG, step i posts hop i+1 at its start (right after step i-1's wait):
    # step 0: hop 1 in [0,3], slice 0 in [0,1], wait -> 3; step 1: hop 2 in [3,6], slice 1 in [3,4], wait -> 6;
    # step 2: hop 3 in [6,9], slice 2, wait -> 9; step 3: slice 3 in [9,10] -> 10 ms: the hops back to back plus
    # the last slice, which is the bound max(C = 4, ring 9 + slice 1) = 10 ms
    e = env(p2p_us=3000.0, gbps=1e12)
    t = ops.column_fwd(e, Group(4, 4), 4000, 512, 512)
    assert close(t.times["flash:1"], 10e-3)
    assert close(t.bound, 10e-3)
    # RS: block 0 made in [0,1]; its hop posted at step 1 (t=1) ends 4 while block 1 is made; the arrival is
    # waited at step 1's end (4); hops end 7 and 10 -> 10 ms, the first slice plus three hops
    r = ops.row_fwd(e, Group(4, 4), 4000, 512, 512)
    assert close(r.times["flash:1"], 10e-3)


def test_reference_and_slicing_by_hand():
    # stock AG: NCCL ring, one step latency 1 us per step (P-1 = 3), bytes ~0 -> 3 us, then the GEMM (4 ms)
    e = env(p2p_us=0.0, gbps=1e12)
    t = ops.column_fwd(e, Group(4, 4), 4000, 512, 512)
    assert close(t.times["reference"], 3e-6 + 4e-3)
    # slicing k=2: gathers of 3 us each run one after another; chunk 0 (2 ms) after 3 us, chunk 1 after it
    assert close(t.times["slicing:2"], 3e-6 + 4e-3)
    # GEMM + RS: the GEMM, then the RS (3 us)
    r = ops.row_fwd(e, Group(4, 4), 4000, 512, 512)
    assert close(r.times["reference"], 4e-3 + 3e-6)
    # slicing k=4: RS of chunk j runs under chunk j+1; the last RS (3 us) is the tail
    assert close(r.times["slicing:4"], 4e-3 + 3e-6)


@pytest.mark.parametrize("p", [2, 4, 8])
def test_flash_never_slower_than_stock_where_a_hop_costs_no_more_than_nccls_step(p):
    # our hop = 1 us latency + bytes/bw, NCCL's ring = 1 us per step + the same bytes: with a linear GEMM and no
    # contention, flash <= max(C, ring + C/P) <= ring + C <= stock, for any shape
    e = env(p2p_us=1.0, gbps=50.0, gemm=FlopsGemm)
    for m, k, n in ((8192, 4096, 4096), (1024, 8192, 1024), (64 * p, 128, 8192)):
        for fn in (ops.column_fwd, ops.row_fwd, ops.row_bwd):  # (the column backward's stock overlaps: not here)
            t = fn(e, Group(p, p), m, k, n)
            assert t.time("flash") <= t.time("reference") * (1 + 1e-12), (fn.__name__, m, k, n)


def test_hop_subchunks_walk_by_hand():
    # P=2, c=2: step 0 computes both local sub-chunks (2 x 1 ms) and posts sub-chunks 0 and 1 (one after the
    # other on the one comm stream: 3 ms each, ending 3 and 6); step 0 waits sub-chunk 0 -> t = max(2, 3) = 3;
    # step 1 computes it (1 ms) -> 4, waits sub-chunk 1 -> 6; step 2 computes it -> 7 ms
    e = env(p2p_us=3000.0, gbps=1e12)
    t = ops.column_fwd(e, Group(2, 2), 4000, 512, 512)
    assert close(t.times["flash:2"], 7e-3)
    # c=1: slice 0 (2 ms) under the hop (3 ms), slice 1 (2 ms) -> 5 ms
    assert close(t.times["flash:1"], 5e-3)


def test_contention_stretches_compute_only_while_a_transfer_runs():
    # 2 s of work from t=0, a transfer busy in [0, 1], slowdown 1.0: the first second does 0.5 of work,
    # the remaining 1.5 runs at full speed -> ends at 2.5
    assert stretch(0.0, 2.0, [(0.0, 1.0)], 1.0) == 2.5
    assert stretch(0.0, 2.0, [(3.0, 4.0)], 1.0) == 2.0  # the transfer comes after: no effect
    # slowdown in the walk: P=2, hop 1 ms beside slice 0 (2 ms), slowdown 1.0: slice 0 ends at 0.5 + 1.5 = ...
    e = env(p2p_us=1000.0, gbps=1e12, slowdown=1.0)
    t = ops.column_fwd(e, Group(2, 2), 4000, 512, 512)
    # slice 0: 1 ms of wall (0.5 work) under the hop, then 1.5 ms -> 2.5 ms; slice 1: 2 ms -> 4.5 ms
    assert close(t.times["flash:1"], 4.5e-3)


@pytest.mark.parametrize("g, n, hops", [(4, 4, 2 * 3 + 2), (8, 2, 2 * 7 + 1), (4, 3, 2 * 3 + 1 + 2)])
def test_hierarchical_all_reduce_latency_terms(g, n, hops):
    # every hop costs 1 us (both levels), bytes ~0, adds free: hierarchical = 2(G-1) intra + log2(N') inter
    # (+2 for the fold of a non-power-of-two N); the flat ring = 2(NG-1) hops
    e = env(p2p_us=1.0, gbps=1e12, gpn=g, nodes=n)
    t = collectives.all_reduce(e, Group(g * n, g, 1), 1024)
    assert close(t.times["flash:hierarchical"], hops * 1e-6)
    assert close(t.times["flash:ring"], 2 * (g * n - 1) * 1e-6)


def test_wave_quantisation_makes_slices_slower():
    # 132 SMs. A 4096 x 6144 GEMM: 128x256 tiles, 768 of them = 5.8 waves -> 6: 768/792 (the best shape).
    # A 512-row slice: 128x256 -> 96 tiles in one wave of 132 (0.727); 64x128 (rate 0.8) -> 384 tiles in 3 waves
    # of 132: 0.8 x 384/396 = 0.776, the best; 128x128 (0.92) -> 192 tiles, 2 waves: 0.92 x 192/264 = 0.669
    assert tile_utilisation(4096, 6144, 132) == pytest.approx(768 / 792)
    assert tile_utilisation(512, 6144, 132) == pytest.approx(0.8 * 384 / 396)


def test_groups_are_placed_in_megatrons_rank_order():
    c = env(gpn=8, nodes=4).cluster
    assert place(8, 1, c) == Group(8, 8, 1)  # TP 8: one node
    assert place(4, 8, c) == Group(4, 1, 8)  # DP over nodes, 8 apart: one per node, 8 groups per node
    assert place(8, 2, c) == Group(8, 4, 2)  # 2 apart: 4 per node, 2 groups per node
    with pytest.raises(ValueError, match="does not tile"):
        place(3, 4, c)  # 4 apart: 2 per node, but 3 members


def test_a_stock_call_is_the_kernel_plus_the_call_and_nvls_moves_its_first_bytes_at_the_mid_rate():
    # one node of 4, 100 GB/s, NCCL's ring at 0.1 of it (so NVLS wins), NVLS at 0.5 of the link over the first
    # R = links.NVLS_RAMP_BYTES and at 1.0 after; a message of 2R: 25 us + 2 (P-1)/P x (R / 0.5 + R / 1.0) / 100 GB/s
    from megatron_flashoverlap.plan import links
    from megatron_flashoverlap.plan.links import Net
    lk = Link("l", 100.0, 0.1, 0.1, (0.0, 0.0, 0.0), (0.0, 0.0, 0.0), 1.0, nvls_efficiency=1.0,
              nvls_mid_efficiency=0.5, call_us=2.0)
    net, g, r = Net(Cluster(GPU, lk, lk, 4, 1)), Group(4, 4), links.NVLS_RAMP_BYTES
    assert close(net.kernel("all_reduce", 2 * r, g), 25e-6 + 1.5 * (r / 0.5 + r) / 100e9)
    assert close(net.collective("all_reduce", 2 * r, g), net.kernel("all_reduce", 2 * r, g) + 2e-6)
    assert close(net.kernel("all_reduce", r, g), 25e-6 + 1.5 * (r / 0.5) / 100e9)  # within the ramp: mid rate
    assert net.collective("all_reduce", 2 * r, Group(1, 1)) == 0.0  # a group of one calls nothing


def test_a_post_queued_behind_a_transfer_in_flight_hides_its_host_part_under_those_bytes():
    """walk.run: a unit's host part (Prices.fixed) overlaps the previous unit's bytes only where it was posted
    while they were in flight; a unit posted after a wait pays host part and bytes in series."""
    from megatron_flashoverlap.plan.walk import Prices, run
    from megatron_flashoverlap.schedules import Slice, Step, Transfer

    def unit(b, lag):
        return Transfer(1, Slice(0, b, 0), lag=lag)
    ahead = [Step(sends=(unit(0, 0),), recvs=(unit(0, 0),)),  # posted, then the next posted before any wait
             Step(sends=(unit(1, 0),), recvs=(unit(1, 0),))]
    # 1 ms host + 4 ms bytes per unit, no compute: step 0 waits its unit (0-5), step 1 posts at 5 -> 10
    waited = run(ahead, Prices(compute=lambda x: 0.0, transfer=lambda s, r: 5e-3, fixed=lambda s, r: 1e-3), 0.0)
    assert math.isclose(waited.t, 10e-3)
    lagged = [Step(sends=(unit(0, 1),), recvs=(unit(0, 1),)),  # waited one step later: unit 1 is posted ahead
              Step(sends=(unit(1, 0),), recvs=(unit(1, 0),))]
    both = run(lagged, Prices(compute=lambda x: 0.0, transfer=lambda s, r: 5e-3, fixed=lambda s, r: 1e-3), 0.0)
    assert math.isclose(both.t, 9e-3)  # unit 1's host part (1-2 ms) under unit 0's bytes (1-5), its bytes 5-9
    serial = run(lagged, Prices(compute=lambda x: 0.0, transfer=lambda s, r: 5e-3), 0.0)
    assert math.isclose(serial.t, 10e-3)  # no host part: the old walk, one unit after the other


def test_a_worker_units_host_part_shares_the_core_with_the_compute_beside_it():
    """walk.run, Prices.worker (a gloo collective on a CPU rank): the post costs the compute stream nothing; with
    compute beside it the host part and the compute share the core at half speed; waited with nothing between,
    the host part runs at full speed. A post_blocks unit charges its host part to the compute stream instead."""
    from megatron_flashoverlap.plan.walk import Prices, run
    from megatron_flashoverlap.schedules import Slice, Step, Transfer

    unit = Transfer(-1, Slice(0, 0, 50), lag=1)
    beside = [Step(sends=(unit,), compute=(Slice(0, 0, 0),)), Step()]  # posted, 3 ms of compute, waited next step

    def prices(worker, compute=3e-3):
        return Prices(compute=lambda x: compute, transfer=lambda s, r: 5e-3, fixed=lambda s, r: 1e-3,
                      post_blocks=True, worker=lambda s, r: worker)
    # worker: host 0-2 ms at half speed, the compute 1 ms of work in it then 2 ms alone: ends 4; bytes 2-6
    assert math.isclose(run(beside, prices(True), 0.0).t, 6e-3)
    # post_blocks: host 0-1 holds the compute (1-4); bytes 1-5
    assert math.isclose(run(beside, prices(False), 0.0).t, 5e-3)
    # compute-bound: 10 ms of compute; worker: 1 ms of it in 0-2, 9 ms after: 11; post_blocks: 1 + 10 = 11
    assert math.isclose(run(beside, prices(True, 10e-3), 0.0).t, 11e-3)
    assert math.isclose(run(beside, prices(False, 10e-3), 0.0).t, 11e-3)
    blocking = [Step(sends=(Transfer(-1, Slice(0, 0, 50), lag=0),)), Step(compute=(Slice(0, 0, 0),))]
    # waited at once: host 0-1 at full speed, bytes 1-5, then 3 ms of compute: 8 either way
    assert math.isclose(run(blocking, prices(True), 0.0).t, 8e-3)
    assert math.isclose(run(blocking, prices(False), 0.0).t, 8e-3)
