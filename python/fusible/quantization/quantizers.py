"""Quantizers: plain Python objects (not ``nn.Module``, not tensors) that cast a high-precision
tensor into a quantized data container.

Usage flags: ``rowwise`` / ``columnwise`` say which copies :meth:`Quantizer.quantize` produces;
they are attributes (``set_usage``) and can be overridden per call.

The package is split by concern; this module re-exports the others' names, so every import path
of ``fusible.quantization.quantizers`` keeps working:

* :mod:`fusible.quantization.data` -- the containers (:class:`Float8Data`, :class:`MXFP8Data`,
  :class:`Float8BlockData`), plain tensors that flow inside the framework;
* :mod:`fusible.quantization.scale_log` -- :class:`ScaleLog` (delayed scales replayed by a
  checkpoint's recomputation);
* :mod:`fusible.quantization.tensor` -- :class:`QuantizedTensor`, the ``torch.Tensor`` subclass
  for quantized tensors a *user* holds.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from fusible import _kernels as _ops  # torch.ops.fusible.*
from fusible._kernels import HIGH_PRECISION_DTYPES
from fusible.quantization.data import (
    Float8BlockData,
    Float8Data,
    MXFP8Data,
    QuantizedData,
    _check_fp8_dtype,
)

# Old import paths (the modules that import them from here, and pickles of a QuantizedTensor made
# before the split, which name fusible.quantization.quantizers._rebuild_quantized_tensor).
from fusible.quantization.data import qdata_tensors as qdata_tensors
from fusible.quantization.data import same_layout as same_layout
from fusible.quantization.recipe import (
    Float8BlockScaling,
    Float8CurrentScaling,
    MXFP8BlockScaling,
    Recipe,
)
from fusible.quantization.roles import QuantizerRole, as_role
from fusible.quantization.scale_log import (
    SNAPSHOT_SCALES,
    ScaleLog,
    ScalingBuffers,
    _dynamo_compiling,
    _log_stack,
    replaying_scales,
    scale_log,
    scale_snapshot,
)
from fusible.quantization.tensor import (
    Float8BlockTensor,
    Float8Tensor,
    MXFP8Tensor,
    QuantizedTensor,
)
from fusible.quantization.tensor import _rebuild_quantized_tensor as _rebuild_quantized_tensor

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
        # By type first: isinstance is a call (a QuantizedTensor is a subclass, never this).
        if type(x) is not torch.Tensor and (
            not isinstance(x, torch.Tensor) or isinstance(x, QuantizedTensor)
        ):
            raise TypeError(f"{name}.quantize: 'x' must be a plain torch.Tensor, got {type(x)}")
        if x.dtype not in HIGH_PRECISION_DTYPES:
            raise TypeError(
                f"{name}.quantize: 'x' must be float32, float16 or bfloat16, got {x.dtype}"
            )
        if x.ndim == 0:
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


class _OwnBuffers:
    def __init__(self, amax_history: torch.Tensor, scale: torch.Tensor) -> None:
        self.amax_history = amax_history
        self.scale = scale


class Float8Quantizer(Quantizer):
    """Delayed-scaling FP8 quantizer of slot ``slot`` of a delayed-scaling state.

    Casts with ``buffers.scale[slot]`` (the scale computed at the last update) and records the
    tensor's amax into ``buffers.amax_history[0, slot]`` as a running max (so a quantizer used
    several times before an update records the largest amax; NaN propagates): the cast kernel
    max-combines it into that slot itself (:meth:`amax_into`). ``buffers`` is
    read at every call, so moving or reloading the state is seen by its quantizers.
    """

    scaling = "delayed"
    _views2: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None

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
        self._views2 = None  # (scale buffer, amax buffer, their slot views): see _pair

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
        live = self._pair()[0]
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
        return self._cast(x, rowwise, columnwise, False)[0]

    def quantize_keeping_scale(
        self, x: torch.Tensor, *, rowwise: bool, columnwise: bool
    ) -> tuple[Float8Data, torch.Tensor]:
        """``(quantize(x), scale)``: the cast, recording its amax as :meth:`quantize` does, and a
        float32 ``(1,)`` copy of the scale it cast with, made by the cast operator itself
        (``keep_scale``): what backward hands :meth:`quantize_with_scale` to make the same bits
        again after the step's update has changed this quantizer's scale in place."""
        return self._cast(x, rowwise, columnwise, True)

    def _cast(
        self, x: torch.Tensor, rowwise: bool | None, columnwise: bool | None, keep_scale: bool
    ) -> tuple[Float8Data, torch.Tensor]:
        """The cast of :meth:`quantize` and its fourth output (the scale's copy with
        ``keep_scale``, else an empty tensor)."""
        x = self._check_input(x)
        r, c = self._usage(rowwise, columnwise)
        if _log_stack:
            scale, seen = self.scale, self.amax_into()  # through the checkpoint's scale log
        else:
            scale, seen = self._pair()
        # The kernel max-combines the amax into this step's slot itself (amax_into; None in a
        # recomputation, which records nothing): no scratch amax, no maximum.
        data, data_t, scale_inv, fourth = _ops.quantize_fp8(
            x, scale, self.dtype, r, c, seen, want_amax=seen is not None, keep_scale=keep_scale
        )
        q = Float8Data._trusted(
            data if r else None, data_t if c else None, scale_inv, self.dtype, x.shape
        )
        return q, fourth

    def quantize_with_scale(
        self, x: torch.Tensor, scale: torch.Tensor, *, rowwise: bool, columnwise: bool
    ) -> Float8Data:
        """``x`` cast with ``scale`` -- a float32 ``(1,)`` copy of a scale this quantizer cast
        with before (:attr:`scale` then) -- recording no amax: the bits that cast made, made
        again (how backward remakes the weight copy its forward made, after the step's update
        has changed the state)."""
        x = self._check_input(x)
        data, data_t, scale_inv, _ = _ops.quantize_fp8(
            x, scale, self.dtype, rowwise, columnwise, want_amax=False
        )
        return Float8Data._trusted(
            data if rowwise else None, data_t if columnwise else None, scale_inv, self.dtype,
            x.shape,
        )  # fmt: skip

    def amax_into(self) -> torch.Tensor | None:
        """The slot a cast with :attr:`scale` max-combines its amax into (the kernels'
        ``amax_into``): this step's running max ``amax_history[0, slot]``, a float32 ``(1,)``
        view; None inside a checkpoint recomputation, which records nothing (its forward did)."""
        if _log_stack and replaying_scales():
            return None
        return self._pair()[1]

    def record_amax(self, amax: torch.Tensor) -> None:
        """Fold ``amax`` (float32, one element) into this step's running max,
        ``amax_history[0, slot]`` -- for an amax a kernel returned (one combined across ranks
        first; the casts themselves accumulate through :meth:`amax_into`). A checkpoint
        recomputation records nothing (its forward did)."""
        if _log_stack and replaying_scales():
            return
        seen = self._pair()[1]
        if amax.dtype == torch.float32 and amax.shape == (1,) and amax.device == seen.device:
            torch.maximum(seen, amax, out=seen)
        else:
            seen.copy_(torch.maximum(seen, amax.reshape(1).to(seen)))

    def __getstate__(self) -> dict[str, Any]:
        # The slot views are not state: a copy (pickle does not keep a view sharing its base's
        # storage) makes its own from its buffers.
        state = self.__dict__.copy()
        state["_views"] = {}
        state["_views2"] = None
        return state

    def _pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scale view, amax view)``: :meth:`_slot_view` of both buffers in one call (a cast
        reads both), cached for the buffer tensors they were made of."""
        b = self.buffers
        scale, hist = b.scale, b.amax_history
        if _dynamo_compiling():  # see _slot_view
            s = self.slot
            if SNAPSHOT_SCALES[0]:  # inside a compiled fusible.checkpoint: a saved copy
                return scale_snapshot(scale[s : s + 1]), hist[0][s : s + 1]
            return scale[s : s + 1], hist[0][s : s + 1]
        v = self._views2
        if v is not None and v[0] is scale and v[1] is hist:
            return v[2], v[3]
        sv, hv = self._slot_view("scale"), self._slot_view("amax_history")
        if not torch.compiler.is_compiling():  # traced (make_fx): no state changes
            self._views2 = (scale, hist, sv, hv)
        return sv, hv

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
        # Made with grad mode on: a view made under no_grad (a cast in an ordinary backward)
        # and cached would be refused by autograd as the cast's in-place amax target in a later
        # grad-mode call (a create_graph backward). The buffers need no gradient: no graph.
        with torch.enable_grad():  # once per buffer tensor
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
