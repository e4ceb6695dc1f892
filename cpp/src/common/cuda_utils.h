// CUDA helpers shared by the backends: error checks that throw fusible::Error (converted to
// FUS_ERROR_CUDA at the API boundary; the library never aborts), launch checks and a device guard.
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>

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

// Attributes and occupancies are fixed for the life of the process, so each is queried once per
// device (and kernel) and cached: a query costs host time at every launch otherwise (about 30
// queries a step of a small FP8 block, 0.6-1.7 us each on the H200's host).
constexpr int kCachedDevices = 64;

inline int current_device() {
  int device = 0;
  FUS_CUDA_CHECK(cudaGetDevice(&device));
  return device;
}

// cudaDeviceGetAttribute(attr, device) for the attributes cached here (others: one query).
inline int device_attribute(cudaDeviceAttr attr, int device) {
  static std::atomic<int> sms[kCachedDevices], max_grid_x[kCachedDevices];  // 0: not yet known
  std::atomic<int>* slot = nullptr;
  if (device >= 0 && device < kCachedDevices) {
    if (attr == cudaDevAttrMultiProcessorCount) slot = &sms[device];
    if (attr == cudaDevAttrMaxGridDimX) slot = &max_grid_x[device];
  }
  if (slot != nullptr) {
    const int known = slot->load(std::memory_order_relaxed);
    if (known > 0) return known;
  }
  int value = 0;
  FUS_CUDA_CHECK(cudaDeviceGetAttribute(&value, attr, device));
  if (slot != nullptr) slot->store(value, std::memory_order_relaxed);
  return value;
}

// Number of multiprocessors of the current device, to size grid-stride launches.
inline int sm_count() { return device_attribute(cudaDevAttrMultiProcessorCount, current_device()); }

// cudaOccupancyMaxActiveBlocksPerMultiprocessor(kernel, threads, no dynamic shared memory) on
// the current device, cached per (kernel, threads, device).
inline int resident_blocks_per_sm(const void* kernel, int threads) {
  struct Key {
    const void* kernel;
    int threads, device;
    bool operator==(const Key& o) const {
      return kernel == o.kernel && threads == o.threads && device == o.device;
    }
  };
  struct Hash {
    size_t operator()(const Key& k) const {
      return std::hash<const void*>()(k.kernel) ^ (static_cast<size_t>(k.threads) << 8) ^
             (static_cast<size_t>(k.device) << 24);
    }
  };
  static std::mutex mutex;
  static std::unordered_map<Key, int, Hash> cache;
  const Key key{kernel, threads, current_device()};
  {
    const std::lock_guard<std::mutex> lock(mutex);
    const auto it = cache.find(key);
    if (it != cache.end()) return it->second;
  }
  int per_sm = 0;
  FUS_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads, 0));
  const std::lock_guard<std::mutex> lock(mutex);
  cache.emplace(key, per_sm);
  return per_sm;
}

// Grid of a persistent (grid-stride) kernel that has `blocks` blocks of work: at most the blocks
// of `threads` threads that are resident at once, since a partial second wave would leave most
// SMs idle.
template <typename K>
unsigned persistent_blocks(K kernel, int threads, int64_t blocks) {
  const int per_sm = resident_blocks_per_sm(reinterpret_cast<const void*>(kernel), threads);
  const int64_t resident = static_cast<int64_t>(per_sm > 0 ? per_sm : 1) * sm_count();
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks < resident ? blocks : resident));
}

inline bool is_aligned(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

}  // namespace fusible
