// One registration function per kernel family (ops_<family>.cpp), called by library.cpp for the
// CPU and CUDA dispatch keys.
#pragma once

#include <torch/library.h>

namespace fusible_torch {

void register_quantize(torch::Library& m);
void register_recipe(torch::Library& m);
void register_gemm(torch::Library& m);
void register_normalization(torch::Library& m);
void register_activation(torch::Library& m);
void register_grouped(torch::Library& m);

}  // namespace fusible_torch
