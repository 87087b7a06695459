"""Worker bodies for the query-split attention tests (run on every gloo rank by the pool).

Every rank builds the same global q, k, v [s, b, np, hn], W_proj [h, np*hn] and dy [s, b, h] from one seed,
takes its head shard (TP = the whole group), and runs
  - Megatron: its local `DotProductAttention` (TP = P, SP on), F.linear with the local proj shard and
    Megatron's `reduce_scatter_to_sequence_parallel_region` (the stock local-spec path), and
  - ours: `query_split_attention` with the same inputs,
then returns max errors of y and of the input gradients (dq, dk, dv, dw); the test asserts on them.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from megatron_flashoverlap.ops.attention.core import Attend
from megatron_flashoverlap.ops.attention.query_split import query_split_attention
from megatron_flashoverlap.ops.registry import OpPlan

DT = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _err(a, b):
    return (a.double() - b.double()).abs().max().item()


def _globals(seed, s, b, heads, groups, hn, h, dtype):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(s, b, heads, hn, generator=g)
    k = torch.randn(s, b, groups, hn, generator=g)
    v = torch.randn(s, b, groups, hn, generator=g)
    w = torch.randn(h, heads * hn, generator=g) / (heads * hn) ** 0.5
    dy = torch.randn(s, b, h, generator=g)
    pad = torch.zeros(b, 1, s, s, dtype=torch.bool)
    pad[1, :, :, s - s // 3:] = True  # batch 1: the last third of the keys is padding
    return [t.to(dtype) for t in (q, k, v, w, dy)] + [pad]


def _shards(rank, world, q, k, v, w, dy):
    hq, hk, hw = q.shape[2] // world, k.shape[2] // world, w.shape[1] // world
    sl = q.shape[0] // world
    loc = [q[:, :, rank * hq:(rank + 1) * hq], k[:, :, rank * hk:(rank + 1) * hk],
           v[:, :, rank * hk:(rank + 1) * hk], w[:, rank * hw:(rank + 1) * hw]]
    return [t.contiguous().requires_grad_() for t in loc], dy[rank * sl:(rank + 1) * sl].contiguous()


def _megatron(world, heads, groups, hn, h, dtype, loc, dy_s, mask):
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.mappings import reduce_scatter_to_sequence_parallel_region
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    cfg = TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=heads, num_query_groups=groups,
                            kv_channels=hn, tensor_model_parallel_size=world, sequence_parallel=True,
                            use_cpu_initialization=True, attention_dropout=0.0, hidden_dropout=0.0,
                            bf16=dtype == torch.bfloat16, params_dtype=dtype)
    dpa = DotProductAttention(cfg, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    q, k, v, w = loc
    ctx = dpa(q, k, v, mask)  # [s, b, np/P*hn]
    y = reduce_scatter_to_sequence_parallel_region(F.linear(ctx, w), group=parallel_state.get_tensor_model_parallel_group())
    y.backward(dy_s)
    return y.detach(), [t.grad for t in loc]


def vs_megatron(rank, world, dtype="float32", s=12, b=2, heads=12, groups=12, hn=4, h=24, algo="flash",
                padding=False, seed=0, num_chunks=None):
    """Errors of ours vs Megatron's DotProductAttention + proj + stock RS (causal, optional padding)."""
    from megatron_flashoverlap.megatron.models import destroy, init_tp

    dt = DT[dtype]
    init_tp(world)
    try:
        from megatron.core import parallel_state

        q, k, v, w, dy, pad = _globals(seed, s, b, heads, groups, hn, h, dt)
        causal = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), 1)
        loc_m, dy_s = _shards(rank, world, q, k, v, w, dy)
        y_m, g_m = _megatron(world, heads, groups, hn, h, dt, loc_m, dy_s, (causal | pad) if padding else causal)
        loc, _ = _shards(rank, world, q, k, v, w, dy)
        group = parallel_state.get_tensor_model_parallel_group()
        y = query_split_attention(*loc, group, attend=Attend(causal=True, mask=pad if padding else None),
                                  plan=OpPlan(algo, num_chunks=num_chunks))
        y.backward(dy_s)
        names = ("dq", "dk", "dv", "dw")
        out = {"y": _err(y, y_m), "y_scale": y_m.abs().max().item(), "dtype_ok": y.dtype == dt}
        for n, a, m in zip(names, loc, g_m):
            out[n] = _err(a.grad, m)
            out[n + "_scale"] = m.abs().max().item()
        return out
    finally:
        destroy()


def dropout_vs_reference(rank, world, p=0.25, s=8, b=2, heads=4, hn=4, h=8, seed=3):
    """With dropout: flash vs reference (same per-row masks) and the fraction of dropped probabilities."""
    import torch.distributed as dist

    q, k, v, w, dy, _ = _globals(seed, s, b, heads, heads, hn, h, torch.float32)
    res = {}
    for algo in ("flash", "reference"):
        loc, dy_s = _shards(rank, world, q, k, v, w, dy)
        y = query_split_attention(*loc, dist.group.WORLD, attend=Attend(causal=False, dropout_p=p, seed=11),
                                  plan=OpPlan(algo))
        y.backward(dy_s)
        res[algo] = (y.detach(), [t.grad for t in loc])
    loc, _ = _shards(rank, world, q, k, v, w, dy)
    y0 = query_split_attention(*loc, dist.group.WORLD, attend=Attend(causal=False), plan=OpPlan("reference"))
    (yf, gf), (yr, gr) = res["flash"], res["reference"]
    return {"y": _err(yf, yr), "grads": max(_err(a, c) for a, c in zip(gf, gr)),
            "changed": _err(yf, y0.detach())}


def zigzag_vs_dense(rank, world, s=16, b=2, heads=8, groups=4, hn=4, h=16, padding=True, seed=4, dropout=0.0):
    """query_split_attention(attend=Attend(zigzag=True)): rank d's output rows are chunks (d, 2P-1-d) of 2P; errors vs
    the float64 dense formula on the global tensors (one process), output and input gradients. dropout > 0: a
    drawn mask of the whole sequence (attend.keep, in natural order), this rank's heads of it."""
    import torch.distributed as dist

    from megatron_flashoverlap.ops.attention.core import AttnSpec, attention_rows, draw_keep

    q, k, v, w, dy, pad = _globals(seed, s, b, heads, groups, hn, h, torch.float32)
    keep = None
    if dropout:
        torch.manual_seed(seed)
        keep = draw_keep((b, heads, s, s), torch.float32, dropout, "cpu")
    c = s // (2 * world)
    idx = torch.cat([torch.arange(j * c, (j + 1) * c) for j in (rank, 2 * world - 1 - rank)])
    loc, _ = _shards(rank, world, q, k, v, w, dy)
    hl = heads // world
    y = query_split_attention(*loc, dist.group.WORLD, attend=Attend(
        mask=pad if padding else None, zigzag=True, dropout_p=dropout,
        keep=None if keep is None else keep[:, rank * hl:(rank + 1) * hl].contiguous()))
    y.backward(dy[idx])
    full = [t.double().requires_grad_() for t in (q, k, v, w)]
    spec = AttnSpec(scale=hn ** -0.5, causal=True, mask=pad if padding else None, dropout_p=dropout, keep=keep)
    y_full = F.linear(attention_rows(*full[:3], spec, 0), full[3])
    (y_full * dy.double()).sum().backward()
    ref_loc, _ = _shards(rank, world, *(t.grad for t in full[:3]), full[3].grad, dy)
    out = {"y": _err(y, y_full[idx]), "scale": y_full.abs().max().item()}
    for n, a, r in zip(("dq", "dk", "dv", "dw"), loc, ref_loc):
        out[n] = _err(a.grad, r)
    return out


def core_vs_dot_product(rank, world, dtype="float32", softmax_in_fp32=True, dropout=0.0, s=16, b=2, heads=8,
                        groups=4, hn=8, block=4, seed=5):
    """Our core attention (attention_rows on the whole sequence, with the mask QuerySplitDotProductAttention
    draws) against Megatron's DotProductAttention at TP = world without SP, each from the same RNG states: ctx
    and dq, dk, dv compared exactly; `blocks`: the error of query blocks of `block` rows (attention_rows with the
    same drawn mask, as query split computes them); `next_equal`: what the RNG gives after each."""
    from megatron.core import tensor_parallel
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_flashoverlap.config import from_dict
    from megatron_flashoverlap.megatron.query_split_pair import QuerySplitDotProductAttention
    from megatron_flashoverlap.megatron.models import destroy, init_tp
    from megatron_flashoverlap.ops.attention.core import attention_rows, make_spec

    dt = DT[dtype]
    init_tp(world)
    try:
        cfg = TransformerConfig(num_layers=1, hidden_size=heads * hn, num_attention_heads=heads, num_query_groups=groups,
                                kv_channels=hn, tensor_model_parallel_size=world, use_cpu_initialization=True,
                                attention_dropout=dropout, hidden_dropout=0.0, bf16=dt == torch.bfloat16,
                                params_dtype=dt, attention_softmax_in_fp32=softmax_in_fp32)
        q, k, v, w, dy, _ = _globals(seed, s, b, heads, groups, hn, heads * hn, dt)
        q = q * 4  # peaked softmax rows: the precision of the softmax shows
        dctx = dy[..., :heads * hn // world].contiguous()
        ours_layer = QuerySplitDotProductAttention(cfg, 1, AttnMaskType.causal, "self",
                                                   flash_config=from_dict({"attention": {"query_split": True}}))
        ours_layer.train()

        def ours(q_, k_, v_, rows=None):
            keep = ours_layer._keep(q_, k_)
            spec = make_spec(q_, Attend(softmax_scale=ours_layer.softmax_scale, dropout_p=dropout if keep is not None
                                        else 0.0, keep=keep, softmax_in_fp32=softmax_in_fp32), None, keep=keep)
            if rows is None:
                return attention_rows(q_, k_, v_, spec, 0)
            return torch.cat([attention_rows(q_[a:a + rows], k_, v_, spec, a) for a in range(0, s, rows)])

        out = {}
        for name in ("stock", "ours", "blocks"):
            torch.manual_seed(seed)
            tensor_parallel.model_parallel_cuda_manual_seed(seed)
            loc, _ = _shards(rank, world, q, k, v, w, dy)
            if name == "stock":
                ctx = DotProductAttention(cfg, 1, AttnMaskType.causal, "self").train()(*loc[:3], None)
            else:
                ctx = ours(*loc[:3], rows=block if name == "blocks" else None)
            ctx.backward(dctx)
            with tensor_parallel.get_cuda_rng_tracker().fork():
                forked = torch.rand(3)
            out[name] = ctx.detach(), [t.grad for t in loc[:3]], (torch.rand(3), forked)
        (cs, gs, ns), (co, go, no), (cb, _, _) = out["stock"], out["ours"], out["blocks"]
        kept = ours_layer._keep(*loc[:2])
        return {"ctx_equal": bool(torch.equal(co, cs)), "grads_equal": all(torch.equal(a, c) for a, c in zip(go, gs)),
                "next_equal": all(torch.equal(a, c) for a, c in zip(no, ns)), "blocks": _err(cb, cs),
                "scale": cs.abs().max().item(), "kept": 1.0 if kept is None else kept.double().mean().item()}
    finally:
        destroy()


def kept_vs_recompute(rank, world, algo="flash", s=16, b=2, heads=8, groups=8, hn=4, h=16, dropout=0.0, seed=5):
    """The backward through the forward's kept graphs against the same backward recomputing each block's
    attention (query_split.py), and how many blocks each pass computed: {"forward", "backward": attention
    blocks computed, "no_grad_kept": Kept built by a forward without grad, "y": the outputs' max difference,
    "exact": every gradient equal to the bit}."""
    import torch.distributed as dist

    from megatron_flashoverlap.ops.attention import query_split as qs_mod

    q, k, v, w, dy, _ = _globals(seed, s, b, heads, groups, hn, h, torch.float32)
    attend = Attend(causal=True, dropout_p=dropout, seed=7)
    calls, kept_built = [], []
    rows, kept_init = qs_mod.attention_rows, qs_mod.Kept.__init__

    def counting(*a, **kw):
        calls.append(torch.is_grad_enabled())
        return rows(*a, **kw)

    def counting_init(self, *a):
        kept_built.append(1)
        kept_init(self, *a)
    qs_mod.attention_rows, qs_mod.Kept.__init__ = counting, counting_init
    try:
        loc, dy_s = _shards(rank, world, q, k, v, w, dy)
        y = query_split_attention(*loc, dist.group.WORLD, attend=attend, plan=OpPlan(algo))
        forward = len(calls)
        y.backward(dy_s)
        backward = len(calls) - forward
        kept = [t.grad for t in loc]
        del kept_built[:]
        with torch.no_grad():
            query_split_attention(*_shards(rank, world, q, k, v, w, dy)[0], dist.group.WORLD, attend=attend,
                                  plan=OpPlan(algo))
        no_grad_kept = len(kept_built)
        # the recompute path: the same Function with nothing kept
        loc2, _ = _shards(rank, world, q, k, v, w, dy)
        plain = qs_mod.QuerySplitAttention.forward
        qs_mod.QuerySplitAttention.forward = staticmethod(
            lambda ctx, q, k, v, w, qs, *a: plain(ctx, q, k, v, w, qs._replace(keep=False), *a))
        try:
            y2 = query_split_attention(*loc2, dist.group.WORLD, attend=attend, plan=OpPlan(algo))
            y2.backward(dy_s)
        finally:
            qs_mod.QuerySplitAttention.forward = staticmethod(plain)
        recomputed = [t.grad for t in loc2]
    finally:
        qs_mod.attention_rows, qs_mod.Kept.__init__ = rows, kept_init
    return {"forward": forward, "backward": backward, "no_grad_kept": no_grad_kept, "y": _err(y, y2),
            "exact": all(torch.equal(a, c) for a, c in zip(kept, recomputed))}
