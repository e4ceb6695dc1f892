// Bindings of the activation family (glue only). Optional tensors and quantized outputs are
// passed as None.
#include <optional>

#include "bindings.h"
#include "fusible/activation.h"

namespace fusible_bindings {

void bind_activation(py::module_& m) {
  m.def(
      "activation_is_gated",
      [](int kind) { return fus_activation_is_gated(static_cast<fus_activation>(kind)) != 0; },
      py::arg("kind"));
  m.def(
      "activation_forward",
      [](int kind, const fus_tensor& x, std::optional<fus_tensor> y, std::optional<fus_quantized> q,
         const fus_context& ctx) {
        check(fus_activation_forward(static_cast<fus_activation>(kind), &x, y ? &*y : nullptr,
                                     q ? &*q : nullptr, &ctx));
      },
      py::arg("kind"), py::arg("x"), py::arg("y"), py::arg("q"), py::arg("ctx"));
  m.def(
      "activation_backward_workspace_size",
      [](int64_t rows, int64_t cols, const fus_context& ctx) {
        size_t bytes = 0;
        check(fus_activation_backward_workspace_size(rows, cols, &ctx, &bytes));
        return bytes;
      },
      py::arg("rows"), py::arg("cols"), py::arg("ctx"));
  m.def(
      "activation_backward",
      [](int kind, const fus_tensor& grad, const fus_tensor& x, std::optional<fus_tensor> dx,
         std::optional<fus_quantized> q, std::optional<fus_tensor> dbias, uintptr_t workspace,
         size_t workspace_bytes, const fus_context& ctx) {
        check(fus_activation_backward(
            static_cast<fus_activation>(kind), &grad, &x, dx ? &*dx : nullptr, q ? &*q : nullptr,
            dbias ? &*dbias : nullptr, as_ptr(workspace), workspace_bytes, &ctx));
      },
      py::arg("kind"), py::arg("grad"), py::arg("x"), py::arg("dx"), py::arg("q"), py::arg("dbias"),
      py::arg("workspace"), py::arg("workspace_bytes"), py::arg("ctx"));
}

}  // namespace fusible_bindings
