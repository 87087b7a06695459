"""Attention-block benchmark: query-split attention (TP+SP) and Flash all-to-all Ulysses (CP) vs stock.

    sudo .venv/bin/python benchmarks/attention.py --rate 1gbit     # ranks in a tbf-shaped namespace
    .venv/bin/python benchmarks/attention.py --unshaped            # host loopback (no root), labelled so

Blocks (megatron_flashoverlap/ops/attention_bench.py): "qsa" = AG+QKV GEMM, then attention + proj + RS
(stock: attention, GEMM, RS; slicing k: attention, sliced GEMM+RS; flash: query split in Flash-RS order),
"qsa_zigzag" = the same with zigzag-balanced causal blocks, "ulysses" = QKV GEMM, a2a, attention, a2a,
proj GEMM (stock: all_to_all_single; flash: GEMMs inside the pairwise a2a steps). Per method and mode:
block time, compute alone (the same block on torch's fake process group: every transfer is free),
communication alone (qsa: width 1, same bytes; ulysses: the two exchanges only), exposed = block -
compute, hidden = 1 - exposed / comm. Medians over repeats of the max over ranks. On a shared 2-core VM
absolute times are noise; compare rows of one run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

KINDS = {"qsa": ["stock", "slicing k=2", "slicing k=4", "flash", "flash_bidir"],
         "qsa_zigzag": ["stock", "flash"], "ulysses": ["stock", "flash"]}


def _time(fn, repeats):
    import torch.distributed as dist
    import torch

    ts = []
    for _ in range(repeats + 1):  # one warm-up
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        t = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        ts.append(t.item())
    return statistics.median(ts[1:])


def _call(block, x, group, method, ctx, mode, comm_alone=False):
    x = x.detach().requires_grad_(mode != "fwd")
    y = block.comm_alone(x, group, method, ctx) if comm_alone else block.forward(x, group, method, ctx)
    if mode != "fwd" and not comm_alone:
        y.backward(y.detach())
        for p in block.params():
            p.grad = None


def worker(cfg: dict) -> None:
    import torch
    import torch.distributed as dist

    from megatron_flashoverlap.bench.blocks import Shape, comm_only, method_by_name
    from megatron_flashoverlap.bench.timing import fake_group
    from megatron_flashoverlap.bench.attention_blocks import ATTENTION_BLOCKS
    from megatron_flashoverlap.runtime import OverlapContext

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    fake = fake_group(world)
    shape = Shape(cfg["seq"], cfg["batch"], cfg["hidden"], cfg["width"], cfg["head_dim"])
    ctx = OverlapContext(check_peers=False)
    rows = []
    for kind, methods in KINDS.items():
        block = ATTENTION_BLOCKS[kind](shape, world)
        thin = ATTENTION_BLOCKS[kind](comm_only(shape), world) if kind != "ulysses" else block
        x = block.input()
        for name in methods:
            m = method_by_name(name)
            for mode in ("fwd", "fwd+bwd"):
                t_block = _time(lambda: _call(block, x, None, m, ctx, mode), cfg["repeats"])
                t_comp = _time(lambda: _call(block, x, fake, m, ctx, mode), cfg["repeats"])
                t_comm = _time(lambda: _call(thin, x, None, m, ctx, mode, kind == "ulysses"), cfg["repeats"])
                if kind == "ulysses" and mode != "fwd":
                    t_comm *= 2  # backward repeats both exchanges (the duals)
                rows.append({"kind": kind, "method": name, "mode": mode, "block": t_block, "compute": t_comp,
                             "comm": t_comm})
    if rank == 0:
        with open(cfg["out"], "w") as f:
            json.dump({"config": cfg, "world": world, "rows": rows}, f, indent=1)
    dist.destroy_process_group()


def table(res: dict) -> str:
    out = ["| block | method | mode | block ms | compute ms | comm ms | exposed ms | hidden | vs stock |",
           "|---|---|---|---|---|---|---|---|---|"]
    stock = {(r["kind"], r["mode"]): r["block"] for r in res["rows"] if r["method"] == "stock"}
    for r in res["rows"]:
        exposed = max(r["block"] - r["compute"], 0.0)
        hidden = 1 - min(exposed / r["comm"], 1.0) if r["comm"] > 0 else float("nan")
        out.append(f"| {r['kind']} | {r['method']} | {r['mode']} | {r['block'] * 1e3:.1f} | {r['compute'] * 1e3:.1f} | "
                   f"{r['comm'] * 1e3:.1f} | {exposed * 1e3:.1f} | {hidden:.0%} | "
                   f"{r['block'] / stock[(r['kind'], r['mode'])]:.2f} |")
    return "\n".join(out)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--width", type=int, default=256, help="qsa: per-rank heads*head_dim; ulysses: all heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rate", default="1gbit", help="tbf rate of the namespace's loopback")
    p.add_argument("--unshaped", action="store_true", help="host loopback, no namespace (no root needed)")
    p.add_argument("--out", default="results/attention.md")
    a = p.parse_args(argv)
    from megatron_flashoverlap.bench.launch import _run, torchrun_argv
    from megatron_flashoverlap.bench.netns import shaped_namespace

    with tempfile.TemporaryDirectory() as tmp:
        cfg = {k: getattr(a, k) for k in ("seq", "batch", "hidden", "width", "head_dim", "repeats")}
        cfg["out"] = os.path.join(tmp, "out.json")
        cfg_path = os.path.join(tmp, "cfg.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        argv = torchrun_argv(cfg_path, cfg["out"], a.world)
        argv[argv.index("megatron_flashoverlap.bench.worker") - 1:] = [os.path.abspath(__file__), "--worker", cfg_path]
        if a.unshaped:
            _run(argv, None, 3600)
        else:
            with shaped_namespace(a.rate) as ns:
                _run(argv, ns, 3600)
        with open(cfg["out"]) as f:
            res = json.load(f)
    link = "unshaped loopback" if a.unshaped else f"tbf {a.rate}"
    text = (f"P={res['world']}, {link}, seq={a.seq}, batch={a.batch}, hidden={a.hidden}, width={a.width}, "
            f"head_dim={a.head_dim}, causal, fp32, medians of {a.repeats}\n\n{table(res)}\n")
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        with open(sys.argv[2]) as f:
            worker(json.load(f))
    else:
        main()
