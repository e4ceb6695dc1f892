"""Backward: MakeExtraOutput + BasicLinear: the dgrad GEMM accumulates the branch gradient."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fusible.ops import _compute as C
from fusible.ops.basic import BasicLinear
from fusible.ops.op import BasicOperation, FusedOperation

__all__ = ["BackwardLinearAdd", "accepts"]


def accepts(ops: Sequence[BasicOperation], recipe: Any) -> str | None:
    """Fusion rule (pattern: MakeExtraOutput then BasicLinear). Always applies: without an input
    gradient the Linear skips dgrad and the add is a plain add."""
    return None


class BackwardLinearAdd(FusedOperation):
    name = "linear_dgrad_add"
    forward, backward = False, True

    def kernels(self, fwd: bool) -> list[str]:
        linear: BasicLinear = self.ops[1]  # type: ignore[assignment]
        dgrad = linear.gemm_kernel("dgrad, beta=1 accumulate the branch gradient")
        return [*linear.weight_kernels(fwd), dgrad, linear.wgrad_kernel()]

    def fuser_backward(self, ctxs, dy, *, prev_grad_quantizer, extra_output_grads):
        linear: BasicLinear = self.ops[1]  # type: ignore[assignment]
        (g,) = extra_output_grads[0]
        dx, dw = linear.linear_backward(ctxs[1], dy, c=None if g is None else C.dequantize(g))
        if dx is None and g is not None:
            dx = g
        return dx, [[], [dw]], [[], []]
