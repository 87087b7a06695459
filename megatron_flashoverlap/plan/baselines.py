"""Step lists of the baselines, in the executor's vocabulary (schedules.Step), so one walk prices everything.

The flash algorithms walk the schedules of megatron_flashoverlap.schedules themselves (plan/ops.py). The
baselines are not schedules there: they are collective calls in ops/ (reference and slicing) and in stock
Megatron. Each is written here as the step list it amounts to; a transfer of tag >= COLL is one whole stock
collective (priced by NCCL's model), its `peer` is -1 (not a point-to-point peer).

    consume_chunks(k)  ops/tp_sp/plain.py slicing (k = 1: the reference): all k all-gathers posted at once
                       (their own posts, so they run one after another), GEMM chunk j once gather j arrived
        step 0: post gathers 0..k-1 (gather j waited at the end of step j)     step j+1: GEMM chunk j
    produce_chunks(k)  ops/tp_sp/plain.py slicing (k = 1: the reference): GEMM chunk j, then its
                       reduce-scatter posted; all waited after the last
        step 0: GEMM 0     step j: post RS j-1, GEMM j     step k: post RS k-1; every RS waited at step k
    bulk()             stock Megatron's column backward with SP (tensor_parallel/layers.py): the all-gather of x
                       in flight under the dgrad GEMM, the reduce-scatter of dx under the wgrad GEMM
        step 0: post AG(x), dgrad     step 1: post RS(dx), wgrad
"""
from __future__ import annotations

from ..schedules import Slice, Step, Transfer

COLL = 50  # tags from here are stock collectives
NO_PEER = -1


def _coll(j: int, tag: int, lag: int = 0) -> Transfer:
    return Transfer(NO_PEER, Slice(j, 0, tag), lag=lag)


def consume_chunks(k: int, compute_tag: int = 0, coll_tag: int = COLL) -> tuple[Step, ...]:
    """Collective chunk j in flight, then compute chunk j (module docstring)."""
    first = Step(sends=tuple(_coll(j, coll_tag, lag=j) for j in range(k)))
    return (first,) + tuple(Step(compute=(Slice(j, 0, compute_tag),)) for j in range(k))


def produce_chunks(k: int, compute_tag: int = 0, coll_tag: int = COLL) -> tuple[Step, ...]:
    """Compute chunk j, then its collective; all waited after the last (module docstring)."""
    steps = [Step(compute=(Slice(0, 0, compute_tag),))]
    for j in range(1, k + 1):
        compute = (Slice(j, 0, compute_tag),) if j < k else ()
        steps.append(Step(sends=(_coll(j - 1, coll_tag, lag=k - j),), compute=compute))
    return tuple(steps)


def bulk(first: Slice, second: Slice, coll_tag: int = COLL) -> tuple[Step, ...]:
    """Collective 0 under `first`, collective 1 under `second` (module docstring)."""
    return (Step(sends=(_coll(0, coll_tag),), compute=(first,)), Step(sends=(_coll(1, coll_tag),), compute=(second,)))

