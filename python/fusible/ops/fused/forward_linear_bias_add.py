"""Forward: BasicLinear (+ Bias) + AddExtraInput as one GEMM accumulating into the residual."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fusible.ops import _compute as C
from fusible.ops.basic import BasicLinear, Bias
from fusible.ops.op import BasicOperation, FusedOperation

__all__ = ["ForwardLinearBiasAdd", "accepts"]


def accepts(ops: Sequence[BasicOperation], recipe: Any) -> str | None:
    """Fusion rule. Rejections:
    - a Bias whose size differs from the Linear's output (the unfused path reports the error)."""
    linear = ops[0]
    assert isinstance(linear, BasicLinear)
    if isinstance(ops[1], Bias) and ops[1].features != linear.out_features:
        return "bias size differs from out_features"
    return None


class ForwardLinearBiasAdd(FusedOperation):
    name = "linear_bias_add"
    forward, backward = True, False

    def kernels(self, fwd: bool) -> list[str]:
        epi = "bias" if isinstance(self.ops[1], Bias) else "none"
        linear: BasicLinear = self.ops[0]  # type: ignore[assignment]
        what = f"fprop, epilogue={epi}, beta=1 accumulate into the extra input"
        return [*linear.weight_kernels(fwd), linear.gemm_kernel(what)]

    def fuser_forward(self, ctxs, x, params, *, next_input_quantizer, extra_inputs):
        linear: BasicLinear = self.ops[0]  # type: ignore[assignment]
        linear.check_input(x)
        has_bias = isinstance(self.ops[1], Bias)
        (w,) = params[0]
        (residual,) = extra_inputs[-1]
        out_dtype = C.hp_dtype(x)
        lead = x.shape[:-1]
        n = linear.out_features
        if tuple(residual.shape) != (*lead, n):
            raise ValueError(
                f"AddExtraInput: extra input shape {tuple(residual.shape)} does not match the main "
                f"input shape {(*lead, n)}"
            )
        xq, wq, _ = linear.fprop_operands(ctxs[0], x, w, out_dtype)
        bias = params[1][0].to(out_dtype) if has_bias else None
        y, _ = C.gemm_fprop(xq, wq, out_dtype, bias=bias,
                               epilogue="bias" if has_bias else "none",
                               c=C.as_2d(residual.to(out_dtype)).contiguous())  # fmt: skip
        if has_bias:
            ctxs[1].attrs["dtype"] = params[1][0].dtype
        ctxs[-1].attrs["extra_dtype"] = residual.dtype
        return C.gemm_output(y, (*lead, n)), [[] for _ in self.ops]
