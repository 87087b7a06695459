"""Worker-side body of the decode test: greedy generation with Megatron's StaticInferenceContext (KV cache)
over a tiny GPTModel, TP without SP, stock local spec vs our spec (layer_spec(): the shipped
FlashRowParallelLinear, whose forward without SP is matmul_all_reduce; on decode-shaped inputs [1, b, k/P]
that operator runs the GEMM, then the all-reduce by the chooser's algorithm: the config's all_reduce.decode,
or under "auto" the calibration table's pick).
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from megatron_flashoverlap.megatron import models as tm
from tests.support import profile
from tests.support.chooser import active

PROMPT, NEW = 6, 6


def _ours(cfg, seq: int):
    """GPT with our layer spec (the active config's: its all_reduce.decode)."""
    from megatron_flashoverlap.megatron.linear import FlashRowParallelLinear
    from megatron_flashoverlap.megatron.spec import layer_spec

    model = tm.build_gpt(cfg, layer_spec(), seq=seq).eval()
    rows = [m for m in model.modules() if isinstance(m, FlashRowParallelLinear)]
    assert len(rows) == 2 * cfg.num_layers, rows  # proj and fc2 of every layer are the shipped class
    return model


def _step(model, tokens, start, ictx):
    """logits of the last position [b, vocab] (full vocab: runtime_gather_output), KV cache advanced."""
    b, s = tokens.shape
    pos = torch.arange(start, start + s).unsqueeze(0).expand(b, s).contiguous()
    logits = model(tokens, pos, None, inference_context=ictx, runtime_gather_output=True)
    ictx.sequence_len_offset += s
    return logits[:, -1, :]


def _generate(model, prompt, new_tokens, profile_step=None):
    """Greedy: prefill the prompt, then one token per step ([1, b, h] activations). -> tokens, margin, ops,
    the last-position logits of every step [steps, b, vocab]."""
    from megatron.core.inference.contexts import StaticInferenceContext

    b, plen = prompt.shape
    ictx = StaticInferenceContext(b, plen + new_tokens)
    out, margins, ops, logits = [], [], {}, []
    with torch.no_grad():
        last = _step(model, prompt, 0, ictx)
        for t in range(new_tokens):
            logits.append(last)
            top = last.topk(2, dim=-1).values
            margins.append((top[:, 0] - top[:, 1]).min().item())
            nxt = last.argmax(-1, keepdim=True)  # [b, 1]
            out.append(nxt)
            if t == new_tokens - 1:
                break
            if t == profile_step:
                ops = profile.comm_ops(lambda: None)  # warm the profiler outside the measured step
                holder = {}
                ops = profile.comm_ops(lambda: holder.setdefault("l", _step(model, nxt, plen + t, ictx)))
                last = holder["l"]
            else:
                last = _step(model, nxt, plen + t, ictx)
    return torch.cat(out, dim=1), min(margins), ops, torch.stack(logits)


def greedy(rank, world, algo, table=None, local_world_size=None, seed=5):
    """Tokens of stock and ours for one prompt and weights; our decode-step c10d op counts."""
    tm.init_tp(world)
    if local_world_size:  # the node layout the layers' all-reduce reads (as torchrun would set it)
        os.environ["LOCAL_WORLD_SIZE"] = str(local_world_size)
    try:
        with active({"all_reduce": {"decode": algo}}, table=table):
            return _compare(world, seed)
    finally:
        os.environ.pop("LOCAL_WORLD_SIZE", None)
        tm.destroy()


def _compare(world, seed):
    """Stock and ours on the same weights and prompt: tokens, margin, op counts, logits."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    cfg = tm.tiny_config(world, sp=False)
    seq = PROMPT + NEW
    stock = tm.build_gpt(cfg, get_gpt_layer_local_spec(), seq=seq).eval()
    ours = _ours(cfg, seq)
    tm.copy_weights(ours, stock)
    prompt = tm.batch(seed, b=2, s=PROMPT)["input_ids"]
    t_stock, margin, stock_ops, l_stock = _generate(stock, prompt, NEW, profile_step=1)
    t_ours, _, our_ops, l_ours = _generate(ours, prompt, NEW, profile_step=1)
    same = torch.tensor([int(torch.equal(t_ours, t_stock))])
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return {"stock": t_stock.tolist(), "ours": t_ours.tolist(), "margin": margin, "stock_ops": stock_ops,
            "our_ops": our_ops, "all_ranks_same": bool(same.item()),
            "logits": ((l_ours - l_stock).abs().max() / l_stock.abs().max()).item()}
