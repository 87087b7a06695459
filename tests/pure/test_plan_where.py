"""docs/planner.md's "Where it pays, on GPUs" table is what `python -m megatron_flashoverlap.plan where` prints.

Tier: pure (the planner runs in-process on the catalogue; a few seconds). The figures are the model's predictions and
are not asserted; what is asserted is that the committed table is today's code's, and that the rows are labelled.
"""
import pathlib
import re

from megatron_flashoverlap.plan import cli, where

ROOT = pathlib.Path(__file__).resolve().parents[2]
BEGIN, END = "<!-- where-it-pays:begin -->", "<!-- where-it-pays:end -->"


def committed() -> str:
    text = (ROOT / "docs" / "planner.md").read_text()
    return text[text.index(BEGIN) + len(BEGIN):text.index(END)].strip("\n")


def test_the_committed_table_is_what_the_code_prints():
    assert committed() == where.table(), "regenerate: python -m megatron_flashoverlap.plan where"


def test_the_table_sits_under_a_predictions_heading_and_every_row_has_its_command(capsys):
    text = (ROOT / "docs" / "planner.md").read_text()
    heading = [h for h in re.findall(r"^## (.+)$", text[:text.index(BEGIN)], flags=re.M)][-1]
    assert "PREDICTIONS" in heading
    assert cli.main(["where"]) == 0
    out = capsys.readouterr().out
    assert out.count("python -m megatron_flashoverlap.plan --hidden-size") == len(where.SCENARIOS)
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    assert len(rows) == len(where.SCENARIOS) + 1  # the header and one row per scenario
