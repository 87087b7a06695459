"""Worker-side bodies of the fused expert pipeline tests (ops/moe/fused.py), run on every rank by the gloo pool.

Every rank draws the same global count tensor counts[src][dst][e] (rows src routes to local expert e of
dst, zeros included), the same tokens of every rank (seeded by the rank) and the same expert weights (seeded
by the global expert index), so the expected outputs and gradients are computed here directly, per global
expert on its rows (plain torch autograd), never through the operator.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_flashoverlap.ops.moe import LocalExperts, expert_pipeline
from megatron_flashoverlap.runtime import OverlapContext
from tests.support import profile

H, F, E = 6, 5, 2  # hidden, expert ffn, local experts per rank


def _counts(world, seed, zeros):
    """[src][dst][e]; zeros: "one" (rank 0 routes nothing to the last rank, expert 0 of rank 1 gets nothing from
    rank 0), "all" (nothing routed anywhere), "none"."""
    g = torch.Generator().manual_seed(seed)
    c = torch.randint(1, 5, (world, world, E), generator=g)
    if zeros == "one":
        c[0, world - 1] = 0
        c[0, 1 % world, 0] = 0
    return c * (zeros != "all")


def _weights(world):
    """Per global expert g (rank g // E, local g % E): (w1 [F, H], w2 [H, F])."""
    out = []
    for g in range(world * E):
        gen = torch.Generator().manual_seed(100 + g)
        out.append((torch.randn(F, H, generator=gen) / 3, torch.randn(H, F, generator=gen) / 3))
    return out


def _tokens(src, counts):
    """Rank src's permuted tokens [rows, H] and probs [rows]: block dst, grouped by dst's local expert."""
    n = int(counts[src].sum())
    gen = torch.Generator().manual_seed(1000 + src)
    return torch.randn(n, H, generator=gen), torch.rand(n, generator=gen) + 0.1


def _dout(src, rows):
    return torch.cos(torch.arange(rows * H, dtype=torch.float32).view(rows, H) + src)


def _mlp(x, w1, w2, p):
    """Stock SequentialMLP's math per expert: fc1, gelu, times the prob (per_token_scale), fc2."""
    return (torch.nn.functional.gelu(x @ w1.t()) * p.unsqueeze(-1)) @ w2.t()


class Experts:
    """The local experts of one rank as plain parameters; __call__ is the `experts` of expert_pipeline."""

    def __init__(self, rank, world, fused_main_grad=False):
        ws = _weights(world)[rank * E:(rank + 1) * E]
        self.params = [t.clone().requires_grad_() for pair in ws for t in pair]
        self.fused = fused_main_grad
        for p in self.params:
            p.main_grad = torch.zeros_like(p)
            p.grad_added_to_main_grad = False
        self.hooks = [0] * len(self.params)
        for i, p in enumerate(self.params):
            p.register_post_accumulate_grad_hook(lambda _p, i=i: self.hooks.__setitem__(i, self.hooks[i] + 1))

    def __call__(self, x, counts, p):
        outs, lo = [], 0
        for e, n in enumerate(counts):
            w1, w2 = self.params[2 * e], self.params[2 * e + 1]
            if self.fused:
                w1, w2 = _FusedWgrad.apply(w1), _FusedWgrad.apply(w2)
            outs.append(_mlp(x[lo:lo + n], w1, w2, p[lo:lo + n]))
            lo += n
        return torch.cat(outs)


class _FusedWgrad(torch.autograd.Function):
    """Identity on a weight whose gradient goes the way Megatron's fused linears send it: added into
    weight.main_grad, grad_added_to_main_grad set, an (uninitialised) dummy returned."""

    @staticmethod
    def forward(fctx, w):
        fctx.w = w
        return w.view_as(w)

    @staticmethod
    def backward(fctx, g):
        fctx.w.main_grad.add_(g)
        fctx.w.grad_added_to_main_grad = True
        return torch.empty_like(g)


def _expected(rank, world, counts):
    """Rank rank's outputs and token/prob grads, and its experts' weight grads, from the global data."""
    ws = [tuple(t.clone().requires_grad_() for t in pair) for pair in _weights(world)]
    toks = [tuple(t.requires_grad_() for t in _tokens(s, counts)) for s in range(world)]
    loss = 0
    for s in range(world):
        x, p = toks[s]
        ys, lo = [], 0
        for d in range(world):
            for e in range(E):
                n = int(counts[s, d, e])
                ys.append(_mlp(x[lo:lo + n], *ws[d * E + e], p[lo:lo + n]))
                lo += n
        y = torch.cat(ys)
        loss = loss + (y * _dout(s, y.shape[0])).sum()
        if s == rank:
            y_mine = y.detach()
    loss.backward()
    wgrads = [t.grad for pair in ws[rank * E:(rank + 1) * E] for t in pair]
    return y_mine, toks[rank][0].grad, toks[rank][1].grad, wgrads


def _run(rank, world, counts, algo, ctx, fused=False, profiled=False):
    """One forward + backward. profiled: under torch's profiler (-> c10d op counts), which keeps every post in
    the calling thread (runtime/commthread.threaded); else gloo's default path, the posts on the communication
    thread (-> how many jobs that thread was given)."""
    experts = Experts(rank, world, fused)
    x, p = (t.requires_grad_() for t in _tokens(rank, counts))
    ins = counts[rank].sum(dim=1).tolist()
    held = {}

    def fwd():
        held["y"] = expert_pipeline(x, p, LocalExperts(experts, experts.params), counts[:, rank], ins, None, ctx,
                                    algo=algo)

    def bwd():
        (held["y"] * _dout(rank, held["y"].shape[0])).sum().backward()
    watch = profile.comm_ops if profiled else _thread_jobs
    ops = {"fwd": watch(fwd), "bwd": watch(bwd)}
    return experts, x, p, held["y"], ops


def _thread_jobs(fn) -> int:
    """fn() run as is; -> the jobs submitted to communication threads meanwhile (counted, not changed)."""
    from megatron_flashoverlap.runtime.commthread import CommThread

    submit, n = CommThread.submit, [0]

    def counted(self, job):
        n[0] += 1
        return submit(self, job)
    CommThread.submit = counted
    try:
        fn()
    finally:
        CommThread.submit = submit
    return n[0]


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) if b.numel() else 0.0


def pipeline_vs_expected(rank, world, algo, seed=0, zeros="one"):
    """-> relative errors of y, dx, dprobs, each weight grad and the grad-hook calls of a run on gloo's default
    path (posts on the communication thread; "thread_jobs" fwd / bwd), and the c10d ops fwd / bwd of a
    profiled run (the profiler keeps the posts in the caller, so it checks the other path's numerics: only
    its op counts are used)."""
    counts = _counts(world, seed, zeros)
    ctx = OverlapContext(check_peers=False)
    _run(rank, world, counts, algo, ctx, profiled=True)  # warm-up: the profiler's first window misses c10d ops
    ops = _run(rank, world, counts, algo, ctx, profiled=True)[4]
    experts, x, p, y, jobs = _run(rank, world, counts, algo, ctx)
    y_e, dx_e, dp_e, dw_e = _expected(rank, world, counts)
    return {"y": _rel(y.detach(), y_e), "dx": _rel(x.grad, dx_e), "dp": _rel(p.grad, dp_e),
            "dw": max((_rel(q.grad, g) for q, g in zip(experts.params, dw_e)), default=0.0),
            "hooks": experts.hooks, "ops": ops, "thread_jobs": jobs}


def fused_main_grad(rank, world, seed=2):
    """Experts whose wgrad goes into main_grad (the fusion contract): -> main_grad error, hooks, flags."""
    counts = _counts(world, seed, "one")
    experts, *_ = _run(rank, world, counts, "flash", OverlapContext(check_peers=False), fused=True)
    dw_e = _expected(rank, world, counts)[3]
    return {"main_grad": max(_rel(q.main_grad, g) for q, g in zip(experts.params, dw_e)),
            "hooks": experts.hooks, "flags": [q.grad_added_to_main_grad for q in experts.params]}


def walk_order(rank, world, seed=1):
    """The trace of one forward walk: -> [(what, block of a compute or None), ...]."""
    counts = _counts(world, seed, "none")
    ctx = OverlapContext(check_peers=False, trace=[])
    experts = Experts(rank, world)
    x, p = _tokens(rank, counts)
    expert_pipeline(x, p, LocalExperts(experts, experts.params), counts[:, rank], counts[rank].sum(dim=1).tolist(),
                    None, ctx)
    return [(ev.what, int(ev.label.split("#")[0].split(".")[0]) if ev.what == "compute" else None)
            for ev in ctx.trace]


def bad_counts(rank, world):
    """-> the ValueError messages for counts of the wrong shape and splits that miss the token rows."""
    x, p = torch.zeros(4, H), torch.zeros(4)
    msgs = []
    for counts, ins in (([[1, 1]] * (world + 1), [4] + [0] * (world - 1)), ([[2, 2]] * world, [3] * world)):
        try:
            expert_pipeline(x, p, LocalExperts(None, []), counts, ins, None, OverlapContext())
        except ValueError as err:
            msgs.append(str(err))
    dist.barrier()
    return msgs


def no_grad_forward(rank, world, seed=3):
    """Under torch.no_grad the walk keeps no subgraphs: -> the output error vs expected."""
    counts = _counts(world, seed, "one")
    experts = Experts(rank, world)
    x, p = _tokens(rank, counts)
    with torch.no_grad():
        y = expert_pipeline(x, p, LocalExperts(experts, experts.params), counts[:, rank],
                            counts[rank].sum(dim=1).tolist(), None, OverlapContext(check_peers=False))
    return {"y": _rel(y, _expected(rank, world, counts)[0]), "requires_grad": y.requires_grad}
