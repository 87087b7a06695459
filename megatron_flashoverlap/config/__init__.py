"""The one configuration source: what each tensor-parallel layer runs, the attention and all-reduce settings,
the wait timeout; `environment()` (at the bottom) is the one reader of FLASHOVERLAP_* variables.

Layers are Megatron's `tp_comm_buffer_name`s: qkv, proj, fc1, fc2. Forward and backward of a layer run as
ONE operator (the column backward walks its dgrad RS and wgrad AG on the same ring steps), so a layer has
ONE plan: an algorithm from ALGOS and its knobs.

    flash          decomposed ring, rank-adaptive slices (no tail)
    flash_bidir    the same on a bidirectional ring (half of each shard each way)
    slicing        data slicing with `num_chunks` chunks (the TE "pipeline"-like baseline)
    reference      the unfused path: Megatron's own forward (the blocking collective, then the GEMM)
    auto           the default: reference, flash or (under SP, hop_chunks open) flash with 2 sub-chunks per hop,
                   measured at the layer's first training call on the real group (plan/chooser.py; stock unless
                   one of ours wins); its knobs are flash's (hop_chunks, keep_gathered)
    num_chunks     slicing only: the chunk count
    hop_chunks     flash only: row sub-chunks per ring hop, each posted ahead as its own transfer (None: 1 for
                   flash, 1 or 2 by measurement for auto; ops/tp_sp/plain.py hop_chunks_for)
    keep_gathered  column layers (qkv, fc1): keep AG(x) from forward for the weight gradient

YAML (files in configs/ only choose values; every key is optional):
    default: {algo: auto}                         # every layer not named below (auto: the default)
    proj: {algo: slicing, num_chunks: 4}          # one layer
    attention: {core: auto, query_split: auto, ulysses_algo: auto}
                                                  # core: auto (stock's core attention for the flags; SDPA
                                                  # for --attention-backend flash|fused without TE's spec),
                                                  # megatron (stock's, always), sdpa (SDPA, always);
                                                  # query_split: auto (a candidate of proj's auto where it can
                                                  # run), true (asked: refused where it cannot), false (never)
    all_reduce: {num_chunks: 4, decode: auto, prefill: reference}
                                                  # TP without SP at inference (plan/chooser.py): decode: the
                                                  # decode all-reduce, auto (measured) or an algorithm of
                                                  # ALL_REDUCE_ALGOS; prefill: the row layers' output all-reduce
                                                  # of prefill and mixed steps, reference (default), auto or decomposed
                                                  # (the layer's algo); table: a calibration JSON the decode
                                                  # all-reduce then chooses by instead of measuring
    choices: {budget_s: 10, write: choices.yaml}  # the chooser: seconds of paired measurement the run may spend
                                                  # (all buckets together); where it writes its choices (this
                                                  # file's format: passed back, every bucket it holds is pinned)
    choices: {layout: "...", pinned: {proj/prefill/16: reference, all_reduce/decode/4: ring}}
                                                  # what a run wrote: pinned buckets are not measured
    moe: {algo: auto}                             # the EP token exchange: auto (default: stock or flash,
                                                  # measured), flash (fused with the experts), exchange or
                                                  # reference (stock a2a)
    dp: {fuse: auto}                              # pretrain()'s DDP under --flash-overlap: which TP linears
                                                  # reduce-scatter in their wgrad GEMM: auto (the cost model),
                                                  # all (every one), none (stock DDP)
    planner: {probe: auto}                        # on CUDA: the choices this YAML leaves open (layers it does
                                                  # not name, hop_chunks, dp.fuse auto, the decode all-reduce
                                                  # table) from the planner after a start-up probe
                                                  # (megatron/probe.py); always: on every backend (gloo
                                                  # too); off: the CPU rules everywhere
    timeout_s: 300                                # an upper bound on every wait of ours; unset: the
                                                  # process group's own timeout (Megatron's
                                                  # --distributed-timeout-minutes), as stock waits
    description: "..."                            # free text
    stock_megatron: {...}                         # documents an equivalent stock run (kept, not interpreted)
Where the YAML is silent the environment fills in (FLASHOVERLAP_TIMEOUT_S, FLASHOVERLAP_ALLREDUCE_TABLE,
FLASHOVERLAP_QUERY_SPLIT, FLASHOVERLAP_ULYSSES, FLASHOVERLAP_CORE_ATTENTION), then the defaults.

The active config (in-process): `activate(cfg)` (the `--flash-overlap` flag does it at parse time) and
`active()` (the spec and the layers read it when Megatron builds the model; without an activated config:
the YAML at $FLASHOVERLAP_CONFIG, else the defaults).
"""
from __future__ import annotations

import os
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping

# The algorithm words, defined once in config/plan.py (the ops registry maps them to functions; YAML is checked
# against them): ALGOS (`reference` is the one name of the unfused path: the stock collective, then the GEMM),
# SITE_ALGOS (a layer's word: an algorithm, or auto, plan/chooser.py), ALL_REDUCE_ALGOS.
from .plan import (ALGOS, ALL_REDUCE_ALGOS, SITE_ALGOS, Fp8Recipe, OpPlan,  # noqa: E402,F401  (re-exported)
                   _positive_int_or_none)
TRAIN_PICKS = ("reference", "flash")  # the candidates of an auto site's training step
# a TP layer's under sequence parallelism adds flash_c2: flash with every ring hop cut in 2 row sub-chunks
# (hop_chunks 2), where the YAML leaves hop_chunks open and no FP8 recipe runs (megatron/train_choice.py)
# proj's adds query_split under attention.query_split (true, or auto where it can run): core attention + proj + RS
# by query block (megatron/train_choice.py query_split_plan)
LAYER_PICKS = TRAIN_PICKS + ("flash_c2", "query_split")
ULYSSES_ALGOS = ("flash", "reference")
# attention.ulysses_algo: an a2a word, or auto (the default: reference or flash, measured at the attention's first
# training forward; ops/attention/choose.py)
ULYSSES_SITE_ALGOS = ULYSSES_ALGOS + ("auto",)
ULYSSES_SITE = "ulysses"  # Ulysses attention's all-to-all site word in a choice key
# the core attention (megatron/sdpa.py core_attention_for): auto = what stock Megatron builds for the same flags,
# except --attention-backend flash|fused where stock would not use TE (then SDPA with that kernel);
# megatron = what stock builds, always (equal to stock to the bit); sdpa = SdpaDotProductAttention, always
CORE_ATTENTIONS = ("auto", "megatron", "sdpa")
# the MoE alltoall dispatcher (expert-TP 1): flash = dispatch, experts and combine in one pipelined walk (each
# source block through the experts as it arrives); exchange = the pairwise steps, experts after (the ablation);
# reference = stock's all_to_all_single. Where flash cannot fuse, it runs exchange (logged once per reason).
MOE_ALGOS = ("flash", "exchange", "reference")
# moe.algo: an exchange word, or auto (the default: reference or flash, measured at the MoE layer's first training
# forward; ops/moe/choose.py)
MOE_SITE_ALGOS = MOE_ALGOS + ("auto",)
MOE_SITE = "moe"  # the MoE exchange's site word in a choice key
DP_FUSE = ("auto", "all", "none")  # megatron/ddp/pretrain.py
PLANNER_PROBES = ("auto", "always", "off")  # megatron/probe.py: auto = on NCCL only, always = every backend

LAYERS = ("qkv", "proj", "fc1", "fc2")
COLUMN_LAYERS = ("qkv", "fc1")
PLAN_KNOBS = ("algo", "num_chunks", "keep_gathered", "hop_chunks")
DEFAULT_TIMEOUT_S = None  # no bound of ours: each wait ends at its process group's own timeout
_SECTIONS = {"attention": ("core", "query_split", "ulysses_algo"),
             "all_reduce": ("num_chunks", "table", "decode", "prefill"), "moe": ("algo",), "dp": ("fuse",),
             "planner": ("probe",), "choices": ("budget_s", "write", "layout", "pinned")}
PREFILL_ALGOS = ("auto", "reference", "decomposed")  # the row layers' all-reduce at prefill (plan/chooser.py)
STEP_KINDS = ("train", "prefill", "decode", "mixed")  # the step kinds a choice is made for (megatron/step_kind.py)
ROW_SITES = ("proj", "fc2")  # the row layers whose output all-reduce is chosen at prefill and mixed steps
DECODE_SITE = "all_reduce"  # the decode all-reduce's site word in a choice key
_DOC_KEYS = ("description", "stock_megatron")
_PASSES = ("fprop", "dgrad", "wgrad")  # Transformer Engine's per-pass site names: refused, with the fix


from .sections import (AllReduceSettings, AttentionSettings, ChoiceSettings, DPSettings,  # noqa: E402
                       MoESettings, PlannerSettings)


def _plan():
    return field(default_factory=lambda: OpPlan("auto"))


@dataclass(frozen=True)
class FlashOverlapConfig:
    """Frozen: one OpPlan per layer, the attention and all-reduce settings, the P2P wait timeout."""
    qkv: OpPlan = _plan()
    proj: OpPlan = _plan()
    fc1: OpPlan = _plan()
    fc2: OpPlan = _plan()
    attention: AttentionSettings = field(default_factory=AttentionSettings)
    all_reduce: AllReduceSettings = field(default_factory=AllReduceSettings)
    moe: MoESettings = field(default_factory=MoESettings)
    dp: DPSettings = field(default_factory=DPSettings)
    planner: PlannerSettings = field(default_factory=PlannerSettings)
    choices: ChoiceSettings = field(default_factory=ChoiceSettings)
    timeout_s: float | None = DEFAULT_TIMEOUT_S  # None: the group's own timeout; a number bounds it further
    description: str = ""
    stock_megatron: Mapping = field(default_factory=lambda: types.MappingProxyType({}))

    def __post_init__(self):
        for layer in LAYERS:
            if getattr(self, layer).keep_gathered and layer not in COLUMN_LAYERS:
                raise ValueError(f"keep_gathered applies to column layers {COLUMN_LAYERS} only; remove it from "
                                 f"{layer}")
        t = self.timeout_s
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0):
            raise ValueError(f"timeout_s must be a number of seconds > 0 (or absent: the process group's own "
                             f"timeout), got {t!r}")

    def plan(self, layer: str) -> OpPlan:
        """The plan of `layer` (qkv/proj/fc1/fc2)."""
        if layer not in LAYERS:
            raise ValueError(f"unknown layer {layer!r}; choose one of {LAYERS} (Megatron's tp_comm_buffer_name)")
        return getattr(self, layer)


def uniform(algo: str = "flash", num_chunks: int | None = None, keep_gathered: bool = False):
    """Every layer runs `algo` (keep_gathered applies to the column layers)."""
    return from_dict({"default": {"algo": algo, "num_chunks": num_chunks, "keep_gathered": keep_gathered}})


def from_dict(data: Mapping, env: Environment | None = None) -> FlashOverlapConfig:
    """Build a FlashOverlapConfig from the YAML mapping (module docstring); `env` (default: environment())
    fills what the mapping leaves out."""
    if not isinstance(data, Mapping):
        raise ValueError(f"a flash-overlap config is a mapping (layer -> settings, ...), got {type(data).__name__}")
    _check_keys(data)
    env = environment() if env is None else env
    default = _mapping(data.get("default"), "default")
    if set(default) - set(PLAN_KNOBS):
        raise ValueError(f"default: unknown knob(s) {sorted(set(default) - set(PLAN_KNOBS))}; valid knobs: {PLAN_KNOBS}")
    plans = {layer: _layer_plan(layer, default, data.get(layer)) for layer in LAYERS}
    attention = _section(data, "attention", {"query_split": env.query_split, "ulysses_algo": env.ulysses,
                                                  "core": env.core_attention})
    all_reduce = _section(data, "all_reduce", {"table": env.allreduce_table})
    moe = MoESettings(**_section(data, "moe", {}))
    dp = DPSettings(**_section(data, "dp", {}))
    planner = PlannerSettings(**_section(data, "planner", {}))
    choices = ChoiceSettings(**_section(data, "choices", {}))
    doc = {"description": str(data.get("description") or ""),
           "stock_megatron": types.MappingProxyType(dict(data.get("stock_megatron") or {}))}
    timeout = data.get("timeout_s", env.timeout_s)
    return FlashOverlapConfig(**plans, attention=AttentionSettings(**attention),
                              all_reduce=AllReduceSettings(**all_reduce), moe=moe, dp=dp, planner=planner,
                              choices=choices, timeout_s=timeout, **doc)


def to_dict(cfg: FlashOverlapConfig) -> dict:
    """The YAML mapping that from_dict turns back into `cfg` (every layer and section written out)."""
    def plain(obj, keys=None):
        return {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in vars(obj).items()
                if not k.startswith("_") and v is not None and (keys is None or k in keys)}
    out = {layer: plain(cfg.plan(layer), PLAN_KNOBS) for layer in LAYERS}  # a site's words, not an operator's
    out.update({name: plain(getattr(cfg, name)) for name in _SECTIONS})
    out["timeout_s"] = cfg.timeout_s
    if cfg.description:
        out["description"] = cfg.description
    return out


def _check_keys(data: Mapping) -> None:
    for key in data:
        layer, _, p = str(key).rpartition("_")
        if layer in LAYERS and p in _PASSES:
            raise ValueError(f"{key}: a layer has one algorithm (forward and backward run as one operator); "
                             f"write {layer}: {{algo: ...}} instead of {key}")
    valid = ("default", *LAYERS, *_SECTIONS, "timeout_s", *_DOC_KEYS)
    unknown = sorted(str(k) for k in set(data) - set(valid))
    if unknown:
        raise ValueError(f"unknown key(s) {unknown}; valid keys: {valid}")


def _mapping(values, where: str) -> dict:
    """The knobs of one YAML entry, checked; None values dropped (absent)."""
    if values is None:
        return {}
    if not isinstance(values, Mapping):
        raise ValueError(f"{where}: expected a mapping like {{algo: flash}}, got {values!r}")
    return {k: v for k, v in values.items() if v is not None}


def _layer_plan(layer: str, default: dict, values) -> OpPlan:
    """The layer's own entry, else the default (whose keep_gathered reaches column layers only)."""
    where = layer if values is not None else "default"
    kw = _mapping(values, layer) if values is not None else dict(default)
    if values is None and layer not in COLUMN_LAYERS:
        kw.pop("keep_gathered", None)
    unknown = sorted(set(kw) - set(PLAN_KNOBS))
    if unknown:
        raise ValueError(f"{where}: unknown knob(s) {unknown}; valid knobs: {PLAN_KNOBS}")
    kw.setdefault("algo", "auto")
    if kw.get("num_chunks") is not None and kw["algo"] != "slicing":  # a site's all-reduce chunks: all_reduce:
        raise ValueError(f"{where}: num_chunks is a knob of algo 'slicing' only; remove it for algo "
                         f"{kw['algo']!r} (the all-reduce's sequence chunks: all_reduce: {{num_chunks: N}})")
    try:
        return OpPlan(**kw)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None


def _section(data: Mapping, name: str, silent: dict) -> dict:
    """A settings section: its YAML values over `silent` (what the environment says where YAML is silent)."""
    values = _mapping(data.get(name), name)
    unknown = sorted(set(values) - set(_SECTIONS[name]))
    if unknown:
        raise ValueError(f"{name}: unknown key(s) {unknown}; valid keys: {_SECTIONS[name]}")
    return {**silent, **values}


def load_config(path: str | Path, env: Environment | None = None) -> FlashOverlapConfig:
    """Read a YAML file from configs/ (or anywhere; relative to the working directory) into a
    FlashOverlapConfig; errors name the file."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"flash-overlap config {str(path)!r} does not exist (working directory {os.getcwd()}); "
                         f"see configs/*.yaml for examples")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        what = " ".join(str(x) for x in (getattr(err, "context", None), getattr(err, "problem", None)) if x)
        raise ValueError(f"{where}: not valid YAML ({what or type(err).__name__}); fix the file (configs/*.yaml "
                         f"are examples)") from None
    try:
        return from_dict(data or {}, env)
    except ValueError as err:
        raise ValueError(f"{path}: {err}") from None


# ---------------------------------------------------------------- the active config (in-process)

_ACTIVE: FlashOverlapConfig | None = None


def activate(cfg: FlashOverlapConfig | None) -> FlashOverlapConfig | None:
    """Make `cfg` the config `active()` returns (None: back to $FLASHOVERLAP_CONFIG / the defaults).
    Returns the previously activated one, so a caller can restore it."""
    global _ACTIVE
    if cfg is not None and not isinstance(cfg, FlashOverlapConfig):
        raise ValueError(f"activate() takes a FlashOverlapConfig (load_config(path) reads a YAML), got "
                         f"{type(cfg).__name__}")
    previous, _ACTIVE = _ACTIVE, cfg
    return previous


def active() -> FlashOverlapConfig:
    """The activated config, else the YAML at $FLASHOVERLAP_CONFIG, else the defaults (env-filled)."""
    if _ACTIVE is not None:
        return _ACTIVE
    env = environment()
    if env not in _FROM_ENV:  # one object per environment: its chooser's decisions are kept on it
        _FROM_ENV[env] = load_config(env.config_path, env) if env.config_path else from_dict({}, env)
    return _FROM_ENV[env]


_FROM_ENV: dict = {}


# ---------------------------------------------------------------- the environment: read here and nowhere else

ENV_VARS = {
    "config_path": "FLASHOVERLAP_CONFIG",            # YAML that active() loads when no config was activated
    "timeout_s": "FLASHOVERLAP_TIMEOUT_S",           # a bound (s) below the group's own timeout on each wait
    "allreduce_table": "FLASHOVERLAP_ALLREDUCE_TABLE",  # calibration JSON for all_reduce(algo="auto")
    "query_split": "FLASHOVERLAP_QUERY_SPLIT",       # attention.query_split: 1 (true), 0 (false), auto (default)
    "ulysses": "FLASHOVERLAP_ULYSSES",               # "auto" (default), "flash" or "reference": Ulysses' a2a
    "core_attention": "FLASHOVERLAP_CORE_ATTENTION",  # attention.core: auto (default), megatron or sdpa
    "failure_dir": "FLASHOVERLAP_FAILURE_DIR",       # set by the launcher for its ranks: where a failing rank
                                                     # says so (megatron/cli/failures.py)
}


@dataclass(frozen=True)
class Environment:
    """Every FLASHOVERLAP_* variable, parsed and checked (`environment()` reads them)."""
    config_path: str | None = None
    timeout_s: float | None = DEFAULT_TIMEOUT_S
    allreduce_table: str | None = None
    query_split: bool | str = "auto"
    ulysses: str = "auto"
    core_attention: str = "auto"
    failure_dir: str | None = None


def environment(environ: Mapping[str, str] | None = None) -> Environment:
    """The one reader of FLASHOVERLAP_* variables (os.environ by default); a bad value names the variable."""
    env = os.environ if environ is None else environ
    get = {k: env.get(v) for k, v in ENV_VARS.items()}
    try:
        timeout = float(get["timeout_s"]) if get["timeout_s"] else DEFAULT_TIMEOUT_S
    except ValueError:
        raise ValueError(f"{ENV_VARS['timeout_s']}={get['timeout_s']!r} is not a number of seconds") from None
    if timeout is not None and timeout <= 0:
        raise ValueError(f"{ENV_VARS['timeout_s']}={get['timeout_s']!r} must be > 0 seconds")
    if get["query_split"] not in (None, "", "0", "1", "auto"):
        raise ValueError(f"{ENV_VARS['query_split']}={get['query_split']!r}: use 1 (on), 0 (off) or auto")
    ulysses = get["ulysses"] or "auto"
    if ulysses not in ULYSSES_SITE_ALGOS:
        renamed = " ('stock' is now called 'reference')" if ulysses == "stock" else ""
        raise ValueError(f"{ENV_VARS['ulysses']}={ulysses!r}: choose one of {ULYSSES_SITE_ALGOS}{renamed}")
    core = get["core_attention"] or "auto"
    if core not in CORE_ATTENTIONS:
        raise ValueError(f"{ENV_VARS['core_attention']}={core!r}: choose one of {CORE_ATTENTIONS}")
    query_split = {"1": True, "0": False}.get(get["query_split"], "auto")
    return Environment(config_path=get["config_path"] or None, timeout_s=timeout,
                       allreduce_table=get["allreduce_table"] or None, query_split=query_split,
                       ulysses=ulysses, core_attention=core, failure_dir=get["failure_dir"] or None)
