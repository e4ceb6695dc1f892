// The blockwise FP8 cast of one 128 x 128 tile on the device (fusible/quantize.h: 1x128 blocks,
// or 128x128 tiles, fp32 scales), for any source of values: the quantize family's blockwise cast
// reads them from its input, the fused normalization and activation kernels compute them. One
// implementation, so the fused outputs are the blockwise quantize of the same values bit for bit
// (and equal common/cast_cpu.cpp's: amaxes are maxima of abs_bits, scales come from block_scale
// and casts from scale_element + float_to_fp8, common/numerics.h; only the order of the exact max
// reductions differs).
//
// A block of 256 threads holds a tile in registers: warp w rows w, w + 8, ..., w + 120, lane l
// columns l, l + 32, l + 64, l + 96 (each load instruction of a warp reads 32 consecutive
// elements). Row block amaxes (1D rowwise) by warp shuffles; column amaxes (1D columnwise) and the
// tile amax (2D) through shared memory. The rowwise copy is stored from registers; the columnwise
// copy goes through a shared byte tile [128][132] (padded rows) and is stored as rows of the
// transposed copy. Elements outside the matrix are zeros (they change no amax) and are not stored.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/dispatch.h"
#include "common/numerics.h"
#include "fusible/common.h"

namespace fusible {
namespace block_cast {

constexpr int kThreads = 256;
constexpr int kTile = FUS_FP8_BLOCK;          // 128
constexpr int kWarps = kThreads / 32;         // 8
constexpr int kRowsPerWarp = kTile / kWarps;  // 16
constexpr int kColsPerLane = kTile / 32;      // 4

// The blockwise copies of a matrix [rows, cols] (fusible/common.h layouts); a null copy is not
// written.
struct Out {
  uint8_t* row_q;  // rowwise [rows, cols]
  uint8_t* col_q;  // columnwise [cols, rows]
  float* row_s;
  float* col_s;
  int64_t rows, cols, nbr, nbc;  // nbr / nbc: 128-blocks down the rows / along the columns
  float fp8_max, epsilon;
  bool pow2, two_d;
};

// The Out of a validated blockwise fus_quantized.
inline Out make_out(const fus_quantized& q) {
  return Out{static_cast<uint8_t*>(q.rowwise_data),
             static_cast<uint8_t*>(q.columnwise_data),
             static_cast<float*>(q.rowwise_scale_inv),
             static_cast<float*>(q.columnwise_scale_inv),
             q.rows,
             q.cols,
             ceil_div(q.rows, kTile),
             ceil_div(q.cols, kTile),
             fus_fp8_max(q.dtype),
             q.amax_epsilon,
             q.power_2_scale != 0,
             q.mode == FUS_SCALING_BLOCK_2D};
}

// Shared memory of cast_tile (reusable by the block's next call without a barrier in between).
struct Smem {
  uint32_t col_max[kWarps][kTile];
  uint32_t warp_tile_max[kWarps];
  float col_mul[kTile];
  uint8_t tq[kTile][kTile + 4];  // tq[c][r]: the tile's columnwise codes
};

// A thread's values of the tile with first element (r0, c0): v[i][j] is element
// (r0 + warp + 8 i, c0 + lane + 32 j), +0 outside the matrix.
using Values = float[kRowsPerWarp][kColsPerLane];

__device__ __forceinline__ int64_t tile_row(int64_t r0, int i) {
  return r0 + static_cast<int>(threadIdx.x / 32) + kWarps * i;
}
__device__ __forceinline__ int64_t tile_col(int64_t c0, int j) {
  return c0 + static_cast<int>(threadIdx.x % 32) + 32 * j;
}

// v = value(r, c) over the tile at (r0, c0) of a matrix [rows, cols].
template <typename Value>
__device__ __forceinline__ void load_tile(const Value& value, int64_t rows, int64_t cols,
                                          int64_t r0, int64_t c0, Values& v) {
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int64_t r = tile_row(r0, i);
#pragma unroll
    for (int j = 0; j < kColsPerLane; ++j) {
      const int64_t c = tile_col(c0, j);
      v[i][j] = (r < rows && c < cols) ? value(r, c) : 0.0f;
    }
  }
}

__device__ __forceinline__ uint32_t warp_max(uint32_t v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

// Writes the copies of tile (tr, tc) (first element (128 tr, 128 tc)) with their scales from the
// values v, and returns the tile's amax (abs_bits; the same in every thread). Every thread of the
// block calls it with the same tile (it synchronises).
template <Fp8Format F>
__device__ __forceinline__ uint32_t cast_tile(const Out& o, Smem& sm, const Values& v, int64_t tr,
                                              int64_t tc) {
  const int64_t r0 = tr * kTile, c0 = tc * kTile;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  uint32_t cm[kColsPerLane] = {0u, 0u, 0u, 0u};
  uint32_t rmax[kRowsPerWarp];
  uint32_t wmax = 0;
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    uint32_t m = 0;
#pragma unroll
    for (int j = 0; j < kColsPerLane; ++j) {
      const uint32_t a = abs_bits(v[i][j]);
      m = max(m, a);
      cm[j] = max(cm[j], a);
    }
    rmax[i] = warp_max(m);
    wmax = max(wmax, rmax[i]);
  }
#pragma unroll
  for (int j = 0; j < kColsPerLane; ++j) sm.col_max[warp][lane + 32 * j] = cm[j];
  if (lane == 0) sm.warp_tile_max[warp] = wmax;
  __syncthreads();
  uint32_t tmax = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) tmax = max(tmax, sm.warp_tile_max[w]);
  const float tile_mul = block_scale(bits_as_float(tmax), o.fp8_max, o.epsilon, o.pow2);
  if (threadIdx.x < kTile) {
    const int c = threadIdx.x;
    uint32_t m = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) m = max(m, sm.col_max[w][c]);
    const float s =
        o.two_d ? tile_mul : block_scale(bits_as_float(m), o.fp8_max, o.epsilon, o.pow2);
    sm.col_mul[c] = s;
    if (!o.two_d && o.col_q && c0 + c < o.cols) o.col_s[tr * o.cols + c0 + c] = 1.0f / s;
  }
  if (threadIdx.x == 0 && o.two_d) {
    if (o.row_q) o.row_s[tr * o.nbc + tc] = 1.0f / tile_mul;
    if (o.col_q) o.col_s[tc * o.nbr + tr] = 1.0f / tile_mul;
  }
  __syncthreads();

  if (o.row_q) {
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const int64_t r = tile_row(r0, i);
      if (r >= o.rows) continue;
      const float mul =
          o.two_d ? tile_mul : block_scale(bits_as_float(rmax[i]), o.fp8_max, o.epsilon, o.pow2);
      if (!o.two_d && lane == 0) o.row_s[tc * o.rows + r] = 1.0f / mul;
#pragma unroll
      for (int j = 0; j < kColsPerLane; ++j) {
        const int64_t c = tile_col(c0, j);
        if (c < o.cols) o.row_q[r * o.cols + c] = float_to_fp8<F>(scale_element(v[i][j], mul));
      }
    }
  }
  if (o.col_q) {
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i)
#pragma unroll
      for (int j = 0; j < kColsPerLane; ++j) {
        const int c = lane + 32 * j;
        sm.tq[c][warp + kWarps * i] = float_to_fp8<F>(scale_element(v[i][j], sm.col_mul[c]));
      }
    __syncthreads();
    // Warp w stores rows w, w + 8, ... of the transposed tile; lane l bytes 4l .. 4l + 3.
    for (int cl = warp; cl < kTile; cl += kWarps) {
      const int64_t c = c0 + cl;
      if (c >= o.cols) break;
      uint8_t* dst = o.col_q + c * o.rows + r0;
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const int rl = lane * 4 + b;
        if (r0 + rl < o.rows) dst[rl] = sm.tq[cl][rl];
      }
    }
  }
  return tmax;
}

}  // namespace block_cast
}  // namespace fusible
