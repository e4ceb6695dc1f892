"""Backward: an activation after a GroupedLinear (an MoE expert MLP's first layer) under delayed
scaling: per expert one activation-backward kernel writes the layer's output gradient in FP8 with
that expert's scale, its bias gradient and its amax, where unfused the activation kernel writes a
bf16 gradient that the grouped cast and the grouped bias gradient then read again."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from fusible import _kernels as K
from fusible.ops import _compute as C
from fusible.ops.basic.activation import _Activation
from fusible.ops.basic.grouped_linear import GradCast, GroupedLinear
from fusible.ops.op import BasicOperation, FusedOperation
from fusible.quantization.quantizers import Float8Data, Float8Quantizer

__all__ = ["BackwardGroupedLinearActivation", "accepts"]


def accepts(ops: Sequence[BasicOperation], recipe: Any) -> str | None:
    """Fusion rule (pattern: GroupedLinear then an activation, in forward order). Rejections:
    - a gated activation (its input has twice the GroupedLinear's output features; the kernel's
      dbias is the gradient of the gate and linear halves together)."""
    act = ops[1]
    assert isinstance(act, _Activation)
    if act.glu:
        return f"{type(act).__name__} is gated"
    return None


class BackwardGroupedLinearActivation(FusedOperation):
    name = "dact_grouped_linear"
    forward, backward = False, True

    def kernels(self, fwd: bool) -> list[str]:
        lin: GroupedLinear = self.ops[0]  # type: ignore[assignment]
        act: _Activation = self.ops[1]  # type: ignore[assignment]
        *notes, step = lin.kernels(fwd)  # notes: what stored FP8 weights add
        for done_here in ("grouped_quantize_fp8(grad_output), ", ", grouped_bias_grad"):
            step = step.replace(done_here, "")
        return [
            *notes,
            f"per expert act_bwd({act.kind}, FP8 with the expert's scale, dbias) + transpose_fp8, "
            f"then {step} (no grouped_bias_grad; delayed scaling with the grouped kernels; else "
            "unfused)",
        ]

    def fuser_backward(self, ctxs, dy, *, prev_grad_quantizer, extra_output_grads):
        lin: GroupedLinear = self.ops[0]  # type: ignore[assignment]
        act: _Activation = self.ops[1]  # type: ignore[assignment]
        x = ctxs[1].saved[0]
        dy_t = C.dequantize(dy)
        out = None
        # Delayed scaling only: its scales are known before the cast, so one kernel pass casts.
        if (
            x is not None
            and isinstance(dy_t, torch.Tensor)
            and dy_t.dtype == x.dtype
            and lin._fp8_kind(False) is Float8Quantizer
        ):
            # The activation's input goes with its last reference once the casts have read it
            # (as activation_backward frees it), not after fc1's GEMMs.
            held = [C.as_2d(dy_t).contiguous(), C.as_2d(x), ctxs[1]]
            del x
            grad_cast = _dact_cast(act.kind, held, ctxs[0].attrs)
            out = lin.backward_grouped(ctxs[0], dy_t, grad_cast)
        if out is None:  # the two ops' own backward passes, one after the other
            dh, _, _ = act.op_backward(
                ctxs[1], dy, prev_grad_quantizer=None, extra_output_grads=extra_output_grads[1]
            )
            dx, grads, extra = lin.op_backward(
                ctxs[0], dh, prev_grad_quantizer=prev_grad_quantizer,
                extra_output_grads=extra_output_grads[0],
            )  # fmt: skip
            return dx, [grads, []], [extra, []]
        dx, grads, extra = out
        return dx, [grads, []], [extra, []]


def _dact_cast(kind: str, held: list[Any], attrs: dict[str, Any]) -> GradCast:
    """The :data:`GradCast` of :meth:`GroupedLinear.backward_grouped`: per expert with tokens,
    ``act_bwd`` of its rows writing the rowwise FP8 gradient with the expert's delayed scale
    (the cast of the rounded value: the bits of the unfused cast), its amax into the expert's
    history slot and its column sums (the bias gradient, summed in the activation kernel's
    order); the transposed copy is a byte transpose of it (one scale for both copies).
    ``held``: ``[dy, x, the activation's context]``, emptied (and the context's saved input
    dropped) once every expert is cast."""

    def cast(
        qs: list[Any], splits: tuple[int, ...], rowwise: bool, columnwise: tuple[bool, ...]
    ) -> tuple[list[Float8Data], list[torch.Tensor | None] | None]:
        dy, x, act_ctx = held
        need_bgrad, b_dtypes = attrs["need_bgrad"], attrs["b_dtypes"]
        bgrad = bool(need_bgrad) and any(need_bgrad)
        cols = dy.shape[-1]
        gs: list[Float8Data] = []
        dbs: list[torch.Tensor | None] = []
        start = 0
        for i, (q, m) in enumerate(zip(qs, splits, strict=True)):
            db = None
            if m == 0:  # no kernel: empty copies and 1 / scale, as the grouped cast leaves them
                rows_, cols_ = (
                    dy.new_empty((0, cols), dtype=q.dtype),
                    dy.new_empty((cols, 0), dtype=q.dtype),
                )
                gs.append(Float8Data._trusted(rows_, cols_, torch.reciprocal(q.scale), q.dtype,
                                              torch.Size((0, cols))))  # fmt: skip
                if bgrad and need_bgrad[i]:
                    db = dy.new_zeros(cols, dtype=b_dtypes[i])
                dbs.append(db)
                continue
            fused = C.fused_quant_args(q, dy.device)
            assert fused is not None  # delayed scaling: every backend fuses the cast
            quant, fp8_dtype, scale, pow2, eps, into = fused
            with_dbias = bgrad and bool(need_bgrad[i])
            _, d, _, scale_inv, _, amax, dbias = K.act_bwd(
                dy[start : start + m], x[start : start + m], kind, None, quant, fp8_dtype, scale,
                True, False, with_dbias, pow2, eps, into,
            )  # fmt: skip
            C.record_amax(q, amax)
            data_t = K.transpose_fp8(d) if columnwise[i] else None
            gs.append(Float8Data._trusted(d, data_t, scale_inv, q.dtype, torch.Size((m, cols))))
            dbs.append(dbias.to(b_dtypes[i]) if with_dbias else None)
            start += m
        act_ctx.saved = []
        held.clear()
        return gs, (dbs if bgrad else None)

    return cast
