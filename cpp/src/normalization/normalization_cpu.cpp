// CPU backend of the normalization family: the executable specification of
// fusible/normalization.h. Row statistics follow the reduction plan of normalization_math.h
// literally, so the CUDA backend can match them bit for bit.
//
// The quantized output (per tensor, MXFP8 or blockwise) is produced by the shared CPU cast that
// the quantize family runs too (cast_cpu, common/cast.h) applied to the rounded high-precision
// result, so "fused == unfused" holds here by construction; the CUDA backend is tested against
// this.
//
// Speed without changing a bit. Rows are independent and split over the CPU backend's threads.
// A row sum runs every lane of the plan at once: the row is transposed into xt[j][c] = x[8 c + j]
// (element j of chunk c), so that for the k-th chunk of every lane and its element j the lanes'
// values are contiguous, and lane t's accumulator still receives its elements in the plan's order
// (ascending k, then j); the loop over the lanes vectorises, the lane sums are then combined by
// norm_combine_lanes as before. The backward's dgamma / dbeta keep their plan too: each group of
// rows is one task, its teams summed in order as before, and the group sums are added in
// ascending group order at the end.
#include <algorithm>
#include <vector>

#include "common/cast.h"
#include "common/cpu_rows.h"
#include "common/cpu_runtime.h"
#include "common/hp_access.h"
#include "normalization/normalization_impl.h"
#include "normalization/normalization_math.h"

namespace fusible {
namespace {

// The row transposed for the lanes: xt[j * cp + c] = x[c * 8 + j] (0 past the row), c < cp,
// cp = lanes * chunks-per-lane.
struct LaneLayout {
  int64_t cols;
  int lanes;
  int64_t per_lane;  // chunks a lane owns
  int64_t cp;
  LaneLayout(int64_t cols_, int lanes_)
      : cols(cols_), lanes(lanes_), per_lane(norm_chunks_per_lane(cols_, lanes_)) {
    cp = per_lane * lanes;
  }
};

FUS_ALWAYS_INLINE void to_lanes(const LaneLayout& L, const float* x, float* xt) {
  const int64_t full = L.cols / kNormChunk;
  for (int64_t c = 0; c < full; ++c)
    for (int j = 0; j < kNormChunk; ++j) xt[j * L.cp + c] = x[c * kNormChunk + j];
  for (int64_t c = full; c < L.cp; ++c)
    for (int j = 0; j < kNormChunk; ++j) {
      const int64_t i = c * kNormChunk + j;
      xt[j * L.cp + c] = i < L.cols ? x[i] : 0.0f;
    }
}

// norm_row_sum with acc = step(acc, value): the lanes' accumulators in acc[0, lanes).
template <typename Step>
FUS_ALWAYS_INLINE float lane_sum(const LaneLayout& L, const float* xt, float* acc, Step step) {
  for (int t = 0; t < L.lanes; ++t) acc[t] = 0.0f;
  for (int64_t k = 0; k < L.per_lane; ++k) {
    for (int j = 0; j < kNormChunk; ++j) {
      const float* v = xt + j * L.cp + k * L.lanes;
      const int64_t i0 = k * L.lanes * kNormChunk + j;  // element of lane t: i0 + 8 t
      if (i0 + (L.lanes - 1) * kNormChunk < L.cols) {
        for (int t = 0; t < L.lanes; ++t) acc[t] = step(acc[t], v[t]);
      } else {
        for (int t = 0; t < L.lanes; ++t)
          acc[t] = i0 + t * kNormChunk < L.cols ? step(acc[t], v[t]) : acc[t];
      }
    }
  }
  return norm_combine_lanes(acc, L.lanes);
}

// norm_row_sum2 of the backward: s1 = sum(dyw x_hat) with fma, s2 = sum(dyw).
FUS_ALWAYS_INLINE void lane_sum2(const LaneLayout& L, const float* dywt, const float* xht,
                                 float* a1, float* a2, float* s1, float* s2) {
  for (int t = 0; t < L.lanes; ++t) a1[t] = a2[t] = 0.0f;
  for (int64_t k = 0; k < L.per_lane; ++k) {
    for (int j = 0; j < kNormChunk; ++j) {
      const float* d = dywt + j * L.cp + k * L.lanes;
      const float* h = xht + j * L.cp + k * L.lanes;
      const int64_t i0 = k * L.lanes * kNormChunk + j;
      if (i0 + (L.lanes - 1) * kNormChunk < L.cols) {
        for (int t = 0; t < L.lanes; ++t) {
          a1[t] = f_fma(d[t], h[t], a1[t]);
          a2[t] = f_add(a2[t], d[t]);
        }
      } else {
        for (int t = 0; t < L.lanes; ++t) {
          const bool valid = i0 + t * kNormChunk < L.cols;
          a1[t] = valid ? f_fma(d[t], h[t], a1[t]) : a1[t];
          a2[t] = valid ? f_add(a2[t], d[t]) : a2[t];
        }
      }
    }
  }
  *s1 = norm_combine_lanes(a1, L.lanes);
  *s2 = norm_combine_lanes(a2, L.lanes);
}

// Rows a task: at least ~32K elements.
int64_t min_rows(int64_t cols) {
  if (cpu_force_split()) return 1;
  return std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(cols, 1));
}

}  // namespace

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
  const LaneLayout L(cols, norm_fwd_lanes(cols));
  std::vector<float> w(cols), b(cols);
  for (int64_t c = 0; c < cols; ++c) {
    w[c] = norm_weight(load_hp(a.gamma.data, a.gamma.dtype, c), a.zero_centered);
    b[c] = a.beta ? load_hp(a.beta, a.beta_dtype, c) : 0.0f;
  }
  parallel_ranges(rows, min_rows(cols), [&](int64_t r0, int64_t r1) {
    std::vector<float> xr(cols), xt(kNormChunk * L.cp), y(std::min(cols, kCpuSeg));
    float acc[kNormMaxLanes];
    with_cpu_isa([&]() FUS_INLINE_LAMBDA {
      for (int64_t r = r0; r < r1; ++r) {
        load_run(a.x.dtype, a.x.data, r * cols, cols, xr.data());
        to_lanes(L, xr.data(), xt.data());
        float mean = 0.0f, rstd;
        if (a.layernorm) {
          mean = norm_mean(lane_sum(L, xt.data(), acc,
                                    [](float s, float x) FUS_INLINE_LAMBDA { return f_add(s, x); }),
                           cols);
          const float var = lane_sum(L, xt.data(), acc, [mean](float s, float x) FUS_INLINE_LAMBDA {
            const float d = f_sub(x, mean);
            return f_fma(d, d, s);
          });
          rstd = norm_rstd(var, cols, a.eps);
          a.mean[r] = mean;
        } else {
          rstd =
              norm_rstd(lane_sum(L, xt.data(), acc,
                                 [](float s, float x) FUS_INLINE_LAMBDA { return f_fma(x, x, s); }),
                        cols, a.eps);
        }
        a.rstd[r] = rstd;
        if (out == nullptr) continue;
        for (int64_t c0 = 0; c0 < cols; c0 += kCpuSeg) {
          const int64_t n = std::min(kCpuSeg, cols - c0);
          const float* xs = xr.data() + c0;
          const float* ws = w.data() + c0;
          const float* bs = b.data() + c0;
          if (a.layernorm) {
            for (int64_t j = 0; j < n; ++j)
              y[j] = norm_y(true, norm_xhat(true, xs[j], mean, rstd), ws[j], bs[j]);
          } else {
            for (int64_t j = 0; j < n; ++j)
              y[j] = norm_y(false, norm_xhat(false, xs[j], mean, rstd), ws[j], bs[j]);
          }
          store_run(out_dt, out, r * cols + c0, n, y.data());
        }
      }
    });
  });
  if (a.q != nullptr) cast_cpu(fus_tensor{out, out_dt, rows, cols}, *a.q);
}

void norm_backward_cpu(const NormBwdArgs& a) {
  const int64_t rows = a.dy.rows, cols = a.dy.cols;
  const LaneLayout L(cols, norm_bwd_lanes(cols));
  const NormColPlan plan = norm_bwd_col_plan(rows, cols);
  const bool ln = a.layernorm;
  std::vector<float> w(cols);
  for (int64_t c = 0; c < cols; ++c)
    w[c] = norm_weight(load_hp(a.gamma.data, a.gamma.dtype, c), a.zero_centered);
  // Group sums of dgamma and dbeta: [groups, cols] each.
  std::vector<float> part_g(static_cast<size_t>(plan.groups * cols)),
      part_b(static_cast<size_t>(plan.groups * cols));
  parallel_for(plan.groups, [&](int64_t g) {
    const int64_t r0 = g * plan.rows_per_group;
    const int64_t r1 = std::min(rows, r0 + plan.rows_per_group);
    std::vector<float> buf(static_cast<size_t>(6 * cols + 2 * kNormChunk * L.cp));
    float* dyv = buf.data();
    float* xh = dyv + cols;
    float* dyw = xh + cols;
    float* dx = dyw + cols;
    float* team_g = dx + cols;
    float* team_b = team_g + cols;
    float* dywt = team_b + cols;
    float* xht = dywt + kNormChunk * L.cp;
    float* group_g = part_g.data() + g * cols;
    float* group_b = part_b.data() + g * cols;
    float a1[kNormMaxLanes], a2[kNormMaxLanes];
    with_cpu_isa([&]() FUS_INLINE_LAMBDA {
      for (int64_t c = 0; c < cols; ++c) group_g[c] = group_b[c] = 0.0f;
      for (int t = 0; t < plan.teams; ++t) {
        for (int64_t c = 0; c < cols; ++c) team_g[c] = team_b[c] = 0.0f;
        for (int64_t r = r0 + t; r < r1; r += plan.teams) {
          const float mean = ln ? a.mean[r] : 0.0f, rstd = a.rstd[r];
          load_run(a.dy.dtype, a.dy.data, r * cols, cols, dyv);
          load_run(a.x.dtype, a.x.data, r * cols, cols, xh);
          if (ln) {
            for (int64_t c = 0; c < cols; ++c) xh[c] = norm_xhat(true, xh[c], mean, rstd);
          } else {
            for (int64_t c = 0; c < cols; ++c) xh[c] = norm_xhat(false, xh[c], mean, rstd);
          }
          for (int64_t c = 0; c < cols; ++c) dyw[c] = f_mul(dyv[c], w[c]);
          to_lanes(L, dyw, dywt);
          to_lanes(L, xh, xht);
          float s1, s2;
          lane_sum2(L, dywt, xht, a1, a2, &s1, &s2);
          const float m1 = norm_mean(s1, cols), m2 = norm_mean(s2, cols);
          if (ln) {
            for (int64_t c = 0; c < cols; ++c) dx[c] = norm_dx(true, dyw[c], xh[c], m1, m2, rstd);
          } else {
            for (int64_t c = 0; c < cols; ++c) dx[c] = norm_dx(false, dyw[c], xh[c], m1, m2, rstd);
          }
          store_run(a.dx.dtype, a.dx.data, r * cols, cols, dx);
          for (int64_t c = 0; c < cols; ++c) {
            team_g[c] = f_fma(dyv[c], xh[c], team_g[c]);
            team_b[c] = f_add(team_b[c], dyv[c]);
          }
        }
        for (int64_t c = 0; c < cols; ++c) {
          group_g[c] = f_add(group_g[c], team_g[c]);
          group_b[c] = f_add(group_b[c], team_b[c]);
        }
      }
    });
  });
  // The groups in ascending order, split by columns.
  std::vector<float> total_g(cols, 0.0f), total_b(cols, 0.0f);
  parallel_ranges(cols, cpu_force_split() ? 1 : 4096, [&](int64_t c0, int64_t c1) {
    with_cpu_isa([&]() FUS_INLINE_LAMBDA {
      for (int64_t g = 0; g < plan.groups; ++g) {
        const float* pg = part_g.data() + g * cols;
        const float* pb = part_b.data() + g * cols;
        for (int64_t c = c0; c < c1; ++c) {
          total_g[c] = f_add(total_g[c], pg[c]);
          total_b[c] = f_add(total_b[c], pb[c]);
        }
      }
    });
  });
  store_run(a.dgamma.dtype, a.dgamma.data, 0, cols, total_g.data());
  if (a.dbeta) store_run(a.dbeta->dtype, a.dbeta->data, 0, cols, total_b.data());
}

}  // namespace fusible
