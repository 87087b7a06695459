"""Curated results: one RESULTS.md per benchmark folder, every data file linked, every table re-renderable.

Tier: pure (reads files; the renderers run in-process on the committed samples, nothing is measured).
    - no file under results/ or benchmarks/ is named after an issue
    - every file under results/ and every data file under benchmarks/NAME/ (what is not code, not a
      RESULTS.md) is the target of a markdown link in a RESULTS.md, README.md or docs/*.md
    - every benchmark folder has a RESULTS.md; its links resolve
    - RESULTS.md and the data markdown state no clock time, no UTC, no machine load (a date is fine)
    - every benchmarks/NAME/data/X_raw.json has X.md beside it whose tables are exactly what
      `python benchmarks/NAME/run.py --render` writes from those samples today
"""
from __future__ import annotations

import importlib
import json
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
CODE = {".py", ".c"}
SCRATCH = {"__pycache__", "out"}  # git-ignored: a run's scratch output, bytecode
ISSUE = re.compile(r"issue[\W_]*\d+", re.I)
LINK = re.compile(r"\]\(([^)\s]+)\)")
DATED = [re.compile(p) for p in (r"\b\d{1,2}:\d{2}\b(?! ?(?:nodes|ranks))", r"\bUTC\b", r"load average",
                                 r"\bload(?:s| of)? ?[~=]?\d", r"\bsession\b", r"previous machine")]
RENDERED = "(Tables and verdicts re-rendered from the same samples"


def _files(top: pathlib.Path) -> list[pathlib.Path]:
    return sorted(p for p in top.rglob("*") if p.is_file() and not SCRATCH & set(p.relative_to(top).parts))


def benchmark_folders() -> list[pathlib.Path]:
    return sorted(p for p in BENCH.iterdir() if p.is_dir() and (p / "run.py").exists())


def results_pages() -> list[pathlib.Path]:
    return sorted(BENCH.glob("*/RESULTS.md"))


def link_pages() -> list[pathlib.Path]:
    """Every page a data file may be linked from: RESULTS.md files, README.md, docs/*.md (where present)."""
    return results_pages() + [p for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))] if p.exists()]


def links(page: pathlib.Path) -> set[pathlib.Path]:
    """The local files a page links to (markdown links and images; anchors and web addresses dropped)."""
    out = set()
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        out.add((page.parent / target.split("#")[0]).resolve())
    return out


def data_files() -> list[pathlib.Path]:
    """What must be linked: everything under results/, and what is not code or a RESULTS.md in benchmarks/."""
    files = _files(ROOT / "results") if (ROOT / "results").exists() else []
    for folder in benchmark_folders():
        files += [p for p in _files(folder) if p.suffix not in CODE and p.name != "RESULTS.md"]
    return files


def test_nothing_is_named_after_an_issue():
    named = [str(p.relative_to(ROOT)) for top in (ROOT / "results", BENCH) if top.exists()
             for p in _files(top) if ISSUE.search(str(p.relative_to(ROOT)))]
    assert not named, named


def test_every_benchmark_folder_has_its_results_page():
    assert benchmark_folders(), "no benchmarks/NAME/run.py found"
    missing = [f.name for f in benchmark_folders() if not (f / "RESULTS.md").exists()]
    assert not missing, missing


def test_every_data_file_is_linked_from_a_page():
    linked = set().union(*(links(p) for p in link_pages()))
    orphans = [str(p.relative_to(ROOT)) for p in data_files() if p.resolve() not in linked]
    assert not orphans, f"referenced by no RESULTS.md, README.md or docs page: {orphans}"


def test_every_link_of_a_results_page_resolves():
    broken = [f"{p.relative_to(ROOT)} -> {t}" for p in results_pages() for t in links(p) if not t.exists()]
    assert not broken, broken


def test_results_state_no_clock_time_load_or_session():
    pages = results_pages() + sorted(BENCH.glob("*/data/*.md"))
    bad = [f"{p.relative_to(ROOT)}:{i}: {line.strip()[:100]}" for p in pages
           for i, line in enumerate(p.read_text().splitlines(), 1) if any(r.search(line) for r in DATED)]
    assert not bad, "\n".join(bad)


def raw_files() -> list[pathlib.Path]:
    return sorted(BENCH.glob("*/data/*_raw.json"))


@pytest.mark.newest_only  # rendering does not depend on the Megatron version: one lane checks it
@pytest.mark.parametrize("raw", raw_files(), ids=lambda p: str(p.relative_to(BENCH)))
def test_each_data_table_renders_from_its_samples(raw):
    """The markdown beside X_raw.json = its head, one render note, then exactly run.py's body(samples)."""
    md = raw.with_name(raw.name[:-len("_raw.json")] + ".md")
    assert md.exists(), f"{raw.name}: no {md.name} beside it (run.py --render {raw.name} writes it)"
    text = md.read_text()
    notes = [ln for ln in text.splitlines() if ln.startswith(RENDERED)]
    assert len(notes) == 1, f"{md.name}: {len(notes)} render notes; rebuild it with run.py --render"
    body = importlib.import_module(f"benchmarks.{raw.parent.parent.name}.run").body
    assert text.split(notes[0] + "\n\n", 1)[1] == body(json.loads(raw.read_text())), (
        f"{md.name} is not what today's table code renders from {raw.name}: "
        f"python benchmarks/{raw.parent.parent.name}/run.py --render {raw.relative_to(ROOT)}")


def test_the_checks_see_what_they_look_for(tmp_path):
    """The patterns catch an issue name, a clock time, a load and a dangling link; a date and a layout pass."""
    assert ISSUE.search("overlap_issue13_subslice.md") and ISSUE.search("results/issue-7/x.json")
    hits = ["2026-12-01 17:38 UTC", "load 16.1", "load ~2", "load average 3.3", "(20:14)"]
    assert all(any(r.search(s) for r in DATED) for s in hits)
    quiet = ["run 2026-12-01", "--layouts 4:2 8:2", "1:1", "under load)", "4 ranks = 2 nodes x 2"]
    assert not [s for s in quiet if any(r.search(s) for r in DATED)]
    page = tmp_path / "RESULTS.md"
    page.write_text("[a](data/a.md) ![b](data/b.png#x) [web](https://x.org/y) [top](#head)\n")
    assert links(page) == {(tmp_path / "data/a.md").resolve(), (tmp_path / "data/b.png").resolve()}
