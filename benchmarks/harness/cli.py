"""What every benchmarks/NAME/run.py shares: its parser, where it writes, and --render.

    parser(doc, name, needs) -> ArgumentParser   description = the script's docstring; the epilog says that
                                                 it runs from a checkout, what it needs (`needs`: SHAPED,
                                                 NO_ROOT or a sentence of its own), where it writes and
                                                 where the curated results are
    out_dir(name) -> ROOT/out/NAME               the default --out (git-ignored scratch; curated runs are
                                                 copied into benchmarks/NAME/data/ and linked from RESULTS.md)
    rerender(raw_path, body, script) -> md path  the markdown beside RAW (X_raw.json -> X.md) rebuilt from
                                                 RAW's samples by today's table code: its head (title,
                                                 command, setting: everything before the first "## ") kept,
                                                 every section after it replaced by body(json.load(RAW))
    before_run(a, body, script) -> exit code | None   what a run.py does before measuring: --render RAW
                                                 (rerender, 0), a shaped run without root (why, 2), else None

A results file holds its command, its setting and its spread: no load averages, no clock times (a date is
the most a run records), so a file reads the same whoever ran it.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

from benchmarks.harness.launch import ROOT, write_text
from benchmarks.harness.netns import why_not_shaped

SHAPED = ("Shaping the link (a network namespace and tc) needs root and iproute2; --unshaped runs on the host "
          "loopback without root, its tables labelled 'unshaped'.")
NO_ROOT = "It needs no root: one process, no network."
RENDERED = "(Tables and verdicts re-rendered from the same samples"  # the note rerender writes


def parser(doc: str, name: str, needs: str = SHAPED) -> argparse.ArgumentParser:
    """The script's parser: its docstring, then what running it takes."""
    epilog = (f"Runs from a source checkout (`pip install .` installs no benchmark code): from the repository "
              f"root, `python benchmarks/{name}/run.py ...` with the project's environment (e.g. .venv/bin/python). "
              f"{needs} Writes into --out (default out/{name}/, not tracked); the curated tables and "
              f"plots: benchmarks/{name}/RESULTS.md.")
    return argparse.ArgumentParser(description=doc, epilog=epilog,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def out_dir(name: str) -> str:
    return os.path.join(ROOT, "out", name)


def md_beside(raw_path: str) -> str:
    """X_raw.json -> X.md (the pair write_results writes)."""
    base = raw_path[:-len("_raw.json")] if raw_path.endswith("_raw.json") else os.path.splitext(raw_path)[0]
    return base + ".md"


def head_of(md: str) -> list[str]:
    """The lines before the first section, an earlier render's note and the blank lines around it dropped."""
    head = [ln for ln in md.split("\n## ")[0].rstrip("\n").splitlines() if not ln.startswith(RENDERED)]
    while head and not head[-1]:
        head.pop()
    return head


def rerender(raw_path: str, body, script: str) -> str:
    """Rewrite the markdown beside raw_path: its head kept, one note, then body(raw) (module docstring)."""
    md_path = md_beside(raw_path)
    with open(raw_path) as f:
        raw = json.load(f)
    with open(md_path) as f:
        head = head_of(f.read())
    note = f"{RENDERED} by `python benchmarks/{script} --render {raw_path}`, {datetime.date.today()}.)"
    write_text(md_path, "\n".join(head + ["", note, ""]) + "\n" + body(raw))
    return md_path


def before_run(a, body, script: str) -> int | None:
    """--render RAW: the markdown beside RAW rebuilt, 0. A shaped run that cannot shape: the reason, 2."""
    if getattr(a, "render", None):
        rerender(a.render, body, script)
        return 0
    reason = why_not_shaped()
    if reason and not a.unshaped:
        print(f"cannot shape the link: {reason}.\nRerun with --unshaped for a run on the plain host loopback; its "
              "tables are labelled 'unshaped' (TCP copies then compete with the GEMMs for the cores).", file=sys.stderr)
        return 2
    return None
