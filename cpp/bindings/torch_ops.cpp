// Helpers shared by the torch operator layer (torch_ops.h).
#include "torch_ops.h"

#include <ATen/Context.h>
#include <ATen/EmptyTensor.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <cmath>
#include <cstdlib>
#include <sstream>

namespace fusible_torch {

fus_dtype code_of(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return FUS_FLOAT32;
    case at::kHalf: return FUS_FLOAT16;
    case at::kBFloat16: return FUS_BFLOAT16;
    case at::kFloat8_e4m3fn: return FUS_FLOAT8_E4M3;
    case at::kFloat8_e5m2: return FUS_FLOAT8_E5M2;
    case at::kByte: return FUS_E8M0;
    default: TORCH_CHECK_TYPE(false, "fusible: dtype ", dtype_name(t), " has no fus_dtype");
  }
}

std::string dtype_name(at::ScalarType t) {
  switch (t) {  // torch's Python names (c10's are "Float", "Half", ...)
    case at::kFloat: return "torch.float32";
    case at::kDouble: return "torch.float64";
    case at::kHalf: return "torch.float16";
    case at::kBFloat16: return "torch.bfloat16";
    case at::kFloat8_e4m3fn: return "torch.float8_e4m3fn";
    case at::kFloat8_e5m2: return "torch.float8_e5m2";
    case at::kByte: return "torch.uint8";
    case at::kChar: return "torch.int8";
    case at::kShort: return "torch.int16";
    case at::kInt: return "torch.int32";
    case at::kLong: return "torch.int64";
    case at::kBool: return "torch.bool";
    default: return std::string("torch.") + c10::toString(t);
  }
}

std::string dtype_list(const std::vector<at::ScalarType>& dtypes) {
  std::string s;
  for (size_t i = 0; i < dtypes.size(); ++i) s += (i ? ", " : "") + dtype_name(dtypes[i]);
  return s;
}

std::string shape_str(at::IntArrayRef shape) {  // Python's tuple repr: (), (5,), (2, 3)
  std::ostringstream s;
  s << "(";
  for (size_t i = 0; i < shape.size(); ++i) s << (i ? ", " : "") << shape[i];
  if (shape.size() == 1) s << ",";
  s << ")";
  return s.str();
}

const std::vector<at::ScalarType>& high_precision() {
  static const std::vector<at::ScalarType> v{at::kFloat, at::kHalf, at::kBFloat16};
  return v;
}

const std::vector<at::ScalarType>& fp8_dtypes() {
  static const std::vector<at::ScalarType> v{at::kFloat8_e4m3fn, at::kFloat8_e5m2};
  return v;
}

bool is_fp8(at::ScalarType t) { return t == at::kFloat8_e4m3fn || t == at::kFloat8_e5m2; }

void check_tensor(const char* op, const char* name, const Tensor& t,
                  const std::vector<at::ScalarType>& dtypes, std::optional<c10::Device> device) {
  if (!dtypes.empty()) {
    bool ok = false;
    for (auto d : dtypes) ok = ok || t.scalar_type() == d;
    FUS_TYPE_CHECK(ok, op, "argument '", name, "' must have dtype in (", dtype_list(dtypes),
                   "), got ", dtype_name(t.scalar_type()));
  }
  const auto type = t.device().type();
  FUS_VALUE_CHECK(type == c10::DeviceType::CPU || type == c10::DeviceType::CUDA ||
                      type == c10::DeviceType::Meta,
                  op, "argument '", name, "' is on ", t.device().str(),
                  "; expected a CPU or CUDA tensor");
  FUS_VALUE_CHECK(!device.has_value() || t.device() == *device, op, "argument '", name, "' is on ",
                  t.device().str(), ", expected the input's device ",
                  device.has_value() ? device->str() : "");
  FUS_VALUE_CHECK(t.is_contiguous(), op, "argument '", name, "' must be contiguous (shape ",
                  shape_str(t.sizes()), ", stride ", shape_str(t.strides()),
                  "); call .contiguous() first");
  TORCH_CHECK(type != c10::DeviceType::CUDA || fus_has_cuda(), "fusible.", op, ": argument '", name,
              "' is a CUDA tensor but fusible was built without its CUDA backend (no nvcc at "
              "build time)");
}

void check_scalar(const char* op, const char* name, const Tensor& t, c10::Device device) {
  check_tensor(op, name, t, {at::kFloat}, device);
  FUS_VALUE_CHECK(t.numel() == 1, op, "argument '", name,
                  "' must hold exactly one float32 value, got shape ", shape_str(t.sizes()));
}

void check_fp8_dtype(const char* op, at::ScalarType t) {
  FUS_TYPE_CHECK(is_fp8(t), op,
                 "argument 'fp8_dtype' must be torch.float8_e4m3fn or torch.float8_e5m2, got ",
                 dtype_name(t));
}

void check_out_dtype(const char* op, at::ScalarType t) {
  FUS_TYPE_CHECK(t == at::kFloat || t == at::kHalf || t == at::kBFloat16, op,
                 "argument 'out_dtype' must be float32, float16 or bfloat16, got ", dtype_name(t));
}

void check_opt_out_dtype(const char* op, std::optional<at::ScalarType> t) {
  FUS_TYPE_CHECK(!t.has_value() || *t == at::kFloat || *t == at::kHalf || *t == at::kBFloat16, op,
                 "argument 'out_dtype' must be None, float32, float16 or bfloat16, got ",
                 t.has_value() ? dtype_name(*t) : "None");
}

void check_margin(const char* op, int64_t margin) {
  FUS_VALUE_CHECK(margin >= -(int64_t{1} << 31) && margin < (int64_t{1} << 31), op,
                  "argument 'margin' must fit in int32, got ", margin);
}

void require_a_copy(const char* op, bool rowwise, bool columnwise) {
  FUS_VALUE_CHECK(rowwise || columnwise, op,
                  "at least one of 'rowwise' and 'columnwise' must be True");
}

int check_choice(const char* op, const char* name, std::string_view value,
                 const std::vector<std::string_view>& choices) {
  for (size_t i = 0; i < choices.size(); ++i)
    if (choices[i] == value) return static_cast<int>(i);
  std::string list;  // Python's tuple repr: ('a', 'b')
  for (size_t i = 0; i < choices.size(); ++i)
    list += std::string(i ? ", " : "") + "'" + std::string(choices[i]) + "'";
  FUS_VALUE_CHECK(false, op, "argument '", name, "' must be one of (", list, "), got '",
                  std::string(value), "'");
  return -1;
}

std::pair<int64_t, int64_t> matrix_shape(const char* op, const Tensor& x, const char* name) {
  FUS_VALUE_CHECK(x.dim() > 0, op, "argument '", name,
                  "' must have at least one dimension, got a scalar");
  const int64_t cols = x.size(-1);
  int64_t rows = 1;
  for (int64_t i = 0; i + 1 < x.dim(); ++i) rows *= x.size(i);
  return {rows, cols};
}

fus_context context_of(const Tensor& t) {
  if (!t.is_cuda()) {
    // CPU kernels use as many threads as torch's intra-op pool (torch.set_num_threads; one
    // inside a torch parallel region), unless FUSIBLE_NUM_THREADS sets the count.
    static const bool follow_torch = std::getenv("FUSIBLE_NUM_THREADS") == nullptr;
    if (follow_torch) fus_cpu_set_num_threads(at::get_num_threads());
    return fus_context{FUS_DEVICE_CPU, 0, nullptr};
  }
  const c10::Device dev = t.device();
  // The current stream through the CUDA guard that torch registers at run time: no link against
  // torch's CUDA libraries, and the same stream torch.cuda.current_stream() names (CUDA graph
  // capture included).
  const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  return fus_context{FUS_DEVICE_CUDA, dev.index(), impl->getStream(dev).native_handle()};
}

void check_status(const char* op, fus_status st) {
  if (st == FUS_SUCCESS) return;
  FUS_VALUE_CHECK(st != FUS_ERROR_INVALID_ARGUMENT, op, fus_last_error());
  FUS_TYPE_CHECK(st != FUS_ERROR_UNSUPPORTED, op, fus_last_error());
  TORCH_CHECK(false, "fusible.", op, ": ", fus_last_error());
}

Tensor empty(at::IntArrayRef shape, at::ScalarType dtype, const Tensor& like) {
  // The operators allocate 4-8 outputs each (about 90 a step of a small FP8 block), so on CPU
  // and CUDA this calls the allocator directly, as aten's own empty kernels do below their
  // dispatch (BackendSelect, then the backend's kernel): the same allocator, stream and device,
  // less the dispatcher's work for each call. Other devices (meta under fake tensors), and
  // deterministic mode's fill of fresh memory, take at::empty.
  const c10::Device device = like.device();
  const bool direct = (device.is_cpu() || device.is_cuda()) && !shapes_only(like) &&
                      !(at::globalContext().deterministicAlgorithms() &&
                        at::globalContext().deterministicFillUninitializedMemory());
  if (!direct) return at::empty(shape, at::TensorOptions().dtype(dtype).device(device));
  if (device.is_cpu()) {
    return at::detail::empty_generic(shape, c10::GetCPUAllocator(),
                                     c10::DispatchKeySet(c10::DispatchKey::CPU), dtype,
                                     std::nullopt);
  }
  // The CUDA caching allocator allocates on the current device, with the current stream.
  const c10::DeviceGuard guard(device);
  return at::detail::empty_generic(shape, c10::GetAllocator(c10::kCUDA),
                                   c10::DispatchKeySet(c10::DispatchKey::CUDA), dtype,
                                   std::nullopt);
}

std::vector<int64_t> block_scale_shape(int64_t block_dim, int64_t R, int64_t C) {
  if (block_dim == 1) return {ceil_div(C, FUS_FP8_BLOCK), R};
  return {ceil_div(R, FUS_FP8_BLOCK), ceil_div(C, FUS_FP8_BLOCK)};
}

int check_quant_args(const char* op, std::string_view quant, at::ScalarType fp8_dtype,
                     const OptTensor& scale, bool rowwise, bool columnwise, double amax_epsilon,
                     c10::Device device) {
  // "none", then the modes' names in fus_scaling_mode order.
  static const std::vector<std::string_view> kQuantNames{"none",
#define FUS_QUANT_NAME_(id, value, name, block_rows, block_cols, scale_dtype, transposed) name,
                                                         FUS_SCALING_MODE_TABLE(FUS_QUANT_NAME_)
#undef FUS_QUANT_NAME_
  };
  const int mode = check_choice(op, "quant", quant, kQuantNames);
  if (mode == kQuantNone) return mode;
  check_fp8_dtype(op, fp8_dtype);
  require_a_copy(op, rowwise, columnwise);
  if (mode == kQuant_PER_TENSOR) {
    FUS_VALUE_CHECK(scale.has_value(), op,
                    "argument 'scale' is required for quant='fp8' (float32, one value)");
    check_scalar(op, "scale", *scale, device);
  } else if (scale.has_value()) {
    check_tensor(op, "scale", *scale, {}, device);  // unused, but must not mix devices
  }
  if (mode == kQuant_BLOCK_1D || mode == kQuant_BLOCK_2D)
    FUS_VALUE_CHECK(std::isfinite(amax_epsilon) && amax_epsilon >= 0.0, op,
                    "argument 'amax_epsilon' must be finite and >= 0, got ", amax_epsilon);
  return mode;
}

void check_amax_into(const char* op, const OptTensor& amax_into, int quant, c10::Device device) {
  if (!amax_into.has_value()) return;
  FUS_VALUE_CHECK(quant != kQuantNone, op,
                  "argument 'amax_into' must be None for quant='none' (no cast, no amax)");
  check_scalar(op, "amax_into", *amax_into, device);
}

void accumulate_into(std::optional<fus_quantized>& qv, std::vector<Tensor>& outs, size_t first,
                     const OptTensor& amax_into, const Tensor& like) {
  if (!amax_into.has_value()) return;
  outs[first + 4] = nothing(at::kFloat, like);
  if (qv) {
    qv->amax = fptr(*amax_into);
    qv->amax_accumulate = 1;
  }
}

std::vector<Tensor> copy_outputs(at::IntArrayRef shape, const Tensor& like, int quant,
                                 at::ScalarType fp8_dtype, bool rowwise, bool columnwise) {
  int64_t rows = 1;
  for (size_t i = 0; i + 1 < shape.size(); ++i) rows *= shape[i];
  const int64_t cols = shape.empty() ? 1 : shape.back();
  const auto u8 = at::kByte;
  Tensor data = rowwise ? empty(shape, fp8_dtype, like) : nothing(fp8_dtype, like);
  if (quant == kQuant_PER_TENSOR || quant == kQuant_BLOCK_1D || quant == kQuant_BLOCK_2D) {
    Tensor data_t = columnwise ? empty({cols, rows}, fp8_dtype, like) : nothing(fp8_dtype, like);
    if (quant == kQuant_PER_TENSOR)
      return {data, data_t, empty({1}, at::kFloat, like), nothing(u8, like)};
    const int64_t bd = quant == kQuant_BLOCK_1D ? 1 : 2;
    const auto f32 = at::kFloat;
    Tensor s = rowwise ? empty(block_scale_shape(bd, rows, cols), f32, like) : nothing(f32, like);
    Tensor cs =
        columnwise ? empty(block_scale_shape(bd, cols, rows), f32, like) : nothing(f32, like);
    return {data, data_t, s, cs};
  }
  Tensor col = columnwise ? empty(shape, fp8_dtype, like) : nothing(fp8_dtype, like);
  Tensor s = rowwise ? empty({rows, ceil_div(cols, FUS_MXFP8_BLOCK)}, u8, like) : nothing(u8, like);
  Tensor cs =
      columnwise ? empty({ceil_div(rows, FUS_MXFP8_BLOCK), cols}, u8, like) : nothing(u8, like);
  return {data, col, s, cs};
}

std::vector<Tensor> quant_outputs(at::IntArrayRef shape, const Tensor& like, int quant,
                                  at::ScalarType fp8_dtype, bool rowwise, bool columnwise) {
  const auto u8 = at::kByte;
  if (quant == kQuantNone)
    return {nothing(u8, like), nothing(u8, like), nothing(at::kFloat, like), nothing(u8, like),
            nothing(at::kFloat, like)};
  std::vector<Tensor> outs = copy_outputs(shape, like, quant, fp8_dtype, rowwise, columnwise);
  outs.push_back(empty({1}, at::kFloat, like));
  return outs;
}

std::optional<fus_quantized> quantized_view(int quant, at::ScalarType fp8_dtype, int64_t rows,
                                            int64_t cols, const std::vector<Tensor>& outs,
                                            size_t first, const OptTensor& scale,
                                            bool power_2_scale, double amax_epsilon) {
  if (quant == kQuantNone) return std::nullopt;
  const fus_scaling_mode mode = scaling_mode_of(quant);
  return fus_quantized{mode,
                       code_of(fp8_dtype),
                       rows,
                       cols,
                       ptr(outs[first]),
                       ptr(outs[first + 1]),
                       ptr(outs[first + 2]),
                       mode == FUS_SCALING_PER_TENSOR ? nullptr : ptr(outs[first + 3]),
                       mode == FUS_SCALING_PER_TENSOR ? fptr(scale) : nullptr,
                       fptr(outs[first + 4]),
                       power_2_scale ? 1 : 0,
                       static_cast<float>(amax_epsilon),
                       0};
}

std::string nth(const char* name, size_t i) {
  return std::string(name) + "[" + std::to_string(i) + "]";
}

Groups split_groups(const char* op, const char* name, at::TensorList x, at::IntArrayRef m_splits,
                    const std::vector<at::ScalarType>& dtypes) {
  Groups g;
  FUS_VALUE_CHECK(!x.empty(), op, "argument '", name, "' must hold at least one tensor, got none");
  const c10::Device dev = x[0].device();
  // A list of G > 1 tensors with m_splits: group g is x[g] (m_splits[g] == its rows) or skipped
  // (m_splits[g] == 0: an empty group).
  const bool listed = m_splits.empty() || (x.size() > 1 && x.size() == m_splits.size());
  if (listed) {
    for (size_t i = 0; i < x.size(); ++i) {
      const std::string n = nth(name, i);
      check_tensor(op, n.c_str(), x[i], dtypes, dev);
      FUS_TYPE_CHECK(x[i].scalar_type() == x[0].scalar_type(), op, "argument '", n, "' has dtype ",
                     dtype_name(x[i].scalar_type()), ", expected ", name, "[0]'s ",
                     dtype_name(x[0].scalar_type()), " (one dtype per group)");
      auto [rows, cols] = matrix_shape(op, x[i], n.c_str());
      const Tensor m = x[i].view({rows, cols});
      if (m_splits.empty()) {
        g.mats.push_back(m);
        continue;
      }
      FUS_VALUE_CHECK(m_splits[i] == rows || m_splits[i] == 0, op, "argument 'm_splits[", i,
                      "]' must be the rows of ", n, " (", rows, ") or 0 (skip it), got ",
                      m_splits[i]);
      g.mats.push_back(m_splits[i] ? m : m.narrow(0, 0, 0));
    }
    return g;
  }
  FUS_VALUE_CHECK(x.size() == 1, op, "argument '", name, "' must be one packed tensor when ",
                  "m_splits is given (", m_splits.size(), " groups), got ", x.size(), " tensors");
  const std::string n = nth(name, 0);
  check_tensor(op, n.c_str(), x[0], dtypes);
  auto [rows, cols] = matrix_shape(op, x[0], n.c_str());
  int64_t total = 0;
  for (size_t i = 0; i < m_splits.size(); ++i) {
    FUS_VALUE_CHECK(m_splits[i] >= 0, op, "argument 'm_splits[", i, "]' must be >= 0, got ",
                    m_splits[i]);
    total += m_splits[i];
  }
  FUS_VALUE_CHECK(total == rows, op, "argument 'm_splits' must sum to the rows of ", n, " (", rows,
                  ", shape ", shape_str(x[0].sizes()), "), got sum ", total);
  const Tensor m = x[0].view({rows, cols});
  int64_t off = 0;
  for (int64_t s : m_splits) {
    g.mats.push_back(m.narrow(0, off, s));
    off += s;
  }
  g.packed = true;
  return g;
}

}  // namespace fusible_torch
