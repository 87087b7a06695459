"""The planner's command-line arguments: Megatron's model and layout flags, the cluster, the op form.

    main_parser()   the main form (cli.py's module docstring); model_of(args) -> Model; sizes(args) -> (Layout, nodes)
    op_parser()     the op form;  cluster_of(args, nodes) -> Cluster (the catalogue, plus --hardware's file)
"""
from __future__ import annotations

import argparse

from . import catalog
from .hardware import Cluster, load_hardware
from .model import Layout, Model

OPS = ("all_gather_matmul", "matmul_reduce_scatter", "all_reduce")
DTYPES = ("bf16", "fp16", "fp8", "fp32")


def _cluster_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--gpu", default="h100", help="GPU type: one of the catalogue's (plan/catalog.py) or --hardware's")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--nodes", type=int, default=None, help="default: the layout's GPUs / --gpus-per-node")
    ap.add_argument("--inter-node", default=catalog.DEFAULT_INTER, help="network between nodes (a link name)")
    ap.add_argument("--intra-node", default=None, help="link inside a node (default: the GPU's NVLink)")
    ap.add_argument("--nics-per-node", type=int, default=None, help="default: one per GPU")
    ap.add_argument("--hardware", default=None, help="JSON file adding GPUs / links (hardware.load_hardware)")
    ap.add_argument("--overlap-slowdown", type=float, default=0.10,
                    help="a GEMM slice runs this much slower beside one of our transfers [est] (default 0.10)")


def cluster_of(a: argparse.Namespace, nodes: int) -> Cluster:
    gpus, links = dict(catalog.GPUS), dict(catalog.LINKS)
    if a.hardware:
        gpus, links = load_hardware(a.hardware, gpus, links)
    if a.gpu not in gpus:
        raise ValueError(f"--gpu {a.gpu!r}: choose one of {sorted(gpus)} or add it with --hardware FILE")
    intra = a.intra_node or catalog.GPU_INTRA.get(a.gpu)
    for flag, name in (("--intra-node", intra), ("--inter-node", a.inter_node)):
        if name not in links:
            raise ValueError(f"{flag} {name!r}: choose one of {sorted(links)} or add it with --hardware FILE")
    return Cluster(gpus[a.gpu], links[intra], links[a.inter_node], a.gpus_per_node, nodes,
                   a.nics_per_node or a.gpus_per_node, a.overlap_slowdown)


def main_parser(description: str = "") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="flashoverlap-plan", description=description,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    m = ap.add_argument_group("model (Megatron's arguments)")
    for flag, kw in (("--hidden-size", {"required": True}), ("--ffn-hidden-size", {}),
                     ("--num-attention-heads", {"required": True}), ("--num-query-groups", {}), ("--kv-channels", {}),
                     ("--seq-length", {"required": True}), ("--micro-batch-size", {"default": 1}),
                     ("--global-batch-size", {}), ("--num-layers", {"required": True}),
                     ("--padded-vocab-size", {"default": 32000}), ("--num-experts", {"default": 0}),
                     ("--moe-router-topk", {"default": 2}), ("--moe-ffn-hidden-size", {})):
        m.add_argument(flag, type=int, **kw)
    m.add_argument("--swiglu", action="store_true")
    m.add_argument("--recompute-granularity", choices=("full", "selective"), default=None)
    for d in DTYPES:
        m.add_argument(f"--{d}", dest="dtype", action="store_const", const=d)
    lay = ap.add_argument_group("layout")
    for flags in (("--tensor-model-parallel-size",), ("--pipeline-model-parallel-size",),
                  ("--context-parallel-size", "--context-model-parallel-size"), ("--expert-model-parallel-size",)):
        lay.add_argument(*flags, type=int, default=1)
    lay.add_argument("--data-parallel-size", type=int, default=None, help="default: from --nodes x --gpus-per-node")
    lay.add_argument("--sequence-parallel", action="store_true",
                     help="TP with SP (Megatron's flag; without it the row outputs are all-reduced)")
    _cluster_args(ap)
    out = ap.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print the numbers as JSON")
    out.add_argument("--emit-config", metavar="PATH", help="write the YAML --flash-overlap-config takes")
    out.add_argument("--timeline", metavar="PATH", help="draw one layer's timeline (needs matplotlib)")
    out.add_argument("--decode-batch", type=int, default=1, help="sequences of the decode all-reduce [1, b, h]")
    return ap


def sizes(a: argparse.Namespace) -> tuple[Layout, int]:
    tp, pp, cp = a.tensor_model_parallel_size, a.pipeline_model_parallel_size, a.context_parallel_size
    inner = tp * pp * cp
    if a.data_parallel_size is None:
        gpus = (a.nodes or 1) * a.gpus_per_node
        if gpus % inner:
            raise ValueError(f"{gpus} GPUs are not divisible by tp x pp x cp = {inner}; pass --data-parallel-size "
                             f"or --nodes")
        dp = gpus // inner
    else:
        dp = a.data_parallel_size
    world = inner * dp
    nodes = a.nodes if a.nodes is not None else max(1, -(-world // a.gpus_per_node))
    if nodes * a.gpus_per_node != world:
        raise ValueError(f"tp x pp x cp x dp = {world} GPUs but --nodes {nodes} x --gpus-per-node "
                         f"{a.gpus_per_node} = {nodes * a.gpus_per_node}; make them agree")
    return Layout(tp, pp, cp, a.expert_model_parallel_size, dp, a.sequence_parallel), nodes


def model_of(a: argparse.Namespace) -> Model:
    return Model(hidden=a.hidden_size, ffn=a.ffn_hidden_size or 4 * a.hidden_size, heads=a.num_attention_heads,
                 layers=a.num_layers, seq=a.seq_length, micro_batch=a.micro_batch_size,
                 query_groups=a.num_query_groups, kv_channels=a.kv_channels, vocab=a.padded_vocab_size,
                 swiglu=a.swiglu, experts=a.num_experts, topk=a.moe_router_topk, moe_ffn=a.moe_ffn_hidden_size,
                 global_batch=a.global_batch_size, recompute=a.recompute_granularity == "full")


def op_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="flashoverlap-plan op",
                                 description="one operator, forward (flashoverlap-plan --help: the op form)")
    ap.add_argument("--op", required=True, choices=OPS)
    for flag in ("--m", "--k", "--n", "--bytes"):
        ap.add_argument(flag, type=int, default=None)
    ap.add_argument("--tp", type=int, required=True)
    ap.add_argument("--dtype", choices=DTYPES, default="bf16")
    ap.add_argument("--json", action="store_true")
    _cluster_args(ap)
    return ap
