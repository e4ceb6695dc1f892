// CPU backend of the normalization family: the executable specification of
// fusible/normalization.h. Row statistics follow the reduction plan of normalization_math.h
// literally, so the CUDA backend can match them bit for bit.
//
// The quantized output is produced by the quantize family's own CPU cast (quantize_cpu) applied to
// the rounded high-precision result, so "fused == unfused" holds here by construction; the CUDA
// backend is tested against this.
#include <algorithm>
#include <vector>

#include "common/hp_access.h"
#include "normalization/normalization_impl.h"
#include "normalization/normalization_math.h"
#include "quantize/quantize_impl.h"

namespace fusible {

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
  if (a.q != nullptr) quantize_cpu(fus_tensor{out, out_dt, rows, cols}, *a.q);
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

}  // namespace fusible
