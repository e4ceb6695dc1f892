// CUDA backend of the blockwise FP8 casts (fusible/quantize.h). Bit-identical to blockwise_cpu.cpp.
//
// block_cast_kernel<T, F, kTwoD>: one 256-thread block per 128 x 128 tile of the input, loaded as
// 16-byte chunks and cast by the shared blockwise tile cast (common/block_cast.cuh: its header
// describes the layout; the fused normalization and activation kernels use the same cast with
// computed values). 3 blocks an SM of 16-bit input (<= 80 registers), 2 of fp32 (<= 128), each
// with its 32 or 64 KB of loads in flight while the others cast and store.
//
// block_dequantize_kernel<T, F, kVec>: a grid-stride walk over 16-code chunks of the rows of a copy
// [R, C], row and chunk column advanced incrementally (no division per element or chunk), four
// chunks a thread in flight. kVec (16-byte aligned codes and output, C % 16 == 0): one 16-byte
// load of codes, the codes widened in pairs by the hardware (cvt.rn.f16x2.e{4m3,5m2}x2, exact; a
// chunk holding a NaN code goes through fp8_to_float, which defines the NaN), scale_element with
// the chunk's one scale (a chunk never straddles a 128-block), output rounded as numerics.h
// (round_pack8 for 16-bit outputs) and stored as 16-byte words. Otherwise element by element.
#include <climits>

#include "common/block_cast.cuh"
#include "common/cuda_utils.h"
#include "common/device_common.cuh"
#include "common/dispatch.h"
#include "common/tile_io.cuh"
#include "quantize/quantize_impl.h"

namespace fusible {
namespace {

constexpr int kThreads = block_cast::kThreads;
constexpr int kTile = block_cast::kTile;

// Blocks an SM should hold (register budget: 80 a thread for 16-bit inputs, 128 for fp32).
template <typename T>
constexpr int kMinBlocks = sizeof(T) == 2 ? 3 : 2;

template <typename T, Fp8Format F, bool kTwoD>
__global__ void __launch_bounds__(kThreads, kMinBlocks<T>)
    block_cast_kernel(const void* x, const block_cast::Out o, bool vec_in, float* amax) {
  __shared__ block_cast::Smem sm;
  const unsigned nbc = static_cast<unsigned>(o.nbc);
  const int64_t tr = blockIdx.x / nbc, tc = blockIdx.x % nbc;
  block_cast::Chunks<T> raw;
  block_cast::load_chunks<T>(static_cast<const T*>(x), o.rows, o.cols, tr * kTile, tc * kTile,
                             vec_in, raw);
  const uint32_t tkey = block_cast::cast_tile<T, F>(o, sm, raw, tr, tc, kTwoD, amax != nullptr);
  if (amax && threadIdx.x == 0 && tkey != 0) atomicMax(reinterpret_cast<unsigned int*>(amax), tkey);
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
          tile_io::Chunk<uint8_t> ch;
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
                             const fus_context& ctx) {
  CudaDeviceGuard guard(ctx.device_index);
  cudaStream_t stream = stream_of(ctx);
  fused::begin_cast(&out, input.rows * input.cols == 0, stream);  // blockwise: amax only
  if (input.rows * input.cols == 0) return;
  const int64_t tiles = ceil_div(input.rows, kTile) * ceil_div(input.cols, kTile);
  if (tiles > INT_MAX)
    throw Error(FUS_ERROR_UNSUPPORTED,
                "fus_quantize_blockwise: matrix too large for the CUDA backend");
  const bool two_d = out.mode == FUS_SCALING_BLOCK_2D;
  dispatch_hp(input.dtype, [&](auto t) {
    using T = decltype(t);
    const block_cast::Out o = block_cast::make_out<T>(out);
    const bool vec_in = input.cols % block_cast::Geo<T>::kC == 0 && is_aligned(input.data, 16);
    dispatch_fp8(out.dtype, [&](auto f) {
      constexpr Fp8Format F = decltype(f)::value;
      const auto kernel = two_d ? block_cast_kernel<T, F, true> : block_cast_kernel<T, F, false>;
      kernel<<<static_cast<unsigned>(tiles), kThreads, 0, stream>>>(input.data, o, vec_in,
                                                                    out.amax);
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
