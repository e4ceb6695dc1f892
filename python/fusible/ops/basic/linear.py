"""BasicLinear (y = x W^T, no bias) and Bias (y = x + b)."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import torch

from fusible import _kernels as K
from fusible.ops import _compute as C

# Split by concern: the quantized-weight lifecycle (quantized_weight.py) and Bias (bias.py); their
# names stay importable from here.
from fusible.ops.basic.bias import Bias
from fusible.ops.basic.quantized_weight import (
    QuantizedWeightOp,
    _stored_matches,
    kaiming_init,
    stored_operand,
)
from fusible.ops.op import BasicOperation, OpContext
from fusible.ops.workspace import WorkspaceCache, quantize_weight
from fusible.quantization import QuantizerRole
from fusible.quantization.quantizers import (
    Float8BlockData,
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8Data,
    Float8Quantizer,
    MXFP8Data,
    MXFP8Quantizer,
    QuantizedTensor,
    Quantizer,
)
from fusible.quantization.roles import UNREAD_BUCKETS

__all__ = ["BasicLinear", "Bias"]


class BasicLinear(QuantizedWeightOp):
    """``y = x @ weight.T``; ``weight`` is ``[out_features, in_features]``.

    Quantizer roles: forward ``input``, ``weight``, ``output``; backward ``grad_output``,
    ``grad_input`` (scope ``linear`` unless a module re-scopes it). Under FP8 per-tensor recipes the
    three GEMMs run in FP8 on cuBLASLt (CPU: the core library's reference GEMM) using the
    transposed copies the quantizers produce; MXFP8 GEMMs run on exactly dequantized operands.

    A high-precision weight under an FP8 recipe (the built-in quantizers) is not kept quantized
    from forward to backward: the forward quantizes its rowwise copy only, and dgrad quantizes
    the parameter again for its columnwise copy -- the same bits (delayed scaling casts with the
    scale the forward cast with, saved; current scaling takes the same amax; MXFP8 blocks do
    not depend on the other copy), freed after dgrad. Backward then needs the parameter as the
    forward saw it: an in-place change in between raises, as it does without a recipe. With the
    weight workspace cache (``is_first_microbatch``) and under ``torch.autocast`` (the weight is
    a cast) the forward's columnwise copy is saved instead. Delayed scaling's saved scale is an
    output of the forward's cast operator (``quantize_fp8(keep_scale=True)``), which a traced
    graph's partitioner does not recompute in backward from the updated state.

    ``scope`` / ``name``: the roles' scope (default ``linear``) and name, as
    :meth:`set_role_scope` sets them; modules pass theirs here so that a weight built inside
    ``fusible.quantized_model_init`` is quantized with its final role.

    ``save_original_input`` (TransformerEngine's ``Linear`` argument): under an FP8 recipe,
    keep the high-precision input itself for wgrad (a reference, no copy) instead of its
    transposed / columnwise FP8 copy, and quantize it again in backward -- the same bits, as
    for the weight (delayed scaling casts with the scale the forward cast with, saved; current
    scaling takes the same amax; MXFP8 / blockwise blocks do not depend on the other copy); the
    forward then makes the input's rowwise copy only. It saves memory when something else keeps
    that input anyway (attention keeps its output for its backward: the output projection's
    input); otherwise it costs the difference between the input's bytes and its FP8 copy's.
    The op then asks the previous op for a high-precision input (no quantizer hand-off); an input
    that arrives quantized all the same and a custom quantizer keep the FP8 copy as without
    it. Without a recipe, or
    without a weight gradient, it changes nothing. Fixed at construction (plans resolve it).

    Quantized weights (built inside ``fusible.quantized_model_init``, or any
    ``nn.Parameter(QuantizedTensor)`` assigned to ``weight``): the forward uses the stored data as
    it is when the autocast recipe's weight quantizer asks for its format (per-tensor FP8 -- any
    per-tensor quantizer -- or MXFP8, same FP8 dtype): no weight quantize kernel runs, and the
    weight workspace cache is not used (``is_first_microbatch`` is ignored for it). A per-tensor
    weight keeps its rowwise copy only; dgrad gets the transposed copy by a byte transpose in
    backward (freed after). Otherwise (no autocast, another format) the op computes with the
    exactly dequantized weight, as if it were a high-precision weight of those values. The
    weight gradient is a plain tensor of the weight's nominal dtype. ``state_dict()`` holds the
    dequantized weight (a plain tensor of the nominal dtype) under ``weight`` (the parameter
    itself with ``keep_vars=True``) and the exact quantized data in ``_extra_state``; loading
    re-quantizes into the stored weight in place, then restores the exact data when the
    checkpoint's weight is its dequantization (``assign=True`` keeps the weight quantized too).
    Module conversions (``.to()``, ``.cuda()``, ``.bfloat16()``) keep it quantized (see
    ``_convert_quantized``); an op built on ``meta`` inside ``quantized_model_init`` gets its
    quantized weight when materialised (``to_empty()``).
    """

    unread_buckets = UNREAD_BUCKETS

    role_scope = "linear"
    _SNAPSHOT_ATTRS = (*BasicOperation._SNAPSHOT_ATTRS, "_rowwise_twins")

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        name: str | None = None,
        scope: str | None = None,
        save_original_input: bool = False,
        init_method: Callable[[torch.Tensor], Any] | None = None,
    ) -> None:
        super().__init__(name=name)
        if not isinstance(save_original_input, bool):
            raise TypeError(
                f"BasicLinear: save_original_input must be a bool, got {save_original_input!r}"
            )
        self._save_original_input = save_original_input
        if in_features <= 0 or out_features <= 0:
            raise ValueError(
                f"BasicLinear: in_features and out_features must be positive, got "
                f"{in_features} and {out_features}"
            )
        if scope is not None:
            super().set_role_scope(scope)
        self.in_features, self.out_features = in_features, out_features
        self.weight = torch.nn.Parameter(
            torch.empty(out_features, in_features, device=device, dtype=dtype)
        )
        self.workspace_cache = WorkspaceCache()
        self._rowwise_twins: dict[str, tuple[Quantizer, Quantizer]] = {}
        self._record_weight_init()
        self._set_init_method(init_method)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Kaiming-uniform initialisation (or ``init_method``). A quantized weight is
        re-initialised in place (re-quantized with its quantizer); a weight built inside
        ``quantized_model_init`` (and still high precision, e.g. built on ``meta`` and
        materialised with ``to_empty()``) is initialised, then quantized."""
        self._reset_quantized_weight("weight", kaiming_init)

    @property
    def save_original_input(self) -> bool:
        """Whether wgrad keeps the high-precision input (see the class docstring). (False for
        an op pickled before the option existed.)"""
        return bool(self.__dict__.get("_save_original_input", False))

    def extra_repr(self) -> str:
        extra = ", save_original_input=True" if self.save_original_input else ""
        return f"in_features={self.in_features}, out_features={self.out_features}{extra}"

    def get_quantizer_roles(self, fwd: bool) -> list[QuantizerRole]:
        buckets = ("input", "weight", "output") if fwd else ("grad_output", "grad_input")
        return [QuantizerRole(b, self.scope, self.quantizer_name) for b in buckets]

    def input_quantizer(self) -> Quantizer | None:
        """The input quantizer offered to the previous op (which may write this op's input
        quantized, the hand-off), with the usage this op reads: the rowwise copy (fprop), and
        the columnwise copy only when the weight trains (wgrad). For a frozen weight it is a
        rowwise-only twin of the slot's quantizer (same scaling state, see
        :meth:`reset_recipe_state`): quantizers are never mutated while a plan runs
        (``torch.compile`` traces that). The choice depends only on ``weight.requires_grad``,
        which is part of the plan key, so a plan may resolve it once. With
        ``save_original_input``: None (this op keeps its high-precision input, so it takes it
        unquantized and casts it itself)."""
        train = bool(self.weight.requires_grad)
        if train and self.save_original_input:
            q = self.get_quantizer(True, "input")
            if q is None or C.can_requantize_columnwise(q):
                return None
        return self._with_usage(True, "input", train)

    def grad_output_quantizer(self) -> Quantizer | None:
        """The grad-output quantizer offered to the next op's backward (which may write this op's
        output gradient quantized), with the usage this op's backward reads: the columnwise copy
        only when wgrad runs."""
        return self._with_usage(False, "grad_output", bool(self.weight.requires_grad))

    def _with_usage(self, fwd: bool, bucket: str, columnwise: bool) -> Quantizer | None:
        q = self.get_quantizer(fwd, bucket)
        if q is None or columnwise:
            return q
        twin = getattr(self, "_rowwise_twins", {}).get(bucket)
        return twin[1] if twin is not None and twin[0] is q else q

    def reset_recipe_state(self, recipe: Any | None) -> None:
        """Build the recipe states (see :class:`BasicOperation`), and a rowwise-only twin of the
        input and grad-output quantizers (a shallow copy: a delayed-scaling twin reads and
        records the same scaling buffers), offered to the neighbouring ops when this op's
        backward reads no columnwise copy (frozen weight)."""
        super().reset_recipe_state(recipe)
        twins: dict[str, tuple[Quantizer, Quantizer]] = {}
        for fwd, bucket in ((True, "input"), (False, "grad_output")):
            q = self.get_quantizer(fwd, bucket)
            if q is not None:
                twins[bucket] = (q, copy.copy(q).set_usage(rowwise=True, columnwise=False))
        self._rowwise_twins = twins

    def workspace_spec(self) -> tuple[torch.Tensor, Quantizer] | None:
        q = self.get_quantizer(True, "weight")
        if q is None or isinstance(self.weight, QuantizedTensor):
            return None  # a quantized weight is its own workspace
        return (self.weight, q)

    def kernels(self, fwd: bool) -> list[str]:
        out = (
            [self.gemm_kernel("fprop")] if fwd else [self.gemm_kernel("dgrad"), self.wgrad_kernel()]
        )
        return self.weight_kernels(fwd) + out

    def wgrad_kernel(self) -> str:
        """The wgrad GEMM as ``explain()`` names it: none for a frozen weight (the backward
        skips it: the plan's requires-grad pattern)."""
        if not self.weight.requires_grad:
            return "no gemm(wgrad): the weight is frozen (requires_grad=False)"
        return self.gemm_kernel("wgrad")

    def gemm_kernel(self, what: str) -> str:
        """How ``explain()`` names one of this Linear's GEMMs (fused ops running it use it too):
        MXFP8 GEMMs run on exactly dequantized operands here, and say so; per-tensor FP8
        forward GEMMs use fast accumulation (``_compute.gemm_fprop``), and say so."""
        qw = self.get_quantizer(True, "weight")
        how = ""
        if isinstance(qw, MXFP8Quantizer):
            how = " on dequantized MXFP8 operands (no native MXFP8 GEMM on this path)"
        elif isinstance(qw, Float8BlockQuantizer):
            how = blockwise_gemm_note(self, what, qw)
        elif qw is not None and what.startswith("fprop"):
            how = " with fast accumulation (where it runs in FP8: CUDA, 16-aligned shapes)"
        return f"gemm({what}){how}"

    def weight_kernels(self, fwd: bool) -> list[str]:
        """What a quantized weight adds to a pass (for ``explain()``; fused ops running this
        Linear list it too)."""
        w = self.weight
        if not isinstance(w, QuantizedTensor):
            qw = self.get_quantizer(True, "weight")
            if fwd or qw is None or not C.can_requantize_columnwise(qw):
                return []
            # Without the workspace cache (is_first_microbatch): see the class docstring.
            return ["quantize the weight again, columnwise copy only (for dgrad: not kept from "
                    "forward)"]  # fmt: skip
        name = type(w).__name__
        if not _stored_matches(w.qdata, self.get_quantizer(True, "weight"), need_columnwise=True):
            return [f"dequantize(stored {name} weight: another format is active)"] if fwd else []
        if fwd:
            return [f"(stored {name} weight used as is: no weight quantize)"]
        if isinstance(w.qdata, Float8Data) and w.qdata.data_t is None:  # (else keep_transpose)
            return [f"fp8 byte transpose of the stored {name} weight (for dgrad)"]
        return []

    def prepare(self, params_requires_grad: tuple[bool, ...], input_requires_grad: bool) -> Any:
        """The :class:`LinearPrep` of a plan with these flags (see
        :meth:`BasicOperation.prepare`)."""
        return LinearPrep(self, bool(params_requires_grad and params_requires_grad[0]),
                          bool(input_requires_grad))  # fmt: skip

    def _prep(self, ctx: OpContext) -> LinearPrep:
        """``ctx.prep``, or (a context made outside a plan) resolved now, with
        ``torch.inference_mode`` checked (a plan's flags have grad mode folded in)."""
        prep = ctx.prep
        if prep is None:
            grad = not _inference()
            prg = ctx.params_requires_grad
            prep = LinearPrep(self, grad and bool(prg and prg[0]),
                              grad and bool(ctx.input_requires_grad))  # fmt: skip
        return prep  # type: ignore[no-any-return]

    def check_input(self, x: Any) -> None:
        k = x.shape[-1]
        if k != self.in_features:
            raise ValueError(
                f"{type(self).__name__}: input feature size {k} does not match in_features "
                f"{self.in_features} (input shape {tuple(x.shape)})"
            )

    def op_forward(self, ctx, x, params, *, next_input_quantizer, extra_inputs):
        self.check_input(x)
        (w,) = params
        out_dtype = C.hp_dtype(x)
        xq, wq, hp = self.fprop_operands(ctx, x, w, out_dtype)
        if hp:
            y = torch.nn.functional.linear(xq, wq.to(xq.dtype))
        else:
            y, _ = C.gemm_fprop(xq, wq, out_dtype)
            y = C.gemm_output(y, (*x.shape[:-1], self.out_features))
        return y, []

    def fprop_operands(
        self, ctx: OpContext, x: Any, w: torch.Tensor, out_dtype: torch.dtype
    ) -> tuple[Any, Any, bool]:
        """``(x, w, high_precision)``: the forward GEMM's operands (quantized when a recipe is
        active), with ``ctx`` holding what :meth:`linear_backward` reads; ``high_precision``:
        neither is quantized (the op then runs torch's linear). Every unit running this
        Linear's forward (fused or not) gets its operands here.

        Copies are made only where backward reads them: no columnwise copy of the input without
        a weight gradient, no weight copy without an input gradient (``torch.inference_mode``:
        neither). ``ctx`` keeps nothing else: for wgrad the input's columnwise copy (per-tensor
        ``data_t``, MXFP8 ``col_data``; a high-precision input as it is), for dgrad the
        parameter itself when backward quantizes it again (see the class docstring; with the
        delayed-scaling scale the forward cast with), else the weight's columnwise copy (a
        reference to the cached workspace's when there is one; a stored FP8 weight as it is).
        What only the forward GEMM reads (the rowwise copies) is referenced by the returned
        operands alone, so the caller frees it by dropping them after the GEMM; an MXFP8 GEMM's
        operands are its dequantized rowwise copies (see :func:`_compute.dequant_dtype`), made
        here one at a time so that each rowwise MXFP8 copy is freed once dequantized."""
        attrs = ctx.attrs
        prep = self._prep(ctx)
        need_wgrad, need_dgrad = prep.need_wgrad, prep.need_dgrad
        qx, qw = prep.qx, prep.qw
        if prep.blockwise:
            check_blockwise_sizes(type(self).__name__, self.in_features, self.out_features,
                                  math.prod(x.shape[:-1]))  # fmt: skip
        if prep.mx:
            # MXFP8 GEMMs scale 32-element blocks along K for fprop and along M / N for the
            # backward GEMMs; partial blocks have no hardware GEMM layout.
            tokens = math.prod(x.shape[:-1])
            if self.in_features % 32 or self.out_features % 32 or tokens % 32:
                raise ValueError(
                    f"{type(self).__name__}: MXFP8 needs in_features, out_features and the token "
                    f"count divisible by 32, got {self.in_features}, {self.out_features} and "
                    f"{tokens}; pad the input (e.g. the batch) or keep this op out of MXFP8 "
                    "(a CustomRecipe rule such as '*:*:<name>': None)"
                )
        attrs["need_wgrad"], attrs["need_dgrad"] = need_wgrad, need_dgrad
        xq: Any
        # x_requant: the quantizer with which backward quantizes the saved high-precision input
        # again for wgrad (save_original_input); x_scale: delayed scaling's scale for it.
        x_requant, x_scale = None, None
        if type(x) is C.HandOff:
            xq = x.take()  # this op's alone: its rowwise copy is freed after the forward GEMM
        elif qx is None:
            xq = x
        elif prep.x_requant is not None:
            # The forward makes the rowwise copy only; backward casts x again (the same bits).
            x_requant = qx
            xq, x_scale = C.quantize_rowwise_for_requant(qx, x)
        else:
            xq = C.quantize(qx, x, rowwise=True, columnwise=need_wgrad)
        if need_wgrad and x_requant is None and type(xq) is not torch.Tensor:
            xq = _with_columnwise(xq, type(self).__name__)
        # w_own: whether what backward reads for dgrad is its own (freed after dgrad), not a
        # parameter's or a cached workspace's (see linear_backward); w_requant: the quantizer
        # with which backward quantizes the parameter again.
        # w_hp: wq is a high-precision tensor.
        w_own, requant, w_scale, w_hp = False, None, None, True
        wq: Any = w
        if type(w) is not torch.nn.Parameter and isinstance(w, QuantizedTensor):
            wq, as_is = stored_operand(w, qw, need_dgrad, type(self).__name__)
            if as_is:
                # Used as it is (saved for dgrad without a copy); see the class docstring. A
                # per-tensor one gets its transposed copy in backward.
                w_own, qw, w_hp = isinstance(w.qdata, Float8Data), None, False
            else:
                w_own = True
        if qw is not None:
            w_hp = False
            w_own = ctx.workspace is None and not ctx.cache_weight
            if (
                prep.requant
                and w_own
                and wq is self.weight  # not a torch.autocast cast or a dequantized stored weight
            ):
                # Backward quantizes the parameter again for dgrad: the forward makes the
                # rowwise copy only, and saves the parameter (no copy) and, for delayed
                # scaling, the scale it cast with.
                requant = qw
                wq, w_scale = C.quantize_rowwise_for_requant(qw, wq)
                ctx.new_workspace = None
            else:
                wq, ctx.new_workspace = quantize_weight(
                    wq, qw, ctx.workspace, ctx.cache_weight, columnwise=need_dgrad
                )
        wsave = None
        if need_dgrad:
            wsave = w if requant is not None else _keep_columnwise(wq)
        if x_requant is not None:
            xsave = x
        else:
            xsave = _keep_columnwise(xq) if need_wgrad else None
        ctx.saved = [xsave, wsave, w_scale, x_scale]
        attrs["dtype"], attrs["w_dtype"] = out_dtype, w.dtype
        attrs["w_own"], attrs["w_requant"] = w_own, requant
        attrs["x_requant"] = x_requant
        hp = qx is None and w_hp
        may_mx = prep.may_mx or type(w) is not torch.nn.Parameter
        dt = None if hp or not may_mx else C.dequant_dtype(xq, wq, out_dtype)
        if dt is not None:
            xq = C.dequantized(xq, "r", dt)
            wq = C.dequantized(wq, "r", dt)
        return xq, wq, hp

    def linear_backward(
        self, ctx: OpContext, dy: Any, *, c: torch.Tensor | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(dx, dw); ``c`` is added to dx inside the dgrad GEMM (residual-gradient fusion).

        Memory: the saved operands are taken out of ``ctx`` (this call then holds the only
        references) and each is dropped once the GEMM that reads it has it, as is each copy of
        the quantized gradient (an MXFP8 GEMM's operands are their dequantized copies, made one
        at a time, see :func:`_compute.dequant_dtype`). The GEMM whose own operand is the larger
        runs first -- wgrad's input copy ``[tokens, in]`` against dgrad's weight copy ``[out,
        in]``, when that is backward's own (not a parameter or a cached workspace) -- so it is
        gone while the other runs. The two GEMMs are independent: their order changes no
        result."""
        xq, wq, w_scale, x_scale = ctx.saved
        ctx.saved = []
        attrs = ctx.attrs
        need_dgrad, need_wgrad = attrs["need_dgrad"], attrs["need_wgrad"]
        dtype, w_dtype = attrs["dtype"], attrs["w_dtype"]
        prep = ctx.prep
        qg = self.get_quantizer(False, "grad_output") if prep is None else prep.qg
        lead = dy.shape[:-1]
        if type(dy) is C.HandOff:
            dy = dy.take()  # quantized for this op by the next one's backward: this call's now
        elif qg is not None:
            dy = C.quantize(qg, dy, rowwise=need_dgrad, columnwise=need_wgrad)
        if qg is not None and need_wgrad:
            dy = _with_columnwise(dy, type(self).__name__)
        # x_requant / w_requant: xq / wq is then the high-precision tensor, cast below as the
        # forward cast it (so a GEMM on them is not a high-precision one).
        x_requant, w_requant = attrs["x_requant"], attrs["w_requant"]
        hp = (
            (type(dy) in _PLAIN or isinstance(dy, torch.Tensor))
            and x_requant is None
            and w_requant is None
            and (xq is None or type(xq) in _PLAIN or isinstance(xq, torch.Tensor))
            and (wq is None or type(wq) in _PLAIN or isinstance(wq, torch.Tensor))
        )
        if hp:
            dy = C.as_2d(dy)
        left = need_wgrad + need_dgrad  # GEMMs still to run
        # Traced: dgrad first (wgrad when it runs alone or the weight copy is not backward's),
        # without comparing the token count: only peak memory depends on the order, and with
        # dynamic shapes that comparison is a guard, which recompiled at each threshold.
        x_larger = not torch.compiler.is_compiling() and math.prod(lead) >= self.out_features
        wgrad_first = need_wgrad and (not need_dgrad or not attrs["w_own"] or x_larger)
        dx = dw = None
        for wgrad in _WGRAD_FIRST if wgrad_first else _DGRAD_FIRST:
            if not (need_wgrad if wgrad else need_dgrad):
                continue
            left -= 1
            which = "c" if wgrad else "r"  # the copy of dy this GEMM reads
            if wgrad:
                b, xq = xq, None
                if x_requant is not None:  # the input: quantized again, as forward did
                    b = C.requantize_columnwise(x_requant, b, x_scale)
            else:
                b, wq = wq, None
                if not hp:
                    if w_requant is not None:  # the parameter: quantized again, as forward did
                        b = C.requantize_columnwise(w_requant, b, w_scale)
                    b = C.ensure_fp8_copy(b, "c")  # a stored FP8 weight: transposed on demand
            dt = None if hp else C.dequant_dtype(dy, b, w_dtype if wgrad else dtype)
            a = dy
            if dt is not None:
                b = C.dequantized(b, "c", dt)
                a = C.dequantized(dy, which, dt)
            # The copy of dy this GEMM reads is no longer referenced once ``a`` is dropped.
            dy = None if not left else dy if hp else C.without_copy(dy, which)
            if wgrad and hp:
                dw = a.t() @ C.as_2d(b).to(a.dtype)
            elif wgrad:
                dw, _ = C.gemm_wgrad(a, b, w_dtype)
            elif hp:
                dx = C.in_shape(a @ b.to(a.dtype), (*lead, self.in_features))
                if c is not None and c.dtype == dx.dtype:
                    dx += c  # dx is this GEMM's own: the same sum, without a second tensor
                elif c is not None:
                    dx = dx + c
            else:
                dx, _ = C.gemm_dgrad(a, b, dtype, c=None if c is None else C.as_2d(c))
                dx = C.in_shape(dx, (*lead, self.in_features))
            del a, b
        if dw is not None:
            dw = dw.to(w_dtype)
        return dx, dw

    def op_backward(self, ctx, dy, *, prev_grad_quantizer, extra_output_grads):
        dx, dw = self.linear_backward(ctx, dy)
        return dx, [dw], []


_WGRAD_FIRST, _DGRAD_FIRST = (True, False), (False, True)  # linear_backward's GEMM orders

# Quantizer types whose data is never MXFP8 (a custom quantizer may make any container).
_NOT_MX = (Float8Quantizer, Float8CurrentScalingQuantizer, Float8BlockQuantizer)


class LinearPrep:
    """What a :class:`BasicLinear` decides once per plan (``BasicOperation.prepare``): its
    quantizers, which GEMMs backward runs (grad mode folded in by the plan), which size
    checks apply, whether backward may quantize the parameter again. A plain object (read by
    attribute, also while torch.compile traces)."""

    def __init__(self, op: BasicLinear, need_wgrad: bool, need_dgrad: bool) -> None:
        qx, qw = op.get_quantizer(True, "input"), op.get_quantizer(True, "weight")
        self.qx, self.qw = qx, qw
        self.qg = op.get_quantizer(False, "grad_output")
        self.need_wgrad, self.need_dgrad = need_wgrad, need_dgrad
        block = Float8BlockQuantizer
        self.blockwise = isinstance(qx, block) or isinstance(qw, block)
        self.mx = isinstance(qx, MXFP8Quantizer) or isinstance(qw, MXFP8Quantizer)
        # Whether an operand may be MXFP8 data (the GEMM's operands are then dequantized first).
        self.may_mx = any(q is not None and type(q) not in _NOT_MX for q in (qx, qw, self.qg))
        self.requant = need_dgrad and qw is not None and C.can_requantize_columnwise(qw)
        # save_original_input: the input quantizer backward casts the saved input with again.
        self.x_requant = (
            qx
            if op.save_original_input and need_wgrad and qx is not None
            and C.can_requantize_columnwise(qx)
            else None
        )  # fmt: skip


_PLAIN = (torch.Tensor, torch.nn.Parameter)  # tested by type first (isinstance is a call)


def _keep_columnwise(x: Any) -> Any:
    return x if type(x) in _PLAIN else C.keep_columnwise(x)


def _inference() -> bool:
    """Whether ``torch.inference_mode`` is on (no backward can follow). ``torch.no_grad`` cannot
    be seen here: the autograd function's forward always runs with grad disabled. Under
    ``torch.compile`` (which cannot trace the query) this says False."""
    return not torch.compiler.is_compiling() and torch.is_inference_mode_enabled()


def _with_columnwise(xq: Any, op: str) -> Any:
    """``xq`` with the columnwise copy wgrad reads. A hand-off (a value the neighbouring op
    quantized with this op's quantizer) carries the copies the quantizer's usage asked for; if
    that lacked the columnwise copy, a per-tensor one is made by an exact byte transpose; an
    MXFP8 columnwise copy cannot be made without the high-precision values."""
    if type(xq) is Float8Data:
        return C.ensure_fp8_copy(xq, "c")
    if isinstance(xq, Float8BlockData) and xq.data_t is None and xq.block_dim == 1:
        raise RuntimeError(
            f"{op}: the blockwise FP8 input or gradient handed over has no columnwise copy, which "
            "the weight gradient needs (1x128 columnwise blocks need the high-precision values)"
        )
    if isinstance(xq, MXFP8Data) and xq.col_data is None:
        raise RuntimeError(
            f"{op}: the MXFP8 input or gradient handed over has no columnwise copy, which the "
            "weight gradient needs (the quantizer's usage said columnwise=False)"
        )
    return C.ensure_fp8_copy(xq, "c")


def blockwise_multiple() -> int:
    """What every dimension of a Linear's three blockwise FP8 GEMMs must be a multiple of: each
    feature size and the token count is K of one GEMM and M or N of another, so the least common
    multiple of ``GEMM_RULES``' ``block_k_multiple`` (16: 16-byte FP8 rows) and
    ``block_mn_multiple`` (4)."""
    r = K.GEMM_RULES
    return math.lcm(r.block_k_multiple, r.block_mn_multiple)


def check_blockwise_sizes(op: str, in_features: int, out_features: int, tokens: int) -> None:
    """Blockwise FP8 GEMMs (cuBLASLt's block-scaled kernels) need every GEMM dimension -- the
    features (fprop's K and N, dgrad's K) and the token count (fprop's M, wgrad's K) -- to be a
    multiple of :func:`blockwise_multiple` (16). Checked on every backend, so a model that would
    fail on the GPU fails on the CPU too; partial 128-blocks are fine."""
    mult = blockwise_multiple()
    for name, n in (("in_features", in_features), ("out_features", out_features),
                    ("the token count (prod(x.shape[:-1]))", tokens)):  # fmt: skip
        if n % mult:
            raise ValueError(
                f"{op}: Float8BlockScaling needs {name} to be a multiple of {mult} (the blockwise "
                f"FP8 GEMM's alignment), got {n}; pad the input or use another recipe for this op"
            )


def blockwise_gemm_note(op: BasicLinear, what: str, qw: Float8BlockQuantizer) -> str:
    """How explain() names a blockwise GEMM: the operands' block shapes, and where it runs."""
    dims = {1: "1x128", 2: "128x128"}
    if what.startswith("fprop"):
        other = op.get_quantizer(True, "input")
    else:
        other = op.get_quantizer(False, "grad_output")
    if what.startswith("wgrad"):
        x = op.get_quantizer(True, "input")
        pair = [other, x]
    else:
        pair = [other, qw]
    if not all(isinstance(q, Float8BlockQuantizer) for q in pair):
        return " on dequantized operands (blockwise FP8 mixed with another format)"
    a, b = (dims[q.block_dim] for q in pair)  # type: ignore[union-attr]
    return (f" blockwise FP8 ({a} x {b} blocks, fp32 scales; cuBLASLt block scaling on CUDA, "
            "exactly dequantized operands on the CPU)")  # fmt: skip
