"""The GEMM sites line: once per run, when the model is built, what every GEMM site of every layer kind runs,
and why wherever it is stock. Printed by rank 0 for the launcher (Megatron-LM's own pretrain_gpt.py) and
the project entry alike (`install`), for stock and --flash-overlap runs.

    GEMM sites: stock                                             no layer of ours (a stock run)
    GEMM sites: <kind>[<layers>]: <site>=<what>, ...; <kind>[<layers>]: ...
        kind     dense | moe (decoder layers, by their MLP) | mtp (multi-token prediction layers)
        layers   1-based numbers in the model (decoder) or MTP depths, as ranges: [1-3,5]
        site     qkv, proj, fc1, fc2; shared_fc1, shared_fc2 (shared experts); ep_a2a (the expert-parallel
                 exchange) and experts (the routed experts); eh_proj (MTP's projection)
        what     flash | flash_bidir | slicing      the SP ring of that algorithm
                 <algo> (all-reduce, no SP)         TP without SP: the decomposed all-reduce
                 query_split (<algo>)               proj: core attention + proj + RS by query block
                 stock (<why>)                      Megatron's forward, and why
        a kind whose sites all run stock for one reason prints it once: mtp[1]: stock (<why>)

    e.g. GEMM sites: dense[1]: qkv=flash, proj=flash, fc1=flash, fc2=flash; moe[2]: qkv=flash, proj=flash,
         ep_a2a=flash (fused with the experts), experts=stock (...); mtp[1]: stock (Megatron builds ...)

    summarize(model) -> {kind: {"layers": set, "sites": {site: set of what}}}   this rank's layers
    sites_line(model) -> str        every pipeline stage's summary (gathered over the PP group), merged
    install()                       wrap megatron.training's setup_model_and_optimizer: print the line after it
"""
from __future__ import annotations

import functools

import torch.distributed as dist
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.multi_token_prediction import MultiTokenPredictionLayer
from megatron.core.transformer.transformer_layer import TransformerLayer

from ..runtime.once import LogOnce, print_rank0

_log_once = LogOnce(print_rank0)  # the sites line, rank 0 ($RANK), once per process
MTP_STOCK = "Megatron builds the MTP block from its own spec (get_gpt_mtp_block_spec), not from --spec"
NOT_OURS = "a Megatron linear: its spec is not ours"
PREFIX = "GEMM sites: "
ORDER = ("eh_proj", "qkv", "proj", "fc1", "fc2", "shared_fc1", "shared_fc2", "ep_a2a", "experts")  # then the rest


def _site(path: str) -> str | None:
    """Module path inside a layer -> its site (None: not a site of its own, e.g. a routed expert's linear)."""
    parts = path.split(".")
    if "experts" in parts:
        return None  # routed experts: the MoE layer reports them as one site
    name = parts[-1].removeprefix("linear_")
    return f"shared_{name}" if "shared_experts" in parts else name


def _what_ran(layer, why_stock: str) -> dict:
    """{site: what ran} for one layer (module order: attention, then the MLP)."""
    ran: dict = {}
    for path, module in layer.named_modules():
        if isinstance(module, MoELayer):
            flash = getattr(module, "flash_ran", None)
            ran.update(flash() if flash else {"ep_a2a": f"stock ({why_stock})", "experts": f"stock ({why_stock})"})
        elif "ParallelLinear" in type(module).__name__ and _site(path):  # Megatron's, TE's, ours
            flash = getattr(module, "flash_ran", None)
            ran[_site(path)] = flash() if flash else f"stock ({why_stock})"
    return ran


def _layers(chunks: list):
    """(kind, number, layer, why a Megatron linear there is stock) for every transformer / MTP layer."""
    mtp = [m for chunk in chunks for m in chunk.modules() if isinstance(m, MultiTokenPredictionLayer)]
    inside = {id(sub) for m in mtp for sub in m.modules()}
    for chunk in chunks:
        for m in chunk.modules():
            if isinstance(m, TransformerLayer) and id(m) not in inside:
                yield ("moe" if isinstance(m.mlp, MoELayer) else "dense"), m.layer_number, m, NOT_OURS
    for m in mtp:
        yield "mtp", m.layer_number, m, MTP_STOCK


def summarize(model) -> dict:
    """This rank's layers -> {"ours": any module of ours, "kinds": {kind: {"layers": {numbers}, "sites": {site:
    {what}}}}}."""
    chunks = model if isinstance(model, (list, tuple)) else [model]
    out: dict = {"ours": any(hasattr(m, "flash_ran") for chunk in chunks for m in chunk.modules()), "kinds": {}}
    for kind, number, layer, why in _layers(chunks):
        entry = out["kinds"].setdefault(kind, {"layers": set(), "sites": {}})
        entry["layers"].add(number)
        for site, what in _what_ran(layer, why).items():
            entry["sites"].setdefault(site, set()).add(what)
    return out


def _merge(summaries: list) -> dict:
    out: dict = {"ours": any(s["ours"] for s in summaries), "kinds": {}}
    for summary in summaries:
        for kind, entry in summary["kinds"].items():
            mine = out["kinds"].setdefault(kind, {"layers": set(), "sites": {}})
            mine["layers"] |= entry["layers"]
            for site, whats in entry["sites"].items():
                mine["sites"].setdefault(site, set()).update(whats)
    return out


def _gathered(summary: dict) -> list:
    """Every pipeline stage's summary (rank 0 holds only the first stage's layers)."""
    from megatron.core import parallel_state

    if not (dist.is_initialized() and parallel_state.model_parallel_is_initialized()):
        return [summary]
    group = parallel_state.get_pipeline_model_parallel_group()
    size = dist.get_world_size(group)
    if size == 1:
        return [summary]
    out = [None] * size
    dist.all_gather_object(out, summary, group=group)
    return out


def _ranges(numbers) -> str:
    """{1, 2, 3, 5} -> '1-3,5'."""
    runs: list = []
    for n in sorted(numbers):
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def format_line(summary: dict) -> str:
    """The merged summary -> the GEMM sites line (module docstring)."""
    if not summary["ours"]:
        return PREFIX + "stock"
    kinds = []
    for kind, entry in sorted(summary["kinds"].items(), key=lambda kv: ("dense", "moe", "mtp").index(kv[0])):
        ranked = sorted(entry["sites"].items(), key=lambda kv: ORDER.index(kv[0]) if kv[0] in ORDER else len(ORDER))
        sites = {site: "/".join(sorted(whats)) for site, whats in ranked}
        values = set(sites.values())
        one_stock = len(values) == 1 and next(iter(values)).startswith("stock (")
        body = values.pop() if one_stock else ", ".join(f"{site}={what}" for site, what in sites.items())
        kinds.append(f"{kind}[{_ranges(entry['layers'])}]: {body or 'no GEMM site'}")
    return PREFIX + "; ".join(kinds)


def sites_line(model) -> str:
    """The line for `model` (this rank's module or chunks), every pipeline stage included (a collective over
    the PP group: every rank calls it)."""
    return format_line(_merge(_gathered(summarize(model))))


def install() -> None:
    """Wrap `megatron.training.training.setup_model_and_optimizer` (pretrain() calls it by module-global name;
    idempotent): once it has built the model, rank 0 prints the GEMM sites line."""
    from megatron.training import training

    original = training.setup_model_and_optimizer
    if getattr(original, "_flash_sites", False):
        return

    @functools.wraps(original)
    def setup(*args, **kwargs):
        out = original(*args, **kwargs)
        _log_once(sites_line(out[0]))
        return out

    setup._flash_sites = True
    training.setup_model_and_optimizer = setup
