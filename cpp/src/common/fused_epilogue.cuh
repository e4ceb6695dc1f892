// Device building blocks shared by the fused CUDA kernels of the normalization and activation
// families: 8-element vector loads / stores of run-time dtypes, the FP8 / MXFP8 casts (through the
// shared numerics, exactly as the quantize family's kernels do them), and a tile epilogue that
// turns a 32 x 64 tile of fp32 results into every output a fused kernel can have (high precision,
// per-tensor FP8 rowwise and transposed, MXFP8 rowwise and columnwise, amax, column sums).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/device_common.cuh"
#include "common/hp_access.h"

namespace fusible {
namespace fused {

__device__ __forceinline__ int64_t imin(int64_t a, int64_t b) { return a < b ? a : b; }
__device__ __forceinline__ int64_t imax(int64_t a, int64_t b) { return a > b ? a : b; }

// ---- 8-element chunks
// -----------------------------------------------------------------------------

// v[j] = element i + j of a run-time-dtype matrix for j < n, else 0. vec: n == 8 may be read as
// 16-byte vectors (base 16-byte aligned, i % 8 == 0).
__device__ __forceinline__ void load8(const void* p, fus_dtype dt, int64_t i, int n, bool vec,
                                      float (&v)[8]) {
  if (vec && n == 8) {
    if (dt == FUS_FLOAT32) {
      const float4* q = reinterpret_cast<const float4*>(static_cast<const float*>(p) + i);
      const float4 a = q[0], b = q[1];
      v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z,
      v[7] = b.w;
    } else {
      const uint4 raw = *reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(p) + i);
      const uint32_t w[4] = {raw.x, raw.y, raw.z, raw.w};
      if (dt == FUS_BFLOAT16) {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          v[2 * k] = bf16_to_float(static_cast<uint16_t>(w[k] & 0xffffu));
          v[2 * k + 1] = bf16_to_float(static_cast<uint16_t>(w[k] >> 16));
        }
      } else {
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          v[2 * k] = half_to_float(static_cast<uint16_t>(w[k] & 0xffffu));
          v[2 * k + 1] = half_to_float(static_cast<uint16_t>(w[k] >> 16));
        }
      }
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = j < n ? load_hp(p, dt, i + j) : 0.0f;
}

// Stores v[j] rounded to dt at element i + j for j < n. vec as for load8.
__device__ __forceinline__ void store8(void* p, fus_dtype dt, int64_t i, int n, bool vec,
                                       const float (&v)[8]) {
  if (vec && n == 8) {
    if (dt == FUS_FLOAT32) {
      float4* q = reinterpret_cast<float4*>(static_cast<float*>(p) + i);
      q[0] = make_float4(v[0], v[1], v[2], v[3]);
      q[1] = make_float4(v[4], v[5], v[6], v[7]);
    } else {
      uint32_t w[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const uint16_t lo = dt == FUS_BFLOAT16 ? float_to_bf16(v[2 * k]) : float_to_half(v[2 * k]);
        const uint16_t hi =
            dt == FUS_BFLOAT16 ? float_to_bf16(v[2 * k + 1]) : float_to_half(v[2 * k + 1]);
        w[k] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
      }
      *reinterpret_cast<uint4*>(static_cast<uint16_t*>(p) + i) = make_uint4(w[0], w[1], w[2], w[3]);
    }
    return;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j)
    if (j < n) store_hp(p, dt, i + j, v[j]);
}

// ---- casts (run-time FP8 format; uniform branches)
// ------------------------------------------------

// fp8(v[j] * s[j]) for eight values, byte j of the two words, exactly as the quantize family
// casts (numerics.h scaled_fp8x4: paired conversions, defined NaN rule).
__device__ __forceinline__ uint2 cast8(bool e5m2, const float (&v)[8], const float (&s)[8]) {
  const float v0[4] = {v[0], v[1], v[2], v[3]}, v1[4] = {v[4], v[5], v[6], v[7]};
  const float s0[4] = {s[0], s[1], s[2], s[3]}, s1[4] = {s[4], s[5], s[6], s[7]};
  if (e5m2)
    return make_uint2(scaled_fp8x4<Fp8Format::kE5M2>(v0, s0),
                      scaled_fp8x4<Fp8Format::kE5M2>(v1, s1));
  return make_uint2(scaled_fp8x4<Fp8Format::kE4M3>(v0, s0), scaled_fp8x4<Fp8Format::kE4M3>(v1, s1));
}

__device__ __forceinline__ uint2 cast8(bool e5m2, const float (&v)[8], float s) {
  const float ss[8] = {s, s, s, s, s, s, s, s};
  return cast8(e5m2, v, ss);
}

__device__ __forceinline__ uint8_t byte_of(uint2 w, int j) {
  return static_cast<uint8_t>((j < 4 ? w.x : w.y) >> (8 * (j % 4)));
}

// Stores the first n of the 8 bytes in w at dst. vec: n == 8 may be one 8-byte store (dst 8-byte
// aligned).
__device__ __forceinline__ void store_words8(uint8_t* dst, int n, bool vec, uint2 w) {
  if (vec && n == 8) {
    *reinterpret_cast<uint2*>(dst) = w;
    return;
  }
#pragma unroll
  for (int j = 0; j < 8; ++j)
    if (j < n) dst[j] = byte_of(w, j);
}

__device__ __forceinline__ uint8_t e8m0_for(bool e5m2, uint32_t amax_bits) {
  const float a = bits_as_float(amax_bits);
  return e5m2 ? e8m0_from_amax<Fp8Format::kE5M2>(a) : e8m0_from_amax<Fp8Format::kE4M3>(a);
}

// ---- the tile epilogue
// ----------------------------------------------------------------------------

// Outputs of a fused kernel over an output matrix [rows, out_cols].
struct EpilogueOut {
  void* hp;  // high-precision output or null
  fus_dtype hp_dtype;
  fus_dtype round_dtype;  // every value is rounded to this dtype first
  bool vec_hp;            // 16-byte stores legal (aligned base, every chunk start % 8 == 0)
  int qmode;              // 0 none, 1 per tensor, 2 MXFP8
  bool e5m2;
  uint8_t* q_row;      // rowwise fp8 [rows, out_cols]
  uint8_t* q_col;      // per tensor: transposed [out_cols, rows]; MXFP8: [rows, out_cols]
  uint8_t* s_row;      // MXFP8 E8M0 [rows, ceil(out_cols / 32)]
  uint8_t* s_col;      // MXFP8 E8M0 [ceil(rows / 32), out_cols]
  const float* scale;  // per tensor
  bool vec_q_row;      // 8-byte rowwise stores legal
  bool vec_q_t;        // 8-byte stores into the transposed copy legal (rows % 8 == 0, aligned)
  bool amax;           // accumulate max |value| (block_amax at the end of the kernel)
  bool colsum;         // accumulate column sums (dbias)
  int64_t rows, out_cols;
};

constexpr int kTileRows = 32, kTileCols = 64, kTileThreads = 256;

// Shared memory of one epilogue (reused by consecutive tiles and strips).
struct EpilogueSmem {
  uint8_t qt[kTileCols][kTileRows + 4];     // transposed fp8 bytes
  uint32_t absb[kTileRows][kTileCols + 1];  // |v| bits for MXFP8 column blocks, or values
  uint8_t ecol[kTileCols];                  // MXFP8 column-block scales of the tile
};

// Per-thread state that outlives one tile.
struct EpilogueAcc {
  uint32_t amax = 0;    // max abs_bits of the values
  uint32_t am16 = 0;    // 16-bit path: packed magnitudes instead (amax16_update; amax16_bits)
  float colsum = 0.0f;  // threads < 64: the running column sum of column c0 + threadIdx.x
};

// max |value| of an accumulator as abs_bits (T as for emit_tile).
template <typename T = void>
__device__ __forceinline__ uint32_t acc_amax_bits(const EpilogueAcc& acc) {
  if constexpr (std::is_void_v<T>)
    return acc.amax;
  else
    return amax16_bits<T>(acc.am16);
}

// Emits one strip: the thread's 8 values v (row r0 + ty, columns col .. col + 7 of the output
// matrix, n of them inside), where the tile covers rows [r0, r0 + 32) and the strip's columns
// [c0s, c0s + 64) (c0s = the strip's first output column; col = c0s + 8 tx). strip_cols: columns
// of the strip inside the matrix (<= 64). Every thread of the block calls it with the same
// r0 / c0s (it synchronises).
// T: void for run-time dtypes, or the 16-bit type of the common case, where o.round_dtype and
// o.hp_dtype are T, chunks are whole (n is 8 or 0), 16-byte hp stores are legal and qmode is not
// MXFP8 (the caller's condition; this path writes no MXFP8 output): values are rounded two at a
// time (round_pack8) and amax is taken on the packed magnitudes (acc.am16). Same bits.
template <typename T = void>
__device__ __forceinline__ void emit_tile(const EpilogueOut& o, EpilogueSmem& sm, EpilogueAcc& acc,
                                          int64_t r0, int64_t c0s, int strip_cols, float (&v)[8],
                                          int n) {
  constexpr bool k16 = !std::is_void_v<T>;
  const int tid = threadIdx.x, tx = tid % 8, ty = tid / 8;
  const int64_t r = r0 + ty, col = c0s + 8 * tx;
  const bool row_ok = r < o.rows;
  if (!row_ok) n = 0;
  const int64_t at = r * o.out_cols + col;
  uint32_t m = 0;
  if constexpr (k16) {
    const uint4 packed = round_pack8<T>(v);
    if (o.hp && n > 0) *reinterpret_cast<uint4*>(static_cast<T*>(o.hp) + at) = packed;
    if (o.amax && n > 0) acc.am16 = amax16_update(acc.am16, packed);
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) v[j] = round_hp(o.round_dtype, v[j]);
    if (o.hp && n > 0) store8(o.hp, o.hp_dtype, at, n, o.vec_hp, v);
#pragma unroll
    for (int j = 0; j < 8; ++j)
      if (j < n) m = max(m, abs_bits(v[j]));
    if (o.amax) acc.amax = max(acc.amax, m);
  }

  if (o.qmode == 1) {
    const uint2 q = cast8(o.e5m2, v, *o.scale);
    if (o.q_row && n > 0) store_words8(o.q_row + at, n, o.vec_q_row, q);
    if (o.q_col) {
#pragma unroll
      for (int j = 0; j < 8; ++j) sm.qt[8 * tx + j][ty] = byte_of(q, j);
      __syncthreads();
      const int cl = tid / 4, part = tid % 4;
      const int64_t rr = r0 + 8 * part;
      if (cl < strip_cols && rr < o.rows) {
        // Rows are kTileRows + 4 bytes apart: 4-byte aligned, so two word reads.
        const uint32_t* src = reinterpret_cast<const uint32_t*>(&sm.qt[cl][8 * part]);
        const int64_t left = o.rows - rr;
        store_words8(o.q_col + (c0s + cl) * o.rows + rr, left < 8 ? static_cast<int>(left) : 8,
                     o.vec_q_t, make_uint2(src[0], src[1]));
      }
      __syncthreads();
    }
  } else if (!k16 && o.qmode == 2) {
    if (o.q_row) {
      // A 32-wide block is 4 consecutive threads of one row (tx = 4 i .. 4 i + 3).
      uint32_t bm = m;
      bm = max(bm, __shfl_xor_sync(kFull, bm, 1));
      bm = max(bm, __shfl_xor_sync(kFull, bm, 2));
      const uint8_t e = e8m0_for(o.e5m2, bm);
      const float mult = e8m0_inverse(e);
      if (n > 0) store_words8(o.q_row + at, n, o.vec_q_row, cast8(o.e5m2, v, mult));
      if (tx % 4 == 0 && n > 0) o.s_row[r * ((o.out_cols + 31) / 32) + col / 32] = e;
    }
    if (o.q_col) {
#pragma unroll
      for (int j = 0; j < 8; ++j) sm.absb[ty][8 * tx + j] = j < n ? abs_bits(v[j]) : 0u;
      __syncthreads();
      if (tid < kTileCols) {
        uint32_t cm = 0;
#pragma unroll 8
        for (int i = 0; i < kTileRows; ++i) cm = max(cm, sm.absb[i][tid]);
        const uint8_t e = e8m0_for(o.e5m2, cm);
        sm.ecol[tid] = e;
        if (tid < strip_cols && r0 < o.rows) o.s_col[(r0 / 32) * o.out_cols + c0s + tid] = e;
      }
      __syncthreads();
      float mc[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) mc[j] = e8m0_inverse(sm.ecol[8 * tx + j]);
      if (n > 0) store_words8(o.q_col + at, n, o.vec_q_row, cast8(o.e5m2, v, mc));
      __syncthreads();
    }
  }

  if (o.colsum) {
    // Sequential over the tile's rows, continuing the column's running sum (activation.h order).
    float* vals = reinterpret_cast<float*>(&sm.absb[0][0]);
#pragma unroll
    for (int j = 0; j < 8; ++j) vals[ty * (kTileCols + 1) + 8 * tx + j] = v[j];
    __syncthreads();
    if (tid < kTileCols) {
      if (r0 + kTileRows <= o.rows) {
        // A full tile: issue the 32 shared-memory loads first, then the dependent adds (same
        // order). The loop with a data-dependent exit serialised a load and an add per row.
        float t[kTileRows];
#pragma unroll
        for (int i = 0; i < kTileRows; ++i) t[i] = vals[i * (kTileCols + 1) + tid];
#pragma unroll
        for (int i = 0; i < kTileRows; ++i) acc.colsum = f_add(acc.colsum, t[i]);
      } else {
        for (int i = 0; i < kTileRows && r0 + i < o.rows; ++i)
          acc.colsum = f_add(acc.colsum, vals[i * (kTileCols + 1) + tid]);
      }
    }
    __syncthreads();
  }
}

// ---- small kernels
// ----------------------------------------------------------------------------------

// out[c] = sum over g of partial[g * cols + c], sequentially in g (from 0.0f), rounded to dt.
// The order is fixed, so the parallelism is in the loads: a block owns 32 columns, its 8 warps
// load a chunk of 64 groups' partials (8 loads in flight a thread) into shared memory, and warp 0
// adds them in order. One thread a column looping over the groups waited a memory latency per
// add (about 13 us for 256 groups x 2048 columns on an H200, against about 3 now).
constexpr int kColsumCols = 32;
constexpr int kColsumWarps = 8;
constexpr int kColsumUnroll = 8;
constexpr int kColsumChunk = kColsumWarps * kColsumUnroll;

static __global__ void __launch_bounds__(kColsumWarps * 32)
    colsum_finalize_kernel(const float* __restrict__ partial, int64_t groups, int64_t cols,
                           void* out, fus_dtype dt) {
  __shared__ float tile[kColsumChunk][kColsumCols + 1];
  const int lane = static_cast<int>(threadIdx.x) & 31;
  const int warp = static_cast<int>(threadIdx.x) >> 5;
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kColsumCols + lane;
  float t = 0.0f;
  for (int64_t g0 = 0; g0 < groups; g0 += kColsumChunk) {
#pragma unroll
    for (int u = 0; u < kColsumUnroll; ++u) {
      const int r = warp * kColsumUnroll + u;
      const int64_t g = g0 + r;
      tile[r][lane] = (c < cols && g < groups) ? partial[g * cols + c] : 0.0f;
    }
    __syncthreads();
    if (warp == 0) {
      const int64_t n = imin(kColsumChunk, groups - g0);
      if (n == kColsumChunk) {
#pragma unroll
        for (int r = 0; r < kColsumChunk; ++r) t = f_add(t, tile[r][lane]);
      } else {
        for (int r = 0; r < n; ++r) t = f_add(t, tile[r][lane]);
      }
    }
    __syncthreads();
  }
  if (warp == 0 && c < cols) store_hp(out, dt, c, t);
}

// Launches colsum_finalize_kernel over cols columns (the caller checks the launch).
static inline void launch_colsum_finalize(const float* partial, int64_t groups, int64_t cols,
                                          void* out, fus_dtype dt, cudaStream_t stream) {
  const auto blocks = static_cast<unsigned>((cols + kColsumCols - 1) / kColsumCols);
  colsum_finalize_kernel<<<blocks, kColsumWarps * 32, 0, stream>>>(partial, groups, cols, out, dt);
}

}  // namespace fused
}  // namespace fusible
