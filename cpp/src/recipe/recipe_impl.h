// Backend entry points of the recipe family; arguments validated by recipe_api.cpp. The scale of
// one amax (fus_compute_scale) is the shared rule of common/cast.h.
#pragma once

#include "common/cast.h"
#include "common/numerics.h"
#include "fusible/recipe.h"

namespace fusible {

// One column of one group: the update documented in fusible/recipe.h. Shared by both backends.
FUS_HD void delayed_scaling_update_column(float* history, float* scale, int64_t history_len,
                                          int64_t n, int64_t i, float fp8_max, bool most_recent,
                                          int margin) {
  uint32_t amax = abs_bits(history[i]);
  if (!most_recent) {
    for (int64_t k = 1; k < history_len; ++k) {
      const uint32_t v = abs_bits(history[k * n + i]);
      amax = v > amax ? v : amax;
    }
  }
  scale[i] = compute_scale(bits_as_float(amax), fp8_max, margin, scale[i]);
  const float newest = history[i];
  for (int64_t k = 0; k + 1 < history_len; ++k) history[k * n + i] = history[(k + 1) * n + i];
  history[(history_len - 1) * n + i] = newest;
  history[i] = 0.0f;
}

void delayed_scaling_update_cpu(const fus_delayed_scaling_group* groups, int num_groups,
                                fus_amax_algo algo, int margin);

#if defined(FUSIBLE_WITH_CUDA)
void delayed_scaling_update_cuda(const fus_delayed_scaling_group* groups, int num_groups,
                                 fus_amax_algo algo, int margin, const fus_context& ctx);
#endif

}  // namespace fusible
