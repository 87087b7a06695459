"""What `pip install .` installs: the package alone, no benchmark, harness or test code.

Tier: pure (no ranks; one `pip wheel` subprocess, a few seconds). The wheel is built for real, with the
project's own build backend, from a copy of the checkout (a build writes build/ and *.egg-info beside the
sources; the copy keeps the checkout clean), and its file list is what an install unpacks.
Newest lane only: packaging does not depend on the Megatron version.
"""
import pathlib
import shutil
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PKG = "megatron_flashoverlap"
SKIP = shutil.ignore_patterns(".git", ".venv*", "__pycache__", "*.egg-info", "build", "dist", "out", ".pytest_cache",
                              ".hypothesis")

pytestmark = pytest.mark.newest_only


@pytest.fixture(scope="module")
def wheel_files(tmp_path_factory) -> list[str]:
    src = tmp_path_factory.mktemp("src") / "checkout"
    shutil.copytree(ROOT, src, ignore=SKIP)
    out = tmp_path_factory.mktemp("wheel")
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(out), str(src)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (whl,) = out.glob("*.whl")
    return zipfile.ZipFile(whl).namelist()


def test_the_wheel_holds_the_package_and_its_metadata_only(wheel_files):
    tops = {name.split("/")[0] for name in wheel_files}
    assert {t for t in tops if not t.endswith(".dist-info")} == {PKG}, sorted(tops)


def test_no_benchmark_harness_or_test_module_is_installed(wheel_files):
    rig = [n for n in wheel_files if n.startswith(PKG + "/")
           and n.split("/")[1] in ("bench", "benchmarks", "harness", "testing", "tests")]
    assert not rig, rig
    assert not [n for n in wheel_files if "line_rate_rs" in n or n.endswith("/pool.py")]


def test_what_a_user_runs_is_installed(wheel_files):
    """The all-reduce calibration `algo="auto"` reads is a user's tool: it ships, with its timing loop."""
    for mod in ("tools/calibrate_allreduce.py", "runtime/timing.py", "ops/all_reduce/select.py", "megatron/__init__.py"):
        assert f"{PKG}/{mod}" in wheel_files, mod


def test_the_wings_sub_packages_and_the_scripts_targets_are_installed(wheel_files):
    """megatron/ddp, moe, cli ship as packages, and every [project.scripts] target is a shipped module's def."""
    import ast
    import tomllib
    for sub in ("ddp", "moe", "cli"):
        assert f"{PKG}/megatron/{sub}/__init__.py" in wheel_files, sub
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    for name, target in scripts.items():
        mod, func = target.split(":")
        path = mod.replace(".", "/") + ".py"
        assert path in wheel_files, f"{name} = {target}: {path} is not in the wheel"
        defs = {n.name for n in ast.parse((ROOT / path).read_text()).body if isinstance(n, ast.FunctionDef)}
        assert func in defs, f"{name} = {target}: no def {func} in {path}"


def test_every_top_level_name_resolves():
    # the lazy exports (megatron_flashoverlap/__init__.py) name modules by path: a renamed module would leave a
    # name that raises only when a user reaches for it
    code = ("import megatron_flashoverlap as m; missing = [n for n in m.__all__ if getattr(m, n, None) is None]; "
            "assert not missing, missing; print(len(m.__all__))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.strip().splitlines()[-1]) >= 20
