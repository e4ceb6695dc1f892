"""LayerNorm and RMSNorm over the last dimension, with the next op's input quantizer fused."""

from __future__ import annotations

import torch

from fusible import _kernels as K
from fusible.ops import _compute as C
from fusible.ops.op import BasicOperation

__all__ = ["LayerNorm", "RMSNorm"]


class _Norm(BasicOperation):
    kind: str = ""

    def __init__(
        self,
        normalized_shape: int,
        *,
        eps: float = 1e-5,
        zero_centered_gamma: bool = False,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__(name=name)
        if normalized_shape <= 0:
            raise ValueError(f"{type(self).__name__}: normalized_shape must be positive")
        if not eps > 0:
            raise ValueError(f"{type(self).__name__}: eps must be > 0, got {eps}")
        self.normalized_shape, self.eps = normalized_shape, float(eps)
        self.zero_centered_gamma = zero_centered_gamma
        init = torch.zeros if zero_centered_gamma else torch.ones
        self.weight = torch.nn.Parameter(init(normalized_shape, device=device, dtype=dtype))
        if self.kind == "layernorm":
            self.bias = torch.nn.Parameter(
                torch.zeros(normalized_shape, device=device, dtype=dtype)
            )

    def reset_parameters(self) -> None:
        """The initial values (gamma 1, i.e. weight 0 when ``zero_centered_gamma``; beta 0): what
        materialises a model built on the ``meta`` device, after ``to_empty()``."""
        with torch.no_grad():
            self.weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
            if self.kind == "layernorm":
                self.bias.zero_()

    def extra_repr(self) -> str:
        zc = self.zero_centered_gamma
        return f"{self.normalized_shape}, eps={self.eps}, zero_centered_gamma={zc}"

    def kernels(self, fwd: bool) -> list[str]:
        return (
            [f"norm_fwd({self.kind}, + quantize for the next op when its quantizer allows)"]
            if fwd
            else [f"norm_bwd({self.kind})"]
        )

    def op_forward(self, ctx, x, params, *, next_input_quantizer, extra_inputs):
        x = C.dequantize(x)
        if x.shape[-1] != self.normalized_shape:
            raise ValueError(
                f"{type(self).__name__}: input feature size {x.shape[-1]} does not match "
                f"normalized_shape {self.normalized_shape}"
            )
        gamma = params[0].to(x.dtype)
        beta = params[1].to(x.dtype) if len(params) > 1 else None
        fused = C.fused_quant_args(next_input_quantizer, x.device)
        x = x.contiguous()
        if fused is None:
            y, *_, mean, rstd = K.norm_fwd(x, gamma, beta, self.eps, self.kind,
                                           self.zero_centered_gamma, x.dtype, "none",
                                           torch.float8_e4m3fn, None, True, False)  # fmt: skip
            q = next_input_quantizer
            out = y if q is None else C.handoff_after(q, y)
        else:
            # Norm + quantize: the kernel writes the next op's FP8 input directly.
            quant, fp8_dtype, scale, pow2, eps, into = fused
            assert next_input_quantizer is not None
            colwise = next_input_quantizer.columnwise
            y, d, d2, s, s2, amax, mean, rstd = K.norm_fwd(
                x, gamma, beta, self.eps, self.kind, self.zero_centered_gamma, None, quant,
                fp8_dtype, scale, True, colwise, pow2, eps, into,
            )  # fmt: skip
            out = C.wrap_quantized(next_input_quantizer, (d, d2, s, s2, amax), x.shape, x.dtype)
        # What backward reads -- nothing when no gradient reaches here (it does not run).
        needed = ctx.input_requires_grad or any(ctx.params_requires_grad)
        ctx.saved = [x, mean, rstd, params[0]] if needed else [None] * 4
        ctx.attrs["dtype"] = x.dtype
        return out, []

    def op_backward(self, ctx, dy, *, prev_grad_quantizer, extra_output_grads):
        x, mean, rstd, gamma = ctx.saved
        dy = C.dequantize(dy).contiguous()
        dx, dgamma, dbeta = K.norm_bwd(dy, x, mean, rstd, gamma.to(x.dtype), self.kind,
                                       self.zero_centered_gamma)  # fmt: skip
        grads = [dgamma.to(gamma.dtype)]
        if self.kind == "layernorm":
            grads.append(dbeta.to(gamma.dtype))
        return dx, grads, []


class LayerNorm(_Norm):
    """``(x - mean) / sqrt(var + eps) * gamma + beta`` (``gamma = 1 + weight`` when
    ``zero_centered_gamma``)."""

    kind = "layernorm"


class RMSNorm(_Norm):
    """``x / sqrt(mean(x^2) + eps) * gamma``."""

    kind = "rmsnorm"


if (LayerNorm.kind, RMSNorm.kind) != K.NORM_KINDS:
    raise ImportError(
        f"fusible: ops.basic.normalization's kinds {(LayerNorm.kind, RMSNorm.kind)} do not match "
        f"the core library's normalization table {K.NORM_KINDS} (FUS_NORM_KIND_TABLE, "
        "normalization.h)"
    )
