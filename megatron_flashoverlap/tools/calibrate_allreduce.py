"""Measure all-reduce latency per message size, stock vs ours, on the current group; write the JSON table
that `all_reduce(algo="auto")` reads (plan/chooser.py).

    torchrun --nproc-per-node 4 -m megatron_flashoverlap.tools.calibrate_allreduce \
        --out allreduce_calibration.json [--local-world-size 2] [--dtype bfloat16]
    then point the decode all-reduce at the file: all_reduce.table in the config, or the variable
    config.ENV_VARS["allreduce_table"] (it then chooses by the file instead of measuring at first use)

Each size: `warmup + iters` rounds of runtime/timing.py `interleaved`; a round runs every algorithm once
(order rotated per round), each behind a barrier; a round's time is the slowest rank's; the table keeps
the median, the minimum and every kept round (`<algo>_rounds_us`, for intervals). "auto" is measured too, on
the same message shaped [1, 1, n] (decode-shaped): what the chooser picks there (plan/chooser.py; its own
paired measurement runs in the warm-up round), timed like the others, and what it picked (`auto_ran`); the
lookup ignores both.
The file holds one table per (world_size, local_world_size, backend, dtype), the key `auto` looks up
(a gloo or float32 table never steers NCCL or bfloat16); a run replaces its own entry.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics

import torch
import torch.distributed as dist

from ..config import active
from ..ops.all_reduce.all_reduce import AR_ALGOS, all_reduce, auto_key, resolve_local_world_size
from ..ops.all_reduce.select import dtype_name
from ..plan.chooser import chooser_of
from ..runtime import OverlapContext
from ..runtime.timing import interleaved, rank_max, timed

DT = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MEASURED = AR_ALGOS  # auto (what the start-up calibration chose), stock, ours
TABLE_KEY = ("world_size", "local_world_size", "backend", "dtype")  # what plan/chooser.py table_layout matches


def default_sizes(lo: int = 8 << 10, hi: int = 8 << 20) -> list[int]:
    """Powers of two from lo to hi bytes (8 KB - 8 MB: the decode range and a decade around it)."""
    out, s = [], lo
    while s <= hi:
        out.append(s)
        s *= 2
    return out


def _variant(x, algo, group, local, ctx, device):
    """One measured all-reduce (behind a barrier of `group`; a CUDA device is synchronised inside the clock);
    auto gets the message decode-shaped, [1, 1, n], as a decode step hands it over."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None
    x = x.view(1, 1, -1) if algo == "auto" else x
    return lambda: timed(lambda: all_reduce(x, group, algo=algo, local_world_size=local, context=ctx), sync=sync,
                         group=group)


def measure(sizes, algos=MEASURED, group=None, local_world_size=None, dtype=torch.bfloat16, iters=20,
            warmup=3, device=None) -> list[dict]:
    """Rows {"bytes", "<algo>_us" (median over rounds of the slowest rank), "<algo>_min_us"} per size."""
    device = device or torch.device("cpu")
    world = dist.get_world_size(group)
    local = resolve_local_world_size(world, local_world_size, group)
    ctx = OverlapContext(check_peers=False)  # the peer check is one extra all-gather: not part of the op
    esize = torch.empty((), dtype=dtype).element_size()
    rows = []
    for nbytes in sizes:
        x = torch.randn(max(nbytes // esize, 1), device=device).to(dtype)
        variants = {a: _variant(x, a, group, local, ctx, device) for a in algos}
        times = rank_max(interleaved(variants, iters, warmup=warmup, rotate=True), group)  # slowest rank's round
        row = {"bytes": int(nbytes)}
        if "auto" in algos:
            row["auto_ran"] = _auto_ran(x, group, local)
        for a in algos:
            row[f"{a}_us"] = round(statistics.median(times[a]) * 1e6, 1)
            row[f"{a}_min_us"] = round(min(times[a]) * 1e6, 1)
            row[f"{a}_rounds_us"] = [round(t * 1e6, 1) for t in times[a]]
        rows.append(row)
    return rows


def _auto_ran(x, group, local: int) -> str | None:
    """What the chooser picked for auto's message x, decode-shaped [1, 1, n] (None: nothing decided for it)."""
    got = chooser_of(active()).decided.get(auto_key(x.view(1, 1, -1), group, local))
    return got.pick if got is not None else None


def table(rows, group=None, local_world_size=None, dtype=torch.bfloat16, iters=20, note="") -> dict:
    """The file's entry: the layout, dtype, versions and conditions beside the rows."""
    world = dist.get_world_size(group)
    local = resolve_local_world_size(world, local_world_size, group)
    out = {"world_size": world, "local_world_size": local, "backend": str(dist.get_backend(group)),
           "dtype": dtype_name(dtype), "iters": iters, "torch": torch.__version__, "note": note, "rows": rows,
           "measured_at": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")}
    return out


def write(path: str, entry: dict) -> None:
    """Merge `entry` into the file's tables, replacing the one with the same lookup key (TABLE_KEY)."""
    data = {"tables": []}
    if os.path.exists(path):
        with open(path) as f:
            data = json.load(f)
    data["tables"] = [t for t in data["tables"] if any(t.get(k) != entry[k] for k in TABLE_KEY)] + [entry]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(data, f, indent=1)


def _args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="allreduce_calibration.json")
    p.add_argument("--sizes", type=int, nargs="*", help="message sizes in bytes (default 8 KB - 8 MB, x2)")
    p.add_argument("--local-world-size", type=int, default=None, help="ranks per node (default LOCAL_WORLD_SIZE)")
    p.add_argument("--dtype", choices=sorted(DT), default="bfloat16")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--note", default="", help="conditions to record with the table (link, load)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    a = _args(argv)
    cuda = torch.cuda.is_available()
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo")  # env:// (torchrun or the topology benchmark)
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(1)
    dt = DT[a.dtype]
    rows = measure(a.sizes or default_sizes(), group=None, local_world_size=a.local_world_size, dtype=dt,
                   iters=a.iters, warmup=a.warmup, device=device)
    if dist.get_rank() == 0:
        write(a.out, table(rows, None, a.local_world_size, dt, a.iters, a.note))
        print(json.dumps(rows))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
