"""The kernels: torch operators ``torch.ops.fusible.*``, implemented in C++ (``cpp/bindings/``,
the library ``libfusible_torch.so``) over the core library, one module a family, as in C:
:mod:`.quantize` (per-tensor, MXFP8 and blockwise casts, the grouped cast), :mod:`.recipe`
(scales, delayed-scaling updates), :mod:`.gemm` (the GEMMs and their rules table
:data:`GEMM_RULES`), :mod:`.normalization`, :mod:`.activation`; :mod:`._common` holds what they
share (the library, the dtype constants, the fake kernels' checks and the quantized outputs'
layouts). Every name is re-exported here: callers use ``from fusible import _kernels as K`` and
look up ``K.<name>`` at call time (so a test's ``monkeypatch.setattr(K, name, ...)`` is seen by
every caller); each family's docstring documents its operators.

Every operator validates its arguments (device, dtype, contiguity, shape, choices) and raises
``ValueError`` / ``TypeError`` naming the operator, the argument and what was expected, allocates
its outputs, and calls the C API on the input's device (the current CUDA stream for CUDA tensors).
They are registered for the CPU, CUDA and Meta dispatch keys with one C++ function each, so eager
calls, fake tensors and ``torch.compile`` graphs run the same code, with no Python in between; the
Autograd key raises at backward (fusible's ops call them inside their autograd functions).

Tensors are viewed as matrices: ``x`` of shape ``(..., k)`` is ``[x.numel() // k, k]``.
FP8 data is returned as ``torch.float8_e4m3fn`` / ``torch.float8_e5m2``; E8M0 scales as ``uint8``.
Outputs that were not requested are returned as empty tensors (operators cannot return None).

Grouped operators (MoE experts: ``grouped_quantize_fp8``, ``grouped_gemm``, ``grouped_bias_grad``)
make one operator call for every group, where a loop over per-tensor operators dispatches once per
expert. Groups are a list of tensors (``m_splits`` empty; or, for G > 1 tensors, ``m_splits[g]``
their rows or 0 to skip tensor ``g``: an empty group) or one packed tensor whose rows ``m_splits``
splits into consecutive groups (tokens grouped by expert); every output is its own tensor (no
output aliases another), one per group.

Quantized outputs of the normalization and activation kernels (normalization.h, activation.h):
fp32 math, a fixed reduction order (CPU and CUDA agree bit for bit), and a quantized output that
is the cast of the high-precision result rounded to ``out_dtype`` (or, without one, to the input's
dtype), so it equals quantize_fp8 / quantize_mxfp8 of that output bit for bit. Quantized outputs
come as four tensors plus amax ``(q_data, q_data_t_or_col, q_scale_inv_or_mx_scale, q_col_scale,
amax)``: quant ``"fp8"``: data, data_t [k, rows], scale_inv (1,), empty; ``"mxfp8"``: data, col
data, E8M0 scale [rows, ceil(k/32)], E8M0 col scale [ceil(rows/32), k]; ``"block1d"`` /
``"block2d"`` (blockwise FP8, 1x128 / 128x128 blocks, the cast ``quantize_fp8_block`` makes, with
the trailing ``power_2_scale`` and ``amax_epsilon``): data, data_t [k, rows], scale_inv and
col_scale_inv in the layouts of ``block_scale_shape``; ``"none"``: all empty.
"""

from __future__ import annotations

from fusible._kernels._common import (
    FP8_BLOCK,
    FP8_DTYPES,
    HIGH_PRECISION_DTYPES,
    MXFP8_BLOCK,
    QUANT_MODES,
    SCALING_MODES,
    ScalingMode,
    block_scale_shape,
    has_cuda,
)
from fusible._kernels.activation import ACTIVATIONS, GATED_ACTIVATIONS, act_bwd, act_fwd
from fusible._kernels.gemm import (
    GEMM_EPILOGUES,
    GEMM_RULES,
    GemmEpilogue,
    GemmRules,
    gemm,
    gemm_bias_fused,
    gemm_block,
    gemm_epilogue_supported,
    gemm_fp8_aligned,
    gemm_has_cublaslt,
    grouped_bias_grad,
    grouped_gemm,
)
from fusible._kernels.normalization import NORM_KINDS, norm_bwd, norm_fwd
from fusible._kernels.quantize import (
    compute_amax,
    dequantize_fp8,
    dequantize_fp8_block,
    dequantize_mxfp8,
    fp8_max,
    grouped_quantize_fp8,
    quantize_fp8,
    quantize_fp8_block,
    quantize_fp8_current,
    quantize_mxfp8,
    transpose_fp8,
)
from fusible._kernels.recipe import AMAX_ALGOS, compute_scale, delayed_scaling_update

__all__ = [
    "ACTIVATIONS",
    "AMAX_ALGOS",
    "FP8_BLOCK",
    "FP8_DTYPES",
    "GATED_ACTIVATIONS",
    "GEMM_EPILOGUES",
    "GEMM_RULES",
    "HIGH_PRECISION_DTYPES",
    "MXFP8_BLOCK",
    "NORM_KINDS",
    "QUANT_MODES",
    "SCALING_MODES",
    "GemmEpilogue",
    "GemmRules",
    "ScalingMode",
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
    "gemm_bias_fused",
    "gemm_block",
    "gemm_epilogue_supported",
    "gemm_fp8_aligned",
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
