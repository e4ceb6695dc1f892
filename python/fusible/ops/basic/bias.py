"""Bias: ``y = x + b`` over the last dimension (fused into the preceding GEMM's epilogue, or
into the activation backward's bias gradient, by the fusion rules); ReturnBias: the bias handed
back to the caller instead (TransformerEngine's ``return_bias=True``)."""

from __future__ import annotations

import torch

from fusible.ops import _compute as C
from fusible.ops.basic.activation import dact_quantized
from fusible.ops.op import BasicOperation

__all__ = ["Bias", "ReturnBias"]

_HALF = (torch.bfloat16, torch.float16)


class _BiasParameter(BasicOperation):
    """A ``bias`` parameter ``[features]``, zero-initialised: what Bias and ReturnBias share
    (not a Bias: the fusion rules match Bias by type, and ReturnBias must not be fused as one)."""

    def __init__(
        self,
        features: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__(name=name)
        if features <= 0:
            raise ValueError(f"{type(self).__name__}: features must be positive, got {features}")
        self.features = features
        self.bias = torch.nn.Parameter(torch.zeros(features, device=device, dtype=dtype))

    def reset_parameters(self) -> None:
        """The initial value (zeros): what materialises a model built on the ``meta`` device,
        after ``to_empty()``."""
        with torch.no_grad():
            self.bias.zero_()

    def extra_repr(self) -> str:
        return f"features={self.features}"

    def _bias_for(self, ctx, x, params):
        """``(x, b)``: the input dequantized, checked against ``features``, and the bias; the
        bias's dtype kept for backward."""
        (b,) = params
        x = C.dequantize(x)
        if x.shape[-1] != self.features:
            raise ValueError(
                f"{type(self).__name__}: input feature size {x.shape[-1]} does not match "
                f"features {self.features}"
            )
        ctx.attrs["dtype"] = b.dtype
        return x, b


class ReturnBias(_BiasParameter):
    """Passes ``x`` on unchanged and emits the bias (in ``x``'s dtype) as an extra output of
    ``Sequential.forward``, which then returns ``(y, bias)``: TransformerEngine's
    ``return_bias=True``, for a caller that adds the bias itself later (fused with a dropout and
    a residual add, or after a tensor-parallel reduction). Its gradient is the gradient of that
    output."""

    num_extra_outputs = 1
    computes = False

    def op_forward(self, ctx, x, params, *, next_input_quantizer, extra_inputs):
        x, b = self._bias_for(ctx, x, params)
        # A copy: an output of the plan's autograd function must not alias its parameter input.
        return x, [b.to(x.dtype, copy=True)]

    def op_backward(self, ctx, dy, *, prev_grad_quantizer, extra_output_grads):
        (g,) = extra_output_grads
        db = None if g is None or not ctx.params_requires_grad[0] else g.to(ctx.attrs["dtype"])
        return dy, [db], []


class Bias(_BiasParameter):
    """``y = x + bias`` (bias ``[features]``)."""

    def op_forward(self, ctx, x, params, *, next_input_quantizer, extra_inputs):
        x, b = self._bias_for(ctx, x, params)
        return x + b.to(x.dtype), []

    def kernels(self, fwd: bool) -> list[str]:
        return (
            []
            if fwd
            else ["act_bwd(identity, dbias, quantized grad for the preceding op) where its "
                  "quantizer fuses, else a column sum"]
        )  # fmt: skip

    def op_backward(self, ctx, dy, *, prev_grad_quantizer, extra_output_grads):
        db = None
        q = prev_grad_quantizer
        if ctx.params_requires_grad[0] and q is not None:
            g = C.dequantize(dy)
            # The preceding op (a Linear) takes dy quantized: its cast and the bias gradient in
            # one pass over dy (activation.h's identity kind: bit for bit the quantizer's cast).
            # Where dy's dtype is the bias's (else the bias gradient keeps its fp32 sum), and the
            # quantizer fuses into the kernel: delayed scaling, MXFP8 (and blockwise on CPU).
            # Not current scaling: it needs dy's amax before the cast, so the kernel would run
            # twice plus a transpose, more operators than quantize_fp8_current and a sum.
            if g.dtype == ctx.attrs["dtype"] and C.fused_quant_args(q, g.device) is not None:
                inputs = [g.contiguous()] * 2
                del dy, g
                dx, db = dact_quantized("identity", inputs, q, True)
                return dx, [db], []
        if ctx.params_requires_grad[0]:
            # fp32 accumulation without an fp32 copy of dy (the copy cost more than the sum).
            # A contiguous 16-bit dy of the bias's dtype: ATen's sum accumulates it in fp32 and
            # rounds once, the bits of the two-operator form in one kernel (tested).
            dt, g = ctx.attrs["dtype"], C.as_2d(dy)
            if g.dtype == dt and dt in _HALF and g.is_contiguous():
                db = g.sum(0)
            else:
                db = g.sum(0, dtype=torch.float32).to(dt)
        return dy, [db], []
