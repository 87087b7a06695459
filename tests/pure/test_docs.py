"""The front page and the docs read as a product: short README, no run diary, every link resolves.

Tier: pure (reads README.md, docs/*.md, CHANGELOG.md and the Makefile; nothing runs).
    - README.md <= 250 lines; its set-up commands are exactly `make demo` and `make test`, both Makefile targets
    - README.md, CHANGELOG.md and docs/*.md state no run date, clock time, UTC, machine load, "this machine",
      "previous machine" or session (history lives in git; a figure states its command, setting and spread)
    - every local link of README.md and docs/*.md resolves, anchors included where the target is markdown
    - every docs page is reachable from README.md's docs index
"""
from __future__ import annotations

import pathlib
import re

from tests.pure.test_results import DATED, LINK

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_LINES = 250
# user pages state no run date (YYYY-MM-DD) and no words about the machine a figure ran on; RESULTS.md files
# keep their run dates (tests/pure/test_results.py), the user pages link to them
UNDATED = DATED + [re.compile(p, re.I) for p in (r"\b20\d\d-\d\d-\d\d\b", r"\bthis machine\b",
                                                  r"\bthe machine at hand\b", r"\bthis VM\b")]


def user_pages() -> list[pathlib.Path]:
    return [README, ROOT / "CHANGELOG.md", *DOCS]


def anchors(page: pathlib.Path) -> set[str]:
    """GitHub's heading slugs of a markdown page, plus explicit <a id="..."> anchors."""
    text = page.read_text()
    out = set(re.findall(r'<a id="([^"]+)"', text))
    for head in re.findall(r"^#+ (.+)$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", head.strip().lower()).replace(" ", "-")
        out.add(slug)
    return out


def broken_links(page: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    bad = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{page.relative_to(root)} -> {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{page.relative_to(root)} -> {target} (no such heading or anchor)")
    return bad


def dated_lines(page: pathlib.Path, root: pathlib.Path = ROOT) -> list[str]:
    return [f"{page.relative_to(root)}:{i}: {line.strip()[:100]}"
            for i, line in enumerate(page.read_text().splitlines(), 1) if any(r.search(line) for r in UNDATED)]


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines; depth goes to docs/ (limit {MAX_LINES})"


def test_readme_gives_the_two_commands_and_the_makefile_has_them():
    text = README.read_text()
    commands = set(re.findall(r"^make (\w+)", text, flags=re.M))
    assert commands == {"demo", "test"}, commands
    targets = set(re.findall(r"^(\w[\w-]*):", (ROOT / "Makefile").read_text(), flags=re.M))
    assert {"demo", "test"} <= targets, targets


def test_user_pages_state_no_run_dates_clock_times_loads_or_machines():
    bad = [line for page in user_pages() for line in dated_lines(page)]
    assert not bad, "\n".join(bad)


def test_every_link_of_readme_and_docs_resolves():
    bad = [b for page in [README, *DOCS] for b in broken_links(page)]
    assert not bad, "\n".join(bad)


def test_every_docs_page_is_in_the_readme_index():
    linked = {t.split("#")[0] for t in LINK.findall(README.read_text())}
    missing = [p.name for p in DOCS if f"docs/{p.name}" not in linked]
    assert not missing, f"docs pages README.md does not link: {missing}"


def test_the_checks_see_what_they_look_for(tmp_path):
    """A planted date, machine word and broken link/anchor are caught; a plain page passes."""
    page = tmp_path / "p.md"
    page.write_text("# Head one\n\nran 2026-12-01 on this machine\n[x](missing.md) [y](#head-one) [z](#nope)\n")
    assert len(dated_lines(page, tmp_path)) == 1
    bad = broken_links(page, tmp_path)
    assert len(bad) == 2 and "missing.md" in bad[0] and "#nope" in bad[1], bad
    page.write_text("# Head one\n\n`--layouts 4:2` ran in 1.2 s [y](#head-one)\n")
    assert not dated_lines(page, tmp_path) and not broken_links(page, tmp_path)


CONFLICT = re.compile(r"^(<{7} |>{7} |={7}$)", re.M)


def test_no_merge_conflict_markers_in_the_pages_and_the_changelog():
    """A merge that left its markers in prose (Python would not import; Markdown renders them)."""
    pages = [*user_pages(), ROOT / "CHANGELOG.md", *sorted(ROOT.glob("benchmarks/*/RESULTS.md"))]
    assert [str(p.relative_to(ROOT)) for p in pages if CONFLICT.search(p.read_text())] == []
    assert CONFLICT.search("text\n<<<<<<< HEAD\nours\n=======\ntheirs\n>>>>>>> branch\n")  # the pattern finds one
