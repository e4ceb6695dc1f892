// CPU backend of the gemm family: the reference of the numerics in fusible/gemm.h.
//
// Summation order (the specification): every output element has one fp32 accumulator that starts
// at +0 and receives its products op(A)[m, k] * op(B)[k, n] one at a time in ascending k, each
// product and each addition rounded separately (the library is built with -ffp-contract=off,
// CMakeLists.txt, and the vector kernels use separate multiply and add instructions; a fused
// multiply-add only for panels whose products are all exact, where it rounds identically, see
// exact_products). Everything else is memory order, which never changes a bit:
//
//  - Blocking for cache (GotoBLAS / BLIS): a task owns a block of output columns [j0, j0 + nc) and
//    rows [r0, r1). For each K panel of kKc, it packs op(B)[k0:k0+kc, j0:j0+nc] into column strips
//    of NR (FP8 decoded exactly through a 256-entry table, fp16/bf16 widened exactly, zero padded),
//    then for each block of kMc rows packs op(A) into row strips of MR, and a register-blocked
//    micro-kernel adds the panel's products to MR x NR accumulators: loaded from the task's fp32
//    accumulator buffer (or +0 for the first panel), k ascending, stored back. Padded rows and
//    columns are computed and ignored.
//  - The epilogue runs on the finished accumulators of the task, row by row in ascending row, each
//    step a vectorisable loop over the row (t = (alpha * s) * acc, + beta * C, + bias, GELU / dGELU,
//    rounding to D, amax, the dbias sum), exactly the per-element operations of gemm.h.
//  - Tasks write disjoint parts of D / aux and run on the CPU backend's threads in any order
//    (common/cpu_runtime.h). amax is a max, combined over tasks. With DGELU_BGRAD a task owns its
//    columns over all rows (in ascending row blocks), so every dbias[n] is summed in ascending m
//    by one task.
//  - Micro-kernels: AVX-512 (8 x 32), AVX2 (6 x 16) and a portable one (4 x 8, auto-vectorised);
//    cpu_isa() picks one. All perform the same per-element operations in the same order
//    (tests/cpp/gemm/test_gemm_legacy.cpp compares them with the scalar loop they replaced).
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <type_traits>
#include <vector>

#include "common/activation_math.h"
#include "common/cpu_rows.h"
#include "common/cpu_runtime.h"
#include "common/dispatch.h"
#include "common/fp32_ops.h"
#include "gemm/gemm_impl.h"

#if FUS_CPU_X86
#include <immintrin.h>
#endif

namespace fusible {
namespace {

constexpr int64_t kKc = 256;        // depth of a packed panel
constexpr int64_t kMc = 96;         // rows of a packed A block (a multiple of every MR)
constexpr int64_t kNcMax = 512;     // columns of a task (a multiple of every NR)
constexpr int64_t kRowsMax = 1024;  // rows of a task's accumulator buffer (a multiple of kMc)

// Value table of an FP8 dtype: every code decoded exactly.
struct Fp8Table {
  float v[256];
  explicit Fp8Table(fus_dtype dtype) {
    for (int i = 0; i < 256; ++i) {
      const uint8_t q = static_cast<uint8_t>(i);
      v[i] = dtype == FUS_FLOAT8_E4M3 ? fp8_to_float<Fp8Format::kE4M3>(q)
                                      : fp8_to_float<Fp8Format::kE5M2>(q);
    }
  }
};

const float* fp8_table(fus_dtype dtype) {
  static const Fp8Table e4m3(FUS_FLOAT8_E4M3), e5m2(FUS_FLOAT8_E5M2);
  return dtype == FUS_FLOAT8_E4M3 ? e4m3.v : e5m2.v;
}

// Element loaders: load(i) -> the exact fp32 value of element i.
struct LoadF32 {
  const float* p;
  FUS_ALWAYS_INLINE float operator()(int64_t i) const { return p[i]; }
};
struct LoadHalf {
  const uint16_t* p;
  FUS_ALWAYS_INLINE float operator()(int64_t i) const { return half_to_float_sel(p[i]); }
};
struct LoadBf16 {
  const uint16_t* p;
  FUS_ALWAYS_INLINE float operator()(int64_t i) const { return bf16_to_float(p[i]); }
};
struct LoadFp8 {
  const uint8_t* p;
  const float* table;
  FUS_ALWAYS_INLINE float operator()(int64_t i) const { return table[p[i]]; }
};

// Calls f(load) with the loader of a matrix stored as dtype.
template <typename F>
FUS_ALWAYS_INLINE void with_loader(fus_dtype dtype, const void* data, F&& f) {
  switch (dtype) {
    case FUS_FLOAT32: f(LoadF32{static_cast<const float*>(data)}); return;
    case FUS_FLOAT16: f(LoadHalf{static_cast<const uint16_t*>(data)}); return;
    case FUS_BFLOAT16: f(LoadBf16{static_cast<const uint16_t*>(data)}); return;
    case FUS_FLOAT8_E4M3:
    case FUS_FLOAT8_E5M2: f(LoadFp8{static_cast<const uint8_t*>(data), fp8_table(dtype)}); return;
    default: throw Error(FUS_ERROR_INTERNAL, "fus_gemm: unexpected dtype in the CPU backend");
  }
}

// A 64-byte aligned float buffer that only grows (one per thread and use, kept between calls).
struct Scratch {
  float* p = nullptr;
  size_t n = 0;
  float* get(size_t count) {
    if (count > n) {
      std::free(p);
      const size_t bytes = ((count * sizeof(float) + 63) / 64) * 64;
      p = static_cast<float*>(std::aligned_alloc(64, bytes));
      if (p == nullptr) throw Error(FUS_ERROR_INTERNAL, "fus_gemm: out of memory (CPU scratch)");
      n = count;
    }
    return p;
  }
  ~Scratch() { std::free(p); }
};

// Everything a task needs, computed once per call.
struct Plan {
  const fus_gemm_args* args;
  const GemmShape* s;
  float scale_ab;
  float d_scale;
  bool d_fp8;
  const float* bias;  // widened bias [N], or NULL
};

// ---- packing ------------------------------------------------------------------------------------

// What a packed panel holds, for the choice of micro-kernel: the OR of the values' bits (their
// lowest significand bit bounds the significant bits), and whether a value lies outside
// {0} U [2^-63, 2^63) in magnitude (subnormal, huge, inf or NaN).
struct PanelBits {
  uint32_t bits_or = 0;
  bool out_of_range = false;
};

FUS_ALWAYS_INLINE PanelBits panel_bits(const float* p, int64_t n) {
  uint32_t bits_or = 0, bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = float_as_bits(p[i]);
    const uint32_t e = (u >> 23) & 0xffu;
    bits_or |= u;
    bad |= static_cast<uint32_t>((u & 0x7fffffffu) != 0) & static_cast<uint32_t>(e - 64u > 125u);
  }
  return PanelBits{bits_or, bad != 0};
}

// Significant bits of the widest value (24 for any full-precision fp32 value).
inline int significant_bits(const PanelBits& p) {
  const uint32_t m = (p.bits_or & 0x7fffffu) | 0x800000u;
  return 24 - __builtin_ctz(m);
}

// Whether every product of the two panels is exact in fp32: then fma(a, b, acc) rounds exactly
// as acc + a * b does (one rounding of the same exact sum, zero signs included), and the FMA
// micro-kernel gives the same bits. Holds for FP8 and fp16 operands (at most 4 + 4 or 11 + 11
// significant bits, no under- or overflow), bf16 in the range above, and fp32 values with few
// significant bits (MXFP8 dequantized operands); never for inf or NaN.
inline bool exact_products(const PanelBits& a, const PanelBits& b) {
  return !a.out_of_range && !b.out_of_range && significant_bits(a) + significant_bits(b) <= 24;
}

// Packing. Both operands are packed as strips of W lanes (A: MR rows, B: NR columns) by kc
// depths: dst[strip * kc * W + k * W + l] = element (lane base + strip * W + l, depth k0 + k),
// zero for lanes >= n. In a lane-contiguous source (A transposed, B not) that element is
// src[(k0 + k) * ld + lane]; in a depth-contiguous one (A not transposed, B transposed)
// src[lane * ld + k0 + k], which the packing transposes.

template <int W, typename L>
FUS_ALWAYS_INLINE void pack_lane_contiguous(L load, int64_t ld, int64_t base, int64_t n, int64_t k0,
                                            int64_t kc, float* dst) {
  for (int64_t s0 = 0; s0 < n; s0 += W) {
    float* d = dst + s0 * kc;
    const int64_t w = std::min<int64_t>(W, n - s0);
    for (int64_t k = 0; k < kc; ++k) {
      const int64_t src = (k0 + k) * ld + base + s0;
      for (int64_t l = 0; l < w; ++l) d[k * W + l] = load(src + l);
      for (int64_t l = w; l < W; ++l) d[k * W + l] = 0.0f;
    }
  }
}

// rows[l * kc + k] = element (lane base + l, depth k0 + k) for l < w: one contiguous decode a lane.
template <typename L>
FUS_ALWAYS_INLINE void decode_rows(L load, int64_t ld, int64_t base, int64_t w, int64_t k0,
                                   int64_t kc, float* rows) {
  for (int64_t l = 0; l < w; ++l) {
    const int64_t src = (base + l) * ld + k0;
    float* r = rows + l * kc;
    for (int64_t k = 0; k < kc; ++k) r[k] = load(src + k);
  }
}

// Scalar transpose of rows [w lanes, kc depths] (lane stride rs) into a strip of W lanes.
template <int W>
FUS_ALWAYS_INLINE void transpose_strip_scalar(const float* rows, int64_t rs, int64_t w, int64_t kc,
                                              float* d) {
  for (int64_t k = 0; k < kc; ++k) {
    for (int64_t l = 0; l < w; ++l) d[k * W + l] = rows[l * rs + k];
    for (int64_t l = w; l < W; ++l) d[k * W + l] = 0.0f;
  }
}

template <int W, typename L>
FUS_ALWAYS_INLINE void pack_depth_contiguous_portable(L load, int64_t ld, int64_t base, int64_t n,
                                                      int64_t k0, int64_t kc, float* dst,
                                                      float* rows) {
  for (int64_t s0 = 0; s0 < n; s0 += W) {
    const int64_t w = std::min<int64_t>(W, n - s0);
    decode_rows(load, ld, base + s0, w, k0, kc, rows);
    transpose_strip_scalar<W>(rows, kc, w, kc, dst + s0 * kc);
  }
}

#if FUS_CPU_X86
// dst[i * ds + l] = src[l * ss + i] for i, l < 8.
FUS_TARGET_AVX2 FUS_ALWAYS_INLINE void transpose8x8(const float* src, int64_t ss, float* dst,
                                                    int64_t ds) {
  const __m256 r0 = _mm256_loadu_ps(src), r1 = _mm256_loadu_ps(src + ss),
               r2 = _mm256_loadu_ps(src + 2 * ss), r3 = _mm256_loadu_ps(src + 3 * ss),
               r4 = _mm256_loadu_ps(src + 4 * ss), r5 = _mm256_loadu_ps(src + 5 * ss),
               r6 = _mm256_loadu_ps(src + 6 * ss), r7 = _mm256_loadu_ps(src + 7 * ss);
  const __m256 t0 = _mm256_unpacklo_ps(r0, r1), t1 = _mm256_unpackhi_ps(r0, r1),
               t2 = _mm256_unpacklo_ps(r2, r3), t3 = _mm256_unpackhi_ps(r2, r3),
               t4 = _mm256_unpacklo_ps(r4, r5), t5 = _mm256_unpackhi_ps(r4, r5),
               t6 = _mm256_unpacklo_ps(r6, r7), t7 = _mm256_unpackhi_ps(r6, r7);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(1, 0, 1, 0)),
               u1 = _mm256_shuffle_ps(t0, t2, _MM_SHUFFLE(3, 2, 3, 2)),
               u2 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(1, 0, 1, 0)),
               u3 = _mm256_shuffle_ps(t1, t3, _MM_SHUFFLE(3, 2, 3, 2)),
               u4 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(1, 0, 1, 0)),
               u5 = _mm256_shuffle_ps(t4, t6, _MM_SHUFFLE(3, 2, 3, 2)),
               u6 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(1, 0, 1, 0)),
               u7 = _mm256_shuffle_ps(t5, t7, _MM_SHUFFLE(3, 2, 3, 2));
  _mm256_storeu_ps(dst, _mm256_permute2f128_ps(u0, u4, 0x20));
  _mm256_storeu_ps(dst + ds, _mm256_permute2f128_ps(u1, u5, 0x20));
  _mm256_storeu_ps(dst + 2 * ds, _mm256_permute2f128_ps(u2, u6, 0x20));
  _mm256_storeu_ps(dst + 3 * ds, _mm256_permute2f128_ps(u3, u7, 0x20));
  _mm256_storeu_ps(dst + 4 * ds, _mm256_permute2f128_ps(u0, u4, 0x31));
  _mm256_storeu_ps(dst + 5 * ds, _mm256_permute2f128_ps(u1, u5, 0x31));
  _mm256_storeu_ps(dst + 6 * ds, _mm256_permute2f128_ps(u2, u6, 0x31));
  _mm256_storeu_ps(dst + 7 * ds, _mm256_permute2f128_ps(u3, u7, 0x31));
}

// A full strip (w == W, W a multiple of 8) from rows with lane stride rs, by 8 x 8 blocks.
template <int W>
FUS_TARGET_AVX2 FUS_ALWAYS_INLINE void transpose_strip8(const float* rows, int64_t rs, int64_t kc,
                                                        float* d) {
  const int64_t k8 = kc / 8 * 8;
  for (int64_t k = 0; k < k8; k += 8)
    for (int l = 0; l < W; l += 8) transpose8x8(rows + l * rs + k, rs, d + k * W + l, W);
  for (int64_t k = k8; k < kc; ++k)
    for (int l = 0; l < W; ++l) d[k * W + l] = rows[l * rs + k];
}

template <int W, typename L>
FUS_TARGET_AVX2 FUS_ALWAYS_INLINE void pack_depth_contiguous_x86(L load, int64_t ld, int64_t base,
                                                                 int64_t n, int64_t k0, int64_t kc,
                                                                 float* dst, float* rows) {
  for (int64_t s0 = 0; s0 < n; s0 += W) {
    const int64_t w = std::min<int64_t>(W, n - s0);
    float* d = dst + s0 * kc;
    if (W % 8 != 0 || w < W) {
      decode_rows(load, ld, base + s0, w, k0, kc, rows);
      transpose_strip_scalar<W>(rows, kc, w, kc, d);
    } else if constexpr (std::is_same_v<L, LoadF32>) {
      transpose_strip8<W>(load.p + (base + s0) * ld + k0, ld, kc, d);
    } else {
      decode_rows(load, ld, base + s0, w, k0, kc, rows);
      transpose_strip8<W>(rows, kc, kc, d);
    }
  }
}
#endif

// ---- micro-kernels ------------------------------------------------------------------------------
// c[r * ldc + j] (r < MR, j < NR) = (first ? +0 : c) + a[k * MR + r] * b[k * NR + j] for k
// ascending: one rounded product and one rounded addition at a time.

template <int MR, int NR>
FUS_ALWAYS_INLINE void micro_portable(const float* a, const float* b, int64_t kc, float* c,
                                      int64_t ldc, bool first) {
  float acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) acc[r][j] = first ? 0.0f : c[r * ldc + j];
  for (int64_t k = 0; k < kc; ++k) {
    const float* ak = a + k * MR;
    const float* bk = b + k * NR;
    for (int r = 0; r < MR; ++r) {
      const float x = ak[r];
      for (int j = 0; j < NR; ++j) acc[r][j] = acc[r][j] + x * bk[j];
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int j = 0; j < NR; ++j) c[r * ldc + j] = acc[r][j];
}

#if FUS_CPU_X86
// Fma: fused multiply-adds, for panels whose products are all exact (exact_products).
template <bool Fma>
FUS_TARGET_AVX2 void micro_avx2(const float* a, const float* b, int64_t kc, float* c, int64_t ldc,
                                bool first) {
  constexpr int MR = 6;
  __m256 acc[MR][2];
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
    acc[r][0] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + r * ldc);
    acc[r][1] = first ? _mm256_setzero_ps() : _mm256_loadu_ps(c + r * ldc + 8);
  }
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 b0 = _mm256_loadu_ps(b + k * 16), b1 = _mm256_loadu_ps(b + k * 16 + 8);
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      const __m256 x = _mm256_broadcast_ss(a + k * MR + r);
      if (Fma) {
        acc[r][0] = _mm256_fmadd_ps(x, b0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(x, b1, acc[r][1]);
      } else {
        acc[r][0] = _mm256_add_ps(acc[r][0], _mm256_mul_ps(x, b0));
        acc[r][1] = _mm256_add_ps(acc[r][1], _mm256_mul_ps(x, b1));
      }
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
    _mm256_storeu_ps(c + r * ldc, acc[r][0]);
    _mm256_storeu_ps(c + r * ldc + 8, acc[r][1]);
  }
}

template <bool Fma>
FUS_TARGET_AVX512 void micro_avx512(const float* a, const float* b, int64_t kc, float* c,
                                    int64_t ldc, bool first) {
  constexpr int MR = 8;
  __m512 acc[MR][2];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    acc[r][0] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + r * ldc);
    acc[r][1] = first ? _mm512_setzero_ps() : _mm512_loadu_ps(c + r * ldc + 16);
  }
  for (int64_t k = 0; k < kc; ++k) {
    const __m512 b0 = _mm512_loadu_ps(b + k * 32), b1 = _mm512_loadu_ps(b + k * 32 + 16);
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const __m512 x = _mm512_set1_ps(a[k * MR + r]);
      if (Fma) {
        acc[r][0] = _mm512_fmadd_ps(x, b0, acc[r][0]);
        acc[r][1] = _mm512_fmadd_ps(x, b1, acc[r][1]);
      } else {
        acc[r][0] = _mm512_add_ps(acc[r][0], _mm512_mul_ps(x, b0));
        acc[r][1] = _mm512_add_ps(acc[r][1], _mm512_mul_ps(x, b1));
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
    _mm512_storeu_ps(c + r * ldc, acc[r][0]);
    _mm512_storeu_ps(c + r * ldc + 16, acc[r][1]);
  }
}
#endif

// ---- epilogue -----------------------------------------------------------------------------------

template <typename T>
struct Hp;  // fp32 / fp16 / bf16 element access
template <>
struct Hp<float> {
  using S = float;
  static FUS_ALWAYS_INLINE float load(const S* p, int64_t i) { return p[i]; }
  static FUS_ALWAYS_INLINE void store(S* p, int64_t i, float v) { p[i] = v; }
};
template <>
struct Hp<Half> {
  using S = uint16_t;
  static FUS_ALWAYS_INLINE float load(const S* p, int64_t i) { return half_to_float_sel(p[i]); }
  static FUS_ALWAYS_INLINE void store(S* p, int64_t i, float v) { p[i] = float_to_half_sel(v); }
};
template <>
struct Hp<Bf16> {
  using S = uint16_t;
  static FUS_ALWAYS_INLINE float load(const S* p, int64_t i) { return bf16_to_float(p[i]); }
  static FUS_ALWAYS_INLINE void store(S* p, int64_t i, float v) { p[i] = float_to_bf16_sel(v); }
};

template <typename F>
FUS_ALWAYS_INLINE void with_hp(fus_dtype dtype, F&& f) {
  switch (dtype) {
    case FUS_FLOAT32: f(float{}); return;
    case FUS_FLOAT16: f(Half{}); return;
    case FUS_BFLOAT16: f(Bf16{}); return;
    default: throw Error(FUS_ERROR_INTERNAL, "fus_gemm: unexpected epilogue dtype");
  }
}

// t[j] += beta * C[j]
template <typename T>
FUS_ALWAYS_INLINE void ep_add_c(float* t, int64_t n, float beta, const void* c) {
  const auto* p = static_cast<const typename Hp<T>::S*>(c);
  for (int64_t j = 0; j < n; ++j) t[j] = f_add(t[j], f_mul(beta, Hp<T>::load(p, j)));
}

template <typename T>
FUS_ALWAYS_INLINE void ep_store(const float* v, int64_t n, void* out) {
  auto* p = static_cast<typename Hp<T>::S*>(out);
  for (int64_t j = 0; j < n; ++j) Hp<T>::store(p, j, v[j]);
}

// r[j] = t[j] * gelu'(aux[j])
template <typename T>
FUS_ALWAYS_INLINE void ep_dgelu(float* t, int64_t n, const void* aux) {
  const auto* p = static_cast<const typename Hp<T>::S*>(aux);
  for (int64_t j = 0; j < n; ++j) t[j] = f_mul(t[j], dgelu_tanh(Hp<T>::load(p, j)));
}

template <Fp8Format F>
FUS_ALWAYS_INLINE uint32_t ep_store_fp8(const float* v, int64_t n, float scale, uint8_t* out,
                                        uint32_t amax) {
  for (int64_t j = 0; j < n; ++j) {
    out[j] = float_to_fp8_sel<F>(v[j] * scale);
    amax = std::max(amax, abs_bits(v[j]));
  }
  return amax;
}

// The epilogue of one row segment: t (fp32 accumulators of row `row`, columns [j0, j0 + n)) is
// turned into r in place and stored.
FUS_ALWAYS_INLINE void epilogue_row(const Plan& pl, int64_t row, int64_t j0, int64_t n, float* t,
                                    float* dbias, uint32_t* amax) {
  const fus_gemm_args& a = *pl.args;
  const GemmShape& s = *pl.s;
  const int64_t idx = row * s.n + j0;
  const size_t d_size = fus_dtype_size(a.d.dtype);
  if (pl.scale_ab != 1.0f) {  // x * 1 == x for every x an accumulation can produce
    const float sc = pl.scale_ab;
    for (int64_t j = 0; j < n; ++j) t[j] = f_mul(sc, t[j]);
  }
  if (s.has_c) {
    const void* c = static_cast<const uint8_t*>(a.c.data) + idx * fus_dtype_size(a.c.dtype);
    with_hp(a.c.dtype, [&](auto tag) { ep_add_c<decltype(tag)>(t, n, a.beta, c); });
  }
  if (s.uses_bias) {
    const float* b = pl.bias + j0;
    for (int64_t j = 0; j < n; ++j) t[j] = f_add(t[j], b[j]);
  }
  if (s.gelu) {
    if (s.writes_aux) {
      void* aux = static_cast<uint8_t*>(a.aux.data) + idx * fus_dtype_size(a.aux.dtype);
      with_hp(a.aux.dtype, [&](auto tag) { ep_store<decltype(tag)>(t, n, aux); });
    }
    for (int64_t j = 0; j < n; ++j) t[j] = gelu_tanh(t[j]);
  } else if (s.dgelu) {
    const void* aux = static_cast<const uint8_t*>(a.aux.data) + idx * fus_dtype_size(a.aux.dtype);
    with_hp(a.aux.dtype, [&](auto tag) { ep_dgelu<decltype(tag)>(t, n, aux); });
  }
  void* d = static_cast<uint8_t*>(a.d.data) + idx * d_size;
  if (pl.d_fp8) {
    uint8_t* q = static_cast<uint8_t*>(d);
    *amax = a.d.dtype == FUS_FLOAT8_E4M3
                ? ep_store_fp8<Fp8Format::kE4M3>(t, n, pl.d_scale, q, *amax)
                : ep_store_fp8<Fp8Format::kE5M2>(t, n, pl.d_scale, q, *amax);
  } else {
    with_hp(a.d.dtype, [&](auto tag) { ep_store<decltype(tag)>(t, n, d); });
  }
  if (s.bgrad)
    for (int64_t j = 0; j < n; ++j) dbias[j] = f_add(dbias[j], t[j]);
}

// ---- one task -----------------------------------------------------------------------------------

struct TaskScratch {
  Scratch ap, bp, acc, rows, dbias;
};

// The micro-kernel and packing of an instruction set. (The x86 ones are not always_inline: GCC
// inlines a function with a target attribute only into one compiled for that target, and
// run_task is compiled for each through the task_* wrappers below.)
struct PortablePolicy {
  static constexpr int MR = 4, NR = 8;
  static constexpr bool kFma = false;
  static FUS_ALWAYS_INLINE void micro(const float* a, const float* b, int64_t kc, float* c,
                                      int64_t ldc, bool first) {
    micro_portable<MR, NR>(a, b, kc, c, ldc, first);
  }
  static FUS_ALWAYS_INLINE void micro_fma(const float* a, const float* b, int64_t kc, float* c,
                                          int64_t ldc, bool first) {
    micro(a, b, kc, c, ldc, first);
  }
  template <int W, typename L>
  static FUS_ALWAYS_INLINE void pack_depth(L load, int64_t ld, int64_t base, int64_t n, int64_t k0,
                                           int64_t kc, float* dst, float* rows) {
    pack_depth_contiguous_portable<W>(load, ld, base, n, k0, kc, dst, rows);
  }
};

#if FUS_CPU_X86
// The x86 policies differ only in tile, target and micro-kernel; a target attribute cannot be a
// template argument, hence a macro.
#define FUS_X86_POLICY_(NAME, TARGET, MR_, NR_, MICRO)                                          \
  struct NAME {                                                                                 \
    static constexpr int MR = MR_, NR = NR_;                                                    \
    static constexpr bool kFma = true;                                                          \
    static TARGET void micro(const float* a, const float* b, int64_t kc, float* c, int64_t ldc, \
                             bool first) {                                                      \
      MICRO<false>(a, b, kc, c, ldc, first);                                                    \
    }                                                                                           \
    static TARGET void micro_fma(const float* a, const float* b, int64_t kc, float* c,          \
                                 int64_t ldc, bool first) {                                     \
      MICRO<true>(a, b, kc, c, ldc, first);                                                     \
    }                                                                                           \
    template <int W, typename L>                                                                \
    static TARGET void pack_depth(L load, int64_t ld, int64_t base, int64_t n, int64_t k0,      \
                                  int64_t kc, float* dst, float* rows) {                        \
      pack_depth_contiguous_x86<W>(load, ld, base, n, k0, kc, dst, rows);                       \
    }                                                                                           \
  };
FUS_X86_POLICY_(Avx2Policy, FUS_TARGET_AVX2, 6, 16, micro_avx2)
FUS_X86_POLICY_(Avx512Policy, FUS_TARGET_AVX512, 8, 32, micro_avx512)
#undef FUS_X86_POLICY_
#endif

// Output columns [j0, j0 + nc), rows [r0, r1) in blocks of at most kRowsMax rows (ascending).
template <typename P>
FUS_ALWAYS_INLINE void run_task(const Plan& pl, int64_t j0, int64_t nc, int64_t r0, int64_t r1,
                                uint32_t* amax) {
  constexpr int MR = P::MR, NR = P::NR;
  static thread_local TaskScratch ws;
  const fus_gemm_args& a = *pl.args;
  const GemmShape& s = *pl.s;
  const int64_t K = s.k;
  const int64_t kc_max = std::min<int64_t>(kKc, std::max<int64_t>(K, 1));
  const int64_t ldc = (nc + NR - 1) / NR * NR;
  const int64_t rows_max = std::min<int64_t>(kRowsMax, r1 - r0);
  float* bp = ws.bp.get(static_cast<size_t>(kc_max * ldc));
  float* ap = ws.ap.get(static_cast<size_t>(kc_max * kMc));
  float* rows = ws.rows.get(static_cast<size_t>(kc_max * std::max(MR, NR)));
  float* acc = ws.acc.get(static_cast<size_t>(((rows_max + MR - 1) / MR * MR) * ldc));
  float* dbias = nullptr;
  if (s.bgrad) {
    dbias = ws.dbias.get(static_cast<size_t>(nc));
    std::fill(dbias, dbias + nc, 0.0f);
  }
  const int64_t lda = a.transa ? s.m : s.k;
  const int64_t ldb = a.transb ? s.k : s.n;
  for (int64_t c0 = r0; c0 < r1; c0 += kRowsMax) {
    const int64_t c1 = std::min(r1, c0 + kRowsMax);
    if (K == 0) std::fill(acc, acc + (c1 - c0) * ldc, 0.0f);
    for (int64_t k0 = 0; k0 < K; k0 += kKc) {
      const int64_t kc = std::min(kKc, K - k0);
      with_loader(a.b.dtype, a.b.data, [&](auto load) {
        if (a.transb)
          P::template pack_depth<NR>(load, ldb, j0, nc, k0, kc, bp, rows);
        else
          pack_lane_contiguous<NR>(load, ldb, j0, nc, k0, kc, bp);
      });
      const PanelBits b_bits = P::kFma ? panel_bits(bp, kc * ldc) : PanelBits{~0u, true};
      for (int64_t i0 = c0; i0 < c1; i0 += kMc) {
        const int64_t mc = std::min(kMc, c1 - i0);
        with_loader(a.a.dtype, a.a.data, [&](auto load) {
          if (a.transa)
            pack_lane_contiguous<MR>(load, lda, i0, mc, k0, kc, ap);
          else
            P::template pack_depth<MR>(load, lda, i0, mc, k0, kc, ap, rows);
        });
        const int64_t mc_pad = (mc + MR - 1) / MR * MR;
        const bool fma =
            P::kFma && !b_bits.out_of_range && exact_products(panel_bits(ap, kc * mc_pad), b_bits);
        float* acc_blk = acc + (i0 - c0) * ldc;
        for (int64_t q0 = 0; q0 < nc; q0 += NR)
          for (int64_t p0 = 0; p0 < mc; p0 += MR) {
            float* c = acc_blk + p0 * ldc + q0;
            if (fma)
              P::micro_fma(ap + p0 * kc, bp + q0 * kc, kc, c, ldc, k0 == 0);
            else
              P::micro(ap + p0 * kc, bp + q0 * kc, kc, c, ldc, k0 == 0);
          }
      }
    }
    for (int64_t row = c0; row < c1; ++row)
      epilogue_row(pl, row, j0, nc, acc + (row - c0) * ldc, dbias, amax);
  }
  if (s.bgrad) {
    with_hp(a.dbias.dtype, [&](auto tag) {
      ep_store<decltype(tag)>(dbias, nc,
                              static_cast<uint8_t*>(a.dbias.data) +
                                  j0 * static_cast<int64_t>(fus_dtype_size(a.dbias.dtype)));
    });
  }
}

void task_portable(const Plan& pl, int64_t j0, int64_t nc, int64_t r0, int64_t r1, uint32_t* amax) {
  run_task<PortablePolicy>(pl, j0, nc, r0, r1, amax);
}

#if FUS_CPU_X86
FUS_TARGET_AVX2 void task_avx2(const Plan& pl, int64_t j0, int64_t nc, int64_t r0, int64_t r1,
                               uint32_t* amax) {
  run_task<Avx2Policy>(pl, j0, nc, r0, r1, amax);
}

FUS_TARGET_AVX512 void task_avx512(const Plan& pl, int64_t j0, int64_t nc, int64_t r0, int64_t r1,
                                   uint32_t* amax) {
  run_task<Avx512Policy>(pl, j0, nc, r0, r1, amax);
}
#endif

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

}  // namespace

void gemm_cpu(const fus_gemm_args& args, const GemmShape& s) {
  const int64_t M = s.m, N = s.n, K = s.k;
  const bool d_fp8 = args.d.dtype == FUS_FLOAT8_E4M3 || args.d.dtype == FUS_FLOAT8_E5M2;
  const float scale_ab =
      s.fp8 ? f_mul(args.alpha, f_mul(args.a_scale_inv[0], args.b_scale_inv[0])) : args.alpha;
  std::vector<float> bias;
  if (s.uses_bias && N > 0 && M > 0) {
    bias.resize(static_cast<size_t>(N));
    with_loader(args.bias.dtype, args.bias.data, [&](auto load) {
      for (int64_t j = 0; j < N; ++j) bias[j] = load(j);
    });
  }
  const Plan pl{&args,    &s,
                scale_ab, d_fp8 ? args.d_scale[0] : 1.0f,
                d_fp8,    bias.empty() ? nullptr : bias.data()};
  uint32_t amax = 0;  // max |r| as ordered bits (NaN propagates, see numerics.h)

  if (M > 0 && N > 0) {
    const CpuIsa isa = cpu_isa();
    const int64_t nr = isa == CpuIsa::kAvx512 ? 32 : 16;
    const int threads = cpu_threads();
    const double flops = 2.0 * static_cast<double>(M) * static_cast<double>(N) *
                         static_cast<double>(std::max<int64_t>(K, 1));
    const int use_threads = flops < 4e6 && !cpu_force_split() ? 1 : threads;
    // Columns per task: kNcMax, or fewer so that there are at least 2 column blocks a thread.
    int64_t nc = std::min(kNcMax, round_up(N, nr));
    if (use_threads > 1 && (N + nc - 1) / nc < 2 * use_threads)
      nc = std::max<int64_t>(std::min<int64_t>(nc, 2 * nr),
                             round_up((N + 2 * use_threads - 1) / (2 * use_threads), nr));
    const int64_t col_blocks = (N + nc - 1) / nc;
    // Rows per task: all (DGELU_BGRAD: one task sums a column over every row), else enough row
    // blocks for about 4 tasks a thread.
    int64_t rows = M;
    if (!s.bgrad) {
      const int64_t splits = std::max<int64_t>(1, (4 * use_threads + col_blocks - 1) / col_blocks);
      rows = std::min(kRowsMax, std::max(kMc, round_up((M + splits - 1) / splits, kMc)));
    }
    const int64_t row_blocks = (M + rows - 1) / rows;
    const int64_t tasks = col_blocks * row_blocks;
    std::vector<uint32_t> task_amax(static_cast<size_t>(tasks), 0u);
    parallel_for(
        tasks,
        [&](int64_t t) {
          const int64_t cb = t % col_blocks, rb = t / col_blocks;
          const int64_t j0 = cb * nc, ncols = std::min(nc, N - j0);
          const int64_t r0 = rb * rows, r1 = std::min(M, r0 + rows);
          uint32_t* am = &task_amax[static_cast<size_t>(t)];
#if FUS_CPU_X86
          if (isa == CpuIsa::kAvx512) return task_avx512(pl, j0, ncols, r0, r1, am);
          if (isa == CpuIsa::kAvx2) return task_avx2(pl, j0, ncols, r0, r1, am);
#endif
          task_portable(pl, j0, ncols, r0, r1, am);
        },
        use_threads);
    for (uint32_t v : task_amax) amax = std::max(amax, v);
  } else if (s.bgrad && N > 0) {
    for (int64_t j = 0; j < N; ++j) {
      if (args.dbias.dtype == FUS_FLOAT32)
        static_cast<float*>(args.dbias.data)[j] = 0.0f;
      else
        static_cast<uint16_t*>(args.dbias.data)[j] = 0;  // +0 in fp16 and bf16
    }
  }
  if (d_fp8 && args.d_amax != nullptr) *args.d_amax = bits_as_float(amax);
}

}  // namespace fusible
