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
  bool dgelu = false;  // DGELU, DGELU_BGRAD (aux is read)
  bool bgrad = false;  // DGELU_BGRAD
};

void gemm_cpu(const fus_gemm_args& args, const GemmShape& shape);

#if defined(FUSIBLE_WITH_CUDA)
void gemm_cuda(const fus_gemm_args& args, const GemmShape& shape, const fus_context& ctx);
#endif

}  // namespace fusible
