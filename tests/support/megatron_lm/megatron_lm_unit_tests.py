"""A pytest plugin that runs Megatron-LM's own unit tests on CPU over gloo, with stock layers or ours (a manual
check: CI has no Megatron-LM checkout). From a Megatron-LM core_v0.19.0 checkout:

    cd Megatron-LM      # its own `tests` package must stay importable: this module goes on PYTHONPATH by its own folder
    PYTHONPATH=/path/to/megatron-flashoverlap:/path/to/megatron-flashoverlap/tests/support/megatron_lm OMP_NUM_THREADS=1 \
    [FLASH=1] python -m torch.distributed.run --standalone --nproc-per-node 2 -m pytest \
        -p megatron_lm_unit_tests -p no:cacheprovider -q \
        "tests/unit_tests/inference/text_generation_controllers/test_text_generation_controller.py::\
TestTextGenerationController::test_zero_tokens_generated_batch_vs_single"

What it changes, and nothing else:
    - `cpu.enable()` (the launcher's --cpu shims); Megatron's `Utils` asks for NCCL -> gloo, and one device
    - the test file's one Transformer Engine import (`check_fp8_support`, its FP8 cases only) -> "not supported";
      every Megatron module that file imports is imported first, so none of them sees that stand-in
    - FLASH=1: the test module's `get_gpt_layer_local_spec` -> our `get_gpt_layer_flashoverlap_spec` with the
      config's `attention_backend` (BACKEND, default local, as the test's TransformerConfig sets)
"""
import importlib
import os
import sys
import types

import torch

from megatron_flashoverlap.megatron import cpu

IMPORTED_BY_THE_TEST = (
    "megatron.core.inference.config", "megatron.core.inference.contexts", "megatron.core.inference.inference_request",
    "megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper",
    "megatron.core.inference.sampling_params",
    "megatron.core.inference.text_generation_controllers.text_generation_controller",
    "megatron.core.inference.utils", "megatron.core.models.gpt.gpt_layer_specs", "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.hybrid.hybrid_layer_specs", "megatron.core.models.hybrid.hybrid_model",
    "megatron.core.tensor_parallel.random", "megatron.core.transformer.enums", "megatron.core.transformer.module",
    "megatron.core.transformer.transformer_config", "megatron.core.utils", "megatron.training.initialize",
    "megatron_flashoverlap.megatron.spec")


def _no_fp8_transformer_engine() -> None:
    te = types.ModuleType("transformer_engine")
    te.pytorch = types.ModuleType("transformer_engine.pytorch")
    te.pytorch.fp8 = types.ModuleType("transformer_engine.pytorch.fp8")
    te.pytorch.fp8.check_fp8_support = lambda: (False, "no FP8 on CPU")
    sys.modules.update({"transformer_engine": te, "transformer_engine.pytorch": te.pytorch,
                        "transformer_engine.pytorch.fp8": te.pytorch.fp8})


def _gloo_for_nccl() -> None:
    init = torch.distributed.init_process_group

    def init_process_group(*args, **kwargs):
        if kwargs.get("backend") == "nccl":
            kwargs["backend"] = "gloo"
        return init(*args, **kwargs)

    torch.distributed.init_process_group = init_process_group
    torch.cuda.device_count = lambda: 1  # Utils.initialize_distributed: set_device(rank % device_count())


def pytest_configure(config):
    cpu.enable()
    for name in IMPORTED_BY_THE_TEST:
        importlib.import_module(name)
    _no_fp8_transformer_engine()
    _gloo_for_nccl()


def pytest_collection_modifyitems(session, config, items):
    if os.environ.get("FLASH") != "1":
        return
    from megatron_flashoverlap.megatron.spec import get_gpt_layer_flashoverlap_spec

    backend = os.environ.get("BACKEND", "local")
    for item in items:
        if hasattr(item.module, "get_gpt_layer_local_spec"):
            item.module.get_gpt_layer_local_spec = lambda *a, **k: get_gpt_layer_flashoverlap_spec(
                *a, attention_backend=backend, **k)
