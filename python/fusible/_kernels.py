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

import functools
import inspect
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from fusible import _C  # type: ignore[attr-defined]

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
    "transpose_fp8",
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


_HAS_CUDA = bool(_C.has_cuda())


def has_cuda() -> bool:
    """True if the core library was built with its CUDA backend."""
    return _HAS_CUDA


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype."""
    if dtype not in _FP8_MAX:
        raise TypeError(f"fp8_max: expected one of {FP8_DTYPES}, got {dtype}")
    return _FP8_MAX[dtype]


# ---- custom ops with an eager fast path ---------------------------------------------------------


class _FusibleOp:
    """A torch custom op (``torch.ops.fusible.<name>``) that plain eager code calls directly.

    The Python custom-op dispatch round trip costs ~60 us of host time per call, more than most
    of these kernels take on the GPU at small sizes; fusible's ops call the kernels with grad
    mode off (inside their autograd function), where the direct call is equivalent. Everything
    else goes through the custom op, which is what tracing and transforms need: grad mode on
    (autograd then reports the missing formula), ``torch.compile``, dispatch modes (fake
    tensors, ``make_fx``), ``torch.jit.trace``, functorch transforms (``vmap``), and tensor
    subclasses with their own ``__torch_dispatch__`` (e.g. a ``QuantizedTensor`` argument).
    Both paths run the same function; the direct path bumps the version counters of the
    tensors an op mutates, as the custom op does.
    """

    def __init__(self, op: Any, mutates: Sequence[str] = ()) -> None:
        self.op = op
        self.fn: Callable[..., Any] = op._init_fn
        self.mutates = tuple(mutates)
        # Positions of the mutated arguments (bumping their version counters on the direct
        # path without binding the signature at every call).
        names = list(inspect.signature(self.fn).parameters)
        self.mutated_at = tuple((names.index(m), m) for m in self.mutates)
        functools.update_wrapper(self, self.fn)

    def _direct(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        return plain_eager((*args, *kwargs.values()))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not (FLAGS.direct or self._direct(args, kwargs)):
            return self.op(*args, **kwargs)
        out = self.fn(*args, **kwargs)
        if self.mutated_at:
            mutated = [args[i] if i < len(args) else kwargs[name] for i, name in self.mutated_at]
            flat = [t for m in mutated for t in (m if isinstance(m, (list, tuple)) else (m,))]
            torch.autograd.graph.increment_version(flat)
        return out

    def register_fake(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        return self.op.register_fake(fn)


class _RunFlags(threading.local):
    """Set by the op executor (ops/fuser.py) around a plan's forward or backward, per thread
    (threads may run models side by side, e.g. ``nn.DataParallel``).

    ``direct``: the executor checked the run's arguments with :func:`plain_eager` (once per run,
    not once per kernel): the kernels call the core library directly.
    ``trusted``: the run is for an input signature (shapes, contiguity) the plan has run before
    with every check passing: what the checks verify (dtypes, devices, contiguity, shapes,
    argument choices) is then fixed by the plan's key and that signature, so the argument checks
    are skipped. Validation happens once per plan and signature, in the validated run; a new
    shape, dtype or device is a new plan or signature and is checked again."""

    direct = False
    trusted = False


FLAGS = _RunFlags()


def plain_eager(args: Sequence[Any]) -> bool:
    """Whether kernels called on ``args`` (tensors, lists / tuples of tensors, constants) may
    skip the custom-op dispatch: grad mode off, not tracing or compiling, no dispatch mode or
    functorch transform, and only plain, non-meta tensors (a meta tensor dispatches to the fake
    kernel, which gives shapes)."""
    if (
        torch.is_grad_enabled()
        or torch.compiler.is_compiling()
        or _get_current_dispatch_mode() is not None
        or torch.jit.is_tracing()
        or torch._C._are_functorch_transforms_active()
    ):
        return False
    plain = torch.Tensor.__torch_dispatch__
    for a in args:
        items = a if isinstance(a, (list, tuple)) else (a,)
        for t in items:
            if isinstance(t, torch.Tensor) and (
                type(t).__torch_dispatch__ is not plain or t.is_meta
            ):
                return False
    return True


def _custom_op(name: str, mutates_args: Sequence[str] = ()) -> Callable[..., _FusibleOp]:
    def wrap(fn: Callable[..., Any]) -> _FusibleOp:
        op = torch.library.custom_op(f"fusible::{name}", mutates_args=mutates_args)(fn)
        return _FusibleOp(op, mutates_args)

    return wrap


# ---- validation and C-struct helpers ------------------------------------------------------------


def _check_tensor(
    op: str,
    name: str,
    t: torch.Tensor,
    dtypes: Sequence[torch.dtype] | None = None,
    device: torch.device | None = None,
) -> None:
    if FLAGS.trusted:  # a plan run that was validated before (see _RunFlags)
        return
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
            f"fusible.{op}: argument '{name}' is on {t.device}, expected the input's device "
            f"{device}"
        )
    if not t.is_contiguous():
        raise ValueError(
            f"fusible.{op}: argument '{name}' must be contiguous (shape {tuple(t.shape)}, "
            f"stride {t.stride()}); call .contiguous() first"
        )
    if t.is_cuda and not _HAS_CUDA:
        raise RuntimeError(
            f"fusible.{op}: argument '{name}' is a CUDA tensor but fusible was built without its "
            "CUDA backend (no nvcc at build time)"
        )


def _check_scalar(op: str, name: str, t: torch.Tensor, device: torch.device) -> None:
    if FLAGS.trusted:  # a plan run that was validated before (see _RunFlags)
        return
    _check_tensor(op, name, t, (torch.float32,), device)
    if t.numel() != 1:
        raise ValueError(
            f"fusible.{op}: argument '{name}' must hold exactly one float32 value, "
            f"got shape {tuple(t.shape)}"
        )


def _check_fp8_dtype(op: str, dtype: torch.dtype) -> None:
    if FLAGS.trusted:  # a plan run that was validated before (see _RunFlags)
        return
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
    if FLAGS.trusted:  # a plan run that was validated before (see _RunFlags)
        return
    if not -(2**31) <= margin < 2**31:
        raise ValueError(f"fusible.{op}: argument 'margin' must fit in int32, got {margin}")


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None or t.numel() == 0 else t.data_ptr()


def _mat(t: torch.Tensor, rows: int, cols: int) -> _C.Tensor:
    return _C.Tensor(_ptr(t), _CODE[t.dtype], rows, cols)


# The current stream's raw handle in one call (what torch.cuda.current_stream(...).cuda_stream
# gives, without building a Stream object); older torch builds fall back to that.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_CPU_CTX = _C.Context(0, 0, 0)


def _ctx(t: torch.Tensor) -> _C.Context:
    if t.is_cuda:
        index = t.get_device()
        if _raw_stream is not None:
            return _C.Context(1, index, _raw_stream(index))
        return _C.Context(1, index, torch.cuda.current_stream(t.device).cuda_stream)
    return _CPU_CTX


_NOTHING: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def _nothing(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A 0-element tensor for an output not asked for. The direct path (``FLAGS.direct``) shares one
    per dtype and device (no allocation per call); the custom op, whose outputs may not alias
    each other, gets a new one."""
    if not FLAGS.direct:
        return torch.empty(0, dtype=dtype, device=device)
    key = (dtype, device)
    t = _NOTHING.get(key)
    if t is None:
        t = _NOTHING[key] = torch.empty(0, dtype=dtype, device=device)
    return t


def _ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def _fp8_outputs(
    op: str, x: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool, columnwise: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = _matrix_shape(op, x)
    data = torch.empty(x.shape, dtype=fp8_dtype, device=x.device) if rowwise else None
    data_t = torch.empty((cols, rows), dtype=fp8_dtype, device=x.device) if columnwise else None
    e = _nothing(fp8_dtype, x.device)
    return (data if data is not None else e), (data_t if data_t is not None else e)


def _require_a_copy(op: str, rowwise: bool, columnwise: bool) -> None:
    if FLAGS.trusted:  # a plan run that was validated before (see _RunFlags)
        return
    if not (rowwise or columnwise):
        raise ValueError(f"fusible.{op}: at least one of 'rowwise' and 'columnwise' must be True")


# ---- per-tensor FP8 -----------------------------------------------------------------------------


@_custom_op("quantize_fp8")
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


@_custom_op("quantize_fp8_current")
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
    # All three are written by the call (amax first, then scale from it, then scale_inv): no
    # fill kernels needed.
    scale, scale_inv, amax = (
        torch.empty(1, dtype=torch.float32, device=x.device) for _ in range(3)
    )
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


@_custom_op("dequantize_fp8")
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
    if FLAGS.trusted:  # a plan run that was validated before (see _RunFlags)
        return
    if dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(
            f"fusible.{op}: argument 'out_dtype' must be float32, float16 or bfloat16, got {dtype}"
        )


def _transpose_shape(op: str, x: torch.Tensor) -> tuple[int, int]:
    if x.dim() != 2:
        raise ValueError(
            f"fusible.{op}: argument 'x' must be a 2-D matrix [rows, cols], got shape "
            f"{tuple(x.shape)}"
        )
    return x.shape[0], x.shape[1]


@_custom_op("transpose_fp8")
def transpose_fp8(x: torch.Tensor) -> torch.Tensor:
    """Byte transpose of an FP8 matrix: ``x`` ``[rows, cols]`` -> ``[cols, rows]``, bits unchanged.

    The transposed (columnwise) copy of a per-tensor FP8 tensor made from its rowwise copy: the two
    share one ``scale_inv``.
    """
    op = "transpose_fp8"
    _check_tensor(op, "x", x, FP8_DTYPES)
    rows, cols = _transpose_shape(op, x)
    out = torch.empty((cols, rows), dtype=x.dtype, device=x.device)
    _C.transpose_fp8(_mat(x, rows, cols), _mat(out, cols, rows), _ctx(x))
    return out


@transpose_fp8.register_fake
def _(x):
    rows, cols = _transpose_shape("transpose_fp8", x)
    return x.new_empty((cols, rows))


@_custom_op("compute_amax")
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


@_custom_op("compute_scale")
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
    e8 = _nothing(fp8_dtype, dev)
    e0 = _nothing(torch.uint8, dev)
    data = torch.empty(x.shape, dtype=fp8_dtype, device=dev) if rowwise else e8
    scale = (
        torch.empty((rows, _ceil_div(cols, MXFP8_BLOCK)), dtype=torch.uint8, device=dev)
        if rowwise
        else e0
    )
    col = (
        torch.empty(x.shape, dtype=fp8_dtype, device=dev)
        if columnwise
        else _nothing(fp8_dtype, dev)
    )
    col_scale = (
        torch.empty((_ceil_div(rows, MXFP8_BLOCK), cols), dtype=torch.uint8, device=dev)
        if columnwise
        else _nothing(torch.uint8, dev)
    )
    return data, scale, col, col_scale


@_custom_op("quantize_mxfp8")
def quantize_mxfp8(
    x: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool, columnwise: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """MXFP8 cast (OCP MX, 32-element blocks), one pass.

    Returns ``(data, scale, col_data, col_scale)``: ``data`` has ``x``'s shape with E8M0 ``scale``
    ``[rows, ceil(k/32)]`` (blocks along rows); ``col_data`` has ``x``'s shape too, with
    ``col_scale``
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


@_custom_op("dequantize_mxfp8")
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


@_custom_op("delayed_scaling_update", mutates_args=("amax_histories", "scales"))
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
    dims: tuple[int, int, int, tuple[int, ...]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _, n, _, d_shape = dims if dims is not None else _gemm_dims(a, b, transa, transb)
    dev = a.device
    vec = _gemm_epilogue_dtype(out_dtype, bias)
    if epilogue in _GEMM_READS_AUX and aux is not None and out_dtype in FP8_DTYPES:
        vec = aux.dtype
    d = torch.empty(d_shape, dtype=out_dtype, device=dev)
    aux_out = (
        torch.empty(d_shape, dtype=vec, device=dev)
        if epilogue in _GEMM_WRITES_AUX
        else _nothing(vec, dev)
    )
    dbias = (
        torch.empty(n, dtype=vec, device=dev) if epilogue == "dgelu_bgrad" else _nothing(vec, dev)
    )
    f32 = torch.float32
    amax = torch.empty(1, dtype=f32, device=dev) if want_amax else _nothing(f32, dev)
    return d, aux_out, dbias, amax


def _gemm_check_epilogue_operand(
    arg: str, t: torch.Tensor | None, epilogue: str, needed_by: Any, what: str = ""
) -> None:
    """An operand given exactly when ``epilogue`` (one of ``needed_by`` or not) uses it."""
    if FLAGS.trusted:  # a plan run that was validated before (see _RunFlags)
        return
    if (t is not None) != (epilogue in needed_by):
        use = "required" if t is None else "not used"
        raise ValueError(f"fusible.gemm: argument '{arg}'{what} is {use} by epilogue {epilogue!r}")


def _gemm_check_mn(name: str, t: torch.Tensor, m: int, n: int) -> None:
    if FLAGS.trusted:  # a plan run that was validated before (see _RunFlags)
        return
    if t.dim() == 0 or t.shape[-1] != n or t.numel() != m * n:
        raise ValueError(
            f"fusible.gemm: argument '{name}' has shape {tuple(t.shape)}; expected a tensor "
            f"viewable as [M, N] = [{m}, {n}] (last dimension {n}, {m * n} elements)"
        )


@_custom_op("gemm")
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
    dims = _gemm_dims(a, b, transa, transb)
    m, n = dims[0], dims[1]
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
    _gemm_check_epilogue_operand("bias", bias, epilogue, _GEMM_USES_BIAS)
    if bias is not None:
        _check_tensor(op, "bias", bias, HIGH_PRECISION_DTYPES, a.device)
        if tuple(bias.shape) != (n,):
            raise ValueError(
                f"fusible.{op}: argument 'bias' has shape {tuple(bias.shape)}, expected ({n},)"
            )
    _gemm_check_epilogue_operand(
        "aux", aux, epilogue, _GEMM_READS_AUX, " (the GELU input, for dgelu)"
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
        a, b, transa, transb, out_dtype, bias, epilogue, aux, want_amax, dims=dims
    )
    k = dims[2]
    try:
        # Positional, in the binding's order (a b transa transb a_scale_inv b_scale_inv d d_scale
        # d_amax c alpha beta epilogue bias aux dbias use_fast_accum ctx): no keyword matching.
        _C.gemm(
            _mat(a, k, m) if transa else _mat(a, m, k),
            _mat(b, n, k) if transb else _mat(b, k, n),
            transa,
            transb,
            _ptr(a_scale_inv),
            _ptr(b_scale_inv),
            _mat(d, m, n),
            _ptr(out_scale),
            _ptr(amax),
            _mat(c, m, n) if beta != 0.0 and c is not None else _ABSENT,
            float(alpha),
            float(beta),
            _GEMM_EPILOGUE_CODE[epilogue],
            _mat(bias, 1, n) if bias is not None else _ABSENT,
            (
                _mat(aux_out, m, n)
                if epilogue in _GEMM_WRITES_AUX
                else (_mat(aux, m, n) if aux is not None else _ABSENT)
            ),
            _mat(dbias, 1, n) if epilogue == "dgelu_bgrad" else _ABSENT,
            bool(fast_accum),
            _ctx(a),
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


# ---- normalization and activations --------------------------------------------------------------
# cpp/include/fusible/normalization.h and activation.h hold the contract: fp32 math, the fixed
# reduction order (CPU and CUDA agree bit for bit), and the rule that a quantized output is the
# cast of the high-precision result rounded to ``out_dtype`` (or, without one, to the input's
# dtype), so it equals quantize_fp8 / quantize_mxfp8 of that output bit for bit.
#
# Quantized outputs come in the layouts of quantize_fp8 / quantize_mxfp8, as four tensors
# ``(q_data, q_data_t_or_col, q_scale_inv_or_mx_scale, q_col_scale)``:
#   quant="fp8":   data (output's shape), data_t [k, rows], scale_inv (1,), empty
#   quant="mxfp8": data (output's shape), col data (output's shape), E8M0 scale [rows, ceil(k/32)],
#                  E8M0 col scale [ceil(rows/32), k]
#   quant="none":  four empty tensors
# plus ``amax`` (1,) float32 (empty for quant="none"). Unrequested copies are empty.

NORM_KINDS = ("layernorm", "rmsnorm")
ACTIVATIONS = ("gelu", "gelu_erf", "relu", "silu", "swiglu", "geglu")
QUANT_MODES = ("none", "fp8", "mxfp8")
_NORM_CODE = {name: code for code, name in enumerate(NORM_KINDS)}  # fus_norm_kind
_ACT_CODE = {name: code for code, name in enumerate(ACTIVATIONS)}  # fus_activation
_GATED = frozenset({"swiglu", "geglu"})

__all__ += [
    "ACTIVATIONS",
    "NORM_KINDS",
    "QUANT_MODES",
    "act_bwd",
    "act_fwd",
    "norm_bwd",
    "norm_fwd",
]


def _c_call(op: str, fn: object, *args: object) -> None:
    """Calls the C API; its message (naming the C function and argument) gets the op's prefix."""
    try:
        fn(*args)  # type: ignore[operator]
    except (ValueError, TypeError) as e:
        raise type(e)(f"fusible.{op}: {e}") from None


def _check_choice(op: str, name: str, value: str, choices: Sequence[str]) -> None:
    if FLAGS.trusted:  # a plan run that was validated before (see _RunFlags)
        return
    if value not in choices:
        raise ValueError(f"fusible.{op}: argument '{name}' must be one of {choices}, got {value!r}")


def _check_opt_out_dtype(op: str, dtype: torch.dtype | None) -> None:
    if FLAGS.trusted:  # a plan run that was validated before (see _RunFlags)
        return
    if dtype is not None and dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(
            f"fusible.{op}: argument 'out_dtype' must be None, float32, float16 or bfloat16, "
            f"got {dtype}"
        )


def _check_quant_args(
    op: str,
    quant: str,
    fp8_dtype: torch.dtype,
    scale: torch.Tensor | None,
    rowwise: bool,
    columnwise: bool,
    device: torch.device,
) -> None:
    if FLAGS.trusted:  # a plan run that was validated before (see _RunFlags)
        return
    _check_choice(op, "quant", quant, QUANT_MODES)
    if quant == "none":
        return
    _check_fp8_dtype(op, fp8_dtype)
    _require_a_copy(op, rowwise, columnwise)
    if quant == "fp8":
        if scale is None:
            raise ValueError(
                f"fusible.{op}: argument 'scale' is required for quant='fp8' (float32, one value)"
            )
        _check_scalar(op, "scale", scale, device)


def _quant_outputs(
    shape: Sequence[int],
    device: torch.device,
    quant: str,
    fp8_dtype: torch.dtype,
    rowwise: bool,
    columnwise: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(data, data_t_or_col, scale_inv_or_mx_scale, col_scale, amax) for an output of `shape`."""
    shape = tuple(shape)
    rows = math.prod(shape[:-1]) if len(shape) else 1
    cols = shape[-1] if len(shape) else 1
    u8 = torch.uint8
    if quant == "none":
        e = _nothing(u8, device)
        f = _nothing(torch.float32, device)
        return e, _nothing(u8, device), f, _nothing(u8, device), _nothing(torch.float32, device)
    e8 = _nothing(fp8_dtype, device)
    e0 = _nothing(u8, device)
    amax = torch.empty(1, dtype=torch.float32, device=device)
    data = torch.empty(shape, dtype=fp8_dtype, device=device) if rowwise else e8
    if quant == "fp8":
        data_t = (
            torch.empty((cols, rows), dtype=fp8_dtype, device=device)
            if columnwise
            else _nothing(fp8_dtype, device)
        )
        return data, data_t, torch.empty(1, dtype=torch.float32, device=device), e0, amax
    col = (
        torch.empty(shape, dtype=fp8_dtype, device=device)
        if columnwise
        else _nothing(fp8_dtype, device)
    )
    s = (
        torch.empty((rows, _ceil_div(cols, MXFP8_BLOCK)), dtype=u8, device=device)
        if rowwise
        else e0
    )
    cs = (
        torch.empty((_ceil_div(rows, MXFP8_BLOCK), cols), dtype=u8, device=device)
        if columnwise
        else _nothing(u8, device)
    )
    return data, col, s, cs, amax


def _quantized_struct(
    quant: str,
    fp8_dtype: torch.dtype,
    rows: int,
    cols: int,
    outs: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    scale: torch.Tensor | None,
) -> _C.Quantized | None:
    if quant == "none":
        return None
    data, data2, s, cs, amax = outs
    if quant == "fp8":
        return _C.Quantized(
            _SCALING_PER_TENSOR, _CODE[fp8_dtype], rows, cols,
            _ptr(data), _ptr(data2), s.data_ptr(), 0, _ptr(scale), amax.data_ptr(),
        )  # fmt: skip
    return _C.Quantized(
        _SCALING_MXFP8, _CODE[fp8_dtype], rows, cols,
        _ptr(data), _ptr(data2), _ptr(s), _ptr(cs), 0, amax.data_ptr(),
    )  # fmt: skip


def _check_vector(op: str, name: str, t: torch.Tensor, n: int, device: torch.device) -> None:
    if FLAGS.trusted:  # a plan run that was validated before (see _RunFlags)
        return
    _check_tensor(op, name, t, HIGH_PRECISION_DTYPES, device)
    if tuple(t.shape) != (n,):
        raise ValueError(
            f"fusible.{op}: argument '{name}' must have shape ({n},) (the last dimension of the "
            f"input), got {tuple(t.shape)}"
        )


def _check_stats(op: str, name: str, t: torch.Tensor, rows: int, device: torch.device) -> None:
    if FLAGS.trusted:  # a plan run that was validated before (see _RunFlags)
        return
    _check_tensor(op, name, t, (torch.float32,), device)
    if t.numel() != rows:
        raise ValueError(
            f"fusible.{op}: argument '{name}' must hold {rows} float32 values (one per row, as "
            f"norm_fwd returns it), got shape {tuple(t.shape)}"
        )


# ---- norm_fwd / norm_bwd ------------------------------------------------------------------------


def _norm_fwd_outputs(
    x: torch.Tensor,
    kind: str,
    out_dtype: torch.dtype | None,
    quant: str,
    fp8_dtype: torch.dtype,
    rowwise: bool,
    columnwise: bool,
) -> tuple[torch.Tensor, ...]:
    rows = math.prod(x.shape[:-1])
    dev = x.device
    y = (
        torch.empty(x.shape, dtype=out_dtype, device=dev)
        if out_dtype is not None
        else _nothing(x.dtype, dev)
    )
    q = _quant_outputs(x.shape, dev, quant, fp8_dtype, rowwise, columnwise)
    mean = torch.empty(rows if kind == "layernorm" else 0, dtype=torch.float32, device=dev)
    rstd = torch.empty(rows, dtype=torch.float32, device=dev)
    return (y, *q, mean, rstd)


def _norm_fwd_checks(
    op: str,
    x: torch.Tensor,
    gamma: torch.Tensor,
    beta: torch.Tensor | None,
    eps: float,
    kind: str,
    out_dtype: torch.dtype | None,
    quant: str,
    fp8_dtype: torch.dtype,
    scale: torch.Tensor | None,
    rowwise: bool,
    columnwise: bool,
) -> tuple[int, int]:
    _check_tensor(op, "x", x, HIGH_PRECISION_DTYPES)
    rows, cols = _matrix_shape(op, x)
    _check_choice(op, "kind", kind, NORM_KINDS)
    _check_vector(op, "gamma", gamma, cols, x.device)
    if beta is not None:
        if kind != "layernorm":
            raise ValueError(f"fusible.{op}: argument 'beta' must be None for kind='rmsnorm'")
        _check_vector(op, "beta", beta, cols, x.device)
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"fusible.{op}: argument 'eps' must be finite and >= 0, got {eps}")
    if cols == 0:
        raise ValueError(f"fusible.{op}: argument 'x' must have a non-empty last dimension")
    _check_opt_out_dtype(op, out_dtype)
    _check_quant_args(op, quant, fp8_dtype, scale, rowwise, columnwise, x.device)
    return rows, cols


@_custom_op("norm_fwd")
def norm_fwd(
    x: torch.Tensor,
    gamma: torch.Tensor,
    beta: torch.Tensor | None,
    eps: float,
    kind: str,
    zero_centered_gamma: bool,
    out_dtype: torch.dtype | None,
    quant: str,
    fp8_dtype: torch.dtype,
    scale: torch.Tensor | None,
    rowwise: bool,
    columnwise: bool,
) -> tuple[
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
    torch.Tensor,
]:
    """LayerNorm / RMSNorm over the last dimension with optional high-precision and quantized
    outputs, in one pass (normalization.h).

    ``y = (x - mean) * rstd * w + beta`` (LayerNorm) or ``x * rstd * w`` (RMSNorm), with
    ``w = 1 + gamma`` if ``zero_centered_gamma`` else ``gamma``; statistics in fp32.
    Returns ``(y, q_data, q_data_t_or_col, q_scale_inv_or_mx_scale, q_col_scale, amax, mean,
    rstd)``: ``y`` in ``out_dtype`` (empty if None), the quantized output (see above; computed from
    ``y`` rounded to ``out_dtype``, or to ``x.dtype`` when ``out_dtype`` is None), ``mean``
    (LayerNorm; empty for RMSNorm) and ``rstd`` float32 of shape ``(rows,)``.
    """
    op = "norm_fwd"
    rows, cols = _norm_fwd_checks(
        op, x, gamma, beta, eps, kind, out_dtype, quant, fp8_dtype, scale, rowwise, columnwise
    )
    outs = _norm_fwd_outputs(x, kind, out_dtype, quant, fp8_dtype, rowwise, columnwise)
    y, mean, rstd = outs[0], outs[6], outs[7]
    q = _quantized_struct(quant, fp8_dtype, rows, cols, outs[1:6], scale)  # type: ignore[arg-type]
    _c_call(
        op, _C.norm_forward, _NORM_CODE[kind], _mat(x, rows, cols), _mat(gamma, 1, cols),
        None if beta is None else _mat(beta, 1, cols), float(eps), bool(zero_centered_gamma),
        None if out_dtype is None else _mat(y, rows, cols), q, _ptr(mean), _ptr(rstd), _ctx(x),
    )  # fmt: skip
    return outs  # type: ignore[return-value]


@norm_fwd.register_fake
def _(
    x,
    gamma,
    beta,
    eps,
    kind,
    zero_centered_gamma,
    out_dtype,
    quant,
    fp8_dtype,
    scale,
    rowwise,
    columnwise,
):
    for name, t in (("gamma", gamma), ("beta", beta), ("scale", scale)):
        if t is not None:
            _check_same_device("norm_fwd", name, t, x.device)
    _check_choice("norm_fwd", "kind", kind, NORM_KINDS)
    _check_choice("norm_fwd", "quant", quant, QUANT_MODES)
    return _norm_fwd_outputs(x, kind, out_dtype, quant, fp8_dtype, rowwise, columnwise)


def _norm_bwd_outputs(
    dy: torch.Tensor, gamma: torch.Tensor, kind: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx = torch.empty(dy.shape, dtype=dy.dtype, device=dy.device)
    dgamma = torch.empty(gamma.shape, dtype=gamma.dtype, device=dy.device)
    dbeta = torch.empty(
        gamma.shape if kind == "layernorm" else (0,), dtype=gamma.dtype, device=dy.device
    )
    return dx, dgamma, dbeta


@_custom_op("norm_bwd")
def norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    gamma: torch.Tensor,
    kind: str,
    zero_centered_gamma: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Backward of norm_fwd: ``(dx, dgamma, dbeta)``. ``dx`` has ``dy``'s dtype; ``dgamma`` and
    ``dbeta`` (LayerNorm; empty for RMSNorm) have ``gamma``'s, accumulated in fp32. ``mean`` and
    ``rstd`` are norm_fwd's (``mean`` is ignored for RMSNorm)."""
    op = "norm_bwd"
    _check_tensor(op, "dy", dy, HIGH_PRECISION_DTYPES)
    rows, cols = _matrix_shape(op, dy, "dy")
    _check_tensor(op, "x", x, HIGH_PRECISION_DTYPES, dy.device)
    if x.shape != dy.shape:
        raise ValueError(
            f"fusible.{op}: argument 'x' has shape {tuple(x.shape)}, expected dy's "
            f"{tuple(dy.shape)}"
        )
    _check_choice(op, "kind", kind, NORM_KINDS)
    if cols == 0:
        raise ValueError(f"fusible.{op}: argument 'dy' must have a non-empty last dimension")
    _check_vector(op, "gamma", gamma, cols, dy.device)
    if kind == "layernorm":
        _check_stats(op, "mean", mean, rows, dy.device)
    _check_stats(op, "rstd", rstd, rows, dy.device)
    dx, dgamma, dbeta = _norm_bwd_outputs(dy, gamma, kind)
    ctx = _ctx(dy)
    ws_bytes = _C.norm_backward_workspace_size(rows, cols, ctx)
    ws = torch.empty(ws_bytes, dtype=torch.uint8, device=dy.device)
    _c_call(
        op, _C.norm_backward, _NORM_CODE[kind], _mat(dy, rows, cols), _mat(x, rows, cols),
        _ptr(mean) if kind == "layernorm" else 0, _ptr(rstd), _mat(gamma, 1, cols),
        bool(zero_centered_gamma), _mat(dx, rows, cols), _mat(dgamma, 1, cols),
        _mat(dbeta, 1, cols) if kind == "layernorm" else None, _ptr(ws), ws_bytes, ctx,
    )  # fmt: skip
    return dx, dgamma, dbeta


@norm_bwd.register_fake
def _(dy, x, mean, rstd, gamma, kind, zero_centered_gamma):
    for name, t in (("x", x), ("mean", mean), ("rstd", rstd), ("gamma", gamma)):
        _check_same_device("norm_bwd", name, t, dy.device)
    _check_choice("norm_bwd", "kind", kind, NORM_KINDS)
    return _norm_bwd_outputs(dy, gamma, kind)


# ---- act_fwd / act_bwd --------------------------------------------------------------------------


def _act_out_shape(op: str, x: torch.Tensor, kind: str) -> tuple[int, ...]:
    """Forward output shape: x's, with the last dimension halved for the gated kinds."""
    if x.dim() == 0:
        raise ValueError(f"fusible.{op}: argument 'x' must have at least one dimension")
    k = x.shape[-1]
    if kind in _GATED:
        if k % 2 or k == 0:
            raise ValueError(
                f"fusible.{op}: argument 'x' must have an even, non-zero last dimension for "
                f"kind={kind!r} ([a | b] = 2H), got {k}"
            )
        return (*x.shape[:-1], k // 2)
    return tuple(x.shape)


def _act_fwd_outputs(
    x: torch.Tensor,
    kind: str,
    out_dtype: torch.dtype | None,
    quant: str,
    fp8_dtype: torch.dtype,
    rowwise: bool,
    columnwise: bool,
) -> tuple[torch.Tensor, ...]:
    shape = _act_out_shape("act_fwd", x, kind)
    y = (
        torch.empty(shape, dtype=out_dtype, device=x.device)
        if out_dtype is not None
        else _nothing(x.dtype, x.device)
    )
    return (y, *_quant_outputs(shape, x.device, quant, fp8_dtype, rowwise, columnwise))


@_custom_op("act_fwd")
def act_fwd(
    x: torch.Tensor,
    kind: str,
    out_dtype: torch.dtype | None,
    quant: str,
    fp8_dtype: torch.dtype,
    scale: torch.Tensor | None,
    rowwise: bool,
    columnwise: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Activation forward with optional high-precision and quantized outputs, one pass
    (activation.h). ``kind``: gelu (tanh approximation), gelu_erf, relu, silu, swiglu
    (``silu(a) * b``), geglu (``gelu(a) * b``), where ``x = [a | b]`` along the last dimension for
    the gated kinds. Returns ``(y, q_data, q_data_t_or_col, q_scale_inv_or_mx_scale, q_col_scale,
    amax)``; the quantized output is computed from ``y`` rounded to ``out_dtype`` (or to
    ``x.dtype`` when ``out_dtype`` is None)."""
    op = "act_fwd"
    _check_tensor(op, "x", x, HIGH_PRECISION_DTYPES)
    _check_choice(op, "kind", kind, ACTIVATIONS)
    shape = _act_out_shape(op, x, kind)
    _check_opt_out_dtype(op, out_dtype)
    _check_quant_args(op, quant, fp8_dtype, scale, rowwise, columnwise, x.device)
    if out_dtype is None and quant == "none":
        raise ValueError(f"fusible.{op}: nothing to compute: out_dtype is None and quant='none'")
    if x.shape[-1] == 0:
        raise ValueError(f"fusible.{op}: argument 'x' must have a non-empty last dimension")
    rows, k = _matrix_shape(op, x)
    h = shape[-1]
    outs = _act_fwd_outputs(x, kind, out_dtype, quant, fp8_dtype, rowwise, columnwise)
    q = _quantized_struct(quant, fp8_dtype, rows, h, outs[1:6], scale)  # type: ignore[arg-type]
    _c_call(
        op, _C.activation_forward, _ACT_CODE[kind], _mat(x, rows, k),
        None if out_dtype is None else _mat(outs[0], rows, h), q, _ctx(x),
    )  # fmt: skip
    return outs  # type: ignore[return-value]


@act_fwd.register_fake
def _(x, kind, out_dtype, quant, fp8_dtype, scale, rowwise, columnwise):
    if scale is not None:
        _check_same_device("act_fwd", "scale", scale, x.device)
    _check_choice("act_fwd", "kind", kind, ACTIVATIONS)
    _check_choice("act_fwd", "quant", quant, QUANT_MODES)
    return _act_fwd_outputs(x, kind, out_dtype, quant, fp8_dtype, rowwise, columnwise)


def _act_bwd_outputs(
    grad: torch.Tensor,
    x: torch.Tensor,
    out_dtype: torch.dtype | None,
    quant: str,
    fp8_dtype: torch.dtype,
    rowwise: bool,
    columnwise: bool,
    with_dbias: bool,
) -> tuple[torch.Tensor, ...]:
    dev = x.device
    dt = out_dtype if out_dtype is not None else grad.dtype
    dx = (
        torch.empty(x.shape, dtype=out_dtype, device=dev)
        if out_dtype is not None
        else _nothing(grad.dtype, dev)
    )
    q = _quant_outputs(x.shape, dev, quant, fp8_dtype, rowwise, columnwise)
    dbias = torch.empty(x.shape[-1] if with_dbias else 0, dtype=dt, device=dev)
    return (dx, *q, dbias)


@_custom_op("act_bwd")
def act_bwd(
    grad: torch.Tensor,
    x: torch.Tensor,
    kind: str,
    out_dtype: torch.dtype | None,
    quant: str,
    fp8_dtype: torch.dtype,
    scale: torch.Tensor | None,
    rowwise: bool,
    columnwise: bool,
    with_dbias: bool,
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor
]:
    """Activation backward ("dact + dbias + cast"): ``dx = grad * act'(x)`` (gated: ``[da | db]``,
    shaped like ``x``), with optional high-precision (``out_dtype``) and quantized outputs and
    ``dbias`` = column sums of ``dx`` (fp32 accumulation of the rounded values; dtype
    ``out_dtype``, or ``grad.dtype`` when None). Returns ``(dx, q_data, q_data_t_or_col,
    q_scale_inv_or_mx_scale, q_col_scale, amax, dbias)``. For a gated kind, an MXFP8 rowwise copy
    needs H % 32 == 0."""
    op = "act_bwd"
    _check_tensor(op, "grad", grad, HIGH_PRECISION_DTYPES)
    _check_tensor(op, "x", x, HIGH_PRECISION_DTYPES, grad.device)
    _check_choice(op, "kind", kind, ACTIVATIONS)
    shape = _act_out_shape(op, x, kind)
    if tuple(grad.shape) != shape:
        raise ValueError(
            f"fusible.{op}: argument 'grad' has shape {tuple(grad.shape)}, expected {shape} "
            f"(the forward output's shape for x of shape {tuple(x.shape)}, kind={kind!r})"
        )
    _check_opt_out_dtype(op, out_dtype)
    _check_quant_args(op, quant, fp8_dtype, scale, rowwise, columnwise, grad.device)
    if out_dtype is None and quant == "none" and not with_dbias:
        raise ValueError(
            f"fusible.{op}: nothing to compute: out_dtype is None, quant='none' and with_dbias "
            "is False"
        )
    if x.shape[-1] == 0:
        raise ValueError(f"fusible.{op}: argument 'x' must have a non-empty last dimension")
    rows, k = _matrix_shape(op, x)
    h = shape[-1]
    outs = _act_bwd_outputs(grad, x, out_dtype, quant, fp8_dtype, rowwise, columnwise, with_dbias)
    dx, dbias = outs[0], outs[6]
    q = _quantized_struct(quant, fp8_dtype, rows, k, outs[1:6], scale)  # type: ignore[arg-type]
    ctx = _ctx(grad)
    ws_bytes = _C.activation_backward_workspace_size(rows, k, ctx) if with_dbias else 0
    ws = torch.empty(ws_bytes, dtype=torch.uint8, device=grad.device)
    _c_call(
        op, _C.activation_backward, _ACT_CODE[kind], _mat(grad, rows, h), _mat(x, rows, k),
        None if out_dtype is None else _mat(dx, rows, k), q,
        _mat(dbias, 1, k) if with_dbias else None, _ptr(ws), ws_bytes, ctx,
    )  # fmt: skip
    return outs  # type: ignore[return-value]


@act_bwd.register_fake
def _(grad, x, kind, out_dtype, quant, fp8_dtype, scale, rowwise, columnwise, with_dbias):
    for name, t in (("x", x), ("scale", scale)):
        if t is not None:
            _check_same_device("act_bwd", name, t, grad.device)
    _check_choice("act_bwd", "kind", kind, ACTIVATIONS)
    _check_choice("act_bwd", "quant", quant, QUANT_MODES)
    return _act_bwd_outputs(grad, x, out_dtype, quant, fp8_dtype, rowwise, columnwise, with_dbias)
