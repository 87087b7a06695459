"""The start-up probe: a few GEMMs and point-to-point hops timed on the real group, the same figures on every
rank, handed to the planner (plan/probe_plan.py) for the choices the YAML leaves open.

    planned(cfg) -> cfg      where the spec reads the config (spec.model_layer_specs), torch.distributed
                             initialized and Megatron's args parsed, when cfg.planner.probe is
                                 "auto"  on NCCL only (the default: on gloo the CPU rules decide)
                                 "always" on every backend: gloo runs the very code a GPU run takes (CI runs it)
                             probe once, choose, apply (the YAML wins), activate the result (the DDP wrapper reads
                             dp.fuse from it), hand the predicted picks and decode table to the chooser's model
                             tier; log the figures once (INFO) and the choices once (WARNING, as every decision
                             line). Anything else: cfg unchanged (ops/tp_sp/plain.py hop_chunks_for,
                             megatron/ddp/auto_fuse.py, the measured tier).
    measure(shapes, gpus_per_node, group=None, hop_bytes=HOP_BYTES, stock_bytes=(), rounds=3) -> figures
                                                            (plan/probe_plan.py: Figures)
        GEMMs: each shape, median of `rounds` calls after a warm-up (runtime/timing.interleaved): on NCCL in bf16
               between CUDA events, on any other backend in fp32 on the host clock
        hops:  every rank exchanges `bytes` with a partner at once: one walk of the executor of HOP_STEPS steps
               after a barrier, each step one exchange, per step: intra = the neighbour in its node (rank ^ 1),
               inter = the same local rank on the paired node (ranks without a pair report nothing)
        stock: where `stock_bytes` names sizes, the group's own all-gather (bytes per rank), all-reduce
               (bytes) and reduce-scatter (bytes per rank out: whatever dist.reduce_scatter_tensor runs, e.g.
               the benchmarks' line-rate ring) timed the same way, every rank at once: the call-level price
               of what stock runs ("stock": {"all_gather": [[bytes, s]], "all_reduce": ..., "reduce_scatter": ...})
        identical on every rank: each figure is all-reduced with MAX over the group
"""
from __future__ import annotations

import functools
import logging
import statistics

import torch
import torch.distributed as dist

from ..config import activate
from ..plan.chooser import chooser_of
from ..runtime.context import OverlapContext
from ..runtime.executor import execute
from ..runtime.group import all_gather_into, reduce_scatter_into
from ..schedules import Slice, Step, Transfer
from ..runtime.timing import cuda_timed, interleaved, timed
from ..runtime.once import LogOnce
from ..plan.probe_plan import apply, choose, partners, probe_shapes
from ..plan.model import Layout, Model

log = logging.getLogger(__name__)
_FIGURES = LogOnce(log, logging.INFO)  # the figures, once per process
_CHOSE = LogOnce(log)  # the choices: a decision line, as the chooser's
_REFUSED = LogOnce(log)
HOP_BYTES = (1 << 16, 1 << 20, 1 << 24)
HOP_STEPS = 4  # steps of the executor walk a hop figure times (_exchange)
STOCK = ("all_gather", "all_reduce", "reduce_scatter")  # the stock collectives the probe times (stock_bytes)
ROUNDS = 3


def _median(call, rounds: int = ROUNDS) -> float:
    """The median of `rounds` calls of `call` (one measured call -> its seconds) after a warm-up call (kernels
    chosen, connections made)."""
    return statistics.median(interleaved({"call": call}, rounds, warmup=1)["call"])


class _Clock:
    """Where the probe runs: (device, GEMM dtype, its figures' word, seconds of one call) of the group's backend."""

    def __init__(self, group):
        self.backend = str(dist.get_backend(group))
        cuda = self.backend == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        self.dtype, self.word = (torch.bfloat16, "bf16") if cuda else (torch.float32, "fp32")
        self.name = torch.cuda.get_device_name() if cuda else f"host CPU ({self.backend})"
        self.seconds = cuda_timed if cuda else (lambda fn: timed(fn, barrier=False))


def _gemm_seconds(shapes, clock: _Clock, rounds: int = ROUNDS) -> list[float]:
    out = []
    for m, k, n in shapes:
        a = torch.randn(m, k, device=clock.device, dtype=clock.dtype)
        b = torch.randn(k, n, device=clock.device, dtype=clock.dtype)
        out.append(_median(lambda: clock.seconds(lambda: torch.matmul(a, b)), rounds))
    return out


class _Pair:
    """The probe walk's handler: one send and one receive buffer, nothing to compute, nothing done on arrival
    (the planner prices an arrival's add or copy apart)."""

    def __init__(self, send: torch.Tensor, recv: torch.Tensor):
        self.out, self.inc = send, recv

    def send(self, x):
        return self.out

    def recv(self, x):
        return self.inc

    def compute(self, x) -> None:
        pass

    def arrived(self, t) -> None:
        pass


def _exchange(peer: int | None, nbytes: int, group, clock: _Clock) -> float:
    """Seconds of one exchange of `nbytes` with group rank `peer` (0 without a peer): one walk of the executor
    (runtime/executor.py) of HOP_STEPS steps after a barrier, each step one exchange with `peer`, per step. The
    executor's own walk, because its per-step host work (the transport's post and wait, the step's bookkeeping)
    is part of every hop the planner prices; several steps, because a walk's steps follow one another (the first
    one after a barrier finds every rank awake)."""
    dist.barrier(group=group)
    if peer is None:
        return 0.0
    send = torch.empty(nbytes, dtype=torch.uint8, device=clock.device)
    pair, ctx = _Pair(send, torch.empty_like(send)), OverlapContext(check_peers=False)
    one = Slice(0, 0, 0)
    steps = tuple(Step(sends=(Transfer(peer, one),), recvs=(Transfer(peer, one),)) for _ in range(HOP_STEPS))
    return clock.seconds(lambda: execute(steps, group, {0: pair}, ctx)) / HOP_STEPS


def _hop_seconds(peer: int | None, group, clock: _Clock, sizes=HOP_BYTES, rounds: int = ROUNDS) -> list[float]:
    out = []
    for nbytes in sizes:
        out.append(_median(lambda: _exchange(peer, nbytes, group, clock), rounds))
    return out


def _stock(kind: str, nbytes: int, group, clock: _Clock) -> float:
    """Seconds of one stock `kind` call (all_gather, reduce_scatter: `nbytes` per rank; all_reduce: of
    `nbytes`), after a barrier; the reduced buffer is a fresh copy each call (outside the clock)."""
    x = torch.ones(max(1, nbytes // torch.empty((), dtype=clock.dtype).element_size()), dtype=clock.dtype,
                   device=clock.device)
    out = torch.ones(dist.get_world_size(group) * x.numel(), dtype=clock.dtype, device=clock.device)
    dist.barrier(group=group)
    if kind == "all_gather":
        return clock.seconds(lambda: all_gather_into(out, x, group))
    if kind == "reduce_scatter":
        return clock.seconds(lambda: reduce_scatter_into(x, out, group))
    return clock.seconds(lambda: dist.all_reduce(x, group=group))


def _stock_seconds(sizes, group, clock: _Clock, rounds: int) -> list[float]:
    return [_median(lambda: _stock(kind, nbytes, group, clock), rounds) for kind in STOCK for nbytes in sizes]


def measure(shapes, gpus_per_node: int, group=None, hop_bytes=HOP_BYTES, stock_bytes=(), rounds: int = ROUNDS) -> dict:
    """The probe's figures, identical on every rank (module docstring)."""
    rank, world, clock = dist.get_rank(group), dist.get_world_size(group), _Clock(group)
    intra, inter = partners(rank, world, gpus_per_node)
    times = (_gemm_seconds(shapes, clock, rounds) + _hop_seconds(intra, group, clock, hop_bytes, rounds)
             + _hop_seconds(inter, group, clock, hop_bytes, rounds) + _stock_seconds(stock_bytes, group, clock, rounds))
    t = torch.tensor(times, dtype=torch.float64, device=clock.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    times = t.tolist()
    n, h, c = len(shapes), len(hop_bytes), len(stock_bytes)
    rows = (lambda sizes, xs: [[b, s] for b, s in zip(sizes, xs) if s > 0])
    out = {"device": clock.name, "backend": clock.backend, "dtype": clock.word, "gpus_per_node": gpus_per_node,
           "nodes": max(1, world // gpus_per_node),
           "gemm": [[*s, x] for s, x in zip(shapes, times[:n])],
           "intra": rows(hop_bytes, times[n:n + h]), "inter": rows(hop_bytes, times[n + h:n + 2 * h])}
    if c:
        tail = times[n + 2 * h:]
        out["stock"] = {kind: rows(stock_bytes, tail[i * c:(i + 1) * c]) for i, kind in enumerate(STOCK)}
    return out


def model_layout(args) -> tuple[Model, Layout]:
    """Megatron's parsed args -> the planner's Model and Layout."""
    groups = args.num_query_groups if getattr(args, "group_query_attention", False) else None
    model = Model(hidden=args.hidden_size, ffn=args.ffn_hidden_size, heads=args.num_attention_heads,
                  layers=args.num_layers, seq=args.seq_length, micro_batch=args.micro_batch_size,
                  query_groups=groups, kv_channels=getattr(args, "kv_channels", None),
                  vocab=getattr(args, "padded_vocab_size", None) or 32000, swiglu=bool(getattr(args, "swiglu", False)),
                  experts=getattr(args, "num_experts", None) or 0, topk=getattr(args, "moe_router_topk", 2) or 2,
                  moe_ffn=getattr(args, "moe_ffn_hidden_size", None), global_batch=args.global_batch_size,
                  recompute=getattr(args, "recompute_granularity", None) == "full")
    layout = Layout(args.tensor_model_parallel_size, args.pipeline_model_parallel_size,
                    getattr(args, "context_parallel_size", 1), getattr(args, "expert_model_parallel_size", 1),
                    args.data_parallel_size, bool(args.sequence_parallel))
    return model, layout


def _megatron_args():
    try:
        from megatron.training.global_vars import get_args
        return get_args()
    except Exception:  # not initialized, or megatron.training absent: no probe
        return None


def _gpus_per_node(world: int) -> int:
    import os
    g = int(os.environ.get("LOCAL_WORLD_SIZE", 0)) or torch.cuda.device_count()
    return max(1, min(g, world))


@functools.lru_cache(maxsize=None)
def _probe_and_choose(model: Model, layout: Layout):
    g = _gpus_per_node(dist.get_world_size())
    figures = measure(probe_shapes(model, layout), g)
    return figures, choose(figures, model, layout)


def planned(cfg):
    """cfg with the planner's choices on this GPU cluster, or cfg unchanged (module docstring)."""
    if cfg.planner.probe == "off" or not dist.is_initialized():
        return cfg
    if cfg.planner.probe == "auto" and not (torch.cuda.is_available() and dist.get_backend() == "nccl"):
        return cfg
    args = _megatron_args()
    if args is None:
        return cfg
    try:
        model, layout = model_layout(args)
        figures, choices = _probe_and_choose(model, layout)
    except ValueError as err:  # a layout the planner cannot price: say so once, keep the YAML / CPU rules
        _REFUSED(str(err), "flash-overlap planner: %s; the layers keep the YAML's plans and the operators' own "
                 "rules", err)
        return cfg
    out = apply(choices, cfg)
    chooser = chooser_of(out)  # the model tier (plan/chooser.py): where an auto site or a bucket is not measured
    chooser.model_sites = dict(choices.sites)
    if choices.decode_table is not None:
        chooser.model_tables = list(choices.decode_table["tables"])
    _FIGURES(("probe", model, layout), "flash-overlap probe: %s", figures)
    if dist.get_rank() == 0:
        _CHOSE(("choices", model, layout), "flash-overlap %s", choices.log)
    activate(out)
    return out
