"""FP8 all-gather: the sequence-parallel all-gather fused with the Linear that reads it.

Forward, ``AllGather`` + ``BasicLinear`` (+ ``Bias`` (+ ``GELU`` | ``AddExtraInput``)): the
column-parallel Linear's input quantizer casts this rank's rows *before* the all-gather (the
scale agreed across the ranks, see :func:`fusible.ops.basic.comm.gather_quantized`), the FP8
bytes and scales travel, and the gathered FP8 data feeds the GEMM as a quantized hand-off (no
dequantize and requantize); the rest runs as the unfused ops or the built-in Linear fusion would.

Backward, ``BasicLinear`` + ``ReduceScatter`` (a row-parallel Linear under sequence
parallelism): the ``ReduceScatter``'s backward all-gathers the output gradient; here the Linear's
grad-output quantizer casts this rank's gradient first and the FP8 gradient is gathered.

Numerics: the gathered data equals the quantizer's cast of the gathered tensor with the agreed
scale, bit for bit, so the fused result equals the unfused ops' (tested). Where the FP8 gather
does not apply (see ``gather_quantized``) the unit gathers high precision, as unfused.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fusible.ops import _compute as C
from fusible.ops.basic import AllGather, BasicLinear, ReduceScatter
from fusible.ops.basic.comm import gather_quantized
from fusible.ops.basic.linear import _inference
from fusible.ops.op import BasicOperation, FusedOperation
from fusible.quantization.recipe import DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling

__all__ = ["BackwardLinearFP8GradAllGather", "ForwardFP8AllGatherLinear", "accepts_recipe"]

_FP8_GATHER_RECIPES = (DelayedScaling, Float8CurrentScaling, MXFP8BlockScaling)


def accepts_recipe(ops: Sequence[BasicOperation], recipe: Any) -> str | None:
    """Rejections: no recipe (nothing to quantize: high precision travels), or a recipe whose
    quantizers are not per-tensor FP8 or MXFP8 (Float8BlockScaling, CustomRecipe)."""
    if recipe is None:
        return "no recipe: the all-gather moves high precision"
    if not isinstance(recipe, _FP8_GATHER_RECIPES):
        return f"{type(recipe).__name__}: FP8 all-gather covers per-tensor FP8 and MXFP8 only"
    return None


def accepts_forward(inner: Any) -> Any:
    """The forward rule's predicate: the recipe (:func:`accepts_recipe`), then the predicate of
    the Linear fusion ``inner`` running the ops after the all-gather (None: the Linear alone)."""

    def pred(ops: Sequence[BasicOperation], recipe: Any) -> str | None:
        why = accepts_recipe(ops, recipe)
        if why is None and inner is not None:
            why = inner(ops[1:], recipe)
        return why

    return pred


def _gather_kernels(op: Any, what: str, q: Any) -> list[str]:
    n = op.group_size
    back = op._backend()
    if q is None:
        return [f"all_gather(dim 0) over {n} ranks [{back}]"]
    if q.scaling == "mxfp8":
        return [
            f"quantize({what}, local rows, before the all-gather)",
            f"all_gather(dim 0) of the FP8 bytes + E8M0 block scales over {n} ranks [{back}] "
            "(FP8 on the wire; high precision where the columnwise copy's blocks straddle ranks "
            "or both copies outweigh a 16-bit input)",
        ]
    return [
        f"quantize({what}, local rows, before the all-gather + all_reduce(max) of the amax: one "
        "scale)",
        f"all_gather(dim 0) of the FP8 bytes over {n} ranks [{back}] (FP8 on the wire)",
    ]


class ForwardFP8AllGatherLinear(FusedOperation):
    """``AllGather`` then a Linear (with what follows it, run by ``inner``): quantize, gather
    FP8, GEMM on the gathered FP8 data."""

    name = "fp8_all_gather_linear"
    forward, backward = True, False
    inner: Any = None  # a FusedOperation class for ops[1:] (None: BasicLinear alone)

    def __init__(self, ops: list[BasicOperation]) -> None:
        super().__init__(ops)
        self._rest = None if self.inner is None else self.inner(ops[1:])

    def kernels(self, fwd: bool) -> list[str]:
        linear: BasicLinear = self.ops[1]  # type: ignore[assignment]
        q = linear.get_quantizer(True, "input")
        rest = linear.kernels(fwd) if self._rest is None else self._rest.kernels(fwd)
        return [*_gather_kernels(self.ops[0], "input", q), *rest]

    def fuser_forward(self, ctxs, x, params, *, next_input_quantizer, extra_inputs):
        ag: AllGather = self.ops[0]  # type: ignore[assignment]
        linear: BasicLinear = self.ops[1]  # type: ignore[assignment]
        x = C.dequantize(x)
        prg = ctxs[1].params_requires_grad
        need_wgrad = not _inference() and bool(prg and prg[0])
        h: Any = gather_quantized(ag, linear.input_quantizer(), x, columnwise=need_wgrad)
        if h is None:
            h = ag._gather(x)
        if self._rest is None:
            y, extra = linear.op_forward(ctxs[1], h, params[1],
                                         next_input_quantizer=next_input_quantizer,
                                         extra_inputs=extra_inputs[1])  # fmt: skip
            return y, [[], extra]
        y, extras = self._rest.fuser_forward(
            ctxs[1:], h, params[1:], next_input_quantizer=next_input_quantizer,
            extra_inputs=extra_inputs[1:],
        )  # fmt: skip
        return y, [[], *extras]


def forward_rule(inner: Any) -> type[ForwardFP8AllGatherLinear]:
    """The forward fused op for ``AllGather`` + the ops ``inner`` fuses (None: BasicLinear)."""
    if inner is None:
        return ForwardFP8AllGatherLinear
    return type(f"ForwardFP8AllGather_{inner.__name__}", (ForwardFP8AllGatherLinear,),
                {"inner": inner, "name": f"fp8_all_gather_{inner.name}"})  # fmt: skip


class BackwardLinearFP8GradAllGather(FusedOperation):
    """``BasicLinear`` then ``ReduceScatter`` (row-parallel, sequence parallel), backward: the
    output gradient quantized before its all-gather, the FP8 gradient fed to dgrad and wgrad."""

    name = "linear_fp8_grad_all_gather"
    forward, backward = False, True

    def kernels(self, fwd: bool) -> list[str]:
        linear: BasicLinear = self.ops[0]  # type: ignore[assignment]
        q = linear.get_quantizer(False, "grad_output")
        return [*_gather_kernels(self.ops[1], "grad_output", q), *linear.kernels(fwd)]

    def fuser_backward(self, ctxs, dy, *, prev_grad_quantizer, extra_output_grads):
        linear: BasicLinear = self.ops[0]  # type: ignore[assignment]
        rs: ReduceScatter = self.ops[1]  # type: ignore[assignment]
        dy = C.dequantize(dy)
        need_wgrad = bool(ctxs[0].attrs.get("need_wgrad"))
        h: Any = gather_quantized(rs, linear.grad_output_quantizer(), dy, columnwise=need_wgrad)
        if h is None:
            h = rs._gather(dy)
        dx, dw = linear.linear_backward(ctxs[0], h)
        return dx, [[dw], []], [[], []]
