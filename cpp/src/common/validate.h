// Argument checks shared by every family's API layer. Each throws fusible::Error with a message
// naming the function, the argument and what was expected.
#pragma once

#include <initializer_list>
#include <string>

#include "common/status.h"

namespace fusible {

// The high-precision dtypes a family's inputs and outputs may have (for check_matrix).
inline constexpr std::initializer_list<fus_dtype> kHighPrecision = {FUS_FLOAT32, FUS_FLOAT16,
                                                                    FUS_BFLOAT16};

// Throws FUS_ERROR_INVALID_ARGUMENT "<fn>: <what>" unless cond.
inline void require(bool cond, const char* fn, const std::string& what) {
  if (!cond) throw Error(FUS_ERROR_INVALID_ARGUMENT, std::string(fn) + ": " + what);
}

void check_context(const char* fn, const fus_context* ctx);

// t non-null, rows/cols >= 0, data non-null when non-empty, dtype one of allowed.
void check_matrix(const char* fn, const char* arg, const fus_tensor* t,
                  std::initializer_list<fus_dtype> allowed);

void check_same_shape(const char* fn, const char* arg, const fus_tensor* t, int64_t rows,
                      int64_t cols);

// The FP8 copies of q that exist must describe [rows, cols]; require_one: at least one copy.
void check_quantized(const char* fn, const char* arg, const fus_quantized* q, int64_t rows,
                     int64_t cols);

bool is_cuda(const fus_context* ctx);

// The body of a fus_*_workspace_size query: argument checks, then cuda_bytes(rows, cols) for a
// CUDA context and 0 for the CPU backend (which needs no workspace).
template <typename F>
fus_status workspace_size_query(const char* fn, int64_t rows, int64_t cols, const fus_context* ctx,
                                size_t* bytes, F cuda_bytes) {
  return guarded(fn, [&] {
    check_context(fn, ctx);
    require(bytes != nullptr, fn, "bytes is NULL");
    require(
        rows >= 0 && cols >= 0, fn,
        "rows and cols must be >= 0, got " + std::to_string(rows) + " and " + std::to_string(cols));
    *bytes = is_cuda(ctx) ? cuda_bytes(rows, cols) : 0;
    return FUS_SUCCESS;
  });
}

}  // namespace fusible
