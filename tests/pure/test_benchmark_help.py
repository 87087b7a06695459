"""Tier: pure. Every benchmark's `run.py --help` works from a checkout, as a user types it from the repository
root, and says what running it takes: that it runs from a source checkout (`pip install .` installs no benchmark
code). In-process (runpy with the script's own __main__), so the tier stays in seconds."""
import contextlib
import io
import runpy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted((ROOT / "benchmarks").glob("*/run.py"))


def test_every_benchmark_folder_has_its_script():
    folders = sorted(p.parent.name for p in (ROOT / "benchmarks").glob("*/RESULTS.md"))
    assert folders and folders == sorted(s.parent.name for s in SCRIPTS if s.parent.name in folders)


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.parent.name for s in SCRIPTS])
def test_run_py_help_works_from_a_checkout(script, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(sys, "argv", [str(script.relative_to(ROOT)), "--help"])
    monkeypatch.setattr(sys, "path", list(sys.path))  # the script puts the checkout's root first; undone after
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(script), run_name="__main__")
    text = " ".join(out.getvalue().split())
    assert exit_.value.code in (0, None), text
    assert text.startswith("usage:") and f"benchmarks/{script.parent.name}/run.py" in text, text[:300]
    assert "source checkout" in text and "installs no benchmark code" in text, text[-600:]
