"""Tier: pure (no processes). The package's prose is legend and reason: no measured figure, date or issue number
in a module's docstrings or comments (figures live in benchmarks/*/RESULTS.md, history in git)."""
import io
import re
import tokenize
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "megatron_flashoverlap"
FIGURE = re.compile(r"\bissues? #?\d+|\bitem \d+[a-z]?\b|\b20\d\d-\d\d-\d\d\b|\d(\.\d+)? ?(ms|us|µs|GFLOP/s|GB/s)\b"
                    r"|\d(\.\d+)?x (faster|slower)\b")
# where a figure in prose is data, not a measurement: (file, why)
EXEMPT = {
    "plan/catalog.py": "the planner's catalogue of published hardware figures, each with its source",
    "plan/links.py": "the planner's network model, which names NCCL's own published constants",
    "runtime/transport.py": "quotes gloo's own timeout message, which names its limit in ms",
}


def prose(src: str):
    """(line, text) of every docstring (a string statement in triple quotes) and comment of `src`."""
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type == tokenize.COMMENT or (tok.type == tokenize.STRING
                                            and tok.string.lstrip("rbuRBU").startswith(('"""', "'''"))):
            yield tok.start[0], tok.string


def figures(src: str) -> list:
    return [(line, m.group(0)) for line, text in prose(src) for m in FIGURE.finditer(text)]


def test_package_prose_quotes_no_measured_figure_date_or_issue_number():
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        hits = figures(path.read_text())
        if hits and name not in EXEMPT:
            found[name] = hits
    assert not found, f"cite the RESULTS.md section instead (or say why in EXEMPT): {found}"


def test_the_figure_check_sees_what_it_looks_for():
    src = ('"""A hop blocks ~1.5 ms at 4 gbit/s (issue 25, item 4b), run of 2026-12-02."""\n'
           'x = "12 ms"  # 3.2x faster than stock\n')
    assert [f for _, f in figures(src)] == ["1.5 ms", "issue 25", "item 4b", "2026-12-02", "3.2x faster"]
    assert figures('"""The legend: x [s/P, b, h], 16 rows, fp8 max 448."""\n') == []
