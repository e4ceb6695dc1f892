"""Forward: BasicLinear + Bias (+ an activation that a GEMM epilogue computes: GELU) as one GEMM
with a bias (+ activation-aux) epilogue (ops.basic.activation.ACTIVATIONS' ``gemm_epilogue``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fusible.ops import _compute as C
from fusible.ops.basic import BasicLinear, Bias
from fusible.ops.basic.activation import ACTIVATIONS, _act, _Activation
from fusible.ops.op import BasicOperation, FusedOperation
from fusible.quantization.quantizers import Float8BlockData

__all__ = ["ForwardLinearBiasActivation", "accepts"]


def accepts(ops: Sequence[BasicOperation], recipe: Any) -> str | None:
    """Fusion rule. Rejections:
    - an activation kind with no GEMM epilogue (GELU with approximate="none": cuBLASLt's GELU
      epilogue computes the tanh form only);
    - a Bias whose size differs from the Linear's output (the unfused path reports the error)."""
    linear, bias = ops[0], ops[1]
    assert isinstance(linear, BasicLinear) and isinstance(bias, Bias)
    if bias.features != linear.out_features:
        return "bias size differs from out_features"
    if len(ops) == 3 and _epilogue(ops) == "bias":
        act = ops[2]
        return f"{type(act).__name__}({act.extra_repr()}) has no GEMM epilogue (kind {act.kind!r})"
    return None


def _epilogue(ops: Sequence[BasicOperation]) -> str:
    """The GEMM epilogue of Linear + Bias (+ activation): the activation kind's, else ``bias``."""
    if len(ops) < 3:
        return "bias"
    act: _Activation = ops[2]  # type: ignore[assignment]
    return ACTIVATIONS[act.kind].gemm_epilogue or "bias"


class ForwardLinearBiasActivation(FusedOperation):
    name = "linear_bias_activation"
    forward, backward = True, False

    def __init__(self, ops: list[BasicOperation]) -> None:
        super().__init__(ops)
        self.epilogue = _epilogue(ops)  # fixed by the ops; read at every step

    def kernels(self, fwd: bool) -> list[str]:
        epi = self.epilogue
        linear: BasicLinear = self.ops[0]  # type: ignore[assignment]
        return [*linear.weight_kernels(fwd), linear.gemm_kernel(f"fprop, epilogue={epi}")]

    def fuser_forward(self, ctxs, x, params, *, next_input_quantizer, extra_inputs):
        linear: BasicLinear = self.ops[0]  # type: ignore[assignment]
        linear.check_input(x)
        (w,), (b,) = params[0], params[1]
        out_dtype = C.hp_dtype(x)
        lead = x.shape[:-1]
        xq, wq, _ = linear.fprop_operands(ctxs[0], x, w, out_dtype)
        act = len(self.ops) == 3
        # The blockwise GEMM has no epilogues: after its bias, the activation kernel writes the
        # next op's blockwise input itself (the bits of activation then cast).
        q = next_input_quantizer
        late_act = (
            act
            and type(xq) is Float8BlockData  # no calls on the other recipes' hot path
            and C.blockwise_gemm(xq, wq)
            and C.fused_quant_args(q, b.device) is not None
        )
        epi = "bias" if late_act else self.epilogue
        y, aux = C.gemm_fprop(xq, wq, out_dtype, bias=b.to(out_dtype), epilogue=epi)
        aux = y if late_act else aux
        del xq, wq  # freed before a hand-off cast allocates
        n = linear.out_features
        ctxs[1].attrs["dtype"] = b.dtype
        y = C.gemm_output(y, (*lead, n))
        if act:  # the activation's backward reads the pre-activation (when a gradient reaches it)
            ctxs[2].saved = [C.in_shape(aux, (*lead, n)) if ctxs[2].input_requires_grad else None]
        if late_act:
            act_op: _Activation = self.ops[2]  # type: ignore[assignment]
            return _act(y, act_op.kind, False, q), [[] for _ in self.ops]
        if next_input_quantizer is not None:
            # The GEMM epilogue cannot cast for the next op here; one cast kernel does.
            return C.handoff(next_input_quantizer, y), [[] for _ in self.ops]
        return y, [[] for _ in self.ops]
