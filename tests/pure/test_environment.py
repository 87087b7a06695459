"""The project's environments run what Megatron-LM's scripts import beyond megatron-core's own requirements.

Tier: pure (imports only, both lanes: the one pure file the oldest lane runs). `pretrain_gpt.py --save` writes through dist_checkpointing's
filesystem_async (imports psutil); Megatron's inference engines import tqdm (and psutil). Both are pinned in
requirements/newest.txt and requirements/oldest.txt; the end-to-end `--save` runs in
tests/megatron/test_pretrain.py (the CP=1 run's checkpoint).
"""
import ast
import importlib
import importlib.metadata
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
LANE = "newest" if sys.version_info >= (3, 12) else "oldest"  # the Makefile's lanes: 3.12 and 3.11


def pins(lane: str) -> dict:
    """requirements/<lane>.txt -> {name: version}."""
    lines = (ln.split("#")[0].strip() for ln in (ROOT / "requirements" / f"{lane}.txt").read_text().splitlines())
    return dict(ln.split("==") for ln in lines if ln)


@pytest.mark.parametrize("name", ["psutil", "tqdm"])
def test_megatron_lms_extra_imports_are_pinned_in_both_lanes_and_installed(name):
    assert name in pins("newest") and pins("newest")[name] == pins("oldest")[name], name
    assert importlib.metadata.version(name) == pins(LANE)[name]


def test_megatrons_checkpoint_writer_finds_psutil():
    """filesystem_async imports psutil under try (HAVE_PSUTIL) and raises at the first save without it."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    assert filesystem_async.HAVE_PSUTIL


def imports_megatron_core(path: pathlib.Path) -> bool:
    """Whether the file has an import statement of megatron (megatron.core, megatron.training), anywhere in it."""
    for node in ast.walk(ast.parse(path.read_text())):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        if any(n == "megatron" or n.startswith("megatron.") for n in names):
            return True
    return False


def oldest_lane_paths() -> list[str]:
    """The Makefile's OLDEST_TESTS: the paths the oldest lane (megatron-core 0.16.1) runs."""
    line = next(ln for ln in (ROOT / "Makefile").read_text().splitlines() if ln.startswith("OLDEST_TESTS :="))
    return line.split(":=", 1)[1].split()


def test_every_pure_file_that_imports_megatron_core_runs_in_the_oldest_lane():
    """The oldest lane runs tests/megatron and only the pure files that import megatron-core: a new one that
    does must be listed there, or the 0.16.1 wheel never sees it."""
    lane = oldest_lane_paths()
    assert "tests/megatron" in lane and "tests/pure" not in lane
    importing = [f"tests/pure/{p.name}" for p in sorted((ROOT / "tests" / "pure").glob("*.py"))
                 if imports_megatron_core(p)]
    assert "tests/pure/test_environment.py" in importing  # the pattern finds this file's own import
    assert [p for p in importing if p not in lane] == []


SERVE = ("pyzmq", "msgpack", "quart", "hypercorn")  # Megatron's HTTP server (tests/megatron/test_serve.py)


@pytest.mark.newest_only
def test_the_serve_extra_is_pinned_as_the_newest_lane_installs_it():
    """pyproject's `serve` extra names requirements/newest.txt's versions, the ones installed here."""
    import tomllib

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["serve"]
    assert sorted(extra) == sorted(f"{name}=={pins('newest')[name]}" for name in SERVE)
    assert all(importlib.metadata.version(name) == pins("newest")[name] for name in SERVE)
