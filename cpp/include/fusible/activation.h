/*
 * fusible core library: the activation family (GELU, ReLU, SiLU and the gated SwiGLU / GEGLU),
 * forward and backward, with optional quantized outputs and (backward) the bias gradient.
 *
 * Functions (fp32 math; formulas, derivatives and accuracy in src/common/activation_math.h, which
 * every backend and the GEMM family's CPU epilogues share; host and device compute the same bits,
 * except the sign and payload of a NaN the arithmetic makes):
 *   FUS_ACT_GELU      gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
 *                     (cuBLASLt's GELU epilogue; torch gelu(approximate="tanh"))
 *   FUS_ACT_GELU_ERF  x * Phi(x) = 0.5 x (1 + erf(x / sqrt 2))       (torch gelu())
 *   FUS_ACT_RELU      max(x, 0) (NaN and -0 pass through, as torch.relu)
 *   FUS_ACT_SILU      x * sigmoid(x)
 *   FUS_ACT_SWIGLU    gated: input [N, 2H] = [a | b], output silu(a) * b       [N, H]
 *   FUS_ACT_GEGLU     gated: input [N, 2H] = [a | b], output gelu_tanh(a) * b  [N, H]
 *   FUS_ACT_IDENTITY  x; backward dx = grad, and x is not read on CUDA (pass grad as x): a
 *                     gradient's quantized copy (bit for bit fus_quantize() of grad) and its
 *                     column sums (in the order below) in one pass. Meant for a bias gradient
 *                     beside the FP8 cast of a Linear's grad_output (Bias's backward).
 *
 * Shapes: K = H for the elementwise kinds, 2H for the gated ones.
 *   forward:  x [N, K] -> y [N, H]
 *   backward: grad [N, H], x [N, K] (the forward's input) -> dx [N, K], dbias [1, K]
 * Element types: x, y, grad, dx, dbias in {fp32, fp16, bf16}, chosen independently.
 *
 * Rounding and quantized outputs: each result is computed in fp32 and rounded (RNE) to the dtype
 * of the high-precision output; a quantized output is the cast of that rounded value, so it equals
 * fus_quantize() of the stored high-precision output bit for bit (fused == unfused). Without a
 * high-precision output, values are rounded to the input's dtype (forward: x; backward: grad)
 * first. amax (optional) is max |rounded value|. dbias[k] is the fp32 sum over rows of the rounded
 * dx[:, k] (what an unfused dx.sum(0) would see), then rounded to dbias's dtype.
 *
 * Column-sum order (dbias): rows are split into groups of P = 32 * ceil(ceil(N / 32) / 64)
 * consecutive rows; each group is summed sequentially in row order, and the group sums are added
 * sequentially. Fixed by N alone, so both backends agree bit for bit.
 *
 * The quantized output q (optional, describing the output matrix: [N, H] forward, [N, K]
 * backward) follows common.h: per tensor (q->scale required; rowwise and/or transposed columnwise
 * copy; rowwise_scale_inv = 1 / scale), MXFP8 (rowwise and/or columnwise copies with E8M0
 * scales) or blockwise (1x128 or 128x128 blocks with q->power_2_scale and q->amax_epsilon;
 * rowwise and/or transposed columnwise copies with fp32 scales; blocks of a gated backward may
 * straddle [da | db], as they do in the stored dx). Backward of a gated kind with an MXFP8 rowwise
 * copy needs H % 32 == 0 (so no 32-element block straddles the [da | db] boundary). One pass over
 * the inputs; the CUDA dbias needs a second, small launch over [groups, K] partial sums held in
 * the caller's workspace.
 *
 * All functions accept N == 0 and require H >= 1.
 */
#ifndef FUSIBLE_ACTIVATION_H_
#define FUSIBLE_ACTIVATION_H_

#include "fusible/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * The activation table: one row a kind, X(ID, value, name, gated, fn). Every list of the family
 * is read from it: the enum below, the C API's checks and names (activation_api.cpp), the
 * kernels' dispatch (fn: the elementwise function, a row of FUS_ACT_FUNCTIONS in
 * src/common/activation_math.h; a gated kind applies it to the first half a of [a | b]). Python
 * reads the names and gated flags through fus_activation_name / fus_activation_is_gated.
 * docs/architecture.md says how to add a kind.
 */
#define FUS_ACTIVATION_TABLE(X)          \
  X(GELU, 0, "gelu", 0, GeluTanh)        \
  X(GELU_ERF, 1, "gelu_erf", 0, GeluErf) \
  X(RELU, 2, "relu", 0, Relu)            \
  X(SILU, 3, "silu", 0, Silu)            \
  X(SWIGLU, 4, "swiglu", 1, Silu)        \
  X(GEGLU, 5, "geglu", 1, GeluTanh)      \
  X(IDENTITY, 6, "identity", 0, Identity)

typedef enum fus_activation {
#define FUS_ACT_ENUMERATOR_(id, value, name, gated, fn) FUS_ACT_##id = value,
  FUS_ACTIVATION_TABLE(FUS_ACT_ENUMERATOR_)
#undef FUS_ACT_ENUMERATOR_
} fus_activation;

/* 1 for the gated kinds (SwiGLU, GEGLU), whose input has twice the output's columns; else 0. */
int fus_activation_is_gated(fus_activation kind);

/* The kind's name ("gelu", "swiglu", ...: the torch operators' and Python's spelling); NULL for a
 * value that is not a kind (so the kinds are 0, 1, ... up to the first NULL). */
const char* fus_activation_name(fus_activation kind);

/*
 * Forward: y = act(x). y (optional) [N, H]; q (optional) quantized [N, H]; at least one of them.
 */
fus_status fus_activation_forward(fus_activation kind, const fus_tensor* x, fus_tensor* y,
                                  fus_quantized* q, const fus_context* ctx);

/* Bytes of device workspace fus_activation_backward needs for dx [rows, cols] with a bias
 * gradient, on ctx's backend (0 on the CPU). */
fus_status fus_activation_backward_workspace_size(int64_t rows, int64_t cols,
                                                  const fus_context* ctx, size_t* bytes);

/*
 * Backward: dx = grad * act'(x) (gated: [da | db]). dx (optional) [N, K]; q (optional) quantized
 * [N, K]; dbias (optional) [1, K]; at least one of the three. workspace / workspace_bytes: at least
 * fus_activation_backward_workspace_size() bytes on ctx's device when dbias is requested (NULL / 0
 * otherwise or on the CPU).
 */
fus_status fus_activation_backward(fus_activation kind, const fus_tensor* grad, const fus_tensor* x,
                                   fus_tensor* dx, fus_quantized* q, fus_tensor* dbias,
                                   void* workspace, size_t workspace_bytes, const fus_context* ctx);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* FUSIBLE_ACTIVATION_H_ */
