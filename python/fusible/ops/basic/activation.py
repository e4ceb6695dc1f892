"""Activations (GELU, ReLU, SiLU, SwiGLU, GEGLU), with quantized output / gradient fused, and
:data:`ACTIVATIONS`, the one Python table of the family that the modules and the fusion rules read
(docs/architecture.md: how to add an activation)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from fusible import _kernels as K
from fusible.ops import _compute as C
from fusible.ops.op import BasicOperation, OpContext
from fusible.quantization.quantizers import Float8CurrentScalingQuantizer, Float8Data, Quantizer

__all__ = [
    "ACTIVATIONS",
    "GEGLU",
    "GELU",
    "ActivationKind",
    "ReLU",
    "SiLU",
    "SwiGLU",
    "activation_backward",
    "dact_quantized",
]


def _act(x: torch.Tensor, kind: str, glu: bool, q: Quantizer | None) -> torch.Tensor | C.HandOff:
    """act(x), written quantized by ``q`` when that fuses into the kernel."""
    fused = C.fused_quant_args(q, x.device)
    if fused is None:
        y, *_ = K.act_fwd(x, kind, x.dtype, "none", torch.float8_e4m3fn, None, True, False)
        return y if q is None else C.handoff_after(q, y)
    assert q is not None
    quant, fp8_dtype, scale, pow2, eps, into = fused
    colwise = q.columnwise
    _, d, d2, s, s2, amax = K.act_fwd(x, kind, None, quant, fp8_dtype, scale, True, colwise, pow2,
                                      eps, into)  # fmt: skip
    shape = torch.Size((*x.shape[:-1], x.shape[-1] // 2 if glu else x.shape[-1]))
    return C.wrap_quantized(q, (d, d2, s, s2, amax), shape, x.dtype)


def activation_backward(
    kind: str, ctx: OpContext, dy: torch.Tensor | C.HandOff, q: Quantizer | None, with_dbias: bool
) -> tuple[torch.Tensor | C.HandOff, torch.Tensor | None]:
    """(dx, dbias): dact, optionally the bias gradient (column sums of dx) and dx quantized by
    ``q`` (the preceding op's grad-output quantizer), in one kernel where the quantizer allows.

    Peak memory (this is the backward's peak in a Linear -> act -> Linear block): the kernel
    reads the saved input and ``dy`` (both high precision), so what it writes next to them is
    kept small. A per-tensor FP8 ``dx`` is written rowwise only; its transposed copy (the
    preceding Linear's wgrad operand) is a byte transpose of it made once the saved input is
    freed (the same bits: one per-tensor scale for both copies). Current scaling writes no
    high-precision ``dx`` at all: a first pass of the kernel takes the amax of the rounded values
    (its FP8 output, cast with a placeholder scale, is dropped), then the second casts with the
    scale of that amax -- bit for bit ``quantize_fp8_current`` of the high-precision ``dx``
    (activation.h: the quantized output is the cast of the rounded value; amax is max |rounded
    value|; both passes compute the same values)."""
    inputs = [C.dequantize(dy).contiguous(), *ctx.saved]
    ctx.saved = []  # the saved input is freed as soon as the kernel has read it
    del dy
    return dact_quantized(kind, inputs, q, with_dbias)


def dact_quantized(
    kind: str, inputs: list[torch.Tensor], q: Quantizer | None, with_dbias: bool
) -> tuple[torch.Tensor | C.HandOff, torch.Tensor | None]:
    """:func:`activation_backward` on ``inputs = [dy, x]`` (``dy`` contiguous, ``x`` the
    forward's input), which it empties: the caller hands over its references, so both are freed
    as soon as the kernel has read them. ``kind="identity"`` with ``[dy, dy]``: ``dy`` quantized
    by ``q`` and its column sums, in one pass over ``dy`` (Bias's backward)."""
    x = inputs.pop()
    dy = inputs.pop()
    shape, dtype = x.shape, x.dtype
    if isinstance(q, Float8CurrentScalingQuantizer) and dy.dtype == dtype:
        d, scale_inv, dbias = _dact_current_scaling(kind, dy, x, q, with_dbias)
        del x, dy
        data_t = K.transpose_fp8(C.as_2d(d)) if q.columnwise else None
        qd = Float8Data(d if q.rowwise else None, data_t, scale_inv, q.dtype, shape)
        return C.HandOff(qd, dtype), (dbias if with_dbias else None)
    fused = C.fused_quant_args(q, x.device)
    if fused is None:
        dx, *_, dbias = K.act_bwd(dy, x, kind, dtype, "none", torch.float8_e4m3fn, None, True,
                                  False, with_dbias)  # fmt: skip
        del x
        return (dx if q is None else C.handoff_after(q, dx)), (dbias if with_dbias else None)
    assert q is not None
    quant, fp8_dtype, scale, pow2, eps, into = fused
    colwise = q.columnwise
    # The transposed copy after the kernel, from the rowwise (the saved input freed first);
    # not for the identity kind, which has no saved input: both copies in its one pass, as the
    # Linear's own cast-transpose would write them (one operator, not two).
    late_t = colwise and quant == "fp8" and kind != "identity"
    _, d, d2, s, s2, amax, dbias = K.act_bwd(dy, x, kind, None, quant, fp8_dtype, scale, True,
                                             colwise and not late_t, with_dbias, pow2,
                                             eps, into)  # fmt: skip
    del x, dy
    if late_t:
        d2 = K.transpose_fp8(C.as_2d(d))
    dx = C.wrap_quantized(q, (d, d2, s, s2, amax), shape, dtype)
    return dx, (dbias if with_dbias else None)


def _dact_current_scaling(
    kind: str,
    dy: torch.Tensor,
    x: torch.Tensor,
    q: Float8CurrentScalingQuantizer,
    with_dbias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(data, scale_inv, dbias)``: :func:`activation_backward`'s rowwise FP8 ``dx`` under
    current scaling, without a high-precision ``dx`` (``dy`` and ``x`` of one dtype, the one
    ``dx`` is rounded to either way)."""
    placeholder = torch.ones(1, dtype=torch.float32, device=x.device)
    amax = K.act_bwd(dy, x, kind, None, "fp8", q.dtype, placeholder, True, False, False)[5]
    scale, _ = K.compute_scale(amax, q.dtype, q.margin)
    _, d, _, scale_inv, _, _, dbias = K.act_bwd(dy, x, kind, None, "fp8", q.dtype, scale, True,
                                                False, with_dbias)  # fmt: skip
    return d, scale_inv, dbias


class _Activation(BasicOperation):
    kind: str = ""

    @property
    def glu(self) -> bool:
        """Gated ([a | b] in, half the features out): the kernels' table says."""
        return self.kind in K.GATED_ACTIVATIONS

    def kernels(self, fwd: bool) -> list[str]:
        return (
            [f"act_fwd({self.kind}, + quantize for the next op when its quantizer allows)"]
            if fwd
            else [f"act_bwd({self.kind})"]
        )

    def op_forward(self, ctx, x, params, *, next_input_quantizer, extra_inputs):
        x = C.dequantize(x).contiguous()
        if self.glu and x.shape[-1] % 2:
            raise ValueError(
                f"{type(self).__name__}: input feature size must be even (gate and linear halves), "
                f"got {x.shape[-1]}"
            )
        ctx.saved = [x if ctx.input_requires_grad else None]  # backward runs only then
        return _act(x, self.kind, self.glu, next_input_quantizer), []

    def op_backward(self, ctx, dy, *, prev_grad_quantizer, extra_output_grads):
        dx, _ = activation_backward(self.kind, ctx, dy, prev_grad_quantizer, False)
        return dx, [], []


class GELU(_Activation):
    """GELU; ``approximate="tanh"`` (default, the form cuBLASLt's GEMM epilogue computes, so it
    can fuse into the preceding Linear) or ``"none"`` (erf)."""

    def __init__(self, approximate: str = "tanh", *, name: str | None = None) -> None:
        super().__init__(name=name)
        if approximate not in ("tanh", "none"):
            raise ValueError(f"GELU: approximate must be 'tanh' or 'none', got {approximate!r}")
        self.approximate = approximate
        self.kind = "gelu" if approximate == "tanh" else "gelu_erf"

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


class ReLU(_Activation):
    kind = "relu"


class SiLU(_Activation):
    kind = "silu"


class SwiGLU(_Activation):
    """``silu(x[..., :h]) * x[..., h:]``; output has half the input's features."""

    kind = "swiglu"


class GEGLU(_Activation):
    """``gelu_tanh(x[..., :h]) * x[..., h:]``."""

    kind = "geglu"


# ---- the registry ------------------------------------------------------------------------------


def _gated(act: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    def ref(x: torch.Tensor) -> torch.Tensor:
        a, b = x.chunk(2, dim=-1)
        return act(a) * b

    return ref


_gelu_tanh = partial(F.gelu, approximate="tanh")


@dataclass(frozen=True)
class ActivationKind:
    """One activation kind: a row of :data:`ACTIVATIONS`. Whether it is gated, and that it exists
    at all, is the core library's table (``FUS_ACTIVATION_TABLE``, read as ``_kernels``'
    ``ACTIVATIONS`` / ``GATED_ACTIVATIONS``)."""

    kind: str
    op: type[_Activation]
    reference: Callable[[torch.Tensor], torch.Tensor]  # torch: what the kernels compute
    op_kwargs: dict[str, Any] = field(default_factory=dict)  # op(**op_kwargs).kind == kind
    in_modules: bool = True  # offered as the modules' ``activation=`` (by its kind)
    gemm_epilogue: str | None = None  # computed by the GEMM after Linear + Bias (forward fusion)

    @property
    def gated(self) -> bool:
        return self.kind in K.GATED_ACTIVATIONS

    def make(self) -> _Activation:
        return self.op(**self.op_kwargs)


# The one table of the Python side, in the kernels' order. The modules' ``activation=`` choices
# (modules/_common.py) and the fusion rules (ops/fused/__init__.py) are read from it.
ACTIVATIONS: dict[str, ActivationKind] = {
    a.kind: a
    for a in (
        ActivationKind("gelu", GELU, _gelu_tanh, gemm_epilogue="bias_gelu_aux"),
        ActivationKind("gelu_erf", GELU, F.gelu, {"approximate": "none"}, in_modules=False),
        ActivationKind("relu", ReLU, F.relu),
        ActivationKind("silu", SiLU, F.silu),
        ActivationKind("swiglu", SwiGLU, _gated(F.silu)),
        ActivationKind("geglu", GEGLU, _gated(_gelu_tanh)),
    )
}
# Kinds of the core library's table that are kernels only, not activation ops: "identity" is
# the gradient's quantized cast with its column sums (Bias's backward, dact_quantized).
KERNEL_ONLY_KINDS = ("identity",)
if tuple(ACTIVATIONS) + KERNEL_ONLY_KINDS != K.ACTIVATIONS:
    raise ImportError(
        f"fusible: ops.basic.activation.ACTIVATIONS {tuple(ACTIVATIONS)} does not match the core "
        f"library's activation table {K.ACTIVATIONS} less {KERNEL_ONLY_KINDS} "
        "(FUS_ACTIVATION_TABLE, activation.h)"
    )
