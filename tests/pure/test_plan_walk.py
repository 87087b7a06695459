"""The planner prices the executor's own step lists: a changed schedule changes the price.

Tier: pure (no processes; seconds). The machine is the exact one of test_plan_model.py (a GEMM linear in its
rows, free adds, no contention, hops of a stated latency); expected values are derived in the comments.
"""
import math

from megatron_flashoverlap import schedules as S
from megatron_flashoverlap.plan import baselines, collectives, dp, ops
from megatron_flashoverlap.plan.links import Group
from megatron_flashoverlap.schedules import Step

from .test_plan_model import env


def _local_last(real):
    """all_gather_ring with the local shard's slice moved from step 0 to the end (no longer under hop 1)."""
    def build(rank, world, **kw):
        sched = real(rank, world, **kw)
        first, *rest = sched.steps
        moved = (Step(first.sends, first.recvs, ()),) + tuple(rest[:-1]) + (
            Step(rest[-1].sends, rest[-1].recvs, rest[-1].compute + first.compute),)
        return S.Schedule(sched.kind, sched.rank, sched.world_size, moved, sched.parts, name="local_last",
                          local=sched.local, expected=sched.expected)
    return build


def test_a_changed_schedule_changes_the_price(monkeypatch):
    # P=2, slice 2 ms, hop 3 ms. The executor's ring: slice 0 (local) under the hop, then slice 1: 3 + 2 = 5 ms.
    # With the local slice moved last nothing runs under the hop: 3 + 2 + 2 = 7 ms
    e = env(p2p_us=3000.0, gbps=1e12)
    assert math.isclose(ops.column_fwd(e, Group(2, 2), 4000, 512, 512).times["flash:1"], 5e-3)
    monkeypatch.setattr(S, "all_gather_ring", _local_last(S.all_gather_ring))
    assert math.isclose(ops.column_fwd(e, Group(2, 2), 4000, 512, 512).times["flash:1"], 7e-3)


def test_the_column_backward_walks_the_merged_dgrad_rs_and_wgrad_ag():
    # ops/tp_sp/plain.py walks scatter(tag 0) and gather(tag 1) in ONE merged walk: the planner prices that list
    e = env()
    p = 4
    rings = [ops.RingSide("rs", 4000, lambda r: 0.0, lambda r: 0.0), ops.RingSide("ag", 4000, lambda r: 0.0,
                                                                                 lambda r: 0.0)]
    lists, _ = ops.flash_walk(e, Group(p, p), rings)
    assert lists == [S.merge(S.reduce_scatter_ring(0, p, tag=0), S.all_gather_ring(0, p, tag=1))]


def test_the_decode_all_reduce_walks_schedules_all_reduce_schedule(monkeypatch):
    # 4 nodes x 4: hierarchical = 2(4-1) + log2 4 = 8 hops of 1 us; priced from a ring's steps instead: 2(16-1)
    e = env(p2p_us=1.0, gbps=1e12, gpn=4, nodes=4)
    g = Group(16, 4, 1)
    assert math.isclose(collectives.all_reduce(e, g, 1024).times["flash:hierarchical"], 8e-6)
    real = S.all_reduce_schedule
    monkeypatch.setattr(S, "all_reduce_schedule", lambda algo, r, p, local=None, **kw: real("ring", r, p, **kw))
    assert math.isclose(collectives.all_reduce(e, g, 1024).times["flash:hierarchical"], 30e-6)


def test_the_slicing_baseline_step_lists():
    # consume: step 0 posts k gathers (gather j due at the end of step j), then one GEMM chunk per step
    c = baselines.consume_chunks(3)
    assert [t.lag for t in c[0].sends] == [0, 1, 2] and [len(s.compute) for s in c] == [0, 1, 1, 1]
    # produce: chunk j's reduce-scatter posted at step j+1, every one due at the last step (k)
    p = baselines.produce_chunks(3)
    assert [(i, t.lag) for i, s in enumerate(p) for t in s.sends] == [(1, 2), (2, 1), (3, 0)]


def test_the_last_dp_bucket_is_exposed():
    # two parameters of 1 ms backward each, one bucket: its reduce-scatter (NCCL ring over 4 ranks: 3 steps of
    # 1 us, bytes ~0) starts when the backward ends: exposed = 3 us, the backward unchanged
    e = env(p2p_us=1.0, gbps=1e12)
    params = [dp.Grad("a", 1000, 1e-3), dp.Grad("b", 1000, 1e-3)]
    out = dp.sync(e, Group(4, 4), params, fused=False)
    assert math.isclose(out.exposed, 3e-6) and abs(out.extra) < 1e-15
    # buckets of >= 40M elements: a first parameter that fills one alone closes it, and that bucket's
    # reduce-scatter (3 us) runs under the second parameter's 1 ms: only the last bucket is exposed
    params = [dp.Grad("a", 40_000_000, 1e-3), dp.Grad("b", 1000, 1e-3)]
    assert math.isclose(dp.sync(e, Group(4, 4), params, fused=False).exposed, 3e-6)
