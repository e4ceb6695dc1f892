// torch.ops.fusible normalization family: LayerNorm / RMSNorm forward with optional quantized
// output, and backward (cpp/include/fusible/normalization.h).
#include <cmath>
#include <iterator>

#include "families.h"
#include "fusible/normalization.h"
#include "torch_ops.h"

namespace fusible_torch {
namespace {

// The kinds' names in fus_norm_kind order (FUS_NORM_KIND_TABLE, fusible/normalization.h).
const std::vector<std::string_view> kNormKinds{
#define FUS_NORM_NAME_(id, value, name) name,
    FUS_NORM_KIND_TABLE(FUS_NORM_NAME_)
#undef FUS_NORM_NAME_
};

// gamma / beta: a high-precision vector [n] (the input's last dimension).
void check_vector(const char* op, const char* name, const Tensor& t, int64_t n, c10::Device dev) {
  check_tensor(op, name, t, high_precision(), dev);
  FUS_VALUE_CHECK(t.dim() == 1 && t.size(0) == n, op, "argument '", name, "' must have shape (", n,
                  ",) (the last dimension of the input), got ", shape_str(t.sizes()));
}

// mean / rstd: one float32 value per row, as norm_fwd returns them.
void check_stats(const char* op, const char* name, const Tensor& t, int64_t rows, c10::Device dev) {
  check_tensor(op, name, t, {at::kFloat}, dev);
  FUS_VALUE_CHECK(t.numel() == rows, op, "argument '", name, "' must hold ", rows,
                  " float32 values (one per row, as norm_fwd returns it), got shape ",
                  shape_str(t.sizes()));
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> norm_fwd(
    const Tensor& x, const Tensor& gamma, const OptTensor& beta, double eps,
    c10::string_view kind_name, bool zero_centered_gamma, std::optional<at::ScalarType> out_dtype,
    c10::string_view quant_name, at::ScalarType fp8_dtype, const OptTensor& scale, bool rowwise,
    bool columnwise, bool power_2_scale, double amax_epsilon, const OptTensor& amax_into) {
  const char* op = "norm_fwd";
  check_tensor(op, "x", x, high_precision());
  auto [rows, cols] = matrix_shape(op, x);
  const int kind = check_choice(op, "kind", kind_name, kNormKinds);
  const c10::Device dev = x.device();
  check_vector(op, "gamma", gamma, cols, dev);
  if (beta.has_value()) {
    FUS_VALUE_CHECK(kind == FUS_NORM_LAYERNORM, op,
                    "argument 'beta' must be None for kind='rmsnorm'");
    check_vector(op, "beta", *beta, cols, dev);
  }
  FUS_VALUE_CHECK(std::isfinite(eps) && eps >= 0, op,
                  "argument 'eps' must be finite and >= 0, got ", eps);
  FUS_VALUE_CHECK(cols != 0, op, "argument 'x' must have a non-empty last dimension");
  check_opt_out_dtype(op, out_dtype);
  const int quant =
      check_quant_args(op, quant_name, fp8_dtype, scale, rowwise, columnwise, amax_epsilon, dev);
  check_amax_into(op, amax_into, quant, dev);

  Tensor y = out_dtype.has_value() ? empty(x.sizes(), *out_dtype, x) : nothing(x.scalar_type(), x);
  std::vector<Tensor> q = quant_outputs(x.sizes(), x, quant, fp8_dtype, rowwise, columnwise);
  Tensor mean = empty({kind == FUS_NORM_LAYERNORM ? rows : 0}, at::kFloat, x);
  Tensor rstd = empty({rows}, at::kFloat, x);
  std::optional<fus_quantized> qv;
  if (!shapes_only(x))
    qv = quantized_view(quant, fp8_dtype, rows, cols, q, 0, scale, power_2_scale, amax_epsilon);
  accumulate_into(qv, q, 0, amax_into, x);
  if (!shapes_only(x)) {
    const fus_tensor xm = mat(x, rows, cols);
    const fus_tensor gm = mat(gamma, 1, cols);
    const fus_tensor bm = beta.has_value() ? mat(*beta, 1, cols) : kAbsent;
    fus_tensor ym = out_dtype.has_value() ? mat(y, rows, cols) : kAbsent;
    const fus_context ctx = context_of(x);
    check_status(
        op, fus_norm_forward(static_cast<fus_norm_kind>(kind), &xm, &gm,
                             beta.has_value() ? &bm : nullptr, static_cast<float>(eps),
                             zero_centered_gamma ? 1 : 0, out_dtype.has_value() ? &ym : nullptr,
                             qv ? &*qv : nullptr, fptr(mean), fptr(rstd), &ctx));
  }
  return {y, q[0], q[1], q[2], q[3], q[4], mean, rstd};
}

std::tuple<Tensor, Tensor, Tensor> norm_bwd(const Tensor& dy, const Tensor& x, const Tensor& mean,
                                            const Tensor& rstd, const Tensor& gamma,
                                            c10::string_view kind_name, bool zero_centered_gamma) {
  const char* op = "norm_bwd";
  check_tensor(op, "dy", dy, high_precision());
  auto [rows, cols] = matrix_shape(op, dy, "dy");
  const c10::Device dev = dy.device();
  check_tensor(op, "x", x, high_precision(), dev);
  FUS_VALUE_CHECK(x.sizes() == dy.sizes(), op, "argument 'x' has shape ", shape_str(x.sizes()),
                  ", expected dy's ", shape_str(dy.sizes()));
  const int kind = check_choice(op, "kind", kind_name, kNormKinds);
  FUS_VALUE_CHECK(cols != 0, op, "argument 'dy' must have a non-empty last dimension");
  check_vector(op, "gamma", gamma, cols, dev);
  const bool layernorm = kind == FUS_NORM_LAYERNORM;
  if (layernorm)
    check_stats(op, "mean", mean, rows, dev);
  else
    check_tensor(op, "mean", mean, {}, dev);  // ignored, but must not mix devices
  check_stats(op, "rstd", rstd, rows, dev);

  Tensor dx = empty(dy.sizes(), dy.scalar_type(), dy);
  Tensor dgamma = empty(gamma.sizes(), gamma.scalar_type(), dy);
  Tensor dbeta =
      layernorm ? empty(gamma.sizes(), gamma.scalar_type(), dy) : nothing(gamma.scalar_type(), dy);
  if (!shapes_only(dy)) {
    const fus_context ctx = context_of(dy);
    size_t ws_bytes = 0;
    check_status(op, fus_norm_backward_workspace_size(rows, cols, &ctx, &ws_bytes));
    Tensor ws = empty({static_cast<int64_t>(ws_bytes)}, at::kByte, dy);
    const fus_tensor dym = mat(dy, rows, cols);
    const fus_tensor xm = mat(x, rows, cols);
    const fus_tensor gm = mat(gamma, 1, cols);
    fus_tensor dxm = mat(dx, rows, cols);
    fus_tensor dgm = mat(dgamma, 1, cols);
    fus_tensor dbm = mat(dbeta, 1, cols);
    check_status(op, fus_norm_backward(static_cast<fus_norm_kind>(kind), &dym, &xm,
                                       layernorm ? fptr(mean) : nullptr, fptr(rstd), &gm,
                                       zero_centered_gamma ? 1 : 0, &dxm, &dgm,
                                       layernorm ? &dbm : nullptr, ptr(ws), ws_bytes, &ctx));
  }
  return {dx, dgamma, dbeta};
}

// Operator schemas (docs in python/fusible/_kernels/; the C contract in fusible/normalization.h).
const char* const kSchemas[] = {
    "norm_fwd(Tensor x, Tensor gamma, Tensor? beta, float eps, str kind,"
    " bool zero_centered_gamma, ScalarType? out_dtype, str quant, ScalarType fp8_dtype,"
    " Tensor? scale, bool rowwise, bool columnwise, bool power_2_scale=True,"
    " float amax_epsilon=0.0, Tensor(a!)? amax_into=None)"
    " -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)",
    "norm_bwd(Tensor dy, Tensor x, Tensor mean, Tensor rstd, Tensor gamma, str kind,"
    " bool zero_centered_gamma) -> (Tensor, Tensor, Tensor)",
};

// The CPU / CUDA kernels of the family's operators.
void register_kernels(torch::Library& m) {
  m.impl("norm_fwd", &norm_fwd);
  m.impl("norm_bwd", &norm_bwd);
}

}  // namespace

Family normalization_family() { return {kSchemas, std::size(kSchemas), &register_kernels}; }

}  // namespace fusible_torch
