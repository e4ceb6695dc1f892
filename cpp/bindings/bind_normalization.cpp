// Bindings of the normalization family (glue only). Optional tensors and quantized outputs are
// passed as None.
#include <optional>

#include "bindings.h"
#include "fusible/normalization.h"

namespace fusible_bindings {

void bind_normalization(py::module_& m) {
  m.def(
      "norm_forward",
      [](int kind, const fus_tensor& x, const fus_tensor& gamma, std::optional<fus_tensor> beta,
         float eps, bool zero_centered_gamma, std::optional<fus_tensor> y,
         std::optional<fus_quantized> q, uintptr_t mean, uintptr_t rstd, const fus_context& ctx) {
        check(fus_norm_forward(
            static_cast<fus_norm_kind>(kind), &x, &gamma, beta ? &*beta : nullptr, eps,
            zero_centered_gamma ? 1 : 0, y ? &*y : nullptr, q ? &*q : nullptr,
            static_cast<float*>(as_ptr(mean)), static_cast<float*>(as_ptr(rstd)), &ctx));
      },
      py::arg("kind"), py::arg("x"), py::arg("gamma"), py::arg("beta"), py::arg("eps"),
      py::arg("zero_centered_gamma"), py::arg("y"), py::arg("q"), py::arg("mean"), py::arg("rstd"),
      py::arg("ctx"));
  m.def(
      "norm_backward_workspace_size",
      [](int64_t rows, int64_t cols, const fus_context& ctx) {
        size_t bytes = 0;
        check(fus_norm_backward_workspace_size(rows, cols, &ctx, &bytes));
        return bytes;
      },
      py::arg("rows"), py::arg("cols"), py::arg("ctx"));
  m.def(
      "norm_backward",
      [](int kind, const fus_tensor& dy, const fus_tensor& x, uintptr_t mean, uintptr_t rstd,
         const fus_tensor& gamma, bool zero_centered_gamma, fus_tensor dx, fus_tensor dgamma,
         std::optional<fus_tensor> dbeta, uintptr_t workspace, size_t workspace_bytes,
         const fus_context& ctx) {
        check(fus_norm_backward(
            static_cast<fus_norm_kind>(kind), &dy, &x, static_cast<const float*>(as_ptr(mean)),
            static_cast<const float*>(as_ptr(rstd)), &gamma, zero_centered_gamma ? 1 : 0, &dx,
            &dgamma, dbeta ? &*dbeta : nullptr, as_ptr(workspace), workspace_bytes, &ctx));
      },
      py::arg("kind"), py::arg("dy"), py::arg("x"), py::arg("mean"), py::arg("rstd"),
      py::arg("gamma"), py::arg("zero_centered_gamma"), py::arg("dx"), py::arg("dgamma"),
      py::arg("dbeta"), py::arg("workspace"), py::arg("workspace_bytes"), py::arg("ctx"));
}

}  // namespace fusible_bindings
