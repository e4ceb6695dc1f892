// torch.ops.fusible quantize family: per-tensor FP8 (delayed and current scaling), MXFP8,
// blockwise FP8, FP8 transpose, amax, and the grouped per-tensor casts of MoE experts
// (cpp/include/fusible/quantize.h).
#include <cmath>
#include <iterator>

#include "families.h"
#include "fusible/quantize.h"
#include "torch_ops.h"

namespace fusible_torch {
namespace {

// data (x's shape) and data_t [k, rows] for the requested copies; empty when not requested.
std::pair<Tensor, Tensor> fp8_outputs(const Tensor& x, int64_t rows, int64_t cols,
                                      at::ScalarType fp8_dtype, bool rowwise, bool columnwise) {
  return {rowwise ? empty(x.sizes(), fp8_dtype, x) : nothing(fp8_dtype, x),
          columnwise ? empty({cols, rows}, fp8_dtype, x) : nothing(fp8_dtype, x)};
}

// The fus_quantized view of a per-tensor FP8 cast's outputs.
fus_quantized per_tensor_view(at::ScalarType fp8_dtype, int64_t rows, int64_t cols,
                              const Tensor& data, const Tensor& data_t, const Tensor& scale_inv,
                              const Tensor& scale, const Tensor& amax, bool accumulate = false) {
  return fus_quantized{FUS_SCALING_PER_TENSOR,
                       code_of(fp8_dtype),
                       rows,
                       cols,
                       ptr(data),
                       ptr(data_t),
                       ptr(scale_inv),
                       nullptr,
                       fptr(scale),
                       fptr(amax),
                       0,
                       0.0f,
                       accumulate ? 1 : 0};
}

// The fus_quantized view of data copies and their scales alone (no per-tensor scale or amax, no
// blockwise parameters in the struct): the MXFP8 and blockwise casts and every dequantize.
fus_quantized copies_view(fus_scaling_mode mode, fus_dtype dtype, int64_t rows, int64_t cols,
                          void* data, void* data_t, void* scale, void* col_scale) {
  return fus_quantized{mode,      dtype,   rows,    cols, data, data_t, scale,
                       col_scale, nullptr, nullptr, 0,    0.0f, 0};
}

// x's cast into copies of `quant` (copy_outputs) by `cast(in, q, ctx)`, the C call, once the
// operator has checked its arguments: {data, rowwise scales, columnwise copy, columnwise scales}.
template <typename Cast>
std::tuple<Tensor, Tensor, Tensor, Tensor> cast_copies(const char* op, const Tensor& x, int quant,
                                                       at::ScalarType fp8_dtype, bool rowwise,
                                                       bool columnwise, Cast cast) {
  auto [rows, cols] = matrix_shape(op, x);
  const std::vector<Tensor> outs =
      copy_outputs(x.sizes(), x, quant, fp8_dtype, rowwise, columnwise);
  if (!shapes_only(x)) {
    fus_quantized q = copies_view(scaling_mode_of(quant), code_of(fp8_dtype), rows, cols,
                                  ptr(outs[0]), ptr(outs[1]), ptr(outs[2]), ptr(outs[3]));
    const fus_tensor in = mat(x, rows, cols);
    const fus_context ctx = context_of(x);
    check_status(op, cast(&in, &q, &ctx));
  }
  return {outs[0], outs[2], outs[1], outs[3]};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> quantize_fp8(const Tensor& x, const Tensor& scale,
                                                        at::ScalarType fp8_dtype, bool rowwise,
                                                        bool columnwise, const OptTensor& amax_into,
                                                        bool want_amax, bool keep_scale) {
  const char* op = "quantize_fp8";
  check_tensor(op, "x", x, high_precision());
  check_scalar(op, "scale", scale, x.device());
  check_fp8_dtype(op, fp8_dtype);
  require_a_copy(op, rowwise, columnwise);
  check_amax_into(op, amax_into, kQuant_PER_TENSOR, x.device());
  auto [rows, cols] = matrix_shape(op, x);
  auto [data, data_t] = fp8_outputs(x, rows, cols, fp8_dtype, rowwise, columnwise);
  Tensor scale_inv = empty({1}, at::kFloat, x);
  // Accumulating: the amax goes into amax_into, and the returned one is empty. Neither (a cast
  // remade with a scale of before, which records nothing): no amax is taken at all -- no reset,
  // no reduction -- and the returned one is empty.
  const bool acc = amax_into.has_value();
  FUS_VALUE_CHECK(want_amax || !acc, op,
                  "argument 'want_amax' must be True when amax_into is given (it is the amax)");
  // keep_scale: the fourth output is a copy of `scale` as this cast read it (delayed scaling keeps
  // it for backward's cast again; the state's scale changes in place at the step's update). Made
  // here rather than by a clone after the call: one operator less, and a traced graph cannot
  // recompute it in backward from the updated scale (a partitioner may recompute a clone).
  FUS_VALUE_CHECK(!keep_scale || acc || !want_amax, op,
                  "argument 'keep_scale' needs the amax not returned (amax_into given, or "
                  "want_amax=False): the fourth output is the scale's copy then");
  Tensor amax = keep_scale          ? scale.clone()
                : acc || !want_amax ? nothing(at::kFloat, x)
                                    : empty({1}, at::kFloat, x);
  if (!shapes_only(x)) {
    fus_quantized q = per_tensor_view(fp8_dtype, rows, cols, data, data_t, scale_inv, scale,
                                      acc ? *amax_into : amax, acc);
    if (!acc && !want_amax) q.amax = nullptr;
    const fus_tensor in = mat(x, rows, cols);
    const fus_context ctx = context_of(x);
    check_status(op, fus_quantize(&in, &q, &ctx));
  }
  return {data, data_t, scale_inv, amax};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor> quantize_fp8_current(
    const Tensor& x, at::ScalarType fp8_dtype, int64_t margin, bool rowwise, bool columnwise) {
  const char* op = "quantize_fp8_current";
  check_tensor(op, "x", x, high_precision());
  check_fp8_dtype(op, fp8_dtype);
  require_a_copy(op, rowwise, columnwise);
  check_margin(op, margin);
  auto [rows, cols] = matrix_shape(op, x);
  auto [data, data_t] = fp8_outputs(x, rows, cols, fp8_dtype, rowwise, columnwise);
  // All three are written by the call (amax first, then scale from it, then scale_inv).
  Tensor scale = empty({1}, at::kFloat, x);
  Tensor scale_inv = empty({1}, at::kFloat, x);
  Tensor amax = empty({1}, at::kFloat, x);
  if (!shapes_only(x)) {
    fus_quantized q = per_tensor_view(fp8_dtype, rows, cols, data, data_t, scale_inv, scale, amax);
    const fus_tensor in = mat(x, rows, cols);
    const fus_context ctx = context_of(x);
    check_status(op, fus_quantize_current_scaling(&in, &q, static_cast<int>(margin), &ctx));
  }
  return {data, data_t, scale, scale_inv, amax};
}

// One copy (rowwise, or MXFP8's columnwise) of quantized data, dequantized into a new tensor of
// data's shape: the C call every dequantize operator makes once its arguments are checked.
Tensor dequantize_copy(const char* op, fus_scaling_mode mode, const Tensor& data,
                       const Tensor& scale, bool columnwise, int64_t rows, int64_t cols,
                       at::ScalarType out_dtype) {
  Tensor out = empty(data.sizes(), out_dtype, data);
  if (!shapes_only(data)) {
    void* p = ptr(data);
    void* sc = ptr(scale);
    const fus_quantized q =
        copies_view(mode, code_of(data.scalar_type()), rows, cols, columnwise ? nullptr : p,
                    columnwise ? p : nullptr, columnwise ? nullptr : sc, columnwise ? sc : nullptr);
    fus_tensor o = mat(out, rows, cols);
    const fus_context ctx = context_of(data);
    check_status(op, fus_dequantize(&q, columnwise ? 1 : 0, &o, &ctx));
  }
  return out;
}

Tensor dequantize_fp8(const Tensor& data, const Tensor& scale_inv, at::ScalarType out_dtype) {
  const char* op = "dequantize_fp8";
  check_tensor(op, "data", data, fp8_dtypes());
  check_scalar(op, "scale_inv", scale_inv, data.device());
  check_out_dtype(op, out_dtype);
  auto [rows, cols] = matrix_shape(op, data, "data");
  return dequantize_copy(op, FUS_SCALING_PER_TENSOR, data, scale_inv, false, rows, cols, out_dtype);
}

Tensor transpose_fp8(const Tensor& x) {
  const char* op = "transpose_fp8";
  check_tensor(op, "x", x, fp8_dtypes());
  FUS_VALUE_CHECK(x.dim() == 2, op, "argument 'x' must be a 2-D matrix [rows, cols], got shape ",
                  shape_str(x.sizes()));
  const int64_t rows = x.size(0), cols = x.size(1);
  Tensor out = empty({cols, rows}, x.scalar_type(), x);
  if (!shapes_only(x)) {
    const fus_tensor in = mat(x, rows, cols);
    fus_tensor o = mat(out, cols, rows);
    const fus_context ctx = context_of(x);
    check_status(op, fus_transpose_fp8(&in, &o, &ctx));
  }
  return out;
}

Tensor compute_amax(const Tensor& x) {
  const char* op = "compute_amax";
  check_tensor(op, "x", x, high_precision());
  auto [rows, cols] = matrix_shape(op, x);
  Tensor amax = empty({1}, at::kFloat, x);
  if (!shapes_only(x)) {
    const fus_tensor in = mat(x, rows, cols);
    const fus_context ctx = context_of(x);
    check_status(op, fus_compute_amax(&in, fptr(amax), &ctx));
  }
  return amax;
}

std::tuple<Tensor, Tensor, Tensor, Tensor> quantize_mxfp8(const Tensor& x, at::ScalarType fp8_dtype,
                                                          bool rowwise, bool columnwise) {
  const char* op = "quantize_mxfp8";
  check_tensor(op, "x", x, high_precision());
  check_fp8_dtype(op, fp8_dtype);
  require_a_copy(op, rowwise, columnwise);
  return cast_copies(op, x, kQuant_MXFP8, fp8_dtype, rowwise, columnwise, fus_quantize);
}

Tensor dequantize_mxfp8(const Tensor& data, const Tensor& scale, bool columnwise,
                        at::ScalarType out_dtype) {
  const char* op = "dequantize_mxfp8";
  check_tensor(op, "data", data, fp8_dtypes());
  check_tensor(op, "scale", scale, {at::kByte}, data.device());
  check_out_dtype(op, out_dtype);
  auto [rows, cols] = matrix_shape(op, data, "data");
  const std::vector<int64_t> expected =
      columnwise ? std::vector<int64_t>{ceil_div(rows, FUS_MXFP8_BLOCK), cols}
                 : std::vector<int64_t>{rows, ceil_div(cols, FUS_MXFP8_BLOCK)};
  FUS_VALUE_CHECK(rows * cols == 0 || scale.sizes() == at::IntArrayRef(expected), op,
                  "argument 'scale' has shape ", shape_str(scale.sizes()), ", expected ",
                  shape_str(expected), " for ", columnwise ? "columnwise" : "rowwise",
                  " data of matrix shape (", rows, ", ", cols, ")");
  return dequantize_copy(op, FUS_SCALING_MXFP8, data, scale, columnwise, rows, cols, out_dtype);
}

void check_block_dim(const char* op, int64_t block_dim) {
  FUS_VALUE_CHECK(block_dim == 1 || block_dim == 2, op,
                  "argument 'block_dim' must be 1 (1x128 blocks) or 2 (128x128 blocks), got ",
                  block_dim);
}

std::tuple<Tensor, Tensor, Tensor, Tensor> quantize_fp8_block(const Tensor& x,
                                                              at::ScalarType fp8_dtype,
                                                              int64_t block_dim, bool power_2_scale,
                                                              double amax_epsilon, bool rowwise,
                                                              bool columnwise) {
  const char* op = "quantize_fp8_block";
  check_tensor(op, "x", x, high_precision());
  check_fp8_dtype(op, fp8_dtype);
  check_block_dim(op, block_dim);
  require_a_copy(op, rowwise, columnwise);
  FUS_VALUE_CHECK(std::isfinite(amax_epsilon) && amax_epsilon >= 0.0, op,
                  "argument 'amax_epsilon' must be finite and >= 0, got ", amax_epsilon);
  const int quant = block_dim == 1 ? kQuant_BLOCK_1D : kQuant_BLOCK_2D;
  return cast_copies(op, x, quant, fp8_dtype, rowwise, columnwise,
                     [&](const fus_tensor* in, fus_quantized* q, const fus_context* ctx) {
                       return fus_quantize_blockwise(in, q, power_2_scale ? 1 : 0,
                                                     static_cast<float>(amax_epsilon), ctx);
                     });
}

Tensor dequantize_fp8_block(const Tensor& data, const Tensor& scale_inv, int64_t block_dim,
                            at::ScalarType out_dtype) {
  const char* op = "dequantize_fp8_block";
  check_tensor(op, "data", data, fp8_dtypes());
  check_tensor(op, "scale_inv", scale_inv, {at::kFloat}, data.device());
  check_block_dim(op, block_dim);
  check_out_dtype(op, out_dtype);
  auto [R, C] = matrix_shape(op, data, "data");
  const std::vector<int64_t> expected = block_scale_shape(block_dim, R, C);
  FUS_VALUE_CHECK(R * C == 0 || scale_inv.sizes() == at::IntArrayRef(expected), op,
                  "argument 'scale_inv' has shape ", shape_str(scale_inv.sizes()), ", expected ",
                  shape_str(expected), " for ", block_dim == 1 ? "1x128" : "128x128",
                  " blocks of data viewed as the matrix (", R, ", ", C, ")");
  // The copy is dequantized as a rowwise copy of its own [R, C] (both copies share the layouts).
  return dequantize_copy(op, block_dim == 1 ? FUS_SCALING_BLOCK_1D : FUS_SCALING_BLOCK_2D, data,
                         scale_inv, false, R, C, out_dtype);
}

// ---- grouped_quantize_fp8 -------------------------------------------------------------------------

std::tuple<std::vector<Tensor>, std::vector<Tensor>, std::vector<Tensor>, Tensor, Tensor>
grouped_quantize_fp8(at::TensorList x, at::IntArrayRef m_splits, const OptTensor& scales,
                     at::ScalarType fp8_dtype, int64_t margin, bool rowwise, bool columnwise) {
  // No amax_into here (the groups' amaxes are returned and folded by the caller): torch's
  // functionalization (auto_functionalized) takes no mutable operator returning Tensor[].
  // The C API accumulates for grouped casts too (fus_quantized.amax_accumulate).
  const char* op = "grouped_quantize_fp8";
  Groups g = split_groups(op, "x", x, m_splits, high_precision());
  check_fp8_dtype(op, fp8_dtype);
  require_a_copy(op, rowwise, columnwise);
  check_margin(op, margin);
  const auto count = static_cast<int64_t>(g.mats.size());
  const Tensor& like = x[0];
  const bool current = !scales.has_value();
  if (!current) {
    check_tensor(op, "scales", *scales, {at::kFloat}, like.device());
    FUS_VALUE_CHECK(scales->dim() == 1 && scales->size(0) == count, op,
                    "argument 'scales' must be float32 of shape (", count,
                    ",) (one delayed-scaling scale per group), got shape ",
                    shape_str(scales->sizes()));
  }
  std::vector<Tensor> data, data_t, scale_inv;
  data.reserve(count);
  data_t.reserve(count);
  scale_inv.reserve(count);
  for (int64_t i = 0; i < count; ++i) {
    const Tensor& m = g.mats[i];
    const int64_t rows = m.size(0), cols = m.size(1);
    // The rowwise copy has the group's shape: x[i]'s own, or [m_i, cols] of the packed input.
    const bool whole = !g.packed && rows == matrix_shape(op, x[i]).first;
    data.push_back(rowwise ? empty(whole ? x[i].sizes() : m.sizes(), fp8_dtype, like)
                           : nothing(fp8_dtype, like));
    data_t.push_back(columnwise ? empty({cols, rows}, fp8_dtype, like) : nothing(fp8_dtype, like));
    scale_inv.push_back(empty({1}, at::kFloat, like));
  }
  Tensor amax = empty({count}, at::kFloat, like);
  Tensor scale = current ? empty({count}, at::kFloat, like) : nothing(at::kFloat, like);
  if (shapes_only(like)) return {data, data_t, scale_inv, amax, scale};

  std::vector<fus_tensor> in(count);
  std::vector<fus_quantized> out(count);
  float* amax_p = fptr(amax);
  float* scale_p = current ? fptr(scale) : fptr(*scales);
  for (int64_t i = 0; i < count; ++i) {
    const Tensor& m = g.mats[i];
    const int64_t rows = m.size(0), cols = m.size(1);
    in[i] = mat(m, rows, cols);
    out[i] = fus_quantized{FUS_SCALING_PER_TENSOR,
                           code_of(fp8_dtype),
                           rows,
                           cols,
                           ptr(data[i]),
                           ptr(data_t[i]),
                           ptr(scale_inv[i]),
                           nullptr,
                           scale_p ? scale_p + i : nullptr,
                           amax_p ? amax_p + i : nullptr,
                           0,
                           0.0f,
                           0};
  }
  const fus_context ctx = context_of(like);
  check_status(op, fus_quantize_grouped(in.data(), out.data(), count, current ? 1 : 0,
                                        static_cast<int>(margin), &ctx));
  return {data, data_t, scale_inv, amax, scale};
}

// Operator schemas (docs in python/fusible/_kernels/; the C contract in fusible/quantize.h).
const char* const kSchemas[] = {
    "quantize_fp8(Tensor x, Tensor scale, ScalarType fp8_dtype, bool rowwise, bool columnwise,"
    " Tensor(a!)? amax_into=None, bool want_amax=True, bool keep_scale=False)"
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
    "grouped_quantize_fp8(Tensor[] x, SymInt[] m_splits, Tensor? scales, ScalarType fp8_dtype,"
    " SymInt margin, bool rowwise, bool columnwise)"
    " -> (Tensor[], Tensor[], Tensor[], Tensor, Tensor)",
};

// The CPU / CUDA kernels of the family's operators.
void register_kernels(torch::Library& m) {
  m.impl("quantize_fp8", &quantize_fp8);
  m.impl("quantize_fp8_current", &quantize_fp8_current);
  m.impl("dequantize_fp8", &dequantize_fp8);
  m.impl("transpose_fp8", &transpose_fp8);
  m.impl("compute_amax", &compute_amax);
  m.impl("quantize_mxfp8", &quantize_mxfp8);
  m.impl("dequantize_mxfp8", &dequantize_mxfp8);
  m.impl("quantize_fp8_block", &quantize_fp8_block);
  m.impl("dequantize_fp8_block", &dequantize_fp8_block);
  m.impl("grouped_quantize_fp8", &grouped_quantize_fp8);
}

}  // namespace

Family quantize_family() { return {kSchemas, std::size(kSchemas), &register_kernels}; }

}  // namespace fusible_torch
