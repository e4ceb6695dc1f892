"""Forward: GroupedLinear + GELU (an MoE expert MLP's first layer) as grouped GEMMs whose
epilogue adds the bias and applies GELU, writing GELU's input (kept for its backward) beside."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fusible import _kernels as K
from fusible.ops import _compute as C
from fusible.ops.basic.activation import ACTIVATIONS, _Activation
from fusible.ops.basic.grouped_linear import GroupedLinear
from fusible.ops.op import BasicOperation, FusedOperation

__all__ = ["ForwardGroupedLinearActivation", "accepts"]


def _epilogue(ops: Sequence[BasicOperation]) -> str | None:
    """The GEMM epilogue that computes the pair: the activation's (``bias_gelu_aux``), or its
    bias-free form for a GroupedLinear without bias; None where the GEMM has none."""
    lin, act = ops[0], ops[1]
    assert isinstance(lin, GroupedLinear) and isinstance(act, _Activation)
    epi = ACTIVATIONS[act.kind].gemm_epilogue
    if epi is None or lin.use_bias:
        return epi
    bare = epi.removeprefix("bias_")
    return bare if bare in K.GEMM_RULES.epilogues else None


def accepts(ops: Sequence[BasicOperation], recipe: Any) -> str | None:
    """Fusion rule (pattern: GroupedLinear then an activation). Rejections:
    - an activation kind with no GEMM epilogue (GELU with approximate="none", ReLU, ...);
    - out_features not a multiple of the aux epilogues' N rule (cuBLASLt's leading dimension of
      aux; required on every backend so that CPU and GPU fuse alike)."""
    lin = ops[0]
    assert isinstance(lin, GroupedLinear)
    if _epilogue(ops) is None:
        act = ops[1]
        return f"{type(act).__name__}({act.extra_repr()}) has no GEMM epilogue (kind {act.kind!r})"
    mult = K.GEMM_RULES.aux_n_multiple
    if lin.out_features % mult:
        return f"out_features {lin.out_features} is not a multiple of {mult} (the aux epilogue's N)"
    return None


class ForwardGroupedLinearActivation(FusedOperation):
    name = "grouped_linear_activation"
    forward, backward = True, False

    def __init__(self, ops: list[BasicOperation]) -> None:
        super().__init__(ops)
        epi = _epilogue(ops)
        assert epi is not None  # accepts() checked it
        self.epilogue = epi

    def kernels(self, fwd: bool) -> list[str]:
        lin: GroupedLinear = self.ops[0]  # type: ignore[assignment]
        act: _Activation = self.ops[1]  # type: ignore[assignment]
        *notes, step = lin.kernels(fwd)  # notes: what stored FP8 weights add
        return [
            *notes,
            f"{step}, epilogue={self.epilogue} (where the grouped kernels serve the recipe; else "
            f"the per-expert loop, then act_fwd({act.kind}))",
        ]

    def fuser_forward(self, ctxs, x, params, *, next_input_quantizer, extra_inputs):
        lin: GroupedLinear = self.ops[0]  # type: ignore[assignment]
        act: _Activation = self.ops[1]  # type: ignore[assignment]
        out = lin.forward_grouped(ctxs[0], x, params[0], self.epilogue)
        if out is None:  # the per-expert loop serves this pass: the two ops one after the other
            h, _ = lin.op_forward(ctxs[0], x, params[0], next_input_quantizer=None,
                                  extra_inputs=extra_inputs[0])  # fmt: skip
            y, _ = act.op_forward(ctxs[1], h, params[1], next_input_quantizer=next_input_quantizer,
                                  extra_inputs=extra_inputs[1])  # fmt: skip
            return y, [[], []]
        y, aux = out
        # The activation's backward reads its input (when a gradient reaches it).
        ctxs[1].saved = [aux if ctxs[1].input_requires_grad else None]
        if next_input_quantizer is not None:  # the epilogue cannot cast for the next op
            return C.handoff(next_input_quantizer, y), [[], []]
        return y, [[], []]
