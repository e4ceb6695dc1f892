"""Backward: activation backward + bias gradient + quantize-for-the-preceding-Linear, one kernel."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fusible.ops.basic.activation import _Activation, activation_backward
from fusible.ops.op import BasicOperation, FusedOperation

__all__ = ["BackwardActivationBias", "accepts"]


def accepts(ops: Sequence[BasicOperation], recipe: Any) -> str | None:
    """Fusion rule (pattern: Bias then an activation, in forward order). Rejections:
    - the Bias has no trainable parameter (nothing to fuse but the dact itself)."""
    if not ops[0].bias.requires_grad:  # type: ignore[union-attr]
        return "bias does not require grad"
    return None


class BackwardActivationBias(FusedOperation):
    name = "dact_dbias_quantize"
    forward, backward = False, True

    def kernels(self, fwd: bool) -> list[str]:
        act: _Activation = self.ops[1]  # type: ignore[assignment]
        return [f"act_bwd({act.kind}, dbias, quantized grad for the preceding op)"]

    def fuser_backward(self, ctxs, dy, *, prev_grad_quantizer, extra_output_grads):
        act: _Activation = self.ops[1]  # type: ignore[assignment]
        dx, dbias = activation_backward(act.kind, ctxs[1], dy, prev_grad_quantizer, True)
        bias_ctx = ctxs[0]
        assert dbias is not None
        return dx, [[dbias.to(bias_ctx.attrs["dtype"])], []], [[], []]
