// CUDA backend of the blockwise FP8 casts (fusible/quantize.h). Bit-identical to blockwise_cpu.cpp:
// amaxes are maxima of abs_bits, scales come from block_scale and casts from scale_element +
// float_to_fp8 (common/numerics.h), only the order of the (exact) max reductions differs.
//
// block_cast_kernel: one 256-thread block per 128 x 128 tile of the input, read once for both
// copies. Warp w holds rows w, w + 8, ..., w + 120 of the tile in registers, lane l columns
// l, l + 32, l + 64, l + 96 (each load instruction of a warp reads 32 consecutive elements). Row
// block amaxes (1D rowwise) by warp shuffles; column amaxes (1D columnwise) and the tile amax (2D)
// through shared memory. The rowwise copy is stored from registers; the columnwise copy goes
// through a shared byte tile [128][132] (padded rows) and is stored as rows of the transposed copy.
// Out-of-range elements of edge tiles are zeros (they do not change an amax) and are not stored.
#include "common/cuda_utils.h"
#include "common/dispatch.h"
#include "quantize/quantize_impl.h"

namespace fusible {
namespace {

constexpr int kThreads = 256;
constexpr int kTile = FUS_FP8_BLOCK;          // 128
constexpr int kWarps = kThreads / 32;         // 8
constexpr int kRowsPerWarp = kTile / kWarps;  // 16
constexpr int kColsPerLane = kTile / 32;      // 4

struct BlockParams {
  const void* x;
  uint8_t* row_q;
  uint8_t* col_q;
  float* row_s;
  float* col_s;
  float* amax;
  int64_t rows, cols, nbr, nbc;  // nbr / nbc: 128-blocks down the rows / along the columns
  float fp8_max, epsilon;
  bool pow2, two_d;
};

__device__ __forceinline__ uint32_t warp_max(uint32_t v) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) v = max(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}

template <typename T, Fp8Format F>
__global__ void __launch_bounds__(kThreads) block_cast_kernel(const BlockParams p) {
  __shared__ uint32_t col_max[kWarps][kTile];
  __shared__ uint32_t warp_tile_max[kWarps];
  __shared__ float col_mul[kTile];
  __shared__ uint8_t tq[kTile][kTile + 4];  // tq[c][r]: the tile's columnwise codes

  const int64_t tr = blockIdx.x / p.nbc, tc = blockIdx.x % p.nbc;
  const int64_t r0 = tr * kTile, c0 = tc * kTile;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const T* x = static_cast<const T*>(p.x);

  float v[kRowsPerWarp][kColsPerLane];
  uint32_t cm[kColsPerLane] = {0u, 0u, 0u, 0u};
  uint32_t rmax[kRowsPerWarp];
  uint32_t wmax = 0;
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int64_t r = r0 + warp + kWarps * i;
    uint32_t m = 0;
#pragma unroll
    for (int j = 0; j < kColsPerLane; ++j) {
      const int64_t c = c0 + lane + 32 * j;
      v[i][j] = (r < p.rows && c < p.cols) ? Element<T>::load(x, r * p.cols + c) : 0.0f;
      const uint32_t a = abs_bits(v[i][j]);
      m = max(m, a);
      cm[j] = max(cm[j], a);
    }
    rmax[i] = warp_max(m);
    wmax = max(wmax, rmax[i]);
  }
#pragma unroll
  for (int j = 0; j < kColsPerLane; ++j) col_max[warp][lane + 32 * j] = cm[j];
  if (lane == 0) warp_tile_max[warp] = wmax;
  __syncthreads();
  uint32_t tmax = 0;
#pragma unroll
  for (int w = 0; w < kWarps; ++w) tmax = max(tmax, warp_tile_max[w]);
  const float tile_mul = block_scale(bits_as_float(tmax), p.fp8_max, p.epsilon, p.pow2);
  if (threadIdx.x < kTile) {
    const int c = threadIdx.x;
    uint32_t m = 0;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) m = max(m, col_max[w][c]);
    const float s =
        p.two_d ? tile_mul : block_scale(bits_as_float(m), p.fp8_max, p.epsilon, p.pow2);
    col_mul[c] = s;
    if (!p.two_d && p.col_q && c0 + c < p.cols) p.col_s[tr * p.cols + c0 + c] = 1.0f / s;
  }
  if (threadIdx.x == 0) {
    if (p.two_d) {
      if (p.row_q) p.row_s[tr * p.nbc + tc] = 1.0f / tile_mul;
      if (p.col_q) p.col_s[tc * p.nbr + tr] = 1.0f / tile_mul;
    }
    if (p.amax && tmax != 0) atomicMax(reinterpret_cast<unsigned int*>(p.amax), tmax);
  }
  __syncthreads();

  if (p.row_q) {
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const int64_t r = r0 + warp + kWarps * i;
      if (r >= p.rows) continue;
      const float mul =
          p.two_d ? tile_mul : block_scale(bits_as_float(rmax[i]), p.fp8_max, p.epsilon, p.pow2);
      if (!p.two_d && lane == 0) p.row_s[tc * p.rows + r] = 1.0f / mul;
#pragma unroll
      for (int j = 0; j < kColsPerLane; ++j) {
        const int64_t c = c0 + lane + 32 * j;
        if (c < p.cols) p.row_q[r * p.cols + c] = float_to_fp8<F>(scale_element(v[i][j], mul));
      }
    }
  }
  if (p.col_q) {
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i)
#pragma unroll
      for (int j = 0; j < kColsPerLane; ++j) {
        const int c = lane + 32 * j;
        tq[c][warp + kWarps * i] = float_to_fp8<F>(scale_element(v[i][j], col_mul[c]));
      }
    __syncthreads();
    // Warp w stores rows w, w + 8, ... of the transposed tile; lane l bytes 4l .. 4l + 3.
    for (int cl = warp; cl < kTile; cl += kWarps) {
      const int64_t c = c0 + cl;
      if (c >= p.cols) break;
      uint8_t* dst = p.col_q + c * p.rows + r0;
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const int rl = lane * 4 + b;
        if (r0 + rl < p.rows) dst[rl] = tq[cl][rl];
      }
    }
  }
}

struct DqBlockParams {
  const uint8_t* q;
  const float* s;
  void* out;
  int64_t R, C, nbc;
  bool two_d;
};

template <typename T, Fp8Format F>
__global__ void __launch_bounds__(kThreads) block_dequantize_kernel(const DqBlockParams p) {
  const int64_t n = p.R * p.C;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < n;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = idx / p.C, j = idx % p.C;
    const float si = p.two_d ? p.s[(i / kTile) * p.nbc + j / kTile] : p.s[(j / kTile) * p.R + i];
    Element<T>::store(static_cast<T*>(p.out), idx, scale_element(fp8_to_float<F>(p.q[idx]), si));
  }
}

}  // namespace

void quantize_blockwise_cuda(const fus_tensor& input, const fus_quantized& out,
                             const BlockScaling& bs, const fus_context& ctx) {
  CudaDeviceGuard guard(ctx.device_index);
  cudaStream_t stream = stream_of(ctx);
  if (out.amax) FUS_CUDA_CHECK(cudaMemsetAsync(out.amax, 0, sizeof(float), stream));
  if (input.rows * input.cols == 0) return;
  BlockParams p{input.data,
                static_cast<uint8_t*>(out.rowwise_data),
                static_cast<uint8_t*>(out.columnwise_data),
                static_cast<float*>(out.rowwise_scale_inv),
                static_cast<float*>(out.columnwise_scale_inv),
                out.amax,
                input.rows,
                input.cols,
                ceil_div(input.rows, kTile),
                ceil_div(input.cols, kTile),
                fus_fp8_max(out.dtype),
                bs.epsilon,
                bs.pow2,
                out.mode == FUS_SCALING_BLOCK_2D};
  const int64_t tiles = p.nbr * p.nbc;
  dispatch_hp(input.dtype, [&](auto t) {
    using T = decltype(t);
    dispatch_fp8(out.dtype, [&](auto f) {
      constexpr Fp8Format F = decltype(f)::value;
      block_cast_kernel<T, F><<<static_cast<unsigned>(tiles), kThreads, 0, stream>>>(p);
      FUS_CUDA_CHECK_LAUNCH("block_cast_kernel");
    });
  });
}

void dequantize_blockwise_cuda(const fus_quantized& in, bool columnwise, const fus_tensor& output,
                               const fus_context& ctx) {
  CudaDeviceGuard guard(ctx.device_index);
  cudaStream_t stream = stream_of(ctx);
  if (output.rows * output.cols == 0) return;
  DqBlockParams p{
      static_cast<const uint8_t*>(columnwise ? in.columnwise_data : in.rowwise_data),
      static_cast<const float*>(columnwise ? in.columnwise_scale_inv : in.rowwise_scale_inv),
      output.data,
      output.rows,
      output.cols,
      ceil_div(output.cols, kTile),
      in.mode == FUS_SCALING_BLOCK_2D};
  const int64_t n = output.rows * output.cols;
  dispatch_hp(output.dtype, [&](auto t) {
    using T = decltype(t);
    dispatch_fp8(in.dtype, [&](auto f) {
      constexpr Fp8Format F = decltype(f)::value;
      auto kernel = block_dequantize_kernel<T, F>;
      kernel<<<persistent_blocks(kernel, kThreads, ceil_div(n, kThreads)), kThreads, 0, stream>>>(
          p);
      FUS_CUDA_CHECK_LAUNCH("block_dequantize_kernel");
    });
  });
}

}  // namespace fusible
