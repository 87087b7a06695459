"""Worker body: a tiny real GPTModel, TP without sequence parallel, flashoverlap_layer_spec vs stock.

The non-SP layers route the row output all-reduce (proj, fc2) through `matmul_all_reduce` and the column
dgrad all-reduce (qkv, fc1) through `matmul_allreduce_dgrad`; the profile counts those autograd Functions.
"""
from __future__ import annotations

from megatron_flashoverlap.testing import megatron as tm
from tests.mp_megatron import _models, _rel, _same_params, _train

FNS = ("MatmulAllReduce", "MatmulAllReduceDgrad")


def gpt_nosp(rank, world, tp, config_name="flash", steps=20, lr=1e-2):
    tm.init_tp(tp)
    try:
        stock, ours = _models(tp, False, config_name)
        out = {"init_equal": _same_params(stock, ours)}
        data = tm.batch(0)
        out["logits_rel"] = _rel(tm.gpt_logits(stock, data), tm.gpt_logits(ours, data))
        loss_s = tm.gpt_loss(stock, data)
        loss_s.backward()
        holder = {}
        out["fns"] = tm.autograd_fns(lambda: holder.setdefault("l", tm.gpt_loss(ours, data)).backward(), FNS)
        out["loss"] = (loss_s.item(), holder["l"].item())
        out["grad_rel"] = {n: _rel(p.grad, q.grad) for (n, p), q in zip(stock.named_parameters(), ours.parameters())}
        out["curves"] = [_train(m, steps, lr) for m in (stock, ours)]
        return out
    finally:
        tm.destroy()
