// Tests of the activation family: the shared math (common/activation_math.h) against long-double
// references, the CPU backend through the C API against FP64 references (forward, backward,
// dbias), the quantized output against fus_quantize of the high-precision output (bit for bit),
// the documented dbias order, argument validation, and, where a CUDA device is present, the CUDA
// backend against the CPU backend bit for bit.
#include <gtest/gtest.h>

#include <random>
#include <sstream>
#include <tuple>

#include "common/activation_math.h"
#include "fused_test_utils.h"
#include "fusible/activation.h"

using namespace fustest;
namespace fu = fusible;

namespace {

using LD = long double;

// ---- long-double references
// -----------------------------------------------------------------------

LD sigmoid_ref(LD x) { return 1.0L / (1.0L + std::exp(-x)); }
LD gelu_tanh_ref(LD x) {
  const LD v =
      2.0L * std::sqrt(2.0L / 3.14159265358979323846264338327950288L) * (x + 0.044715L * x * x * x);
  return x * sigmoid_ref(v);  // = 0.5 x (1 + tanh(v / 2)) without cancellation
}
LD dgelu_tanh_ref(LD x) {
  const LD k = 2.0L * std::sqrt(2.0L / 3.14159265358979323846264338327950288L);
  const LD s = sigmoid_ref(k * (x + 0.044715L * x * x * x));
  return s + x * s * (1.0L - s) * k * (1.0L + 3.0L * 0.044715L * x * x);
}
LD gelu_erf_ref(LD x) { return 0.5L * x * std::erfc(-x / std::sqrt(2.0L)); }
LD dgelu_erf_ref(LD x) {
  return 0.5L * std::erfc(-x / std::sqrt(2.0L)) +
         x * std::exp(-x * x / 2.0L) / std::sqrt(2.0L * 3.14159265358979323846264338327950288L);
}
LD silu_ref(LD x) { return x * sigmoid_ref(x); }
LD dsilu_ref(LD x) {
  const LD s = sigmoid_ref(x);
  return s * (1.0L + x * (1.0L - s));
}
LD relu_ref(LD x) { return x < 0 ? 0.0L : x; }
LD drelu_ref(LD x) { return x > 0 ? 1.0L : 0.0L; }

// Error in units of the float spacing at ref (2^-149 below the normal range).
double ulps(float got, LD ref) {
  int e = std::ilogb(static_cast<double>(ref));
  if (ref == 0 || e < -126) e = -126;
  return static_cast<double>(std::fabs(static_cast<LD>(got) - ref) / std::ldexp(1.0L, e - 23));
}

std::vector<float> sample_points(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> v(n);
  for (size_t i = 0; i < n; ++i)
    v[i] = i % 2 ? u(rng) * 12.0f : std::ldexp(u(rng), static_cast<int>(i % 40) - 30);
  return v;
}

// Every float in [lo, hi] whose bit pattern is a multiple of stride above that of the end nearer
// 0, and both ends: every binade sampled alike, so densest near 0.
std::vector<float> floats_in(float lo, float hi, uint32_t stride) {
  std::vector<float> v;
  auto walk = [&](float near0, float far) {  // same sign, |near0| <= |far|
    for (uint64_t u = f2u(near0); u <= f2u(far); u += stride)
      v.push_back(u2f(static_cast<uint32_t>(u)));
    v.push_back(far);
  };
  if (lo < 0) walk(hi < 0 ? hi : -0.0f, lo);
  if (hi >= 0) walk(lo > 0 ? lo : 0.0f, hi);
  return v;
}

// The largest error seen and where (a NaN error counts as the largest).
struct Worst {
  double err = 0;
  float at = 0;
  void add(double e, float x) {
    if (!(e <= err)) err = std::isnan(e) ? std::numeric_limits<double>::infinity() : e, at = x;
  }
};

// Derivative error relative to max(|d|, 0.1) (absolute near the zeros of d).
double drel(float got, LD ref) {
  return static_cast<double>(std::fabs(got - ref) / std::max(std::fabs(ref), 0.1L));
}

TEST(ActivationMath, ExpWithinDocumentedUlpsFlushingBelowHalfTheSmallestNormal) {
  Worst w, w2;
  for (float x : floats_in(-87.68f, 0.0f, 1021))  // subnormal results from -87.34 on
    w.add(ulps(fu::exp_neg_f(x), std::exp(static_cast<LD>(x))), x);
  for (float a : floats_in(-126.49f, 0.0f, 1021))
    w2.add(ulps(fu::exp2_neg_f(a), std::exp2(static_cast<LD>(a))), a);
  EXPECT_LE(w.err, 1.1) << "exp_neg_f at " << w.at;
  EXPECT_LE(w2.err, 2.05) << "exp2_neg_f at " << w2.at;
  // e^x < 2^-126.5 flushes to +0 (x < -87.68; 2^a for a < -126.5).
  for (float x : floats_in(-1e30f, -87.69f, 4099)) ASSERT_EQ(f2u(fu::exp_neg_f(x)), 0u) << x;
  for (float a : floats_in(-1e30f, -126.5f, 4099)) ASSERT_EQ(f2u(fu::exp2_neg_f(a)), 0u) << a;
  for (auto f : {fu::exp_neg_f, fu::exp2_neg_f}) {
    EXPECT_EQ(f(0.0f), 1.0f);
    EXPECT_EQ(f(-0.0f), 1.0f);
    EXPECT_EQ(f2u(f(-inf())), 0u);
    EXPECT_TRUE(std::isnan(f(qnan())));
    EXPECT_TRUE(std::isnan(f(qnan(true))));
  }
}

// exp_neg_half(q, lo) is exp_neg_f(-q / 2) evaluated with its reduced argument scaled by -2
// (activation_math.h): the same bits when lo = 0.
TEST(ActivationMath, ExpNegHalfIsExpNegOfHalfTheArgument) {
  for (float q : floats_in(0.0f, fu::kCdfAMax * fu::kCdfAMax, 577))
    ASSERT_EQ(f2u(fu::exp_neg_half(q, 0.0f)), f2u(fu::exp_neg_f(-0.5f * q))) << q;
}

// v, the tanh argument's fp32 rounding dominates gelu_tanh's error below x = -3.
LD gelu_tanh_v(LD x) {
  return 2.0L * std::sqrt(2.0L / 3.14159265358979323846264338327950288L) *
         (x + 0.044715L * x * x * x);
}

// The bounds activation_math.h states (the largest errors over every float of the ranges with
// |x| >= 2^-10, rounded up), on a dense sample of each range (every binade, 0 to 1e4).
TEST(ActivationMath, FunctionsMatchLongDoubleWithinDocumentedBounds) {
  struct Case {
    const char* name;
    float (*f)(float);
    LD (*ref)(LD);
    float lo, hi;
    double bound;
    bool deriv;  // bound relative to max(|d|, 0.1), else in ulps
  };
  const Case cases[] = {
      {"sigmoid", fu::sigmoid_f, sigmoid_ref, -87.68f, 1e4f, 2.8, false},
      {"silu", fu::silu, silu_ref, -87.68f, 1e4f, 3.7, false},
      {"gelu_tanh", fu::gelu_tanh, gelu_tanh_ref, -3.0f, 1e4f, 14.1, false},
      {"gelu_erf", fu::gelu_erf, gelu_erf_ref, -13.0f, 1e4f, 7.3, false},
      {"dgelu_tanh", fu::dgelu_tanh, dgelu_tanh_ref, -1e4f, 1e4f, 7.5e-7, true},
      {"dgelu_erf", fu::dgelu_erf, dgelu_erf_ref, -1e4f, 1e4f, 1.15e-6, true},
      {"dsilu", fu::dsilu, dsilu_ref, -1e4f, 1e4f, 5e-7, true},
  };
  for (const Case& c : cases) {
    Worst w;
    for (float x : floats_in(c.lo, c.hi, 3001)) {
      const float got = c.f(x);
      const LD ref = c.ref(x);
      w.add(c.deriv ? drel(got, ref) : ulps(got, ref), x);
    }
    EXPECT_LE(w.err, c.bound) << c.name << " at " << w.at;
  }
  // gelu_tanh below -3, while e^-|v| is normal: 2.6 |v| ulp.
  Worst w;
  for (float x : floats_in(-9.9f, -3.0f, 257)) {
    const double v = std::fabs(static_cast<double>(gelu_tanh_v(x)));
    w.add(ulps(fu::gelu_tanh(x), gelu_tanh_ref(x)) / (2.6 * v), x);
  }
  EXPECT_LE(w.err, 1.0) << "gelu_tanh below -3 at " << w.at;
  for (float x : floats_in(-1e4f, 1e4f, 1021)) {
    EXPECT_EQ(f2u(fu::relu(x)), f2u(static_cast<float>(relu_ref(x))));
    EXPECT_EQ(fu::drelu(x), static_cast<float>(drelu_ref(x)));
  }
}

TEST(ActivationMath, SpecialValues) {
  using Fn = float (*)(float);
  const Fn fwd[] = {fu::gelu_tanh, fu::gelu_erf, fu::silu};
  const Fn bwd[] = {fu::dgelu_tanh, fu::dgelu_erf, fu::dsilu};
  for (Fn f : fwd) {
    EXPECT_EQ(f2u(f(0.0f)), f2u(0.0f));
    EXPECT_EQ(f2u(f(-0.0f)), f2u(-0.0f));
    EXPECT_EQ(f(inf()), inf());
    EXPECT_TRUE(std::isnan(f(-inf())));  // -inf * 0, as torch
    EXPECT_TRUE(std::isnan(f(qnan())));
    EXPECT_TRUE(std::isnan(f(qnan(true))));
    // Near 0 the functions are x / 2 exactly (subnormal x included: the same multiply).
    for (float x : floats_in(-1e-9f, 1e-9f, 65537)) ASSERT_EQ(f2u(f(x)), f2u(x * 0.5f)) << x;
  }
  for (Fn d : bwd) {
    EXPECT_EQ(d(0.0f), 0.5f);
    EXPECT_EQ(d(-0.0f), 0.5f);
    EXPECT_TRUE(std::isnan(d(inf())));  // inf * 0, as torch's backward
    EXPECT_TRUE(std::isnan(d(-inf())));
    EXPECT_TRUE(std::isnan(d(qnan())));
    EXPECT_TRUE(std::isnan(d(qnan(true))));
  }
  EXPECT_EQ(fu::sigmoid_f(0.0f), 0.5f);
  EXPECT_EQ(fu::sigmoid_f(inf()), 1.0f);
  EXPECT_EQ(f2u(fu::sigmoid_f(-inf())), 0u);
  EXPECT_TRUE(std::isnan(fu::sigmoid_f(qnan())));
  // Saturation: the function is x (and its derivative 1) from where the sigmoid or Phi rounds to
  // 1; it flushes to -0 (derivative +0) where e^-|v| flushes: v < -87.68, i.e. x < -10.016 (tanh
  // GELU), x < -87.68 (SiLU), x < -13.243 (erf GELU). The true values there are below 8.4e-38,
  // 7.3e-37 and 3.3e-39.
  for (float x : floats_in(6.0f, 3e38f, 4099)) {
    ASSERT_EQ(fu::gelu_tanh(x), x) << x;
    ASSERT_EQ(fu::dgelu_tanh(x), 1.0f) << x;
  }
  for (float x : floats_in(7.0f, 3e38f, 4099)) {
    ASSERT_EQ(fu::gelu_erf(x), x) << x;
    ASSERT_EQ(fu::dgelu_erf(x), 1.0f) << x;
  }
  for (float x : floats_in(22.0f, 3e38f, 4099)) {
    ASSERT_EQ(fu::silu(x), x) << x;
    ASSERT_EQ(fu::dsilu(x), 1.0f) << x;
    ASSERT_EQ(fu::sigmoid_f(x), 1.0f) << x;
  }
  for (float x : floats_in(-3e38f, -10.02f, 4099)) {
    ASSERT_EQ(f2u(fu::gelu_tanh(x)), f2u(-0.0f)) << x;
    ASSERT_EQ(f2u(fu::dgelu_tanh(x)), 0u) << x;
  }
  for (float x : floats_in(-3e38f, -13.25f, 4099)) {
    ASSERT_EQ(f2u(fu::gelu_erf(x)), f2u(-0.0f)) << x;
    ASSERT_EQ(f2u(fu::dgelu_erf(x)), 0u) << x;
  }
  for (float x : floats_in(-3e38f, -87.69f, 4099)) {
    ASSERT_EQ(f2u(fu::silu(x)), f2u(-0.0f)) << x;
    ASSERT_EQ(f2u(fu::dsilu(x)), 0u) << x;
    ASSERT_EQ(f2u(fu::sigmoid_f(x)), 0u) << x;
  }
  EXPECT_EQ(f2u(fu::relu(-0.0f)), f2u(-0.0f));  // as torch.relu
  EXPECT_TRUE(std::isnan(fu::relu(qnan())));
  // ReLU's gradient selects: an inf gradient where x <= 0 gives 0 (torch threshold_backward).
  EXPECT_EQ(fu::act_grad<fu::ActFn::kRelu>(inf(), -1.0f), 0.0f);
}

// The GEGLU backward evaluates gelu_tanh and its derivative together (gelu_tanh_and_d): the same
// bits as the two functions.
TEST(ActivationMath, GeluTanhAndDerivativeTogetherAreTheTwoFunctions) {
  std::vector<float> xs = floats_in(-3e38f, 3e38f, 2049);
  for (float x : {inf(), -inf(), qnan(), qnan(true), 20.0f, -20.0f}) xs.push_back(x);
  for (float x : xs) {
    float y, d;
    fu::gelu_tanh_and_d(x, &y, &d);
    if (std::isnan(x)) {
      EXPECT_TRUE(std::isnan(y) && std::isnan(d));
      continue;
    }
    ASSERT_TRUE(f2u(y) == f2u(fu::gelu_tanh(x)) || (std::isnan(y) && std::isnan(fu::gelu_tanh(x))))
        << x;
    ASSERT_TRUE(f2u(d) == f2u(fu::dgelu_tanh(x)) ||
                (std::isnan(d) && std::isnan(fu::dgelu_tanh(x))))
        << x;
  }
}

// ---- C API plumbing
// ---------------------------------------------------------------------------------

const char* kind_name(fus_activation k) {
  switch (k) {
    case FUS_ACT_GELU: return "GELU";
    case FUS_ACT_GELU_ERF: return "GELU_ERF";
    case FUS_ACT_RELU: return "RELU";
    case FUS_ACT_SILU: return "SILU";
    case FUS_ACT_SWIGLU: return "SWIGLU";
    case FUS_ACT_GEGLU: return "GEGLU";
    case FUS_ACT_IDENTITY: return "IDENTITY";
  }
  return "?";
}

bool gated(fus_activation k) { return fus_activation_is_gated(k) != 0; }

LD act_ref(fus_activation k, LD x) {
  switch (k) {
    case FUS_ACT_GELU:
    case FUS_ACT_GEGLU: return gelu_tanh_ref(x);
    case FUS_ACT_GELU_ERF: return gelu_erf_ref(x);
    case FUS_ACT_RELU: return relu_ref(x);
    case FUS_ACT_IDENTITY: return x;
    default: return silu_ref(x);
  }
}
LD dact_ref(fus_activation k, LD x) {
  switch (k) {
    case FUS_ACT_GELU:
    case FUS_ACT_GEGLU: return dgelu_tanh_ref(x);
    case FUS_ACT_GELU_ERF: return dgelu_erf_ref(x);
    case FUS_ACT_RELU: return drelu_ref(x);
    case FUS_ACT_IDENTITY: return 1;
    default: return dsilu_ref(x);
  }
}

struct ActSetup {
  fus_activation kind = FUS_ACT_GELU;
  bool bwd = false;
  fus_dtype x_dt = FUS_FLOAT32, g_dt = FUS_FLOAT32, out_dt = FUS_FLOAT32, bias_dt = FUS_FLOAT32;
  bool has_out = true, dbias = false;
  int64_t rows = 0, cols = 0;  // cols = H
  QSpec q;
  uint32_t seed = 1;
  int64_t in_cols() const { return gated(kind) ? 2 * cols : cols; }
  int64_t out_cols() const { return bwd ? in_cols() : cols; }

  // Chainable setters of the fields most cases set together.
  ActSetup& problem(fus_activation k, bool backward, int64_t r, int64_t c) {
    return (kind = k, bwd = backward, rows = r, cols = c), *this;
  }
  ActSetup& dtypes(fus_dtype x, fus_dtype g, fus_dtype out) {
    return (x_dt = x, g_dt = g, out_dt = out), *this;
  }
};

std::string describe(const ActSetup& s) {
  std::ostringstream os;
  os << kind_name(s.kind) << (s.bwd ? " bwd" : " fwd") << " x " << dt_name(s.x_dt) << " out "
     << (s.has_out ? dt_name(s.out_dt) : "-") << " [" << s.rows << ", " << s.cols << "] q "
     << qmode_name(s.q.mode) << " " << fmt_name(s.q.fmt) << " row " << s.q.row << " col " << s.q.col
     << " dbias " << s.dbias;
  return os.str();
}

enum Slot { kX = 0, kG, kOut, kBias, kWs, kQ };

struct Data {
  HostMatrix x, g;
  Buffers bufs;
};

Data make_data(const ActSetup& s, size_t workspace = 0) {
  Data d;
  d.x = random_matrix(s.x_dt, s.rows, s.in_cols(), s.seed, 0.0f, 2.0f);
  d.g = random_matrix(s.g_dt, s.rows, s.cols, s.seed + 1, 0.0f, 1.0f);
  Buffers& b = d.bufs;
  b.add_bytes(d.x.bytes);
  b.add_bytes(s.bwd ? d.g.bytes : std::vector<uint8_t>{});
  b.add_filled(s.has_out ? static_cast<size_t>(s.rows * s.out_cols()) * fus_dtype_size(s.out_dt)
                         : 0);
  b.add_filled(s.dbias ? static_cast<size_t>(s.out_cols()) * fus_dtype_size(s.bias_dt) : 0);
  b.add_filled(workspace);
  add_q_buffers(b, s.rows, s.out_cols(), s.q);
  return d;
}

ApiCall call(const ActSetup& s) {
  return [s](const std::vector<void*>& p, const fus_context& ctx) {
    fus_tensor x{p[kX], s.x_dt, s.rows, s.in_cols()}, g{p[kG], s.g_dt, s.rows, s.cols},
        out{p[kOut], s.out_dt, s.rows, s.out_cols()}, bias{p[kBias], s.bias_dt, 1, s.out_cols()};
    fus_quantized q = make_q(p, kQ, s.rows, s.out_cols(), s.q);
    fus_quantized* qp = s.q.mode ? &q : nullptr;
    if (!s.bwd) return fus_activation_forward(s.kind, &x, s.has_out ? &out : nullptr, qp, &ctx);
    size_t ws = 0;
    const fus_status st = fus_activation_backward_workspace_size(s.rows, s.out_cols(), &ctx, &ws);
    if (st != FUS_SUCCESS) return st;
    return fus_activation_backward(s.kind, &g, &x, s.has_out ? &out : nullptr, qp,
                                   s.dbias ? &bias : nullptr, p[kWs], ws, &ctx);
  };
}

size_t cuda_workspace(const ActSetup& s) {
  const fus_context ctx = cuda_ctx();
  size_t ws = 0;
  if (fus_has_cuda() && s.bwd && s.dbias) {
    EXPECT_EQ(fus_activation_backward_workspace_size(s.rows, s.out_cols(), &ctx, &ws), FUS_SUCCESS);
  }
  return ws;
}

// FP64 (long double) reference of the output matrix.
std::vector<double> reference(const ActSetup& s, const Data& d) {
  const int64_t n = s.rows, h = s.cols, k = s.in_cols();
  std::vector<double> r(static_cast<size_t>(n * s.out_cols()));
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < h; ++c) {
      const LD a = d.x.values[i * k + c];
      if (!s.bwd) {
        r[i * h + c] = static_cast<double>(
            gated(s.kind) ? act_ref(s.kind, a) * d.x.values[i * k + h + c] : act_ref(s.kind, a));
      } else {
        const LD g = d.g.values[i * h + c];
        if (gated(s.kind)) {
          const LD b = d.x.values[i * k + h + c];
          r[i * k + c] = static_cast<double>(g * dact_ref(s.kind, a) * b);
          r[i * k + h + c] = static_cast<double>(g * act_ref(s.kind, a));
        } else {
          r[i * h + c] = static_cast<double>(g * dact_ref(s.kind, a));
        }
      }
    }
  return r;
}

const fus_activation kKinds[] = {FUS_ACT_GELU,   FUS_ACT_GELU_ERF, FUS_ACT_RELU,    FUS_ACT_SILU,
                                 FUS_ACT_SWIGLU, FUS_ACT_GEGLU,    FUS_ACT_IDENTITY};

// ---- CPU vs FP64
// ------------------------------------------------------------------------------------

using RefParam = std::tuple<fus_activation, fus_dtype, bool, std::pair<int64_t, int64_t>>;

class ActReference : public ::testing::TestWithParam<RefParam> {};

TEST_P(ActReference, MatchesFp64) {
  const auto [kind, dt, bwd, shape] = GetParam();
  ActSetup s;
  s.problem(kind, bwd, shape.first, shape.second).dtypes(dt, dt, dt);
  s.dbias = bwd;
  SCOPED_TRACE(describe(s));
  Data d = make_data(s);
  ASSERT_EQ(run_cpu(d.bufs, call(s)), FUS_SUCCESS) << fus_last_error();
  const std::vector<double> ref = reference(s, d);
  const std::vector<double> got = as_doubles(d.bufs.b[kOut], s.out_dt);
  // fp32 math: a few ulps, more in the far tails (activation_math.h); the derivative products
  // (gelu) are accurate to ~1e-6 of max(|d|, 0.1) times |grad|.
  const double rtol = out_rtol(s.out_dt, 2e-5);
  EXPECT_TRUE(all_close(got, ref, rtol, (bwd ? 1e-6 : 1e-9) + dtype_atom(s.out_dt), "output"));
  if (s.dbias) {
    // dbias = column sums of the stored (rounded) dx, accumulated in fp32.
    const int64_t k = s.out_cols();
    std::vector<double> sum(k, 0.0), abs(k, 0.0);
    for (int64_t i = 0; i < s.rows; ++i)
      for (int64_t c = 0; c < k; ++c) sum[c] += got[i * k + c], abs[c] += std::fabs(got[i * k + c]);
    const std::vector<double> db = as_doubles(d.bufs.b[kBias], s.bias_dt);
    for (int64_t c = 0; c < k; ++c)
      ASSERT_NEAR(db[c], sum[c], 1e-6 * abs[c] + 1e-30) << "dbias[" << c << "]";
  }
}

const std::vector<std::pair<int64_t, int64_t>> kShapes = {{1, 1},    {7, 7},    {127, 127},
                                                          {3, 4097}, {4097, 3}, {64, 256}};

INSTANTIATE_TEST_SUITE_P(All, ActReference,
                         ::testing::Combine(::testing::ValuesIn(kKinds),
                                            ::testing::Values(FUS_FLOAT32, FUS_FLOAT16,
                                                              FUS_BFLOAT16),
                                            ::testing::Bool(), ::testing::ValuesIn(kShapes)));

// dbias follows the documented order exactly: sequential in groups of P = 32 ceil(ceil(N/32)/64)
// rows, then sequential over the groups.
TEST(ActDbias, OrderIsSequentialGroupsThenGroups) {
  for (int64_t rows : {1, 31, 100, 2049, 5000}) {
    ActSetup s;
    s.problem(FUS_ACT_RELU, true, rows, 5);
    s.dbias = true;
    SCOPED_TRACE(rows);
    Data d = make_data(s);
    ASSERT_EQ(run_cpu(d.bufs, call(s)), FUS_SUCCESS) << fus_last_error();
    const std::vector<float> dx = d.bufs.get<float>(kOut), db = d.bufs.get<float>(kBias);
    const int64_t per = 32 * (((rows + 31) / 32 + 63) / 64);
    for (int64_t c = 0; c < 5; ++c) {
      float total = 0.0f;
      for (int64_t r0 = 0; r0 < rows; r0 += per) {
        float group = 0.0f;
        for (int64_t r = r0; r < std::min(rows, r0 + per); ++r) group += dx[r * 5 + c];
        total += group;
      }
      EXPECT_EQ(f2u(db[c]), f2u(total)) << "column " << c;
    }
  }
}

// ---- quantized output == quantize(high-precision output)
// ------------------------------------------

using QParam = std::tuple<fus_activation, fus_dtype, bool, int, std::pair<int64_t, int64_t>>;

class ActQuantized : public ::testing::TestWithParam<QParam> {};

// The fused quantized output of s (with the high-precision output of s.out_dt) equals
// fus_quantize of that output; without it, fus_quantize of the output rounded to the input's
// dtype (x forward, grad backward), and dbias is unchanged.
void expect_fused_equals_unfused(const ActSetup& s) {
  Data d = make_data(s);
  ASSERT_EQ(run_cpu(d.bufs, call(s)), FUS_SUCCESS) << fus_last_error();
  expect_same_q(d.bufs, kQ, quantize_of(d.bufs.b[kOut], s.out_dt, s.rows, s.out_cols(), s.q), 1,
                "fused vs quantize(out)");
  const fus_dtype dt = s.bwd ? s.g_dt : s.x_dt;
  ActSetup n = s;
  n.has_out = false;
  Data dn = make_data(n);
  ASSERT_EQ(run_cpu(dn.bufs, call(n)), FUS_SUCCESS) << fus_last_error();
  ActSetup o = s;
  o.out_dt = dt;
  o.q.mode = 0;
  Data dout = make_data(o);
  ASSERT_EQ(run_cpu(dout.bufs, call(o)), FUS_SUCCESS) << fus_last_error();
  expect_same_q(dn.bufs, kQ, quantize_of(dout.bufs.b[kOut], dt, s.rows, s.out_cols(), s.q), 1,
                "fused without out vs quantize(out in the input's dtype)");
  if (s.dbias) {
    EXPECT_EQ(dn.bufs.b[kBias], dout.bufs.b[kBias]) << "dbias without out";
  }
}

TEST_P(ActQuantized, EqualsQuantizeOfHighPrecisionOutput) {
  const auto [kind, dt, bwd, qmode, shape] = GetParam();
  for (int variant = 0; variant < 3; ++variant) {
    ActSetup s;
    s.problem(kind, bwd, shape.first, shape.second)
        .dtypes(dt, dt, variant == 1 ? FUS_FLOAT32 : (variant == 2 ? FUS_BFLOAT16 : dt));
    s.q.mode = qmode;
    s.q.fmt = variant == 1 ? FUS_FLOAT8_E5M2 : FUS_FLOAT8_E4M3;
    s.q.scale = qmode == 1 ? 11.0f : 1.0f;
    s.q.row = variant != 2;
    s.q.col = variant != 0;
    s.q.pow2 = variant != 1;  // blockwise: exact scales with an amax floor
    s.q.eps = variant == 1 ? 1e-3f : 0.0f;
    if (bwd && gated(kind) && qmode == 2 && s.cols % 32 != 0) s.q.row = false;  // documented limit
    if (!s.q.row && !s.q.col) s.q.col = true;
    s.dbias = bwd;
    SCOPED_TRACE(describe(s));
    expect_fused_equals_unfused(s);
  }
}

// Modes 1 per tensor, 2 MXFP8, 3 / 4 blockwise 1x128 / 128x128. Rows 1, primes and 2^n - 1
// around the 32- and 128-row blocks; H that is and is not a multiple of 32 and 128 (partial edge
// blocks; gated backward: blocks straddling [da | db]).
const std::vector<std::pair<int64_t, int64_t>> kQShapes = {
    {1, 1}, {127, 7}, {33, 64}, {70, 4097}, {1, 300}, {31, 129}, {128, 127}, {257, 256}};

INSTANTIATE_TEST_SUITE_P(All, ActQuantized,
                         ::testing::Combine(::testing::ValuesIn(kKinds),
                                            ::testing::Values(FUS_FLOAT32, FUS_BFLOAT16),
                                            ::testing::Bool(), ::testing::Values(1, 2, 3, 4),
                                            ::testing::ValuesIn(kQShapes)));

TEST(ActQuantizedEdge, ZeroRows) {
  ActSetup s;
  s.problem(FUS_ACT_GELU, true, 0, 12);
  s.dbias = true;
  s.q.mode = 1;
  s.q.scale = 8.0f;
  Data d = make_data(s);
  ASSERT_EQ(run_cpu(d.bufs, call(s)), FUS_SUCCESS) << fus_last_error();
  EXPECT_EQ(d.bufs.get<float>(kQ + kQAmax)[0], 0.0f);
  EXPECT_EQ(d.bufs.get<float>(kQ + kQRowS)[0], 0.125f);
  for (float v : d.bufs.get<float>(kBias)) EXPECT_EQ(f2u(v), 0u);
}

// ---- argument validation
// ----------------------------------------------------------------------------

TEST(ActErrors, RejectBadArguments) {
  float x[24] = {}, y[24] = {}, g[12] = {}, dx[24] = {}, db[8] = {};
  const fus_context ctx = cpu_ctx();
  fus_tensor tx{x, FUS_FLOAT32, 3, 8}, ty{y, FUS_FLOAT32, 3, 8}, ty4{y, FUS_FLOAT32, 3, 4},
      tg{g, FUS_FLOAT32, 3, 4}, tg8{g, FUS_FLOAT32, 3, 8}, tdx{dx, FUS_FLOAT32, 3, 8},
      tdb{db, FUS_FLOAT32, 1, 8};
  const char* f = "fus_activation_forward";
  const char* b = "fus_activation_backward";
  EXPECT_EQ(fus_activation_forward(FUS_ACT_GELU, &tx, &ty, nullptr, &ctx), FUS_SUCCESS);
  EXPECT_EQ(fus_activation_forward(FUS_ACT_SWIGLU, &tx, &ty4, nullptr, &ctx), FUS_SUCCESS);
  EXPECT_TRUE(
      is_error(fus_activation_forward(static_cast<fus_activation>(9), &tx, &ty, nullptr, &ctx),
               FUS_ERROR_INVALID_ARGUMENT, {f, "kind"}));
  EXPECT_TRUE(is_error(fus_activation_forward(FUS_ACT_GELU, nullptr, &ty, nullptr, &ctx),
                       FUS_ERROR_INVALID_ARGUMENT, {f, "x"}));
  EXPECT_TRUE(is_error(fus_activation_forward(FUS_ACT_GELU, &tx, nullptr, nullptr, &ctx),
                       FUS_ERROR_INVALID_ARGUMENT, {f, "y", "q"}));
  EXPECT_TRUE(is_error(fus_activation_forward(FUS_ACT_GELU, &tx, &ty4, nullptr, &ctx),
                       FUS_ERROR_INVALID_ARGUMENT, {f, "y", "[3, 8]"}));
  EXPECT_TRUE(is_error(fus_activation_forward(FUS_ACT_SWIGLU, &tx, &ty, nullptr, &ctx),
                       FUS_ERROR_INVALID_ARGUMENT, {f, "y", "[3, 4]"}));
  fus_tensor odd{x, FUS_FLOAT32, 3, 7};
  EXPECT_TRUE(is_error(fus_activation_forward(FUS_ACT_GEGLU, &odd, &ty, nullptr, &ctx),
                       FUS_ERROR_INVALID_ARGUMENT, {f, "x", "even"}));
  uint8_t q8[24], s8[8];
  fus_quantized q = rowwise_q(q8, s8, 3, 8);
  EXPECT_TRUE(is_error(fus_activation_forward(FUS_ACT_GELU, &tx, nullptr, &q, &ctx),
                       FUS_ERROR_INVALID_ARGUMENT, {f, "q->scale"}));
  fus_quantized qb = q;
  qb.mode = FUS_SCALING_BLOCK_2D;
  qb.amax_epsilon = NAN;
  EXPECT_TRUE(is_error(fus_activation_forward(FUS_ACT_GELU, &tx, nullptr, &qb, &ctx),
                       FUS_ERROR_INVALID_ARGUMENT, {f, "q->amax_epsilon"}));
  EXPECT_TRUE(is_error(
      fus_activation_backward(FUS_ACT_GELU, &tg8, &tx, nullptr, nullptr, nullptr, nullptr, 0, &ctx),
      FUS_ERROR_INVALID_ARGUMENT, {b, "dx", "q", "dbias"}));
  EXPECT_TRUE(is_error(
      fus_activation_backward(FUS_ACT_GELU, &tg, &tx, &tdx, nullptr, nullptr, nullptr, 0, &ctx),
      FUS_ERROR_INVALID_ARGUMENT, {b, "x", "[3, 4]"}));
  EXPECT_EQ(fus_activation_backward(FUS_ACT_GEGLU, &tg, &tx, &tdx, nullptr, &tdb, nullptr, 0, &ctx),
            FUS_SUCCESS);
  fus_tensor db4{db, FUS_FLOAT32, 1, 4};
  EXPECT_TRUE(is_error(
      fus_activation_backward(FUS_ACT_GEGLU, &tg, &tx, &tdx, nullptr, &db4, nullptr, 0, &ctx),
      FUS_ERROR_INVALID_ARGUMENT, {b, "dbias", "[1, 8]"}));
  uint8_t mx[24], ms[8];
  fus_quantized qm{FUS_SCALING_MXFP8, FUS_FLOAT8_E4M3, 3,       8, mx,  nullptr, ms,
                   nullptr,           nullptr,         nullptr, 0, 0.0f};
  EXPECT_TRUE(is_error(
      fus_activation_backward(FUS_ACT_SWIGLU, &tg, &tx, nullptr, &qm, nullptr, nullptr, 0, &ctx),
      FUS_ERROR_INVALID_ARGUMENT, {b, "H % 32"}));
  fus_tensor g0{g, FUS_FLOAT32, 3, 0}, x0{x, FUS_FLOAT32, 3, 0};
  EXPECT_TRUE(is_error(
      fus_activation_backward(FUS_ACT_GELU, &g0, &x0, &x0, nullptr, nullptr, nullptr, 0, &ctx),
      FUS_ERROR_INVALID_ARGUMENT, {b, "grad", "column"}));
  const fus_context gpu = cuda_ctx();
  if (fus_has_cuda()) {
    EXPECT_TRUE(is_error(
        fus_activation_backward(FUS_ACT_GELU, &tg8, &tx, &tdx, nullptr, &tdb, nullptr, 0, &gpu),
        FUS_ERROR_INVALID_ARGUMENT, {b, "workspace_bytes"}));
  } else {
    EXPECT_TRUE(is_error(fus_activation_forward(FUS_ACT_GELU, &tx, &ty, nullptr, &gpu),
                         FUS_ERROR_UNSUPPORTED, {f, "CUDA"}));
  }
  size_t ws = 1;
  EXPECT_EQ(fus_activation_backward_workspace_size(3, 8, &ctx, &ws), FUS_SUCCESS);
  EXPECT_EQ(ws, 0u);
  EXPECT_EQ(fus_activation_is_gated(FUS_ACT_SWIGLU), 1);
  EXPECT_EQ(fus_activation_is_gated(FUS_ACT_GELU), 0);
}

// ---- CUDA vs CPU
// ------------------------------------------------------------------------------------

class ActCuda : public ::testing::TestWithParam<std::tuple<fus_activation, fus_dtype, bool, int>> {
};

TEST_P(ActCuda, BitIdenticalToCpu) {
  FUSTEST_REQUIRE_CUDA();
  const auto [kind, dt, bwd, qmode] = GetParam();
  // {6000, 40} with dbias: blockwise blocks walk three 128-row tiles (row groups of 96 rows).
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {1, 1},   {7, 7},     {127, 127}, {4097, 7},  {3, 4097},  {64, 1024},
      {96, 96}, {2500, 64}, {31, 40},   {129, 100}, {257, 384}, {6000, 40}};
  for (const auto& shape : shapes) {
    for (int variant = 0; variant < 3; ++variant) {
      ActSetup s;
      s.problem(kind, bwd, shape.first, shape.second)
          .dtypes(dt, variant == 1 ? FUS_FLOAT32 : dt, variant == 2 ? FUS_FLOAT32 : dt);
      s.has_out = variant != 1;
      s.dbias = bwd && variant != 2;
      s.bias_dt = variant == 0 ? dt : FUS_FLOAT32;
      s.q.mode = qmode;
      s.q.fmt = variant == 2 ? FUS_FLOAT8_E5M2 : FUS_FLOAT8_E4M3;
      s.q.scale = 5.0f;
      s.q.col = variant != 0 || qmode == 2;
      s.q.row = !(bwd && gated(kind) && qmode == 2 && s.cols % 32 != 0) &&
                !(qmode >= 3 && variant == 2);  // blockwise: the columnwise copy alone too
      s.q.pow2 = variant != 1;                  // blockwise: exact scales with an amax floor
      s.q.eps = variant == 1 ? 1e-3f : 0.0f;
      if (!s.has_out && !qmode && !s.dbias) s.has_out = true;
      SCOPED_TRACE(describe(s));
      Data d = make_data(s, cuda_workspace(s));
      const DualResult r = run_both(d.bufs, call(s));
      ASSERT_EQ(r.cpu_status, FUS_SUCCESS) << fus_last_error();
      ASSERT_EQ(r.cuda_status, FUS_SUCCESS) << fus_last_error();
      for (size_t i = 0; i < d.bufs.b.size(); ++i) {
        if (static_cast<int>(i) == kWs) continue;
        EXPECT_TRUE(same_bits<uint8_t>(r.cpu, r.cuda, static_cast<int>(i),
                                       ("buffer " + std::to_string(i)).c_str()));
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(All, ActCuda,
                         ::testing::Combine(::testing::ValuesIn(kKinds),
                                            ::testing::Values(FUS_FLOAT32, FUS_FLOAT16,
                                                              FUS_BFLOAT16),
                                            ::testing::Bool(), ::testing::Values(0, 1, 2, 3, 4)));

// The CUDA kernel's 16-bit path (x, grad and every output of one 16-bit type, H a multiple of 64,
// aligned vectors, no MXFP8): each output combination, partial last tiles, several tiles a block,
// and non-finite inputs. NaN made by arithmetic may differ in sign and payload between the
// backends, so NaN matches NaN; every other value must have the same bits.
class ActCuda16 : public ::testing::TestWithParam<std::tuple<fus_activation, fus_dtype, bool>> {};

TEST_P(ActCuda16, BitIdenticalToCpu) {
  FUSTEST_REQUIRE_CUDA();
  const auto [kind, dt, bwd] = GetParam();
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {1, 64}, {37, 128}, {2049, 192}, {4001, 192}, {8192, 1152}};
  for (const auto& shape : shapes) {
    for (int variant = 0; variant < 4; ++variant) {
      // Without dbias the blocks walk several tiles only on large matrices: one such case.
      if (shape.first == 8192 && variant != 1) continue;
      ActSetup s;
      s.problem(kind, bwd, shape.first, shape.second).dtypes(dt, dt, dt);
      s.has_out = variant != 1;
      s.dbias = bwd && variant != 1;
      s.bias_dt = variant == 3 ? FUS_FLOAT32 : dt;
      s.q.mode = variant == 0 ? 0 : 1;  // none, or per-tensor FP8
      s.q.fmt = variant == 3 ? FUS_FLOAT8_E5M2 : FUS_FLOAT8_E4M3;
      s.q.row = variant != 3;
      s.q.col = variant >= 2;
      s.q.scale = 5.0f;
      SCOPED_TRACE(describe(s));
      Data d = make_data(s, cuda_workspace(s));
      auto put = [&](int64_t r, int64_t c, uint16_t bits) {
        std::memcpy(d.bufs.b[kX].data() + (r * s.in_cols() + c) * 2, &bits, 2);
      };
      const bool bf = dt == FUS_BFLOAT16;
      const int64_t last = s.rows - 1;
      // Max finite values (products overflow), then NaN and inf; variants 0 and 1 stay finite,
      // so their amax and dbias are compared as numbers.
      if (variant >= 2) {
        for (int64_t c = 0; c < s.in_cols(); c += 5) put(last, c, bf ? 0x7f7f : 0x7bff);
        put(0, 3, bf ? 0x7fc1 : 0x7e01);     // +NaN with payload
        put(last, 5, bf ? 0xffc3 : 0xfe03);  // -NaN with payload
        put(0, 7, bf ? 0x7f80 : 0x7c00);     // +inf
        put(last, 9, bf ? 0xff80 : 0xfc00);  // -inf
      }
      const DualResult r = run_both(d.bufs, call(s));
      ASSERT_EQ(r.cpu_status, FUS_SUCCESS) << fus_last_error();
      ASSERT_EQ(r.cuda_status, FUS_SUCCESS) << fus_last_error();
      EXPECT_TRUE(same_bits_or_both_nan(r.cpu, r.cuda, kOut, s.out_dt, "out"));
      EXPECT_TRUE(same_bits_or_both_nan(r.cpu, r.cuda, kBias, s.bias_dt, "dbias"));
      expect_q_same_or_both_nan(r.cpu, r.cuda, kQ, s.q);
      for (int i : {kX, kG})  // inputs untouched
        EXPECT_TRUE(same_bits<uint8_t>(r.cpu, r.cuda, i, "input"));
      if (HasFailure()) return;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(All, ActCuda16,
                         ::testing::Combine(::testing::ValuesIn(kKinds),
                                            ::testing::Values(FUS_FLOAT16, FUS_BFLOAT16),
                                            ::testing::Bool()));

// The special values and the points where the functions change regime (clamps, flushes,
// saturation), for the device-vs-host tests.
std::vector<float> special_points() {
  return {0.0f,   -0.0f,   inf(),   -inf(),   qnan(),    qnan(true), 1e-40f,   -1e-40f, 20.0f,
          -20.0f, 13.25f,  -13.25f, 13.2426f, -13.2426f, -10.016f,   -10.017f, -87.68f, -87.69f,
          -88.0f, -126.5f, -127.0f, 1.5f,     -1.5f,     3e38f,      -3e38f};
}

#if defined(FUSIBLE_WITH_CUDA)
// A dense sample of every binade and the special points.
std::vector<float> math_points() {
  std::vector<float> v = floats_in(-3e38f, 3e38f, 8191);
  for (float x : special_points()) v.push_back(x);
  return v;
}

}  // namespace
namespace fustest {
bool device_rcp_1to8(uint32_t first, uint32_t count, std::vector<float>& out);  // *_cuda.cu
bool device_act_math(int fn, const std::vector<float>& in, std::vector<float>& out);
}  // namespace fustest
namespace {

// The reciprocal of the sigmoid and of the normal cdf skips __frcp_rn's range test (fp32_ops.h
// f_rcp_1to8): on every float in [1, 8] it must still be the correctly rounded 1 / a of the host.
TEST(ActCudaMath, ReciprocalOnOneToEightMatchesHost) {
  FUSTEST_REQUIRE_CUDA();
  const uint32_t first = 0x3f800000u, count = 3 * (1u << 23) + 1;  // 1.0f .. 8.0f
  std::vector<float> got;
  ASSERT_TRUE(device_rcp_1to8(first, count, got));
  size_t bad = 0;
  for (uint32_t i = 0; i < count; ++i) {
    const float a = u2f(first + i);
    if (f2u(got[i]) != f2u(1.0f / a) && bad++ < 5)
      ADD_FAILURE() << "1 / " << a << ": device " << got[i] << ", host " << 1.0f / a;
  }
  EXPECT_EQ(bad, 0u);
}

// Each shared function (activation_math_cuda.cu's list, with the clamps and the select of
// fp32_ops.h) evaluated on the device gives the host's bits (NaN: any NaN).
TEST(ActCudaMath, FunctionsSameBitsAsHost) {
  FUSTEST_REQUIRE_CUDA();
  using Fn = float (*)(float);
  const Fn host[] = {
      fu::exp_neg_f,
      fu::exp2_neg_f,
      [](float x) { return fu::exp_neg_half(fu::f_abs(x), 0.0f); },
      fu::sigmoid_f,
      fu::gelu_tanh,
      fu::dgelu_tanh,
      fu::gelu_erf,
      fu::dgelu_erf,
      fu::silu,
      fu::dsilu,
      [](float x) {
        float y, d;
        fu::gelu_tanh_and_d(x, &y, &d);
        return y;
      },
      [](float x) {
        float y, d;
        fu::gelu_tanh_and_d(x, &y, &d);
        return d;
      },
      [](float x) { return fu::f_max_nan(x, -1.5f); },
      [](float x) { return fu::f_min_nan(x, 1.5f); },
      [](float x) { return fu::f_min_num(x, 1.5f); },
      [](float x) { return fu::f_select(x < 0.0f, 1.0f, x); },
  };
  const std::vector<float> pts = math_points();
  for (int fn = 0; fn < static_cast<int>(sizeof(host) / sizeof(host[0])); ++fn) {
    std::vector<float> got;
    ASSERT_TRUE(device_act_math(fn, pts, got));
    size_t bad = 0;
    for (size_t i = 0; i < pts.size(); ++i) {
      const float want = host[fn](pts[i]);
      if (f2u(got[i]) == f2u(want) || (std::isnan(got[i]) && std::isnan(want))) continue;
      if (bad++ < 5)
        ADD_FAILURE() << "function " << fn << " at " << pts[i] << ": device " << got[i] << ", host "
                      << want;
    }
    EXPECT_EQ(bad, 0u) << "function " << fn;
  }
}
#endif

// The GPU evaluates the shared math to the same bits as the host on a dense sample of inputs
// (through the forward / backward of every kind in fp32; NaN: any NaN).
TEST(ActCudaMath, SameBitsAsHostOnDenseSample) {
  FUSTEST_REQUIRE_CUDA();
  std::vector<float> pts = sample_points(1 << 18, 11);
  const std::vector<float> special = special_points();
  for (size_t i = 0; i < special.size(); ++i) {  // in the a and the b half of every column group
    pts[i * 1031] = special[i];
    pts[i * 1031 + 128] = special[i];
  }
  for (fus_activation kind : kKinds) {
    for (bool bwd : {false, true}) {
      ActSetup s;
      s.problem(kind, bwd, 1 << 10, gated(kind) ? 1 << 7 : 1 << 8);  // the input is [rows, 256]
      Data d = make_data(s);
      d.bufs.b[kX] = HostMatrix(FUS_FLOAT32, s.rows, s.in_cols(), pts).bytes;
      const DualResult r = run_both(d.bufs, call(s));
      ASSERT_EQ(r.cuda_status, FUS_SUCCESS) << fus_last_error();
      EXPECT_TRUE(same_bits_or_both_nan(r.cpu, r.cuda, kOut, FUS_FLOAT32, kind_name(kind)));
    }
  }
}

}  // namespace

TEST(ActAmaxAccumulate, ForwardAndBackwardMaxCombineIntoPresetValue) {
  const int64_t rows = 6, cols = 24;
  std::vector<float> x(rows * cols), grad(rows * cols, 0.5f);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>((i * 5) % 9) - 4.0f;
  std::vector<uint8_t> data(rows * cols);
  float scale = 1.0f, scale_inv = 0.0f;
  const fus_tensor xm{x.data(), FUS_FLOAT32, rows, cols}, gm{grad.data(), FUS_FLOAT32, rows, cols};
  const fus_context ctx = cpu_ctx();
  for (int bwd = 0; bwd < 2; ++bwd) {
    SCOPED_TRACE(bwd);
    auto run = [&](float* amax, int acc) {
      fus_quantized q = per_tensor_out(FUS_FLOAT8_E4M3, rows, cols, data.data(), nullptr,
                                       &scale_inv, &scale, amax, acc);
      if (bwd)
        return fus_activation_backward(FUS_ACT_GELU, &gm, &xm, nullptr, &q, nullptr, nullptr, 0,
                                       &ctx);
      return fus_activation_forward(FUS_ACT_GELU, &xm, nullptr, &q, &ctx);
    };
    ASSERT_NO_FATAL_FAILURE(expect_amax_accumulates(run));
  }
}
