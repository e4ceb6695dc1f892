// Backend entry points of the normalization family. Arguments are validated by
// normalization_api.cpp (shapes, dtypes, required pointers); backends throw fusible::Error on
// failure.
#pragma once

#include "fusible/normalization.h"

namespace fusible {

struct NormFwdArgs {
  bool layernorm;
  fus_tensor x;
  fus_tensor gamma;
  const void* beta;  // NULL: no bias; else gamma-shaped, dtype beta_dtype
  fus_dtype beta_dtype;
  float eps;
  bool zero_centered;
  const fus_tensor* y;     // NULL: no high-precision output
  fus_dtype round_dtype;   // y's dtype, or x's when y is absent
  const fus_quantized* q;  // NULL: no quantized output
  float* mean;             // NULL for RMSNorm
  float* rstd;
};

struct NormBwdArgs {
  bool layernorm;
  fus_tensor dy;
  fus_tensor x;
  const float* mean;  // NULL for RMSNorm
  const float* rstd;
  fus_tensor gamma;
  bool zero_centered;
  fus_tensor dx;
  fus_tensor dgamma;
  const fus_tensor* dbeta;  // NULL: not computed
  void* workspace;
  size_t workspace_bytes;
};

// Device workspace of the CUDA backward: [groups, cols] fp32 partial sums for dgamma and dbeta.
size_t norm_bwd_workspace_bytes(int64_t rows, int64_t cols);

void norm_forward_cpu(const NormFwdArgs& a);
void norm_backward_cpu(const NormBwdArgs& a);

#if defined(FUSIBLE_WITH_CUDA)
void norm_forward_cuda(const NormFwdArgs& a, const fus_context& ctx);
void norm_backward_cuda(const NormBwdArgs& a, const fus_context& ctx);
#endif

}  // namespace fusible
