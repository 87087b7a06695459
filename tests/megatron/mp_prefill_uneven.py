"""Worker bodies: a tiny real GPTModel, TP without sequence parallel, prefill-shaped forward + backward at
sequence lengths TP does not divide: our spec vs the stock local spec, same weights."""
from __future__ import annotations

from megatron_flashoverlap.megatron import models as tm
from megatron_flashoverlap.ops.tp_nosp import autograd as arm
from tests.megatron.mp_megatron import _models, _rel


def gpt_any_length(rank, world, tp, lengths):
    """{s: logits, loss, worst grad (relative), padded calls} for each length s."""
    tm.init_tp(tp)
    padded = []
    real = arm._padded

    def counting(x, p):  # counts the decomposed all-reduces that had to pad (the operator's own function)
        padded.append(tuple(x.shape))
        return real(x, p)

    arm._padded = counting
    try:
        out = {}
        for s in lengths:
            stock, ours = _models(tp, False, "flash")
            data = tm.batch(0, s=s)
            padded.clear()
            res = {"logits": _rel(tm.gpt_logits(stock, data), tm.gpt_logits(ours, data))}
            ls, lo = tm.gpt_loss(stock, data), tm.gpt_loss(ours, data)
            ls.backward()
            lo.backward()
            res["loss"] = abs(ls.item() - lo.item()) / abs(ls.item())
            pairs = zip(stock.named_parameters(), ours.named_parameters())
            grads = {n: _rel(a.grad, b.grad) for (n, a), (_, b) in pairs if a.grad is not None}
            res["grad"] = max(grads.values())
            res["padded"] = len(padded)
            out[s] = res
        return out
    finally:
        arm._padded = real
        tm.destroy()
