// torch.ops.fusible: every family's operators (their schemas and CPU / CUDA kernels live in the
// family's own ops_<family>.cpp) defined and registered for the CPU and CUDA dispatch keys.
// Shapes under fake tensors (torch.compile) come from the fake kernels in
// python/fusible/_kernels/<family>.py, which handle symbolic shapes. The Autograd key gets torch's
// "not implemented" kernel: the operators are called by fusible's autograd functions with grad mode
// off; called with grad on, they run, and a backward through their outputs raises, naming the
// operator (as torch.library.custom_op does).
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/library.h>

#include <string>
#include <string_view>
#include <vector>

#include "families.h"
#include "fusible/common.h"
#include "fusible/gemm.h"

// Every family, in one list (each defines its own schemas and kernels: ops_<family>.cpp).
static std::vector<fusible_torch::Family> families() {
  using namespace fusible_torch;
  return {quantize_family(), recipe_family(), gemm_family(), normalization_family(),
          activation_family()};
}

TORCH_LIBRARY(fusible, m) {
  for (const auto& f : families())
    for (size_t i = 0; i < f.count; ++i) m.def(f.schemas[i]);
  // What this build of the core library has (no tensors: one kernel for every backend).
  m.def("has_cuda() -> bool", [] { return fus_has_cuda() != 0; });
  m.def("gemm_has_cublaslt() -> bool", [] { return fus_gemm_has_cublaslt() != 0; });
}

TORCH_LIBRARY_IMPL(fusible, CPU, m) {
  for (const auto& f : families()) f.register_kernels(m);
}
TORCH_LIBRARY_IMPL(fusible, CUDA, m) {
  for (const auto& f : families()) f.register_kernels(m);
}

TORCH_LIBRARY_IMPL(fusible, Autograd, m) {
  for (const auto& f : families()) {
    for (size_t i = 0; i < f.count; ++i) {
      const std::string_view s(f.schemas[i]);
      const std::string name(s.substr(0, s.find('(')));
      m.impl(name.c_str(), torch::autograd::autogradNotImplementedFallback());
    }
  }
}
