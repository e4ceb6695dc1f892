"""The kernels: torch operators ``torch.ops.fusible.*``, implemented in C++ (``cpp/bindings/``,
the library ``libfusible_torch.so``) over the core library.

Every operator validates its arguments (device, dtype, contiguity, shape, choices) and raises
``ValueError`` / ``TypeError`` naming the operator, the argument and what was expected, allocates
its outputs, and calls the C API on the input's device (the current CUDA stream for CUDA tensors).
They are registered for the CPU, CUDA and Meta dispatch keys with one C++ function each, so eager
calls, fake tensors and ``torch.compile`` graphs run the same code, with no Python in between; the
Autograd key raises at backward (fusible's ops call them inside their autograd functions).

Tensors are viewed as matrices: ``x`` of shape ``(..., k)`` is ``[x.numel() // k, k]``.
FP8 data is returned as ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``; E8M0 scales as ``uint8``.
Outputs that were not requested are returned as empty tensors (operators cannot return None).

Per-tensor FP8
--------------
``quantize_fp8(x, scale, fp8_dtype, rowwise, columnwise) -> (data, data_t, scale_inv, amax)``
    Cast with a given per-tensor ``scale`` (delayed scaling), one pass: ``data`` has ``x``'s shape,
    ``data_t`` is the transposed matrix ``[k, rows]`` (empty unless ``columnwise``),
    ``scale_inv = 1/scale`` and ``amax = max|x|`` are float32 of shape ``(1,)``.
``quantize_fp8_current(x, fp8_dtype, margin, rowwise, columnwise)
-> (data, data_t, scale, scale_inv, amax)``
    Current scaling: amax pass, ``scale = fp8_max / amax / 2**margin``, cast pass.
``dequantize_fp8(data, scale_inv, out_dtype) -> out``
    ``float(data) * scale_inv`` rounded to ``out_dtype``; works for either stored layout.
``transpose_fp8(x) -> out``
    Byte transpose ``[rows, cols] -> [cols, rows]``, bits unchanged: the columnwise copy of a
    per-tensor FP8 tensor from its rowwise copy (the two share one ``scale_inv``).
``compute_amax(x) -> amax``
    ``max|x|`` as float32 of shape ``(1,)`` (NaN if ``x`` holds a NaN).
``compute_scale(amax, fp8_dtype, margin) -> (scale, scale_inv)``
    Per-tensor scale from ``amax`` (scale 1 where amax is 0 or not finite).

MXFP8 (OCP MX, 32-element blocks)
---------------------------------
``quantize_mxfp8(x, fp8_dtype, rowwise, columnwise) -> (data, scale, col_data, col_scale)``
    ``data`` has ``x``'s shape with E8M0 ``scale`` ``[rows, ceil(k/32)]`` (blocks along rows);
    ``col_data`` has ``x``'s shape too, with ``col_scale`` ``[ceil(rows/32), k]`` (blocks down
    columns). Unrequested copies are empty.
``dequantize_mxfp8(data, scale, columnwise, out_dtype) -> out``
    ``columnwise`` says whether ``scale`` runs down columns.

Blockwise FP8 (1x128 / 128x128 blocks, fp32 scales; cpp/include/fusible/quantize.h)
------------------------------------------------------------------------------------
Each copy is a matrix ``[R, C]`` scaled in blocks along its rows (``C`` is its GEMM's K): the
rowwise copy ``data`` (``x``'s shape, ``[rows, k]``) and the columnwise copy ``data_t``
(``[k, rows]``, the transpose). Scales of a copy ``[R, C]``: ``block_dim=1`` (1x128)
``[ceil(C/128), R]`` (R contiguous, cuBLASLt's layout); ``block_dim=2`` (128x128)
``[ceil(R/128), ceil(C/128)]``.

``quantize_fp8_block(x, fp8_dtype, block_dim, power_2_scale, amax_epsilon, rowwise, columnwise)
-> (data, scale_inv, data_t, col_scale_inv)``
    Both copies in one pass; unrequested copies are empty.
``dequantize_fp8_block(data, scale_inv, block_dim, out_dtype) -> out``
    Either copy (its own ``[R, C]`` and scale layout).
``gemm_block(a, a_scale_inv, a_block_dim, b, b_scale_inv, b_block_dim, out_dtype, c, alpha, beta)
-> d``
    ``d[M, N] = alpha * a[M, K] @ b[N, K]^T + beta * c`` (gemm.h: not both 128x128; M, N % 4 == 0,
    K % 16 == 0; output fp32 / fp16 / bf16). CPU: the GEMM of the exactly dequantized operands.

Delayed scaling
---------------
``delayed_scaling_update(amax_histories, scales, fp8_maxes, algo, margin) -> None``
    Updates many states in one launch (cpp/include/fusible/recipe.h), in place:
    ``amax_histories[g]`` float32 ``[history_len, n]``, ``scales[g]`` float32 ``[n]``; ``algo``
    ``"max"`` or ``"most_recent"``.

GEMM (cpp/include/fusible/gemm.h: numerics, epilogues, dtype rules, the FP8 "TN" layout)
---------------------------------------------------------------------------------------
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

Grouped (MoE experts; quantize.h: fus_quantize_grouped, gemm.h: fus_gemm_grouped)
------------------------------------------------------------------------------------
One operator call for every group, where a loop over per-tensor operators dispatches once per
expert. Groups are a list of tensors (``m_splits`` empty; or, for G > 1 tensors, ``m_splits[g]``
their rows or 0 to skip tensor ``g``: an empty group) or one packed tensor whose rows ``m_splits``
splits into consecutive groups (tokens grouped by expert); every output is its own tensor (no
output aliases another), one per group.

``grouped_quantize_fp8(x, m_splits, scales, fp8_dtype, margin, rowwise, columnwise)
-> (data, data_t, scale_inv, amax, scale)``
    Per-tensor FP8 casts of every group, each the bits ``quantize_fp8`` (``scales`` given: float32
    ``[G]``, delayed scaling) or ``quantize_fp8_current`` (``scales`` None, with ``margin``) makes
    for that group: lists ``data`` (the group's shape), ``data_t`` (``[k, rows_g]``) and
    ``scale_inv`` (``(1,)`` each); ``amax`` float32 ``[G]``; ``scale`` ``[G]`` (current scaling;
    empty for delayed). On CUDA a constant number of launches for all groups.
``grouped_gemm(a, b, m_splits, a_scale_inv, b_scale_inv, out_dtype, bias, fast_accum, packed_out)
-> list of d``
    ``d_i = a_i @ b_i^T (+ bias_i)`` for every group (the FP8 "TN" form: ``a_i`` ``[M_i, K_i]``,
    ``b_i`` ``[N_i, K_i]``), each the bits ``gemm`` gives for it as the per-GEMM path calls it.
    ``a``: G tensors or one packed tensor split by ``m_splits``; FP8 operands need
    ``a_scale_inv`` / ``b_scale_inv`` (G one-element tensors, or one ``[G]`` tensor); high
    precision operands have ``out_dtype``. ``bias``: G tensors ``[N_i]`` of ``out_dtype``, in the
    epilogue (an FP8 GEMM with a float32 output adds it afterwards, as ``fusible.gemm`` needs).
    ``packed_out``: one output ``[sum M_i, N]`` (the rows in group order); else one per group.
    A group with ``M_i == 0`` computes nothing; ``K_i == 0`` writes zeros. On CUDA: one cuBLASLt
    call per group on the current stream from one host call, no synchronisation.
``grouped_bias_grad(dy, m_splits, out_dtype) -> list of dbias``
    Per group ``dy_i.sum(0, dtype=torch.float32).to(out_dtype)`` (zeros for an empty group), the
    bits of that torch expression.

Normalization and activations (normalization.h, activation.h)
-------------------------------------------------------------
fp32 math, a fixed reduction order (CPU and CUDA agree bit for bit), and a quantized output that
is the cast of the high-precision result rounded to ``out_dtype`` (or, without one, to the input's
dtype), so it equals quantize_fp8 / quantize_mxfp8 of that output bit for bit. Quantized outputs
come as four tensors plus amax ``(q_data, q_data_t_or_col, q_scale_inv_or_mx_scale, q_col_scale,
amax)``: quant ``"fp8"``: data, data_t [k, rows], scale_inv (1,), empty; ``"mxfp8"``: data, col
data, E8M0 scale [rows, ceil(k/32)], E8M0 col scale [ceil(rows/32), k]; ``"block1d"`` /
``"block2d"`` (blockwise FP8, 1x128 / 128x128 blocks, the cast ``quantize_fp8_block`` makes, with
the trailing ``power_2_scale`` and ``amax_epsilon``): data, data_t [k, rows], scale_inv and
col_scale_inv in the layouts of ``block_scale_shape``; ``"none"``: all empty.

``norm_fwd(x, gamma, beta, eps, kind, zero_centered_gamma, out_dtype, quant, fp8_dtype, scale,
rowwise, columnwise, power_2_scale=True, amax_epsilon=0.0) -> (y, *quantized, amax, mean, rstd)``
    LayerNorm / RMSNorm over the last dimension (``w = 1 + gamma`` if ``zero_centered_gamma``);
    ``y`` empty if ``out_dtype`` is None; ``mean`` empty for RMSNorm.
``norm_bwd(dy, x, mean, rstd, gamma, kind, zero_centered_gamma) -> (dx, dgamma, dbeta)``
``act_fwd(x, kind, out_dtype, quant, fp8_dtype, scale, rowwise, columnwise, power_2_scale=True,
amax_epsilon=0.0) -> (y, *quantized, amax)``
    ``kind`` in :data:`ACTIVATIONS`; the gated kinds read ``x = [a | b]`` and halve the last
    dimension.
``act_bwd(grad, x, kind, out_dtype, quant, fp8_dtype, scale, rowwise, columnwise, with_dbias,
power_2_scale=True, amax_epsilon=0.0) -> (dx, *quantized, amax, dbias)``
    ``dx = grad * act'(x)``; ``dbias`` = column sums of ``dx`` (dtype ``out_dtype`` or
    ``grad.dtype``). For a gated kind, an MXFP8 rowwise copy needs H % 32 == 0.
"""

from __future__ import annotations

import ctypes
import glob
import math
import os
from collections.abc import Sequence
from typing import Any

import torch


def _load_operators() -> tuple[Any, str]:
    here = os.path.dirname(os.path.abspath(__file__))
    found = glob.glob(os.path.join(here, "libfusible_torch*.so"))
    if not found:
        raise ImportError(
            f"fusible: the torch operator library (libfusible_torch.so) is missing from {here}; "
            "build fusible with `bash scripts/setup.sh`"
        )
    if not hasattr(torch.ops.fusible, "gemm"):
        torch.ops.load_library(found[0])
    return torch.ops.fusible, found[0]


_ops, _LIBRARY = _load_operators()


def _activation_table(library: str) -> tuple[tuple[str, ...], frozenset[str]]:
    """The activation kinds in ``fus_activation`` order and the gated ones, read from the core
    library's one table (``FUS_ACTIVATION_TABLE``, activation.h) through its C API."""
    lib = ctypes.CDLL(library)
    lib.fus_activation_name.argtypes = [ctypes.c_int]
    lib.fus_activation_name.restype = ctypes.c_char_p
    lib.fus_activation_is_gated.argtypes = [ctypes.c_int]
    lib.fus_activation_is_gated.restype = ctypes.c_int
    kinds: list[str] = []
    while (name := lib.fus_activation_name(len(kinds))) is not None:
        kinds.append(name.decode())
    gated = frozenset(k for i, k in enumerate(kinds) if lib.fus_activation_is_gated(i))
    return tuple(kinds), gated


__all__ = [
    "ACTIVATIONS",
    "FP8_BLOCK",
    "FP8_DTYPES",
    "GATED_ACTIVATIONS",
    "GEMM_EPILOGUES",
    "HIGH_PRECISION_DTYPES",
    "MXFP8_BLOCK",
    "NORM_KINDS",
    "QUANT_MODES",
    "act_bwd",
    "act_fwd",
    "block_scale_shape",
    "compute_amax",
    "compute_scale",
    "delayed_scaling_update",
    "dequantize_fp8",
    "dequantize_fp8_block",
    "dequantize_mxfp8",
    "fp8_max",
    "gemm",
    "gemm_block",
    "gemm_epilogue_supported",
    "gemm_has_cublaslt",
    "grouped_bias_grad",
    "grouped_gemm",
    "grouped_quantize_fp8",
    "has_cuda",
    "norm_bwd",
    "norm_fwd",
    "quantize_fp8",
    "quantize_fp8_block",
    "quantize_fp8_current",
    "quantize_mxfp8",
    "transpose_fp8",
]

MXFP8_BLOCK = 32
FP8_BLOCK = 128  # blockwise FP8 block edge
HIGH_PRECISION_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}

# The operators (OpOverloads: what eager code, dynamo and the fake-tensor machinery all call).
quantize_fp8: Any = _ops.quantize_fp8.default
quantize_fp8_current: Any = _ops.quantize_fp8_current.default
dequantize_fp8: Any = _ops.dequantize_fp8.default
transpose_fp8: Any = _ops.transpose_fp8.default
compute_amax: Any = _ops.compute_amax.default
compute_scale: Any = _ops.compute_scale.default
quantize_mxfp8: Any = _ops.quantize_mxfp8.default
dequantize_mxfp8: Any = _ops.dequantize_mxfp8.default
quantize_fp8_block: Any = _ops.quantize_fp8_block.default
dequantize_fp8_block: Any = _ops.dequantize_fp8_block.default
gemm_block: Any = _ops.gemm_block.default
delayed_scaling_update: Any = _ops.delayed_scaling_update.default
gemm: Any = _ops.gemm.default
norm_fwd: Any = _ops.norm_fwd.default
norm_bwd: Any = _ops.norm_bwd.default
act_fwd: Any = _ops.act_fwd.default
act_bwd: Any = _ops.act_bwd.default
grouped_quantize_fp8: Any = _ops.grouped_quantize_fp8.default
grouped_gemm: Any = _ops.grouped_gemm.default
grouped_bias_grad: Any = _ops.grouped_bias_grad.default

# Choices of the string arguments, in the C enums' order (cpp/bindings/ops_<family>.cpp reads them
# from the same lists there).
GEMM_EPILOGUES = (
    "none",
    "bias",
    "gelu",
    "gelu_aux",
    "bias_gelu",
    "bias_gelu_aux",
    "dgelu",
    "dgelu_bgrad",
)
NORM_KINDS = ("layernorm", "rmsnorm")
# The activation kinds (the torch operators' ``kind``) and the gated ones ([a | b] -> H columns).
ACTIVATIONS, GATED_ACTIVATIONS = _activation_table(_LIBRARY)
QUANT_MODES = ("none", "fp8", "mxfp8", "block1d", "block2d")
_GEMM_READS_AUX = frozenset({"dgelu", "dgelu_bgrad"})
_GEMM_DTYPES = HIGH_PRECISION_DTYPES + FP8_DTYPES

_HAS_CUDA = bool(_ops.has_cuda())


def has_cuda() -> bool:
    """True if the core library was built with its CUDA backend."""
    return _HAS_CUDA


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype."""
    if dtype not in _FP8_MAX:
        raise TypeError(f"fp8_max: expected one of {FP8_DTYPES}, got {dtype}")
    return _FP8_MAX[dtype]


def gemm_has_cublaslt() -> bool:
    """True if CUDA GEMMs are available (CUDA backend built with cuBLASLt)."""
    return bool(_ops.gemm_has_cublaslt())


def gemm_epilogue_supported(
    a_dtype: torch.dtype, b_dtype: torch.dtype, out_dtype: torch.dtype, epilogue: str
) -> bool:
    """Whether ``fusible.gemm`` serves this combination of operand dtypes, output dtype and
    epilogue (on every backend; see gemm.h). High-precision GEMMs (``a_dtype == b_dtype``, output
    ``a_dtype`` or float32) support every epilogue. FP8 GEMMs have no kernel for: E5M2 x E5M2; an
    E5M2 output from E4M3 x E4M3; a float32 output with ``bias_gelu_aux`` / ``dgelu_bgrad``; an FP8
    output with ``dgelu`` / ``dgelu_bgrad``. Fusions use this to choose between an epilogue and
    separate kernels."""
    if epilogue not in GEMM_EPILOGUES:
        return False
    if a_dtype in HIGH_PRECISION_DTYPES:
        return b_dtype == a_dtype and out_dtype in (a_dtype, torch.float32)
    if a_dtype not in FP8_DTYPES or b_dtype not in FP8_DTYPES or out_dtype not in _GEMM_DTYPES:
        return False
    e5m2 = torch.float8_e5m2
    if a_dtype == e5m2 and b_dtype == e5m2:
        return False
    if out_dtype == e5m2 and e5m2 not in (a_dtype, b_dtype):
        return False
    if out_dtype == torch.float32 and epilogue in ("bias_gelu_aux", "dgelu_bgrad"):
        return False
    return not (out_dtype in FP8_DTYPES and epilogue in _GEMM_READS_AUX)


# ---- shapes under fake tensors ------------------------------------------------------------------
# torch.compile, FakeTensorMode and meta tensors run these (registered with torch.library's
# register_fake, which works with symbolic shapes): the outputs' shapes, dtypes and devices of each
# operator, plus the device checks that a mix of meta and real tensors needs. The C++ operators
# allocate the same outputs; torch.library.opcheck (tests/python/test_kernels_*.py) checks that the
# two agree.


def _fake(name: str) -> Any:
    return torch.library.register_fake(f"fusible::{name}")


def _nothing(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=dtype, device=device)


def _check_choice(op: str, name: str, value: str, choices: Sequence[str]) -> None:
    if value not in choices:
        raise ValueError(f"fusible.{op}: argument '{name}' must be one of {choices}, got {value!r}")


_GEMM_EPILOGUE_CODE = {name: code for code, name in enumerate(GEMM_EPILOGUES)}
_GEMM_WRITES_AUX = frozenset({"gelu_aux", "bias_gelu_aux"})


def _matrix_shape(op: str, x: torch.Tensor, name: str = "x") -> tuple[int, int]:
    if x.dim() == 0:
        raise ValueError(
            f"fusible.{op}: argument '{name}' must have at least one dimension, got a scalar"
        )
    return math.prod(x.shape[:-1]), x.shape[-1]


def _check_same_device(op: str, name: str, t: torch.Tensor, device: torch.device) -> None:
    # Also called by the fake kernels: a mix of meta and real tensors dispatches to them, and they
    # must not hand back uninitialised real tensors.
    if t.device != device:
        raise ValueError(
            f"fusible.{op}: argument '{name}' is on {t.device}, expected the input's device "
            f"{device}"
        )


def _ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def _fp8_outputs(
    op: str, x: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool, columnwise: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = _matrix_shape(op, x)
    data = torch.empty(x.shape, dtype=fp8_dtype, device=x.device) if rowwise else None
    data_t = torch.empty((cols, rows), dtype=fp8_dtype, device=x.device) if columnwise else None
    e = _nothing(fp8_dtype, x.device)
    return (data if data is not None else e), (data_t if data_t is not None else e)


def _transpose_shape(op: str, x: torch.Tensor) -> tuple[int, int]:
    if x.dim() != 2:
        raise ValueError(
            f"fusible.{op}: argument 'x' must be a 2-D matrix [rows, cols], got shape "
            f"{tuple(x.shape)}"
        )
    return x.shape[0], x.shape[1]


def _mx_outputs(
    x: torch.Tensor, fp8_dtype: torch.dtype, rowwise: bool, columnwise: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    rows, cols = _matrix_shape("quantize_mxfp8", x)
    dev = x.device
    e8 = _nothing(fp8_dtype, dev)
    e0 = _nothing(torch.uint8, dev)
    data = torch.empty(x.shape, dtype=fp8_dtype, device=dev) if rowwise else e8
    scale = (
        torch.empty((rows, _ceil_div(cols, MXFP8_BLOCK)), dtype=torch.uint8, device=dev)
        if rowwise
        else e0
    )
    col = (
        torch.empty(x.shape, dtype=fp8_dtype, device=dev)
        if columnwise
        else _nothing(fp8_dtype, dev)
    )
    col_scale = (
        torch.empty((_ceil_div(rows, MXFP8_BLOCK), cols), dtype=torch.uint8, device=dev)
        if columnwise
        else _nothing(torch.uint8, dev)
    )
    return data, scale, col, col_scale


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
    dims: tuple[int, int, int, tuple[int, ...]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    _, n, _, d_shape = dims if dims is not None else _gemm_dims(a, b, transa, transb)
    dev = a.device
    vec = _gemm_epilogue_dtype(out_dtype, bias)
    if epilogue in _GEMM_READS_AUX and aux is not None and out_dtype in FP8_DTYPES:
        vec = aux.dtype
    d = torch.empty(d_shape, dtype=out_dtype, device=dev)
    aux_out = (
        torch.empty(d_shape, dtype=vec, device=dev)
        if epilogue in _GEMM_WRITES_AUX
        else _nothing(vec, dev)
    )
    dbias = (
        torch.empty(n, dtype=vec, device=dev) if epilogue == "dgelu_bgrad" else _nothing(vec, dev)
    )
    f32 = torch.float32
    amax = torch.empty(1, dtype=f32, device=dev) if want_amax else _nothing(f32, dev)
    return d, aux_out, dbias, amax


def _quant_outputs(
    shape: Sequence[int],
    device: torch.device,
    quant: str,
    fp8_dtype: torch.dtype,
    rowwise: bool,
    columnwise: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(data, data_t_or_col, scale_inv_or_mx_scale, col_scale, amax) for an output of `shape`."""
    shape = tuple(shape)
    rows = math.prod(shape[:-1]) if len(shape) else 1
    cols = shape[-1] if len(shape) else 1
    u8 = torch.uint8
    if quant == "none":
        e = _nothing(u8, device)
        f = _nothing(torch.float32, device)
        return e, _nothing(u8, device), f, _nothing(u8, device), _nothing(torch.float32, device)
    e8 = _nothing(fp8_dtype, device)
    e0 = _nothing(u8, device)
    amax = torch.empty(1, dtype=torch.float32, device=device)
    data = torch.empty(shape, dtype=fp8_dtype, device=device) if rowwise else e8
    if quant in ("block1d", "block2d"):
        bd = 1 if quant == "block1d" else 2
        data, s, data_t, cs = _block_outputs(shape, device, fp8_dtype, bd, rowwise, columnwise)
        return data, data_t, s, cs, amax
    if quant == "fp8":
        data_t = (
            torch.empty((cols, rows), dtype=fp8_dtype, device=device)
            if columnwise
            else _nothing(fp8_dtype, device)
        )
        return data, data_t, torch.empty(1, dtype=torch.float32, device=device), e0, amax
    col = (
        torch.empty(shape, dtype=fp8_dtype, device=device)
        if columnwise
        else _nothing(fp8_dtype, device)
    )
    s = (
        torch.empty((rows, _ceil_div(cols, MXFP8_BLOCK)), dtype=u8, device=device)
        if rowwise
        else e0
    )
    cs = (
        torch.empty((_ceil_div(rows, MXFP8_BLOCK), cols), dtype=u8, device=device)
        if columnwise
        else _nothing(u8, device)
    )
    return data, col, s, cs, amax


def _norm_fwd_outputs(
    x: torch.Tensor,
    kind: str,
    out_dtype: torch.dtype | None,
    quant: str,
    fp8_dtype: torch.dtype,
    rowwise: bool,
    columnwise: bool,
) -> tuple[torch.Tensor, ...]:
    rows = math.prod(x.shape[:-1])
    dev = x.device
    y = (
        torch.empty(x.shape, dtype=out_dtype, device=dev)
        if out_dtype is not None
        else _nothing(x.dtype, dev)
    )
    q = _quant_outputs(x.shape, dev, quant, fp8_dtype, rowwise, columnwise)
    mean = torch.empty(rows if kind == "layernorm" else 0, dtype=torch.float32, device=dev)
    rstd = torch.empty(rows, dtype=torch.float32, device=dev)
    return (y, *q, mean, rstd)


def _norm_bwd_outputs(
    dy: torch.Tensor, gamma: torch.Tensor, kind: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx = torch.empty(dy.shape, dtype=dy.dtype, device=dy.device)
    dgamma = torch.empty(gamma.shape, dtype=gamma.dtype, device=dy.device)
    dbeta = torch.empty(
        gamma.shape if kind == "layernorm" else (0,), dtype=gamma.dtype, device=dy.device
    )
    return dx, dgamma, dbeta


def _act_out_shape(op: str, x: torch.Tensor, kind: str) -> tuple[int, ...]:
    """Forward output shape: x's, with the last dimension halved for the gated kinds."""
    if x.dim() == 0:
        raise ValueError(f"fusible.{op}: argument 'x' must have at least one dimension")
    k = x.shape[-1]
    if kind in GATED_ACTIVATIONS:
        if k % 2 or k == 0:
            raise ValueError(
                f"fusible.{op}: argument 'x' must have an even, non-zero last dimension for "
                f"kind={kind!r} ([a | b] = 2H), got {k}"
            )
        return (*x.shape[:-1], k // 2)
    return tuple(x.shape)


def _act_fwd_outputs(
    x: torch.Tensor,
    kind: str,
    out_dtype: torch.dtype | None,
    quant: str,
    fp8_dtype: torch.dtype,
    rowwise: bool,
    columnwise: bool,
) -> tuple[torch.Tensor, ...]:
    shape = _act_out_shape("act_fwd", x, kind)
    y = (
        torch.empty(shape, dtype=out_dtype, device=x.device)
        if out_dtype is not None
        else _nothing(x.dtype, x.device)
    )
    return (y, *_quant_outputs(shape, x.device, quant, fp8_dtype, rowwise, columnwise))


def _act_bwd_outputs(
    grad: torch.Tensor,
    x: torch.Tensor,
    out_dtype: torch.dtype | None,
    quant: str,
    fp8_dtype: torch.dtype,
    rowwise: bool,
    columnwise: bool,
    with_dbias: bool,
) -> tuple[torch.Tensor, ...]:
    dev = x.device
    dt = out_dtype if out_dtype is not None else grad.dtype
    dx = (
        torch.empty(x.shape, dtype=out_dtype, device=dev)
        if out_dtype is not None
        else _nothing(grad.dtype, dev)
    )
    q = _quant_outputs(x.shape, dev, quant, fp8_dtype, rowwise, columnwise)
    dbias = torch.empty(x.shape[-1] if with_dbias else 0, dtype=dt, device=dev)
    return (dx, *q, dbias)


@_fake("quantize_fp8")
def _quantize_fp8_fake(x, scale, fp8_dtype, rowwise, columnwise):
    _check_same_device("quantize_fp8", "scale", scale, x.device)
    data, data_t = _fp8_outputs("quantize_fp8", x, fp8_dtype, rowwise, columnwise)
    return data, data_t, scale.new_empty(1), scale.new_empty(1)


@_fake("quantize_fp8_current")
def _quantize_fp8_current_fake(x, fp8_dtype, margin, rowwise, columnwise):
    data, data_t = _fp8_outputs("quantize_fp8_current", x, fp8_dtype, rowwise, columnwise)
    one = torch.empty(1, dtype=torch.float32, device=x.device)
    return data, data_t, one, one.clone(), one.clone()


@_fake("dequantize_fp8")
def _dequantize_fp8_fake(data, scale_inv, out_dtype):
    _check_same_device("dequantize_fp8", "scale_inv", scale_inv, data.device)
    return torch.empty(data.shape, dtype=out_dtype, device=data.device)


@_fake("transpose_fp8")
def _transpose_fp8_fake(x):
    rows, cols = _transpose_shape("transpose_fp8", x)
    return x.new_empty((cols, rows))


@_fake("compute_amax")
def _compute_amax_fake(x):
    return torch.empty(1, dtype=torch.float32, device=x.device)


@_fake("compute_scale")
def _compute_scale_fake(amax, fp8_dtype, margin):
    return amax.new_empty(1), amax.new_empty(1)


@_fake("quantize_mxfp8")
def _quantize_mxfp8_fake(x, fp8_dtype, rowwise, columnwise):
    return _mx_outputs(x, fp8_dtype, rowwise, columnwise)


@_fake("dequantize_mxfp8")
def _dequantize_mxfp8_fake(data, scale, columnwise, out_dtype):
    _check_same_device("dequantize_mxfp8", "scale", scale, data.device)
    return torch.empty(data.shape, dtype=out_dtype, device=data.device)


def block_scale_shape(block_dim: int, r: int, c: int) -> tuple[int, int]:
    """Shape of the scale_inv matrix of a blockwise copy ``[r, c]`` (see above)."""
    if block_dim == 1:
        return (_ceil_div(c, FP8_BLOCK), r)
    return (_ceil_div(r, FP8_BLOCK), _ceil_div(c, FP8_BLOCK))


def _block_outputs(
    shape: Sequence[int],
    dev: torch.device,
    fp8_dtype: torch.dtype,
    block_dim: int,
    rowwise: bool,
    columnwise: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(data, scale_inv, data_t, col_scale_inv) of a blockwise cast of a tensor of ``shape``."""
    shape = tuple(shape)
    rows, cols = math.prod(shape[:-1]), shape[-1]
    f32 = torch.float32
    e8 = _nothing(fp8_dtype, dev)
    data = torch.empty(shape, dtype=fp8_dtype, device=dev) if rowwise else e8
    scale = (
        torch.empty(block_scale_shape(block_dim, rows, cols), dtype=f32, device=dev)
        if rowwise
        else _nothing(f32, dev)
    )
    data_t = (
        torch.empty((cols, rows), dtype=fp8_dtype, device=dev)
        if columnwise
        else _nothing(fp8_dtype, dev)
    )
    col_scale = (
        torch.empty(block_scale_shape(block_dim, cols, rows), dtype=f32, device=dev)
        if columnwise
        else _nothing(f32, dev)
    )
    return data, scale, data_t, col_scale


@_fake("quantize_fp8_block")
def _quantize_fp8_block_fake(x, fp8_dtype, block_dim, power_2_scale, amax_epsilon, rowwise,
                             columnwise):  # fmt: skip
    _matrix_shape("quantize_fp8_block", x)
    return _block_outputs(x.shape, x.device, fp8_dtype, block_dim, rowwise, columnwise)


@_fake("dequantize_fp8_block")
def _dequantize_fp8_block_fake(data, scale_inv, block_dim, out_dtype):
    _check_same_device("dequantize_fp8_block", "scale_inv", scale_inv, data.device)
    return torch.empty(data.shape, dtype=out_dtype, device=data.device)


@_fake("gemm_block")
def _gemm_block_fake(a, a_scale_inv, a_block_dim, b, b_scale_inv, b_block_dim, out_dtype, c, alpha,
                     beta):  # fmt: skip
    for name, t in (("a_scale_inv", a_scale_inv), ("b", b), ("b_scale_inv", b_scale_inv), ("c", c)):
        if t is not None:
            _check_same_device("gemm_block", name, t, a.device)
    n = math.prod(b.shape[:-1])
    return torch.empty((*a.shape[:-1], n), dtype=out_dtype, device=a.device)


@_fake("delayed_scaling_update")
def _delayed_scaling_update_fake(amax_histories, scales, fp8_maxes, algo, margin):
    for g, (h, s) in enumerate(zip(amax_histories, scales, strict=False)):
        _check_same_device(
            "delayed_scaling_update", f"amax_histories[{g}]", h, amax_histories[0].device
        )
        _check_same_device("delayed_scaling_update", f"scales[{g}]", s, amax_histories[0].device)
    return None


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
    if epilogue not in _GEMM_EPILOGUE_CODE:
        raise ValueError(
            f"fusible.gemm: argument 'epilogue' must be one of {GEMM_EPILOGUES}, got {epilogue!r}"
        )
    for name, t in (
        ("b", b),
        ("a_scale_inv", a_scale_inv),
        ("b_scale_inv", b_scale_inv),
        ("bias", bias),
        ("aux", aux),
        ("c", c),
        ("out_scale", out_scale),
    ):
        if t is not None:
            _check_same_device("gemm", name, t, a.device)
    return _gemm_outputs(a, b, transa, transb, out_dtype, bias, epilogue, aux, want_amax)


@_fake("norm_fwd")
def _norm_fwd_fake(
    x,
    gamma,
    beta,
    eps,
    kind,
    zero_centered_gamma,
    out_dtype,
    quant,
    fp8_dtype,
    scale,
    rowwise,
    columnwise,
    power_2_scale=True,
    amax_epsilon=0.0,
):
    for name, t in (("gamma", gamma), ("beta", beta), ("scale", scale)):
        if t is not None:
            _check_same_device("norm_fwd", name, t, x.device)
    _check_choice("norm_fwd", "kind", kind, NORM_KINDS)
    _check_choice("norm_fwd", "quant", quant, QUANT_MODES)
    return _norm_fwd_outputs(x, kind, out_dtype, quant, fp8_dtype, rowwise, columnwise)


@_fake("norm_bwd")
def _norm_bwd_fake(dy, x, mean, rstd, gamma, kind, zero_centered_gamma):
    for name, t in (("x", x), ("mean", mean), ("rstd", rstd), ("gamma", gamma)):
        _check_same_device("norm_bwd", name, t, dy.device)
    _check_choice("norm_bwd", "kind", kind, NORM_KINDS)
    return _norm_bwd_outputs(dy, gamma, kind)


@_fake("act_fwd")
def _act_fwd_fake(x, kind, out_dtype, quant, fp8_dtype, scale, rowwise, columnwise,
                  power_2_scale=True, amax_epsilon=0.0):  # fmt: skip
    if scale is not None:
        _check_same_device("act_fwd", "scale", scale, x.device)
    _check_choice("act_fwd", "kind", kind, ACTIVATIONS)
    _check_choice("act_fwd", "quant", quant, QUANT_MODES)
    return _act_fwd_outputs(x, kind, out_dtype, quant, fp8_dtype, rowwise, columnwise)


@_fake("act_bwd")
def _act_bwd_fake(
    grad, x, kind, out_dtype, quant, fp8_dtype, scale, rowwise, columnwise, with_dbias,
    power_2_scale=True, amax_epsilon=0.0,
):  # fmt: skip
    for name, t in (("x", x), ("scale", scale)):
        if t is not None:
            _check_same_device("act_bwd", name, t, grad.device)
    _check_choice("act_bwd", "kind", kind, ACTIVATIONS)
    _check_choice("act_bwd", "quant", quant, QUANT_MODES)
    return _act_bwd_outputs(grad, x, out_dtype, quant, fp8_dtype, rowwise, columnwise, with_dbias)


# ---- grouped operators --------------------------------------------------------------------------


def _group_mats(
    op: str, name: str, x: Sequence[torch.Tensor], m_splits: Sequence[Any]
) -> list[tuple[Any, Any]]:
    """(rows, cols) of each group of ``x`` (see ``grouped_quantize_fp8``), with the C++ checks a
    fake tensor can make: counts, devices, dtypes, the packed rows."""
    if len(x) == 0:
        raise ValueError(f"fusible.{op}: argument '{name}' must hold at least one tensor, got none")
    dev = x[0].device
    if len(m_splits) == 0 or (len(x) > 1 and len(x) == len(m_splits)):
        out = []
        for i, t in enumerate(x):
            _check_same_device(op, f"{name}[{i}]", t, dev)
            if t.dtype != x[0].dtype:
                raise TypeError(
                    f"fusible.{op}: argument '{name}[{i}]' has dtype {t.dtype}, expected "
                    f"{name}[0]'s {x[0].dtype} (one dtype per group)"
                )
            rows, cols = _matrix_shape(op, t, f"{name}[{i}]")
            out.append((rows, cols) if len(m_splits) == 0 or m_splits[i] else (0, cols))
        return out
    if len(x) != 1:
        raise ValueError(
            f"fusible.{op}: argument '{name}' must be one packed tensor when m_splits is given "
            f"({len(m_splits)} groups), got {len(x)} tensors"
        )
    rows, cols = _matrix_shape(op, x[0], f"{name}[0]")
    torch._check(
        sum(m_splits) == rows,
        lambda: f"fusible.{op}: argument 'm_splits' must sum to the rows of {name}[0] ({rows})",
    )
    return [(m, cols) for m in m_splits]


@_fake("grouped_quantize_fp8")
def _grouped_quantize_fp8_fake(x, m_splits, scales, fp8_dtype, margin, rowwise, columnwise):
    op = "grouped_quantize_fp8"
    mats = _group_mats(op, "x", x, m_splits)
    dev = x[0].device
    if scales is not None:
        _check_same_device(op, "scales", scales, dev)
    if fp8_dtype not in FP8_DTYPES:
        raise TypeError(
            f"fusible.{op}: argument 'fp8_dtype' must be torch.float8_e4m3fn or "
            f"torch.float8_e5m2, got {fp8_dtype}"
        )
    if not (rowwise or columnwise):
        raise ValueError(f"fusible.{op}: at least one of 'rowwise' and 'columnwise' must be True")
    g = len(mats)
    data, data_t, scale_inv = [], [], []
    for i, (rows, cols) in enumerate(mats):
        listed = len(m_splits) == 0 or len(x) > 1
        shape = tuple(x[i].shape) if listed and rows == _matrix_shape(op, x[i])[0] else (rows, cols)
        data.append(torch.empty(shape, dtype=fp8_dtype, device=dev) if rowwise else
                    _nothing(fp8_dtype, dev))  # fmt: skip
        data_t.append(torch.empty((cols, rows), dtype=fp8_dtype, device=dev) if columnwise else
                      _nothing(fp8_dtype, dev))  # fmt: skip
        scale_inv.append(torch.empty(1, dtype=torch.float32, device=dev))
    f32 = torch.float32
    amax = torch.empty(g, dtype=f32, device=dev)
    scale = torch.empty(g if scales is None else 0, dtype=f32, device=dev)
    return data, data_t, scale_inv, amax, scale


@_fake("grouped_gemm")
def _grouped_gemm_fake(
    a, b, m_splits, a_scale_inv, b_scale_inv, out_dtype, bias, fast_accum, packed_out
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
    if packed_out:
        rows = sum(m for m, _ in mats)
        return [torch.empty((rows, b[0].shape[0]), dtype=out_dtype, device=dev)]
    return [
        torch.empty((m, bi.shape[0]), dtype=out_dtype, device=dev)
        for (m, _), bi in zip(mats, b, strict=True)
    ]


@_fake("grouped_bias_grad")
def _grouped_bias_grad_fake(dy, m_splits, out_dtype):
    mats = _group_mats("grouped_bias_grad", "dy", [dy], m_splits)
    return [torch.empty(dy.shape[-1], dtype=out_dtype, device=dy.device) for _ in mats]
