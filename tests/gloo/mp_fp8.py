"""Worker-side bodies of tests/gloo/test_fp8.py: the FP8 all-gather + GEMM against its unfused FP8 path
(algo="reference": the stock all-gather of the bytes, one scaled GEMM) and against the recipe written in
plain torch, and the bytes its ring sends.

The recipe reference (tests/support/fp8_recipe.py) follows the recipe's definition, not the package's code: the
amax of the whole tensor (for x the gathered one, which is what a MAX all-reduce of the shards' amaxes gives),
scale = fp8_max / amax / 2^margin in fp32, a saturating cast, one torch._scaled_mm with the inverse scales and
fp32 accumulation; gradients e5m2 under "hybrid", each rank's dy and weight shard scaled from their own amax.
"""
from __future__ import annotations

import torch

import megatron_flashoverlap as fo
from benchmarks.harness.wire import Sends
from tests.gloo.mp_ops import _raises
from tests.support.fp8_recipe import E4M3, E5M2, recipe_backward, recipe_cast, recipe_forward, recipe_row, scaled

BF16, F32 = torch.bfloat16, torch.float32
ROWS, B, H, N_PER_RANK = 16, 2, 32, 16  # s/P * b = 32 tokens: 16 per wgrad slice even when a shard is halved


def _globals(world, seed=0):
    g = torch.Generator().manual_seed(seed)
    s, n = ROWS * world, N_PER_RANK * world
    x = (torch.randn(s, B, H, generator=g) * 3).to(BF16)
    w = (torch.randn(n, H, generator=g) / H ** 0.5).to(BF16)
    return x, w, torch.randn(n, generator=g).to(BF16), torch.randn(s, B, n, generator=g).to(BF16)


def _shards(rank, x, w, bias):
    rows, cols = slice(rank * ROWS, (rank + 1) * ROWS), slice(rank * N_PER_RANK, (rank + 1) * N_PER_RANK)
    return [t[i].clone().requires_grad_() for t, i in ((x, rows), (w, cols), (bias, cols))]


def _run(rank, world, plan, seed=0):
    """-> (y, dx, dw, db) of all_gather_matmul on this rank's shards under `plan`."""
    x, w, bias, dy = _globals(world, seed)
    xs, ws, bs = _shards(rank, x, w, bias)
    y = fo.all_gather_matmul(xs, ws, bias=bs, plan=plan)
    y.backward(dy[..., rank * N_PER_RANK:(rank + 1) * N_PER_RANK])
    return y.detach(), xs.grad, ws.grad, bs.grad


def _rel(a, ref):
    ref = ref.double()
    return ((a.double() - ref).abs().max() / ref.abs().max()).item()


def ag_fp8(rank, world, algo, fmt="hybrid", margin=0, wire="input", keep=False, hop_chunks=None):
    """The FP8 operator under `algo` against algo="reference" (bitwise flags and errors) and the recipe."""
    recipe = fo.Fp8Recipe(fmt, margin=margin)
    knobs = dict(fp8=recipe, wire_dtype=wire, keep_gathered=keep, hop_chunks=hop_chunks,
                 num_chunks=2 if algo == "slicing" else None)
    got = _run(rank, world, fo.OpPlan(algo, **knobs))
    ref = _run(rank, world, fo.OpPlan("reference", fp8=recipe, wire_dtype=wire, keep_gathered=keep))
    x, w, bias, dy = _globals(world)
    y_recipe, x8 = recipe_forward(x, w[rank * N_PER_RANK:(rank + 1) * N_PER_RANK],
                                  bias[rank * N_PER_RANK:(rank + 1) * N_PER_RANK], margin)
    dx_recipe, dws = recipe_backward(x8, dy, w, world, E5M2 if fmt == "hybrid" else E4M3, margin)
    dequant = (x8[0].double() * x8[1].double()).reshape(-1, H)  # the GEMM in fp64 on the dequantized operands
    wq, w_inv = recipe_cast(w[rank * N_PER_RANK:(rank + 1) * N_PER_RANK], E4M3, margin)
    y64 = (dequant @ (wq.double() * w_inv.double()).t()).view(ROWS * world, B, -1) + bias[
        rank * N_PER_RANK:(rank + 1) * N_PER_RANK].double()
    return {f"{k}_is_reference": bool(torch.equal(a, b)) for k, a, b in zip(("y", "dx", "dw", "db"), got, ref)} | {
        "y_is_recipe": bool(torch.equal(got[0], y_recipe)), "y_vs_fp64": _rel(got[0], y64),
        "dx_vs_recipe": _rel(got[1], dx_recipe[rank * ROWS:(rank + 1) * ROWS]), "dw_vs_recipe": _rel(got[2], dws[rank]),
        "dw_is_recipe": bool(torch.equal(got[2], dws[rank])), "dw_vs_reference": _rel(got[2], ref[2])}


def wire_bytes(rank, world, algo):
    """Bytes and dtypes each rank's ring sends, forward and backward, with and without the FP8 recipe."""
    out = {}
    for name, plan in (("fp8", fo.OpPlan(algo, fp8=fo.Fp8Recipe("hybrid"))), ("bf16", fo.OpPlan(algo))):
        x, w, bias, dy = _globals(world)
        xs, ws, bs = _shards(rank, x, w, bias)
        with Sends() as fwd:
            y = fo.all_gather_matmul(xs, ws, bias=bs, plan=plan)
        with Sends() as bwd:
            y.backward(dy[..., rank * N_PER_RANK:(rank + 1) * N_PER_RANK])
        for key, m in (("fwd", fwd), ("bwd", bwd)):
            out[f"{name}_{key}"] = (sum(n for _, n in m.sent), sorted({d for d, _ in m.sent}))
    out["x_shard_numel"], out["dx_numel"] = ROWS * B * H, ROWS * B * H
    return out


def delayed_steps(rank, world, algo, margin=1):
    """Two steps of the delayed recipe (history 2, max): step 1 casts with scale 1, the update agrees each
    role's scale over the group, step 2 casts x with 448 / amax(step 1's global x) / 2^margin and the weight
    with the same of step 1's global weight (the max of the shards' amaxes). -> per step, whether y is the
    recipe's bit for bit, and this rank's scales after the updates."""
    recipe = fo.Fp8Recipe("hybrid", "delayed", margin=margin, amax_history_len=2, amax_compute_algo="max")
    scales, flags, want = fo.DelayedScales(recipe), [], (torch.tensor(1.0), torch.tensor(1.0))
    seen = []  # (amax x, amax w) of each step's global tensors
    for step in range(2):
        x, w, bias, _ = _globals(world, seed=10 + step)
        xs, ws, bs = (t.detach() for t in _shards(rank, x, w, bias))
        y = fo.all_gather_matmul_fp8(xs, ws, bias=bs, plan=fo.OpPlan(algo, fp8=recipe), scales=scales)
        xq, wq = ((t.float() * sc).clamp(-448, 448).to(E4M3) for t, sc in zip((x, ws), want))
        y_recipe = scaled(xq.reshape(-1, H), torch.reciprocal(want[0]), wq, torch.reciprocal(want[1]), BF16, bs)
        flags.append(bool(torch.equal(y, y_recipe.view(y.shape))))
        seen.append(torch.stack([x.float().abs().max(), w.float().abs().max()]))
        want = tuple(torch.tensor(448.0) / torch.stack(seen).amax(0) / 2.0 ** margin)  # the window's max
        scales.update()
    return {"steps_match_recipe": flags, "scales": scales.scales.tolist()[:2], "want": [t.item() for t in want]}


def hop_slices_too_small(rank, world):
    """hop_chunks=2 on a shard of 8 rows x 2: 8 tokens per wgrad slice, not a multiple of 16 -> ValueError."""
    xs = torch.randn(8, 2, 32, dtype=BF16)
    ws = torch.randn(16, 32, dtype=BF16, requires_grad=True)
    plan = fo.OpPlan("flash", hop_chunks=2, fp8=fo.Fp8Recipe())
    return _raises(lambda: fo.all_gather_matmul(xs, ws, plan=plan))


# ---------------------------------------------------------------- the row operator (GEMM + reduce-scatter)

K_PER_RANK = 16  # x [s, b, k/P], w [H, k/P]: the forward's K and the dgrad's N


def _row_globals(world, seed=0, s=None, b=B):
    g = torch.Generator().manual_seed(seed)
    s, k = ROWS * world if s is None else s, K_PER_RANK * world
    x = (torch.randn(s, b, k, generator=g) * 3).to(BF16)
    w = (torch.randn(H, k, generator=g) / k ** 0.5).to(BF16)
    return x, w, torch.randn(s, b, H, generator=g).to(BF16)


def _row_shards(rank, x, w):
    cols = slice(rank * K_PER_RANK, (rank + 1) * K_PER_RANK)
    return [t[..., cols].contiguous().requires_grad_() for t in (x, w)]


def _own(dy, y, rank):
    """dy's rows of this rank's y: its block under SP (y [s/P, b, h]), all of dy without (y replicated)."""
    r = y.shape[0]
    return dy if r == dy.shape[0] else dy[rank * r:(rank + 1) * r]


def _row_run(rank, world, plan, op=fo.matmul_reduce_scatter_fp8, seed=0, scales=None, into=False, shape=()):
    """-> (y, dx, dw) of a row-parallel FP8 operator (`op`) on this rank's shards under `plan`; into: dW added
    into an fp32 buffer (Megatron's main_grad), then rounded to bf16 here; shape: (s, b) of x."""
    x, w, dy = _row_globals(world, seed, *shape)
    xs, ws = _row_shards(rank, x, w)
    buf = torch.zeros(ws.shape, dtype=F32) if into else None
    y = op(xs, ws, plan=plan, scales=scales, wgrad=fo.WgradRoute(into=buf))
    y.backward(_own(dy, y, rank))
    return y.detach(), xs.grad, (buf.to(BF16) if into else ws.grad)


def _row_report(rank, world, got, ref, recipe_out):
    """Flags and errors of a row-parallel FP8 run (got), its reference (ref) and the recipe's (parts, dx, dws)."""
    (parts, dx, dws), cols = recipe_out, slice(rank * K_PER_RANK, (rank + 1) * K_PER_RANK)
    y32, y64 = _own(sum(parts), got[0], rank), _own(sum(p.double() for p in parts), got[0], rank)
    return {f"{k}_is_reference": bool(torch.equal(a, b)) for k, a, b in zip(("y", "dx", "dw"), got, ref)} | {
        "y_vs_recipe": _rel(got[0], y64), "y_is_fp32_sum": bool(torch.equal(got[0], y32.to(BF16))),
        "dx_is_recipe": bool(torch.equal(got[1], dx[..., cols])), "dw_is_recipe": bool(torch.equal(got[2], dws[rank])),
        "dw_vs_recipe": _rel(got[2], dws[rank]), "dw_vs_reference": _rel(got[2], ref[2]), "y_out": got[0]}


def rs_fp8(rank, world, algo, fmt="hybrid", margin=0, wire="input", hop_chunks=None, into=False):
    """The FP8 row operator under `algo` against algo="reference" (bitwise flags) and the recipe: y against the
    fp64 sum of every rank's recipe partial (and bitwise against their fp32 sum), dx and dW against the
    recipe's."""
    recipe = fo.Fp8Recipe(fmt, margin=margin)
    plan = fo.OpPlan(algo, fp8=recipe, wire_dtype=wire, hop_chunks=hop_chunks,
                     num_chunks=2 if algo == "slicing" else None)
    got = _row_run(rank, world, plan, into=into)
    ref = _row_run(rank, world, fo.OpPlan("reference", fp8=recipe, wire_dtype=wire))
    x, w, dy = _row_globals(world)
    return _row_report(rank, world, got, ref, recipe_row(x, w, dy, world, E5M2 if fmt == "hybrid" else E4M3, margin))


def ar_fp8(rank, world, algo, wire="input", s=None, b=B, decode=None):
    """matmul_all_reduce in FP8 (row-parallel, no SP: y replicated, backward local) against algo="reference"
    and the recipe, as rs_fp8; s, b: x's sequence and batch (s not a multiple of P: padded); decode: the
    plan's decode_all_reduce (x [1, b, k/P] takes the decode branch with it)."""
    recipe, chunks = fo.Fp8Recipe("hybrid"), 2 if algo == "slicing" else None
    plan = fo.OpPlan(algo, fp8=recipe, wire_dtype=wire, num_chunks=chunks, decode_all_reduce=decode)
    got = _row_run(rank, world, plan, fo.matmul_all_reduce_fp8, shape=(s, b))
    ref = _row_run(rank, world, fo.OpPlan("reference", fp8=recipe, wire_dtype=wire), fo.matmul_all_reduce_fp8,
                   shape=(s, b))
    x, w, dy = _row_globals(world, 0, s, b)
    return _row_report(rank, world, got, ref, recipe_row(x, w, dy, world, E5M2))


def dgrad_ar_fp8(rank, world, algo, wire="input"):
    """matmul_allreduce_dgrad in FP8 (column-parallel, no SP: x replicated, dx all-reduced) against
    algo="reference" and the recipe: y bit for bit, dx against the fp64 sum of every rank's partial, dW against
    the one GEMM."""
    recipe, cols = fo.Fp8Recipe("hybrid"), slice(rank * N_PER_RANK, (rank + 1) * N_PER_RANK)
    plan = fo.OpPlan(algo, fp8=recipe, wire_dtype=wire, num_chunks=2 if algo == "slicing" else None)
    x, w, bias, dy = _globals(world)

    def run(plan):
        xs, ws, bs = (t.clone().requires_grad_() for t in (x, w[cols], bias[cols]))
        y = fo.matmul_allreduce_dgrad_fp8(xs, ws, bias=bs, plan=plan)
        y.backward(dy[..., cols])
        return y.detach(), xs.grad, ws.grad, bs.grad
    got, ref = run(plan), run(fo.OpPlan("reference", fp8=recipe, wire_dtype=wire))
    y_want, x8 = recipe_forward(x, w[cols], bias[cols])
    dx_want, dws = recipe_backward(x8, dy, w, world, E5M2)
    return {f"{k}_is_reference": bool(torch.equal(a, b)) for k, a, b in zip(("y", "dx", "dw", "db"), got, ref)} | {
        "y_is_recipe": bool(torch.equal(got[0], y_want)), "dx_vs_recipe": _rel(got[1], dx_want),
        "dw_is_recipe": bool(torch.equal(got[2], dws[rank])), "dw_vs_recipe": _rel(got[2], dws[rank]),
        "dx_out": got[1]}


def row_wire_bytes(rank, world, algo):
    """Bytes and dtypes each rank's row ring sends, forward (the reduce-scatter of partials) and backward (the
    all-gather of dy), with and without the FP8 recipe."""
    out = {}
    for name, plan in (("fp8", fo.OpPlan(algo, fp8=fo.Fp8Recipe("hybrid"))), ("bf16", fo.OpPlan(algo))):
        x, w, dy = _row_globals(world)
        xs, ws = _row_shards(rank, x, w)
        with Sends() as fwd:
            y = fo.matmul_reduce_scatter(xs, ws, plan=plan)
        with Sends() as bwd:
            y.backward(dy[rank * ROWS:(rank + 1) * ROWS])
        for key, m in (("fwd", fwd), ("bwd", bwd)):
            out[f"{name}_{key}"] = (sum(n for _, n in m.sent), sorted({d for d, _ in m.sent}))
    out["y_numel"] = out["dy_shard_numel"] = ROWS * B * H
    return out


def row_delayed_steps(rank, world, algo, margin=1, op="matmul_reduce_scatter_fp8"):
    """Two steps of the delayed recipe (history 2, max) on a row-parallel op (matmul_reduce_scatter_fp8 or
    matmul_all_reduce_fp8), fp32 partials on the wire, P = 2: each step's y is the fp32 sum of the recipe's
    partials and dx the recipe's, both bit for bit, cast with scale 1 at step 1 and at step 2
    with fmt_max / amax(step 1's global tensor) / 2^margin per role (x, w, dy: the MAX over the shards that
    the update agrees). -> per step the flags, and this rank's scales after the updates."""
    recipe = fo.Fp8Recipe("hybrid", "delayed", margin=margin, amax_history_len=2, amax_compute_algo="max")
    scales, flags, want, seen = fo.DelayedScales(recipe), [], (torch.tensor(1.0),) * 3, []
    cols = slice(rank * K_PER_RANK, (rank + 1) * K_PER_RANK)
    for step in range(2):
        plan = fo.OpPlan(algo, fp8=recipe, wire_dtype="fp32")
        y, dx, _ = _row_run(rank, world, plan, getattr(fo, op), 10 + step, scales)
        x, w, dy = _row_globals(world, seed=10 + step)
        parts, dx_want, _ = recipe_row(x, w, dy, world, E5M2, margin, scales=want)
        flags.append(bool(torch.equal(y, _own(sum(parts), y, rank).to(BF16)) and torch.equal(dx, dx_want[..., cols])))
        seen.append(torch.stack([t.float().abs().max() for t in (x, w, dy)]))
        want = tuple(torch.tensor([448.0, 448.0, 57344.0]) / torch.stack(seen).amax(0) / 2.0 ** margin)
        scales.update()
    return {"steps_match_recipe": flags, "scales": scales.scales.tolist(), "want": [t.item() for t in want]}


def row_hop_slices_too_small(rank, world):
    """hop_chunks=2 on y's shard of 8 rows x 2: 8 tokens per wgrad slice of dy, not a multiple of 16."""
    x = torch.randn(8 * world, 2, 16, dtype=BF16)
    w = torch.randn(32, 16, dtype=BF16, requires_grad=True)
    plan = fo.OpPlan("flash", hop_chunks=2, fp8=fo.Fp8Recipe())
    return _raises(lambda: fo.matmul_reduce_scatter(x, w, plan=plan))


def nosp_wire_bytes(rank, world, algo):
    """Bytes and dtypes each rank sends in the all-reduce of the row operator's forward and of the column
    operator's backward (no SP), with and without the FP8 recipe."""
    out, cols = {}, slice(rank * N_PER_RANK, (rank + 1) * N_PER_RANK)
    for name, plan in (("fp8", fo.OpPlan(algo, fp8=fo.Fp8Recipe("hybrid"))), ("bf16", fo.OpPlan(algo))):
        x, w, dy = _row_globals(world)
        xs, ws = _row_shards(rank, x, w)
        with Sends() as fwd:
            fo.matmul_all_reduce(xs, ws, plan=plan)
        x, w, bias, dy = _globals(world)
        y = fo.matmul_allreduce_dgrad(x.clone().requires_grad_(), w[cols].clone().requires_grad_(), plan=plan)
        with Sends() as bwd:
            y.backward(dy[..., cols])
        for key, m in (("row_fwd", fwd), ("column_bwd", bwd)):
            out[f"{name}_{key}"] = (sum(n for _, n in m.sent), sorted({d for d, _ in m.sent}))
    return out
