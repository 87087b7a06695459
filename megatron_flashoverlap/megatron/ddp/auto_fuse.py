"""The automatic choice of `wrap_with_dp_overlap`: which TP linears reduce-scatter inside their wgrad GEMM.

    auto_linears(module, candidates, bucket_size, dp_group, tokens, asynchronous) -> (linears, log line, asynchronous)
        tokens known (the wgrad GEMM's rows: seq x micro-batch; or Megatron's args when initialized):
            a quick calibration on this machine (PROBE gradient elements reduce-scattered over DP by stock's
            collective and by our ring, a ring over 8 x DP elements (its latency), the GEMM of a PROBE-element
            weight over `tokens` rows; runtime/timing.paired: the max over the DP ranks per round, CUDA events
            on a GPU; each the best of two rounds after a warm-up) feeds the
            DP cost model (plan/dp.py); the k linears reduced last in backward that minimize its
            modelled step are fused (k = 0 where stock already hides its buckets)
        tokens unknown: stock's last bucket (layout.last_bucket_weights)
    asynchronous None on a host-driven transport (gloo), with the cost model: at TP = 1 the DP worker thread
        only where the model's best step with rings in backward is longer than on the worker by more than a
        call latency per ring (plan/dp.worker_pays), each ring in its layer's backward otherwise; at TP > 1 the
        worker (the model counts neither the TP rings the compute thread also waits on nor the host's threads).
        Without the cost model, and on NCCL: worker.runs_async. The measured basis, worker against in
        backward at each layout: benchmarks/dp/RESULTS.md.
"""
from __future__ import annotations

import torch

from ...plan.dp import Rates, choose, worker_pays
from ...ops.dp.wgrad_rs import DPBucket, matmul_wgrad_reduce_scatter
from ...runtime import OverlapContext, reduce_scatter_into
from ...runtime.timing import paired
from .worker import runs_async
from .layout import last_bucket_weights

IN_BACKWARD = "in backward under their wgrad, each last hop waited at the next ring"
PROBE = 1 << 20  # elements: ~4 MB fp32, long enough to be link-bound at 1-10 Gbit/s, short enough for start-up


def megatron_tokens() -> int | None:
    """seq_length * micro_batch_size from Megatron's parsed args, when pretrain() set them up; else None."""
    try:
        from megatron.training.global_vars import get_args
        args = get_args()
    except Exception:  # not initialized, or megatron.training absent: the caller falls back
        return None
    seq, mbs = getattr(args, "seq_length", None), getattr(args, "micro_batch_size", None)
    return seq * mbs if seq and mbs else None


def calibrate(dp_group, tokens: int, dtype=torch.float32, device="cpu") -> Rates:
    """Rates measured here (module docstring); the same on every DP rank (max over the group)."""
    world = dp_group.size()
    length = -(-PROBE // world) * world
    grad = torch.zeros(length, dtype=dtype, device=device)
    out = torch.empty(length // world, dtype=dtype, device=device)
    side = 1 << 10  # a [1024, 1024] weight = PROBE elements
    gen = torch.Generator(device=device).manual_seed(0)  # its own: the training's RNG stream (dropout) untouched
    dy = torch.randn(tokens, side, dtype=dtype, device=device, generator=gen)
    x = torch.randn(tokens, side, dtype=dtype, device=device, generator=gen)
    ctx = OverlapContext(check_peers=False)
    tiny = grad[:8 * world]  # one row of 8 per rank: the ring's per-call latency
    calls = {"comm": lambda: reduce_scatter_into(out, grad, dp_group),
             "ring": lambda: matmul_wgrad_reduce_scatter(dy[:1], x[:1], DPBucket(grad, 0), dp_group, context=ctx),
             "gemm": lambda: torch.mm(dy.t(), x),
             "lat": lambda: matmul_wgrad_reduce_scatter(dy[:1, :8], x[:1, :world], DPBucket(tiny, 0), dp_group,
                                                        context=ctx)}
    best = {k: min(v) for k, v in paired(calls, dp_group, torch.device(device), rounds=2, warmup=1).items()}
    return Rates(best["comm"] / PROBE, best["ring"] / PROBE, best["gemm"] / PROBE, best["lat"], hops=world - 1)


def _tp_size(candidates) -> int:
    """The tensor-parallel size of the candidate linears (Megatron's layers keep their group as tp_group)."""
    return max((m.tp_group.size() for m in candidates if getattr(m, "tp_group", None) is not None), default=1)


def _params(module, candidates) -> tuple[list, list[tuple[int, bool]]]:
    """Trainable params in backward (layout) order, and (numel, is a candidate's weight) of each."""
    ids = {id(m.weight) for m in candidates}
    order = [p for _, p in module.named_parameters() if p.requires_grad][::-1]
    return order, [(p.numel(), id(p) in ids) for p in order]


def by_cost_model(module, candidates, bucket_size, rates: Rates, asynchronous: bool = False) -> tuple[list, str]:
    """The candidates the cost model fuses, and its one log line."""
    order, params = _params(module, candidates)
    k, best, stock = choose(rates.grads(params), bucket_size, rates.link(), asynchronous)
    chosen = {id(p) for p in [order[i] for i in range(len(order) - 1, -1, -1) if params[i][1]][:k]}
    picked = [m for m in candidates if id(m.weight) in chosen]
    line = (f"flash DP overlap (automatic, cost model): reduce-scatter {rates.comm_s * 1e9:.1f} ns (stock) / "
            f"{rates.ring_s * 1e9:.1f} ns + {rates.ring_lat_s * 1e3:.2f} ms a call (our ring) and one backward GEMM {rates.gemm_s * 1e9:.1f} ns per "
            f"gradient element; stock --overlap-grad-reduce (bucket_size "
            f"{bucket_size}) leaves ~{stock.exposed * 1e3:.0f} ms of its reduce-scatters after a "
            f"~{stock.compute * 1e3:.0f} ms backward; fusing the {k} of {len(candidates)} tensor-parallel "
            f"linears reduced last in backward ({sum(m.weight.numel() for m in picked)} elements) leaves "
            f"~{best.exposed * 1e3:.0f} ms after a ~{best.compute * 1e3:.0f} ms backward (their rings run "
            f"{'on the DP worker thread from their wgrad on' if asynchronous else IN_BACKWARD}"
            f"); every other parameter keeps Megatron's buckets")
    return picked, line


def by_last_bucket(module, candidates, bucket_size) -> tuple[list, str]:
    """Stock's last bucket (no token count for the cost model), and its one log line."""
    chosen = {id(w) for w in last_bucket_weights(module, [m.weight for m in candidates], bucket_size)}
    picked = [m for m in candidates if id(m.weight) in chosen]
    total = sum(p.numel() for p in module.parameters() if p.requires_grad)
    line = (f"flash DP overlap (automatic): fusing {len(picked)} of {len(candidates)} tensor-parallel linear "
            f"weights ({sum(m.weight.numel() for m in picked)} of {total} gradient elements), those in stock's "
            f"last bucket (bucket_size {bucket_size}): stock reduce-scatters it after the whole backward, exposed; "
            f"every other parameter keeps Megatron's buckets and their overlap (pass tokens= to "
            f"wrap_with_dp_overlap for the cost model)")
    return picked, line


def auto_linears(module, candidates, bucket_size, dp_group, tokens, asynchronous=None) -> tuple[list, str, bool | None]:
    """The automatic choice (module docstring), its one log line and where the rings run (None: left to
    worker.runs_async, the case without the cost model)."""
    tokens = tokens or megatron_tokens()
    if not tokens or dp_group is None or dp_group.size() < 2:
        return (*by_last_bucket(module, candidates, bucket_size), asynchronous)
    first = next(module.parameters())
    rates = calibrate(dp_group, tokens, dtype=first.dtype, device=first.device)
    if asynchronous is None:
        grads = rates.grads(_params(module, candidates)[1])
        asynchronous = runs_async(dp_group, first.device.type) and (
            _tp_size(candidates) > 1 or worker_pays(grads, bucket_size, rates.link(), rates.ring_lat_s))
    return (*by_cost_model(module, candidates, bucket_size, rates, asynchronous), asynchronous)
