"""Tier 1 (no processes): the mutation helper (tests/support/mutations.py) names real tests and undoes itself.

Each mutation's own proof (its tests FAIL under it, pass without) is a run of
`python -m tests.support.mutations NAME --control`, minutes per mutation: not part of the suite."""
import pathlib
import re

import pytest

from tests.support.mutations import MUTATIONS, mutated

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_each_mutation_names_existing_tests(name):
    for node in MUTATIONS[name].tests:
        path, func = node.split("::")
        func = re.sub(r"\[.*\]$", "", func)
        assert re.search(rf"^def {func}\(", (ROOT / path).read_text(), re.M), node


def test_a_mutation_is_undone_after_its_block():
    from megatron_flashoverlap import schedules
    from megatron_flashoverlap.schedules import step

    before = (schedules.merge, step.merge)
    with mutated("merge_drops_recvs"):
        assert schedules.merge is not before[0] and step.merge is not before[1]
        ring = schedules.all_gather_ring(0, 2, tag=1)
        merged = schedules.merge(schedules.reduce_scatter_ring(0, 2, tag=0), ring)
        assert not any(t.slice.tag == 1 for s in merged for t in s.recvs)  # the defect is in place
    assert (schedules.merge, step.merge) == before
