"""Rank bodies for tests/gloo/test_bench.py (run on the gloo pool)."""
import torch

from megatron_flashoverlap.bench import worker
from megatron_flashoverlap.bench.blocks import METHODS, Shape, make_block
from megatron_flashoverlap.runtime import OverlapContext


def harness(rank, world, cfg):
    """The worker's whole run (probes, interleaved repeats, trace) on tiny sizes; rank 0 returns the output."""
    return worker.run(cfg)


def block_outputs(rank, world, kind, shape_args):
    """Forward + backward of one block under every method: {method: (y, dx, dw_in, dw_out)} on this rank."""
    out = {}
    for m in METHODS:
        blk = make_block(kind, Shape(*shape_args), world, seed=3)
        x = blk.input(seed=4).requires_grad_()
        y = blk.forward(x, None, m, OverlapContext(check_peers=True))
        y.backward(torch.ones_like(y))
        out[m.name] = (y.detach(), x.grad, blk.w_in.grad, blk.w_out.grad)
    return out
