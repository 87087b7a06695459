"""Part (f) of benchmarks/gpu_check/run.py: NCCL across the GPUs of one machine, one spawned process per GPU.

numerics   y = RS(x_k @ w_k^T), bf16, by flash with wire "input" and "fp32" and by stock's reduce-scatter,
           relative RMS error against the fp64 formula (the gloo test's ordering: fp32 <= input ~ stock);
           all_gather_matmul flash against reference bit for bit (no sum is reordered)
run-ahead  a ~100 ms GPU sleep, then 10 flash calls: the host must return long before the sleep ends
           (a timed `work.wait(timeout)` on NCCL polls on the host, which this catches and the fake group not)
overlap    one MLP block forward (all_gather_matmul, gelu, matmul_reduce_scatter; 8k tokens, d_model 4096)
           for reference, slicing (k = 4), flash, flash_bidir; compute alone (the same GEMMs, no communication)
           and communication alone (stock all-gather + reduce-scatter of the same bytes):
           exposed = T_block - T_compute, hidden = 1 - exposed / T_comm (CUDA events, median of rounds, the
           slowest rank).
"""
from __future__ import annotations

import socket
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

import megatron_flashoverlap.ops as fo
from megatron_flashoverlap.runtime import OverlapContext, all_gather_into, reduce_scatter_into
from megatron_flashoverlap.runtime.timing import cuda_timed, interleaved

ROUNDS, WARMUP = 10, 3


def run(world: int, timeout_s: float = 240.0) -> dict:
    """Spawn `world` NCCL ranks; -> rank 0's results (or {"error": traceback})."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.SimpleQueue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, q), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    while q.empty() and time.monotonic() < deadline and any(p.is_alive() for p in procs):
        time.sleep(0.5)
    out = q.get() if not q.empty() else {"error": f"no result within {timeout_s:.0f} s (or a rank died)"}
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    return out


def _worker(rank: int, world: int, port: int, q) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        out = {"world": world, "numerics": _numerics(rank, world), "run_ahead": _run_ahead(rank, world),
               "overlap": _overlap(rank, world)}
    except Exception:  # noqa: BLE001 - the report shows it
        out = {"error": traceback.format_exc()}
    if rank == 0:
        q.put(out)
    dist.destroy_process_group()


def _shards(rank, world, s, k, h, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(s, 1, k, generator=g).to(torch.bfloat16)
    w = (torch.randn(h, k, generator=g) / k ** 0.5).to(torch.bfloat16)
    kl = k // world
    return x, w, x[..., rank * kl:(rank + 1) * kl].cuda(), w[:, rank * kl:(rank + 1) * kl].cuda()


def _numerics(rank, world) -> dict:
    s, k, h = 256 * world, 512 * world, 512
    x, w, xk, wk = _shards(rank, world, s, k, h)
    sl = s // world
    y64 = (x.double() @ w.double().t())[rank * sl:(rank + 1) * sl].cuda()
    ctx = OverlapContext(check_peers=False)
    got = {wire: fo.matmul_reduce_scatter(xk, wk, plan=fo.OpPlan(wire_dtype=wire), context=ctx)
           for wire in ("input", "fp32")}
    partial = F.linear(xk, wk)
    got["stock"] = torch.empty_like(got["input"])
    reduce_scatter_into(got["stock"], partial.contiguous(), None)
    sums = torch.tensor([(got[key].double() - y64).pow(2).sum().item() for key in ("input", "fp32", "stock")]
                        + [y64.pow(2).sum().item()], device="cuda", dtype=torch.float64)
    dist.all_reduce(sums)
    xs = x[rank * sl:(rank + 1) * sl].cuda()
    ws = torch.randn(64, xs.shape[-1], device="cuda").to(torch.bfloat16)  # this rank's column shard [n/P, k]
    y, y_ref = fo.all_gather_matmul(xs, ws, context=ctx), fo.all_gather_matmul(xs, ws, algo="reference")
    rel = {key: (sums[i] / sums[3]).sqrt().item() for i, key in enumerate(("input", "fp32", "stock"))}
    diff = ((y.double() - y_ref.double()).abs().max() / y_ref.double().abs().max()).item()
    return {"rel_rms": rel, "ag_flash_equals_reference": bool(torch.equal(y, y_ref)), "ag_max_rel_diff": diff}


def _sleep_cycles(seconds: float) -> int:
    """GPU clock cycles of torch.cuda._sleep that last about `seconds` (calibrated on this device)."""
    probe = 10_000_000
    t = cuda_timed(lambda: torch.cuda._sleep(probe))
    return int(probe * seconds / max(t, 1e-6))


def _run_ahead(rank, world) -> dict:
    _, _, xk, wk = _shards(rank, world, 64 * world, 64 * world, 256)
    ctx = OverlapContext(check_peers=False)
    call = lambda: fo.matmul_reduce_scatter(xk, wk, context=ctx)  # noqa: E731
    call()
    cycles = _sleep_cycles(0.1)
    torch.cuda.synchronize()
    dist.barrier()
    torch.cuda._sleep(cycles)
    t0 = time.perf_counter()
    for _ in range(10):
        call()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    total = time.perf_counter() - t0
    return {"host_s": host, "gpu_done_s": total, "ran_ahead": host < 0.5 * total}


def _block(xs, w1, w2, algo, ctx):
    kw = dict(plan=fo.OpPlan(algo, num_chunks=4 if algo == "slicing" else None), context=ctx)
    return fo.matmul_reduce_scatter(F.gelu(fo.all_gather_matmul(xs, w1, **kw)), w2, **kw)


def _overlap(rank, world, tokens=8192, h=4096) -> dict:
    mk = lambda *shape: (torch.randn(shape, device="cuda") * shape[-1] ** -0.5).to(torch.bfloat16)  # noqa: E731
    xs, w1, w2 = mk(tokens // world, 1, h), mk(4 * h // world, h), mk(h, 4 * h // world)
    full, part = mk(tokens, 1, h), mk(tokens, 1, h)  # AG(x) [s, 1, h]; the fc2 partial [s, 1, h]
    ctx = OverlapContext(check_peers=False)
    gathered, out = torch.empty_like(full), torch.empty(tokens // world, 1, h, device="cuda", dtype=torch.bfloat16)
    variants = {algo: (lambda a=algo: cuda_timed(lambda: _block(xs, w1, w2, a, ctx)))
                for algo in ("reference", "slicing", "flash", "flash_bidir")}
    variants["compute alone"] = lambda: cuda_timed(lambda: F.linear(F.gelu(F.linear(full, w1)), w2))
    variants["comm alone"] = lambda: cuda_timed(lambda: (all_gather_into(gathered, xs, None),
                                                         reduce_scatter_into(out, part, None)))
    with torch.no_grad():
        samples = interleaved(variants, ROUNDS, warmup=WARMUP, tick=dist.barrier)
    med = {key: sorted(ts)[len(ts) // 2] for key, ts in samples.items()}
    t = torch.tensor(list(med.values()), device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    med = dict(zip(med, t.tolist()))
    comp, comm = med["compute alone"], med["comm alone"]
    return {key: {"ms": v * 1e3, "exposed_ms": (v - comp) * 1e3, "hidden": 1 - (v - comp) / comm,
                  "vs_bound": v / max(comp, comm)} for key, v in med.items()}
