// Argument checks shared by every family's API layer. Each throws fusible::Error with a message
// naming the function, the argument and what was expected.
#pragma once

#include <initializer_list>

#include "common/status.h"

namespace fusible {

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

}  // namespace fusible
