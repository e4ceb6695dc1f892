// CUDA backend of the normalization family. Bit-identical to normalization_cpu.cpp: the kernels
// evaluate the formulas of normalization_math.h and reduce in the plan's order (a team of L lanes
// per row, lane t owning chunks k*L + t, warp butterflies then a halving tree over the warps; the
// backward's column sums per team, per group and over groups in order).
//
// Forward:
//  - norm_fwd_kernel: one team (L = 32..512 threads) per row, teams packed into blocks of at least
//    128 threads. The row is read once (16-byte vectors when aligned) and kept in registers for the
//    mean, variance and output passes (up to 4 chunks = 32 elements a lane, H <= 16384; beyond,
//    the passes re-read the row, which then comes from L1/L2). The output pass writes y, the
//    rowwise FP8 / MXFP8 / 1x128 blockwise copy (32-wide blocks = 4 adjacent lanes, 128-wide
//    blocks = 16 adjacent lanes, combined by shuffles), mean, rstd and the block's amax (one
//    atomicMax).
//  - norm_fwd_fast_kernel: the same for the common case (16-bit dtypes throughout, aligned, whole
//    chunks, no MXFP8) with those choices fixed at compile time; persistent over rows.
//  - a per-tensor transposed copy: the rowwise copy's bytes transposed (common/cast.h).
//  - norm_col_kernel, for an MXFP8 columnwise copy (or a transposed copy without a rowwise one):
//    32 x 64 tiles, recomputing y from x, mean and rstd (same formula, same bits) and writing
//    through the shared tile epilogue (common/fused_epilogue.cuh).
//  - norm_block_kernel, for a blockwise columnwise copy (1x128 blocks down the columns of y) or
//    128x128 tiles (both copies): one 128 x 128 tile a block, y recomputed from x, mean and rstd
//    and cast by the shared blockwise tile cast (common/block_cast.cuh).
// Backward:
//  - norm_bwd_kernel: one block per row group, `teams` teams per block; per row two team sums,
//    then dx; dgamma / dbeta accumulate per team in registers (fp32), are combined across the
//    block's teams in order through shared memory and written as the group's partial sums into
//    the workspace; colsum_finalize_kernel adds the groups in order.
//  - norm_bwd_fast_kernel: the same for 16-bit dtypes throughout, aligned, two or four whole
//    chunks a lane (H = 16384 is four), with dy and x kept as 16-bit vectors in registers and the
//    next row's loads in flight while the current row is finished.
#include "common/block_cast.cuh"
#include "common/cast.h"
#include "common/cuda_utils.h"
#include "common/fused_epilogue.cuh"
#include "normalization/normalization_impl.h"
#include "normalization/normalization_math.h"

namespace fusible {
namespace {

using fused::kFull;

// Sums of v[0..N) over the team of `lanes` lanes (this thread's team: threads
// [t * lanes, (t+1) * lanes) of the block), each in the plan's order: a butterfly within warps,
// then the warps' partials pairwise. N > 1 shares one pair of barriers; the bits are those of N
// separate sums. red: 16 N floats of shared memory. Every thread of the block must call it with
// the same lanes.
template <int N>
__device__ __forceinline__ void team_sums(float (&v)[N], int lanes, float* red) {
#pragma unroll
  for (int n = 0; n < N; ++n)
#pragma unroll
    for (int off = 16; off >= 1; off /= 2) v[n] = f_add(v[n], __shfl_xor_sync(kFull, v[n], off));
  if (lanes == 32) return;
  const int w = lanes / 32, first = (threadIdx.x / lanes) * w;
  __syncthreads();  // earlier readers of red are done
  if ((threadIdx.x & 31) == 0) {
#pragma unroll
    for (int n = 0; n < N; ++n) red[16 * n + threadIdx.x / 32] = v[n];
  }
  __syncthreads();
#pragma unroll
  for (int n = 0; n < N; ++n) {
    float g[16];
#pragma unroll
    for (int i = 0; i < 16; ++i) g[i] = i < w ? red[16 * n + first + i] : 0.0f;
#pragma unroll
    for (int off = 8; off >= 1; off /= 2) {
      if (off < w) {
#pragma unroll
        for (int i = 0; i < 8; ++i)
          if (i < off) g[i] = f_add(g[i], g[i + off]);
      }
    }
    v[n] = g[0];
  }
}

__device__ __forceinline__ float team_sum(float v, int lanes, float* red) {
  float a[1] = {v};
  team_sums(a, lanes, red);
  return a[0];
}

// LayerNorm's backward needs two independent sums a row, RMSNorm's one.
__device__ __forceinline__ void team_sum_bwd(bool ln, float& s1, float& s2, int lanes, float* red) {
  if (ln) {
    float a[2] = {s1, s2};
    team_sums(a, lanes, red);
    s1 = a[0], s2 = a[1];
  } else {
    s1 = team_sum(s1, lanes, red);
  }
}

__device__ __forceinline__ int chunk_len(int64_t cols, int64_t col) {
  return static_cast<int>(fused::imax(0, fused::imin(8, cols - col)));
}

// ---- forward, rowwise
// -----------------------------------------------------------------------------

// The forward's inputs, as every forward kernel reads them.
struct NormInputs {
  bool ln, zc;
  const void* x;
  fus_dtype x_dt;
  const void* gamma;
  fus_dtype g_dt;
  const void* beta;
  fus_dtype b_dt;
};

NormInputs inputs_of(const NormFwdArgs& a) {
  return NormInputs{a.layernorm,  a.zero_centered, a.x.data, a.x.dtype,
                    a.gamma.data, a.gamma.dtype,   a.beta,   a.beta_dtype};
}

struct NormFwdParams : NormInputs {
  float eps;
  int64_t rows, cols;
  int lanes;
  int64_t kmax;  // chunks a lane owns
  bool vec_x, vec_g, vec_b;
  void* y;
  fus_dtype y_dt;
  bool vec_y;
  fus_dtype round_dt;
  bool out;   // y or any quantized copy is wanted
  int qmode;  // 0 none, 1 per tensor, 2 MXFP8, 3 blockwise 1x128 (rowwise copy)
  bool e5m2;
  uint8_t* q_row;  // rowwise fp8 (per tensor, MXFP8 or blockwise)
  uint8_t* s_row;  // MXFP8 rowwise scales
  float* bs_row;   // blockwise rowwise scales [ceil(cols / 128), rows]
  float fp8_max, block_eps;
  bool block_pow2;
  const float* scale;
  float* scale_inv;
  bool vec_q;
  float* amax;
  float* mean;
  float* rstd;
};

template <int C>
__global__ void __launch_bounds__(512) norm_fwd_kernel(const NormFwdParams p) {
  __shared__ float red[16];
  const int L = p.lanes, team = threadIdx.x / L, lane = threadIdx.x % L;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * (blockDim.x / L) + team;
  const bool active = row < p.rows;
  const int64_t H = p.cols, base = row * H;
  const int64_t K = C > 0 ? C : p.kmax;
  float xv[C > 0 ? 8 * C : 1];

  auto col_of = [&](int64_t k) { return (k * L + lane) * 8; };
  // The k-th chunk of x (from registers when cached).
  auto get = [&](int64_t k, float (&v)[8], int& n) {
    const int64_t col = col_of(k);
    n = active ? chunk_len(H, col) : 0;
    if constexpr (C > 0) {
#pragma unroll
      for (int j = 0; j < 8; ++j) v[j] = xv[k * 8 + j];
    } else {
      fused::load8(p.x, p.x_dt, base + col, n, p.vec_x, v);
    }
  };

  float s = 0.0f;
#pragma unroll
  for (int64_t k = 0; k < K; ++k) {
    const int64_t col = col_of(k);
    const int n = active ? chunk_len(H, col) : 0;
    float v[8];
    fused::load8(p.x, p.x_dt, base + col, n, p.vec_x, v);
    if constexpr (C > 0) {
#pragma unroll
      for (int j = 0; j < 8; ++j) xv[k * 8 + j] = v[j];
    }
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (j < n) s = p.ln ? f_add(s, v[j]) : f_fma(v[j], v[j], s);
  }
  s = team_sum(s, L, red);
  float mean = 0.0f, rstd;
  if (p.ln) {
    mean = norm_mean(s, H);
    float s2 = 0.0f;
#pragma unroll
    for (int64_t k = 0; k < K; ++k) {
      float v[8];
      int n;
      get(k, v, n);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (j < n) {
          const float d = f_sub(v[j], mean);
          s2 = f_fma(d, d, s2);
        }
      }
    }
    rstd = norm_rstd(team_sum(s2, L, red), H, p.eps);
  } else {
    rstd = norm_rstd(s, H, p.eps);
  }
  if (active && lane == 0) {
    if (p.mean) p.mean[row] = mean;
    p.rstd[row] = rstd;
  }

  uint32_t am = 0;
  if (p.out) {
    const float scale = p.qmode == 1 ? *p.scale : 1.0f;
    const int64_t nb = (H + 31) / 32;
#pragma unroll
    for (int64_t k = 0; k < K; ++k) {
      float v[8], w[8], b[8], y[8];
      int n;
      get(k, v, n);
      const int64_t col = col_of(k);
      fused::load8(p.gamma, p.g_dt, col, n, p.vec_g, w);
      if (p.beta) fused::load8(p.beta, p.b_dt, col, n, p.vec_b, b);
      uint32_t m = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float xh = norm_xhat(p.ln, v[j], mean, rstd);
        y[j] =
            round_hp(p.round_dt, norm_y(p.ln, xh, norm_weight(w[j], p.zc), p.beta ? b[j] : 0.0f));
        if (j < n) m = max(m, abs_bits(y[j]));
      }
      am = max(am, m);
      if (p.y && n > 0) fused::store8(p.y, p.y_dt, base + col, n, p.vec_y, y);
      if (p.q_row) {
        float mult = scale;
        uint8_t e = 0;
        if (p.qmode == 2) {
          m = max(m, __shfl_xor_sync(kFull, m, 1));
          m = max(m, __shfl_xor_sync(kFull, m, 2));
          e = fused::e8m0_for(p.e5m2, m);
          mult = e8m0_inverse(e);
        } else if (p.qmode == 3) {
          // A 128-wide block is 16 consecutive lanes of one team (chunk k * L + lane, L % 32 == 0).
#pragma unroll
          for (int off = 1; off < 16; off <<= 1) m = max(m, __shfl_xor_sync(kFull, m, off));
          mult = block_scale(bits_as_float(m), p.fp8_max, p.block_eps, p.block_pow2);
          if (lane % 16 == 0 && n > 0) p.bs_row[(col / FUS_FP8_BLOCK) * p.rows + row] = 1.0f / mult;
        }
        if (n > 0)
          fused::store_words8(p.q_row + base + col, n, p.vec_q, fused::cast8(p.e5m2, y, mult));
        if (p.qmode == 2 && lane % 4 == 0 && n > 0) p.s_row[row * nb + col / 32] = e;
      }
    }
  }
  if (p.amax) fused::block_amax(am, p.amax);
  if (p.scale_inv && blockIdx.x == 0 && threadIdx.x == 0) *p.scale_inv = f_div(1.0f, *p.scale);
}

// ---- forward, rowwise: the fast path
// --------------------------------------------------------------

// norm_fwd_kernel's common case with the dtypes and output kind fixed at compile time: x, gamma,
// beta and y all of the 16-bit type T, 16-byte aligned, every lane owning exactly C whole chunks,
// no quantized output or a per-tensor FP8 one with its rowwise copy (kQ). Same plan, same formulas,
// same bits. Persistent: a team walks rows with a grid stride, loading the next row's x while it
// reduces and writes the current one; gamma and beta are re-read per row through L1 (registers are
// what limits occupancy).
template <typename T, int C, bool kLn, bool kQ, Fp8Format F>
__global__ void __launch_bounds__(512) norm_fwd_fast_kernel(const NormFwdParams p) {
  static_assert(sizeof(T) == 2, "16-bit rows");
  __shared__ float red[16];
  const int L = p.lanes, teams = blockDim.x / L, team = threadIdx.x / L, lane = threadIdx.x % L;
  const int64_t H = p.cols;
  const bool has_beta = p.beta != nullptr;
  const float scale = kQ ? *p.scale : 1.0f;
  const int64_t step = static_cast<int64_t>(gridDim.x) * teams;
  auto load_row = [&](int64_t row, uint4(&xr)[C]) {
    if (row >= p.rows) return;
    const T* src = static_cast<const T*>(p.x) + row * H + lane * 8;
#pragma unroll
    for (int k = 0; k < C; ++k) xr[k] = __ldcs(reinterpret_cast<const uint4*>(src + k * L * 8));
  };

  uint32_t am16 = 0;  // packed 16-bit magnitudes (fused::amax16_update)
  uint4 x[C];
  int64_t row = static_cast<int64_t>(blockIdx.x) * teams + team;
  load_row(row, x);
  // The output pass, with zero-centred gamma and beta fixed at compile time.
  auto emit = [&](auto zc, auto with_beta, float mean, float rstd) {
    constexpr bool kZc = decltype(zc)::value, kBeta = decltype(with_beta)::value;
#pragma unroll
    for (int k = 0; k < C; ++k) {
      const int64_t col = (static_cast<int64_t>(k) * L + lane) * 8, at = row * H + col;
      const uint4 gk = __ldg(reinterpret_cast<const uint4*>(static_cast<const T*>(p.gamma) + col));
      uint4 bk = make_uint4(0, 0, 0, 0);
      if constexpr (kBeta)
        bk = __ldg(reinterpret_cast<const uint4*>(static_cast<const T*>(p.beta) + col));
      float y[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float xh = norm_xhat(kLn, fused::elem8<T>(x[k], j), mean, rstd);
        y[j] = norm_y(kLn, xh, norm_weight(fused::elem8<T>(gk, j), kZc),
                      kBeta ? fused::elem8<T>(bk, j) : 0.0f);
      }
      const uint4 packed = fused::round_pack8<T>(y);
      am16 = fused::amax16_update(am16, packed);
      if (p.y) *reinterpret_cast<uint4*>(static_cast<T*>(p.y) + at) = packed;
      if constexpr (kQ) {
        const float y0[4] = {y[0], y[1], y[2], y[3]}, y1[4] = {y[4], y[5], y[6], y[7]};
        *reinterpret_cast<uint2*>(p.q_row + at) =
            make_uint2(scaled_fp8x4<F>(y0, scale), scaled_fp8x4<F>(y1, scale));
      }
    }
  };
  // Every team of the block takes the same number of steps (team_sum synchronises the block).
  for (int64_t first = static_cast<int64_t>(blockIdx.x) * teams; first < p.rows;
       first += step, row += step) {
    uint4 xn[C];
    load_row(row + step, xn);
    const bool active = row < p.rows;
    float s = 0.0f;
#pragma unroll
    for (int k = 0; k < C; ++k)
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float v = fused::elem8<T>(x[k], j);
        s = kLn ? f_add(s, v) : f_fma(v, v, s);
      }
    s = team_sum(s, L, red);
    float mean = 0.0f, rstd;
    if constexpr (kLn) {
      mean = norm_mean(s, H);
      float s2 = 0.0f;
#pragma unroll
      for (int k = 0; k < C; ++k)
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float d = f_sub(fused::elem8<T>(x[k], j), mean);
          s2 = f_fma(d, d, s2);
        }
      rstd = norm_rstd(team_sum(s2, L, red), H, p.eps);
    } else {
      rstd = norm_rstd(s, H, p.eps);
    }
    if (active) {
      if (lane == 0) {
        if (p.mean) p.mean[row] = mean;
        p.rstd[row] = rstd;
      }
      using Yes = std::true_type;
      using No = std::false_type;
      if (p.zc) {
        if (has_beta)
          emit(Yes{}, Yes{}, mean, rstd);
        else
          emit(Yes{}, No{}, mean, rstd);
      } else {
        if (has_beta)
          emit(No{}, Yes{}, mean, rstd);
        else
          emit(No{}, No{}, mean, rstd);
      }
    }
#pragma unroll
    for (int k = 0; k < C; ++k) x[k] = xn[k];
  }
  const uint32_t am = fused::amax16_bits<T>(am16);
  if (p.amax) fused::block_amax(am, p.amax);
  if (p.scale_inv && blockIdx.x == 0 && threadIdx.x == 0) *p.scale_inv = f_div(1.0f, *p.scale);
}

// ---- forward, columnwise copies
// -------------------------------------------------------------------

// What the kernels that recompute y from x and the row statistics read (after the rowwise
// kernel): norm_col_kernel and norm_block_kernel.
struct NormSource : NormInputs {
  const float* mean;
  const float* rstd;
};

NormSource source_of(const NormFwdArgs& a) { return NormSource{inputs_of(a), a.mean, a.rstd}; }

struct NormColParams : NormSource {
  bool vec_x;
  int64_t rows, cols;
  int64_t rows_per_block;
  fused::EpilogueOut out;
};

__global__ void __launch_bounds__(fused::kTileThreads) norm_col_kernel(const NormColParams p) {
  __shared__ fused::EpilogueSmem sm;
  const int tid = threadIdx.x, tx = tid % 8, ty = tid / 8;
  const int64_t H = p.cols;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * fused::kTileCols, c = c0 + 8 * tx;
  const int nc = chunk_len(H, c);
  const int strip_cols = static_cast<int>(fused::imin(fused::kTileCols, H - c0));
  float w[8], b[8];
  fused::load8(p.gamma, p.g_dt, c, nc, false, w);
  fused::load8(p.beta ? p.beta : p.gamma, p.beta ? p.b_dt : p.g_dt, c, p.beta ? nc : 0, false, b);
#pragma unroll
  for (int j = 0; j < 8; ++j) w[j] = norm_weight(w[j], p.zc);
  fused::EpilogueAcc acc;
  const int64_t rbeg = static_cast<int64_t>(blockIdx.y) * p.rows_per_block;
  const int64_t rend = fused::imin(p.rows, rbeg + p.rows_per_block);
  for (int64_t r0 = rbeg; r0 < rend; r0 += fused::kTileRows) {
    const int64_t r = r0 + ty;
    const int n = r < p.rows ? nc : 0;
    float v[8];
    fused::load8(p.x, p.x_dt, r * H + c, n, p.vec_x, v);
    const float mean = n > 0 && p.ln ? p.mean[r] : 0.0f, rstd = n > 0 ? p.rstd[r] : 0.0f;
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = norm_y(p.ln, norm_xhat(p.ln, v[j], mean, rstd), w[j], b[j]);
    fused::emit_tile(p.out, sm, acc, r0, c0, strip_cols, v, n);
  }
}

// ---- forward, blockwise tiles
// ---------------------------------------------------------------------

struct NormBlockParams : NormSource {
  fus_dtype round_dt;
  block_cast::Out out;  // [rows, cols] = x's shape
};

// One 128 x 128 tile of y a block: y recomputed as norm_fwd_kernel computes it (same formula,
// same rounding, same bits), then the shared blockwise tile cast (fp32 chunks of the rounded y).
template <Fp8Format F, bool kTwoD>
__global__ void __launch_bounds__(block_cast::kThreads) norm_block_kernel(const NormBlockParams p) {
  __shared__ block_cast::Smem sm;
  const block_cast::Out& o = p.out;
  const int64_t tr = blockIdx.x / o.nbc, tc = blockIdx.x % o.nbc, H = o.cols;
  const int64_t r0 = tr * block_cast::kTile, c0 = tc * block_cast::kTile;
  const int64_t ct = c0 + block_cast::col0<float>();  // the thread's 4 columns
  float w[4], b[4];
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int64_t c = ct + e;
    w[e] = c < H ? norm_weight(load_hp(p.gamma, p.g_dt, c), p.zc) : 0.0f;
    b[e] = c < H && p.beta ? load_hp(p.beta, p.b_dt, c) : 0.0f;
  }
  block_cast::Chunks<float> raw;
  block_cast::compute_chunks(
      [&](int64_t r, int64_t c, int n, float (&v)[4]) {
        const float mean = p.ln ? p.mean[r] : 0.0f, rstd = p.rstd[r];
#pragma unroll
        for (int e = 0; e < 4; ++e)
          if (e < n)
            v[e] = round_hp(
                p.round_dt,
                norm_y(p.ln, norm_xhat(p.ln, load_hp(p.x, p.x_dt, r * H + c + e), mean, rstd), w[e],
                       b[e]));
      },
      o.rows, H, r0, c0, raw);
  block_cast::cast_tile<float, F>(o, sm, raw, tr, tc, kTwoD, false);
}

// ---- backward
// -------------------------------------------------------------------------------------

struct NormBwdParams {
  bool ln, zc;
  const void* dy;
  fus_dtype dy_dt;
  const void* x;
  fus_dtype x_dt;
  const float* mean;
  const float* rstd;
  const void* gamma;
  fus_dtype g_dt;
  void* dx;
  fus_dtype dx_dt;
  bool vec_dy, vec_x, vec_g, vec_dx;
  int64_t rows, cols;
  int lanes, teams;
  int64_t rows_per_group;
  int64_t kmax;
  float* pg;  // [groups, cols] dgamma partials
  float* pb;  // [groups, cols] dbeta partials, or null
};

// Writes a block's dgamma / dbeta partial sums (C chunks a lane in dg / db) as its group's row
// of the workspace: group result = 0 + team 0 + team 1 + ... (in order).
template <int C>
__device__ __forceinline__ void write_group_partials(const NormBwdParams& p,
                                                     const float (&dg)[8 * C],
                                                     const float (&db)[8 * C], int team, int lane,
                                                     float* pg, float* pb, float* team_part) {
  const int L = p.lanes, T = p.teams;
  const int64_t H = p.cols;
  // One team: its sums are the group's. Several: staged in shared memory, added in team order.
  float* sg = team_part;
  float* sb = team_part + static_cast<int64_t>(T) * H;
#pragma unroll
  for (int k = 0; k < C; ++k) {
    const int64_t col = (static_cast<int64_t>(k) * L + lane) * 8;
    const int nn = chunk_len(H, col);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (j >= nn) continue;
      if (T == 1) {
        pg[col + j] = f_add(0.0f, dg[k * 8 + j]);
        if (pb) pb[col + j] = f_add(0.0f, db[k * 8 + j]);
      } else {
        sg[team * H + col + j] = dg[k * 8 + j];
        sb[team * H + col + j] = db[k * 8 + j];
      }
    }
  }
  if (T == 1) return;
  __syncthreads();
  for (int64_t c = threadIdx.x; c < H; c += blockDim.x) {
    float ag = 0.0f, ab = 0.0f;
    for (int t = 0; t < T; ++t) {
      ag = f_add(ag, sg[t * H + c]);
      ab = f_add(ab, sb[t * H + c]);
    }
    pg[c] = ag;
    if (pb) pb[c] = ab;
  }
}

// C: chunks a lane owns (1, 2 or 4, accumulators in registers; 0: any number, accumulators in the
// workspace, one team per block). kCache: keep dy and x in registers between the two passes.
template <int C, bool kCache>
__global__ void __launch_bounds__(512) norm_bwd_kernel(const NormBwdParams p) {
  extern __shared__ float team_part[];  // teams > 1: [teams][cols] dgamma, then dbeta
  __shared__ float red[32];             // team_sum_bwd: two sums
  const int L = p.lanes, T = p.teams, team = threadIdx.x / L, lane = threadIdx.x % L;
  const int64_t H = p.cols, g = blockIdx.x;
  const int64_t rbeg = g * p.rows_per_group, rend = fused::imin(p.rows, rbeg + p.rows_per_group);
  const int64_t iters = (rend - rbeg + T - 1) / T;
  const int64_t K = C > 0 ? C : p.kmax;
  constexpr int R = C > 0 ? 8 * C : 1;
  constexpr int RC = kCache ? R : 1;
  // w is kept in registers with dy and x; the uncached variant (4 chunks a lane) re-reads gamma,
  // which stays in L1, to stay within 128 registers at 512 threads.
  float wv[RC], dg[R], db[R], xc[RC], dyc[RC];
  auto col_of = [&](int64_t k) { return (k * L + lane) * 8; };
  float* pg = p.pg + g * H;
  float* pb = p.pb ? p.pb + g * H : nullptr;

  if constexpr (C > 0) {
#pragma unroll
    for (int k = 0; k < C; ++k) {
      if constexpr (kCache) {
        float w[8];
        fused::load8(p.gamma, p.g_dt, col_of(k), chunk_len(H, col_of(k)), p.vec_g, w);
#pragma unroll
        for (int j = 0; j < 8; ++j) wv[k * 8 + j] = norm_weight(w[j], p.zc);
      }
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        dg[k * 8 + j] = 0.0f;
        db[k * 8 + j] = 0.0f;
      }
    }
  } else {
    for (int64_t k = 0; k < K; ++k) {
      const int64_t col = col_of(k);
      for (int j = 0; j < chunk_len(H, col); ++j) {
        pg[col + j] = 0.0f;
        if (pb) pb[col + j] = 0.0f;
      }
    }
  }

  for (int64_t it = 0; it < iters; ++it) {
    const int64_t row = rbeg + team + it * T;
    const bool active = row < rend;
    const int64_t base = row * H;
    const float mean = active && p.ln ? p.mean[row] : 0.0f, rstd = active ? p.rstd[row] : 0.0f;
    // Loads chunk k of dy, x and w.
    auto get = [&](int64_t k, float (&d)[8], float (&x)[8], float (&w)[8], int& n, bool first) {
      const int64_t col = col_of(k);
      n = active ? chunk_len(H, col) : 0;
      if (kCache && !first) {
#pragma unroll
        for (int j = 0; j < 8; ++j) d[j] = dyc[k * 8 + j], x[j] = xc[k * 8 + j];
      } else {
        fused::load8(p.dy, p.dy_dt, base + col, n, p.vec_dy, d);
        fused::load8(p.x, p.x_dt, base + col, n, p.vec_x, x);
        if (kCache) {
#pragma unroll
          for (int j = 0; j < 8; ++j) dyc[k * 8 + j] = d[j], xc[k * 8 + j] = x[j];
        }
      }
      if constexpr (kCache) {
#pragma unroll
        for (int j = 0; j < 8; ++j) w[j] = wv[k * 8 + j];
      } else {
        fused::load8(p.gamma, p.g_dt, col, n, p.vec_g, w);
#pragma unroll
        for (int j = 0; j < 8; ++j) w[j] = norm_weight(w[j], p.zc);
      }
    };

    float s1 = 0.0f, s2 = 0.0f;
#pragma unroll
    for (int64_t k = 0; k < K; ++k) {
      float d[8], x[8], w[8];
      int n;
      get(k, d, x, w, n, true);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if (j < n) {
          const float xh = norm_xhat(p.ln, x[j], mean, rstd), dyw = f_mul(d[j], w[j]);
          s1 = f_fma(dyw, xh, s1);
          s2 = f_add(s2, dyw);
        }
      }
    }
    team_sum_bwd(p.ln, s1, s2, L, red);
    const float m1 = norm_mean(s1, H), m2 = p.ln ? norm_mean(s2, H) : 0.0f;

#pragma unroll
    for (int64_t k = 0; k < K; ++k) {
      float d[8], x[8], w[8], out[8];
      int n;
      get(k, d, x, w, n, false);
      const int64_t col = col_of(k);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const float xh = norm_xhat(p.ln, x[j], mean, rstd);
        out[j] = norm_dx(p.ln, f_mul(d[j], w[j]), xh, m1, m2, rstd);
        if (j < n) {
          if constexpr (C > 0) {
            dg[k * 8 + j] = f_fma(d[j], xh, dg[k * 8 + j]);
            db[k * 8 + j] = f_add(db[k * 8 + j], d[j]);
          } else {
            pg[col + j] = f_fma(d[j], xh, pg[col + j]);
            if (pb) pb[col + j] = f_add(pb[col + j], d[j]);
          }
        }
      }
      if (n > 0) fused::store8(p.dx, p.dx_dt, base + col, n, p.vec_dx, out);
    }
  }

  // Group result = 0 + team 0 + team 1 + ... (in order).
  if constexpr (C == 0) {
    for (int64_t k = 0; k < K; ++k) {
      const int64_t col = col_of(k);
      for (int j = 0; j < chunk_len(H, col); ++j) {
        pg[col + j] = f_add(0.0f, pg[col + j]);
        if (pb) pb[col + j] = f_add(0.0f, pb[col + j]);
      }
    }
  } else {
    write_group_partials<C>(p, dg, db, team, lane, pg, pb, team_part);
  }
}

// norm_bwd_kernel's common case: dy, x, gamma and dx all of the 16-bit type T, 16-byte aligned,
// every lane owning exactly C (2 or 4) whole chunks. Same plan and bits; dy and x stay in registers
// as 16-bit vectors between the two passes, and the next row's loads are issued before the current
// row is done (the generic kernel waits for each row's loads). C = 2 keeps gamma in registers and
// loads the next row into a second buffer while it reduces and writes the current one. C = 4 (512
// lanes) cannot: with 32 registers of dy / x and 64 accumulators, that buffer and gamma would
// exceed the 128 registers a thread has at 512 threads. It re-reads gamma (from L1) and loads the
// next row's chunk k into chunk k's registers as soon as the dx pass is done with them.
template <typename T, int C, bool kLn>
__global__ void __launch_bounds__(512) norm_bwd_fast_kernel(const NormBwdParams p) {
  static_assert(C == 2 || C == 4, "chunks a lane");
  constexpr bool kSpare = C == 2;       // registers for gamma and a second row
  extern __shared__ float team_part[];  // teams > 1: [teams][cols] dgamma, then dbeta
  __shared__ float red[32];             // team_sum_bwd: two sums
  // Four chunks a lane means 512 lanes (fewer own at most two) and one team: fixed at compile
  // time, the chunks' offsets become immediates (registers are short at C = 4).
  const int L = C == 4 ? kNormMaxLanes : p.lanes, T_ = C == 4 ? 1 : p.teams;
  const int team = C == 4 ? 0 : threadIdx.x / L, lane = threadIdx.x % L;
  const int64_t H = p.cols, g = blockIdx.x;
  const int64_t rbeg = g * p.rows_per_group, rend = fused::imin(p.rows, rbeg + p.rows_per_group);
  const int64_t iters = (rend - rbeg + T_ - 1) / T_;
  auto col_of = [&](int k) { return (static_cast<int64_t>(k) * L + lane) * 8; };
  auto gamma = [&](int k) {
    return __ldg(reinterpret_cast<const uint4*>(static_cast<const T*>(p.gamma) + col_of(k)));
  };
  uint4 w[C];
  float dg[8 * C], db[8 * C];
#pragma unroll
  for (int k = 0; k < C; ++k) {
    if constexpr (kSpare) w[k] = gamma(k);
#pragma unroll
    for (int j = 0; j < 8; ++j) dg[k * 8 + j] = db[k * 8 + j] = 0.0f;
  }
  auto weight = [&](int k) {
    if constexpr (kSpare)
      return w[k];
    else
      return gamma(k);
  };
  // Chunk k of dy and x of the given row (none past the group's rows).
  auto load = [&](int64_t row, int k, uint4& dk, uint4& xk) {
    if (row >= rend) return;
    const int64_t at = row * H + col_of(k);
    dk = __ldcs(reinterpret_cast<const uint4*>(static_cast<const T*>(p.dy) + at));
    xk = __ldcs(reinterpret_cast<const uint4*>(static_cast<const T*>(p.x) + at));
  };
  uint4 d[C], x[C];
#pragma unroll
  for (int k = 0; k < C; ++k) load(rbeg + team, k, d[k], x[k]);
  for (int64_t it = 0; it < iters; ++it) {
    const int64_t row = rbeg + team + it * T_;
    const bool active = row < rend;
    uint4 dn[C], xn[C];
    if constexpr (kSpare) {
#pragma unroll
      for (int k = 0; k < C; ++k) load(row + T_, k, dn[k], xn[k]);
    }
    const float mean = active && kLn ? p.mean[row] : 0.0f, rstd = active ? p.rstd[row] : 0.0f;
    float s1 = 0.0f, s2 = 0.0f;
    if (active) {
#pragma unroll
      for (int k = 0; k < C; ++k) {
        const uint4 wk = weight(k);
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float xh = norm_xhat(kLn, fused::elem8<T>(x[k], j), mean, rstd);
          const float dyw =
              f_mul(fused::elem8<T>(d[k], j), norm_weight(fused::elem8<T>(wk, j), p.zc));
          s1 = f_fma(dyw, xh, s1);
          s2 = f_add(s2, dyw);
        }
      }
    }
    team_sum_bwd(kLn, s1, s2, L, red);
    const float m1 = norm_mean(s1, H), m2 = kLn ? norm_mean(s2, H) : 0.0f;
    if (active) {
#pragma unroll
      for (int k = 0; k < C; ++k) {
        const uint4 wk = weight(k);
        float out[8];
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const float dj = fused::elem8<T>(d[k], j),
                      xh = norm_xhat(kLn, fused::elem8<T>(x[k], j), mean, rstd);
          const float dyw = f_mul(dj, norm_weight(fused::elem8<T>(wk, j), p.zc));
          out[j] = norm_dx(kLn, dyw, xh, m1, m2, rstd);
          dg[k * 8 + j] = f_fma(dj, xh, dg[k * 8 + j]);
          db[k * 8 + j] = f_add(db[k * 8 + j], dj);
        }
        *reinterpret_cast<uint4*>(static_cast<T*>(p.dx) + row * H + col_of(k)) =
            fused::round_pack8<T>(out);
        if constexpr (!kSpare) load(row + T_, k, d[k], x[k]);
      }
    }
    if constexpr (kSpare) {
#pragma unroll
      for (int k = 0; k < C; ++k) d[k] = dn[k], x[k] = xn[k];
    }
  }
  write_group_partials<C>(p, dg, db, team, lane, p.pg + g * H, p.pb ? p.pb + g * H : nullptr,
                          team_part);
}

bool aligned(const void* p, size_t bytes) { return p == nullptr || is_aligned(p, bytes); }

template <typename T, bool kLn, bool kQ, Fp8Format F>
void launch_fast(const NormFwdParams& p, int64_t blocks, int threads, cudaStream_t stream) {
  const auto kernel = norm_fwd_fast_kernel<T, 4, kLn, kQ, F>;
  kernel<<<persistent_blocks(kernel, threads, blocks), threads, 0, stream>>>(p);
  FUS_CUDA_CHECK_LAUNCH("norm_fwd_fast_kernel");
}

// norm_fwd_fast_kernel for the 16-bit dtype dt (C = 4 chunks a lane).
void launch_norm_fwd_fast(const NormFwdParams& p, fus_dtype dt, int64_t blocks, int threads,
                          cudaStream_t stream) {
  auto by_out = [&](auto t, auto ln) {
    using T = decltype(t);
    constexpr bool kLn = decltype(ln)::value;
    if (p.qmode == 0)
      launch_fast<T, kLn, false, Fp8Format::kE4M3>(p, blocks, threads, stream);
    else if (p.e5m2)
      launch_fast<T, kLn, true, Fp8Format::kE5M2>(p, blocks, threads, stream);
    else
      launch_fast<T, kLn, true, Fp8Format::kE4M3>(p, blocks, threads, stream);
  };
  auto by_kind = [&](auto t) {
    if (p.ln)
      by_out(t, std::true_type{});
    else
      by_out(t, std::false_type{});
  };
  if (dt == FUS_BFLOAT16)
    by_kind(Bf16{});
  else
    by_kind(Half{});
}

// The columnwise copy of a quantized forward output, after the rowwise kernel.
void finish_norm_forward(const NormFwdArgs& a, const NormFwdParams& p, const fus_quantized* q,
                         bool per_tensor, const fus_context& ctx) {
  const cudaStream_t stream = stream_of(ctx);
  const int64_t rows = a.x.rows, H = a.x.cols;
  const bool vec = H % 8 == 0;
  const bool blockwise = q && (q->mode == FUS_SCALING_BLOCK_1D || q->mode == FUS_SCALING_BLOCK_2D);
  if (blockwise) {
    // The copies the rowwise kernel did not write: 1D the columnwise one, 2D both.
    fus_quantized rest = *q;
    if (q->mode == FUS_SCALING_BLOCK_1D) rest.rowwise_data = rest.rowwise_scale_inv = nullptr;
    if (!rest.rowwise_data && !rest.columnwise_data) return;
    const NormBlockParams c{source_of(a), a.round_dtype, block_cast::make_out<float>(rest)};
    const auto tiles = static_cast<unsigned>(c.out.nbr * c.out.nbc);
    dispatch_fp8(q->dtype, [&](auto f) {
      constexpr Fp8Format F = decltype(f)::value;
      const auto kernel = c.out.two_d ? norm_block_kernel<F, true> : norm_block_kernel<F, false>;
      kernel<<<tiles, block_cast::kThreads, 0, stream>>>(c);
      FUS_CUDA_CHECK_LAUNCH("norm_block_kernel");
    });
  } else if (q && q->columnwise_data && per_tensor && q->rowwise_data) {
    // Per tensor, the transposed copy is the rowwise one's bytes transposed (same scale): a byte
    // transpose moves half the bytes norm_col_kernel would and does no arithmetic.
    transpose_fp8_cuda(fus_tensor{q->rowwise_data, q->dtype, rows, H},
                       fus_tensor{q->columnwise_data, q->dtype, H, rows}, ctx);
  } else if (q && q->columnwise_data) {
    NormColParams c{};
    static_cast<NormSource&>(c) = source_of(a);
    c.vec_x = p.vec_x;
    c.rows = rows;
    c.cols = H;
    const int64_t tiles = (rows + fused::kTileRows - 1) / fused::kTileRows;
    c.rows_per_block = fused::kTileRows * ((tiles + 65534) / 65535);
    fused::EpilogueOut& o = c.out;
    o.hp = nullptr;
    o.hp_dtype = a.round_dtype;
    o.round_dtype = a.round_dtype;
    o.qmode = p.qmode;
    o.e5m2 = p.e5m2;
    o.q_col = static_cast<uint8_t*>(q->columnwise_data);
    o.s_col = per_tensor ? nullptr : static_cast<uint8_t*>(q->columnwise_scale_inv);
    o.scale = p.scale;
    o.vec_q_row = vec && aligned(o.q_col, 8);
    o.vec_q_t = per_tensor && rows % 8 == 0 && aligned(o.q_col, 8);
    o.rows = rows;
    o.out_cols = H;
    const dim3 grid(static_cast<unsigned>((H + fused::kTileCols - 1) / fused::kTileCols),
                    static_cast<unsigned>((rows + c.rows_per_block - 1) / c.rows_per_block));
    norm_col_kernel<<<grid, fused::kTileThreads, 0, stream>>>(c);
    FUS_CUDA_CHECK_LAUNCH("norm_col_kernel");
  }
}

}  // namespace

void norm_forward_cuda(const NormFwdArgs& a, const fus_context& ctx) {
  CudaDeviceGuard guard(ctx.device_index);
  cudaStream_t stream = stream_of(ctx);
  const int64_t rows = a.x.rows, H = a.x.cols;
  const fus_quantized* q = a.q;
  const bool per_tensor = q && q->mode == FUS_SCALING_PER_TENSOR;
  const bool block1d = q && q->mode == FUS_SCALING_BLOCK_1D;
  const bool block2d = q && q->mode == FUS_SCALING_BLOCK_2D;
  float* scale_inv = per_tensor ? static_cast<float*>(q->rowwise_scale_inv) : nullptr;
  float* amax = q ? q->amax : nullptr;
  fused::begin_cast(q, rows == 0, stream);
  if (rows == 0) return;

  NormFwdParams p{};
  static_cast<NormInputs&>(p) = inputs_of(a);
  p.eps = a.eps;
  p.rows = rows;
  p.cols = H;
  p.lanes = norm_fwd_lanes(H);
  p.kmax = norm_chunks_per_lane(H, p.lanes);
  const bool vec = H % 8 == 0;
  p.vec_x = vec && aligned(a.x.data, 16);
  p.vec_g = vec && aligned(a.gamma.data, 16);
  p.vec_b = vec && aligned(a.beta, 16);
  p.y = a.y ? a.y->data : nullptr;
  p.y_dt = a.y ? a.y->dtype : a.round_dtype;
  p.vec_y = vec && aligned(p.y, 16);
  p.round_dt = a.round_dtype;
  p.out = a.y != nullptr || q != nullptr;
  // 128x128 tiles need whole tiles of y: the rowwise kernel writes no copy then (norm_block_kernel
  // writes both, finish_norm_forward).
  p.qmode = !q ? 0 : per_tensor ? 1 : block1d ? 3 : block2d ? 0 : 2;
  p.e5m2 = q && q->dtype == FUS_FLOAT8_E5M2;
  p.q_row = q && !block2d ? static_cast<uint8_t*>(q->rowwise_data) : nullptr;
  p.s_row = q && p.qmode == 2 ? static_cast<uint8_t*>(q->rowwise_scale_inv) : nullptr;
  p.bs_row = block1d ? static_cast<float*>(q->rowwise_scale_inv) : nullptr;
  p.fp8_max = q ? fus_fp8_max(q->dtype) : 0.0f;
  p.block_eps = q ? q->amax_epsilon : 0.0f;
  p.block_pow2 = q && q->power_2_scale != 0;
  p.scale = per_tensor ? q->scale : nullptr;
  p.scale_inv = scale_inv;
  p.vec_q = vec && aligned(p.q_row, 8);
  p.amax = amax;
  p.mean = a.mean;
  p.rstd = a.rstd;

  const int threads = p.lanes < 128 ? 128 : p.lanes;
  const int64_t teams = threads / p.lanes;
  const unsigned blocks = static_cast<unsigned>((rows + teams - 1) / teams);
  const bool same_dt = a.x.dtype != FUS_FLOAT32 && a.gamma.dtype == a.x.dtype &&
                       (!a.beta || a.beta_dtype == a.x.dtype) && a.round_dtype == a.x.dtype &&
                       p.y_dt == a.x.dtype;
  const bool fast = same_dt && (p.qmode == 0 || p.qmode == 1) && p.kmax == 4 &&
                    norm_chunks(H) == 4 * static_cast<int64_t>(p.lanes) && p.vec_x && p.vec_g &&
                    p.vec_b && p.vec_y && (p.qmode == 0 || (p.q_row && p.vec_q));
  if (fast) {
    launch_norm_fwd_fast(p, a.x.dtype, blocks, threads, stream);
    return finish_norm_forward(a, p, q, per_tensor, ctx);
  }
  switch (p.kmax) {
    case 1: norm_fwd_kernel<1><<<blocks, threads, 0, stream>>>(p); break;
    case 2: norm_fwd_kernel<2><<<blocks, threads, 0, stream>>>(p); break;
    case 3:
    case 4: norm_fwd_kernel<4><<<blocks, threads, 0, stream>>>(p); break;
    default: norm_fwd_kernel<0><<<blocks, threads, 0, stream>>>(p); break;
  }
  FUS_CUDA_CHECK_LAUNCH("norm_fwd_kernel");
  finish_norm_forward(a, p, q, per_tensor, ctx);
}

void norm_backward_cuda(const NormBwdArgs& a, const fus_context& ctx) {
  CudaDeviceGuard guard(ctx.device_index);
  cudaStream_t stream = stream_of(ctx);
  const int64_t rows = a.dy.rows, H = a.dy.cols;
  if (rows == 0) {
    FUS_CUDA_CHECK(cudaMemsetAsync(a.dgamma.data, 0, H * fus_dtype_size(a.dgamma.dtype), stream));
    if (a.dbeta)
      FUS_CUDA_CHECK(cudaMemsetAsync(a.dbeta->data, 0, H * fus_dtype_size(a.dbeta->dtype), stream));
    return;
  }
  const NormColPlan plan = norm_bwd_col_plan(rows, H);
  NormBwdParams p{};
  p.ln = a.layernorm;
  p.zc = a.zero_centered;
  p.dy = a.dy.data;
  p.dy_dt = a.dy.dtype;
  p.x = a.x.data;
  p.x_dt = a.x.dtype;
  p.mean = a.mean;
  p.rstd = a.rstd;
  p.gamma = a.gamma.data;
  p.g_dt = a.gamma.dtype;
  p.dx = a.dx.data;
  p.dx_dt = a.dx.dtype;
  const bool vec = H % 8 == 0;
  p.vec_dy = vec && aligned(p.dy, 16);
  p.vec_x = vec && aligned(p.x, 16);
  p.vec_g = vec && aligned(p.gamma, 16);
  p.vec_dx = vec && aligned(p.dx, 16);
  p.rows = rows;
  p.cols = H;
  p.lanes = norm_bwd_lanes(H);
  p.teams = plan.teams;
  p.rows_per_group = plan.rows_per_group;
  p.kmax = norm_chunks_per_lane(H, p.lanes);
  float* ws = static_cast<float*>(a.workspace);
  p.pg = ws;
  p.pb = a.dbeta ? ws + plan.groups * H : nullptr;

  const int threads = p.lanes * p.teams;
  const size_t smem = p.teams > 1 ? 2 * sizeof(float) * p.teams * H : 0;
  const unsigned blocks = static_cast<unsigned>(plan.groups);
  const fus_dtype dt = a.x.dtype;
  const bool fast =
      dt != FUS_FLOAT32 && a.dy.dtype == dt && a.gamma.dtype == dt && a.dx.dtype == dt &&
      (p.kmax == 2 || (p.kmax == 4 && p.lanes == kNormMaxLanes && p.teams == 1)) &&
      norm_chunks(H) == p.kmax * p.lanes && p.vec_dy && p.vec_x && p.vec_g && p.vec_dx;
  if (fast) {
    auto launch = [&](auto t, auto c) {
      using T = decltype(t);
      constexpr int C = decltype(c)::value;
      if (p.ln)
        norm_bwd_fast_kernel<T, C, true><<<blocks, threads, smem, stream>>>(p);
      else
        norm_bwd_fast_kernel<T, C, false><<<blocks, threads, smem, stream>>>(p);
    };
    auto by_chunks = [&](auto t) {
      if (p.kmax == 2)
        launch(t, std::integral_constant<int, 2>{});
      else
        launch(t, std::integral_constant<int, 4>{});
    };
    if (dt == FUS_BFLOAT16)
      by_chunks(Bf16{});
    else
      by_chunks(Half{});
  } else {
    switch (p.kmax) {
      case 1: norm_bwd_kernel<1, true><<<blocks, threads, smem, stream>>>(p); break;
      case 2: norm_bwd_kernel<2, true><<<blocks, threads, smem, stream>>>(p); break;
      case 3:
      case 4: norm_bwd_kernel<4, false><<<blocks, threads, smem, stream>>>(p); break;
      default: norm_bwd_kernel<0, false><<<blocks, threads, smem, stream>>>(p); break;
    }
  }
  FUS_CUDA_CHECK_LAUNCH("norm_bwd_kernel");
  fused::launch_colsum_finalize(p.pg, plan.groups, H, a.dgamma.data, a.dgamma.dtype, stream);
  FUS_CUDA_CHECK_LAUNCH("colsum_finalize_kernel");
  if (a.dbeta) {
    fused::launch_colsum_finalize(p.pb, plan.groups, H, a.dbeta->data, a.dbeta->dtype, stream);
    FUS_CUDA_CHECK_LAUNCH("colsum_finalize_kernel");
  }
}

}  // namespace fusible
