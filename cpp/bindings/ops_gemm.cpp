// torch.ops.fusible gemm family (cpp/include/fusible/gemm.h holds the contract: numerics,
// epilogues, dtype rules, the FP8 "TN" layout, and the CUDA backend's cuBLASLt constraints), and
// the grouped GEMMs and bias gradients of MoE experts (one operator call for every group, where a
// loop of per-GEMM operators would dispatch once per expert; fus_gemm_grouped). Groups come as a
// list of tensors or as one packed tensor split by m_splits (torch_ops.h split_groups); outputs
// are one tensor per group, each its own allocation, except the packed GEMM output.
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros.h>

#include <iterator>

#include "families.h"
#include "fusible/gemm.h"
#include "torch_ops.h"

namespace fusible_torch {
namespace {

// The epilogue names in fus_gemm_epilogue order (FUS_GEMM_EPILOGUE_TABLE, fusible/gemm.h).
const std::vector<std::string_view> kEpilogues{
#define FUS_GEMM_EPILOGUE_NAME_(id, value, name, ...) name,
    FUS_GEMM_EPILOGUE_TABLE(FUS_GEMM_EPILOGUE_NAME_)
#undef FUS_GEMM_EPILOGUE_NAME_
};
// The table's row of a valid epilogue (check_choice made it one).
const fus_gemm_epilogue_info& row(int e) {
  return *fus_gemm_epilogue_row(static_cast<fus_gemm_epilogue>(e));
}
bool uses_bias(int e) { return row(e).bias != 0; }
bool writes_aux(int e) { return row(e).writes_aux != 0; }
bool reads_aux(int e) { return row(e).reads_aux != 0; }
bool bgrad(int e) { return row(e).bgrad != 0; }

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
  Tensor dbias = bgrad(epilogue) ? empty({n}, vec, a) : nothing(vec, a);
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
  args.dbias = bgrad(epilogue) ? mat(dbias, 1, n) : kAbsent;
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
                  const OptTensor& c, double alpha, double beta, const OptTensor& bias) {
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
  if (bias.has_value()) {  // the BIAS epilogue: bias has D's dtype (a 16-bit D; gemm.h)
    check_tensor(op, "bias", *bias, {at::kBFloat16, at::kHalf}, dev);
    FUS_VALUE_CHECK(bias->scalar_type() == out_dtype, op, "argument 'bias' has dtype ",
                    bias->scalar_type(), ", expected out_dtype ", out_dtype);
    FUS_VALUE_CHECK(bias->dim() == 1 && bias->size(0) == n, op, "argument 'bias' has shape ",
                    shape_str(bias->sizes()), ", expected ", shape_str(std::vector<int64_t>{n}),
                    " (N)");
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
    args.epilogue = bias.has_value() ? FUS_GEMM_EPILOGUE_BIAS : FUS_GEMM_EPILOGUE_NONE;
    if (bias.has_value()) args.bias = mat(*bias, 1, n);
    const fus_context ctx = context_of(a);
    check_status(op, fus_gemm(&args, &ctx));
  }
  return d;
}

// ---- grouped_gemm ---------------------------------------------------------------------------------

// Group i's scale_inv: element i of one [G] tensor, or list element i of G one-element tensors.
const float* group_scale(const char* op, const char* name, at::TensorList s, size_t i, size_t count,
                         c10::Device dev) {
  if (i == 0) {
    FUS_VALUE_CHECK(s.size() == count || (s.size() == 1 && s[0].numel() == (int64_t)count), op,
                    "argument '", name, "' must hold ", count,
                    " one-element float32 tensors or one float32 tensor of ", count,
                    " elements (one per GEMM), got ", s.size(), " tensors");
    for (size_t j = 0; j < s.size(); ++j) {
      const std::string n = nth(name, j);
      check_tensor(op, n.c_str(), s[j], {at::kFloat}, dev);
      FUS_VALUE_CHECK(s.size() == 1 || s[j].numel() == 1, op, "argument '", n,
                      "' must hold exactly one float32 value, got shape ", shape_str(s[j].sizes()));
    }
  }
  if (s.size() == count && s[i].numel() == 1) return fptr(s[i]);
  const float* base = fptr(s[0]);
  return base ? base + i : nullptr;
}

std::vector<Tensor> grouped_gemm(at::TensorList a, at::TensorList b, at::IntArrayRef m_splits,
                                 const std::optional<at::TensorList>& a_scale_inv,
                                 const std::optional<at::TensorList>& b_scale_inv,
                                 at::ScalarType out_dtype,
                                 const std::optional<at::TensorList>& bias, bool fast_accum,
                                 bool packed_out, c10::string_view epilogue_name,
                                 const OptTensor& aux) {
  const char* op = "grouped_gemm";
  const std::vector<at::ScalarType> dtypes{at::kFloat, at::kHalf, at::kBFloat16, at::kFloat8_e4m3fn,
                                           at::kFloat8_e5m2};
  Groups ga = split_groups(op, "a", a, m_splits, dtypes);
  const size_t count = ga.mats.size();
  const c10::Device dev = a[0].device();
  FUS_VALUE_CHECK(b.size() == count, op, "argument 'b' has ", b.size(), " tensors, expected ",
                  count, " (one per GEMM, as 'a')");
  const at::ScalarType at_ = a[0].scalar_type();
  const bool fp8 = is_fp8(at_);
  FUS_TYPE_CHECK(out_dtype == at::kFloat || out_dtype == at::kHalf || out_dtype == at::kBFloat16,
                 op, "argument 'out_dtype' must be float32, float16 or bfloat16, got ",
                 dtype_name(out_dtype));
  if (!fp8) {
    FUS_TYPE_CHECK(at_ == out_dtype, op, "argument 'a' has dtype ", dtype_name(at_),
                   "; high-precision operands must have out_dtype ", dtype_name(out_dtype));
  }
  std::vector<Tensor> bm(count);
  for (size_t i = 0; i < count; ++i) {
    const std::string n = nth("b", i);
    check_tensor(op, n.c_str(), b[i], fp8 ? fp8_dtypes() : std::vector<at::ScalarType>{at_}, dev);
    FUS_VALUE_CHECK(b[i].dim() == 2, op, "argument '", n,
                    "' must be a 2-D matrix [N, K], got shape ", shape_str(b[i].sizes()));
    FUS_VALUE_CHECK(b[i].size(1) == ga.mats[i].size(1), op,
                    "arguments 'a' and 'b' disagree on K for GEMM ", i, ": a's matrix is ",
                    shape_str(ga.mats[i].sizes()), " and ", n, " is ", shape_str(b[i].sizes()),
                    " (D = A @ B^T needs A [M, K] and B [N, K])");
    bm[i] = b[i];
  }
  FUS_VALUE_CHECK(fp8 == a_scale_inv.has_value() && fp8 == b_scale_inv.has_value(), op,
                  "arguments 'a_scale_inv' and 'b_scale_inv' are ",
                  fp8 ? "required for FP8 operands" : "only for FP8 operands; pass None");
  if (bias.has_value()) {
    FUS_VALUE_CHECK(bias->size() == count, op, "argument 'bias' has ", bias->size(),
                    " tensors, expected ", count, " (one per GEMM)");
    for (size_t i = 0; i < count; ++i) {
      const std::string n = nth("bias", i);
      check_tensor(op, n.c_str(), (*bias)[i], {out_dtype}, dev);
      FUS_VALUE_CHECK((*bias)[i].dim() == 1 && (*bias)[i].size(0) == b[i].size(0), op, "argument '",
                      n, "' has shape ", shape_str((*bias)[i].sizes()), ", expected (",
                      b[i].size(0), ",)");
    }
  }
  // The epilogue: "" is "bias" with a bias, else "none"; a named one must match the bias given
  // and, reading aux, takes it packed [sum M_i, N] (rows split as a's groups). One that writes aux
  // returns it packed, after the outputs. The bias gradient's epilogues are not offered (their
  // dbias sums in cuBLASLt's order, not the per-expert reduction of grouped_bias_grad).
  int epilogue = bias.has_value() ? FUS_GEMM_EPILOGUE_BIAS : FUS_GEMM_EPILOGUE_NONE;
  if (!epilogue_name.empty()) {
    epilogue = check_choice(op, "epilogue", epilogue_name, kEpilogues);
    if (bgrad(epilogue)) {
      std::string offered;
      for (size_t e = 0; e < kEpilogues.size(); ++e)
        if (!bgrad(static_cast<int>(e)))
          offered += (offered.empty() ? "" : ", ") + std::string(kEpilogues[e]);
      FUS_VALUE_CHECK(false, op, "argument 'epilogue' '", std::string(epilogue_name),
                      "' is not offered for grouped GEMMs (", offered, " are)");
    }
    FUS_VALUE_CHECK(bias.has_value() == uses_bias(epilogue), op, "argument 'bias' is ",
                    bias.has_value() ? "not used" : "required", " by epilogue '",
                    std::string(epilogue_name), "'");
  }
  const bool aux_in = reads_aux(epilogue), aux_out = writes_aux(epilogue);
  FUS_VALUE_CHECK(aux.has_value() == aux_in, op, "argument 'aux' is ",
                  aux.has_value() ? "not used" : "required", " by epilogue '",
                  std::string(epilogue_name), "'",
                  aux_in ? " (the GELU input, packed [sum M_i, N])" : "");
  int64_t total_rows = 0;
  for (size_t i = 0; i < count; ++i) total_rows += ga.mats[i].size(0);
  if (aux_in || aux_out) {
    for (size_t i = 0; i < count; ++i)
      FUS_VALUE_CHECK(b[i].size(0) == b[0].size(0), op, "epilogue '", std::string(epilogue_name),
                      "' needs one N for every GEMM (aux is packed), got b[0] with ", b[0].size(0),
                      " rows and ", nth("b", i), " with ", b[i].size(0));
  }
  const int64_t n_all = count ? b[0].size(0) : 0;
  if (aux_in) {
    check_tensor(op, "aux", *aux, {out_dtype}, dev);
    FUS_VALUE_CHECK(aux->dim() == 2 && aux->size(0) == total_rows && aux->size(1) == n_all &&
                        aux->is_contiguous(),
                    op, "argument 'aux' has shape ", shape_str(aux->sizes()),
                    ", expected a contiguous [", total_rows, ", ", n_all,
                    "] (the groups' rows packed, N columns)");
  }
  // Outputs.
  std::vector<Tensor> outs;
  std::vector<Tensor> d(count);
  if (packed_out) {
    int64_t rows = 0;
    for (size_t i = 0; i < count; ++i) {
      FUS_VALUE_CHECK(b[i].size(0) == b[0].size(0), op, "packed_out needs one N for every GEMM, ",
                      "got b[0] with ", b[0].size(0), " rows and ", nth("b", i), " with ",
                      b[i].size(0));
      rows += ga.mats[i].size(0);
    }
    Tensor packed = empty({rows, count ? b[0].size(0) : 0}, out_dtype, a[0]);
    int64_t off = 0;
    for (size_t i = 0; i < count; ++i) {
      d[i] = packed.narrow(0, off, ga.mats[i].size(0));
      off += ga.mats[i].size(0);
    }
    outs.push_back(packed);
  } else {
    for (size_t i = 0; i < count; ++i) {
      d[i] = empty({ga.mats[i].size(0), b[i].size(0)}, out_dtype, a[0]);
      outs.push_back(d[i]);
    }
  }
  std::vector<const float*> sa(count, nullptr), sb(count, nullptr);
  if (fp8) {
    for (size_t i = 0; i < count; ++i) {
      sa[i] = group_scale(op, "a_scale_inv", *a_scale_inv, i, count, dev);
      sb[i] = group_scale(op, "b_scale_inv", *b_scale_inv, i, count, dev);
    }
  }
  Tensor aux_packed = aux_out ? empty({total_rows, n_all}, out_dtype, a[0]) : Tensor();
  if (aux_out) outs.push_back(aux_packed);
  if (shapes_only(a[0])) return outs;

  // As the per-GEMM path (python/fusible/ops/_compute.py, _gemm) calls fusible.gemm for D = A @ B^T:
  // the bias in the epilogue, except for an FP8 GEMM with a float32 D (cuBLASLt's bias is bf16
  // there), whose float32 bias is added to D afterwards (the same add, so the same bits).
  const bool add_after = fp8 && out_dtype == at::kFloat && epilogue == FUS_GEMM_EPILOGUE_BIAS;
  // cuBLASLt picks its kernel by the pointers' alignment too (gemm.cu passes the real alignment
  // of each): a packed output row block that is not 256-byte aligned, as a fresh allocation is,
  // is computed into a fresh tensor and copied, so every GEMM runs the kernel (and gives the bits)
  // of the per-GEMM path, whose outputs are fresh allocations.
  std::vector<Tensor> staged(count);
  if (packed_out && a[0].is_cuda()) {
    for (size_t i = 0; i < count; ++i) {
      const void* p = ptr(d[i]);
      if (p != nullptr && reinterpret_cast<uintptr_t>(p) % 256 != 0)
        staged[i] = empty({d[i].size(0), d[i].size(1)}, out_dtype, a[0]);
    }
  }
  std::vector<fus_gemm_args> args(count);
  int64_t aux_off = 0;
  for (size_t i = 0; i < count; ++i) {
    const Tensor& am = ga.mats[i];
    const int64_t m = am.size(0), k = am.size(1), n = b[i].size(0);
    fus_gemm_args& g = args[i];
    g = fus_gemm_args{};
    g.a = mat(am, m, k);
    g.b = mat(bm[i], n, k);
    g.transa = 0;
    g.transb = 1;
    g.a_scale_inv = sa[i];
    g.b_scale_inv = sb[i];
    g.d = fus_tensor{ptr(staged[i].defined() ? staged[i] : d[i]), code_of(out_dtype), m, n};
    g.alpha = 1.0f;
    g.beta = 0.0f;
    const bool fused_bias = bias.has_value() && !add_after;
    g.epilogue = static_cast<fus_gemm_epilogue>(add_after ? FUS_GEMM_EPILOGUE_NONE : epilogue);
    g.bias = fused_bias ? mat((*bias)[i], 1, n) : kAbsent;
    if (aux_in || aux_out) {
      const Tensor& src = aux_in ? *aux : aux_packed;
      g.aux = fus_tensor{static_cast<char*>(ptr(src)) + aux_off * n * src.element_size(),
                         code_of(out_dtype), m, n};
      aux_off += m;
    }
    g.use_fast_accum = fast_accum && fp8 ? 1 : 0;
  }
  const fus_context ctx = context_of(a[0]);
  check_status(op, fus_gemm_grouped(args.data(), static_cast<int64_t>(count), &ctx));
  for (size_t i = 0; i < count; ++i)
    if (staged[i].defined()) d[i].copy_(staged[i]);
  if (add_after) {
    for (size_t i = 0; i < count; ++i)
      if (d[i].numel()) d[i].add_((*bias)[i]);
  }
  return outs;
}

// ---- grouped_bias_grad ----------------------------------------------------------------------------

// Column sums of each group of dy's rows, in float32, then rounded to out_dtype: per group exactly
// torch's dy_i.sum(0, dtype=torch.float32).to(out_dtype) (ATen's own reduction, so the bits of the
// per-expert path), zeros for an empty group; one operator call for all groups. Returns them as
// the rows of one [G, N] tensor: the float32 sums go into the rows of one buffer, rounded by one
// conversion (G + 1 kernels instead of 2G; row views as separate outputs would alias each other,
// which an operator's schema may not).
Tensor grouped_bias_grad(const Tensor& dy, at::IntArrayRef m_splits, at::ScalarType out_dtype) {
  const char* op = "grouped_bias_grad";
  check_out_dtype(op, out_dtype);
  Groups g = split_groups(op, "dy", at::TensorList(dy), m_splits, high_precision());
  const int64_t n = dy.size(-1);
  const auto count = static_cast<int64_t>(g.mats.size());
  if (shapes_only(dy)) return empty({count, n}, out_dtype, dy);
  bool any_empty = false;
  for (const Tensor& m : g.mats) any_empty = any_empty || m.size(0) == 0;
  Tensor sums = any_empty ? at::zeros({count, n}, dy.options().dtype(at::kFloat))
                          : empty({count, n}, at::kFloat, dy);
  for (int64_t i = 0; i < count; ++i) {
    const Tensor& m = g.mats[static_cast<size_t>(i)];
    if (m.size(0) == 0) continue;
    Tensor row = sums.select(0, i);
    at::sum_out(row, m, {0}, false, at::kFloat);
  }
  return sums.to(out_dtype);
}

// Operator schemas (docs in python/fusible/_kernels/; the C contract in fusible/gemm.h).
const char* const kSchemas[] = {
    "gemm(Tensor a, Tensor b, bool transa, bool transb, Tensor? a_scale_inv,"
    " Tensor? b_scale_inv, ScalarType out_dtype, Tensor? bias, str epilogue, Tensor? aux,"
    " Tensor? c, float alpha, float beta, Tensor? out_scale, bool want_amax,"
    " bool fast_accum=False) -> (Tensor, Tensor, Tensor, Tensor)",
    "gemm_block(Tensor a, Tensor a_scale_inv, SymInt a_block_dim, Tensor b, Tensor b_scale_inv,"
    " SymInt b_block_dim, ScalarType out_dtype, Tensor? c, float alpha, float beta,"
    " Tensor? bias=None) -> Tensor",
    "grouped_gemm(Tensor[] a, Tensor[] b, SymInt[] m_splits, Tensor[]? a_scale_inv,"
    " Tensor[]? b_scale_inv, ScalarType out_dtype, Tensor[]? bias, bool fast_accum,"
    " bool packed_out, str epilogue=\"\", Tensor? aux=None) -> Tensor[]",
    "grouped_bias_grad(Tensor dy, SymInt[] m_splits, ScalarType out_dtype) -> Tensor",
};

// The CPU / CUDA kernels of the family's operators.
void register_kernels(torch::Library& m) {
  m.impl("gemm", &gemm);
  m.impl("gemm_block", &gemm_block);
  m.impl("grouped_gemm", &grouped_gemm);
  m.impl("grouped_bias_grad", &grouped_bias_grad);
}

}  // namespace

Family gemm_family() { return {kSchemas, std::size(kSchemas), &register_kernels}; }

}  // namespace fusible_torch
