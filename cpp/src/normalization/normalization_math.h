// The numerics of the normalization family (fusible/normalization.h), shared by the CPU and CUDA
// backends: the per-element formulas and the fixed reduction order ("plan"). The CPU backend
// evaluates the plan literally (row_sum below); the CUDA kernels are laid out so their reductions
// happen in exactly this order, which makes the two backends agree bit for bit.
#pragma once

#include <cstdint>

#include "common/fp32_ops.h"

namespace fusible {

// ---- plan
// -----------------------------------------------------------------------------------------

// A row is cut into chunks of kNormChunk consecutive elements (one 16-byte vector of 16-bit types).
constexpr int kNormChunk = 8;
// Largest team: 16 warps.
constexpr int kNormMaxLanes = 512;

FUS_HD int64_t norm_chunks(int64_t cols) { return (cols + kNormChunk - 1) / kNormChunk; }

// Lanes of the team that reduces one row: the smallest power of two L in [32, 512] such that no
// lane owns more than max_per_lane chunks, else 512.
FUS_HD int norm_lanes(int64_t cols, int64_t max_per_lane) {
  const int64_t chunks = norm_chunks(cols);
  int lanes = 32;
  while (lanes < kNormMaxLanes && (chunks + lanes - 1) / lanes > max_per_lane) lanes *= 2;
  return lanes;
}

// Forward: up to 4 chunks (32 elements) a lane, so H <= 16384 stays in registers.
FUS_HD int norm_fwd_lanes(int64_t cols) { return norm_lanes(cols, 4); }
// Backward: up to 2 chunks a lane (the dgamma / dbeta accumulators need registers too).
FUS_HD int norm_bwd_lanes(int64_t cols) { return norm_lanes(cols, 2); }

// Chunks a lane owns: ceil(chunks / lanes).
FUS_HD int64_t norm_chunks_per_lane(int64_t cols, int lanes) {
  return (norm_chunks(cols) + lanes - 1) / lanes;
}

// Column-sum plan of the backward (dgamma, dbeta): `groups` groups of `rows_per_group`
// consecutive rows (the last may be shorter); in a group, `teams` teams take rows round-robin
// (team t: rows g*P + t, g*P + t + teams, ...).
struct NormColPlan {
  int64_t groups;
  int64_t rows_per_group;
  int teams;
};

constexpr int64_t kNormMaxGroups = 256;

FUS_HD NormColPlan norm_bwd_col_plan(int64_t rows, int64_t cols) {
  const int lanes = norm_bwd_lanes(cols);
  const int teams = lanes >= 256 ? 1 : 256 / lanes;
  if (rows <= 0) return NormColPlan{0, 0, teams};
  int64_t groups = (rows + 8 * teams - 1) / (8 * teams);  // at least 8 rows a team
  if (groups > kNormMaxGroups) groups = kNormMaxGroups;
  if (groups < 1) groups = 1;
  const int64_t per = (rows + groups - 1) / groups;
  return NormColPlan{(rows + per - 1) / per, per, teams};
}

// ---- formulas
// -------------------------------------------------------------------------------------

FUS_HD float norm_weight(float gamma, bool zero_centered) {
  return zero_centered ? f_add(1.0f, gamma) : gamma;
}

// rstd = 1 / sqrt(sum / H + eps)
FUS_HD float norm_rstd(float sum_sq, int64_t cols, float eps) {
  return f_rcp(f_sqrt(f_add(f_div(sum_sq, static_cast<float>(cols)), eps)));
}

FUS_HD float norm_mean(float sum, int64_t cols) { return f_div(sum, static_cast<float>(cols)); }

// x_hat: (x - mean) * rstd (LayerNorm) or x * rstd (RMSNorm).
FUS_HD float norm_xhat(bool layernorm, float x, float mean, float rstd) {
  return layernorm ? f_mul(f_sub(x, mean), rstd) : f_mul(x, rstd);
}

// y = fma(x_hat, w, b) (LayerNorm; b = 0 without beta) or x_hat * w (RMSNorm).
FUS_HD float norm_y(bool layernorm, float xhat, float w, float b) {
  return layernorm ? f_fma(xhat, w, b) : f_mul(xhat, w);
}

// dx from dyw = dy * w, x_hat and the row means m1 = sum(dyw x_hat) / H, m2 = sum(dyw) / H.
FUS_HD float norm_dx(bool layernorm, float dyw, float xhat, float m1, float m2, float rstd) {
  return layernorm ? f_mul(f_sub(dyw, f_fma(xhat, m1, m2)), rstd)
                   : f_mul(f_fma(-xhat, m1, dyw), rstd);
}

// ---- the reduction order, literally (host)
// --------------------------------------------------------

// Combines the L lane sums in place as the CUDA team does: a halving tree within each group of 32
// (offsets 16, 8, 4, 2, 1: v[i] = v[i] + v[i + off] for i % 32 < off), then a halving tree over the
// L / 32 group sums. Returns the total.
inline float norm_combine_lanes(float* v, int lanes) {
  for (int w = 0; w < lanes; w += 32)
    for (int off = 16; off >= 1; off /= 2)
      for (int i = 0; i < off; ++i) v[w + i] = f_add(v[w + i], v[w + i + off]);
  const int groups = lanes / 32;
  float g[kNormMaxLanes / 32] = {};
  for (int i = 0; i < groups; ++i) g[i] = v[i * 32];
  for (int off = groups / 2; off >= 1; off /= 2)
    for (int i = 0; i < off; ++i) g[i] = f_add(g[i], g[i + off]);
  return g[0];
}

// Row sum in the plan's order: lane t owns chunks k*L + t; it folds its elements i (ascending k,
// then j) into its accumulator with acc = step(acc, i); the lane sums are then combined.
template <typename Step>
float norm_row_sum(int64_t cols, int lanes, Step&& step) {
  float acc[kNormMaxLanes];
  const int64_t chunks = norm_chunks(cols);
  for (int t = 0; t < lanes; ++t) {
    float a = 0.0f;
    for (int64_t c = t; c < chunks; c += lanes)
      for (int j = 0; j < kNormChunk; ++j) {
        const int64_t i = c * kNormChunk + j;
        if (i < cols) a = step(a, i);
      }
    acc[t] = a;
  }
  return norm_combine_lanes(acc, lanes);
}

// Two sums over the same elements at once (the backward's sum(dyw x_hat) and sum(dyw)).
template <typename Step>
void norm_row_sum2(int64_t cols, int lanes, Step&& step, float* s1, float* s2) {
  float a1[kNormMaxLanes], a2[kNormMaxLanes];
  const int64_t chunks = norm_chunks(cols);
  for (int t = 0; t < lanes; ++t) {
    float x1 = 0.0f, x2 = 0.0f;
    for (int64_t c = t; c < chunks; c += lanes)
      for (int j = 0; j < kNormChunk; ++j) {
        const int64_t i = c * kNormChunk + j;
        if (i < cols) step(&x1, &x2, i);
      }
    a1[t] = x1;
    a2[t] = x2;
  }
  *s1 = norm_combine_lanes(a1, lanes);
  *s2 = norm_combine_lanes(a2, lanes);
}

}  // namespace fusible
