// Tests of the gemm family: the CPU backend through the C API against an FP64 reference (every
// epilogue, every transpose of high-precision operands, FP8 operands with scales, FP8 outputs with
// scale and amax, odd sizes), the documented FP32 summation order bit for bit, argument validation
// (including the CUDA-only cuBLASLt alignment rules, which are checked before any device work),
// and, where a CUDA device is present, the CUDA backend (cuBLASLt) against the CPU backend within
// a tolerance (the FP32 accumulation order differs).
#include <gtest/gtest.h>

#include <cmath>
#include <sstream>
#include <string>
#include <vector>

#include "common/activation_math.h"
#include "fusible/gemm.h"
#include "test_utils.h"

using namespace fustest;

namespace {

constexpr fus_dtype kF32 = FUS_FLOAT32;
constexpr fus_dtype kF16 = FUS_FLOAT16;
constexpr fus_dtype kBF16 = FUS_BFLOAT16;
constexpr fus_dtype kE4M3 = FUS_FLOAT8_E4M3;
constexpr fus_dtype kE5M2 = FUS_FLOAT8_E5M2;

bool is_fp8(fus_dtype d) { return d == kE4M3 || d == kE5M2; }

const char* ep_name(fus_gemm_epilogue e) {
  switch (e) {
    case FUS_GEMM_EPILOGUE_NONE: return "none";
    case FUS_GEMM_EPILOGUE_BIAS: return "bias";
    case FUS_GEMM_EPILOGUE_GELU: return "gelu";
    case FUS_GEMM_EPILOGUE_GELU_AUX: return "gelu_aux";
    case FUS_GEMM_EPILOGUE_BIAS_GELU: return "bias_gelu";
    case FUS_GEMM_EPILOGUE_BIAS_GELU_AUX: return "bias_gelu_aux";
    case FUS_GEMM_EPILOGUE_DGELU: return "dgelu";
    case FUS_GEMM_EPILOGUE_DGELU_BGRAD: return "dgelu_bgrad";
  }
  return "?";
}

bool uses_bias(fus_gemm_epilogue e) {
  return e == FUS_GEMM_EPILOGUE_BIAS || e == FUS_GEMM_EPILOGUE_BIAS_GELU ||
         e == FUS_GEMM_EPILOGUE_BIAS_GELU_AUX;
}
bool is_gelu(fus_gemm_epilogue e) {
  return e == FUS_GEMM_EPILOGUE_GELU || e == FUS_GEMM_EPILOGUE_GELU_AUX ||
         e == FUS_GEMM_EPILOGUE_BIAS_GELU || e == FUS_GEMM_EPILOGUE_BIAS_GELU_AUX;
}
bool writes_aux(fus_gemm_epilogue e) {
  return e == FUS_GEMM_EPILOGUE_GELU_AUX || e == FUS_GEMM_EPILOGUE_BIAS_GELU_AUX;
}
bool is_dgelu(fus_gemm_epilogue e) {
  return e == FUS_GEMM_EPILOGUE_DGELU || e == FUS_GEMM_EPILOGUE_DGELU_BGRAD;
}
bool is_bgrad(fus_gemm_epilogue e) { return e == FUS_GEMM_EPILOGUE_DGELU_BGRAD; }

const fus_gemm_epilogue kAllEpilogues[] = {
    FUS_GEMM_EPILOGUE_NONE,     FUS_GEMM_EPILOGUE_BIAS,       FUS_GEMM_EPILOGUE_GELU,
    FUS_GEMM_EPILOGUE_GELU_AUX, FUS_GEMM_EPILOGUE_BIAS_GELU,  FUS_GEMM_EPILOGUE_BIAS_GELU_AUX,
    FUS_GEMM_EPILOGUE_DGELU,    FUS_GEMM_EPILOGUE_DGELU_BGRAD};

// ---- FP64 math of the reference
// ------------------------------------------------------------------

constexpr double kGeluK0 = 0.79788456080286535588;  // sqrt(2 / pi)
constexpr double kGeluK1 = 0.044715;

double gelu_ref(double x) {
  return 0.5 * x * (1.0 + std::tanh(kGeluK0 * (x + kGeluK1 * x * x * x)));
}
double dgelu_ref(double x) {
  const double th = std::tanh(kGeluK0 * (x + kGeluK1 * x * x * x));
  return 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * kGeluK0 * (1.0 + 3.0 * kGeluK1 * x * x);
}

// Relative half-ulp of a dtype and the absolute rounding error near zero (subnormals).
double rel_round(fus_dtype d) {
  switch (d) {
    case kF32: return std::ldexp(1.0, -24);
    case kF16: return std::ldexp(1.0, -11);
    case kBF16: return std::ldexp(1.0, -8);
    case kE4M3: return std::ldexp(1.0, -4);
    default: return std::ldexp(1.0, -3);
  }
}
double abs_round(fus_dtype d) {
  switch (d) {
    case kF32: return 1e-44;
    case kF16: return std::ldexp(1.0, -25);
    case kBF16: return 1e-38;
    case kE4M3: return std::ldexp(1.0, -10);
    default: return std::ldexp(1.0, -17);
  }
}

// ---- a GEMM problem ----------------------------------------------------------------------------

struct Case {
  int64_t m = 1, n = 1, k = 1;
  fus_dtype at = kF32, bt = kF32, dt = kF32;
  bool transa = false, transb = false;
  fus_gemm_epilogue ep = FUS_GEMM_EPILOGUE_NONE;
  float alpha = 1.0f, beta = 0.0f;
  bool c_is_d = false;  // accumulate in place (c.data == d.data)
  bool want_amax = false;
  bool fast_accum = false;
  float a_scale_inv = 0.5f, b_scale_inv = 0.375f, d_scale = 2.0f;
  fus_dtype vec_dtype = kF32;  // bias / aux / dbias dtype; set by finish()
  int value_exp = 1;           // HP operand values ~ normal * 2^[-value_exp, value_exp]
  uint32_t seed = 1;

  // Chainable setters of the fields most cases set together.
  Case& size(int64_t m_, int64_t n_, int64_t k_) { return (m = m_, n = n_, k = k_), *this; }
  Case& types(fus_dtype a, fus_dtype b, fus_dtype d) { return (at = a, bt = b, dt = d), *this; }
  Case& types(fus_dtype ab, fus_dtype d) { return types(ab, ab, d); }  // both operands ab
  Case& trans(bool ta, bool tb) { return (transa = ta, transb = tb), *this; }
  Case& scales(float a_inv, float b_inv, float d) {
    return (a_scale_inv = a_inv, b_scale_inv = b_inv, d_scale = d), *this;
  }

  // Epilogue tensor dtypes per fusible/gemm.h.
  Case& finish() {
    vec_dtype = dt;
    if (is_fp8(dt)) vec_dtype = kBF16;
    return *this;
  }
  fus_dtype bias_dtype() const {
    if (is_fp8(at) && dt == kF32) return kBF16;
    return vec_dtype;
  }
  std::string str() const {
    std::ostringstream os;
    os << "M=" << m << " N=" << n << " K=" << k << " a=" << fmt_name(at) << " b=" << fmt_name(bt)
       << " d=" << fmt_name(dt) << " transa=" << transa << " transb=" << transb
       << " epilogue=" << ep_name(ep) << " alpha=" << alpha << " beta=" << beta
       << (c_is_d ? " c=d" : "") << " seed=" << seed;
    return os.str();
  }
};

// A stored matrix: bytes in its dtype and the exact value of each element.
struct Stored {
  fus_dtype dtype = kF32;
  int64_t rows = 0, cols = 0;
  std::vector<uint8_t> bytes;
  std::vector<double> values;
};

Stored make_operand(fus_dtype dt, int64_t rows, int64_t cols, uint32_t seed, int value_exp) {
  Stored s;
  s.dtype = dt;
  s.rows = rows;
  s.cols = cols;
  const size_t n = static_cast<size_t>(rows * cols);
  if (is_fp8(dt)) {
    // Random finite codes with magnitudes well inside the range (no NaN / inf codes).
    std::mt19937 rng(seed);
    std::uniform_int_distribution<int> code(0, 255);
    s.bytes.resize(n);
    s.values.resize(n);
    for (size_t i = 0; i < n; ++i) {
      uint8_t c;
      double v;
      do {
        c = static_cast<uint8_t>(code(rng));
        v = ref::fp8_decode(c, dt);
      } while (!std::isfinite(v) || std::fabs(v) > 64.0 || (std::fabs(v) < 1.0 / 64 && v != 0));
      s.bytes[i] = c;
      s.values[i] = v;
    }
    return s;
  }
  HostMatrix h(dt, rows, cols, random_values(n, seed, -value_exp, value_exp));
  s.bytes = h.bytes;
  s.values.assign(h.values.begin(), h.values.end());
  return s;
}

Stored make_hp(fus_dtype dt, int64_t rows, int64_t cols, uint32_t seed, int lo, int hi) {
  Stored s;
  s.dtype = dt;
  s.rows = rows;
  s.cols = cols;
  HostMatrix h(dt, rows, cols, random_values(static_cast<size_t>(rows * cols), seed, lo, hi));
  s.bytes = h.bytes;
  s.values.assign(h.values.begin(), h.values.end());
  return s;
}

// Value of element i of an output buffer of dtype (FP8: decoded, divided by the d scale).
double out_value(const std::vector<uint8_t>& bytes, fus_dtype dt, size_t i, double fp8_scale) {
  if (is_fp8(dt)) return ref::fp8_decode(bytes[i], dt) / fp8_scale;
  return load_as_double(bytes, dt, i);
}

enum Slot { kA = 0, kB, kSa, kSb, kD, kDs, kAmax, kC, kBias, kAux, kDbias, kNumSlots };

// The inputs of a case, the C API call over them, and the FP64 expectation with error bounds.
struct Problem {
  Case c;
  Stored a, b, cmat, bias, aux_in;
  Buffers init;

  // FP64 reference: r (the epilogue result), t (the pre-activation), and bounds on the fp32 error
  // of a correct implementation (any fp32 summation order).
  std::vector<double> r, t, r_err, t_err, dbias, dbias_err;
  double amax = 0, amax_err = 0;

  // acc_err_per_k * K + acc_err_floor bounds the accumulation error relative to sum |a b|.
  explicit Problem(const Case& cs, double acc_err_per_k = std::ldexp(1.0, -23),
                   double acc_err_floor = 0.0)
      : c(cs) {
    const uint32_t sd = c.seed * 7919u;
    a = c.transa ? make_operand(c.at, c.k, c.m, sd + 1, c.value_exp)
                 : make_operand(c.at, c.m, c.k, sd + 1, c.value_exp);
    b = c.transb ? make_operand(c.bt, c.n, c.k, sd + 2, c.value_exp)
                 : make_operand(c.bt, c.k, c.n, sd + 2, c.value_exp);
    const bool has_c = c.beta != 0.0f;
    if (has_c) cmat = make_hp(c.dt, c.m, c.n, sd + 3, -2, 2);
    if (uses_bias(c.ep)) bias = make_hp(c.bias_dtype(), 1, c.n, sd + 4, -1, 1);
    if (is_dgelu(c.ep)) aux_in = make_hp(c.vec_dtype, c.m, c.n, sd + 5, -2, 1);

    const size_t mn = static_cast<size_t>(c.m * c.n);
    init.b.resize(kNumSlots);
    init.b[kA] = a.bytes;
    init.b[kB] = b.bytes;
    if (is_fp8(c.at)) {
      Buffers tmp;
      tmp.add(std::vector<float>{c.a_scale_inv});
      tmp.add(std::vector<float>{c.b_scale_inv});
      init.b[kSa] = tmp.b[0];
      init.b[kSb] = tmp.b[1];
    }
    init.b[kD] = c.c_is_d ? cmat.bytes : std::vector<uint8_t>(mn * fus_dtype_size(c.dt), 0xA5);
    if (is_fp8(c.dt)) {
      Buffers tmp;
      tmp.add(std::vector<float>{c.d_scale});
      tmp.add(std::vector<float>{-1.0f});
      init.b[kDs] = tmp.b[0];
      if (c.want_amax) init.b[kAmax] = tmp.b[1];
    }
    if (has_c && !c.c_is_d) init.b[kC] = cmat.bytes;
    if (uses_bias(c.ep)) init.b[kBias] = bias.bytes;
    if (writes_aux(c.ep))
      init.b[kAux] = std::vector<uint8_t>(mn * fus_dtype_size(c.vec_dtype), 0xA5);
    if (is_dgelu(c.ep)) init.b[kAux] = aux_in.bytes;
    if (is_bgrad(c.ep))
      init.b[kDbias] =
          std::vector<uint8_t>(static_cast<size_t>(c.n) * fus_dtype_size(c.vec_dtype), 0xA5);

    reference(acc_err_per_k, acc_err_floor);
  }

  double opa(int64_t i, int64_t k) const {
    return c.transa ? a.values[k * c.m + i] : a.values[i * c.k + k];
  }
  double opb(int64_t k, int64_t j) const {
    return c.transb ? b.values[j * c.k + k] : b.values[k * c.n + j];
  }

  void reference(double acc_err_per_k, double acc_err_floor) {
    const size_t mn = static_cast<size_t>(c.m * c.n);
    r.assign(mn, 0);
    t.assign(mn, 0);
    r_err.assign(mn, 0);
    t_err.assign(mn, 0);
    dbias.assign(static_cast<size_t>(c.n), 0);
    dbias_err.assign(static_cast<size_t>(c.n), 0);
    const double s = is_fp8(c.at) ? static_cast<double>(c.alpha) *
                                        (static_cast<double>(c.a_scale_inv) * c.b_scale_inv)
                                  : c.alpha;
    const double u = std::ldexp(1.0, -24);
    amax = 0;
    amax_err = 0;
    for (int64_t i = 0; i < c.m; ++i) {
      for (int64_t j = 0; j < c.n; ++j) {
        double acc = 0, mag = 0;
        for (int64_t k = 0; k < c.k; ++k) {
          const double p = opa(i, k) * opb(k, j);
          acc += p;
          mag += std::fabs(p);
        }
        const size_t idx = static_cast<size_t>(i * c.n + j);
        double tv = s * acc;
        double te =
            std::fabs(s) * ((static_cast<double>(c.k) * acc_err_per_k + acc_err_floor) * mag) +
            4 * u * std::fabs(tv);
        if (c.beta != 0.0f) {
          const double cv = static_cast<double>(c.beta) * cmat.values[idx];
          tv += cv;
          te += 4 * u * (std::fabs(cv) + std::fabs(tv));
        }
        if (uses_bias(c.ep)) {
          tv += bias.values[static_cast<size_t>(j)];
          te += 2 * u * (std::fabs(tv) + std::fabs(bias.values[static_cast<size_t>(j)]));
        }
        double rv = tv, re = te;
        if (is_gelu(c.ep)) {
          rv = gelu_ref(tv);
          re = 1.2 * te + 64 * u * (std::fabs(rv) + 1e-30) + 1e-37;
        } else if (is_dgelu(c.ep)) {
          const double x = aux_in.values[idx];
          const double g = dgelu_ref(x);
          rv = tv * g;
          re = std::fabs(g) * te + std::fabs(tv) * 64 * u * (1.0 + std::fabs(x)) +
               4 * u * std::fabs(rv);
        }
        t[idx] = tv;
        t_err[idx] = te;
        r[idx] = rv;
        r_err[idx] = re;
        if (std::fabs(rv) > amax) amax = std::fabs(rv);
        amax_err = std::max(amax_err, re);
        dbias[static_cast<size_t>(j)] += rv;
        dbias_err[static_cast<size_t>(j)] += re + 2 * u * std::fabs(rv) * static_cast<double>(c.m);
      }
    }
  }

  // cuBLASLt's epilogues, as measured on an H200 (cuBLAS 13.0): DGELU rounds the matmul result
  // to D's type before multiplying by gelu'(aux), and its bias gradient sums those rounded values,
  // so 16-bit outputs may be off by one more rounding; the bias / GELU-aux epilogues may round
  // likewise; GELU may use an approximate tanh (relative error 2^-11).
  void widen_for_cublaslt() {
    const size_t mn = static_cast<size_t>(c.m * c.n);
    for (size_t i = 0; i < mn; ++i) {
      if (c.dt == kF16 || c.dt == kBF16) {
        // Its epilogues may also round the matmul result to D's type before adding the bias or
        // storing the GELU input (measured on a 16-bit aux).
        const double b =
            uses_bias(c.ep) ? std::fabs(bias.values[i % static_cast<size_t>(c.n)]) : 0.0;
        const double e = 2 * rel_round(c.dt) * (std::fabs(t[i]) + b);
        t_err[i] += e;
        r_err[i] += is_gelu(c.ep) ? 1.2 * e : (is_dgelu(c.ep) ? 0.0 : e);
      }
      double extra = 0;
      if (is_dgelu(c.ep))
        extra = 2 * rel_round(c.dt) * std::fabs(r[i]) + 2 * rel_round(c.dt) * std::fabs(t[i]) * 1.2;
      if (is_gelu(c.ep)) extra = std::fabs(t[i]) * std::ldexp(1.0, -11);
      r_err[i] += extra;
      amax_err = std::max(amax_err, r_err[i]);
      dbias_err[i % static_cast<size_t>(c.n)] += extra;
    }
  }

  ApiCall call() const {
    const Case cs = c;
    return [cs](const std::vector<void*>& p, const fus_context& ctx) {
      fus_gemm_args g{};
      g.a = fus_tensor{p[kA], cs.at, cs.transa ? cs.k : cs.m, cs.transa ? cs.m : cs.k};
      g.b = fus_tensor{p[kB], cs.bt, cs.transb ? cs.n : cs.k, cs.transb ? cs.k : cs.n};
      g.transa = cs.transa;
      g.transb = cs.transb;
      g.a_scale_inv = static_cast<const float*>(p[kSa]);
      g.b_scale_inv = static_cast<const float*>(p[kSb]);
      g.d = fus_tensor{p[kD], cs.dt, cs.m, cs.n};
      g.d_scale = static_cast<const float*>(p[kDs]);
      g.d_amax = static_cast<float*>(p[kAmax]);
      g.alpha = cs.alpha;
      g.beta = cs.beta;
      if (cs.beta != 0.0f) g.c = fus_tensor{cs.c_is_d ? p[kD] : p[kC], cs.dt, cs.m, cs.n};
      g.epilogue = cs.ep;
      g.use_fast_accum = cs.fast_accum;
      if (uses_bias(cs.ep)) g.bias = fus_tensor{p[kBias], cs.bias_dtype(), 1, cs.n};
      if (writes_aux(cs.ep) || is_dgelu(cs.ep))
        g.aux = fus_tensor{p[kAux], cs.vec_dtype, cs.m, cs.n};
      if (is_bgrad(cs.ep)) g.dbias = fus_tensor{p[kDbias], cs.vec_dtype, 1, cs.n};
      return fus_gemm(&g, &ctx);
    };
  }

  // Checks the outputs in bufs against the reference; err_scale widens the bounds (CUDA).
  ::testing::AssertionResult check(const Buffers& bufs, double err_scale = 1.0) const {
    std::ostringstream fail;
    int bad = 0;
    auto expect_close = [&](const char* what, size_t i, double got, double want, double tol) {
      if (std::fabs(got - want) <= tol || (std::isnan(got) && std::isnan(want))) return;
      if (bad < 6)
        fail << "\n  " << what << "[" << i << "]: got " << got << ", want " << want << " +- "
             << tol;
      ++bad;
    };
    const size_t mn = static_cast<size_t>(c.m * c.n);
    const double ds = is_fp8(c.dt) ? c.d_scale : 1.0;
    for (size_t i = 0; i < mn; ++i) {
      const double tol =
          1.1 * err_scale * r_err[i] + rel_round(c.dt) * std::fabs(r[i]) + abs_round(c.dt) / ds;
      expect_close("d", i, out_value(bufs.b[kD], c.dt, i, ds), r[i], tol);
    }
    if (writes_aux(c.ep)) {
      for (size_t i = 0; i < mn; ++i) {
        const double tol = err_scale * t_err[i] + rel_round(c.vec_dtype) * std::fabs(t[i]) +
                           abs_round(c.vec_dtype);
        expect_close("aux", i, load_as_double(bufs.b[kAux], c.vec_dtype, i), t[i], tol);
      }
    }
    if (is_bgrad(c.ep)) {
      for (size_t j = 0; j < static_cast<size_t>(c.n); ++j) {
        const double tol = err_scale * dbias_err[j] + rel_round(c.vec_dtype) * std::fabs(dbias[j]) +
                           abs_round(c.vec_dtype);
        expect_close("dbias", j, load_as_double(bufs.b[kDbias], c.vec_dtype, j), dbias[j], tol);
      }
    }
    if (c.want_amax && is_fp8(c.dt)) {
      const double got = bufs.get<float>(kAmax)[0];
      expect_close("d_amax", 0, got, amax, err_scale * amax_err);
    }
    if (bad == 0) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << c.str() << ": " << bad << " mismatches" << fail.str();
  }
};

// The FP8 combinations fusible/gemm.h refuses (no cuBLASLt kernel).
bool supported(const Case& c) {
  if (!is_fp8(c.at)) return true;
  if (c.dt == kE5M2 && c.at == kE4M3 && c.bt == kE4M3) return false;
  if (c.dt == kF32 &&
      (c.ep == FUS_GEMM_EPILOGUE_BIAS_GELU_AUX || c.ep == FUS_GEMM_EPILOGUE_DGELU_BGRAD))
    return false;
  if (is_fp8(c.dt) && is_dgelu(c.ep)) return false;
  return true;
}

::testing::AssertionResult run_and_check_cpu(const Case& cs) {
  Problem p(cs);
  Buffers bufs = p.init;
  const fus_status st = run_cpu(bufs, p.call());
  if (!supported(cs)) {
    if (st == FUS_ERROR_UNSUPPORTED) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << cs.str() << ": expected FUS_ERROR_UNSUPPORTED, got "
                                         << st << " (" << fus_last_error() << ")";
  }
  if (st != FUS_SUCCESS)
    return ::testing::AssertionFailure()
           << cs.str() << ": status " << st << ": " << fus_last_error();
  return p.check(bufs);
}

// ---- CPU backend vs FP64
// -------------------------------------------------------------------------

struct Size {
  int64_t m, n, k;
};
const Size kOddSizes[] = {{1, 1, 1}, {7, 13, 5}, {13, 7, 127}, {127, 1, 13}, {1, 127, 7}};

TEST(GemmCpu, HighPrecisionAllTransposesAndOddSizes) {
  uint32_t seed = 1;
  for (fus_dtype dt : {kF32, kF16, kBF16}) {
    for (bool out_fp32 : {false, true}) {
      if (dt == kF32 && out_fp32) continue;
      for (int ta = 0; ta < 2; ++ta) {
        for (int tb = 0; tb < 2; ++tb) {
          for (const Size& sz : kOddSizes) {
            Case c;
            c.size(sz.m, sz.n, sz.k).types(dt, out_fp32 ? kF32 : dt).trans(ta, tb);
            c.seed = seed++;
            EXPECT_TRUE(run_and_check_cpu(c.finish()));
          }
        }
      }
    }
  }
}

TEST(GemmCpu, BlockBoundariesOfTheTiledLoops) {
  // Tiles are 64 x 256 with K panels of 256: cross each boundary, with every transpose.
  const Size sizes[] = {{65, 257, 257}, {128, 256, 512}, {63, 300, 700}};
  uint32_t seed = 100;
  for (const Size& sz : sizes) {
    for (int ta = 0; ta < 2; ++ta) {
      for (int tb = 0; tb < 2; ++tb) {
        Case c;
        c.size(sz.m, sz.n, sz.k).types(kBF16, kF32).trans(ta, tb);
        c.ep = FUS_GEMM_EPILOGUE_DGELU_BGRAD;
        c.seed = seed++;
        EXPECT_TRUE(run_and_check_cpu(c.finish()));
      }
    }
  }
}

TEST(GemmCpu, EveryEpilogueEveryHighPrecisionOutput) {
  uint32_t seed = 200;
  for (fus_gemm_epilogue ep : kAllEpilogues) {
    for (fus_dtype in : {kF32, kF16, kBF16}) {
      for (fus_dtype out : {in, kF32}) {
        for (const Size& sz : {Size{7, 13, 5}, Size{33, 40, 127}}) {
          Case c;
          c.size(sz.m, sz.n, sz.k).types(in, out).trans((seed % 2) == 1, (seed % 3) == 1);
          c.ep = ep;
          c.alpha = (seed % 4 == 0) ? 0.75f : 1.0f;
          c.seed = seed++;
          EXPECT_TRUE(run_and_check_cpu(c.finish()));
        }
      }
    }
  }
}

TEST(GemmCpu, AccumulateWithCAndResidualBias) {
  uint32_t seed = 300;
  for (fus_gemm_epilogue ep : {FUS_GEMM_EPILOGUE_NONE, FUS_GEMM_EPILOGUE_BIAS}) {
    for (fus_dtype in : {kF32, kBF16, kF16}) {
      for (fus_dtype out : {in, kF32}) {
        for (bool in_place : {false, true}) {
          for (float beta : {1.0f, -0.5f}) {
            Case c;
            c.size(13, 7, 31).types(in, out).trans(in_place, !in_place);
            c.ep = ep;
            c.beta = beta;
            c.c_is_d = in_place;
            c.seed = seed++;
            EXPECT_TRUE(run_and_check_cpu(c.finish()));
          }
        }
      }
    }
  }
}

TEST(GemmCpu, BetaZeroNeverReadsC) {
  // beta == 0: C is not read, so NaN in it must not reach D (BLAS convention).
  Case cs;
  cs.size(3, 4, 5);
  cs.finish();
  Problem p(cs);
  Buffers bufs = p.init;
  std::vector<float> nan_c(12, qnan());
  ApiCall base = p.call();
  const fus_status st = run_cpu(bufs, [&](const std::vector<void*>& ptrs, const fus_context& ctx) {
    fus_gemm_args g{};
    g.a = fus_tensor{ptrs[kA], kF32, 3, 5};
    g.b = fus_tensor{ptrs[kB], kF32, 5, 4};
    g.d = fus_tensor{ptrs[kD], kF32, 3, 4};
    g.c = fus_tensor{nan_c.data(), kF32, 3, 4};
    g.alpha = 1.0f;
    g.beta = 0.0f;
    return fus_gemm(&g, &ctx);
  });
  ASSERT_EQ(st, FUS_SUCCESS) << fus_last_error();
  EXPECT_TRUE(p.check(bufs));
}

TEST(GemmCpu, Fp8OperandsWithScalesAllMixes) {
  uint32_t seed = 400;
  const fus_dtype mixes[][2] = {{kE4M3, kE4M3}, {kE4M3, kE5M2}, {kE5M2, kE4M3}};
  for (const auto& mix : mixes) {
    for (fus_dtype out : {kF32, kBF16, kF16, kE4M3, kE5M2}) {
      for (const Size& sz : {Size{1, 1, 1}, Size{7, 13, 5}, Size{13, 16, 127}, Size{127, 32, 64}}) {
        Case c;
        c.size(sz.m, sz.n, sz.k)
            .types(mix[0], mix[1], out)
            .trans(false, true)
            .scales((seed % 2) ? 0.5f : 1.0f / 3.0f, (seed % 3) ? 0.375f : 3.0f, 1.0f / 64);
        c.want_amax = is_fp8(out) && (seed % 2 == 0);
        c.seed = seed++;
        EXPECT_TRUE(run_and_check_cpu(c.finish()));
      }
    }
  }
}

TEST(GemmCpu, Fp8EveryEpilogue) {
  uint32_t seed = 500;
  for (fus_gemm_epilogue ep : kAllEpilogues) {
    for (fus_dtype out : {kF32, kBF16, kF16, kE4M3, kE5M2}) {
      Case c;
      c.size(13, 16, 32).types(kE4M3, (seed % 2) ? kE5M2 : kE4M3, out).trans(false, true);
      c.ep = ep;
      c.scales(0.25f, 0.125f, 1.0f / 16);
      c.want_amax = is_fp8(out);
      c.seed = seed++;
      EXPECT_TRUE(run_and_check_cpu(c.finish()));
    }
  }
}

TEST(GemmCpu, Fp8OutputAmaxIsMaxAbsOfTheUnscaledResult) {
  Case c;
  c.size(5, 16, 16).types(kE4M3, kE4M3);
  c.transb = true;
  c.want_amax = true;
  c.d_scale = 1.0f / 128;
  c.finish();
  Problem p(c);
  Buffers bufs = p.init;
  ASSERT_EQ(run_cpu(bufs, p.call()), FUS_SUCCESS) << fus_last_error();
  EXPECT_TRUE(p.check(bufs));
  EXPECT_NEAR(bufs.get<float>(kAmax)[0], p.amax, p.amax_err);
}

TEST(GemmCpu, Fp8OutputSaturates) {
  // A huge d_scale: every nonzero output saturates to +-448 (E4M3 has no inf).
  Case c;
  c.size(4, 16, 16).types(kE4M3, kE4M3);
  c.transb = true;
  c.d_scale = 1e30f;
  c.finish();
  Problem p(c);
  Buffers bufs = p.init;
  ASSERT_EQ(run_cpu(bufs, p.call()), FUS_SUCCESS) << fus_last_error();
  const std::vector<uint8_t> d = bufs.get<uint8_t>(kD);
  for (size_t i = 0; i < d.size(); ++i) {
    if (p.r[i] == 0) continue;
    EXPECT_EQ(d[i] & 0x7f, 0x7e) << i;
    EXPECT_EQ((d[i] & 0x80) != 0, p.r[i] < 0) << i;
  }
}

// The documented order: one fp32 accumulator per element, products added in ascending k; then
// t = (alpha * s) * acc (+ beta * c) (+ bias), each one fp32 operation. A naive float loop gives
// the same bits.
TEST(GemmCpu, SummationOrderIsAscendingKInFp32BitForBit) {
  for (fus_gemm_epilogue ep : kAllEpilogues) {
    for (bool fp8 : {false, true}) {
      Case c;
      c.size(70, 260, 300)  // crosses the 64 x 256 tiles and the 256-deep K panels
          .types(fp8 ? kE4M3 : kF32, kF32)
          .trans(false, true);
      c.ep = ep;
      c.alpha = 0.7f;
      c.beta = (ep == FUS_GEMM_EPILOGUE_BIAS && !fp8) ? 0.3f : 0.0f;
      c.value_exp = 8;
      c.seed = 600 + static_cast<uint32_t>(ep) + (fp8 ? 50 : 0);
      c.finish();
      if (!supported(c)) continue;  // FP8 with a float32 output: not every epilogue
      SCOPED_TRACE(c.str());
      Problem p(c);
      Buffers bufs = p.init;
      ASSERT_EQ(run_cpu(bufs, p.call()), FUS_SUCCESS) << fus_last_error();
      const float s = fp8 ? c.alpha * (c.a_scale_inv * c.b_scale_inv) : c.alpha;
      const std::vector<float> d = bufs.get<float>(kD);
      const std::vector<float> aux = writes_aux(ep) ? bufs.get<float>(kAux) : std::vector<float>();
      const std::vector<float> dbias =
          is_bgrad(ep) ? bufs.get<float>(kDbias) : std::vector<float>();
      std::vector<float> col_sum(static_cast<size_t>(c.n), 0.0f);
      int bad = 0;
      for (int64_t i = 0; i < c.m; ++i) {
        for (int64_t j = 0; j < c.n; ++j) {
          volatile float acc = 0.0f;  // volatile: no contraction, no reassociation
          for (int64_t k = 0; k < c.k; ++k) {
            volatile float prod = static_cast<float>(p.opa(i, k)) * static_cast<float>(p.opb(k, j));
            acc = acc + prod;
          }
          const size_t idx = static_cast<size_t>(i * c.n + j);
          volatile float t = s * acc;
          if (c.beta != 0.0f) {
            volatile float bc = c.beta * static_cast<float>(p.cmat.values[idx]);
            t = t + bc;
          }
          if (uses_bias(ep)) t = t + static_cast<float>(p.bias.values[static_cast<size_t>(j)]);
          float r = t;
          if (is_gelu(ep)) r = fusible::gelu_tanh(t);
          if (is_dgelu(ep)) r = t * fusible::dgelu_tanh(static_cast<float>(p.aux_in.values[idx]));
          if (f2u(d[idx]) != f2u(r) && bad++ < 5)
            ADD_FAILURE() << "d[" << idx << "] " << d[idx] << " != " << r;
          if (writes_aux(ep) && f2u(aux[idx]) != f2u(t) && bad++ < 5)
            ADD_FAILURE() << "aux[" << idx << "] " << aux[idx] << " != " << t;
          col_sum[static_cast<size_t>(j)] += r;
        }
      }
      for (size_t j = 0; j < dbias.size(); ++j)
        if (f2u(dbias[j]) != f2u(col_sum[j]) && bad++ < 5)
          ADD_FAILURE() << "dbias[" << j << "] " << dbias[j] << " != " << col_sum[j];
      EXPECT_EQ(bad, 0);
    }
  }
}

TEST(GemmCpu, EmptyProblems) {
  // K == 0: t = beta * C (+ bias), epilogue still applied. M or N == 0: dbias zero, amax zero.
  for (fus_gemm_epilogue ep : kAllEpilogues) {
    Case c;
    c.size(3, 5, 0).types(kBF16, kF32);
    c.ep = ep;
    c.seed = 700 + static_cast<uint32_t>(ep);
    EXPECT_TRUE(run_and_check_cpu(c.finish()));
  }
  {
    Case c;
    c.size(3, 5, 0);
    c.beta = 1.0f;
    c.ep = FUS_GEMM_EPILOGUE_BIAS;
    EXPECT_TRUE(run_and_check_cpu(c.finish()));
  }
  for (const Size& sz : {Size{0, 5, 3}, Size{4, 0, 3}, Size{0, 0, 0}}) {
    Case c;
    c.size(sz.m, sz.n, sz.k);
    c.ep = FUS_GEMM_EPILOGUE_DGELU_BGRAD;
    c.finish();
    Problem p(c);
    Buffers bufs = p.init;
    ASSERT_EQ(run_cpu(bufs, p.call()), FUS_SUCCESS) << fus_last_error();
    for (float v : bufs.get<float>(kDbias)) EXPECT_EQ(f2u(v), 0u);
  }
  {
    Case c;
    c.size(0, 16, 16).types(kE4M3, kE4M3);
    c.transb = true;
    c.want_amax = true;
    c.finish();
    Problem p(c);
    Buffers bufs = p.init;
    ASSERT_EQ(run_cpu(bufs, p.call()), FUS_SUCCESS) << fus_last_error();
    EXPECT_EQ(bufs.get<float>(kAmax)[0], 0.0f);
  }
}

// ---- argument validation
// -------------------------------------------------------------------------

// A valid bf16 call [4, 16] @ [16, 8] with buffers owned by the fixture; tests break one thing.
class GemmArgs : public ::testing::Test {
 protected:
  std::vector<uint16_t> a = std::vector<uint16_t>(64, 0x3f80),
                        b = std::vector<uint16_t>(128, 0x3f80);
  std::vector<uint16_t> d = std::vector<uint16_t>(64), c = std::vector<uint16_t>(64);
  std::vector<uint16_t> bias = std::vector<uint16_t>(8), aux = std::vector<uint16_t>(32);
  std::vector<uint8_t> a8 = std::vector<uint8_t>(64 + 16), b8 = std::vector<uint8_t>(128 + 16);
  std::vector<float> scales = std::vector<float>(4, 1.0f);
  fus_gemm_args g{};
  fus_context cpu = cpu_ctx();

  void SetUp() override {
    g = fus_gemm_args{};
    g.a = fus_tensor{a.data(), kBF16, 4, 16};
    g.b = fus_tensor{b.data(), kBF16, 16, 8};
    g.d = fus_tensor{d.data(), kBF16, 4, 8};
    g.alpha = 1.0f;
  }
  void make_fp8() {
    g.a = fus_tensor{a8.data(), kE4M3, 4, 16};
    g.b = fus_tensor{b8.data(), kE4M3, 8, 16};
    g.transa = 0;
    g.transb = 1;
    g.a_scale_inv = &scales[0];
    g.b_scale_inv = &scales[1];
  }
  fus_status run() { return fus_gemm(&g, &cpu); }
};

TEST_F(GemmArgs, ValidCallSucceeds) {
  EXPECT_EQ(run(), FUS_SUCCESS) << fus_last_error();
  EXPECT_STREQ(fus_last_error(), "");
  make_fp8();
  EXPECT_EQ(run(), FUS_SUCCESS) << fus_last_error();
}

TEST_F(GemmArgs, NullArgsAndContext) {
  EXPECT_TRUE(is_error(fus_gemm(nullptr, &cpu), FUS_ERROR_INVALID_ARGUMENT, {"fus_gemm", "args"}));
  EXPECT_TRUE(is_error(fus_gemm(&g, nullptr), FUS_ERROR_INVALID_ARGUMENT, {"fus_gemm", "ctx"}));
  g.a.data = nullptr;
  EXPECT_TRUE(is_error(run(), FUS_ERROR_INVALID_ARGUMENT, {"fus_gemm", "a", "NULL"}));
}

TEST_F(GemmArgs, TransposeFlagsAndInnerDimension) {
  g.transa = 2;
  EXPECT_TRUE(is_error(run(), FUS_ERROR_INVALID_ARGUMENT, {"transa"}));
  g.transa = 0;
  g.b.rows = 15;
  EXPECT_TRUE(is_error(run(), FUS_ERROR_INVALID_ARGUMENT, {"inner dimensions", "op(a)", "op(b)"}));
  g.b.rows = 16;
  g.transb = 1;  // b is now [N=16, K=8]
  EXPECT_TRUE(is_error(run(), FUS_ERROR_INVALID_ARGUMENT, {"inner dimensions"}));
}

TEST_F(GemmArgs, OperandDtypes) {
  g.b.dtype = kF16;
  EXPECT_TRUE(is_error(run(), FUS_ERROR_INVALID_ARGUMENT, {"b", "float16", "bfloat16"}));
  g.b = fus_tensor{b8.data(), kE4M3, 16, 8};
  EXPECT_TRUE(is_error(run(), FUS_ERROR_INVALID_ARGUMENT, {"both be FP8 or both high precision"}));
  g.a.dtype = FUS_E8M0;
  EXPECT_TRUE(is_error(run(), FUS_ERROR_INVALID_ARGUMENT, {"a", "e8m0"}));
}

TEST_F(GemmArgs, Fp8LayoutScalesAndFormats) {
  make_fp8();
  g.transb = 0;
  g.b = fus_tensor{b8.data(), kE4M3, 16, 8};
  EXPECT_TRUE(is_error(run(), FUS_ERROR_UNSUPPORTED, {"operand b", "transb = 1", "[N, K]"}));
  make_fp8();
  g.transa = 1;
  g.a = fus_tensor{a8.data(), kE4M3, 16, 4};
  EXPECT_TRUE(is_error(run(), FUS_ERROR_UNSUPPORTED, {"operand a", "transa = 0"}));
  make_fp8();
  g.a.dtype = g.b.dtype = kE5M2;
  EXPECT_TRUE(is_error(run(), FUS_ERROR_UNSUPPORTED, {"float8_e5m2", "E5M2 x E5M2"}));
  make_fp8();
  g.b.dtype = kE5M2;
  EXPECT_EQ(run(), FUS_SUCCESS) << fus_last_error();
  g.a_scale_inv = nullptr;
  EXPECT_TRUE(is_error(run(), FUS_ERROR_INVALID_ARGUMENT, {"a_scale_inv"}));
  make_fp8();
  g.b_scale_inv = nullptr;
  EXPECT_TRUE(is_error(run(), FUS_ERROR_INVALID_ARGUMENT, {"b_scale_inv"}));
  SetUp();
  g.a_scale_inv = &scales[0];
  EXPECT_TRUE(is_error(run(), FUS_ERROR_INVALID_ARGUMENT, {"a_scale_inv", "high-precision"}));
}

TEST_F(GemmArgs, OutputShapeDtypeScaleAmax) {
  g.d.cols = 7;
  EXPECT_TRUE(is_error(run(), FUS_ERROR_INVALID_ARGUMENT, {"d", "[4, 7]", "[4, 8]"}));
  SetUp();
  g.d.dtype = kF16;
  EXPECT_TRUE(is_error(run(), FUS_ERROR_INVALID_ARGUMENT, {"d", "float16"}));
  g.d.dtype = kE4M3;
  EXPECT_TRUE(is_error(run(), FUS_ERROR_INVALID_ARGUMENT, {"d", "float8_e4m3"}));
  SetUp();
  g.d.dtype = kF32;
  EXPECT_EQ(run(), FUS_SUCCESS) << fus_last_error();
  g.d_amax = &scales[2];
  EXPECT_TRUE(is_error(run(), FUS_ERROR_INVALID_ARGUMENT, {"d_amax", "high-precision"}));
  g.d_amax = nullptr;
  g.d_scale = &scales[2];
  EXPECT_TRUE(is_error(run(), FUS_ERROR_INVALID_ARGUMENT, {"d_scale"}));
  make_fp8();
  g.d_scale = nullptr;
  g.d = fus_tensor{b8.data(), kE4M3, 4, 8};
  EXPECT_TRUE(is_error(run(), FUS_ERROR_INVALID_ARGUMENT, {"d_scale", "FP8 output"}));
  g.d_scale = &scales[2];
  g.d_amax = &scales[3];
  EXPECT_EQ(run(), FUS_SUCCESS) << fus_last_error();
}

TEST_F(GemmArgs, EpilogueTensorsRequiredOrRejected) {
  g.epilogue = static_cast<fus_gemm_epilogue>(42);
  EXPECT_TRUE(is_error(run(), FUS_ERROR_INVALID_ARGUMENT, {"epilogue", "42"}));
  g.epilogue = FUS_GEMM_EPILOGUE_BIAS;
  EXPECT_TRUE(is_error(run(), FUS_ERROR_INVALID_ARGUMENT, {"bias", "required", "BIAS"}));
  g.bias = fus_tensor{bias.data(), kBF16, 1, 7};
  EXPECT_TRUE(is_error(run(), FUS_ERROR_INVALID_ARGUMENT, {"bias", "[1, 7]", "[1, 8]"}));
  g.bias = fus_tensor{bias.data(), kF16, 1, 8};
  EXPECT_TRUE(is_error(run(), FUS_ERROR_INVALID_ARGUMENT, {"bias", "float16", "d's dtype"}));
  g.bias.dtype = kBF16;
  EXPECT_EQ(run(), FUS_SUCCESS) << fus_last_error();
  g.epilogue = FUS_GEMM_EPILOGUE_NONE;
  EXPECT_TRUE(is_error(run(), FUS_ERROR_INVALID_ARGUMENT, {"bias", "does not use it", "NONE"}));
  g.bias = fus_tensor{};
  g.epilogue = FUS_GEMM_EPILOGUE_DGELU;
  EXPECT_TRUE(is_error(run(), FUS_ERROR_INVALID_ARGUMENT, {"aux", "required", "DGELU"}));
  g.aux = fus_tensor{aux.data(), kBF16, 4, 8};
  EXPECT_EQ(run(), FUS_SUCCESS) << fus_last_error();
  g.epilogue = FUS_GEMM_EPILOGUE_DGELU_BGRAD;
  EXPECT_TRUE(is_error(run(), FUS_ERROR_INVALID_ARGUMENT, {"dbias", "required"}));
  g.dbias = fus_tensor{bias.data(), kF32, 1, 8};
  EXPECT_TRUE(is_error(run(), FUS_ERROR_INVALID_ARGUMENT, {"dbias", "float32"}));
  g.dbias.dtype = kBF16;
  EXPECT_EQ(run(), FUS_SUCCESS) << fus_last_error();
  g.epilogue = FUS_GEMM_EPILOGUE_GELU;
  EXPECT_TRUE(is_error(run(), FUS_ERROR_INVALID_ARGUMENT, {"aux", "does not use it", "GELU"}));
}

TEST_F(GemmArgs, Fp8EpilogueDtypeRules) {
  make_fp8();
  g.d = fus_tensor{d.data(), kF32, 4, 8};
  g.epilogue = FUS_GEMM_EPILOGUE_BIAS;
  g.bias = fus_tensor{bias.data(), kF32, 1, 8};
  EXPECT_TRUE(is_error(run(), FUS_ERROR_INVALID_ARGUMENT, {"bias", "float32", "bfloat16"}));
  g.bias.dtype = kBF16;
  EXPECT_EQ(run(), FUS_SUCCESS) << fus_last_error();
  g.d = fus_tensor{b8.data(), kE4M3, 4, 8};
  g.d_scale = &scales[2];
  g.bias.dtype = kF16;
  EXPECT_EQ(run(), FUS_SUCCESS) << fus_last_error();
  g.bias.dtype = kF32;
  EXPECT_TRUE(is_error(run(), FUS_ERROR_INVALID_ARGUMENT, {"bias", "bfloat16 or float16"}));
}

TEST_F(GemmArgs, AccumulateRules) {
  g.beta = 1.0f;
  EXPECT_TRUE(is_error(run(), FUS_ERROR_INVALID_ARGUMENT, {"c", "beta"}));
  g.c = fus_tensor{c.data(), kF32, 4, 8};
  EXPECT_TRUE(is_error(run(), FUS_ERROR_INVALID_ARGUMENT, {"c", "float32"}));
  g.c.dtype = kBF16;
  EXPECT_EQ(run(), FUS_SUCCESS) << fus_last_error();
  g.c.data = d.data();  // in place
  EXPECT_EQ(run(), FUS_SUCCESS) << fus_last_error();
  g.c.data = d.data() + 1;  // partial overlap
  EXPECT_TRUE(is_error(run(), FUS_ERROR_INVALID_ARGUMENT, {"c", "overlaps"}));
  g.c.data = c.data();
  g.epilogue = FUS_GEMM_EPILOGUE_GELU;
  EXPECT_TRUE(is_error(run(), FUS_ERROR_INVALID_ARGUMENT, {"c", "NONE and BIAS", "GELU"}));
  g.epilogue = FUS_GEMM_EPILOGUE_NONE;
  make_fp8();
  g.d = fus_tensor{b8.data(), kE4M3, 4, 8};
  g.d_scale = &scales[2];
  g.c = fus_tensor{b8.data(), kE4M3, 4, 8};
  EXPECT_TRUE(is_error(run(), FUS_ERROR_INVALID_ARGUMENT, {"c", "FP8 output"}));
}

// The cuBLASLt rules apply to CUDA contexts only, and are checked before any device work, so they
// are testable without a GPU in any build with the CUDA backend.
TEST_F(GemmArgs, CudaAlignmentRulesNameTheArgument) {
  if (!fus_has_cuda()) GTEST_SKIP() << "this build has no CUDA backend";
  const fus_context cuda = cuda_ctx();
  // Nothing is dereferenced: validation fails before any device work.
  auto align16 = [](std::vector<uint8_t>& v) {
    return reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(v.data()) + 15) &
                                      ~uintptr_t{15});
  };
  uint8_t* a16 = align16(a8);
  uint8_t* b16 = align16(b8);
  make_fp8();
  g.a = fus_tensor{a16, kE4M3, 8, 8};  // K = 8
  g.b = fus_tensor{b16, kE4M3, 8, 8};
  g.d = fus_tensor{d.data(), kBF16, 8, 8};
  EXPECT_TRUE(
      is_error(fus_gemm(&g, &cuda), FUS_ERROR_INVALID_ARGUMENT, {"K = 8", "multiple of 16"}));
  EXPECT_EQ(fus_gemm(&g, &cpu), FUS_SUCCESS) << fus_last_error();  // the CPU has no such rule
  g.a = fus_tensor{a16 + 1, kE4M3, 4, 16};
  g.b = fus_tensor{b16, kE4M3, 8, 16};
  g.d = fus_tensor{d.data(), kBF16, 4, 8};
  EXPECT_TRUE(is_error(fus_gemm(&g, &cuda), FUS_ERROR_INVALID_ARGUMENT, {"a.data", "16-byte"}));
  g.a.data = a16;
  g.b.data = b16 + 8;
  EXPECT_TRUE(is_error(fus_gemm(&g, &cuda), FUS_ERROR_INVALID_ARGUMENT, {"b.data", "16-byte"}));
  g.b.data = b16;
  // An FP8 D with N = 8 has 8-byte rows.
  std::vector<uint8_t> d8(64);
  g.d = fus_tensor{align16(d8), kE4M3, 4, 8};
  g.d_scale = &scales[2];
  EXPECT_TRUE(is_error(fus_gemm(&g, &cuda), FUS_ERROR_INVALID_ARGUMENT, {"N = 8", "d"}));
  EXPECT_EQ(fus_gemm(&g, &cpu), FUS_SUCCESS) << fus_last_error();
  // Aux epilogues need N % 8 == 0 (high precision too).
  SetUp();
  g.b.cols = 6;
  g.d.cols = 6;
  g.epilogue = FUS_GEMM_EPILOGUE_GELU_AUX;
  g.aux = fus_tensor{aux.data(), kBF16, 4, 6};
  EXPECT_TRUE(
      is_error(fus_gemm(&g, &cuda), FUS_ERROR_INVALID_ARGUMENT, {"aux", "N = 6", "multiple of 8"}));
  EXPECT_EQ(fus_gemm(&g, &cpu), FUS_SUCCESS) << fus_last_error();
}

TEST(GemmBuild, CublasLtAvailabilityMatchesTheBuild) {
  if (!fus_has_cuda()) {
    EXPECT_EQ(fus_gemm_has_cublaslt(), 0);
  }
#if defined(FUSIBLE_WITH_CUBLASLT)
  EXPECT_EQ(fus_gemm_has_cublaslt(), 1);
#endif
}

// ---- CUDA (cuBLASLt) vs CPU
// ----------------------------------------------------------------------

// Runs the case on both backends; each must be within its bound of the FP64 reference, and so
// within the sum of the bounds of each other. cuBLASLt's FP8 kernels promote the partial sums
// periodically rather than adding every product in fp32, so their bound per product is wider.
void expect_cuda_matches_cpu(const Case& cs) {
  SCOPED_TRACE(cs.str());
  if (!supported(cs)) {
    Problem p(cs);
    const DualResult res = run_both(p.init, p.call());
    EXPECT_EQ(res.cpu_status, FUS_ERROR_UNSUPPORTED);
    EXPECT_EQ(res.cuda_status, FUS_ERROR_UNSUPPORTED);
    return;
  }
  // Hopper's FP8 tensor cores add products with about 14 significant bits inside an MMA (cuBLASLt
  // promotes the partial sums to FP32 between MMAs unless fast accumulation is on); measured errors
  // stay below 2^-12 of sum |a b|, the bound allows 2^-9.
  const double floor = is_fp8(cs.at) ? std::ldexp(1.0, -9) : 0.0;
  Problem p(cs, std::ldexp(1.0, -22), floor);
  p.widen_for_cublaslt();
  const DualResult res = run_both(p.init, p.call());
  ASSERT_EQ(res.cpu_status, FUS_SUCCESS) << fus_last_error();
  ASSERT_EQ(res.cuda_status, FUS_SUCCESS) << fus_last_error();
  EXPECT_TRUE(p.check(res.cpu));
  EXPECT_TRUE(p.check(res.cuda));
  // Exact agreement is not expected, but a bug gives O(1) errors: also compare CPU vs CUDA.
  const size_t mn = static_cast<size_t>(cs.m * cs.n);
  const double ds = is_fp8(cs.dt) ? cs.d_scale : 1.0;
  size_t far = 0;
  for (size_t i = 0; i < mn; ++i) {
    const double a = out_value(res.cpu.b[kD], cs.dt, i, ds),
                 b = out_value(res.cuda.b[kD], cs.dt, i, ds);
    const double tol =
        2 * p.r_err[i] + 2 * rel_round(cs.dt) * std::fabs(p.r[i]) + 2 * abs_round(cs.dt) / ds;
    if (std::fabs(a - b) > tol) ++far;
  }
  EXPECT_EQ(far, 0u) << "elements where CPU and CUDA differ by more than both bounds";
}

TEST(GemmCuda, HighPrecisionAllTransposesOddSizes) {
  FUSTEST_REQUIRE_CUDA();
  uint32_t seed = 1000;
  for (fus_dtype in : {kF32, kF16, kBF16}) {
    for (fus_dtype out : {in, kF32}) {
      if (in == kF32 && out != kF32) continue;
      for (int ta = 0; ta < 2; ++ta)
        for (int tb = 0; tb < 2; ++tb)
          for (const Size& sz :
               {Size{1, 1, 1}, Size{7, 13, 5}, Size{127, 129, 67}, Size{256, 384, 512}}) {
            Case c;
            c.size(sz.m, sz.n, sz.k).types(in, out).trans(ta, tb);
            c.seed = seed++;
            expect_cuda_matches_cpu(c.finish());
          }
      if (in == kF32) break;
    }
  }
}

TEST(GemmCuda, HighPrecisionEveryEpilogueAndAccumulate) {
  FUSTEST_REQUIRE_CUDA();
  uint32_t seed = 1100;
  for (fus_gemm_epilogue ep : kAllEpilogues) {
    for (fus_dtype in : {kF32, kF16, kBF16}) {
      for (fus_dtype out : {in, kF32}) {
        Case c;
        c.size(127, 96, 200).types(in, out).trans((seed % 2) == 1, (seed % 3) != 1);
        c.ep = ep;
        c.alpha = 0.5f;
        c.seed = seed++;
        expect_cuda_matches_cpu(c.finish());
        if (ep == FUS_GEMM_EPILOGUE_NONE || ep == FUS_GEMM_EPILOGUE_BIAS) {
          c.beta = 1.0f;
          c.c_is_d = (seed % 2) == 0;
          c.seed = seed++;
          expect_cuda_matches_cpu(c);
        }
      }
    }
  }
}

TEST(GemmCuda, Fp8AllMixesOutputsAndEpilogues) {
  FUSTEST_REQUIRE_CUDA();
  uint32_t seed = 1200;
  const fus_dtype mixes[][2] = {{kE4M3, kE4M3}, {kE4M3, kE5M2}, {kE5M2, kE4M3}};
  for (const auto& mix : mixes) {
    for (fus_dtype out : {kF32, kBF16, kF16, kE4M3, kE5M2}) {
      for (fus_gemm_epilogue ep : kAllEpilogues) {
        for (const Size& sz : {Size{1, 16, 16}, Size{13, 48, 64}, Size{256, 256, 512}}) {
          Case c;
          c.size(sz.m, sz.n, sz.k)
              .types(mix[0], mix[1], out)
              .trans(false, true)
              .scales(0.5f, 1.0f / 3.0f, 1.0f / 32);
          c.ep = ep;
          c.want_amax = is_fp8(out);
          c.seed = seed++;
          expect_cuda_matches_cpu(c.finish());
        }
      }
    }
  }
}

TEST(GemmCuda, EmptyProblemsAndKZero) {
  FUSTEST_REQUIRE_CUDA();
  for (fus_gemm_epilogue ep : kAllEpilogues) {
    Case c;
    c.size(3, 8, 0).types(kBF16, kBF16);
    c.ep = ep;
    c.seed = 1300 + static_cast<uint32_t>(ep);
    expect_cuda_matches_cpu(c.finish());
  }
  for (const Size& sz : {Size{0, 8, 16}, Size{4, 0, 16}}) {
    Case c;
    c.size(sz.m, sz.n, sz.k).types(kBF16, kBF16);
    c.ep = FUS_GEMM_EPILOGUE_DGELU_BGRAD;
    expect_cuda_matches_cpu(c.finish());
  }
}

TEST(GemmCuda, BadShapesReportErrorsNotCrashes) {
  FUSTEST_REQUIRE_CUDA();
  // An FP8 layout cuBLASLt cannot run is refused before launch.
  Case c;
  c.size(4, 16, 16).types(kE4M3, kBF16).trans(true, true);
  c.finish();
  Problem p(c);
  Buffers bufs = p.init;
  EXPECT_TRUE(is_error(run_cuda(bufs, p.call()), FUS_ERROR_UNSUPPORTED, {"operand a"}));
}

TEST(GemmCpu, UnsupportedFp8CombinationsNameTheReason) {
  Case c;
  c.size(4, 16, 16);
  c.at = c.bt = kE4M3;
  c.transb = true;
  auto rejected = [&c](std::initializer_list<const char*> words) {
    c.finish();
    Problem p(c);
    Buffers bufs = p.init;
    return is_error(run_cpu(bufs, p.call()), FUS_ERROR_UNSUPPORTED, words);
  };
  c.dt = kE5M2;
  EXPECT_TRUE(rejected({"float8_e5m2", "E5M2 operand"}));
  c.dt = kF32;
  c.ep = FUS_GEMM_EPILOGUE_DGELU_BGRAD;
  EXPECT_TRUE(rejected({"DGELU_BGRAD", "float32"}));
  c.dt = kE4M3;
  c.ep = FUS_GEMM_EPILOGUE_DGELU;
  EXPECT_TRUE(rejected({"DGELU", "FP8 output"}));
}

TEST(GemmCuda, Fp8FastAccumulation) {
  FUSTEST_REQUIRE_CUDA();
  for (fus_gemm_epilogue ep : {FUS_GEMM_EPILOGUE_NONE, FUS_GEMM_EPILOGUE_BIAS_GELU_AUX}) {
    Case c;
    c.size(128, 256, 1024).types(kE4M3, kBF16).trans(false, true);
    c.ep = ep;
    c.fast_accum = true;
    c.seed = 1500 + static_cast<uint32_t>(ep);
    expect_cuda_matches_cpu(c.finish());
  }
}

TEST(GemmCuda, HighPrecisionFp32WithAndWithoutTf32) {
  FUSTEST_REQUIRE_CUDA();
  Case c;
  c.size(64, 64, 256).types(kF32, kF32);
  c.seed = 1600;
  expect_cuda_matches_cpu(c.finish());  // precise: full fp32 products
}

#if defined(FUSIBLE_WITH_CUDA)
// The first GEMM on a fresh stream happens inside a stream capture (its workspace is allocated in
// relaxed capture mode, outside the graph); replaying the graph gives the eager result.
TEST(GemmCuda, CapturedInACudaGraphIncludingTheFirstCallOnAStream) {
  FUSTEST_REQUIRE_CUDA();
  Case c;
  c.size(64, 128, 256).types(kE4M3, kBF16).trans(false, true);
  c.ep = FUS_GEMM_EPILOGUE_BIAS_GELU_AUX;
  c.seed = 1700;
  c.finish();
  Problem p(c);
  Buffers cpu = p.init;
  ASSERT_EQ(run_cpu(cpu, p.call()), FUS_SUCCESS) << fus_last_error();

  DeviceBuffers dev(p.init);
  ASSERT_TRUE(dev.ok());
  cudaStream_t stream;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const fus_context ctx{FUS_DEVICE_CUDA, 0, stream};
  cudaGraph_t graph;
  ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
  const fus_status st = p.call()(dev.ptrs, ctx);
  ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
  ASSERT_EQ(st, FUS_SUCCESS) << fus_last_error();
  cudaGraphExec_t exec;
  ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);
  ASSERT_EQ(cudaGraphLaunch(exec, stream), cudaSuccess);  // replays are idempotent
  ASSERT_EQ(cudaStreamSynchronize(stream), cudaSuccess);
  Buffers got = p.init;
  ASSERT_TRUE(dev.copy_back(got));
  cudaGraphExecDestroy(exec);
  cudaGraphDestroy(graph);
  cudaStreamDestroy(stream);
  Problem wide(c, std::ldexp(1.0, -22), std::ldexp(1.0, -9));
  wide.widen_for_cublaslt();
  EXPECT_TRUE(wide.check(got));
  EXPECT_TRUE(p.check(cpu));
}
#endif

}  // namespace
