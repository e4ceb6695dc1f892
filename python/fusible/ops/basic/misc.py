"""Structural ops: Identity, Quantize, Reshape, Dropout, ConstantScale, AddExtraInput,
MakeExtraOutput."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fusible.ops import _compute as C
from fusible.ops.op import TORCH_VERSION, BasicOperation
from fusible.quantization import QuantizerRole

__all__ = [
    "AddExtraInput",
    "ConstantScale",
    "Dropout",
    "Identity",
    "MakeExtraOutput",
    "Quantize",
    "Reshape",
]


class Identity(BasicOperation):
    computes = False

    def op_forward(self, ctx, x, params, *, next_input_quantizer, extra_inputs):
        return x, []

    def op_backward(self, ctx, dy, *, prev_grad_quantizer, extra_output_grads):
        return dy, [], []


class Quantize(BasicOperation):
    """Explicit cast point: quantizes its input (forward) and/or its gradient (backward) with its
    own quantizers (roles ``input:quantize`` / ``grad_output:quantize``), then passes the values
    on, dequantized, so the following op sees exactly representable numbers."""

    role_scope = "quantize"

    def __init__(self, forward: bool = True, backward: bool = False, *, name: str | None = None):
        super().__init__(name=name)
        self.quantize_forward, self.quantize_backward = forward, backward

    def get_quantizer_roles(self, fwd: bool) -> list[QuantizerRole]:
        if fwd and self.quantize_forward:
            return [QuantizerRole("input", self.scope, self.quantizer_name)]
        if not fwd and self.quantize_backward:
            return [QuantizerRole("grad_output", self.scope, self.quantizer_name)]
        return []

    def op_forward(self, ctx, x, params, *, next_input_quantizer, extra_inputs):
        q = self.get_quantizer(True, "input")
        x = C.dequantize(x)
        return (
            x if q is None else q.quantize(x, rowwise=True, columnwise=False).dequantize(x.dtype)
        ), []

    def op_backward(self, ctx, dy, *, prev_grad_quantizer, extra_output_grads):
        q = self.get_quantizer(False, "grad_output")
        dy = C.dequantize(dy)
        if q is not None:
            dy = q.quantize(dy, rowwise=True, columnwise=False).dequantize(dy.dtype)
        return dy, [], []


class Reshape(BasicOperation):
    """``x.reshape(shape)``; -1 allowed."""

    computes = False

    def __init__(self, shape: Sequence[int], *, name: str | None = None) -> None:
        super().__init__(name=name)
        self.shape = tuple(int(s) for s in shape)

    def extra_repr(self) -> str:
        return f"shape={self.shape}"

    def op_forward(self, ctx, x, params, *, next_input_quantizer, extra_inputs):
        x = C.dequantize(x)
        ctx.attrs["in_shape"] = tuple(x.shape)
        return x.reshape(self.shape), []

    def op_backward(self, ctx, dy, *, prev_grad_quantizer, extra_output_grads):
        return C.dequantize(dy).reshape(ctx.attrs["in_shape"]), [], []


class Dropout(BasicOperation):
    """Inverted dropout with probability ``p`` (identity in eval mode)."""

    def __init__(self, p: float, *, name: str | None = None) -> None:
        super().__init__(name=name)
        if not 0.0 <= p < 1.0:
            raise ValueError(f"Dropout: p must be in [0, 1), got {p}")
        self.p = float(p)

    def extra_repr(self) -> str:
        return f"p={self.p}"

    def op_forward(self, ctx, x, params, *, next_input_quantizer, extra_inputs):
        x = C.dequantize(x)
        if not self.training or self.p == 0.0:
            ctx.saved = [None]
            return x, []
        keep = torch.rand_like(x, dtype=torch.float32) >= self.p
        # Backward gets the kept positions as bools (1 byte per element) and rebuilds the very
        # mask the forward multiplied by (same ops, same dtype).
        ctx.saved = [keep if ctx.input_requires_grad else None]
        ctx.attrs["dtype"], ctx.attrs["p"] = x.dtype, self.p
        return x * _dropout_mask(keep, x.dtype, self.p), []

    def op_backward(self, ctx, dy, *, prev_grad_quantizer, extra_output_grads):
        (keep,) = ctx.saved
        dy = C.dequantize(dy)
        if keep is None:
            return dy, [], []
        return dy * _dropout_mask(keep, ctx.attrs["dtype"], ctx.attrs["p"]), [], []


def _dropout_mask(keep: torch.Tensor, dtype: torch.dtype, p: float) -> torch.Tensor:
    return keep.to(dtype) / (1.0 - p)


class ConstantScale(BasicOperation):
    """``y = scale * x``."""

    def __init__(self, scale: float, *, name: str | None = None) -> None:
        super().__init__(name=name)
        self.scale = float(scale)

    def extra_repr(self) -> str:
        return f"scale={self.scale}"

    def op_forward(self, ctx, x, params, *, next_input_quantizer, extra_inputs):
        return C.dequantize(x) * self.scale, []

    def op_backward(self, ctx, dy, *, prev_grad_quantizer, extra_output_grads):
        return C.dequantize(dy) * self.scale, [], []


class AddExtraInput(BasicOperation):
    """``y = x + extra`` where ``extra`` is the next extra input given to ``Sequential.forward``
    (e.g. a residual). Its gradient is returned to that input."""

    num_extra_inputs = 1

    def op_forward(self, ctx, x, params, *, next_input_quantizer, extra_inputs):
        (extra,) = extra_inputs
        x = C.dequantize(x)
        if extra.shape != x.shape:
            raise ValueError(
                f"AddExtraInput: extra input shape {tuple(extra.shape)} does not match the main "
                f"input shape {tuple(x.shape)}"
            )
        ctx.attrs["extra_dtype"] = extra.dtype
        return x + extra.to(x.dtype), []

    def op_backward(self, ctx, dy, *, prev_grad_quantizer, extra_output_grads):
        dy = C.dequantize(dy)
        return dy, [], [dy.to(ctx.attrs["extra_dtype"])]


# Traced on torch < 2.13, the branch is a view of the tensor passed on, not that tensor itself:
# torch 2.11's dynamo traced the plan's backward with zeros for the gradient of an extra output
# that a later op also reads (an FP8 cast), so the branch gradient was lost
# (test_compile.py::test_compiled_extra_output_gradient). The view costs nothing, but torch then
# refuses in-place ops on the branch (a view output of a multi-output function), which 2.13
# allows: so only where the bug is (2.12 untested, taken as 2.11).
_BRANCH_AS_VIEW = TORCH_VERSION < (2, 13)


class MakeExtraOutput(BasicOperation):
    """Emits its input as an extra output of ``Sequential.forward`` (a branch, e.g. the residual
    stream) and passes it on; backward adds the branch's gradient."""

    num_extra_outputs = 1
    computes = False

    def op_forward(self, ctx, x, params, *, next_input_quantizer, extra_inputs):
        x = C.dequantize(x)
        if _BRANCH_AS_VIEW and torch.compiler.is_compiling():
            return x, [x.view_as(x)]
        return x, [x]

    def op_backward(self, ctx, dy, *, prev_grad_quantizer, extra_output_grads):
        (g,) = extra_output_grads
        dy = C.dequantize(dy)
        return (dy if g is None else dy + g), [], []
