"""The quantized-weight lifecycle of an op with weight parameters (BasicLinear: ``weight``;
GroupedLinear: ``weight0 ..``): a weight quantized at build (``fusible.quantized_model_init``),
converted by ``.to()`` / ``.cuda()`` without losing its quantization, saved dequantized and
loaded re-quantized (bit for bit when the checkpoint holds the exact data), and the checks the
GEMM path makes on the stored copies."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch

from fusible._kernels import HIGH_PRECISION_DTYPES
from fusible.ops import _compute as C
from fusible.ops.op import TORCH_VERSION, BasicOperation
from fusible.ops.workspace import quantize_weight
from fusible.quantization.model_init import (
    get_quantized_model_init_recipe,
    quantized_model_init_keeps_transpose,
    weight_init_quantizer,
)
from fusible.quantization.quantizers import (
    Float8BlockData,
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8Data,
    Float8Quantizer,
    MXFP8Quantizer,
    QuantizedData,
    QuantizedTensor,
    Quantizer,
    qdata_tensors,
    same_layout,
)
from fusible.quantization.recipe import Recipe
from fusible.quantization.roles import QuantizerRole

__all__ = ["QuantizedWeightOp", "kaiming_init"]


def kaiming_init(w: torch.Tensor) -> None:
    """``torch.nn.Linear``'s weight initialisation, in place."""
    torch.nn.init.kaiming_uniform_(w, a=math.sqrt(5))


class QuantizedWeightOp(BasicOperation):
    """Base of an op whose weight parameters may be ``QuantizedTensor`` parameters: how such a
    weight is made, moved, saved and loaded. The op sets ``weight_init_recipe`` and names its
    weights and their roles in :meth:`weight_roles` (BasicLinear: ``weight``; GroupedLinear:
    ``weight0 .. weight{n-1}``, each with its expert's role)."""

    # Class defaults: an op pickled before these attributes existed reads them here.
    weight_init_recipe: Recipe | None = None
    weight_init_transpose: bool = False
    init_method: Callable[[torch.Tensor], Any] | None = None

    def _set_init_method(self, init_method: Any) -> None:
        """TransformerEngine's ``init_method``: a callable that initialises a weight tensor in
        place (``init_method(w)``; None: kaiming-uniform, as ``torch.nn.Linear``), kept for
        :meth:`reset_parameters` (``to_empty()`` after a ``meta`` build runs it again). Under
        tensor parallelism it initialises this rank's shard."""
        if init_method is not None and not callable(init_method):
            raise TypeError(
                f"{type(self).__name__}: init_method must be a callable w -> None that "
                f"initialises w in place, or None, got {type(init_method).__name__}"
            )
        self.init_method = init_method

    def _record_weight_init(self) -> None:
        """Keep the ``quantized_model_init`` region active at construction (None: high-precision
        weights): what ``to_empty()`` and ``set_role_scope`` quantize with later."""
        self.weight_init_recipe = get_quantized_model_init_recipe()
        self.weight_init_transpose = quantized_model_init_keeps_transpose()

    def weight_roles(self) -> dict[str, QuantizerRole]:
        """Each weight parameter that may be stored quantized, by name, and its weight role (the
        role whose quantizer stores it under ``quantized_model_init``)."""
        return {"weight": self.get_quantizer_roles(True)[1]}

    def quantized_weights(self) -> dict[str, QuantizedTensor]:
        """The weight parameters stored quantized, by name."""
        ps: dict[str, Any] = self._parameters
        return {n: p for n in self.weight_roles() if isinstance(p := ps.get(n), QuantizedTensor)}

    def _quantize_weight_param(self, recipe: Recipe, names: Any = None) -> None:
        """Replace the high-precision weights ``names`` (default: every weight) by their
        quantization with the weight quantizer ``recipe`` gives each one's role (kept high
        precision where that is None). Per-tensor FP8 stores the rowwise copy only; MXFP8 and
        blockwise FP8 both."""
        for name, role in self.weight_roles().items():
            w = self._parameters.get(name)
            if (names is not None and name not in names) or w is None:
                continue
            if isinstance(w, QuantizedTensor):
                continue
            q = weight_init_quantizer(recipe, role, w.device)
            if q is None:
                continue
            # Blockwise: both copies too (a 1x128 columnwise copy has its own scales; a 128x128
            # one could be transposed on demand, but keeping it costs no second pass).
            # Per-tensor: the transposed copy only when the region asked to keep it.
            blocks = isinstance(q, (MXFP8Quantizer, Float8BlockQuantizer))
            both = blocks or self.weight_init_transpose
            qdata, _ = quantize_weight(w.detach(), q, None, False, columnwise=both)
            qt = QuantizedTensor.wrap(qdata, dtype=w.dtype, quantizer=q)
            setattr(self, name, torch.nn.Parameter(qt, requires_grad=w.requires_grad))

    def _reset_quantized_weight(self, name: str, init: Any) -> None:
        """Re-initialise weight ``name`` with ``init`` (an in-place initialiser such as
        ``kaiming_uniform_``): a quantized weight in place (re-quantized with its quantizer), a
        high-precision one built inside ``quantized_model_init`` initialised, then quantized.
        A no-op on ``meta`` (``to_empty()`` then ``reset_parameters()`` materialises)."""
        w = self._parameters[name]
        assert w is not None
        if w.device.type == "meta":
            return
        init = self.init_method or init
        if isinstance(w, QuantizedTensor):
            value = torch.empty(w.shape, dtype=w.dtype, device=w.device)
            init(value)
            with torch.no_grad():
                w.copy_(value)
            return
        with torch.no_grad():  # a user's init_method may write the parameter directly
            init(w)
        if self.weight_init_recipe is not None:
            self._quantize_weight_param(self.weight_init_recipe, (name,))

    def set_role_scope(self, scope: str, name: str | None = None) -> None:
        """Re-scope the roles (see :class:`BasicOperation`). Weights built inside
        ``quantized_model_init`` follow: when a new role's quantizer has another format, the
        weight is re-quantized from its dequantized value (one more rounding; pass ``scope`` /
        ``name`` to the constructor to quantize the initial weight once)."""
        super().set_role_scope(scope, name)
        recipe = self.weight_init_recipe
        if recipe is None or not self.__dict__.get("_parameters"):
            return
        roles = self.weight_roles()
        for pname, w in self.quantized_weights().items():
            q = weight_init_quantizer(recipe, roles[pname], w.device)
            old = w.quantizer
            if q is not None and old is not None and _same_quantization(q, old):
                w._quantizer = q  # the stored bits are what q makes of the initial weight
                continue
            plain = torch.nn.Parameter(w.dequantize(), requires_grad=w.requires_grad)
            setattr(self, pname, plain)
            if q is not None:
                self._quantize_weight_param(recipe, (pname,))

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        # nn.Module._apply would give a quantized weight the converted tensor's storage
        # (``param.data = fn(param)``, a dequantized copy for a dtype change): it is converted
        # here instead, see _convert_quantized.
        held = self.quantized_weights()
        if not held:
            params = [p for p in map(self._parameters.get, self.weight_roles()) if p is not None]
            on_meta = [p.device.type == "meta" for p in params]
            out = super()._apply(fn, recurse)
            now = [p for p in map(self._parameters.get, self.weight_roles()) if p is not None]
            if self.weight_init_recipe is not None and any(
                was and p.device.type != "meta" for was, p in zip(on_meta, now, strict=True)
            ):
                # Built on meta inside quantized_model_init, now materialised (to_empty()): FP8
                # from here on; reset_parameters() or load_state_dict() fill in the values.
                # (Plain weights that were not on meta -- e.g. assigned for fine-tuning -- stay
                # the parameters they are.)
                self._quantize_weight_param(self.weight_init_recipe)
            return out
        # A conversion quantized weights cannot take is refused before anything moves.
        for n, w in held.items():
            _check_conversion(w, fn, f"{type(self).__name__}.{n}")
        for n in held:
            self._parameters[n] = None
        try:
            super()._apply(fn, recurse)
        finally:
            for n, w in held.items():
                self._parameters[n] = w  # type: ignore[assignment]
        for w in held.values():
            _convert_quantized(w, fn)
        self._move_recipe_states()
        return self

    # ---- checkpoints: a quantized weight is saved dequantized, loaded re-quantized ------------

    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if keep_vars:
            return
        for name, w in self.quantized_weights().items():
            # A plain tensor of the nominal dtype: loadable with torch.load(weights_only=True)
            # and by a model with high-precision weights.
            destination[prefix + name] = w.dequantize()

    def get_extra_state(self) -> dict[str, torch.Tensor]:
        """Recipe state, and each quantized weight's exact data and scales (copies) under
        ``<weight>.<field>`` (``weight.data``, ``weight.scale_inv`` / ``weight.scale``,
        ``weight.col_data``, ``weight.col_scale``; ``weight3.data`` for a GroupedLinear), so
        that loading restores it bit for bit."""
        out = super().get_extra_state()
        for name, w in self.quantized_weights().items():
            for field, t in qdata_tensors(w.qdata).items():
                out[f"{name}.{field}"] = t.detach().clone()
        return out

    def set_extra_state(self, state: Any) -> None:
        # ``<weight>.*`` entries are read by _load_from_state_dict (they need the checkpoint's
        # weight); a model with high-precision weights ignores them.
        # Another op's weight data (a checkpoint with more experts, or of a Linear, loaded with
        # strict=False) is ignored too: quantized data, not malformed recipe state.
        if isinstance(state, Mapping):
            names = self.weight_roles()

            def weight_entry(key: Any) -> bool:
                head, _, field = str(key).partition(".")
                return head in names or (head not in _MODES and field in _QDATA_FIELDS)

            state = {k: v for k, v in state.items() if not weight_entry(k)}
        super().set_extra_state(state)

    def _load_from_state_dict(self, state_dict: Any, prefix: str, *args: Any) -> None:
        before = {n: self._parameters.get(n) for n in self.weight_roles()}
        meta = args[0] if args and isinstance(args[0], Mapping) else {}
        if meta.get("assign_to_params_buffers", False):
            for name, w in before.items():
                if (
                    isinstance(w, QuantizedTensor)
                    and w.quantizer is None
                    and (prefix + name in state_dict)
                ):
                    raise ValueError(
                        f"{type(self).__name__}: load_state_dict(assign=True) cannot quantize the "
                        f"loaded {name} like the weight it replaces: that QuantizedTensor has no "
                        "quantizer (wrap it with one, or load without assign=True)"
                    )
        values = {}
        for name in before:
            value = state_dict.get(prefix + name)
            if isinstance(value, QuantizedTensor):
                state_dict[prefix + name] = value = value.dequantize()
            values[name] = value
        super()._load_from_state_dict(state_dict, prefix, *args)
        extra = state_dict.get(prefix + "_extra_state")
        for name, w in before.items():
            new = self._parameters.get(name)
            replaced = new is not w and new is not None and not isinstance(new, QuantizedTensor)
            if isinstance(w, QuantizedTensor) and replaced:
                # load_state_dict(assign=True) put the checkpoint's plain tensor in: quantize it
                # like the weight it replaced (same quantizer, same copies).
                assert w.quantizer is not None
                qdata = w.quantizer.quantize(new.detach(), rowwise=w.qdata.has_rowwise,
                                             columnwise=w.qdata.has_columnwise)  # fmt: skip
                qt = QuantizedTensor.wrap(qdata, dtype=new.dtype, quantizer=w.quantizer)
                new = torch.nn.Parameter(qt, requires_grad=new.requires_grad)
                setattr(self, name, new)
            value = values[name]
            if isinstance(new, QuantizedTensor) and isinstance(value, torch.Tensor):
                _restore_exact(new, name, value, extra)


# torch.compile reads a stored quantized weight through QuantizedTensor's traceable-subclass
# protocol (__tensor_flatten__): dynamo reads the container's tensors and AOTAutograd passes
# them to the graph as inputs; the weight gradient, a plain tensor, reaches the parameter. Tested
# on torch 2.13 (CI) and 2.11 (the H200's; CPU, session 23); older releases keep the clear error
# until they are tested.
COMPILE_QUANTIZED_MIN_TORCH = (2, 11)
_COMPILE_UNSUPPORTED = (
    "{op}: torch.compile with quantized weights (fusible.quantized_model_init, or the FP8 "
    "weights of fusible.distributed.fully_shard_fp8) needs torch >= {need} (tested there), this "
    "is torch {have}. Run the model eagerly, or upgrade torch"
)


def compile_quantized_supported() -> bool:
    """Whether this torch's ``torch.compile`` takes quantized weights (``>=
    COMPILE_QUANTIZED_MIN_TORCH``)."""
    return TORCH_VERSION >= COMPILE_QUANTIZED_MIN_TORCH


def check_compile_quantized(op: str) -> None:
    """Raise ``RuntimeError`` naming ``op`` unless :func:`compile_quantized_supported`."""
    if not compile_quantized_supported():
        need = ".".join(map(str, COMPILE_QUANTIZED_MIN_TORCH))
        raise RuntimeError(_COMPILE_UNSUPPORTED.format(op=op, need=need, have=torch.__version__))


def _restore_exact(w: QuantizedTensor, name: str, value: torch.Tensor, extra: Any) -> None:
    """After ``w`` was re-quantized from a checkpoint's dequantized ``value``: if the checkpoint
    also holds the exact quantized weight (``<name>.*`` in its extra state) with ``w``'s layout,
    and that is what ``value`` was dequantized from (it was not edited), write it into ``w`` in
    place. Re-quantizing a dequantized weight is not always exact: an MXFP8 columnwise copy, or
    a per-tensor scale derived from an amax that the nominal dtype rounds, can come out
    different."""
    if not isinstance(extra, Mapping):
        return
    head = f"{name}."
    raw = {k[len(head) :]: v for k, v in extra.items() if str(k).startswith(head)}
    mine = qdata_tensors(w.qdata)
    if not all(isinstance(v, torch.Tensor) for v in raw.values()):
        return
    transpose = False
    if raw.keys() != mine.keys():
        # A per-tensor weight saved with or without its transposed copy (keep_transpose) and
        # loaded into the other layout: the rowwise copy and scale are exact either way; the
        # transposed copy is their byte transpose.
        rowwise = {"data", "scale_inv"}
        if not (type(w.qdata) is Float8Data and rowwise <= raw.keys() and rowwise <= mine.keys()):
            return
        raw = {k: raw[k] for k in rowwise}
        transpose = "data_t" in mine
        raw["data_t"] = None  # type: ignore[assignment]
    moved: dict[str, Any] = {k: None if v is None else v.to(w.device) for k, v in raw.items()}
    exact = replace(w.qdata, **moved)
    if transpose:
        exact = C.ensure_fp8_copy(exact, "c")
    if not same_layout(exact, w.qdata):
        return
    if value.dtype in HIGH_PRECISION_DTYPES and torch.equal(
        exact.dequantize(value.dtype), value.to(exact.device)
    ):
        w.load_qdata_(exact)


_MODES = ("forward", "backward")  # the recipe-state keys' heads (BasicOperation.get_extra_state)
_QDATA_FIELDS = frozenset(("data", "data_t", "scale_inv", "scale", "col_data", "col_scale",
                           "col_scale_inv"))  # fmt: skip


def _stored_matches(qdata: QuantizedData, qw: Quantizer | None, *, need_columnwise: bool) -> bool:
    """Whether a stored quantized weight is what the active weight quantizer ``qw`` asks for:
    per-tensor FP8 for a per-tensor quantizer (delayed or current scaling: the stored scale is
    as good as any), MXFP8 for MXFP8 (with the columnwise copy if dgrad needs it), same FP8
    dtype."""
    if qw is None or qdata.fp8_dtype != qw.dtype:
        return False
    if isinstance(qdata, Float8Data):
        return isinstance(qw, (Float8Quantizer, Float8CurrentScalingQuantizer))
    if isinstance(qdata, Float8BlockData):
        return (
            isinstance(qw, Float8BlockQuantizer)
            and qw.block_dim == qdata.block_dim
            and qdata.has_rowwise
            and (qdata.has_columnwise or not need_columnwise or qdata.block_dim == 2)
        )
    return (
        isinstance(qw, MXFP8Quantizer)
        and qdata.has_rowwise
        and (qdata.has_columnwise or not need_columnwise)
    )


def stored_operand(
    w: QuantizedTensor, qw: Quantizer | None, need_dgrad: bool, op: str
) -> tuple[Any, bool]:
    """``(operand, as_is)``: a stored quantized weight as a GEMM reads it -- its data as they are
    where the active weight quantizer ``qw`` asks for that format (``as_is``; a per-tensor
    weight's rowwise copy, which backward transposes), else its exact dequantization (then
    quantized by ``qw`` like a high-precision weight, or used as it is without a recipe)."""
    if _stored_matches(w.qdata, qw, need_columnwise=need_dgrad):
        return C.ensure_fp8_copy(w.qdata, "r"), True
    return w.dequantize(), False


def _check_conversion(w: QuantizedTensor, fn: Any, what: str) -> None:
    """Raise ``TypeError`` naming ``what`` when ``fn`` would give quantized weight ``w`` a
    nominal dtype other than fp32 / fp16 / bf16."""
    probe = fn(torch.empty(0, dtype=w.dtype, device=w.device))
    if probe.dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(
            f"{what}: a quantized weight's nominal dtype must be float32, float16 or bfloat16, "
            f"got a conversion to {probe.dtype}"
        )


def _convert_quantized(w: QuantizedTensor, fn: Any) -> None:
    """Apply a module conversion ``fn`` (``.to()``, ``.cuda()``, ``.bfloat16()``, ``to_empty()``)
    to a quantized weight parameter, in place (``torch.utils.swap_tensors``, as torch does for
    tensor subclasses): a device change moves the quantized data; a dtype change sets the nominal
    dtype (fp32 / fp16 / bf16) and leaves the data as it is. Its gradient follows ``fn``."""
    probe = fn(torch.empty(0, dtype=w.dtype, device=w.device))
    if probe.dtype == w.dtype and probe.device == w.device:
        return
    if probe.dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(
            f"BasicLinear: a quantized weight's nominal dtype must be float32, float16 or "
            f"bfloat16, got a conversion to {probe.dtype}"
        )
    qdata = w.qdata
    if probe.device != w.device:
        if w.device.type == "meta":  # to_empty(): storage without values, as for any tensor
            qdata = qdata._map(lambda t: torch.empty_like(t, device=probe.device))
        else:
            qdata = qdata.to(probe.device)
    qt = QuantizedTensor.wrap(qdata, dtype=probe.dtype, quantizer=w.quantizer)
    new = torch.nn.Parameter(qt, requires_grad=w.requires_grad)
    grad = w.grad
    w.grad = None
    torch.utils.swap_tensors(w, new)
    if grad is not None:
        w.grad = fn(grad)


def _same_quantization(a: Quantizer, b: Quantizer) -> bool:
    """Whether ``a`` and ``b`` quantize every tensor to the same bits."""

    def key(q: Quantizer) -> tuple[Any, ...]:
        block = tuple(getattr(q, k, None) for k in ("block_dim", "power_2_scale", "amax_epsilon"))
        return (type(q), q.dtype, getattr(q, "margin", 0), block)

    return key(a) == key(b)
