// The CPU normalization kernels (cpp/src/normalization/normalization_cpu.cpp: rows split over
// threads, the plan's lane sums vectorised, dgamma / dbeta by groups in the plan's order) against
// the scalar implementation they replaced, kept below verbatim as legacy:: (703b091): every output
// byte (y, the quantized copies and scales, amax, mean, rstd, dx, dgamma, dbeta) must be equal,
// for every instruction set this processor runs and 1, 2 and 3 threads, at sizes around every
// lane count, chunk, group and team of the plan, for LayerNorm and RMSNorm, every dtype, with and
// without beta and zero-centered gamma, with special values.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "common/cast.h"
#include "common/hp_access.h"
#include "legacy_test_utils.h"
#include "normalization/normalization_impl.h"
#include "normalization/normalization_math.h"

// ---- legacy: cpp/src/normalization/normalization_cpu.cpp at 703b091, verbatim --------------------

namespace legacy {
using namespace fusible;

void norm_forward_cpu(const NormFwdArgs& a) {
  const int64_t rows = a.x.rows, cols = a.x.cols;
  const fus_dtype out_dt = a.round_dtype;
  // Destination of the rounded result: y itself, or a scratch matrix when only q is wanted.
  std::vector<uint8_t> scratch;
  void* out = nullptr;
  if (a.y != nullptr) {
    out = a.y->data;
  } else if (a.q != nullptr && rows * cols > 0) {
    scratch.resize(static_cast<size_t>(rows * cols) * fus_dtype_size(out_dt));
    out = scratch.data();
  }
  const int lanes = norm_fwd_lanes(cols);
  std::vector<float> w(cols), b(cols), xr(cols);
  for (int64_t c = 0; c < cols; ++c) {
    w[c] = norm_weight(load_hp(a.gamma.data, a.gamma.dtype, c), a.zero_centered);
    b[c] = a.beta ? load_hp(a.beta, a.beta_dtype, c) : 0.0f;
  }
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) xr[c] = load_hp(a.x.data, a.x.dtype, r * cols + c);
    float mean = 0.0f, rstd;
    if (a.layernorm) {
      mean = norm_mean(
          norm_row_sum(cols, lanes, [&](float s, int64_t i) { return f_add(s, xr[i]); }), cols);
      const float var = norm_row_sum(cols, lanes, [&](float s, int64_t i) {
        const float d = f_sub(xr[i], mean);
        return f_fma(d, d, s);
      });
      rstd = norm_rstd(var, cols, a.eps);
      a.mean[r] = mean;
    } else {
      rstd = norm_rstd(
          norm_row_sum(cols, lanes, [&](float s, int64_t i) { return f_fma(xr[i], xr[i], s); }),
          cols, a.eps);
    }
    a.rstd[r] = rstd;
    if (out == nullptr) continue;
    for (int64_t c = 0; c < cols; ++c) {
      const float xh = norm_xhat(a.layernorm, xr[c], mean, rstd);
      store_hp(out, out_dt, r * cols + c, norm_y(a.layernorm, xh, w[c], b[c]));
    }
  }
  if (a.q != nullptr) cast_cpu(fus_tensor{out, out_dt, rows, cols}, *a.q);
}

void norm_backward_cpu(const NormBwdArgs& a) {
  const int64_t rows = a.dy.rows, cols = a.dy.cols;
  const int lanes = norm_bwd_lanes(cols);
  const NormColPlan plan = norm_bwd_col_plan(rows, cols);
  const bool ln = a.layernorm;
  std::vector<float> w(cols), xh(cols), dyv(cols), dyw(cols);
  for (int64_t c = 0; c < cols; ++c)
    w[c] = norm_weight(load_hp(a.gamma.data, a.gamma.dtype, c), a.zero_centered);
  std::vector<float> total_g(cols, 0.0f), total_b(cols, 0.0f);
  std::vector<float> group_g(cols), group_b(cols), team_g(cols), team_b(cols);
  for (int64_t g = 0; g < plan.groups; ++g) {
    const int64_t r0 = g * plan.rows_per_group;
    const int64_t r1 = std::min(rows, r0 + plan.rows_per_group);
    std::fill(group_g.begin(), group_g.end(), 0.0f);
    std::fill(group_b.begin(), group_b.end(), 0.0f);
    for (int t = 0; t < plan.teams; ++t) {
      std::fill(team_g.begin(), team_g.end(), 0.0f);
      std::fill(team_b.begin(), team_b.end(), 0.0f);
      for (int64_t r = r0 + t; r < r1; r += plan.teams) {
        const float mean = ln ? a.mean[r] : 0.0f, rstd = a.rstd[r];
        for (int64_t c = 0; c < cols; ++c) {
          dyv[c] = load_hp(a.dy.data, a.dy.dtype, r * cols + c);
          xh[c] = norm_xhat(ln, load_hp(a.x.data, a.x.dtype, r * cols + c), mean, rstd);
          dyw[c] = f_mul(dyv[c], w[c]);
        }
        float s1 = 0.0f, s2 = 0.0f;
        norm_row_sum2(
            cols, lanes,
            [&](float* p1, float* p2, int64_t i) {
              *p1 = f_fma(dyw[i], xh[i], *p1);
              *p2 = f_add(*p2, dyw[i]);
            },
            &s1, &s2);
        const float m1 = norm_mean(s1, cols), m2 = norm_mean(s2, cols);
        for (int64_t c = 0; c < cols; ++c) {
          store_hp(a.dx.data, a.dx.dtype, r * cols + c, norm_dx(ln, dyw[c], xh[c], m1, m2, rstd));
          team_g[c] = f_fma(dyv[c], xh[c], team_g[c]);
          team_b[c] = f_add(team_b[c], dyv[c]);
        }
      }
      for (int64_t c = 0; c < cols; ++c) {
        group_g[c] = f_add(group_g[c], team_g[c]);
        group_b[c] = f_add(group_b[c], team_b[c]);
      }
    }
    for (int64_t c = 0; c < cols; ++c) {
      total_g[c] = f_add(total_g[c], group_g[c]);
      total_b[c] = f_add(total_b[c], group_b[c]);
    }
  }
  for (int64_t c = 0; c < cols; ++c) {
    store_hp(a.dgamma.data, a.dgamma.dtype, c, total_g[c]);
    if (a.dbeta) store_hp(a.dbeta->data, a.dbeta->dtype, c, total_b[c]);
  }
}

}  // namespace legacy

// ---- the comparison ----------------------------------------------------------------------------

namespace {

using fusible::NormBwdArgs;
using fusible::NormFwdArgs;
using legacy_test::CpuIsa;
using legacy_test::Runtime;
using legacy_test::Values;

constexpr fus_dtype kF32 = FUS_FLOAT32, kF16 = FUS_FLOAT16, kBF16 = FUS_BFLOAT16,
                    kE4M3 = FUS_FLOAT8_E4M3;
constexpr fus_dtype kNone = static_cast<fus_dtype>(-1);

struct Case {
  bool layernorm;
  int64_t rows, cols;
  fus_dtype xt, wt;  // x (and dy), gamma / beta
  fus_dtype yt;      // y / dx dtype; kNone: forward without y
  bool beta, zero_centered;
  int quant;  // forward: 0 none, 1 per-tensor, 2 MXFP8
  Values values;
  std::string str() const {
    return std::string(layernorm ? "layernorm " : "rmsnorm ") + std::to_string(rows) + "x" +
           std::to_string(cols) + " x=" + std::to_string(xt) + " w=" + std::to_string(wt) +
           " y=" + std::to_string(yt) + " beta=" + std::to_string(beta) +
           " zero_centered=" + std::to_string(zero_centered) + " quant=" + std::to_string(quant);
  }
};

struct Inputs {
  std::vector<uint8_t> x, dy, gamma, beta;
  Inputs(const Case& c, uint32_t seed) {
    std::mt19937 g(seed);
    x = legacy_test::random_hp(c.xt, c.rows * c.cols, c.values, g, 2.0f);
    // Rows with an offset, so the mean matters.
    dy = legacy_test::random_hp(c.xt, c.rows * c.cols, c.values, g);
    gamma = legacy_test::random_hp(c.wt, c.cols, Values::kNormal, g, 0.5f);
    beta = legacy_test::random_hp(c.wt, c.cols, Values::kNormal, g);
  }
};

struct Fwd {
  std::vector<uint8_t> y;
  std::vector<float> mean, rstd;
  fus_tensor y_t{};
  std::unique_ptr<legacy_test::QuantOut> q;
  Fwd(const Case& c) {
    mean.assign(static_cast<size_t>(c.rows), -7.0f);
    rstd.assign(static_cast<size_t>(c.rows), -7.0f);
    if (c.yt != kNone) {
      y.assign(static_cast<size_t>(c.rows * c.cols) * fus_dtype_size(c.yt), 0xcd);
      y_t = fus_tensor{y.data(), c.yt, c.rows, c.cols};
    }
    if (c.quant)
      q = std::make_unique<legacy_test::QuantOut>(
          c.quant == 1 ? FUS_SCALING_PER_TENSOR : FUS_SCALING_MXFP8, kE4M3, c.rows, c.cols, true,
          true, 1.25f);
  }
  NormFwdArgs args(const Case& c, Inputs& in) {
    NormFwdArgs a{};
    a.layernorm = c.layernorm;
    a.x = fus_tensor{in.x.data(), c.xt, c.rows, c.cols};
    a.gamma = fus_tensor{in.gamma.data(), c.wt, 1, c.cols};
    a.beta = c.beta ? in.beta.data() : nullptr;
    a.beta_dtype = c.wt;
    a.eps = 1e-5f;
    a.zero_centered = c.zero_centered;
    a.y = c.yt != kNone ? &y_t : nullptr;
    a.round_dtype = c.yt != kNone ? c.yt : c.xt;
    a.q = q ? &q->q : nullptr;
    a.mean = c.layernorm ? mean.data() : nullptr;
    a.rstd = rstd.data();
    return a;
  }
  ::testing::AssertionResult same(const Fwd& w) const {
    auto r = legacy_test::same_values("y", y_t.dtype, w.y, y);
    if (r && q) r = q->same(*w.q, true);
    if (!r) return r;
    for (size_t i = 0; i < mean.size(); ++i)
      if (!legacy_test::same_float(w.mean[i], mean[i]) ||
          !legacy_test::same_float(w.rstd[i], rstd[i]))
        return ::testing::AssertionFailure() << "mean / rstd differ at row " << i;
    return ::testing::AssertionSuccess();
  }
};

struct Bwd {
  std::vector<uint8_t> dx, dgamma, dbeta;
  fus_tensor dbeta_t{};
  Bwd(const Case& c) {
    dx.assign(static_cast<size_t>(c.rows * c.cols) * fus_dtype_size(dx_dtype(c)), 0xcd);
    dgamma.assign(static_cast<size_t>(c.cols) * fus_dtype_size(c.wt), 0xcd);
    if (c.beta) dbeta.assign(static_cast<size_t>(c.cols) * fus_dtype_size(c.wt), 0xcd);
  }
  static fus_dtype dx_dtype(const Case& c) { return c.yt != kNone ? c.yt : c.xt; }
  NormBwdArgs args(const Case& c, Inputs& in, const Fwd& f) {
    NormBwdArgs a{};
    a.layernorm = c.layernorm;
    a.dy = fus_tensor{in.dy.data(), c.xt, c.rows, c.cols};
    a.x = fus_tensor{in.x.data(), c.xt, c.rows, c.cols};
    a.mean = c.layernorm ? f.mean.data() : nullptr;
    a.rstd = f.rstd.data();
    a.gamma = fus_tensor{in.gamma.data(), c.wt, 1, c.cols};
    a.zero_centered = c.zero_centered;
    a.dx = fus_tensor{dx.data(), dx_dtype(c), c.rows, c.cols};
    a.dgamma = fus_tensor{dgamma.data(), c.wt, 1, c.cols};
    dbeta_t = fus_tensor{dbeta.empty() ? nullptr : dbeta.data(), c.wt, 1, c.cols};
    a.dbeta = c.beta ? &dbeta_t : nullptr;
    return a;
  }
};

void check(const Case& c, uint32_t seed) {
  Inputs in(c, seed);
  Fwd want_f(c);
  legacy::norm_forward_cpu(want_f.args(c, in));
  Bwd want_b(c);
  legacy::norm_backward_cpu(want_b.args(c, in, want_f));
  for (CpuIsa isa : legacy_test::isas()) {
    for (int threads : {1, 2, 3}) {
      Runtime rt(isa, threads);
      const std::string where = c.str() + Runtime::name(isa, threads);
      Fwd got_f(c);
      fusible::norm_forward_cpu(got_f.args(c, in));
      EXPECT_TRUE(got_f.same(want_f)) << where << " forward";
      Bwd got_b(c);
      fusible::norm_backward_cpu(got_b.args(c, in, want_f));  // the same statistics
      EXPECT_TRUE(legacy_test::same_values("dx", Bwd::dx_dtype(c), want_b.dx, got_b.dx)) << where;
      EXPECT_TRUE(legacy_test::same_values("dgamma", c.wt, want_b.dgamma, got_b.dgamma)) << where;
      EXPECT_TRUE(legacy_test::same_values("dbeta", c.wt, want_b.dbeta, got_b.dbeta)) << where;
    }
  }
}

struct Size {
  int64_t rows, cols;
};
// Columns around the chunks (8), the lane counts (32 .. 512 lanes: 256, 257, 1024, 2049, 4096,
// 16385) and rows around the backward's groups and teams.
const Size kSizes[] = {{1, 1},    {1, 7},     {7, 1},     {3, 9},      {33, 31},
                       {65, 255}, {31, 257},  {97, 1023}, {129, 1024}, {17, 2049},
                       {9, 4097}, {3, 16385}, {1025, 65}};

}  // namespace

TEST(NormalizationCpuLegacy, LayerNormAndRmsNormEveryDtypeAndOutput) {
  uint32_t seed = 1;
  for (const Size& sz : kSizes) {
    for (bool ln : {true, false}) {
      for (fus_dtype xt : {kF32, kBF16, kF16}) {
        Case c{ln,
               sz.rows,
               sz.cols,
               xt,
               seed % 2 ? xt : kF32,
               kNone,
               ln && seed % 3 != 0,
               seed % 5 == 0,
               static_cast<int>(seed % 3),
               seed % 4 == 0 ? Values::kSpecial : Values::kNormal};
        c.yt = seed % 4 == 1 ? kNone : (seed % 4 == 2 ? kF32 : xt);
        if (c.yt == kNone && c.quant == 0) c.quant = 1;
        check(c, seed++);
      }
    }
  }
}

TEST(NormalizationCpuLegacy, TheBlockSize) {
  // The README block's LayerNorm(1024) over 1024 tokens, fp32, with and without an FP8 cast.
  const Case cases[] = {
      {true, 1024, 1024, kF32, kF32, kF32, true, false, 0, Values::kNormal},
      {true, 1024, 1024, kF32, kF32, kNone, true, false, 1, Values::kNormal},
  };
  uint32_t seed = 500;
  for (const Case& c : cases) check(c, seed++);
}
