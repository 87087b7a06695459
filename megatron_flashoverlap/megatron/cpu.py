"""Run a real Megatron-Core model on CPU over gloo: `megatron_flashoverlap.megatron.cpu.enable()`.

Megatron-Core (0.16.x - 0.19.x) assumes CUDA in four places that the local (non-TE) spec reaches. Each shim
below replaces exactly one of them, and says what it replaces:

    1. current device    `torch.cuda.current_device()` allocates buffers (SP gather buffer, attention
                         baddbmm buffer, reduce-scatter outputs)                 -> "cpu"
    2. RNG tracker       `CudaRNGStatesTracker` reads/writes the CUDA generator  -> the CPU generator
    3. LayerNorm + SP    `WrappedTorchNorm` asserts `not sequence_parallel`      -> build it, tag params
                         `sequence_parallel` as apex's FusedLayerNorm does
    4. causal mask       `get_default_causal_mask` builds its mask on "cuda"     -> on "cpu"

Rules: one explicit call (tests, examples and benchmarks call it in every process before building
modules), idempotent, and never applied when CUDA is available: then `enable()` changes nothing and
returns False (GPU runs use Megatron untouched). megatron-core 0.19.x imports `triton` at import time;
the `.venv` lane has the real `triton` wheel installed, so no stub is needed here (checked by `enable`).
Call it before `model_parallel_cuda_manual_seed(...)` and before building any module.
"""
from __future__ import annotations

import copy
import logging

import torch

log = logging.getLogger(__name__)
_ENABLED = False


def is_enabled() -> bool:
    """True once `enable()` has installed the CPU shims in this process."""
    return _ENABLED


def enable() -> bool:
    """Install the CPU shims for Megatron-Core; True if active, False (untouched) when CUDA is available."""
    global _ENABLED
    if _ENABLED:
        return True
    if torch.cuda.is_available():
        log.warning("megatron_flashoverlap.megatron.cpu.enable(): CUDA is available, Megatron left untouched (GPU path)")
        return False
    _check_importable()
    _shim_current_device()
    _shim_rng_tracker()
    _shim_torch_norm()
    _shim_causal_mask()
    _ENABLED = True
    return True


def _check_importable() -> None:
    """megatron-core 0.19 does `import triton` at import time; say the fix instead of a bare ImportError."""
    try:
        import megatron.core  # noqa: F401
    except ModuleNotFoundError as err:
        if err.name == "triton":
            raise ModuleNotFoundError(
                "megatron-core >= 0.17 imports triton at import time: `pip install triton` "
                "(the CUDA torch wheel brings it), or use megatron-core 0.16.x on CPU torch") from err
        raise


def _shim_current_device() -> None:
    # Replaces: torch.cuda.current_device() -> int (raises without a GPU). Megatron passes it as `device=`
    # to torch.empty in GlobalMemoryBuffer.get_tensor, mappings._gather/_reduce_scatter_along_first_dim and
    # the SP backward of linear_with_grad_accumulation_and_async_allreduce; "cpu" makes those CPU tensors.
    torch.cuda.current_device = lambda: "cpu"


def _shim_rng_tracker() -> None:
    # Replaces: the CUDA default generator behind Megatron's RNG tracker (model_parallel_cuda_manual_seed,
    # CudaRNGStatesTracker.add/fork, used for dropout and CPU-side init under `get_cuda_rng_tracker().fork()`).
    # On CPU the "CUDA generator" is the CPU generator: same seeds, same fork/restore semantics.
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()  # used directly by the tracker's add()
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)  # model_parallel_cuda_manual_seed


def _shim_torch_norm() -> None:
    # Replaces: WrappedTorchNorm's `assert not config.sequence_parallel` (the local spec picks it when apex is
    # missing). A norm is the same math with SP on; what SP needs is the `sequence_parallel` tag on its params,
    # so finalize_model_grads all-reduces their grads over TP (apex FusedLayerNorm sets the same tag).
    from megatron.core.transformer import torch_norm

    cls = torch_norm.WrappedTorchNorm
    if getattr(cls.__new__, "_flashoverlap_cpu", False):
        return
    original = cls.__new__

    def new(klass, config, hidden_size, eps=1e-5, *args, **kwargs):
        plain = copy.copy(config)
        plain.sequence_parallel = False
        module = original(klass, plain, hidden_size, eps, *args, **kwargs)
        for p in module.parameters():
            p.sequence_parallel = config.sequence_parallel
        return module

    new._flashoverlap_cpu = True
    cls.__new__ = staticmethod(new)


def _causal_mask_cpu(sq: int) -> torch.Tensor:
    """mask [sq, sq] bool, True above the diagonal (masked out), as Megatron's, on CPU."""
    return torch.triu(torch.ones(sq, sq, device="cpu"), diagonal=1).bool()


def _shim_causal_mask() -> None:
    # Replaces: megatron.core.transformer.utils.get_default_causal_mask, which hard-codes device="cuda"
    # (reached by FusedScaleMaskSoftmax when attention_mask is None). fused_softmax imports it by name,
    # so both bindings are replaced.
    from megatron.core.fusions import fused_softmax
    from megatron.core.transformer import utils as tutils

    tutils.get_default_causal_mask = _causal_mask_cpu
    fused_softmax.get_default_causal_mask = _causal_mask_cpu
