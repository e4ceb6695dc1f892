// Device side of the activation math tests: shared fp32 functions evaluated on the GPU, for
// comparison with the host's evaluation of the same code.
#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "common/fp32_ops.h"

namespace fustest {
namespace {

__global__ void rcp_1to2_kernel(uint32_t first, uint32_t count, float* out) {
  const uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < count) out[i] = fusible::f_rcp_1to2(fusible::bits_as_float(first + i));
}

}  // namespace

// out[i] = f_rcp_1to2 on the current device of the float with bits first + i, i < count. False
// (out untouched) when a CUDA call fails.
bool device_rcp_1to2(uint32_t first, uint32_t count, std::vector<float>& out) {
  float* d = nullptr;
  if (cudaMalloc(&d, sizeof(float) * count) != cudaSuccess) return false;
  rcp_1to2_kernel<<<(count + 255) / 256, 256>>>(first, count, d);
  std::vector<float> h(count);
  const bool ok =
      cudaGetLastError() == cudaSuccess &&
      cudaMemcpy(h.data(), d, sizeof(float) * count, cudaMemcpyDeviceToHost) == cudaSuccess;
  cudaFree(d);
  if (ok) out.swap(h);
  return ok;
}

}  // namespace fustest
