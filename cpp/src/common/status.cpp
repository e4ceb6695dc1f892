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

}  // namespace fusible

extern "C" {

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
