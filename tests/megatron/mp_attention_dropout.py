"""Worker bodies of the attention-dropout tests (run on every gloo rank by the pool).

The mask is read off the output: with q = 0 every probability is 1/sk (no mask), and with v = the identity
over keys (hn = sk) ctx[i, b, head*hn + j] = keep[b, head, i, j] / (sk * keep_p), exactly (powers of two).
A projection weight equal to the identity carries ctx through the query-split operator's GEMM + RS.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_flashoverlap.ops.attention.core import Attend, AttnSpec, attention_reference, attention_rows
from megatron_flashoverlap.ops.attention.query_split import query_split_attention
from megatron_flashoverlap.ops.registry import OpPlan


def _probe(s, b, heads):
    """q = 0, k random, v = e_j for key j: q, k, v [s, b, heads, s]; W = I [heads*s, heads*s]."""
    q = torch.zeros(s, b, heads, s)
    k = torch.randn(s, b, heads, s, generator=torch.Generator().manual_seed(1))
    v = torch.eye(s).view(s, 1, 1, s).expand(s, b, heads, s).contiguous()
    return q, k, v, torch.eye(heads * s)


def _gather(t, dim):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts, dim=dim)


def query_split_masks(rank, world, p=0.5, s=8, b=2, heads=4, seed=11):
    """Masks of query split (flash, reference) at P = world against one full-sequence block on each rank."""
    q, k, v, w = _probe(s, b, heads)
    hl = heads // world
    loc = [t[:, :, rank * hl:(rank + 1) * hl].contiguous() for t in (q, k, v)]
    w_loc = w[:, rank * hl * s:(rank + 1) * hl * s].contiguous()
    out = {}
    for algo in ("flash", "reference"):
        y = query_split_attention(*loc, w_loc, dist.group.WORLD, attend=Attend(causal=False, dropout_p=p, seed=seed),
                                  plan=OpPlan(algo))
        out[algo] = _gather(y.detach(), 0)  # [s, b, heads*s]: every rank's heads, every row
    dense = attention_reference(*loc, AttnSpec(scale=s ** -0.5, causal=False, dropout_p=p, seed=seed))
    full = _gather(dense, 2)  # [s, b, heads*s]: rank r's heads side by side, as W = I places them
    level = 1.0 / (s * (1 - p))
    return {"flash_equal": bool(torch.equal(out["flash"], full)),
            "ref_equal": bool(torch.equal(out["reference"], full)),
            "two_levels": bool(((full == 0) | (full == level)).all()), "kept": (full > 0).double().mean().item()}


def _config(world, sp, p, s, heads):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=heads * s, num_attention_heads=heads, kv_channels=s,
                             tensor_model_parallel_size=world, sequence_parallel=sp, use_cpu_initialization=True,
                             attention_dropout=p, hidden_dropout=0.0)


def _ours(cfg, loc, p, s):
    """Our core attention's dropout: its mask drawn by QuerySplitDotProductAttention's rule (the core attention
    query split runs on, with and without SP), then applied by our attention."""
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_flashoverlap.config import from_dict
    from megatron_flashoverlap.megatron.query_split_pair import QuerySplitDotProductAttention

    ours = QuerySplitDotProductAttention(cfg, 1, AttnMaskType.no_mask, "self",
                                         flash_config=from_dict({"attention": {"query_split": True}})).train()
    return attention_rows(*loc, AttnSpec(scale=s ** -0.5, causal=False, dropout_p=p, keep=ours._keep(*loc[:2])), 0)


def tp_rank_masks(rank, world, sp, fork, p=0.5, s=8, b=2, heads=4):
    """Do the TP ranks' dropout masks differ, for Megatron's DotProductAttention and for ours, and are ours
    stock's? Every rank feeds the same local q, k, v; `fork`: inside the model-parallel RNG, as TransformerBlock
    runs under SP. Both start from the same RNG states (the default generator and the tracker's); `next` compares
    what the RNG gives after each."""
    import contextlib

    from megatron.core import tensor_parallel
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_flashoverlap.megatron.models import destroy, init_tp

    init_tp(world)
    try:
        cfg = _config(world, sp, p, s, heads)
        loc = [t[:, :, :heads // world].contiguous() for t in _probe(s, b, heads)[:3]]
        tracker = tensor_parallel.get_cuda_rng_tracker()
        region = tracker.fork if fork else contextlib.nullcontext
        start = torch.get_rng_state(), tracker.get_states()
        out, after = {}, {}
        for name in ("stock", "ours"):
            torch.set_rng_state(start[0])
            tracker.set_states(dict(start[1]))  # set_states keeps the dict it is given
            with region():
                out[name] = (DotProductAttention(cfg, 1, AttnMaskType.no_mask, "self").train()(*loc, None)
                             if name == "stock" else _ours(cfg, loc, p, s)).detach()
            with tracker.fork():
                forked = torch.rand(4)
            after[name] = torch.rand(4), forked
        stock, ours = out["stock"], out["ours"]
        return {name: not all(torch.equal(t, m) for t in _gather(m[None], 0))
                for name, m in (("stock", stock), ("ours", ours))} | {
                    "ours_kept": (ours > 0).double().mean().item(), "equal": bool(torch.equal(ours, stock)),
                    "next_equal": all(torch.equal(x, y) for x, y in zip(after["stock"], after["ours"]))}
    finally:
        destroy()
