"""The plan as the YAML that `--flash-overlap-config` takes (config.py), checked by config.from_dict first.

    default: {algo: reference}            sites the plan does not name keep Megatron's own path
    qkv / proj / fc1 / fc2: {algo: ..., num_chunks: k (slicing), hop_chunks: c (flash, c > 1)}
    all_reduce: {num_chunks: C}           TP without SP under flash: the chunk count of ops/tp_nosp
    attention: {ulysses_algo: ...}        cp > 1
    moe: {algo: ...}                      experts
    dp: {fuse: all | none}                the DP reduce-scatter inside the wgrad GEMMs, or stock buckets
The writer is this module's (the planner imports no YAML library): flow mappings of plain scalars, and the
description as a JSON string (a valid YAML double-quoted scalar).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

from ..config import from_dict
from .train_step import StepTimes


def _site_entry(variant: str, tp_sp: bool) -> dict:
    algo, _, knob = variant.partition(":")
    entry = {"algo": algo}
    if algo == "slicing":
        entry["num_chunks"] = int(knob)
    elif algo == "flash" and tp_sp and knob and int(knob) > 1:
        entry["hop_chunks"] = int(knob)
    return entry


def plan_dict(st: StepTimes, description: str) -> dict:
    """The config mapping of the plan (module docstring)."""
    sp = st.layout.sequence_parallel
    out: dict = {"description": description, "default": {"algo": "reference"}}
    for name, site in st.layer.sites.items():
        out[name] = _site_entry(site.variant, sp) if st.layout.tp > 1 else {"algo": "reference"}
    flash_c = {int(s.variant.split(":")[1]) for s in st.layer.sites.values() if s.algo == "flash" and ":" in s.variant}
    if not sp and flash_c:
        out["all_reduce"] = {"num_chunks": flash_c.pop()}
    if "ulysses" in st.layer.extras:
        out["attention"] = {"ulysses_algo": st.layer.extras["ulysses"].algo}
    if "moe" in st.layer.extras:
        out["moe"] = {"algo": st.layer.extras["moe"].algo}
    out["dp"] = {"fuse": "all" if st.dp_fuse else "none"}
    from_dict(out)  # raises ValueError naming the entry if the plan could not be loaded
    return out


_WORDS = {"true", "false", "yes", "no", "on", "off", "null"}  # YAML would read these as something else


def _scalar(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return str(v)
    text = str(v)
    return text if re.fullmatch(r"[a-z_]+", text) and text not in _WORDS else json.dumps(text)


def to_yaml(mapping: dict, header: str = "") -> str:
    lines = [f"# {line}" for line in header.splitlines()]
    for key, value in mapping.items():
        if isinstance(value, dict):
            inner = ", ".join(f"{k}: {_scalar(v)}" for k, v in value.items())
            lines.append(f"{key}: {{{inner}}}")
        else:
            lines.append(f"{key}: {_scalar(value)}")
    return "\n".join(lines) + "\n"


def write(st: StepTimes, path: str | Path, description: str) -> dict:
    """Write the plan's YAML to `path`; returns the mapping."""
    mapping = plan_dict(st, description)
    header = ("Written by flashoverlap-plan: PREDICTED choices (a model of the cluster, not a measurement).\n"
              "Load with --flash-overlap-config PATH (megatron_flashoverlap.config.load_config).")
    Path(path).write_text(to_yaml(mapping, header))
    return mapping
