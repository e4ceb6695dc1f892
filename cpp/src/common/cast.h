// The FP8 casts every family that writes quantized output shares (the quantize family itself, the
// fused normalization and activation kernels), their scales and the FP8 byte transpose: one
// implementation of the rules of fusible/quantize.h for both backends, so a family includes only
// common/ and its own files (docs/architecture.md, "Layering").
//
//  - CPU backend (cast_cpu.cpp): the executable specification. cast_cpu writes every copy of a
//    fus_quantized in any of its four modes; the fused CPU kernels round their results into a
//    matrix and call it, so fused == unfused holds by construction.
//  - CUDA backend (cast.cu): the byte transpose and the scale from an amax. The CUDA casts are
//    device code: block_cast.cuh (blockwise tiles, any value source), fused_epilogue.cuh (the
//    per-tensor and MXFP8 tile epilogue of the fused kernels); the quantize family's own
//    persistent casts stay in quantize/quantize.cu.
#pragma once

#include "fusible/common.h"

namespace fusible {

// The cast of input [rows, cols] into every non-NULL copy of out, by out.mode: per tensor with
// *out.scale (scale_inv = 1 / scale), MXFP8 (OCP rule), blockwise (1x128 / 128x128 blocks with
// out.power_2_scale and out.amax_epsilon). out.amax (optional) receives max |x|. Arguments are
// validated by the caller (check_quantized).
void cast_cpu(const fus_tensor& input, const fus_quantized& out);

// output [cols, rows] = the byte transpose of the FP8 matrix input [rows, cols].
void transpose_fp8_cpu(const fus_tensor& input, const fus_tensor& output);

// output [R, C] (any high-precision dtype, rounded as every CPU store is) = the exact dequantize
// fp32(float(q) * scale_inv) of a blockwise FP8 copy q [R, C] of dtype fp8: 1x128 blocks along the
// rows with scale_inv[(j / 128) * R + i], or 128x128 tiles (two_d) with
// scale_inv[(i / 128) * tile_stride + j / 128] (the quantize layout's stride is ceil(C / 128), the
// GEMM operand's a padded one). Rows are split over the CPU threads.
void dequantize_blocks_cpu(fus_dtype fp8, const void* q, const float* scale_inv, bool two_d,
                           int64_t tile_stride, const fus_tensor& output);

// The per-tensor scale rule (quantize.h) on one amax: scale[0] = compute_scale(amax[0], fp8_max,
// margin, keep_previous ? scale[0] : 1), scale_inv[0] = 1 / scale[0] (scale_inv may be NULL).
void scale_from_amax_cpu(const float* amax, float* scale, float* scale_inv, float fp8_max,
                         int margin, bool keep_previous);

#if defined(FUSIBLE_WITH_CUDA)
void transpose_fp8_cuda(const fus_tensor& input, const fus_tensor& output, const fus_context& ctx);
void scale_from_amax_cuda(const float* amax, float* scale, float* scale_inv, float fp8_max,
                          int margin, bool keep_previous, const fus_context& ctx);
#endif

}  // namespace fusible
