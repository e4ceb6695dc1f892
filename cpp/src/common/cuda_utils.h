// CUDA helpers shared by the backends: error checks that throw fusible::Error (converted to
// FUS_ERROR_CUDA at the API boundary; the library never aborts), launch checks and a device guard.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "common/status.h"
#include "fusible/common.h"

namespace fusible {

inline void cuda_check(cudaError_t err, const char* what, const char* file, int line) {
  if (err == cudaSuccess) return;
  throw Error(FUS_ERROR_CUDA, std::string(what) + " failed: " + cudaGetErrorName(err) + ": " +
                                  cudaGetErrorString(err) + " (" + file + ":" +
                                  std::to_string(line) + ")");
}

inline void cuda_check_launch(const char* kernel, const char* file, int line) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) cuda_check(err, (std::string("launch of ") + kernel).c_str(), file, line);
}

}  // namespace fusible

// Throws fusible::Error(FUS_ERROR_CUDA, ...) when a CUDA runtime call fails.
#define FUS_CUDA_CHECK(expr) ::fusible::cuda_check((expr), #expr, __FILE__, __LINE__)

// After every <<<...>>>: launch errors (bad configuration, no kernel image for this device) are
// only reported through cudaGetLastError.
#define FUS_CUDA_CHECK_LAUNCH(kernel_name) \
  ::fusible::cuda_check_launch((kernel_name), __FILE__, __LINE__)

namespace fusible {

// Makes ctx.device_index current for the scope and restores the caller's device afterwards, so a
// call on device 1 does not change the current device of the calling thread.
class CudaDeviceGuard {
 public:
  explicit CudaDeviceGuard(int device) {
    FUS_CUDA_CHECK(cudaGetDevice(&previous_));
    if (device != previous_) {
      FUS_CUDA_CHECK(cudaSetDevice(device));
      restore_ = true;
    }
  }
  ~CudaDeviceGuard() {
    if (restore_) (void)cudaSetDevice(previous_);  // a destructor must not throw
  }
  CudaDeviceGuard(const CudaDeviceGuard&) = delete;
  CudaDeviceGuard& operator=(const CudaDeviceGuard&) = delete;

 private:
  int previous_ = 0;
  bool restore_ = false;
};

inline cudaStream_t stream_of(const fus_context& ctx) {
  return static_cast<cudaStream_t>(ctx.stream);
}

// Number of multiprocessors of the current device, to size grid-stride launches.
inline int sm_count() {
  int device = 0, count = 0;
  FUS_CUDA_CHECK(cudaGetDevice(&device));
  FUS_CUDA_CHECK(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  return count;
}

// Grid of a persistent (grid-stride) kernel that has `blocks` blocks of work: at most the blocks
// of `threads` threads that are resident at once, since a partial second wave would leave most
// SMs idle.
template <typename K>
unsigned persistent_blocks(K kernel, int threads, int64_t blocks) {
  int per_sm = 0;
  FUS_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0));
  const int64_t resident = static_cast<int64_t>(per_sm > 0 ? per_sm : 1) * sm_count();
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks < resident ? blocks : resident));
}

inline bool is_aligned(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

}  // namespace fusible
