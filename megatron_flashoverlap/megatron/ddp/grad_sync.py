"""Every Megatron-Core DDP internal this plugin touches, in one place (checked: megatron-core 0.16.1, 0.19.2).

What the data-parallel overlap needs from Megatron's `DistributedDataParallel` (distributed optimizer):
a selected weight's gradient is reduce-scattered INSIDE its wgrad GEMM (ops/dp/wgrad_rs.py), so Megatron
must (a) give that weight a bucket of its own, and (b) not reduce-scatter that bucket a second time.

    (a) layout   `layout.isolated_buckets(module, weights)`: while DDP (and, on 0.19, its param layout) is
                 built, the weights carry `shared_embedding = True` (the attribute both versions' layout
                 code honours to close a bucket before and after a param) and come last in layout order,
                 so the other params keep stock's buckets; a precomputed 0.19 `full_param_layout` is
                 rewritten the same way (`layout.relayout`). Both are undone afterwards.
    (b) sync     `_ParamAndGradBucketGroup.start_grad_sync` is wrapped (class-level, once): for a bucket
                 group marked `_flashoverlap_reduced` this iteration it installs the ring's handle instead
                 of issuing the collective (an in-backward ring's last hop, waited at the next ring or
                 here: _DeferredRing; or the DP worker's: worker.py, gloo); `finish_grad_sync` then
                 waits on it as usual. Every other bucket group runs the original.
    (c) checks   the NaN / Inf / large-gradient check runs on the LOCAL gradient, as stock runs it before
                 its collective: the fused ring hands every local part (before it is sent) to a norm
                 accumulator, and Megatron's own `check_grads` judges that norm on the rank that made it.

Bookkeeping it relies on (read, never written except the two items above and the documented
`param.grad_added_to_main_grad = True`, the same flag Megatron's fused-wgrad path sets):
`ddp.param_to_bucket_group`, `bucket_group.buckets / is_last_microbatch / ddp_config /
intra_distributed_optimizer_instance_group`, `bucket.grad_data / params_list /
gradient_scaling_factor`, `param.main_grad` (a view into `bucket.grad_data`).
Falls back to stock (one log line names every refused weight) when: DP group of size 1; no distributed opt.;
`overlap_grad_reduce` off; several distributed-optimizer instances; `reduce_scatter_with_fp32_accumulation`;
or the weight does not own its bucket and bucket group (e.g. `disable_bucketing`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from ...config.refusals import unhonoured
from ...runtime import OverlapContext, default_context, shared_context
from ...ops.checks import peers_agree
from ...ops.dp.wgrad_rs import OP as DP_OP, DPBucket, matmul_wgrad_reduce_scatter
from .worker import RingHandle, check_async, no_grad, runs_async, worker

log = logging.getLogger(__name__)
SUPPORTED = ("0.16", "0.17", "0.18", "0.19")
_PATCHED = False


def megatron_version() -> str:
    import megatron.core
    return getattr(megatron.core, "__version__", "0")


def check_version() -> None:
    v = megatron_version()
    if not v.startswith(SUPPORTED):
        raise RuntimeError(f"megatron_flashoverlap.megatron.ddp patches DDP internals checked on megatron-core 0.16.1 and "
                           f"0.19.2; found {v}. Pin megatron-core>=0.16.1,<0.20 or disable the DP overlap")


class _Done:
    """A completed communication handle: the reduce-scatter already ran inside the wgrad GEMM."""

    def wait(self, *args, **kwargs) -> None:
        return None


def _patch_start_grad_sync() -> None:
    global _PATCHED
    if _PATCHED:
        return
    check_version()
    from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup as G

    original = G.start_grad_sync

    def start_grad_sync(self, force_all_reduce=False):
        if not getattr(self, "_flashoverlap_reduced", False):
            return original(self, force_all_reduce=force_all_reduce)
        if force_all_reduce:
            raise RuntimeError("a bucket reduce-scattered by the flash DP overlap cannot be all-reduced again "
                               "(force_all_reduce); disable the DP overlap for this model")
        self._flashoverlap_reduced = False
        # the ring's handle: done (it ran in the backward) or running on the DP worker (worker.py)
        self.grad_reduce_handle = getattr(self, "_flashoverlap_handle", None) or _Done()
        self._flashoverlap_handle = None

    start_grad_sync._flashoverlap_original = original
    G.start_grad_sync = start_grad_sync
    _PATCHED = True


@dataclass
class DPSite:
    """Where a weight's gradient lives in Megatron's buffers, and the DP group that reduces it."""

    bucket_group: object
    grad_flat: torch.Tensor  # the bucket's grad_data [L]
    offset: int  # W's main_grad starts at grad_flat[offset]
    group: object
    scale: float  # gradient_scaling_factor, or 1/D under average_in_collective
    algo: str = "flash"
    context: OverlapContext = field(default_factory=default_context)
    fused_calls: int = 0  # last-micro-batch wgrads reduce-scattered in the GEMM (tests read it)
    placement: object = None  # IN_BACKWARD or ON_WORKER: where the ring runs (set by _site)

    @property
    def asynchronous(self) -> bool:
        """The ring runs on the DP worker thread (worker.py)."""
        return self.placement is ON_WORKER


def _refuse(ddp, param, bucket_group) -> str | None:
    """Why this weight cannot use the fused reduce-scatter, or None. The DDP flags' reasons are the dp rows of
    config/refusals.py, which `dp: {fuse: all}` refuses at parse time."""
    cfg = ddp.ddp_config
    missing = unhonoured("dp", cfg)
    if missing:
        return missing
    if bucket_group.intra_distributed_optimizer_instance_group.size() == 1:
        return "the data-parallel group has size 1"
    if cfg.num_distributed_optimizer_instances > 1 or getattr(cfg, "reduce_scatter_with_fp32_accumulation", False):
        return "several distributed-optimizer instances or reduce_scatter_with_fp32_accumulation"
    if len(bucket_group.buckets) != 1 or len(bucket_group.buckets[0].params_list) != 1:
        return ("its bucket is shared with other parameters (build DDP through wrap_with_dp_overlap or inside "
                "layout.isolated_buckets(...); disable_bucketing merges all buckets)")
    return None


def _site(ddp, param, algo, context, asynchronous=None) -> DPSite:
    bucket_group = ddp.param_to_bucket_group[param]
    bucket = bucket_group.buckets[0]
    grad_flat = bucket.grad_data
    offset = (param.main_grad.data_ptr() - grad_flat.data_ptr()) // grad_flat.element_size()
    group = bucket_group.intra_distributed_optimizer_instance_group
    scale = bucket.gradient_scaling_factor / (group.size() if ddp.ddp_config.average_in_collective else 1)
    if asynchronous:
        check_async(group, grad_flat.device.type)
    on_worker = asynchronous if asynchronous is not None else runs_async(group, grad_flat.device.type)
    return DPSite(bucket_group, grad_flat, offset, group, scale, algo, context or default_context(),
                  placement=ON_WORKER if on_worker else IN_BACKWARD)


def enable_dp_overlap(ddp, weights, *, algo: str = "flash", context: OverlapContext | None = None,
                      asynchronous: bool | None = None) -> list:
    """Mark `weights` of a Megatron DDP model for the fused wgrad reduce-scatter; returns the ones accepted
    (the others stay stock, named in one log line). The backward calls `dp_wgrad` (ddp/wrap.py).
    asynchronous: True = the ring on the DP worker thread (worker.py, gloo); False = in backward; None = as
    worker.runs_async decides (the worker on gloo, the current stream on NCCL)."""
    _patch_start_grad_sync()
    accepted, refused = [], []
    for w in weights:
        bucket_group = ddp.param_to_bucket_group.get(w)
        why = "it is not a DDP parameter with a gradient" if bucket_group is None else _refuse(ddp, w, bucket_group)
        if why:
            refused.append(f"{tuple(w.shape)}: {why}")
            continue
        w._flashoverlap_dp = _site(ddp, w, algo, context, asynchronous)
        accepted.append(w)
    if refused:
        log.warning("flash DP overlap: %d weight(s) stay on Megatron's bucketed reduce-scatter: %s",
                    len(refused), "; ".join(sorted(set(refused))))
    return accepted


def _dummy_grad(weight: torch.Tensor) -> torch.Tensor:
    # DDP's hook asserts param.grad is not None under overlap_grad_reduce and skips adding it when
    # grad_added_to_main_grad is set (Megatron's gradient_accumulation_fusion does the same)
    return torch.zeros((), dtype=weight.dtype, device=weight.device).expand(weight.shape)


class _LocalNorm:
    """The local bucket norm from the parts the fused ring sends (each one fp32 norm pass, summed in fp64)."""

    def __init__(self):
        self.sq = None

    @staticmethod
    def wanted(bucket_group) -> bool:
        """Whether Megatron would check this bucket (else the ring is given no on_local: no norm pass)."""
        cfg = bucket_group.ddp_config
        return bool(cfg.check_for_nan_in_grad or cfg.check_for_large_grads)

    def __call__(self, part: torch.Tensor, scale: float = 1.0) -> None:
        # part is (gradient * scale): its norm / |scale| is the local gradient's (NaN and Inf stay themselves)
        sq = (torch.linalg.vector_norm(part, dtype=torch.float32).double() / (abs(scale) or 1.0)).pow(2)
        self.sq = sq if self.sq is None else self.sq + sq

    def check(self, bucket_group) -> None:
        """Megatron's own check_grads on this rank's local norm (its messages, its rerun state machine)."""
        cfg = bucket_group.ddp_config
        if not self.wanted(bucket_group) or self.sq is None:
            return
        norm = self.sq.sqrt().float().reshape(1)  # a 1-element "bucket" whose norm is the local norm
        stand_in = SimpleNamespace(buckets=[SimpleNamespace(grad_data=norm)])
        type(bucket_group).check_grads(stand_in, check_for_nan_or_inf=cfg.check_for_nan_in_grad,
                                       check_for_large=cfg.check_for_large_grads)


def _fused_reduce_scatter(site: DPSite, dy, x) -> None:
    """Last micro-batch: dW produced shard by shard inside the DP reduce-scatter of the weight's bucket, where
    site.placement runs it; finish_grad_sync waits on the handle left on the bucket group."""
    group_ = site.bucket_group
    if getattr(group_, "_flashoverlap_reduced", False):
        raise RuntimeError("flash DP overlap: this weight's bucket is already reduce-scattered and not yet "
                           "consumed: either the weight is used twice per step (disable the DP overlap for "
                           "it) or the previous step skipped ddp.finish_grad_sync() (call it every step)")
    local = _LocalNorm()
    bucket = DPBucket(site.grad_flat, site.offset, site.scale, local if local.wanted(group_) else None)

    def run(ctx, **kw):
        return matmul_wgrad_reduce_scatter(dy, x, bucket, site.group, algo=site.algo, context=ctx, **kw)
    group_._flashoverlap_handle = site.placement.launch(site, run, lambda: local.check(group_), dy, x)
    group_._flashoverlap_reduced = True
    site.fused_calls += 1


class _InBackward:
    """The ring in the compute thread, in its layer's backward, up to its last hop: that hop is waited at the
    next ring on the same context (whose buffers it shares) or at finish_grad_sync (_DeferredRing)."""

    def launch(self, site: DPSite, run, on_done, dy, x):
        ctx = site.context
        finish_pending(ctx)
        handle = _PENDING[id(ctx)] = _DeferredRing(ctx, run(ctx, defer_last=True), on_done)
        return handle


class _OnWorker:
    """The ring on the DP worker thread (worker.py): the shape check here, in program order; the ring, with
    the worker's own context (runtime/context.py), queued behind the rings before it."""

    def launch(self, site: DPSite, run, on_done, dy, x):
        peers_agree(DP_OP, site.group, site.group.size(), site.grad_flat.device, site.context,
                    site.grad_flat.numel(), site.offset, dy.shape[-1], x.shape[-1])
        bound = None if site.context.timeout is None else site.context.timeout.total_seconds()
        ctx = shared_context("worker", bound)
        return RingHandle(worker().submit(no_grad(lambda: run(ctx))), on_done)


IN_BACKWARD, ON_WORKER = _InBackward(), _OnWorker()
# id(context) -> the in-backward ring whose last hop is not yet waited (one per context; the handle holds its
# context, so the id is not reused while the entry lives)
_PENDING: dict = {}


class _DeferredRing:
    """Megatron's handle of a bucket whose ring ran in backward up to its last hop: wait() (finish_grad_sync,
    or the next ring on the same context, whose buffers it shares) waits on that hop, writes the own shard
    and runs the local-gradient check. So a ring holds the backward only when its peer is a whole layer
    behind, not at every layer (a wait bounded by the context's timeout: a dead peer raises here)."""

    def __init__(self, ctx, finish, on_done):
        self._ctx, self._finish, self._on_done = ctx, finish, on_done

    def wait(self, *args, **kwargs) -> None:
        if self._finish is None:
            return
        finish, self._finish = self._finish, None
        if _PENDING.get(id(self._ctx)) is self:
            del _PENDING[id(self._ctx)]
        finish()
        self._on_done()


def finish_pending(ctx) -> None:
    """Wait on the last hop of the in-backward ring still pending on `ctx`, if any (_DeferredRing)."""
    pending = _PENDING.get(id(ctx))
    if pending is not None:
        pending.wait()


def dp_wgrad(weight: torch.Tensor, dy: torch.Tensor, x: torch.Tensor, wgrad=None) -> torch.Tensor:
    """The gradient to hand autograd for `weight` [n, k], given dy [.., n] and x [.., k] (this rank's whole
    dW = dy^T x; the plugin's TP operators call it as their `wgrad_fn`).

    Stock weight: `wgrad()` (the layer's own dW). Flash weight: non-last micro-batch -> main_grad += dW
    locally; last micro-batch -> dW is produced shard by shard inside the DP reduce-scatter of its bucket.
    Either way main_grad holds the result and a zero placeholder goes to autograd."""
    site = getattr(weight, "_flashoverlap_dp", None)
    if site is None:
        if wgrad is None:
            raise RuntimeError("dp_wgrad: this weight is not marked for the flash DP overlap")
        return wgrad()
    if not site.bucket_group.is_last_microbatch:
        a, b = dy.reshape(-1, dy.shape[-1]).t(), x.reshape(-1, x.shape[-1])
        main = weight.main_grad.view(a.shape[0], b.shape[1])
        if a.dtype == main.dtype:
            main.addmm_(a, b)  # the add inside the GEMM's pass
        else:  # stock's order: dW in the weight's dtype, then added into the wider main_grad
            main.add_(torch.mm(a, b).to(main.dtype))
    else:
        _fused_reduce_scatter(site, dy, x)
    weight.grad_added_to_main_grad = True
    return _dummy_grad(weight)
