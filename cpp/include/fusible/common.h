/*
 * fusible core library: types shared by every kernel family.
 *
 * Conventions
 *  - Every kernel works on row-major, contiguous matrices. Callers flatten leading dimensions:
 *    a tensor of shape (d0, ..., dn-1, dn) is the matrix [d0*...*dn-1, dn].
 *  - Every entry point returns a fus_status. On failure, fus_last_error() returns a message that
 *    names the function, the argument and what was expected (thread-local; valid until the next call
 *    on the same thread). No entry point aborts the process.
 *  - fus_context selects the backend. FUS_DEVICE_CPU runs synchronously: the call returns when
 *    the results are written, computed on the calling thread and up to fus_cpu_num_threads() - 1
 *    worker threads of the library (the results do not depend on the thread count).
 *    FUS_DEVICE_CUDA enqueues on ctx->stream (a cudaStream_t; NULL is the legacy default stream) and
 *    returns without synchronising; pointers must then be device pointers.
 */
#ifndef FUSIBLE_COMMON_H_
#define FUSIBLE_COMMON_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum fus_status {
  FUS_SUCCESS = 0,
  FUS_ERROR_INVALID_ARGUMENT = 1, /* bad shape, dtype, pointer, alignment or combination */
  FUS_ERROR_UNSUPPORTED = 2,      /* valid request this build or device cannot serve */
  FUS_ERROR_CUDA = 3,             /* a CUDA runtime or cuBLASLt call failed */
  FUS_ERROR_INTERNAL = 4,
} fus_status;

/* Element types. Values are stable: the Python layer maps torch dtypes onto them. */
typedef enum fus_dtype {
  FUS_FLOAT32 = 0,
  FUS_FLOAT16 = 1,
  FUS_BFLOAT16 = 2,
  FUS_FLOAT8_E4M3 = 3, /* OCP E4M3 ("fn"): max 448, no inf, NaN = S.1111.111 */
  FUS_FLOAT8_E5M2 = 4, /* OCP E5M2: max 57344, IEEE-like inf/NaN */
  FUS_E8M0 = 5,        /* OCP MX scale: 2^(bits - 127), 0xFF = NaN */
} fus_dtype;

typedef enum fus_device_type {
  FUS_DEVICE_CPU = 0,
  FUS_DEVICE_CUDA = 1,
} fus_device_type;

typedef struct fus_context {
  fus_device_type device;
  int device_index; /* CUDA ordinal; ignored on CPU */
  void* stream;     /* cudaStream_t; ignored on CPU */
} fus_context;

/* A row-major contiguous matrix [rows, cols]. A vector is [1, n]. data may be NULL only when
 * rows * cols == 0 or where a function documents the matrix as optional. */
typedef struct fus_tensor {
  void* data;
  fus_dtype dtype;
  int64_t rows;
  int64_t cols;
} fus_tensor;

/* MXFP8 block size along the scaled dimension. */
#define FUS_MXFP8_BLOCK 32

/* Blockwise FP8 block edge (1x128 and 128x128 blocks). */
#define FUS_FP8_BLOCK 128

/*
 * The scaling-mode table (how a quantized tensor is scaled): one row a mode,
 * X(ID, value, name, block_rows, block_cols, scale_dtype, transposed):
 *   name        the torch operators' quant= spelling (norm_fwd / act_fwd / act_bwd; "none" is no
 *               quantized output) and Python's
 *   block_rows x block_cols   the block of the rowwise copy one scale covers (0 x 0: the tensor)
 *   scale_dtype the dtype of the scales (scale_inv) stored with the data
 *   transposed  1 if the columnwise copy is stored transposed ([cols, rows]), 0 if as X
 * Every list of modes is read from it: the enum below, check_quantized (common/validate.cpp),
 * the torch operators' quant names (cpp/bindings/torch_ops.cpp) and Python's QUANT_MODES /
 * MXFP8_BLOCK / FP8_BLOCK (through fus_scaling_mode_name / fus_scaling_mode_layout). The layouts
 * of the scales are in the comment of fus_quantized below.
 */
#define FUS_SCALING_MODE_TABLE(X)                             \
  X(PER_TENSOR, 0, "fp8", 0, 0, FUS_FLOAT32, 1)               \
  X(MXFP8, 1, "mxfp8", 1, FUS_MXFP8_BLOCK, FUS_E8M0, 0)       \
  X(BLOCK_1D, 2, "block1d", 1, FUS_FP8_BLOCK, FUS_FLOAT32, 1) \
  X(BLOCK_2D, 3, "block2d", FUS_FP8_BLOCK, FUS_FP8_BLOCK, FUS_FLOAT32, 1)

/* PER_TENSOR: one fp32 scale for the whole tensor (delayed or current scaling); MXFP8: one E8M0
 * scale per 32 consecutive elements (OCP MX); BLOCK_1D: one fp32 scale per 1x128 block (blockwise
 * FP8, activations); BLOCK_2D: one fp32 scale per 128x128 block (blockwise FP8, weights). */
typedef enum fus_scaling_mode {
#define FUS_SCALING_ENUMERATOR_(id, value, name, block_rows, block_cols, scale_dtype, transposed) \
  FUS_SCALING_##id = value,
  FUS_SCALING_MODE_TABLE(FUS_SCALING_ENUMERATOR_)
#undef FUS_SCALING_ENUMERATOR_
} fus_scaling_mode;

/* The mode's name ("fp8", "mxfp8", ...); NULL for a value that is not a mode (so the modes are
 * 0, 1, ... up to the first NULL). */
const char* fus_scaling_mode_name(fus_scaling_mode mode);

/* The mode's row: *block_rows, *block_cols, *scale_dtype and *transposed (see the table; any
 * pointer may be NULL). FUS_ERROR_INVALID_ARGUMENT for a value that is not a mode. */
fus_status fus_scaling_mode_layout(fus_scaling_mode mode, int64_t* block_rows, int64_t* block_cols,
                                   fus_dtype* scale_dtype, int* transposed);

/*
 * A quantized view of a high-precision matrix X [rows, cols]. Either copy may be absent (NULL).
 *
 * FUS_SCALING_PER_TENSOR
 *   rowwise_data          FP8 [rows, cols]             q = fp8(x * scale)
 *   columnwise_data       FP8 [cols, rows]             the transpose of rowwise_data (same bits)
 *   rowwise_scale_inv     float[1]                     1 / scale, written by quantize; shared by both
 *   columnwise_scale_inv  unused
 *   scale                 float[1]                     input to quantize
 * FUS_SCALING_MXFP8
 *   rowwise_data          FP8 [rows, cols]             blocks of 32 along a row
 *   rowwise_scale_inv     E8M0 [rows, ceil(cols/32)]   x ~= q * 2^(s - 127)
 *   columnwise_data       FP8 [rows, cols]             blocks of 32 down a column (not transposed)
 *   columnwise_scale_inv  E8M0 [ceil(rows/32), cols]
 *   scale                 unused
 * FUS_SCALING_BLOCK_1D / FUS_SCALING_BLOCK_2D (blockwise FP8, see quantize.h)
 *   Each copy is a matrix [R, C] scaled in blocks along its rows (C is the GEMM's K):
 *   rowwise_data          FP8 [rows, cols]             the copy [R, C] = [rows, cols]
 *   columnwise_data       FP8 [cols, rows]             the copy [R, C] = [cols, rows] (x transposed)
 *   *_scale_inv           float, per copy [R, C]:      1D (1x128 blocks along C): [ceil(C/128), R]
 *                                                      2D (128x128 blocks): [ceil(R/128), ceil(C/128)]
 *                         x ~= q * scale_inv of the element's block (1D: R contiguous, the
 *                         "M-major" layout cuBLASLt's VEC128_32F mode reads)
 *   scale                 unused
 *   power_2_scale         0 or 1, amax_epsilon finite and >= 0: the parameters of the cast's
 *                         scale rule (quantize.h); read only in these two modes
 * amax (optional, all modes): float[1], receives max |x| over X (NaN if X holds a NaN).
 * amax_accumulate       0 or 1 (all modes; 1 needs amax): 0 overwrites *amax with max |x|; 1
 *                     max-combines into it, *amax = max(*amax, max |x|), for a running amax (a
 *                     delayed-scaling history slot: a float[1] that may lie at any offset in a
 *                     larger buffer; casts of one step accumulate). The max is taken on the float
 *                     bits as uint32 (abs_bits, as the CUDA backend's atomicMax): with *amax an
 *                     amax (+0 .. +inf, or a NaN with the sign bit clear) a NaN in either wins,
 *                     and an empty X leaves *amax unchanged. Not for current scaling, whose amax
 *                     is the tensor's own (fus_quantize_current_scaling and the grouped current
 *                     cast reject it).
 */
typedef struct fus_quantized {
  fus_scaling_mode mode;
  fus_dtype dtype; /* FUS_FLOAT8_E4M3 or FUS_FLOAT8_E5M2 */
  int64_t rows;
  int64_t cols;
  void* rowwise_data;
  void* columnwise_data;
  void* rowwise_scale_inv;
  void* columnwise_scale_inv;
  float* scale;
  float* amax;
  int power_2_scale;   /* blockwise modes: scales rounded down to powers of two (0 or 1) */
  float amax_epsilon;  /* blockwise modes: floor on each block's amax (finite, >= 0) */
  int amax_accumulate; /* 0: *amax = max |x|; 1: *amax = max(*amax, max |x|) (see above) */
} fus_quantized;

/* Message of the last failed call on this thread ("" if none). */
const char* fus_last_error(void);

/* 1 if this build contains the CUDA backend. */
int fus_has_cuda(void);

/* Largest finite value of an FP8 dtype (448 or 57344); 0 for other dtypes. */
float fus_fp8_max(fus_dtype dtype);

/* Size of one element in bytes, or 0 for an unknown dtype. */
size_t fus_dtype_size(fus_dtype dtype);

/* Threads the CPU backend may use per call: n > 0 sets it, n <= 0 restores the default (the
 * environment variable FUSIBLE_NUM_THREADS, else the processors the process may run on). The
 * results of every kernel are the same bits for any thread count. */
void fus_cpu_set_num_threads(int n);
int fus_cpu_num_threads(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* FUSIBLE_COMMON_H_ */
