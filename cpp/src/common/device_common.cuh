// Device helpers that every CUDA kernel family shares: packed vectors of eight 16-bit values
// (widening, paired rounding, packed amax), the block-wide amax, the scale_inv kernel and what
// every cast does on the host before its kernels (begin_cast).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/cuda_utils.h"
#include "common/fp32_ops.h"
#include "fusible/common.h"

namespace fusible {
namespace fused {

constexpr unsigned kFull = 0xffffffffu;

// ---- packed 16-bit vectors
// ------------------------------------------------------------------------

// Rounds v[0..7] to the 16-bit type T in place (as numerics.h float_to_bf16 / float_to_half, bit
// for bit) and returns them packed as one 16-byte vector. Without a NaN among them (the usual case)
// the values go through two-at-a-time hardware conversions; a NaN, whose sign and payload the
// hardware would not keep, sends the chunk through the scalar path.
template <typename T>
__device__ __forceinline__ uint4 round_pack8(float (&v)[8]) {
  static_assert(sizeof(T) == 2, "16-bit types");
  bool nan = false;
#pragma unroll
  for (int j = 0; j < 8; ++j) nan |= v[j] != v[j];
  uint32_t w[4];
  if (!nan) {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      if constexpr (std::is_same_v<T, Bf16>) {
        const __nv_bfloat162 h = __floats2bfloat162_rn(v[2 * k], v[2 * k + 1]);
        w[k] = *reinterpret_cast<const uint32_t*>(&h);
        v[2 * k] = bits_as_float(w[k] << 16);
        v[2 * k + 1] = bits_as_float(w[k] & 0xffff0000u);
      } else {
        const __half2 h = __floats2half2_rn(v[2 * k], v[2 * k + 1]);
        w[k] = *reinterpret_cast<const uint32_t*>(&h);
        v[2 * k] = __half2float(__low2half(h));
        v[2 * k + 1] = __half2float(__high2half(h));
      }
    }
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      T lo, hi;
      Element<T>::store(&lo, 0, v[2 * k]);
      Element<T>::store(&hi, 0, v[2 * k + 1]);
      v[2 * k] = Element<T>::load(&lo, 0);
      v[2 * k + 1] = Element<T>::load(&hi, 0);
      w[k] = static_cast<uint32_t>(lo.bits) | (static_cast<uint32_t>(hi.bits) << 16);
    }
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

// Element j of eight 16-bit values packed in a 16-byte vector, widened as Element<T>::load. Taken
// from its 32-bit word by shifts and masks, so widening a bf16 is one instruction.
template <typename T>
__device__ __forceinline__ float elem8(const uint4& raw, int j) {
  const uint32_t w = j < 2 ? raw.x : j < 4 ? raw.y : j < 6 ? raw.z : raw.w;
  const T h{static_cast<uint16_t>(j % 2 ? w >> 16 : w & 0xffffu)};
  return Element<T>::load(&h, 0);
}

// All eight of them.
template <typename T>
__device__ __forceinline__ void unpack8(const uint4& raw, float (&v)[8]) {
#pragma unroll
  for (int j = 0; j < 8; ++j) v[j] = elem8<T>(raw, j);
}

// Running max of the 16-bit magnitudes of a packed vector's eight values, two per word: widening
// to fp32 is monotonic in them, so amax16_bits turns the final max into abs_bits of the value.
__device__ __forceinline__ uint32_t amax16_update(uint32_t m, const uint4& w) {
  constexpr uint32_t kMag = 0x7fff7fffu;
  return __vmaxu2(__vmaxu2(m, __vmaxu2(w.x & kMag, w.y & kMag)), __vmaxu2(w.z & kMag, w.w & kMag));
}

template <typename T>
__device__ __forceinline__ uint32_t amax16_bits(uint32_t m) {
  T h;
  h.bits = static_cast<uint16_t>(max(m & 0xffffu, m >> 16));
  return abs_bits(Element<T>::load(&h, 0));
}

// ---- amax
// -----------------------------------------------------------------------------------------

// Max of v over the block, then one atomicMax into *amax (zeroed beforehand on the stream, or a
// running amax the cast accumulates into: fus_quantized.amax_accumulate). Every thread of the
// block must call it; blockDim.x <= 1024.
__device__ __forceinline__ void block_amax(uint32_t v, float* amax) {
  __shared__ uint32_t warp_max[32];
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = max(v, __shfl_xor_sync(kFull, v, off));
  if ((threadIdx.x & 31) == 0) warp_max[threadIdx.x / 32] = v;
  __syncthreads();
  if (threadIdx.x == 0) {
    for (int w = 1; w < static_cast<int>(blockDim.x / 32); ++w) v = max(v, warp_max[w]);
    if (v != 0) atomicMax(reinterpret_cast<unsigned int*>(amax), v);
  }
}

// ---- small kernels
// ----------------------------------------------------------------------------------

// *scale_inv = 1 / *scale (the same IEEE division as the CPU backend).
static __global__ void scale_inv_kernel(const float* scale, float* scale_inv) {
  *scale_inv = f_div(1.0f, *scale);
}

// ---- host side
// --------------------------------------------------------------------------------------

// What a cast into q (null: none) does first, on the stream: zero q's amax for the blocks'
// atomicMax, unless the caller accumulates into it (amax_accumulate: they max-combine into its
// value); for an empty input, whose cast launches nothing else, the per-tensor scale_inv =
// 1 / scale, as the CPU backend (cast_cpu).
static inline void begin_cast(const fus_quantized* q, bool empty, cudaStream_t stream) {
  if (q == nullptr) return;
  if (q->amax && !q->amax_accumulate)
    FUS_CUDA_CHECK(cudaMemsetAsync(q->amax, 0, sizeof(float), stream));
  if (empty && q->mode == FUS_SCALING_PER_TENSOR && q->scale && q->rowwise_scale_inv) {
    scale_inv_kernel<<<1, 1, 0, stream>>>(q->scale, static_cast<float*>(q->rowwise_scale_inv));
    FUS_CUDA_CHECK_LAUNCH("scale_inv_kernel");
  }
}

}  // namespace fused
}  // namespace fusible
