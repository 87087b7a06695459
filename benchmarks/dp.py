"""DP gradient reduce-scatter inside the wgrad GEMM, and TP without SP (all-reduce), vs stock, on the
emulated link (2 ranks in a tbf-shaped network namespace; the bench harness's netns, timing and stats).

    sudo .venv/bin/python benchmarks/dp.py                        # results/dp.md (+ dp_raw.json)
    .venv/bin/python benchmarks/dp.py --unshaped --quick          # no root: host loopback, labelled

Rows (every sample: max over ranks after a barrier; medians over --repeats, min-max in brackets):
- "dp wgrad+RS": the last bucket of a backward. stock = Megatron's order (wgrad GEMM into main_grad,
  scale, reduce-scatter of the bucket: nothing is left to hide it); flash = the reduce-scatter inside the
  wgrad GEMM (ddp/wgrad_rs.py). compute = the same call on a fake group (transfers complete at once);
  comm = the same call with one token (same bytes, GEMM shrunk to an outer product).
- "tp-nosp mlp": column (local fwd, all-reduce of dgrad in bwd) -> gelu -> row (all-reduce fwd), on
  [s, b, h] replicated activations: stock (GEMM, all_reduce; dgrad all-reduce async under the wgrad, as
  Megatron), data slicing k=2/4, flash with C sequence chunks (ops/all_reduce_matmul.py). compute/comm as
  the harness: fake group / inner width 1.
- "megatron ddp": a real Megatron-Core MLP (`--ddp-layers` x column+row, TP=1, DP=2) under
  DistributedDataParallel (distributed optimizer, overlap_grad_reduce): forward + backward +
  finish_grad_sync. stock (default 40M-param bucket: one bucket, reduced after the backward), stock with
  one bucket per weight, flash on every linear, flash on the first block only (the buckets reduced last).
  Block time only (the DP group cannot be faked inside Megatron): compare against stock.
exposed = block - compute; hidden = 1 - exposed / comm.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from megatron_flashoverlap.bench import blocks, timing  # noqa: E402
from megatron_flashoverlap.bench.blocks import Block, Method, Shape  # noqa: E402
from megatron_flashoverlap.bench.netns import shaped_namespace, why_not_shaped  # noqa: E402
from megatron_flashoverlap.ops.dp.wgrad_rs import matmul_wgrad_reduce_scatter  # noqa: E402
from megatron_flashoverlap.ops.tp_nosp.all_reduce_matmul import matmul_all_reduce, matmul_allreduce_dgrad  # noqa: E402
from megatron_flashoverlap.runtime import OverlapContext  # noqa: E402

TP_METHODS = (Method("stock", "reference"), Method("slicing k=2", "slicing", 2), Method("slicing k=4", "slicing", 4),
              Method("flash C=2", "flash", 2), Method("flash C=4", "flash", 4), Method("flash_bidir C=2", "flash_bidir", 2))
DP_METHODS = (Method("stock", "reference"), Method("flash", "flash"), Method("flash_bidir", "flash_bidir"))


class NoSPMlpBlock(Block):
    """x [s, b, h] replicated -> column (n/P) -> gelu -> row -> y [s, b, h] replicated."""

    kind = "mlp_nosp"

    def input(self, seed: int = 1) -> torch.Tensor:
        s = self.shape
        return torch.randn(s.seq, s.batch, s.hidden, generator=torch.Generator().manual_seed(seed))

    def forward(self, x, group, method: Method, ctx, spans=None):
        kw = dict(algo=method.algo, num_chunks=method.chunks, context=ctx)
        a = F.gelu(matmul_allreduce_dgrad(x, self.w_in, group, **kw))
        return matmul_all_reduce(a, self.w_out, group, **kw)


blocks.BLOCKS[NoSPMlpBlock.kind] = NoSPMlpBlock  # this process only: the harness's Runner builds it by kind


# ------------------------------------------------------------------ rank side

def _gathered(obj):
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _timed(fn) -> float:
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def dp_rows(cfg: dict, fake) -> list[dict]:
    """wgrad [n, k] of `tokens` rows + DP reduce-scatter of its bucket, per method."""
    world = dist.get_world_size()
    n, k, tokens = cfg["dp_n"], cfg["dp_k"], cfg["dp_tokens"]
    g = torch.Generator().manual_seed(dist.get_rank())
    full = (torch.randn(tokens, 1, n, generator=g), torch.randn(tokens, 1, k, generator=g))
    thin = (full[0][:1], full[1][:1])
    length = -(-(n * k) // (128 * world)) * 128 * world  # Megatron pads a bucket to lcm(DP, 128)
    grad = torch.zeros(length)
    ctx = OverlapContext(check_peers=False)

    def call(m, tensors, group):
        return lambda: matmul_wgrad_reduce_scatter(*tensors, grad, 0, group, scale=1.0 / world, algo=m.algo,
                                                   context=ctx)
    samples: dict = {}
    for r in range(cfg["repeats"] + 1):
        for m in DP_METHODS:
            s = {"block": _timed(call(m, full, None)), "compute": _timed(call(m, full, fake)),
                 "comm": _timed(call(m, thin, None))}
            for key, v in s.items():
                if r:
                    samples.setdefault((m.name, "bwd", key), []).append(v)
    stats = timing.combine(_gathered(samples))
    return [{"kind": "dp wgrad+RS", "seq": tokens, "method": m.name, "mode": "bwd",
             **timing.derived(stats, m.name, "bwd")} for m in DP_METHODS]


def tp_rows(cfg: dict, fake) -> list[dict]:
    world = dist.get_world_size()
    out = []
    for seq in cfg["seqs"]:
        runner = timing.Runner(NoSPMlpBlock.kind, Shape(seq, cfg["batch"], cfg["hidden"], cfg["width"]), world)
        stats = timing.combine(_gathered(timing.measure(runner, TP_METHODS, cfg["repeats"], None, fake)))
        out += [{"kind": "tp-nosp mlp", "seq": seq, "method": m.name, "mode": mode,
                 **timing.derived(stats, m.name, mode)} for m in TP_METHODS for mode in timing.MODES]
    return out


def ddp_rows(cfg: dict) -> list[dict]:
    """Megatron DDP fwd+bwd+finish_grad_sync per variant (block time only)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    from megatron_flashoverlap.megatron import cpu
    from megatron_flashoverlap.megatron.ddp_linear import wrap_with_dp_overlap

    cpu.enable()  # also the optimizer's and 0.19's start_grad_sync CUDA-stream shims
    ps.initialize_model_parallel(tensor_model_parallel_size=1)
    model_parallel_cuda_manual_seed(1)
    h, f, layers, tokens = cfg["hidden"], cfg["width"], cfg["ddp_layers"], cfg["dp_tokens"]
    tcfg = TransformerConfig(num_layers=1, hidden_size=h, num_attention_heads=1, use_cpu_initialization=True)
    init = torch.nn.init.xavier_normal_

    def module():
        return torch.nn.Sequential(*[m for _ in range(layers) for m in (
            ColumnParallelLinear(h, f, config=tcfg, init_method=init, bias=False, gather_output=False),
            RowParallelLinear(f, h, config=tcfg, init_method=init, bias=False, input_is_parallel=True,
                              skip_bias_add=False))])

    def build(variant):
        torch.manual_seed(0)
        m = module()
        kw = {"bucket_size": h * f} if variant == "stock, bucket per weight" else {}
        dcfg = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=True, **kw)
        if variant.startswith("stock"):
            return m, DistributedDataParallel(tcfg, dcfg, m)
        chosen = list(m) if variant == "flash, every linear" else list(m)[:2]
        return m, wrap_with_dp_overlap(tcfg, dcfg, m, linears=chosen)[0]

    x = torch.randn(tokens, 1, h)
    variants = ("stock", "stock, bucket per weight", "flash, every linear", "flash, first block")
    models = {v: build(v) for v in variants}

    def step(v):
        m, ddp = models[v]
        ddp.zero_grad_buffer()
        y = x
        for i in range(0, len(m), 2):
            y = m[i + 1](m[i](y)[0])[0]
        y.sum().backward()
        ddp.finish_grad_sync()
    samples: dict = {}
    for r in range(cfg["repeats"] + 1):
        for v in variants:
            t = _timed(lambda: step(v))
            if r:
                samples.setdefault(v, []).append(t)
    ps.destroy_model_parallel()
    per_rank = _gathered(samples)
    rows = []
    for v in variants:
        ts = [max(vals) for vals in zip(*(d[v] for d in per_rank))]
        med = sorted(ts)[len(ts) // 2]
        rows.append({"kind": "megatron ddp", "seq": tokens, "method": v, "mode": "fwd+bwd", "block": med,
                     "compute": float("nan"), "comm": float("nan"), "exposed": float("nan"),
                     "hidden": float("nan"), "spread": (min(ts), max(ts))})
    return rows


def worker(cfg_path: str, out_path: str) -> None:
    cfg = json.loads(open(cfg_path).read())
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    dist.init_process_group("gloo")
    try:
        fake = timing.fake_group(dist.get_world_size())
        rows = dp_rows(cfg, fake) + ddp_rows(cfg) + tp_rows(cfg, fake)
        if dist.get_rank() == 0:
            with open(out_path, "w") as f:
                json.dump({"config": cfg, "world": dist.get_world_size(), "rows": rows}, f)
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------ launcher side

def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT, "TORCH_CPP_LOG_LEVEL": "ERROR",
            "PYTHONWARNINGS": "ignore"}


def run_rate(cfg: dict, rate: str, ns, tmp: str, timeout: float) -> dict:
    tag = rate.replace("/", "_")
    cfg_path, out_path = os.path.join(tmp, f"cfg_{tag}.json"), os.path.join(tmp, f"out_{tag}.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
            os.path.abspath(__file__), "--worker", cfg_path, out_path]
    if ns is not None:
        ns.shape_lo(rate, cfg["burst"])
        argv = ns.exec_argv(argv)
    subprocess.run(argv, env=_env(), check=True, timeout=timeout)
    with open(out_path) as f:
        return {**json.load(f), "rate": rate}


COLS = ("| rows | mode | size | method | block ms (min-max) | compute ms | comm ms | exposed ms | hidden | "
        "vs stock |\n|---|---|---|---|---|---|---|---|---|---|")


def table(run: dict) -> str:
    stock = {(r["kind"], r["seq"], r["mode"]): r["block"] for r in run["rows"] if r["method"] == "stock"}
    lines = [COLS]
    for r in run["rows"]:
        lo, hi = r["spread"]
        size = f"{r['seq']} tokens" if "dp" in r["kind"] else f"s={r['seq']}"
        lines.append(f"| {r['kind']} | {r['mode']} | {size} | {r['method']} | {r['block'] * 1e3:.1f} "
                     f"({lo * 1e3:.1f}-{hi * 1e3:.1f}) | {r['compute'] * 1e3:.1f} | {r['comm'] * 1e3:.1f} | "
                     f"{r['exposed'] * 1e3:.1f} | {r['hidden'] * 100:.0f}% | "
                     f"{stock[(r['kind'], r['seq'], r['mode'])] / r['block']:.2f}x |".replace("nan%", "-").replace("nan", "-"))
    return "\n".join(lines)


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rates", default="1gbit", help="tbf rates (comma list)")
    p.add_argument("--burst", default="512kb")
    p.add_argument("--seqs", default="512,1024", help="TP-without-SP sequence lengths")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--width", type=int, default=512, help="per-rank inner width of the TP MLP")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dp-n", type=int, default=1024, help="DP weight rows (W [n, k])")
    p.add_argument("--dp-k", type=int, default=512)
    p.add_argument("--dp-tokens", type=int, default=2048, help="tokens of the wgrad GEMM")
    p.add_argument("--ddp-layers", type=int, default=2, help="column+row blocks of the Megatron DDP rows")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--unshaped", action="store_true", help="host loopback, no root; labelled 'unshaped'")
    p.add_argument("--quick", action="store_true", help="tiny sizes, 1 repeat (smoke test)")
    p.add_argument("--out", default="results")
    p.add_argument("--timeout", type=float, default=3600.0)
    a = p.parse_args(argv)
    if a.quick:
        a.seqs, a.hidden, a.width, a.dp_n, a.dp_k, a.dp_tokens, a.repeats = "64", 64, 64, 64, 64, 64, 1
    return a


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2], sys.argv[3])
        return 0
    a = parse(argv)
    if not a.unshaped and why_not_shaped():
        print(f"cannot shape the link: {why_not_shaped()}. Rerun with --unshaped (labelled).", file=sys.stderr)
        return 2
    cfg = {"seqs": [int(s) for s in a.seqs.split(",")], "hidden": a.hidden, "width": a.width, "batch": a.batch,
           "dp_n": a.dp_n, "dp_k": a.dp_k, "dp_tokens": a.dp_tokens, "ddp_layers": a.ddp_layers, "repeats": a.repeats, "burst": a.burst}
    runs = []
    with tempfile.TemporaryDirectory(prefix="flashoverlap-dp-") as tmp:
        if a.unshaped:
            runs.append({**run_rate(cfg, "unshaped", None, tmp, a.timeout), "rate": "unshaped (host loopback)"})
        else:
            with shaped_namespace(None) as ns:
                runs += [run_rate(cfg, rate, ns, tmp, a.timeout) for rate in a.rates.split(",")]
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    cmd = "python benchmarks/dp.py " + " ".join(sys.argv[1:] if argv is None else argv)
    md = [f"# DP reduce-scatter in the wgrad GEMM, TP without SP ({now})", "", f"Command: `{cmd}`", ""]
    for run in runs:
        md += [f"## link {run['rate']}, 2 ranks, W [{a.dp_n}, {a.dp_k}] fp32, TP MLP h={a.hidden} "
               f"w={a.width} b={a.batch}", "", table(run), ""]
    os.makedirs(a.out, exist_ok=True)
    text = "\n".join(md) + "\n"
    with open(os.path.join(a.out, "dp.md"), "w") as f:
        f.write(text)
    with open(os.path.join(a.out, "dp_raw.json"), "w") as f:
        json.dump(runs, f)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
