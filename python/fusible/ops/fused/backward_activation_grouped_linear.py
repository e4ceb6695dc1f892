"""Backward: GELU then GroupedLinear (an MoE expert MLP's second layer): the grouped dgrad GEMMs
apply GELU's derivative in their epilogue (``dgelu``, reading GELU's saved input), so no separate
activation-backward kernel runs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fusible import _kernels as K
from fusible.ops import _compute as C
from fusible.ops.basic.activation import _Activation
from fusible.ops.basic.grouped_linear import GroupedLinear
from fusible.ops.op import BasicOperation, FusedOperation

__all__ = ["BackwardActivationGroupedLinear", "accepts"]


def accepts(ops: Sequence[BasicOperation], recipe: Any) -> str | None:
    """Fusion rule (pattern: an activation then GroupedLinear, in forward order). Rejections:
    - an activation other than the tanh GELU (the ``dgelu`` epilogue's derivative);
    - in_features not a multiple of the aux epilogues' N rule (the dgrad GEMM's N; required on
      every backend so that CPU and GPU fuse alike)."""
    act, lin = ops[0], ops[1]
    assert isinstance(act, _Activation) and isinstance(lin, GroupedLinear)
    if act.kind != "gelu":
        name = f"{type(act).__name__}({act.extra_repr()})"
        return f"{name} is not the tanh GELU of the dgelu epilogue"
    mult = K.GEMM_RULES.aux_n_multiple
    if lin.in_features % mult:
        return f"in_features {lin.in_features} is not a multiple of {mult} (the aux epilogue's N)"
    return None


class BackwardActivationGroupedLinear(FusedOperation):
    name = "dact_grouped_linear"
    forward, backward = False, True

    def kernels(self, fwd: bool) -> list[str]:
        lin: GroupedLinear = self.ops[1]  # type: ignore[assignment]
        return [
            f"{lin.kernels(fwd)[0]}, dgrad epilogue=dgelu (where the grouped kernels serve the "
            "recipe; else the per-expert loop, then act_bwd(gelu))"
        ]

    def fuser_backward(self, ctxs, dy, *, prev_grad_quantizer, extra_output_grads):
        act: _Activation = self.ops[0]  # type: ignore[assignment]
        lin: GroupedLinear = self.ops[1]  # type: ignore[assignment]
        (x,) = ctxs[0].saved
        out = None if x is None else lin.backward_grouped(ctxs[1], dy, dgelu_aux=x)
        if out is None:  # the two ops' own backward passes, one after the other
            dh, grads, extra = lin.op_backward(
                ctxs[1], dy, prev_grad_quantizer=None, extra_output_grads=extra_output_grads[1]
            )
            dx, _, _ = act.op_backward(ctxs[0], dh, prev_grad_quantizer=prev_grad_quantizer,
                                       extra_output_grads=extra_output_grads[0])  # fmt: skip
            return dx, [[], grads], [[], extra]
        ctxs[0].saved = []
        del x
        dx, grads, extra = out
        if prev_grad_quantizer is not None:
            dx = C.handoff_after(prev_grad_quantizer, dx)
        return dx, [[], grads], [[], extra]
