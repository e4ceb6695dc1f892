// CUDA backend of the recipe family: the delayed-scaling update (one block per column, see the
// kernel); results equal the CPU backend bit for bit. (The scale of one amax is common/cast.cu.)
#include <algorithm>

#include "common/cuda_utils.h"
#include "common/dispatch.h"
#include "recipe/recipe_impl.h"

namespace fusible {
namespace {

constexpr int kThreads = 256;

// Group descriptors travel in the kernel parameters (no host-to-device copy, no allocation). 64
// descriptors plus their block offsets stay under the classic 4 KB parameter limit; more groups
// are split over several launches.
constexpr int kMaxGroups = 64;

struct UpdateBatch {
  fus_delayed_scaling_group groups[kMaxGroups];
  int64_t block_begin[kMaxGroups + 1];  // first block of each group; [num] = total blocks
  int num;
};
static_assert(sizeof(UpdateBatch) <= 4096, "kernel parameters must stay under 4 KB");

// One block per column of every group (blocks are assigned to columns in group order, so the
// group lookup is uniform within a block). The threads split the column's history rows: the amax
// is a block max of abs bits (order-free, so it equals the CPU's sequential scan bit for bit),
// then the roll moves the rows in chunks of kThreads, each chunk read before any thread writes it.
// (One thread walking a 1024-row column took ~0.1 ms per call: a chain of dependent loads.)
__global__ void __launch_bounds__(kThreads)
    delayed_scaling_update_kernel(const __grid_constant__ UpdateBatch b, bool most_recent,
                                  int margin) {
  __shared__ uint32_t warp_max[kThreads / 32];
  const int tid = threadIdx.x;
  for (int64_t blk = blockIdx.x; blk < b.block_begin[b.num]; blk += gridDim.x) {
    // Last group whose first block is <= blk (every packed group has at least one block).
    int lo = 0, hi = b.num - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (b.block_begin[mid] <= blk) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    const fus_delayed_scaling_group& g = b.groups[lo];
    const int64_t i = blk - b.block_begin[lo], n = g.n, len = g.history_len;
    float* h = g.amax_history;
    uint32_t m = 0;
    for (int64_t k = tid; k < (most_recent ? 1 : len); k += kThreads)
      m = max(m, abs_bits(h[k * n + i]));
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = max(m, __shfl_xor_sync(0xffffffffu, m, off));
    if (tid % 32 == 0) warp_max[tid / 32] = m;
    const float newest = h[i];  // read before the first barrier: row 0 is overwritten below
    __syncthreads();
    if (tid == 0) {
      for (int w = 1; w < kThreads / 32; ++w) m = max(m, warp_max[w]);
      g.scale[i] = compute_scale(bits_as_float(m), g.fp8_max, margin, g.scale[i]);
    }
    for (int64_t k0 = 0; k0 + 1 < len; k0 += kThreads) {
      const int64_t k = k0 + tid;
      const float v = k + 1 < len ? h[(k + 1) * n + i] : 0.0f;
      __syncthreads();
      if (k + 1 < len) h[k * n + i] = v;
    }
    if (tid == 0) {  // after its own chunk writes; row len - 1 was read before the last barrier
      h[(len - 1) * n + i] = newest;
      h[i] = 0.0f;
    }
    __syncthreads();  // warp_max is reused by the next column
  }
}

}  // namespace

void delayed_scaling_update_cuda(const fus_delayed_scaling_group* groups, int num_groups,
                                 fus_amax_algo algo, int margin, const fus_context& ctx) {
  CudaDeviceGuard guard(ctx.device_index);
  const cudaStream_t stream = stream_of(ctx);
  const int max_grid = device_attribute(cudaDevAttrMaxGridDimX, current_device());
  const bool most_recent = algo == FUS_AMAX_MOST_RECENT;
  UpdateBatch b;
  int g = 0;
  while (g < num_groups) {
    // Pack the next groups that have columns (empty groups need no work).
    b.num = 0;
    b.block_begin[0] = 0;
    for (; g < num_groups && b.num < kMaxGroups; ++g) {
      if (groups[g].n == 0) continue;
      b.groups[b.num] = groups[g];
      b.block_begin[b.num + 1] = b.block_begin[b.num] + groups[g].n;
      ++b.num;
    }
    if (b.num == 0) break;
    const unsigned grid = static_cast<unsigned>(std::min<int64_t>(b.block_begin[b.num], max_grid));
    delayed_scaling_update_kernel<<<grid, kThreads, 0, stream>>>(b, most_recent, margin);
    FUS_CUDA_CHECK_LAUNCH("delayed_scaling_update_kernel");
  }
}

}  // namespace fusible
