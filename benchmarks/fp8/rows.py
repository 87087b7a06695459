"""What FP8 changes on the wire of a TP + SP layer, on every rank (run_ranks target of benchmarks/fp8/run.py).

    main(rank, world, cfg) -> {"world", "sites": [...], "ring": {...}}
        cfg: {"seq" (the ring's), "sites_seq" (the operators'), "batch", "hidden", "rounds"}

sites   bytes one rank sends per pass of each all-gather site, counted per c10d send (harness/wire.py `Sends`)
        on the operators themselves, FP8 (hybrid tensorwise) against bf16, x_shard [s/P, b, h]:
            column  all_gather_matmul (qkv, fc1): forward AG(x); backward AG(x) again beside RS(dx)
            row     matmul_reduce_scatter (proj, fc2): forward RS(y); backward AG(dy)
        The weight shards are 16 wide (qkv, fc1: 16 output rows; proj, fc2: 16 input columns: CUDA's smallest FP8
        GEMM width, as torch._scaled_mm on CPU is ~1000x slower than fp32; the bytes on the wire do not depend on
        it) and the reduce-scatter partials travel on the fp32 wire (twice the default bf16 wire's bytes), so a
        send's dtype names its ring: uint8 (FP8 bytes) or bf16 is an all-gather hop, fp32 a reduce-scatter hop.
ring    the all-gather ring alone (runtime `gather_and_consume`, the transfers of the operators' Flash-AG, nothing
        consumed) and the stock all-gather, of the bf16 shard and of its FP8 bytes, plus the FP8 ring with the
        shard's cast (`cast_shared`: the amax all-reduced MAX, then the quantize) as an operator runs it: seconds
        per call, the max over ranks of each round (runtime/timing.py `interleaved`, rotated, one warm-up round),
        and the bytes of one call.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

import megatron_flashoverlap as fo
from benchmarks.harness.wire import Sends
from megatron_flashoverlap.runtime import OverlapContext, all_gather_into, gather_and_consume
from megatron_flashoverlap.runtime.fp8 import cast_shared
from megatron_flashoverlap.runtime.timing import interleaved, rank_max, timed

BF16 = torch.bfloat16
WIDTH = 16  # weight rows per rank
RECIPE = fo.Fp8Recipe("hybrid")
AG_DTYPES = ("torch.uint8", "torch.bfloat16")


def _plan(fp8: bool) -> fo.OpPlan:
    return fo.OpPlan("flash", wire_dtype="fp32", fp8=RECIPE if fp8 else None)


def _pass_bytes(m: Sends) -> dict:
    """{"ag": all-gather bytes, "rs": reduce-scatter bytes} of one pass (module docstring: the dtype names the ring)."""
    return {"ag": sum(m.bytes(d) for d in AG_DTYPES), "rs": m.bytes("torch.float32")}


def _column(x_shard, fp8: bool) -> dict:
    w = torch.randn(WIDTH, x_shard.shape[-1]).to(BF16).requires_grad_()
    x = x_shard.clone().requires_grad_()
    with Sends() as fwd:
        y = fo.all_gather_matmul(x, w, plan=_plan(fp8))
    with Sends() as bwd:
        y.backward(torch.randn_like(y))
    return {"forward": _pass_bytes(fwd), "backward": _pass_bytes(bwd)}


def _row(x_shard, world: int, fp8: bool) -> dict:
    s, b, h = x_shard.shape
    x = torch.randn(s * world, b, WIDTH).to(BF16).requires_grad_()
    w = torch.randn(h, WIDTH).to(BF16).requires_grad_()
    with Sends() as fwd:
        y = fo.matmul_reduce_scatter(x, w, plan=_plan(fp8))
    with Sends() as bwd:
        y.backward(torch.randn_like(y))
    return {"forward": _pass_bytes(fwd), "backward": _pass_bytes(bwd)}


def sites(x_shard: torch.Tensor, world: int) -> list[dict]:
    """One row per (layer kind, pass): the all-gather and reduce-scatter bytes of the bf16 and the FP8 run."""
    runs = {fp8: {"column": _column(x_shard, fp8), "row": _row(x_shard, world, fp8)} for fp8 in (False, True)}
    return [{"layer": layer, "pass": pas, "bf16": runs[False][layer][pas], "fp8": runs[True][layer][pas]}
            for layer in ("column", "row") for pas in ("forward", "backward")]


def _variants(x_shard: torch.Tensor, ctx) -> dict:
    """{name: () -> None}: one call of each timed variant (module docstring)."""
    world = dist.get_world_size()
    wire = cast_shared(x_shard, "input", RECIPE, None, None).data.view(torch.uint8)  # the FP8 bytes [s/P, b, h]
    out = {BF16: torch.empty((world * x_shard.shape[0],) + x_shard.shape[1:], dtype=BF16),
           torch.uint8: torch.empty((world * wire.shape[0],) + wire.shape[1:], dtype=torch.uint8)}

    def ring(t):
        return lambda: gather_and_consume(t, lambda span, rows: None, None, ctx)

    def cast_then_ring():
        ring(cast_shared(x_shard, "input", RECIPE, None, None).data.view(torch.uint8))()
    return {"ring bf16": ring(x_shard), "ring fp8": ring(wire), "ring fp8 + cast": cast_then_ring,
            "stock bf16": lambda: all_gather_into(out[BF16], x_shard, None),
            "stock fp8": lambda: all_gather_into(out[torch.uint8], wire, None)}


def ring(x_shard: torch.Tensor, rounds: int) -> dict:
    """{variant: {"seconds": [max over ranks per round], "bytes": one call's sends on this rank}}."""
    calls = _variants(x_shard, OverlapContext())
    sent = {}
    for name, call in calls.items():
        with Sends() as m:
            call()
        sent[name] = m.bytes()
    seconds = rank_max(interleaved({n: (lambda c=c: timed(c)) for n, c in calls.items()}, rounds, rotate=True))
    return {n: {"seconds": seconds[n], "bytes": sent[n]} for n in calls}


def main(rank: int, world: int, cfg: dict) -> dict:
    torch.manual_seed(rank)
    shard = {s: torch.randn(cfg[s] // world, cfg["batch"], cfg["hidden"]).to(BF16) for s in ("sites_seq", "seq")}
    return {"world": world, "sites": sites(shard["sites_seq"], world), "ring": ring(shard["seq"], cfg["rounds"])}
