"""Small pieces (STYLE.md 12): no package file over 400 lines, function length median <= 12, p90 <= 40.

Tier: pure (parses the source with `ast`; nothing is imported or run).
"""
from __future__ import annotations

import ast
import pathlib
import statistics

PKG = pathlib.Path(__file__).resolve().parents[2] / "megatron_flashoverlap"
MAX_FILE_LINES, MAX_MEDIAN, MAX_P90 = 400, 12, 40


def _sources() -> list[pathlib.Path]:
    return sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def function_lengths(src: str) -> list[int]:
    """Lines of every def (nested ones too), decorators excluded."""
    return [n.end_lineno - n.lineno + 1 for n in ast.walk(ast.parse(src))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def test_no_file_over_400_lines():
    big = {p.relative_to(PKG).as_posix(): n for p in _sources() if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert not big, f"files over {MAX_FILE_LINES} lines: {big}"


def test_functions_are_short():
    lengths = sorted(n for p in _sources() for n in function_lengths(p.read_text()))
    p90 = lengths[int(0.9 * (len(lengths) - 1))]
    assert statistics.median(lengths) <= MAX_MEDIAN and p90 <= MAX_P90, (statistics.median(lengths), p90)


def test_the_length_counter_counts():
    src = "def f():\n    x = 1\n    return x\n\n\nclass C:\n    def g(self):\n        def h():\n            pass\n"
    assert sorted(function_lengths(src)) == [2, 3, 3]
