"""The FP8 recipe in plain torch, written from its definition (not from the package's code): the reference the
FP8 operator tests compare against (tests/pure/test_fp8_op.py, tests/gloo/mp_fp8.py).

    recipe_cast(t, dtype, margin, amax, scale)
                                          scale = fp8_max / amax / 2^margin in fp32 (amax: t's own unless
                                          given; `scale` given: the delayed recipe's), the saturating cast
                                          (clamp, then cast) -> (fp8, 1 / scale)
    scaled(a, a_inv, b, b_inv, out_dtype, bias)
                                          a [m, k] @ b [n, k]^T by torch's own _scaled_mm, CUDA's layouts
    recipe_forward(x, w, bias, margin)    y [s, b, n] = x [s, b, h] @ w [n, h]^T + bias, x and w cast whole
    recipe_backward(x8, dy, w, world, grad_dtype, margin)
                                          w [n, h] in `world` row shards, dy [s, b, n] in the matching column
                                          shards: dx [s, b, h] (every rank's partial summed in fp64) and each
                                          rank's dw [n/P, h]
    recipe_row(x, w, dy, world, grad_dtype, margin, scales)
                                          row-parallel: x [s, b, k] and w [h, k] in `world` column shards,
                                          each cast from its own amax; dy [s, b, h] cast whole (one scale for
                                          the group): each rank's fp32 partial [s, b, h], dx [s, b, k] and
                                          each rank's dw [h, k/P]; `scales` (x, w, dy): the delayed recipe's
"""
from __future__ import annotations

import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}


def recipe_cast(t, dtype, margin=0, amax=None, scale=None):
    """-> (fp8 tensor, inverse scale): the recipe's cast of t, from its own amax unless an amax or a scale is
    given."""
    if scale is None:
        amax = t.float().abs().max() if amax is None else amax
        scale = torch.tensor(FP8_MAX[dtype]) / amax / 2.0 ** margin
    return (t.float() * scale).clamp(-FP8_MAX[dtype], FP8_MAX[dtype]).to(dtype), torch.reciprocal(scale)


def scaled(a, a_inv, b, b_inv, out_dtype, bias=None):
    """a [m, k] @ b [n, k]^T with CUDA's layouts (a row-major, b^T column-major), torch's own scaled GEMM."""
    return torch._scaled_mm(a.contiguous(), b.contiguous().t(), scale_a=a_inv, scale_b=b_inv, out_dtype=out_dtype,
                            bias=bias)


def recipe_forward(x, w, bias, margin=0):
    """-> (y [s, b, n] in x's dtype, (x cast [s, b, h], its inverse scale))."""
    xq, x_inv = recipe_cast(x, E4M3, margin)
    wq, w_inv = recipe_cast(w, E4M3, margin)
    y = scaled(xq.reshape(-1, x.shape[-1]), x_inv, wq, w_inv, x.dtype, bias)  # [s * b, n]
    return y.view(tuple(x.shape[:-1]) + (-1,)), (xq, x_inv)


def recipe_backward(x8, dy, w, world, grad_dtype, margin=0):
    """-> (dx [s, b, h] fp64, [dw_r [n/P, h] in dy's dtype for each rank r]); x8 = (x cast, inverse scale)."""
    (n, h), dx, dws = w.shape, 0.0, []
    nl = n // world
    for r in range(world):
        dyq, dy_inv = recipe_cast(dy[..., r * nl:(r + 1) * nl], grad_dtype, margin)
        wq, w_inv = recipe_cast(w[r * nl:(r + 1) * nl], E4M3, margin)
        dy2 = dyq.reshape(-1, nl)  # [s * b, n/P]
        dx = dx + scaled(dy2, dy_inv, wq.t(), w_inv, torch.float32).double()
        dws.append(scaled(dy2.t(), dy_inv, x8[0].reshape(-1, h).t(), x8[1], torch.float32).to(dy.dtype))
    return dx.view(tuple(dy.shape[:-1]) + (h,)), dws


def recipe_row(x, w, dy, world, grad_dtype, margin=0, scales=(None, None, None)):
    """-> ([partial_r [s, b, h] fp32 for each rank r], dx [s, b, k] in dy's dtype, [dw_r [h, k/P] in dy's dtype])."""
    (h, k), (s, b) = w.shape, x.shape[:2]
    kl = k // world
    dyq, dy_inv = recipe_cast(dy, grad_dtype, margin, scale=scales[2])  # dy's whole amax: MAX over the shards'
    dy2 = dyq.reshape(-1, h)  # [s * b, h]
    parts, dxs, dws = [], [], []
    for r in range(world):
        xq, x_inv = recipe_cast(x[..., r * kl:(r + 1) * kl], E4M3, margin, scale=scales[0])
        wq, w_inv = recipe_cast(w[:, r * kl:(r + 1) * kl], E4M3, margin, scale=scales[1])
        x2 = xq.reshape(-1, kl)  # [s * b, k/P]
        parts.append(scaled(x2, x_inv, wq, w_inv, torch.float32).view(s, b, h))
        dxs.append(scaled(dy2, dy_inv, wq.t(), w_inv, dy.dtype).view(s, b, kl))
        dws.append(scaled(dy2.t(), dy_inv, x2.t(), x_inv, torch.float32).to(dy.dtype))
    return parts, torch.cat(dxs, dim=-1), dws
