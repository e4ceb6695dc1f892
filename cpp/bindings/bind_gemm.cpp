// Bindings of the gemm family (glue only): fus_gemm_args is assembled from keyword arguments;
// absent tensors are passed as all-zero fusible._C.Tensor(0, 0, 0, 0).
#include "bindings.h"
#include "fusible/gemm.h"

namespace fusible_bindings {

void bind_gemm(py::module_& m) {
  m.def(
      "gemm",
      [](const fus_tensor& a, const fus_tensor& b, bool transa, bool transb, uintptr_t a_scale_inv,
         uintptr_t b_scale_inv, const fus_tensor& d, uintptr_t d_scale, uintptr_t d_amax,
         const fus_tensor& c, float alpha, float beta, int epilogue, const fus_tensor& bias,
         const fus_tensor& aux, const fus_tensor& dbias, bool use_fast_accum,
         const fus_context& ctx) {
        fus_gemm_args args{};
        args.a = a;
        args.b = b;
        args.transa = transa ? 1 : 0;
        args.transb = transb ? 1 : 0;
        args.a_scale_inv = static_cast<const float*>(as_ptr(a_scale_inv));
        args.b_scale_inv = static_cast<const float*>(as_ptr(b_scale_inv));
        args.d = d;
        args.d_scale = static_cast<const float*>(as_ptr(d_scale));
        args.d_amax = static_cast<float*>(as_ptr(d_amax));
        args.c = c;
        args.alpha = alpha;
        args.beta = beta;
        args.epilogue = static_cast<fus_gemm_epilogue>(epilogue);
        args.bias = bias;
        args.aux = aux;
        args.dbias = dbias;
        args.use_fast_accum = use_fast_accum ? 1 : 0;
        check(fus_gemm(&args, &ctx));
      },
      py::arg("a"), py::arg("b"), py::arg("transa"), py::arg("transb"), py::arg("a_scale_inv"),
      py::arg("b_scale_inv"), py::arg("d"), py::arg("d_scale"), py::arg("d_amax"), py::arg("c"),
      py::arg("alpha"), py::arg("beta"), py::arg("epilogue"), py::arg("bias"), py::arg("aux"),
      py::arg("dbias"), py::arg("use_fast_accum"), py::arg("ctx"));
  m.def("gemm_has_cublaslt", [] { return fus_gemm_has_cublaslt() != 0; });
}

}  // namespace fusible_bindings
