"""Torch custom ops (``torch.ops.fusible.*``) over the core library ``fusible._C``.

Every op validates its inputs (device, dtype, contiguity, shape) and raises ``ValueError`` /
``TypeError`` naming the op, the argument and what was expected, allocates its outputs with torch,
and calls the C API on the input's device (the current CUDA stream for CUDA tensors). Each op has a
fake (meta) implementation, so ``torch.compile`` traces through them without graph breaks.

Tensors are viewed as matrices: ``x`` of shape ``(..., k)`` is ``[x.numel() // k, k]``.
FP8 data is returned as ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``; E8M0 scales as ``uint8``.
Outputs that were not requested are returned as empty tensors (custom ops cannot return None).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from fusible import _C

__all__ = [
    "FP8_DTYPES",
    "HIGH_PRECISION_DTYPES",
    "MXFP8_BLOCK",
    "compute_amax",
    "compute_scale",
    "delayed_scaling_update",
    "dequantize_fp8",
    "dequantize_mxfp8",
    "fp8_max",
    "has_cuda",
    "quantize_fp8",
    "quantize_fp8_current",
    "quantize_mxfp8",
]

MXFP8_BLOCK = 32
HIGH_PRECISION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)

# Codes of fus_dtype (cpp/include/fusible/common.h).
_CODE = {
    torch.float32: 0,
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.float8_e4m3fn: 3,
    torch.float8_e5m2: 4,
    torch.uint8: 5,  # E8M0 scales
}
_SCALING_PER_TENSOR, _SCALING_MXFP8 = 0, 1
_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
_ALGO = {"max": 0, "most_recent": 1}


def has_cuda() -> bool:
    """True if the core library was built with its CUDA backend."""
    return bool(_C.has_cuda())


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype."""
    if dtype not in _FP8_MAX:
        raise TypeError(f"fp8_max: expected one of {FP8_DTYPES}, got {dtype}")
    return _FP8_MAX[dtype]


# ---- validation and C-struct helpers ------------------------------------------------------------


def _check_tensor(
    op: str,
    name: str,
    t: torch.Tensor,
    dtypes: Sequence[torch.dtype] | None = None,
    device: torch.device | None = None,
) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"fusible.{op}: argument '{name}' must be a torch.Tensor, got {type(t)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d) for d in dtypes)
        raise TypeError(
            f"fusible.{op}: argument '{name}' must have dtype in ({names}), got {t.dtype}"
        )
    if t.device.type not in ("cpu", "cuda", "meta"):
        raise ValueError(
            f"fusible.{op}: argument '{name}' is on {t.device}; expected a CPU or CUDA tensor"
        )
    if device is not None and t.device != device:
        raise ValueError(
            f"fusible.{op}: argument '{name}' is on {t.device}, expected the input's device {device}"
        )
    if not t.is_contiguous():
        raise ValueError(
            f"fusible.{op}: argument '{name}' must be contiguous (shape {tuple(t.shape)}, "
            f"stride {t.stride()}); call .contiguous() first"
        )
    if t.device.type == "cuda" and not has_cuda():
        raise RuntimeError(
            f"fusible.{op}: argument '{name}' is a CUDA tensor but fusible was built without its "
            "CUDA backend (no nvcc at build time)"
        )


def _check_scalar(op: str, name: str, t: torch.Tensor, device: torch.device) -> None:
    _check_tensor(op, name, t, (torch.float32,), device)
    if t.numel() != 1:
        raise ValueError(
            f"fusible.{op}: argument '{name}' must hold exactly one float32 value, "
            f"got shape {tuple(t.shape)}"
        )


def _check_fp8_dtype(op: str, dtype: torch.dtype) -> None:
    if dtype not in FP8_DTYPES:
        raise TypeError(
            f"fusible.{op}: argument 'fp8_dtype' must be torch.float8_e4m3fn or "
            f"torch.float8_e5m2, got {dtype}"
        )


def _matrix_shape(op: str, x: torch.Tensor, name: str = "x") -> tuple[int, int]:
    if x.dim() == 0:
        raise ValueError(
            f"fusible.{op}: argument '{name}' must have at least one dimension, got a scalar"
        )
    return math.prod(x.shape[:-1]), x.shape[-1]


def _check_same_device(op: str, name: str, t: torch.Tensor, device: torch.device) -> None:
    # Also called by the fake kernels: a mix of meta and real tensors dispatches to them, and they
    # must not hand back uninitialised real tensors.
    if t.device != device:
        raise ValueError(
            f"fusible.{op}: argument '{name}' is on {t.device}, expected the input's device "
            f"{device}"
        )


def _check_margin(op: str, margin: int) -> None:
    if not -(2**31) <= margin < 2**31:
        raise ValueError(f"fusible.{op}: argument 'margin' must fit in int32, got {margin}")


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None or t.numel() == 0 else t.data_ptr()


def _mat(t: torch.Tensor, rows: int, cols: int) -> _C.Tensor:
    return _C.Tensor(_ptr(t), _CODE[t.dtype], rows, cols)


def _ctx(t: torch.Tensor) -> _C.Context:
    if t.device.type == "cuda":
        index = t.device.index if t.device.index is not None else torch.cuda.current_device()
        return _C.Context(1, index, torch.cuda.current_stream(t.device).cuda_stream)
    return _C.Context(0, 0, 0)


def _empty(x: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.float32, device=x.device)


def _ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def _fp8_outputs(
    op: str, x: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool, columnwise: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = _matrix_shape(op, x)
    data = torch.empty(x.shape, dtype=fp8_dtype, device=x.device) if rowwise else None
    data_t = torch.empty((cols, rows), dtype=fp8_dtype, device=x.device) if columnwise else None
    e = torch.empty(0, dtype=fp8_dtype, device=x.device)
    return (data if data is not None else e), (data_t if data_t is not None else e)


def _require_a_copy(op: str, rowwise: bool, columnwise: bool) -> None:
    if not (rowwise or columnwise):
        raise ValueError(f"fusible.{op}: at least one of 'rowwise' and 'columnwise' must be True")


# ---- per-tensor FP8 -----------------------------------------------------------------------------


@torch.library.custom_op("fusible::quantize_fp8", mutates_args=())
def quantize_fp8(
    x: torch.Tensor, scale: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool, columnwise: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cast ``x`` with a given per-tensor ``scale`` (delayed scaling), one pass.

    Returns ``(data, data_t, scale_inv, amax)``: ``data`` has ``x``'s shape, ``data_t`` is the
    transposed matrix ``[k, rows]`` (empty unless ``columnwise``), ``scale_inv = 1/scale`` and
    ``amax = max|x|`` are float32 of shape ``(1,)``.
    """
    op = "quantize_fp8"
    _check_tensor(op, "x", x, HIGH_PRECISION_DTYPES)
    _check_scalar(op, "scale", scale, x.device)
    _check_fp8_dtype(op, fp8_dtype)
    _require_a_copy(op, rowwise, columnwise)
    rows, cols = _matrix_shape(op, x)
    data, data_t = _fp8_outputs(op, x, fp8_dtype, rowwise, columnwise)
    scale_inv = torch.empty(1, dtype=torch.float32, device=x.device)
    amax = torch.empty(1, dtype=torch.float32, device=x.device)
    q = _C.Quantized(
        _SCALING_PER_TENSOR, _CODE[fp8_dtype], rows, cols,
        _ptr(data), _ptr(data_t), scale_inv.data_ptr(), 0, scale.data_ptr(), amax.data_ptr(),
    )  # fmt: skip
    _C.quantize(_mat(x, rows, cols), q, _ctx(x))
    return data, data_t, scale_inv, amax


@quantize_fp8.register_fake
def _(x, scale, fp8_dtype, rowwise, columnwise):
    _check_same_device("quantize_fp8", "scale", scale, x.device)
    data, data_t = _fp8_outputs("quantize_fp8", x, fp8_dtype, rowwise, columnwise)
    return data, data_t, scale.new_empty(1), scale.new_empty(1)


@torch.library.custom_op("fusible::quantize_fp8_current", mutates_args=())
def quantize_fp8_current(
    x: torch.Tensor, fp8_dtype: torch.dtype, margin: int, rowwise: bool, columnwise: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Current scaling: amax pass, ``scale = fp8_max / amax / 2**margin``, cast pass.

    Returns ``(data, data_t, scale, scale_inv, amax)``.
    """
    op = "quantize_fp8_current"
    _check_tensor(op, "x", x, HIGH_PRECISION_DTYPES)
    _check_fp8_dtype(op, fp8_dtype)
    _require_a_copy(op, rowwise, columnwise)
    _check_margin(op, margin)
    rows, cols = _matrix_shape(op, x)
    data, data_t = _fp8_outputs(op, x, fp8_dtype, rowwise, columnwise)
    scale, scale_inv, amax = (torch.ones(1, dtype=torch.float32, device=x.device) for _ in range(3))
    q = _C.Quantized(
        _SCALING_PER_TENSOR, _CODE[fp8_dtype], rows, cols,
        _ptr(data), _ptr(data_t), scale_inv.data_ptr(), 0, scale.data_ptr(), amax.data_ptr(),
    )  # fmt: skip
    _C.quantize_current_scaling(_mat(x, rows, cols), q, int(margin), _ctx(x))
    return data, data_t, scale, scale_inv, amax


@quantize_fp8_current.register_fake
def _(x, fp8_dtype, margin, rowwise, columnwise):
    data, data_t = _fp8_outputs("quantize_fp8_current", x, fp8_dtype, rowwise, columnwise)
    one = torch.empty(1, dtype=torch.float32, device=x.device)
    return data, data_t, one, one.clone(), one.clone()


@torch.library.custom_op("fusible::dequantize_fp8", mutates_args=())
def dequantize_fp8(
    data: torch.Tensor, scale_inv: torch.Tensor, out_dtype: torch.dtype
) -> torch.Tensor:
    """``float(data) * scale_inv`` rounded to ``out_dtype``; works for either stored layout."""
    op = "dequantize_fp8"
    _check_tensor(op, "data", data, FP8_DTYPES)
    _check_scalar(op, "scale_inv", scale_inv, data.device)
    _check_out_dtype(op, out_dtype)
    rows, cols = _matrix_shape(op, data, "data")
    out = torch.empty(data.shape, dtype=out_dtype, device=data.device)
    q = _C.Quantized(
        _SCALING_PER_TENSOR, _CODE[data.dtype], rows, cols,
        _ptr(data), 0, scale_inv.data_ptr(), 0, 0, 0,
    )  # fmt: skip
    _C.dequantize(q, False, _mat(out, rows, cols), _ctx(data))
    return out


@dequantize_fp8.register_fake
def _(data, scale_inv, out_dtype):
    _check_same_device("dequantize_fp8", "scale_inv", scale_inv, data.device)
    return torch.empty(data.shape, dtype=out_dtype, device=data.device)


def _check_out_dtype(op: str, dtype: torch.dtype) -> None:
    if dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(
            f"fusible.{op}: argument 'out_dtype' must be float32, float16 or bfloat16, got {dtype}"
        )


@torch.library.custom_op("fusible::compute_amax", mutates_args=())
def compute_amax(x: torch.Tensor) -> torch.Tensor:
    """``max|x|`` as float32 of shape ``(1,)`` (NaN if ``x`` holds a NaN)."""
    _check_tensor("compute_amax", "x", x, HIGH_PRECISION_DTYPES)
    rows, cols = _matrix_shape("compute_amax", x)
    amax = torch.empty(1, dtype=torch.float32, device=x.device)
    _C.compute_amax(_mat(x, rows, cols), amax.data_ptr(), _ctx(x))
    return amax


@compute_amax.register_fake
def _(x):
    return torch.empty(1, dtype=torch.float32, device=x.device)


@torch.library.custom_op("fusible::compute_scale", mutates_args=())
def compute_scale(
    amax: torch.Tensor, fp8_dtype: torch.dtype, margin: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor ``(scale, scale_inv)`` from ``amax`` (scale 1 where amax is 0 or non-finite)."""
    _check_scalar("compute_scale", "amax", amax, amax.device)
    _check_fp8_dtype("compute_scale", fp8_dtype)
    _check_margin("compute_scale", margin)
    scale = torch.ones(1, dtype=torch.float32, device=amax.device)
    scale_inv = torch.empty(1, dtype=torch.float32, device=amax.device)
    _C.compute_scale(
        amax.data_ptr(), scale.data_ptr(), scale_inv.data_ptr(), _FP8_MAX[fp8_dtype],
        int(margin), False, _ctx(amax),
    )  # fmt: skip
    return scale, scale_inv


@compute_scale.register_fake
def _(amax, fp8_dtype, margin):
    return amax.new_empty(1), amax.new_empty(1)


# ---- MXFP8 --------------------------------------------------------------------------------------


def _mx_outputs(
    x: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool, columnwise: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, cols = _matrix_shape("quantize_mxfp8", x)
    dev = x.device
    e8 = torch.empty(0, dtype=fp8_dtype, device=dev)
    e0 = torch.empty(0, dtype=torch.uint8, device=dev)
    data = torch.empty(x.shape, dtype=fp8_dtype, device=dev) if rowwise else e8
    scale = (
        torch.empty((rows, _ceil_div(cols, MXFP8_BLOCK)), dtype=torch.uint8, device=dev)
        if rowwise
        else e0
    )
    col = torch.empty(x.shape, dtype=fp8_dtype, device=dev) if columnwise else e8.clone()
    col_scale = (
        torch.empty((_ceil_div(rows, MXFP8_BLOCK), cols), dtype=torch.uint8, device=dev)
        if columnwise
        else e0.clone()
    )
    return data, scale, col, col_scale


@torch.library.custom_op("fusible::quantize_mxfp8", mutates_args=())
def quantize_mxfp8(
    x: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool, columnwise: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """MXFP8 cast (OCP MX, 32-element blocks), one pass.

    Returns ``(data, scale, col_data, col_scale)``: ``data`` has ``x``'s shape with E8M0 ``scale``
    ``[rows, ceil(k/32)]`` (blocks along rows); ``col_data`` has ``x``'s shape too, with ``col_scale``
    ``[ceil(rows/32), k]`` (blocks down columns). Unrequested copies are empty.
    """
    op = "quantize_mxfp8"
    _check_tensor(op, "x", x, HIGH_PRECISION_DTYPES)
    _check_fp8_dtype(op, fp8_dtype)
    _require_a_copy(op, rowwise, columnwise)
    rows, cols = _matrix_shape(op, x)
    data, scale, col, col_scale = _mx_outputs(x, fp8_dtype, rowwise, columnwise)
    q = _C.Quantized(
        _SCALING_MXFP8, _CODE[fp8_dtype], rows, cols,
        _ptr(data), _ptr(col), _ptr(scale), _ptr(col_scale), 0, 0,
    )  # fmt: skip
    _C.quantize(_mat(x, rows, cols), q, _ctx(x))
    return data, scale, col, col_scale


@quantize_mxfp8.register_fake
def _(x, fp8_dtype, rowwise, columnwise):
    return _mx_outputs(x, fp8_dtype, rowwise, columnwise)


@torch.library.custom_op("fusible::dequantize_mxfp8", mutates_args=())
def dequantize_mxfp8(
    data: torch.Tensor, scale: torch.Tensor, columnwise: bool, out_dtype: torch.dtype
) -> torch.Tensor:
    """Dequantize an MXFP8 copy: ``columnwise`` says whether ``scale`` runs down columns."""
    op = "dequantize_mxfp8"
    _check_tensor(op, "data", data, FP8_DTYPES)
    _check_tensor(op, "scale", scale, (torch.uint8,), data.device)
    _check_out_dtype(op, out_dtype)
    rows, cols = _matrix_shape(op, data, "data")
    expected = (
        (_ceil_div(rows, MXFP8_BLOCK), cols) if columnwise else (rows, _ceil_div(cols, MXFP8_BLOCK))
    )
    if rows * cols and tuple(scale.shape) != expected:
        raise ValueError(
            f"fusible.{op}: argument 'scale' has shape {tuple(scale.shape)}, expected {expected} "
            f"for {'columnwise' if columnwise else 'rowwise'} data of matrix shape ({rows}, {cols})"
        )
    out = torch.empty(data.shape, dtype=out_dtype, device=data.device)
    p, s = _ptr(data), _ptr(scale)
    q = _C.Quantized(
        _SCALING_MXFP8, _CODE[data.dtype], rows, cols,
        0 if columnwise else p, p if columnwise else 0,
        0 if columnwise else s, s if columnwise else 0, 0, 0,
    )  # fmt: skip
    _C.dequantize(q, columnwise, _mat(out, rows, cols), _ctx(data))
    return out


@dequantize_mxfp8.register_fake
def _(data, scale, columnwise, out_dtype):
    _check_same_device("dequantize_mxfp8", "scale", scale, data.device)
    return torch.empty(data.shape, dtype=out_dtype, device=data.device)


# ---- delayed scaling ----------------------------------------------------------------------------


@torch.library.custom_op(
    "fusible::delayed_scaling_update", mutates_args=("amax_histories", "scales")
)
def delayed_scaling_update(
    amax_histories: list[torch.Tensor],
    scales: list[torch.Tensor],
    fp8_maxes: list[float],
    algo: str,
    margin: int,
) -> None:
    """Delayed-scaling update of many states in one launch (see cpp/include/fusible/recipe.h).

    ``amax_histories[g]`` is float32 ``[history_len, n]``, ``scales[g]`` float32 ``[n]``.
    """
    op = "delayed_scaling_update"
    if not (len(amax_histories) == len(scales) == len(fp8_maxes)):
        raise ValueError(
            f"fusible.{op}: amax_histories, scales and fp8_maxes must have equal lengths, got "
            f"{len(amax_histories)}, {len(scales)} and {len(fp8_maxes)}"
        )
    if algo not in _ALGO:
        raise ValueError(f"fusible.{op}: algo must be 'max' or 'most_recent', got {algo!r}")
    _check_margin(op, margin)
    if not amax_histories:
        return
    device = amax_histories[0].device
    groups = []
    for g, (h, s, m) in enumerate(zip(amax_histories, scales, fp8_maxes, strict=True)):
        _check_tensor(op, f"amax_histories[{g}]", h, (torch.float32,), device)
        _check_tensor(op, f"scales[{g}]", s, (torch.float32,), device)
        if h.dim() != 2 or s.dim() != 1 or h.shape[1] != s.shape[0] or h.shape[0] < 1:
            raise ValueError(
                f"fusible.{op}: amax_histories[{g}] must be [history_len >= 1, n] and scales[{g}] "
                f"[n], got {tuple(h.shape)} and {tuple(s.shape)}"
            )
        if not m > 0:
            raise ValueError(
                f"fusible.{op}: argument 'fp8_maxes[{g}]' must be > 0 (448 for E4M3, 57344 for "
                f"E5M2), got {m}"
            )
        groups.append(_C.DelayedScalingGroup(_ptr(h), _ptr(s), h.shape[0], h.shape[1], float(m)))
    _C.delayed_scaling_update(groups, _ALGO[algo], int(margin), _ctx(amax_histories[0]))


@delayed_scaling_update.register_fake
def _(amax_histories, scales, fp8_maxes, algo, margin):
    for g, (h, s) in enumerate(zip(amax_histories, scales, strict=False)):
        _check_same_device(
            "delayed_scaling_update", f"amax_histories[{g}]", h, amax_histories[0].device
        )
        _check_same_device("delayed_scaling_update", f"scales[{g}]", s, amax_histories[0].device)
    return None
