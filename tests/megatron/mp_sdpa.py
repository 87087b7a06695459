"""Worker bodies for test_sdpa.py: SdpaDotProductAttention vs Megatron's DotProductAttention at TP=world
(each rank holds its np/tp heads and ng/tp groups), on the same q, k, v and output gradient."""
from __future__ import annotations

import contextlib
import logging

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_flashoverlap.megatron import models as tm

SQ, B = 16, 2


def _config(heads=4, groups=None, kv=8, dropout=0.0):
    from megatron.core.transformer import TransformerConfig

    return TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=heads, num_query_groups=groups,
                             kv_channels=kv, attention_dropout=dropout, use_cpu_initialization=True,
                             params_dtype=torch.float32, tensor_model_parallel_size=torch.distributed.get_world_size())


def _pair(cfg, mask_type, softmax_scale=None, kernels=None, layer_number=1):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_flashoverlap.megatron.sdpa import SdpaDotProductAttention

    kw = dict(layer_number=layer_number, attn_mask_type=mask_type, attention_type="self", softmax_scale=softmax_scale)
    return DotProductAttention(cfg, **kw), SdpaDotProductAttention(cfg, **kw, kernels=kernels)


def _qkv(cfg, rank, sq=SQ):
    """q [sq, b, np/tp, hn], k / v [sq, b, ng/tp, hn], this rank's heads (seeded per rank)."""
    tp = torch.distributed.get_world_size()
    g = torch.Generator().manual_seed(10 + rank)
    groups = cfg.num_query_groups // tp
    q = torch.randn(sq, B, cfg.num_attention_heads // tp, cfg.kv_channels, generator=g)
    k, v = (torch.randn(sq, B, groups, cfg.kv_channels, generator=g) for _ in range(2))
    return q, k, v


def _mask(kind):
    """Megatron's bool masks, True = masked out: causal [1,1,s,s]; padding [b,1,1,s] (sample 1: last 5 keys
    padded); causal+left-padding [b,1,s,s] (sample 1's first 3 query rows see no key at all)."""
    causal = torch.triu(torch.ones(1, 1, SQ, SQ, dtype=torch.bool), 1)
    pad = torch.zeros(B, 1, 1, SQ, dtype=torch.bool)
    pad[1, ..., SQ - 5:] = True
    if kind == "causal":
        return causal
    if kind == "padding":
        return pad
    left = torch.zeros(B, 1, 1, SQ, dtype=torch.bool)
    left[1, ..., :3] = True
    return causal | left


def _run(module, q, k, v, mask, dy, **kw):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    y = module(q, k, v, mask, **kw)
    y.backward(dy)
    return [y.detach(), q.grad, k.grad, v.grad]


def _rel(a, b) -> float:
    scale = a.double().abs().max().item()
    return (a.double() - b.double()).abs().max().item() / scale


def versus_dpa(rank, world, mask=None, mask_type="causal", groups=None, softmax_scale=None, train=False,
               kernels=None, layer_scaling=False):
    """-> max relative difference of (y, dq, dk, dv) between DotProductAttention and ours."""
    from megatron.core.transformer.enums import AttnMaskType

    tm.init_tp(world)
    try:
        cfg = _config(groups=groups)
        cfg.apply_query_key_layer_scaling = layer_scaling  # set after __post_init__ (it wants fp16 there)
        # layer 3: with layer scaling DotProductAttention divides the scale by 3 and multiplies it back
        dpa, ours = _pair(cfg, getattr(AttnMaskType, mask_type), softmax_scale, kernels, 3 if layer_scaling else 1)
        dpa.train(train), ours.train(train)
        q, k, v = _qkv(cfg, rank)
        dy = torch.randn(SQ, B, q.shape[2] * q.shape[3], generator=torch.Generator().manual_seed(99))
        m = None if mask is None else _mask(mask)
        ref, got = _run(dpa, q, k, v, m, dy), _run(ours, q, k, v, m, dy)
        return {"rel": [_rel(a, b) for a, b in zip(ref, got)], "shape": list(got[0].shape),
                "finite": all(torch.isfinite(t).all().item() for t in got)}
    finally:
        tm.destroy()


def _one_hot_probe(module, sk, seed):
    """q = k = 0 -> every prob 1/sk; v[j] = e_j -> y[i, j] = keep_ij / (sk (1 - p)): the dropout mask, read."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    heads = module.config.num_attention_heads // torch.distributed.get_world_size()
    q = torch.zeros(sk, B, heads, sk)
    v = torch.eye(sk).view(sk, 1, 1, sk).expand(sk, B, heads, sk).contiguous()
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    return module(q, q.clone(), v, None)


def dropout_stats(rank, world, p=0.3, sk=64):
    """Dropout of ours and DotProductAttention's on the one-hot probe: zero fraction, kept value, repeats."""
    from megatron.core.transformer.enums import AttnMaskType

    tm.init_tp(world)
    try:
        cfg = _config(heads=4, kv=sk, dropout=p)
        out = {}
        for name, module in zip(("dpa", "ours"), _pair(cfg, AttnMaskType.no_mask)):
            module.train()
            y1, y2, y3 = (_one_hot_probe(module, sk, s) for s in (5, 5, 6))
            kept = y1[y1 != 0]
            out[name] = {"zero_fraction": (y1 == 0).double().mean().item(), "n": y1.numel(),
                         "kept_min": kept.min().item(), "kept_max": kept.max().item(),
                         "same_seed_equal": torch.equal(y1, y2), "other_seed_differs": not torch.equal(y1, y3)}
        return out
    finally:
        tm.destroy()


def unsupported(rank, world):
    """-> the ValueError messages of what ours refuses (forward-time ones on a built module)."""
    from megatron.core.transformer.enums import AttnMaskType

    tm.init_tp(world)
    try:
        cfg = _config()
        _, ours = _pair(cfg, AttnMaskType.causal)
        q, k, v = _qkv(cfg, rank)
        no_kernel = RuntimeError("No viable backend for scaled_dot_product_attention was found.")
        calls = {"bias": lambda: ours(q, k, v, None, attention_bias=torch.zeros(1)),
                 "packed": lambda: ours(q, k, v, None, packed_seq_params=object()),
                 "float_mask": lambda: ours(q, k, v, torch.zeros(1, 1, SQ, SQ)),
                 "causal_sq_ne_sk": lambda: ours(q[:4], k, v, None),
                 "no_kernel_on_cuda": lambda: ours._no_kernel_here(torch.device("cuda", 0), no_kernel)}
        out = {}
        for name, call in calls.items():
            try:
                call()
                out[name] = None
            except ValueError as err:
                out[name] = str(err)
        return out
    finally:
        tm.destroy()


@contextlib.contextmanager
def warnings_logged(name: str = "megatron_flashoverlap"):
    """-> the list the warning lines logged under `name` go to while the block runs; the log-once memory of
    megatron/sdpa.py starts empty (a pool worker may have logged the same line for an earlier job)."""
    from megatron_flashoverlap.megatron import sdpa

    getattr(sdpa, "_LOGGED", set()).clear()  # getattr: the same body runs against older code (revert checks)
    lines, handler = [], logging.Handler(logging.WARNING)
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger(name).addHandler(handler)
    try:
        yield lines
    finally:
        logging.getLogger(name).removeHandler(handler)


class _Kernels(TorchDispatchMode):
    """The SDPA kernels (aten ops named *scaled_dot_product*) that reach the dispatcher while active; the
    math kernel decomposes into matmul / softmax, so it shows as no such op."""

    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "scaled_dot_product" in func.__name__:
            self.names.add(func.__name__.split(".")[0])
        return func(*args, **(kwargs or {}))


def cpu_fallback(rank, world, kernels=("efficient", "cudnn"), dropout=0.0, calls=3):
    """Ours with `kernels` (what --attention-backend selects) on CPU, `calls` forward + backward passes, vs
    ours with the math kernel on the same inputs and seeds -> {equal per call, SDPA kernels ours ran, log lines}."""
    from megatron.core.transformer.enums import AttnMaskType

    tm.init_tp(world)
    try:
        cfg = _config(dropout=dropout)
        _, ours = _pair(cfg, AttnMaskType.causal, kernels=kernels)
        _, math = _pair(cfg, AttnMaskType.causal, kernels=("math",))
        q, k, v = _qkv(cfg, rank)
        dy = torch.randn(SQ, B, q.shape[2] * q.shape[3], generator=torch.Generator().manual_seed(99))
        ran = _Kernels()
        with warnings_logged() as logged:
            equal = [_same_as_math(ours, math, (q, k, v, dy), call, dropout, ran) for call in range(calls)]
        return {"equal": equal, "ran": sorted(ran.names), "logged": logged}
    finally:
        tm.destroy()


def _same_as_math(ours, math, qkv_dy, call, dropout, ran) -> bool:
    """One forward + backward of each from the same seeds (odd calls with an explicit causal mask)."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    got = []
    for module in (ours, math):
        module.train(dropout > 0)
        torch.manual_seed(call)
        model_parallel_cuda_manual_seed(call)
        with ran if module is ours else contextlib.nullcontext():
            got.append(_run(module, *qkv_dy[:3], _mask("causal") if call % 2 else None, qkv_dy[3]))
    return all(torch.equal(a, b) for a, b in zip(*got))


def falls_back_to_megatron(rank, world, **config_kw):
    """What SdpaDotProductAttention builds for a config it does not implement -> (class name, log lines)."""
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_flashoverlap.megatron.sdpa import SdpaDotProductAttention

    tm.init_tp(world)
    try:
        cfg = _config()
        for key, value in config_kw.items():
            setattr(cfg, key, value)
        with warnings_logged() as logged:
            built = [SdpaDotProductAttention(cfg, 1, AttnMaskType.causal, "self", kernels=("flash",)) for _ in "ab"]
        return {"classes": [type(m).__name__ for m in built], "logged": logged}
    finally:
        tm.destroy()


def _reference(q, k, v, mask, scale):
    """fp64 softmax(scale q k^T + mask) v on [sq, b, n, hn] inputs (k, v with as many heads as q)."""
    qd, kd, vd = (t.double().permute(1, 2, 0, 3) for t in (q, k, v))  # [s, b, n, hn] -> [b, n, s, hn]
    scores = (qd @ kd.transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    ctx = torch.softmax(scores, dim=-1) @ vd
    return ctx.permute(2, 0, 1, 3).reshape(q.shape[0], q.shape[1], -1)  # [b, n, s, hn] -> [s, b, n*hn]


def half_precision_error(rank, world, dtype="bfloat16", mask="causal"):
    """Forward ctx of DotProductAttention and ours in a 16-bit dtype vs an fp64 reference: max |err| / max |ref|
    for each, and between the two."""
    from megatron.core.transformer.enums import AttnMaskType

    tm.init_tp(world)
    try:
        cfg = _config()
        dt = getattr(torch, dtype)
        cfg.params_dtype, cfg.bf16, cfg.fp16 = dt, dt == torch.bfloat16, dt == torch.float16
        dpa, ours = _pair(cfg, AttnMaskType.causal)
        q, k, v = (t.to(dt) for t in _qkv(cfg, rank))
        m = _mask(mask)
        ref = _reference(q, k, v, m, 1.0 / cfg.kv_channels ** 0.5)
        got = {name: mod(q, k, v, m) for name, mod in (("dpa", dpa), ("ours", ours))}
        return {**{name: _rel(ref, y) for name, y in got.items()}, "between": _rel(got["dpa"], got["ours"]),
                "eps": torch.finfo(dt).eps}
    finally:
        tm.destroy()
