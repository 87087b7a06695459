"""FP8 GEMM slices: CUDA's rules for torch._scaled_mm, checked on every device, and the one call.

    check_scaled_mm(a, b)       a [m, k] row-major, b [k, n] column-major, k and n multiples of 16, both fp8,
                                not both e5m2: cuBLASLt's FP8 rules, a ValueError naming the fix (the CPU
                                kernel accepts more, so without this a CPU test passes a layout a GPU refuses)
    scaled_mm(a, b, scale_a, scale_b, out_dtype, bias, out)
                                one torch._scaled_mm: out = (a @ b) * scale_a * scale_b (+ bias), accumulated in
                                fp32, written in out_dtype; scale_a, scale_b 0-dim fp32 (the operands' scale_inv)
    column_major(t)             t [k, n] laid out column-major: a transpose copy of the fp8 bytes
    fp8_rows_writer(out, wq, x_scale_inv, bias)
                                write(span, x_rows): out[span] = x_rows [r, b, k] (fp8) @ wq^T, dequantized,
                                (+ bias), straight into out's rows: the GEMM slice of a gather
    fp8_linear(xq, wq, bias)    y [s, b, m] = xq [s, b, k] @ wq^T dequantized (+ bias), in xq.dtype: one GEMM
    transposed(wq)              wq [m, k] as [k, m], row-major: a transpose copy of its bytes (a dgrad's weight)
    scaled_partial(aq, wq)      gemm(rows, out): rows [r, b, k] (fp8, aq's scale) @ wq^T dequantized in fp32
                                (into out): the partial of a reduce-scatter or all-reduce, kept in fp32
    scaled_producer(aq, wq, offset)
                                the Flash-RS Producer of those partials, each written into its fp32 ring slot
                                (runtime/numerics.py partial_producer's FP8 twin)
    wgrad_adder(held, arriving_inv, into, held_is_dy)
                                add(span, rows): into [n, h] += dy[span]^T @ x[span] dequantized, in fp32: the
                                wgrad slice of a gather, one operand held whole, the other arriving
    dw_buffer(wq, into)         where dW is summed: `into`, else fp32 zeros of the weight's shape
    whole_dw(dyq, xq, wq, dw)   the unfused wgrad, one scaled GEMM, routed by dw (a WgradRoute; None: no dW)

A row-major weight w [n, k] is the second operand as it is: w.t() is [k, n] column-major. CUDA's bias epilogue
takes a bias of the output's dtype and no fp32 output with a bias: there the bias is added after the GEMM.
"""
from __future__ import annotations

import math

import torch

from .fp8 import Quantized
from .numerics import flat, wgrad_result
from .options import Producer

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _row_major(t: torch.Tensor) -> bool:
    return t.stride(1) == 1 and t.stride(0) >= max(1, t.shape[1])


def _col_major(t: torch.Tensor) -> bool:
    return t.stride(0) == 1 and t.stride(1) >= max(1, t.shape[0])


def _check_dtypes(a: torch.Tensor, b: torch.Tensor) -> None:
    if a.dtype not in FP8_DTYPES or b.dtype not in FP8_DTYPES:
        raise ValueError(f"scaled_mm: operands are {a.dtype} and {b.dtype}; both must be fp8 ({FP8_DTYPES}): cast "
                         f"them with runtime.fp8.quantize first")
    if a.dtype == b.dtype == torch.float8_e5m2:
        raise ValueError("scaled_mm: e5m2 x e5m2 has no CUDA kernel; cast one operand to e4m3 (format 'hybrid' "
                         "keeps e5m2 for gradients only)")


def check_scaled_mm(a: torch.Tensor, b: torch.Tensor) -> None:
    """ValueError naming the fix unless a [m, k] @ b [k, n] is a GEMM CUDA's _scaled_mm runs (module docstring)."""
    _check_dtypes(a, b)
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"scaled_mm: shapes {tuple(a.shape)} @ {tuple(b.shape)} are not [m, k] @ [k, n]")
    if not _row_major(a):
        raise ValueError(f"scaled_mm: the first operand [m, k] must be row-major (stride[1] == 1), got strides "
                         f"{a.stride()}; pass a contiguous tensor (a.contiguous())")
    if not _col_major(b):
        raise ValueError(f"scaled_mm: the second operand [k, n] must be column-major (stride[0] == 1), got strides "
                         f"{b.stride()}; pass w.t() of a row-major weight w [n, k], or column_major(b)")
    k, n = b.shape
    if k % 16 or n % 16:
        raise ValueError(f"scaled_mm: k = {k} and n = {n} must both be multiples of 16 for CUDA's FP8 GEMM; pad "
                         f"the hidden size and the output features per rank to multiples of 16, or run without FP8")


def column_major(t: torch.Tensor) -> torch.Tensor:
    """t [k, n] with the same values, column-major (a copy unless it already is)."""
    return t if _col_major(t) else t.t().contiguous().t()


def scaled_mm(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor,
              out_dtype: torch.dtype, bias: torch.Tensor | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """a [m, k] @ b [k, n] (fp8, CUDA's layout: checked) * scale_a * scale_b (+ bias [n]) -> [m, n] out_dtype."""
    check_scaled_mm(a, b)
    fused = bias if out_dtype != torch.float32 else None  # CUDA: no bias epilogue with an fp32 output
    kw = {} if out is None else {"out": out}
    y = torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, bias=fused, out_dtype=out_dtype, **kw)
    if bias is not None and fused is None:
        y.add_(bias)
    return y


def fp8_rows_writer(out: torch.Tensor, wq: Quantized, x_scale_inv: torch.Tensor,
                    bias: torch.Tensor | None = None):
    """-> write(span, x_rows): out[span] = x_rows [r, b, k] (fp8) @ wq.data [m, k]^T, dequantized, (+ bias [m])
    for out [s, b, m] (contiguous), written in place, one _scaled_mm per call."""
    per = math.prod(out.shape[1:-1])  # rows of the flattened [s * b, m] per row of s
    o2, wt = out.view(-1, out.shape[-1]), wq.data.t()  # [s * b, m], [k, m] column-major

    def write(span, x_rows: torch.Tensor) -> None:
        x2 = x_rows.reshape(-1, x_rows.shape[-1])  # [r * b, k]
        scaled_mm(x2, wt, x_scale_inv, wq.scale_inv, out.dtype, bias, out=o2[span[0] * per:span[1] * per])
    return write


def fp8_linear(xq: Quantized, wq: Quantized, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y [s, b, m] = xq.data [s, b, k] @ wq.data [m, k]^T dequantized (+ bias [m]), in xq.dtype: one _scaled_mm."""
    y = torch.empty(tuple(xq.data.shape[:-1]) + (wq.data.shape[0],), dtype=xq.dtype, device=xq.data.device)
    fp8_rows_writer(y, wq, xq.scale_inv, bias)((0, y.shape[0]), xq.data)
    return y


def transposed(wq: Quantized) -> Quantized:
    """wq [m, k] as [k, m], row-major: a transpose copy of its bytes, made once per call."""
    return wq._replace(data=wq.data.t().contiguous())


def scaled_partial(aq: Quantized, wq: Quantized):
    """-> gemm(rows [r, b, k] fp8, out [r, b, m] fp32 or None): rows @ wq.data [m, k]^T dequantized (rows in aq's
    scale), in fp32, into `out`. wq.data row-major, so its transpose is the K-major second operand CUDA wants."""
    wt = wq.data.t()  # [k, m], column-major

    def gemm(rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        o2 = None if out is None else out.view(-1, out.shape[-1])
        y = scaled_mm(rows.reshape(-1, rows.shape[-1]), wt, aq.scale_inv, wq.scale_inv, torch.float32, out=o2)
        return y.view(tuple(rows.shape[:-1]) + (wt.shape[1],))  # [r, b, m]
    return gemm


def scaled_producer(aq: Quantized, wq: Quantized, offset: int = 0) -> Producer:
    """The Flash-RS Producer of partials aq.data[offset + rows] @ wq^T, each one scaled GEMM written into its fp32
    ring slot (the sums' acc dtype: fp32 for every activation dtype an FP8 GEMM writes)."""
    gemm = scaled_partial(aq, wq)
    return Producer(lambda span, out: gemm(aq.data[offset + span[0]:offset + span[1]], out), into=True)


F32 = torch.float32


def wgrad_adder(held: Quantized, arriving_inv: torch.Tensor, into: torch.Tensor, held_is_dy: bool = True):
    """-> add(span, rows fp8 [r, b, c]): into [n, h] += dy[span]^T @ x[span] dequantized, in fp32, where `held`
    is dy [s, b, n] (the rows are x's) or x [s, b, h] (held_is_dy=False: the rows are dy's)."""
    held_t = flat(held.data).t().contiguous()  # [c, s * b]: K-major, transposed once per call
    per = math.prod(held.data.shape[1:-1])

    def add(span, rows: torch.Tensor) -> None:
        part = held_t[:, span[0] * per:span[1] * per]  # [c, r * b]: dy^T row-major, or x^T (x column-major)
        if held_is_dy:
            into.add_(scaled_mm(part, column_major(flat(rows)), held.scale_inv, arriving_inv, F32))
        else:
            into.add_(scaled_mm(flat(rows).t().contiguous(), part.t(), arriving_inv, held.scale_inv, F32))
    return add


def dw_buffer(wq: Quantized, into: torch.Tensor | None) -> torch.Tensor:
    """Where dW is summed: the caller's `into` (e.g. Megatron's main_grad), else fresh fp32 zeros."""
    return into if into is not None else torch.zeros(wq.data.shape, dtype=F32, device=wq.data.device)


def whole_dw(dyq: Quantized, xq: Quantized, wq: Quantized, dw):
    """The unfused wgrad: one scaled GEMM dyq [s, b, n]^T @ xq [s, b, h], where `dw` routes it (None: not
    wanted)."""
    if dw is None:
        return None
    acc = dw_buffer(wq, dw.into)
    wgrad_adder(dyq, xq.scale_inv, acc)((0, xq.data.shape[0]), xq.data)
    return wgrad_result(wq, acc, dw.into)
