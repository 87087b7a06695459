"""The table of refusals (config/refusals.py): well formed, every row reachable at each check that reads it, the
evaluator's reading of unset values, the Megatron wing reading the table by known check words only, and
docs/megatron.md's table equal to it.

Tier: pure (imports config/refusals.py and parses the wing's source with `ast`; nothing of Megatron is imported).
The wing's sites raising the rows' own messages: tests/megatron/test_refusals.py (it reuses CASES).
"""
from __future__ import annotations

import ast
import enum
import pathlib

import pytest

from megatron_flashoverlap.config import refusals
from megatron_flashoverlap.config.refusals import CHECKS, OPS, ROWS, found, holds, rows, said

ROOT = pathlib.Path(__file__).resolve().parents[2]
WING = ROOT / "megatron_flashoverlap" / "megatron"
DOC = ROOT / "docs" / "megatron.md"
BEGIN, END = "<!-- refusals: python -m megatron_flashoverlap.config.refusals -->", "<!-- /refusals -->"
READERS = {"refuse", "found", "unhonoured", "rows"}  # the table's functions that take a check word first


SATISFYING = {"on": lambda v: True, "off": lambda v: False, "==": lambda v: v, "!=": lambda v: "other",
              "not in": lambda v: "other", ">": lambda v: v + 1, "has": lambda v: [v]}  # op -> a value it holds for


def satisfying(op: str, value):
    return SATISFYING[op](value)


def base(at: str) -> dict:
    """Facts under which no row of `at` holds: every flag whose absence is refused, given."""
    return {r.name(at): True for r in rows(at) if r.op == "off"}


def case(at: str, row) -> dict:
    """The facts that make `row` hold at check `at` (and nothing else changed from base)."""
    facts = {**base(at), row.name(at): satisfying(row.op, row.value)}
    facts.update({field: satisfying(op, value) for field, op, value in row.also})
    return facts


CASES = [(at, row, case(at, row)) for row in ROWS for at in row.at]


def test_every_row_is_well_formed():
    for r in ROWS:
        assert r.flag.startswith("--") or r.flag.isidentifier(), r  # the flag as typed, or a config field
        assert r.field.isidentifier() and (r.args is None or r.args.isidentifier()), r
        assert r.op in OPS and all(op in OPS and f.isidentifier() for f, op, _ in r.also), r
        assert r.op != "not in" or isinstance(r.value, tuple), r
        assert r.reason.strip() and r.fix.strip() and not r.fix.endswith("."), r
        assert r.at and set(r.at) <= set(CHECKS), r
    assert {a for r in ROWS for a in r.at} == set(CHECKS)  # no check word without a row


def test_no_row_holds_where_nothing_is_given():
    """A flag the user did not give is never refused (only the absence rows, given in base, could be)."""
    for at in CHECKS:
        assert found(at, None, **base(at)) is None, at
        absent = {r.name(at): None for r in rows(at) if r.op == "off" and not r.also}
        if absent:  # and each absence that needs nothing else given is refused
            assert found(at, None, **absent) is not None, at


@pytest.mark.parametrize("at, row, facts", CASES, ids=[f"{a}:{r.flag}" for a, r, _ in CASES])
def test_each_row_is_reached_at_each_check_that_reads_it(at, row, facts):
    """The row itself answers (not an earlier row of the same check), with the value it was given."""
    assert found(at, None, **facts) == (row, facts[row.name(at)])
    with pytest.raises(ValueError) as err:
        refusals.refuse(at, None, "where", **facts)
    assert str(err.value) == f"where: {said(row, facts[row.name(at)])}; {row.fix}"


class Backend(enum.Enum):
    local = 1


def test_unset_values_and_typed_values():
    assert not holds(None, "!=", "vanilla") and not holds(False, "on", None) and not holds("", "on", None)
    assert holds(None, "off", None) and holds(False, "off", None) and not holds(0, "on", None)
    assert holds(Backend.local, "==", "local") and holds(["my", "spec"], "not in", refusals.OUR_SPECS)
    assert not holds(list(refusals.OUR_SPECS[0]), "not in", refusals.OUR_SPECS)
    assert holds(["core_attn", "mlp"], "has", "core_attn") and not holds(1, ">", 1)
    with pytest.raises(KeyError):
        rows("no such check")


def test_the_flag_is_shown_as_typed():
    flags = ("--spec", "--window-size", "fp8_dot_product_attention", "--mock-data")
    spec, window, fp8_attention, mock = (next(r for r in ROWS if r.flag == f) for f in flags)
    assert said(spec, ["my.mod", "my_spec"]).startswith("--spec my.mod my_spec was given")  # nargs: spaces
    assert said(window, (4, 0)).startswith("--window-size 4,0 ")  # Megatron's tuple_type: commas
    assert said(fp8_attention, True).startswith("fp8_dot_product_attention turns on")
    assert said(fp8_attention, "x").startswith("fp8_dot_product_attention='x' ")
    assert said(mock, False).startswith("without --mock-data, ")


def _reads(path: pathlib.Path) -> list:
    """The first argument (a constant, else None) of every call of a table reader the file imports."""
    tree = ast.parse(path.read_text())
    readers = {a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
               and (n.module or "").endswith("config.refusals") for a in n.names if a.name in READERS}
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) in readers]
    return [c.args[0].value if c.args and isinstance(c.args[0], ast.Constant) else None for c in calls]


def test_the_wing_reads_every_check_by_its_word():
    """Every check word is read somewhere in the wing, and every read names a known word as a literal (a typo
    would read no row and refuse nothing)."""
    words = [word for path in sorted(WING.rglob("*.py")) for word in _reads(path)]
    assert None not in words and set(words) <= set(CHECKS), words
    assert set(CHECKS) <= set(words), set(CHECKS) - set(words)


def test_the_docs_table_is_the_table():
    text = DOC.read_text()
    assert BEGIN in text and END in text, "docs/megatron.md lost its generated refusals block"
    block = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    assert block == refusals.markdown(), "regenerate: python -m megatron_flashoverlap.config.refusals"
