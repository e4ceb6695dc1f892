/*
 * fusible core library: the quantize family.
 *
 * Numerics (identical on every backend; the CPU backend is the specification):
 *  - FP8 cast: y = fp8(float(x) * scale), rounded to nearest even, saturated to the finite range
 *    (+-448 for E4M3, +-57344 for E5M2; inf saturates too); NaN becomes NaN with x's sign bit
 *    (0x7F | sign), the bits torch.Tensor.to(torch.float8_*) gives for NaN.
 *  - NaN rule of every scaled product (casts and dequantize): a NaN operand x keeps its sign; any
 *    other NaN product (NaN scale, inf * 0) is +NaN. (common/numerics.h: scale_element.)
 *  - amax = max |x| over the whole input, NaN if any element is NaN.
 *  - Per-tensor scale from amax (current scaling and delayed scaling alike):
 *      amax finite and > 0:  scale = ldexp(fp8_max / amax, -margin)   (FLT_MAX if that overflows)
 *      otherwise:            scale = fallback (1 for current scaling; the previous scale for
 *                            delayed scaling), so no inf/NaN scale is ever produced.
 *    scale_inv = 1 / scale.
 *  - MXFP8 (OCP MX v1.0, section 6.3): for each block of 32 elements, with amax_b = max |x| over the
 *    block, the shared exponent is e = floor(log2(amax_b)) - emax_elem (emax_elem = 8 for E4M3,
 *    15 for E5M2), stored as the E8M0 byte clamp(e + 127, 0, 254). Elements are fp8(x * 2^-e) with
 *    the saturating cast above. amax_b == 0 gives byte 0 (2^-127); a block holding NaN or inf gets
 *    the NaN byte 0xFF (the whole block then dequantizes to NaN); in such a block a NaN
 *    element is stored as 0x7F | sign(x) and every other element as 0x7F. A partial block at the end of a
 *    row or column (size not divisible by 32) is scaled over the elements that exist.
 *  - Blockwise FP8 (FUS_SCALING_BLOCK_1D: 1x128 blocks; FUS_SCALING_BLOCK_2D: 128x128 blocks; the
 *    DeepSeek-V3 recipe, layouts in common.h): each block b gets its own fp32 scale from its amax
 *    amax_b = max |x| over the block:
 *      m = max(amax_b, amax_epsilon)          (a NaN amax_b stays NaN)
 *      scale_b = per-tensor rule on m with margin 0 and fallback 1 (m = 0, inf or NaN: 1)
 *      power_2_scale: scale_b = 2^floor(log2(scale_b)) (mantissa bits cleared)
 *      scale_inv_b = 1 / scale_b;  q = fp8(scale_element(x, scale_b))  (the saturating cast)
 *    The rowwise copy scales 1x128 blocks along each row of x ([rows, cols]); the columnwise copy is
 *    x transposed ([cols, rows]) with 1x128 blocks along *its* rows, i.e. 128 consecutive rows of
 *    one column of x. 2D: 128x128 tiles of x; both copies share the tile scales (the columnwise
 *    copy is the byte transpose of the rowwise one, its scales the transposed scale matrix).
 *    Partial blocks at the right and bottom edges (cols or rows not divisible by 128) are scaled
 *    over the elements that exist; the scale matrices have ceil(n/128) entries along those edges.
 *    Both copies come from one call (one kernel on CUDA). power_2_scale and amax_epsilon are
 *    fields of the fus_quantized (common.h); the fused normalization and activation kernels
 *    write blockwise output by the same rule (the same bits as this cast of their output).
 *  - Dequantize: x' = fp32(float(q) * scale_inv) (per tensor and blockwise) or float(q) * 2^(s - 127) (MXFP8),
 *    the product rounded to fp32 first and then to the output dtype (RNE); for fp16/bf16 outputs
 *    that is two roundings, deliberately: it is what a GEMM consuming fp32-dequantized operands
 *    sees. (MXFP8 products are exact in fp32, so there it is one rounding.)
 *
 * Inputs are fp32, fp16 or bf16 matrices (see common.h). All functions accept rows*cols == 0.
 */
#ifndef FUSIBLE_QUANTIZE_H_
#define FUSIBLE_QUANTIZE_H_

#include "fusible/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * Cast input [rows, cols] into out, using the scale already in out->scale (per tensor), the OCP
 * rule (MXFP8) or the blockwise rule with out->power_2_scale and out->amax_epsilon (blockwise).
 * Writes every non-NULL copy of out and its scale_inv, and out->amax if non-NULL. One pass over
 * the input. out->rows/cols must equal input's.
 */
fus_status fus_quantize(const fus_tensor* input, fus_quantized* out, const fus_context* ctx);

/*
 * Blockwise FP8 cast (out->mode FUS_SCALING_BLOCK_1D or FUS_SCALING_BLOCK_2D): fus_quantize of a
 * copy of *out whose power_2_scale (0 or 1) and amax_epsilon (finite, >= 0) are the arguments (the
 * fields of *out are not read). Writes every non-NULL copy of out with its scale_inv matrix
 * (layouts in common.h), and out->amax (max |x|) if non-NULL.
 */
fus_status fus_quantize_blockwise(const fus_tensor* input, fus_quantized* out, int power_2_scale,
                                  float amax_epsilon, const fus_context* ctx);

/* amax[0] = max |x| over input (NaN if any NaN). */
fus_status fus_compute_amax(const fus_tensor* input, float* amax, const fus_context* ctx);

/*
 * Current scaling, per tensor: amax pass, scale = f(amax) (fallback 1), cast pass. Writes out->amax
 * (required), out->scale (required), scale_inv and the requested copies. Two passes over the input.
 */
fus_status fus_quantize_current_scaling(const fus_tensor* input, fus_quantized* out, int margin,
                                        const fus_context* ctx);

/*
 * Grouped per-tensor FP8 cast: count independent casts, inputs[g] -> outs[g], each with the
 * numerics (and so the bits) of the per-tensor call it stands for, in one call (on CUDA a constant
 * number of launches for the whole group, not one per tensor: an amax reset, for current scaling
 * an amax pass over every tensor, and one cast kernel whose blocks each take one tensor's tiles).
 *  - current_scaling == 0 (delayed scaling): as fus_quantize for each g: outs[g].scale given
 *    (float[1]), scale_inv written, outs[g].amax written when non-NULL.
 *  - current_scaling != 0: as fus_quantize_current_scaling(inputs + g, outs + g, margin) for each
 *    g: outs[g].amax and outs[g].scale required (written), then the cast.
 * Every outs[g] must have mode FUS_SCALING_PER_TENSOR; the inputs share one dtype and the outputs
 * one FP8 dtype; each output's copies (rowwise and/or columnwise) are its own. Empty
 * tensors (rows * cols == 0, e.g. an expert that got no tokens) are allowed: amax 0 and
 * scale_inv = 1 / scale. Buffers of different groups must not overlap. count == 0 is a no-op.
 */
fus_status fus_quantize_grouped(const fus_tensor* inputs, fus_quantized* outs, int64_t count,
                                int current_scaling, int margin, const fus_context* ctx);

/*
 * Dequantize one copy of in into output. columnwise = 0 reads rowwise_data and writes output
 * [rows, cols]; columnwise = 1 reads columnwise_data and writes it in its stored layout:
 * [cols, rows] for per-tensor and blockwise scaling (the transpose), [rows, cols] for MXFP8.
 * output dtype: fp32, fp16 or bf16.
 */
fus_status fus_dequantize(const fus_quantized* in, int columnwise, fus_tensor* output,
                          const fus_context* ctx);

/*
 * Byte transpose of an FP8 matrix: output[c, r] = input[r, c], bits unchanged (exact).
 * input [rows, cols] and output [cols, rows], both FUS_FLOAT8_E4M3 or both FUS_FLOAT8_E5M2; the
 * buffers must not overlap. Makes the transposed (columnwise) copy of a per-tensor FP8 tensor from
 * its rowwise copy: the two share the same scale_inv.
 */
fus_status fus_transpose_fp8(const fus_tensor* input, fus_tensor* output, const fus_context* ctx);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* FUSIBLE_QUANTIZE_H_ */
