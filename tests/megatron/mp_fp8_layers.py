"""Worker-side bodies of tests/megatron/test_fp8_layers.py: our Megatron linears under --fp8-format with
--fp8-recipe tensorwise, against the recipe written in plain torch (tests/support/fp8_recipe.py)."""
from __future__ import annotations

import torch

from megatron_flashoverlap.megatron import models as tm
from tests.support.fp8_recipe import E4M3, E5M2, recipe_backward, recipe_cast, recipe_forward, recipe_row, scaled

BF16 = torch.bfloat16
S, B, H, N = 32, 2, 32, 64  # tokens per rank s/P * b = 32 at P = 2: every FP8 dimension a multiple of 16


def _config(world, fmt, sp=True):
    return tm.tiny_config(world, sp, hidden=H, heads=4, ffn=N, fp8=fmt, fp8_recipe="tensorwise")


def _column(cfg, flash, gather_output=False):
    from megatron_flashoverlap.config import from_dict
    from megatron_flashoverlap.megatron.linear import FlashColumnParallelLinear

    torch.manual_seed(3)
    return FlashColumnParallelLinear(H, N, config=cfg, init_method=cfg.init_method, bias=True, skip_bias_add=False,
                                     is_expert=False, gather_output=gather_output, tp_comm_buffer_name="fc1",
                                     flash_config=from_dict(flash)).to(BF16)


def _rel(a, ref):
    ref = ref.double()
    return ((a.double() - ref).abs().max() / ref.abs().max()).item()


def column(rank, world, flash, fmt="hybrid"):
    """fc1 (column, SP) under `flash` (a YAML mapping): y, dx, dW against the recipe; the sites word."""
    tm.init_tp(world)
    try:
        layer = _column(_config(world, fmt), flash)
        g = torch.Generator().manual_seed(5)
        x = (torch.randn(S * world, B, H, generator=g) * 3).to(BF16)  # the whole sequence; this rank's shard below
        dy = torch.randn(S * world, B, N // world, generator=g).to(BF16)  # this rank's columns of dy
        xs = x[rank * S:(rank + 1) * S].clone().requires_grad_()
        y, _ = layer(xs)
        y.backward(dy)
        w, b = layer.weight.detach(), layer.bias.detach()
        y_recipe, x8 = recipe_forward(x, w, b)  # x's amax: the whole sequence's (the group's MAX)
        world_dy = torch.cat([dy] * world, dim=-1)  # recipe_backward takes every rank's columns: ours only matter
        world_w = torch.cat([w] * world, dim=0)
        dx, dws = recipe_backward(x8, world_dy, world_w, world, E5M2 if fmt == "hybrid" else E4M3)
        return {"y_is_recipe": bool(torch.equal(y, y_recipe)), "dw_vs_recipe": _rel(layer.weight.grad, dws[0]),
                "ran": layer.flash_ran(), "decided": {k.word: c.pick for k, c in layer.flash_chooser.decided.items()},
                "y_vs_bf16": _rel(y, (x.float() @ w.float().t() + b.float())), "dx_shape": tuple(xs.grad.shape),
                "dx_finite": bool(torch.isfinite(xs.grad).all())}
    finally:
        tm.destroy()


def _row(cfg, flash):
    from megatron_flashoverlap.config import from_dict
    from megatron_flashoverlap.megatron.linear import FlashRowParallelLinear

    torch.manual_seed(3)
    return FlashRowParallelLinear(N, H, config=cfg, init_method=cfg.init_method, bias=True, skip_bias_add=True,
                                  is_expert=False, input_is_parallel=True, tp_comm_buffer_name="fc2",
                                  flash_config=from_dict(flash)).to(BF16)


def row(rank, world, flash, fmt="hybrid"):
    """fc2 (row, SP) under `flash`: y against the sum of the recipe's fp32 partials, dx and dW against the
    recipe's; the sites word."""
    import torch.distributed as dist

    tm.init_tp(world)
    try:
        layer = _row(_config(world, fmt), flash)
        g = torch.Generator().manual_seed(7)
        x = (torch.randn(S * world, B, N, generator=g) * 3).to(BF16)  # every rank's columns; ours below
        dy = torch.randn(S * world, B, H, generator=g).to(BF16)  # the whole sequence; this rank's rows below
        kl, rows = N // world, slice(rank * S, (rank + 1) * S)
        xs = x[..., rank * kl:(rank + 1) * kl].clone().requires_grad_()
        y, bias = layer(xs)
        y.backward(dy[rows])
        shards = [torch.empty_like(layer.weight) for _ in range(world)]
        dist.all_gather(shards, layer.weight.detach().contiguous(), group=layer.tp_group)
        w = torch.cat(shards, dim=1)  # [h, k]
        parts, dx, dws = recipe_row(x, w, dy, world, E5M2 if fmt == "hybrid" else E4M3)
        y64 = sum(q.double() for q in parts)[rows]
        return {"y_vs_recipe": _rel(y, y64), "dx_is_recipe": bool(torch.equal(xs.grad, dx[..., rank * kl:(rank + 1) * kl])),
                "dw_vs_recipe": _rel(layer.weight.grad, dws[rank]), "bias_is_param": bias is layer.bias,
                "y_vs_bf16": _rel(y, (x.float() @ w.float().t())[rows]), "ran": layer.flash_ran()}
    finally:
        tm.destroy()


def no_sp(rank, world, algo="flash"):
    """fc1 then fc2 without SP (the all-reduce operators) under `algo`: the column's output against the recipe;
    both sites say FP8; the row's inference steps against its training forward."""
    from megatron_flashoverlap.config import from_dict
    from megatron_flashoverlap.megatron.linear import FlashColumnParallelLinear, FlashRowParallelLinear

    tm.init_tp(world)
    try:
        cfg, flash = _config(world, "hybrid", sp=False), from_dict({"default": {"algo": algo}})
        torch.manual_seed(3)
        fc1 = FlashColumnParallelLinear(H, N, config=cfg, init_method=cfg.init_method, bias=False, skip_bias_add=True,
                                        is_expert=False, gather_output=False, tp_comm_buffer_name="fc1",
                                        flash_config=flash).to(BF16)
        fc2 = FlashRowParallelLinear(N, H, config=cfg, init_method=cfg.init_method, bias=False, skip_bias_add=True,
                                     is_expert=False, input_is_parallel=True, tp_comm_buffer_name="fc2",
                                     flash_config=flash).to(BF16)
        x = (torch.randn(S, B, H, generator=torch.Generator().manual_seed(9)) * 3).to(BF16)
        h, _ = fc1(x)
        y, _ = fc2(h)
        want, _ = recipe_forward(x, fc1.weight.detach(), None)  # the column: x whole (it is not split here)
        steps = {}
        with torch.no_grad():  # inference: a decode step (one token per sequence) and a prefill step, each against
            for kind, rows in (("decode", slice(0, 1)), ("prefill", slice(None))):  # the training forward of its x
                z = h[rows].detach()
                fc2.flash_step_kind = "train"
                trained = fc2(z)[0]
                fc2.flash_step_kind = kind
                steps[kind] = _rel(fc2(z)[0], trained)
        return {"h_is_recipe": bool(torch.equal(h, want)), "y_finite": bool(torch.isfinite(y).all()),
                "ran": (fc1.flash_ran(), fc2.flash_ran()), "shape": tuple(y.shape), "steps": steps}
    finally:
        tm.destroy()


def delayed(rank, world):
    """fc1 (column, SP) under --fp8-recipe delayed (history 2, max, margin 1), two training steps: step 1 casts
    with scale 1, step 2 with 448 / amax / 2 of step 1's whole x and whole weight (the MAX over the ranks);
    then its `_extra_state` into a fresh layer (the scales resume), and stock's None (a fresh state)."""
    import dataclasses

    import torch.distributed as dist

    tm.init_tp(world)
    try:
        cfg = dataclasses.replace(_config(world, "hybrid"), fp8_recipe="delayed", fp8_amax_history_len=2,
                                  fp8_amax_compute_algo="max", fp8_margin=1)
        layer, flags = _column(cfg, {"default": {"algo": "flash"}}), []
        w, b = layer.weight.detach(), layer.bias.detach()  # this rank's shard [n/P, h]
        w_amax = w.float().abs().max()  # the whole weight's: the MAX over the shards (the update's reduction)
        dist.all_reduce(w_amax, op=dist.ReduceOp.MAX, group=layer.tp_group)
        want = (torch.tensor(1.0), torch.tensor(1.0))
        for step in range(2):
            g = torch.Generator().manual_seed(20 + step)
            x = (torch.randn(S * world, B, H, generator=g) * (3 + step)).to(BF16)
            xs = x[rank * S:(rank + 1) * S].clone().requires_grad_()
            y, _ = layer(xs)
            y.backward(torch.ones_like(y))
            xq, x_inv = recipe_cast(x, E4M3, scale=want[0])
            wq, w_inv = recipe_cast(w, E4M3, scale=want[1])
            y_want = scaled(xq.reshape(-1, H), x_inv, wq, w_inv, BF16, b).view(y.shape)
            flags.append(bool(torch.equal(y, y_want)))
            want = (torch.tensor(448.0) / x.float().abs().max() / 2, torch.tensor(448.0) / w_amax / 2)
        layer.flash_step_kind = "train"
        with torch.enable_grad():
            layer(xs)  # the third forward takes step 2's amaxes
        state = layer.get_extra_state()
        fresh = _column(cfg, {"default": {"algo": "flash"}})
        fresh.set_extra_state(state)
        other = _column(cfg, {"default": {"algo": "flash"}})
        other.set_extra_state(None)
        return {"steps_match_recipe": flags, "resumed": bool(torch.equal(fresh.flash_fp8_state.scales.scales,
                                                                          layer.flash_fp8_state.scales.scales)),
                "fresh_after_none": other.flash_fp8_state.scales.scales.tolist(),
                "stock_state": _column(_config(world, "hybrid"), {"default": {"algo": "flash"}}).get_extra_state()}
    finally:
        tm.destroy()


def refused_stock_forward(rank, world):
    """gather_output under FP8 would run Megatron's forward (no FP8): the ValueError's text."""
    tm.init_tp(world)
    try:
        layer = _column(_config(world, "hybrid"), {"default": {"algo": "flash"}}, gather_output=True)
        try:
            layer(torch.randn(S, B, H, dtype=BF16))
        except ValueError as err:
            return str(err)
        return None
    finally:
        tm.destroy()
