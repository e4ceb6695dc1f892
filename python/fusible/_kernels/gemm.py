"""The gemm family (cpp/include/fusible/gemm.h: numerics, epilogues, dtype rules, the FP8 "TN"
layout; cpp/bindings/ops_gemm.cpp), and its one table of rules, :data:`GEMM_RULES`.

``gemm(a, b, transa, transb, a_scale_inv, b_scale_inv, out_dtype, bias, epilogue, aux, c, alpha,
beta, out_scale, want_amax, fast_accum=False) -> (d, aux_out, dbias, amax)``
    ``d = epilogue(alpha * s * op(a) @ op(b) + beta * c)``, FP32 accumulation. ``a`` is viewed as
    ``[prod(a.shape[:-1]), a.shape[-1]]``, which is op(a) = [M, K] (``transa=False``) or its
    transpose; ``b`` likewise is [K, N] or, with ``transb``, [N, K]. Operands are both high
    precision (same dtype) or both FP8 with per-tensor ``a_scale_inv`` / ``b_scale_inv``
    (``s`` is their product); FP8 GEMMs must be ``transa=False, transb=True``. ``epilogue`` is one
    of :data:`GEMM_EPILOGUES`: ``bias`` adds ``bias`` [N]; ``gelu*`` apply the tanh GELU,
    ``*_aux`` also return its input; ``dgelu`` multiplies by gelu'(``aux``); ``dgelu_bgrad`` also
    returns ``dbias``. ``c`` [M, N] is read when ``beta != 0``. An FP8 ``out_dtype`` needs
    ``out_scale``; ``want_amax`` then returns ``max|r|``. ``fast_accum`` allows cuBLASLt's faster
    FP8 accumulation (and TF32 for float32) on CUDA. ``d`` has shape ``(*a.shape[:-1], N)``
    (``(M, N)`` when ``transa``).
``gemm_block(a, a_scale_inv, a_block_dim, b, b_scale_inv, b_block_dim, out_dtype, c, alpha, beta,
bias=None) -> d``
    Blockwise FP8 operands (the layouts of ``quantize_fp8_block``):
    ``d[M, N] = alpha * a[M, K] @ b[N, K]^T + beta * c (+ bias)`` (the pairs, output dtypes and
    sizes of :data:`GEMM_RULES`). ``bias`` [N] (a bf16 / fp16 ``out_dtype``, the same dtype) is
    added in the epilogue, before D's one rounding. CPU: the GEMM of the exactly dequantized
    operands.

Grouped (MoE experts; fus_gemm_grouped)
---------------------------------------
``grouped_gemm(a, b, m_splits, a_scale_inv, b_scale_inv, out_dtype, bias, fast_accum, packed_out,
epilogue="", aux=None) -> list of d (+ aux)``
    ``d_i = a_i @ b_i^T (+ bias_i)`` for every group (the FP8 "TN" form: ``a_i`` ``[M_i, K_i]``,
    ``b_i`` ``[N_i, K_i]``), each the bits ``gemm`` gives for it as the per-GEMM path calls it.
    ``a``: G tensors or one packed tensor split by ``m_splits``; FP8 operands need
    ``a_scale_inv`` / ``b_scale_inv`` (G one-element tensors, or one ``[G]`` tensor); high
    precision operands have ``out_dtype``. ``bias``: G tensors ``[N_i]`` of ``out_dtype``, in the
    epilogue (an FP8 GEMM with a float32 output adds it afterwards, as ``fusible.gemm`` needs).
    ``packed_out``: one output ``[sum M_i, N]`` (the rows in group order); else one per group.
    A group with ``M_i == 0`` computes nothing; ``K_i == 0`` writes zeros. On CUDA: one cuBLASLt
    call per group on the current stream from one host call, no synchronisation.
    ``epilogue`` (default ``""``: ``"bias"`` with a bias, else ``"none"``): one of ``gemm``'s
    epilogues without a bias gradient or C, the same for every group (``bias`` given exactly
    when it reads one). One that reads aux (``"dgelu"``) takes ``aux`` packed ``[sum M_i, N]``
    (the groups' rows in order, ``out_dtype``); one that writes aux (``"bias_gelu_aux"``,
    ``"gelu_aux"``) returns it packed ``[sum M_i, N]`` after the outputs. Either needs one N
    for every group. With an explicit epilogue each group gives the bits of ``gemm`` with that
    epilogue (no staging of the packed aux; D is staged as above).
``grouped_bias_grad(dy, m_splits, out_dtype) -> dbias [G, N]``
    Row ``i``: group ``i``'s ``dy_i.sum(0, dtype=torch.float32).to(out_dtype)`` (zeros for an
    empty group), the bits of that torch expression; G + 1 kernels.
"""

from __future__ import annotations

import ctypes
import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch

from fusible._kernels._common import (
    _FUS_DTYPES,
    _LIBRARY,
    FP8_DTYPES,
    HIGH_PRECISION_DTYPES,
    _check_devices,
    _check_same_device,
    _fake,
    _group_mats,
    _matrix_shape,
    _nothing,
    _ops,
    _or_nothing,
)

gemm: Any = _ops.gemm.default
gemm_block: Any = _ops.gemm_block.default
grouped_gemm: Any = _ops.grouped_gemm.default
grouped_bias_grad: Any = _ops.grouped_bias_grad.default


def gemm_has_cublaslt() -> bool:
    """True if CUDA GEMMs are available (CUDA backend built with cuBLASLt)."""
    return bool(_ops.gemm_has_cublaslt())


# ---- the rules table ----------------------------------------------------------------------------


_EPILOGUE_FLAGS = ("bias", "gelu", "writes_aux", "reads_aux", "bgrad", "c", "fp8_f32_out",
                   "fp8_out")  # fmt: skip
_LIMITS = ("fp8_k_multiple", "fp8_d_row_bytes", "aux_n_multiple", "block_mn_multiple",
           "block_k_multiple")  # fmt: skip


class _EpilogueInfo(ctypes.Structure):  # fus_gemm_epilogue_info (gemm.h)
    _fields_ = [("name", ctypes.c_char_p)] + [(f, ctypes.c_int) for f in _EPILOGUE_FLAGS]


class _Limits(ctypes.Structure):  # fus_gemm_limits (gemm.h)
    _fields_ = [(f, ctypes.c_int) for f in _LIMITS]


@dataclass(frozen=True)
class GemmEpilogue:
    """One row of the core library's epilogue table (``FUS_GEMM_EPILOGUE_TABLE``, gemm.h)."""

    name: str
    bias: bool  #: reads ``bias`` [N]
    gelu: bool  #: applies the tanh GELU
    writes_aux: bool  #: returns GELU's input as ``aux_out`` [M, N]
    reads_aux: bool  #: multiplies by gelu'(``aux``)
    bgrad: bool  #: returns ``dbias`` [N]
    c: bool  #: accumulates ``c`` (``beta != 0``)
    fp8_f32_out: bool  #: FP8 operands may write a float32 output with it
    fp8_out: bool  #: FP8 operands may write an FP8 output with it


@dataclass(frozen=True)
class GemmRules:
    """What ``fusible.gemm`` / ``gemm_block`` serve, on every backend unless said: read once at
    import from the core library, which checks the same rules (gemm_api.cpp), so nothing in Python
    restates them. Callers (the fusions, ``ops/_compute.py``) choose between a fused epilogue, the
    FP8 GEMM and the dequantized fallback from here.

    - ``epilogues``: the epilogue rows, by name, in ``fus_gemm_epilogue`` order;
    - ``supported``: every ``(a_dtype, b_dtype, out_dtype, epilogue)`` with a kernel for
      per-tensor (or high-precision) operands (``fus_gemm_supported``);
    - ``block_pairs``: the ``(a_block_dim, b_block_dim)`` pairs of blockwise operands with a kernel
      (1: 1x128, 2: 128x128 blocks), ``block_out_dtypes`` their outputs, ``block_epilogues`` their
      epilogues;
    - the size limits (``fus_gemm_limits``): on CUDA, FP8 operands need K a multiple of
      ``fp8_k_multiple`` and output rows of a multiple of ``fp8_d_row_bytes`` bytes, aux epilogues
      N a multiple of ``aux_n_multiple``; blockwise operands need M and N multiples of
      ``block_mn_multiple`` and K of ``block_k_multiple`` (every backend).
    """

    epilogues: dict[str, GemmEpilogue]
    supported: frozenset[tuple[torch.dtype, torch.dtype, torch.dtype, str]]
    block_pairs: frozenset[tuple[int, int]]
    block_out_dtypes: tuple[torch.dtype, ...]
    block_epilogues: tuple[str, ...]
    fp8_k_multiple: int
    fp8_d_row_bytes: int
    aux_n_multiple: int
    block_mn_multiple: int
    block_k_multiple: int


# fus_dtype's values (common.h), in order.


def _gemm_rules(library: str) -> GemmRules:
    """:data:`GEMM_RULES`, read from the core library's C API."""
    lib = ctypes.CDLL(library)
    lib.fus_gemm_epilogue_row.argtypes = [ctypes.c_int]
    lib.fus_gemm_epilogue_row.restype = ctypes.POINTER(_EpilogueInfo)
    lib.fus_gemm_supported.argtypes = [ctypes.c_int] * 6
    lib.fus_gemm_supported.restype = ctypes.c_int
    lib.fus_gemm_get_limits.restype = ctypes.POINTER(_Limits)
    rows: list[GemmEpilogue] = []
    while row := lib.fus_gemm_epilogue_row(len(rows)):
        info = row.contents
        flags = {f: bool(getattr(info, f)) for f in _EPILOGUE_FLAGS}
        rows.append(GemmEpilogue(name=info.name.decode(), **flags))
    codes = range(_FUS_DTYPES.index(torch.uint8))  # the element dtypes (not E8M0, a scale dtype)

    def supported(a: int, b: int, d: int, e: int, sa: int = 0, sb: int = 0) -> bool:
        return bool(lib.fus_gemm_supported(a, b, d, e, sa, sb))

    per_tensor = frozenset(
        (_FUS_DTYPES[a], _FUS_DTYPES[b], _FUS_DTYPES[d], rows[e].name)
        for a, b, d, e in itertools.product(codes, codes, codes, range(len(rows)))
        if supported(a, b, d, e)
    )
    e4m3 = _FUS_DTYPES.index(torch.float8_e4m3fn)
    none = 0
    pairs = frozenset(
        (sa, sb) for sa, sb in itertools.product((1, 2), (1, 2))
        if supported(e4m3, e4m3, 0, none, sa, sb)
    )  # fmt: skip
    sa, sb = min(pairs)
    limits = lib.fus_gemm_get_limits().contents
    return GemmRules(
        epilogues={r.name: r for r in rows},
        supported=per_tensor,
        block_pairs=pairs,
        block_out_dtypes=tuple(
            _FUS_DTYPES[d] for d in codes if supported(e4m3, e4m3, d, none, sa, sb)
        ),
        block_epilogues=tuple(
            r.name for e, r in enumerate(rows) if supported(e4m3, e4m3, 0, e, sa, sb)
        ),
        **{f: getattr(limits, f) for f in _LIMITS},
    )


#: The GEMM's rules (see :class:`GemmRules`).
GEMM_RULES = _gemm_rules(_LIBRARY)
#: The choices of ``epilogue``, in the C enum's order.
GEMM_EPILOGUES = tuple(GEMM_RULES.epilogues)


def gemm_epilogue_supported(
    a_dtype: torch.dtype, b_dtype: torch.dtype, out_dtype: torch.dtype, epilogue: str
) -> bool:
    """Whether ``fusible.gemm`` serves this combination of operand dtypes, output dtype and
    epilogue (on every backend; ``GEMM_RULES.supported``, the rules of gemm.h). Fusions use this
    to choose between an epilogue and separate kernels."""
    return (a_dtype, b_dtype, out_dtype, epilogue) in GEMM_RULES.supported


def gemm_fp8_aligned(k: int, n: int, out_dtype: torch.dtype) -> bool:
    """Whether an FP8 GEMM with K = ``k`` and N = ``n`` writing ``out_dtype`` meets cuBLASLt's
    alignment on CUDA with any epilogue (``GEMM_RULES``' ``fp8_k_multiple``, ``fp8_d_row_bytes``
    and ``aux_n_multiple``); the CPU takes any."""
    r = GEMM_RULES
    return (
        k % r.fp8_k_multiple == 0
        and (n * out_dtype.itemsize) % r.fp8_d_row_bytes == 0
        and n % r.aux_n_multiple == 0
    )


def gemm_bias_fused(fp8: bool, out_dtype: torch.dtype) -> bool:
    """Whether a bias of the output's dtype can be added in the GEMM's epilogue (gemm.h: an FP8
    GEMM with a float32 output takes only a bfloat16 bias, which would round a float32 bias);
    otherwise callers add it after the GEMM."""
    return not (fp8 and out_dtype == torch.float32)


# ---- shapes under fake tensors (see _common) ----------------------------------------------------


def _gemm_dims(
    a: torch.Tensor, b: torch.Tensor, transa: bool, transb: bool
) -> tuple[int, int, int, tuple[int, ...]]:
    """(M, N, K, shape of d). a and b are matrices [prod(shape[:-1]), shape[-1]]."""
    op = "gemm"
    rows_a, cols_a = _matrix_shape(op, a, "a")
    rows_b, cols_b = _matrix_shape(op, b, "b")
    m, k = (cols_a, rows_a) if transa else (rows_a, cols_a)
    kb, n = (cols_b, rows_b) if transb else (rows_b, cols_b)
    if k != kb:
        raise ValueError(
            f"fusible.{op}: arguments 'a' and 'b' disagree on K: op(a) is [{m}, {k}] (a of shape "
            f"{tuple(a.shape)}, transa={transa}) but op(b) is [{kb}, {n}] (b of shape "
            f"{tuple(b.shape)}, transb={transb})"
        )
    d_shape = (m, n) if transa else (*a.shape[:-1], n)
    return m, n, k, d_shape


def _gemm_epilogue_dtype(out_dtype: torch.dtype, bias: torch.Tensor | None) -> torch.dtype:
    """dtype of aux / dbias: the output's, or for an FP8 output the bias's (bf16 without one)."""
    if out_dtype in HIGH_PRECISION_DTYPES:
        return out_dtype
    return bias.dtype if bias is not None else torch.bfloat16


def _gemm_outputs(
    a: torch.Tensor,
    b: torch.Tensor,
    transa: bool,
    transb: bool,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None,
    epilogue: str,
    aux: torch.Tensor | None,
    want_amax: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _, n, _, d_shape = _gemm_dims(a, b, transa, transb)
    dev = a.device
    row = GEMM_RULES.epilogues[epilogue]
    vec = _gemm_epilogue_dtype(out_dtype, bias)
    if row.reads_aux and aux is not None and out_dtype in FP8_DTYPES:
        vec = aux.dtype
    d = torch.empty(d_shape, dtype=out_dtype, device=dev)
    aux_out = _or_nothing(row.writes_aux, d_shape, vec, dev)
    dbias = _or_nothing(row.bgrad, (n,), vec, dev)
    f32 = torch.float32
    amax = torch.empty(1, dtype=f32, device=dev) if want_amax else _nothing(f32, dev)
    return d, aux_out, dbias, amax


@_fake("gemm_block")
def _gemm_block_fake(a, a_scale_inv, a_block_dim, b, b_scale_inv, b_block_dim, out_dtype, c, alpha,
                     beta, bias=None):  # fmt: skip
    _check_devices("gemm_block", a.device, (("a_scale_inv", a_scale_inv), ("b", b),
                                            ("b_scale_inv", b_scale_inv), ("c", c),
                                            ("bias", bias)))  # fmt: skip
    n = math.prod(b.shape[:-1])
    return torch.empty((*a.shape[:-1], n), dtype=out_dtype, device=a.device)


@_fake("gemm")
def _gemm_fake(
    a,
    b,
    transa,
    transb,
    a_scale_inv,
    b_scale_inv,
    out_dtype,
    bias,
    epilogue,
    aux,
    c,
    alpha,
    beta,
    out_scale,
    want_amax,
    fast_accum=False,
):
    if epilogue not in GEMM_RULES.epilogues:
        raise ValueError(
            f"fusible.gemm: argument 'epilogue' must be one of {GEMM_EPILOGUES}, got {epilogue!r}"
        )
    _check_devices("gemm", a.device, (("b", b), ("a_scale_inv", a_scale_inv),
                                      ("b_scale_inv", b_scale_inv), ("bias", bias), ("aux", aux),
                                      ("c", c), ("out_scale", out_scale)))  # fmt: skip
    return _gemm_outputs(a, b, transa, transb, out_dtype, bias, epilogue, aux, want_amax)


@_fake("grouped_gemm")
def _grouped_gemm_fake(
    a,
    b,
    m_splits,
    a_scale_inv,
    b_scale_inv,
    out_dtype,
    bias,
    fast_accum,
    packed_out,
    epilogue="",
    aux=None,
):
    op = "grouped_gemm"
    mats = _group_mats(op, "a", a, m_splits)
    dev = a[0].device
    if len(b) != len(mats):
        raise ValueError(
            f"fusible.{op}: argument 'b' has {len(b)} tensors, expected {len(mats)} (one per "
            "GEMM, as 'a')"
        )
    if out_dtype not in HIGH_PRECISION_DTYPES:
        raise TypeError(
            f"fusible.{op}: argument 'out_dtype' must be float32, float16 or bfloat16, got "
            f"{out_dtype}"
        )
    for name, ts in (("b", b), ("a_scale_inv", a_scale_inv), ("b_scale_inv", b_scale_inv),
                     ("bias", bias)):  # fmt: skip
        for i, t in enumerate(ts or ()):
            _check_same_device(op, f"{name}[{i}]", t, dev)
    if bias is not None and len(bias) != len(mats):
        raise ValueError(
            f"fusible.{op}: argument 'bias' has {len(bias)} tensors, expected {len(mats)} (one "
            "per GEMM)"
        )
    rows = sum(m for m, _ in mats)
    if packed_out:
        outs = [torch.empty((rows, b[0].shape[0]), dtype=out_dtype, device=dev)]
    else:
        outs = [
            torch.empty((m, bi.shape[0]), dtype=out_dtype, device=dev)
            for (m, _), bi in zip(mats, b, strict=True)
        ]
    if epilogue and GEMM_RULES.epilogues[epilogue].writes_aux:
        outs.append(torch.empty((rows, b[0].shape[0]), dtype=out_dtype, device=dev))
    return outs


@_fake("grouped_bias_grad")
def _grouped_bias_grad_fake(dy, m_splits, out_dtype):
    mats = _group_mats("grouped_bias_grad", "dy", [dy], m_splits)
    return torch.empty(len(mats), dy.shape[-1], dtype=out_dtype, device=dy.device)
