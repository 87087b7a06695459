"""The one chooser: which algorithm a site runs, per step kind and shape bucket, and why.

    Key(site, kind, bucket, layout, shape)
        site    proj | fc2: the row-parallel output all-reduce without SP of a prefill or mixed step
                    candidates: reference (the GEMM, then stock all-reduce) | decomposed (the layer's algo)
                qkv | proj | fc1 | fc2 at a training step, where the layer's algo is auto
                    candidates: reference (stock's forward) | flash | flash_c2 (under SP: 2 sub-chunks per hop),
                    forward + backward (megatron/train_choice.py)
                proj with the query-split pair (attention.query_split auto or true) at a training step, where
                proj's algo is auto
                    candidates: reference | flash | flash_c2 (Megatron's attention, then the GEMM + RS) |
                    query_split, forward + backward with the attention (megatron/train_choice.py query_split_plan)
                moe: an MoE layer's exchange + experts at a training step, where moe.algo is auto
                    candidates: reference (stock a2a, experts, a2a) | flash (fused), forward (ops/moe/choose.py)
                ulysses: Ulysses attention's two all-to-alls at a training step, ulysses_algo auto
                    candidates: reference (all_to_all_single) | flash, fwd + bwd (ops/attention/choose.py)
                all_reduce: the decode all-reduce (one per row site and decode step, whole after the GEMM)
                    candidates: reference | the all-reduce algorithms distinct on the layout
        kind    train | prefill | decode | mixed (a step holding prefill and decode tokens)
        bucket  the step's tokens rounded up to a power of two (as Megatron's CUDA-graph batch buckets);
                a bucket is measured at its own size, once
        layout  "4 ranks, 2 per node, gloo, bfloat16": the group and dtype the choice holds for
        shape   the operands' sizes ("h 512 k 128"): two models in one process never share a choice
        members the group's global ranks (a measurement is collective: every member decides it together)
    Precedence, first that answers (`answer`, then `decide` / `fallback`):
        1 yaml      the user's word: all_reduce.decode / all_reduce.prefill other than auto; a layer's algo
                    other than auto (its training step never asks)
        2 pinned    choices.pinned: what a run wrote to choices.write, passed back (same layout, else an error)
        3 measured  paired rounds of stock and every candidate on the real group at the bucket's shape
                    (ops/choose.py `settle`; each site's measurement: ops/all_reduce/choose.py,
                    ops/tp_nosp/choose.py, ops/moe/choose.py, ops/attention/choose.py,
                    megatron/train_choice.py), or an all-reduce calibration file
                    (all_reduce.table), while the measured seconds stay inside choices.budget_s; a row site's
                    prefill and mixed keys of a bucket share one measurement. When: a dynamic engine's first
                    step measures every bucket the engine can meet, smallest first (megatron/step_kind.py), so
                    no later request waits on one; any other inference measures a bucket on first use
        4 model     nothing measured (budget spent, or inside a CUDA-graph capture): the planner's prediction
                    where its probe made one (megatron/probe.py: its decode table; a training site's pick where
                    that is a candidate, reference or flash), else stock
    Rule (`paired_pick`): stock, unless a candidate's median is below stock's AND it was faster than stock in
    PAIRED_WINS of the rounds, each round pairing them under the same load: a noisy win stays stock. Of the
    candidates that beat stock so, the one of lowest median (the fastest by median may not be among them: its
    gain within the noise of stock, where another's is not).
Every rank of a group decides alike: the samples it decides on are the max over the group's ranks (the time of
a collective is its slowest rank's), the budget is charged those same seconds, and the rule is a pure function.
A training site's samples are the max over its replicas as well (the stage's tensor + data + context parallel
group; the expert-data-parallel group for the MoE exchange): every replica agrees.
"""
from __future__ import annotations

import dataclasses
import json
import math
import statistics
from dataclasses import dataclass
from typing import Mapping, NamedTuple, Sequence

from ..config import ALL_REDUCE_ALGOS, DECODE_SITE, TRAIN_PICKS, FlashOverlapConfig, to_dict

STOCK = "reference"
_TWIN_KIND = {"prefill": "mixed", "mixed": "prefill"}  # one measurement answers both (Chooser.decide)
PAIRED_WINS = 0.8  # share of paired rounds a candidate must win (5 rounds: 4; a coin does that 19 % of the time)


def bucket(tokens: int) -> int:
    """The power of two at or above `tokens` (>= 1)."""
    return 1 << max(int(tokens) - 1, 0).bit_length()


@dataclass(frozen=True)
class Key:
    site: str
    kind: str
    bucket: int
    layout: str
    shape: str
    members: tuple = ()  # the group's global ranks: a choice measured on one group never answers another's
    nbytes: int = 0      # the bucket's all-reduce message (decode keys), for a calibration table's lookup

    @property
    def word(self) -> str:
        """'proj/prefill/16': the key as the choice file names it."""
        return f"{self.site}/{self.kind}/{self.bucket}"


class Measured(NamedTuple):
    """What a site's measurement hands the rule: {candidate: [seconds per kept paired round]} (the max over the
    group) and the seconds the budget is charged: the samples' sum (`of`), or less where the samples count a
    shared part more than once (the query-split pair times Megatron's attention once a round, adds it to three)."""
    samples: Mapping[str, Sequence[float]]
    seconds: float

    @classmethod
    def of(cls, samples: Mapping[str, Sequence[float]]) -> "Measured":
        return cls(samples, sum(sum(v) for v in samples.values()))


@dataclass(frozen=True)
class Choice:
    pick: str
    source: str   # yaml | pinned | measured | model
    reason: str
    medians_us: tuple = ()  # ((candidate, median us), ...) where measured


def _median_us(samples: Sequence[float]) -> float:
    return round(statistics.median(samples) * 1e6, 1)


def paired_pick(samples: Mapping[str, Sequence[float]], stock: str = STOCK) -> tuple[str, str]:
    """(pick, reason) from {candidate: [seconds per paired round]} (module docstring: the rule)."""
    ref = samples[stock]
    others = {k: v for k, v in samples.items() if k != stock}
    if not others:
        return stock, "no other candidate"
    n = len(ref)
    need = math.ceil(PAIRED_WINS * n)
    median = {k: statistics.median(v) for k, v in others.items()}
    wins = {k: sum(o < r for o, r in zip(v, ref)) for k, v in others.items()}
    beat = [k for k in others if median[k] < statistics.median(ref) and wins[k] >= need]
    fastest = min(others, key=median.get)
    if beat:
        best = min(beat, key=median.get)
        why = f"{best} faster than stock in {wins[best]}/{n} paired rounds"
        if best != fastest:  # the fastest by median is within the noise of stock: a sure gain runs instead
            why += f"; the fastest by median, {fastest}, won {wins[fastest]}/{n} (needs {need})"
        return best, why
    short = ", not the median" if wins[fastest] >= need else f" (needs {need})"
    return stock, f"stock kept: the fastest other, {fastest}, won {wins[fastest]}/{n} paired rounds{short}"


def best_at(table: Mapping, nbytes: int) -> str | None:
    """From an all-reduce calibration table (rows per message size, ops/all_reduce/choose.py): the algorithm
    paired_pick takes at the measured size nearest `nbytes` (log scale), None where that is stock or `nbytes`
    lies outside the measured sizes (no extrapolation). Rows without rounds compare medians alone."""
    rows = table["rows"]
    sizes = [r["bytes"] for r in rows]
    if not rows or not min(sizes) <= nbytes <= max(sizes):
        return None
    row = min(rows, key=lambda r: abs(math.log(r["bytes"]) - math.log(max(nbytes, 1))))
    ref = row.get("reference_rounds_us") or [row.get("reference_us", row.get("stock_us"))]
    samples = {STOCK: ref}
    for a in ALL_REDUCE_ALGOS:
        if f"{a}_us" in row and a not in ("auto", STOCK):
            got = row.get(f"{a}_rounds_us") or [row[f"{a}_us"]]
            samples[a] = got if len(got) == len(ref) else [row[f"{a}_us"]] * len(ref)
    pick = paired_pick(samples)[0]
    return None if pick == STOCK else pick


class Chooser:
    """The decisions of one config (module docstring); `chooser_of(cfg)` makes it once per config."""

    def __init__(self, config: FlashOverlapConfig):
        self.config = config
        self.tables = _tables(config.all_reduce.table)  # a calibration file's entries (read once)
        self.model_tables: list = []  # the planner's predicted decode tables (megatron/probe.py), the model tier
        self.model_sites: dict = {}  # the planner's per-site training picks {site: {"algo", ...}}, the model tier
        self.decided: dict[Key, Choice] = {}
        self.spent_s = 0.0
        self.costs: dict[tuple, tuple[int, float]] = {}  # (site, layout, shape): (bucket, seconds) last measured

    @property
    def budget_s(self) -> float:
        return self.config.choices.budget_s

    def answer(self, key: Key) -> Choice | None:
        """The choice of a higher tier than a measurement (yaml, pinned, a calibration file at the bucket's
        key.nbytes), or the one already made; None: the caller measures (within the budget) or falls back."""
        if key in self.decided:
            return self.decided[key]
        knob = "decode" if key.site == DECODE_SITE else "prefill"
        word, choices = getattr(self.config.all_reduce, knob), self.config.choices
        if word != "auto" and key.kind != "train":  # a training site asks only under its own word, auto
            return self._keep(key, Choice(word, "yaml", f"all_reduce.{knob}: {word} in the config"))
        if key.word in choices.pinned:
            if choices.layout is not None and choices.layout != key.layout:
                raise ValueError(f"choices.pinned was written for {choices.layout!r}, this group is "
                                 f"{key.layout!r}; remove choices.pinned (or run with the layout it was measured on)")
            return self._keep(key, Choice(choices.pinned[key.word], "pinned", "choices.pinned"))
        if key.site == DECODE_SITE and self.config.all_reduce.table is not None:
            return self._from_table(key)
        return None

    def _from_table(self, key: Key) -> Choice:
        path = self.config.all_reduce.table
        table = next((t for t in self.tables if table_layout(t) == key.layout), None)
        if table is None:
            return self._keep(key, Choice(STOCK, "model", f"all_reduce.table {path} has no entry for "
                                                           f"{key.layout} (a table file is the whole truth)"))
        pick = best_at(table, key.nbytes) or STOCK
        return self._keep(key, Choice(pick, "measured", f"all_reduce.table {path}"))

    def expected_s(self, key: Key) -> float:
        """What measuring `key` should cost: the last measured bucket of its site and operands, scaled by the
        bucket (a message grows with it); for a site not measured yet, the costliest per token measured on its
        layout so far, at its bucket; 0 where nothing was measured on the layout (the first measurement runs)."""
        last = self.costs.get((key.site, key.layout, key.shape))
        if last is None:
            seen = [s / b for (_, layout, _), (b, s) in self.costs.items() if layout == key.layout]
            return max(seen, default=0.0) * key.bucket
        return last[1] * key.bucket / last[0]

    def can_measure(self, key: Key | None = None) -> bool:
        """The budget holds the measured seconds so far and, for `key`, what it should cost."""
        return self.spent_s + (0.0 if key is None else self.expected_s(key)) < self.budget_s

    def decide(self, key: Key, measured: Measured) -> Choice:
        """Record the rule's pick from a measurement's paired samples; charge its seconds. A row site's prefill
        and mixed keys of one bucket share it (the op is the same forward of the step's tokens), unless the twin
        is decided or pinned already."""
        samples, cost = measured
        self.spent_s += cost
        self.costs[(key.site, key.layout, key.shape)] = (key.bucket, cost)
        pick, why = paired_pick(samples)
        choice = Choice(pick, "measured", why, tuple((k, _median_us(v)) for k, v in samples.items()))
        twin = _TWIN_KIND.get(key.kind) if key.site != DECODE_SITE else None
        if twin is not None:
            other = dataclasses.replace(key, kind=twin)
            if other not in self.decided and other.word not in self.config.choices.pinned:
                self._keep(other, choice)
        return self._keep(key, choice)

    def fallback(self, key: Key, why: str) -> Choice:
        """Nothing measured for `key`: the model's pick (the planner's predicted table for a decode key, its site
        pick for a training key, where the probe made them), else stock (no figure says otherwise)."""
        if key.kind == "train":
            planned = self.model_sites.get(key.site, {}).get("algo")
            pick = planned if planned in TRAIN_PICKS else None
        else:
            table = next((t for t in self.model_tables if table_layout(t) == key.layout), None)
            pick = best_at(table, key.nbytes) if table is not None and key.site == DECODE_SITE else None
        return self._keep(key, Choice(pick or STOCK, "model", why + ("; the planner's prediction" if pick else "")))

    def _keep(self, key: Key, choice: Choice) -> Choice:
        self.decided[key] = choice
        return choice

    def as_config(self) -> dict:
        """The config this run ran, its choices pinned (the --flash-overlap-config format): passed back, every
        bucket decided here is decided the same without measuring."""
        data = to_dict(self.config)
        layouts = {k.layout for k in self.decided}
        pinned = dict(self.config.choices.pinned)
        pinned.update({k.word: c.pick for k, c in sorted(self.decided.items(), key=lambda kc: kc[0].word)})
        choices = dict(data.get("choices", {}))
        choices.update({"pinned": pinned, "layout": next(iter(layouts)) if len(layouts) == 1 else None})
        data["choices"] = choices
        return data


def line(key: Key, choice: Choice) -> str:
    """The one log line of a decision: the key, the pick, where it came from, the measured medians."""
    times = ", ".join(f"{k} {v:.0f} us" for k, v in choice.medians_us)
    return (f"flash-overlap chose {choice.pick} for {key.word} ({key.layout}; {key.shape}): {choice.source}, "
            f"{choice.reason}" + (f" [{times}]" if times else ""))


def layout_word(world: int, per_node: int | None, backend: str, dtype: str) -> str:
    """'4 ranks, 2 per node, gloo, bfloat16' (per_node None: 'not node-contiguous')."""
    nodes = f"{per_node} per node" if per_node is not None else "not node-contiguous"
    return f"{world} ranks, {nodes}, {backend}, {dtype}"


def table_layout(t: Mapping) -> str:
    """The layout word of a calibration-table entry (world_size, local_world_size, backend, dtype)."""
    return layout_word(t.get("world_size"), t.get("local_world_size"), str(t.get("backend")), str(t.get("dtype")))


def chooser_of(cfg: FlashOverlapConfig) -> Chooser:
    """The config's chooser, made on first use and kept on the config object (it owns its decisions)."""
    made = cfg.__dict__.get("_chooser")
    if made is None:
        made = Chooser(cfg)
        object.__setattr__(cfg, "_chooser", made)
    return made


def _tables(path: str | None) -> list:
    if path is None:
        return []
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"all_reduce.table {path!r}: no such file; write one with python -m "
                         f"megatron_flashoverlap.tools.calibrate_allreduce, or unset it") from None
    if not isinstance(data, Mapping) or "tables" not in data:
        raise ValueError(f"all_reduce.table {path!r}: expected {{'tables': [...]}}, as written by python -m "
                         f"megatron_flashoverlap.tools.calibrate_allreduce")
    return list(data["tables"])
