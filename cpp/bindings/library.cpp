// torch.ops.fusible: the operator schemas, and one registration of each family's functions for the
// CPU and CUDA dispatch keys. Shapes under fake tensors (torch.compile) come from the fake kernels
// in python/fusible/_kernels.py, which handle symbolic shapes. The Autograd key gets torch's "not
// implemented" kernel: the operators are called by fusible's autograd functions with grad mode
// off; called with grad on, they run, and a backward through their outputs raises, naming the
// operator (as torch.library.custom_op does).
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include <string>
#include <string_view>

#include "families.h"
#include "fusible/common.h"
#include "fusible/gemm.h"

// Operator schemas (docs in python/fusible/_kernels.py; the C contract in
// cpp/include/fusible/<family>.h).
static const char* const kSchemas[] = {
    // quantize
    "quantize_fp8(Tensor x, Tensor scale, ScalarType fp8_dtype, bool rowwise, bool columnwise)"
    " -> (Tensor, Tensor, Tensor, Tensor)",
    "quantize_fp8_current(Tensor x, ScalarType fp8_dtype, SymInt margin, bool rowwise,"
    " bool columnwise) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
    "dequantize_fp8(Tensor data, Tensor scale_inv, ScalarType out_dtype) -> Tensor",
    "transpose_fp8(Tensor x) -> Tensor",
    "compute_amax(Tensor x) -> Tensor",
    "quantize_mxfp8(Tensor x, ScalarType fp8_dtype, bool rowwise, bool columnwise)"
    " -> (Tensor, Tensor, Tensor, Tensor)",
    "dequantize_mxfp8(Tensor data, Tensor scale, bool columnwise, ScalarType out_dtype) -> Tensor",
    "quantize_fp8_block(Tensor x, ScalarType fp8_dtype, SymInt block_dim, bool power_2_scale,"
    " float amax_epsilon, bool rowwise, bool columnwise) -> (Tensor, Tensor, Tensor, Tensor)",
    "dequantize_fp8_block(Tensor data, Tensor scale_inv, SymInt block_dim, ScalarType out_dtype)"
    " -> Tensor",
    // recipe
    "compute_scale(Tensor amax, ScalarType fp8_dtype, SymInt margin) -> (Tensor, Tensor)",
    "delayed_scaling_update(Tensor(a0!)[] amax_histories, Tensor(a1!)[] scales,"
    " float[] fp8_maxes, str algo, SymInt margin) -> ()",
    // gemm
    "gemm(Tensor a, Tensor b, bool transa, bool transb, Tensor? a_scale_inv,"
    " Tensor? b_scale_inv, ScalarType out_dtype, Tensor? bias, str epilogue, Tensor? aux,"
    " Tensor? c, float alpha, float beta, Tensor? out_scale, bool want_amax,"
    " bool fast_accum=False) -> (Tensor, Tensor, Tensor, Tensor)",
    "gemm_block(Tensor a, Tensor a_scale_inv, SymInt a_block_dim, Tensor b, Tensor b_scale_inv,"
    " SymInt b_block_dim, ScalarType out_dtype, Tensor? c, float alpha, float beta) -> Tensor",
    // normalization
    "norm_fwd(Tensor x, Tensor gamma, Tensor? beta, float eps, str kind,"
    " bool zero_centered_gamma, ScalarType? out_dtype, str quant, ScalarType fp8_dtype,"
    " Tensor? scale, bool rowwise, bool columnwise, bool power_2_scale=True,"
    " float amax_epsilon=0.0) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    "norm_bwd(Tensor dy, Tensor x, Tensor mean, Tensor rstd, Tensor gamma, str kind,"
    " bool zero_centered_gamma) -> (Tensor, Tensor, Tensor)",
    // activation
    "act_fwd(Tensor x, str kind, ScalarType? out_dtype, str quant, ScalarType fp8_dtype,"
    " Tensor? scale, bool rowwise, bool columnwise, bool power_2_scale=True,"
    " float amax_epsilon=0.0) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    "act_bwd(Tensor grad, Tensor x, str kind, ScalarType? out_dtype, str quant,"
    " ScalarType fp8_dtype, Tensor? scale, bool rowwise, bool columnwise, bool with_dbias,"
    " bool power_2_scale=True, float amax_epsilon=0.0)"
    " -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    // grouped (MoE experts: one call for every group)
    "grouped_quantize_fp8(Tensor[] x, SymInt[] m_splits, Tensor? scales, ScalarType fp8_dtype,"
    " SymInt margin, bool rowwise, bool columnwise)"
    " -> (Tensor[], Tensor[], Tensor[], Tensor, Tensor)",
    "grouped_gemm(Tensor[] a, Tensor[] b, SymInt[] m_splits, Tensor[]? a_scale_inv,"
    " Tensor[]? b_scale_inv, ScalarType out_dtype, Tensor[]? bias, bool fast_accum,"
    " bool packed_out) -> Tensor[]",
    "grouped_bias_grad(Tensor dy, SymInt[] m_splits, ScalarType out_dtype) -> Tensor[]",
};

static void register_all(torch::Library& m) {
  fusible_torch::register_quantize(m);
  fusible_torch::register_recipe(m);
  fusible_torch::register_gemm(m);
  fusible_torch::register_normalization(m);
  fusible_torch::register_activation(m);
  fusible_torch::register_grouped(m);
}

TORCH_LIBRARY(fusible, m) {
  for (const char* schema : kSchemas) m.def(schema);
  // What this build of the core library has (no tensors: one kernel for every backend).
  m.def("has_cuda() -> bool", [] { return fus_has_cuda() != 0; });
  m.def("gemm_has_cublaslt() -> bool", [] { return fus_gemm_has_cublaslt() != 0; });
}

TORCH_LIBRARY_IMPL(fusible, CPU, m) { register_all(m); }
TORCH_LIBRARY_IMPL(fusible, CUDA, m) { register_all(m); }

TORCH_LIBRARY_IMPL(fusible, Autograd, m) {
  for (const char* schema : kSchemas) {
    const std::string_view s(schema);
    const std::string name(s.substr(0, s.find('(')));
    m.impl(name.c_str(), torch::autograd::autogradNotImplementedFallback());
  }
}
