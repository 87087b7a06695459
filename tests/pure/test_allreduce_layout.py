"""Tier 1 (pure): the all-reduce node layout derived from a group's global ranks and LOCAL_WORLD_SIZE.

Node of global rank g = g // L (L = the job's ranks per node). Expected layouts are written out by hand
from that rule; the hierarchical schedule needs G = group ranks per node with group rank = node * G + local.
"""
import pytest

from megatron_flashoverlap.ops.all_reduce.select import node_layout


@pytest.mark.parametrize("ranks,lws,nodes,counts,contiguous,balanced,per_node", [
    ([0, 1, 2, 3], 2, (0, 0, 1, 1), (2, 2), True, True, 2),            # 2 nodes x 2
    ([0, 1, 2, 3], 8, (0, 0, 0, 0), (4,), True, True, 4),              # one node: G = the group size
    ([0, 1, 2, 3, 4, 5], 4, (0, 0, 0, 0, 1, 1), (4, 2), True, False, None),  # 6 on 4-rank nodes: unbalanced
    ([1, 2, 3], 2, (0, 1, 1), (1, 2), True, False, None),              # shifted off a node boundary
    ([0, 2, 4, 6], 2, (0, 1, 2, 3), (1, 1, 1, 1), True, True, 1),      # one per node: G = 1
    ([0, 2, 1, 3], 2, (0, 1, 0, 1), (2, 2), False, True, None),        # strided: nodes interleave
    ([4, 5, 0, 1], 2, (2, 2, 0, 0), (2, 2), True, True, 2),            # nodes out of order: still contiguous
    ([0, 8, 16], 8, (0, 1, 2), (1, 1, 1), True, True, 1),              # 3 nodes x 1 (non-power-of-two N)
    ([6, 7, 8, 9, 10, 11], 3, (2, 2, 2, 3, 3, 3), (3, 3), True, True, 3),
    ([5, 6, 7, 8, 9, 10], 3, (1, 2, 2, 2, 3, 3), (1, 3, 2), True, False, None),
    ([0, 1, 4, 5, 2, 3], 2, (0, 0, 2, 2, 1, 1), (2, 2, 2), True, True, 2),
    ([0, 4, 1, 5], 4, (0, 1, 0, 1), (2, 2), False, True, None),
    ([3], 4, (0,), (1,), True, True, 1),
])
def test_layout_from_global_ranks(ranks, lws, nodes, counts, contiguous, balanced, per_node):
    lay = node_layout(ranks, lws)
    assert (lay.nodes, lay.counts, lay.contiguous, lay.balanced) == (nodes, counts, contiguous, balanced)
    assert lay.per_node == per_node
    assert (lay.why_not() == "") == (per_node is not None)


def test_why_not_names_the_reason():
    assert "not node-contiguous" in node_layout([0, 2, 1, 3], 2).why_not()
    msg = node_layout([0, 1, 2, 3, 4, 5], 4).why_not()
    assert "unequal rank counts [4, 2]" in msg and "[0, 0, 0, 0, 1, 1]" in msg


@pytest.mark.parametrize("ranks,lws,match", [([0, 1], 0, "LOCAL_WORLD_SIZE"), ([0, 0], 2, "distinct"),
                                             ([], 2, "distinct"), ([-1, 0], 2, "non-negative")])
def test_bad_layout_input_is_a_value_error(ranks, lws, match):
    with pytest.raises(ValueError, match=match):
        node_layout(ranks, lws)
