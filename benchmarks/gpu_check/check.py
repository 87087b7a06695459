"""Measurements of benchmarks/gpu_check/run.py on one GPU (parts a-e; f, NCCL on two or more GPUs: multi.py).

(a) syncs: every public operator (algo flash, flash_bidir, reference) and one Flash MLP layer, forward +
    backward on CUDA bf16 tensors, and the four TP operators in FP8 (hybrid, tensorwise: CUDA's _scaled_mm must
    take every layout our code hands it), on the fake process group at P = 2, 4, 8: shapes and dtypes as expected,
    and the steady-state call (after one warm-up) makes zero host syncs under set_sync_debug_mode("error").
    The operators run with OverlapContext(check_peers=False): the default peer check reads an all-gather on
    the host (one sync per call by design); one row measures it.
(b) slicing: each GEMM site's y = x @ W^T (bf16, d_model 4096 and 8192, 8k and 16k tokens, TP = P) split
    into the P row slices of the ring (2P for the bidirectional ring) against the unsplit GEMM; the RS sites
    also with fp32 output (torch.mm(out_dtype=), what the Flash-RS partial uses); the same in FP8 (e4m3,
    our scaled_mm: bf16 out, fp32 out at the RS sites) against the unsplit FP8 GEMM, and the FP8 GEMM's speed-up
    over bf16's. Cost = sum(slices) / unsplit - 1, goal <= 3 %.
(c) host overhead: host microseconds per call and per ring step of the forward operators on the fake group
    (tiny CUDA tensors, so the host is what is timed), flash against reference.
(d) memory: peak allocated bytes of forward + backward per operator at P = 4 (8k tokens, d_model 4096),
    flash against reference.
(e) CUDA graph: capture one Flash MLP layer forward (fake group, P = 2 and 4, 8k tokens, d_model 4096),
    replay, compare with eager bit for bit; host time of eager vs replay.
Timing: runtime/timing.py `interleaved` + `cuda_timed` (CUDA events), upper median of the rounds.
"""
from __future__ import annotations

import time

import torch

from megatron_flashoverlap.runtime import OverlapContext
from benchmarks.gpu_check.ops import FUSED, fake_group, first_sync, flash_layer, fp8_calls, layer_forward, operator_calls
from megatron_flashoverlap.runtime.scaled_mm import scaled_mm
from megatron_flashoverlap.runtime.timing import cuda_timed, interleaved

PARTS = (2, 4, 8)
ALGOS = FUSED + ("reference",)
D_MODELS, TOKENS = (4096, 8192), (8192, 16384)
ROUNDS, WARMUP, REPS = 7, 2, 3


def _ctx(check_peers: bool = False) -> OverlapContext:
    return OverlapContext(check_peers=check_peers)


def _shape_errors(call, outs) -> str:
    got = tuple(tuple(o.shape) for o in outs)
    want = tuple(tuple(s) for s in call.shapes)
    bad = [o.dtype for o in outs if o.dtype != torch.bfloat16]
    return "" if got == want and not bad else f"shapes {got} != {want} or dtypes {bad}"


def sync_rows(device="cuda", dry: bool = False) -> list[dict]:
    """(a): one row per (P, operator, algo): shape check and the first host sync of the second call."""
    rows = []
    for p in PARTS:
        with fake_group(p, rank=p - 1):
            for algo in ALGOS:
                calls = operator_calls(p, device, torch.bfloat16, _ctx(), algo)
                calls["flash_layer (MLP fwd+bwd)"] = flash_layer(p, device, torch.bfloat16, _ctx(), algo=algo)
                if not dry:  # CUDA takes our FP8 layouts; a dry run builds them small at P = 2 (CPU FP8 is slow)
                    calls.update(fp8_calls(p, device, torch.bfloat16, _ctx(), algo))
                elif p == 2:
                    calls.update(fp8_calls(p, device, torch.bfloat16, _ctx(), algo, rows=16, h=64))
                for name, call in calls.items():
                    bad = _shape_errors(call, call.fn())  # warm-up: buffers, cuBLAS handles, lazy inits
                    sync = "not checked (dry run)" if dry else (first_sync(call.fn) or "none")
                    rows.append({"P": p, "op": name, "algo": algo, "shapes": bad or "ok", "first_sync": sync})
            if not dry:
                peers = operator_calls(p, device, torch.bfloat16, _ctx(check_peers=True))["matmul_reduce_scatter"]
                peers.fn()
                rows.append({"P": p, "op": "matmul_reduce_scatter", "algo": "flash, check_peers=True",
                             "shapes": "ok", "first_sync": first_sync(peers.fn) or "none"})
    return rows


def _median(ts: list[float]) -> float:
    return sorted(ts)[len(ts) // 2]


def _sites(h: int, p: int) -> dict:
    """GEMM sites of one TP = p rank: name -> (K, N, reduce-scatter site?) of y [t, N] = x [t, K] @ W^T."""
    return {"qkv": (h, 3 * h // p, False), "proj": (h // p, h, True), "fc1": (h, 4 * h // p, False),
            "fc2": (4 * h // p, h, True)}


def _sliced(x, w, parts: int, fp32_out: bool):
    rows = x.shape[0] // parts
    for i in range(parts):
        xi = x[i * rows:(i + 1) * rows]
        torch.mm(xi, w.t(), out_dtype=torch.float32) if fp32_out else torch.mm(xi, w.t())


def _fp8_sliced(x8, w8t, one, parts: int, out_dtype):
    rows = x8.shape[0] // parts
    for i in range(parts):
        scaled_mm(x8[i * rows:(i + 1) * rows], w8t, one, one, out_dtype)


def slicing_point(tokens: int, h: int, p: int, site: str) -> dict:
    """(b) one point: unsplit vs P and 2P row slices (and fp32-output slices at RS sites)."""
    k, n, rs = _sites(h, p)[site]
    x = torch.randn(tokens, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    reps = lambda fn: cuda_timed(lambda: [fn() for _ in range(REPS)]) / REPS  # noqa: E731
    variants = {"unsplit": lambda: reps(lambda: torch.mm(x, w.t())),
                "P": lambda: reps(lambda: _sliced(x, w, p, False)),
                "2P": lambda: reps(lambda: _sliced(x, w, 2 * p, False))}
    if rs:
        variants["P fp32 out"] = lambda: reps(lambda: _sliced(x, w, p, True))
    x8, w8t, one = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn).t(), torch.ones((), device="cuda")
    out8 = torch.float32 if rs else torch.bfloat16  # what our Flash-RS partial / AG slice writes
    variants["fp8"] = lambda: reps(lambda: _fp8_sliced(x8, w8t, one, 1, out8))
    variants["fp8 P"] = lambda: reps(lambda: _fp8_sliced(x8, w8t, one, p, out8))
    t = {key: _median(ts) for key, ts in interleaved(variants, ROUNDS, warmup=WARMUP).items()}
    row = {"d_model": h, "tokens": tokens, "P": p, "site": site, "unsplit_ms": t["unsplit"] * 1e3,
           "tflops": 2.0 * tokens * k * n / t["unsplit"] / 1e12, "fp8 speed-up": t["unsplit"] / t["fp8"]}
    row.update({f"cost {key}": t[key] / t["unsplit"] - 1 for key in t if key not in ("unsplit", "fp8", "fp8 P")})
    row["cost fp8 P"] = t["fp8 P"] / t["fp8"] - 1
    return row


def slicing_rows(deadline: float) -> list[dict]:
    rows = []
    for h in D_MODELS:
        for tokens in TOKENS:
            for p in PARTS:
                for site in _sites(h, p):
                    if time.monotonic() > deadline:
                        return rows + [{"stopped": "time budget reached"}]
                    rows.append(slicing_point(tokens, h, p, site))
    return rows


def _host_us(fn, calls: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(calls):
        fn()
    host = time.perf_counter() - t
    torch.cuda.synchronize()
    return host / calls * 1e6


def host_rows(device="cuda") -> list[dict]:
    """(c): host us per forward call and per ring step (P steps), flash vs reference, tiny tensors."""
    rows = []
    for p in PARTS:
        with fake_group(p, rank=p - 1), torch.no_grad():
            for algo in ALGOS:
                calls = operator_calls(p, device, torch.bfloat16, _ctx(), algo, rows=8, hidden=64)
                for name in ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce"):
                    us = _host_us(calls[name].forward)
                    rows.append({"P": p, "op": name, "algo": algo, "host_us": us, "us_per_step": us / p})
    return rows


def memory_rows(device="cuda", p: int = 4, rows_per_rank: int = 2048, hidden: int = 4096) -> list[dict]:
    """(d): peak allocated MiB above the inputs, forward + backward, per operator and algo."""
    out = []
    with fake_group(p, rank=p - 1):
        for algo in ALGOS:
            for name, call in operator_calls(p, device, torch.bfloat16, _ctx(), algo, rows_per_rank,
                                             hidden).items():
                call.fn()  # warm-up: the context's buffers exist from here on, as in training
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                call.fn()
                torch.cuda.synchronize()
                out.append({"P": p, "op": name, "algo": algo,
                            "peak_MiB": (torch.cuda.max_memory_allocated() - base) / 2 ** 20})
    return out


def graph_rows(device="cuda", tokens: int = 8192, hidden: int = 4096) -> list[dict]:
    """(e): capture + replay of one Flash MLP layer forward; replay must equal eager bit for bit."""
    rows = []
    for p in (2, 4):
        with fake_group(p, rank=p - 1):
            ctx = _ctx()
            xs, forward = layer_forward(p, device, torch.bfloat16, ctx, tokens, hidden)
            rows.append({"P": p, **_capture(xs, forward)})
    return rows


def _capture(xs, forward) -> dict:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # warm-up off the capture stream: buffers and handles exist before capture
            forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_static = forward()
    results = {}
    for trial in ("same input", "new input"):
        if trial == "new input":
            xs.copy_(torch.randn_like(xs))
        graph.replay()
        eager = forward()
        torch.cuda.synchronize()
        results[trial] = torch.equal(torch.nan_to_num(y_static), torch.nan_to_num(eager))
    eager_us, replay_us = _host_us(forward, 10), _host_us(graph.replay, 10)
    return {"captured": True, "replay_equals_eager": all(results.values()), "eager_host_us": eager_us,
            "replay_host_us": replay_us}
