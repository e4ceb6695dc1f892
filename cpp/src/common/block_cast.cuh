// The blockwise FP8 cast of one 128 x 128 tile on the device (fusible/quantize.h: 1x128 blocks,
// or 128x128 tiles, fp32 scales), for any source of values: the quantize family's blockwise cast
// loads them from its input (load_chunks), the fused normalization and activation kernels compute
// them (compute_chunks). One implementation, so the fused outputs are the blockwise quantize of
// the same values bit for bit, and equal common/cast_cpu.cpp's: amaxes are maxima of abs_bits,
// scales come from block_scale and casts from scaled_fp8x4 (the paired form of scale_element +
// float_to_fp8, common/numerics.h); only the order of the (exact) max reductions differs.
//
// cast_tile<T, F>: one 256-thread block per tile, the tile held in registers as its raw 16-byte
// chunks of T (kR * 16 bytes a thread, widened to fp32 only when cast), so no shared-memory input
// stage is needed and several blocks share an SM: the standalone quantize holds 3 of 16-bit input
// (<= 80 registers), 2 of fp32 (<= 128). The fused kernels compute fp32 values (already rounded to
// their output dtype, so widening is exact) and use the fp32 geometry.
//  - Thread layout (Geo): thread t owns one 16-byte chunk (kC = 8 columns of a 16-bit input, 4 of
//    fp32) in each of kR consecutive rows (8 or 16): columns cc * kC ..., rows g * kR ..., with
//    cc = t % kCpr, g = t / kCpr. The kCpr = 128 / kC lanes of one row group (a half warp or a
//    warp) read whole 256- or 512-byte row segments with 16-byte loads.
//  - 1D rowwise amaxes: a row block is spread over the kCpr lanes of a group, each holding kR rows.
//    transpose_max reduces all kR rows over those lanes in kR shuffles (not kR * log2 kCpr):
//    afterwards each lane holds the maximum of one row, computes that row's scale (one division a
//    lane instead of kR) and stores its scale_inv (the 128 rows of a tile are 512 contiguous bytes
//    of the [nbc, rows] matrix); the multipliers reach the other lanes by shuffles. 16-bit inputs
//    reduce their packed magnitudes (__vmaxu2, two columns a word), widened once at the end.
//  - 1D columnwise amaxes: per-thread column maxima over its kR rows, across the two half warps by
//    a shuffle (16-bit), across the warps through shared memory; 128 threads then compute the
//    column scales (coalesced scale_inv stores). 2D: the tile amax through the same exchange.
//  - Rowwise codes: the kC codes of a row as kC / 4 words, one 8-byte (16-bit input) or 4-byte
//    (fp32) store; a warp store covers whole 128-byte rows of the copy.
//  - Columnwise (transposed) codes: scaled_fp8x4 is given four elements of one *column* (four
//    rows), so its word is already a piece of a transposed row, and a thread's kR codes of a column
//    are one 8- or 16-byte shared store into the byte tile tq[c][r] (no byte permutes). The kR-byte
//    units of a tq row are XOR-swizzled (unit g lies at g ^ (cc % units)), so the lanes of a store
//    hit distinct banks; read back as 16-byte pieces (8 lanes = one 128-byte tq row: conflict free
//    in any order) and stored as 16-byte words (a warp covers four 128-byte rows of the copy).
//  - Edges: elements outside the matrix are +0 (no effect on an amax) and are never stored;
//    unaligned inputs (pointer, or cols % kC) load element by element into the same chunks,
//    unaligned outputs (pointer, cols % kC, rows % 16) store byte by byte; the math is shared.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "common/cuda_utils.h"
#include "common/device_common.cuh"
#include "common/dispatch.h"
#include "common/numerics.h"
#include "common/tile_io.cuh"
#include "fusible/common.h"

namespace fusible {
namespace block_cast {

constexpr int kThreads = 256;
constexpr int kTile = FUS_FP8_BLOCK;  // 128
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFull = 0xffffffffu;

// A thread's part of a tile: one 16-byte chunk (kC elements of T) in each of kR consecutive rows.
template <typename T>
struct Geo {
  static constexpr int kC = 16 / static_cast<int>(sizeof(T));  // columns a thread: 8 / 4
  static constexpr int kCpr = kTile / kC;                      // lanes a tile row: 16 / 32
  static constexpr int kGroups = kThreads / kCpr;              // row groups: 16 / 8
  static constexpr int kR = kTile / kGroups;                   // rows a thread: 8 / 16
  static constexpr int kUnits = kTile / kR;                    // kR-byte units in a tq row
  static_assert(kCpr == 2 * kR && kCpr <= 32 && kR % 4 == 0 && kC % 4 == 0, "tile geometry");
};

// The thread's chunks of a tile: raw[i] holds columns col0() .. col0() + kC - 1 of row row0() + i.
template <typename T>
using Chunks = uint4[Geo<T>::kR];

// The thread's first row / column within a tile.
template <typename T>
__device__ __forceinline__ int row0() {
  return static_cast<int>(threadIdx.x / Geo<T>::kCpr) * Geo<T>::kR;
}
template <typename T>
__device__ __forceinline__ int col0() {
  return static_cast<int>(threadIdx.x % Geo<T>::kCpr) * Geo<T>::kC;
}

// The blockwise copies of a matrix [rows, cols] (fusible/common.h layouts); a null copy is not
// written. Scales: 1D row_s [nbc, rows], col_s [nbr, cols]; 2D row_s [nbr, nbc], col_s [nbc, nbr].
struct Out {
  uint8_t* row_q;  // rowwise [rows, cols]
  uint8_t* col_q;  // columnwise [cols, rows]
  float* row_s;
  float* col_s;
  int64_t rows, cols, nbr, nbc;  // nbr / nbc: 128-blocks down the rows / along the columns
  float fp8_max, epsilon;
  bool pow2, two_d;
  bool vec_row;  // kC-byte rowwise stores: row_q kC-byte aligned, cols % kC == 0
  bool vec_col;  // 16-byte columnwise stores: col_q 16-byte aligned, rows % 16 == 0
};

// The Out of a validated blockwise fus_quantized, for chunks of T (cast_tile<T, ...>).
template <typename T>
inline Out make_out(const fus_quantized& q) {
  constexpr int kC = Geo<T>::kC;
  Out o{static_cast<uint8_t*>(q.rowwise_data),
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
        q.mode == FUS_SCALING_BLOCK_2D,
        false,
        false};
  o.vec_row = q.cols % kC == 0 && is_aligned(o.row_q, kC);
  o.vec_col = q.rows % 16 == 0 && is_aligned(o.col_q, 16);
  return o;
}

// Shared memory of cast_tile. A block that casts several tiles needs a __syncthreads() between
// two calls (the tile max exchange of one call may not be read yet when the next one writes).
struct Smem {
  alignas(16) uint8_t tq[kTile * kTile];        // columnwise codes tq[c][r], swizzled units
  alignas(16) uint32_t col_key[kWarps][kTile];  // per-warp column maxima (abs bits)
  alignas(16) float col_mul[kTile];
  uint32_t warp_key[kWarps];
};

__device__ __forceinline__ uint32_t word(const uint4& v, int k) {
  return k == 0 ? v.x : k == 1 ? v.y : k == 2 ? v.z : v.w;
}

// Element j of a chunk, widened as Element<T>::load.
template <typename T>
__device__ __forceinline__ float elem(const uint4& raw, int j) {
  if constexpr (sizeof(T) == 4) {
    return bits_as_float(word(raw, j));
  } else {
    return fused::elem8<T>(raw, j);
  }
}

// Magnitude keys: abs_bits for fp32; the 16-bit magnitude (bits & 0x7fff) for 16-bit types, whose
// widening to fp32 is monotonic in it (NaN payloads included), so the max of keys widened is the
// max of abs_bits.
template <typename T>
__device__ __forceinline__ uint32_t key_bits(uint32_t key) {
  if constexpr (sizeof(T) == 4) {
    return key;
  } else {
    T h;
    h.bits = static_cast<uint16_t>(key);
    return abs_bits(Element<T>::load(&h, 0));
  }
}

// Key of column j (of a thread's chunk) from the per-word column maxima ck (16-bit: two columns a
// word, low half first).
template <typename T>
__device__ __forceinline__ uint32_t col_key_of(const uint32_t (&ck)[4], int j) {
  if constexpr (sizeof(T) == 4) {
    return ck[j];
  } else {
    return j % 2 ? ck[j / 2] >> 16 : ck[j / 2] & 0xffffu;
  }
}

// Bit reversal of i over log2(N) bits.
template <int N>
__device__ __forceinline__ constexpr int bitrev(int i) {
  int r = 0;
  for (int b = 1, rb = N / 2; b < N; b <<= 1, rb >>= 1)
    if (i & b) r |= rb;
  return r;
}

// One halving exchange of transpose_max, between lanes at distance o: v[0 .. m) become m / 2
// partial maxima (each lane keeps the half its bit o selects and receives the other's).
template <int N>
__device__ __forceinline__ void halving_step(uint32_t (&v)[N], int lane, int o, int m) {
  const bool upper = (lane & o) != 0;
#pragma unroll
  for (int k = 0; k < m / 2; ++k) {
    const uint32_t send = upper ? v[k] : v[k + m / 2];
    const uint32_t keep = upper ? v[k + m / 2] : v[k];
    v[k] = max(keep, __shfl_xor_sync(kFull, send, o));
  }
}

// The halving exchanges from v[0 .. M) on (lane distance N / M, then the next step with M / 2). As
// template recursion every index is a compile-time constant.
template <int N, int M>
__device__ __forceinline__ void halving_max(uint32_t (&v)[N], int lane) {
  if constexpr (M > 1) {
    halving_step(v, lane, N / M, M);
    halving_max<N, M / 2>(v, lane);
  }
}

// Max of v[i] over the L lanes of an aligned lane group (L = 2N, L <= 32), for all N values at
// once: log2(N) halving exchanges (N - 1 shuffles) leave each lane with the partial max of one
// value over N lanes, one butterfly step completes it over L. Returns, on every lane, the max of
// v[bitrev<N>(lane % N)].
//
// The same exchanges (halving_step) sequenced two ways, for ptxas: N = 16 (fp32 chunks, the fused
// kernels) by template recursion, because nvcc leaves the step loop rolled inside
// norm_block_kernel (v then lives in local memory, 64 bytes a thread); N = 8 (16-bit chunks, the
// standalone cast only) as the loop, because the recursion costs that cast a 4-byte spill at its
// 80-register budget.
template <int N, int L>
__device__ __forceinline__ uint32_t transpose_max(uint32_t (&v)[N]) {
  static_assert(L == 2 * N, "one butterfly step after the exchanges");
  const int lane = threadIdx.x % 32;
  if constexpr (N == 16) {
    halving_max<N, N>(v, lane);
  } else {
#pragma unroll
    for (int s = 0; (1 << s) < N; ++s) halving_step(v, lane, 1 << s, N >> s);
  }
  return max(v[0], __shfl_xor_sync(kFull, v[0], N));
}

// ---- value sources ----------------------------------------------------------------------------

// The thread's chunks of the tile at (r0, c0) of a matrix x [rows, cols] of T in memory; +0
// outside the matrix. vec_in: x 16-byte aligned and cols % kC == 0 (16-byte loads).
template <typename T>
__device__ __forceinline__ void load_chunks(const T* __restrict__ x, int64_t rows, int64_t cols,
                                            int64_t r0, int64_t c0, bool vec_in, Chunks<T>& raw) {
  constexpr int kC = Geo<T>::kC, kR = Geo<T>::kR;
  const int64_t rt = r0 + row0<T>(), ct = c0 + col0<T>();
  if (vec_in && r0 + kTile <= rows && c0 + kTile <= cols) {
    const uint4* src = reinterpret_cast<const uint4*>(x + rt * cols + ct);
    const int64_t pitch = cols / kC;
#pragma unroll
    for (int i = 0; i < kR; ++i) raw[i] = __ldg(src + i * pitch);
  } else if (vec_in) {  // cols % kC == 0: a chunk lies wholly inside or outside
#pragma unroll
    for (int i = 0; i < kR; ++i)
      raw[i] = rt + i < rows && ct < cols
                   ? __ldg(reinterpret_cast<const uint4*>(x + (rt + i) * cols + ct))
                   : make_uint4(0u, 0u, 0u, 0u);
  } else {
#pragma unroll
    for (int i = 0; i < kR; ++i) {
      tile_io::Chunk<T> ch;
#pragma unroll
      for (int e = 0; e < kC; ++e)
        ch.e[e] = rt + i < rows && ct + e < cols ? x[(rt + i) * cols + ct + e] : T{};
      raw[i] = ch.u;
    }
  }
}

// The thread's chunks (fp32) of the tile at (r0, c0) of a computed matrix [rows, cols]:
// value(r, c, n, v) writes v[0 .. n) = the values of elements (r, c) .. (r, c + n - 1), with
// 1 <= n <= 4 (already rounded to the output dtype: cast_tile casts exactly these floats). The
// rest of the chunk is +0.
template <typename Value>
__device__ __forceinline__ void compute_chunks(const Value& value, int64_t rows, int64_t cols,
                                               int64_t r0, int64_t c0, Chunks<float>& raw) {
  constexpr int kR = Geo<float>::kR;
  const int64_t rt = r0 + row0<float>(), ct = c0 + col0<float>();
  const int n = ct < cols ? static_cast<int>(cols - ct < 4 ? cols - ct : 4) : 0;
#pragma unroll
  for (int i = 0; i < kR; ++i) {
    float v[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    if (rt + i < rows && n > 0) value(rt + i, ct, n, v);
    raw[i] = make_uint4(float_as_bits(n > 0 ? v[0] : 0.0f), float_as_bits(n > 1 ? v[1] : 0.0f),
                        float_as_bits(n > 2 ? v[2] : 0.0f), float_as_bits(n > 3 ? v[3] : 0.0f));
  }
}

// ---- the cast ---------------------------------------------------------------------------------

// Writes the copies of tile (tr, tc) (first element (128 tr, 128 tc)) of o with their scales from
// the thread's chunks raw, and returns the tile's amax (abs_bits, the same in every thread) when
// want_amax or o.two_d (0 otherwise). Every thread of the block calls it with the same tile (it
// synchronises). two_d must equal o.two_d (a compile-time constant where the caller has one).
template <typename T, Fp8Format F>
__device__ __forceinline__ uint32_t cast_tile(const Out& o, Smem& sm, const Chunks<T>& raw,
                                              int64_t tr, int64_t tc, bool two_d, bool want_amax) {
  using G = Geo<T>;
  constexpr int kC = G::kC, kR = G::kR, kCpr = G::kCpr;
  const int64_t rows = o.rows, cols = o.cols;
  const int64_t r0 = tr * kTile, c0 = tc * kTile;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int cc = threadIdx.x % kCpr, g = threadIdx.x / kCpr;
  const int64_t rt = r0 + g * kR, ct = c0 + cc * kC;  // the thread's first row and column
  const bool full = r0 + kTile <= rows && c0 + kTile <= cols;

  // ---- magnitude keys: per row (rkey) and per column of the thread's chunk (ck)
  uint32_t rkey[kR];
  uint32_t ck[4] = {0u, 0u, 0u, 0u};
#pragma unroll
  for (int i = 0; i < kR; ++i) {
    uint32_t m = 0;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if constexpr (sizeof(T) == 2) {
        const uint32_t a = word(raw[i], k) & 0x7fff7fffu;
        ck[k] = __vmaxu2(ck[k], a);
        m = __vmaxu2(m, a);
      } else {
        const uint32_t a = word(raw[i], k) & 0x7fffffffu;
        ck[k] = max(ck[k], a);
        m = max(m, a);
      }
    }
    rkey[i] = sizeof(T) == 2 ? max(m & 0xffffu, m >> 16) : m;
  }

  // ---- 1D rowwise scales: lane holds row bitrev(lane % kR) of its group
  float row_mul = 1.0f;
  if (!two_d && o.row_q) {
    const uint32_t key = transpose_max<kR, kCpr>(rkey);
    row_mul = block_scale(bits_as_float(key_bits<T>(key)), o.fp8_max, o.epsilon, o.pow2);
    const int64_t r = rt + bitrev<kR>(lane % kR);
    if ((lane & kR) == 0 && r < rows) o.row_s[tc * rows + r] = 1.0f / row_mul;
  }

  // ---- column maxima and the tile max through shared memory
  const bool need_col = !two_d && o.col_q != nullptr;
  const bool need_tile = two_d || want_amax;
  uint32_t tile_key = 0;
  if (need_col || need_tile) {
    if constexpr (sizeof(T) == 2) {  // the warp's two row groups hold the same columns
#pragma unroll
      for (int k = 0; k < 4; ++k) ck[k] = __vmaxu2(ck[k], __shfl_xor_sync(kFull, ck[k], 16));
    }
    uint32_t cb[kC];
    uint32_t t = 0;
#pragma unroll
    for (int j = 0; j < kC; ++j) {
      cb[j] = key_bits<T>(col_key_of<T>(ck, j));
      t = max(t, cb[j]);
    }
    if (need_col && (sizeof(T) == 4 || lane < 16)) {
#pragma unroll
      for (int j = 0; j < kC; j += 4)
        *reinterpret_cast<uint4*>(&sm.col_key[warp][cc * kC + j]) =
            make_uint4(cb[j], cb[j + 1], cb[j + 2], cb[j + 3]);
    }
    if (need_tile) {
#pragma unroll
      for (int s = 16; s > 0; s >>= 1) t = max(t, __shfl_xor_sync(kFull, t, s));
      if (lane == 0) sm.warp_key[warp] = t;
    }
    __syncthreads();
    if (need_tile) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) tile_key = max(tile_key, sm.warp_key[w]);
    }
  }
  const float tile_mul =
      two_d ? block_scale(bits_as_float(tile_key), o.fp8_max, o.epsilon, o.pow2) : 1.0f;
  if (two_d && threadIdx.x == 0) {
    const float inv = 1.0f / tile_mul;
    if (o.row_q) o.row_s[tr * o.nbc + tc] = inv;
    if (o.col_q) o.col_s[tc * o.nbr + tr] = inv;
  }
  if (need_col && threadIdx.x < kTile) {  // 1D columnwise scales, one column a thread
    const int c = threadIdx.x;
    uint32_t m = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) m = max(m, sm.col_key[w][c]);
    const float s = block_scale(bits_as_float(m), o.fp8_max, o.epsilon, o.pow2);
    sm.col_mul[c] = s;
    if (c0 + c < cols) o.col_s[tr * cols + c0 + c] = 1.0f / s;
  }

  // ---- rowwise codes
  if (o.row_q) {
    const bool fast = o.vec_row && full;
    uint8_t* dst = o.row_q + rt * cols + ct;
#pragma unroll
    for (int i = 0; i < kR; ++i) {
      const float mul = two_d ? tile_mul : __shfl_sync(kFull, row_mul, bitrev<kR>(i), kCpr);
      uint32_t w[kC / 4];
#pragma unroll
      for (int k = 0; k < kC / 4; ++k) {
        const float v[4] = {elem<T>(raw[i], 4 * k), elem<T>(raw[i], 4 * k + 1),
                            elem<T>(raw[i], 4 * k + 2), elem<T>(raw[i], 4 * k + 3)};
        w[k] = scaled_fp8x4<F>(v, mul);
      }
      if (fast) {
        tile_io::store_vec<kC>(dst + i * cols, w);
      } else if (rt + i < rows && ct < cols) {
        tile_io::store_bytes<kC>(dst + i * cols, cols - ct, o.vec_row, w);
      }
    }
  }

  // ---- columnwise codes: through tq, stored as 16-byte pieces of the transposed rows
  if (o.col_q) {
    if (!two_d) __syncthreads();  // col_mul
    float cm[kC];
#pragma unroll
    for (int j = 0; j < kC; ++j) cm[j] = two_d ? tile_mul : sm.col_mul[cc * kC + j];
    const int unit = (g ^ (cc % G::kUnits)) * kR;  // byte offset of the thread's unit in a tq row
#pragma unroll
    for (int j = 0; j < kC; ++j) {
      uint32_t w[kR / 4];
#pragma unroll
      for (int m = 0; m < kR / 4; ++m) {
        const float v[4] = {elem<T>(raw[4 * m], j), elem<T>(raw[4 * m + 1], j),
                            elem<T>(raw[4 * m + 2], j), elem<T>(raw[4 * m + 3], j)};
        w[m] = scaled_fp8x4<F>(v, cm[j]);
      }
      tile_io::store_vec<kR>(&sm.tq[(cc * kC + j) * kTile + unit], w);
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kTile * kTile / 16 / kThreads; ++k) {
      const int q = threadIdx.x + kThreads * k;
      const int c = q / 8, u = q % 8;      // tq row c, rows 16u .. 16u + 15 of the tile
      const int s = (c / kC) % G::kUnits;  // the swizzle of tq row c
      uint4 v;
      if constexpr (kR == 16) {
        v = *reinterpret_cast<const uint4*>(&sm.tq[c * kTile + (u ^ s) * 16]);
      } else {  // 8-byte units 2u, 2u + 1 are the two halves of 16-byte unit u ^ (s / 2)
        v = *reinterpret_cast<const uint4*>(&sm.tq[c * kTile + (u ^ (s >> 1)) * 16]);
        if (s & 1) v = make_uint4(v.z, v.w, v.x, v.y);
      }
      const int64_t cg = c0 + c, rg = r0 + 16 * u;
      if (cg < cols && rg < rows) {
        const uint32_t w[4] = {v.x, v.y, v.z, v.w};
        tile_io::store_bytes<16>(o.col_q + cg * rows + rg, rows - rg, o.vec_col, w);
      }
    }
  }
  return tile_key;
}

}  // namespace block_cast
}  // namespace fusible
