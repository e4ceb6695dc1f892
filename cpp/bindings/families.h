// The torch operators of each kernel family (ops_<family>.cpp): their schemas and the
// registration of their CPU and CUDA kernels, which library.cpp defines and registers.
#pragma once

#include <torch/library.h>

#include <cstddef>

namespace fusible_torch {

struct Family {
  const char* const* schemas;  // torch.library schemas of the family's operators
  size_t count;
  void (*register_kernels)(torch::Library& m);  // for the CPU and CUDA dispatch keys
};

Family quantize_family();
Family recipe_family();
Family gemm_family();
Family normalization_family();
Family activation_family();

}  // namespace fusible_torch
