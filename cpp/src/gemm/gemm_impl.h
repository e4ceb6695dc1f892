// Backend entry points of the gemm family. Arguments are validated by gemm_api.cpp (shapes,
// dtypes, layouts, epilogue tensors); backends throw fusible::Error on failure.
#pragma once

#include "fusible/gemm.h"

namespace fusible {

// The problem size and what the validated arguments imply, computed once by the API layer.
struct GemmShape {
  int64_t m = 0, n = 0, k = 0;
  bool fp8 = false;        // A and B are FP8 (else both high precision)
  bool has_c = false;      // beta != 0: C is read
  bool uses_bias = false;  // BIAS, BIAS_GELU, BIAS_GELU_AUX
  bool gelu = false;       // GELU, GELU_AUX, BIAS_GELU, BIAS_GELU_AUX
  bool writes_aux = false;
  bool dgelu = false;      // DGELU, DGELU_BGRAD (aux is read)
  bool bgrad = false;      // DGELU_BGRAD
  bool blockwise = false;  // blockwise FP8 operands (a_scaling / b_scaling)
};

// Row stride of a 2D block scale matrix for K (cuBLASLt's K-major BLK128x128_32F layout).
inline int64_t block2d_scale_stride(int64_t k) { return (((k + 127) / 128) + 3) / 4 * 4; }

// Blockwise FP8 operands on the CPU: exact dequantization, then the fp32 GEMM (gemm_blockwise_cpu.cpp).
void gemm_blockwise_cpu(const fus_gemm_args& args, const GemmShape& shape);

void gemm_cpu(const fus_gemm_args& args, const GemmShape& shape);

#if defined(FUSIBLE_WITH_CUDA)
void gemm_cuda(const fus_gemm_args& args, const GemmShape& shape, const fus_context& ctx);
#endif

}  // namespace fusible
