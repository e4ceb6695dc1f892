"""GroupedLinear: ``num_gemms`` linears over consecutive row groups of one input (MoE experts)."""

from __future__ import annotations

import math
import operator
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch

from fusible import _kernels as K
from fusible.ops import _compute as C
from fusible.ops.basic.linear import _inference, blockwise_multiple
from fusible.ops.basic.quantized_weight import (
    QuantizedWeightOp,
    _stored_matches,
    kaiming_init,
    stored_operand,
)
from fusible.ops.workspace import WorkspaceCache, quantize_weight
from fusible.quantization import QuantizerRole
from fusible.quantization.quantizers import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8Data,
    Float8Quantizer,
    MXFP8Quantizer,
    QuantizedTensor,
    Quantizer,
    replaying_scales,
)
from fusible.quantization.roles import BACKWARD_BUCKETS, FORWARD_BUCKETS, UNREAD_BUCKETS

__all__ = ["GradCast", "GroupedLinear", "gemm_index"]

#: A fused backward's replacement of GroupedLinear's output-gradient cast and bias gradient (see
#: :meth:`GroupedLinear.backward_grouped`).
GradCast = Callable[
    [list[Any], tuple[int, ...], bool, tuple[bool, ...]],
    tuple[list[Float8Data], list[torch.Tensor | None] | None],
]

_GEMM_NAME = re.compile(r"(?:\A|_)gemm(\d+)\Z")


def gemm_index(role: QuantizerRole) -> int | None:
    """The GEMM (expert) index a ``GroupedLinear`` role names (``gemm3`` or ``<name>_gemm3``
    -> 3), or None for a role without one -- handy in a ``CustomRecipe`` factory."""
    found = _GEMM_NAME.search(role.name or "")
    return None if found is None else int(found.group(1))


#: The grouped kernels (one cast, one GEMM call for all experts) serve CUDA tensors unless
#: ``FUSIBLE_GROUPED_KERNELS_ON_CUDA=0`` (then CUDA takes the per-expert loop, the reference of
#: the grouped path's tests). They passed the GPU suite and compute-sanitizer on the H200
#: (session 8). CPU always takes the grouped path.
GROUPED_KERNELS_ON_CUDA = os.environ.get("FUSIBLE_GROUPED_KERNELS_ON_CUDA", "1") != "0"


class GroupedLinear(QuantizedWeightOp):
    """``num_gemms`` linear layers over consecutive groups of rows (tokens grouped by expert):
    with ``x`` of ``sum(m_splits)`` rows (``(..., in_features)``, the leading dimensions
    flattened), rows ``[s_i, s_i + m_splits[i])`` give ``y_i = x_i @ weight{i}.T + bias{i}``,
    and ``y`` is the ``y_i`` stacked in order (``(..., out_features)``). Parameters, named as in
    TransformerEngine: ``weight0 .. weight{n-1}`` (``[out_features, in_features]`` each), then
    ``bias0 .. bias{n-1}`` (``bias=True``).

    **Split sizes.** ``m_splits`` is a per-call keyword of ``Sequential.forward``
    (``seq(x, m_splits=[...])``; the module ``fusible.GroupedLinear`` passes its positional
    argument on): a list or tuple of ``num_gemms`` ints >= 0 summing to the token count, or a
    1-D integer tensor, which is read with ``.tolist()`` -- a device-to-host sync for a CUDA
    tensor, and a graph break under ``torch.compile``; pass a list there. Why a keyword and not
    an extra input (TransformerEngine's op takes a tensor of sizes as one): the per-expert loop
    needs the sizes on the host, and a tensor read inside the autograd function would sync
    there and cannot be traced. The sizes are not part of the fusion plan's key, so one cached
    plan serves every split: :meth:`prepare_call` checks them per call and they cross the
    autograd function as a constant (a tuple of ints, kept in the op's context for backward),
    so a new split needs no new plan, and backward always uses the sizes of its own forward
    (several forwards may be pending). Under ``torch.compile`` the first call specializes the
    sizes; after a change, dynamo traces them as symbolic ints and one graph serves every split
    that leaves the same experts empty (the op branches on an expert being empty, which
    recompiles). Every ``GroupedLinear`` of one ``Sequential`` call reads the same ``m_splits``
    (an MoE expert MLP keeps tokens grouped between its two layers). Empty experts (0 rows)
    are allowed: no kernel runs for them (on an ``is_first_microbatch=True`` step their weight
    is still quantized, to fill the cache), they have no rows in ``y`` and their weight and bias
    gradients are zeros.

    **Quantizer roles** (scope ``grouped_linear``; the GEMM index in the role's name:
    ``gemm<i>``, or ``<name>_gemm<i>`` for an op built with ``name=``): forward, per GEMM in
    order, ``input``, ``weight``, ``output``; backward, per GEMM, ``grad_output``,
    ``grad_input``. So every expert has its own quantizers and scaling state under every
    recipe (a ``CustomRecipe`` factory can route by expert, see :func:`gemm_index`). Each
    expert's input and output gradient are quantized with its own scale, so the op offers no
    quantizer to its neighbours (no hand-off: one tensor cannot carry per-expert scales).
    MXFP8 needs ``in_features``, ``out_features`` and every split divisible by 32.

    **Kernels.** Under delayed and current scaling (every expert's quantizers of one kind) a
    pass runs grouped operators, a fixed number of operator calls whatever ``num_gemms`` is:
    one ``grouped_quantize_fp8`` for the inputs (and one for the weights that are not cached),
    one ``grouped_gemm`` for the forward GEMMs, and in backward one ``grouped_quantize_fp8`` for
    the output gradient, one ``grouped_gemm`` each for dgrad and wgrad and one
    ``grouped_bias_grad``; without a recipe the forward GEMMs with bias are one
    ``grouped_gemm`` (the backward GEMMs are torch matmuls per expert, as before). Each grouped
    operator computes, per expert, the bits of the per-expert kernel it replaces, so the
    results equal the per-expert loop's bit for bit; the loop still runs for MXFP8, custom
    recipes and mixed quantizers (and, on CUDA, for the weight gradient of an expert whose
    token count is not a multiple of 16, which cuBLASLt's FP8 GEMM cannot take).

    **Weight workspaces**: one per expert (``workspace_caches[i]``), each looked up, stored and
    invalidated on its own (an in-place update of ``weight3`` re-quantizes expert 3 only); see
    ``fusible.ops.workspace`` for ``is_first_microbatch``.

    **Quantized weights** (built inside ``fusible.quantized_model_init``, or an
    ``nn.Parameter(QuantizedTensor)`` assigned to ``weight<i>``): as for ``ops.Linear`` (see
    ``BasicLinear``), each expert's weight is stored quantized with the quantizer the recipe
    gives its own weight role, used as it is where the autocast recipe's weight quantizer asks
    for its format (no weight cast, no workspace cache: ``is_first_microbatch`` is ignored for
    it; a per-tensor weight's transposed copy for dgrad is a byte transpose in backward, freed
    after) and as its exact dequantization otherwise; the weight gradients are plain tensors of
    the nominal dtype; ``state_dict()`` holds the dequantized weights and their exact data in
    ``_extra_state`` (``weight<i>.data``, ...). The grouped kernels serve stored per-tensor FP8
    weights under delayed and current scaling; every other case runs the per-expert loop.
    """

    unread_buckets = UNREAD_BUCKETS

    role_scope = "grouped_linear"
    call_kwargs = ("m_splits",)
    #: Private switch: False runs every pass as the per-expert loop (the grouped path's tests
    #: compare the two bit for bit).
    _grouped = True

    def __init__(
        self,
        num_gemms: int,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        name: str | None = None,
        init_method: Callable[[torch.Tensor], Any] | None = None,
    ) -> None:
        super().__init__(name=name)
        for arg, v in (("num_gemms", num_gemms), ("in_features", in_features),
                       ("out_features", out_features)):  # fmt: skip
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"GroupedLinear: {arg} must be a positive int, got {v!r}")
        self.num_gemms, self.in_features, self.out_features = num_gemms, in_features, out_features
        self.use_bias = bool(bias)
        for i in range(num_gemms):
            w = torch.empty(out_features, in_features, device=device, dtype=dtype)
            self.register_parameter(f"weight{i}", torch.nn.Parameter(w))
        if self.use_bias:
            for i in range(num_gemms):
                b = torch.zeros(out_features, device=device, dtype=dtype)
                self.register_parameter(f"bias{i}", torch.nn.Parameter(b))
        self.workspace_caches = [WorkspaceCache() for _ in range(num_gemms)]
        self._record_weight_init()
        self._set_init_method(init_method)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Each weight kaiming-uniform (as ``torch.nn.Linear``) or by ``init_method`` (a
        quantized one re-quantized in place, one built inside ``quantized_model_init`` quantized
        after), biases zero; a no-op on ``meta`` (``to_empty()`` then ``reset_parameters()``
        materialises)."""
        for i in range(self.num_gemms):
            self._reset_quantized_weight(f"weight{i}", kaiming_init)
        with torch.no_grad():
            for b in self.biases():
                if b.device.type != "meta":
                    b.zero_()

    def weights(self) -> list[torch.nn.Parameter]:
        return [self._parameters[f"weight{i}"] for i in range(self.num_gemms)]  # type: ignore[misc]

    def biases(self) -> list[torch.nn.Parameter]:
        if not self.use_bias:
            return []
        return [self._parameters[f"bias{i}"] for i in range(self.num_gemms)]  # type: ignore[misc]

    def extra_repr(self) -> str:
        return (
            f"num_gemms={self.num_gemms}, in_features={self.in_features}, "
            f"out_features={self.out_features}, bias={self.use_bias}"
        )

    # ---- quantizers --------------------------------------------------------------------------

    def gemm_name(self, i: int) -> str:
        """The role name of GEMM ``i``: ``gemm<i>``, or ``<name>_gemm<i>``."""
        return f"gemm{i}" if self.quantizer_name is None else f"{self.quantizer_name}_gemm{i}"

    def get_quantizer_roles(self, fwd: bool) -> list[QuantizerRole]:
        buckets = FORWARD_BUCKETS if fwd else BACKWARD_BUCKETS
        return [
            QuantizerRole(b, self.scope, self.gemm_name(i))
            for i in range(self.num_gemms)
            for b in buckets
        ]

    def weight_roles(self) -> dict[str, QuantizerRole]:
        k, step = FORWARD_BUCKETS.index("weight"), len(FORWARD_BUCKETS)
        roles = self.get_quantizer_roles(True)
        return {f"weight{i}": roles[i * step + k] for i in range(self.num_gemms)}

    def gemm_quantizers(self, fwd: bool, bucket: str) -> list[Quantizer | None]:
        """The quantizer of ``bucket`` for each GEMM, in order (all None without a recipe)."""
        state = self.recipe_state(fwd)
        buckets = FORWARD_BUCKETS if fwd else BACKWARD_BUCKETS
        if state is None:
            return [None] * self.num_gemms
        k, step = buckets.index(bucket), len(buckets)
        return list(state.quantizers[k::step])

    def workspace_specs(self) -> list[tuple[int | None, torch.Tensor, Quantizer]]:
        ws = self.weights()
        # A quantized weight is its own workspace.
        return [(i, ws[i], q) for i, q in enumerate(self.gemm_quantizers(True, "weight"))
                if q is not None and not isinstance(ws[i], QuantizedTensor)]  # fmt: skip

    def kernels(self, fwd: bool) -> list[str]:
        qw = self.gemm_quantizers(True, "weight")[0]
        how = " on dequantized MXFP8 operands" if isinstance(qw, MXFP8Quantizer) else ""
        if isinstance(qw, Float8BlockQuantizer):
            how = " blockwise FP8 (cuBLASLt block scaling on CUDA, dequantized operands on CPU)"
        n = self.num_gemms
        note, cast_all = self._stored_weights_note(fwd)
        wcast = qw is not None and cast_all
        # The wgrad GEMMs run for the experts whose weight trains (the plan's requires-grad
        # pattern): none when every weight is frozen.
        training = sum(w.requires_grad for w in self.weights())
        if training == 0:
            wgrad = "no wgrad GEMMs: the weights are frozen (requires_grad=False)"
        else:
            wgrad = "" if training == n else f" for the {training} experts whose weight trains"
        if self._fp8_kind(fwd) is not None:
            if fwd:
                wq = "grouped_quantize_fp8(weight), " if wcast else ""
                step = (f"grouped (x{n}, empty experts skipped): grouped_quantize_fp8(input), "
                        f"{wq}grouped_gemm(fprop)")  # fmt: skip
            else:
                wg = wgrad if training == 0 else f"grouped_gemm(wgrad){wgrad}"
                step = (f"grouped (x{n}): grouped_quantize_fp8(grad_output), grouped_gemm(dgrad), "
                        f"{wg}, grouped_bias_grad")  # fmt: skip
        elif fwd:
            quant = ("quantize(input, weight), " if wcast else "quantize(input), ") if qw else ""
            step = f"per expert (x{n}, empty experts skipped): {quant}gemm(fprop){how}"
        else:
            quant = "quantize(grad_output), " if qw is not None else ""
            wg = wgrad if training == 0 else f"gemm(wgrad){how}{wgrad}"
            step = f"per expert (x{n}): {quant}gemm(dgrad){how}, {wg}"
        return [*note, step]

    def _stored_weights_note(self, fwd: bool) -> tuple[list[str], bool]:
        """What stored quantized weights add to a pass in ``explain()``, and whether any weight
        is still cast (a high-precision one, or a stored one of another format: dequantized)."""
        stored = self.quantized_weights()
        qws = dict(zip(self.weight_roles(), self.gemm_quantizers(True, "weight"), strict=True))
        used = {k: w for k, w in stored.items()
                if _stored_matches(w.qdata, qws[k], need_columnwise=True)}  # fmt: skip
        note = []
        if used:
            name = type(next(iter(used.values()))).__name__
            if fwd:
                note.append(f"(stored {name} weights used as is: no weight quantize)")
            elif any(type(w.qdata) is Float8Data and w.qdata.data_t is None
                     for w in used.values()):  # fmt: skip
                # (keep_transpose: the stored transposed copy is read as it is)
                note.append(f"fp8 byte transpose of each stored {name} weight (for dgrad)")
        other = [w for k, w in stored.items() if k not in used]
        if other and fwd:
            name = type(other[0]).__name__
            note.append(f"dequantize(stored {name} weights: another format is active)")
        return note, len(used) < self.num_gemms

    # ---- per-call split sizes ------------------------------------------------------------------

    def prepare_call(self, kwargs: Mapping[str, Any]) -> tuple[Any, ...]:
        """``m_splits`` checked and as a tuple of ints (a tensor is read with ``.tolist()``)."""
        if "m_splits" not in kwargs or kwargs["m_splits"] is None:
            raise TypeError(
                f"GroupedLinear: m_splits is required: pass m_splits=[...] ({self.num_gemms} "
                "token counts, one per GEMM) to the Sequential call"
            )
        return check_splits(kwargs["m_splits"], self.num_gemms)

    def _check_input(self, x: torch.Tensor, splits: tuple[int, ...]) -> int:
        if x.dim() < 1 or x.shape[-1] != self.in_features:
            raise ValueError(
                f"GroupedLinear: input feature size {x.shape[-1] if x.dim() else None} does not "
                f"match in_features {self.in_features} (input shape {tuple(x.shape)})"
            )
        tokens = math.prod(x.shape[:-1])
        if sum(splits) != tokens:
            raise ValueError(
                f"GroupedLinear: m_splits must sum to the number of input rows {tokens} (input "
                f"shape {tuple(x.shape)}), got sum {sum(splits)} for m_splits={list(splits)}"
            )
        return tokens

    def _check_mxfp8(self, splits: tuple[int, ...]) -> None:
        bad = [(i, m) for i, m in enumerate(splits) if m % 32]
        if self.in_features % 32 or self.out_features % 32 or bad:
            what = f"m_splits[{bad[0][0]}]={bad[0][1]}" if bad else f"m_splits={list(splits)}"
            raise ValueError(
                f"GroupedLinear: MXFP8 needs in_features, out_features and every m_splits entry "
                f"divisible by 32, got {self.in_features}, {self.out_features} and {what}; pad "
                "each expert's rows to a multiple of 32 or use another recipe"
            )

    def _check_blockwise(self, splits: tuple[int, ...]) -> None:
        """Blockwise FP8 GEMMs need every dimension a multiple of 16 (see
        ``linear.check_blockwise_sizes``); an empty split runs no GEMM."""
        mult = blockwise_multiple()
        bad = [(i, m) for i, m in enumerate(splits) if m % mult]
        if self.in_features % mult or self.out_features % mult or bad:
            what = f"m_splits[{bad[0][0]}]={bad[0][1]}" if bad else f"m_splits={list(splits)}"
            raise ValueError(
                f"GroupedLinear: Float8BlockScaling needs in_features, out_features and every "
                f"m_splits entry to be multiples of {mult} (the blockwise FP8 GEMM's alignment), "
                f"got {self.in_features}, {self.out_features} and {what}"
            )

    # ---- execution ----------------------------------------------------------------------------

    def op_forward(self, ctx, x, params, *, next_input_quantizer, extra_inputs):
        out = self.forward_grouped(ctx, x, params)
        if out is not None:
            return out[0], []
        ctx.attrs["grouped"] = False
        return self._forward_loop(ctx, x, params)

    def forward_grouped(
        self, ctx: Any, x: Any, params: Any, epilogue: str = ""
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """``(y, aux)``: the forward pass as grouped operators, the GEMMs with ``epilogue``
        (``""``: the bias alone; ``"bias_gelu_aux"`` / ``"gelu_aux"``: y is GELU's output and aux
        its input, packed as y; else aux is None). None where the per-expert loop must run it (a
        recipe or dtype the grouped kernels do not serve, or an epilogue the GEMM has no kernel
        for): nothing has run then."""
        if not self._grouped or (x.device.type == "cuda" and not GROUPED_KERNELS_ON_CUDA):
            return None
        return self._forward_grouped(ctx, x, params, epilogue)

    def _forward_loop(self, ctx, x, params):
        """The per-expert loop: per expert a quantize and a GEMM (kept for the recipes the
        grouped kernels do not serve, and as the reference of the grouped path's tests)."""
        splits: tuple[int, ...] = ctx.call
        x = C.dequantize(x)
        self._check_input(x, splits)
        n = self.num_gemms
        ws, bs = params[:n], params[n:]
        dtype = x.dtype
        prg = ctx.params_requires_grad or (False,) * len(params)
        grad = not _inference()
        need_dgrad = grad and ctx.input_requires_grad
        need_wgrad = tuple(grad and bool(r) for r in prg[:n])
        qxs = self.gemm_quantizers(True, "input")
        qws = self.gemm_quantizers(True, "weight")
        if any(isinstance(q, MXFP8Quantizer) for q in (*qxs, *qws)):
            self._check_mxfp8(splits)
        if any(isinstance(q, Float8BlockQuantizer) for q in (*qxs, *qws)):
            self._check_blockwise(splits)
        keyed = isinstance(ctx.cache_weight, dict)
        cache = ctx.cache_weight if keyed else {}
        given = ctx.workspace if keyed else {}
        x2 = C.as_2d(x)
        xs = torch.split(x2, list(splits)) if n > 1 else (x2,)
        ys: list[torch.Tensor] = []
        saved_x: list[Any] = []
        saved_w: list[Any] = []
        for i in range(n):
            m, qx, qw, w = splits[i], qxs[i], qws[i], ws[i]
            b = bs[i] if bs else None
            if isinstance(w, QuantizedTensor):
                w = stored_operand(w, qw, need_dgrad, "GroupedLinear")[0]
            wq: Any = w
            if qw is not None and isinstance(w, torch.Tensor) and (m or cache.get(i, False)):
                # An empty expert's weight is quantized only to fill its cache.
                wq, made = quantize_weight(
                    w, qw, given.get(i), cache.get(i, False), columnwise=need_dgrad
                )
                if cache.get(i, False):
                    ctx.new_workspace[i] = made
            if m == 0:
                saved_x.append(None)
                saved_w.append(None)
                continue
            xi = xs[i]
            xq: Any = xi if qx is None else qx.quantize(xi, rowwise=True, columnwise=need_wgrad[i])
            # As ops.Linear computes it (BasicLinear, fused with its Bias): the same bits.
            if b is not None:
                yi, _ = C.gemm_fprop(xq, wq, dtype, bias=b.to(dtype), epilogue="bias")
            elif isinstance(xq, torch.Tensor) and isinstance(wq, torch.Tensor):
                yi = torch.nn.functional.linear(xq, wq.to(dtype))
            else:
                yi, _ = C.gemm_fprop(xq, wq, dtype)
            ys.append(yi)
            saved_x.append(C.keep_columnwise(xq) if need_wgrad[i] else None)
            saved_w.append(C.keep_columnwise(wq) if need_dgrad else None)
        if ys:
            # Traced, one non-empty expert's output goes through a cat too: torch 2.11's dynamo
            # asserts on the autograd function's output when it is that GEMM's output directly
            # (m_splits=[96, 0, 0] after [32, 0, 64]; torch 2.13 traces either).
            one = len(ys) == 1 and not torch.compiler.is_compiling()
            y = ys[0] if one else torch.cat(ys)
        else:
            y = x2.new_empty(0, self.out_features)
        y = C.gemm_output(y, (*x.shape[:-1], self.out_features))
        _save(ctx, saved_x, saved_w, splits, need_dgrad, need_wgrad, dtype, ws, bs, grad, prg[n:],
              False)  # fmt: skip
        return y, []

    def op_backward(self, ctx, dy, *, prev_grad_quantizer, extra_output_grads):
        out = self.backward_grouped(ctx, dy)
        if out is not None:
            return out
        return self._backward_loop(ctx, dy)

    def backward_grouped(
        self, ctx: Any, dy: Any, grad_cast: GradCast | None = None
    ) -> tuple[Any, list[torch.Tensor | None], list[Any]] | None:
        """``(dx, param grads, [])``: the backward pass as grouped operators, or None where the
        per-expert loop must run it (nothing has run then). ``grad_cast`` (a fused backward's)
        replaces the output gradient's grouped cast and bias gradient: called as
        ``grad_cast(quantizers, splits, rowwise, columnwise)`` after every check passed, it
        returns the per-expert ``Float8Data`` (empty experts included: their scale_inv and empty
        copies) and the bias gradients (None where no bias gradient is needed); ``dy`` then
        gives only the gradient's shape and device."""
        if ctx.attrs.get("grouped") != "fp8":
            return None
        return self._backward_grouped(ctx, dy, grad_cast)

    def _backward_loop(self, ctx, dy):
        n = self.num_gemms
        a = ctx.attrs
        splits, need_dgrad, need_wgrad = a["splits"], a["need_dgrad"], a["need_wgrad"]
        need_bgrad, dtype = a["need_bgrad"], a["dtype"]
        saved_x, saved_w = ctx.saved[:n], ctx.saved[n:]
        qgs = self.gemm_quantizers(False, "grad_output")
        dy = C.dequantize(dy)
        lead = dy.shape[:-1]
        dy2 = C.as_2d(dy)
        dys = torch.split(dy2, list(splits)) if n > 1 else (dy2,)
        dxs: list[torch.Tensor] = []
        dws: list[torch.Tensor | None] = []
        dbs: list[torch.Tensor | None] = []
        for i in range(n):
            m, w_dtype = splits[i], a["w_dtypes"][i]
            dw = db = None
            if m == 0:
                if need_wgrad[i]:
                    dw = dy2.new_zeros(self.out_features, self.in_features, dtype=w_dtype)
                if need_bgrad and need_bgrad[i]:
                    db = dy2.new_zeros(self.out_features, dtype=a["b_dtypes"][i])
                dws.append(dw)
                dbs.append(db)
                continue
            dyi = dys[i]
            if need_bgrad and need_bgrad[i]:
                db = dyi.sum(0, dtype=torch.float32).to(a["b_dtypes"][i])
            g: Any = dyi
            qg = qgs[i]
            if qg is not None and (need_dgrad or need_wgrad[i]):
                g = qg.quantize(dyi, rowwise=need_dgrad, columnwise=need_wgrad[i])
            xq, wq = saved_x[i], saved_w[i]
            plain = isinstance(g, torch.Tensor)
            if need_dgrad:
                wq = C.ensure_fp8_copy(wq, "c")  # a stored FP8 weight: transposed on demand
                if plain and isinstance(wq, torch.Tensor):
                    dxs.append(g @ wq.to(g.dtype))
                else:
                    dxs.append(C.gemm_dgrad(g, wq, dtype)[0])
            if need_wgrad[i]:
                if plain and isinstance(xq, torch.Tensor):
                    dw = g.t() @ xq.to(g.dtype)
                else:
                    dw = C.gemm_wgrad(g, xq, w_dtype)[0]
                dw = dw.to(w_dtype)
            dws.append(dw)
            dbs.append(db)
        dx = None
        if need_dgrad:
            if dxs:
                dx2 = torch.cat(dxs) if len(dxs) > 1 else dxs[0]
            else:
                dx2 = dy2.new_empty(0, self.in_features)
            dx = dx2.to(dtype).view(*lead, self.in_features)
        return dx, dws + (dbs if self.use_bias else []), []

    # ---- the grouped path ---------------------------------------------------------------------

    def _fp8_kind(self, fwd: bool) -> type[Quantizer] | None:
        """The quantizer class every quantizer of the pass ``fwd`` has, when the grouped kernels
        serve it: all delayed (``Float8Quantizer``) or all current scaling, one FP8 dtype per
        bucket (and one margin); else None (MXFP8, custom recipes, mixed quantizers, no
        recipe, or the private switch off)."""
        if not self._grouped:
            return None
        buckets = ("input", "weight") if fwd else ("grad_output",)
        qs = [q for b in buckets for q in self.gemm_quantizers(fwd, b)]
        if not qs or any(q is None for q in qs):
            return None
        kind = type(qs[0])
        if kind not in (Float8Quantizer, Float8CurrentScalingQuantizer):
            return None
        for b in buckets:
            bq = self.gemm_quantizers(fwd, b)
            first: Any = bq[0]
            for q in bq:
                if type(q) is not kind or q.dtype != first.dtype:
                    return None
                if getattr(q, "margin", 0) != getattr(first, "margin", 0):
                    return None
        return kind

    def _grouped_cast(
        self, qs: list[Any], x: list[torch.Tensor], splits: Any, rowwise: bool, columnwise: bool
    ) -> list[Float8Data]:
        """``x`` (G tensors, or one packed tensor with ``splits``) cast by the quantizers ``qs``
        (one per group, all delayed or all current scaling) in one operator call: per group the
        container ``q.quantize`` makes, and for delayed scaling each amax folded into its
        quantizer's running max as ``q.quantize`` does."""
        q0 = qs[0]
        delayed = isinstance(q0, Float8Quantizer)
        scales = torch.cat([q.scale for q in qs]) if delayed else None
        margin = 0 if delayed else q0.margin
        data, data_t, scale_inv, amax, _ = K.grouped_quantize_fp8(
            x, list(splits), scales, q0.dtype, margin, rowwise, columnwise
        )
        if delayed:
            _record_amaxes(qs, amax)
        out = []
        for i in range(len(qs)):
            if len(x) == len(qs):  # listed: each tensor's own shape
                shape = x[i].shape
            else:
                shape = torch.Size((splits[i], x[0].shape[-1]))
            out.append(Float8Data._trusted(data[i] if rowwise else None,
                                           data_t[i] if columnwise else None, scale_inv[i],
                                           q0.dtype, shape))  # fmt: skip
        return out

    def _aligned(self, x: torch.Tensor, dtype: torch.dtype) -> bool:
        """cuBLASLt's FP8 alignment for the forward and dgrad GEMMs of every expert (they depend
        on the feature sizes only; see ``_kernels.gemm_fp8_aligned``); the CPU takes any."""
        if not x.is_cuda:
            return True
        return all(K.gemm_fp8_aligned(k, n, dtype)
                   for k, n in ((self.in_features, self.out_features),
                                (self.out_features, self.in_features)))  # fmt: skip

    def _forward_grouped(self, ctx, x, params, epilogue):
        """:meth:`forward_grouped` (its checks passed)."""
        splits: tuple[int, ...] = ctx.call
        if not isinstance(x, torch.Tensor):
            return None
        n = self.num_gemms
        ws, bs = list(params[:n]), list(params[n:])
        dtype = x.dtype
        if any(w.dtype != ws[0].dtype for w in ws):
            return None  # the loop takes mixed dtypes
        stored = [isinstance(w, QuantizedTensor) for w in ws]
        kind = self._fp8_kind(True)
        qxs = self.gemm_quantizers(True, "input")
        if kind is None:
            if any(q is not None for q in qxs) or not bs or not self._grouped:
                return None
            # No recipe: the forward GEMMs with bias (the loop's fusible.gemm calls; without a
            # bias the loop runs torch's linear, whose bits another GEMM would not reproduce).
            if ws[0].dtype != dtype or any(b.dtype != bs[0].dtype for b in bs):
                return None
            if epilogue and not K.gemm_epilogue_supported(dtype, dtype, dtype, epilogue):
                return None
            # Stored weights: their exact dequantization, as the loop computes with.
            ws = [w.dequantize() if st else w for w, st in zip(ws, stored, strict=True)]
            return self._forward_hp(ctx, x, ws, bs, splits, epilogue)
        if not self._aligned(x, dtype) or any(b.dtype != bs[0].dtype for b in bs):
            return None
        qws = self.gemm_quantizers(True, "weight")
        fp8 = (qxs[0].dtype, qws[0].dtype)  # type: ignore[union-attr]
        if epilogue and not K.gemm_epilogue_supported(*fp8, dtype, epilogue):
            return None
        self._check_input(x, splits)
        prg = ctx.params_requires_grad or (False,) * len(params)
        grad = not _inference()
        need_dgrad = grad and ctx.input_requires_grad
        need_wgrad = tuple(grad and bool(r) for r in prg[:n])
        # Stored weights: per-tensor FP8 of the active format used as they are; the others (MXFP8,
        # blockwise) as their exact dequantization, cast like high-precision weights (they have
        # no workspace cache: see workspace_specs).
        used = [_used_as_is(w, q) for w, q in zip(ws, qws, strict=True)]
        ws = [w.dequantize() if st and not u else w
              for w, st, u in zip(ws, stored, used, strict=True)]  # fmt: skip
        keyed = isinstance(ctx.cache_weight, dict)
        cache = ctx.cache_weight if keyed else {}
        given = ctx.workspace if keyed else {}
        # Weights: stored ones and cache hits as they are; the others cast in one call (an empty
        # expert's weight only to fill its cache, as in the loop).
        wqs: list[Any] = [w.qdata if u else w for w, u in zip(ws, used, strict=True)]
        todo = []
        for i in range(n):
            if used[i]:
                continue
            update = cache.get(i, False)
            if not (splits[i] or update):
                continue
            if given.get(i) is not None and not update:
                wqs[i] = given[i]
            else:
                todo.append(i)
        if todo:
            # Every weight goes in (evenly spaced quantizer slots: one amax fold), the others
            # skipped (m_splits 0: no cast, amax 0, which leaves a running max as it is).
            col = need_dgrad or any(cache.get(i, False) for i in todo)
            rows = [self.out_features if i in todo else 0 for i in range(n)]
            if n == 1:
                made = self._grouped_cast(qws, [ws[0].contiguous()], (), True, col)
            else:
                # A weight used as stored goes in as an empty placeholder (its tensor would be
                # dequantized by QuantizedTensor's dispatch only to be skipped).
                hole = x.new_empty((0, self.in_features), dtype=ws[0].dtype)
                listed = [hole if used[i] else w.contiguous() for i, w in enumerate(ws)]
                made = self._grouped_cast(qws, listed, rows, True, col)
            for i in todo:
                wqs[i] = made[i]
                if cache.get(i, False):
                    ctx.new_workspace[i] = made[i]
        x2 = C.as_2d(x).contiguous()
        xqs = self._grouped_cast(qxs, [x2], splits, True, any(need_wgrad))
        idx = [i for i in range(n) if splits[i]]
        aux = None
        if idx:
            y, *rest = K.grouped_gemm(
                [xqs[i].data for i in idx], [wqs[i].data for i in idx], [],
                [xqs[i].scale_inv for i in idx], [wqs[i].scale_inv for i in idx], dtype,
                [bs[i].to(dtype) for i in idx] if bs else None, True, True, epilogue,
            )  # fmt: skip
            aux = rest[0] if rest else None
        else:
            y = x2.new_empty(0, self.out_features)
            aux = y if K.GEMM_RULES.epilogues[epilogue or "none"].writes_aux else None
        y = C.gemm_output(y, (*x.shape[:-1], self.out_features))
        if aux is not None:
            aux = aux.view(y.shape)
        # What the loop saves: columnwise copies, nothing for an empty expert.
        saved_x = [C.keep_columnwise(xqs[i]) if need_wgrad[i] and splits[i] else None
                   for i in range(n)]  # fmt: skip
        saved_w = [C.keep_columnwise(wqs[i]) if need_dgrad and splits[i] else None
                   for i in range(n)]  # fmt: skip
        _save(ctx, saved_x, saved_w, splits, need_dgrad, need_wgrad, dtype, ws, bs, grad, prg[n:],
              "fp8")  # fmt: skip
        return y, aux

    def _forward_hp(self, ctx, x, ws, bs, splits, epilogue):
        """No recipe, with bias: the forward GEMMs in one ``grouped_gemm`` (per expert the
        loop's ``fusible.gemm`` call with the bias epilogue); backward is the loop's."""
        n = self.num_gemms
        self._check_input(x, splits)
        dtype = x.dtype
        params_rg = ctx.params_requires_grad or (False,) * (2 * n)
        grad = not _inference()
        need_dgrad = grad and ctx.input_requires_grad
        need_wgrad = tuple(grad and bool(r) for r in params_rg[:n])
        x2 = C.as_2d(x).contiguous()
        wc, bc = [w.contiguous() for w in ws], [b.to(dtype) for b in bs]
        y, *rest = K.grouped_gemm([x2], wc, list(splits), None, None, dtype, bc, False, True,
                                  epilogue)  # fmt: skip
        y = C.gemm_output(y, (*x.shape[:-1], self.out_features))
        aux = rest[0].view(y.shape) if rest else None
        xs = torch.split(x2, list(splits)) if n > 1 else (x2,)
        saved_x = [xs[i] if need_wgrad[i] and splits[i] else None for i in range(n)]
        saved_w = [ws[i] if need_dgrad and splits[i] else None for i in range(n)]
        _save(ctx, saved_x, saved_w, splits, need_dgrad, need_wgrad, dtype, ws, bs, grad,
              params_rg[n:], "hp")  # fmt: skip
        return y, aux

    def _backward_grouped(self, ctx, dy, grad_cast):
        """The backward pass as grouped operators, or None where the loop runs it. (fc2's dgrad
        with cuBLASLt's ``dgelu`` epilogue, which would replace the GELU backward kernel of an
        expert MLP, measured slower on the H200: for FP8 operands cuBLASLt runs the epilogue as a
        separate kernel, 0.26 ms per expert against 0.42 ms for act_bwd over all of them.)"""
        if self._fp8_kind(False) is None or not isinstance(dy, torch.Tensor):
            return None
        n = self.num_gemms
        a = ctx.attrs
        splits, need_dgrad, need_wgrad = a["splits"], a["need_dgrad"], a["need_wgrad"]
        need_bgrad, dtype = a["need_bgrad"], a["dtype"]
        w_dtypes, b_dtypes = a["w_dtypes"], a["b_dtypes"]
        if len(set(w_dtypes)) > 1 or len(set(b_dtypes)) > 1:
            return None
        saved_x, saved_w = ctx.saved[:n], ctx.saved[n:]
        lead = dy.shape[:-1]
        dy2 = C.as_2d(dy)
        if not dy2.is_contiguous():
            return None  # the loop's per-expert reductions read the strided view itself
        wgrad = any(need_wgrad)
        qgs = self.gemm_quantizers(False, "grad_output")
        given_dbs = None
        if grad_cast is not None:
            gs, given_dbs = grad_cast(qgs, splits, need_dgrad, need_wgrad)
        elif need_dgrad or wgrad:
            gs = self._grouped_cast(qgs, [dy2], splits, need_dgrad, wgrad)
        else:
            gs = []
        idx = [i for i in range(n) if splits[i]]
        dx = None
        if need_dgrad:
            if idx:
                # A stored FP8 weight's transposed copy: a byte transpose, freed after dgrad.
                wts = [C.ensure_fp8_copy(saved_w[i], "c") for i in idx]
                dx2 = K.grouped_gemm(
                    [gs[i].data for i in idx], [w.data_t for w in wts], [],
                    [gs[i].scale_inv for i in idx], [w.scale_inv for w in wts], dtype,
                    None, False, True,
                )[0]  # fmt: skip
            else:
                dx2 = dy2.new_empty(0, self.in_features)
            dx = dx2.to(dtype).view(*lead, self.in_features)
        dws: list[torch.Tensor | None] = [None] * n
        if wgrad:
            w_dtype = w_dtypes[0]
            # cuBLASLt's FP8 GEMM needs K = the expert's token count % 16 == 0: others (CUDA
            # only) run the loop's GEMM on dequantized operands.
            k_mult = K.GEMM_RULES.fp8_k_multiple
            one = [i for i in range(n) if need_wgrad[i] and dy2.is_cuda and splits[i] % k_mult]
            grp = [i for i in range(n) if need_wgrad[i] and i not in one]
            if grp:
                # An empty expert is a GEMM with K = 0, which writes its zeros: its B is one
                # shared [in_features, 0] matrix (its input saved nothing).
                none = None
                if not all(splits[i] for i in grp):
                    x_fp8 = self.gemm_quantizers(True, "input")[0].dtype  # type: ignore[union-attr]
                    none = dy2.new_empty((self.in_features, 0), dtype=x_fp8)
                xb = [saved_x[i].data_t if splits[i] else none for i in grp]
                xs = [saved_x[i].scale_inv if splits[i] else gs[i].scale_inv for i in grp]
                got = K.grouped_gemm(
                    [gs[i].data_t for i in grp], xb, [],
                    [gs[i].scale_inv for i in grp], xs, w_dtype, None, False, False,
                )  # fmt: skip
                for i, dw in zip(grp, got, strict=True):
                    dws[i] = dw
            for i in one:
                dws[i] = C.gemm_wgrad(gs[i], saved_x[i], w_dtype)[0].to(w_dtype)
        dbs: list[torch.Tensor | None] = [None] * n
        if given_dbs is not None:
            dbs = list(given_dbs)
        elif need_bgrad and any(need_bgrad):
            got = K.grouped_bias_grad(dy2, list(splits), b_dtypes[0]).unbind(0)
            dbs = [db if need_bgrad[i] else None for i, db in enumerate(got)]
        return dx, dws + (dbs if self.use_bias else []), []


def _used_as_is(w: torch.Tensor, qw: Quantizer | None) -> bool:
    """Whether the grouped path reads weight ``w`` as it is stored: a per-tensor FP8
    ``QuantizedTensor`` whose format the active weight quantizer ``qw`` asks for."""
    return (
        isinstance(w, QuantizedTensor)
        and type(w.qdata) is Float8Data
        and _stored_matches(w.qdata, qw, need_columnwise=True)
    )


def check_splits(m_splits: Any, num_gemms: int, owner: str = "GroupedLinear") -> tuple[Any, ...]:
    """``m_splits`` as a tuple of ``num_gemms`` ints >= 0 (see :class:`GroupedLinear`); raises
    ``TypeError`` / ``ValueError`` naming ``owner``, the argument and what was expected."""
    if isinstance(m_splits, torch.Tensor):
        if m_splits.dim() != 1 or m_splits.dtype.is_floating_point or m_splits.is_complex():
            raise TypeError(
                f"{owner}: m_splits as a tensor must be 1-D of an integer dtype, got shape "
                f"{tuple(m_splits.shape)} and dtype {m_splits.dtype}"
            )
        m_splits = m_splits.tolist()  # a host sync for a device tensor (documented)
    if not isinstance(m_splits, (list, tuple)):
        raise TypeError(
            f"{owner}: m_splits must be a list or tuple of {num_gemms} ints (or a 1-D integer "
            f"tensor), got {type(m_splits).__name__}"
        )
    out: list[Any] = []
    for i, v in enumerate(m_splits):
        if isinstance(v, bool):
            raise TypeError(f"{owner}: m_splits[{i}] must be an int, got {v!r}")
        if isinstance(v, (int, torch.SymInt)):
            out.append(v)
            continue
        try:
            out.append(operator.index(v))
        except TypeError:
            raise TypeError(
                f"{owner}: m_splits[{i}] must be an int, got {type(v).__name__} {v!r}"
            ) from None
    if len(out) != num_gemms:
        raise ValueError(
            f"{owner}: m_splits must have num_gemms={num_gemms} entries (one token count per "
            f"GEMM), got {len(out)}: {out}"
        )
    neg = [(i, v) for i, v in enumerate(out) if v < 0]
    if neg:
        raise ValueError(
            f"{owner}: m_splits entries must be >= 0, got m_splits[{neg[0][0]}]={neg[0][1]}"
        )
    return tuple(out)


def _record_amaxes(qs: list[Any], amax: torch.Tensor) -> None:
    """Fold ``amax[i]`` into delayed-scaling quantizer ``qs[i]``'s running max, as
    ``Float8Quantizer.quantize`` does with its kernel's amax (NaN propagates): one in-place
    maximum over a strided view when the quantizers are evenly spaced slots of one state (the
    usual layout: a GroupedLinear's slots repeat every few roles), else one per quantizer. A
    checkpoint recomputation records nothing (its forward did)."""
    if replaying_scales():
        return
    q0 = qs[0]
    buf = q0.buffers
    step = qs[1].slot - q0.slot if len(qs) > 1 else 1
    if step > 0 and all(q.buffers is buf and q.slot == q0.slot + i * step
                        for i, q in enumerate(qs)):  # fmt: skip
        row = buf.amax_history[0]
        seen = row[q0.slot : q0.slot + step * (len(qs) - 1) + 1 : step]
        if torch.compiler.is_compiling():  # dynamo takes no strided out= tensor
            seen.copy_(torch.maximum(seen, amax))
        else:
            torch.maximum(seen, amax, out=seen)
        return
    for i, q in enumerate(qs):
        q.record_amax(amax[i : i + 1])


def _save(
    ctx: Any,
    saved_x: list[Any],
    saved_w: list[Any],
    splits: tuple[int, ...],
    need_dgrad: bool,
    need_wgrad: tuple[bool, ...],
    dtype: torch.dtype,
    ws: Any,
    bs: Any,
    grad: bool,
    bias_requires_grad: Any,
    grouped: str | bool,
) -> None:
    """What each forward path (the loop, ``grouped`` False; the grouped FP8 one, "fp8"; the
    high-precision one, "hp") leaves its backward: per expert the saved input copy, then the
    saved weight copy (None where nothing is saved), and the attributes the backward reads."""
    ctx.saved = saved_x + saved_w
    ctx.attrs.update(
        splits=splits, need_dgrad=need_dgrad, need_wgrad=need_wgrad, dtype=dtype,
        w_dtypes=tuple(w.dtype for w in ws), b_dtypes=tuple(b.dtype for b in bs),
        need_bgrad=tuple(grad and bool(r) for r in bias_requires_grad), grouped=grouped,
    )  # fmt: skip
