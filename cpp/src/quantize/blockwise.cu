// CUDA backend of the blockwise FP8 casts (fusible/quantize.h). Bit-identical to
// common/cast_cpu.cpp.
//
// block_quantize_kernel: one 256-thread block per 128 x 128 tile of the input, read once for both
// copies, through the shared tile cast (common/block_cast.cuh, which the fused normalization and
// activation kernels use too). block_dequantize_kernel: a grid-stride loop over the copy.
#include "common/block_cast.cuh"
#include "common/cuda_utils.h"
#include "common/dispatch.h"
#include "quantize/quantize_impl.h"

namespace fusible {
namespace {

constexpr int kThreads = block_cast::kThreads;
constexpr int kTile = block_cast::kTile;

template <typename T, Fp8Format F>
__global__ void __launch_bounds__(kThreads)
    block_quantize_kernel(const void* x, const block_cast::Out o, float* amax) {
  __shared__ block_cast::Smem sm;
  const int64_t tr = blockIdx.x / o.nbc, tc = blockIdx.x % o.nbc;
  const T* in = static_cast<const T*>(x);
  block_cast::Values v;
  block_cast::load_tile([&](int64_t r, int64_t c) { return Element<T>::load(in, r * o.cols + c); },
                        o.rows, o.cols, tr * kTile, tc * kTile, v);
  const uint32_t tmax = block_cast::cast_tile<F>(o, sm, v, tr, tc);
  if (amax && threadIdx.x == 0 && tmax != 0) atomicMax(reinterpret_cast<unsigned int*>(amax), tmax);
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
                             const fus_context& ctx) {
  CudaDeviceGuard guard(ctx.device_index);
  cudaStream_t stream = stream_of(ctx);
  if (out.amax) FUS_CUDA_CHECK(cudaMemsetAsync(out.amax, 0, sizeof(float), stream));
  if (input.rows * input.cols == 0) return;
  const block_cast::Out o = block_cast::make_out(out);
  const int64_t tiles = o.nbr * o.nbc;
  dispatch_hp(input.dtype, [&](auto t) {
    using T = decltype(t);
    dispatch_fp8(out.dtype, [&](auto f) {
      constexpr Fp8Format F = decltype(f)::value;
      block_quantize_kernel<T, F>
          <<<static_cast<unsigned>(tiles), kThreads, 0, stream>>>(input.data, o, out.amax);
      FUS_CUDA_CHECK_LAUNCH("block_quantize_kernel");
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
