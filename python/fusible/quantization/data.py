"""Quantized data containers: plain frozen dataclasses of tensors, the pytree nodes that flow
through the framework.

* :class:`Float8Data` -- per-tensor FP8: ``data`` (``x``'s shape), ``data_t`` (the transposed
  matrix ``[k, rows]``, what a GEMM needs for the other operand layout), ``scale_inv``;
* :class:`MXFP8Data` -- MXFP8: rowwise ``data`` + E8M0 ``scale`` ``[rows, ceil(k/32)]`` and
  columnwise ``col_data`` (``x``'s shape, blocks run down columns) + ``col_scale``
  ``[ceil(rows/32), k]``;
* :class:`Float8BlockData` -- blockwise FP8 (1x128 or 128x128 blocks, fp32 scales): rowwise
  ``data`` + ``scale_inv`` and the transposed ``data_t`` ``[k, rows]`` + ``col_scale_inv``.

The quantizers that make them are in :mod:`fusible.quantization.quantizers`; the user-facing
tensor subclass that wraps them in :mod:`fusible.quantization.tensor`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, TypeVar

import torch
import torch.utils._pytree as pytree

from fusible import _kernels as _ops  # torch.ops.fusible.*
from fusible._kernels import FP8_DTYPES, HIGH_PRECISION_DTYPES

__all__ = [
    "Float8BlockData",
    "Float8Data",
    "MXFP8Data",
    "QuantizedData",
    "qdata_tensors",
    "same_layout",
]


def _nbytes(*ts: torch.Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def _check_fp8_dtype(owner: str, dtype: object) -> None:
    if dtype not in FP8_DTYPES:
        raise TypeError(
            f"{owner}: 'dtype' must be torch.float8_e4m3fn or torch.float8_e5m2, got {dtype!r}"
        )


def _check_out_dtype(owner: str, dtype: object) -> None:
    if dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(
            f"{owner}: 'dtype' must be torch.float32, torch.float16 or torch.bfloat16, "
            f"got {dtype!r}"
        )


def _check_copies(owner: str, d: Any, row: str, col: str, scales: tuple[str, str] | None) -> None:
    """A container's copies ``row`` and ``col`` (field names): with ``scales`` (the fields of
    their scales) each copy present with its scale or neither; at least one copy present."""
    if scales is not None:
        rs, cs = scales
        if (getattr(d, row) is None) != (getattr(d, rs) is None) or (getattr(d, col) is None) != (
            getattr(d, cs) is None
        ):
            raise ValueError(f"{owner}: each copy needs both its data and its {rs}")
    if getattr(d, row) is None and getattr(d, col) is None:
        raise ValueError(f"{owner}: at least one of '{row}' and '{col}' must be given")


def _check_copy_dtypes(owner: str, d: Any, row: str, col: str) -> None:
    """Each present copy (``row``, ``col``: field names) of the container's ``fp8_dtype``."""
    for name in (row, col):
        t = getattr(d, name)
        if t is not None and t.dtype != d.fp8_dtype:
            raise ValueError(
                f"{owner}: '{name}' has dtype {t.dtype}, expected fp8_dtype {d.fp8_dtype}"
            )


# ---- quantized data containers ------------------------------------------------------------------


_C = TypeVar("_C", bound="_Tensors")


class _Tensors:
    """What every container does with its tensor fields, ``TENSORS`` (in pytree child order;
    the executor packs saved containers by them too)."""

    TENSORS: tuple[str, ...] = ()
    data: torch.Tensor | None  # the rowwise copy, in every container

    @property
    def has_rowwise(self) -> bool:
        return self.data is not None

    @property
    def nbytes(self) -> int:
        """Bytes held by all tensors of this container (its memory footprint)."""
        return _nbytes(*(getattr(self, n) for n in self.TENSORS))

    def _map(self: _C, fn: Any) -> _C:
        """A copy with ``fn`` applied to each tensor present."""
        new = {n: None if (t := getattr(self, n)) is None else fn(t) for n in self.TENSORS}
        # Every subclass is a dataclass; mypy cannot see that through the mixin.
        return replace(self, **new)  # type: ignore[type-var]

    def to(self: _C, device: torch.device | str) -> _C:
        return self._map(lambda t: t.to(device))

    def detach(self: _C) -> _C:
        return self._map(lambda t: t.detach())

    def clone(self: _C) -> _C:
        return self._map(lambda t: t.clone())


@dataclass(frozen=True, eq=False)
class Float8Data(_Tensors):
    """Per-tensor FP8 data: ``x ~= float(data) * scale_inv``.

    ``data``: rowwise copy with the original ``shape`` (None if not produced); ``data_t``: the
    transposed matrix ``[k, rows]`` where ``x`` is viewed as ``[rows, k]`` (None if not produced);
    ``scale_inv``: float32 ``(1,)``; ``fp8_dtype``: the FP8 dtype of both copies.
    """

    data: torch.Tensor | None
    data_t: torch.Tensor | None
    scale_inv: torch.Tensor
    fp8_dtype: torch.dtype
    shape: torch.Size

    TENSORS = ("data", "data_t", "scale_inv")

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", torch.Size(self.shape))
        _check_copies("Float8Data", self, "data", "data_t", None)
        _check_copy_dtypes("Float8Data", self, "data", "data_t")

    @classmethod
    def _trusted(
        cls,
        data: torch.Tensor | None,
        data_t: torch.Tensor | None,
        scale_inv: torch.Tensor,
        fp8_dtype: torch.dtype,
        shape: torch.Size,
    ) -> Float8Data:
        """A container of a quantize kernel's own outputs, which hold by construction what
        ``__post_init__`` checks (``shape`` a ``torch.Size``, the copies of ``fp8_dtype``):
        built without the dataclass machinery, on every cast of the hot path."""
        if torch.compiler.is_dynamo_compiling():
            # dynamo (torch 2.11) cannot trace a frozen dataclass's __dict__: the checked way.
            # (is_dynamo_compiling: one call eagerly; dynamo folds it to True, as it does
            # is_compiling -- torch/_dynamo/variables/torch.py, tracing_state_functions.)
            return cls(data, data_t, scale_inv, fp8_dtype, shape)
        obj = object.__new__(cls)
        obj.__dict__.update(
            data=data, data_t=data_t, scale_inv=scale_inv, fp8_dtype=fp8_dtype, shape=shape
        )
        return obj

    @property
    def device(self) -> torch.device:
        return self.scale_inv.device

    @property
    def has_columnwise(self) -> bool:
        return self.data_t is not None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Exact dequantization ``float(q) * scale_inv`` rounded to ``dtype``, in ``shape``."""
        _check_out_dtype("Float8Data.dequantize", dtype)
        if self.data is not None:
            return _ops.dequantize_fp8(self.data, self.scale_inv, dtype)
        assert self.data_t is not None
        out_t = _ops.dequantize_fp8(self.data_t, self.scale_inv, dtype)
        return out_t.t().reshape(self.shape)


@dataclass(frozen=True, eq=False)
class MXFP8Data(_Tensors):
    """MXFP8 data: ``x ~= float(q) * 2**(s - 127)`` per 32-element block.

    ``data`` / ``scale``: rowwise copy (``x``'s shape) and its E8M0 scales ``[rows, ceil(k/32)]``
    (uint8); ``col_data`` / ``col_scale``: columnwise copy (also ``x``'s shape) and its scales
    ``[ceil(rows/32), k]``. Either pair may be None.
    """

    data: torch.Tensor | None
    scale: torch.Tensor | None
    col_data: torch.Tensor | None
    col_scale: torch.Tensor | None
    fp8_dtype: torch.dtype
    shape: torch.Size

    TENSORS = ("data", "scale", "col_data", "col_scale")

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", torch.Size(self.shape))
        _check_copies("MXFP8Data", self, "data", "col_data", ("scale", "col_scale"))
        _check_copy_dtypes("MXFP8Data", self, "data", "col_data")

    @property
    def device(self) -> torch.device:
        t = self.data if self.data is not None else self.col_data
        assert t is not None
        return t.device

    @property
    def has_columnwise(self) -> bool:
        return self.col_data is not None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Exact dequantization of the rowwise copy (else the columnwise one), to ``dtype``."""
        _check_out_dtype("MXFP8Data.dequantize", dtype)
        if self.data is not None:
            assert self.scale is not None
            return _ops.dequantize_mxfp8(self.data, self.scale, False, dtype)
        assert self.col_data is not None and self.col_scale is not None
        return _ops.dequantize_mxfp8(self.col_data, self.col_scale, True, dtype)


@dataclass(frozen=True, eq=False)
class Float8BlockData(_Tensors):
    """Blockwise FP8 data: ``x ~= float(q) * scale_inv`` of the element's block.

    ``block_dim`` 1: 1x128 blocks along the rows of each copy; 2: 128x128 blocks. Each copy is a
    matrix ``[R, C]`` whose blocks run along its rows: ``data`` (``x``'s shape, viewed as
    ``[rows, k]``) with ``scale_inv``, and ``data_t`` (``[k, rows]``, the transpose, so its 1x128
    blocks run down the columns of ``x``) with ``col_scale_inv``. Scale layouts of a copy
    ``[R, C]`` (float32): 1D ``[ceil(C/128), R]`` (R contiguous: cuBLASLt's layout), 2D
    ``[ceil(R/128), ceil(C/128)]``. Either pair may be None.
    """

    data: torch.Tensor | None
    scale_inv: torch.Tensor | None
    data_t: torch.Tensor | None
    col_scale_inv: torch.Tensor | None
    fp8_dtype: torch.dtype
    shape: torch.Size
    block_dim: int

    TENSORS = ("data", "scale_inv", "data_t", "col_scale_inv")

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", torch.Size(self.shape))
        _check_copies("Float8BlockData", self, "data", "data_t", ("scale_inv", "col_scale_inv"))
        if self.block_dim not in (1, 2):
            raise ValueError(f"Float8BlockData: 'block_dim' must be 1 or 2, got {self.block_dim!r}")
        _check_copy_dtypes("Float8BlockData", self, "data", "data_t")

    @property
    def device(self) -> torch.device:
        t = self.data if self.data is not None else self.data_t
        assert t is not None
        return t.device

    @property
    def has_columnwise(self) -> bool:
        return self.data_t is not None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Exact dequantization of the rowwise copy (else of the columnwise one, transposed back),
        rounded to ``dtype``, in ``shape``."""
        _check_out_dtype("Float8BlockData.dequantize", dtype)
        if self.data is not None:
            return _ops.dequantize_fp8_block(self.data, self.scale_inv, self.block_dim, dtype)
        out_t = _ops.dequantize_fp8_block(self.data_t, self.col_scale_inv, self.block_dim, dtype)
        return out_t.t().reshape(self.shape)


QuantizedData = Float8Data | MXFP8Data | Float8BlockData


# The containers are pytree nodes (their tensors are the children), so that code flattening
# saved state -- the ops' autograd function passing what backward needs through
# save_for_backward -- sees the quantized tensors themselves: saved-tensor hooks such as
# activation checkpointing then free and recompute them like any other activation.
def _flatten_float8(d: Float8Data) -> tuple[list[Any], Any]:
    return [d.data, d.data_t, d.scale_inv], (d.fp8_dtype, tuple(d.shape))


def _unflatten_float8(children: Any, context: Any) -> Float8Data:
    data, data_t, scale_inv = children
    return Float8Data(data, data_t, scale_inv, context[0], torch.Size(context[1]))


def _flatten_mxfp8(d: MXFP8Data) -> tuple[list[Any], Any]:
    return [d.data, d.scale, d.col_data, d.col_scale], (d.fp8_dtype, tuple(d.shape))


def _unflatten_mxfp8(children: Any, context: Any) -> MXFP8Data:
    data, scale, col_data, col_scale = children
    return MXFP8Data(data, scale, col_data, col_scale, context[0], torch.Size(context[1]))


def _flatten_block(d: Float8BlockData) -> tuple[list[Any], Any]:
    children = [d.data, d.scale_inv, d.data_t, d.col_scale_inv]
    return children, (d.fp8_dtype, tuple(d.shape), d.block_dim)


def _unflatten_block(children: Any, context: Any) -> Float8BlockData:
    data, scale_inv, data_t, col_scale_inv = children
    dtype, shape, block_dim = context
    shape = torch.Size(shape)
    return Float8BlockData(data, scale_inv, data_t, col_scale_inv, dtype, shape, block_dim)


pytree.register_pytree_node(Float8Data, _flatten_float8, _unflatten_float8)
pytree.register_pytree_node(MXFP8Data, _flatten_mxfp8, _unflatten_mxfp8)
pytree.register_pytree_node(Float8BlockData, _flatten_block, _unflatten_block)


def qdata_tensors(qdata: QuantizedData) -> dict[str, torch.Tensor]:
    """A container's tensors by field name, in field order (absent copies left out)."""
    out = {}
    for f in fields(qdata):
        t = getattr(qdata, f.name)
        if isinstance(t, torch.Tensor):
            out[f.name] = t
    return out


def same_layout(a: QuantizedData, b: QuantizedData) -> bool:
    """Same container type, same copies, and their tensors of the same shapes and dtypes."""
    ta, tb = qdata_tensors(a), qdata_tensors(b)
    return (
        type(a) is type(b)
        and ta.keys() == tb.keys()
        and all(t.shape == tb[k].shape and t.dtype == tb[k].dtype for k, t in ta.items())
    )
