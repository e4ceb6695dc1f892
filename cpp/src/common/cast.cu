// CUDA backend of the shared casts' host entry points (common/cast.h): the FP8 byte transpose
// and the per-tensor scale of one amax. Bit-identical to common/cast_cpu.cpp.
//
//  - transpose_fp8_kernel: a byte transpose in 128 x 128 tiles, persistent (the next tile's
//    16-byte row pieces in flight by cp.async into a second stage), gathered 4x4 bytes at a time
//    with byte permutes and stored as 16-byte pieces (128 contiguous bytes per 8 lanes).
//  - scale_from_amax_kernel: one thread, the shared compute_scale (common/numerics.h).
#include <climits>

#include "common/cast.h"
#include "common/cuda_utils.h"
#include "common/dispatch.h"
#include "common/tile_io.cuh"

namespace fusible {
namespace {

using namespace tile_io;  // NOLINT(build/namespaces): the shared tile loads and stores

constexpr int kThreads = 256;

// Tiles of kTp x kTp bytes. Each thread loads kTpSteps 16-byte row pieces of a tile (tile rows
// threadIdx.x / 8 + k * kTpRps, columns threadIdx.x % 8 * 16 ...) and, after the barrier, gathers
// 16 tile rows x 4 tile columns: one 16-byte piece of each of 4 output rows.
constexpr int kTp = 128;
constexpr int kTpCpr = kTp / 16;           // 16-byte pieces per tile row
constexpr int kTpRps = kThreads / kTpCpr;  // tile rows one load step covers
constexpr int kTpSteps = kTp / kTpRps;     // load steps per tile
constexpr int kTpGroupPad = 16;            // bytes after every 16 tile rows
constexpr int kTpTileBytes = kTp * kTp + kTp / 16 * kTpGroupPad;
constexpr int kTpStages = 2;  // one tile in flight while one is stored
static_assert(kTp / 16 * (kTp / 4) == kThreads, "one gather task of 16 x 4 bytes per thread");

// Byte offset of tile element (r, c). The padding puts the 16-row groups 4 banks apart, so the
// gather's word reads (8 row groups x 4 column words per warp) hit 32 distinct banks; a quarter
// warp's 16-byte writes cover one 128-byte tile row.
__device__ __forceinline__ int tp_at(int r, int c) { return r * kTp + (r >> 4) * kTpGroupPad + c; }

// Loads tile w (if any) of the [rows, cols] byte matrix p.x into `tile` and commits one cp.async
// group (always, so the group count stays in step with the tiles). Pieces outside the matrix are
// zero-filled; they are never stored. Without vec_in the pieces are read byte by byte.
__device__ __forceinline__ void tp_issue(const CastParams& p, uint8_t* tile, const TileWalk& w) {
  if (w.valid(p)) {
    const uint8_t* __restrict__ x = static_cast<const uint8_t*>(p.x);
    const int64_t rows = p.rows, cols = p.cols;
    const int64_t r0 = static_cast<int64_t>(w.tr) * kTp, c0 = static_cast<int64_t>(w.tc) * kTp;
    const int tr = threadIdx.x / kTpCpr, tc = threadIdx.x % kTpCpr * 16;
    const int64_t r = r0 + tr, c = c0 + tc;
    if (p.vec_in && r0 + kTp <= rows && c0 + kTp <= cols) {
      const uint8_t* src = x + r * cols + c;
#pragma unroll
      for (int k = 0; k < kTpSteps; ++k)
        cp_async16(reinterpret_cast<uint4*>(tile + tp_at(tr + k * kTpRps, tc)),
                   src + k * kTpRps * cols, true);
    } else {
#pragma unroll
      for (int k = 0; k < kTpSteps; ++k) {
        const int64_t rr = r + k * kTpRps;
        uint4* dst = reinterpret_cast<uint4*>(tile + tp_at(tr + k * kTpRps, tc));
        if (p.vec_in) {  // cols % 16 == 0: a piece is wholly inside or outside
          const bool in = rr < rows && c < cols;
          cp_async16(dst, in ? x + rr * cols + c : x, in);
        } else {
          Chunk<uint8_t> ch;
#pragma unroll
          for (int i = 0; i < 16; ++i)
            ch.e[i] = rr < rows && c + i < cols ? x[rr * cols + c + i] : 0;
          *dst = ch.u;
        }
      }
    }
  }
  cp_async_commit();
}

// out[c, r] = in[r, c] for the byte matrix in = p.x [rows, cols], out = p.col [cols, rows].
// Persistent: the tiles of a block are walked with a grid stride, the next tile's loads (cp.async
// into the other shared-memory stage) in flight while the current one is transposed and stored.
// The gather reads 4 x 4 byte blocks as words, transposes them with byte permutes and stores
// 16-byte pieces of output rows: the 8 lanes of one row group store 128 contiguous bytes.
__global__ void __launch_bounds__(kThreads) transpose_fp8_kernel(const CastParams p) {
  __shared__ alignas(16) uint8_t tiles[kTpStages][kTpTileBytes];
  const int64_t rows = p.rows, cols = p.cols;
  const int lane = threadIdx.x & 31, warp = threadIdx.x / 32;
  const int j = lane & 7, cg = warp * 4 + (lane >> 3);  // tile rows 16 * j ..., columns 4 * cg ...

  auto issue = [&](const TileWalk& w, int s) { tp_issue(p, tiles[s], w); };
  walk_tiles<kTpStages>(p, issue, [&](const TileWalk& w, int stage) {
    __syncthreads();  // and every other thread's pieces of tile w (walk_tiles waited for its own)

    const uint8_t* tile = tiles[stage];
    const int64_t r0 = static_cast<int64_t>(w.tr) * kTp, c0 = static_cast<int64_t>(w.tc) * kTp;
    const int64_t r = r0 + 16 * j, cc = c0 + 4 * cg;
    const bool fast = p.vec_col && r0 + kTp <= rows && c0 + kTp <= cols;
    store_transposed16([&](int row, int col) { return tile + tp_at(row, col); }, 16 * j, 4 * cg,
                       p.col + cc * rows + r, rows, r, cc, cols, fast, p.vec_col);
    __syncthreads();  // the stage is reloaded by the next iteration's issue
  });
}

__global__ void scale_from_amax_kernel(const float* amax, float* scale, float* scale_inv,
                                       float fp8_max, int margin, bool keep_previous) {
  const float s = compute_scale(*amax, fp8_max, margin, keep_previous ? *scale : 1.0f);
  *scale = s;
  if (scale_inv) *scale_inv = 1.0f / s;
}

}  // namespace

void transpose_fp8_cuda(const fus_tensor& input, const fus_tensor& output, const fus_context& ctx) {
  CudaDeviceGuard guard(ctx.device_index);
  const cudaStream_t stream = stream_of(ctx);
  const int64_t rows = input.rows, cols = input.cols;
  if (rows * cols == 0) return;
  const int64_t tiles = ceil_div(rows, kTp) * ceil_div(cols, kTp);
  if (tiles > INT_MAX)
    throw Error(FUS_ERROR_UNSUPPORTED, "fus_transpose_fp8: matrix too large for the CUDA backend");
  // The transpose reuses the cast's tile walk: x is the input, col the [cols, rows] output.
  CastParams p{};
  p.x = input.data;
  p.col = static_cast<uint8_t*>(output.data);
  p.rows = rows;
  p.cols = cols;
  p.tiles_r = static_cast<unsigned>(ceil_div(rows, kTp));
  p.tiles_c = static_cast<unsigned>(ceil_div(cols, kTp));
  p.vec_in = cols % 16 == 0 && is_aligned(p.x, 16);
  p.vec_col = rows % 16 == 0 && is_aligned(p.col, 16);
  // As many tiles for every block (a block with one tile more than the others would run alone at
  // the end): the fewest blocks that need no more tiles each than the resident blocks would.
  const auto kernel = transpose_fp8_kernel;
  const int64_t per_block = ceil_div(tiles, persistent_blocks(kernel, kThreads, tiles));
  const auto grid = static_cast<unsigned>(ceil_div(tiles, per_block));
  kernel<<<grid, kThreads, 0, stream>>>(p);
  FUS_CUDA_CHECK_LAUNCH("transpose_fp8_kernel");
}

void scale_from_amax_cuda(const float* amax, float* scale, float* scale_inv, float fp8_max,
                          int margin, bool keep_previous, const fus_context& ctx) {
  CudaDeviceGuard guard(ctx.device_index);
  scale_from_amax_kernel<<<1, 1, 0, stream_of(ctx)>>>(amax, scale, scale_inv, fp8_max, margin,
                                                      keep_previous);
  FUS_CUDA_CHECK_LAUNCH("scale_from_amax_kernel");
}

}  // namespace fusible
