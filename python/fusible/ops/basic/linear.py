"""BasicLinear (y = x W^T, no bias) and Bias (y = x + b)."""

from __future__ import annotations

import math
from typing import Any

import torch

from fusible.ops import _compute as C
from fusible.ops.op import BasicOperation, OpContext
from fusible.ops.workspace import WorkspaceCache, quantize_weight
from fusible.quantization import QuantizerRole
from fusible.quantization.quantizers import MXFP8Quantizer, Quantizer

__all__ = ["BasicLinear", "Bias"]


class BasicLinear(BasicOperation):
    """``y = x @ weight.T``; ``weight`` is ``[out_features, in_features]``.

    Quantizer roles: forward ``input``, ``weight``, ``output``; backward ``grad_output``,
    ``grad_input`` (scope ``linear`` unless a module re-scopes it). Under FP8 per-tensor recipes the
    three GEMMs run in FP8 on cuBLASLt (CPU: the core library's reference GEMM) using the
    transposed copies the quantizers produce; MXFP8 GEMMs run on exactly dequantized operands.
    """

    role_scope = "linear"

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        name: str | None = None,
    ) -> None:
        super().__init__(name=name)
        if in_features <= 0 or out_features <= 0:
            raise ValueError(
                f"BasicLinear: in_features and out_features must be positive, got "
                f"{in_features} and {out_features}"
            )
        self.in_features, self.out_features = in_features, out_features
        self.weight = torch.nn.Parameter(
            torch.empty(out_features, in_features, device=device, dtype=dtype)
        )
        self.workspace_cache = WorkspaceCache()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight.device.type != "meta":
            torch.nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"

    def get_quantizer_roles(self, fwd: bool) -> list[QuantizerRole]:
        buckets = ("input", "weight", "output") if fwd else ("grad_output", "grad_input")
        return [QuantizerRole(b, self.scope, self.quantizer_name) for b in buckets]

    def input_quantizer(self) -> Quantizer | None:
        return self.get_quantizer(True, "input")

    def workspace_spec(self) -> tuple[torch.Tensor, Quantizer] | None:
        q = self.get_quantizer(True, "weight")
        return None if q is None else (self.weight, q)

    def grad_output_quantizer(self) -> Quantizer | None:
        return self.get_quantizer(False, "grad_output")

    def kernels(self, fwd: bool) -> list[str]:
        mx = isinstance(self.get_quantizer(True, "weight"), MXFP8Quantizer)
        how = " on dequantized MXFP8 operands (no native MXFP8 GEMM on this path)" if mx else ""
        return [f"gemm(fprop){how}"] if fwd else [f"gemm(dgrad){how}", f"gemm(wgrad){how}"]

    def check_input(self, x: Any) -> None:
        k = x.shape[-1]
        if k != self.in_features:
            raise ValueError(
                f"{type(self).__name__}: input feature size {k} does not match in_features "
                f"{self.in_features} (input shape {tuple(x.shape)})"
            )

    def quantize_operands(self, ctx: OpContext, x: Any, w: torch.Tensor) -> tuple[Any, Any]:
        """The input and weight as the GEMMs need them (quantized when a recipe is active), and
        what backward will need saved: the transposed copies (x^T for wgrad, W^T for dgrad)."""
        need_wgrad = bool(ctx.params_requires_grad and ctx.params_requires_grad[0])
        need_dgrad = ctx.input_requires_grad
        qx, qw = self.get_quantizer(True, "input"), self.get_quantizer(True, "weight")
        if isinstance(qx, MXFP8Quantizer) or isinstance(qw, MXFP8Quantizer):
            # MXFP8 GEMMs scale 32-element blocks along K for fprop and along M / N for the
            # backward GEMMs; partial blocks have no hardware GEMM layout.
            tokens = math.prod(x.shape[:-1])
            if self.in_features % 32 or self.out_features % 32 or tokens % 32:
                raise ValueError(
                    f"{type(self).__name__}: MXFP8 needs in_features, out_features and the token "
                    f"count divisible by 32, got {self.in_features}, {self.out_features} and "
                    f"{tokens}"
                )
        ctx.attrs["need_wgrad"], ctx.attrs["need_dgrad"] = need_wgrad, need_dgrad
        xq: Any = x if qx is None else C.quantize(qx, x, rowwise=True, columnwise=need_wgrad)
        if qw is None:
            return xq, w
        wq, ctx.new_workspace = quantize_weight(
            w, qw, ctx.workspace, ctx.cache_weight, columnwise=need_dgrad
        )
        return xq, wq

    def op_forward(self, ctx, x, params, *, next_input_quantizer, extra_inputs):
        self.check_input(x)
        (w,) = params
        out_dtype = C.hp_dtype(x)
        xq, wq = self.quantize_operands(ctx, x, w)
        if isinstance(xq, torch.Tensor) and isinstance(wq, torch.Tensor):
            y = torch.nn.functional.linear(xq, wq.to(xq.dtype))
        else:
            y, _ = C.gemm_fprop(xq, wq, out_dtype)
            y = y.view(*x.shape[:-1], self.out_features)
        ctx.saved = [xq if ctx.attrs["need_wgrad"] else None,
                     wq if ctx.attrs["need_dgrad"] else None]  # fmt: skip
        ctx.attrs["dtype"], ctx.attrs["w_dtype"] = out_dtype, w.dtype
        return y, []

    def linear_backward(
        self, ctx: OpContext, dy: Any, *, c: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(dx, dw); ``c`` is added to dx inside the dgrad GEMM (residual-gradient fusion)."""
        xq, wq = ctx.saved
        dtype = ctx.attrs["dtype"]
        qg = self.get_quantizer(False, "grad_output")
        lead = dy.shape[:-1]
        if qg is not None:
            dy = C.quantize(
                qg, dy, rowwise=ctx.attrs["need_dgrad"], columnwise=ctx.attrs["need_wgrad"]
            )
        dx = dw = None
        if (
            isinstance(dy, torch.Tensor)
            and (xq is None or isinstance(xq, torch.Tensor))
            and (wq is None or isinstance(wq, torch.Tensor))
        ):
            dy2 = C.as_2d(dy)
            if ctx.attrs["need_dgrad"]:
                assert wq is not None
                dx = (dy2 @ wq.to(dy2.dtype)).view(*lead, self.in_features)
                if c is not None:
                    dx = dx + c
            if ctx.attrs["need_wgrad"]:
                assert xq is not None
                dw = dy2.t() @ C.as_2d(xq).to(dy2.dtype)
        else:
            if ctx.attrs["need_dgrad"]:
                dx, _ = C.gemm_dgrad(dy, wq, dtype, c=None if c is None else C.as_2d(c))
                dx = dx.view(*lead, self.in_features)
            if ctx.attrs["need_wgrad"]:
                dw, _ = C.gemm_wgrad(dy, xq, ctx.attrs["w_dtype"])
        if dw is not None:
            dw = dw.to(ctx.attrs["w_dtype"])
        return dx, dw

    def op_backward(self, ctx, dy, *, prev_grad_quantizer, extra_output_grads):
        dx, dw = self.linear_backward(ctx, dy)
        return dx, [dw], []


class Bias(BasicOperation):
    """``y = x + bias`` (bias ``[features]``)."""

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
            raise ValueError(f"Bias: features must be positive, got {features}")
        self.features = features
        self.bias = torch.nn.Parameter(torch.zeros(features, device=device, dtype=dtype))

    def reset_parameters(self) -> None:
        """The initial value (zeros): what materialises a model built on the ``meta`` device,
        after ``to_empty()``."""
        with torch.no_grad():
            self.bias.zero_()

    def extra_repr(self) -> str:
        return f"features={self.features}"

    def op_forward(self, ctx, x, params, *, next_input_quantizer, extra_inputs):
        (b,) = params
        x = C.dequantize(x)
        if x.shape[-1] != self.features:
            raise ValueError(
                f"Bias: input feature size {x.shape[-1]} does not match features {self.features}"
            )
        ctx.attrs["dtype"] = b.dtype
        return x + b.to(x.dtype), []

    def op_backward(self, ctx, dy, *, prev_grad_quantizer, extra_output_grads):
        db = None
        if ctx.params_requires_grad[0]:
            db = C.as_2d(dy).float().sum(0).to(ctx.attrs["dtype"])
        return dy, [db], []
