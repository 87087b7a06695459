"""Per-GEMM-site configuration: which overlap algorithm each tensor-parallel GEMM uses.

Sites are Transformer Engine's names: `<layer>_<pass>` with layer in qkv, proj, fc1, fc2 (Megatron's
`tp_comm_buffer_name`) and pass in fprop, dgrad, wgrad. Each site picks an algorithm:

    flash        decomposed ring, rank-adaptive slices (no tail)
    flash_bidir  the same on a bidirectional ring (half of each shard each way)
    slicing      data slicing with `num_chunks` chunks (the TE "pipeline"-like baseline)
    reference    our layer, unfused: the blocking collective then the GEMM
    off          our layer steps aside: the stock Megatron forward (blocking collectives)

Forward and backward of one layer run as ONE operator (the column backward walks its dgrad RS and wgrad
AG on the same ring steps), so a layer has one algorithm: a `_dgrad` / `_wgrad` site either is unset
(inherits `_fprop`) or must equal `_fprop`; anything else is a ValueError that says so.
Knobs: `num_chunks` (slicing only), `keep_gathered` (column layers qkv/fc1: keep AG(x) from forward for
the weight gradient instead of re-gathering it; set on `_fprop` or `_wgrad`).

YAML (files in configs/ only choose values):
    default: {algo: flash}          # every site not named below
    proj_fprop: {algo: slicing, num_chunks: 4}
    description: "..."              # optional free text
    stock_megatron: {...}           # optional: documents an equivalent stock run (kept, not interpreted)
"""
from __future__ import annotations

import dataclasses
import os
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

# The algorithm words, defined once (the ops registry maps them to functions; YAML is checked against them).
# `reference` is the one name of the unfused path: the stock collective, then the GEMM.
ALGOS = ("flash", "flash_bidir", "slicing", "reference")
ALL_REDUCE_ALGOS = ("auto", "reference", "ring", "recursive_doubling", "hierarchical")
ULYSSES_ALGOS = ("flash", "reference")

LAYERS = ("qkv", "proj", "fc1", "fc2")
PASSES = ("fprop", "dgrad", "wgrad")
SITES = tuple(f"{layer}_{p}" for layer in LAYERS for p in PASSES)
SITE_ALGOS = ("flash", "flash_bidir", "slicing", "reference", "off")
KNOBS = ("algo", "num_chunks", "keep_gathered")
COLUMN_LAYERS = ("qkv", "fc1")
_DOC_KEYS = ("description", "stock_megatron")


@dataclass(frozen=True)
class SiteConfig:
    """One GEMM site: algo in SITE_ALGOS; num_chunks for slicing; keep_gathered for column wgrad."""
    algo: str = "flash"
    num_chunks: int | None = None
    keep_gathered: bool = False

    def __post_init__(self):
        if self.algo not in SITE_ALGOS:
            raise ValueError(f"unknown algo {self.algo!r}; choose one of {SITE_ALGOS}")
        if self.algo == "slicing" and (not isinstance(self.num_chunks, int) or self.num_chunks < 1):
            raise ValueError(f"algo 'slicing' needs num_chunks >= 1 (e.g. num_chunks: 4), got {self.num_chunks!r}")
        if self.algo != "slicing" and self.num_chunks is not None:
            raise ValueError(f"num_chunks is a knob of algo 'slicing' only; remove it for algo {self.algo!r}")
        if not isinstance(self.keep_gathered, bool):
            raise ValueError(f"keep_gathered must be true or false, got {self.keep_gathered!r}")


@dataclass(frozen=True)
class LayerPlan:
    """What one layer (one tp_comm_buffer_name) runs: forward and backward together."""
    algo: str
    num_chunks: int | None = None
    keep_gathered: bool = False

    @property
    def stock(self) -> bool:
        return self.algo == "off"


def _fprop():
    return field(default_factory=SiteConfig)


@dataclass(frozen=True)
class FlashOverlapConfig:
    """Frozen per-site choices; `plan(layer)` gives what a layer runs. dgrad/wgrad None = inherit fprop."""
    qkv_fprop: SiteConfig = _fprop()
    qkv_dgrad: SiteConfig | None = None
    qkv_wgrad: SiteConfig | None = None
    proj_fprop: SiteConfig = _fprop()
    proj_dgrad: SiteConfig | None = None
    proj_wgrad: SiteConfig | None = None
    fc1_fprop: SiteConfig = _fprop()
    fc1_dgrad: SiteConfig | None = None
    fc1_wgrad: SiteConfig | None = None
    fc2_fprop: SiteConfig = _fprop()
    fc2_dgrad: SiteConfig | None = None
    fc2_wgrad: SiteConfig | None = None
    description: str = ""
    stock_megatron: Mapping = field(default_factory=lambda: types.MappingProxyType({}))

    def __post_init__(self):
        for layer in LAYERS:
            self.plan(layer)

    def plan(self, layer: str) -> LayerPlan:
        """The one algorithm of `layer` (qkv/proj/fc1/fc2); ValueError if its passes disagree."""
        if layer not in LAYERS:
            raise ValueError(f"unknown layer {layer!r}; choose one of {LAYERS} (Megatron's tp_comm_buffer_name)")
        fprop = getattr(self, f"{layer}_fprop")
        for p in ("dgrad", "wgrad"):
            other = getattr(self, f"{layer}_{p}")
            if other is not None and (other.algo, other.num_chunks) != (fprop.algo, fprop.num_chunks):
                raise ValueError(
                    f"{layer}_{p}={_show(other)} differs from {layer}_fprop={_show(fprop)}: a layer runs forward "
                    f"and backward as one operator (one algorithm); set {layer}_{p} equal to {layer}_fprop or "
                    f"leave it unset")
        wgrad = getattr(self, f"{layer}_wgrad")
        keep = fprop.keep_gathered or (wgrad is not None and wgrad.keep_gathered)
        if keep and layer not in COLUMN_LAYERS:
            raise ValueError(f"keep_gathered applies to column layers {COLUMN_LAYERS} only; remove it from {layer}")
        return LayerPlan(fprop.algo, fprop.num_chunks, keep)


def _show(site: SiteConfig) -> str:
    return site.algo if site.num_chunks is None else f"{site.algo}(num_chunks={site.num_chunks})"


def uniform(algo: str = "flash", num_chunks: int | None = None, keep_gathered: bool = False):
    """Every layer runs `algo` (keep_gathered applies to the column layers)."""
    return from_dict({"default": {"algo": algo, "num_chunks": num_chunks, "keep_gathered": keep_gathered}})


def from_dict(data: Mapping):
    """Build a FlashOverlapConfig from the YAML mapping (see the module docstring)."""
    if not isinstance(data, Mapping):
        raise ValueError(f"a flash-overlap config is a mapping of site -> settings, got {type(data).__name__}")
    unknown = sorted(set(data) - set(SITES) - {"default", *_DOC_KEYS})
    if unknown:
        raise ValueError(f"unknown site(s) {unknown}; valid sites: {SITES} (plus 'default', {_DOC_KEYS})")
    default = _site(data.get("default") or {}, "default")
    sites = {s: _site(data[s] or {}, s) for s in SITES if s in data}
    for layer in LAYERS:  # the default fills every fprop not named; keep_gathered only reaches column layers
        keep = default.keep_gathered and layer in COLUMN_LAYERS
        sites.setdefault(f"{layer}_fprop", dataclasses.replace(default, keep_gathered=keep))
    doc = {"description": str(data.get("description", "")),
           "stock_megatron": types.MappingProxyType(dict(data.get("stock_megatron") or {}))}
    return FlashOverlapConfig(**sites, **doc)


def _site(values: Mapping, where: str) -> SiteConfig:
    if not isinstance(values, Mapping):
        raise ValueError(f"{where}: expected a mapping like {{algo: flash}}, got {values!r}")
    unknown = sorted(set(values) - set(KNOBS))
    if unknown:
        raise ValueError(f"{where}: unknown knob(s) {unknown}; valid knobs: {KNOBS}")
    kw = {k: v for k, v in values.items() if v is not None}
    if kw.get("algo") is False:  # YAML 1.1 reads a bare `off` as false
        kw["algo"] = "off"
    try:
        return SiteConfig(**kw)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def load_config(path: str | Path):
    """Read a YAML file from configs/ (or anywhere) into a FlashOverlapConfig; errors name the file."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"flash-overlap config {str(path)!r} does not exist; see configs/*.yaml for examples")
    try:
        return from_dict(yaml.safe_load(path.read_text()) or {})
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


# ---------------------------------------------------------------- the environment: read here and nowhere else

ENV_VARS = {
    "config_path": "FLASHOVERLAP_CONFIG",            # per-site YAML the spec loads when the model config names none
    "timeout_s": "FLASHOVERLAP_TIMEOUT_S",           # gloo: seconds a P2P wait may take before PeerTimeoutError
    "allreduce_table": "FLASHOVERLAP_ALLREDUCE_TABLE",  # calibration JSON for all_reduce(algo="auto")
    "query_split": "FLASHOVERLAP_QUERY_SPLIT",       # "1": query-split attention (TP with SP, cp == 1)
    "ulysses": "FLASHOVERLAP_ULYSSES",               # "flash" (default) or "stock": the a2a of Ulysses attention
}
ULYSSES_CHOICES = ("flash", "stock")


@dataclass(frozen=True)
class Environment:
    """Every FLASHOVERLAP_* variable, parsed and checked (`environment()` reads them)."""
    config_path: str | None = None
    timeout_s: float = 300.0
    allreduce_table: str | None = None
    query_split: bool = False
    ulysses: str = "flash"


def environment(environ: Mapping[str, str] | None = None) -> Environment:
    """The one reader of FLASHOVERLAP_* variables (os.environ by default); a bad value names the variable."""
    env = os.environ if environ is None else environ
    get = {k: env.get(v) for k, v in ENV_VARS.items()}
    try:
        timeout = float(get["timeout_s"]) if get["timeout_s"] else 300.0
    except ValueError:
        raise ValueError(f"{ENV_VARS['timeout_s']}={get['timeout_s']!r} is not a number of seconds") from None
    if timeout <= 0:
        raise ValueError(f"{ENV_VARS['timeout_s']}={get['timeout_s']!r} must be > 0 seconds")
    if get["query_split"] not in (None, "", "0", "1"):
        raise ValueError(f"{ENV_VARS['query_split']}={get['query_split']!r}: use 1 (on) or 0 (off)")
    ulysses = get["ulysses"] or "flash"
    if ulysses not in ULYSSES_CHOICES:
        raise ValueError(f"{ENV_VARS['ulysses']}={ulysses!r}: choose one of {ULYSSES_CHOICES}")
    return Environment(config_path=get["config_path"] or None, timeout_s=timeout,
                       allreduce_table=get["allreduce_table"] or None, query_split=get["query_split"] == "1",
                       ulysses=ulysses)
