// fusible._C: glue between Python and the C API. No logic lives here: the structs are exposed as
// plain records (pointers as integers), and a failed status becomes a Python exception.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings.h"
#include "fusible/recipe.h"

using namespace fusible_bindings;

namespace {

fus_tensor make_tensor(uintptr_t data, int dtype, int64_t rows, int64_t cols) {
  return fus_tensor{as_ptr(data), static_cast<fus_dtype>(dtype), rows, cols};
}

fus_context make_context(int device, int index, uintptr_t stream) {
  return fus_context{static_cast<fus_device_type>(device), index, as_ptr(stream)};
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "fusible core library bindings (see cpp/include/fusible/*.h)";

  py::class_<fus_tensor>(m, "Tensor")
      .def(py::init(&make_tensor), py::arg("data"), py::arg("dtype"), py::arg("rows"),
           py::arg("cols"));
  py::class_<fus_context>(m, "Context")
      .def(py::init(&make_context), py::arg("device"), py::arg("device_index"),
           py::arg("stream"));
  py::class_<fus_quantized>(m, "Quantized")
      .def(py::init([](int mode, int dtype, int64_t rows, int64_t cols, uintptr_t rowwise_data,
                       uintptr_t columnwise_data, uintptr_t rowwise_scale_inv,
                       uintptr_t columnwise_scale_inv, uintptr_t scale, uintptr_t amax) {
             return fus_quantized{static_cast<fus_scaling_mode>(mode),
                                  static_cast<fus_dtype>(dtype),
                                  rows,
                                  cols,
                                  as_ptr(rowwise_data),
                                  as_ptr(columnwise_data),
                                  as_ptr(rowwise_scale_inv),
                                  as_ptr(columnwise_scale_inv),
                                  static_cast<float*>(as_ptr(scale)),
                                  static_cast<float*>(as_ptr(amax))};
           }),
           py::arg("mode"), py::arg("dtype"), py::arg("rows"), py::arg("cols"),
           py::arg("rowwise_data"), py::arg("columnwise_data"), py::arg("rowwise_scale_inv"),
           py::arg("columnwise_scale_inv"), py::arg("scale"), py::arg("amax"));
  py::class_<fus_delayed_scaling_group>(m, "DelayedScalingGroup")
      .def(py::init([](uintptr_t amax_history, uintptr_t scale, int64_t history_len, int64_t n,
                       float fp8_max) {
             return fus_delayed_scaling_group{static_cast<float*>(as_ptr(amax_history)),
                                              static_cast<float*>(as_ptr(scale)), history_len, n,
                                              fp8_max};
           }),
           py::arg("amax_history"), py::arg("scale"), py::arg("history_len"), py::arg("n"),
           py::arg("fp8_max"));

  m.def("has_cuda", [] { return fus_has_cuda() != 0; });
  m.def("fp8_max", [](int dtype) { return fus_fp8_max(static_cast<fus_dtype>(dtype)); });

  bind_quantize(m);
  bind_recipe(m);
  bind_gemm(m);
  bind_normalization(m);
  bind_activation(m);
  // One line per kernel family (bind_<family>.cpp).
}
