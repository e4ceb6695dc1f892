// C API of the activation family: validation, then dispatch to the CPU or CUDA backend.
#include <string>

#include "activation/activation_impl.h"
#include "common/validate.h"

namespace fusible {
namespace {

// One row of FUS_ACTIVATION_TABLE (fusible/activation.h), indexed by the kind's value.
struct KindRow {
  const char* name;    // "gelu"
  const char* c_name;  // "FUS_ACT_GELU"
  bool gated;
  ActFn fn;
};

constexpr KindRow kKinds[] = {
#define FUS_ACT_KIND_ROW_(id, value, name, gated, fn) \
  {name, "FUS_ACT_" #id, gated != 0, ActFn::k##fn},
    FUS_ACTIVATION_TABLE(FUS_ACT_KIND_ROW_)
#undef FUS_ACT_KIND_ROW_
};
constexpr int kNumKinds = static_cast<int>(sizeof(kKinds) / sizeof(kKinds[0]));

// kKinds is indexed by the kinds' values.
#define FUS_ACT_KIND_VALUE_(id, value, ...) value,
static_assert(values_are_row_indices({FUS_ACTIVATION_TABLE(FUS_ACT_KIND_VALUE_)}),
              "FUS_ACTIVATION_TABLE: values must be 0, 1, ... in order");
#undef FUS_ACT_KIND_VALUE_

bool valid_kind(fus_activation kind) {
  return static_cast<int>(kind) >= 0 && static_cast<int>(kind) < kNumKinds;
}

void check_kind(const char* fn, fus_activation kind) {
  require(valid_kind(kind), fn,
          std::string("kind must be a fus_activation (") + kKinds[0].c_name + " .. " +
              kKinds[kNumKinds - 1].c_name + ", 0.." + std::to_string(kNumKinds - 1) + "), got " +
              std::to_string(static_cast<int>(kind)));
}

ActFn fn_of(fus_activation kind) { return kKinds[kind].fn; }

// H from x's columns; the gated kinds need an even, non-zero count.
int64_t output_cols(const char* fn, fus_activation kind, const fus_tensor* x) {
  if (fus_activation_is_gated(kind)) {
    require(x->cols >= 2 && x->cols % 2 == 0, fn,
            "x must have an even number of columns >= 2 for a gated activation ([a | b], "
            "2H), got " +
                std::to_string(x->cols));
    return x->cols / 2;
  }
  require(x->cols >= 1, fn, "x must have at least one column, got 0");
  return x->cols;
}

void check_q(const char* fn, const fus_quantized* q, int64_t rows, int64_t cols) {
  check_quantized(fn, "q", q, rows, cols);
  if (rows * cols > 0 && q->mode == FUS_SCALING_PER_TENSOR)
    require(q->scale != nullptr, fn, "q->scale is NULL; per-tensor scaling needs float[1]");
}

}  // namespace
}  // namespace fusible

using namespace fusible;

extern "C" {

int fus_activation_is_gated(fus_activation kind) {
  return valid_kind(kind) && kKinds[kind].gated ? 1 : 0;
}

const char* fus_activation_name(fus_activation kind) {
  return valid_kind(kind) ? kKinds[kind].name : nullptr;
}

fus_status fus_activation_forward(fus_activation kind, const fus_tensor* x, fus_tensor* y,
                                  fus_quantized* q, const fus_context* ctx) {
  constexpr const char* fn = "fus_activation_forward";
  return guarded(fn, [&] {
    check_context(fn, ctx);
    check_kind(fn, kind);
    check_matrix(fn, "x", x, kHighPrecision);
    const int64_t rows = x->rows, cols = output_cols(fn, kind, x);
    require(y != nullptr || q != nullptr, fn,
            "y and q are both NULL; expected at least one output");
    if (y != nullptr) {
      check_matrix(fn, "y", y, kHighPrecision);
      check_same_shape(fn, "y", y, rows, cols);
    }
    if (q != nullptr) check_q(fn, q, rows, cols);
    const ActArgs a{fn_of(kind), fus_activation_is_gated(kind) != 0,
                    rows,        cols,
                    *x,          fus_tensor{nullptr, x->dtype, 0, 0},
                    y,           y ? y->dtype : x->dtype,
                    q,           nullptr,
                    nullptr,     0};
    if (is_cuda(ctx)) {
#if defined(FUSIBLE_WITH_CUDA)
      act_forward_cuda(a, *ctx);
#endif
    } else {
      act_forward_cpu(a);
    }
    return FUS_SUCCESS;
  });
}

fus_status fus_activation_backward_workspace_size(int64_t rows, int64_t cols,
                                                  const fus_context* ctx, size_t* bytes) {
  return workspace_size_query("fus_activation_backward_workspace_size", rows, cols, ctx, bytes,
                              act_bwd_workspace_bytes);
}

fus_status fus_activation_backward(fus_activation kind, const fus_tensor* grad, const fus_tensor* x,
                                   fus_tensor* dx, fus_quantized* q, fus_tensor* dbias,
                                   void* workspace, size_t workspace_bytes,
                                   const fus_context* ctx) {
  constexpr const char* fn = "fus_activation_backward";
  return guarded(fn, [&] {
    check_context(fn, ctx);
    check_kind(fn, kind);
    const bool gated = fus_activation_is_gated(kind) != 0;
    check_matrix(fn, "grad", grad, kHighPrecision);
    check_matrix(fn, "x", x, kHighPrecision);
    const int64_t rows = grad->rows, cols = grad->cols;
    require(cols >= 1, fn, "grad must have at least one column, got 0");
    const int64_t in_cols = gated ? 2 * cols : cols;
    check_same_shape(fn, "x", x, rows, in_cols);
    require(dx != nullptr || q != nullptr || dbias != nullptr, fn,
            "dx, q and dbias are all NULL; expected at least one output");
    if (dx != nullptr) {
      check_matrix(fn, "dx", dx, kHighPrecision);
      check_same_shape(fn, "dx", dx, rows, in_cols);
    }
    if (q != nullptr) {
      check_q(fn, q, rows, in_cols);
      require(!(gated && q->mode == FUS_SCALING_MXFP8 && q->rowwise_data != nullptr &&
                cols % FUS_MXFP8_BLOCK != 0),
              fn,
              "an MXFP8 rowwise q of a gated backward needs H % 32 == 0 (no 32-element block "
              "may straddle [da | db]), got H = " +
                  std::to_string(cols));
    }
    if (dbias != nullptr) {
      check_matrix(fn, "dbias", dbias, kHighPrecision);
      check_same_shape(fn, "dbias", dbias, 1, in_cols);
      if (is_cuda(ctx)) {
        const size_t need = act_bwd_workspace_bytes(rows, in_cols);
        require(workspace_bytes >= need, fn,
                "workspace_bytes is " + std::to_string(workspace_bytes) + ", expected at least " +
                    std::to_string(need) + " (fus_activation_backward_workspace_size)");
        require(need == 0 || (workspace != nullptr &&
                              reinterpret_cast<uintptr_t>(workspace) % alignof(float) == 0),
                fn, "workspace must be a non-NULL, 4-byte aligned device pointer");
      }
    }
    const ActArgs a{fn_of(kind), gated, rows,      cols,
                    *x,          *grad, dx,        dx ? dx->dtype : grad->dtype,
                    q,           dbias, workspace, workspace_bytes};
    if (is_cuda(ctx)) {
#if defined(FUSIBLE_WITH_CUDA)
      act_backward_cuda(a, *ctx);
#endif
    } else {
      act_backward_cpu(a);
    }
    return FUS_SUCCESS;
  });
}

}  // extern "C"
