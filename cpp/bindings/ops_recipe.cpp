// torch.ops.fusible recipe family: per-tensor scale from an amax, and the batched delayed-scaling
// update (cpp/include/fusible/recipe.h).
#include <cmath>
#include <iterator>

#include "families.h"
#include "fusible/recipe.h"
#include "torch_ops.h"

namespace fusible_torch {
namespace {

std::tuple<Tensor, Tensor> compute_scale(const Tensor& amax, at::ScalarType fp8_dtype,
                                         int64_t margin) {
  const char* op = "compute_scale";
  check_scalar(op, "amax", amax, amax.device());
  check_fp8_dtype(op, fp8_dtype);
  check_margin(op, margin);
  Tensor scale = empty({1}, at::kFloat, amax);
  Tensor scale_inv = empty({1}, at::kFloat, amax);
  if (!shapes_only(amax)) {
    const fus_context ctx = context_of(amax);
    // keep_previous = 0: scale 1 where amax is 0 or not finite (scale is never read).
    check_status(
        op, fus_compute_scale(fptr(amax), fptr(scale), fptr(scale_inv),
                              fus_fp8_max(code_of(fp8_dtype)), static_cast<int>(margin), 0, &ctx));
  }
  return {scale, scale_inv};
}

// The algorithm named `algo` (FUS_AMAX_ALGO_TABLE, fusible/recipe.h: "max", "most_recent").
fus_amax_algo check_algo(const char* op, c10::string_view algo) {
  std::string names;  // "'A', 'B' or 'C'"
  int count = 0;
#define FUS_AMAX_ALGO_COUNT_(id, value, name) ++count;
  FUS_AMAX_ALGO_TABLE(FUS_AMAX_ALGO_COUNT_)
#undef FUS_AMAX_ALGO_COUNT_
  for (int a = 0; a < count; ++a) {
    const char* name = fus_amax_algo_name(static_cast<fus_amax_algo>(a));
    if (algo == name) return static_cast<fus_amax_algo>(a);
    names += std::string(a == 0 ? "" : a + 1 == count ? " or " : ", ") + "'" + name + "'";
  }
  FUS_VALUE_CHECK(false, op, "algo must be ", names, ", got '", std::string(algo), "'");
  return FUS_AMAX_MAX;  // not reached
}

// Operator schemas (docs in python/fusible/_kernels/; the C contract in fusible/recipe.h).
const char* const kSchemas[] = {
    "compute_scale(Tensor amax, ScalarType fp8_dtype, SymInt margin) -> (Tensor, Tensor)",
    "delayed_scaling_update(Tensor(a0!)[] amax_histories, Tensor(a1!)[] scales,"
    " float[] fp8_maxes, str algo, SymInt margin) -> ()",
};

}  // namespace

void delayed_scaling_update(at::TensorList amax_histories, at::TensorList scales,
                            at::ArrayRef<double> fp8_maxes, c10::string_view algo, int64_t margin) {
  const char* op = "delayed_scaling_update";
  FUS_VALUE_CHECK(amax_histories.size() == scales.size() && scales.size() == fp8_maxes.size(), op,
                  "amax_histories, scales and fp8_maxes must have equal lengths, got ",
                  amax_histories.size(), ", ", scales.size(), " and ", fp8_maxes.size());
  const fus_amax_algo algo_value = check_algo(op, algo);
  check_margin(op, margin);
  if (amax_histories.empty()) return;
  const c10::Device device = amax_histories[0].device();
  for (size_t g = 0; g < amax_histories.size(); ++g) {
    const Tensor& h = amax_histories[g];
    const Tensor& s = scales[g];
    const std::string hn = "amax_histories[" + std::to_string(g) + "]";
    const std::string sn = "scales[" + std::to_string(g) + "]";
    check_tensor(op, hn.c_str(), h, {at::kFloat}, device);
    check_tensor(op, sn.c_str(), s, {at::kFloat}, device);
    FUS_VALUE_CHECK(h.dim() == 2 && s.dim() == 1 && h.size(1) == s.size(0) && h.size(0) >= 1, op,
                    hn, " must be [history_len >= 1, n] and ", sn, " [n], got ",
                    shape_str(h.sizes()), " and ", shape_str(s.sizes()));
    FUS_VALUE_CHECK(fp8_maxes[g] > 0, op, "argument 'fp8_maxes[", g,
                    "]' must be > 0 (448 for E4M3, 57344 for E5M2), got ", fp8_maxes[g]);
  }
  if (shapes_only(amax_histories[0])) return;
  std::vector<fus_delayed_scaling_group> groups;
  groups.reserve(amax_histories.size());
  for (size_t g = 0; g < amax_histories.size(); ++g) {
    const Tensor& h = amax_histories[g];
    groups.push_back(fus_delayed_scaling_group{fptr(h), fptr(scales[g]), h.size(0), h.size(1),
                                               static_cast<float>(fp8_maxes[g])});
  }
  const fus_context ctx = context_of(amax_histories[0]);
  check_status(op, fus_delayed_scaling_update(groups.data(), static_cast<int>(groups.size()),
                                              algo_value, static_cast<int>(margin), &ctx));
}

Family recipe_family() {
  // The CPU / CUDA kernel of compute_scale (delayed_scaling_update: one for every backend, below).
  auto kernels = [](torch::Library& m) { m.impl("compute_scale", &compute_scale); };
  return {kSchemas, std::size(kSchemas), kernels};
}

}  // namespace fusible_torch

// The update takes lists, which may be empty (nothing to dispatch on): one kernel for every
// backend, which reads the device from the tensors.
TORCH_LIBRARY_IMPL(fusible, CompositeExplicitAutograd, m) {
  m.impl("delayed_scaling_update", &fusible_torch::delayed_scaling_update);
}
