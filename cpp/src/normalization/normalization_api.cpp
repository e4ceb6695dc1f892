// C API of the normalization family: validation, then dispatch to the CPU or CUDA backend.
#include <cmath>
#include <string>

#include "common/validate.h"
#include "normalization/normalization_impl.h"
#include "normalization/normalization_math.h"

namespace fusible {
namespace {

// One row of FUS_NORM_KIND_TABLE (fusible/normalization.h), indexed by the kind's value.
struct KindRow {
  const char* name;    // "layernorm"
  const char* c_name;  // "FUS_NORM_LAYERNORM"
};

constexpr KindRow kKinds[] = {
#define FUS_NORM_KIND_ROW_(id, value, name) {name, "FUS_NORM_" #id},
    FUS_NORM_KIND_TABLE(FUS_NORM_KIND_ROW_)
#undef FUS_NORM_KIND_ROW_
};
constexpr int kNumKinds = static_cast<int>(sizeof(kKinds) / sizeof(kKinds[0]));

// kKinds is indexed by the kinds' values.
#define FUS_NORM_KIND_VALUE_(id, value, ...) value,
static_assert(values_are_row_indices({FUS_NORM_KIND_TABLE(FUS_NORM_KIND_VALUE_)}),
              "FUS_NORM_KIND_TABLE: values must be 0, 1, ... in order");
#undef FUS_NORM_KIND_VALUE_

bool valid_kind(fus_norm_kind kind) {
  return static_cast<int>(kind) >= 0 && static_cast<int>(kind) < kNumKinds;
}

void check_kind(const char* fn, fus_norm_kind kind) {
  if (valid_kind(kind)) return;
  std::vector<std::string> kinds;  // "FUS_NORM_LAYERNORM (0)", ...: every kind of the table
  for (int k = 0; k < kNumKinds; ++k)
    kinds.push_back(std::string(kKinds[k].c_name) + " (" + std::to_string(k) + ")");
  require(false, fn,
          "kind must be " + or_list(kinds) + ", got " + std::to_string(static_cast<int>(kind)));
}

// A [1, H] vector of a high-precision dtype.
void check_vector(const char* fn, const char* arg, const fus_tensor* t, int64_t cols) {
  check_matrix(fn, arg, t, kHighPrecision);
  check_same_shape(fn, arg, t, 1, cols);
}

}  // namespace

size_t norm_bwd_workspace_bytes(int64_t rows, int64_t cols) {
  const NormColPlan plan = norm_bwd_col_plan(rows, cols);
  return static_cast<size_t>(plan.groups) * static_cast<size_t>(cols) * 2 * sizeof(float);
}

}  // namespace fusible

using namespace fusible;

extern "C" {

const char* fus_norm_kind_name(fus_norm_kind kind) {
  return valid_kind(kind) ? kKinds[kind].name : nullptr;
}

fus_status fus_norm_forward(fus_norm_kind kind, const fus_tensor* x, const fus_tensor* gamma,
                            const fus_tensor* beta, float eps, int zero_centered_gamma,
                            fus_tensor* y, fus_quantized* q, float* mean, float* rstd,
                            const fus_context* ctx) {
  constexpr const char* fn = "fus_norm_forward";
  return guarded(fn, [&] {
    check_context(fn, ctx);
    check_kind(fn, kind);
    const bool ln = kind == FUS_NORM_LAYERNORM;
    check_matrix(fn, "x", x, kHighPrecision);
    const int64_t rows = x->rows, cols = x->cols;
    require(cols >= 1, fn, "x must have at least one column (the normalized dimension), got 0");
    check_vector(fn, "gamma", gamma, cols);
    if (beta != nullptr) {
      require(ln, fn, "beta must be NULL for RMSNorm (it has no bias)");
      check_vector(fn, "beta", beta, cols);
    }
    require(std::isfinite(eps) && eps >= 0.0f, fn,
            "eps must be finite and >= 0, got " + std::to_string(eps));
    if (y != nullptr) {
      check_matrix(fn, "y", y, kHighPrecision);
      check_same_shape(fn, "y", y, rows, cols);
      require(rows * cols == 0 || y->data != x->data, fn,
              "y must not alias x (in-place normalization is not supported)");
    }
    if (q != nullptr) {
      check_quantized(fn, "q", q, rows, cols);
      if (rows > 0 && q->mode == FUS_SCALING_PER_TENSOR)
        require(q->scale != nullptr, fn, "q->scale is NULL; per-tensor scaling needs float[1]");
    }
    if (rows > 0) {
      require(!ln || mean != nullptr, fn, "mean is NULL; LayerNorm needs float[rows] for mean");
      require(rstd != nullptr, fn, "rstd is NULL; expected float[rows]");
    }
    NormFwdArgs a{ln,
                  *x,
                  *gamma,
                  beta ? beta->data : nullptr,
                  beta ? beta->dtype : gamma->dtype,
                  eps,
                  zero_centered_gamma != 0,
                  y,
                  y ? y->dtype : x->dtype,
                  q,
                  ln ? mean : nullptr,
                  rstd};
    if (is_cuda(ctx)) {
#if defined(FUSIBLE_WITH_CUDA)
      norm_forward_cuda(a, *ctx);
#endif
    } else {
      norm_forward_cpu(a);
    }
    return FUS_SUCCESS;
  });
}

fus_status fus_norm_backward_workspace_size(int64_t rows, int64_t cols, const fus_context* ctx,
                                            size_t* bytes) {
  return workspace_size_query("fus_norm_backward_workspace_size", rows, cols, ctx, bytes,
                              norm_bwd_workspace_bytes);
}

fus_status fus_norm_backward(fus_norm_kind kind, const fus_tensor* dy, const fus_tensor* x,
                             const float* mean, const float* rstd, const fus_tensor* gamma,
                             int zero_centered_gamma, fus_tensor* dx, fus_tensor* dgamma,
                             fus_tensor* dbeta, void* workspace, size_t workspace_bytes,
                             const fus_context* ctx) {
  constexpr const char* fn = "fus_norm_backward";
  return guarded(fn, [&] {
    check_context(fn, ctx);
    check_kind(fn, kind);
    const bool ln = kind == FUS_NORM_LAYERNORM;
    check_matrix(fn, "dy", dy, kHighPrecision);
    const int64_t rows = dy->rows, cols = dy->cols;
    require(cols >= 1, fn, "dy must have at least one column (the normalized dimension), got 0");
    check_matrix(fn, "x", x, kHighPrecision);
    check_same_shape(fn, "x", x, rows, cols);
    check_vector(fn, "gamma", gamma, cols);
    check_matrix(fn, "dx", dx, kHighPrecision);
    check_same_shape(fn, "dx", dx, rows, cols);
    check_vector(fn, "dgamma", dgamma, cols);
    require(dgamma->dtype == gamma->dtype, fn,
            std::string("dgamma has dtype ") + dtype_name(dgamma->dtype) +
                ", expected gamma's dtype " + dtype_name(gamma->dtype));
    if (dbeta != nullptr) {
      require(ln, fn, "dbeta must be NULL for RMSNorm (it has no bias)");
      check_vector(fn, "dbeta", dbeta, cols);
      require(dbeta->dtype == gamma->dtype, fn,
              std::string("dbeta has dtype ") + dtype_name(dbeta->dtype) +
                  ", expected gamma's dtype " + dtype_name(gamma->dtype));
    }
    if (rows > 0) {
      require(!ln || mean != nullptr, fn,
              "mean is NULL; LayerNorm needs the forward's float[rows]");
      require(rstd != nullptr, fn, "rstd is NULL; expected the forward's float[rows]");
    }
    if (is_cuda(ctx)) {
      const size_t need = norm_bwd_workspace_bytes(rows, cols);
      require(workspace_bytes >= need, fn,
              "workspace_bytes is " + std::to_string(workspace_bytes) + ", expected at least " +
                  std::to_string(need) + " (fus_norm_backward_workspace_size)");
      require(need == 0 || (workspace != nullptr &&
                            reinterpret_cast<uintptr_t>(workspace) % alignof(float) == 0),
              fn, "workspace must be a non-NULL, 4-byte aligned device pointer");
    }
    NormBwdArgs a{
        ln,  *dy,     *x,    ln ? mean : nullptr, rstd,           *gamma, zero_centered_gamma != 0,
        *dx, *dgamma, dbeta, workspace,           workspace_bytes};
    if (is_cuda(ctx)) {
#if defined(FUSIBLE_WITH_CUDA)
      norm_backward_cuda(a, *ctx);
#endif
    } else {
      norm_backward_cpu(a);
    }
    return FUS_SUCCESS;
  });
}

}  // extern "C"
