"""Where --flash-overlap pays on GPUs nobody here can run: the planner's PREDICTIONS for a fixed set of clusters,
models and layouts, as the markdown table docs/planner.md carries (a pure test keeps the two equal).

    python -m megatron_flashoverlap.plan where        prints the table and the command of every row

Each row is the main form of the CLI (cli.py) on one scenario: the training step stock vs --flash-overlap, the
algorithm the planner picks at each TP site, and the decode all-reduce of [1, DECODE_BATCH, h] over TP: NCCL's
call, our best schedule on NCCL send/recv hops (the executor as it is), and the same schedules with GPU-initiated
hops (catalog.GPU_PUT_US: a put and its signal instead of a send/recv call; none published over PCIe).
"""
from __future__ import annotations

import dataclasses
import shlex

from . import catalog
from .flags import cluster_of, main_parser, model_of, sizes
from .collectives import all_reduce
from .links import place
from .price import Env
from .train_step import StepTimes, plan_step

DECODE_BATCH = 32
_COMMON = "--seq-length 8192 --micro-batch-size 1 --global-batch-size 64 --sequence-parallel"
MODELS = {
    "Llama-3-8B": "--hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --num-query-groups 8 "
                  "--num-layers 32 --padded-vocab-size 128256 --swiglu",
    "Llama-3-70B": "--hidden-size 8192 --ffn-hidden-size 28672 --num-attention-heads 64 --num-query-groups 8 "
                   "--num-layers 80 --padded-vocab-size 128256 --swiglu",
    "GPT-3-175B": "--hidden-size 12288 --ffn-hidden-size 49152 --num-attention-heads 96 --num-layers 96 "
                  "--padded-vocab-size 51200",
}
# (cluster in words, model, the cluster and layout arguments); 4 nodes of 8 GPUs each
SCENARIOS = (
    ("H100 SXM, NVLink 4 + IB NDR", "Llama-3-8B", "--gpu h100 --nodes 4 --tensor-model-parallel-size 8"),
    ("H100 SXM, NVLink 4 + IB NDR", "Llama-3-70B", "--gpu h100 --nodes 4 --tensor-model-parallel-size 8"),
    ("H100 SXM, FP8", "Llama-3-70B", "--gpu h100 --nodes 4 --tensor-model-parallel-size 8 --fp8"),
    ("H100 SXM, NVLink 4 + IB NDR", "GPT-3-175B", "--gpu h100 --nodes 4 --tensor-model-parallel-size 8"),
    ("H100 SXM, TP across 2 nodes", "GPT-3-175B", "--gpu h100 --nodes 4 --tensor-model-parallel-size 16"),
    ("H200 SXM, NVLink 4 + IB NDR", "Llama-3-70B", "--gpu h200 --nodes 4 --tensor-model-parallel-size 8"),
    ("B200 HGX, NVLink 5 + IB NDR", "Llama-3-70B", "--gpu b200 --nodes 4 --tensor-model-parallel-size 8"),
    ("H800, NVLink 400 GB/s + IB NDR", "Llama-3-8B", "--gpu h800 --nodes 4 --tensor-model-parallel-size 8"),
    ("H800, NVLink 400 GB/s + IB NDR", "Llama-3-70B", "--gpu h800 --nodes 4 --tensor-model-parallel-size 8"),
    ("A800, NVLink 400 GB/s + IB NDR", "Llama-3-70B", "--gpu a800 --nodes 4 --tensor-model-parallel-size 8"),
    ("L40S, PCIe Gen4 + RoCE 400G", "Llama-3-8B", "--gpu l40s --nodes 4 --tensor-model-parallel-size 8 "
                                                  "--inter-node roce_400"),
    ("L20, PCIe Gen4 + RoCE 400G", "Llama-3-8B", "--gpu l20 --nodes 4 --tensor-model-parallel-size 8 "
                                                 "--inter-node roce_400"),
)


def command(model: str, args: str) -> str:
    """The CLI arguments of one row (module docstring)."""
    return f"{MODELS[model]} {_COMMON} {args} --decode-batch {DECODE_BATCH}"


def gpu_initiated(env: Env) -> Env | None:
    """The same machine with every hop a GPU-initiated put (catalog.GPU_PUT_US); None where the node's link has
    no published price (PCIe)."""
    c = env.cluster
    if not c.intra.name.startswith("nvlink"):
        return None
    intra = dataclasses.replace(c.intra, p2p_us=catalog.GPU_PUT_US["nvlink"])
    inter = dataclasses.replace(c.inter, p2p_us=catalog.GPU_PUT_US["net"])
    return Env(dataclasses.replace(c, intra=intra, inter=inter), env.dtype)


def _speedup(nccl: float, ours: float, algo: str) -> str:
    return f"{nccl / ours:.2f}x ({algo.split(':')[1].replace('_', ' ')}, {ours * 1e6:.0f} us)"


def _decode(env: Env, st: StepTimes) -> list[str]:
    d = st.decode
    nccl = d.time("reference")
    algo, ours = d.best("flash")
    gi = gpu_initiated(env)
    if gi is None:
        put = "-"
    else:
        tp = place(st.layout.tp, 1, env.cluster)
        g = all_reduce(gi, tp, DECODE_BATCH * st.model.hidden * env.bytes)
        put = _speedup(nccl, *reversed(g.best("flash")))
    return [f"{nccl * 1e6:.1f}", _speedup(nccl, ours, algo), put]


def row(cluster: str, model: str, args: str) -> list[str]:
    """One table row (module docstring)."""
    a = main_parser().parse_args(shlex.split(command(model, args)))
    layout, nodes = sizes(a)
    env = Env(cluster_of(a, nodes), a.dtype or "bf16")
    st = plan_step(env, model_of(a), layout, DECODE_BATCH)
    stock, ours = st.step(True), st.step(False)
    sites = " / ".join(s.variant for s in st.layer.sites.values())
    gpn = env.cluster.gpus_per_node
    across = f" over {layout.tp // gpn} nodes" if layout.tp > gpn else ""
    layout_words = f"TP {layout.tp}{across} + SP, DP {layout.dp}"
    return [cluster, model, layout_words, f"{stock:.2f} -> {ours:.2f} s ({(ours - stock) / stock * 100:+.1f} %)",
            sites, "all" if st.dp_fuse else "none"] + _decode(env, st)


HEADER = ("cluster (8 GPUs a node, 4 nodes)", "model", "layout", "training step, stock -> --flash-overlap",
          "sites qkv / proj / fc1 / fc2", "dp.fuse", "decode all-reduce: NCCL, us",
          "ours on NCCL send/recv (speedup)", "ours on GPU-initiated hops (speedup)")


def table() -> str:
    """The markdown table and the commands of its rows, every figure a PREDICTION (module docstring)."""
    lines = ["| " + " | ".join(HEADER) + " |", "|" + "---|" * len(HEADER)]
    lines += ["| " + " | ".join(row(*s)) + " |" for s in SCENARIOS]
    lines += ["", "Commands (row by row):", "", "```"]
    lines += [f"python -m megatron_flashoverlap.plan {command(m, a)}" for _, m, a in SCENARIOS]
    return "\n".join(lines + ["```"])


def main(argv=None) -> int:
    if argv:
        raise ValueError(f"`where` takes no arguments (got {argv}); the scenarios are where.SCENARIOS")
    print(table())
    return 0
