// Device building blocks of the tiled FP8 kernels that walk a matrix with their loads in flight
// (the quantize family's persistent casts and the FP8 byte transpose of common/cast.cu): 16-byte
// chunks, cp.async loads, vector stores of packed bytes, the tile walk and the pipelined loop over
// it (walk_tiles), and the transposed store of a byte tile.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace fusible {
namespace tile_io {

// Elements of T in one 16-byte chunk.
template <typename T>
constexpr int kVec = 16 / static_cast<int>(sizeof(T));

template <typename T>
union Chunk {
  uint4 u;
  T e[kVec<T>];
};

// Stores N packed bytes to an N-byte aligned dst with one vector store.
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

// Stores N packed bytes to dst, of which only the first `valid` lie inside the matrix. vec: dst
// is N-byte aligned whenever valid >= N.
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

// cp.async (sm_80+): 16 bytes global -> shared without a register round trip; with valid false
// the slot is zero-filled and nothing is read.
__device__ __forceinline__ void cp_async16(uint4* smem, const void* gmem, bool valid) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem),
               "r"(valid ? 16 : 0)
               : "memory");
#else
  *smem = valid ? *static_cast<const uint4*>(gmem) : make_uint4(0, 0, 0, 0);
#endif
}

__device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
}

// Waits until at most kPending of this thread's most recent cp.async groups are in flight.
template <int kPending>
__device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
#endif
}

struct CastParams {
  const void* x;
  uint8_t* row;        // rowwise fp8 [rows, cols] or null
  uint8_t* col;        // columnwise fp8: [cols, rows] per tensor, [rows, cols] MXFP8; or null
  uint8_t* row_scale;  // MXFP8 E8M0 [rows, ceil(cols / 32)]
  uint8_t* col_scale;  // MXFP8 E8M0 [ceil(rows / 32), cols]
  const float* scale;  // per tensor
  float* scale_inv;    // per tensor, may be null
  float* amax;         // may be null
  int64_t rows, cols;
  unsigned tiles_r, tiles_c;  // tile t is (t / tiles_c, t % tiles_c)
  bool vec_in;                // 16-byte loads are legal (aligned base, cols % kVec == 0)
  bool vec_row;               // rowwise chunks may be stored as one vector
  bool vec_col;               // columnwise chunks may be stored as one vector
};

// Walks tiles blockIdx.x + i * gridDim.x in (tile row, tile column) form without a division per
// step.
struct TileWalk {
  unsigned tr, tc, dr, dc;
  __device__ TileWalk(const CastParams& p, unsigned t)
      : tr(t / p.tiles_c),
        tc(t % p.tiles_c),
        dr(gridDim.x / p.tiles_c),
        dc(gridDim.x % p.tiles_c) {}
  __device__ bool valid(const CastParams& p) const { return tr < p.tiles_r; }
  __device__ void next(const CastParams& p) {
    tr += dr;
    tc += dc;
    if (tc >= p.tiles_c) {
      tc -= p.tiles_c;
      ++tr;
    }
  }
};

// A block's persistent walk over its tiles, the loads of the next kStages - 1 tiles in flight:
// issue(w, s) loads tile w (if valid) into stage s and commits one cp.async group (always, so the
// group count stays in step with the tiles); body(w, s) runs once this thread's loads of tile w
// into stage s have landed.
template <int kStages, typename Issue, typename Body>
__device__ __forceinline__ void walk_tiles(const CastParams& p, Issue&& issue, Body&& body) {
  TileWalk ahead(p, blockIdx.x);
#pragma unroll
  for (int d = 0; d < kStages - 1; ++d, ahead.next(p)) issue(ahead, d);
  int stage = 0;
  for (TileWalk w(p, blockIdx.x); w.valid(p); w.next(p), ahead.next(p)) {
    issue(ahead, (stage + kStages - 1) % kStages);
    cp_async_wait<kStages - 1>();  // this thread's loads of tile w have landed
    body(w, stage);
    stage = (stage + 1) % kStages;
  }
  cp_async_wait<0>();
}

// Transposes a 4x4 byte block: out[i] holds byte i of in[0..3], in order.
__device__ __forceinline__ void transpose4x4(const uint32_t (&in)[4], uint32_t (&out)[4]) {
  const uint32_t t0 = __byte_perm(in[0], in[1], 0x5140), t1 = __byte_perm(in[0], in[1], 0x7362);
  const uint32_t t2 = __byte_perm(in[2], in[3], 0x5140), t3 = __byte_perm(in[2], in[3], 0x7362);
  out[0] = __byte_perm(t0, t2, 0x5410);
  out[1] = __byte_perm(t0, t2, 0x7632);
  out[2] = __byte_perm(t1, t3, 0x5410);
  out[3] = __byte_perm(t1, t3, 0x7632);
}

// The transposed write of 16 rows x 4 columns of an fp8 byte tile: rows row0 .. row0 + 15,
// columns col0 .. col0 + 3 (col0 % 4 == 0), read as words at byte_at(row, col0), transposed 4x4
// at a time; column cc + i of the matrix (tile column col0 + i) is stored as the 16 bytes of rows
// r .. r + 15 at out + i * rows. fast: all of them lie inside the matrix and 16-byte stores are
// legal.
template <typename ByteAt>
__device__ __forceinline__ void store_transposed16(ByteAt byte_at, int row0, int col0, uint8_t* out,
                                                   int64_t rows, int64_t r, int64_t cc,
                                                   int64_t cols, bool fast, bool vec) {
  uint32_t piece[4][4];  // [tile column col0 + i][rows row0 + 4 * m ...]
#pragma unroll
  for (int m = 0; m < 4; ++m) {
    uint32_t rw[4], cw[4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
      rw[i] = *reinterpret_cast<const uint32_t*>(byte_at(row0 + 4 * m + i, col0));
    transpose4x4(rw, cw);
#pragma unroll
    for (int i = 0; i < 4; ++i) piece[i][m] = cw[i];
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    if (fast) {
      store_vec<16>(out + i * rows, piece[i]);
    } else if (cc + i < cols) {
      store_bytes<16>(out + i * rows, rows - r, vec, piece[i]);
    }
  }
}

}  // namespace tile_io
}  // namespace fusible
