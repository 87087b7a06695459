"""Tier 1 (no processes): schedules as data, the dry-run validator and the grid printer."""
import pytest

from megatron_flashoverlap.schedules import (
    Schedule, ScheduleError, Slice, Step, Transfer, all_gather_ring, all_to_all_consume, all_to_all_produce,
    grid, merge, reduce_scatter_ring, validate,
)

SIZES = range(1, 9)


def _all(builder, p, **kw):
    return [builder(r, p, **kw) for r in range(p)]


@pytest.mark.parametrize("p", SIZES)
@pytest.mark.parametrize("bidir", [False, True])
def test_rings_validate(p, bidir):
    validate(_all(all_gather_ring, p, bidirectional=bidir))
    validate(_all(reduce_scatter_ring, p, bidirectional=bidir))


@pytest.mark.parametrize("p", SIZES)
def test_all_to_all_validate(p):
    validate(_all(all_to_all_produce, p))
    validate(_all(all_to_all_consume, p))


@pytest.mark.parametrize("p", SIZES)
def test_merged_backward_walk_validates_per_tag(p):
    # the column backward merges the dgrad RS (tag 0) and the wgrad AG (tag 1) into one walk: each tag's part
    # of the merged walk, run on all ranks by the validator, must be a correct ring of its own
    rings = {0: reduce_scatter_ring, 1: all_gather_ring}
    merged = [merge(*(build(r, p, tag=t) for t, build in rings.items())) for r in range(p)]
    for steps in merged:
        assert len(steps) == p
        assert sum(len(s.compute) for s in steps) == 2 * p
    for tag, build in rings.items():
        validate([_tag_only(build(r, p, tag=tag), merged[r], tag) for r in range(p)])


def _tag_only(original: Schedule, steps, tag: int) -> Schedule:
    """The schedule of one tag as the merged walk runs it: its transfers and slices, step by step."""
    def keep(xs, of=lambda x: x.slice):
        return tuple(x for x in xs if of(x).tag == tag)
    mine = tuple(Step(sends=keep(s.sends), recvs=keep(s.recvs), compute=keep(s.compute, lambda x: x))
                 for s in steps)
    return Schedule(**{**original.__dict__, "steps": mine})


@pytest.mark.parametrize("p", SIZES)
def test_rank_adaptive_order(p):
    for r in range(p):
        ag, rs = all_gather_ring(r, p), reduce_scatter_ring(r, p)
        assert ag.steps[0].compute == (Slice(r),)            # local shard first: no wait at the start
        assert not ag.steps[-1].has_comm                      # the last action is a GEMM: no tail
        assert rs.steps[-1].compute == (Slice(r),)            # own block last: its partial never leaves
        assert not rs.steps[0].has_comm
        assert all(len(st.sends) <= 1 for st in ag.steps + rs.steps)  # one hop per step per direction


@pytest.mark.parametrize("p", [2, 3, 5])
def test_bidirectional_halves_travel_both_ways(p):
    s = all_gather_ring(0, p, bidirectional=True)
    peers = {(t.peer, t.slice.part) for st in s.steps for t in st.sends}
    assert peers == {(1 % p, 0), ((0 - 1) % p, 1)}


def _mutate(scheds, rank, step, **changes):
    s = scheds[rank]
    steps = list(s.steps)
    steps[step] = Step(**{**{"sends": steps[step].sends, "recvs": steps[step].recvs,
                             "compute": steps[step].compute}, **changes})
    scheds[rank] = Schedule(**{**s.__dict__, "steps": tuple(steps)})
    return scheds


def test_validator_catches_missing_recv():
    scheds = _mutate(_all(all_gather_ring, 3), 1, 0, recvs=())
    with pytest.raises(ScheduleError, match="unmatched|deadlock|never computes|before it is local"):
        validate(scheds)


def test_validator_catches_deadlock():
    # rank 0 waits for a slice from rank 1 that rank 1 never sends
    scheds = _all(all_gather_ring, 2)
    extra = Transfer(1, Slice(1, 0))
    scheds = _mutate(scheds, 0, 1, recvs=(extra,))
    with pytest.raises(ScheduleError, match="deadlock"):
        validate(scheds)


def test_validator_catches_double_compute():
    scheds = _mutate(_all(all_gather_ring, 3), 0, 2, compute=(Slice(0),))
    with pytest.raises(ScheduleError, match="second time"):
        validate(scheds)


def test_validator_catches_wrong_slice_and_premature_send():
    scheds = _mutate(_all(all_gather_ring, 3), 0, 1, sends=(Transfer(1, Slice(1)),))
    with pytest.raises(ScheduleError):
        validate(scheds)
    rs = _all(reduce_scatter_ring, 3)
    bad = _mutate(rs, 0, 1, compute=rs[0].steps[0].compute)  # never computes block 1, sends 2 early
    with pytest.raises(ScheduleError):
        validate(bad)


def test_validator_catches_double_counted_sum():
    # two ranks swap-and-add twice: each ends with every part counted twice (a set would call it complete)
    def sched(r, rounds):
        x = Slice(0)
        step = Step(sends=(Transfer(1 - r, x),), recvs=(Transfer(1 - r, x),))
        return Schedule("exchange", r, 2, (step,) * rounds, local=(x,), final=(x,))
    validate([sched(0, 1), sched(1, 1)])
    with pytest.raises(ScheduleError, match="exactly once"):
        validate([sched(0, 2), sched(1, 2)])


def test_grid_p4_shows_local_first_and_own_last():
    ag = grid(_all(all_gather_ring, 4)).splitlines()
    rs = grid(_all(reduce_scatter_ring, 4)).splitlines()
    for r in range(4):
        ag_row = ag[2 + r].split()
        rs_row = rs[2 + r]
        assert ag_row[0] == f"r{r}" and ag_row[1] == f"[{r}]"
        assert rs_row.rstrip().split("  ")[-1].strip().startswith(f"[{r}]")


def test_bad_rank():
    with pytest.raises(ValueError, match="not in a group"):
        all_gather_ring(4, 4)


@pytest.mark.parametrize("p", SIZES)
@pytest.mark.parametrize("c", [1, 2, 3, 4])
def test_sub_chunked_rings_validate(p, c):
    validate(_all(all_gather_ring, p, chunks=c))
    validate(_all(reduce_scatter_ring, p, chunks=c))
    for r in range(p):  # the column backward's merged walk: both rings have 1 + (P-1) c steps
        steps = merge(reduce_scatter_ring(r, p, chunks=c, tag=0), all_gather_ring(r, p, chunks=c, tag=1))
        assert len(steps) == 1 + (p - 1) * c


@pytest.mark.parametrize("c", [2, 3, 4])
def test_sub_chunks_at_p2_are_posted_ahead_and_used_as_they_arrive(c):
    ag, rs = all_gather_ring(0, 2, chunks=c), reduce_scatter_ring(0, 2, chunks=c)
    # AG: step 0 multiplies the whole local shard and posts every sub-chunk of the hop, sub-chunk j waited
    # at the end of step j; step j+1 multiplies the peer's sub-chunk j
    assert ag.steps[0].compute == tuple(Slice(0, j) for j in range(c))
    assert [(t.slice, t.lag) for t in ag.steps[0].recvs] == [(Slice(1, j), j) for j in range(c)]
    assert [st.compute for st in ag.steps[1:]] == [(Slice(1, j),) for j in range(c)]
    assert not any(st.has_comm for st in ag.steps[1:])
    # RS: partial j of the peer's block is made at step j and sent at step j+1; the own block last, its
    # sub-chunks waited after it (all at the last step)
    assert [st.compute for st in rs.steps[:c]] == [(Slice(1, j),) for j in range(c)]
    assert [[t.slice for t in st.sends] for st in rs.steps] == [[]] + [[Slice(1, j)] for j in range(c)]
    assert rs.steps[-1].compute == tuple(Slice(0, j) for j in range(c))
    assert all(i + t.lag == c for i, st in enumerate(rs.steps) for t in st.recvs)


def test_validator_catches_a_slice_computed_before_its_sub_chunk_is_waited():
    scheds = _all(all_gather_ring, 2, chunks=2)
    late = tuple(Transfer(t.peer, t.slice, lag=t.lag + 1) if t.slice.part == 0 else t for t in scheds[0].steps[0].recvs)
    with pytest.raises(ScheduleError, match="before it is local or has arrived"):
        validate(_mutate(scheds, 0, 0, recvs=late))
    past = tuple(Transfer(t.peer, t.slice, lag=5) for t in scheds[0].steps[0].recvs)
    with pytest.raises(ScheduleError, match="outside steps"):
        validate(_mutate(scheds, 0, 0, recvs=past))


def test_validator_catches_an_arrival_added_before_its_partial_is_made():
    rs = _all(reduce_scatter_ring, 2, chunks=2)
    early = tuple(Transfer(t.peer, t.slice, lag=0) for t in rs[0].steps[1].recvs)  # own 0.0 is made at step 2
    with pytest.raises(ScheduleError, match="before computing its own partial"):
        validate(_mutate(rs, 0, 1, recvs=early))


def test_sub_chunks_refuse_bad_counts_and_the_bidirectional_ring():
    with pytest.raises(ValueError, match="integer >= 1"):
        all_gather_ring(0, 2, chunks=0)
    with pytest.raises(ValueError, match="one-directional"):
        reduce_scatter_ring(0, 2, bidirectional=True, chunks=2)
