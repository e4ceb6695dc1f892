"""The quantize family (cpp/include/fusible/quantize.h, cpp/bindings/ops_quantize.cpp).

Per-tensor FP8
--------------
``quantize_fp8(x, scale, fp8_dtype, rowwise, columnwise, amax_into=None, want_amax=True,
keep_scale=False) -> (data, data_t, scale_inv, amax)``
    Cast with a given per-tensor ``scale`` (delayed scaling), one pass: ``data`` has ``x``'s shape,
    ``data_t`` is the transposed matrix ``[k, rows]`` (empty unless ``columnwise``),
    ``scale_inv = 1/scale`` and ``amax = max|x|`` are float32 of shape ``(1,)``. With
    ``amax_into`` (float32, one value, mutated: a delayed-scaling history slot) the kernel
    max-combines ``max|x|`` into it instead (``amax_into = max(amax_into, max|x|)`` on the float
    bits, NaN wins: ``fus_quantized.amax_accumulate``) and the returned ``amax`` is empty.
    ``want_amax=False`` (without ``amax_into``): no amax is taken (no reset, no reduction; a
    cast remade with a scale of before, which records nothing) and the returned ``amax`` is
    empty; the data and ``scale_inv`` are the same bits. ``keep_scale=True`` (only where the
    amax is not returned: with ``amax_into`` or ``want_amax=False``) returns in the ``amax``
    place a float32 ``(1,)`` copy of ``scale`` as the cast read it: what delayed scaling keeps for
    backward's cast again, made by the operator (no clone after it, which a traced graph's
    partitioner could recompute in backward from the scale the step's update changed).
``quantize_fp8_current(x, fp8_dtype, margin, rowwise, columnwise)
-> (data, data_t, scale, scale_inv, amax)``
    Current scaling: amax pass, ``scale = fp8_max / amax / 2**margin``, cast pass.
``dequantize_fp8(data, scale_inv, out_dtype) -> out``
    ``float(data) * scale_inv`` rounded to ``out_dtype``; works for either stored layout.
``transpose_fp8(x) -> out``
    Byte transpose ``[rows, cols] -> [cols, rows]``, bits unchanged: the columnwise copy of a
    per-tensor FP8 tensor from its rowwise copy (the two share one ``scale_inv``).
``compute_amax(x) -> amax``
    ``max|x|`` as float32 of shape ``(1,)`` (NaN if ``x`` holds a NaN).

MXFP8 (OCP MX, 32-element blocks)
---------------------------------
``quantize_mxfp8(x, fp8_dtype, rowwise, columnwise) -> (data, scale, col_data, col_scale)``
    ``data`` has ``x``'s shape with E8M0 ``scale`` ``[rows, ceil(k/32)]`` (blocks along rows);
    ``col_data`` has ``x``'s shape too, with ``col_scale`` ``[ceil(rows/32), k]`` (blocks down
    columns). Unrequested copies are empty.
``dequantize_mxfp8(data, scale, columnwise, out_dtype) -> out``
    ``columnwise`` says whether ``scale`` runs down columns.

Blockwise FP8 (1x128 / 128x128 blocks, fp32 scales)
---------------------------------------------------
Each copy is a matrix ``[R, C]`` scaled in blocks along its rows (``C`` is its GEMM's K): the
rowwise copy ``data`` (``x``'s shape, ``[rows, k]``) and the columnwise copy ``data_t``
(``[k, rows]``, the transpose). Scales of a copy ``[R, C]`` (``block_scale_shape``):
``block_dim=1`` (1x128) ``[ceil(C/128), R]`` (R contiguous, cuBLASLt's layout); ``block_dim=2``
(128x128) ``[ceil(R/128), ceil(C/128)]``.

``quantize_fp8_block(x, fp8_dtype, block_dim, power_2_scale, amax_epsilon, rowwise, columnwise)
-> (data, scale_inv, data_t, col_scale_inv)``
    Both copies in one pass; unrequested copies are empty.
``dequantize_fp8_block(data, scale_inv, block_dim, out_dtype) -> out``
    Either copy (its own ``[R, C]`` and scale layout).

Grouped (MoE experts; fus_quantize_grouped)
-------------------------------------------
``grouped_quantize_fp8(x, m_splits, scales, fp8_dtype, margin, rowwise, columnwise)
-> (data, data_t, scale_inv, amax, scale)``
    Per-tensor FP8 casts of every group (the groups of ``fusible._kernels``' docstring), each the
    bits ``quantize_fp8`` (``scales`` given: float32 ``[G]``, delayed scaling) or
    ``quantize_fp8_current`` (``scales`` None, with ``margin``) makes for that group: lists
    ``data`` (the group's shape), ``data_t`` (``[k, rows_g]``) and ``scale_inv`` (``(1,)`` each);
    ``amax`` float32 ``[G]``; ``scale`` ``[G]`` (current scaling; empty for delayed). On CUDA a
    constant number of launches for all groups. (No ``amax_into``: torch's functionalization
    takes no mutating operator that returns lists, so the caller folds ``amax`` into the history
    with one strided maximum; the C API can accumulate, ``fus_quantized.amax_accumulate``.)
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from fusible._kernels._common import (
    _FUS_DTYPES,
    _LIBRARY,
    FP8_DTYPES,
    _block_outputs,
    _check_same_device,
    _fake,
    _fp8_copies,
    _group_mats,
    _matrix_shape,
    _mx_copies,
    _ops,
)


def _fp8_maxes(library: str) -> dict[torch.dtype, float]:
    """Largest finite value of each FP8 dtype, read from the core library (``fus_fp8_max``)."""
    lib = ctypes.CDLL(library)
    lib.fus_fp8_max.argtypes = [ctypes.c_int]
    lib.fus_fp8_max.restype = ctypes.c_float
    return {dt: float(lib.fus_fp8_max(_FUS_DTYPES.index(dt))) for dt in FP8_DTYPES}


_FP8_MAX = _fp8_maxes(_LIBRARY)

# The operators (OpOverloads: what eager code, dynamo and the fake-tensor machinery all call).
quantize_fp8: Any = _ops.quantize_fp8.default
quantize_fp8_current: Any = _ops.quantize_fp8_current.default
dequantize_fp8: Any = _ops.dequantize_fp8.default
transpose_fp8: Any = _ops.transpose_fp8.default
compute_amax: Any = _ops.compute_amax.default
quantize_mxfp8: Any = _ops.quantize_mxfp8.default
dequantize_mxfp8: Any = _ops.dequantize_mxfp8.default
quantize_fp8_block: Any = _ops.quantize_fp8_block.default
dequantize_fp8_block: Any = _ops.dequantize_fp8_block.default
grouped_quantize_fp8: Any = _ops.grouped_quantize_fp8.default


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype."""
    if dtype not in _FP8_MAX:
        raise TypeError(f"fp8_max: expected one of {FP8_DTYPES}, got {dtype}")
    return _FP8_MAX[dtype]


# ---- shapes under fake tensors (see _common) ----------------------------------------------------


def _fp8_outputs(
    op: str, x: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool, columnwise: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    _matrix_shape(op, x)
    return _fp8_copies(x.shape, x.device, fp8_dtype, rowwise, columnwise)


def _transpose_shape(op: str, x: torch.Tensor) -> tuple[int, int]:
    if x.dim() != 2:
        raise ValueError(
            f"fusible.{op}: argument 'x' must be a 2-D matrix [rows, cols], got shape "
            f"{tuple(x.shape)}"
        )
    return x.shape[0], x.shape[1]


def _dequantize_fake(op: str, scale_name: str) -> Any:
    """The fake kernel of a dequantize operator ``op(data, <scale_name>, *mode, out_dtype)``: an
    ``out_dtype`` tensor of ``data``'s shape."""

    def fake(data: torch.Tensor, scale: torch.Tensor, *args: Any) -> torch.Tensor:
        _check_same_device(op, scale_name, scale, data.device)
        return torch.empty(data.shape, dtype=args[-1], device=data.device)

    return _fake(op)(fake)


@_fake("quantize_fp8")
def _quantize_fp8_fake(
    x, scale, fp8_dtype, rowwise, columnwise, amax_into=None, want_amax=True, keep_scale=False
):
    _check_same_device("quantize_fp8", "scale", scale, x.device)
    if keep_scale and amax_into is None and want_amax:
        raise ValueError("fusible.quantize_fp8: argument 'keep_scale' needs the amax not returned "
                         "(amax_into given, or want_amax=False): the fourth output is the scale's "
                         "copy then")  # fmt: skip
    data, data_t = _fp8_outputs("quantize_fp8", x, fp8_dtype, rowwise, columnwise)
    if amax_into is not None:  # accumulated into amax_into: the returned amax is empty
        if not want_amax:
            raise ValueError("fusible.quantize_fp8: argument 'want_amax' must be True when "
                             "amax_into is given (it is the amax)")  # fmt: skip
        _check_same_device("quantize_fp8", "amax_into", amax_into, x.device)
        return data, data_t, scale.new_empty(1), scale.new_empty(1 if keep_scale else 0)
    return data, data_t, scale.new_empty(1), scale.new_empty(1 if want_amax or keep_scale else 0)


@_fake("quantize_fp8_current")
def _quantize_fp8_current_fake(x, fp8_dtype, margin, rowwise, columnwise):
    data, data_t = _fp8_outputs("quantize_fp8_current", x, fp8_dtype, rowwise, columnwise)
    one = torch.empty(1, dtype=torch.float32, device=x.device)
    return data, data_t, one, one.clone(), one.clone()


_dequantize_fp8_fake = _dequantize_fake("dequantize_fp8", "scale_inv")


@_fake("transpose_fp8")
def _transpose_fp8_fake(x):
    rows, cols = _transpose_shape("transpose_fp8", x)
    return x.new_empty((cols, rows))


@_fake("compute_amax")
def _compute_amax_fake(x):
    return torch.empty(1, dtype=torch.float32, device=x.device)


@_fake("quantize_mxfp8")
def _quantize_mxfp8_fake(x, fp8_dtype, rowwise, columnwise):
    _matrix_shape("quantize_mxfp8", x)
    return _mx_copies(x.shape, x.device, fp8_dtype, rowwise, columnwise)


_dequantize_mxfp8_fake = _dequantize_fake("dequantize_mxfp8", "scale")


@_fake("quantize_fp8_block")
def _quantize_fp8_block_fake(x, fp8_dtype, block_dim, power_2_scale, amax_epsilon, rowwise,
                             columnwise):  # fmt: skip
    _matrix_shape("quantize_fp8_block", x)
    return _block_outputs(x.shape, x.device, fp8_dtype, block_dim, rowwise, columnwise)


_dequantize_fp8_block_fake = _dequantize_fake("dequantize_fp8_block", "scale_inv")


@_fake("grouped_quantize_fp8")
def _grouped_quantize_fp8_fake(x, m_splits, scales, fp8_dtype, margin, rowwise, columnwise):
    op = "grouped_quantize_fp8"
    mats = _group_mats(op, "x", x, m_splits)
    dev = x[0].device
    if scales is not None:
        _check_same_device(op, "scales", scales, dev)
    if fp8_dtype not in FP8_DTYPES:
        raise TypeError(
            f"fusible.{op}: argument 'fp8_dtype' must be torch.float8_e4m3fn or "
            f"torch.float8_e5m2, got {fp8_dtype}"
        )
    if not (rowwise or columnwise):
        raise ValueError(f"fusible.{op}: at least one of 'rowwise' and 'columnwise' must be True")
    g = len(mats)
    data, data_t, scale_inv = [], [], []
    for i, (rows, cols) in enumerate(mats):
        listed = len(m_splits) == 0 or len(x) > 1
        shape = tuple(x[i].shape) if listed and rows == _matrix_shape(op, x[i])[0] else (rows, cols)
        d, dt = _fp8_copies(shape, dev, fp8_dtype, rowwise, columnwise)
        data.append(d)
        data_t.append(dt)
        scale_inv.append(torch.empty(1, dtype=torch.float32, device=dev))
    f32 = torch.float32
    amax = torch.empty(g, dtype=f32, device=dev)
    scale = torch.empty(g if scales is None else 0, dtype=f32, device=dev)
    return data, data_t, scale_inv, amax, scale
