// CUDA backend of the quantize family. Bit-identical to common/cast_cpu.cpp: every value goes through
// the shared numerics (common/numerics.h); only the memory access pattern differs.
//
// All kernels are memory bound and use 256 threads a block.
//  - The casts are persistent: each block walks tiles with a grid stride. A thread's input chunks
//    (16 bytes each, 64 bytes a tile) are fetched with cp.async into thread-private slots of a
//    shared-memory ring, one tile (two for 16-bit MXFP8) ahead of the tile being cast, so loads
//    stay in flight through the casts and barriers without holding registers.
//  - cast_transpose_kernel (per tensor): a tile of 64 columns by 128 (16-bit input) or 64 (fp32)
//    rows. The rowwise copy is stored from registers (8- or 4-byte stores); the transposed copy
//    goes through a shared-memory byte tile, read back as words, transposed 4x4 bytes at a time
//    with byte permutes and stored as 16-byte pieces (64 contiguous bytes per 4 lanes).
//  - mxfp8_kernel: a tile of 128 columns by 32 rows (one block of the columnwise scaling, four of
//    the rowwise scaling per row). Row-block amax by warp shuffles, column-block amax through
//    shared memory; the input is read once for both copies.
//  - amax_kernel: grid-stride loop, four 16-byte loads a thread per iteration.
//  - dequantize_kernel: 16-byte fp8 loads, several per thread in flight; fp8 decoding through a
//    256-entry shared table built with the shared numerics (per tensor the table holds the final
//    output bits).
// (The FP8 byte transpose, which the normalization family uses too, is common/cast.cu; the
// tile loads and transposed stores both share are common/tile_io.cuh.)
// amax is a max over abs_bits (uint32), so NaN propagates; blocks combine with one atomicMax on
// the bits of a float zeroed by cudaMemsetAsync on the same stream -- or, with amax_accumulate,
// on the caller's running amax as it is (no reset), the same max over one more value.
#include <climits>

#include "common/cuda_utils.h"
#include "common/device_common.cuh"
#include "common/dispatch.h"
#include "common/tile_io.cuh"
#include "quantize/quantize_impl.h"

namespace fusible {
namespace {

using namespace tile_io;  // NOLINT(build/namespaces): the shared tile loads and stores

constexpr int kThreads = 256;
constexpr int kMx = FUS_MXFP8_BLOCK;

template <typename T>
__device__ __forceinline__ float chunk_elem(const uint4& raw, int i) {
  Chunk<T> c;
  c.u = raw;
  return Element<T>::load(c.e, i);
}

// Casts the N elements of a chunk (each times its multiplier, NaN rule of scale_element) to N fp8
// bytes packed in words.
template <typename T, Fp8Format F, int N = kVec<T>>
__device__ __forceinline__ void cast_chunk(const uint4& raw, const float (&s)[N],
                                           uint32_t (&w)[N / 4]) {
#pragma unroll
  for (int j = 0; j < N / 4; ++j) {
    float x[4], m[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      x[i] = chunk_elem<T>(raw, 4 * j + i);
      m[i] = s[4 * j + i];
    }
    w[j] = scaled_fp8x4<F>(x, m);
  }
}

template <typename T, int N = kVec<T>>
__device__ __forceinline__ uint32_t chunk_amax(const uint4& raw) {
  if constexpr (sizeof(T) == 2) {
    return fused::amax16_bits<T>(fused::amax16_update(0u, raw));  // on packed magnitudes
  } else {
    uint32_t m = 0;
#pragma unroll
    for (int i = 0; i < N; ++i) m = max(m, abs_bits(chunk_elem<T>(raw, i)));
    return m;
  }
}

// Geometry of a cast tile: kCols columns; every thread owns kSteps 16-byte chunks, rows
// tr + k * kRps at columns [tc, tc + kVec).
template <typename T, int kCols, int kStepsT>
struct TileShape {
  static constexpr int kSteps = kStepsT;
  static constexpr int kCpr = kCols / kVec<T>;  // chunks per tile row
  static constexpr int kRps = kThreads / kCpr;  // tile rows one step of all threads covers
  static constexpr int kRows = kRps * kSteps;
  static constexpr int kTileCols = kCols;
};

// Ring of thread-private input slots: stage s, chunk k of thread i is slot[s][k][i], so a warp's
// 16-byte accesses are contiguous. kStages - 1 tiles are in flight while one is being cast.
template <typename S, int kStages>
struct InputRing {
  uint4 slot[kStages][S::kSteps][kThreads];
};

// Issues the loads of tile w (if any) into stage s of the ring and commits them as one group
// (always, so the group count stays in step with the tiles). Elements outside the matrix read as
// +0, which changes no amax and is never stored. Unaligned inputs are loaded element by element.
template <typename T, typename S, int kStages>
__device__ __forceinline__ void issue_tile(const CastParams& p, InputRing<S, kStages>& ring,
                                           const TileWalk& w, int s) {
  if (w.valid(p)) {
    const T* __restrict__ x = static_cast<const T*>(p.x);
    const int64_t r0 = static_cast<int64_t>(w.tr) * S::kRows,
                  c0 = static_cast<int64_t>(w.tc) * S::kTileCols;
    const int64_t r = r0 + threadIdx.x / S::kCpr, c = c0 + threadIdx.x % S::kCpr * kVec<T>;
    if (p.vec_in && r0 + S::kRows <= p.rows && c0 + S::kTileCols <= p.cols) {
      const T* src = x + r * p.cols + c;
#pragma unroll
      for (int k = 0; k < S::kSteps; ++k)
        cp_async16(&ring.slot[s][k][threadIdx.x], src + k * S::kRps * p.cols, true);
    } else {
#pragma unroll
      for (int k = 0; k < S::kSteps; ++k) {
        const int64_t rr = r + k * S::kRps;
        uint4* dst = &ring.slot[s][k][threadIdx.x];
        if (p.vec_in) {  // cols % kVec == 0: a chunk is wholly inside or outside
          const bool in = rr < p.rows && c < p.cols;
          cp_async16(dst, in ? x + rr * p.cols + c : x, in);
        } else {
          Chunk<T> ch;
#pragma unroll
          for (int i = 0; i < kVec<T>; ++i)
            ch.e[i] = rr < p.rows && c + i < p.cols ? x[rr * p.cols + c + i] : T{};
          *dst = ch.u;
        }
      }
    }
  }
  cp_async_commit();
}

// Shapes and ring depths (about 64 bytes of loads in flight per thread; static shared memory
// stays under 48 KB).
template <typename T>
using PtShape = TileShape<T, 64, 4>;
template <typename T>
using MxShape = TileShape<T, 128, kMx / (kThreads / (128 / kVec<T>))>;  // 32 rows: one block
template <typename T>
constexpr int kPtStages = 2;
template <typename T>
constexpr int kMxStages = 1 + 64 / (MxShape<T>::kSteps * 16);

// The per-tensor cast of p with `scale` (the body of cast_transpose_kernel and of one group of
// grouped_cast_transpose_kernel).
template <typename T, Fp8Format F>
__device__ __forceinline__ void cast_transpose_body(const CastParams& p, const float scale) {
  constexpr int N = kVec<T>;
  using S = PtShape<T>;
  constexpr int kStages = kPtStages<T>, kTr = S::kRows, kTc = S::kTileCols;
  constexpr int kGroups = kTr / 16;            // 16-row groups of the tile
  constexpr int kPitch = kTc, kGroupPad = 32;  // bytes
  static_assert(kTc == 64 && kTr % 64 == 0, "the gather mapping assumes 64 columns");
  __shared__ InputRing<S, kStages> ring;
  // fp8 tile for the transpose: rows of 64 bytes, 32 bytes of padding after every 16 rows. Row
  // writes (two rows per half-warp) fall in disjoint bank halves; the gather's word reads (four
  // row groups x eight columns of words per warp) hit 32 distinct banks.
  __shared__ alignas(16) uint8_t tile[kTr * kPitch + kGroups * kGroupPad];
  auto at = [](int r, int c) { return r * kPitch + (r >> 4) * kGroupPad + c; };

  const int64_t rows = p.rows, cols = p.cols;
  const int tr = threadIdx.x / S::kCpr, tc = threadIdx.x % S::kCpr * N;
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  // Gather: 4 tile columns (4 * cg ...) x 16 rows (group j) per thread; the lanes of one j % 4
  // quad store 64 contiguous bytes of one transposed row.
  const int cg = (warp & 1) * 8 + (lane >> 2), j = (warp >> 1) * 4 + (lane & 3);
  float s[N];
#pragma unroll
  for (int i = 0; i < N; ++i) s[i] = scale;

  uint32_t amax = 0;
  auto issue = [&](const TileWalk& t, int st) { issue_tile<T, S, kStages>(p, ring, t, st); };
  walk_tiles<kStages>(p, issue, [&](const TileWalk& w, int stage) {
    const int64_t r0 = static_cast<int64_t>(w.tr) * kTr, c0 = static_cast<int64_t>(w.tc) * kTc;
    const bool full = r0 + kTr <= rows && c0 + kTc <= cols;
    const bool fast_row = full && p.vec_row, fast_col = full && p.vec_col;
    uint8_t* row_out = p.row + (r0 + tr) * cols + c0 + tc;
#pragma unroll
    for (int k = 0; k < S::kSteps; ++k) {
      const uint4 raw = ring.slot[stage][k][threadIdx.x];
      amax = max(amax, chunk_amax<T>(raw));
      uint32_t q[N / 4];
      cast_chunk<T, F>(raw, s, q);
      const int lr = tr + k * S::kRps;
      if (p.row) {
        uint8_t* dst = row_out + k * S::kRps * cols;
        if (fast_row) {
          store_vec<N>(dst, q);
        } else {
          store_bytes<N>(dst, r0 + lr < rows ? cols - c0 - tc : 0, p.vec_row, q);
        }
      }
      if (p.col) {
        if constexpr (N == 8) {
          *reinterpret_cast<uint2*>(&tile[at(lr, tc)]) = make_uint2(q[0], q[1]);
        } else {
          *reinterpret_cast<uint32_t*>(&tile[at(lr, tc)]) = q[0];
        }
      }
    }
    if (p.col) {
      __syncthreads();
      if (j < kGroups) {
        const int64_t r = r0 + 16 * j, cc = c0 + 4 * cg;
        store_transposed16([&](int row, int col) { return &tile[at(row, col)]; }, 16 * j, 4 * cg,
                           p.col + cc * rows + r, rows, r, cc, cols, fast_col, p.vec_col);
      }
      __syncthreads();  // the tile is rewritten by the next iteration
    }
  });

  if (p.amax) fused::block_amax(amax, p.amax);
  // Same division as the CPU backend (IEEE, no fast math).
  if (p.scale_inv && blockIdx.x == 0 && threadIdx.x == 0) *p.scale_inv = 1.0f / scale;
}

template <typename T, Fp8Format F>
__global__ void __launch_bounds__(kThreads) cast_transpose_kernel(const CastParams p) {
  cast_transpose_body<T, F>(p, *p.scale);
}

// Current scaling: every block derives the scale from the amax of the amax pass before it with
// the shared numerics (compute_scale, fallback 1, as scale_from_amax_kernel) and block 0 writes it
// out, so the scale costs no launch of its own; the bits are those of the two-kernel sequence.
template <typename T, Fp8Format F>
__global__ void __launch_bounds__(kThreads)
    cast_transpose_current_kernel(const CastParams p, CurrentScale c) {
  const float scale = compute_scale(*c.amax, c.fp8_max, c.margin, 1.0f);
  if (blockIdx.x == 0 && threadIdx.x == 0) *c.scale = scale;
  cast_transpose_body<T, F>(p, scale);
}

// ---- grouped per-tensor casts (fus_quantize_grouped) ---------------------------------------------
// One launch casts up to kMaxGroups tensors: blockIdx.y is the group, whose blocks walk its tiles
// with a stride of gridDim.x (a block past its group's tiles only writes its share of nothing). For
// current scaling every block derives the group's scale from the amax of the preceding amax pass
// with the shared numerics (compute_scale, fallback 1, as compute_scale_kernel), and block 0
// writes it out; so a grouped cast is the per-tensor cast of each group, bit for bit.
constexpr int kMaxGroups = 32;

struct GroupedCastParams {
  CastParams p[kMaxGroups];
  const float* amax_in[kMaxGroups];  // current scaling: the group's amax (already reduced)
  float* scale_out[kMaxGroups];      // current scaling: where the group's scale goes
  float fp8_max;
  int margin;
  bool current;
};

template <typename T, Fp8Format F>
__global__ void __launch_bounds__(kThreads)
    grouped_cast_transpose_kernel(const GroupedCastParams g) {
  const unsigned gi = blockIdx.y;
  const CastParams p = g.p[gi];
  float scale;
  if (g.current) {
    scale = compute_scale(*g.amax_in[gi], g.fp8_max, g.margin, 1.0f);
    if (blockIdx.x == 0 && threadIdx.x == 0) *g.scale_out[gi] = scale;
  } else {
    scale = *p.scale;
  }
  cast_transpose_body<T, F>(p, scale);
}

template <typename T, Fp8Format F>
__global__ void __launch_bounds__(kThreads) mxfp8_kernel(const CastParams p) {
  constexpr int N = kVec<T>;
  using S = MxShape<T>;
  constexpr int kStages = kMxStages<T>, kTc = S::kTileCols;
  constexpr int kLanesPerBlock = kMx / N;  // lanes holding one 32-wide row block
  static_assert(S::kRows == kMx && S::kCpr <= 32 && 32 % S::kCpr == 0, "tile geometry");
  __shared__ InputRing<S, kStages> ring;
  // Per-thread-row partial column amaxes, then the tile's column multipliers.
  __shared__ alignas(16) uint32_t col_amax[S::kRps][kTc];
  __shared__ float col_mult[kTc];

  const int64_t rows = p.rows, cols = p.cols, nb = (cols + kMx - 1) / kMx;
  const int tr = threadIdx.x / S::kCpr, tc = threadIdx.x % S::kCpr * N;

  uint32_t amax = 0;
  auto issue = [&](const TileWalk& t, int st) { issue_tile<T, S, kStages>(p, ring, t, st); };
  walk_tiles<kStages>(p, issue, [&](const TileWalk& w, int stage) {
    const int64_t r0 = static_cast<int64_t>(w.tr) * S::kRows, c0 = static_cast<int64_t>(w.tc) * kTc;
    const bool full = r0 + S::kRows <= rows && c0 + kTc <= cols;
    const bool fast_row = full && p.vec_row, fast_col = full && p.vec_col;
    const int64_t c = c0 + tc, out_off = (r0 + tr) * cols + c;
    uint8_t* row_scale = p.row_scale + (r0 + tr) * nb + c / kMx;
    uint32_t cmax[N];
#pragma unroll
    for (int i = 0; i < N; ++i) cmax[i] = 0;
#pragma unroll
    for (int k = 0; k < S::kSteps; ++k) {
      const uint4 raw = ring.slot[stage][k][threadIdx.x];
      uint32_t bmax = 0;
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const uint32_t a = abs_bits(chunk_elem<T>(raw, i));
        cmax[i] = max(cmax[i], a);
        bmax = max(bmax, a);
      }
      amax = max(amax, bmax);
      if (p.row) {
        // The kLanesPerBlock consecutive lanes of one 32-wide block (same row) combine.
#pragma unroll
        for (int off = 1; off < kLanesPerBlock; off <<= 1)
          bmax = max(bmax, __shfl_xor_sync(fused::kFull, bmax, off));
        const uint8_t e = e8m0_from_amax<F>(bits_as_float(bmax));
        const float m = e8m0_inverse(e);
        float sr[N];
#pragma unroll
        for (int i = 0; i < N; ++i) sr[i] = m;
        uint32_t q[N / 4];
        cast_chunk<T, F>(raw, sr, q);
        uint8_t* dst = p.row + out_off + k * S::kRps * cols;
        const bool in = full || (r0 + tr + k * S::kRps < rows && c < cols);
        if (fast_row) {
          store_vec<N>(dst, q);
        } else if (in) {
          store_bytes<N>(dst, cols - c, p.vec_row, q);
        }
        if (threadIdx.x % kLanesPerBlock == 0 && in) row_scale[k * S::kRps * nb] = e;
      }
    }

    if (p.col) {
#pragma unroll
      for (int i = 0; i < N; i += 4)
        *reinterpret_cast<uint4*>(&col_amax[tr][tc + i]) =
            make_uint4(cmax[i], cmax[i + 1], cmax[i + 2], cmax[i + 3]);
      __syncthreads();
      if (threadIdx.x < kTc) {
        uint32_t m = 0;
#pragma unroll
        for (int k = 0; k < S::kRps; ++k) m = max(m, col_amax[k][threadIdx.x]);
        const uint8_t e = e8m0_from_amax<F>(bits_as_float(m));
        col_mult[threadIdx.x] = e8m0_inverse(e);
        if (c0 + threadIdx.x < cols) p.col_scale[r0 / kMx * cols + c0 + threadIdx.x] = e;
      }
      // Also orders this tile's col_amax reads before the next tile's writes.
      __syncthreads();
      float sc[N];
#pragma unroll
      for (int i = 0; i < N; ++i) sc[i] = col_mult[tc + i];
#pragma unroll
      for (int k = 0; k < S::kSteps; ++k) {
        uint32_t q[N / 4];
        cast_chunk<T, F>(ring.slot[stage][k][threadIdx.x], sc, q);
        uint8_t* dst = p.col + out_off + k * S::kRps * cols;
        if (fast_col) {
          store_vec<N>(dst, q);
        } else if (r0 + tr + k * S::kRps < rows && c < cols) {
          store_bytes<N>(dst, cols - c, p.vec_col, q);
        }
      }
      // The next tile's col_mult writes come after its first barrier, which every thread reaches
      // only after reading col_mult here.
    }
  });

  if (p.amax) fused::block_amax(amax, p.amax);
}

// amax over x[0, n). x + head is 16-byte aligned; [head, head + nv * N) is read as vectors, four
// per thread per iteration to keep enough bytes in flight.
template <typename T>
__device__ __forceinline__ void amax_body(const T* __restrict__ x, int64_t n, int64_t head,
                                          float* amax) {
  constexpr int N = kVec<T>, kUnroll = 4;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  const int64_t nv = (n - head) / N;
  const uint4* __restrict__ xv = reinterpret_cast<const uint4*>(x + head);
  uint32_t m = 0;
  int64_t i = tid;
  for (; i + (kUnroll - 1) * stride < nv; i += kUnroll * stride) {
    uint4 raw[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) raw[u] = __ldg(xv + i + u * stride);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) m = max(m, chunk_amax<T>(raw[u]));
  }
  for (; i < nv; i += stride) m = max(m, chunk_amax<T>(__ldg(xv + i)));
  // The unaligned head and the tail after the last whole vector.
  if (tid < head) m = max(m, abs_bits(Element<T>::load(x, tid)));
  for (int64_t j = head + nv * N + tid; j < n; j += stride)
    m = max(m, abs_bits(Element<T>::load(x, j)));
  fused::block_amax(m, amax);
}

template <typename T>
__global__ void __launch_bounds__(kThreads)
    amax_kernel(const T* __restrict__ x, int64_t n, int64_t head, float* amax) {
  amax_body<T>(x, n, head, amax);
}

// Grouped amax pass (blockIdx.y is the group) and the reset of the groups' amaxes before it.
struct GroupedAmaxParams {
  const void* x[kMaxGroups];
  int64_t n[kMaxGroups], head[kMaxGroups];
  float* amax[kMaxGroups];
};

template <typename T>
__global__ void __launch_bounds__(kThreads) grouped_amax_kernel(const GroupedAmaxParams g) {
  const unsigned gi = blockIdx.y;
  if (g.n[gi] == 0) return;
  amax_body<T>(static_cast<const T*>(g.x[gi]), g.n[gi], g.head[gi], g.amax[gi]);
}

struct AmaxPointers {
  float* amax[kMaxGroups];
  int count;
};

__global__ void zero_amax_kernel(const AmaxPointers z) {
  if (static_cast<int>(threadIdx.x) < z.count && z.amax[threadIdx.x]) *z.amax[threadIdx.x] = 0.0f;
}

enum class DqMode { kPerTensor, kMxRow, kMxCol };

struct DqParams {
  const uint8_t* q;   // fp8 [rows, cols] (a per-tensor copy is viewed as [1, rows * cols])
  const void* scale;  // float[1] scale_inv, or the E8M0 scales of the copy
  void* y;            // output [rows, cols]
  int64_t rows, cols;
  // Chunks of 16 elements handled with 16-byte loads: all of them when vectorizable (then, for
  // MXFP8, cols % 16 == 0 and chunk i starts at element 16 * i), else none. Elements from
  // 16 * vec_chunks on are handled one by one.
  int64_t vec_chunks;
  bool idx32;  // vec_chunks fits 32 bits: cheaper index division
};

// The bits of v stored as a T, in the low bits of a word.
template <typename T>
__device__ __forceinline__ uint32_t encode(float v) {
  union {
    T e;
    uint32_t u;
  } o;
  o.u = 0;
  Element<T>::store(&o.e, 0, v);
  return o.u;
}

template <typename T, Fp8Format F, DqMode M>
__global__ void __launch_bounds__(kThreads) dequantize_kernel(const DqParams p) {
  constexpr bool kPt = M == DqMode::kPerTensor;
  // Chunks a thread loads before using any. MXFP8 has more arithmetic and state per chunk.
  constexpr int kC = 16, kUnroll = kPt ? 4 : 2, kWords = kC * sizeof(T) / 4;
  static_assert(kThreads == 256, "one table entry per thread");
  // Per tensor: the output bits of every code (the whole computation, done with the shared
  // numerics). MXFP8: the float value of every code.
  __shared__ uint32_t lut[256];
  {
    const float v = fp8_to_float<F>(static_cast<uint8_t>(threadIdx.x));
    lut[threadIdx.x] =
        kPt ? encode<T>(scale_element(v, *static_cast<const float*>(p.scale))) : float_as_bits(v);
  }
  __syncthreads();

  const uint8_t* __restrict__ sb = static_cast<const uint8_t*>(p.scale);
  const int64_t cols = p.cols, n = p.rows * cols, nv = p.vec_chunks;
  const int64_t cpr = cols / kC, nb = (cols + kMx - 1) / kMx;
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;

  for (int64_t base = tid; base < nv; base += kUnroll * stride) {
    uint4 raw[kUnroll], sraw[kUnroll];
    uint32_t rs[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {  // every load first
      const int64_t i = base + u * stride;
      if (i >= nv) break;
      raw[u] = __ldg(reinterpret_cast<const uint4*>(p.q) + i);
      if constexpr (!kPt) {
        const int64_t r = p.idx32 ? static_cast<uint32_t>(i) / static_cast<uint32_t>(cpr) : i / cpr;
        const int64_t c = (i - r * cpr) * kC;
        if constexpr (M == DqMode::kMxCol)
          sraw[u] = __ldg(reinterpret_cast<const uint4*>(sb + (r / kMx) * cols + c));
        else
          rs[u] = sb[r * nb + c / kMx];
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * stride;
      if (i >= nv) break;
      const uint32_t qw[4] = {raw[u].x, raw[u].y, raw[u].z, raw[u].w};
      const uint32_t sw[4] = {sraw[u].x, sraw[u].y, sraw[u].z, sraw[u].w};
      uint32_t ow[kWords];
#pragma unroll
      for (int e = 0; e < kC; ++e) {
        uint32_t bits = lut[(qw[e / 4] >> (8 * (e % 4))) & 0xffu];
        if constexpr (!kPt) {
          const uint32_t s = M == DqMode::kMxRow ? rs[u] : sw[e / 4] >> (8 * (e % 4));
          bits =
              encode<T>(scale_element(bits_as_float(bits), e8m0_to_float(static_cast<uint8_t>(s))));
        }
        if constexpr (sizeof(T) == 4) {
          ow[e] = bits;
        } else if (e % 2 == 0) {
          ow[e / 2] = bits;
        } else {
          ow[e / 2] |= bits << 16;
        }
      }
      uint4* dst = reinterpret_cast<uint4*>(static_cast<T*>(p.y) + i * kC);
#pragma unroll
      for (int j = 0; j < kWords / 4; ++j)
        dst[j] = make_uint4(ow[4 * j], ow[4 * j + 1], ow[4 * j + 2], ow[4 * j + 3]);
    }
  }

  // The tail after the last chunk, or every element of an unaligned or odd-shaped copy.
  for (int64_t i = nv * kC + tid; i < n; i += stride) {
    const uint32_t bits = lut[p.q[i]];
    if constexpr (kPt) {
      if constexpr (sizeof(T) == 4) {
        static_cast<uint32_t*>(p.y)[i] = bits;
      } else {
        static_cast<uint16_t*>(p.y)[i] = static_cast<uint16_t>(bits);
      }
    } else {
      const int64_t r = i / cols, c = i - r * cols;
      const uint8_t s = M == DqMode::kMxRow ? sb[r * nb + c / kMx] : sb[(r / kMx) * cols + c];
      Element<T>::store(static_cast<T*>(p.y), i,
                        scale_element(bits_as_float(bits), e8m0_to_float(s)));
    }
  }
}

}  // namespace

void quantize_cuda(const fus_tensor& input, const fus_quantized& out, const fus_context& ctx,
                   const CurrentScale* current) {
  CudaDeviceGuard guard(ctx.device_index);
  const cudaStream_t stream = stream_of(ctx);
  const int64_t rows = input.rows, cols = input.cols;
  const bool per_tensor = out.mode == FUS_SCALING_PER_TENSOR;
  fused::begin_cast(&out, rows * cols == 0, stream);
  if (rows * cols == 0) return;

  CastParams p{};
  p.x = input.data;
  p.row = static_cast<uint8_t*>(out.rowwise_data);
  p.col = static_cast<uint8_t*>(out.columnwise_data);
  p.row_scale = per_tensor ? nullptr : static_cast<uint8_t*>(out.rowwise_scale_inv);
  p.col_scale = per_tensor ? nullptr : static_cast<uint8_t*>(out.columnwise_scale_inv);
  p.scale = out.scale;
  p.scale_inv = per_tensor ? static_cast<float*>(out.rowwise_scale_inv) : nullptr;
  p.amax = out.amax;
  p.rows = rows;
  p.cols = cols;

  dispatch_hp(input.dtype, [&](auto t) {
    using T = decltype(t);
    constexpr int N = kVec<T>;
    const int64_t tile_r = per_tensor ? PtShape<T>::kRows : MxShape<T>::kRows;
    const int64_t tile_c = per_tensor ? PtShape<T>::kTileCols : MxShape<T>::kTileCols;
    const int64_t tiles = ceil_div(rows, tile_r) * ceil_div(cols, tile_c);
    if (tiles > INT_MAX)
      throw Error(FUS_ERROR_UNSUPPORTED, "fus_quantize: matrix too large for the CUDA backend");
    p.tiles_r = static_cast<unsigned>(ceil_div(rows, tile_r));
    p.tiles_c = static_cast<unsigned>(ceil_div(cols, tile_c));
    const bool cols_vec = cols % N == 0;
    p.vec_in = cols_vec && is_aligned(p.x, 16);
    p.vec_row = cols_vec && is_aligned(p.row, N);
    // Transposed rows are `rows` bytes long and leave as 16-byte pieces; MXFP8's columnwise copy
    // has the rowwise layout.
    p.vec_col =
        per_tensor ? rows % 16 == 0 && is_aligned(p.col, 16) : cols_vec && is_aligned(p.col, N);
    dispatch_fp8(out.dtype, [&](auto f) {
      constexpr Fp8Format F = decltype(f)::value;
      if (current != nullptr) {
        const auto kernel = cast_transpose_current_kernel<T, F>;
        kernel<<<persistent_blocks(kernel, kThreads, tiles), kThreads, 0, stream>>>(p, *current);
        FUS_CUDA_CHECK_LAUNCH("cast_transpose_current_kernel");
        return;
      }
      const auto kernel = per_tensor ? cast_transpose_kernel<T, F> : mxfp8_kernel<T, F>;
      kernel<<<persistent_blocks(kernel, kThreads, tiles), kThreads, 0, stream>>>(p);
      FUS_CUDA_CHECK_LAUNCH(per_tensor ? "cast_transpose_kernel" : "mxfp8_kernel");
    });
  });
}

namespace {

// Elements before the first 16-byte boundary of x, read one by one by the amax kernels.
template <typename T>
int64_t amax_head(const void* x, int64_t n) {
  const uintptr_t addr = reinterpret_cast<uintptr_t>(x);
  int64_t head = addr % sizeof(T) ? n : static_cast<int64_t>((16 - addr % 16) % 16 / sizeof(T));
  return head > n ? n : head;
}

// Groups [first, first + count) of a grouped cast (count <= kMaxGroups): amax reset, amax pass
// (current scaling), cast.
void quantize_group_chunk(const fus_tensor* inputs, const fus_quantized* outs, int64_t count,
                          bool current, int margin, cudaStream_t stream) {
  AmaxPointers z{};
  z.count = static_cast<int>(count);
  bool any_amax = false;
  for (int64_t g = 0; g < count; ++g) {
    // An accumulating group's amax is not reset: the cast max-combines into it.
    z.amax[g] = outs[g].amax_accumulate ? nullptr : outs[g].amax;
    any_amax = any_amax || z.amax[g] != nullptr;
  }
  if (any_amax) {
    zero_amax_kernel<<<1, kMaxGroups, 0, stream>>>(z);
    FUS_CUDA_CHECK_LAUNCH("zero_amax_kernel");
  }
  dispatch_hp(inputs[0].dtype, [&](auto t) {
    using T = decltype(t);
    constexpr int N = kVec<T>;
    using S = PtShape<T>;
    const auto count_u = static_cast<unsigned>(count);
    if (current) {
      GroupedAmaxParams a{};
      int64_t most = 0;
      for (int64_t g = 0; g < count; ++g) {
        const int64_t n = inputs[g].rows * inputs[g].cols;
        a.x[g] = inputs[g].data;
        a.n[g] = n;
        a.head[g] = n ? amax_head<T>(inputs[g].data, n) : 0;
        a.amax[g] = outs[g].amax;
        const int64_t work = ceil_div((n - a.head[g]) / N / 4 + a.head[g], kThreads);
        most = work > most ? work : most;
      }
      if (most > 0) {
        // A wave of blocks shared by the groups; each group's blocks stride over its elements.
        const int64_t resident = persistent_blocks(grouped_amax_kernel<T>, kThreads, INT_MAX);
        int64_t gx = ceil_div(resident, count);
        gx = gx < most ? gx : most;
        const dim3 grid(static_cast<unsigned>(gx < 1 ? 1 : gx), count_u);
        grouped_amax_kernel<T><<<grid, kThreads, 0, stream>>>(a);
        FUS_CUDA_CHECK_LAUNCH("grouped_amax_kernel");
      }
    }
    GroupedCastParams gp{};
    gp.current = current;
    gp.margin = margin;
    gp.fp8_max = fus_fp8_max(outs[0].dtype);
    int64_t most_tiles = 0;
    for (int64_t g = 0; g < count; ++g) {
      const fus_tensor& in = inputs[g];
      const fus_quantized& out = outs[g];
      CastParams& p = gp.p[g];
      const int64_t rows = in.rows, cols = in.cols;
      p.x = in.data;
      p.row = static_cast<uint8_t*>(out.rowwise_data);
      p.col = static_cast<uint8_t*>(out.columnwise_data);
      p.scale = out.scale;
      p.scale_inv = static_cast<float*>(out.rowwise_scale_inv);
      // Current scaling: the amax was reduced by the pass above; the cast records none.
      p.amax = current ? nullptr : out.amax;
      p.rows = rows;
      p.cols = cols;
      const int64_t tiles_r = rows * cols ? ceil_div(rows, S::kRows) : 0;
      const int64_t tiles_c = rows * cols ? ceil_div(cols, S::kTileCols) : 1;
      if (tiles_r * tiles_c > INT_MAX)
        throw Error(FUS_ERROR_UNSUPPORTED,
                    "fus_quantize_grouped: matrix too large for the CUDA backend");
      p.tiles_r = static_cast<unsigned>(tiles_r);
      p.tiles_c = static_cast<unsigned>(tiles_c);
      const bool cols_vec = cols % N == 0;
      p.vec_in = cols_vec && is_aligned(p.x, 16);
      p.vec_row = cols_vec && is_aligned(p.row, N);
      p.vec_col = rows % 16 == 0 && is_aligned(p.col, 16);
      gp.amax_in[g] = out.amax;
      gp.scale_out[g] = out.scale;
      most_tiles = tiles_r * tiles_c > most_tiles ? tiles_r * tiles_c : most_tiles;
    }
    dispatch_fp8(outs[0].dtype, [&](auto f) {
      constexpr Fp8Format F = decltype(f)::value;
      // Blocks of about four tiles of the largest group each; the hardware schedules the groups'
      // blocks as others finish, so uneven groups share the device.
      int64_t gx = ceil_div(most_tiles, 4);
      gx = gx < 1 ? 1 : (gx > 65535 ? 65535 : gx);
      const dim3 grid(static_cast<unsigned>(gx), count_u);
      grouped_cast_transpose_kernel<T, F><<<grid, kThreads, 0, stream>>>(gp);
      FUS_CUDA_CHECK_LAUNCH("grouped_cast_transpose_kernel");
    });
  });
}

}  // namespace

void quantize_grouped_cuda(const fus_tensor* inputs, const fus_quantized* outs, int64_t count,
                           bool current_scaling, int margin, const fus_context& ctx) {
  CudaDeviceGuard guard(ctx.device_index);
  const cudaStream_t stream = stream_of(ctx);
  for (int64_t first = 0; first < count; first += kMaxGroups) {
    const int64_t n = count - first < kMaxGroups ? count - first : kMaxGroups;
    quantize_group_chunk(inputs + first, outs + first, n, current_scaling, margin, stream);
  }
}

void amax_cuda(const fus_tensor& input, float* amax, const fus_context& ctx) {
  CudaDeviceGuard guard(ctx.device_index);
  const cudaStream_t stream = stream_of(ctx);
  FUS_CUDA_CHECK(cudaMemsetAsync(amax, 0, sizeof(float), stream));
  const int64_t n = input.rows * input.cols;
  if (n == 0) return;
  dispatch_hp(input.dtype, [&](auto t) {
    using T = decltype(t);
    // Elements before the first 16-byte boundary are read one by one.
    const uintptr_t addr = reinterpret_cast<uintptr_t>(input.data);
    int64_t head = addr % sizeof(T) ? n : static_cast<int64_t>((16 - addr % 16) % 16 / sizeof(T));
    if (head > n) head = n;
    const unsigned grid = persistent_blocks(amax_kernel<T>, kThreads,
                                            ceil_div((n - head) / kVec<T> / 4 + head, kThreads));
    amax_kernel<T><<<grid, kThreads, 0, stream>>>(static_cast<const T*>(input.data), n, head, amax);
    FUS_CUDA_CHECK_LAUNCH("amax_kernel");
  });
}

void dequantize_cuda(const fus_quantized& in, bool columnwise, const fus_tensor& output,
                     const fus_context& ctx) {
  CudaDeviceGuard guard(ctx.device_index);
  const cudaStream_t stream = stream_of(ctx);
  if (output.rows * output.cols == 0) return;
  const bool per_tensor = in.mode == FUS_SCALING_PER_TENSOR;
  DqParams p{};
  p.q = static_cast<const uint8_t*>(columnwise ? in.columnwise_data : in.rowwise_data);
  p.y = output.data;
  // Per tensor, position does not matter: view the copy (either layout) as one long row.
  p.rows = per_tensor ? 1 : output.rows;
  p.cols = per_tensor ? output.rows * output.cols : output.cols;
  p.scale = per_tensor ? in.rowwise_scale_inv
                       : (columnwise ? in.columnwise_scale_inv : in.rowwise_scale_inv);
  const bool vec = is_aligned(p.q, 16) && is_aligned(p.y, 16) &&
                   (per_tensor || (p.cols % 16 == 0 && (!columnwise || is_aligned(p.scale, 16))));
  p.vec_chunks = vec ? p.rows * p.cols / 16 : 0;
  p.idx32 = p.vec_chunks <= static_cast<int64_t>(UINT32_MAX);
  const int64_t work = vec ? ceil_div(p.vec_chunks, 4) : p.rows * p.cols;
  dispatch_hp(output.dtype, [&](auto t) {
    using T = decltype(t);
    dispatch_fp8(in.dtype, [&](auto f) {
      constexpr Fp8Format F = decltype(f)::value;
      const auto kernel = per_tensor   ? dequantize_kernel<T, F, DqMode::kPerTensor>
                          : columnwise ? dequantize_kernel<T, F, DqMode::kMxCol>
                                       : dequantize_kernel<T, F, DqMode::kMxRow>;
      kernel<<<persistent_blocks(kernel, kThreads, ceil_div(work, kThreads)), kThreads, 0,
               stream>>>(p);
      FUS_CUDA_CHECK_LAUNCH("dequantize_kernel");
    });
  });
}

}  // namespace fusible
