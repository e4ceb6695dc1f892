// Compile-time dispatch over runtime dtype codes, shared by the CPU and CUDA backends.
#pragma once

#include <type_traits>

#include "common/numerics.h"
#include "common/status.h"

namespace fusible {

// Calls f(T{}) with T = float, Half or Bf16 for a high-precision dtype.
template <typename F>
void dispatch_hp(fus_dtype dtype, F&& f) {
  switch (dtype) {
    case FUS_FLOAT32: f(float{}); return;
    case FUS_FLOAT16: f(Half{}); return;
    case FUS_BFLOAT16: f(Bf16{}); return;
    default: throw Error(FUS_ERROR_INVALID_ARGUMENT, "unsupported high-precision dtype");
  }
}

template <Fp8Format F>
using Fp8Tag = std::integral_constant<Fp8Format, F>;

// Calls f(Fp8Tag<F>{}) for an FP8 dtype.
template <typename F>
void dispatch_fp8(fus_dtype dtype, F&& f) {
  switch (dtype) {
    case FUS_FLOAT8_E4M3: f(Fp8Tag<Fp8Format::kE4M3>{}); return;
    case FUS_FLOAT8_E5M2: f(Fp8Tag<Fp8Format::kE5M2>{}); return;
    default: throw Error(FUS_ERROR_INVALID_ARGUMENT, "unsupported fp8 dtype");
  }
}

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

}  // namespace fusible
