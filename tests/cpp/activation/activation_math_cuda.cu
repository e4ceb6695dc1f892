// Device side of the activation math tests: shared fp32 functions evaluated on the GPU, for
// comparison with the host's evaluation of the same code.
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "common/activation_math.h"

namespace fustest {
namespace {

__global__ void rcp_1to8_kernel(uint32_t first, uint32_t count, float* out) {
  const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < count) out[i] = fusible::f_rcp_1to8(fusible::bits_as_float(first + i));
}

// The functions device_act_math evaluates, by index (the host test keeps the same list).
__device__ float act_math_fn(int fn, float x) {
  namespace fu = fusible;
  switch (fn) {
    case 0: return fu::exp_neg_f(x);
    case 1: return fu::exp2_neg_f(x);
    case 2: return fu::exp_neg_half(fu::f_abs(x), 0.0f);
    case 3: return fu::sigmoid_f(x);
    case 4: return fu::gelu_tanh(x);
    case 5: return fu::dgelu_tanh(x);
    case 6: return fu::gelu_erf(x);
    case 7: return fu::dgelu_erf(x);
    case 8: return fu::silu(x);
    case 9: return fu::dsilu(x);
    case 10: {
      float y, d;
      fu::gelu_tanh_and_d(x, &y, &d);
      return y;
    }
    case 11: {
      float y, d;
      fu::gelu_tanh_and_d(x, &y, &d);
      return d;
    }
    case 12: return fu::f_max_nan(x, -1.5f);
    case 13: return fu::f_min_nan(x, 1.5f);
    case 14: return fu::f_min_num(x, 1.5f);
    case 15: return fu::f_select(x < 0.0f, 1.0f, x);
    default: return 0.0f;
  }
}

__global__ void act_math_kernel(int fn, const float* in, uint32_t n, float* out) {
  const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = act_math_fn(fn, in[i]);
}

}  // namespace

// out[i] = f_rcp_1to8 on the current device of the float with bits first + i, i < count. False
// (out untouched) when a CUDA call fails.
bool device_rcp_1to8(uint32_t first, uint32_t count, std::vector<float>& out) {
  float* d = nullptr;
  if (cudaMalloc(&d, sizeof(float) * count) != cudaSuccess) return false;
  rcp_1to8_kernel<<<(count + 255) / 256, 256>>>(first, count, d);
  std::vector<float> h(count);
  const bool ok =
      cudaGetLastError() == cudaSuccess &&
      cudaMemcpy(h.data(), d, sizeof(float) * count, cudaMemcpyDeviceToHost) == cudaSuccess;
  cudaFree(d);
  if (ok) out.swap(h);
  return ok;
}

// out[i] = function fn (act_math_fn's list) of in[i] on the current device. False (out untouched)
// when a CUDA call fails.
bool device_act_math(int fn, const std::vector<float>& in, std::vector<float>& out) {
  const uint32_t n = static_cast<uint32_t>(in.size());
  float *d_in = nullptr, *d_out = nullptr;
  if (cudaMalloc(&d_in, sizeof(float) * n) != cudaSuccess) return false;
  if (cudaMalloc(&d_out, sizeof(float) * n) != cudaSuccess) {
    cudaFree(d_in);
    return false;
  }
  std::vector<float> h(n);
  bool ok = cudaMemcpy(d_in, in.data(), sizeof(float) * n, cudaMemcpyHostToDevice) == cudaSuccess;
  if (ok) {
    act_math_kernel<<<(n + 255) / 256, 256>>>(fn, d_in, n, d_out);
    ok = cudaGetLastError() == cudaSuccess &&
         cudaMemcpy(h.data(), d_out, sizeof(float) * n, cudaMemcpyDeviceToHost) == cudaSuccess;
  }
  cudaFree(d_in);
  cudaFree(d_out);
  if (ok) out.swap(h);
  return ok;
}

}  // namespace fustest
