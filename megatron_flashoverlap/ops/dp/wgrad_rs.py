"""Weight-gradient GEMM fused with the data-parallel reduce-scatter of a flat gradient bucket.

    dy [s, b, n]    x [s, b, k]    dW [n, k] = dy^T x  (the wgrad of a linear whose weight is [n, k])
    bucket = DPBucket(grad_flat, offset, scale, on_local): where dW goes
    grad_flat [L]   the bucket's gradient buffer, L = D * S (D = DP group size, S = shard size);
                    W's gradient occupies grad_flat[offset : offset + n*k] (row-major); the rest of the
                    bucket is padding (or gradients accumulated earlier: they are reduced too)
    result: grad_flat[r*S : (r+1)*S] = scale * sum over DP ranks q of (grad_flat_q + dW_q)[r*S : (r+1)*S]
            (what Megatron's `start_grad_sync` computes: scale the bucket, reduce-scatter it)

"flash": the Flash-RS ring over the D shards (`reduce_scatter_ring`, own shard last). The partial of
shard d is produced when the ring needs it: the rows of dW that cover shard d (one GEMM slice; a row
cut by a shard boundary is computed for both shards), plus the gradient already accumulated there, times
`scale`; it goes to the next rank at once while the GEMM slice of the next shard runs:

    comm     |            | shard r-1 -> next  | shard r-2 -> next  | ... | shard r+1 -> next
    compute  | GEMM r-1   | GEMM r-2 (+ add)   | GEMM r-3 (+ add)   | ... | GEMM r (own, + add)

The own shard is made and summed in place in the bucket (an fp32 bucket; a bf16/fp16 one sums in an fp32
slot and is written once at the end). Only the last add is exposed; the whole bucket's reduce-scatter
hides under the wgrad GEMM of this layer (stock Megatron starts it after the GEMM and the last bucket of
the backward stays exposed).
Partials are summed in fp32 when the buffer is bf16/fp16 and travel in the wire dtype (OpPlan.wire:
"input", the buffer's dtype, stock's bytes; or "fp32"; runtime/numerics.py); OpPlan.hop_chunks (flash): the
pieces each shard is made and sent in (default 1). "reference": add dW into the
buffer, scale, one stock reduce-scatter (Megatron's own order of operations; in fp32 for wire_dtype="fp32").
bucket.on_local(part, scale) (optional): called with every LOCAL part of (grad_flat + dW) * scale before it leaves
this rank (the ring: one span per shard, scaled already; the reference: the whole bucket, scale 1), e.g. to
check the local gradient for NaN as Megatron does before its collective (part / scale is the unscaled
gradient); the parts tile the bucket once.
Plain functions registered as "matmul_wgrad_reduce_scatter" in ops/registry.py, (dy, x, bucket, group, ctx,
plan); `force_reference()` reaches this operator too.
"""
from __future__ import annotations

from typing import Callable, NamedTuple

import torch

from ...runtime import OverlapContext, Producer, default_context, group_info, names_call, produce_and_scatter
from ...runtime import reduce_scatter_into, sums, wgrad, wire_dtype
from ...runtime.numerics import flat
from ..checks import peers_agree
from ..registry import OpPlan, plain, plan_of, register, resolve, ring_of

OP = "matmul_wgrad_reduce_scatter"
_INPUT_WIRE = OpPlan("reference")  # the widened copy's own reduce-scatter: in its (fp32) dtype


class DPBucket(NamedTuple):
    """Where dW goes in a DP gradient bucket: grad_flat [L] holds W's gradient at `offset`; the bucket is
    scaled by `scale`; on_local(part, scale) sees every local part before it leaves (module docstring)."""
    grad_flat: torch.Tensor
    offset: int
    scale: float = 1.0
    on_local: Callable | None = None


def wgrad_flat_span(dy, x, offset: int, a: int, b: int, out: torch.Tensor) -> None:
    """out [b-a] += dW.flatten()[a-offset : b-offset] over the part of [a, b) that W covers."""
    k = x.shape[-1]
    numel = dy.shape[-1] * k
    lo, hi = max(a - offset, 0), min(b - offset, numel)
    if hi <= lo:
        return
    r0, r1 = lo // k, -(-hi // k)  # rows that cover flat [lo, hi)
    rows = wgrad(dy, x, slice(r0, r1)).reshape(-1)[lo - r0 * k:hi - r0 * k]
    out[lo + offset - a:hi + offset - a].add_(rows.to(out.dtype))


@register(OP, "reference")
def wgrad_reduce_scatter_reference(dy, x, bucket: DPBucket, group, ctx, plan: OpPlan) -> None:
    """Megatron's order: grad_flat[W] += dW; grad_flat *= scale; reduce-scatter into the own shard."""
    grad_flat, offset = bucket.grad_flat, bucket.offset
    rank, world = group_info(group)
    if wire_dtype(grad_flat.dtype, plan.wire_dtype) != grad_flat.dtype:  # fp32 on the wire: reduce a widened copy
        wide = grad_flat.to(wire_dtype(grad_flat.dtype, plan.wire_dtype))
        wgrad_reduce_scatter_reference(dy, x, bucket._replace(grad_flat=wide), group, ctx, _INPUT_WIRE)
        grad_flat.copy_(wide)
        return
    w_view = grad_flat[offset:offset + dy.shape[-1] * x.shape[-1]]
    w_view.add_(wgrad(dy, x).reshape(-1).to(grad_flat.dtype))
    if bucket.on_local is not None:
        bucket.on_local(grad_flat, 1.0)
    if bucket.scale != 1.0:
        grad_flat.mul_(bucket.scale)
    shard = grad_flat.numel() // world
    out = grad_flat[rank * shard:(rank + 1) * shard]
    if world > 1:
        reduce_scatter_into(out, grad_flat, group)


def produce_span_into(dy, x, bucket: DPBucket, a: int, b: int, out: torch.Tensor) -> None:
    """out [b-a] (acc dtype) <- (grad_flat[a:b] + dW.flatten()[a-offset : b-offset] where W covers it) * scale.

    The whole rows of W in [a, b) are ONE addmm into `out` (beta = alpha = scale: the bucket's earlier
    gradient, the GEMM and the scaling in the GEMM's own pass) where the operands share out's dtype;
    the cut rows at the two ends, and mixed dtypes, go through wgrad_flat_span."""
    grad_flat, offset, scale = bucket.grad_flat, bucket.offset, bucket.scale
    k = x.shape[-1]
    lo, hi = max(a - offset, 0), min(b - offset, dy.shape[-1] * k)  # W's flat range inside [a, b)
    r0, r1 = -(-lo // k), hi // k  # whole rows of W inside it
    fused = hi > lo and r1 > r0 and dy.dtype == x.dtype == grad_flat.dtype == out.dtype
    if not fused:
        out.copy_(grad_flat[a:b])
        wgrad_flat_span(dy, x, offset, a, b, out)
        if scale != 1.0:
            out.mul_(scale)
        return
    m0, m1 = offset + r0 * k, offset + r1 * k  # the whole rows, in bucket coordinates
    dst, earlier = out[m0 - a:m1 - a].view(r1 - r0, k), grad_flat[m0:m1].view(r1 - r0, k)
    if dst.data_ptr() == earlier.data_ptr():  # out is the bucket's own shard (the ring's own_into)
        dst.addmm_(flat(dy)[:, r0:r1].t(), flat(x), beta=scale, alpha=scale)
    else:
        torch.addmm(earlier, flat(dy)[:, r0:r1].t(), flat(x), beta=scale, alpha=scale, out=dst)
    for e0, e1 in ((a, m0), (m1, b)):  # the cut rows and the span outside W
        if e1 > e0:
            produce_span_into(dy, x, bucket, e0, e1, out[e0 - a:e1 - a])


@register(OP, "flash")
@register(OP, "flash_bidir")
def wgrad_reduce_scatter_ring(dy, x, bucket: DPBucket, group, ctx: OverlapContext, plan: OpPlan, *,
                              defer_last: bool = False):
    """Flash-RS of (grad_flat + dW) * scale over `group`, dW produced shard by shard into the ring's own
    slot (produce_span_into: no copy of the partial); own shard last.
    plan.hops c: each shard made and sent in c pieces (the first piece leaves after 1/c of its GEMM).
    defer_last: every GEMM slice runs now; -> finish(), which waits on the last hop and writes the own shard."""
    grad_flat, on_local = bucket.grad_flat, bucket.on_local
    rank, world = group_info(group)
    shard = grad_flat.numel() // world
    rule = sums(grad_flat.dtype, grad_flat.device, plan.wire_dtype)

    def produce(span, out):
        produce_span_into(dy, x, bucket, span[0], span[1], out)
        if on_local is not None:
            on_local(out, bucket.scale)

    mine = grad_flat[rank * shard:(rank + 1) * shard]
    producer = Producer(produce, into=True, own_into=mine if rule.acc == grad_flat.dtype else None)
    own = produce_and_scatter(producer, (shard,), rule, group, ctx, ring_of(plan, "dp.rs"), defer_last=defer_last)

    def finish() -> None:
        result = own() if defer_last else own
        if result.data_ptr() != mine.data_ptr():  # summed in the ring's slot (a bf16/fp16 bucket: fp32 sums)
            mine.copy_(result)
    if defer_last:
        return finish
    finish()


@names_call(OP)  # a dead peer's error names this operator, here or at the deferred finish()
def matmul_wgrad_reduce_scatter(dy: torch.Tensor, x: torch.Tensor, bucket: DPBucket, group, *,
                                algo: str | None = None, plan: OpPlan | None = None,
                                context: OverlapContext | None = None, defer_last: bool = False):
    """Plain op (no autograd): own shard of bucket.grad_flat <- scale * sum_ranks (grad_flat + dy^T x placed
    at bucket.offset). grad_flat [L] with L divisible by the group size; dy [.., n], x [.., k],
    n*k <= L - offset. bucket.on_local(part, scale): sees every local part (times scale) before it is sent
    (module docstring). algo: the shorthand of plan=OpPlan(algo) ("flash", "flash_bidir", "reference");
    plan.hop_chunks (flash): pieces per shard of the ring (default 1), plan.wire_dtype: the wire dtype.
    defer_last: -> finish(): the ring's last hop is waited (and the own shard written) when it is called; the
    GEMM has run and every local part was seen; finish before the next call on the same `context` (its ring
    buffers). The reference and a group of 1 finish at once (finish() does nothing)."""
    plan = resolve(OP, plan_of(OP, algo, plan))
    rank, world = group_info(group)
    n, k, grad_flat = dy.shape[-1], x.shape[-1], bucket.grad_flat
    if grad_flat.dim() != 1 or grad_flat.numel() % world:
        raise ValueError(f"matmul_wgrad_reduce_scatter: grad_flat must be 1-D with a length divisible by the "
                         f"DP group size {world}; got shape {tuple(grad_flat.shape)} (pad the bucket)")
    if bucket.offset < 0 or bucket.offset + n * k > grad_flat.numel():
        raise ValueError(f"matmul_wgrad_reduce_scatter: W [{n}, {k}] at offset {bucket.offset} does not fit in a "
                         f"bucket of {grad_flat.numel()} elements; pass the offset of W's main_grad in it")
    ctx = context or default_context()
    if plan.algo != "reference":
        peers_agree(OP, group, world, grad_flat.device, ctx, grad_flat.numel(), bucket.offset, n, k)
    with torch.no_grad():  # a plain op into a gradient buffer: nothing to record (inputs may require grad)
        if world == 1 or plan.algo == "reference":
            wgrad_reduce_scatter_reference(dy, x, bucket, group, ctx, plan)
            return _done if defer_last else None
        return plain(OP, plan.algo)(dy, x, bucket, group, ctx, plan, defer_last=defer_last)


def _done() -> None:
    """finish() of a reduce-scatter that completed in its call."""
