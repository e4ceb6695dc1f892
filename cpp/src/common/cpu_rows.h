// Host-only helpers of the CPU kernels: the element casts of numerics.h in a form whose loops
// vectorise, and contiguous runs of high-precision elements to and from fp32 buffers with the
// dtype branch outside the element loop (inside with_cpu_isa, common/cpu_runtime.h). Exact
// widening and the RNE stores of numerics.h, element by element: the same bits as load_hp /
// store_hp (common/hp_access.h).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include "common/cpu_runtime.h"
#include "common/numerics.h"
#include "fusible/common.h"

namespace fusible {

// Elements per fp32 buffer of a row loop: a few of them stay in L1.
constexpr int64_t kCpuSeg = 512;

// ---- the casts of numerics.h in select form -----------------------------------------------------
// The same functions as scale_element, float_to_fp8_soft, float_to_bf16, float_to_half and
// half_to_float of common/numerics.h (host versions), written without early returns so that loops over them
// vectorise: every branch is computed and the result selected. The quantize tests compare them
// with the originals on every float (tests/cpp/quantize/test_quantize_legacy.cpp).

// rint(x) for 0 <= x < 2^22 in the default rounding mode (to nearest, ties to even): x + 2^23
// lies in [2^23, 2^24), where the float spacing is 1, so the addition rounds x to an integer, ties
// to the even one; the subtraction is exact. As an int32.
FUS_ALWAYS_INLINE int32_t rint_small(float x) {
  return static_cast<int32_t>((x + 8388608.0f) - 8388608.0f);
}

FUS_ALWAYS_INLINE float half_to_float_sel(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  const float sub = bits_as_float(
      sign | float_as_bits(static_cast<float>(man) * 5.9604644775390625e-8f));  // man 2^-24
  const float inf_nan = bits_as_float(sign | 0x7f800000u | (man << 13));
  const float norm = bits_as_float(sign | ((exp + 112u) << 23) | (man << 13));
  return exp == 0x1fu ? inf_nan : (exp == 0 ? sub : norm);
}

FUS_ALWAYS_INLINE float scale_element_sel(float x, float s) {
  const float p = x * s;
  const float r = is_nan_bits(float_as_bits(p)) ? bits_as_float(0x7fc00000u) : p;
  return is_nan_bits(float_as_bits(x)) ? x : r;
}

template <Fp8Format F>
FUS_ALWAYS_INLINE uint8_t float_to_fp8_sel(float f) {
  using T = Fp8Traits<F>;
  const uint32_t u = float_as_bits(f);
  const uint32_t sign = (u >> 24) & 0x80u;
  const uint32_t a = u & 0x7fffffffu;
  // Below the smallest normal fp8: rint of the exactly scaled value (then < 2^mant; the clamp
  // only keeps the other branch's lanes in range).
  const float scaled = bits_as_float(a) * static_cast<float>(1u << (T::kBias - 1 + T::kMantBits));
  const uint32_t sub = static_cast<uint32_t>(rint_small(scaled < 256.0f ? scaled : 0.0f));
  constexpr uint32_t kShift = 23 - T::kMantBits;
  uint32_t r = (a + ((1u << (kShift - 1)) - 1u) + ((a >> kShift) & 1u)) >> kShift;
  r = r - (static_cast<uint32_t>(127 - T::kBias) << T::kMantBits);
  r = r > T::kMaxCode ? T::kMaxCode : r;
  // exp < 1 - bias, i.e. a < 2^(1 - bias) as bits
  constexpr uint32_t kMinNormal = static_cast<uint32_t>(128 - T::kBias) << 23;
  uint32_t code = a < kMinNormal ? sub : r;
  code = a > 0x7f800000u ? 0x7fu : code;
  return static_cast<uint8_t>(sign | code);
}

FUS_ALWAYS_INLINE uint16_t float_to_bf16_sel(float f) {
  const uint32_t u = float_as_bits(f);
  const uint16_t nan = static_cast<uint16_t>((u >> 16) | 0x0040u);
  const uint16_t rn = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  return is_nan_bits(u) ? nan : rn;
}

FUS_ALWAYS_INLINE uint16_t float_to_half_sel(float f) {
  const uint32_t u = float_as_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7fffffffu;
  const uint32_t nan = sign | 0x7e00u | ((a >> 13) & 0x3ffu);
  const uint32_t inf = sign | 0x7c00u;
  // below 2^-14: subnormal quantum 2^-24 (rint of the exactly scaled value, < 1024)
  const float sv = bits_as_float(a < 0x38800000u ? a : 0u) * 16777216.0f;
  const uint32_t sub = sign | static_cast<uint32_t>(rint_small(sv));
  const uint32_t norm = sign | (((a + 0xfffu + ((a >> 13) & 1u)) >> 13) - (112u << 10));
  uint32_t h = a < 0x38800000u ? sub : norm;
  h = a >= 0x477ff000u ? inf : h;
  h = a > 0x7f800000u ? nan : h;
  return static_cast<uint16_t>(h);
}

// ---- runs of elements ---------------------------------------------------------------------------

// dst[j] = element i0 + j of the dt matrix at base, j < n.
FUS_ALWAYS_INLINE void load_run(fus_dtype dt, const void* base, int64_t i0, int64_t n, float* dst) {
  if (dt == FUS_FLOAT32) {
    const float* p = static_cast<const float*>(base) + i0;
    for (int64_t j = 0; j < n; ++j) dst[j] = p[j];
  } else if (dt == FUS_BFLOAT16) {
    const uint16_t* p = static_cast<const uint16_t*>(base) + i0;
    for (int64_t j = 0; j < n; ++j) dst[j] = bf16_to_float(p[j]);
  } else {
    const uint16_t* p = static_cast<const uint16_t*>(base) + i0;
    for (int64_t j = 0; j < n; ++j) dst[j] = half_to_float_sel(p[j]);
  }
}

// Elements i0 .. i0 + n - 1 of the dt matrix at base as fp32: the matrix itself when it is fp32,
// else widened into buf.
FUS_ALWAYS_INLINE const float* run_f32(fus_dtype dt, const void* base, int64_t i0, int64_t n,
                                       float* buf) {
  if (dt == FUS_FLOAT32) return static_cast<const float*>(base) + i0;
  load_run(dt, base, i0, n, buf);
  return buf;
}

// Element i0 + j of the dt matrix at base = src[j] rounded to dt, j < n.
FUS_ALWAYS_INLINE void store_run(fus_dtype dt, void* base, int64_t i0, int64_t n,
                                 const float* src) {
  if (dt == FUS_FLOAT32) {
    float* p = static_cast<float*>(base) + i0;
    for (int64_t j = 0; j < n; ++j) p[j] = src[j];
  } else if (dt == FUS_BFLOAT16) {
    uint16_t* p = static_cast<uint16_t*>(base) + i0;
    for (int64_t j = 0; j < n; ++j) p[j] = float_to_bf16_sel(src[j]);
  } else {
    uint16_t* p = static_cast<uint16_t*>(base) + i0;
    for (int64_t j = 0; j < n; ++j) p[j] = float_to_half_sel(src[j]);
  }
}

// ---- byte transposes ----------------------------------------------------------------------------

// dst[c * ds + r] = src[r * ss + c] for r < rows, c < cols (FP8 codes, E8M0 scales: a byte move).
FUS_ALWAYS_INLINE void transpose_bytes(const uint8_t* src, int64_t ss, int64_t rows, int64_t cols,
                                       uint8_t* dst, int64_t ds) {
  int64_t r8 = 0, c8 = 0;
#if defined(__SSE2__)
  r8 = rows / 8 * 8;
  c8 = cols / 8 * 8;
  // Columns outside: each destination line is completed before the next (with power-of-two
  // strides the destination lines of a whole tile would share a few cache sets).
  for (int64_t c = 0; c < c8; c += 8) {
    for (int64_t r = 0; r < r8; r += 8) {
      const uint8_t* s = src + r * ss + c;
      __m128i x[8];
      for (int i = 0; i < 8; ++i)
        x[i] = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(s + i * ss));
      const __m128i t0 = _mm_unpacklo_epi8(x[0], x[1]), t1 = _mm_unpacklo_epi8(x[2], x[3]),
                    t2 = _mm_unpacklo_epi8(x[4], x[5]), t3 = _mm_unpacklo_epi8(x[6], x[7]);
      const __m128i u0 = _mm_unpacklo_epi16(t0, t1), u1 = _mm_unpackhi_epi16(t0, t1),
                    u2 = _mm_unpacklo_epi16(t2, t3), u3 = _mm_unpackhi_epi16(t2, t3);
      const __m128i v[4] = {_mm_unpacklo_epi32(u0, u2), _mm_unpackhi_epi32(u0, u2),
                            _mm_unpacklo_epi32(u1, u3), _mm_unpackhi_epi32(u1, u3)};
      uint8_t* d = dst + c * ds + r;
      for (int i = 0; i < 4; ++i) {  // v[i] holds columns 2i and 2i + 1
        _mm_storel_epi64(reinterpret_cast<__m128i*>(d + (2 * i) * ds), v[i]);
        _mm_storel_epi64(reinterpret_cast<__m128i*>(d + (2 * i + 1) * ds), _mm_srli_si128(v[i], 8));
      }
    }
  }
#endif
  for (int64_t c = 0; c < cols; ++c) {
    const int64_t r_begin = c < c8 ? r8 : 0;  // the 8 x 8 blocks did rows < r8 of columns < c8
    for (int64_t r = r_begin; r < rows; ++r) dst[c * ds + r] = src[r * ss + c];
  }
}

}  // namespace fusible
