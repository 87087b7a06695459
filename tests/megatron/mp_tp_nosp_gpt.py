"""Worker bodies: a tiny real GPTModel, TP without sequence parallel, flashoverlap_layer_spec vs stock.

Numerics come from the shared `tests.megatron.mp_megatron:gpt_vs_stock` (sp=False); `fns` profiles which autograd
Functions our non-SP layers run: the row output all-reduce (proj, fc2) through `matmul_all_reduce`, the
column dgrad all-reduce (qkv, fc1) through `matmul_allreduce_dgrad`.
"""
from __future__ import annotations

from megatron_flashoverlap.megatron import models as tm
from tests.support import profile
from tests.megatron.mp_megatron import _models, gpt_vs_stock

FNS = ("MatmulAllReduce", "MatmulAllReduceDgrad")


def gpt_nosp(rank, world, tp, config_name="flash", steps=20):
    return gpt_vs_stock(rank, world, tp, False, config_name, steps=steps)


def fns(rank, world, tp, config_name="flash"):
    """{Function name: forward calls} over one loss + backward of our model."""
    tm.init_tp(tp)
    try:
        _, ours = _models(tp, False, config_name)
        data = tm.batch(0)
        return profile.autograd_fns(lambda: tm.gpt_loss(ours, data).backward(), FNS)
    finally:
        tm.destroy()
