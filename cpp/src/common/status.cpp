#include "common/status.h"

#include <cstdio>

namespace fusible {
namespace {
thread_local std::string g_last_error;
}  // namespace

fus_status set_error(fus_status code, const char* fmt, ...) {
  char buf[1024];
  va_list args;
  va_start(args, fmt);
  std::vsnprintf(buf, sizeof(buf), fmt, args);
  va_end(args);
  g_last_error = buf;
  return code;
}

void clear_error() { g_last_error.clear(); }

std::string or_list(const std::vector<std::string>& items) {
  std::string out;
  for (size_t i = 0; i < items.size(); ++i)
    out += std::string(i == 0 ? "" : i + 1 == items.size() ? " or " : ", ") + items[i];
  return out;
}

const char* last_error() { return g_last_error.c_str(); }

const char* dtype_name(fus_dtype dtype) {
  switch (dtype) {
    case FUS_FLOAT32: return "float32";
    case FUS_FLOAT16: return "float16";
    case FUS_BFLOAT16: return "bfloat16";
    case FUS_FLOAT8_E4M3: return "float8_e4m3";
    case FUS_FLOAT8_E5M2: return "float8_e5m2";
    case FUS_E8M0: return "e8m0";
  }
  return "unknown";
}

namespace {

// One row of FUS_SCALING_MODE_TABLE (fusible/common.h), indexed by the mode's value.
struct ScalingModeRow {
  const char* name;    // "fp8"
  const char* c_name;  // "FUS_SCALING_PER_TENSOR"
  int64_t block_rows;
  int64_t block_cols;
  fus_dtype scale_dtype;
  int transposed;
};

constexpr ScalingModeRow kScalingModes[] = {
#define FUS_SCALING_ROW_(id, value, name, block_rows, block_cols, scale_dtype, transposed) \
  {name, "FUS_SCALING_" #id, block_rows, block_cols, scale_dtype, transposed},
    FUS_SCALING_MODE_TABLE(FUS_SCALING_ROW_)
#undef FUS_SCALING_ROW_
};
constexpr int kNumScalingModes = static_cast<int>(sizeof(kScalingModes) / sizeof(kScalingModes[0]));

// kScalingModes is indexed by the modes' values.
#define FUS_SCALING_VALUE_(id, value, ...) value,
static_assert(values_are_row_indices({FUS_SCALING_MODE_TABLE(FUS_SCALING_VALUE_)}),
              "FUS_SCALING_MODE_TABLE: values must be 0, 1, ... in order");
#undef FUS_SCALING_VALUE_

bool valid_mode(fus_scaling_mode mode) {
  return static_cast<int>(mode) >= 0 && static_cast<int>(mode) < kNumScalingModes;
}

}  // namespace

const char* scaling_mode_c_name(fus_scaling_mode mode) {
  return valid_mode(mode) ? kScalingModes[mode].c_name : nullptr;
}

}  // namespace fusible

extern "C" {

const char* fus_scaling_mode_name(fus_scaling_mode mode) {
  return fusible::valid_mode(mode) ? fusible::kScalingModes[mode].name : nullptr;
}

fus_status fus_scaling_mode_layout(fus_scaling_mode mode, int64_t* block_rows, int64_t* block_cols,
                                   fus_dtype* scale_dtype, int* transposed) {
  fusible::clear_error();
  if (!fusible::valid_mode(mode))
    return fusible::set_error(FUS_ERROR_INVALID_ARGUMENT,
                              "fus_scaling_mode_layout: mode must be a fus_scaling_mode (0..%d), "
                              "got %d",
                              fusible::kNumScalingModes - 1, static_cast<int>(mode));
  const fusible::ScalingModeRow& r = fusible::kScalingModes[mode];
  if (block_rows) *block_rows = r.block_rows;
  if (block_cols) *block_cols = r.block_cols;
  if (scale_dtype) *scale_dtype = r.scale_dtype;
  if (transposed) *transposed = r.transposed;
  return FUS_SUCCESS;
}

const char* fus_last_error(void) { return fusible::last_error(); }

int fus_has_cuda(void) {
#if defined(FUSIBLE_WITH_CUDA)
  return 1;
#else
  return 0;
#endif
}

float fus_fp8_max(fus_dtype dtype) {
  switch (dtype) {
    case FUS_FLOAT8_E4M3: return 448.0f;
    case FUS_FLOAT8_E5M2: return 57344.0f;
    default: return 0.0f;
  }
}

size_t fus_dtype_size(fus_dtype dtype) {
  switch (dtype) {
    case FUS_FLOAT32: return 4;
    case FUS_FLOAT16:
    case FUS_BFLOAT16: return 2;
    case FUS_FLOAT8_E4M3:
    case FUS_FLOAT8_E5M2:
    case FUS_E8M0: return 1;
  }
  return 0;
}

}  // extern "C"
