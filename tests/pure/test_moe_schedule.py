"""Tier 1 (no processes): the fused MoE schedule (schedules.alltoall.expert_pipeline) and the validator's
"pipeline" rules: a block computed only after all its tensors arrived, its outputs sent back only after."""
import dataclasses

import pytest

from megatron_flashoverlap.schedules import ScheduleError, Slice, Step, expert_pipeline, grid, validate

SIZES = range(1, 9)


def _all(p, **kw):
    return [expert_pipeline(r, p, **kw) for r in range(p)]


@pytest.mark.parametrize("p", SIZES)
@pytest.mark.parametrize("ins,outs", [(2, 1), (1, 2)])  # forward: tokens+probs in, y out; backward: dy in, dx+dprobs
def test_expert_pipeline_validates(p, ins, outs):
    validate(_all(p, ins=ins, outs=outs))


@pytest.mark.parametrize("p", [2, 3, 4, 5])
def test_own_half_first_blocks_by_source_own_half_last(p):
    for r, s in enumerate(_all(p)):
        order = [st.compute[0] for st in s.steps]
        assert order == [Slice(r, r, 2)] + [Slice((r - j) % p, r, 2) for j in range(1, p)] + [Slice(r, r, 3)]
        assert not s.steps[-1].sends or all(t.slice.tag == 2 for t in s.steps[-1].sends)  # last hop: one output
        assert all(t.slice.tag < 2 for t in s.steps[0].sends)  # first hop: tokens+probs only


def _replace_step(s, i, step):
    steps = list(s.steps)
    steps[i] = step
    return dataclasses.replace(s, steps=tuple(steps))


def test_validator_catches_compute_before_arrival():
    p = 3
    scheds = _all(p)
    st = scheds[0].steps[0]  # rank 0 computes block 2 at step 0, before it arrived
    scheds[0] = _replace_step(scheds[0], 0, Step(st.sends, st.recvs, (Slice(2, 0, 2),)))
    with pytest.raises(ScheduleError, match="before 2 arrived from rank 2"):
        validate(scheds)


def test_validator_catches_output_sent_before_compute():
    p = 3
    scheds = _all(p)
    s1, s2 = scheds[0].steps[1], scheds[0].steps[2]  # rank 0 moves the send of block 2's output to step 1
    scheds[0] = _replace_step(scheds[0], 1, Step(s1.sends + s2.sends[-1:], s1.recvs, s1.compute))
    scheds[0] = _replace_step(scheds[0], 2, Step(s2.sends[:-1], s2.recvs, s2.compute))
    with pytest.raises(ScheduleError, match="before computing block 2"):
        validate(scheds)


def test_validator_catches_a_missing_combine():
    p = 3
    scheds = _all(p)
    for r in range(p):  # nobody sends or expects the output of the last block
        last = scheds[r].steps[-1]
        scheds[r] = _replace_step(scheds[r], p, Step((), (), last.compute))
    with pytest.raises(ScheduleError, match="ends without the output"):
        validate(scheds)


def test_grid_prints_the_pipeline():
    text = grid(_all(2))
    assert text.splitlines()[0] == "expert_pipeline  P=2" and "[0.0#3]" in text
