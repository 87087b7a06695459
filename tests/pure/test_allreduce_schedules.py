"""Tier 1 (no processes): all-reduce schedules as data, checked by the dry-run validator and printed."""
import math

import pytest

from megatron_flashoverlap.schedules import (
    ALL_REDUCE, ScheduleError, Slice, Step, Transfer, all_reduce_hierarchical, all_reduce_recursive_doubling, all_reduce_ring,
    all_reduce_schedule, grid, validate,
)

# (world, ranks per node): 1..8 ranks on one node, flat, and 2-4 nodes incl. 3 nodes and odd node sizes
LAYOUTS = [(p, p) for p in range(1, 9)] + [(p, 1) for p in range(1, 9)] + [
    (4, 2), (6, 2), (6, 3), (8, 2), (8, 4), (9, 3), (12, 4), (10, 2), (12, 3), (15, 5)]


def _all(p, g):
    return [all_reduce_hierarchical(r, p, g) for r in range(p)]


@pytest.mark.parametrize("p,g", LAYOUTS)
def test_hierarchical_validates(p, g):
    # validate: every send matched, no deadlock, every rank ends with every block = each rank's part once
    validate(_all(p, g))


@pytest.mark.parametrize("word", sorted(ALL_REDUCE))
@pytest.mark.parametrize("p,g", LAYOUTS)
def test_every_word_of_the_table_validates_through_all_reduce_schedule(word, p, g):
    # a new row of schedules.ALL_REDUCE is checked here without a test of its own
    validate([all_reduce_schedule(word, r, p, g) for r in range(p)])


@pytest.mark.parametrize("p", range(1, 9))
def test_flat_algorithms_validate(p):
    validate([all_reduce_ring(r, p) for r in range(p)])
    validate([all_reduce_recursive_doubling(r, p) for r in range(p)])


@pytest.mark.parametrize("p,g", LAYOUTS)
def test_step_counts_match_the_latency_model(p, g):
    # 2(G-1) intra + log2(N') inter, +2 where N is not a power of two (fold in, fold out)
    n = p // g
    n2 = 1 << (n.bit_length() - 1)
    fold = 2 if n != n2 else 0
    longest = max(len(s.steps) for s in _all(p, g))
    assert longest == 2 * (g - 1) + int(math.log2(n2)) + fold


@pytest.mark.parametrize("p,g", [(8, 2), (12, 3), (6, 2)])
def test_inter_node_steps_stay_on_the_same_local_rank(p, g):
    for r in range(p):
        s = all_reduce_hierarchical(r, p, g)
        inter = s.steps[g - 1:len(s.steps) - (g - 1)]
        for st in inter:
            for t in st.sends + st.recvs:
                assert t.peer % g == r % g and t.peer // g != r // g  # another node, same local rank
                assert t.slice == Slice(r % g)                       # only this rank's n/G block travels


@pytest.mark.parametrize("p", [2, 4, 8])
def test_recursive_doubling_partners_are_xor(p):
    for r in range(p):
        peers = [st.sends[0].peer for st in all_reduce_recursive_doubling(r, p).steps]
        assert peers == [r ^ (1 << k) for k in range(int(math.log2(p)))]


@pytest.mark.parametrize("p", [3, 5, 6, 7])
def test_non_power_of_two_folds_extra_ranks(p):
    rem = p - (1 << (p.bit_length() - 1))
    for r in range(2 * rem):
        steps = all_reduce_recursive_doubling(r, p).steps
        if r % 2 == 0:  # sits out: hands its value up, idles while the others double, gets the sum as a copy
            log2 = (1 << (p.bit_length() - 1)).bit_length() - 1
            assert len(steps) == 2 + log2 and steps[0].sends[0].peer == r + 1
            assert all(not st.has_comm for st in steps[1:-1])  # idle: keeps its steps aligned with the others'
            assert steps[-1].recvs[0].op == "copy" and steps[-1].recvs[0].peer == r + 1


def test_dispatch_and_bad_layout():
    assert all_reduce_schedule("hierarchical", 0, 8, 4).steps == all_reduce_hierarchical(0, 8, 4).steps
    assert all_reduce_schedule("ring", 1, 4).name == "all_reduce_ring"
    with pytest.raises(ValueError, match="choose one of"):
        all_reduce_schedule("tree", 0, 4)
    with pytest.raises(ValueError, match="ranks per node"):
        all_reduce_hierarchical(0, 6, 4)


def _replace(scheds, rank, step, new_step):
    s = scheds[rank]
    steps = list(s.steps)
    steps[step] = new_step
    scheds[rank] = type(s)(**{**s.__dict__, "steps": tuple(steps)})
    return scheds


def test_validator_catches_a_double_add():
    # turn the fold-back copy on rank 0 (P=3) into an add: rank 0's part would be counted twice
    scheds = [all_reduce_recursive_doubling(r, 3) for r in range(3)]
    _replace(scheds, 0, len(scheds[0].steps) - 1, Step(recvs=(Transfer(1, Slice(0)),)))
    with pytest.raises(ScheduleError, match="exactly once"):
        validate(scheds)


def test_validator_catches_a_missing_exchange():
    # drop one inter-node exchange on both partners: their block misses the other node
    scheds = _all(4, 2)
    for r in (0, 2):
        _replace(scheds, r, 1, Step())
    with pytest.raises(ScheduleError, match="exactly once"):
        validate(scheds)


def test_validator_catches_a_step_receiving_one_slice_twice():
    scheds = [all_reduce_ring(r, 2) for r in range(2)]
    st = scheds[0].steps[0]
    _replace(scheds, 0, 0, Step(st.sends, st.recvs + st.recvs))
    with pytest.raises(ScheduleError, match="twice in a step"):
        validate(scheds)


def test_grid_shows_adds_and_copies():
    text = grid(_all(4, 2))
    assert text.splitlines()[0] == "all_reduce_hierarchical  P=4"
    assert "0<1" in text and "1<=1" in text  # RS adds block 0 from rank 1; AG copies block 1 from rank 1


@pytest.mark.parametrize("p,g", [(4, 2), (6, 2), (8, 2), (8, 4), (9, 3), (12, 3), (10, 2), (6, 3)])
@pytest.mark.parametrize("pieces", [2, 3, 4])
def test_pipelined_hierarchical_validates_and_staggers(p, g, pieces):
    # every piece: the hierarchical steps on its own G blocks, piece k starting at step k
    scheds = [all_reduce_hierarchical(r, p, g, pieces=pieces) for r in range(p)]
    validate(scheds)
    one = max(len(all_reduce_hierarchical(r, p, g).steps) for r in range(p))
    assert max(len(s.steps) for s in scheds) == one + pieces - 1
    for r, s in enumerate(scheds):
        assert s.final == tuple(Slice(b) for b in range(g * pieces))
        first = [min(i for i, st in enumerate(s.steps) if any(t.slice.block // g == k for t in st.sends))
                 for k in range(pieces)]
        assert first == list(range(pieces))  # piece k's first send at step k


def test_pipelined_is_the_registered_algorithm():
    s = all_reduce_schedule("hierarchical_pipelined", 1, 4, 2)
    assert s.name == "all_reduce_hierarchical_pipelined" and len(s.final) == 2 * 4  # G blocks x K = 4 pieces
    with pytest.raises(ValueError, match="pieces"):
        all_reduce_hierarchical(0, 4, 2, pieces=0)


@pytest.mark.parametrize("p,g", LAYOUTS + [(16, 2), (14, 2)])
def test_halving_doubling_validates(p, g):
    validate([all_reduce_schedule("hierarchical_hd", r, p, g) for r in range(p)])


@pytest.mark.parametrize("p,g", [(8, 2), (16, 4), (16, 2), (8, 1)])  # power-of-two node counts (no fold)
def test_halving_doubling_sends_fewer_inter_node_bytes(p, g):
    # per rank across nodes: 2 (M-1)/M of its shard n/G, against log2(M) shards for recursive doubling
    n = p // g
    m = 1 << (n.bit_length() - 1)

    def inter_blocks(s, r, blocks):  # fraction of the message this rank sends to other nodes
        return sum(1 for st in s.steps for t in st.sends if t.peer // g != r // g) / blocks
    for r in range(p):
        hd = all_reduce_schedule("hierarchical_hd", r, p, g)
        rd = all_reduce_hierarchical(r, p, g)
        assert inter_blocks(hd, r, g * m) == pytest.approx(2 * (m - 1) / m / g)
        assert inter_blocks(rd, r, g) == pytest.approx(math.log2(m) / g)
