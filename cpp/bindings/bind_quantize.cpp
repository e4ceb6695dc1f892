// Bindings of the quantize and recipe families (glue only).
#include "bindings.h"
#include "fusible/quantize.h"
#include "fusible/recipe.h"

namespace fusible_bindings {

void bind_quantize(py::module_& m) {
  m.def("quantize", [](const fus_tensor& in, fus_quantized out, const fus_context& ctx) {
    check(fus_quantize(&in, &out, &ctx));
  });
  m.def("quantize_current_scaling",
        [](const fus_tensor& in, fus_quantized out, int margin, const fus_context& ctx) {
          check(fus_quantize_current_scaling(&in, &out, margin, &ctx));
        });
  m.def("compute_amax", [](const fus_tensor& in, uintptr_t amax, const fus_context& ctx) {
    check(fus_compute_amax(&in, static_cast<float*>(as_ptr(amax)), &ctx));
  });
  m.def("dequantize",
        [](const fus_quantized& in, bool columnwise, fus_tensor out, const fus_context& ctx) {
          check(fus_dequantize(&in, columnwise ? 1 : 0, &out, &ctx));
        });
  m.def("transpose_fp8", [](const fus_tensor& in, fus_tensor out, const fus_context& ctx) {
    check(fus_transpose_fp8(&in, &out, &ctx));
  });
}

void bind_recipe(py::module_& m) {
  m.def("delayed_scaling_update", [](const std::vector<fus_delayed_scaling_group>& groups,
                                     int algo, int margin, const fus_context& ctx) {
    check(fus_delayed_scaling_update(groups.data(), static_cast<int>(groups.size()),
                                     static_cast<fus_amax_algo>(algo), margin, &ctx));
  });
  m.def("compute_scale", [](uintptr_t amax, uintptr_t scale, uintptr_t scale_inv, float fp8_max,
                            int margin, bool keep_previous, const fus_context& ctx) {
    check(fus_compute_scale(static_cast<const float*>(as_ptr(amax)),
                            static_cast<float*>(as_ptr(scale)),
                            static_cast<float*>(as_ptr(scale_inv)), fp8_max, margin,
                            keep_previous ? 1 : 0, &ctx));
  });

}

}  // namespace fusible_bindings
