"""CPU/gloo shims for Megatron-Core's optimizers (DistributedOptimizer, clip_grads), tests and benchmarks only.

`megatron_flashoverlap.megatron.cpu.enable()` makes the model side run on CPU; the optimizer side hard-codes CUDA in
two more ways, which `enable_cpu_optimizer()` replaces (checked on megatron-core 0.16.1 and 0.19.2):

    1. `device='cuda'` literals in `torch.tensor/zeros/...` calls (found_inf, overflow buffers, the loss
       scale, the grad-norm all-reduce in clip_grads, the local multi-tensor l2 norm in utils)
                                                        -> those four modules see a `torch` whose tensor
       factories map device "cuda" to "cpu"; nothing else about `torch` changes for them or anyone else
    2. `param.type() == 'torch.cuda.FloatTensor'` checks while the DistributedOptimizer sorts params into
       fp32 / fp16 groups, and in `clip_grad_by_total_norm_fp32`
                                                        -> during those two calls only, a CPU tensor's
                                                           `type()` reports the CUDA type name of its dtype

    3. `torch.cuda.current_stream()` at the top of 0.19's `_ParamAndGradBucketGroup.start_grad_sync` (it
       waits on CUDA-graph events)                      -> param_and_grad_buffer sees a `torch.cuda` whose
                                                           current/default stream is a no-op stream

Never applied when CUDA is available (returns False and changes nothing).
"""
from __future__ import annotations

import functools
import types

import torch

_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "zeros_like", "empty_like", "ones_like")
_ENABLED = False


def _cpu_device(kwargs: dict) -> dict:
    dev = kwargs.get("device")
    if dev is not None and str(dev).startswith("cuda"):
        kwargs["device"] = "cpu"
    return kwargs


class _NullStream:
    """The CPU has one implicit stream: waiting on it or on its events is a no-op."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass


def _cpu_torch() -> types.ModuleType:
    """A stand-in for the `torch` module whose tensor factories put "cuda" tensors on the CPU."""
    proxy = types.ModuleType("torch_cpu_factories")
    proxy.__dict__.update(torch.__dict__)
    cuda = types.ModuleType("torch_cpu_cuda")
    cuda.__dict__.update(torch.cuda.__dict__)
    cuda.current_stream = cuda.default_stream = lambda *a, **k: _NullStream()
    proxy.cuda = cuda
    for name in _FACTORIES:
        fn = getattr(torch, name)
        setattr(proxy, name, functools.wraps(fn)(lambda *a, _fn=fn, **k: _fn(*a, **_cpu_device(k))))
    return proxy


def _cuda_type_names(fn):
    """Wrap `fn`: while it runs, a CPU tensor's type() says torch.cuda.<Type>."""
    if getattr(fn, "_flashoverlap_cpu", False):
        return fn

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        original = torch.Tensor.type

        def type_(t, *a, **k):
            name = original(t, *a, **k)
            if a or k or t.device.type != "cpu":
                return name
            return name.replace("torch.", "torch.cuda.", 1)

        torch.Tensor.type = type_
        try:
            return fn(*args, **kwargs)
        finally:
            torch.Tensor.type = original
    wrapped._flashoverlap_cpu = True
    return wrapped


def enable_cpu_optimizer() -> bool:
    """Install the optimizer shims (idempotent); False, untouched, when CUDA is available."""
    global _ENABLED
    if _ENABLED:
        return True
    if torch.cuda.is_available():
        return False
    from megatron.core import utils
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    proxy = _cpu_torch()
    for mod in (clip_grads, distrib_optimizer, optimizer, utils, param_and_grad_buffer):
        mod.torch = proxy
    cls = distrib_optimizer.DistributedOptimizer
    cls.__init__ = _cuda_type_names(cls.__init__)
    clip = _cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)
    clip_grads.clip_grad_by_total_norm_fp32 = optimizer.clip_grad_by_total_norm_fp32 = clip
    _ENABLED = True
    return True
