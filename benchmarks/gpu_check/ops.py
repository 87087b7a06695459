"""Every public operator as a zero-argument call on one rank of torch's fake process group: shapes only,
no data exchange (a fake receive writes nothing). What benchmarks/gpu_check/run.py and tests/gpu run under
`torch.cuda.set_sync_debug_mode("error")`, and what the dry run exercises on CPU.

    fake_group(world, rank=0)                   context manager: the fake backend as the default group
    operator_calls(world, device, dtype, ctx)   -> {name: Call}; call.forward() -> output; call.fn() runs
                                                   forward (+ backward) -> (output, grads of the leaves),
                                                   call.shapes their expected shapes
    flash_layer(world, device, dtype, ctx)      -> Call: one Flash MLP block, y = RS(gelu(AG(x) W1^T) W2^T)
    first_sync(fn)                              -> None, or the message of the first host sync fn() makes

Sizes (by default small: the checks are about syncs, shapes and dtypes): s = 64 P tokens, b = 2, h = 256, ffn 4h,
16 query heads in 8 groups of hn = 16 (divisible by P = 8 for Ulysses). The Ulysses operators take only
"flash" | "reference": under algo="flash_bidir" they run "flash"; all_reduce runs "ring" under a fused algo.
What the fake group cannot show:
ProcessGroupNCCL's `work.wait(timeout)` polls on the host without a CUDA sync call, so only the host
run-ahead check on two or more GPUs (benchmarks/gpu_check/multi.py, part f) catches that.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

import megatron_flashoverlap.ops as fo
from megatron_flashoverlap.config.plan import Fp8Recipe

B, H, HEADS, GROUPS, HN = 2, 256, 16, 8, 16
FUSED = ("flash", "flash_bidir")


@dataclass
class Call:
    forward: Callable[[], torch.Tensor]
    shapes: tuple
    leaves: tuple = ()

    def fn(self) -> tuple:
        """forward, then backward of sum(output) where there are leaves -> (output, leaf grads...)."""
        y = self.forward()
        if not self.leaves:
            return (y,)
        y.backward(torch.ones_like(y))
        return (y,) + tuple(t.grad for t in self.leaves)


@contextlib.contextmanager
def fake_group(world: int, rank: int = 0):
    """torch's fake backend as the default process group of `world` ranks (this process plays `rank`)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    if dist.is_initialized():
        raise RuntimeError("fake_group: a process group is already initialized in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def first_sync(fn: Callable[[], object]) -> str | None:
    """None if fn() ran without a host sync under set_sync_debug_mode("error"), else the error text."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return None
    except RuntimeError as e:
        return str(e).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _leaf(shape, device, dtype, scale=1.0) -> torch.Tensor:
    return (torch.randn(shape, device=device, dtype=torch.float32) * scale).to(dtype).requires_grad_()


def _tp_calls(p, device, dtype, ctx, algo, rows, h, plan=None) -> dict:
    s, n, f, H = rows * p, 3 * h // p, 4 * h // p, h  # noqa: N806 (H: the hidden size of these calls)
    t = lambda *shape: _leaf(shape, device, dtype, shape[-1] ** -0.5)  # noqa: E731
    xs, w1, bias, xk, w2, xr = t(s // p, B, H), t(n, H), t(n), t(s, B, f), t(H, f), t(s, B, H)
    kw = dict(algo=algo, context=ctx) if plan is None else dict(plan=plan, context=ctx)
    return {
        "all_gather_matmul": Call(lambda: fo.all_gather_matmul(xs, w1, bias=bias, **kw),
                                  ((s, B, n), (s // p, B, H), (n, H), (n,)), (xs, w1, bias)),
        "matmul_reduce_scatter": Call(lambda: fo.matmul_reduce_scatter(xk, w2, **kw),
                                      ((s // p, B, H), (s, B, f), (H, f)), (xk, w2)),
        "matmul_all_reduce": Call(lambda: fo.matmul_all_reduce(xk, w2, **kw), ((s, B, H), (s, B, f), (H, f)),
                                  (xk, w2)),
        "matmul_allreduce_dgrad": Call(lambda: fo.matmul_allreduce_dgrad(xr, w1, **kw),
                                       ((s, B, n), (s, B, H), (n, H)), (xr, w1)),
    }


def fp8_calls(p, device, dtype, ctx, algo, rows=64, h=H) -> dict:
    """{"<TP operator> FP8": Call}: the four TP operators of _tp_calls with OpPlan(algo, fp8=hybrid tensorwise)
    (every GEMM slice a torch._scaled_mm: CUDA must accept the layouts our code hands it)."""
    plan = fo.OpPlan(algo, num_chunks=2 if algo == "slicing" else None, fp8=Fp8Recipe("hybrid"))
    return {f"{name} FP8": call for name, call in _tp_calls(p, device, dtype, ctx, algo, rows, h, plan).items()}


def _attention_calls(p, device, dtype, ctx, algo, rows, h) -> dict:
    s, hp, gp, H = rows * p, HEADS // p, GROUPS // p, h  # noqa: N806
    t = lambda *shape: _leaf(shape, device, dtype)  # noqa: E731
    q, k, v, wo = t(s, B, hp, HN), t(s, B, gp, HN), t(s, B, gp, HN), t(H, hp * HN)
    qs, ks, vs = t(s // p, B, HEADS, HN), t(s // p, B, GROUPS, HN), t(s // p, B, GROUPS, HN)
    xs, wqkv, wproj = t(s // p, B, H), t(GROUPS * (HEADS // GROUPS + 2) * HN, H), t(H, HEADS * HN)
    kw = dict(algo="flash" if algo in FUSED else "reference", context=ctx)  # Ulysses: flash | reference
    return {
        "query_split_attention": Call(lambda: fo.query_split_attention(q, k, v, wo, plan=fo.OpPlan(algo), context=ctx),
                                      ((s // p, B, H), q.shape, k.shape, v.shape, wo.shape), (q, k, v, wo)),
        "ulysses_attention": Call(lambda: fo.ulysses_attention(qs, ks, vs, **kw),
                                  ((s // p, B, HEADS * HN), qs.shape, ks.shape, vs.shape), (qs, ks, vs)),
        "ulysses_fused_attention": Call(
            lambda: fo.ulysses_fused_attention(xs, wqkv, wproj, attend=fo.Attend(heads=HEADS), **kw),
            ((s // p, B, H), xs.shape, wqkv.shape, wproj.shape), (xs, wqkv, wproj)),
    }


def _flat_calls(p, device, dtype, ctx, algo, rows, h) -> dict:
    s, n, k, H = rows * p, 96, 64, h  # noqa: N806
    dy, x = (torch.randn(shape, device=device).to(dtype) for shape in ((s, B, n), (s, B, k)))
    grad = torch.zeros(p * -(-n * k // p), device=device, dtype=dtype)  # [L], L a multiple of P
    msg = torch.randn(B * H, device=device).to(dtype)
    ar_algo = "ring" if algo in FUSED else "reference"
    return {
        "all_reduce": Call(lambda: fo.all_reduce(msg, algo=ar_algo, context=ctx), (msg.shape,)),
        "matmul_wgrad_reduce_scatter": Call(lambda: _wgrad_rs(dy, x, grad, algo, ctx), (grad.shape,)),
    }


def _wgrad_rs(dy, x, grad, algo, ctx) -> torch.Tensor:
    fo.matmul_wgrad_reduce_scatter(dy, x, fo.DPBucket(grad, 0), None, algo=algo, context=ctx)
    return grad


def operator_calls(world: int, device, dtype: torch.dtype, ctx, algo: str = "flash", rows: int = 64,
                   hidden: int = H) -> dict:
    """{public operator: Call} on one rank of a group of `world` (the fake group, or any real one), with
    s = rows * world tokens and hidden size `hidden` (the attention ops keep 16 heads of 16)."""
    calls = {}
    for part in (_tp_calls, _attention_calls, _flat_calls):
        calls.update(part(world, device, dtype, ctx, algo, rows, hidden))
    return calls


def flash_layer(world: int, device, dtype: torch.dtype, ctx, tokens: int = 0, hidden: int = H,
                algo: str = "flash") -> Call:
    """One Flash MLP block of a TP=world rank: x_s [s/P, b, h] -> y_s [s/P, b, h], forward + backward."""
    s = tokens or 64 * world
    t = lambda *shape: _leaf(shape, device, dtype, shape[-1] ** -0.5)  # noqa: E731
    xs, w1, w2 = t(s // world, 1, hidden), t(4 * hidden // world, hidden), t(hidden, 4 * hidden // world)

    def forward():
        h1 = F.gelu(fo.all_gather_matmul(xs, w1, algo=algo, context=ctx))
        return fo.matmul_reduce_scatter(h1, w2, algo=algo, context=ctx)

    return Call(forward, ((s // world, 1, hidden), xs.shape, w1.shape, w2.shape), (xs, w1, w2))


def layer_forward(world: int, device, dtype: torch.dtype, ctx, tokens: int, hidden: int):
    """-> (x_s static input [s/P, 1, h], forward() -> y_s) of one Flash MLP block, no autograd (graph capture)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    mk = lambda *shape: (torch.randn(shape, generator=g) * shape[-1] ** -0.5).to(device, dtype)  # noqa: E731
    xs, w1, w2 = mk(tokens // world, 1, hidden), mk(4 * hidden // world, hidden), mk(hidden, 4 * hidden // world)

    def forward():
        with torch.no_grad():
            h1 = F.gelu(fo.all_gather_matmul(xs, w1, context=ctx))
            return fo.matmul_reduce_scatter(h1, w2, context=ctx)

    return xs, forward
