"""The project's environments run what Megatron-LM's scripts import beyond megatron-core's own requirements.

Tier: pure (imports only, both lanes). `pretrain_gpt.py --save` writes through dist_checkpointing's
filesystem_async (imports psutil); Megatron's inference engines import tqdm (and psutil). Both are pinned in
requirements/newest.txt and requirements/oldest.txt; the end-to-end `--save` runs in
tests/megatron/test_pretrain.py (the CP=1 run's checkpoint).
"""
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


SERVE = ("pyzmq", "msgpack", "quart", "hypercorn")  # Megatron's HTTP server (tests/megatron/test_serve.py)


@pytest.mark.newest_only
def test_the_serve_extra_is_pinned_as_the_newest_lane_installs_it():
    """pyproject's `serve` extra names requirements/newest.txt's versions, the ones installed here."""
    import tomllib

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["serve"]
    assert sorted(extra) == sorted(f"{name}=={pins('newest')[name]}" for name in SERVE)
    assert all(importlib.metadata.version(name) == pins("newest")[name] for name in SERVE)
