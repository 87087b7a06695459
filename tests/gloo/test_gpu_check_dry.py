"""Tier 2 (subprocess, fake process groups): benchmarks/gpu_check/run.py --dry runs on CPU, says it is a dry
run, exits 0 and writes every section of gpu.md (here to a temporary path); its operator table
(every public operator and the Flash layer at P = 2, 4, 8, three algos) has the expected shapes and dtypes."""
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_dry_run_writes_every_section(tmp_path):
    out = tmp_path / "gpu.md"
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check" / "run.py"), "--dry", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "DRY RUN" in proc.stdout
    md = out.read_text()
    for part in "abcdef":
        assert f"## ({part})" in md, part
    assert "102 calls, 0 with a wrong shape/dtype or a host sync." in md  # 90 + the 4 FP8 TP operators x 3 algos at P = 2
    assert md.count("Skipped: dry run") == 5
    assert (tmp_path / "gpu.json").exists()
