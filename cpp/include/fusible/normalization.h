/*
 * fusible core library: the normalization family (LayerNorm and RMSNorm over the last dimension).
 *
 * Shapes: x [N, H] (rows of H elements), gamma / beta / dgamma / dbeta [1, H], mean / rstd
 * float[N]. Element types: x, y, dy, dx, gamma, beta in {fp32, fp16, bf16}, chosen independently.
 *
 * Forward (all arithmetic in fp32, every operation rounded once, identical on every backend):
 *   w     = zero_centered_gamma ? 1 + gamma : gamma
 *   LayerNorm: mean = sum(x) / H;  var = sum((x - mean)^2) / H           (two passes, no Welford)
 *              rstd = 1 / sqrt(var + eps);  y = fma((x - mean) * rstd, w, beta)   (beta absent: 0)
 *   RMSNorm:   rstd = 1 / sqrt(sum(x^2) / H + eps);  y = (x * rstd) * w
 *   y is rounded (RNE) to the output dtype. The quantized output, when requested, is the cast of
 *   that rounded value - so it equals fus_quantize() of the stored y bit for bit (fused ==
 *   unfused). Without a high-precision output, the value is rounded to x's dtype first (the dtype
 *   an unfused norm would have produced). amax (optional) is max |rounded y| over the tensor.
 *
 * Backward (fp32, x_hat = (x - mean) * rstd for LayerNorm, x * rstd for RMSNorm, dyw = dy * w):
 *   LayerNorm: dx = (dyw - fma(x_hat, sum(dyw * x_hat) / H, sum(dyw) / H)) * rstd
 *   RMSNorm:   dx = fma(-x_hat, sum(dyw * x_hat) / H, dyw) * rstd
 *   dgamma = sum over rows of dy * x_hat,  dbeta = sum over rows of dy   (fp32 accumulation, then
 *   rounded to the dtype of dgamma / dbeta).
 *
 * Reduction order (the part of the numerics a backend could choose; fixed here so the CPU and
 * CUDA backends agree bit for bit, see src/normalization/normalization_math.h):
 *  - Row sums: the row is cut into chunks of 8 consecutive elements; a "team" of L lanes owns
 *    chunks c = k*L + lane (k = 0, 1, ...). Each lane adds its elements sequentially in (k, j)
 *    order, then the L lane sums are combined by a pairwise tree (within groups of 32, halving
 *    offsets 16..1; then across the L/32 group sums, halving again). L is a power of two from 32
 *    to 512 chosen from H alone (forward and backward each have their rule).
 *  - Column sums (dgamma, dbeta): rows are split into G consecutive groups; within a group, T
 *    teams take rows round-robin and each sums its rows in order; the group result is the
 *    sequential sum of its T team sums; the total is the sequential sum of the G group results.
 *    G and T depend on N and H only.
 *  Results therefore do not depend on the GPU model or the launch configuration. Compared with the
 *  exact result, sums carry the usual error of fp32 summation in that order; tests compare with
 * FP64 references at rtol 1e-5 (fp32 outputs).
 *
 * All functions accept N == 0 (nothing to do; amax = 0, dgamma = dbeta = 0) and require H >= 1.
 * NaN / inf inputs propagate (NaN payloads and signs may differ between backends).
 */
#ifndef FUSIBLE_NORMALIZATION_H_
#define FUSIBLE_NORMALIZATION_H_

#include "fusible/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * The normalization table: one row a kind, X(ID, value, name). Every list of the family's kinds
 * is read from it: the enum below, the C API's kind check (normalization_api.cpp), the torch
 * operators' kind names (cpp/bindings/ops_normalization.cpp) and Python's NORM_KINDS (through
 * fus_norm_kind_name). (zero_centered_gamma is an argument of every kind, not a kind.)
 */
#define FUS_NORM_KIND_TABLE(X) \
  X(LAYERNORM, 0, "layernorm") \
  X(RMSNORM, 1, "rmsnorm")

typedef enum fus_norm_kind {
#define FUS_NORM_ENUMERATOR_(id, value, name) FUS_NORM_##id = value,
  FUS_NORM_KIND_TABLE(FUS_NORM_ENUMERATOR_)
#undef FUS_NORM_ENUMERATOR_
} fus_norm_kind;

/* The kind's name ("layernorm", "rmsnorm": the torch operators' and Python's spelling); NULL for a
 * value that is not a kind (so the kinds are 0, 1, ... up to the first NULL). */
const char* fus_norm_kind_name(fus_norm_kind kind);

/*
 * Forward.
 *   x      [N, H] input.
 *   gamma  [1, H] weight.          beta [1, H] bias, LayerNorm only; NULL = no bias.
 *   eps    >= 0 and finite.
 *   y      optional (NULL) [N, H] high-precision output.
 *   q      optional (NULL) quantized output describing [N, H]:
 *            per tensor: q->scale (input) required; writes rowwise_data [N, H] and/or the
 *                        transposed columnwise_data [H, N], rowwise_scale_inv = 1 / scale.
 *            MXFP8:      rowwise_data + rowwise_scale_inv and/or columnwise_data +
 *                        columnwise_scale_inv (layouts in common.h).
 *            blockwise:  1x128 or 128x128 blocks (FUS_SCALING_BLOCK_1D / 2D, with
 *                        q->power_2_scale and q->amax_epsilon): rowwise_data + rowwise_scale_inv
 *                        and/or the transposed columnwise_data + columnwise_scale_inv (fp32
 *                        scales, layouts in common.h; partial edge blocks as quantize.h says).
 *            q->amax (optional) receives max |rounded y|.
 *   mean   float[N], LayerNorm: required; RMSNorm: ignored (may be NULL).
 *   rstd   float[N], required.
 * One pass over x for y, mean, rstd, the rowwise copies and amax; a columnwise copy (per-tensor
 * transpose, MXFP8 or blockwise columnwise) or 128x128 blockwise tiles (both copies) cost a second
 * read of x on the CUDA backend.
 */
fus_status fus_norm_forward(fus_norm_kind kind, const fus_tensor* x, const fus_tensor* gamma,
                            const fus_tensor* beta, float eps, int zero_centered_gamma,
                            fus_tensor* y, fus_quantized* q, float* mean, float* rstd,
                            const fus_context* ctx);

/*
 * Bytes of device workspace fus_norm_backward needs for N x H on ctx's backend (0 on the CPU).
 */
fus_status fus_norm_backward_workspace_size(int64_t rows, int64_t cols, const fus_context* ctx,
                                            size_t* bytes);

/*
 * Backward.
 *   dy, x   [N, H];  mean (LayerNorm; ignored for RMSNorm), rstd: float[N] from the forward.
 *   gamma   [1, H] (the forward's weight; w = 1 + gamma when zero_centered_gamma).
 *   dx      [N, H] output (any high-precision dtype).
 *   dgamma  [1, H] output, same dtype as gamma.
 *   dbeta   [1, H] output (LayerNorm only, optional: NULL = not computed), same dtype as gamma.
 *   workspace / workspace_bytes: at least fus_norm_backward_workspace_size() bytes on ctx's device
 *   (NULL / 0 on the CPU).
 */
fus_status fus_norm_backward(fus_norm_kind kind, const fus_tensor* dy, const fus_tensor* x,
                             const float* mean, const float* rstd, const fus_tensor* gamma,
                             int zero_centered_gamma, fus_tensor* dx, fus_tensor* dgamma,
                             fus_tensor* dbeta, void* workspace, size_t workspace_bytes,
                             const fus_context* ctx);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* FUSIBLE_NORMALIZATION_H_ */
