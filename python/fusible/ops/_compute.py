"""Shared compute helpers of the ops: quantized containers, the three training GEMMs, and the
norm/activation kernels with optional quantized output. Every op and fused op goes through these,
so each piece of math has one implementation."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from fusible import _kernels as K
from fusible.quantization.quantizers import (
    Float8BlockData,
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8Data,
    Float8Quantizer,
    MXFP8Data,
    MXFP8Quantizer,
    QuantizedData,
    Quantizer,
)

__all__ = [
    "HandOff",
    "as_2d",
    "blockwise_gemm",
    "can_requantize_columnwise",
    "dequant_dtype",
    "dequantize",
    "dequantized",
    "ensure_fp8_copy",
    "fused_quant_args",
    "gemm_dgrad",
    "gemm_fprop",
    "gemm_output",
    "gemm_wgrad",
    "handoff",
    "handoff_after",
    "hp_dtype",
    "keep_columnwise",
    "quantize",
    "requantize_columnwise",
    "without_copy",
    "wrap_quantized",
]


class HandOff:
    """A unit's output already quantized with the next op's input quantizer (quantizer hand-off),
    with the high-precision dtype the unquantized value would have had.

    The op it is made for may :meth:`take` the quantized data: the hand-off then holds none, so
    the copies that op drops (a Linear's rowwise copy after its forward GEMM, a gradient's
    copies after the backward GEMM that reads them) are freed at once, not when the executor
    moves on to the next unit."""

    __slots__ = ("_qdata", "dtype", "shape")

    def __init__(self, qdata: QuantizedData, dtype: torch.dtype) -> None:
        self._qdata: QuantizedData | None = qdata
        self.dtype = dtype
        self.shape: torch.Size = qdata.shape

    @property
    def qdata(self) -> QuantizedData:
        if self._qdata is None:
            raise RuntimeError("fusible: this hand-off's data was taken by the op it was made for")
        return self._qdata

    def take(self) -> QuantizedData:
        """The quantized data, which the hand-off no longer holds."""
        q = self._qdata
        if q is None:
            raise RuntimeError("fusible: this hand-off's data was taken by the op it was made for")
        self._qdata = None
        return q

    def dequantize(self) -> torch.Tensor:
        return self.qdata.dequantize(self.dtype)


def as_2d(x: torch.Tensor) -> torch.Tensor:
    # Eagerly a 2-D tensor as it is: a reshape to its own shape is still an operator call (a
    # view) per GEMM operand on the hot path. Traced graphs keep their views (free there):
    # without them torch 2.11's compiled blockwise backward on CUDA gave a zero input gradient
    # (test_compile.py's blockwise cases; not analysed further).
    if x.dim() == 2 and not torch.compiler.is_compiling():
        return x
    return x.reshape(-1, x.shape[-1])


def in_shape(y: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """``y.view(*shape)``; eagerly ``y`` itself when it has that shape already (no operator
    call; see :func:`as_2d`)."""
    if y.shape == tuple(shape) and not torch.compiler.is_compiling():
        return y
    return y.view(*shape)


def gemm_output(y: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """A GEMM's fresh 2-D output ``y`` in the op's output ``shape``. Traced, not a view: an
    output that aliases an intermediate comes out of a compiled graph as a view of it, which
    in-place ops on the module's output (``y.add_(r)``) then reject, where a compiled
    ``nn.Linear`` returns a plain tensor (ATen's matmul uses ``_unsafe_view`` the same way). No
    saved tensor shares ``y``'s storage (the ops save their inputs and other buffers). Eagerly a
    view (the executor returns a view as a detached alias; see fuser._forward_python). ``y``
    itself eagerly when it has that shape already (a 2-D input; see :func:`as_2d`)."""
    if torch.compiler.is_compiling():
        return torch.ops.aten._unsafe_view(y, tuple(shape))
    return in_shape(y, shape)


def hp_dtype(x: torch.Tensor | HandOff) -> torch.dtype:
    return x.dtype


def dequantize(x: torch.Tensor | HandOff) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else x.dequantize()


def quantize(
    q: Quantizer, x: torch.Tensor | HandOff, *, rowwise: bool = True, columnwise: bool = False
) -> QuantizedData:
    """``x`` quantized with ``q`` (the copies asked for); a hand-off is already quantized."""
    if isinstance(x, HandOff):
        return x.qdata
    return q.quantize(x, rowwise=rowwise, columnwise=columnwise)


def handoff(q: Quantizer, y: torch.Tensor) -> HandOff:
    """``y`` quantized for the next op with its input quantizer (the copies it asks for)."""
    return HandOff(q.quantize(y), y.dtype)


def handoff_after(q: Quantizer | None, y: torch.Tensor) -> torch.Tensor | HandOff:
    """``y`` as an op whose kernel cannot write its output quantized by ``q`` returns it (see
    :func:`fused_quant_args`): quantized for the next op here, by a separate cast, when ``q`` is
    a current-scaling quantizer, so that the high-precision ``y`` is freed when this op returns
    instead of living on while the next op quantizes it and runs its GEMM. (Current scaling
    casts every copy with the scale of the whole tensor, so these are the bits the next op's
    own cast would make; blockwise scales are functions of ``y``'s blocks alone, so the same holds
    for a blockwise quantizer, which the norm/activation kernels fuse but other callers may not.)
    ``y`` itself otherwise."""
    if isinstance(q, (Float8CurrentScalingQuantizer, Float8BlockQuantizer)):
        return handoff(q, y)
    return y


def record_amax(q: Quantizer, amax: torch.Tensor) -> None:
    """A delayed-scaling quantizer's running amax, for an amax a kernel returned (an empty one:
    the kernel accumulated it into the quantizer's slot, ``amax_into``, already)."""
    if isinstance(q, Float8Quantizer) and amax.numel():
        q.record_amax(amax)


FusedQuant = tuple[str, torch.dtype, torch.Tensor | None, bool, float, torch.Tensor | None]


def fused_quant_args(q: Quantizer | None, device: torch.device) -> FusedQuant | None:
    """Arguments ``(quant, fp8_dtype, scale, power_2_scale, amax_epsilon, amax_into)`` with which
    a norm/activation kernel on ``device`` writes its output quantized by ``q`` (``amax_into``:
    a delayed-scaling quantizer's history slot, which the kernel max-combines its amax into,
    :meth:`Float8Quantizer.amax_into`; else None), or None if that
    quantizer is not fused into the kernel there, and the output is cast by a separate pass
    (:func:`handoff_after`: the same bits). Not fused:
    - current scaling: it needs the amax of the whole output before the first cast;
    - blockwise quantizers (1x128 or 128x128 blocks) on CUDA: the fused blockwise kernels hold a
      128 x 128 tile of fp32 values per block (about 237 registers a thread, one block per SM)
      and run at 0.04-0.15 of copy bandwidth on the H200, while the kernel without the cast and
      the standalone blockwise cast run at 0.55-0.8 and 0.81-0.89 (benchmarks/results/
      ops_kernels_NVIDIA_H200.json, kernels_NVIDIA_H200.json). The CPU backend fuses them."""
    if isinstance(q, Float8Quantizer):
        return "fp8", q.dtype, q.scale, True, 0.0, q.amax_into()
    if isinstance(q, MXFP8Quantizer):
        return "mxfp8", q.dtype, None, True, 0.0, None
    if isinstance(q, Float8BlockQuantizer) and device.type != "cuda":
        quant = "block1d" if q.block_dim == 1 else "block2d"
        return quant, q.dtype, None, q.power_2_scale, q.amax_epsilon, None
    return None


def wrap_quantized(
    q: Quantizer, outs: tuple[torch.Tensor, ...], shape: torch.Size, dtype: torch.dtype
) -> HandOff:
    """Hand-off of a kernel's quantized outputs ``(data, data_t|col, scale_inv|scale, col_scale,
    amax)`` (layouts of ``_kernels.quantize_fp8`` / ``quantize_mxfp8`` / ``quantize_fp8_block``;
    ``amax`` empty when the kernel accumulated it into the quantizer's slot)."""
    data, second, third, col_scale, amax = outs

    def opt(t: torch.Tensor) -> torch.Tensor | None:
        return t if t.numel() or 0 in shape else None

    if isinstance(q, Float8Quantizer):
        record_amax(q, amax)
        qd: QuantizedData = Float8Data(opt(data), opt(second), third, q.dtype, shape)
    elif isinstance(q, Float8BlockQuantizer):
        qd = Float8BlockData(opt(data), opt(third), opt(second), opt(col_scale), q.dtype, shape,
                             q.block_dim)  # fmt: skip
    else:
        qd = MXFP8Data(opt(data), opt(third), opt(second), opt(col_scale), q.dtype, shape)
    return HandOff(qd, dtype)


def _gemm(
    a: Any,
    b: Any,
    which: str,
    out_dtype: torch.dtype,
    *,
    bias: torch.Tensor | None = None,
    epilogue: str = "none",
    c: torch.Tensor | None = None,
    fast_accum: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(d, aux)``: D = A @ B^T (+ bias, GELU with its input as aux, + c) on the copies ``which``
    names ("rr": rowwise A and B; "rc": rowwise A, columnwise B; "cc": both columnwise), the NT
    form cuBLASLt's FP8 GEMM needs. ``epilogue``: "none", "bias" or "bias_gelu_aux".

    Per-tensor FP8 operands run an FP8 GEMM; MXFP8 operands (no MXFP8 GEMM on Hopper or CPU) and
    FP8 shapes cuBLASLt cannot align run on exactly dequantized operands. An epilogue the GEMM has
    no kernel for (gemm.h) is applied after it by the same bias add and GELU kernel the unfused
    ops use, so the result does not depend on which path ran.
    """
    ta_, tb_ = type(a), type(b)
    if ta_ is Float8BlockData and tb_ is Float8BlockData and _block_gemm(a, b):
        return _gemm_blockwise(a, b, which, out_dtype, bias=bias, epilogue=epilogue, c=c)
    if ta_ is Float8Data and tb_ is Float8Data:
        wa, wb = which[0], which[1]
        am = a.data if wa == "r" else a.data_t
        bm = b.data if wb == "r" else b.data_t
        if am is None or bm is None:
            _fp8_copy(a, wa), _fp8_copy(b, wb)  # raises, naming the missing copy
        if wa == "r":
            am = as_2d(am)
        if wb == "r":
            bm = as_2d(bm)
        scales: tuple[torch.Tensor | None, torch.Tensor | None] = (a.scale_inv, b.scale_inv)
        transa, transb = False, True  # the NT form: both operands K-contiguous
        if am.is_cuda and not K.gemm_fp8_aligned(am.shape[-1], bm.shape[0], out_dtype):
            f32 = torch.float32
            (am, ta), (bm, tb) = _dequant_copy(a, which[0], f32), _dequant_copy(b, which[1], f32)
            transa, transb = ta, not tb
            scales = (None, None)
    else:
        pre = type(a) is tuple and type(b) is tuple  # dequantized by the caller
        dt = out_dtype if pre else _common_dtype(a, b, out_dtype)
        (am, ta), (bm, tb) = _dequant_copy(a, which[0], dt), _dequant_copy(b, which[1], dt)
        # A = [M, K] or, transposed, [K, M]; B^T's operand is [N, K] or, transposed, [K, N]
        transa, transb = ta, not tb
        scales = (None, None)
    fp8 = scales[0] is not None
    gemm_out = out_dtype if fp8 or am.dtype == out_dtype else torch.float32
    fused = (
        epilogue != "none"
        and K.gemm_epilogue_supported(am.dtype, bm.dtype, gemm_out, epilogue)
        # cuBLASLt may take another bias dtype (FP8 operands, fp32 output): keep the bias exact
        and (bias is None or K.gemm_bias_fused(fp8, gemm_out))
        and (c is None or K.GEMM_RULES.epilogues[epilogue].c)  # accumulation: none / bias only
    )
    bias_arg = _to(bias, gemm_out) if fused and bias is not None else None
    d, aux, _, _ = K.gemm(
        am, bm, transa, transb, scales[0], scales[1], gemm_out, bias_arg,
        epilogue if fused else "none", None, None if c is None else _to(c, gemm_out), 1.0,
        0.0 if c is None else 1.0, None, False, fast_accum=fast_accum and fp8,
    )  # fmt: skip
    if not fused and epilogue != "none":
        if bias is not None:
            d = d + _to(bias, d.dtype)
        if epilogue == "bias_gelu_aux":
            aux = d.contiguous()
            d = K.act_fwd(aux, "gelu", aux.dtype, "none", torch.float8_e4m3fn, None, True, False)[0]
    if d.dtype != out_dtype:
        d = d.to(out_dtype)
    return d, (_to(aux, out_dtype) if epilogue == "bias_gelu_aux" else None)


def _to(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t.to(dtype)``, which is ``t`` itself when it has that dtype (checked here: a call less
    on the hot path)."""
    return t if t.dtype == dtype else t.to(dtype)


def blockwise_gemm(a: Any, b: Any) -> bool:
    """Whether the GEMM of operands ``a`` and ``b`` is the blockwise FP8 GEMM, which has no
    epilogues (its bias and GELU run after it, see ``_gemm_blockwise``)."""
    return type(a) is Float8BlockData and type(b) is Float8BlockData and _block_gemm(a, b)


def _block_gemm(a: Any, b: Any) -> bool:
    """Whether ``_gemm`` runs the blockwise FP8 GEMM: both operands blockwise in a pair of block
    shapes it serves (``GEMM_RULES.block_pairs``: not both 128x128, which cuBLASLt has no kernel
    for; a CustomRecipe can make that pair, which then runs on the dequantized operands like any
    other mix of formats)."""
    return (
        isinstance(a, Float8BlockData)
        and isinstance(b, Float8BlockData)
        and (a.block_dim, b.block_dim) in K.GEMM_RULES.block_pairs
    )


def _block_copy(x: Float8BlockData, which: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(data, scale_inv)`` of the copy a blockwise GEMM reads: rowwise [rows, k] or the
    transposed copy [k, rows]; a 128x128 copy that is missing is made by a byte transpose (its
    tiles and their scales are the same)."""
    if which == "r" and x.data is not None:
        return as_2d(x.data), x.scale_inv  # type: ignore[return-value]
    if which == "c" and x.data_t is not None:
        return x.data_t, x.col_scale_inv  # type: ignore[return-value]
    if x.block_dim == 2:
        full = ensure_fp8_copy(x, which)
        return _block_copy(full, which)
    raise RuntimeError(
        f"fusible: the {'rowwise' if which == 'r' else 'columnwise'} blockwise FP8 copy a GEMM "
        "needs was not produced (quantizer usage)"
    )


def _gemm_blockwise(
    a: Float8BlockData,
    b: Float8BlockData,
    which: str,
    out_dtype: torch.dtype,
    *,
    bias: torch.Tensor | None,
    epilogue: str,
    c: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The blockwise FP8 GEMM (``gemm_block``: cuBLASLt's block-scaled kernels on CUDA, the
    exactly dequantized operands on the CPU). Its epilogues are none and bias (a 16-bit output):
    a bias of another dtype is added after it, and the GELU (no block-scaled GELU_AUX kernel) is
    the activation kernel after it; ``c`` is accumulated by the GEMM."""
    am, sa = _block_copy(a, which[0])
    bm, sb = _block_copy(b, which[1])
    gemm_out = out_dtype if out_dtype in K.GEMM_RULES.block_out_dtypes else torch.float32
    cc = None if c is None else c.to(gemm_out).contiguous()
    fused_bias = (
        epilogue != "none" and bias is not None and bias.dtype == gemm_out
        and gemm_out in _BLOCK_BIAS_DTYPES
    )  # fmt: skip
    d = K.gemm_block(am, sa, a.block_dim, bm, sb, b.block_dim, gemm_out, cc, 1.0,
                     0.0 if c is None else 1.0, bias if fused_bias else None)  # fmt: skip
    aux = None
    if epilogue != "none":
        if bias is not None and not fused_bias:
            d.add_(bias.to(d.dtype))  # in place: no second [M, N] alive
        if epilogue == "bias_gelu_aux":
            aux = d.contiguous()
            d = K.act_fwd(aux, "gelu", aux.dtype, "none", torch.float8_e4m3fn, None, True, False)[0]
    d = d.to(out_dtype)
    return d, (aux.to(out_dtype) if aux is not None else None)


# The bias dtypes of the blockwise GEMM's bias epilogue (the output's, 16-bit; gemm.h).
_BLOCK_BIAS_DTYPES = (
    (torch.bfloat16, torch.float16) if "bias" in K.GEMM_RULES.block_epilogues else ()
)


def _fp8_copy(x: Float8Data, which: str) -> torch.Tensor:
    m = x.data if which == "r" else x.data_t
    if m is None:
        raise RuntimeError(f"fusible: the {'rowwise' if which == 'r' else 'transposed'} FP8 copy "
                           "a GEMM needs was not produced (quantizer usage)")  # fmt: skip
    return as_2d(m) if which == "r" else m


def _replaced(x: Any, names: tuple[str, ...], values: tuple[Any, ...]) -> Any:
    """``dataclasses.replace(x, **dict(zip(names, values)))`` for a valid container whose change
    keeps it valid (a copy dropped, or one made from the other): eagerly without the dataclass
    machinery (a dozen calls), which dynamo cannot trace on a frozen dataclass's ``__dict__``."""
    if torch.compiler.is_dynamo_compiling():
        return replace(x, **dict(zip(names, values, strict=True)))
    d = x.__dict__.copy()
    for name, value in zip(names, values, strict=True):
        d[name] = value
    obj = object.__new__(type(x))
    obj.__dict__.update(d)
    return obj


_DATA, _DATA_T, _DATA_SCALE = ("data",), ("data_t",), ("data", "scale")
_NONE1, _NONE2 = (None,), (None, None)


def ensure_fp8_copy(x: Any, which: str) -> Any:
    """``x`` with the per-tensor FP8 copy ``which`` ("r": rowwise, "c": transposed) a GEMM needs,
    made when missing by a byte transpose of the other copy (exact, same ``scale_inv``): how a
    stored FP8 weight, which keeps its rowwise copy only, gets its transposed copy for dgrad; a
    128x128 blockwise copy likewise (its tile scales, transposed).
    The new copy lives in the returned container only (freed with it); ``x``'s tensors are
    shared. Anything else (high precision, MXFP8, a copy already there) is returned as is."""
    t = type(x)
    if t is torch.Tensor or t is MXFP8Data:
        return x
    if t is not Float8Data:  # by type first: isinstance is a call
        if isinstance(x, Float8BlockData) and x.block_dim == 2:
            if (x.data if which == "r" else x.data_t) is not None:
                return x
            if which == "c":
                assert x.data is not None and x.scale_inv is not None
                data_t = _byte_transpose(as_2d(x.data))
                return replace(x, data_t=data_t, col_scale_inv=x.scale_inv.t().contiguous())
            assert x.data_t is not None and x.col_scale_inv is not None
            data = _byte_transpose(x.data_t).reshape(x.shape)
            return replace(x, data=data, scale_inv=x.col_scale_inv.t().contiguous())
        if not isinstance(x, Float8Data):
            return x
    if (x.data if which == "r" else x.data_t) is not None:
        return x
    if which == "c":
        assert x.data is not None
        return _replaced(x, _DATA_T, (_byte_transpose(as_2d(x.data)),))
    assert x.data_t is not None
    return _replaced(x, _DATA, (_byte_transpose(x.data_t).reshape(x.shape),))


def can_requantize_columnwise(q: Quantizer) -> bool:
    """Whether :func:`requantize_columnwise` makes, from the high-precision tensor, the very
    columnwise copy ``q`` makes with both: the built-in quantizers, whose copies are casts of the
    same values with the same scale (per tensor, or per block independently of the other
    copy)."""
    return type(q) in (
        Float8Quantizer,
        Float8CurrentScalingQuantizer,
        MXFP8Quantizer,
        Float8BlockQuantizer,
    )


def quantize_rowwise_for_requant(q: Quantizer, x: torch.Tensor) -> tuple[QuantizedData, Any]:
    """``(x's rowwise copy, what requantize_columnwise needs)``: the forward half of a tensor
    backward casts again (:func:`requantize_columnwise`). Delayed scaling keeps the scale the
    cast read (a copy the cast operator makes: a clone after it could be recomputed in backward
    by a traced graph's partitioner, after the step's update); other quantizers need nothing."""
    if isinstance(q, Float8Quantizer):
        return q.quantize_keeping_scale(x, rowwise=True, columnwise=False)
    return q.quantize(x, rowwise=True, columnwise=False), None


def requantize_columnwise(
    q: Quantizer, w: torch.Tensor, scale: torch.Tensor | None
) -> QuantizedData:
    """``w``'s columnwise copy (per-tensor ``data_t``, MXFP8 ``col_data``) as ``q`` made it in
    forward, made again: delayed scaling casts with ``scale``, the scale the forward cast with,
    and records no amax (the forward did); current scaling takes the same amax of the same
    values; MXFP8 blocks do not depend on the rowwise copy."""
    if isinstance(q, Float8Quantizer):
        assert scale is not None
        return q.quantize_with_scale(w, scale, rowwise=False, columnwise=True)
    return q.quantize(w, rowwise=False, columnwise=True)


def keep_columnwise(x: Any) -> Any:
    """``x`` as a backward GEMM reads it: only the copy laid out along the tokens (wgrad's
    input) or along the output features (dgrad's weight) -- the per-tensor transposed copy
    ``data_t`` or the MXFP8 columnwise copy -- with the rowwise copy, which only the forward
    GEMM reads, left out (it is freed once forward is done with it, as nothing else holds it).
    The kept tensors are shared, not copied (a cached weight workspace stays the one storage).
    Containers without that copy (a stored FP8 weight keeps its rowwise copy only; backward
    transposes it, see :func:`ensure_fp8_copy`) and high-precision tensors are returned as is."""
    t = type(x)
    if t is torch.Tensor:
        return x
    if t is Float8Data or (t is not MXFP8Data and isinstance(x, Float8Data)):
        if x.data is not None and x.data_t is not None:
            return _replaced(x, _DATA, _NONE1)
        return x
    if isinstance(x, MXFP8Data) and x.data is not None and x.col_data is not None:
        return _replaced(x, _DATA_SCALE, _NONE2)
    if isinstance(x, Float8BlockData) and x.data is not None and x.data_t is not None:
        return _replaced(x, ("data", "scale_inv"), _NONE2)
    return x


def without_copy(x: Any, which: str) -> Any:
    """``x`` without its rowwise (``which == "r"``) or columnwise (``"c"``) copy -- per-tensor
    ``data`` / ``data_t``, MXFP8 ``data`` + ``scale`` / ``col_data`` + ``col_scale`` -- so that
    copy is freed once nothing else holds it. ``x`` as it is when it has no other copy (a
    container keeps at least one) or is not quantized."""
    t = type(x)
    if t is torch.Tensor:
        return x
    if t is Float8Data or (t is not MXFP8Data and isinstance(x, Float8Data)):
        if x.data is not None and x.data_t is not None:
            return _replaced(x, _DATA_T if which == "c" else _DATA, _NONE1)
        return x
    if isinstance(x, MXFP8Data) and x.data is not None and x.col_data is not None:
        if which == "c":
            return _replaced(x, ("col_data", "col_scale"), _NONE2)
        return _replaced(x, _DATA_SCALE, _NONE2)
    if isinstance(x, Float8BlockData) and x.data is not None and x.data_t is not None:
        if which == "c":
            return _replaced(x, ("data_t", "col_scale_inv"), _NONE2)
        return _replaced(x, ("data", "scale_inv"), _NONE2)
    return x


def _byte_transpose(m: torch.Tensor) -> torch.Tensor:
    return K.transpose_fp8(m.contiguous())


def _common_dtype(a: Any, b: Any, out_dtype: torch.dtype) -> torch.dtype:
    """Operand dtype of a GEMM on dequantized operands. Per-tensor FP8 times an arbitrary fp32
    scale_inv is exact only in fp32; MXFP8 (power-of-two scales) is exact in bf16; high-precision
    operands use the output dtype."""
    fp32_exact = (Float8Data, Float8BlockData)  # fp32 scales: exact only in fp32
    if out_dtype == torch.float32 or isinstance(a, fp32_exact) or isinstance(b, fp32_exact):
        return torch.float32
    if isinstance(a, MXFP8Data) or isinstance(b, MXFP8Data):
        return torch.bfloat16
    return out_dtype


def dequant_dtype(a: Any, b: Any, out_dtype: torch.dtype) -> torch.dtype | None:
    """The dtype in which :func:`_gemm` dequantizes a GEMM's operands, when it would: an MXFP8
    GEMM runs on exactly dequantized operands, so a caller can make them first with
    :func:`dequantized` -- one at a time, dropping each MXFP8 copy once it is read, before the
    GEMM allocates its output -- and pass those in their place. None where ``_gemm`` takes
    another path with the dequantized operands (an operand dtype other than ``out_dtype``, see
    :func:`_common_dtype`) and for any other operands: pass those as they are. The GEMM
    computes the same either way."""
    ta, tb = type(a), type(b)
    fp32_scaled = (Float8Data, Float8BlockData)
    if (ta is not MXFP8Data and tb is not MXFP8Data) or ta in fp32_scaled or tb in fp32_scaled:
        return None
    return out_dtype if out_dtype in _MX_OPERAND_DTYPES else None


_MX_OPERAND_DTYPES = (torch.float32, torch.bfloat16)  # _common_dtype of MXFP8 operands


def _dequant_copy(x: Any, which: str, dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """``(m, transposed)``: the rowwise matrix (``which == "r"``) or the transposed matrix, in
    ``dtype`` -- a high-precision tensor converted, quantized data dequantized (exact in
    ``dtype``, see :func:`_common_dtype`). Where that layout would cost a transpose copy (a
    high-precision tensor or MXFP8's columnwise copy, both stored untransposed) ``m`` is the
    untransposed matrix and ``transposed`` is True: the GEMM reads it through its transpose
    flag, which is free. ``x`` already such a pair (made by :func:`dequantized` for this
    ``which``): ``x`` itself."""
    if type(x) is tuple:
        return x
    if isinstance(x, torch.Tensor):
        return as_2d(x).to(dtype).contiguous(), which != "r"
    if isinstance(x, Float8Data):  # whichever copy exists, the asked one first
        use_rows = x.data is not None if which == "r" else x.data_t is None
        if use_rows:
            return as_2d(K.dequantize_fp8(x.data, x.scale_inv, dtype)), which != "r"
        return K.dequantize_fp8(x.data_t, x.scale_inv, dtype), which == "r"
    if isinstance(x, Float8BlockData):  # likewise; each copy with its own scales
        use_rows = x.data is not None if which == "r" else x.data_t is None
        if use_rows:
            assert x.data is not None
            m = K.dequantize_fp8_block(as_2d(x.data), x.scale_inv, x.block_dim, dtype)
            return m, which != "r"
        m = K.dequantize_fp8_block(x.data_t, x.col_scale_inv, x.block_dim, dtype)
        return m, which == "r"
    if which == "r":
        return as_2d(K.dequantize_mxfp8(x.data, x.scale, False, dtype)), False
    return as_2d(K.dequantize_mxfp8(x.col_data, x.col_scale, True, dtype)), True


#: A GEMM operand dequantized ahead of the GEMM (see :func:`dequant_dtype`): ``dequantized(x,
#: which, dtype)`` is the ``(matrix, transposed)`` pair the GEMM reads for ``x``'s copy
#: ``which``; the GEMM functions take it in ``x``'s place.
dequantized = _dequant_copy


def gemm_fprop(x: Any, w: Any, out_dtype: torch.dtype, **kw: Any) -> tuple[torch.Tensor, Any]:
    """y[M,N] = x[M,K] @ w[N,K]^T (+ epilogue). FP8 operands accumulate without cuBLASLt's
    periodic promotion (fast accumulation), as TransformerEngine's recipes do for the forward
    GEMM; the two backward GEMMs, whose errors accumulate into weight updates, keep it."""
    return _gemm(x, w, "rr", out_dtype, fast_accum=True, **kw)


def gemm_dgrad(dy: Any, w: Any, out_dtype: torch.dtype, **kw: Any) -> tuple[torch.Tensor, Any]:
    """dx[M,K] = dy[M,N] @ w[N,K] = dy @ (w^T)[K,N]^T (+ c)."""
    return _gemm(dy, w, "rc", out_dtype, **kw)


def gemm_wgrad(dy: Any, x: Any, out_dtype: torch.dtype, **kw: Any) -> tuple[torch.Tensor, Any]:
    """dw[N,K] = dy^T[N,M] @ x[M,K] = (dy^T)[N,M] @ (x^T)[K,M]^T."""
    return _gemm(dy, x, "cc", out_dtype, **kw)
