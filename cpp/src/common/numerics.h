// Shared numerics of the CPU and CUDA backends: fp8 / e8m0 / bf16 / fp16 encode and decode, and
// the scale rules documented in fusible/quantize.h and fusible/recipe.h. Everything here is
// __host__ __device__ so both backends compute with the same code; on the device, the fp8 encode
// uses the hardware conversion, which tests prove bit-identical to the software path.
#pragma once

#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#define FUS_HD __host__ __device__ __forceinline__
#else
#define FUS_HD inline
#endif

namespace fusible {

FUS_HD uint32_t float_as_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  return u;
#endif
}

FUS_HD float bits_as_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
#endif
}

FUS_HD bool is_nan_bits(uint32_t u) { return (u & 0x7fffffffu) > 0x7f800000u; }

// |x| as ordered bits: for non-negative floats, unsigned comparison of bits equals float
// comparison, and every NaN compares above +inf, so max over these bits propagates NaN.
FUS_HD uint32_t abs_bits(float x) { return float_as_bits(x) & 0x7fffffffu; }

// ---- bf16 / fp16 -------------------------------------------------------------------------------

FUS_HD float bf16_to_float(uint16_t h) { return bits_as_float(static_cast<uint32_t>(h) << 16); }

FUS_HD uint16_t float_to_bf16(float f) {
  uint32_t u = float_as_bits(f);
  if (is_nan_bits(u)) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // quiet NaN, keep sign
#if defined(__CUDA_ARCH__)
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));  // cvt.rn.bf16.f32: the same RNE
#endif
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return static_cast<uint16_t>(u >> 16);
}

// Exact widening. The device's __half2float drops the sign and payload of a NaN, so NaNs are
// widened in software on both sides.
FUS_HD float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
#if defined(__CUDA_ARCH__)
  if ((h & 0x7fffu) <= 0x7c00u) return __half2float(__ushort_as_half(h));
  return bits_as_float(sign | 0x7f800000u | (static_cast<uint32_t>(h & 0x3ffu) << 13));
#endif
  const uint32_t exp = (h >> 10) & 0x1fu;
  const uint32_t man = h & 0x3ffu;
  if (exp == 0x1f) return bits_as_float(sign | 0x7f800000u | (man << 13));
  if (exp == 0) {
    // zero or subnormal: man * 2^-24, exact in fp32
    const float v = static_cast<float>(man) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return bits_as_float(sign | ((exp + 112u) << 23) | (man << 13));
}

FUS_HD uint16_t float_to_half(float f) {
  const uint32_t u = float_as_bits(f);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7fffffffu;
  // NaN on both sides in software: the device's __float2half_rn returns the canonical 0x7FFF,
  // dropping the sign and payload the host keeps.
  if (a > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((a >> 13) & 0x3ffu));
#if defined(__CUDA_ARCH__)
  return __half_as_ushort(__float2half_rn(f));
#else
  if (a >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (a < 0x38800000u) {
    // below the smallest normal half (2^-14): subnormal quantum 2^-24
    const float v = std::rint(bits_as_float(a) * 16777216.0f);
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(v));
  }
  uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
  r = (r >> 13) - (112u << 10);
  return static_cast<uint16_t>(sign | r);
#endif
}

// ---- fp8 ---------------------------------------------------------------------------------------

enum class Fp8Format { kE4M3, kE5M2 };

template <Fp8Format F>
struct Fp8Traits;

template <>
struct Fp8Traits<Fp8Format::kE4M3> {
  static constexpr int kMantBits = 3;
  static constexpr int kBias = 7;
  static constexpr uint8_t kMaxCode = 0x7e;  // 448
  static constexpr int kEmax = 8;            // exponent of the largest normal (OCP MX emax_elem)
  static constexpr bool kHasInf = false;
};

template <>
struct Fp8Traits<Fp8Format::kE5M2> {
  static constexpr int kMantBits = 2;
  static constexpr int kBias = 15;
  static constexpr uint8_t kMaxCode = 0x7b;  // 57344
  static constexpr int kEmax = 15;
  static constexpr bool kHasInf = true;
};

template <Fp8Format F>
FUS_HD float fp8_max_value() {
  return F == Fp8Format::kE4M3 ? 448.0f : 57344.0f;
}

// Software encode: round to nearest even, saturate to +-max (inf too), NaN -> 0x7F | sign.
template <Fp8Format F>
FUS_HD uint8_t float_to_fp8_soft(float f) {
  using T = Fp8Traits<F>;
  const uint32_t u = float_as_bits(f);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<uint8_t>(sign | 0x7fu);
  uint32_t code;
  const int exp = static_cast<int>(a >> 23) - 127;
  if (exp < 1 - T::kBias) {
    // Below the smallest normal fp8: multiples of the subnormal quantum 2^(1 - bias - mant).
    // The scaling by a power of two is exact; rint rounds to nearest even.
    const float scaled = bits_as_float(a) * static_cast<float>(1u << (T::kBias - 1 + T::kMantBits));
    code = static_cast<uint32_t>(rintf(scaled));
  } else {
    constexpr uint32_t kShift = 23 - T::kMantBits;
    uint32_t r = a + ((1u << (kShift - 1)) - 1u) + ((a >> kShift) & 1u);
    r >>= kShift;
    code = r - (static_cast<uint32_t>(127 - T::kBias) << T::kMantBits);
    if (code > T::kMaxCode) code = T::kMaxCode;
  }
  return static_cast<uint8_t>(sign | code);
}

template <Fp8Format F>
FUS_HD uint8_t float_to_fp8(float f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  // Hardware cvt.rn.satfinite; only the NaN encoding differs from the specification.
  const __nv_fp8_storage_t q =
      __nv_cvt_float_to_fp8(f, __NV_SATFINITE, F == Fp8Format::kE4M3 ? __NV_E4M3 : __NV_E5M2);
  const uint32_t u = float_as_bits(f);
  return is_nan_bits(u) ? static_cast<uint8_t>(((u >> 24) & 0x80u) | 0x7fu)
                        : static_cast<uint8_t>(q);
#else
  return float_to_fp8_soft<F>(f);
#endif
}

template <Fp8Format F>
FUS_HD float fp8_to_float(uint8_t q) {
  using T = Fp8Traits<F>;
  const uint32_t sign = static_cast<uint32_t>(q & 0x80u) << 24;
  const uint32_t exp = (q & 0x7fu) >> T::kMantBits;
  const uint32_t man = q & ((1u << T::kMantBits) - 1u);
  constexpr uint32_t kExpMax = (1u << (7 - T::kMantBits)) - 1u;
  if (T::kHasInf) {
    if (exp == kExpMax) return bits_as_float(sign | 0x7f800000u | (man ? 0x400000u : 0u));
  } else if ((q & 0x7fu) == 0x7fu) {
    return bits_as_float(sign | 0x7fc00000u);
  }
  if (exp == 0) {
    // subnormal: man * 2^(1 - bias - mant), exact
    const float v =
        static_cast<float>(man) / static_cast<float>(1u << (T::kBias - 1 + T::kMantBits));
    return sign ? -v : v;
  }
  return bits_as_float(sign | ((exp + 127u - T::kBias) << 23) | (man << (23 - T::kMantBits)));
}

// ---- scales ------------------------------------------------------------------------------------

// Per-tensor scale rule (quantize.h): never inf or NaN.
FUS_HD float compute_scale(float amax, float fp8_max, int margin, float fallback) {
  const uint32_t a = float_as_bits(amax);
  if (!(amax > 0.0f) || a >= 0x7f800000u) return fallback;
  float s = ldexpf(fp8_max / amax, -margin);
  if (float_as_bits(s) >= 0x7f800000u) s = FLT_MAX;
  return s;
}

// Blockwise FP8 scale of one block (quantize.h): the per-tensor rule on max(amax, epsilon) with
// fallback 1 (margin 0), then, with pow2, rounded down to a power of two by clearing the mantissa
// (the scale is a normal float here, so that is floor to 2^k, and scale_inv = 2^-k exactly).
FUS_HD float block_scale(float amax, float fp8_max, float epsilon, bool pow2) {
  float m = amax;
  if (!is_nan_bits(float_as_bits(m)) && m < epsilon) m = epsilon;  // a NaN amax stays NaN
  float s = compute_scale(m, fp8_max, 0, 1.0f);
  if (pow2) s = bits_as_float(float_as_bits(s) & 0xff800000u);
  return s;
}

constexpr uint8_t kE8M0Nan = 0xff;

// E8M0 scale byte for a block with the given amax (OCP MX rule, see quantize.h). floor(log2(amax))
// is read off the float's exponent field exactly (subnormals included).
template <Fp8Format F>
FUS_HD uint8_t e8m0_from_amax(float amax) {
  const uint32_t a = float_as_bits(amax) & 0x7fffffffu;
  if (a >= 0x7f800000u) return kE8M0Nan;
  if (a == 0) return 0;
  int e = static_cast<int>(a >> 23) - 127;
  if ((a >> 23) == 0) {  // fp32 subnormal: exponent of the leading mantissa bit
    uint32_t m = a;
    e = -127;
    while (m < 0x400000u) {
      m <<= 1;
      --e;
    }
  }
  int biased = e - Fp8Traits<F>::kEmax + 127;
  if (biased < 0) biased = 0;
  if (biased > 254) biased = 254;
  return static_cast<uint8_t>(biased);
}

// 2^(s - 127) as a float; s in [0, 254]. 2^-127 is an fp32 subnormal, still exact.
FUS_HD float e8m0_to_float(uint8_t s) {
  if (s == kE8M0Nan) return bits_as_float(0x7fc00000u);
  if (s == 0) return bits_as_float(0x00400000u);
  return bits_as_float(static_cast<uint32_t>(s) << 23);
}

// The factor elements are multiplied by before the cast: 2^(127 - s). For s = 254 this is 2^-127
// (subnormal, exact); for s = 0 it is 2^127. NaN scale gives NaN.
FUS_HD float e8m0_inverse(uint8_t s) {
  if (s == kE8M0Nan) return bits_as_float(0x7fc00000u);
  if (s == 254) return bits_as_float(0x00400000u);
  return bits_as_float(static_cast<uint32_t>(254 - s) << 23);
}

// x * s with a defined NaN result, for every scaled cast and every dequantize: a NaN x keeps its
// sign; any other NaN product (a NaN scale such as the MXFP8 block scale 0xFF, or inf * 0) is +NaN.
// (x * s alone leaves the NaN's sign to the operand order the compiler picks, so the two backends,
// or two builds of one, could differ.)
FUS_HD float scale_element(float x, float s) {
  if (is_nan_bits(float_as_bits(x))) return x;
  const float p = x * s;
  return is_nan_bits(float_as_bits(p)) ? bits_as_float(0x7fc00000u) : p;
}

// fp8(scale_element(x[i], s[i])) for four elements, byte i of the word: the cast every kernel
// does. On sm_89+ the products go through paired hardware conversions (cvt.rn.satfinite.*x2,
// first element in the low byte); only when a product is NaN (rare) does the word come from the
// per-element path, which defines the NaN's sign. The result is the per-element one either way:
// a product that is not NaN comes from an x that is not NaN, and scale_element returns it as is.
template <Fp8Format F>
FUS_HD uint32_t scaled_fp8x4(const float (&x)[4], const float (&s)[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  float p[4];
  bool nan = false;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    p[i] = x[i] * s[i];
    nan |= p[i] != p[i];
  }
  if (!nan) {
    constexpr __nv_fp8_interpretation_t kInterp = F == Fp8Format::kE4M3 ? __NV_E4M3 : __NV_E5M2;
    const uint32_t lo = __nv_cvt_float2_to_fp8x2(make_float2(p[0], p[1]), __NV_SATFINITE, kInterp);
    const uint32_t hi = __nv_cvt_float2_to_fp8x2(make_float2(p[2], p[3]), __NV_SATFINITE, kInterp);
    return lo | (hi << 16);
  }
#endif
  uint32_t w = 0;
  for (int i = 0; i < 4; ++i)
    w |= static_cast<uint32_t>(float_to_fp8<F>(scale_element(x[i], s[i]))) << (8 * i);
  return w;
}

// The same with one multiplier for all four.
template <Fp8Format F>
FUS_HD uint32_t scaled_fp8x4(const float (&x)[4], float s) {
  const float ss[4] = {s, s, s, s};
  return scaled_fp8x4<F>(x, ss);
}

// ---- element loads / stores by dtype code (fusible/common.h values) -----------------------------

template <typename T>
struct Element;

struct Bf16 {
  uint16_t bits;
};
struct Half {
  uint16_t bits;
};

template <>
struct Element<float> {
  static FUS_HD float load(const float* p, int64_t i) { return p[i]; }
  static FUS_HD void store(float* p, int64_t i, float v) { p[i] = v; }
};
template <>
struct Element<Bf16> {
  static FUS_HD float load(const Bf16* p, int64_t i) { return bf16_to_float(p[i].bits); }
  static FUS_HD void store(Bf16* p, int64_t i, float v) { p[i].bits = float_to_bf16(v); }
};
template <>
struct Element<Half> {
  static FUS_HD float load(const Half* p, int64_t i) { return half_to_float(p[i].bits); }
  static FUS_HD void store(Half* p, int64_t i, float v) { p[i].bits = float_to_half(v); }
};

}  // namespace fusible
