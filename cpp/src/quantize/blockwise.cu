// CUDA backend of the blockwise FP8 casts (fusible/quantize.h). Bit-identical to blockwise_cpu.cpp:
// amaxes are maxima of abs_bits, scales come from block_scale and casts from scaled_fp8x4 (the
// paired form of scale_element + float_to_fp8, common/numerics.h); only the order of the (exact)
// max reductions differs. (The previous, scalar kernels: git history before issue 17.)
//
// block_cast_kernel<T, F, kTwoD>: one 256-thread block per 128 x 128 tile of the input, read once
// for both copies and held in registers as its raw 16-byte chunks (kR * 16 bytes a thread, widened
// to fp32 only when cast), so no shared-memory input stage is needed and several blocks share an
// SM: 3 of 16-bit input (<= 80 registers), 2 of fp32 (<= 128), each with its 32 or 64 KB of loads
// in flight while the others cast and store. (The old kernel held 64 floats a thread, 236-248
// registers: one block an SM, one tile at a time.)
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
//    column scales (coalesced scale_inv stores). 2D: the tile amax through the same exchange. The
//    amax output: one atomicMax a block.
//  - Rowwise codes: the kC codes of a row as kC / 4 words, one 8-byte (16-bit input) or 4-byte
//    (fp32) store; a warp store covers whole 128-byte rows of the copy.
//  - Columnwise (transposed) codes: scaled_fp8x4 is given four elements of one *column* (four
//    rows), so its word is already a piece of a transposed row, and a thread's kR codes of a column
//    are one 8- or 16-byte shared store into the byte tile tq[c][r] (no byte permutes). The kR-byte
//    units of a tq row are XOR-swizzled (unit g lies at g ^ (cc % units)), so the lanes of a store
//    hit distinct banks; read back as 16-byte pieces (8 lanes = one 128-byte tq row: conflict free
//    in any order) and stored as 16-byte words (a warp covers four 128-byte rows of the copy).
//  - Edges: elements outside the matrix load as +0 (no effect on an amax) and are never stored;
//    unaligned inputs (pointer, or cols % kC) load element by element into the same chunks,
//    unaligned outputs (pointer, cols % kC, rows % 16) store byte by byte; the math is shared.
//
// block_dequantize_kernel<T, F, kVec>: a grid-stride walk over 16-code chunks of the rows of a copy
// [R, C], row and chunk column advanced incrementally (no division per element or chunk), four
// chunks a thread in flight. kVec (16-byte aligned codes and output, C % 16 == 0): one 16-byte
// load of codes, the codes widened in pairs by the hardware (cvt.rn.f16x2.e{4m3,5m2}x2, exact; a
// chunk holding a NaN code goes through fp8_to_float, which defines the NaN), scale_element with
// the chunk's one scale (a chunk never straddles a 128-block), output rounded as numerics.h
// (round_pack8 for 16-bit outputs) and stored as 16-byte words. Otherwise element by element.
#include <climits>
#include <type_traits>

#include "common/cuda_utils.h"
#include "common/device_common.cuh"
#include "common/dispatch.h"
#include "quantize/quantize_impl.h"

namespace fusible {
namespace {

constexpr int kThreads = 256;
constexpr int kTile = FUS_FP8_BLOCK;  // 128
constexpr int kWarps = kThreads / 32;
constexpr unsigned kFull = 0xffffffffu;

// A thread's part of a tile: one 16-byte chunk (kC elements) in each of kR consecutive rows.
template <typename T>
struct Geo {
  static constexpr int kC = 16 / static_cast<int>(sizeof(T));  // columns a thread: 8 / 4
  static constexpr int kCpr = kTile / kC;                      // lanes a tile row: 16 / 32
  static constexpr int kGroups = kThreads / kCpr;              // row groups: 16 / 8
  static constexpr int kR = kTile / kGroups;                   // rows a thread: 8 / 16
  static constexpr int kUnits = kTile / kR;                    // kR-byte units in a tq row
  static_assert(kCpr == 2 * kR && kCpr <= 32 && kR % 4 == 0 && kC % 4 == 0, "tile geometry");
};

// Blocks an SM should hold (register budget: 80 a thread for 16-bit inputs, 128 for fp32).
template <typename T>
constexpr int kMinBlocks = sizeof(T) == 2 ? 3 : 2;

template <typename T>
union Chunk {
  uint4 u;
  T e[16 / sizeof(T)];
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

// Max of v[i] over the L lanes of an aligned lane group (L = 2N, L <= 32), for all N values at
// once: log2(N) halving exchanges (N - 1 shuffles) leave each lane with the partial max of one
// value over N lanes, one butterfly step completes it over L. Returns, on every lane, the max of
// v[bitrev<N>(lane % N)].
template <int N, int L>
__device__ __forceinline__ uint32_t transpose_max(uint32_t (&v)[N]) {
  static_assert(L == 2 * N, "one butterfly step after the exchanges");
  const int lane = threadIdx.x % 32;
#pragma unroll
  for (int s = 0; (1 << s) < N; ++s) {
    const int o = 1 << s, m = N >> s;
    const bool upper = (lane & o) != 0;
#pragma unroll
    for (int k = 0; k < m / 2; ++k) {
      const uint32_t send = upper ? v[k] : v[k + m / 2];
      const uint32_t keep = upper ? v[k + m / 2] : v[k];
      v[k] = max(keep, __shfl_xor_sync(kFull, send, o));
    }
  }
  return max(v[0], __shfl_xor_sync(kFull, v[0], N));
}

// Stores N packed bytes to an N-byte aligned dst with one store.
template <int N>
__device__ __forceinline__ void store_vec(uint8_t* dst, const uint32_t (&w)[N / 4]) {
  if constexpr (N == 16) {
    *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
  } else if constexpr (N == 8) {
    *reinterpret_cast<uint2*>(dst) = make_uint2(w[0], w[1]);
  } else {
    *reinterpret_cast<uint32_t*>(dst) = w[0];
  }
}

// Stores the first min(N, valid) of N packed bytes; as one store when vec and valid >= N.
template <int N>
__device__ __forceinline__ void store_bytes(uint8_t* dst, int64_t valid, bool vec,
                                            const uint32_t (&w)[N / 4]) {
  if (vec && valid >= N) {
    store_vec<N>(dst, w);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i)
      if (i < valid) dst[i] = static_cast<uint8_t>(w[i / 4] >> (8 * (i % 4)));
  }
}

struct CastParams {
  const void* x;
  uint8_t* row_q;  // rowwise codes [rows, cols] or null
  uint8_t* col_q;  // columnwise codes [cols, rows] or null
  float* row_s;    // 1D [nbc, rows], 2D [nbr, nbc]
  float* col_s;    // 1D [nbr, cols], 2D [nbc, nbr]
  float* amax;     // or null
  int64_t rows, cols;
  unsigned nbr, nbc;  // 128-blocks down the rows / along the columns; tile b is (b / nbc, b % nbc)
  float fp8_max, epsilon;
  bool pow2;
  bool vec_in;   // 16-byte input loads: x 16-byte aligned, cols % kC == 0
  bool vec_row;  // kC-byte rowwise stores: row_q kC-byte aligned, cols % kC == 0
  bool vec_col;  // 16-byte columnwise stores: col_q 16-byte aligned, rows % 16 == 0
};

template <typename T, Fp8Format F, bool kTwoD>
__global__ void __launch_bounds__(kThreads, kMinBlocks<T>) block_cast_kernel(const CastParams p) {
  using G = Geo<T>;
  constexpr int kC = G::kC, kR = G::kR, kCpr = G::kCpr;
  __shared__ alignas(16) uint8_t tq[kTile * kTile];  // columnwise codes tq[c][r], swizzled units
  __shared__ alignas(16) uint32_t col_key[kWarps][kTile];  // per-warp column maxima (abs bits)
  __shared__ alignas(16) float col_mul[kTile];
  __shared__ uint32_t warp_key[kWarps];

  const unsigned tr = blockIdx.x / p.nbc, tc = blockIdx.x % p.nbc;
  const int64_t rows = p.rows, cols = p.cols;
  const int64_t r0 = static_cast<int64_t>(tr) * kTile, c0 = static_cast<int64_t>(tc) * kTile;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int cc = threadIdx.x % kCpr, g = threadIdx.x / kCpr;
  const int64_t rt = r0 + g * kR, ct = c0 + cc * kC;  // the thread's first row and column
  const bool full = r0 + kTile <= rows && c0 + kTile <= cols;

  // ---- the thread's kR chunks; +0 outside the matrix
  uint4 raw[kR];
  {
    const T* __restrict__ x = static_cast<const T*>(p.x);
    if (p.vec_in && full) {
      const uint4* src = reinterpret_cast<const uint4*>(x + rt * cols + ct);
      const int64_t pitch = cols / kC;
#pragma unroll
      for (int i = 0; i < kR; ++i) raw[i] = __ldg(src + i * pitch);
    } else if (p.vec_in) {  // cols % kC == 0: a chunk lies wholly inside or outside
#pragma unroll
      for (int i = 0; i < kR; ++i)
        raw[i] = rt + i < rows && ct < cols
                     ? __ldg(reinterpret_cast<const uint4*>(x + (rt + i) * cols + ct))
                     : make_uint4(0u, 0u, 0u, 0u);
    } else {
#pragma unroll
      for (int i = 0; i < kR; ++i) {
        Chunk<T> ch;
#pragma unroll
        for (int e = 0; e < kC; ++e)
          ch.e[e] = rt + i < rows && ct + e < cols ? x[(rt + i) * cols + ct + e] : T{};
        raw[i] = ch.u;
      }
    }
  }

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
  if constexpr (!kTwoD) {
    if (p.row_q) {
      const uint32_t key = transpose_max<kR, kCpr>(rkey);
      row_mul = block_scale(bits_as_float(key_bits<T>(key)), p.fp8_max, p.epsilon, p.pow2);
      const int64_t r = rt + bitrev<kR>(lane % kR);
      if ((lane & kR) == 0 && r < rows)
        p.row_s[static_cast<int64_t>(tc) * rows + r] = 1.0f / row_mul;
    }
  }

  // ---- column maxima and the tile max through shared memory
  const bool need_col = !kTwoD && p.col_q != nullptr;
  const bool need_tile = kTwoD || p.amax != nullptr;
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
        *reinterpret_cast<uint4*>(&col_key[warp][cc * kC + j]) =
            make_uint4(cb[j], cb[j + 1], cb[j + 2], cb[j + 3]);
    }
    if (need_tile) {
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) t = max(t, __shfl_xor_sync(kFull, t, o));
      if (lane == 0) warp_key[warp] = t;
    }
    __syncthreads();
    if (need_tile) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) tile_key = max(tile_key, warp_key[w]);
    }
  }
  float tile_mul = 1.0f;
  if constexpr (kTwoD)
    tile_mul = block_scale(bits_as_float(tile_key), p.fp8_max, p.epsilon, p.pow2);
  if (threadIdx.x == 0) {
    if constexpr (kTwoD) {
      const float inv = 1.0f / tile_mul;
      if (p.row_q) p.row_s[static_cast<int64_t>(tr) * p.nbc + tc] = inv;
      if (p.col_q) p.col_s[static_cast<int64_t>(tc) * p.nbr + tr] = inv;
    }
    if (p.amax && tile_key != 0) atomicMax(reinterpret_cast<unsigned int*>(p.amax), tile_key);
  }
  if (need_col && threadIdx.x < kTile) {  // 1D columnwise scales, one column a thread
    const int c = threadIdx.x;
    uint32_t m = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) m = max(m, col_key[w][c]);
    const float s = block_scale(bits_as_float(m), p.fp8_max, p.epsilon, p.pow2);
    col_mul[c] = s;
    if (c0 + c < cols) p.col_s[static_cast<int64_t>(tr) * cols + c0 + c] = 1.0f / s;
  }

  // ---- rowwise codes
  if (p.row_q) {
    const bool fast = p.vec_row && full;
    uint8_t* dst = p.row_q + rt * cols + ct;
#pragma unroll
    for (int i = 0; i < kR; ++i) {
      const float mul = kTwoD ? tile_mul : __shfl_sync(kFull, row_mul, bitrev<kR>(i), kCpr);
      uint32_t w[kC / 4];
#pragma unroll
      for (int k = 0; k < kC / 4; ++k) {
        const float v[4] = {elem<T>(raw[i], 4 * k), elem<T>(raw[i], 4 * k + 1),
                            elem<T>(raw[i], 4 * k + 2), elem<T>(raw[i], 4 * k + 3)};
        w[k] = scaled_fp8x4<F>(v, mul);
      }
      if (fast) {
        store_vec<kC>(dst + i * cols, w);
      } else if (rt + i < rows && ct < cols) {
        store_bytes<kC>(dst + i * cols, cols - ct, p.vec_row, w);
      }
    }
  }

  // ---- columnwise codes: through tq, stored as 16-byte pieces of the transposed rows
  if (p.col_q) {
    if constexpr (!kTwoD) __syncthreads();  // col_mul
    float cm[kC];
#pragma unroll
    for (int j = 0; j < kC; ++j) cm[j] = kTwoD ? tile_mul : col_mul[cc * kC + j];
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
      store_vec<kR>(&tq[(cc * kC + j) * kTile + unit], w);
    }
    __syncthreads();
#pragma unroll
    for (int k = 0; k < kTile * kTile / 16 / kThreads; ++k) {
      const int q = threadIdx.x + kThreads * k;
      const int c = q / 8, u = q % 8;      // tq row c, rows 16u .. 16u + 15 of the tile
      const int s = (c / kC) % G::kUnits;  // the swizzle of tq row c
      uint4 v;
      if constexpr (kR == 16) {
        v = *reinterpret_cast<const uint4*>(&tq[c * kTile + (u ^ s) * 16]);
      } else {  // 8-byte units 2u, 2u + 1 are the two halves of 16-byte unit u ^ (s / 2)
        v = *reinterpret_cast<const uint4*>(&tq[c * kTile + (u ^ (s >> 1)) * 16]);
        if (s & 1) v = make_uint4(v.z, v.w, v.x, v.y);
      }
      const int64_t cg = c0 + c, rg = r0 + 16 * u;
      if (cg < cols && rg < rows) {
        const uint32_t w[4] = {v.x, v.y, v.z, v.w};
        store_bytes<16>(p.col_q + cg * rows + rg, rows - rg, p.vec_col, w);
      }
    }
  }
}

// ---- dequantize ------------------------------------------------------------------------------

constexpr int kDqChunk = 16;  // codes a chunk
constexpr int kDqUnroll = 4;  // chunks a thread loads before converting any

struct DqParams {
  const uint8_t* q;
  const float* s;
  void* out;
  int64_t R, C;  // the copy [R, C]
  int64_t cpr;   // chunks a row: ceil(C / 16)
  int64_t nbc;   // 128-blocks a row
  bool two_d;
};

// A thread's walk over the chunks blockIdx.x * 256 + threadIdx.x + i * stride of the [R, cpr]
// chunk matrix, as (row, chunk column) advanced without a division per step.
struct DqWalk {
  int64_t row, col, dr, dc;
  __device__ explicit DqWalk(const DqParams& p) {
    const int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
    const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
    row = i / p.cpr;
    col = i - row * p.cpr;
    dr = stride / p.cpr;
    dc = stride - dr * p.cpr;
  }
  __device__ void next(const DqParams& p) {
    row += dr;
    col += dc;
    if (col >= p.cpr) {
      col -= p.cpr;
      ++row;
    }
  }
};

template <Fp8Format F>
__device__ __forceinline__ bool has_nan_code(uint32_t w) {
  const uint32_t m = w & 0x7f7f7f7fu;
  return F == Fp8Format::kE4M3 ? __vcmpeq4(m, 0x7f7f7f7fu) != 0 : __vcmpgtu4(m, 0x7c7c7c7cu) != 0;
}

template <typename T, Fp8Format F, bool kVec>
__global__ void __launch_bounds__(kThreads) block_dequantize_kernel(const DqParams p) {
  const int64_t R = p.R, C = p.C;
  DqWalk w(p);
  while (w.row < R) {
    int64_t row[kDqUnroll], col[kDqUnroll];
    uint4 raw[kDqUnroll];
    float sc[kDqUnroll];
#pragma unroll
    for (int u = 0; u < kDqUnroll; ++u) {  // every load first
      row[u] = w.row;
      col[u] = w.col;
      if (w.row < R) {
        const int64_t j = w.col * kDqChunk;
        const uint8_t* src = p.q + w.row * C + j;
        if constexpr (kVec) {
          raw[u] = __ldg(reinterpret_cast<const uint4*>(src));
        } else {
          Chunk<uint8_t> ch;
#pragma unroll
          for (int e = 0; e < kDqChunk; ++e) ch.e[e] = j + e < C ? src[e] : 0;
          raw[u] = ch.u;
        }
        sc[u] = __ldg(p.s + (p.two_d ? (w.row / kTile) * p.nbc + w.col / (kTile / kDqChunk)
                                     : (w.col / (kTile / kDqChunk)) * R + w.row));
      }
      w.next(p);
    }
#pragma unroll
    for (int u = 0; u < kDqUnroll; ++u) {
      if (row[u] >= R) break;
      const uint32_t qw[4] = {raw[u].x, raw[u].y, raw[u].z, raw[u].w};
      float v[kDqChunk];
      if (kVec && !(has_nan_code<F>(qw[0]) || has_nan_code<F>(qw[1]) || has_nan_code<F>(qw[2]) ||
                    has_nan_code<F>(qw[3]))) {
#pragma unroll
        for (int e = 0; e < kDqChunk; e += 2) {
          const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(
              static_cast<__nv_fp8x2_storage_t>(qw[e / 4] >> (8 * (e % 4))),
              F == Fp8Format::kE4M3 ? __NV_E4M3 : __NV_E5M2);
          v[e] = __half2float(__ushort_as_half(h.x));
          v[e + 1] = __half2float(__ushort_as_half(h.y));
        }
      } else {
#pragma unroll
        for (int e = 0; e < kDqChunk; ++e)
          v[e] = fp8_to_float<F>(static_cast<uint8_t>(qw[e / 4] >> (8 * (e % 4))));
      }
#pragma unroll
      for (int e = 0; e < kDqChunk; ++e) v[e] = scale_element(v[e], sc[u]);
      T* out = static_cast<T*>(p.out) + row[u] * C + col[u] * kDqChunk;
      if constexpr (kVec) {
        uint4* dst = reinterpret_cast<uint4*>(out);
        if constexpr (sizeof(T) == 4) {
#pragma unroll
          for (int k = 0; k < kDqChunk / 4; ++k)
            dst[k] = make_uint4(float_as_bits(v[4 * k]), float_as_bits(v[4 * k + 1]),
                                float_as_bits(v[4 * k + 2]), float_as_bits(v[4 * k + 3]));
        } else {
#pragma unroll
          for (int k = 0; k < kDqChunk / 8; ++k) {
            float h[8];
#pragma unroll
            for (int e = 0; e < 8; ++e) h[e] = v[8 * k + e];
            dst[k] = fused::round_pack8<T>(h);
          }
        }
      } else {
        const int64_t j = col[u] * kDqChunk;
#pragma unroll
        for (int e = 0; e < kDqChunk; ++e)
          if (j + e < C) Element<T>::store(out, e, v[e]);
      }
    }
  }
}

}  // namespace

void quantize_blockwise_cuda(const fus_tensor& input, const fus_quantized& out,
                             const BlockScaling& bs, const fus_context& ctx) {
  CudaDeviceGuard guard(ctx.device_index);
  cudaStream_t stream = stream_of(ctx);
  if (out.amax) FUS_CUDA_CHECK(cudaMemsetAsync(out.amax, 0, sizeof(float), stream));
  const int64_t rows = input.rows, cols = input.cols;
  if (rows * cols == 0) return;
  const int64_t nbr = ceil_div(rows, kTile), nbc = ceil_div(cols, kTile);
  if (nbr * nbc > INT_MAX)
    throw Error(FUS_ERROR_UNSUPPORTED,
                "fus_quantize_blockwise: matrix too large for the CUDA backend");
  CastParams p{};
  p.x = input.data;
  p.row_q = static_cast<uint8_t*>(out.rowwise_data);
  p.col_q = static_cast<uint8_t*>(out.columnwise_data);
  p.row_s = static_cast<float*>(out.rowwise_scale_inv);
  p.col_s = static_cast<float*>(out.columnwise_scale_inv);
  p.amax = out.amax;
  p.rows = rows;
  p.cols = cols;
  p.nbr = static_cast<unsigned>(nbr);
  p.nbc = static_cast<unsigned>(nbc);
  p.fp8_max = fus_fp8_max(out.dtype);
  p.epsilon = bs.epsilon;
  p.pow2 = bs.pow2;
  const bool two_d = out.mode == FUS_SCALING_BLOCK_2D;
  p.vec_col = rows % 16 == 0 && is_aligned(p.col_q, 16);
  dispatch_hp(input.dtype, [&](auto t) {
    using T = decltype(t);
    constexpr int kC = Geo<T>::kC;
    p.vec_in = cols % kC == 0 && is_aligned(p.x, 16);
    p.vec_row = cols % kC == 0 && is_aligned(p.row_q, kC);
    dispatch_fp8(out.dtype, [&](auto f) {
      constexpr Fp8Format F = decltype(f)::value;
      const auto kernel = two_d ? block_cast_kernel<T, F, true> : block_cast_kernel<T, F, false>;
      kernel<<<static_cast<unsigned>(nbr * nbc), kThreads, 0, stream>>>(p);
      FUS_CUDA_CHECK_LAUNCH("block_cast_kernel");
    });
  });
}

void dequantize_blockwise_cuda(const fus_quantized& in, bool columnwise, const fus_tensor& output,
                               const fus_context& ctx) {
  CudaDeviceGuard guard(ctx.device_index);
  cudaStream_t stream = stream_of(ctx);
  const int64_t R = output.rows, C = output.cols;
  if (R * C == 0) return;
  DqParams p{};
  p.q = static_cast<const uint8_t*>(columnwise ? in.columnwise_data : in.rowwise_data);
  p.s = static_cast<const float*>(columnwise ? in.columnwise_scale_inv : in.rowwise_scale_inv);
  p.out = output.data;
  p.R = R;
  p.C = C;
  p.cpr = ceil_div(C, kDqChunk);
  p.nbc = ceil_div(C, kTile);
  p.two_d = in.mode == FUS_SCALING_BLOCK_2D;
  const bool vec = C % kDqChunk == 0 && is_aligned(p.q, 16) && is_aligned(p.out, 16);
  const int64_t work = ceil_div(ceil_div(R * p.cpr, kDqUnroll), kThreads);
  dispatch_hp(output.dtype, [&](auto t) {
    using T = decltype(t);
    dispatch_fp8(in.dtype, [&](auto f) {
      constexpr Fp8Format F = decltype(f)::value;
      const auto kernel =
          vec ? block_dequantize_kernel<T, F, true> : block_dequantize_kernel<T, F, false>;
      kernel<<<persistent_blocks(kernel, kThreads, work), kThreads, 0, stream>>>(p);
      FUS_CUDA_CHECK_LAUNCH("block_dequantize_kernel");
    });
  });
}

}  // namespace fusible
