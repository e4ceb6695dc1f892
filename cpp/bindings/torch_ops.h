// The torch operator layer (torch.ops.fusible.*): one C++ function per operator, registered for the
// CPU and CUDA dispatch keys. Each validates its arguments (raising ValueError / TypeError that
// name the operator, the argument and what was expected), allocates its outputs with ATen and
// calls the C API on the input's device and the current CUDA stream. Fake tensors (torch.compile)
// get their shapes from the fake kernels in python/fusible/_kernels/ (symbolic shapes need
// them); torch.library.opcheck checks that the two agree.
//
// Conventions shared with the C API (cpp/include/fusible/common.h): tensors are viewed as
// row-major matrices, x of shape (..., k) being [numel / k, k]; outputs not asked for are
// 0-element tensors (operators cannot return None).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>

#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "fusible/common.h"

namespace fusible_torch {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

// "fusible.<op>: argument '<name>' ..." messages, as ValueError / TypeError.
#define FUS_VALUE_CHECK(cond, op, ...) TORCH_CHECK_VALUE(cond, "fusible.", op, ": ", __VA_ARGS__)
#define FUS_TYPE_CHECK(cond, op, ...) TORCH_CHECK_TYPE(cond, "fusible.", op, ": ", __VA_ARGS__)

// torch dtype -> fus_dtype (fusible/common.h); only the dtypes fusible stores.
fus_dtype code_of(at::ScalarType t);

// Names for messages: "torch.float32".
std::string dtype_name(at::ScalarType t);
std::string dtype_list(const std::vector<at::ScalarType>& dtypes);
std::string shape_str(at::IntArrayRef shape);

const std::vector<at::ScalarType>& high_precision();  // float32, float16, bfloat16
const std::vector<at::ScalarType>& fp8_dtypes();      // float8_e4m3fn, float8_e5m2
bool is_fp8(at::ScalarType t);

// A tensor argument: dtype in `dtypes` (when not empty), on a CPU / CUDA / meta device, on `device`
// (when given), contiguous, and not CUDA in a build without the CUDA backend.
void check_tensor(const char* op, const char* name, const Tensor& t,
                  const std::vector<at::ScalarType>& dtypes = {},
                  std::optional<c10::Device> device = std::nullopt);
// One float32 value on `device`.
void check_scalar(const char* op, const char* name, const Tensor& t, c10::Device device);
void check_fp8_dtype(const char* op, at::ScalarType t);
void check_out_dtype(const char* op, at::ScalarType t);  // float32, float16, bfloat16
void check_opt_out_dtype(const char* op, std::optional<at::ScalarType> t);
void check_margin(const char* op, int64_t margin);
void require_a_copy(const char* op, bool rowwise, bool columnwise);
// `value` is one of `choices`; returns its index (the C enum's value).
int check_choice(const char* op, const char* name, std::string_view value,
                 const std::vector<std::string_view>& choices);

// [prod(shape[:-1]), shape[-1]]; a 0-d tensor is an error naming `name`.
std::pair<int64_t, int64_t> matrix_shape(const char* op, const Tensor& x, const char* name = "x");

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Whether the tensors hold no data (meta, or fake tensors running a Meta kernel with Meta in the
// thread's included dispatch keys). The fake kernels serve those; this guard keeps a kernel from
// reading their data pointers should one reach it anyway.
inline bool shapes_only(const Tensor& t) {
  return t.is_meta() || c10::impl::tls_is_dispatch_key_included(c10::DispatchKey::Meta);
}

// The C API's views. A 0-element tensor passes a null pointer.
inline void* ptr(const Tensor& t) { return t.numel() == 0 ? nullptr : t.data_ptr(); }
inline void* ptr(const OptTensor& t) { return t.has_value() ? ptr(*t) : nullptr; }
inline float* fptr(const Tensor& t) { return static_cast<float*>(ptr(t)); }
inline float* fptr(const OptTensor& t) { return static_cast<float*>(ptr(t)); }
inline fus_tensor mat(const Tensor& t, int64_t rows, int64_t cols) {
  return fus_tensor{ptr(t), code_of(t.scalar_type()), rows, cols};
}
inline constexpr fus_tensor kAbsent{nullptr, FUS_FLOAT32, 0, 0};

// The C API's context for `t`'s device: the current CUDA stream for a CUDA tensor; for a CPU
// tensor it also sets the CPU backend's thread count to torch's (fus_cpu_set_num_threads).
fus_context context_of(const Tensor& t);

// A failed C status becomes ValueError (bad argument), TypeError (unsupported) or RuntimeError,
// with the C API's message (naming the C function and argument) after "fusible.<op>: ".
void check_status(const char* op, fus_status st);

// Output allocation on `like`'s device.
Tensor empty(at::IntArrayRef shape, at::ScalarType dtype, const Tensor& like);
inline Tensor nothing(at::ScalarType dtype, const Tensor& like) { return empty({0}, dtype, like); }

// Shape of a blockwise copy [R, C]'s scale_inv matrix (fusible/common.h): block_dim 1 (1x128
// blocks) [ceil(C/128), R], block_dim 2 (128x128) [ceil(R/128), ceil(C/128)].
std::vector<int64_t> block_scale_shape(int64_t block_dim, int64_t R, int64_t C);

// The quantized output of norm_fwd / act_fwd / act_bwd as four tensors plus amax (see
// python/fusible/_kernels/__init__.py and _common.py), chosen by the operator's quant= name: 0 =
// "none", 1 + m = the name of fus_scaling_mode m (FUS_SCALING_MODE_TABLE, fusible/common.h:
// "fp8", "mxfp8", "block1d" = 1x128 blocks, "block2d" = 128x128 blocks); power_2_scale /
// amax_epsilon: the blockwise cast's parameters.
enum QuantMode {
  kQuantNone = 0,
#define FUS_QUANT_ENUMERATOR_(id, value, name, block_rows, block_cols, scale_dtype, transposed) \
  kQuant_##id = value + 1,
  FUS_SCALING_MODE_TABLE(FUS_QUANT_ENUMERATOR_)
#undef FUS_QUANT_ENUMERATOR_
};
// The scaling mode of a quant other than kQuantNone.
inline fus_scaling_mode scaling_mode_of(int quant) {
  return static_cast<fus_scaling_mode>(quant - kQuant_PER_TENSOR);
}
// The accumulate target of a cast, argument 'amax_into' (a delayed-scaling history slot): float32
// of one value on `device` (a (1,) view at any offset of a larger buffer). The cast then
// max-combines its amax into it (fus_quantized.amax_accumulate) and returns an empty amax; `quant`
// must not be "none" (kQuantNone: nothing is cast).
void check_amax_into(const char* op, const OptTensor& amax_into, int quant, c10::Device device);
// quantized_view's result pointed at amax_into (accumulating) when given, and quant_outputs' amax
// (outs[first + 4]) replaced by an empty tensor.
void accumulate_into(std::optional<fus_quantized>& qv, std::vector<Tensor>& outs, size_t first,
                     const OptTensor& amax_into, const Tensor& like);
int check_quant_args(const char* op, std::string_view quant, at::ScalarType fp8_dtype,
                     const OptTensor& scale, bool rowwise, bool columnwise, double amax_epsilon,
                     c10::Device device);
// The copies of a cast (quant other than kQuantNone) of a tensor of `shape`, as fus_quantized
// holds them: {data, the columnwise copy (data_t [cols, rows]; MXFP8: `shape`), rowwise scales
// (per tensor: scale_inv [1]), columnwise scales (per tensor: none)}, each empty unless requested.
std::vector<Tensor> copy_outputs(at::IntArrayRef shape, const Tensor& like, int quant,
                                 at::ScalarType fp8_dtype, bool rowwise, bool columnwise);
// copy_outputs and the amax [1] (all five empty for quant none).
std::vector<Tensor> quant_outputs(at::IntArrayRef shape, const Tensor& like, int quant,
                                  at::ScalarType fp8_dtype, bool rowwise, bool columnwise);
// The fus_quantized view of quant_outputs (outs[first .. first + 5)), or nullopt for quant none.
std::optional<fus_quantized> quantized_view(int quant, at::ScalarType fp8_dtype, int64_t rows,
                                            int64_t cols, const std::vector<Tensor>& outs,
                                            size_t first, const OptTensor& scale,
                                            bool power_2_scale, double amax_epsilon);

// Groups of rows (MoE experts) given either as a list of tensors (one per group) or as one packed
// tensor whose rows m_splits splits into consecutive groups (tokens grouped by expert): the
// grouped operators of the quantize and gemm families (grouped_quantize_fp8, grouped_gemm,
// grouped_bias_grad). A list of G > 1 tensors with m_splits: group g is x[g] (m_splits[g] == its
// rows) or skipped (m_splits[g] == 0: an empty group).
struct Groups {
  std::vector<Tensor> mats;  // one 2-D view per group
  bool packed = false;
};
Groups split_groups(const char* op, const char* name, at::TensorList x, at::IntArrayRef m_splits,
                    const std::vector<at::ScalarType>& dtypes);
// "name[i]", for messages.
std::string nth(const char* name, size_t i);

}  // namespace fusible_torch
