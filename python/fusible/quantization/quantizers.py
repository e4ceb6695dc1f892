"""Quantizers and quantized data.

A quantizer is a plain Python object (not an ``nn.Module``, not a tensor) that casts a
high-precision tensor into a *quantized data container* holding plain tensors:

* :class:`Float8Data` -- per-tensor FP8: ``data`` (``x``'s shape), ``data_t`` (the transposed
  matrix ``[k, rows]``, what a GEMM needs for the other operand layout), ``scale_inv``;
* :class:`MXFP8Data` -- MXFP8: rowwise ``data`` + E8M0 ``scale`` ``[rows, ceil(k/32)]`` and
  columnwise ``col_data`` (``x``'s shape, blocks run down columns) + ``col_scale``
  ``[ceil(rows/32), k]``;
* :class:`Float8BlockData` -- blockwise FP8 (1x128 or 128x128 blocks, fp32 scales): rowwise
  ``data`` + ``scale_inv`` and the transposed ``data_t`` ``[k, rows]`` + ``col_scale_inv``.

Inside the framework these containers (or their tensors) flow, which keeps tracing simple. For a
user who holds quantized tensors (e.g. FP8 weights), :class:`QuantizedTensor` wraps a container in
a ``torch.Tensor`` subclass that dequantizes for any op it does not know.

Usage flags: ``rowwise`` / ``columnwise`` say which copies :meth:`Quantizer.quantize` produces;
they are attributes (``set_usage``) and can be overridden per call.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar, Protocol

import torch
import torch.utils._pytree as pytree
from torch.utils._pytree import tree_map

from fusible import _kernels as _ops  # torch.ops.fusible.*
from fusible._kernels import FP8_DTYPES, HIGH_PRECISION_DTYPES
from fusible.quantization.recipe import (
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    Recipe,
)
from fusible.quantization.roles import QuantizerRole, as_role

__all__ = [
    "Float8BlockData",
    "Float8BlockQuantizer",
    "Float8BlockTensor",
    "Float8CurrentScalingQuantizer",
    "Float8Data",
    "Float8Quantizer",
    "Float8Tensor",
    "MXFP8Data",
    "MXFP8Quantizer",
    "MXFP8Tensor",
    "QuantizedData",
    "QuantizedTensor",
    "Quantizer",
    "ScaleLog",
    "ScalingBuffers",
    "quantizer_for_recipe",
    "replaying_scales",
    "scale_log",
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


# ---- quantized data containers ------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Float8Data:
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

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", torch.Size(self.shape))
        if self.data is None and self.data_t is None:
            raise ValueError("Float8Data: at least one of 'data' and 'data_t' must be given")
        for name in ("data", "data_t"):
            t = getattr(self, name)
            if t is not None and t.dtype != self.fp8_dtype:
                raise ValueError(
                    f"Float8Data: '{name}' has dtype {t.dtype}, expected fp8_dtype {self.fp8_dtype}"
                )

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
        if torch.compiler.is_compiling():
            # dynamo (torch 2.11) cannot trace a frozen dataclass's __dict__: the checked way.
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
    def has_rowwise(self) -> bool:
        return self.data is not None

    @property
    def has_columnwise(self) -> bool:
        return self.data_t is not None

    @property
    def nbytes(self) -> int:
        """Bytes held by all tensors of this container (its memory footprint)."""
        return _nbytes(self.data, self.data_t, self.scale_inv)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Exact dequantization ``float(q) * scale_inv`` rounded to ``dtype``, in ``shape``."""
        _check_out_dtype("Float8Data.dequantize", dtype)
        if self.data is not None:
            return _ops.dequantize_fp8(self.data, self.scale_inv, dtype)
        assert self.data_t is not None
        out_t = _ops.dequantize_fp8(self.data_t, self.scale_inv, dtype)
        return out_t.t().reshape(self.shape)

    def _map(self, fn: Any) -> Float8Data:
        return replace(
            self,
            data=None if self.data is None else fn(self.data),
            data_t=None if self.data_t is None else fn(self.data_t),
            scale_inv=fn(self.scale_inv),
        )

    def to(self, device: torch.device | str) -> Float8Data:
        return self._map(lambda t: t.to(device))

    def detach(self) -> Float8Data:
        return self._map(lambda t: t.detach())

    def clone(self) -> Float8Data:
        return self._map(lambda t: t.clone())


@dataclass(frozen=True, eq=False)
class MXFP8Data:
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

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", torch.Size(self.shape))
        if (self.data is None) != (self.scale is None) or (self.col_data is None) != (
            self.col_scale is None
        ):
            raise ValueError("MXFP8Data: each copy needs both its data and its scale")
        if self.data is None and self.col_data is None:
            raise ValueError("MXFP8Data: at least one of 'data' and 'col_data' must be given")
        for name in ("data", "col_data"):
            t = getattr(self, name)
            if t is not None and t.dtype != self.fp8_dtype:
                raise ValueError(
                    f"MXFP8Data: '{name}' has dtype {t.dtype}, expected fp8_dtype {self.fp8_dtype}"
                )

    @property
    def device(self) -> torch.device:
        t = self.data if self.data is not None else self.col_data
        assert t is not None
        return t.device

    @property
    def has_rowwise(self) -> bool:
        return self.data is not None

    @property
    def has_columnwise(self) -> bool:
        return self.col_data is not None

    @property
    def nbytes(self) -> int:
        """Bytes held by all tensors of this container (its memory footprint)."""
        return _nbytes(self.data, self.scale, self.col_data, self.col_scale)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Exact dequantization of the rowwise copy (else the columnwise one), to ``dtype``."""
        _check_out_dtype("MXFP8Data.dequantize", dtype)
        if self.data is not None:
            assert self.scale is not None
            return _ops.dequantize_mxfp8(self.data, self.scale, False, dtype)
        assert self.col_data is not None and self.col_scale is not None
        return _ops.dequantize_mxfp8(self.col_data, self.col_scale, True, dtype)

    def _map(self, fn: Any) -> MXFP8Data:
        def f(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else fn(t)

        return replace(
            self,
            data=f(self.data),
            scale=f(self.scale),
            col_data=f(self.col_data),
            col_scale=f(self.col_scale),
        )

    def to(self, device: torch.device | str) -> MXFP8Data:
        return self._map(lambda t: t.to(device))

    def detach(self) -> MXFP8Data:
        return self._map(lambda t: t.detach())

    def clone(self) -> MXFP8Data:
        return self._map(lambda t: t.clone())


@dataclass(frozen=True, eq=False)
class Float8BlockData:
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

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", torch.Size(self.shape))
        if (self.data is None) != (self.scale_inv is None) or (self.data_t is None) != (
            self.col_scale_inv is None
        ):
            raise ValueError("Float8BlockData: each copy needs both its data and its scale_inv")
        if self.data is None and self.data_t is None:
            raise ValueError("Float8BlockData: at least one of 'data' and 'data_t' must be given")
        if self.block_dim not in (1, 2):
            raise ValueError(f"Float8BlockData: 'block_dim' must be 1 or 2, got {self.block_dim!r}")
        for name in ("data", "data_t"):
            t = getattr(self, name)
            if t is not None and t.dtype != self.fp8_dtype:
                raise ValueError(
                    f"Float8BlockData: '{name}' has dtype {t.dtype}, expected fp8_dtype "
                    f"{self.fp8_dtype}"
                )

    @property
    def device(self) -> torch.device:
        t = self.data if self.data is not None else self.data_t
        assert t is not None
        return t.device

    @property
    def has_rowwise(self) -> bool:
        return self.data is not None

    @property
    def has_columnwise(self) -> bool:
        return self.data_t is not None

    @property
    def nbytes(self) -> int:
        """Bytes held by all tensors of this container (its memory footprint)."""
        return _nbytes(self.data, self.scale_inv, self.data_t, self.col_scale_inv)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Exact dequantization of the rowwise copy (else of the columnwise one, transposed back),
        rounded to ``dtype``, in ``shape``."""
        _check_out_dtype("Float8BlockData.dequantize", dtype)
        if self.data is not None:
            return _ops.dequantize_fp8_block(self.data, self.scale_inv, self.block_dim, dtype)
        out_t = _ops.dequantize_fp8_block(self.data_t, self.col_scale_inv, self.block_dim, dtype)
        return out_t.t().reshape(self.shape)

    def _map(self, fn: Any) -> Float8BlockData:
        def f(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else fn(t)

        return replace(
            self,
            data=f(self.data),
            scale_inv=f(self.scale_inv),
            data_t=f(self.data_t),
            col_scale_inv=f(self.col_scale_inv),
        )

    def to(self, device: torch.device | str) -> Float8BlockData:
        return self._map(lambda t: t.to(device))

    def detach(self) -> Float8BlockData:
        return self._map(lambda t: t.detach())

    def clone(self) -> Float8BlockData:
        return self._map(lambda t: t.clone())


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


# ---- quantizers ---------------------------------------------------------------------------------


class Quantizer:
    """Base class: casts high-precision tensors into a quantized data container.

    ``dtype``: the FP8 dtype; ``rowwise`` / ``columnwise``: which copies to produce (settable,
    and overridable per :meth:`quantize` call); ``role``: the slot's role when built by a
    RecipeState (informational).
    """

    scaling: ClassVar[str] = "none"

    def __init__(
        self,
        dtype: torch.dtype,
        *,
        rowwise: bool = True,
        columnwise: bool = True,
        role: QuantizerRole | str | None = None,
    ) -> None:
        _check_fp8_dtype(type(self).__name__, dtype)
        self.dtype = dtype
        self.rowwise = bool(rowwise)
        self.columnwise = bool(columnwise)
        self.role: QuantizerRole | None = None if role is None else as_role(role)

    def set_usage(
        self, *, rowwise: bool | None = None, columnwise: bool | None = None
    ) -> Quantizer:
        """Set which copies later ``quantize`` calls produce; returns ``self``."""
        if rowwise is not None:
            self.rowwise = bool(rowwise)
        if columnwise is not None:
            self.columnwise = bool(columnwise)
        return self

    def _usage(self, rowwise: bool | None, columnwise: bool | None) -> tuple[bool, bool]:
        r = self.rowwise if rowwise is None else bool(rowwise)
        c = self.columnwise if columnwise is None else bool(columnwise)
        if not (r or c):
            raise ValueError(
                f"{type(self).__name__}.quantize: at least one of 'rowwise' and 'columnwise' "
                "must be True"
            )
        return r, c

    def _check_input(self, x: object) -> torch.Tensor:
        name = type(self).__name__
        if not isinstance(x, torch.Tensor) or isinstance(x, QuantizedTensor):
            raise TypeError(f"{name}.quantize: 'x' must be a plain torch.Tensor, got {type(x)}")
        if x.dtype not in HIGH_PRECISION_DTYPES:
            raise TypeError(
                f"{name}.quantize: 'x' must be float32, float16 or bfloat16, got {x.dtype}"
            )
        if x.dim() == 0:
            raise ValueError(f"{name}.quantize: 'x' must have at least one dimension, got a scalar")
        return x.contiguous()

    def quantize(
        self, x: torch.Tensor, *, rowwise: bool | None = None, columnwise: bool | None = None
    ) -> QuantizedData:
        """Quantize ``x`` (fp32/fp16/bf16, CPU or CUDA) into a plain data container."""
        raise NotImplementedError

    def quantize_tensor(
        self,
        x: torch.Tensor,
        *,
        rowwise: bool | None = None,
        columnwise: bool | None = None,
        requires_grad: bool = False,
    ) -> QuantizedTensor:
        """Quantize ``x`` into a user-facing :class:`QuantizedTensor` (nominal dtype x.dtype)."""
        q = self.quantize(x, rowwise=rowwise, columnwise=columnwise)
        return QuantizedTensor.wrap(q, dtype=x.dtype, quantizer=self, requires_grad=requires_grad)

    def _repr_extra(self) -> str:
        return ""

    def __repr__(self) -> str:
        role = "" if self.role is None else f", role={self.role.qualified!r}"
        return (
            f"{type(self).__name__}(dtype={self.dtype}, rowwise={self.rowwise}, "
            f"columnwise={self.columnwise}{self._repr_extra()}{role})"
        )


class ScalingBuffers(Protocol):
    """What a :class:`Float8Quantizer` reads and writes: a delayed-scaling state's buffers."""

    amax_history: torch.Tensor  # float32 [history_len, n]
    scale: torch.Tensor  # float32 [n]


class ScaleLog:
    """Delayed-scaling scales read by a checkpointed forward, replayed by its recomputation.

    While a log is *recording* (the forward of a :func:`fusible.checkpoint` region), every read
    of a :class:`Float8Quantizer`'s scale appends a copy to that quantizer's sequence; while it
    is *replaying* (each recomputation in backward, when the step's update has usually changed
    the state), the reads return the sequence in order, and no amax is recorded, so the
    recomputed tensors are the forward's bit for bit. A recomputation runs the forward's code,
    so it reads the scales in the forward's order (a scale updated between two uses inside the
    region replays both values). See ``fusible.quantization.recompute``."""

    def __init__(self) -> None:
        self.scales: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._cursor: dict[tuple[int, int], int] = {}

    def record(self, key: tuple[int, int], value: torch.Tensor) -> None:
        self.scales.setdefault(key, []).append(value.clone())

    def replay(self, key: tuple[int, int], live: torch.Tensor) -> torch.Tensor:
        seq, i = self.scales.get(key, []), self._cursor.get(key, 0)
        if i >= len(seq):
            return live  # not read by the forward (nothing to reproduce)
        self._cursor[key] = i + 1
        return seq[i]

    def rewind(self) -> None:
        self._cursor.clear()


#: Active logs, outermost first, each (log, replaying). Nested checkpoints stack: the innermost
#: replaying log supplies scales; every recording log above records what was used.
_log_stack: list[tuple[ScaleLog, bool]] = []
_dynamo_compiling = torch.compiler.is_dynamo_compiling


class scale_log:
    """Activate ``log`` (recording, or replaying from the start) for the region. Re-enterable:
    torch enters the same recomputation context again for a second backward."""

    def __init__(self, log: ScaleLog, replaying: bool) -> None:
        self.log, self.replaying = log, replaying

    def __enter__(self) -> None:
        if self.replaying:
            self.log.rewind()
        _log_stack.append((self.log, self.replaying))

    def __exit__(self, *exc_info: object) -> None:
        _log_stack.pop()


def replaying_scales() -> bool:
    """True inside a checkpoint recomputation (no amax recording, no state updates)."""
    return bool(_log_stack) and any(replaying for _, replaying in _log_stack)


class _OwnBuffers:
    def __init__(self, amax_history: torch.Tensor, scale: torch.Tensor) -> None:
        self.amax_history = amax_history
        self.scale = scale


class Float8Quantizer(Quantizer):
    """Delayed-scaling FP8 quantizer of slot ``slot`` of a delayed-scaling state.

    Casts with ``buffers.scale[slot]`` (the scale computed at the last update) and records the
    tensor's amax into ``buffers.amax_history[0, slot]`` as a running max (so a quantizer used
    several times before an update records the largest amax; NaN propagates). ``buffers`` is
    read at every call, so moving or reloading the state is seen by its quantizers.
    """

    scaling = "delayed"

    def __init__(
        self,
        buffers: ScalingBuffers,
        slot: int,
        dtype: torch.dtype,
        *,
        rowwise: bool = True,
        columnwise: bool = True,
        role: QuantizerRole | str | None = None,
    ) -> None:
        super().__init__(dtype, rowwise=rowwise, columnwise=columnwise, role=role)
        n = buffers.scale.shape[0]
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < n:
            raise ValueError(f"Float8Quantizer: 'slot' must be an int in [0, {n}), got {slot!r}")
        self.buffers = buffers
        self.slot = slot
        self._views: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def standalone(
        cls,
        dtype: torch.dtype,
        *,
        scale: float = 1.0,
        amax_history_len: int = 1,
        device: torch.device | str | None = None,
        **kwargs: Any,
    ) -> Float8Quantizer:
        """A quantizer with its own one-slot buffers (for tests and manual scaling)."""
        buffers = _OwnBuffers(
            torch.zeros(amax_history_len, 1, dtype=torch.float32, device=device),
            torch.full((1,), scale, dtype=torch.float32, device=device),
        )
        return cls(buffers, 0, dtype, **kwargs)

    @property
    def scale(self) -> torch.Tensor:
        """This slot's current scale, a float32 ``(1,)`` view into the state's buffer (inside a
        checkpoint recomputation: the copy its forward used, see :class:`ScaleLog`)."""
        live = self._slot_view("scale")
        if not _log_stack:
            return live
        key = (id(self.buffers), self.slot)
        value = live
        for log, replaying in reversed(_log_stack):
            if replaying:
                value = log.replay(key, live)
                break
        for log, replaying in _log_stack:
            if not replaying:
                log.record(key, value)
        return value

    def quantize(
        self, x: torch.Tensor, *, rowwise: bool | None = None, columnwise: bool | None = None
    ) -> Float8Data:
        x = self._check_input(x)
        r, c = self._usage(rowwise, columnwise)
        data, data_t, scale_inv, amax = _ops.quantize_fp8(x, self.scale, self.dtype, r, c)
        if not (_log_stack and replaying_scales()):
            # The kernel's amax: float32 (1,) on the state's device (record_amax's fast case).
            seen = self._slot_view("amax_history")
            torch.maximum(seen, amax, out=seen)
        return Float8Data._trusted(
            data if r else None, data_t if c else None, scale_inv, self.dtype, x.shape
        )

    def quantize_with_scale(
        self, x: torch.Tensor, scale: torch.Tensor, *, rowwise: bool, columnwise: bool
    ) -> Float8Data:
        """``x`` cast with ``scale`` -- a float32 ``(1,)`` copy of a scale this quantizer cast
        with before (:attr:`scale` then) -- recording no amax: the bits that cast made, made
        again (how backward remakes the weight copy its forward made, after the step's update
        has changed the state)."""
        x = self._check_input(x)
        data, data_t, scale_inv, _ = _ops.quantize_fp8(x, scale, self.dtype, rowwise, columnwise)
        return Float8Data._trusted(
            data if rowwise else None, data_t if columnwise else None, scale_inv, self.dtype,
            x.shape,
        )  # fmt: skip

    def record_amax(self, amax: torch.Tensor) -> None:
        """Fold ``amax`` (float32, one element) into this step's running max,
        ``amax_history[0, slot]`` -- for casts done by fused kernels with :attr:`scale`. A
        checkpoint recomputation records nothing (its forward did)."""
        if _log_stack and replaying_scales():
            return
        seen = self._slot_view("amax_history")
        if amax.dtype == torch.float32 and amax.shape == (1,) and amax.device == seen.device:
            torch.maximum(seen, amax, out=seen)
        else:
            seen.copy_(torch.maximum(seen, amax.reshape(1).to(seen)))

    def __getstate__(self) -> dict[str, Any]:
        # The slot views are not state: a copy (pickle does not keep a view sharing its base's
        # storage) makes its own from its buffers.
        state = self.__dict__.copy()
        state["_views"] = {}
        return state

    def _slot_view(self, name: str) -> torch.Tensor:
        """This slot's ``(1,)`` view of ``buffers.scale`` / of this step's row of
        ``buffers.amax_history``, made once per buffer tensor (the buffers are read at every
        call: a moved or reloaded state has new tensors, and new views)."""
        buf = getattr(self.buffers, name)
        if _dynamo_compiling():
            # Made in the graph from the buffer: a view cached by eager steps would be a second
            # graph input aliasing the buffer, and AOTAutograd then rebuilds such inputs from a
            # synthetic base at every call (host time). (is_dynamo_compiling: one call eagerly,
            # on every cast of the hot path.)
            return (buf if name == "scale" else buf[0])[self.slot : self.slot + 1]
        cached = self._views.get(name)
        if cached is not None and cached[0] is buf:
            return cached[1]
        view = (buf if name == "scale" else buf[0])[self.slot : self.slot + 1]
        if not torch.compiler.is_compiling():  # traced (make_fx): no state changes
            self._views[name] = (buf, view)
        return view

    def _repr_extra(self) -> str:
        return f", slot={self.slot}"


class Float8CurrentScalingQuantizer(Quantizer):
    """Current-scaling FP8 quantizer: ``scale = fp8_max / amax(x) / 2**margin`` per call."""

    scaling = "current"

    def __init__(
        self,
        dtype: torch.dtype,
        *,
        margin: int = 0,
        rowwise: bool = True,
        columnwise: bool = True,
        role: QuantizerRole | str | None = None,
    ) -> None:
        super().__init__(dtype, rowwise=rowwise, columnwise=columnwise, role=role)
        if isinstance(margin, bool) or not isinstance(margin, int) or margin < 0:
            raise ValueError(
                f"Float8CurrentScalingQuantizer: 'margin' must be an int >= 0, got {margin!r}"
            )
        self.margin = margin

    def quantize(
        self, x: torch.Tensor, *, rowwise: bool | None = None, columnwise: bool | None = None
    ) -> Float8Data:
        x = self._check_input(x)
        r, c = self._usage(rowwise, columnwise)
        data, data_t, _scale, scale_inv, _amax = _ops.quantize_fp8_current(
            x, self.dtype, self.margin, r, c
        )
        return Float8Data._trusted(
            data if r else None, data_t if c else None, scale_inv, self.dtype, x.shape
        )

    def _repr_extra(self) -> str:
        return f", margin={self.margin}"


class MXFP8Quantizer(Quantizer):
    """MXFP8 quantizer (OCP MX v1.0, 32-element blocks, E8M0 scales); stateless."""

    scaling = "mxfp8"

    def quantize(
        self, x: torch.Tensor, *, rowwise: bool | None = None, columnwise: bool | None = None
    ) -> MXFP8Data:
        x = self._check_input(x)
        r, c = self._usage(rowwise, columnwise)
        data, scale, col, col_scale = _ops.quantize_mxfp8(x, self.dtype, r, c)
        if not r:
            data = scale = None
        if not c:
            col = col_scale = None
        return MXFP8Data(data, scale, col, col_scale, self.dtype, x.shape)


class Float8BlockQuantizer(Quantizer):
    """Blockwise FP8 quantizer (``Float8BlockScaling``): ``block_dim`` 1 (1x128 blocks) or 2
    (128x128 blocks), fp32 scale per block (``power_2_scale``, ``amax_epsilon``: see the recipe);
    both copies from one kernel; stateless."""

    scaling = "blockwise"

    def __init__(
        self,
        dtype: torch.dtype,
        *,
        block_dim: int = 1,
        power_2_scale: bool = True,
        amax_epsilon: float = 0.0,
        rowwise: bool = True,
        columnwise: bool = True,
        role: QuantizerRole | str | None = None,
    ) -> None:
        super().__init__(dtype, rowwise=rowwise, columnwise=columnwise, role=role)
        if isinstance(block_dim, bool) or block_dim not in (1, 2):
            raise ValueError(
                f"Float8BlockQuantizer: 'block_dim' must be 1 (1x128) or 2 (128x128), got "
                f"{block_dim!r}"
            )
        if not isinstance(power_2_scale, bool):
            raise ValueError(
                f"Float8BlockQuantizer: 'power_2_scale' must be a bool, got {power_2_scale!r}"
            )
        e = amax_epsilon
        if isinstance(e, bool) or not isinstance(e, (int, float)) or not (0.0 <= e < float("inf")):
            raise ValueError(
                f"Float8BlockQuantizer: 'amax_epsilon' must be a finite float >= 0, got {e!r}"
            )
        self.block_dim = block_dim
        self.power_2_scale = power_2_scale
        self.amax_epsilon = float(e)

    def quantize(
        self, x: torch.Tensor, *, rowwise: bool | None = None, columnwise: bool | None = None
    ) -> Float8BlockData:
        x = self._check_input(x)
        r, c = self._usage(rowwise, columnwise)
        data, scale, data_t, col_scale = _ops.quantize_fp8_block(
            x, self.dtype, self.block_dim, self.power_2_scale, self.amax_epsilon, r, c
        )
        if not r:
            data = scale = None
        if not c:
            data_t = col_scale = None
        return Float8BlockData(data, scale, data_t, col_scale, self.dtype, x.shape, self.block_dim)

    def _repr_extra(self) -> str:
        return (
            f", block_dim={self.block_dim}, power_2_scale={self.power_2_scale}, "
            f"amax_epsilon={self.amax_epsilon}"
        )


def quantizer_for_recipe(
    recipe: Recipe, role: QuantizerRole | str, *, mode: str | None = None
) -> Quantizer:
    """A quantizer of a *stateless* recipe for ``role`` (handy inside quantizer factories).

    The FP8 dtype follows the recipe's format for ``mode`` (``"forward"`` / ``"backward"``);
    without ``mode``, gradient roles (``grad_*``) are backward and all others forward.
    ``DelayedScaling`` needs a RecipeState and raises ``ValueError``.
    """
    role = as_role(role)
    if mode is None:
        mode = "backward" if role.is_gradient else "forward"
    if isinstance(recipe, Float8CurrentScaling):
        return Float8CurrentScalingQuantizer(
            recipe.fp8_format.dtype(mode), margin=recipe.margin, role=role
        )
    if isinstance(recipe, MXFP8BlockScaling):
        return MXFP8Quantizer(recipe.fp8_format.dtype(mode), role=role)
    if isinstance(recipe, Float8BlockScaling):
        return block_quantizer(recipe, role, recipe.fp8_format.dtype(mode), mode)
    raise ValueError(
        f"quantizer_for_recipe: expected a stateless recipe (Float8CurrentScaling, "
        f"MXFP8BlockScaling or Float8BlockScaling), got {type(recipe).__name__}; stateful "
        "recipes need "
        "RecipeState.create"
    )


def block_quantizer(
    recipe: Float8BlockScaling, role: QuantizerRole | None, dtype: torch.dtype, mode: str
) -> Float8BlockQuantizer:
    """The recipe's quantizer for ``role`` with FP8 ``dtype``: the block dimension of its bucket
    (a slot without a role counts as an activation, or in backward as a gradient)."""
    kind = role or QuantizerRole("input" if mode == "forward" else "grad_output", "linear")
    return Float8BlockQuantizer(
        dtype, block_dim=recipe.block_dim(kind), power_2_scale=recipe.power_2_scale,
        amax_epsilon=recipe.amax_epsilon, role=role,
    )  # fmt: skip


# ---- user-facing tensor subclass ----------------------------------------------------------------

_aten = torch.ops.aten


class QuantizedTensor(torch.Tensor):
    """A ``torch.Tensor`` subclass wrapping quantized data, for tensors a *user* holds.

    Its nominal ``dtype`` (the high-precision dtype it stands for) and ``shape`` are those of the
    original tensor. ``detach()``, ``clone()`` and ``.to(device)`` keep it quantized; ``.to(dtype)``
    to another dtype, and every other op, see the exactly dequantized tensor (a plain tensor comes
    back). ``copy_(src)`` re-quantizes ``src`` with the quantizer that made it (an fp32 / fp16 /
    bf16 ``src`` as given, other dtypes through the nominal dtype), producing the copies already
    held, and writes data and scales *in place* into the tensors it holds: references to them
    (saved for backward, captured by a CUDA graph) stay valid. Other in-place ops raise
    ``RuntimeError``. Use :func:`QuantizedTensor.wrap` (or ``Quantizer.quantize_tensor``). It can
    be an ``nn.Parameter`` (see ``fusible.quantized_model_init`` for quantized Linear weights).
    """

    _qdata: QuantizedData
    _quantizer: Quantizer | None

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @staticmethod
    def __new__(
        cls,
        qdata: QuantizedData,
        *,
        dtype: torch.dtype = torch.float32,
        quantizer: Quantizer | None = None,
        requires_grad: bool = False,
    ) -> QuantizedTensor:
        expected = _DATA_OF_TENSOR.get(cls)
        if expected is None or not isinstance(qdata, expected):
            raise TypeError(
                f"{cls.__name__}: expected {getattr(expected, '__name__', 'quantized data')}, "
                f"got {type(qdata).__name__}; use QuantizedTensor.wrap"
            )
        _check_out_dtype(cls.__name__, dtype)
        self = torch.Tensor._make_wrapper_subclass(
            cls, qdata.shape, dtype=dtype, device=qdata.device, requires_grad=requires_grad
        )
        self._qdata = qdata
        self._quantizer = quantizer
        return self

    @staticmethod
    def wrap(
        qdata: QuantizedData,
        *,
        dtype: torch.dtype = torch.float32,
        quantizer: Quantizer | None = None,
        requires_grad: bool = False,
    ) -> QuantizedTensor:
        """Wrap a container: a :class:`Float8Tensor`, :class:`MXFP8Tensor` or
        :class:`Float8BlockTensor`."""
        for cls, data_cls in _DATA_OF_TENSOR.items():
            if isinstance(qdata, data_cls):
                return cls(qdata, dtype=dtype, quantizer=quantizer, requires_grad=requires_grad)
        raise TypeError(
            "QuantizedTensor.wrap: expected Float8Data, MXFP8Data or Float8BlockData, got "
            f"{type(qdata).__name__}"
        )

    @property
    def qdata(self) -> QuantizedData:
        """The wrapped plain-tensor container."""
        return self._qdata

    @property
    def quantizer(self) -> Quantizer | None:
        return self._quantizer

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:  # type: ignore[override]
        """A plain tensor, exactly dequantized to ``dtype`` (default: the nominal dtype)."""
        return self._qdata.dequantize(self.dtype if dtype is None else dtype)

    def memory_footprint(self) -> int:
        """Bytes actually held (quantized copies and scales)."""
        return self._qdata.nbytes

    def load_qdata_(self, qdata: QuantizedData) -> QuantizedTensor:
        """Write ``qdata``'s tensors into the ones this tensor holds, in place (``qdata`` must
        have the same layout: container type, copies, shapes, dtypes); returns ``self``."""
        _copy_into(self._qdata, qdata)
        return self

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        return (
            f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self.dtype}, "
            f"fp8_dtype={self._qdata.fp8_dtype}, device={self.device}, "
            f"rowwise={self._qdata.has_rowwise}, columnwise={self._qdata.has_columnwise})"
        )

    def __reduce_ex__(self, protocol: Any) -> Any:
        # The quantizer (what copy_ re-quantizes with) and parameter-ness travel too.
        is_param = bool(getattr(self, "_is_param", False))
        args = (self._qdata, self.dtype, self.requires_grad, self._quantizer, is_param)
        return (_rebuild_quantized_tensor, args)

    def _same(self, qdata: QuantizedData, dtype: torch.dtype | None = None) -> QuantizedTensor:
        return QuantizedTensor.wrap(
            qdata, dtype=self.dtype if dtype is None else dtype, quantizer=self._quantizer
        )

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        src = args[0] if args else None
        if isinstance(src, QuantizedTensor):
            if func is _aten.detach.default:
                return src._same(src._qdata.detach())
            if func is _aten.clone.default:
                return src._same(src._qdata.clone())
            if func is _aten._to_copy.default:
                dtype = kwargs.get("dtype")
                device = kwargs.get("device")
                if dtype is None or dtype == src.dtype:
                    moved = src._qdata if device is None else src._qdata.to(device)
                    return src._same(moved)
                out = src.dequantize(dtype)
                return out if device is None else out.to(device)
            if func is _aten.copy_.default:
                if src._quantizer is None:
                    raise RuntimeError(
                        f"{type(src).__name__}.copy_: this tensor has no quantizer to re-quantize "
                        "with (wrap it with quantizer=...)"
                    )
                value = args[1]
                if isinstance(value, QuantizedTensor):
                    value = value.dequantize()
                # A high-precision source is quantized as given (an fp32 master weight rounds
                # once, straight to FP8); other dtypes go through the nominal dtype.
                dtype = value.dtype if value.dtype in HIGH_PRECISION_DTYPES else src.dtype
                value = value.to(device=src.device, dtype=dtype).expand(src.shape)
                q = src._qdata
                new = src._quantizer.quantize(
                    value, rowwise=q.has_rowwise, columnwise=q.has_columnwise
                )
                _copy_into(q, new)
                return src
        schema = getattr(func, "_schema", None)
        if schema is not None and schema.is_mutable:
            for a, arg in zip(schema.arguments, args, strict=False):
                if a.is_write and isinstance(arg, QuantizedTensor):
                    raise RuntimeError(
                        f"{type(arg).__name__}: in-place op {func} is not supported on quantized "
                        "tensors; dequantize() first, or assign with copy_() (to train quantized "
                        "weights, use fusible.optim.MasterWeightOptimizer)"
                    )

        def unwrap(t: Any) -> Any:
            return t.dequantize() if isinstance(t, QuantizedTensor) else t

        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))


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


def _copy_into(dst: QuantizedData, src: QuantizedData) -> None:
    """Write ``src``'s tensors into ``dst``'s, in place: ``dst``'s tensors (and every alias of
    them, e.g. saved references, CUDA-graph addresses) keep their storage."""
    if not same_layout(dst, src):
        raise RuntimeError(
            f"QuantizedTensor: the new {type(src).__name__} does not have the layout of the "
            "stored one (format, copies, shapes or dtypes differ); cannot update in place"
        )
    new = qdata_tensors(src)
    for k, t in qdata_tensors(dst).items():
        t.copy_(new[k])


class Float8Tensor(QuantizedTensor):
    """User-held per-tensor FP8 tensor (wraps :class:`Float8Data`)."""


class MXFP8Tensor(QuantizedTensor):
    """User-held MXFP8 tensor (wraps :class:`MXFP8Data`)."""


class Float8BlockTensor(QuantizedTensor):
    """User-held blockwise FP8 tensor (wraps :class:`Float8BlockData`)."""


# The tensor subclass of each container type.
_DATA_OF_TENSOR: dict[type, type] = {
    Float8Tensor: Float8Data,
    MXFP8Tensor: MXFP8Data,
    Float8BlockTensor: Float8BlockData,
}


def _rebuild_quantized_tensor(
    qdata: QuantizedData,
    dtype: torch.dtype,
    requires_grad: bool,
    quantizer: Quantizer | None = None,
    is_param: bool = False,
) -> QuantizedTensor:
    t = QuantizedTensor.wrap(qdata, dtype=dtype, quantizer=quantizer, requires_grad=requires_grad)
    return torch.nn.Parameter(t, requires_grad=requires_grad) if is_param else t  # type: ignore[return-value]
