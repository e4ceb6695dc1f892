"""Shared compute helpers of the ops: quantized containers, the three training GEMMs, and the
norm/activation kernels with optional quantized output. Every op and fused op goes through these,
so each piece of math has one implementation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fusible import _kernels as K
from fusible.quantization.quantizers import (
    Float8Data,
    Float8Quantizer,
    MXFP8Data,
    MXFP8Quantizer,
    Quantizer,
)

__all__ = [
    "HandOff",
    "as_2d",
    "dequantize",
    "fused_quant_args",
    "gemm_dgrad",
    "gemm_fprop",
    "gemm_wgrad",
    "hp_dtype",
    "quantize",
    "wrap_quantized",
]


@dataclass(frozen=True)
class HandOff:
    """A unit's output already quantized with the next op's input quantizer (quantizer hand-off),
    with the high-precision dtype the unquantized value would have had."""

    qdata: Float8Data | MXFP8Data
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.qdata.shape

    def dequantize(self) -> torch.Tensor:
        return self.qdata.dequantize(self.dtype)


def as_2d(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1])


def hp_dtype(x: torch.Tensor | HandOff) -> torch.dtype:
    return x.dtype


def dequantize(x: torch.Tensor | HandOff) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else x.dequantize()


def quantize(
    q: Quantizer, x: torch.Tensor | HandOff, *, rowwise: bool = True, columnwise: bool = False
) -> Float8Data | MXFP8Data:
    """``x`` quantized with ``q`` (the copies asked for); a hand-off is already quantized."""
    if isinstance(x, HandOff):
        return x.qdata
    return q.quantize(x, rowwise=rowwise, columnwise=columnwise)


def record_amax(q: Quantizer, amax: torch.Tensor) -> None:
    """A delayed-scaling quantizer's running amax, for casts done by fused kernels."""
    if isinstance(q, Float8Quantizer):
        q.record_amax(amax)


def fused_quant_args(q: Quantizer | None) -> tuple[str, torch.dtype, torch.Tensor | None] | None:
    """Arguments with which a norm/activation kernel writes its output quantized by ``q``, or
    None if that quantizer cannot be fused into the kernel (current scaling needs the amax of the
    whole output before the first cast, so that output is cast by a separate pass)."""
    if isinstance(q, Float8Quantizer):
        return "fp8", q.dtype, q.scale
    if isinstance(q, MXFP8Quantizer):
        return "mxfp8", q.dtype, None
    return None


def wrap_quantized(
    q: Quantizer, outs: tuple[torch.Tensor, ...], shape: torch.Size, dtype: torch.dtype
) -> HandOff:
    """Hand-off of a kernel's quantized outputs ``(data, data_t|col, scale_inv|scale, col_scale,
    amax)`` (layouts of ``_kernels.quantize_fp8`` / ``quantize_mxfp8``)."""
    data, second, third, col_scale, amax = outs

    def opt(t: torch.Tensor) -> torch.Tensor | None:
        return t if t.numel() or 0 in shape else None

    if isinstance(q, Float8Quantizer):
        record_amax(q, amax)
        qd: Float8Data | MXFP8Data = Float8Data(opt(data), opt(second), third, q.dtype, shape)
    else:
        qd = MXFP8Data(opt(data), opt(third), opt(second), opt(col_scale), q.dtype, shape)
    return HandOff(qd, dtype)


def _gemm(a: Any, b: Any, which: str, out_dtype: torch.dtype, **kw: Any) -> torch.Tensor:
    """D = A @ B^T on the copies ``which`` names ("rr": rowwise A, rowwise B; "rc": rowwise A,
    columnwise B; "cc": both columnwise), the NT form cuBLASLt FP8 needs."""
    if isinstance(a, Float8Data) and isinstance(b, Float8Data):
        am = as_2d(a.data) if which[0] == "r" else a.data_t
        bm = as_2d(b.data) if which[1] == "r" else b.data_t
        d, aux, dbias, _ = K.gemm(am, bm, False, True, a.scale_inv, b.scale_inv, out_dtype,
                                  kw.get("bias"), kw.get("epilogue", "none"), kw.get("aux"),
                                  kw.get("c"), 1.0, 1.0 if kw.get("c") is not None else 0.0,
                                  None, False)  # fmt: skip
        return d, aux, dbias
    # MXFP8 on Hopper and CPU: exactly dequantized operands, BF16/FP32 GEMM (explain() says so).
    am = _dequant_copy(a, which[0], out_dtype)
    bm = _dequant_copy(b, which[1], out_dtype)
    d, aux, dbias, _ = K.gemm(am, bm, False, True, None, None, out_dtype, kw.get("bias"),
                              kw.get("epilogue", "none"), kw.get("aux"), kw.get("c"), 1.0,
                              1.0 if kw.get("c") is not None else 0.0, None, False)  # fmt: skip
    return d, aux, dbias


def _dequant_copy(x: Any, which: str, dtype: torch.dtype) -> torch.Tensor:
    """The rowwise matrix, or the transposed matrix, dequantized (hp tensors pass through)."""
    gemm_dtype = torch.float32 if dtype == torch.float32 else torch.bfloat16
    if isinstance(x, torch.Tensor):
        m = as_2d(x)
        return (m if which == "r" else m.t()).to(gemm_dtype).contiguous()
    if isinstance(x, Float8Data):
        if which == "r":
            return as_2d(K.dequantize_fp8(x.data, x.scale_inv, gemm_dtype))
        return K.dequantize_fp8(x.data_t, x.scale_inv, gemm_dtype)
    if which == "r":
        return as_2d(K.dequantize_mxfp8(x.data, x.scale, False, gemm_dtype))
    return as_2d(K.dequantize_mxfp8(x.col_data, x.col_scale, True, gemm_dtype)).t().contiguous()


def gemm_fprop(x: Any, w: Any, out_dtype: torch.dtype, **kw: Any) -> tuple[torch.Tensor, ...]:
    """y[M,N] = x[M,K] @ w[N,K]^T (+ epilogue)."""
    return _gemm(x, w, "rr", out_dtype, **kw)


def gemm_dgrad(dy: Any, w: Any, out_dtype: torch.dtype, **kw: Any) -> tuple[torch.Tensor, ...]:
    """dx[M,K] = dy[M,N] @ w[N,K] = dy @ (w^T)[K,N]^T."""
    return _gemm(dy, w, "rc", out_dtype, **kw)


def gemm_wgrad(dy: Any, x: Any, out_dtype: torch.dtype, **kw: Any) -> tuple[torch.Tensor, ...]:
    """dw[N,K] = dy^T[N,M] @ x[M,K] = (dy^T)[N,M] @ (x^T)[K,M]^T."""
    return _gemm(dy, x, "cc", out_dtype, **kw)
