"""Worker bodies of test_force_reference.py: one call (forward and backward) of each public operator.

`case(rank, world, op)` runs op with a fused algo three ways: free, inside `force_reference()`, and with
algo="reference"; it returns the c10d ops each issued (testing.profile.comm_ops) and whether the forced
outputs are bitwise those of algo="reference" (the same code path: no tolerance).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import megatron_flashoverlap as fo
from tests.support.profile import comm_ops

CTX = fo.OverlapContext(check_peers=False)  # the peer check is one all-gather of its own: keep it out


def _leaves(seed, *shapes):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g).requires_grad_() for s in shapes]


def _grads(y, leaves):
    y.backward(torch.ones_like(y))
    return [y.detach()] + [t.grad for t in leaves]


def _ag(algo):
    x, w = _leaves(0, (4, 2, 8), (6, 8))
    return _grads(fo.all_gather_matmul(x, w, algo=algo, context=CTX), [x, w])


def _rs(algo):
    x, w = _leaves(1, (4, 2, 8), (6, 8))
    return _grads(fo.matmul_reduce_scatter(x, w, algo=algo, context=CTX), [x, w])


def _ar(algo, s=4, decode="auto"):
    x, w = _leaves(2, (s, 2, 8), (6, 8))
    return _grads(fo.matmul_all_reduce(x, w, plan=fo.OpPlan(algo, decode_all_reduce=decode), context=CTX), [x, w])


def _ar_decode(algo):  # decode-shaped x [1, b, k/P] with an explicit P2P choice for decode
    return _ar(algo, s=1, decode="ring")


def _ar_dgrad(algo):
    x, w = _leaves(3, (4, 2, 8), (6, 8))
    return _grads(fo.matmul_allreduce_dgrad(x, w, algo=algo, context=CTX), [x, w])


def _all_reduce(algo):
    (x,) = _leaves(4, (4, 2, 8))
    ring = "ring" if algo != "reference" else algo
    return _grads(fo.all_reduce(x, algo=ring, context=CTX), [x])


def _qsa(algo):
    q, k, v, w = _leaves(5, (4, 2, 2, 4), (4, 2, 2, 4), (4, 2, 2, 4), (8, 8))
    return _grads(fo.query_split_attention(q, k, v, w, plan=fo.OpPlan(algo), context=CTX), [q, k, v, w])


def _ulysses(algo):
    q, k, v = _leaves(6, (2, 2, 2, 4), (2, 2, 2, 4), (2, 2, 2, 4))
    return _grads(fo.ulysses_attention(q, k, v, algo=algo, context=CTX), [q, k, v])


def _ulysses_fused(algo):
    x, wq, wp = _leaves(7, (2, 2, 8), (24, 8), (8, 8))  # heads = groups = 2, hn = 4: w_qkv [2*(1+2)*4, 8]
    y = fo.ulysses_fused_attention(x, wq, wp, attend=fo.Attend(heads=2), algo=algo, context=CTX)
    return _grads(y, [x, wq, wp])


def _dp(algo):
    dy, x = (t.detach() for t in _leaves(8, (2, 2, 3), (2, 2, 4)))
    grad = torch.zeros(12)
    fo.matmul_wgrad_reduce_scatter(dy, x, fo.DPBucket(grad, 0), dist.group.WORLD, algo=algo, context=CTX)
    return [grad]


def _moe(algo):  # uneven splits: rank r sends r+1 rows to every peer (the dispatcher's counts are data)
    from megatron_flashoverlap.ops.moe import expert_all_to_all

    rank, world = dist.get_rank(), dist.get_world_size()
    (x,) = _leaves(9 + rank, ((rank + 1) * world, 4))
    return _grads(expert_all_to_all(x, [r + 1 for r in range(world)], [rank + 1] * world, None, CTX, algo=algo), [x])


CASES = {"all_gather_matmul": _ag, "matmul_reduce_scatter": _rs, "matmul_all_reduce": _ar,
         "matmul_all_reduce_decode": _ar_decode, "matmul_allreduce_dgrad": _ar_dgrad, "all_reduce": _all_reduce,
         "query_split_attention": _qsa, "ulysses_attention": _ulysses, "ulysses_fused_attention": _ulysses_fused,
         "matmul_wgrad_reduce_scatter": _dp, "expert_all_to_all": _moe}


def case(rank, world, op):
    fn, out = CASES[op], {}
    free = comm_ops(lambda: out.setdefault("free", fn("flash")))

    def forced_call():
        with fo.force_reference():
            out["forced"] = fn("flash")

    forced = comm_ops(forced_call)
    reference = comm_ops(lambda: out.setdefault("reference", fn("reference")))
    same = all(torch.equal(a, b) for a, b in zip(out["forced"], out["reference"]))
    return {"free": free, "forced": forced, "reference": reference, "same_as_reference": same}
