/*
 * fusible core library: the gemm family.
 *
 * One entry point, fus_gemm, computes in row-major terms (see common.h for the matrix convention)
 *
 *     t[M, N] = alpha * s * (op(A) @ op(B)) + beta * C          (FP32 accumulation)
 *     D[M, N] = epilogue(t)
 *
 * op(X) is X or its transpose: A is stored [M, K] (transa = 0) or [K, M] (transa = 1); B is stored
 * [K, N] (transb = 0) or [N, K] (transb = 1). s = a_scale_inv[0] * b_scale_inv[0] for FP8 operands
 * (the dequantization factors written by fus_quantize) and 1 otherwise.
 *
 * Operands
 *  - High precision: A and B have the same dtype (fp32, fp16 or bf16); every transpose combination
 *    is supported. D is A's dtype or fp32.
 *  - FP8: A and B are each E4M3 or E5M2 (E5M2 x E5M2 is unsupported: FUS_ERROR_UNSUPPORTED), with
 *    per-tensor a_scale_inv / b_scale_inv (float[1] each, on ctx's device). FP8 GEMMs must be in
 * the "TN" form that Hopper's cuBLASLt FP8 kernels require: both operands K-contiguous, i.e. transa
 * = 0 and transb = 1 (D = A[M, K] @ B[N, K]^T); any other layout returns FUS_ERROR_UNSUPPORTED
 * naming the operand to pass as its transposed copy (the columnwise data of fus_quantize). The CPU
 * backend enforces the same rule so layouts that would fail on the GPU fail in CPU tests too. D is
 * fp32, fp16, bf16, E4M3 or E5M2.
 *  - FP8 output: D = fp8(r * d_scale[0]) (saturating, round to nearest even, see quantize.h) where
 *    r is the epilogue result in fp32; d_amax (optional, float[1]) receives max |r| (on the CPU,
 * NaN if any r is NaN). d_scale / d_amax must be NULL for a high-precision D.
 *
 * Epilogues (bias, aux, dbias are ignored unless the epilogue names them; pass zeroed tensors):
 *    NONE           D = t
 *    BIAS           D = t + bias                  bias [1, N], broadcast over rows
 *    GELU           D = gelu(t)
 *    GELU_AUX       aux = t;          D = gelu(t)          aux [M, N] output
 *    BIAS_GELU      D = gelu(t + bias)
 *    BIAS_GELU_AUX  aux = t + bias;   D = gelu(aux)        (gelu(x) reads the fp32 value, not aux)
 *    DGELU          D = t * gelu'(aux)                     aux [M, N] input (the forward's aux)
 *    DGELU_BGRAD    D = t * gelu'(aux); dbias[n] = sum_m r[m, n]   dbias [1, N] output
 *  gelu is the tanh approximation 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), the GELU of
 *  cuBLASLt's epilogues and torch.nn.functional.gelu(approximate="tanh").
 *  C (beta != 0) is allowed only with NONE and BIAS (residual add, wgrad accumulation); C may be
 *  the same buffer as D (same dtype and shape; no other overlap), which accumulates in place.
 *  beta == 0 never reads C (a NaN in C does not propagate), as in BLAS.
 *
 * Dtypes of the epilogue tensors (cuBLASLt's rules, enforced on every backend):
 *    C                    D's dtype; D high precision
 *    bias                 D's dtype, except FP8 GEMMs: D fp32 -> bf16; D FP8 -> bf16 or fp16
 *    aux, dbias           D's dtype; for an FP8 D: bf16 or fp16 (aux: the same as bias when both)
 *
 * FP8 combinations without a cuBLASLt kernel (measured on Hopper with cuBLAS 13.0) return
 * FUS_ERROR_UNSUPPORTED on every backend, so CPU runs fail where GPU runs would (the epilogue ones
 * are the fp8_f32_out / fp8_out columns of FUS_GEMM_EPILOGUE_TABLE; fus_gemm_supported answers
 * for any combination):
 *    D float8_e5m2 from E4M3 x E4M3 operands (an E5M2 output needs an E5M2 operand);
 *    D fp32 with BIAS_GELU_AUX or DGELU_BGRAD (use a bf16 / fp16 D);
 *    D FP8 with DGELU or DGELU_BGRAD.
 * High-precision GEMMs support every epilogue with every output dtype.
 *
 * Numerics of the CPU backend (the specification):
 *  - FP8 operands are decoded exactly to fp32; fp16/bf16 widen exactly. Each product a*b is
 *    computed in fp32 (exact for FP8 x FP8) and summed into one fp32 accumulator per output
 *    element in ascending k, starting from +0. Then t = (alpha * s) * acc, plus beta * C[m, n]
 *    when beta != 0, plus bias[n]; each step one fp32 operation, in that order.
 *  - The epilogue works on fp32 values; D, aux and dbias are rounded once to their dtype (RNE).
 *  - dbias[n] sums the fp32 results r[m, n] (before D's rounding) in ascending m, in fp32.
 *  - Blocking, threads and vector instructions change none of this (gemm_cpu.cpp): the results
 *    are the same bits for any thread count and instruction set.
 *
 * CUDA backend (cuBLASLt, cpp/src/gemm/gemm.cu). Results agree with the CPU within a tolerance,
 * not bit for bit: cuBLASLt sums in another order; Hopper's FP8 tensor cores add products with
 * about 14 significant bits inside one MMA instruction (partial sums are promoted to fp32 between
 * MMAs unless use_fast_accum); its epilogues round the matmul result to D's dtype before applying
 * them in some cases (one more rounding for 16-bit outputs; measured for DGELU, whose
 * DGELU_BGRAD sums the rounded values, and for a 16-bit GELU aux).
 * Extra constraints, reported as FUS_ERROR_INVALID_ARGUMENT naming the argument: FP8 operands need
 * K % 16 == 0 and 16-byte aligned data, and an FP8 GEMM's d needs 16-byte rows (N * size % 16)
 * and data; aux epilogues need N % 8 == 0 (cuBLASLt's aux leading dimension rule).
 * Resources: the first CUDA GEMM on a device creates a cuBLASLt handle for it, and the first on a
 * (device, stream) pair allocates a 32 MiB workspace for that stream (streams never share one);
 * both are kept until the process exits. Later calls allocate nothing, so they can be captured in
 * CUDA graphs; a first call inside a capture allocates with the thread's capture mode relaxed.
 * use_fast_accum = 1 allows cuBLASLt's FP8 fast accumulation (faster, less accurate) and TF32 for
 * fp32 operands; 0 (the default) keeps full FP32 accumulation. The CPU backend ignores it.
 * Builds without cuBLASLt return FUS_ERROR_UNSUPPORTED for CUDA GEMMs.
 *
 * Blockwise FP8 operands (a_scaling / b_scaling, the Float8BlockScaling recipe). Each operand X
 * (A [M, K] or B [N, K], the TN form) has a float scale_inv per block: FUS_GEMM_SCALING_BLOCK_1D
 * (1x128 blocks along K; scale_inv [ceil(K/128), R], R = M or N, R contiguous: cuBLASLt's
 * CUBLASLT_MATMUL_MATRIX_SCALE_VEC128_32F "M-major" layout) or FUS_GEMM_SCALING_BLOCK_2D (128x128
 * blocks; scale_inv [ceil(R/128), L4] with row stride L4 = ceil(ceil(K/128) / 4) * 4 (entries past
 * ceil(K/128) are not read): CUBLASLT_MATMUL_MATRIX_SCALE_BLK128x128_32F's "K-major" layout).
 * D = alpha * sum over K blocks of (A block . B block) * sa * sb + beta * C. Rules (cuBLAS docs,
 * "128-element 1D and 128x128 2D Block Scaling For FP8 Data Types"; enforced on every backend):
 * both operands blockwise (no mix with per-tensor scaling); not both 2D; D fp32, fp16 or bf16;
 * epilogue NONE (c with beta allowed); M % 4 == 0 and N % 4 == 0; K % 16 == 0; scale_inv
 * pointers 16-byte aligned on CUDA. CUDA needs cuBLASLt 12.9 or newer and compute capability 9.0;
 * use_fast_accum is ignored (cuBLASLt has no fast accumulation for block scaling). The CPU backend
 * dequantizes both operands exactly (fp32(float(q) * scale_inv), see quantize.h) and runs the
 * fp32 GEMM above: the numerics of the dequantized operands, summed in ascending k.
 *
 * Empty problems are valid: M or N == 0 writes nothing but dbias (zeros) and d_amax (0); K == 0
 * gives t = beta * C (the epilogue still runs).
 */
#ifndef FUSIBLE_GEMM_H_
#define FUSIBLE_GEMM_H_

#include "fusible/common.h"

#ifdef __cplusplus
extern "C" {
#endif

/*
 * The epilogue table: one row an epilogue, X(ID, value, name, bias, gelu, writes_aux, reads_aux,
 * bgrad, c, fp8_f32_out, fp8_out, lt), each flag 0 or 1:
 *    bias         reads bias [1, N]            gelu        applies the tanh GELU
 *    writes_aux   writes aux [M, N]            reads_aux   reads aux [M, N] (D = t * gelu'(aux))
 *    bgrad        writes dbias [1, N]          c           allows C (beta != 0)
 *    fp8_f32_out  FP8 operands may write a float32 D with it (cuBLASLt has the kernel)
 *    fp8_out      FP8 operands may write an FP8 D with it
 *    lt           the cuBLASLt epilogue that runs it, CUBLASLT_EPILOGUE_<lt> (gemm.cu)
 * Every rule of the family that depends on the epilogue is read from it: the enum below, the C
 * API's checks (gemm_api.cpp), fus_gemm_epilogue_row, and through it the torch operator's
 * epilogue names (ops_gemm.cpp) and Python (fusible._kernels.gemm, which also reads the dtype
 * rules through fus_gemm_supported and the limits through fus_gemm_get_limits).
 */
#define FUS_GEMM_EPILOGUE_TABLE(X)                                            \
  X(NONE, 0, "none", 0, 0, 0, 0, 0, 1, 1, 1, DEFAULT)                         \
  X(BIAS, 1, "bias", 1, 0, 0, 0, 0, 1, 1, 1, BIAS)                            \
  X(GELU, 2, "gelu", 0, 1, 0, 0, 0, 0, 1, 1, GELU)                            \
  X(GELU_AUX, 3, "gelu_aux", 0, 1, 1, 0, 0, 0, 1, 1, GELU_AUX)                \
  X(BIAS_GELU, 4, "bias_gelu", 1, 1, 0, 0, 0, 0, 1, 1, GELU_BIAS)             \
  X(BIAS_GELU_AUX, 5, "bias_gelu_aux", 1, 1, 1, 0, 0, 0, 0, 1, GELU_AUX_BIAS) \
  X(DGELU, 6, "dgelu", 0, 0, 0, 1, 0, 0, 1, 0, DGELU)                         \
  X(DGELU_BGRAD, 7, "dgelu_bgrad", 0, 0, 0, 1, 1, 0, 0, 0, DGELU_BGRAD)

typedef enum fus_gemm_epilogue {
#define FUS_GEMM_EPILOGUE_ENUMERATOR_(id, value, ...) FUS_GEMM_EPILOGUE_##id = value,
  FUS_GEMM_EPILOGUE_TABLE(FUS_GEMM_EPILOGUE_ENUMERATOR_)
#undef FUS_GEMM_EPILOGUE_ENUMERATOR_
} fus_gemm_epilogue;

/* One row of FUS_GEMM_EPILOGUE_TABLE (the flags are 0 or 1). */
typedef struct fus_gemm_epilogue_info {
  const char* name; /* "none", "bias_gelu_aux", ...: the torch operator's and Python's spelling */
  int bias;
  int gelu;
  int writes_aux;
  int reads_aux;
  int bgrad;
  int c;
  int fp8_f32_out;
  int fp8_out;
} fus_gemm_epilogue_info;

/* The row of epilogue e; NULL for a value that is not an epilogue (so the epilogues are 0, 1, ...
 * up to the first NULL). */
const fus_gemm_epilogue_info* fus_gemm_epilogue_row(fus_gemm_epilogue e);

/* How an FP8 operand's scale_inv scales it (see above). */
typedef enum fus_gemm_scaling {
  FUS_GEMM_SCALING_TENSOR = 0,   /* float[1] (default) */
  FUS_GEMM_SCALING_BLOCK_1D = 1, /* 1x128 blocks along K */
  FUS_GEMM_SCALING_BLOCK_2D = 2, /* 128x128 blocks */
} fus_gemm_scaling;

/*
 * Arguments of fus_gemm. Zero-initialise the struct ({0} / memset) and set what the call uses: an
 * absent tensor is all zero (data NULL, rows = cols = 0), absent pointers are NULL. alpha is not
 * defaulted: set it (usually 1).
 */
typedef struct fus_gemm_args {
  fus_tensor a;             /* [M, K] (transa = 0) or [K, M] (transa = 1) */
  fus_tensor b;             /* [K, N] (transb = 0) or [N, K] (transb = 1) */
  int transa;               /* 0 or 1 */
  int transb;               /* 0 or 1 */
  const float* a_scale_inv; /* float[1] (or block scales, a_scaling), FP8 A only */
  const float* b_scale_inv; /* float[1] (or block scales, b_scaling), FP8 B only */
  fus_tensor d;             /* output [M, N] */
  const float* d_scale;     /* float[1], required for an FP8 D, else NULL */
  float* d_amax;            /* float[1], optional for an FP8 D, else NULL */
  fus_tensor c;             /* [M, N], read when beta != 0; may be d itself */
  float alpha;
  float beta;
  fus_gemm_epilogue epilogue;
  fus_tensor bias;    /* [1, N] input: BIAS, BIAS_GELU, BIAS_GELU_AUX */
  fus_tensor aux;     /* [M, N] output: GELU_AUX, BIAS_GELU_AUX; input: DGELU, DGELU_BGRAD */
  fus_tensor dbias;   /* [1, N] output: DGELU_BGRAD */
  int use_fast_accum; /* 0: precise FP32 accumulation (default); 1: allow fast accumulation */
  fus_gemm_scaling a_scaling; /* how a_scale_inv scales a (default: per tensor) */
  fus_gemm_scaling b_scaling; /* how b_scale_inv scales b (default: per tensor) */
} fus_gemm_args;

/* Runs the GEMM described by args on ctx's backend (see above). */
fus_status fus_gemm(const fus_gemm_args* args, const fus_context* ctx);

/*
 * Grouped GEMM: the count problems args[0 .. count) (each exactly as for fus_gemm) run in order on
 * ctx's backend, with the numerics of fus_gemm for each (so a group gives the bits of count
 * fus_gemm calls). Every args[i] is validated before any GEMM runs; an invalid one fails the whole
 * call (FUS_ERROR_INVALID_ARGUMENT / FUS_ERROR_UNSUPPORTED, the message naming args[i]) and
 * nothing is written. Problems with M or N == 0 write nothing but dbias / d_amax; K == 0 writes
 * beta * C through the epilogue (zeros for beta = 0: the weight gradient of an expert that got no
 * tokens). count == 0 is a no-op.
 *
 * CUDA: one cublasLtMatmul after another on ctx->stream, from one host call, with no host
 * synchronisation (the per-problem host work is the heuristic-cache lookup and descriptor set-up of
 * fus_gemm). cuBLASLt 13.0, the version this build targets, has no grouped matmul; NVIDIA's own
 * grouped GEMM on top of cuBLASLt (TransformerEngine, common/gemm/cublaslt_grouped_gemm.cu) needs
 * cuBLAS 13.3 (BF16), 13.4 (Hopper) and 13.5 (per-tensor FP8 on Hopper).
 */
fus_status fus_gemm_grouped(const fus_gemm_args* args, int64_t count, const fus_context* ctx);

/*
 * 1 if fus_gemm serves operands of dtypes a and b scaled as a_scaling / b_scaling, an output d and
 * epilogue e (the dtype, scaling and epilogue rules above, on every backend; shapes, layouts and
 * the CUDA alignment aside), else 0. fus_gemm checks the same rules, one function each.
 */
int fus_gemm_supported(fus_dtype a, fus_dtype b, fus_dtype d, fus_gemm_epilogue e,
                       fus_gemm_scaling a_scaling, fus_gemm_scaling b_scaling);

/* The size rules above, as fus_gemm checks them (the CUDA ones for CUDA contexts only). */
typedef struct fus_gemm_limits {
  int fp8_k_multiple;    /* CUDA, FP8 operands: K % fp8_k_multiple == 0 */
  int fp8_d_row_bytes;   /* CUDA, FP8 operands: N * size(D) % fp8_d_row_bytes == 0 */
  int aux_n_multiple;    /* CUDA, aux epilogues: N % aux_n_multiple == 0 */
  int block_mn_multiple; /* blockwise operands: M, N % block_mn_multiple == 0 */
  int block_k_multiple;  /* blockwise operands: K % block_k_multiple == 0 */
} fus_gemm_limits;

/* The limits fus_gemm checks (a static table). */
const fus_gemm_limits* fus_gemm_get_limits(void);

/* 1 if CUDA GEMMs are available in this build (CUDA backend built with cuBLASLt), else 0. */
int fus_gemm_has_cublaslt(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* FUSIBLE_GEMM_H_ */
