"""Communication ops over a ``torch.distributed`` process group: AllGather, ReduceScatter,
AllReduce.

They are basic ops of the graph, like LayerNorm or Linear, so tensor- and sequence-parallel
layers are plain ``Sequential``\\ s of them and the fuser (and ``explain()``) sees the whole
chain. The collectives are torch.distributed's own (gloo on CPU, NCCL on CUDA): no other
communication layer. The sequence dimension is the first one (``[tokens, ...]`` or
``[seq, batch, ...]``), as in TransformerEngine's sequence parallelism: a tensor split along it
holds ``dim0 / group_size`` rows per rank, rank ``r`` the ``r``-th block.

Autograd (each rank holds its own loss term; a tensor replicated on every rank carries the same
gradient on every rank, the Megatron-LM convention):

========================  ===============================  ===================================
op                        forward                          backward
========================  ===============================  ===================================
``AllGather``             concatenate the ranks' blocks     reduce-scatter (sum): each rank gets
                          along dim 0                       the summed gradient of its block
``ReduceScatter``         sum over ranks, keep this rank's  all-gather along dim 0
                          block of dim 0
``AllReduce()``           sum over ranks                    identity (the output is replicated:
                                                            every rank holds its full gradient)
``AllReduce("backward")`` identity (the input is            sum over ranks (each rank's gradient
                          replicated)                       is a partial sum)
========================  ===============================  ===================================

On their own the ops move high-precision values (``input_quantizer()`` is None: the op before
writes high precision, the Linear after an ``AllGather`` quantizes the whole gathered tensor).
Under a recipe the fusion rules ``fp8_all_gather_linear`` (``AllGather`` then ``BasicLinear``,
forward) and ``linear_fp8_grad_all_gather`` (``BasicLinear`` then ``ReduceScatter``, backward)
quantize *before* the all-gather with :func:`gather_quantized` (one scale agreed across the
ranks): FP8 bytes travel, and the gathered FP8 data feeds the GEMM (see docs/distributed.md).
"""

from __future__ import annotations

from typing import Any

import torch

from fusible import _kernels as K
from fusible.ops import _compute as C
from fusible.ops.op import TORCH_VERSION, BasicOperation
from fusible.quantization.quantizers import (
    Float8CurrentScalingQuantizer,
    Float8Data,
    Float8Quantizer,
    MXFP8Data,
    MXFP8Quantizer,
    Quantizer,
)

__all__ = ["AllGather", "AllReduce", "ReduceScatter", "gather_quantized"]


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def _check_group(op: str, group: Any) -> None:
    dist = _dist()
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{op}: torch.distributed is not initialized; call "
            "torch.distributed.init_process_group() before building communication ops"
        )
    if group is not None and not isinstance(group, dist.ProcessGroup):
        raise TypeError(
            f"{op}: 'group' must be a torch.distributed.ProcessGroup or None (the default "
            f"group), got {type(group).__name__}"
        )


# Traced on torch < 2.13, the collectives whose result an op returns are the functional ones
# (a new tensor), not the in-place ones into a tensor made here. torch 2.11's dynamo makes every
# intermediate of an autograd.Function's forward an extra output of its traced forward (for side
# effects; no alias filtering), the in-place collective's trailing ``out.copy_(result)`` among
# them: the very tensor the op returns. Where that was the plan's output (a row-parallel Linear or
# GroupedLinear without bias: AllReduce / ReduceScatter last), autograd gave the tensor the extra
# output's slot, and the plan's backward got zeros for dy: dx was zero (test_fsdp_tp.py's
# compile_grow_* cases). The functional ops are what dynamo turns the in-place ones into, minus
# the copy: the same values. Eagerly, and on torch >= 2.13 (no such outputs), unchanged.
_FUNCTIONAL_WHEN_TRACED = TORCH_VERSION < (2, 13)


def _functional() -> bool:
    return _FUNCTIONAL_WHEN_TRACED and torch.compiler.is_compiling()


def _funcol() -> Any:
    import torch.distributed._functional_collectives as funcol

    return funcol


# torch >= 2.12 names the single-tensor collectives *_single (the *_tensor spellings warn).
def _all_gather(out: torch.Tensor, x: torch.Tensor, group: Any) -> None:
    dist = _dist()
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, x, group=group)


def _all_reduce_max(t: torch.Tensor, group: Any) -> None:
    dist = _dist()
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)


def _reduce_scatter(out: torch.Tensor, x: torch.Tensor, group: Any) -> None:
    dist = _dist()
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, x, op=dist.ReduceOp.SUM, group=group)


class _Collective(BasicOperation):
    """A collective over ``group`` (a ``torch.distributed.ProcessGroup``; None: the default
    group). The group's size is read once, at construction."""

    def __init__(self, group: Any = None, *, name: str | None = None) -> None:
        super().__init__(name=name)
        _check_group(type(self).__name__, group)
        self.group = group
        self.group_size = int(_dist().get_world_size(group))

    def extra_repr(self) -> str:
        return f"group_size={self.group_size}"

    def _backend(self) -> str:
        return str(_dist().get_backend(self.group))

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        if self.group_size == 1:
            return x
        if x.dim() == 0:
            raise ValueError(
                f"{type(self).__name__}: expected at least one dimension, got a scalar"
            )
        if _functional():
            return _funcol().all_gather_tensor(x, 0, self.group)  # type: ignore[no-any-return]
        out = x.new_empty((x.shape[0] * self.group_size, *x.shape[1:]))
        _all_gather(out, x, self.group)
        return out

    def _scatter(self, x: torch.Tensor, what: str) -> torch.Tensor:
        x = x.contiguous()
        if self.group_size == 1:
            return x
        n = x.shape[0] if x.dim() else 0
        if n % self.group_size:
            raise ValueError(
                f"{type(self).__name__}: the {what}'s first (sequence) dimension, {n}, must be "
                f"divisible by the group size {self.group_size} (shape {tuple(x.shape)})"
            )
        if _functional():
            return _funcol().reduce_scatter_tensor(x, "sum", 0, self.group)  # type: ignore[no-any-return]
        out = x.new_empty((n // self.group_size, *x.shape[1:]))
        _reduce_scatter(out, x, self.group)
        return out

    def _all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.group_size == 1:
            return x
        if _functional():
            return _funcol().all_reduce(x.contiguous(), "sum", self.group)  # type: ignore[no-any-return]
        out = x.contiguous().clone()  # never reduce into a tensor another op may hold
        _dist().all_reduce(out, op=_dist().ReduceOp.SUM, group=self.group)
        return out


class AllGather(_Collective):
    """Gather the ranks' blocks along the first (sequence) dimension: ``[n, ...]`` on each rank
    becomes ``[group_size * n, ...]``, rank ``r``'s block at rows ``r*n:(r+1)*n``. Backward:
    reduce-scatter (sum) of the gradient. The sequence-parallel input of a column-parallel
    Linear."""

    def op_forward(self, ctx, x, params, *, next_input_quantizer, extra_inputs):
        return self._gather(C.dequantize(x)), []

    def op_backward(self, ctx, dy, *, prev_grad_quantizer, extra_output_grads):
        return self._scatter(C.dequantize(dy), "gradient"), [], []

    def kernels(self, fwd: bool) -> list[str]:
        what = "all_gather(dim 0)" if fwd else "reduce_scatter(sum, dim 0)"
        return [f"{what} over {self.group_size} ranks [{self._backend()}]"]


class ReduceScatter(_Collective):
    """Sum over the ranks and keep this rank's block of the first (sequence) dimension:
    ``[m, ...]`` becomes ``[m / group_size, ...]`` (``m`` must be divisible by the group size).
    Backward: all-gather of the gradient. The sequence-parallel output of a row-parallel
    Linear."""

    def op_forward(self, ctx, x, params, *, next_input_quantizer, extra_inputs):
        return self._scatter(C.dequantize(x), "input"), []

    def op_backward(self, ctx, dy, *, prev_grad_quantizer, extra_output_grads):
        return self._gather(C.dequantize(dy)), [], []

    def kernels(self, fwd: bool) -> list[str]:
        what = "reduce_scatter(sum, dim 0)" if fwd else "all_gather(dim 0)"
        return [f"{what} over {self.group_size} ranks [{self._backend()}]"]


class AllReduce(_Collective):
    """Sum over the ranks in one pass, identity in the other.

    ``direction="forward"`` (default): ``y = sum_r x_r``, backward identity -- the output of a
    row-parallel Linear (its consumers are replicated, so each rank holds the full gradient).
    ``direction="backward"``: forward identity, backward ``dx = sum_r dy_r`` -- the replicated
    input of a column-parallel Linear (each rank's gradient is its columns' share)."""

    def __init__(
        self, group: Any = None, direction: str = "forward", *, name: str | None = None
    ) -> None:
        if direction not in ("forward", "backward"):
            raise ValueError(
                f"AllReduce: 'direction' must be 'forward' or 'backward', got {direction!r}"
            )
        super().__init__(group, name=name)
        self.direction = direction

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, direction={self.direction!r}"

    def op_forward(self, ctx, x, params, *, next_input_quantizer, extra_inputs):
        x = C.dequantize(x)
        return (self._all_reduce(x) if self.direction == "forward" else x), []

    def op_backward(self, ctx, dy, *, prev_grad_quantizer, extra_output_grads):
        dy = C.dequantize(dy)
        return (self._all_reduce(dy) if self.direction == "backward" else dy), [], []

    def kernels(self, fwd: bool) -> list[str]:
        if fwd != (self.direction == "forward"):
            return ["(identity)"]
        return [f"all_reduce(sum) over {self.group_size} ranks [{self._backend()}]"]


# ---- FP8 all-gather ------------------------------------------------------------------------------


def _gather_bytes(t: torch.Tensor, n: int, group: Any) -> torch.Tensor:
    """All-gather ``t`` along dim 0 as raw bytes (FP8 and E8M0 scales travel as ``uint8``: gloo
    has no FP8 type; a byte copy is exact on every backend) and return it in ``t``'s dtype."""
    t = t.contiguous()
    out = torch.empty((t.shape[0] * n, *t.shape[1:]), dtype=torch.uint8, device=t.device)
    _all_gather(out, t.view(torch.uint8), group)
    return out.view(t.dtype)


def gather_quantized(
    op: _Collective, q: Quantizer | None, x: torch.Tensor, *, columnwise: bool
) -> C.HandOff | None:
    """``x`` (this rank's rows) quantized with ``q`` *before* the all-gather over ``op.group``,
    the FP8 bytes and scales gathered, as a hand-off of the gathered tensor for the op after
    (``columnwise``: whether that op's weight gradient needs the columnwise copy). The result
    equals ``q`` quantizing the gathered tensor with the scale agreed across the ranks, bit for
    bit:

    - current scaling: the local amax is max-reduced over the group first (one 4-byte
      all-reduce, as TransformerEngine does), so every rank casts with the scale of the whole
      gathered tensor; only the rowwise copy travels, the transposed copy is a byte transpose of
      the gathered data (made by the Linear when wgrad needs it, same ``scale_inv``);
    - delayed scaling: the cast uses the state's scale (the same on every rank of the group: the
      slot's amax history records the max-reduced amax, the gathered tensor's, as the unfused
      path does); the 4-byte amax all-reduce runs after the cast, off its critical path;
    - MXFP8: each rank's rowwise blocks are 32 elements of its own rows (nothing to agree on);
      the columnwise blocks run along the rows, so they are a rank's own only when its row count
      is a multiple of 32. Both copies (data and E8M0 scales) travel when the weight gradient
      needs the columnwise copy, which moves more bytes than a 16-bit input.

    None where the FP8 all-gather does not apply or does not pay, so the caller gathers high
    precision (the unfused path): no quantizer, a quantizer that is not one of the three built-in
    kinds, MXFP8 with a columnwise copy whose blocks would straddle ranks (rows % 32) or whose
    two copies outweigh a 16-bit input."""
    n = op.group_size
    if q is None or x.dim() == 0:
        return None
    x = x.contiguous()
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    shape = torch.Size((x.shape[0] * n, *x.shape[1:]))
    kind = type(q)
    if kind is Float8CurrentScalingQuantizer or kind is Float8Quantizer:
        if kind is Float8CurrentScalingQuantizer:
            amax = K.compute_amax(x)
            if n > 1:
                _all_reduce_max(amax, op.group)
            scale, _ = K.compute_scale(amax, q.dtype, q.margin)  # type: ignore[attr-defined]
            data, _, scale_inv, _ = K.quantize_fp8(x, scale, q.dtype, True, False, want_amax=False)
        else:
            assert isinstance(q, Float8Quantizer)
            data, _, scale_inv, amax = K.quantize_fp8(x, q.scale, q.dtype, True, False)
            if n > 1:
                _all_reduce_max(amax, op.group)
            C.record_amax(q, amax)
        if n > 1:
            data = _gather_bytes(data, n, op.group)
        return C.HandOff(Float8Data._trusted(data, None, scale_inv, q.dtype, shape), x.dtype)
    if kind is MXFP8Quantizer:
        if columnwise and (rows % 32 or x.element_size() <= 2):
            return None
        x2 = x.reshape(rows, x.shape[-1])
        data, scale, col, col_scale = K.quantize_mxfp8(x2, q.dtype, True, columnwise)
        if n > 1:
            data, scale = _gather_bytes(data, n, op.group), _gather_bytes(scale, n, op.group)
            if columnwise:
                col = _gather_bytes(col, n, op.group)
                col_scale = _gather_bytes(col_scale, n, op.group)
        qd = MXFP8Data(
            data.view(shape), scale, col.view(shape) if columnwise else None,
            col_scale if columnwise else None, q.dtype, shape,
        )  # fmt: skip
        return C.HandOff(qd, x.dtype)
    return None
