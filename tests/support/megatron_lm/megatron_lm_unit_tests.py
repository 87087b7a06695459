"""A pytest plugin that runs Megatron-LM's own unit tests on CPU over gloo, with stock layers or ours (a manual
check: CI has no Megatron-LM checkout). From a Megatron-LM core_v0.19.0 checkout, one test file at a time:

    cd Megatron-LM      # its own `tests` package must stay importable: this module goes on PYTHONPATH by its own folder
    PYTHONPATH=/path/to/megatron-flashoverlap:/path/to/megatron-flashoverlap/tests/support/megatron_lm OMP_NUM_THREADS=1 \
    [FLASH=1] python -m torch.distributed.run --standalone --nproc-per-node 2 -m pytest \
        -p megatron_lm_unit_tests -p no:cacheprovider -q \
        "tests/unit_tests/inference/text_generation_controllers/test_text_generation_controller.py::\
TestTextGenerationController::test_zero_tokens_generated_batch_vs_single"

What it changes, and nothing else (each the same in both arms, except the last):
    - `cpu.enable()` (the launcher's --cpu shims); Megatron's `Utils` asks for NCCL -> gloo, every process
      group's timeout -> GLOO_TIMEOUT_S (default 180 s: a collective whose ranks part ways raises instead of
      hanging the file), and one device
    - the root conftest's test-data downloader (click, requests, GitHub) -> an ImportError, which it catches
    - flash-attn: `megatron.core.utils.is_fa_min_version("2.7.3")` (the dynamic engine tests' skip condition)
      -> True, as for Megatron's attention under `cpu.enable()`, which stands in flash-attn 2's two functions
      (megatron/cpu_flash_attn.py); any other version asked for -> False
    - Transformer Engine: a test file's `from transformer_engine.pytorch.fp8 import check_fp8_support` (its
      FP8 cases only) -> "not supported". The stand-in exists only while pytest imports that test file, and
      every megatron / tests module the file imports is imported before it, so no Megatron module sees it
    - FLASH=1: the test module's `get_gpt_layer_local_spec` -> our `get_gpt_layer_flashoverlap_spec` with the
      config's `attention_backend` (BACKEND, default local, as the tests' TransformerConfig sets)
"""
import ast
import contextlib
import datetime
import importlib
import os
import sys
import types

import pytest
import torch

from megatron_flashoverlap.megatron import cpu

FLASH_ATTN_STOOD_IN = "2.7.3"  # the version cpu.enable()'s flash-attn stand-in answers for
OWN_PACKAGES = ("megatron", "tests")  # imported before a test file, without the Transformer Engine stand-in


def _no_test_data_download() -> None:
    """Megatron-LM's root conftest imports its test-data downloader (click, requests) and, without /opt/data,
    fetches from GitHub; offline it has nothing to fetch. An ImportError from the stand-in is what that conftest
    already catches ("Failed to import download function"), so no test changes."""
    name = "tests.test_utils.python_scripts.download_unit_tests_dataset"
    stand_in = types.ModuleType(name)

    def download_and_extract_asset(assets_dir):
        raise ImportError(f"offline: no test data downloaded to {assets_dir}")

    stand_in.download_and_extract_asset = download_and_extract_asset
    sys.modules.setdefault(name, stand_in)


def _flash_attn_stood_in() -> None:
    from megatron.core import utils

    utils.is_fa_min_version = lambda version, *args, **kwargs: version == FLASH_ATTN_STOOD_IN


@contextlib.contextmanager
def _no_fp8_transformer_engine():
    """sys.modules has a transformer_engine whose check_fp8_support says no FP8, inside the block only."""
    te = types.ModuleType("transformer_engine")
    te.pytorch = types.ModuleType("transformer_engine.pytorch")
    te.pytorch.fp8 = types.ModuleType("transformer_engine.pytorch.fp8")
    te.pytorch.fp8.check_fp8_support = lambda: (False, "no FP8 on CPU")
    names = {"transformer_engine": te, "transformer_engine.pytorch": te.pytorch,
             "transformer_engine.pytorch.fp8": te.pytorch.fp8}
    if any(name in sys.modules for name in names):
        raise RuntimeError("megatron_lm_unit_tests: a transformer_engine is already imported; this plugin "
                           "is for CPU machines without Transformer Engine")
    sys.modules.update(names)
    try:
        yield
    finally:
        for name in names:
            sys.modules.pop(name, None)


def imported_modules(path) -> list:
    """The megatron.* / tests.* modules a test file imports at its top level or in a top-level try;
    `from a.b import c` gives a.b and a.b.c (a module or not: an attribute fails to import, harmlessly)."""
    tree = ast.parse(open(path, encoding="utf-8").read(), filename=str(path))
    names = []
    for statement in tree.body:
        for node in statement.body if isinstance(statement, ast.Try) else [statement]:
            if isinstance(node, ast.Import):
                names += [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
    return [name for name in names if name.split(".")[0] in OWN_PACKAGES]


def _import_first(path) -> None:
    for name in imported_modules(path):
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # a.b.c is an attribute, or the test file's own import fails the same way: pytest reports it


def _gloo_for_nccl() -> None:
    init, new_group = torch.distributed.init_process_group, torch.distributed.new_group
    timeout = datetime.timedelta(seconds=float(os.environ.get("GLOO_TIMEOUT_S", "180")))

    def init_process_group(*args, **kwargs):
        if kwargs.get("backend") == "nccl":
            kwargs["backend"] = "gloo"
        kwargs["timeout"] = timeout  # a test whose ranks part ways fails, and the file goes on
        return init(*args, **kwargs)

    def new_group_with_timeout(*args, **kwargs):
        if len(args) < 2:  # timeout is new_group's second parameter
            kwargs["timeout"] = timeout
        return new_group(*args, **kwargs)

    torch.distributed.new_group = new_group_with_timeout
    torch.distributed.init_process_group = init_process_group
    torch.cuda.device_count = lambda: 1  # Utils.initialize_distributed: set_device(rank % device_count())


def pytest_load_initial_conftests(early_config, parser, args):
    _no_test_data_download()


def pytest_configure(config):
    cpu.enable()
    _flash_attn_stood_in()
    _gloo_for_nccl()
    if os.environ.get("FLASH") == "1":
        importlib.import_module("megatron_flashoverlap.megatron.spec")


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector):
    if not isinstance(collector, pytest.Module):
        return (yield)
    _import_first(collector.path)
    with _no_fp8_transformer_engine():
        return (yield)


def pytest_collection_modifyitems(session, config, items):
    if os.environ.get("FLASH") != "1":
        return
    from megatron_flashoverlap.megatron.spec import get_gpt_layer_flashoverlap_spec

    backend = os.environ.get("BACKEND", "local")
    for item in items:
        if hasattr(item.module, "get_gpt_layer_local_spec"):
            item.module.get_gpt_layer_local_spec = lambda *a, **k: get_gpt_layer_flashoverlap_spec(
                *a, attention_backend=backend, **k)
