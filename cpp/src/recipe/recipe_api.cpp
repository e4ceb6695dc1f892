// C API of the recipe family: validation, then dispatch.
#include <string>

#include "common/validate.h"
#include "recipe/recipe_impl.h"

using namespace fusible;

namespace {

// One row of FUS_AMAX_ALGO_TABLE (fusible/recipe.h), indexed by the algorithm's value.
struct AlgoRow {
  const char* name;    // "max"
  const char* c_name;  // "FUS_AMAX_MAX"
};

constexpr AlgoRow kAlgos[] = {
#define FUS_AMAX_ALGO_ROW_(id, value, name) {name, "FUS_AMAX_" #id},
    FUS_AMAX_ALGO_TABLE(FUS_AMAX_ALGO_ROW_)
#undef FUS_AMAX_ALGO_ROW_
};
constexpr int kNumAlgos = static_cast<int>(sizeof(kAlgos) / sizeof(kAlgos[0]));

// kAlgos is indexed by the algorithms' values.
#define FUS_AMAX_ALGO_VALUE_(id, value, ...) value,
static_assert(values_are_row_indices({FUS_AMAX_ALGO_TABLE(FUS_AMAX_ALGO_VALUE_)}),
              "FUS_AMAX_ALGO_TABLE: values must be 0, 1, ... in order");
#undef FUS_AMAX_ALGO_VALUE_

bool valid_algo(fus_amax_algo algo) {
  return static_cast<int>(algo) >= 0 && static_cast<int>(algo) < kNumAlgos;
}

// "FUS_AMAX_MAX or FUS_AMAX_MOST_RECENT": every algorithm's enumerator.
std::string algo_list() {
  std::vector<std::string> names;
  for (const AlgoRow& r : kAlgos) names.push_back(r.c_name);
  return or_list(names);
}

}  // namespace

extern "C" {

const char* fus_amax_algo_name(fus_amax_algo algo) {
  return valid_algo(algo) ? kAlgos[algo].name : nullptr;
}

fus_status fus_delayed_scaling_update(const fus_delayed_scaling_group* groups, int num_groups,
                                      fus_amax_algo algo, int margin, const fus_context* ctx) {
  constexpr const char* fn = "fus_delayed_scaling_update";
  return guarded(fn, [&] {
    check_context(fn, ctx);
    if (num_groups < 0 || (num_groups > 0 && groups == nullptr))
      throw Error(FUS_ERROR_INVALID_ARGUMENT,
                  std::string(fn) + ": groups must hold num_groups >= 0 descriptors, got " +
                      std::to_string(num_groups));
    if (!valid_algo(algo))
      throw Error(FUS_ERROR_INVALID_ARGUMENT, std::string(fn) + ": algo must be " + algo_list());
    for (int g = 0; g < num_groups; ++g) {
      const fus_delayed_scaling_group& grp = groups[g];
      const std::string where = std::string(fn) + ": groups[" + std::to_string(g) + "]";
      if (grp.history_len < 1 || grp.n < 0)
        throw Error(FUS_ERROR_INVALID_ARGUMENT,
                    where + " needs history_len >= 1 and n >= 0, got history_len=" +
                        std::to_string(grp.history_len) + " n=" + std::to_string(grp.n));
      if (grp.n > 0 && (grp.amax_history == nullptr || grp.scale == nullptr))
        throw Error(FUS_ERROR_INVALID_ARGUMENT, where + " has a NULL amax_history or scale");
      if (!(grp.fp8_max > 0.0f))
        throw Error(FUS_ERROR_INVALID_ARGUMENT, where + ".fp8_max must be > 0");
    }
    if (is_cuda(ctx)) {
#if defined(FUSIBLE_WITH_CUDA)
      delayed_scaling_update_cuda(groups, num_groups, algo, margin, *ctx);
#endif
    } else {
      delayed_scaling_update_cpu(groups, num_groups, algo, margin);
    }
    return FUS_SUCCESS;
  });
}

fus_status fus_compute_scale(const float* amax, float* scale, float* scale_inv, float fp8_max,
                             int margin, int keep_previous, const fus_context* ctx) {
  constexpr const char* fn = "fus_compute_scale";
  return guarded(fn, [&] {
    check_context(fn, ctx);
    if (amax == nullptr || scale == nullptr)
      throw Error(FUS_ERROR_INVALID_ARGUMENT,
                  std::string(fn) + ": amax and scale must be float[1]");
    if (!(fp8_max > 0.0f))
      throw Error(FUS_ERROR_INVALID_ARGUMENT, std::string(fn) + ": fp8_max must be > 0");
    if (is_cuda(ctx)) {
#if defined(FUSIBLE_WITH_CUDA)
      scale_from_amax_cuda(amax, scale, scale_inv, fp8_max, margin, keep_previous != 0, *ctx);
#endif
    } else {
      scale_from_amax_cpu(amax, scale, scale_inv, fp8_max, margin, keep_previous != 0);
    }
    return FUS_SUCCESS;
  });
}

}  // extern "C"
