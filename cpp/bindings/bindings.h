// Shared helpers of the binding files (glue only).
#pragma once

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <stdexcept>

#include "fusible/common.h"

namespace fusible_bindings {

namespace py = pybind11;

inline void* as_ptr(uintptr_t p) { return reinterpret_cast<void*>(p); }

// A failed status becomes ValueError (bad argument), TypeError (unsupported) or RuntimeError.
inline void check(fus_status st) {
  if (st == FUS_SUCCESS) return;
  if (st == FUS_ERROR_INVALID_ARGUMENT) throw py::value_error(fus_last_error());
  if (st == FUS_ERROR_UNSUPPORTED) throw py::type_error(fus_last_error());
  throw std::runtime_error(fus_last_error());
}

// One function per kernel family, each defined in bind_<family>.cpp.
void bind_quantize(py::module_& m);
void bind_recipe(py::module_& m);
void bind_normalization(py::module_& m);
void bind_activation(py::module_& m);
void bind_gemm(py::module_& m);

}  // namespace fusible_bindings
