// CPU backend of the recipe family.
#include "recipe/recipe_impl.h"

namespace fusible {

void delayed_scaling_update_cpu(const fus_delayed_scaling_group* groups, int num_groups,
                                fus_amax_algo algo, int margin) {
  for (int g = 0; g < num_groups; ++g) {
    const fus_delayed_scaling_group& grp = groups[g];
    for (int64_t i = 0; i < grp.n; ++i)
      delayed_scaling_update_column(grp.amax_history, grp.scale, grp.history_len, grp.n, i,
                                    grp.fp8_max, algo == FUS_AMAX_MOST_RECENT, margin);
  }
}

}  // namespace fusible
