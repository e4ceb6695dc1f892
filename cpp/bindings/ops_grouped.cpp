// torch.ops.fusible grouped operators (MoE experts): one operator call for the casts, GEMMs or bias
// gradients of every group, where a loop of per-tensor operators would dispatch once per expert
// (cpp/include/fusible/quantize.h: fus_quantize_grouped; gemm.h: fus_gemm_grouped).
//
// Groups are given either as a list of tensors (one per group) or as one packed tensor whose rows
// m_splits splits into consecutive groups (tokens grouped by expert). Outputs are one tensor per
// group, each its own allocation (no output aliases another), except the packed GEMM output.
#include <ATen/ops/zeros.h>

#include <cstdint>
#include <string>

#include "families.h"
#include "fusible/gemm.h"
#include "fusible/quantize.h"
#include "torch_ops.h"

namespace fusible_torch {
namespace {

std::string nth(const char* name, size_t i) {
  return std::string(name) + "[" + std::to_string(i) + "]";
}

// The groups of `x`: G matrices [rows_g, cols] (x.size() == G, m_splits empty) or one packed
// matrix split by m_splits. Returns (group g's matrix view, rows_g) via the callback's arguments.
struct Groups {
  std::vector<Tensor> mats;  // one 2-D view per group
  bool packed = false;
};

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

// ---- grouped_quantize_fp8 -------------------------------------------------------------------------

std::tuple<std::vector<Tensor>, std::vector<Tensor>, std::vector<Tensor>, Tensor, Tensor>
grouped_quantize_fp8(at::TensorList x, at::IntArrayRef m_splits, const OptTensor& scales,
                     at::ScalarType fp8_dtype, int64_t margin, bool rowwise, bool columnwise) {
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
                           0.0f};
  }
  const fus_context ctx = context_of(like);
  check_status(op, fus_quantize_grouped(in.data(), out.data(), count, current ? 1 : 0,
                                        static_cast<int>(margin), &ctx));
  return {data, data_t, scale_inv, amax, scale};
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
                                 bool packed_out) {
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
  if (shapes_only(a[0])) return outs;

  // As the per-GEMM path (python/fusible/ops/_compute.py, _gemm) calls fusible.gemm for D = A @ B^T:
  // the bias in the epilogue, except for an FP8 GEMM with a float32 D (cuBLASLt's bias is bf16
  // there), whose float32 bias is added to D afterwards (the same add, so the same bits).
  const bool add_after = fp8 && out_dtype == at::kFloat && bias.has_value();
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
    g.epilogue = fused_bias ? FUS_GEMM_EPILOGUE_BIAS : FUS_GEMM_EPILOGUE_NONE;
    g.bias = fused_bias ? mat((*bias)[i], 1, n) : kAbsent;
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
// per-expert path), zeros for an empty group; one operator call for all groups.
std::vector<Tensor> grouped_bias_grad(const Tensor& dy, at::IntArrayRef m_splits,
                                      at::ScalarType out_dtype) {
  const char* op = "grouped_bias_grad";
  check_out_dtype(op, out_dtype);
  Groups g = split_groups(op, "dy", at::TensorList(dy), m_splits, high_precision());
  const int64_t n = dy.size(-1);
  std::vector<Tensor> out;
  out.reserve(g.mats.size());
  if (shapes_only(dy)) {
    for (size_t i = 0; i < g.mats.size(); ++i) out.push_back(empty({n}, out_dtype, dy));
    return out;
  }
  for (const Tensor& m : g.mats) {
    if (m.size(0) == 0) {
      out.push_back(at::zeros({n}, dy.options().dtype(out_dtype)));
    } else {
      out.push_back(m.sum({0}, false, at::kFloat).to(out_dtype));
    }
  }
  return out;
}

}  // namespace

void register_grouped(torch::Library& m) {
  m.impl("grouped_quantize_fp8", &grouped_quantize_fp8);
  m.impl("grouped_gemm", &grouped_gemm);
  m.impl("grouped_bias_grad", &grouped_bias_grad);
}

}  // namespace fusible_torch
