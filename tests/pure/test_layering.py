"""The package's imports run one way, with no cycle, and only the Megatron wing imports megatron.

Tier: pure (parses the source with `ast`; nothing is imported or run). Floors, bottom up:
    0  config, schedules
    1  runtime, plan       (plan: the planner; it imports no third party: test_plan_published.py)
    2  ops
    3  megatron            (the wing: the only importer of `megatron` in the package), by function, bottom up:
           0  ddp/, moe/       DP on Megatron's DDP; MoE on Megatron's MoELayer
           1  its loose modules (the layers, spec, attention, sdpa, norm, sites, step_kind, models, cpu)
           2  cli/             the flags, the launcher, the pretrain entry
    4  tools               (what a user runs beside training: the all-reduce calibration, the timing loop)
    5  the faces: __init__, spec, launch (re-exports; nothing inside the package imports them)
A module may import its own package and anything on a lower floor; two packages of one floor do not
import each other. The package imports neither benchmarks/ nor tests/ (a source checkout's, never installed);
no example or benchmark imports a test helper; a benchmark folder imports the package, the harness and
itself, never another benchmark's folder, and the harness imports no benchmark folder.
"""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PKG = ROOT / "megatron_flashoverlap"
FLOORS = {"config": 0, "schedules": 0, "runtime": 1, "plan": 1, "ops": 2, "megatron": 3, "tools": 4,
          "__init__": 5, "spec": 5, "launch": 5, "pretrain_gpt": 5, "generate": 5,
          "serve": 5}
WING = "megatron"  # the package's one folder that imports megatron
WING_FLOORS = {"ddp": 0, "moe": 0, "layers": 1, "cli": 2}  # the wing's rooms ("layers": its loose modules)
TEST_HELPERS = ("tests",)
BENCH = ROOT / "benchmarks"


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: pathlib.Path) -> list[tuple[str, int]]:
    """(absolute module name, line) of every import statement in the file, relative ones resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    here = module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
            out.append((base, node.lineno))
            out += [(f"{base}.{a.name}", node.lineno) for a in node.names]  # `from . import mod`
    return out


def package_files() -> list[pathlib.Path]:
    return sorted(p for p in PKG.rglob("*.py") if "__pycache__" not in p.parts)


def _room(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def internal_edges() -> dict[str, set[str]]:
    """module -> the package modules it imports (names that are not modules are dropped)."""
    known = {module_name(p) for p in package_files()}
    edges: dict[str, set[str]] = {}
    for p in package_files():
        mod = module_name(p)
        edges[mod] = {m for m, _ in imports_of(p) if m in known and m != mod}
    return edges


def test_floors_run_one_way():
    bad = []
    for mod, targets in internal_edges().items():
        room = _room(mod)
        for t in targets:
            other = _room(t)
            if other == room:
                continue
            if other not in FLOORS or room not in FLOORS:
                bad.append(f"{mod} -> {t}: a room with no floor (add it to FLOORS)")
            elif FLOORS[other] > FLOORS[room] or (FLOORS[other] == FLOORS[room]):
                bad.append(f"{mod} (floor {FLOORS[room]}) imports {t} (floor {FLOORS[other]})")
    assert not bad, "imports against the floor order:\n" + "\n".join(bad)


def test_no_import_cycle():
    edges = internal_edges()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in sorted(edges.get(m, ())):
            if t.startswith(m + "."):  # a package importing its own submodule is not a cycle
                continue
            if state.get(t) == 1:
                pytest.fail("import cycle: " + " -> ".join(stack[stack.index(t):] + [t]))
            if t not in state:
                visit(t)
        stack.pop()
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m)


def _wing_room(mod: str) -> str:
    """megatron_flashoverlap.megatron.<sub-package>.x -> the sub-package; a loose module (or the wing's
    __init__) -> "layers"."""
    parts = mod.split(".")
    sub = PKG / WING / parts[2] if len(parts) > 2 else None
    return parts[2] if sub is not None and sub.is_dir() else "layers"


def test_the_wing_by_function_runs_one_way():
    """Inside megatron/: ddp/ and moe/ import no other room of the wing, the layers import ddp/ and moe/ but
    not cli/, and nothing in the wing imports cli/ but cli/ itself."""
    rooms = sorted(p.name for p in (PKG / WING).iterdir() if p.is_dir() and p.name != "__pycache__")
    assert rooms == sorted(r for r in WING_FLOORS if r != "layers"), f"a wing sub-package with no floor: {rooms}"
    prefix = f"{PKG.name}.{WING}"
    bad = []
    for mod, targets in internal_edges().items():
        if not mod.startswith(prefix):
            continue
        room = _wing_room(mod)
        for t in targets:
            other = _wing_room(t) if t.startswith(prefix) else None
            if other is None or other == room:
                continue
            if WING_FLOORS[other] >= WING_FLOORS[room]:
                bad.append(f"{mod} ({room}, floor {WING_FLOORS[room]}) imports {t} "
                           f"({other}, floor {WING_FLOORS[other]})")
    assert not bad, "imports against the wing's order:\n" + "\n".join(bad)


def test_only_the_wing_imports_megatron():
    bad = []
    for p in package_files():
        rel = p.relative_to(PKG).as_posix()
        if rel.startswith(WING + "/"):
            continue
        bad += [f"{rel}:{line} imports {m}" for m, line in imports_of(p) if m == "megatron" or m.startswith("megatron.")]
    assert not bad, "megatron imported outside megatron_flashoverlap/megatron/:\n" + "\n".join(bad)


def bench_files() -> list[pathlib.Path]:
    return sorted(p for p in BENCH.rglob("*.py") if "__pycache__" not in p.parts)


def test_the_package_imports_no_benchmark_and_no_test():
    """`pip install .` ships the package alone: an import of benchmarks/ or tests/ would fail there."""
    bad = [f"{p.relative_to(ROOT)}:{line} imports {m}" for p in package_files() for m, line in imports_of(p)
           if m.split(".")[0] in ("benchmarks", "tests")]
    assert not bad, "the package imports a source checkout's folder:\n" + "\n".join(bad)


def test_benchmark_folders_import_the_harness_not_each_other():
    bad = []
    for p in bench_files():
        here = p.relative_to(BENCH).parts[0] if len(p.relative_to(BENCH).parts) > 1 else None
        for m, line in imports_of(p):
            parts = m.split(".")
            if parts[0] != "benchmarks" or len(parts) < 2 or parts[1] in ("harness", here):
                continue
            bad.append(f"{p.relative_to(ROOT)}:{line} imports {m}")
    assert not bad, "a benchmark imports another benchmark's folder (shared code goes to harness/):\n" + "\n".join(bad)


def test_no_test_helper_outside_tests():
    files = package_files() + sorted((ROOT / "examples").glob("*.py")) + bench_files()
    bad = [f"{p.relative_to(ROOT)}:{line} imports {m}" for p in files for m, line in imports_of(p)
           if any(m == h or m.startswith(h + ".") for h in TEST_HELPERS)]
    assert not bad, "test helpers imported outside tests/:\n" + "\n".join(bad)


def test_the_checker_sees_a_violation(tmp_path):
    """The parser resolves relative imports: a floor-1 file importing ops (floor 2) is caught."""
    fake = PKG / "runtime" / "_layering_probe.py"
    assert not fake.exists()
    src = "from ..ops import all_gather_matmul\nfrom . import executor\n"
    tree_mods = []
    fake_path = tmp_path / "megatron_flashoverlap" / "runtime" / "_probe.py"
    fake_path.parent.mkdir(parents=True)
    fake_path.write_text(src)
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        tree_mods = [m for m, _ in imports_of(fake_path)]
    finally:
        ROOT = saved
    assert "megatron_flashoverlap.ops" in tree_mods
    assert "megatron_flashoverlap.runtime.executor" in tree_mods


def test_ops_is_family_folders_and_three_loose_modules():
    """ops/: one folder per operator family; loose modules only what every family shares: __init__, registry,
    checks, choose (the chooser's measured tier)."""
    loose = sorted(p.name for p in (PKG / "ops").glob("*.py"))
    assert loose == ["__init__.py", "checks.py", "choose.py", "registry.py"], loose
    families = sorted(p.name for p in (PKG / "ops").iterdir() if p.is_dir() and p.name != "__pycache__")
    assert families == ["all_reduce", "attention", "dp", "moe", "tp_nosp", "tp_sp"], families


def test_env_vars_are_read_in_the_config_module_only():
    """FLASHOVERLAP_* names appear in config/__init__.py alone (config.environment() reads them)."""
    files = package_files() + bench_files() + sorted((ROOT / "examples").glob("*.py"))
    bad = [p.relative_to(ROOT).as_posix() for p in files
           if "FLASHOVERLAP_" in p.read_text() and p != PKG / "config" / "__init__.py"]
    assert not bad, bad
