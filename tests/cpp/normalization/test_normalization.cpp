// Tests of the normalization family: the CPU backend against an FP64 reference (forward and
// backward), the quantized output against fus_quantize of the high-precision output (bit for bit),
// the documented reduction plan, argument validation, and, where a CUDA device is present, the
// CUDA backend against the CPU backend bit for bit.
#include <gtest/gtest.h>

#include <sstream>
#include <tuple>

#include "fused_test_utils.h"
#include "fusible/normalization.h"
#include "normalization/normalization_math.h"

using namespace fustest;
namespace fu = fusible;

namespace {

// ---- forward plumbing
// -----------------------------------------------------------------------------

struct FwdSetup {
  fus_norm_kind kind = FUS_NORM_LAYERNORM;
  fus_dtype x_dt = FUS_FLOAT32, g_dt = FUS_FLOAT32, y_dt = FUS_FLOAT32;
  bool has_y = true, has_beta = true, zc = false;
  int64_t rows = 0, cols = 0;
  float eps = 1e-5f;
  QSpec q;
  uint32_t seed = 1;
};

std::string describe(const FwdSetup& s) {
  std::ostringstream os;
  os << (s.kind == FUS_NORM_LAYERNORM ? "LayerNorm" : "RMSNorm") << " x " << dt_name(s.x_dt)
     << " gamma " << dt_name(s.g_dt) << " y " << (s.has_y ? dt_name(s.y_dt) : "-") << " [" << s.rows
     << ", " << s.cols << "] beta " << s.has_beta << " zc " << s.zc << " q " << qmode_name(s.q.mode)
     << " " << fmt_name(s.q.fmt);
  return os.str();
}

enum FSlot { kX = 0, kGamma, kBeta, kY, kMean, kRstd, kQ };

struct FwdData {
  HostMatrix x, gamma, beta;
  Buffers bufs;
};

FwdData fwd_data(const FwdSetup& s) {
  FwdData d;
  d.x = random_matrix(s.x_dt, s.rows, s.cols, s.seed, 0.75f, 2.0f);
  d.gamma = random_matrix(s.g_dt, 1, s.cols, s.seed + 1, s.zc ? 0.0f : 1.0f, 0.5f);
  d.beta = random_matrix(s.g_dt, 1, s.cols, s.seed + 2, 0.0f, 0.5f);
  Buffers& b = d.bufs;
  b.add_bytes(d.x.bytes);
  b.add_bytes(d.gamma.bytes);
  b.add_bytes(s.has_beta ? d.beta.bytes : std::vector<uint8_t>{});
  b.add_filled(s.has_y ? static_cast<size_t>(s.rows * s.cols) * fus_dtype_size(s.y_dt) : 0);
  b.add_filled(s.kind == FUS_NORM_LAYERNORM ? static_cast<size_t>(s.rows) * 4 : 0);
  b.add_filled(static_cast<size_t>(s.rows) * 4);
  add_q_buffers(b, s.rows, s.cols, s.q);
  return d;
}

ApiCall fwd_call(const FwdSetup& s) {
  return [s](const std::vector<void*>& p, const fus_context& ctx) {
    fus_tensor x{p[kX], s.x_dt, s.rows, s.cols}, g{p[kGamma], s.g_dt, 1, s.cols},
        b{p[kBeta], s.g_dt, 1, s.cols}, y{p[kY], s.y_dt, s.rows, s.cols};
    fus_quantized q = make_q(p, kQ, s.rows, s.cols, s.q);
    return fus_norm_forward(s.kind, &x, &g, s.has_beta ? &b : nullptr, s.eps, s.zc ? 1 : 0,
                            s.has_y ? &y : nullptr, s.q.mode ? &q : nullptr,
                            static_cast<float*>(p[kMean]), static_cast<float*>(p[kRstd]), &ctx);
  };
}

// FP64 reference of y, mean, rstd from the stored inputs.
struct FwdRef {
  std::vector<double> y, mean, rstd;
};

FwdRef fwd_reference(const FwdSetup& s, const FwdData& d) {
  FwdRef r;
  const int64_t n = s.rows, h = s.cols;
  r.y.resize(n * h);
  for (int64_t i = 0; i < n; ++i) {
    double mean = 0, var = 0;
    if (s.kind == FUS_NORM_LAYERNORM) {
      for (int64_t c = 0; c < h; ++c) mean += d.x.values[i * h + c];
      mean /= h;
    }
    for (int64_t c = 0; c < h; ++c) {
      const double dd = d.x.values[i * h + c] - mean;
      var += dd * dd;
    }
    const double rstd = 1.0 / std::sqrt(var / h + s.eps);
    r.mean.push_back(mean);
    r.rstd.push_back(rstd);
    for (int64_t c = 0; c < h; ++c) {
      const double w = s.zc ? 1.0 + d.gamma.values[c] : d.gamma.values[c];
      const double b = s.has_beta ? d.beta.values[c] : 0.0;
      r.y[i * h + c] = (d.x.values[i * h + c] - mean) * rstd * w + b;
    }
  }
  return r;
}

// Tolerance of y in fp32: the statistics carry sum-order errors (~sqrt(H) 2^-24) and (x - mean)
// cancels; scaled by the row's typical |y|.
constexpr double kRtol = 2e-5;

// ---- forward vs FP64
// --------------------------------------------------------------------------------

// (kind, dtype, shape): the parameters of NormForward and NormBackward.
using KindTypeShape = std::tuple<fus_norm_kind, fus_dtype, std::pair<int64_t, int64_t>>;

class NormForward : public ::testing::TestWithParam<KindTypeShape> {};

TEST_P(NormForward, MatchesFp64Reference) {
  const auto [kind, dt, shape] = GetParam();
  for (int variant = 0; variant < 3; ++variant) {
    FwdSetup s;
    s.kind = kind;
    s.x_dt = dt;
    s.rows = shape.first;
    s.cols = shape.second;
    s.has_beta = kind == FUS_NORM_LAYERNORM && variant != 1;
    s.zc = variant == 2;
    s.g_dt = variant == 1 ? FUS_FLOAT32 : dt;
    s.y_dt = variant == 0 ? dt : FUS_FLOAT32;
    s.seed = 100 + variant;
    SCOPED_TRACE(describe(s));
    FwdData d = fwd_data(s);
    ASSERT_EQ(run_cpu(d.bufs, fwd_call(s)), FUS_SUCCESS) << fus_last_error();
    const FwdRef r = fwd_reference(s, d);
    const std::vector<double> y = as_doubles(d.bufs.b[kY], s.y_dt);
    EXPECT_TRUE(all_close(y, r.y, out_rtol(s.y_dt, kRtol), 2e-5 + dtype_atom(s.y_dt), "y"));
    const std::vector<float> rstd = d.bufs.get<float>(kRstd);
    EXPECT_TRUE(all_close(std::vector<double>(rstd.begin(), rstd.end()), r.rstd, 1e-5, 0, "rstd"));
    if (kind == FUS_NORM_LAYERNORM) {
      const std::vector<float> mean = d.bufs.get<float>(kMean);
      EXPECT_TRUE(
          all_close(std::vector<double>(mean.begin(), mean.end()), r.mean, 1e-5, 1e-6, "mean"));
    }
  }
}

const std::vector<std::pair<int64_t, int64_t>> kShapes = {
    {1, 1}, {7, 7}, {127, 127}, {1, 4097}, {4097, 7}, {33, 1024}, {5, 768}, {3, 16384}, {2, 20000}};

// Every kind, input dtype and shape: the NormForward and NormBackward cases.
const auto kKindTypeShape = ::testing::Combine(
    ::testing::Values(FUS_NORM_LAYERNORM, FUS_NORM_RMSNORM),
    ::testing::Values(FUS_FLOAT32, FUS_FLOAT16, FUS_BFLOAT16), ::testing::ValuesIn(kShapes));

INSTANTIATE_TEST_SUITE_P(Shapes, NormForward, kKindTypeShape);

TEST(NormForwardStats, ConstantRowGivesZeroVarianceAndBeta) {
  FwdSetup s;
  s.rows = 3;
  s.cols = 37;
  s.eps = 1e-3f;
  FwdData d = fwd_data(s);
  std::vector<float> xv(3 * 37, 2.5f);
  d.bufs.b[kX] = HostMatrix(FUS_FLOAT32, 3, 37, xv).bytes;
  ASSERT_EQ(run_cpu(d.bufs, fwd_call(s)), FUS_SUCCESS) << fus_last_error();
  const auto y = d.bufs.get<float>(kY), mean = d.bufs.get<float>(kMean),
             rstd = d.bufs.get<float>(kRstd);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(mean[i], 2.5f);
    EXPECT_EQ(rstd[i], 1.0f / std::sqrt(1e-3f));
  }
  for (int c = 0; c < 37; ++c) EXPECT_EQ(y[c], d.beta.values[c]);  // x_hat = 0: y = beta exactly
}

// ---- quantized output == quantize(high-precision output)
// ------------------------------------------

using QParam = std::tuple<fus_norm_kind, fus_dtype, int, fus_dtype, std::pair<int64_t, int64_t>>;

class NormQuantized : public ::testing::TestWithParam<QParam> {};

// The fused quantized output of s (with y of s.y_dt) equals fus_quantize of y; without y, it
// equals fus_quantize of y rounded to x's dtype (what an unfused norm would have produced).
void expect_fused_equals_unfused(const FwdSetup& s) {
  FwdData d = fwd_data(s);
  ASSERT_EQ(run_cpu(d.bufs, fwd_call(s)), FUS_SUCCESS) << fus_last_error();
  const Buffers unfused = quantize_of(d.bufs.b[kY], s.y_dt, s.rows, s.cols, s.q);
  expect_same_q(d.bufs, kQ, unfused, 1, "fused vs quantize(y)");

  FwdSetup n = s;
  n.has_y = false;
  FwdData dn = fwd_data(n);
  ASSERT_EQ(run_cpu(dn.bufs, fwd_call(n)), FUS_SUCCESS) << fus_last_error();
  FwdSetup yx = s;
  yx.y_dt = s.x_dt;
  yx.q.mode = 0;
  FwdData dy = fwd_data(yx);
  ASSERT_EQ(run_cpu(dy.bufs, fwd_call(yx)), FUS_SUCCESS) << fus_last_error();
  expect_same_q(dn.bufs, kQ, quantize_of(dy.bufs.b[kY], s.x_dt, s.rows, s.cols, s.q), 1,
                "fused without y vs quantize(y in x's dtype)");
}

TEST_P(NormQuantized, EqualsQuantizeOfHighPrecisionOutput) {
  const auto [kind, dt, qmode, fmt, shape] = GetParam();
  for (int variant = 0; variant < 4; ++variant) {
    FwdSetup s;
    s.kind = kind;
    s.x_dt = s.g_dt = dt;
    s.rows = shape.first;
    s.cols = shape.second;
    s.has_beta = kind == FUS_NORM_LAYERNORM;
    s.q.mode = qmode;
    s.q.fmt = fmt;
    s.q.scale = qmode == 1 ? 37.5f : 1.0f;
    s.q.row = variant != 2;
    s.q.col = variant != 1;
    s.q.pow2 = variant != 3;  // blockwise: exact scales with an amax floor
    s.q.eps = variant == 3 ? 1e-3f : 0.0f;
    s.zc = variant == 1;
    s.y_dt = variant == 3 ? FUS_FLOAT32 : (variant == 0 ? FUS_BFLOAT16 : dt);
    SCOPED_TRACE(describe(s) + " variant " + std::to_string(variant));
    expect_fused_equals_unfused(s);
  }
}

// Modes 1 per tensor, 2 MXFP8, 3 / 4 blockwise 1x128 / 128x128. Rows 1, primes and 2^n - 1
// around the 32- and 128-row blocks; widths that are and are not multiples of 32 and 128 (partial
// edge blocks), across the lane counts of the plan (32 .. 512 lanes, more chunks a lane beyond
// 16384).
const std::vector<std::pair<int64_t, int64_t>> kQShapes = {
    {1, 1},    {7, 127},   {127, 7},    {65, 4097}, {64, 256},  {1, 300},
    {31, 129}, {128, 127}, {129, 1000}, {257, 384}, {2, 16384}, {2, 20000}};

INSTANTIATE_TEST_SUITE_P(Modes, NormQuantized,
                         ::testing::Combine(::testing::Values(FUS_NORM_LAYERNORM, FUS_NORM_RMSNORM),
                                            ::testing::Values(FUS_FLOAT32, FUS_BFLOAT16,
                                                              FUS_FLOAT16),
                                            ::testing::Values(1, 2, 3, 4),
                                            ::testing::Values(FUS_FLOAT8_E4M3, FUS_FLOAT8_E5M2),
                                            ::testing::ValuesIn(kQShapes)));

// A forward of 0 rows with a per-tensor FP8 cast (scale 4); it still writes amax 0 and
// scale_inv 1/4 (expect_zero_rows_scalars).
FwdSetup zero_rows_setup() {
  FwdSetup s;
  s.rows = 0;
  s.cols = 16;
  s.q.mode = 1;
  s.q.scale = 4.0f;
  return s;
}
void expect_zero_rows_scalars(const Buffers& b) {
  EXPECT_EQ(b.get<float>(kQ + kQAmax)[0], 0.0f);
  EXPECT_EQ(b.get<float>(kQ + kQRowS)[0], 0.25f);
}

TEST(NormQuantizedEdge, ZeroRowsWritesAmaxZeroAndScaleInv) {
  const FwdSetup s = zero_rows_setup();
  FwdData d = fwd_data(s);
  ASSERT_EQ(run_cpu(d.bufs, fwd_call(s)), FUS_SUCCESS) << fus_last_error();
  expect_zero_rows_scalars(d.bufs);
}

// ---- backward
// ---------------------------------------------------------------------------------------

struct BwdSetup {
  fus_norm_kind kind = FUS_NORM_LAYERNORM;
  fus_dtype dy_dt = FUS_FLOAT32, x_dt = FUS_FLOAT32, g_dt = FUS_FLOAT32, dx_dt = FUS_FLOAT32;
  bool zc = false, dbeta = true;
  int64_t rows = 0, cols = 0;
  uint32_t seed = 7;
};

std::string describe(const BwdSetup& s) {
  std::ostringstream os;
  os << (s.kind == FUS_NORM_LAYERNORM ? "LayerNorm" : "RMSNorm") << " dy " << dt_name(s.dy_dt)
     << " x " << dt_name(s.x_dt) << " gamma " << dt_name(s.g_dt) << " dx " << dt_name(s.dx_dt)
     << " [" << s.rows << ", " << s.cols << "] zc " << s.zc;
  return os.str();
}

enum BSlot { kBDy = 0, kBX, kBMean, kBRstd, kBGamma, kBDx, kBDgamma, kBDbeta, kBWs };

struct BwdData {
  HostMatrix dy, x, gamma;
  std::vector<float> mean, rstd;
  Buffers bufs;
};

BwdData bwd_data(const BwdSetup& s, size_t workspace) {
  BwdData d;
  d.dy = random_matrix(s.dy_dt, s.rows, s.cols, s.seed, 0.0f, 1.0f);
  d.x = random_matrix(s.x_dt, s.rows, s.cols, s.seed + 1, 0.5f, 1.5f);
  d.gamma = random_matrix(s.g_dt, 1, s.cols, s.seed + 2, s.zc ? 0.0f : 1.0f, 0.5f);
  // Statistics as the forward stores them (fp32 of the FP64 values is close enough: the backward
  // is tested as a function of the mean / rstd it is given).
  for (int64_t i = 0; i < s.rows; ++i) {
    double mean = 0, var = 0;
    if (s.kind == FUS_NORM_LAYERNORM) {
      for (int64_t c = 0; c < s.cols; ++c) mean += d.x.values[i * s.cols + c];
      mean /= s.cols;
    }
    for (int64_t c = 0; c < s.cols; ++c) {
      const double dd = d.x.values[i * s.cols + c] - mean;
      var += dd * dd;
    }
    d.mean.push_back(static_cast<float>(mean));
    d.rstd.push_back(static_cast<float>(1.0 / std::sqrt(var / s.cols + 1e-5)));
  }
  Buffers& b = d.bufs;
  b.add_bytes(d.dy.bytes);
  b.add_bytes(d.x.bytes);
  b.add(s.kind == FUS_NORM_LAYERNORM ? d.mean : std::vector<float>{});
  b.add(d.rstd);
  b.add_bytes(d.gamma.bytes);
  b.add_filled(static_cast<size_t>(s.rows * s.cols) * fus_dtype_size(s.dx_dt));
  b.add_filled(static_cast<size_t>(s.cols) * fus_dtype_size(s.g_dt));
  b.add_filled(s.dbeta ? static_cast<size_t>(s.cols) * fus_dtype_size(s.g_dt) : 0);
  b.add_filled(workspace);
  return d;
}

ApiCall bwd_call(const BwdSetup& s) {
  return [s](const std::vector<void*>& p, const fus_context& ctx) {
    size_t ws = 0;
    const fus_status st = fus_norm_backward_workspace_size(s.rows, s.cols, &ctx, &ws);
    if (st != FUS_SUCCESS) return st;
    fus_tensor dy{p[kBDy], s.dy_dt, s.rows, s.cols}, x{p[kBX], s.x_dt, s.rows, s.cols},
        g{p[kBGamma], s.g_dt, 1, s.cols}, dx{p[kBDx], s.dx_dt, s.rows, s.cols},
        dg{p[kBDgamma], s.g_dt, 1, s.cols}, db{p[kBDbeta], s.g_dt, 1, s.cols};
    return fus_norm_backward(s.kind, &dy, &x, static_cast<const float*>(p[kBMean]),
                             static_cast<const float*>(p[kBRstd]), &g, s.zc ? 1 : 0, &dx, &dg,
                             s.dbeta ? &db : nullptr, p[kBWs], ws, &ctx);
  };
}

size_t cuda_workspace(const BwdSetup& s) {
  const fus_context ctx = cuda_ctx();
  size_t ws = 0;
  if (fus_has_cuda()) {
    EXPECT_EQ(fus_norm_backward_workspace_size(s.rows, s.cols, &ctx, &ws), FUS_SUCCESS);
  }
  return ws;
}

struct BwdRef {
  std::vector<double> dx, dgamma, dbeta, dgamma_abs, dbeta_abs;
};

// FP64 backward as a function of the given mean / rstd.
BwdRef bwd_reference(const BwdSetup& s, const BwdData& d) {
  BwdRef r;
  const int64_t n = s.rows, h = s.cols;
  const bool ln = s.kind == FUS_NORM_LAYERNORM;
  r.dx.resize(n * h);
  r.dgamma.assign(h, 0);
  r.dbeta.assign(h, 0);
  r.dgamma_abs.assign(h, 0);
  r.dbeta_abs.assign(h, 0);
  std::vector<double> xh(h), dyw(h);
  for (int64_t i = 0; i < n; ++i) {
    const double mean = ln ? d.mean[i] : 0.0, rstd = d.rstd[i];
    double m1 = 0, m2 = 0;
    for (int64_t c = 0; c < h; ++c) {
      const double w = s.zc ? 1.0 + d.gamma.values[c] : d.gamma.values[c];
      const double dy = d.dy.values[i * h + c];
      xh[c] = (d.x.values[i * h + c] - mean) * rstd;
      dyw[c] = dy * w;
      m1 += dyw[c] * xh[c];
      m2 += dyw[c];
      r.dgamma[c] += dy * xh[c];
      r.dbeta[c] += dy;
      r.dgamma_abs[c] += std::fabs(dy * xh[c]);
      r.dbeta_abs[c] += std::fabs(dy);
    }
    m1 /= h;
    m2 /= h;
    for (int64_t c = 0; c < h; ++c)
      r.dx[i * h + c] = ln ? (dyw[c] - m2 - xh[c] * m1) * rstd : (dyw[c] - xh[c] * m1) * rstd;
  }
  return r;
}

class NormBackward : public ::testing::TestWithParam<KindTypeShape> {};

TEST_P(NormBackward, MatchesFp64Reference) {
  const auto [kind, dt, shape] = GetParam();
  for (int variant = 0; variant < 2; ++variant) {
    BwdSetup s;
    s.kind = kind;
    s.dy_dt = s.x_dt = s.dx_dt = dt;
    s.g_dt = variant == 0 ? dt : FUS_FLOAT32;
    s.zc = variant == 1;
    s.dbeta = kind == FUS_NORM_LAYERNORM;
    s.rows = shape.first;
    s.cols = shape.second;
    SCOPED_TRACE(describe(s));
    BwdData d = bwd_data(s, 0);
    ASSERT_EQ(run_cpu(d.bufs, bwd_call(s)), FUS_SUCCESS) << fus_last_error();
    const BwdRef r = bwd_reference(s, d);
    // dx: fp32 row sums over H terms, then cancellation in dyw - m2 - x_hat m1.
    double scale = 0;
    for (double v : r.dx) scale = std::max(scale, std::fabs(v));
    EXPECT_TRUE(all_close(as_doubles(d.bufs.b[kBDx], s.dx_dt), r.dx, out_rtol(s.dx_dt, kRtol),
                          2e-5 * scale + dtype_atom(s.dx_dt), "dx"));
    // Column sums: error bounded by the sum of |terms| times the fp32 step and the row count.
    const std::vector<double> dg = as_doubles(d.bufs.b[kBDgamma], s.g_dt);
    for (int64_t c = 0; c < s.cols; ++c) {
      const double tol = out_rtol(s.g_dt, 0) * std::fabs(r.dgamma[c]) + 1e-6 * r.dgamma_abs[c] +
                         dtype_atom(s.g_dt);
      ASSERT_NEAR(dg[c], r.dgamma[c], tol) << "dgamma[" << c << "]";
    }
    if (s.dbeta) {
      const std::vector<double> db = as_doubles(d.bufs.b[kBDbeta], s.g_dt);
      for (int64_t c = 0; c < s.cols; ++c) {
        const double tol = out_rtol(s.g_dt, 0) * std::fabs(r.dbeta[c]) + 1e-6 * r.dbeta_abs[c] +
                           dtype_atom(s.g_dt);
        ASSERT_NEAR(db[c], r.dbeta[c], tol) << "dbeta[" << c << "]";
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, NormBackward, kKindTypeShape);

TEST(NormBackwardEdge, ZeroRowsGivesZeroGradients) {
  BwdSetup s;
  s.rows = 0;
  s.cols = 9;
  BwdData d = bwd_data(s, 0);
  ASSERT_EQ(run_cpu(d.bufs, bwd_call(s)), FUS_SUCCESS) << fus_last_error();
  for (float v : d.bufs.get<float>(kBDgamma)) EXPECT_EQ(f2u(v), 0u);
  for (float v : d.bufs.get<float>(kBDbeta)) EXPECT_EQ(f2u(v), 0u);
}

// ---- the reduction plan
// -----------------------------------------------------------------------------

TEST(NormPlan, LanesAndColumnGroupsFollowTheDocumentedRule) {
  EXPECT_EQ(fu::norm_fwd_lanes(1), 32);
  EXPECT_EQ(fu::norm_fwd_lanes(1024), 32);  // 128 chunks, 4 a lane
  EXPECT_EQ(fu::norm_fwd_lanes(1025), 64);
  EXPECT_EQ(fu::norm_fwd_lanes(4096), 128);
  EXPECT_EQ(fu::norm_fwd_lanes(16384), 512);
  EXPECT_EQ(fu::norm_fwd_lanes(1 << 20), 512);  // beyond: 512 lanes, more chunks a lane
  EXPECT_EQ(fu::norm_bwd_lanes(512), 32);
  EXPECT_EQ(fu::norm_bwd_lanes(513), 64);
  EXPECT_EQ(fu::norm_bwd_lanes(8192), 512);
  // Four chunks a lane happens at 512 lanes and one team only (the CUDA fast path relies on it).
  EXPECT_EQ(fu::norm_bwd_lanes(16384), 512);
  EXPECT_EQ(fu::norm_chunks_per_lane(16384, 512), 4);
  EXPECT_EQ(fu::norm_bwd_col_plan(70, 16384).teams, 1);
  const fu::NormColPlan p = fu::norm_bwd_col_plan(16384, 1024);  // 64 lanes, 4 teams
  EXPECT_EQ(p.teams, 4);
  EXPECT_EQ(p.groups, 256);
  EXPECT_EQ(p.rows_per_group, 64);
  const fu::NormColPlan q = fu::norm_bwd_col_plan(7, 7);
  EXPECT_EQ(q.teams, 8);
  EXPECT_EQ(q.groups, 1);
  EXPECT_EQ(q.rows_per_group, 7);
  for (int64_t n : {1, 5, 63, 64, 65, 1000, 4097, 100000}) {
    const fu::NormColPlan c = fu::norm_bwd_col_plan(n, 300);
    EXPECT_GE(c.groups * c.rows_per_group, n);
    EXPECT_LT((c.groups - 1) * c.rows_per_group, n);  // no empty group
    EXPECT_LE(c.groups, 256);
  }
}

// The row sum of the plan is the documented lane / tree order: check it against a direct
// transcription for a row whose sum depends on the order.
TEST(NormPlan, RowSumOrderIsLanesThenPairwiseTree) {
  for (int64_t h : {5, 100, 777, 5000}) {
    std::vector<float> v(h);
    for (int64_t i = 0; i < h; ++i)
      v[i] = (i % 3 == 0 ? 1e8f : 1.0f) * (i % 2 ? -1.0f : 1.0f) + i * 1e-3f;
    for (int lanes : {32, 64, 512}) {
      const float got = fu::norm_row_sum(h, lanes, [&](float s, int64_t i) { return s + v[i]; });
      std::vector<float> lane(lanes, 0.0f);
      for (int64_t c = 0; c * 8 < h; ++c)
        for (int j = 0; j < 8 && c * 8 + j < h; ++j) lane[c % lanes] += v[c * 8 + j];
      // Within each warp: butterfly = pairwise with halving offsets.
      for (int w = 0; w < lanes / 32; ++w)
        for (int off = 16; off; off /= 2)
          for (int i = 0; i < off; ++i)
            lane[w * 32 + i] = lane[w * 32 + i] + lane[w * 32 + i + off];
      std::vector<float> g;
      for (int w = 0; w < lanes / 32; ++w) g.push_back(lane[w * 32]);
      for (size_t off = g.size() / 2; off; off /= 2)
        for (size_t i = 0; i < off; ++i) g[i] = g[i] + g[i + off];
      EXPECT_EQ(f2u(got), f2u(g[0])) << "H " << h << " lanes " << lanes;
    }
  }
}

// ---- argument validation
// ----------------------------------------------------------------------------

TEST(NormErrors, ForwardRejectsBadArguments) {
  float x[12] = {}, g[4] = {}, b[4] = {}, y[12] = {}, mean[3] = {}, rstd[3] = {};
  const fus_context ctx = cpu_ctx();
  fus_tensor tx{x, FUS_FLOAT32, 3, 4}, tg{g, FUS_FLOAT32, 1, 4}, tb{b, FUS_FLOAT32, 1, 4},
      ty{y, FUS_FLOAT32, 3, 4};
  const char* fn = "fus_norm_forward";
  auto call = [&](fus_norm_kind k, const fus_tensor* xx, const fus_tensor* gg, const fus_tensor* bb,
                  float eps, fus_tensor* yy, fus_quantized* q, float* m, float* r,
                  const fus_context* c) {
    return fus_norm_forward(k, xx, gg, bb, eps, 0, yy, q, m, r, c);
  };
  EXPECT_EQ(call(FUS_NORM_LAYERNORM, &tx, &tg, &tb, 1e-5f, &ty, nullptr, mean, rstd, &ctx),
            FUS_SUCCESS);
  EXPECT_TRUE(
      is_error(call(FUS_NORM_LAYERNORM, &tx, &tg, &tb, 1e-5f, &ty, nullptr, mean, rstd, nullptr),
               FUS_ERROR_INVALID_ARGUMENT, {fn, "ctx"}));
  EXPECT_TRUE(is_error(
      call(static_cast<fus_norm_kind>(7), &tx, &tg, &tb, 1e-5f, &ty, nullptr, mean, rstd, &ctx),
      FUS_ERROR_INVALID_ARGUMENT, {fn, "kind"}));
  EXPECT_TRUE(
      is_error(call(FUS_NORM_LAYERNORM, nullptr, &tg, &tb, 1e-5f, &ty, nullptr, mean, rstd, &ctx),
               FUS_ERROR_INVALID_ARGUMENT, {fn, "x"}));
  fus_tensor bad = tx;
  bad.dtype = FUS_FLOAT8_E4M3;
  EXPECT_TRUE(
      is_error(call(FUS_NORM_LAYERNORM, &bad, &tg, &tb, 1e-5f, &ty, nullptr, mean, rstd, &ctx),
               FUS_ERROR_INVALID_ARGUMENT, {fn, "x", "dtype"}));
  fus_tensor g5{g, FUS_FLOAT32, 1, 5};
  EXPECT_TRUE(
      is_error(call(FUS_NORM_LAYERNORM, &tx, &g5, &tb, 1e-5f, &ty, nullptr, mean, rstd, &ctx),
               FUS_ERROR_INVALID_ARGUMENT, {fn, "gamma", "[1, 4]"}));
  EXPECT_TRUE(is_error(call(FUS_NORM_RMSNORM, &tx, &tg, &tb, 1e-5f, &ty, nullptr, mean, rstd, &ctx),
                       FUS_ERROR_INVALID_ARGUMENT, {fn, "beta", "RMSNorm"}));
  EXPECT_TRUE(
      is_error(call(FUS_NORM_LAYERNORM, &tx, &tg, &tb, -1.0f, &ty, nullptr, mean, rstd, &ctx),
               FUS_ERROR_INVALID_ARGUMENT, {fn, "eps"}));
  EXPECT_TRUE(is_error(call(FUS_NORM_LAYERNORM, &tx, &tg, &tb, NAN, &ty, nullptr, mean, rstd, &ctx),
                       FUS_ERROR_INVALID_ARGUMENT, {fn, "eps"}));
  fus_tensor y2{y, FUS_FLOAT32, 4, 3};
  EXPECT_TRUE(
      is_error(call(FUS_NORM_LAYERNORM, &tx, &tg, &tb, 1e-5f, &y2, nullptr, mean, rstd, &ctx),
               FUS_ERROR_INVALID_ARGUMENT, {fn, "y", "[3, 4]"}));
  EXPECT_TRUE(
      is_error(call(FUS_NORM_LAYERNORM, &tx, &tg, &tb, 1e-5f, &tx, nullptr, mean, rstd, &ctx),
               FUS_ERROR_INVALID_ARGUMENT, {fn, "y", "alias"}));
  EXPECT_TRUE(
      is_error(call(FUS_NORM_LAYERNORM, &tx, &tg, &tb, 1e-5f, &ty, nullptr, nullptr, rstd, &ctx),
               FUS_ERROR_INVALID_ARGUMENT, {fn, "mean"}));
  EXPECT_TRUE(is_error(
      call(FUS_NORM_RMSNORM, &tx, &tg, nullptr, 1e-5f, &ty, nullptr, nullptr, nullptr, &ctx),
      FUS_ERROR_INVALID_ARGUMENT, {fn, "rstd"}));
  EXPECT_EQ(call(FUS_NORM_RMSNORM, &tx, &tg, nullptr, 1e-5f, &ty, nullptr, nullptr, rstd, &ctx),
            FUS_SUCCESS);
  fus_tensor x0{x, FUS_FLOAT32, 3, 0}, g0{g, FUS_FLOAT32, 1, 0};
  EXPECT_TRUE(is_error(
      call(FUS_NORM_LAYERNORM, &x0, &g0, nullptr, 1e-5f, nullptr, nullptr, mean, rstd, &ctx),
      FUS_ERROR_INVALID_ARGUMENT, {fn, "x", "column"}));
  uint8_t q8[12], s8[3];
  fus_quantized q = rowwise_q(q8, s8, 3, 4);
  EXPECT_TRUE(is_error(call(FUS_NORM_LAYERNORM, &tx, &tg, &tb, 1e-5f, &ty, &q, mean, rstd, &ctx),
                       FUS_ERROR_INVALID_ARGUMENT, {fn, "q->scale"}));
  fus_quantized qs = q;
  qs.rows = 4;
  EXPECT_TRUE(is_error(call(FUS_NORM_LAYERNORM, &tx, &tg, &tb, 1e-5f, &ty, &qs, mean, rstd, &ctx),
                       FUS_ERROR_INVALID_ARGUMENT, {fn, "q"}));
  fus_quantized qd = q;
  qd.dtype = FUS_BFLOAT16;
  EXPECT_TRUE(is_error(call(FUS_NORM_LAYERNORM, &tx, &tg, &tb, 1e-5f, &ty, &qd, mean, rstd, &ctx),
                       FUS_ERROR_INVALID_ARGUMENT, {fn, "q->dtype"}));
  fus_quantized qb = q;
  qb.mode = FUS_SCALING_BLOCK_1D;
  qb.power_2_scale = 3;
  EXPECT_TRUE(is_error(call(FUS_NORM_LAYERNORM, &tx, &tg, &tb, 1e-5f, &ty, &qb, mean, rstd, &ctx),
                       FUS_ERROR_INVALID_ARGUMENT, {fn, "q->power_2_scale"}));
  qb.power_2_scale = 1;
  qb.amax_epsilon = -1.0f;
  EXPECT_TRUE(is_error(call(FUS_NORM_LAYERNORM, &tx, &tg, &tb, 1e-5f, &ty, &qb, mean, rstd, &ctx),
                       FUS_ERROR_INVALID_ARGUMENT, {fn, "q->amax_epsilon"}));
  const fus_context gpu = cuda_ctx();
  if (!fus_has_cuda()) {
    EXPECT_TRUE(
        is_error(call(FUS_NORM_LAYERNORM, &tx, &tg, &tb, 1e-5f, &ty, nullptr, mean, rstd, &gpu),
                 FUS_ERROR_UNSUPPORTED, {fn, "CUDA"}));
  }
}

TEST(NormErrors, BackwardRejectsBadArguments) {
  float dy[12] = {}, x[12] = {}, g[4] = {}, dx[12] = {}, dg[4] = {}, db[4] = {}, mean[3] = {},
        rstd[3] = {};
  uint16_t dgh[4] = {};
  const fus_context ctx = cpu_ctx();
  fus_tensor tdy{dy, FUS_FLOAT32, 3, 4}, tx{x, FUS_FLOAT32, 3, 4}, tg{g, FUS_FLOAT32, 1, 4},
      tdx{dx, FUS_FLOAT32, 3, 4}, tdg{dg, FUS_FLOAT32, 1, 4}, tdb{db, FUS_FLOAT32, 1, 4};
  const char* fn = "fus_norm_backward";
  auto call = [&](fus_norm_kind k, fus_tensor* ddy, fus_tensor* xx, float* m, float* r,
                  fus_tensor* ddx, fus_tensor* ddg, fus_tensor* ddb, void* ws, size_t wsb,
                  const fus_context* c) {
    return fus_norm_backward(k, ddy, xx, m, r, &tg, 0, ddx, ddg, ddb, ws, wsb, c);
  };
  EXPECT_EQ(call(FUS_NORM_LAYERNORM, &tdy, &tx, mean, rstd, &tdx, &tdg, &tdb, nullptr, 0, &ctx),
            FUS_SUCCESS);
  fus_tensor x2{x, FUS_FLOAT32, 4, 3};
  EXPECT_TRUE(
      is_error(call(FUS_NORM_LAYERNORM, &tdy, &x2, mean, rstd, &tdx, &tdg, &tdb, nullptr, 0, &ctx),
               FUS_ERROR_INVALID_ARGUMENT, {fn, "x", "[3, 4]"}));
  EXPECT_TRUE(is_error(
      call(FUS_NORM_LAYERNORM, &tdy, &tx, nullptr, rstd, &tdx, &tdg, &tdb, nullptr, 0, &ctx),
      FUS_ERROR_INVALID_ARGUMENT, {fn, "mean"}));
  EXPECT_TRUE(is_error(
      call(FUS_NORM_LAYERNORM, &tdy, &tx, mean, nullptr, &tdx, &tdg, &tdb, nullptr, 0, &ctx),
      FUS_ERROR_INVALID_ARGUMENT, {fn, "rstd"}));
  fus_tensor dgb{dgh, FUS_BFLOAT16, 1, 4};
  EXPECT_TRUE(
      is_error(call(FUS_NORM_LAYERNORM, &tdy, &tx, mean, rstd, &tdx, &dgb, &tdb, nullptr, 0, &ctx),
               FUS_ERROR_INVALID_ARGUMENT, {fn, "dgamma", "dtype"}));
  EXPECT_TRUE(
      is_error(call(FUS_NORM_RMSNORM, &tdy, &tx, mean, rstd, &tdx, &tdg, &tdb, nullptr, 0, &ctx),
               FUS_ERROR_INVALID_ARGUMENT, {fn, "dbeta", "RMSNorm"}));
  EXPECT_TRUE(is_error(
      call(FUS_NORM_LAYERNORM, &tdy, &tx, mean, rstd, nullptr, &tdg, &tdb, nullptr, 0, &ctx),
      FUS_ERROR_INVALID_ARGUMENT, {fn, "dx"}));
  EXPECT_TRUE(is_error(
      call(FUS_NORM_LAYERNORM, &tdy, &tx, mean, rstd, &tdx, nullptr, &tdb, nullptr, 0, &ctx),
      FUS_ERROR_INVALID_ARGUMENT, {fn, "dgamma"}));
  const fus_context gpu = cuda_ctx();
  if (fus_has_cuda()) {
    // Validation happens before any device work: a too-small workspace is reported as such.
    EXPECT_TRUE(is_error(
        call(FUS_NORM_LAYERNORM, &tdy, &tx, mean, rstd, &tdx, &tdg, &tdb, nullptr, 0, &gpu),
        FUS_ERROR_INVALID_ARGUMENT, {fn, "workspace_bytes"}));
  } else {
    EXPECT_TRUE(is_error(
        call(FUS_NORM_LAYERNORM, &tdy, &tx, mean, rstd, &tdx, &tdg, &tdb, nullptr, 0, &gpu),
        FUS_ERROR_UNSUPPORTED, {fn, "CUDA"}));
  }
  size_t ws = 1;
  EXPECT_EQ(fus_norm_backward_workspace_size(3, 4, &ctx, &ws), FUS_SUCCESS);
  EXPECT_EQ(ws, 0u);
  EXPECT_TRUE(is_error(fus_norm_backward_workspace_size(-1, 4, &ctx, &ws),
                       FUS_ERROR_INVALID_ARGUMENT, {"fus_norm_backward_workspace_size", "rows"}));
}

// ---- CUDA vs CPU
// ------------------------------------------------------------------------------------

// Runs the forward on both backends; every output buffer must hold the same bits.
void expect_forward_cuda_equals_cpu(const FwdSetup& s, const FwdData& d) {
  const DualResult r = run_both(d.bufs, fwd_call(s));
  ASSERT_EQ(r.cpu_status, FUS_SUCCESS) << fus_last_error();
  ASSERT_EQ(r.cuda_status, FUS_SUCCESS) << fus_last_error();
  for (size_t i = 0; i < d.bufs.b.size(); ++i)
    EXPECT_TRUE(same_bits<uint8_t>(r.cpu, r.cuda, static_cast<int>(i),
                                   ("buffer " + std::to_string(i)).c_str()));
}

class NormCudaForward : public ::testing::TestWithParam<std::tuple<fus_norm_kind, fus_dtype, int>> {
};

TEST_P(NormCudaForward, BitIdenticalToCpu) {
  FUSTEST_REQUIRE_CUDA();
  const auto [kind, dt, qmode] = GetParam();
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {1, 1},     {7, 7},     {127, 127}, {4097, 7}, {3, 4097}, {64, 1024}, {33, 768},
      {40, 4096}, {9, 16384}, {3, 20000}, {130, 8},  {100, 96}, {129, 257}, {257, 384}};
  for (const auto& shape : shapes) {
    for (int variant = 0; variant < 3; ++variant) {
      FwdSetup s;
      s.kind = kind;
      s.x_dt = dt;
      s.g_dt = variant == 1 ? FUS_FLOAT32 : dt;
      s.y_dt = variant == 2 ? FUS_FLOAT32 : dt;
      s.has_y = variant != 1;
      s.has_beta = kind == FUS_NORM_LAYERNORM && variant != 2;
      s.zc = variant == 1;
      s.rows = shape.first;
      s.cols = shape.second;
      s.q.mode = qmode;
      s.q.fmt = variant == 2 ? FUS_FLOAT8_E5M2 : FUS_FLOAT8_E4M3;
      s.q.scale = 3.0f;
      s.q.col = variant != 0 || qmode == 2;
      s.q.pow2 = variant != 2;  // blockwise: exact scales with an amax floor
      s.q.eps = variant == 2 ? 1e-3f : 0.0f;
      SCOPED_TRACE(describe(s));
      FwdData d = fwd_data(s);
      expect_forward_cuda_equals_cpu(s, d);
      if (HasFatalFailure()) return;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(All, NormCudaForward,
                         ::testing::Combine(::testing::Values(FUS_NORM_LAYERNORM, FUS_NORM_RMSNORM),
                                            ::testing::Values(FUS_FLOAT32, FUS_FLOAT16,
                                                              FUS_BFLOAT16),
                                            ::testing::Values(0, 1, 2, 3, 4)));

class NormCudaBackward : public ::testing::TestWithParam<std::tuple<fus_norm_kind, fus_dtype>> {};

TEST_P(NormCudaBackward, BitIdenticalToCpu) {
  FUSTEST_REQUIRE_CUDA();
  const auto [kind, dt] = GetParam();
  // With 16-bit dtypes throughout (variants 0 and 2), the fast paths: two chunks a lane at
  // [1000, 1024] (64 lanes, 4 teams, a shorter last group) and [300, 4096]; four at H = 16384
  // (512 lanes, one team: groups of 5 and 4 rows at [9, 16384], of 8 and a last of 6 at
  // [70, 16384]).
  const std::vector<std::pair<int64_t, int64_t>> shapes = {
      {1, 1},      {7, 7},     {127, 127},  {4097, 7},  {3, 4097},  {1000, 1024}, {33, 768},
      {300, 4096}, {9, 16384}, {70, 16384}, {3, 20000}, {2048, 64}, {5000, 300}};
  for (const auto& shape : shapes) {
    for (int variant = 0; variant < 3; ++variant) {
      BwdSetup s;
      s.kind = kind;
      s.dy_dt = s.x_dt = dt;
      s.dx_dt = variant == 1 ? FUS_FLOAT32 : dt;
      s.g_dt = variant == 1 ? FUS_FLOAT32 : dt;
      s.zc = variant != 0;
      s.dbeta = kind == FUS_NORM_LAYERNORM;
      s.rows = shape.first;
      s.cols = shape.second;
      SCOPED_TRACE(describe(s));
      BwdData d = bwd_data(s, cuda_workspace(s));
      const DualResult r = run_both(d.bufs, bwd_call(s));
      ASSERT_EQ(r.cpu_status, FUS_SUCCESS) << fus_last_error();
      ASSERT_EQ(r.cuda_status, FUS_SUCCESS) << fus_last_error();
      EXPECT_TRUE(same_bits<uint8_t>(r.cpu, r.cuda, kBDx, "dx"));
      EXPECT_TRUE(same_bits<uint8_t>(r.cpu, r.cuda, kBDgamma, "dgamma"));
      EXPECT_TRUE(same_bits<uint8_t>(r.cpu, r.cuda, kBDbeta, "dbeta"));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(All, NormCudaBackward,
                         ::testing::Combine(::testing::Values(FUS_NORM_LAYERNORM, FUS_NORM_RMSNORM),
                                            ::testing::Values(FUS_FLOAT32, FUS_FLOAT16,
                                                              FUS_BFLOAT16)));

// Rows holding NaN (either sign, with a payload), inf, and values whose output overflows the
// 16-bit type: the fast paths' paired conversions must hand these to the scalar rules (overflow to
// inf) exactly as the CPU backend does. A NaN or inf input makes its row's statistics and outputs
// NaN; the sign and payload of NaN made by arithmetic are the backend's, so those match as NaN.
TEST(NormCuda, NonFiniteRowsMatchCpu) {
  FUSTEST_REQUIRE_CUDA();
  for (fus_dtype dt : {FUS_BFLOAT16, FUS_FLOAT16}) {
    for (fus_norm_kind kind : {FUS_NORM_LAYERNORM, FUS_NORM_RMSNORM}) {
      for (int qmode : {0, 1, 3, 4}) {
        FwdSetup s;
        s.kind = kind;
        s.x_dt = s.g_dt = s.y_dt = dt;
        s.has_beta = kind == FUS_NORM_LAYERNORM;
        s.rows = 40;
        s.cols = 4096;  // the 16-bit fast path (four whole chunks a lane), blockwise not
        s.q.mode = qmode;
        s.q.scale = 3.0f;
        s.q.col = qmode != 0;
        SCOPED_TRACE(describe(s));
        FwdData d = fwd_data(s);
        auto put = [&](int64_t r, int64_t c, uint16_t bits) {
          std::memcpy(d.bufs.b[kX].data() + (r * s.cols + c) * 2, &bits, 2);
        };
        const bool bf = dt == FUS_BFLOAT16;
        put(3, 5, bf ? 0x7fc1 : 0x7e01);     // +NaN with payload
        put(7, 4000, bf ? 0xffc3 : 0xfe03);  // -NaN with payload
        put(11, 17, bf ? 0x7f80 : 0x7c00);   // +inf
        put(12, 18, bf ? 0xff80 : 0xfc00);   // -inf
        // Max finite inputs (sums that overflow), and max finite gamma over the first chunk of
        // columns, so that some outputs of the ordinary rows overflow the 16-bit type to inf.
        for (int64_t c = 0; c < s.cols; c += 2) put(20, c, bf ? 0x7f7f : 0x7bff);
        for (int64_t c = 0; c < 8; ++c) {
          const uint16_t big = bf ? 0x7f7f : 0x7bff;
          std::memcpy(d.bufs.b[kGamma].data() + c * 2, &big, 2);
        }
        const DualResult r = run_both(d.bufs, fwd_call(s));
        ASSERT_EQ(r.cpu_status, FUS_SUCCESS) << fus_last_error();
        ASSERT_EQ(r.cuda_status, FUS_SUCCESS) << fus_last_error();
        EXPECT_TRUE(same_bits_or_both_nan(r.cpu, r.cuda, kY, dt, "y"));
        if (kind == FUS_NORM_LAYERNORM) {
          EXPECT_TRUE(same_bits_or_both_nan(r.cpu, r.cuda, kMean, FUS_FLOAT32, "mean"));
        }
        EXPECT_TRUE(same_bits_or_both_nan(r.cpu, r.cuda, kRstd, FUS_FLOAT32, "rstd"));
        expect_q_same_or_both_nan(r.cpu, r.cuda, kQ, s.q);
        for (int i : {kX, kGamma, kBeta})  // inputs untouched
          EXPECT_TRUE(same_bits<uint8_t>(r.cpu, r.cuda, i, "input"));
        // Rows with NaN are NaN throughout; so are LayerNorm's rows with inf (inf - inf in the
        // centring). RMSNorm's rstd is 0 there, which leaves NaN only at the inf itself.
        const std::vector<double> y = as_doubles(r.cuda.b[kY], dt);
        for (int64_t row : {3, 7}) EXPECT_TRUE(std::isnan(y[row * s.cols + 100])) << row;
        for (int64_t row : {11, 12})
          EXPECT_EQ(std::isnan(y[row * s.cols + 100]), kind == FUS_NORM_LAYERNORM) << row;
        int64_t infs = 0;
        for (int64_t row = 0; row < 3; ++row)
          for (int64_t c = 0; c < 8; ++c) infs += std::isinf(y[row * s.cols + c]) ? 1 : 0;
        EXPECT_GT(infs, 0);
        if (HasFatalFailure()) return;
      }
    }
  }
}

// A quantized output with only its columnwise copy (allowed by the API): shapes that would take
// the 16-bit fast path otherwise, which writes the rowwise copy.
TEST(NormCuda, ColumnwiseOnlyCopyMatchesCpu) {
  FUSTEST_REQUIRE_CUDA();
  for (fus_dtype dt : {FUS_BFLOAT16, FUS_FLOAT16}) {
    for (int qmode : {1, 2, 3, 4}) {
      FwdSetup s;
      s.kind = FUS_NORM_LAYERNORM;
      s.x_dt = s.g_dt = s.y_dt = dt;
      s.rows = 40;
      s.cols = 4096;
      s.q.mode = qmode;
      s.q.scale = 3.0f;
      s.q.row = false;
      s.q.col = true;
      SCOPED_TRACE(describe(s));
      FwdData d = fwd_data(s);
      expect_forward_cuda_equals_cpu(s, d);
      if (HasFatalFailure()) return;
    }
  }
}

TEST(NormCuda, ZeroRows) {
  FUSTEST_REQUIRE_CUDA();
  const FwdSetup s = zero_rows_setup();
  FwdData d = fwd_data(s);
  const DualResult r = run_both(d.bufs, fwd_call(s));
  ASSERT_EQ(r.cuda_status, FUS_SUCCESS) << fus_last_error();
  expect_zero_rows_scalars(r.cuda);
  BwdSetup b;
  b.rows = 0;
  b.cols = 9;
  BwdData db = bwd_data(b, cuda_workspace(b));
  const DualResult rb = run_both(db.bufs, bwd_call(b));
  ASSERT_EQ(rb.cuda_status, FUS_SUCCESS) << fus_last_error();
  EXPECT_TRUE(same_bits<uint8_t>(rb.cpu, rb.cuda, kBDgamma, "dgamma"));
}

}  // namespace

TEST(NormAmaxAccumulate, MaxCombinesIntoPresetValue) {
  const int64_t rows = 6, cols = 40;
  std::vector<float> x(rows * cols), gamma(cols, 1.5f), rstd(rows);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>((i * 7) % 11) - 5.0f;
  std::vector<uint8_t> data(rows * cols);
  float scale = 1.0f, scale_inv = 0.0f;
  const fus_tensor xm{x.data(), FUS_FLOAT32, rows, cols}, gm{gamma.data(), FUS_FLOAT32, 1, cols};
  const fus_context ctx = cpu_ctx();
  auto run = [&](float* amax, int acc) {
    fus_quantized q = per_tensor_out(FUS_FLOAT8_E4M3, rows, cols, data.data(), nullptr, &scale_inv,
                                     &scale, amax, acc);
    return fus_norm_forward(FUS_NORM_RMSNORM, &xm, &gm, nullptr, 1e-5f, 0, nullptr, &q, nullptr,
                            rstd.data(), &ctx);
  };
  ASSERT_NO_FATAL_FAILURE(expect_amax_accumulates(run));
  EXPECT_EQ(run(nullptr, 1), FUS_ERROR_INVALID_ARGUMENT);
}
