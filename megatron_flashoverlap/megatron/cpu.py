"""Run Megatron (megatron-core 0.16.x - 0.19.x, and Megatron-LM's training loop) on CPU over gloo: `enable()`.

One call, in every process, before any Megatron module is built (tests, examples, benchmarks, and the
launcher's `--cpu`). Each shim replaces one CUDA-only call, and says which:

    model         1. current device     `torch.cuda.current_device()` feeds `device=` of buffers  -> "cpu"
                  2. RNG tracker        CudaRNGStatesTracker reads/writes the CUDA generator      -> the CPU one
                  3. norm + SP          WrappedTorchNorm asserts `not sequence_parallel`          -> build it,
                                        tag its params `sequence_parallel` (as apex's FusedLayerNorm does)
    every module  4. device "cuda"      `device="cuda"` factories (causal mask, optimizer found_inf / loss
                                        scale / grad norm, the schedules' token count, the rerun machine,
                                        the training loop's flags), `Tensor.cuda()` / `.to("cuda")` (the
                                        batch, `Module.cuda`), `pin_memory` (the CP RoPE index)
                                        -> a global TorchFunctionMode puts them on the CPU
    optimizer     5. type names         `param.type() == 'torch.cuda.FloatTensor'` in DistributedOptimizer's
                                        param sort and clip_grad_by_total_norm_fp32 -> during those calls only,
                                        a CPU tensor's `type()` says torch.cuda.<Type>
                 11. --bf16 / --fp16    Float16OptimizerWithFloat16Params (no --use-distributed-optimizer)
                                        sorts params by `param.type()` in torch.cuda.{Half,BFloat16,Float}
                                        Tensor and raises on anything else -> as 5., during its __init__
    streams       6. torch.cuda         synchronize (timers), Stream / stream / current_stream (the DDP side
                                        stream, 0.19's start_grad_sync), empty_cache, memory stats (the
                                        training log)                                             -> no-ops
    MoE           9. alltoall dispatcher  the split sizes' host copy: `maybe_move_tensor_to_cpu(as_numpy=True)`
                                        converts CUDA tensors only (CPU splits reach all_to_all_single as
                                        tensors: TypeError) -> CPU tensors become numpy too; the side
                                        stream's `record_event()` -> the null stream (6.); expert-TP's
                                        uneven all-gather (gloo wants equal sizes) -> pad, gather, cut
    training      7. initialize         `assert torch.cuda.is_available()`, and `device_count() == 0` skips
                                        model-parallel init and seeding silently -> initialize sees 1 device
                  8. arch version       validate_args reads the GPU's major version (TP > 1)      -> 0 (not
                                        Blackwell: CUDA_DEVICE_MAX_CONNECTIONS=1 is then required, and set)
                 10. JIT warm-up        pretrain()'s set_jit_fusion_options -> _warmup_jit_function compiles
                                        the fused bias-GeLU / bias-dropout-add kernels (torch.compile: a C++
                                        build of ~10 s per process on CPU) that a CPU run never calls (the
                                        CPU defaults turn the fusions off), drawing its inputs on the CUDA
                                        generator on a GPU (on CPU they would advance the CPU generator, which
                                        initialises the non-TP parameters) -> skipped: nothing is compiled and
                                        the CPU generator is untouched, as a GPU run leaves it
    inference    12. events, counters   torch.cuda.Event (the controller's step timing), reset_peak_memory_stats,
                                        torch.cuda.LongTensor (offline_inference.py's clock) -> host clock,
                                        no-op, torch.LongTensor; the paged K/V append's triton kernel -> Megatron's
                                        own torch path
                 13. flash-attn         the dynamic engine's attention calls flash-attn 2 (varlen, kvcache:
                                        CUDA) -> the same two functions in torch (cpu_flash_attn.py)

Never applied when CUDA is available: `enable()` then changes nothing and returns False (GPU runs use
Megatron untouched). Outside 0.16.x - 0.19.x it raises, naming the supported versions. megatron-core 0.19
imports `triton` at import time; the lanes install the real wheel (checked, with the fix, by `enable`).
"""
from __future__ import annotations

import collections
import copy
import functools
import logging
import os
import time
import types

import torch
from torch.overrides import TorchFunctionMode

log = logging.getLogger(__name__)
SUPPORTED = ((0, 16), (0, 17), (0, 18), (0, 19))
_ENABLED = False


def is_enabled() -> bool:
    """True once `enable()` has installed the CPU shims in this process."""
    return _ENABLED


def enable(*, relax_norm: bool = True) -> bool:
    """Install every CPU shim (idempotent); True if active, False (untouched) when CUDA is available.

    relax_norm=False leaves Megatron's WrappedTorchNorm as a GPU run sees it (asserting under SP without apex):
    the tests that prove our spec's own norm builds there use it."""
    global _ENABLED
    if _ENABLED:
        return True
    if torch.cuda.is_available():
        log.warning("megatron_flashoverlap.megatron.cpu.enable(): CUDA is available, Megatron left untouched (GPU path)")
        return False
    check_version(_megatron_version())
    for shim in (_shim_current_device, _shim_rng_tracker, _shim_torch_norm, _shim_cuda_devices,
                 _shim_type_names, _shim_cuda_runtime, _shim_moe, _shim_training, _shim_warmup,
                 _shim_float16_optimizer, _shim_inference):
        if relax_norm or shim is not _shim_torch_norm:
            shim()
    _ENABLED = True
    return True


def _megatron_version() -> str:
    """megatron-core's version; megatron-core 0.19 does `import triton`: say the fix, not a bare ImportError."""
    try:
        from megatron.core.package_info import __version__
    except ModuleNotFoundError as err:
        if err.name == "triton":
            raise ModuleNotFoundError(
                "megatron-core >= 0.17 imports triton at import time: `pip install triton` "
                "(the CUDA torch wheel brings it), or use megatron-core 0.16.x on CPU torch") from err
        raise
    return __version__


def check_version(version: str) -> None:
    """ValueError unless `version` (e.g. "0.19.2+abc") is one the shims were checked against."""
    try:
        major_minor = tuple(int(p) for p in version.split("+")[0].split(".")[:2])
    except ValueError:
        major_minor = ()
    if major_minor not in SUPPORTED:
        names = ", ".join(f"{a}.{b}.x" for a, b in SUPPORTED)
        raise ValueError(f"megatron_flashoverlap's CPU shims support megatron-core {names}; found {version}. "
                         f"Install a supported megatron-core (pip install 'megatron-core>=0.16.1,<0.20') or run "
                         f"on a GPU (no shims)")


# ------------------------------------------------------------------------------------------- model
def _shim_current_device() -> None:
    # 1. torch.cuda.current_device() -> int raises without a GPU; Megatron passes it as `device=` to
    # torch.empty in GlobalMemoryBuffer.get_tensor, mappings' gather/reduce-scatter and the SP backward.
    torch.cuda.current_device = lambda: "cpu"


def _shim_rng_tracker() -> None:
    # 2. the CUDA default generator behind Megatron's RNG tracker (model_parallel_cuda_manual_seed,
    # CudaRNGStatesTracker.add/fork: dropout, init under fork()). On CPU it is the CPU generator.
    from megatron.core.tensor_parallel import random as mrandom

    mrandom._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()  # the tracker's add(), the rerun machine
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)


def _shim_torch_norm() -> None:
    # 3. WrappedTorchNorm's `assert not config.sequence_parallel` (the local spec picks it without apex). The
    # math is the same under SP; what SP needs is the `sequence_parallel` tag on its params, so
    # finalize_model_grads all-reduces their grads over TP.
    from megatron.core.transformer import torch_norm

    cls = torch_norm.WrappedTorchNorm
    original = cls.__new__

    def new(klass, config, hidden_size, eps=1e-5, *args, **kwargs):
        plain = copy.copy(config)
        plain.sequence_parallel = False
        module = original(klass, plain, hidden_size, eps, *args, **kwargs)
        for p in module.parameters():
            p.sequence_parallel = config.sequence_parallel
        return module

    cls.__new__ = staticmethod(new)


# ------------------------------------------------------------------------------------ every module
def _is_cuda(device) -> bool:
    return isinstance(device, (str, torch.device)) and str(device).startswith("cuda")


class CudaOnCpu(TorchFunctionMode):
    """4. Every torch call: device "cuda..." -> "cpu", `pin_memory` off, `Tensor.cuda()` / `pin_memory()` -> self.

    A mode instead of per-module proxies: the CUDA literals move between Megatron modules from release to
    release (the DDP side stream, the batch's `.cuda()`), a mode sees them wherever they are."""

    _SELF = (torch.Tensor.cuda, torch.Tensor.pin_memory)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in self._SELF:
            return args[0]
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = "cpu"
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to and len(args) > 1 and _is_cuda(args[1]):
            args = (args[0], "cpu", *args[2:])
        return func(*args, **kwargs)


def _shim_cuda_devices() -> None:
    CudaOnCpu().__enter__()  # pushed for the life of the process (never exited): every thread sees it


def _cuda_type_names(fn):
    """5. Wrap `fn`: while it runs, a CPU tensor's type() says torch.cuda.<Type>."""
    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        original = torch.Tensor.type

        def type_(t, *a, **k):
            name = original(t, *a, **k)
            if a or k or t.device.type != "cpu" or name.startswith("torch.cuda."):  # nested calls: once
                return name
            return name.replace("torch.", "torch.cuda.", 1)

        torch.Tensor.type = type_
        try:
            return fn(*args, **kwargs)
        finally:
            torch.Tensor.type = original
    return wrapped


def _shim_type_names() -> None:
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    cls = distrib_optimizer.DistributedOptimizer
    cls.__init__ = _cuda_type_names(cls.__init__)
    clip = _cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)
    clip_grads.clip_grad_by_total_norm_fp32 = optimizer.clip_grad_by_total_norm_fp32 = clip


def _shim_float16_optimizer() -> None:
    # 11. --bf16 / --fp16 without the distributed optimizer: Megatron's Float16 wrapper (fp32 main params).
    from megatron.core.optimizer import optimizer

    cls = optimizer.Float16OptimizerWithFloat16Params
    if not getattr(cls.__init__, "_cuda_type_names", False):
        cls.__init__ = _cuda_type_names(cls.__init__)
        cls.__init__._cuda_type_names = True


# ------------------------------------------------------------------------------- streams, training
class _NullStream:
    """The CPU has one implicit stream: waiting on it or on its events is a no-op; `with` it does nothing."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def record_event(self, event=None):
        return self  # an event that is already complete: synchronize() / wait() do nothing

    def wait(self, stream=None) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass


def _returning(value):
    """A new function per attribute (torch._dynamo keys its rules by function object: no sharing)."""
    return lambda *args, **kwargs: value() if callable(value) else value


def _shim_cuda_runtime() -> None:
    # 6. torch.cuda calls that raise without a driver and mean nothing on one CPU "device".
    cuda = torch.cuda
    for name in ("synchronize", "empty_cache", "set_device", "set_stream"):
        setattr(cuda, name, _returning(None))
    for name in ("current_stream", "default_stream", "stream"):
        setattr(cuda, name, _returning(_NullStream))
    cuda.Stream = _NullStream
    for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved"):
        setattr(cuda, name, _returning(0))
    cuda.memory_stats = _returning(lambda: collections.defaultdict(int))  # every counter 0 (offline_inference.py's peak)


def _shim_moe() -> None:
    # 9. the MoE alltoall dispatcher's CPU-blind split-size copy and expert-TP's uneven all-gather.
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    to_cpu = moe_utils.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if as_numpy and torch.is_tensor(tensor) and tensor.device.type == "cpu":
            return tensor.numpy()
        return to_cpu(tensor, as_numpy=as_numpy, record_stream=record_stream)

    moe_utils.maybe_move_tensor_to_cpu = token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    mappings._gather_along_first_dim = _padded_gather(mappings._gather_along_first_dim)


def _padded_gather(gather):
    """gather(x [n_r, ...], group, output_split_sizes) with unequal sizes as gloo can: pad every x to
    max(n), all-gather equal blocks [P * max(n), ...], keep the first n_r rows of block r."""
    @functools.wraps(gather)
    def padded(input_, group, output_split_sizes=None, use_global_buffer=False):
        sizes = None if output_split_sizes is None else [int(n) for n in output_split_sizes]
        if sizes is None or len(set(sizes)) <= 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        most = max(sizes)
        pad = input_.new_zeros((most,) + tuple(input_.shape[1:]))
        pad[:input_.shape[0]].copy_(input_)
        blocks = gather(pad, group, None, False).split(most)  # P blocks [max(n), ...]
        return torch.cat([b[:n] for b, n in zip(blocks, sizes)])
    return padded


def _shim_training() -> None:
    # 7 + 8: Megatron-LM's training package (a checkout's, or the megatron-core >= 0.17 wheel's); absent in
    # the 0.16.x wheel, where there is nothing to shim.
    try:
        from megatron.training import arguments, initialize
    except ModuleNotFoundError as err:
        if not (err.name or "").startswith("megatron"):
            raise
        return
    proxy = types.ModuleType("torch_one_cpu_device")
    proxy.__dict__.update(torch.__dict__)
    proxy.cuda = types.ModuleType("torch_cuda_one_cpu_device")
    proxy.cuda.__dict__.update(torch.cuda.__dict__)
    proxy.cuda.is_available = lambda: True
    proxy.cuda.device_count = lambda: 1
    initialize.torch = proxy
    if hasattr(arguments, "get_device_arch_version"):
        arguments.get_device_arch_version = lambda: 0
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")


def _shim_warmup() -> None:
    # 10. the JIT warm-up is skipped: it compiles GPU fusions a CPU run never calls, and its draws would advance
    #     the CPU generator a GPU run leaves untouched.
    try:
        from megatron.training import initialize
    except ModuleNotFoundError as err:
        if not (err.name or "").startswith("megatron"):
            raise
        return
    warmup = getattr(initialize, "_warmup_jit_function", None)
    if warmup is None or getattr(warmup, "_cpu_skipped", False):
        return

    @functools.wraps(warmup)
    def warmup_skipped_on_cpu(*args, **kwargs):
        return None

    warmup_skipped_on_cpu._cpu_skipped = True
    initialize._warmup_jit_function = warmup_skipped_on_cpu  # set_jit_fusion_options calls it by global name
# ------------------------------------------------------------------------------------------- inference
class _CpuEvent:
    """12. torch.cuda.Event on the CPU's one stream: `record()` takes the host clock, `elapsed_time` is ms
    between two records (the text-generation controller's step timings), waiting / querying is immediate."""

    def __init__(self, *args, **kwargs):
        self._at = None

    def record(self, stream=None) -> None:
        self._at = time.perf_counter()

    def elapsed_time(self, end: "_CpuEvent") -> float:
        if self._at is None or end._at is None:
            raise RuntimeError("elapsed_time: both events must be recorded first (as on CUDA)")
        return (end._at - self._at) * 1e3

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True


def _shim_inference() -> None:
    # 12. Megatron's inference path (text-generation controller, dynamic engine, offline_inference.py):
    # step timing events and the peak-memory counters it resets and reads.
    torch.cuda.Event = _CpuEvent
    torch.cuda.reset_peak_memory_stats = _returning(None)
    torch.cuda.LongTensor = torch.LongTensor  # examples/inference/utils.get_curr_time's legacy constructor
    from megatron.core.inference.contexts import dynamic_context

    # the paged K/V cache append: Megatron's own torch path instead of its triton kernel (CUDA only)
    dynamic_context.triton_append_key_value_cache = None
    _shim_flash_attn()


def _shim_flash_attn() -> None:
    # 13. the dynamic engine's attention (paged K/V cache) calls flash-attn 2's varlen / kvcache kernels (CUDA
    # only) and asserts flash-attn >= 2.7.3 first -> the same two functions in torch (cpu_flash_attn.py).
    from megatron.core.transformer import attention

    from . import cpu_flash_attn

    if attention.flash_attn_varlen_func is not None:
        return  # a real flash-attn is installed: nothing to stand in for
    attention.flash_attn_varlen_func = cpu_flash_attn.flash_attn_varlen_func
    attention.flash_attn_with_kvcache = cpu_flash_attn.flash_attn_with_kvcache
    attention.is_fa_min_version = lambda version, *args, **kwargs: version == "2.7.3"  # what ours stands in for
