"""Worker-side bodies of the MoE exchange tests (run on every rank by the gloo pool).

Every rank draws the same count matrix counts[src][dst] (rows src sends to dst, zeros included) from one
seed; row j of the block src sends to dst holds the value (src, dst, j) in its first three columns, so the
expected output is built from the counts alone, never from the operator.
"""
from __future__ import annotations

import torch

from megatron_flashoverlap.ops.moe import COMBINE, DISPATCH, expert_all_to_all
from megatron_flashoverlap.runtime import OverlapContext
from tests.support import profile

H = 5


def _counts(world: int, seed: int, zeros: str) -> torch.Tensor:
    """zeros: "one" (rank 0 sends nothing to the last rank), "all" (nobody sends anything), "none"."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(1, 7, (world, world), generator=g)
    if zeros == "one":
        counts[0, world - 1] = 0
    return counts * (zeros != "all")


def _block(src: int, dst: int, n: int) -> torch.Tensor:
    """[n, H]: (src, dst, j, then a smooth filler), the rows src sends to dst."""
    j = torch.arange(n, dtype=torch.float32)
    cols = [torch.full((n,), float(src)), torch.full((n,), float(dst)), j]
    cols += [torch.sin(j + 10 * src + 100 * dst + k) for k in range(H - 3)]
    return torch.stack(cols, dim=1) if n else torch.zeros(0, H)


def exchange(rank, world, algo, order, seed=0, zeros="one"):
    """-> forward equal to the expected blocks, grads equal to the reference's, and the c10d op counts."""
    counts = _counts(world, seed, zeros)
    ins, outs = counts[rank].tolist(), counts[:, rank].tolist()
    x = torch.cat([_block(rank, d, ins[d]) for d in range(world)]).requires_grad_()
    expected = torch.cat([_block(s, rank, outs[s]) for s in range(world)])
    ctx = OverlapContext(check_peers=False)
    expert_all_to_all(x.detach(), outs, ins, None, ctx, algo=algo, order=order)  # warm-up: the profiler's first
    held = {}                                                                  # window in a process misses c10d ops
    ops = profile.comm_ops(lambda: held.setdefault("y", expert_all_to_all(x, counts[:, rank].numpy(), ins, None,
                                                                          ctx, algo=algo, order=order)))
    y = held["y"]
    w = torch.cos(torch.arange(y.numel(), dtype=torch.float32)).view_as(y) * (1 + rank)  # any fixed dout
    (y * w).sum().backward()
    ref = x.detach().clone().requires_grad_()
    (expert_all_to_all(ref, outs, ins, None, ctx, algo="reference") * w).sum().backward()
    return {"fwd_equal": torch.equal(y.detach(), expected), "grad_equal": torch.equal(x.grad, ref.grad), "ops": ops,
            "peers": (_peers(ins, rank), _peers(outs, rank))}


def _peers(splits, rank: int) -> int:
    """How many other ranks a block of rows goes to (or comes from)."""
    return sum(n > 0 for d, n in enumerate(splits) if d != rank)


def dispatch_order(rank, world, seed=1):
    """The order in which DISPATCH hands blocks to `use`: -> [src, ...] and whether each block was complete."""
    from megatron_flashoverlap.ops.moe.exchange import all_to_all_v_flash

    counts = _counts(world, seed, "none")
    ins, outs = counts[rank].tolist(), counts[:, rank].tolist()
    x = torch.cat([_block(rank, d, ins[d]) for d in range(world)])
    seen = []
    all_to_all_v_flash(x, outs, ins, None, OverlapContext(check_peers=False),
                       use=lambda src, rows: seen.append((src, torch.equal(rows, _block(src, rank, outs[src])))))
    made = []
    all_to_all_v_flash(x, outs, ins, None, OverlapContext(check_peers=False), order=COMBINE,
                       make=lambda d: made.append(d) or _block(rank, d, ins[d]))
    return {"used": seen, "made": made}


def bad_splits(rank, world):
    """-> the ValueError message for splits that do not match x."""
    x = torch.zeros(4, H)
    try:
        expert_all_to_all(x, [2] * world, [3] * world, None, OverlapContext(), order=DISPATCH)
    except ValueError as err:
        return str(err)
    return None
