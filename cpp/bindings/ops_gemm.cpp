// torch.ops.fusible gemm family (cpp/include/fusible/gemm.h holds the contract: numerics,
// epilogues, dtype rules, the FP8 "TN" layout, and the CUDA backend's cuBLASLt constraints).
#include <ATen/ops/zeros.h>

#include "families.h"
#include "fusible/gemm.h"
#include "torch_ops.h"

namespace fusible_torch {
namespace {

// In fus_gemm_epilogue order.
const std::vector<std::string_view> kEpilogues{
    "none", "bias", "gelu", "gelu_aux", "bias_gelu", "bias_gelu_aux", "dgelu", "dgelu_bgrad"};
bool uses_bias(int e) {
  return e == FUS_GEMM_EPILOGUE_BIAS || e == FUS_GEMM_EPILOGUE_BIAS_GELU ||
         e == FUS_GEMM_EPILOGUE_BIAS_GELU_AUX;
}
bool writes_aux(int e) {
  return e == FUS_GEMM_EPILOGUE_GELU_AUX || e == FUS_GEMM_EPILOGUE_BIAS_GELU_AUX;
}
bool reads_aux(int e) { return e == FUS_GEMM_EPILOGUE_DGELU || e == FUS_GEMM_EPILOGUE_DGELU_BGRAD; }

const char* py_bool(bool b) { return b ? "True" : "False"; }

std::vector<at::ScalarType> gemm_dtypes() {
  return {at::kFloat, at::kHalf, at::kBFloat16, at::kFloat8_e4m3fn, at::kFloat8_e5m2};
}

// An operand given exactly when the epilogue uses it.
void check_epilogue_operand(const char* arg, const OptTensor& t, std::string_view epilogue,
                            bool needed, const char* what = "") {
  FUS_VALUE_CHECK(t.has_value() == needed, "gemm", "argument '", arg, "'", what, " is ",
                  t.has_value() ? "not used" : "required", " by epilogue '", std::string(epilogue),
                  "'");
}

void check_mn(const char* name, const Tensor& t, int64_t m, int64_t n) {
  FUS_VALUE_CHECK(t.dim() > 0 && t.size(-1) == n && t.numel() == m * n, "gemm", "argument '", name,
                  "' has shape ", shape_str(t.sizes()),
                  "; expected a tensor viewable as [M, N] = [", m, ", ", n, "] (last dimension ", n,
                  ", ", m * n, " elements)");
}

std::tuple<Tensor, Tensor, Tensor, Tensor> gemm(
    const Tensor& a, const Tensor& b, bool transa, bool transb, const OptTensor& a_scale_inv,
    const OptTensor& b_scale_inv, at::ScalarType out_dtype, const OptTensor& bias,
    c10::string_view epilogue_name, const OptTensor& aux, const OptTensor& c, double alpha,
    double beta, const OptTensor& out_scale, bool want_amax, bool fast_accum) {
  const char* op = "gemm";
  const int epilogue = check_choice(op, "epilogue", epilogue_name, kEpilogues);
  const auto dtypes = gemm_dtypes();
  check_tensor(op, "a", a, dtypes);
  const c10::Device dev = a.device();
  check_tensor(op, "b", b, dtypes, dev);
  bool out_ok = false;
  for (auto d : dtypes) out_ok = out_ok || out_dtype == d;
  FUS_TYPE_CHECK(out_ok, op,
                 "argument 'out_dtype' must be float32, float16, bfloat16, float8_e4m3fn or "
                 "float8_e5m2, got ",
                 dtype_name(out_dtype));
  // M, N, K: a and b are matrices [prod(shape[:-1]), shape[-1]].
  auto [rows_a, cols_a] = matrix_shape(op, a, "a");
  auto [rows_b, cols_b] = matrix_shape(op, b, "b");
  const int64_t m = transa ? cols_a : rows_a, k = transa ? rows_a : cols_a;
  const int64_t kb = transb ? cols_b : rows_b, n = transb ? rows_b : cols_b;
  FUS_VALUE_CHECK(k == kb, op, "arguments 'a' and 'b' disagree on K: op(a) is [", m, ", ", k,
                  "] (a of shape ", shape_str(a.sizes()), ", transa=", py_bool(transa),
                  ") but op(b) is [", kb, ", ", n, "] (b of shape ", shape_str(b.sizes()),
                  ", transb=", py_bool(transb), ")");
  const bool fp8 = is_fp8(a.scalar_type());
  FUS_VALUE_CHECK(fp8 || b.scalar_type() != a.scalar_type() || out_dtype == a.scalar_type() ||
                      out_dtype == at::kFloat,
                  op, "argument 'out_dtype' must be ", dtype_name(a.scalar_type()),
                  " or torch.float32 for ", dtype_name(a.scalar_type()), " operands, got ",
                  dtype_name(out_dtype));
  const std::pair<const char*, const OptTensor*> scales[] = {{"a_scale_inv", &a_scale_inv},
                                                             {"b_scale_inv", &b_scale_inv}};
  for (const auto& [name, s] : scales) {
    FUS_VALUE_CHECK(!fp8 || s->has_value(), op, "argument '", name,
                    "' is required for FP8 operand '", name[0], "'");
    FUS_VALUE_CHECK(fp8 || !s->has_value(), op, "argument '", name,
                    "' must be None for high-precision operands");
    if (s->has_value()) check_scalar(op, name, **s, dev);
  }
  const bool out_fp8 = is_fp8(out_dtype);
  if (out_fp8) {
    FUS_VALUE_CHECK(out_scale.has_value(), op,
                    "argument 'out_scale' is required for an FP8 out_dtype ",
                    dtype_name(out_dtype));
    check_scalar(op, "out_scale", *out_scale, dev);
  } else {
    FUS_VALUE_CHECK(!out_scale.has_value(), op, "argument 'out_scale' must be None for out_dtype ",
                    dtype_name(out_dtype));
    FUS_VALUE_CHECK(!want_amax, op, "argument 'want_amax' needs an FP8 out_dtype, got ",
                    dtype_name(out_dtype));
  }
  check_epilogue_operand("bias", bias, epilogue_name, uses_bias(epilogue));
  if (bias.has_value()) {
    check_tensor(op, "bias", *bias, high_precision(), dev);
    FUS_VALUE_CHECK(bias->dim() == 1 && bias->size(0) == n, op, "argument 'bias' has shape ",
                    shape_str(bias->sizes()), ", expected (", n, ",)");
  }
  check_epilogue_operand("aux", aux, epilogue_name, reads_aux(epilogue),
                         " (the GELU input, for dgelu)");
  if (aux.has_value()) {
    check_tensor(op, "aux", *aux, high_precision(), dev);
    check_mn("aux", *aux, m, n);
  }
  const bool use_c = beta != 0.0;
  if (use_c) {
    FUS_VALUE_CHECK(c.has_value(), op, "argument 'c' is required when beta != 0 (", beta, ")");
    check_tensor(op, "c", *c, dtypes, dev);
    check_mn("c", *c, m, n);
  } else if (c.has_value()) {
    check_tensor(op, "c", *c, {}, dev);  // unused, but must not mix devices
  }

  // Outputs. aux / dbias have the output's dtype, or for an FP8 output the bias's (bf16 without
  // one; dgelu reads an aux of its own dtype).
  std::vector<int64_t> d_shape;
  if (transa) {
    d_shape = {m, n};
  } else {
    d_shape.assign(a.sizes().begin(), a.sizes().end() - 1);
    d_shape.push_back(n);
  }
  at::ScalarType vec =
      out_fp8 ? (bias.has_value() ? bias->scalar_type() : at::kBFloat16) : out_dtype;
  if (reads_aux(epilogue) && aux.has_value() && out_fp8) vec = aux->scalar_type();
  Tensor d = empty(d_shape, out_dtype, a);
  Tensor aux_out = writes_aux(epilogue) ? empty(d_shape, vec, a) : nothing(vec, a);
  Tensor dbias = epilogue == FUS_GEMM_EPILOGUE_DGELU_BGRAD ? empty({n}, vec, a) : nothing(vec, a);
  Tensor amax = want_amax ? empty({1}, at::kFloat, a) : nothing(at::kFloat, a);
  if (shapes_only(a)) return {d, aux_out, dbias, amax};

  fus_gemm_args args{};
  args.a = transa ? mat(a, k, m) : mat(a, m, k);
  args.b = transb ? mat(b, n, k) : mat(b, k, n);
  args.transa = transa ? 1 : 0;
  args.transb = transb ? 1 : 0;
  args.a_scale_inv = fptr(a_scale_inv);
  args.b_scale_inv = fptr(b_scale_inv);
  args.d = mat(d, m, n);
  args.d_scale = fptr(out_scale);
  args.d_amax = fptr(amax);
  args.c = use_c ? mat(*c, m, n) : kAbsent;
  args.alpha = static_cast<float>(alpha);
  args.beta = static_cast<float>(beta);
  args.epilogue = static_cast<fus_gemm_epilogue>(epilogue);
  args.bias = bias.has_value() ? mat(*bias, 1, n) : kAbsent;
  args.aux =
      writes_aux(epilogue) ? mat(aux_out, m, n) : (aux.has_value() ? mat(*aux, m, n) : kAbsent);
  args.dbias = epilogue == FUS_GEMM_EPILOGUE_DGELU_BGRAD ? mat(dbias, 1, n) : kAbsent;
  args.use_fast_accum = fast_accum ? 1 : 0;
  const fus_context ctx = context_of(a);
  check_status(op, fus_gemm(&args, &ctx));
  return {d, aux_out, dbias, amax};
}

// D[M, N] = alpha * A[M, K] @ B[N, K]^T + beta * C with blockwise FP8 operands (gemm.h). The
// stored scale layouts (fusible/common.h) are the GEMM's, except that a 128x128 scale matrix
// [ceil(R/128), ceil(K/128)] gets the row stride cuBLASLt reads (a multiple of 4): padded here
// when ceil(K/128) % 4 != 0.
Tensor gemm_block(const Tensor& a, const Tensor& a_scale_inv, int64_t a_block_dim, const Tensor& b,
                  const Tensor& b_scale_inv, int64_t b_block_dim, at::ScalarType out_dtype,
                  const OptTensor& c, double alpha, double beta) {
  const char* op = "gemm_block";
  check_tensor(op, "a", a, fp8_dtypes());
  const c10::Device dev = a.device();
  check_tensor(op, "b", b, fp8_dtypes(), dev);
  check_tensor(op, "a_scale_inv", a_scale_inv, {at::kFloat}, dev);
  check_tensor(op, "b_scale_inv", b_scale_inv, {at::kFloat}, dev);
  check_out_dtype(op, out_dtype);
  FUS_VALUE_CHECK(a_block_dim == 1 || a_block_dim == 2, op,
                  "argument 'a_block_dim' must be 1 or 2, got ", a_block_dim);
  FUS_VALUE_CHECK(b_block_dim == 1 || b_block_dim == 2, op,
                  "argument 'b_block_dim' must be 1 or 2, got ", b_block_dim);
  auto [m, k] = matrix_shape(op, a, "a");
  auto [n, kb] = matrix_shape(op, b, "b");
  FUS_VALUE_CHECK(k == kb, op, "arguments 'a' [M, K] = [", m, ", ", k, "] and 'b' [N, K] = [", n,
                  ", ", kb, "] disagree on K");
  const int64_t nk = ceil_div(k, FUS_FP8_BLOCK);
  auto expect = [&](const char* name, const Tensor& s, int64_t dim, int64_t rows) {
    const std::vector<int64_t> want = dim == 1
                                          ? std::vector<int64_t>{nk, rows}
                                          : std::vector<int64_t>{ceil_div(rows, FUS_FP8_BLOCK), nk};
    FUS_VALUE_CHECK(s.sizes() == at::IntArrayRef(want), op, "argument '", name, "' has shape ",
                    shape_str(s.sizes()), ", expected ", shape_str(want), " (",
                    dim == 1 ? "1x128" : "128x128", " block scales of a [", rows, ", ", k,
                    "] operand)");
  };
  expect("a_scale_inv", a_scale_inv, a_block_dim, m);
  expect("b_scale_inv", b_scale_inv, b_block_dim, n);
  std::vector<int64_t> d_shape(a.sizes().begin(), a.sizes().end());
  d_shape.back() = n;
  Tensor d = empty(d_shape, out_dtype, a);
  if (c.has_value()) {
    check_tensor(op, "c", *c, {out_dtype}, dev);
    check_mn("c", *c, m, n);
  }
  if (!shapes_only(a)) {
    auto padded = [&](const Tensor& s, int64_t dim) {
      if (dim == 1 || nk % 4 == 0 || s.numel() == 0) return s.contiguous();
      Tensor p = at::zeros({s.size(0), (nk + 3) / 4 * 4}, s.options());
      p.narrow(1, 0, nk).copy_(s);
      return p;
    };
    const Tensor sa = padded(a_scale_inv, a_block_dim), sb = padded(b_scale_inv, b_block_dim);
    fus_gemm_args args{};
    args.a = mat(a, m, k);
    args.b = mat(b, n, k);
    args.transa = 0;
    args.transb = 1;
    args.a_scale_inv = fptr(sa);
    args.b_scale_inv = fptr(sb);
    args.a_scaling = a_block_dim == 1 ? FUS_GEMM_SCALING_BLOCK_1D : FUS_GEMM_SCALING_BLOCK_2D;
    args.b_scaling = b_block_dim == 1 ? FUS_GEMM_SCALING_BLOCK_1D : FUS_GEMM_SCALING_BLOCK_2D;
    args.d = mat(d, m, n);
    if (c.has_value()) args.c = mat(*c, m, n);
    args.alpha = static_cast<float>(alpha);
    args.beta = static_cast<float>(beta);
    args.epilogue = FUS_GEMM_EPILOGUE_NONE;
    const fus_context ctx = context_of(a);
    check_status(op, fus_gemm(&args, &ctx));
  }
  return d;
}

}  // namespace

void register_gemm(torch::Library& m) {
  m.impl("gemm", &gemm);
  m.impl("gemm_block", &gemm_block);
}

}  // namespace fusible_torch
