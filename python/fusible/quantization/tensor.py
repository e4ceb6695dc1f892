"""The user-facing tensor subclass: :class:`QuantizedTensor` (and one subclass per container
type) wraps a quantized data container (:mod:`fusible.quantization.data`) in a ``torch.Tensor``
that dequantizes for any op it does not know, for tensors a *user* holds (e.g. FP8 weights)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch.utils import _pytree as pytree
from torch.utils._pytree import tree_map

from fusible._kernels import HIGH_PRECISION_DTYPES
from fusible.quantization.data import (
    Float8BlockData,
    Float8Data,
    MXFP8Data,
    QuantizedData,
    _check_out_dtype,
    qdata_tensors,
    same_layout,
)

if TYPE_CHECKING:
    from fusible.quantization.quantizers import Quantizer

__all__ = ["Float8BlockTensor", "Float8Tensor", "MXFP8Tensor", "QuantizedTensor"]


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
        # The container's tensors as attributes of their own, for __tensor_flatten__ (torch's
        # traceable-subclass protocol reads its inner tensors by attribute name). They are the
        # container's tensor objects, which every update writes in place (copy_, load_qdata_).
        children, _ = pytree.SUPPORTED_NODES[type(qdata)].flatten_fn(qdata)
        for i, t in enumerate(children):
            if t is not None:
                setattr(self, f"_inner{i}", t)
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

    # ---- torch's traceable wrapper-subclass protocol (torch.compile) ---------------------------

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        """The inner tensors' attribute names, and what rebuilds the tensor around them: the
        container type and its own context (FP8 dtype, shape, ...), which of its tensors are
        present, the nominal dtype, and the quantizer by identity (``_Ref``: dynamo guards on a
        deep copy of this context by equality, which a quantizer object would fail; a rebuilt
        tensor keeps its quantizer, so ``copy_`` re-quantizes in compiled code too)."""
        children, context = pytree.SUPPORTED_NODES[type(self._qdata)].flatten_fn(self._qdata)
        present = tuple(i for i, t in enumerate(children) if t is not None)
        names = [f"_inner{i}" for i in present]
        ref = _Ref(self._quantizer)
        return names, (type(self._qdata), context, present, len(children), self.dtype, ref)

    @staticmethod
    def __tensor_unflatten__(
        inner: dict[str, torch.Tensor], ctx: Any, outer_size: Any, outer_stride: Any
    ) -> QuantizedTensor:
        data_cls, context, present, n, dtype, ref = ctx
        children: list[Any] = [None] * n
        for i in present:
            children[i] = inner[f"_inner{i}"]
        qdata = pytree.SUPPORTED_NODES[data_cls].unflatten_fn(children, context)
        return QuantizedTensor.wrap(qdata, dtype=dtype, quantizer=ref.obj)

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
            if func is _aten.as_strided.default and _is_identity_view(src, args, kwargs):
                # FSDP2 views the tensor fsdp_post_all_gather returns with its own size and
                # contiguous stride (fusible.distributed.fully_shard_fp8): an alias, still FP8.
                return src._same(src._qdata)
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


class _Ref:
    """An object held by identity in a flatten context (equal only to a reference to the same
    object), so that dynamo's guard on the context compares it by identity."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Ref) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)

    def __deepcopy__(self, memo: Any) -> _Ref:
        return self  # dynamo keeps a deep copy of the context to guard on: the same object

    def __repr__(self) -> str:
        return f"_Ref({type(self.obj).__name__})"


def _is_identity_view(src: QuantizedTensor, args: Any, kwargs: dict[str, Any]) -> bool:
    """Whether ``as_strided(src, size, stride, offset)`` is ``src`` itself: its shape, its
    strides (a QuantizedTensor's are those of a contiguous tensor of its shape), offset 0."""
    params = list(args[1:]) + [kwargs.get(k) for k in ("size", "stride", "storage_offset")
                               if k in kwargs]  # fmt: skip
    size, stride = tuple(params[0]), tuple(params[1])
    offset = params[2] if len(params) > 2 and params[2] is not None else 0
    return size == tuple(src.shape) and stride == tuple(src.stride()) and offset == 0


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
