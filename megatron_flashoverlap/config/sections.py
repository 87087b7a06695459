"""The settings sections of a flash-overlap config (one frozen dataclass per YAML section, checked when made;
the package docstring gives the YAML). The vocabularies they check against are the package's."""
from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Mapping

from . import (ALL_REDUCE_ALGOS, CORE_ATTENTIONS, DECODE_SITE, DP_FUSE, LAYER_PICKS, LAYERS, MOE_SITE, MOE_SITE_ALGOS,
               PLANNER_PROBES, PREFILL_ALGOS, ROW_SITES, STEP_KINDS, TRAIN_PICKS, ULYSSES_SITE, ULYSSES_SITE_ALGOS,
               _positive_int_or_none)


@dataclass(frozen=True)
class AttentionSettings:
    """core: the core attention for cp == 1 without query split, one of CORE_ATTENTIONS. query_split:
    attention + proj + RS as one operator (TP with SP, cp == 1): true (asked: what cannot run it is refused),
    auto (a candidate of proj's auto where it can run, megatron/query_split_pair.py query_split_cannot_run), false.
    ulysses_algo: the a2a of Ulysses attention (cp > 1), one of ULYSSES_SITE_ALGOS (auto: stock or flash,
    measured)."""
    query_split: bool | str = "auto"
    ulysses_algo: str = "auto"
    core: str = "auto"

    def __post_init__(self):
        if self.core not in CORE_ATTENTIONS:
            raise ValueError(f"attention.core {self.core!r}: choose one of {CORE_ATTENTIONS}")
        if not isinstance(self.query_split, bool) and self.query_split != "auto":
            raise ValueError(f"attention.query_split must be true, false or auto, got {self.query_split!r}")
        if self.ulysses_algo == "stock":
            raise ValueError("attention.ulysses_algo 'stock' is now called 'reference'; write ulysses_algo: reference")
        if self.ulysses_algo not in ULYSSES_SITE_ALGOS:
            raise ValueError(f"attention.ulysses_algo {self.ulysses_algo!r}: choose one of {ULYSSES_SITE_ALGOS}")


@dataclass(frozen=True)
class AllReduceSettings:
    """num_chunks: the flash sequence chunk count of matmul_all_reduce (TP without SP; None: the operator's
    default). table: a calibration JSON the decode all-reduce chooses by (None: measured at first use).
    decode / prefill: the user's word for the inference all-reduces ("auto": the chooser's, plan/chooser.py)."""
    num_chunks: int | None = None
    table: str | None = None
    decode: str = "auto"
    prefill: str = "reference"  # measured stock under load on gloo CPU: benchmarks/serving RESULTS.md

    def __post_init__(self):
        _positive_int_or_none(self.num_chunks, "all_reduce.num_chunks")
        if self.table is not None and not isinstance(self.table, str):
            raise ValueError(f"all_reduce.table must be a path, got {self.table!r}")
        if self.decode not in ALL_REDUCE_ALGOS:
            raise ValueError(f"all_reduce.decode {self.decode!r}: choose one of {ALL_REDUCE_ALGOS}")
        if self.prefill not in PREFILL_ALGOS:
            raise ValueError(f"all_reduce.prefill {self.prefill!r}: choose one of {PREFILL_ALGOS}")


def _pinned_word(word, pick) -> None:
    """'site/kind/bucket': pick, as the chooser writes it (plan/chooser.py Key.word)."""
    parts = str(word).split("/")
    ok = len(parts) == 3 and parts[2].isdigit() and parts[1] in STEP_KINDS
    if ok and parts[0] == DECODE_SITE:
        ok = parts[1] == "decode" and pick in ALL_REDUCE_ALGOS[1:]
    elif ok and parts[0] in (MOE_SITE, ULYSSES_SITE):
        ok = parts[1] == "train" and pick in TRAIN_PICKS
    elif ok and parts[1] == "train":
        ok = parts[0] in LAYERS and pick in LAYER_PICKS
    elif ok:
        ok = parts[0] in ROW_SITES and parts[1] != "decode" and pick in PREFILL_ALGOS[1:]
    if not ok:
        raise ValueError(f"choices.pinned: {word}: {pick!r} is not a choice the chooser writes (proj|fc2/prefill|"
                         f"mixed/<tokens>: reference|decomposed, all_reduce/decode/<tokens>: an algorithm of "
                         f"{ALL_REDUCE_ALGOS[1:]}, {'|'.join(LAYERS)}/train/<tokens>: {'|'.join(LAYER_PICKS)}, "
                         f"{MOE_SITE}|{ULYSSES_SITE}/train/<tokens>: {'|'.join(TRAIN_PICKS)}); "
                         f"remove it or pass back the file a run wrote")


@dataclass(frozen=True)
class ChoiceSettings:
    """The chooser's budget and file (plan/chooser.py): budget_s of paired measurement in all; write: where
    the run writes its choices (None: nowhere); layout + pinned: choices a run wrote, not measured again."""
    budget_s: float = 10.0
    write: str | None = None
    layout: str | None = None
    pinned: Mapping = field(default_factory=lambda: types.MappingProxyType({}))

    def __post_init__(self):
        b = self.budget_s
        if isinstance(b, bool) or not isinstance(b, (int, float)) or b < 0:
            raise ValueError(f"choices.budget_s must be seconds >= 0 (0: measure nothing, stock where nothing "
                             f"is pinned), got {b!r}")
        if self.write is not None and not isinstance(self.write, str):
            raise ValueError(f"choices.write must be a path, got {self.write!r}")
        if not isinstance(self.pinned, Mapping):
            raise ValueError(f"choices.pinned must be a mapping of site/kind/bucket: pick, got {self.pinned!r}")
        for word, pick in self.pinned.items():
            _pinned_word(word, pick)
        object.__setattr__(self, "pinned", types.MappingProxyType(dict(self.pinned)))


@dataclass(frozen=True)
class MoESettings:
    """algo: how the alltoall dispatcher runs the exchange and the experts, one of MOE_SITE_ALGOS (flash: fused;
    auto: stock or flash, measured)."""
    algo: str = "auto"

    def __post_init__(self):
        if self.algo not in MOE_SITE_ALGOS:
            raise ValueError(f"moe.algo {self.algo!r}: choose one of {MOE_SITE_ALGOS}")


@dataclass(frozen=True)
class DPSettings:
    """fuse: which TP linears of pretrain()'s DDP reduce-scatter inside their wgrad GEMM, one of DP_FUSE."""
    fuse: str = "auto"

    def __post_init__(self):
        if self.fuse not in DP_FUSE:
            raise ValueError(f"dp.fuse {self.fuse!r}: choose one of {DP_FUSE}")


@dataclass(frozen=True)
class PlannerSettings:
    """probe: "auto" (on NCCL, the planner fills what the YAML leaves open: megatron/probe.py), "always" (on
    every backend: gloo runs the GPU run's path) or "off"."""
    probe: str = "auto"

    def __post_init__(self):
        if self.probe is False:  # YAML 1.1 reads a bare `off` as false
            object.__setattr__(self, "probe", "off")
        if self.probe is True:
            raise ValueError("planner.probe: YAML reads a bare on / yes / true as a boolean: write always (every "
                             "backend) or auto (NCCL only)")
        if self.probe not in PLANNER_PROBES:
            raise ValueError(f"planner.probe {self.probe!r}: choose one of {PLANNER_PROBES}")
