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


# ---- gemm ---------------------------------------------------------------------------------------
# The gemm family (cpp/include/fusible/gemm.h holds the contract: numerics, epilogues, dtype rules,
# the FP8 "TN" layout, and the CUDA backend's cuBLASLt constraints).

GEMM_EPILOGUES = (
    "none",
    "bias",
    "gelu",
    "gelu_aux",
    "bias_gelu",
    "bias_gelu_aux",
    "dgelu",
    "dgelu_bgrad",
)
_GEMM_EPILOGUE_CODE = {name: code for code, name in enumerate(GEMM_EPILOGUES)}  # fus_gemm_epilogue
_GEMM_USES_BIAS = frozenset({"bias", "bias_gelu", "bias_gelu_aux"})
_GEMM_WRITES_AUX = frozenset({"gelu_aux", "bias_gelu_aux"})
_GEMM_READS_AUX = frozenset({"dgelu", "dgelu_bgrad"})
_GEMM_DTYPES = HIGH_PRECISION_DTYPES + FP8_DTYPES
_ABSENT = _C.Tensor(0, 0, 0, 0)  # an absent optional tensor of the C API (all zero)

__all__ += ["GEMM_EPILOGUES", "gemm", "gemm_epilogue_supported", "gemm_has_cublaslt"]


def gemm_has_cublaslt() -> bool:
    """True if CUDA GEMMs are available (CUDA backend built with cuBLASLt)."""
    return bool(_C.gemm_has_cublaslt())


def gemm_epilogue_supported(
    a_dtype: torch.dtype, b_dtype: torch.dtype, out_dtype: torch.dtype, epilogue: str
) -> bool:
    """Whether ``fusible.gemm`` serves this combination of operand dtypes, output dtype and
    epilogue (on every backend; see gemm.h). High-precision GEMMs (``a_dtype == b_dtype``, output
    ``a_dtype`` or float32) support every epilogue. FP8 GEMMs have no kernel for: E5M2 x E5M2; an
    E5M2 output from E4M3 x E4M3; a float32 output with ``bias_gelu_aux`` / ``dgelu_bgrad``; an FP8
    output with ``dgelu`` / ``dgelu_bgrad``. Fusions use this to choose between an epilogue and
    separate kernels."""
    if epilogue not in _GEMM_EPILOGUE_CODE:
        return False
    if a_dtype in HIGH_PRECISION_DTYPES:
        return b_dtype == a_dtype and out_dtype in (a_dtype, torch.float32)
    if a_dtype not in FP8_DTYPES or b_dtype not in FP8_DTYPES or out_dtype not in _GEMM_DTYPES:
        return False
    e5m2 = torch.float8_e5m2
    if a_dtype == e5m2 and b_dtype == e5m2:
        return False
    if out_dtype == e5m2 and e5m2 not in (a_dtype, b_dtype):
        return False
    if out_dtype == torch.float32 and epilogue in ("bias_gelu_aux", "dgelu_bgrad"):
        return False
    return not (out_dtype in FP8_DTYPES and epilogue in _GEMM_READS_AUX)


def _gemm_dims(
    a: torch.Tensor, b: torch.Tensor, transa: bool, transb: bool
) -> tuple[int, int, int, tuple[int, ...]]:
    """(M, N, K, shape of d). a and b are matrices [prod(shape[:-1]), shape[-1]]."""
    op = "gemm"
    rows_a, cols_a = _matrix_shape(op, a, "a")
    rows_b, cols_b = _matrix_shape(op, b, "b")
    m, k = (cols_a, rows_a) if transa else (rows_a, cols_a)
    kb, n = (cols_b, rows_b) if transb else (rows_b, cols_b)
    if k != kb:
        raise ValueError(
            f"fusible.{op}: arguments 'a' and 'b' disagree on K: op(a) is [{m}, {k}] (a of shape "
            f"{tuple(a.shape)}, transa={transa}) but op(b) is [{kb}, {n}] (b of shape "
            f"{tuple(b.shape)}, transb={transb})"
        )
    d_shape = (m, n) if transa else (*a.shape[:-1], n)
    return m, n, k, d_shape


def _gemm_epilogue_dtype(out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.dtype:
    """dtype of aux / dbias: the output's, or for an FP8 output the bias's (bf16 without one)."""
    if out_dtype in HIGH_PRECISION_DTYPES:
        return out_dtype
    return bias.dtype if bias is not None else torch.bfloat16


def _gemm_outputs(
    a: torch.Tensor,
    b: torch.Tensor,
    transa: bool,
    transb: bool,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    epilogue: str,
    aux: torch.Tensor | None,
    want_amax: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _, n, _, d_shape = _gemm_dims(a, b, transa, transb)
    dev = a.device
    vec = _gemm_epilogue_dtype(out_dtype, bias)
    if epilogue in _GEMM_READS_AUX and aux is not None and out_dtype in FP8_DTYPES:
        vec = aux.dtype
    d = torch.empty(d_shape, dtype=out_dtype, device=dev)
    aux_out = (
        torch.empty(d_shape, dtype=vec, device=dev)
        if epilogue in _GEMM_WRITES_AUX
        else torch.empty(0, dtype=vec, device=dev)
    )
    dbias = torch.empty(n if epilogue == "dgelu_bgrad" else 0, dtype=vec, device=dev)
    amax = torch.empty(1 if want_amax else 0, dtype=torch.float32, device=dev)
    return d, aux_out, dbias, amax


def _gemm_check_mn(name: str, t: torch.Tensor, m: int, n: int) -> None:
    if t.dim() == 0 or t.shape[-1] != n or t.numel() != m * n:
        raise ValueError(
            f"fusible.gemm: argument '{name}' has shape {tuple(t.shape)}; expected a tensor "
            f"viewable as [M, N] = [{m}, {n}] (last dimension {n}, {m * n} elements)"
        )


@torch.library.custom_op("fusible::gemm", mutates_args=())
def gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    transa: bool,
    transb: bool,
    a_scale_inv: torch.Tensor | None,
    b_scale_inv: torch.Tensor | None,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    epilogue: str,
    aux: torch.Tensor | None,
    c: torch.Tensor | None,
    alpha: float,
    beta: float,
    out_scale: torch.Tensor | None,
    want_amax: bool,
    fast_accum: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``d = epilogue(alpha * s * op(a) @ op(b) + beta * c)``, FP32 accumulation (gemm.h).

    ``a`` is viewed as the matrix ``[prod(a.shape[:-1]), a.shape[-1]]``, which is op(a) = [M, K]
    (``transa=False``) or its transpose [K, M]; ``b`` likewise is [K, N] or, with ``transb``,
    [N, K]. Operands are both high precision (same dtype) or both FP8 with per-tensor
    ``a_scale_inv`` / ``b_scale_inv`` (float32, one element; ``s`` is their product). FP8 GEMMs
    must be ``transa=False, transb=True`` (both operands K-contiguous: pass the transposed FP8
    copy of the second operand).

    ``epilogue`` is one of :data:`GEMM_EPILOGUES`: ``bias`` adds ``bias`` [N]; ``gelu*`` apply
    the tanh GELU, ``*_aux`` also return its input; ``dgelu`` multiplies by gelu'(``aux``) (the
    forward's aux, [M, N]); ``dgelu_bgrad`` also returns ``dbias``, the column sums of ``d``.
    ``c`` [M, N] is read when ``beta != 0`` (epilogues ``none`` and ``bias`` only) and never
    modified: ``d`` is a new tensor. An FP8 ``out_dtype`` needs ``out_scale``
    (``d = fp8(r * out_scale)``); ``want_amax`` then returns ``max|r|``. ``fast_accum`` allows
    cuBLASLt's faster, less accurate FP8 accumulation (and TF32 for float32) on CUDA.

    Returns ``(d, aux_out, dbias, amax)``; ``d`` has shape ``(*a.shape[:-1], N)`` (``(M, N)`` when
    ``transa``); outputs not requested are empty.
    """
    op = "gemm"
    if epilogue not in _GEMM_EPILOGUE_CODE:
        raise ValueError(
            f"fusible.{op}: argument 'epilogue' must be one of {GEMM_EPILOGUES}, got {epilogue!r}"
        )
    _check_tensor(op, "a", a, _GEMM_DTYPES)
    _check_tensor(op, "b", b, _GEMM_DTYPES, a.device)
    if out_dtype not in _GEMM_DTYPES:
        raise TypeError(
            f"fusible.{op}: argument 'out_dtype' must be float32, float16, bfloat16, "
            f"float8_e4m3fn or float8_e5m2, got {out_dtype}"
        )
    m, n, _, _ = _gemm_dims(a, b, transa, transb)
    fp8 = a.dtype in FP8_DTYPES
    if not fp8 and b.dtype == a.dtype and out_dtype not in (a.dtype, torch.float32):
        raise ValueError(
            f"fusible.{op}: argument 'out_dtype' must be {a.dtype} or torch.float32 for "
            f"{a.dtype} operands, got {out_dtype}"
        )
    for name, s in (("a_scale_inv", a_scale_inv), ("b_scale_inv", b_scale_inv)):
        operand = name[0]
        if fp8 and s is None:
            raise ValueError(
                f"fusible.{op}: argument '{name}' is required for FP8 operand '{operand}'"
            )
        if not fp8 and s is not None:
            raise ValueError(
                f"fusible.{op}: argument '{name}' must be None for high-precision operands"
            )
        if s is not None:
            _check_scalar(op, name, s, a.device)
    out_fp8 = out_dtype in FP8_DTYPES
    if out_fp8:
        if out_scale is None:
            raise ValueError(
                f"fusible.{op}: argument 'out_scale' is required for an FP8 out_dtype {out_dtype}"
            )
        _check_scalar(op, "out_scale", out_scale, a.device)
    else:
        if out_scale is not None:
            raise ValueError(
                f"fusible.{op}: argument 'out_scale' must be None for out_dtype {out_dtype}"
            )
        if want_amax:
            raise ValueError(
                f"fusible.{op}: argument 'want_amax' needs an FP8 out_dtype, got {out_dtype}"
            )
    if (bias is not None) != (epilogue in _GEMM_USES_BIAS):
        raise ValueError(
            f"fusible.{op}: argument 'bias' is "
            + ("required" if bias is None else "not used")
            + f" by epilogue {epilogue!r}"
        )
    if bias is not None:
        _check_tensor(op, "bias", bias, HIGH_PRECISION_DTYPES, a.device)
        if tuple(bias.shape) != (n,):
            raise ValueError(
                f"fusible.{op}: argument 'bias' has shape {tuple(bias.shape)}, expected ({n},)"
            )
    if (aux is not None) != (epilogue in _GEMM_READS_AUX):
        raise ValueError(
            f"fusible.{op}: argument 'aux' (the GELU input, for dgelu) is "
            + ("required" if aux is None else "not used")
            + f" by epilogue {epilogue!r}"
        )
    if aux is not None:
        _check_tensor(op, "aux", aux, HIGH_PRECISION_DTYPES, a.device)
        _gemm_check_mn("aux", aux, m, n)
    if beta != 0.0:
        if c is None:
            raise ValueError(f"fusible.{op}: argument 'c' is required when beta != 0 ({beta})")
        _check_tensor(op, "c", c, _GEMM_DTYPES, a.device)
        _gemm_check_mn("c", c, m, n)
    d, aux_out, dbias, amax = _gemm_outputs(
        a, b, transa, transb, out_dtype, bias, epilogue, aux, want_amax
    )
    try:
        _C.gemm(
            a=_mat(a, *_matrix_shape(op, a, "a")),
            b=_mat(b, *_matrix_shape(op, b, "b")),
            transa=transa,
            transb=transb,
            a_scale_inv=_ptr(a_scale_inv),
            b_scale_inv=_ptr(b_scale_inv),
            d=_mat(d, m, n),
            d_scale=_ptr(out_scale),
            d_amax=_ptr(amax),
            c=_mat(c, m, n) if beta != 0.0 and c is not None else _ABSENT,
            alpha=float(alpha),
            beta=float(beta),
            epilogue=_GEMM_EPILOGUE_CODE[epilogue],
            bias=_mat(bias, 1, n) if bias is not None else _ABSENT,
            aux=(
                _mat(aux_out, m, n)
                if epilogue in _GEMM_WRITES_AUX
                else (_mat(aux, m, n) if aux is not None else _ABSENT)
            ),
            dbias=_mat(dbias, 1, n) if epilogue == "dgelu_bgrad" else _ABSENT,
            use_fast_accum=bool(fast_accum),
            ctx=_ctx(a),
        )
    except (ValueError, TypeError) as e:  # the C API's message names the argument
        raise type(e)(f"fusible.{op}: {e}") from None
    return d, aux_out, dbias, amax


@gemm.register_fake
def _(
    a,
    b,
    transa,
    transb,
    a_scale_inv,
    b_scale_inv,
    out_dtype,
    bias,
    epilogue,
    aux,
    c,
    alpha,
    beta,
    out_scale,
    want_amax,
    fast_accum=False,
):
    if epilogue not in _GEMM_EPILOGUE_CODE:
        raise ValueError(
            f"fusible.gemm: argument 'epilogue' must be one of {GEMM_EPILOGUES}, got {epilogue!r}"
        )
    for name, t in (
        ("b", b),
        ("a_scale_inv", a_scale_inv),
        ("b_scale_inv", b_scale_inv),
        ("bias", bias),
        ("aux", aux),
        ("c", c),
        ("out_scale", out_scale),
    ):
        if t is not None:
            _check_same_device("gemm", name, t, a.device)
    return _gemm_outputs(a, b, transa, transb, out_dtype, bias, epilogue, aux, want_amax)
