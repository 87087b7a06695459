"""Worker body: the benchmark attention blocks run every method and agree with the stock method."""
from __future__ import annotations

import torch.distributed as dist


def blocks_agree(rank, world, kind, methods):
    from benchmarks.harness.blocks import Method, Shape
    from benchmarks.attention.blocks import ATTENTION_BLOCKS
    from megatron_flashoverlap.runtime import OverlapContext

    block = ATTENTION_BLOCKS[kind](Shape(seq=16, batch=2, hidden=16, width=8, head_dim=4), world)
    x = block.input()
    outs = {}
    for name, algo, chunks in methods:
        xx = x.clone().requires_grad_()
        y = block.forward(xx, dist.group.WORLD, Method(name, algo, chunks), OverlapContext(check_peers=False))
        y.sum().backward()
        outs[name] = (y.detach(), xx.grad, [p.grad.clone() for p in block.params()])
        for p in block.params():
            p.grad = None
    ys, dxs, gs = outs["stock"]
    err = {}
    for name, (y, dx, g) in outs.items():
        err[name] = max([(y - ys).abs().max().item(), (dx - dxs).abs().max().item()] +
                        [(a - c).abs().max().item() for a, c in zip(g, gs)])
    if kind == "ulysses":
        c = block.comm_alone(x, dist.group.WORLD, Method("flash", "flash"), OverlapContext(check_peers=False))
        err["comm_shape_ok"] = tuple(c.shape) == (x.shape[0], x.shape[1], block.heads, block.head_dim)
    return err
