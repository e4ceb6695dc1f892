// Single-precision arithmetic with exactly one IEEE rounding per operation, identical on the host
// and the device, for math that both backends must evaluate to the same bits (normalization
// statistics, activation functions).
//
// Why: nvcc contracts a * b + c into one fma by default (--fmad=true) and host compilers may do the
// same (GCC on aarch64), so a plain expression can round differently on the two backends. The
// device versions use the _rn intrinsics, which are never contracted; every fused multiply-add is
// written explicitly with f_fma. The library's host code is built with -ffp-contract=off.
// Division and square root are correctly rounded on both sides (IEEE; nvcc's default
// -prec-div=true / -prec-sqrt=true, which the _rn intrinsics guarantee regardless of flags).
#pragma once

#include <cmath>

#include "common/numerics.h"

namespace fusible {

FUS_HD float f_add(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

FUS_HD float f_sub(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}

FUS_HD float f_mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

FUS_HD float f_div(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

// 1 / a, correctly rounded.
FUS_HD float f_rcp(float a) {
#if defined(__CUDA_ARCH__)
  return __frcp_rn(a);
#else
  return 1.0f / a;
#endif
}

// 1 / a for a in [1, 8] (the sigmoid's 1 + e^-|x|, the normal cdf's 1 + c |x|), correctly
// rounded, as f_rcp. On the device: the hardware approximation and one Newton step, which is the
// sequence __frcp_rn runs for operands that need no exponent rescaling, without its range test and
// branch. PTX promises rcp.approx only to 1 ulp, so the bits rest on the GPU's approximation (whose
// error does not depend on the exponent of a normal operand, so [1, 2] decides every binade): the
// CUDA test ActCudaMath.ReciprocalOnOneToEightMatchesHost checks every float in [1, 8] ([1, 2] passed
// on the H200, sm_90, when this was f_rcp_1to2); run it on any other GPU the library targets,
// including PTX JIT to newer ones.
FUS_HD float f_rcp_1to8(float a) {
#if defined(__CUDA_ARCH__)
  float r;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(a));
  return __fmaf_rn(r, __fmaf_rn(-a, r, 1.0f), r);
#else
  return 1.0f / a;
#endif
}

// |a| (exact: clears the sign bit; the device's fabsf is an operand modifier of the next operation,
// not an instruction).
FUS_HD float f_abs(float a) {
#if defined(__CUDA_ARCH__)
  return fabsf(a);
#else
  return bits_as_float(float_as_bits(a) & 0x7fffffffu);
#endif
}

// c ? a : b. On the host as a bit blend rather than a branch: with a branch the compiler moves an
// operation that only one arm uses into that arm, and GCC does not vectorise a loop with a
// floating-point operation under a condition (it could trap, -ftrapping-math), so the CPU
// backend's loops would run scalar. The value is the ternary's on both sides.
FUS_HD float f_select(bool c, float a, float b) {
#if defined(__CUDA_ARCH__)
  return c ? a : b;
#else
  const uint32_t m = 0u - static_cast<uint32_t>(c);
  return bits_as_float((float_as_bits(a) & m) | (float_as_bits(b) & ~m));
#endif
}

// Clamps against a constant c, which must not be a zero (the two sides order -0 and +0
// differently). One instruction on the device; a bit blend on the host (f_select).
// f_max_nan(a, c) = max(a, c), NaN passes (device: max.NaN, sm_80 and later).
FUS_HD float f_max_nan(float a, float c) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(c));
  return r;
#else
  return f_select(a < c, c, a);
#endif
}
// f_min_nan(a, c) = min(a, c), NaN passes.
FUS_HD float f_min_nan(float a, float c) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(c));
  return r;
#else
  return f_select(a > c, c, a);
#endif
}
// f_min_num(a, c) = min(a, c), a NaN a gives c (IEEE minNum, as fminf).
FUS_HD float f_min_num(float a, float c) {
#if defined(__CUDA_ARCH__)
  return fminf(a, c);
#else
  return f_select(a < c, a, c);
#endif
}

// a * b + c with one rounding.
FUS_HD float f_fma(float a, float b, float c) {
#if defined(__CUDA_ARCH__)
  return __fmaf_rn(a, b, c);
#else
  return std::fma(a, b, c);
#endif
}

FUS_HD float f_sqrt(float a) {
#if defined(__CUDA_ARCH__)
  return __fsqrt_rn(a);
#else
  return std::sqrt(a);
#endif
}

// Round to the nearest integer, ties to even (both sides use the IEEE default rounding mode).
FUS_HD float f_rint(float a) {
#if defined(__CUDA_ARCH__)
  return rintf(a);
#else
  return std::nearbyint(a);
#endif
}

// x * s as the x86 host computes it, NaN operands included: a NaN operand is returned quieted with
// its sign and payload (the first NaN operand when both are), where the GPU would return its
// canonical NaN. (The casts of the quantize family use numerics.h's scale_element, whose NaN rule
// is defined independently of the host; the fused kernels use that one too.)
FUS_HD float mul_like_host(float x, float s) {
#if defined(__CUDA_ARCH__)
  const uint32_t xb = float_as_bits(x), sb = float_as_bits(s);
  if (is_nan_bits(xb)) return bits_as_float(xb | 0x400000u);
  if (is_nan_bits(sb)) return bits_as_float(sb | 0x400000u);
  return __fmul_rn(x, s);
#else
  return x * s;
#endif
}

// Rounds an fp32 value to a high-precision storage type and back (exact widening), so a fused
// kernel quantizes exactly the value it stores.
template <typename T>
FUS_HD float round_to(float v);
template <>
FUS_HD float round_to<float>(float v) {
  return v;
}
template <>
FUS_HD float round_to<Bf16>(float v) {
  return bf16_to_float(float_to_bf16(v));
}
template <>
FUS_HD float round_to<Half>(float v) {
  return half_to_float(float_to_half(v));
}

}  // namespace fusible
