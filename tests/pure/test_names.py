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


# A module name used in two places of the package means one thing in both; these are the names that do (every
# other name is used once). name -> its one meaning.
SHARED = {
    "__init__": "a package's face",
    "__main__": "a package's `python -m` entry",
    "plain": "an operator family's plain functions, one per algorithm (ops/<family>/)",
    "plain_fp8": "their FP8 twins",
    "autograd": "an operator family's autograd Functions and public wrappers",
    "choose": "a site's measured pick, the chooser's measured tier (ops/choose.py: the steps they share)",
    "alltoall": "the all-to-all, on the floor the folder names (its schedule; its runtime walk)",
    "fp8": "FP8, on the floor the folder names (the recipe math; Megatron's FP8 layer state)",
}
# the top-level entry points are faces of the wing's modules of the same name
FACES = ("spec", "launch", "generate", "serve", "pretrain_gpt")


def test_no_module_name_means_two_things():
    places = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        places.setdefault(path.stem, []).append(path.relative_to(PACKAGE).as_posix())
    twice = {name: where for name, where in places.items() if len(where) > 1}
    unexplained = {name: where for name, where in twice.items() if name not in SHARED and name not in FACES}
    assert not unexplained, f"rename one, or give the one meaning in SHARED: {unexplained}"
    for name in FACES:  # a face imports its namesake in the wing and defines nothing of its own
        face = (PACKAGE / f"{name}.py").read_text()
        assert f"from .megatron." in face and f".{name} import" in face, name
        assert "\ndef " not in face and "\nclass " not in face, name
