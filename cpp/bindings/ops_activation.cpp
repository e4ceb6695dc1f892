// torch.ops.fusible activation family: forward with optional quantized output, and backward
// ("dact + dbias + cast") (cpp/include/fusible/activation.h).
#include <iterator>

#include "families.h"
#include "fusible/activation.h"
#include "torch_ops.h"

namespace fusible_torch {
namespace {

// The kinds' names in fus_activation order, from the C table (activation.h), so adding a kind
// there is the whole change here.
const std::vector<std::string_view> kActivations{
#define FUS_ACT_NAME_(id, value, name, gated, fn) name,
    FUS_ACTIVATION_TABLE(FUS_ACT_NAME_)
#undef FUS_ACT_NAME_
};

// Forward output shape: x's, with the last dimension halved for the gated kinds ([a | b] = 2H).
std::vector<int64_t> out_shape(const char* op, const Tensor& x, int kind,
                               c10::string_view kind_name) {
  FUS_VALUE_CHECK(x.dim() > 0, op, "argument 'x' must have at least one dimension");
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  if (fus_activation_is_gated(static_cast<fus_activation>(kind))) {
    const int64_t k = shape.back();
    FUS_VALUE_CHECK(k % 2 == 0 && k != 0, op,
                    "argument 'x' must have an even, non-zero last dimension for kind='",
                    std::string(kind_name), "' ([a | b] = 2H), got ", k);
    shape.back() = k / 2;
  }
  return shape;
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> act_fwd(
    const Tensor& x, c10::string_view kind_name, std::optional<at::ScalarType> out_dtype,
    c10::string_view quant_name, at::ScalarType fp8_dtype, const OptTensor& scale, bool rowwise,
    bool columnwise, bool power_2_scale, double amax_epsilon, const OptTensor& amax_into) {
  const char* op = "act_fwd";
  check_tensor(op, "x", x, high_precision());
  const int kind = check_choice(op, "kind", kind_name, kActivations);
  const std::vector<int64_t> shape = out_shape(op, x, kind, kind_name);
  check_opt_out_dtype(op, out_dtype);
  const int quant = check_quant_args(op, quant_name, fp8_dtype, scale, rowwise, columnwise,
                                     amax_epsilon, x.device());
  check_amax_into(op, amax_into, quant, x.device());
  FUS_VALUE_CHECK(out_dtype.has_value() || quant != kQuantNone, op,
                  "nothing to compute: out_dtype is None and quant='none'");
  FUS_VALUE_CHECK(x.size(-1) != 0, op, "argument 'x' must have a non-empty last dimension");
  auto [rows, k] = matrix_shape(op, x);
  const int64_t h = shape.back();
  Tensor y = out_dtype.has_value() ? empty(shape, *out_dtype, x) : nothing(x.scalar_type(), x);
  std::vector<Tensor> q = quant_outputs(shape, x, quant, fp8_dtype, rowwise, columnwise);
  std::optional<fus_quantized> qv;
  if (!shapes_only(x))
    qv = quantized_view(quant, fp8_dtype, rows, h, q, 0, scale, power_2_scale, amax_epsilon);
  accumulate_into(qv, q, 0, amax_into, x);
  if (!shapes_only(x)) {
    const fus_tensor xm = mat(x, rows, k);
    fus_tensor ym = out_dtype.has_value() ? mat(y, rows, h) : kAbsent;
    const fus_context ctx = context_of(x);
    check_status(op, fus_activation_forward(static_cast<fus_activation>(kind), &xm,
                                            out_dtype.has_value() ? &ym : nullptr,
                                            qv ? &*qv : nullptr, &ctx));
  }
  return {y, q[0], q[1], q[2], q[3], q[4]};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> act_bwd(
    const Tensor& grad, const Tensor& x, c10::string_view kind_name,
    std::optional<at::ScalarType> out_dtype, c10::string_view quant_name, at::ScalarType fp8_dtype,
    const OptTensor& scale, bool rowwise, bool columnwise, bool with_dbias, bool power_2_scale,
    double amax_epsilon, const OptTensor& amax_into) {
  const char* op = "act_bwd";
  check_tensor(op, "grad", grad, high_precision());
  const c10::Device dev = grad.device();
  check_tensor(op, "x", x, high_precision(), dev);
  const int kind = check_choice(op, "kind", kind_name, kActivations);
  const std::vector<int64_t> shape = out_shape(op, x, kind, kind_name);
  FUS_VALUE_CHECK(grad.sizes() == at::IntArrayRef(shape), op, "argument 'grad' has shape ",
                  shape_str(grad.sizes()), ", expected ", shape_str(shape),
                  " (the forward output's shape for x of shape ", shape_str(x.sizes()), ", kind='",
                  std::string(kind_name), "')");
  check_opt_out_dtype(op, out_dtype);
  const int quant =
      check_quant_args(op, quant_name, fp8_dtype, scale, rowwise, columnwise, amax_epsilon, dev);
  check_amax_into(op, amax_into, quant, dev);
  FUS_VALUE_CHECK(out_dtype.has_value() || quant != kQuantNone || with_dbias, op,
                  "nothing to compute: out_dtype is None, quant='none' and with_dbias is False");
  FUS_VALUE_CHECK(x.size(-1) != 0, op, "argument 'x' must have a non-empty last dimension");
  auto [rows, k] = matrix_shape(op, x);
  const int64_t h = shape.back();
  const at::ScalarType dt = out_dtype.value_or(grad.scalar_type());
  Tensor dx =
      out_dtype.has_value() ? empty(x.sizes(), *out_dtype, x) : nothing(grad.scalar_type(), x);
  std::vector<Tensor> q = quant_outputs(x.sizes(), x, quant, fp8_dtype, rowwise, columnwise);
  Tensor dbias = empty({with_dbias ? k : 0}, dt, x);
  std::optional<fus_quantized> qv;
  if (!shapes_only(grad))
    qv = quantized_view(quant, fp8_dtype, rows, k, q, 0, scale, power_2_scale, amax_epsilon);
  accumulate_into(qv, q, 0, amax_into, x);
  if (!shapes_only(grad)) {
    const fus_context ctx = context_of(grad);
    size_t ws_bytes = 0;
    if (with_dbias)
      check_status(op, fus_activation_backward_workspace_size(rows, k, &ctx, &ws_bytes));
    Tensor ws = empty({static_cast<int64_t>(ws_bytes)}, at::kByte, grad);
    const fus_tensor gm = mat(grad, rows, h);
    const fus_tensor xm = mat(x, rows, k);
    fus_tensor dxm = out_dtype.has_value() ? mat(dx, rows, k) : kAbsent;
    fus_tensor dbm = with_dbias ? mat(dbias, 1, k) : kAbsent;
    check_status(
        op, fus_activation_backward(static_cast<fus_activation>(kind), &gm, &xm,
                                    out_dtype.has_value() ? &dxm : nullptr, qv ? &*qv : nullptr,
                                    with_dbias ? &dbm : nullptr, ptr(ws), ws_bytes, &ctx));
  }
  return {dx, q[0], q[1], q[2], q[3], q[4], dbias};
}

// Operator schemas (docs in python/fusible/_kernels/; the C contract in fusible/activation.h).
const char* const kSchemas[] = {
    "act_fwd(Tensor x, str kind, ScalarType? out_dtype, str quant, ScalarType fp8_dtype,"
    " Tensor? scale, bool rowwise, bool columnwise, bool power_2_scale=True,"
    " float amax_epsilon=0.0, Tensor(a!)? amax_into=None)"
    " -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    "act_bwd(Tensor grad, Tensor x, str kind, ScalarType? out_dtype, str quant,"
    " ScalarType fp8_dtype, Tensor? scale, bool rowwise, bool columnwise, bool with_dbias,"
    " bool power_2_scale=True, float amax_epsilon=0.0, Tensor(a!)? amax_into=None)"
    " -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
};

// The CPU / CUDA kernels of the family's operators.
void register_kernels(torch::Library& m) {
  m.impl("act_fwd", &act_fwd);
  m.impl("act_bwd", &act_bwd);
}

}  // namespace

Family activation_family() { return {kSchemas, std::size(kSchemas), &register_kernels}; }

}  // namespace fusible_torch
