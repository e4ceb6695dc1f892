// The CPU GEMM (cpp/src/gemm/gemm_cpu.cpp: packed, multi-threaded, vectorised micro-kernels)
// against the scalar implementation it replaced, kept below verbatim as legacy::gemm_cpu (the
// specification's loop as of 703b091): every output byte (d, aux, dbias, amax) must be equal, for
// every instruction set this processor runs (baseline, AVX2, AVX-512) and 1, 2 and 3 threads, with
// small problems split into tasks as large ones are, at odd sizes, every dtype mix, epilogue and
// accumulation, values with few significant bits (the fused multiply-add path) and special values
// (where a NaN matches any NaN: which NaN a two-NaN operation returns is the compiler's operand
// order, see legacy_test_utils.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "common/activation_math.h"
#include "common/cpu_runtime.h"
#include "common/dispatch.h"
#include "common/fp32_ops.h"
#include "fusible/gemm.h"
#include "gemm/gemm_impl.h"
#include "legacy_test_utils.h"

// ---- legacy: cpp/src/gemm/gemm_cpu.cpp at 703b091, verbatim -------------------------------------

namespace legacy {
using namespace fusible;
namespace {

constexpr int64_t kMc = 64;   // rows of a tile
constexpr int64_t kNc = 256;  // columns of a tile
constexpr int64_t kKc = 256;  // depth of a packed panel

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

// Calls f(load) with load(i) -> float for element i of a matrix stored as dtype.
template <typename F>
void with_loader(fus_dtype dtype, const void* data, F&& f) {
  switch (dtype) {
    case FUS_FLOAT32: {
      const float* p = static_cast<const float*>(data);
      f([p](int64_t i) { return p[i]; });
      return;
    }
    case FUS_FLOAT16: {
      const Half* p = static_cast<const Half*>(data);
      f([p](int64_t i) { return Element<Half>::load(p, i); });
      return;
    }
    case FUS_BFLOAT16: {
      const Bf16* p = static_cast<const Bf16*>(data);
      f([p](int64_t i) { return Element<Bf16>::load(p, i); });
      return;
    }
    case FUS_FLOAT8_E4M3:
    case FUS_FLOAT8_E5M2: {
      static const Fp8Table e4m3(FUS_FLOAT8_E4M3), e5m2(FUS_FLOAT8_E5M2);
      const float* table = dtype == FUS_FLOAT8_E4M3 ? e4m3.v : e5m2.v;
      const uint8_t* p = static_cast<const uint8_t*>(data);
      f([p, table](int64_t i) { return table[p[i]]; });
      return;
    }
    default: throw Error(FUS_ERROR_INTERNAL, "fus_gemm: unexpected dtype in the CPU backend");
  }
}

float load_one(fus_dtype dtype, const void* data, int64_t i) {
  switch (dtype) {
    case FUS_FLOAT32: return static_cast<const float*>(data)[i];
    case FUS_FLOAT16: return Element<Half>::load(static_cast<const Half*>(data), i);
    case FUS_BFLOAT16: return Element<Bf16>::load(static_cast<const Bf16*>(data), i);
    default: throw Error(FUS_ERROR_INTERNAL, "fus_gemm: unexpected epilogue dtype");
  }
}

// Rounds v to dtype (RNE); FP8 stores fp8(v * fp8_scale) with the saturating cast of quantize.h.
void store_one(fus_dtype dtype, void* data, int64_t i, float v, float fp8_scale) {
  switch (dtype) {
    case FUS_FLOAT32: static_cast<float*>(data)[i] = v; return;
    case FUS_FLOAT16: Element<Half>::store(static_cast<Half*>(data), i, v); return;
    case FUS_BFLOAT16: Element<Bf16>::store(static_cast<Bf16*>(data), i, v); return;
    case FUS_FLOAT8_E4M3:
      static_cast<uint8_t*>(data)[i] = float_to_fp8<Fp8Format::kE4M3>(v * fp8_scale);
      return;
    case FUS_FLOAT8_E5M2:
      static_cast<uint8_t*>(data)[i] = float_to_fp8<Fp8Format::kE5M2>(v * fp8_scale);
      return;
    default: throw Error(FUS_ERROR_INTERNAL, "fus_gemm: unexpected output dtype");
  }
}

// ap[i * kc + k] = op(A)[i0 + i, k0 + k] for i < mc, k < kc.
void pack_a(const fus_gemm_args& args, const GemmShape& s, int64_t i0, int64_t mc, int64_t k0,
            int64_t kc, float* ap) {
  with_loader(args.a.dtype, args.a.data, [&](auto load) {
    if (args.transa) {  // A stored [K, M]
      for (int64_t k = 0; k < kc; ++k)
        for (int64_t i = 0; i < mc; ++i) ap[i * kc + k] = load((k0 + k) * s.m + i0 + i);
    } else {  // A stored [M, K]
      for (int64_t i = 0; i < mc; ++i)
        for (int64_t k = 0; k < kc; ++k) ap[i * kc + k] = load((i0 + i) * s.k + k0 + k);
    }
  });
}

// bp[k * nc + j] = op(B)[k0 + k, j0 + j] for k < kc, j < nc.
void pack_b(const fus_gemm_args& args, const GemmShape& s, int64_t k0, int64_t kc, int64_t j0,
            int64_t nc, float* bp) {
  with_loader(args.b.dtype, args.b.data, [&](auto load) {
    if (args.transb) {  // B stored [N, K]
      for (int64_t j = 0; j < nc; ++j)
        for (int64_t k = 0; k < kc; ++k) bp[k * nc + j] = load((j0 + j) * s.k + k0 + k);
    } else {  // B stored [K, N]
      for (int64_t k = 0; k < kc; ++k)
        for (int64_t j = 0; j < nc; ++j) bp[k * nc + j] = load((k0 + k) * s.n + j0 + j);
    }
  });
}

// acc[i * nc + j] += sum_k ap[i * kc + k] * bp[k * nc + j], k ascending, one rounding per product
// and one per addition. Four rows at a time share each row of bp.
void multiply_panel(const float* ap, const float* bp, float* acc, int64_t mc, int64_t nc,
                    int64_t kc) {
  int64_t i = 0;
  for (; i + 4 <= mc; i += 4) {
    float* c0 = acc + i * nc;
    float* c1 = c0 + nc;
    float* c2 = c1 + nc;
    float* c3 = c2 + nc;
    const float* a0 = ap + i * kc;
    for (int64_t k = 0; k < kc; ++k) {
      const float x0 = a0[k], x1 = a0[kc + k], x2 = a0[2 * kc + k], x3 = a0[3 * kc + k];
      const float* b = bp + k * nc;
      for (int64_t j = 0; j < nc; ++j) {
        const float bj = b[j];
        c0[j] += x0 * bj;
        c1[j] += x1 * bj;
        c2[j] += x2 * bj;
        c3[j] += x3 * bj;
      }
    }
  }
  for (; i < mc; ++i) {
    float* c0 = acc + i * nc;
    const float* a0 = ap + i * kc;
    for (int64_t k = 0; k < kc; ++k) {
      const float x0 = a0[k];
      const float* b = bp + k * nc;
      for (int64_t j = 0; j < nc; ++j) c0[j] += x0 * b[j];
    }
  }
}

}  // namespace

void gemm_cpu(const fus_gemm_args& args, const GemmShape& s) {
  const int64_t M = s.m, N = s.n, K = s.k;
  const bool d_fp8 = args.d.dtype == FUS_FLOAT8_E4M3 || args.d.dtype == FUS_FLOAT8_E5M2;
  const float scale_ab =
      s.fp8 ? f_mul(args.alpha, f_mul(args.a_scale_inv[0], args.b_scale_inv[0])) : args.alpha;
  const float d_scale = d_fp8 ? args.d_scale[0] : 1.0f;
  uint32_t amax = 0;  // max |r| as ordered bits (NaN propagates, see numerics.h)
  std::vector<float> dbias_acc(s.bgrad ? static_cast<size_t>(N) : 0, 0.0f);

  if (M > 0 && N > 0) {
    std::vector<float> ap(static_cast<size_t>(kMc * std::min(kKc, std::max<int64_t>(K, 1))));
    std::vector<float> bp(static_cast<size_t>(std::min(kKc, std::max<int64_t>(K, 1)) * kNc));
    std::vector<float> acc(static_cast<size_t>(kMc * kNc));
    for (int64_t i0 = 0; i0 < M; i0 += kMc) {
      const int64_t mc = std::min(kMc, M - i0);
      for (int64_t j0 = 0; j0 < N; j0 += kNc) {
        const int64_t nc = std::min(kNc, N - j0);
        std::fill(acc.begin(), acc.begin() + mc * nc, 0.0f);
        for (int64_t k0 = 0; k0 < K; k0 += kKc) {
          const int64_t kc = std::min(kKc, K - k0);
          pack_a(args, s, i0, mc, k0, kc, ap.data());
          pack_b(args, s, k0, kc, j0, nc, bp.data());
          multiply_panel(ap.data(), bp.data(), acc.data(), mc, nc, kc);
        }
        // Epilogue of the tile, element by element: C is read right before D is written, so C
        // may be D itself.
        for (int64_t i = 0; i < mc; ++i) {
          const int64_t row = i0 + i;
          for (int64_t j = 0; j < nc; ++j) {
            const int64_t col = j0 + j;
            const int64_t idx = row * N + col;
            float t = f_mul(scale_ab, acc[i * nc + j]);
            if (s.has_c) t = f_add(t, f_mul(args.beta, load_one(args.c.dtype, args.c.data, idx)));
            if (s.uses_bias) t = f_add(t, load_one(args.bias.dtype, args.bias.data, col));
            float r = t;
            if (s.gelu) {
              if (s.writes_aux) store_one(args.aux.dtype, args.aux.data, idx, t, 1.0f);
              r = gelu_tanh(t);
            } else if (s.dgelu) {
              r = f_mul(t, dgelu_tanh(load_one(args.aux.dtype, args.aux.data, idx)));
            }
            store_one(args.d.dtype, args.d.data, idx, r, d_scale);
            if (d_fp8) amax = std::max(amax, abs_bits(r));
            if (s.bgrad) dbias_acc[col] = f_add(dbias_acc[col], r);
          }
        }
      }
    }
  }

  if (s.bgrad)
    for (int64_t j = 0; j < N; ++j)
      store_one(args.dbias.dtype, args.dbias.data, j, dbias_acc[j], 1);
  if (d_fp8 && args.d_amax != nullptr) *args.d_amax = bits_as_float(amax);
}

}  // namespace legacy

// ---- the comparison ----------------------------------------------------------------------------

namespace {

using legacy_test::CpuIsa;

constexpr fus_dtype kF32 = FUS_FLOAT32, kF16 = FUS_FLOAT16, kBF16 = FUS_BFLOAT16,
                    kE4M3 = FUS_FLOAT8_E4M3, kE5M2 = FUS_FLOAT8_E5M2;

bool is_fp8(fus_dtype d) { return d == kE4M3 || d == kE5M2; }

// Value sets of the operands: full-precision normals; values with few significant bits (the
// fused multiply-add path for fp32 / bf16); and normals mixed with zeros of both signs,
// subnormals, huge values, infinities and NaNs.
enum class Values { kNormal, kFewBits, kSpecial };

float special_value(std::mt19937& g) {
  switch (g() % 8) {
    case 0: return 0.0f;
    case 1: return -0.0f;
    case 2: return 1e-40f;  // fp32 subnormal
    case 3: return -3e38f;
    case 4: return std::numeric_limits<float>::infinity();
    case 5: return -std::numeric_limits<float>::infinity();
    case 6: return std::numeric_limits<float>::quiet_NaN();
    default: return 1e-20f;
  }
}

// n elements of dtype with the given values, as bytes.
std::vector<uint8_t> random_matrix(fus_dtype dt, int64_t n, Values v, std::mt19937& g,
                                   float scale = 1.0f) {
  std::vector<uint8_t> out(static_cast<size_t>(n) * fus_dtype_size(dt));
  std::normal_distribution<float> nd(0.0f, scale);
  for (int64_t i = 0; i < n; ++i) {
    if (is_fp8(dt)) {
      uint8_t q = static_cast<uint8_t>(g());
      const bool nonfinite = dt == kE4M3 ? (q & 0x7f) == 0x7f : (q & 0x7c) == 0x7c;
      if (nonfinite && v != Values::kSpecial) q &= 0xbb;  // a finite code instead
      out[i] = q;
      continue;
    }
    float x = nd(g);
    if (v == Values::kFewBits) x = fusible::bits_as_float(fusible::float_as_bits(x) & 0xffff0000u);
    if (v == Values::kSpecial && g() % 16 == 0) x = special_value(g);
    legacy_test::store_hp_bytes(out, dt, i, x);
  }
  return out;
}

struct Config {
  int64_t m, n, k;
  fus_dtype at, bt, dt;
  int transa = 0, transb = 1;
  fus_gemm_epilogue ep = FUS_GEMM_EPILOGUE_NONE;
  float alpha = 1.0f, beta = 0.0f;
  Values values = Values::kNormal;
  fus_dtype vec = kBF16;  // bias / aux / dbias dtype when d is FP8

  std::string str() const {
    std::ostringstream o;
    o << "m=" << m << " n=" << n << " k=" << k << " a=" << at << " b=" << bt << " d=" << dt
      << " transa=" << transa << " transb=" << transb << " ep=" << ep << " alpha=" << alpha
      << " beta=" << beta << " values=" << static_cast<int>(values);
    return o.str();
  }
};

bool uses_bias(fus_gemm_epilogue e) {
  return e == FUS_GEMM_EPILOGUE_BIAS || e == FUS_GEMM_EPILOGUE_BIAS_GELU ||
         e == FUS_GEMM_EPILOGUE_BIAS_GELU_AUX;
}
bool writes_aux(fus_gemm_epilogue e) {
  return e == FUS_GEMM_EPILOGUE_GELU_AUX || e == FUS_GEMM_EPILOGUE_BIAS_GELU_AUX;
}
bool reads_aux(fus_gemm_epilogue e) {
  return e == FUS_GEMM_EPILOGUE_DGELU || e == FUS_GEMM_EPILOGUE_DGELU_BGRAD;
}

// The buffers of one call; the outputs start filled with a pattern, C (when used) is random.
struct Problem {
  Config c;
  std::vector<uint8_t> a, b, d, bias, aux, dbias;
  float a_scale = 0.5f, b_scale = 1.5f, d_scale = 0.25f, amax = -1.0f;

  explicit Problem(const Config& cfg, uint32_t seed) : c(cfg) {
    std::mt19937 g(seed);
    a = random_matrix(c.at, c.m * c.k, c.values, g);
    b = random_matrix(c.bt, c.k * c.n, c.values, g, 0.5f);
    const fus_dtype vec = vec_dtype();
    if (c.beta != 0.0f)
      d = random_matrix(c.dt, c.m * c.n, Values::kNormal, g);
    else
      d.assign(static_cast<size_t>(c.m * c.n) * fus_dtype_size(c.dt), 0xa5);
    if (uses_bias(c.ep)) bias = random_matrix(bias_dtype(), c.n, Values::kNormal, g);
    if (writes_aux(c.ep)) aux.assign(static_cast<size_t>(c.m * c.n) * fus_dtype_size(vec), 0x5a);
    if (reads_aux(c.ep)) aux = random_matrix(vec, c.m * c.n, Values::kNormal, g, 2.0f);
    if (c.ep == FUS_GEMM_EPILOGUE_DGELU_BGRAD)
      dbias.assign(static_cast<size_t>(c.n) * fus_dtype_size(vec), 0x3c);
  }
  bool fp8() const { return is_fp8(c.at); }
  fus_dtype vec_dtype() const { return is_fp8(c.dt) ? c.vec : c.dt; }
  fus_dtype bias_dtype() const {
    if (is_fp8(c.dt)) return c.vec;
    return fp8() && c.dt == kF32 ? kBF16 : c.dt;
  }
  static void* p(std::vector<uint8_t>& v) { return v.empty() ? nullptr : v.data(); }

  fus_gemm_args args() {
    fus_gemm_args r{};
    r.a = fus_tensor{p(a), c.at, c.transa ? c.k : c.m, c.transa ? c.m : c.k};
    r.b = fus_tensor{p(b), c.bt, c.transb ? c.n : c.k, c.transb ? c.k : c.n};
    r.transa = c.transa;
    r.transb = c.transb;
    if (fp8()) {
      r.a_scale_inv = &a_scale;
      r.b_scale_inv = &b_scale;
    }
    r.d = fus_tensor{p(d), c.dt, c.m, c.n};
    if (is_fp8(c.dt)) {
      r.d_scale = &d_scale;
      r.d_amax = &amax;
    }
    r.alpha = c.alpha;
    r.beta = c.beta;
    if (c.beta != 0.0f) r.c = r.d;  // accumulate in place (C is D)
    r.epilogue = c.ep;
    if (uses_bias(c.ep)) r.bias = fus_tensor{p(bias), bias_dtype(), 1, c.n};
    if (writes_aux(c.ep) || reads_aux(c.ep)) r.aux = fus_tensor{p(aux), vec_dtype(), c.m, c.n};
    if (c.ep == FUS_GEMM_EPILOGUE_DGELU_BGRAD) r.dbias = fus_tensor{p(dbias), vec_dtype(), 1, c.n};
    return r;
  }

  fusible::GemmShape shape() const {
    fusible::GemmShape s;
    s.m = c.m;
    s.n = c.n;
    s.k = c.k;
    s.fp8 = fp8();
    s.has_c = c.beta != 0.0f && c.m * c.n > 0;
    s.uses_bias = uses_bias(c.ep);
    s.gelu = c.ep == FUS_GEMM_EPILOGUE_GELU || c.ep == FUS_GEMM_EPILOGUE_GELU_AUX ||
             c.ep == FUS_GEMM_EPILOGUE_BIAS_GELU || c.ep == FUS_GEMM_EPILOGUE_BIAS_GELU_AUX;
    s.writes_aux = writes_aux(c.ep);
    s.dgelu = reads_aux(c.ep);
    s.bgrad = c.ep == FUS_GEMM_EPILOGUE_DGELU_BGRAD;
    return s;
  }
};

// Runs the legacy implementation once and fus_gemm for every instruction set and 1, 2, 3 threads
// (small problems split into tasks as large ones are), comparing every output byte (a NaN
// matches any NaN: legacy_test::same_values).
void check(const Config& cfg, uint32_t seed, std::initializer_list<int> threads = {1, 2, 3}) {
  Problem want(cfg, seed);
  {
    fus_gemm_args args = want.args();
    legacy::gemm_cpu(args, want.shape());
  }
  const fus_context ctx{FUS_DEVICE_CPU, 0, nullptr};
  for (CpuIsa isa : legacy_test::isas()) {
    for (int t : threads) {
      legacy_test::Runtime rt(isa, t);
      Problem got(cfg, seed);
      fus_gemm_args args = got.args();
      ASSERT_EQ(fus_gemm(&args, &ctx), FUS_SUCCESS) << cfg.str() << ": " << fus_last_error();
      const std::string where = cfg.str() + legacy_test::Runtime::name(isa, t);
      EXPECT_TRUE(legacy_test::same_values("d", cfg.dt, want.d, got.d)) << where;
      EXPECT_TRUE(legacy_test::same_values("aux", want.vec_dtype(), want.aux, got.aux)) << where;
      EXPECT_TRUE(legacy_test::same_values("dbias", want.vec_dtype(), want.dbias, got.dbias))
          << where;
      EXPECT_TRUE(legacy_test::same_float(want.amax, got.amax)) << where;
    }
  }
}

struct Size {
  int64_t m, n, k;
};
// 1, primes, 2^n - 1 and 2^n + 1 around the blocking (rows 96, columns 32 / 16 / 8, K panels 256,
// task rows 1024).
const Size kSizes[] = {{1, 1, 1},      {1, 31, 7},     {7, 1, 31},    {3, 5, 0},     {31, 127, 255},
                       {127, 33, 257}, {97, 257, 513}, {193, 65, 17}, {255, 511, 3}, {1025, 67, 5}};

const fus_gemm_epilogue kEpilogues[] = {
    FUS_GEMM_EPILOGUE_NONE,     FUS_GEMM_EPILOGUE_BIAS,       FUS_GEMM_EPILOGUE_GELU,
    FUS_GEMM_EPILOGUE_GELU_AUX, FUS_GEMM_EPILOGUE_BIAS_GELU,  FUS_GEMM_EPILOGUE_BIAS_GELU_AUX,
    FUS_GEMM_EPILOGUE_DGELU,    FUS_GEMM_EPILOGUE_DGELU_BGRAD};

}  // namespace

TEST(GemmCpuLegacy, HighPrecisionEveryTransposeAndEpilogueAtOddSizes) {
  uint32_t seed = 1;
  for (const Size& sz : kSizes) {
    for (fus_dtype in : {kF32, kBF16, kF16}) {
      for (int ta = 0; ta < 2; ++ta) {
        for (int tb = 0; tb < 2; ++tb) {
          const fus_gemm_epilogue ep = kEpilogues[seed % 8];
          const fus_dtype out = seed % 3 == 0 ? kF32 : in;
          Config c{sz.m, sz.n, sz.k, in, in, out, ta, tb, ep};
          c.alpha = seed % 4 == 0 ? 0.75f : 1.0f;
          c.values = static_cast<Values>(seed % 3);
          check(c, seed++);
        }
      }
    }
  }
}

TEST(GemmCpuLegacy, EveryEpilogueEveryOutput) {
  uint32_t seed = 1000;
  for (fus_gemm_epilogue ep : kEpilogues) {
    for (fus_dtype in : {kF32, kBF16, kF16}) {
      for (fus_dtype out : {in, kF32}) {
        for (Values v : {Values::kNormal, Values::kFewBits, Values::kSpecial}) {
          Config c{97, 130, 300, in, in, out, 0, 1, ep};
          c.values = v;
          check(c, seed++, {1, 2});
        }
      }
    }
  }
}

TEST(GemmCpuLegacy, AccumulateIntoD) {
  uint32_t seed = 2000;
  for (fus_gemm_epilogue ep : {FUS_GEMM_EPILOGUE_NONE, FUS_GEMM_EPILOGUE_BIAS}) {
    for (fus_dtype in : {kF32, kBF16, kF16}) {
      for (fus_dtype out : {in, kF32}) {
        for (const Size& sz : {Size{33, 65, 129}, Size{1, 7, 0}, Size{130, 97, 31}}) {
          Config c{sz.m, sz.n, sz.k, in, in, out, static_cast<int>(seed % 2), 0, ep};
          c.beta = seed % 3 == 0 ? 1.0f : -0.5f;
          c.alpha = seed % 4 == 0 ? 2.0f : 1.0f;
          check(c, seed++, {1, 2});
        }
      }
    }
  }
}

TEST(GemmCpuLegacy, Fp8EveryMixOutputAndEpilogue) {
  uint32_t seed = 3000;
  const std::pair<fus_dtype, fus_dtype> mixes[] = {{kE4M3, kE4M3}, {kE4M3, kE5M2}, {kE5M2, kE4M3}};
  for (const auto& [at, bt] : mixes) {
    for (fus_dtype out : {kF32, kBF16, kF16, kE4M3, kE5M2}) {
      if (out == kE5M2 && at == kE4M3 && bt == kE4M3) continue;
      for (fus_gemm_epilogue ep : kEpilogues) {
        if (out == kF32 &&
            (ep == FUS_GEMM_EPILOGUE_BIAS_GELU_AUX || ep == FUS_GEMM_EPILOGUE_DGELU_BGRAD))
          continue;
        if (is_fp8(out) && reads_aux(ep)) continue;
        const Size sz = kSizes[seed % 10];
        Config c{sz.m, sz.n, sz.k, at, bt, out, 0, 1, ep};
        c.values = seed % 4 == 0 ? Values::kSpecial : Values::kNormal;
        c.vec = seed % 2 ? kBF16 : kF16;
        c.alpha = seed % 3 == 0 ? 0.5f : 1.0f;
        check(c, seed++, {1, 2});
      }
    }
  }
}

TEST(GemmCpuLegacy, TheBlockSizes) {
  // The README block: fc1 forward [1024 x 4096 x 1024] with bias + GELU, fc2 forward
  // [1024 x 1024 x 4096] with bias, the GELU backward of fc1's output with its bias gradient, a
  // weight gradient (both operands transposed reads), and FP8 forward GEMMs.
  const Config cases[] = {
      {1024, 4096, 1024, kF32, kF32, kF32, 0, 1, FUS_GEMM_EPILOGUE_BIAS_GELU_AUX},
      {1024, 1024, 4096, kF32, kF32, kF32, 0, 1, FUS_GEMM_EPILOGUE_BIAS},
      {1024, 4096, 1024, kF32, kF32, kF32, 0, 0, FUS_GEMM_EPILOGUE_DGELU_BGRAD},
      {1024, 4096, 1024, kF32, kF32, kF32, 1, 0, FUS_GEMM_EPILOGUE_NONE},
      {1024, 4096, 1024, kE4M3, kE4M3, kBF16, 0, 1, FUS_GEMM_EPILOGUE_BIAS_GELU_AUX},
      {1024, 1024, 4096, kE4M3, kE4M3, kF32, 0, 1, FUS_GEMM_EPILOGUE_NONE},
  };
  uint32_t seed = 4000;
  for (const Config& c : cases) check(c, seed++, {1, 2});
}
