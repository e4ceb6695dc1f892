// CUDA backend of the recipe family. The per-column update is the shared
// fusible::delayed_scaling_update_column, so results equal the CPU backend bit for bit.
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

// One thread per column of every group. Blocks are assigned to groups whole, so the group lookup
// is uniform within a block.
__global__ void __launch_bounds__(kThreads)
    delayed_scaling_update_kernel(const __grid_constant__ UpdateBatch b, bool most_recent,
                                  int margin) {
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
    const int64_t i = (blk - b.block_begin[lo]) * kThreads + threadIdx.x;
    if (i < g.n)
      delayed_scaling_update_column(g.amax_history, g.scale, g.history_len, g.n, i, g.fp8_max,
                                    most_recent, margin);
  }
}

__global__ void compute_scale_kernel(const float* amax, float* scale, float* scale_inv,
                                     float fp8_max, int margin, bool keep_previous) {
  const float s = compute_scale(*amax, fp8_max, margin, keep_previous ? *scale : 1.0f);
  *scale = s;
  if (scale_inv) *scale_inv = 1.0f / s;
}

}  // namespace

void delayed_scaling_update_cuda(const fus_delayed_scaling_group* groups, int num_groups,
                                 fus_amax_algo algo, int margin, const fus_context& ctx) {
  CudaDeviceGuard guard(ctx.device_index);
  const cudaStream_t stream = stream_of(ctx);
  int device = 0, max_grid = 0;
  FUS_CUDA_CHECK(cudaGetDevice(&device));
  FUS_CUDA_CHECK(cudaDeviceGetAttribute(&max_grid, cudaDevAttrMaxGridDimX, device));
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
      b.block_begin[b.num + 1] = b.block_begin[b.num] + ceil_div(groups[g].n, kThreads);
      ++b.num;
    }
    if (b.num == 0) break;
    const unsigned grid = static_cast<unsigned>(std::min<int64_t>(b.block_begin[b.num], max_grid));
    delayed_scaling_update_kernel<<<grid, kThreads, 0, stream>>>(b, most_recent, margin);
    FUS_CUDA_CHECK_LAUNCH("delayed_scaling_update_kernel");
  }
}

void compute_scale_cuda(const float* amax, float* scale, float* scale_inv, float fp8_max,
                        int margin, bool keep_previous, const fus_context& ctx) {
  CudaDeviceGuard guard(ctx.device_index);
  compute_scale_kernel<<<1, 1, 0, stream_of(ctx)>>>(amax, scale, scale_inv, fp8_max, margin,
                                                    keep_previous);
  FUS_CUDA_CHECK_LAUNCH("compute_scale_kernel");
}

}  // namespace fusible
