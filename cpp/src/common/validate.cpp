#include "common/validate.h"

#include <cmath>
#include <string>

namespace fusible {

void check_context(const char* fn, const fus_context* ctx) {
  if (ctx == nullptr) throw Error(FUS_ERROR_INVALID_ARGUMENT, std::string(fn) + ": ctx is NULL");
  if (ctx->device == FUS_DEVICE_CPU) return;
  if (ctx->device == FUS_DEVICE_CUDA) {
    if (!fus_has_cuda())
      throw Error(FUS_ERROR_UNSUPPORTED, std::string(fn) +
                                             ": CUDA device requested but this build of fusible "
                                             "has no CUDA backend (built without nvcc)");
    return;
  }
  throw Error(FUS_ERROR_INVALID_ARGUMENT,
              std::string(fn) + ": ctx->device must be FUS_DEVICE_CPU or FUS_DEVICE_CUDA, got " +
                  std::to_string(static_cast<int>(ctx->device)));
}

bool is_cuda(const fus_context* ctx) { return ctx->device == FUS_DEVICE_CUDA; }

void check_matrix(const char* fn, const char* arg, const fus_tensor* t,
                  std::initializer_list<fus_dtype> allowed) {
  const std::string where = std::string(fn) + ": " + arg;
  if (t == nullptr) throw Error(FUS_ERROR_INVALID_ARGUMENT, where + " is NULL");
  if (t->rows < 0 || t->cols < 0)
    throw Error(FUS_ERROR_INVALID_ARGUMENT, where + " has a negative dimension [" +
                                                std::to_string(t->rows) + ", " +
                                                std::to_string(t->cols) + "]");
  bool ok = false;
  std::string names;
  for (fus_dtype d : allowed) {
    ok = ok || d == t->dtype;
    names += (names.empty() ? "" : ", ") + std::string(dtype_name(d));
  }
  if (!ok)
    throw Error(FUS_ERROR_INVALID_ARGUMENT,
                where + " has dtype " + dtype_name(t->dtype) + ", expected one of {" + names + "}");
  if (t->rows * t->cols > 0 && t->data == nullptr)
    throw Error(FUS_ERROR_INVALID_ARGUMENT,
                where + " has NULL data but " + std::to_string(t->rows * t->cols) + " elements");
}

void check_same_shape(const char* fn, const char* arg, const fus_tensor* t, int64_t rows,
                      int64_t cols) {
  if (t->rows != rows || t->cols != cols)
    throw Error(FUS_ERROR_INVALID_ARGUMENT,
                std::string(fn) + ": " + arg + " has shape [" + std::to_string(t->rows) + ", " +
                    std::to_string(t->cols) + "], expected [" + std::to_string(rows) + ", " +
                    std::to_string(cols) + "]");
}

void check_quantized(const char* fn, const char* arg, const fus_quantized* q, int64_t rows,
                     int64_t cols) {
  const std::string where = std::string(fn) + ": " + arg;
  if (q == nullptr) throw Error(FUS_ERROR_INVALID_ARGUMENT, where + " is NULL");
  if (scaling_mode_c_name(q->mode) == nullptr) {
    std::vector<std::string> modes;  // every mode of FUS_SCALING_MODE_TABLE
    for (int m = 0; const char* c_name = scaling_mode_c_name(static_cast<fus_scaling_mode>(m)); ++m)
      modes.push_back(c_name);
    throw Error(FUS_ERROR_INVALID_ARGUMENT, where + "->mode must be " + or_list(modes) + ", got " +
                                                std::to_string(static_cast<int>(q->mode)));
  }
  if (q->dtype != FUS_FLOAT8_E4M3 && q->dtype != FUS_FLOAT8_E5M2)
    throw Error(FUS_ERROR_INVALID_ARGUMENT, where + "->dtype is " + dtype_name(q->dtype) +
                                                ", expected float8_e4m3 or float8_e5m2");
  if (q->rows != rows || q->cols != cols)
    throw Error(FUS_ERROR_INVALID_ARGUMENT,
                where + " describes [" + std::to_string(q->rows) + ", " + std::to_string(q->cols) +
                    "], expected [" + std::to_string(rows) + ", " + std::to_string(cols) + "]");
  if (q->mode == FUS_SCALING_BLOCK_1D || q->mode == FUS_SCALING_BLOCK_2D) {
    if (q->power_2_scale != 0 && q->power_2_scale != 1)
      throw Error(FUS_ERROR_INVALID_ARGUMENT, where + "->power_2_scale must be 0 or 1, got " +
                                                  std::to_string(q->power_2_scale));
    if (!std::isfinite(q->amax_epsilon) || q->amax_epsilon < 0.0f)
      throw Error(
          FUS_ERROR_INVALID_ARGUMENT,
          where + "->amax_epsilon must be finite and >= 0, got " + std::to_string(q->amax_epsilon));
  }
  if (q->amax_accumulate != 0 && q->amax_accumulate != 1)
    throw Error(FUS_ERROR_INVALID_ARGUMENT, where + "->amax_accumulate must be 0 or 1, got " +
                                                std::to_string(q->amax_accumulate));
  if (q->amax_accumulate && q->amax == nullptr)
    throw Error(FUS_ERROR_INVALID_ARGUMENT,
                where +
                    "->amax_accumulate is 1 but amax is NULL; expected the float[1] to "
                    "max-combine into");
  const bool empty = rows * cols == 0;
  if (empty) return;
  if (q->rowwise_data == nullptr && q->columnwise_data == nullptr)
    throw Error(FUS_ERROR_INVALID_ARGUMENT,
                where + " has neither rowwise_data nor columnwise_data; expected at least one");
  if (q->mode == FUS_SCALING_MXFP8) {
    if (q->rowwise_data != nullptr && q->rowwise_scale_inv == nullptr)
      throw Error(
          FUS_ERROR_INVALID_ARGUMENT,
          where + " has rowwise_data but NULL rowwise_scale_inv (E8M0 [rows, ceil(cols/32)])");
    if (q->columnwise_data != nullptr && q->columnwise_scale_inv == nullptr)
      throw Error(
          FUS_ERROR_INVALID_ARGUMENT,
          where +
              " has columnwise_data but NULL columnwise_scale_inv (E8M0 [ceil(rows/32), cols])");
  } else if (q->mode == FUS_SCALING_BLOCK_1D || q->mode == FUS_SCALING_BLOCK_2D) {
    if (q->rowwise_data != nullptr && q->rowwise_scale_inv == nullptr)
      throw Error(FUS_ERROR_INVALID_ARGUMENT,
                  where + " has rowwise_data but NULL rowwise_scale_inv (blockwise fp32 scales)");
    if (q->columnwise_data != nullptr && q->columnwise_scale_inv == nullptr)
      throw Error(
          FUS_ERROR_INVALID_ARGUMENT,
          where + " has columnwise_data but NULL columnwise_scale_inv (blockwise fp32 scales)");
  } else if (q->rowwise_scale_inv == nullptr) {
    throw Error(FUS_ERROR_INVALID_ARGUMENT,
                where + "->rowwise_scale_inv is NULL; per-tensor scaling needs float[1]");
  }
}

}  // namespace fusible
