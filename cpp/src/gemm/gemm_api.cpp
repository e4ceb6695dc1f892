// C API of the gemm family: validation, then dispatch to the CPU or CUDA backend. Every rule of
// fusible/gemm.h is checked here, so both backends accept exactly the same calls; the CUDA-only
// alignment rules of cuBLASLt are checked here too (for CUDA contexts only).
#include <cstdint>
#include <string>
#include <vector>

#include "common/validate.h"
#include "fusible/gemm.h"
#include "gemm/gemm_impl.h"

namespace fusible {
namespace {

constexpr const char* kFn = "fus_gemm";

constexpr std::initializer_list<fus_dtype> kOperand = {FUS_FLOAT32, FUS_FLOAT16, FUS_BFLOAT16,
                                                       FUS_FLOAT8_E4M3, FUS_FLOAT8_E5M2};

std::string dims(int64_t r, int64_t c) {
  return "[" + std::to_string(r) + ", " + std::to_string(c) + "]";
}

void require(bool cond, fus_status code, const std::string& what) {
  if (!cond) throw Error(code, std::string(kFn) + ": " + what);
}
void require(bool cond, const std::string& what) {
  require(cond, FUS_ERROR_INVALID_ARGUMENT, what);
}

bool is_fp8(fus_dtype d) { return d == FUS_FLOAT8_E4M3 || d == FUS_FLOAT8_E5M2; }

// An absent optional tensor is all zero.
bool present(const fus_tensor& t) { return t.data != nullptr || t.rows != 0 || t.cols != 0; }

// FUS_GEMM_EPILOGUE_TABLE (fusible/gemm.h), indexed by the epilogue's value.
struct EpilogueRow {
  fus_gemm_epilogue_info info;
  const char* c_name;  // "BIAS_GELU_AUX": the messages' spelling
};
constexpr EpilogueRow kEpilogues[] = {
#define FUS_GEMM_EPILOGUE_ROW_(id, value, name, bias, gelu, writes_aux, reads_aux, bgrad, c, \
                               fp8_f32_out, fp8_out, lt)                                     \
  {{name, bias, gelu, writes_aux, reads_aux, bgrad, c, fp8_f32_out, fp8_out}, #id},
    FUS_GEMM_EPILOGUE_TABLE(FUS_GEMM_EPILOGUE_ROW_)
#undef FUS_GEMM_EPILOGUE_ROW_
};
constexpr int kNumEpilogues = static_cast<int>(sizeof(kEpilogues) / sizeof(kEpilogues[0]));

// kEpilogues is indexed by the epilogues' values.
#define FUS_GEMM_EPILOGUE_VALUE_(id, value, ...) value,
static_assert(values_are_row_indices({FUS_GEMM_EPILOGUE_TABLE(FUS_GEMM_EPILOGUE_VALUE_)}),
              "FUS_GEMM_EPILOGUE_TABLE: values must be 0, 1, ... in order");
#undef FUS_GEMM_EPILOGUE_VALUE_

// The row of e, or nullptr.
const EpilogueRow* epilogue_row(fus_gemm_epilogue e) {
  const int i = static_cast<int>(e);
  return i >= 0 && i < kNumEpilogues ? &kEpilogues[i] : nullptr;
}

// The size rules (fus_gemm_limits).
constexpr fus_gemm_limits kLimits = {16, 16, 8, 4, 16};

// ---- the dtype and scaling rules of gemm.h, one predicate a rule ------------------------------
// validate() raises each where it checks it, with its message; fus_gemm_supported is their
// conjunction.

// Both operands FP8, or both of one high-precision dtype.
bool operands_pair(fus_dtype a, fus_dtype b) {
  return is_fp8(a) == is_fp8(b) && (is_fp8(a) || a == b);
}
// cuBLASLt has no E5M2 x E5M2 kernel.
bool fp8_pair_has_kernel(fus_dtype a, fus_dtype b) {
  return !(a == FUS_FLOAT8_E5M2 && b == FUS_FLOAT8_E5M2);
}
// D of an FP8 GEMM: any of kOperand; of a high-precision one: a's dtype or fp32 (the lists
// validate's check of d allows).
bool output_allowed(fus_dtype a, fus_dtype d) {
  if (is_fp8(a)) {
    for (fus_dtype t : kOperand)
      if (t == d) return true;
    return false;
  }
  return d == a || d == FUS_FLOAT32;
}
// An E5M2 D needs an E5M2 operand.
bool fp8_output_pair_has_kernel(fus_dtype a, fus_dtype b, fus_dtype d) {
  return !(d == FUS_FLOAT8_E5M2 && a == FUS_FLOAT8_E4M3 && b == FUS_FLOAT8_E4M3);
}
// The epilogue with FP8 operands writes D of this dtype (fp8_f32_out / fp8_out).
bool fp8_epilogue_has_kernel(const fus_gemm_epilogue_info& e, fus_dtype d) {
  if (d == FUS_FLOAT32) return e.fp8_f32_out != 0;
  return !is_fp8(d) || e.fp8_out != 0;
}
bool valid_scaling(fus_gemm_scaling s) {
  return s >= FUS_GEMM_SCALING_TENSOR && s <= FUS_GEMM_SCALING_BLOCK_2D;
}
// Blockwise: both operands blockwise, not both 128x128.
bool scaling_pair_has_kernel(fus_gemm_scaling a, fus_gemm_scaling b) {
  return (a != FUS_GEMM_SCALING_TENSOR && b != FUS_GEMM_SCALING_TENSOR) &&
         !(a == FUS_GEMM_SCALING_BLOCK_2D && b == FUS_GEMM_SCALING_BLOCK_2D);
}
// Blockwise: a high-precision D, epilogue NONE.
bool block_output_has_kernel(fus_dtype d) { return !is_fp8(d); }
// cuBLASLt 13.1's block-scaled kernels on Hopper: BIAS has heuristic results for the 1x128 x
// 128x128 and 1x128 x 1x128 pairs, GELU_AUX_BIAS has none (probed; the fused GELU runs after it).
bool block_epilogue_has_kernel(fus_gemm_epilogue e) {
  return e == FUS_GEMM_EPILOGUE_NONE || e == FUS_GEMM_EPILOGUE_BIAS;
}

// An epilogue tensor: present with the given shape and one of the allowed dtypes when the
// epilogue uses it, absent otherwise.
void check_epilogue_tensor(const char* arg, const fus_tensor& t, bool used, const char* epilogue,
                           int64_t rows, int64_t cols, std::initializer_list<fus_dtype> allowed,
                           const char* dtype_rule) {
  if (!used) {
    require(!present(t), std::string(arg) + " is given but epilogue " + epilogue +
                             " does not use it; pass an all-zero fus_tensor");
    return;
  }
  if (!present(t)) {
    require(rows * cols == 0, std::string(arg) + " is required by epilogue " + epilogue +
                                  ": expected " + dims(rows, cols));
    return;  // an empty problem may omit it
  }
  bool ok = false;
  for (fus_dtype d : allowed) ok = ok || d == t.dtype;
  require(ok, std::string(arg) + " has dtype " + dtype_name(t.dtype) + "; " + dtype_rule);
  check_matrix(kFn, arg, &t, allowed);
  check_same_shape(kFn, arg, &t, rows, cols);
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// cuBLASLt's requirements that the CPU backend does not have (CUDA contexts only).
void check_cuda_alignment(const fus_gemm_args& a, const GemmShape& s) {
  if (s.m * s.n == 0) return;
  if (s.fp8) {
    // cuBLAS docs (cublasLtMatmul, FP8 requirements): matrix dimensions and pointers must meet
    // the Tensor Core 16-byte alignment rules. In the TN form the leading dimension of both
    // operands is K (bytes), so K % 16 == 0.
    require(s.k % kLimits.fp8_k_multiple == 0,
            "K = " + std::to_string(s.k) + " (a.cols and b.cols) must be a multiple of " +
                std::to_string(kLimits.fp8_k_multiple) +
                " for FP8 operands on CUDA (cuBLASLt needs 16-byte leading dimensions)");
    require(aligned16(a.a.data), "a.data must be 16-byte aligned for FP8 operands on CUDA");
    require(aligned16(a.b.data), "b.data must be 16-byte aligned for FP8 operands on CUDA");
    const int64_t ld_bytes = s.n * static_cast<int64_t>(fus_dtype_size(a.d.dtype));
    require(ld_bytes % kLimits.fp8_d_row_bytes == 0,
            "N = " + std::to_string(s.n) + " (d.cols) times " +
                std::to_string(fus_dtype_size(a.d.dtype)) + "-byte " + dtype_name(a.d.dtype) +
                " must be a multiple of " + std::to_string(kLimits.fp8_d_row_bytes) +
                " bytes for FP8 GEMMs on CUDA (cuBLASLt 16-byte leading dimension of d)");
    require(aligned16(a.d.data), "d.data must be 16-byte aligned for FP8 GEMMs on CUDA");
  }
  if (s.blockwise) {
    require(aligned16(a.a_scale_inv),
            "a_scale_inv must be 16-byte aligned for block scales on CUDA");
    require(aligned16(a.b_scale_inv),
            "b_scale_inv must be 16-byte aligned for block scales on CUDA");
  }
  if (s.writes_aux || s.dgelu) {
    // cublasLt.h, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD: the GELU input matrix leading dimension
    // "must be divisible by 8"; aux is [M, N] row-major, so its leading dimension is N.
    require(s.n % kLimits.aux_n_multiple == 0,
            "aux: N = " + std::to_string(s.n) + " must be a multiple of " +
                std::to_string(kLimits.aux_n_multiple) +
                " for GELU aux epilogues on CUDA (cuBLASLt aux leading dimension rule)");
  }
}

GemmShape validate(const fus_gemm_args* args, const fus_context* ctx) {
  check_context(kFn, ctx);
  require(args != nullptr, "args is NULL");
  const fus_gemm_args& a = *args;
  check_matrix(kFn, "a", &a.a, kOperand);
  check_matrix(kFn, "b", &a.b, kOperand);
  require(a.transa == 0 || a.transa == 1, "transa must be 0 or 1, got " + std::to_string(a.transa));
  require(a.transb == 0 || a.transb == 1, "transb must be 0 or 1, got " + std::to_string(a.transb));

  GemmShape s;
  s.fp8 = is_fp8(a.a.dtype);
  require(s.fp8 == is_fp8(a.b.dtype), std::string("a (") + dtype_name(a.a.dtype) + ") and b (" +
                                          dtype_name(a.b.dtype) +
                                          ") must both be FP8 or both high precision");
  require(operands_pair(a.a.dtype, a.b.dtype), std::string("b has dtype ") + dtype_name(a.b.dtype) +
                                                   ", expected a's dtype " + dtype_name(a.a.dtype));
  s.m = a.transa ? a.a.cols : a.a.rows;
  s.k = a.transa ? a.a.rows : a.a.cols;
  const int64_t kb = a.transb ? a.b.cols : a.b.rows;
  s.n = a.transb ? a.b.rows : a.b.cols;
  require(kb == s.k, "inner dimensions differ: op(a) is " + dims(s.m, s.k) + " (a " +
                         dims(a.a.rows, a.a.cols) + ", transa " + std::to_string(a.transa) +
                         ") but op(b) is " + dims(kb, s.n) + " (b " + dims(a.b.rows, a.b.cols) +
                         ", transb " + std::to_string(a.transb) + ")");

  if (s.fp8) {
    require(fp8_pair_has_kernel(a.a.dtype, a.b.dtype), FUS_ERROR_UNSUPPORTED,
            "a and b are both float8_e5m2; FP8 GEMMs support E4M3 x E4M3, E4M3 x E5M2 and "
            "E5M2 x E4M3 (cuBLASLt has no E5M2 x E5M2 kernels)");
    require(a.transa == 0, FUS_ERROR_UNSUPPORTED,
            "FP8 operand a must be K-contiguous: pass A as [M, K] with transa = 0 (its rowwise "
            "data), not transposed (FP8 GEMMs need the TN form D = A[M, K] @ B[N, K]^T)");
    require(a.transb == 1, FUS_ERROR_UNSUPPORTED,
            "FP8 operand b must be K-contiguous: pass B transposed, stored [N, K] with transb = 1 "
            "(its transposed / columnwise copy); FP8 GEMMs need the TN form "
            "D = A[M, K] @ B[N, K]^T");
    // Block scales of an empty operand may be empty (NULL); checked with the blockwise rules.
    require(a.a_scale_inv != nullptr || a.a_scaling != FUS_GEMM_SCALING_TENSOR,
            "a_scale_inv is NULL; FP8 operand a needs float[1]");
    require(a.b_scale_inv != nullptr || a.b_scaling != FUS_GEMM_SCALING_TENSOR,
            "b_scale_inv is NULL; FP8 operand b needs float[1]");
  } else {
    require(a.a_scale_inv == nullptr && a.b_scale_inv == nullptr,
            "a_scale_inv and b_scale_inv must be NULL for high-precision operands");
  }

  // Blockwise scaling (gemm.h).
  require(valid_scaling(a.a_scaling), "a_scaling must be a fus_gemm_scaling value, got " +
                                          std::to_string(static_cast<int>(a.a_scaling)));
  require(valid_scaling(a.b_scaling), "b_scaling must be a fus_gemm_scaling value, got " +
                                          std::to_string(static_cast<int>(a.b_scaling)));
  s.blockwise = a.a_scaling != FUS_GEMM_SCALING_TENSOR || a.b_scaling != FUS_GEMM_SCALING_TENSOR;
  if (s.blockwise) {
    require(s.fp8, "a_scaling / b_scaling are blockwise but the operands are not FP8");
    require(a.a_scaling != FUS_GEMM_SCALING_TENSOR && a.b_scaling != FUS_GEMM_SCALING_TENSOR,
            FUS_ERROR_UNSUPPORTED,
            "blockwise scaling needs both operands blockwise (a_scaling and b_scaling 1D or 2D); "
            "cuBLASLt does not mix block and per-tensor scales");
    require(scaling_pair_has_kernel(a.a_scaling, a.b_scaling), FUS_ERROR_UNSUPPORTED,
            "a and b are both 128x128-block scaled; cuBLASLt supports 1D x 1D, 1D x 2D and 2D x 1D "
            "only");
    require(block_output_has_kernel(a.d.dtype), FUS_ERROR_UNSUPPORTED,
            "blockwise FP8 GEMMs write float32, float16 or bfloat16 outputs only (cuBLASLt has no "
            "FP8 output with block scaling)");
    require(block_epilogue_has_kernel(a.epilogue), FUS_ERROR_UNSUPPORTED,
            "blockwise FP8 GEMMs support epilogues NONE and BIAS only (apply GELU separately)");
    if (s.m * s.n * s.k > 0)
      require(a.a_scale_inv != nullptr && a.b_scale_inv != nullptr,
              "a_scale_inv and b_scale_inv must hold the operands' block scales (NULL given)");
    if (s.m * s.n > 0) {
      const int64_t mn = kLimits.block_mn_multiple, kk = kLimits.block_k_multiple;
      require(s.m % mn == 0 && s.n % mn == 0,
              "blockwise FP8 GEMMs need M and N multiples of " + std::to_string(mn) +
                  " (cuBLASLt block scale layout), got M = " + std::to_string(s.m) +
                  ", N = " + std::to_string(s.n));
      require(s.k % kk == 0,
              "blockwise FP8 GEMMs need K (a.cols and b.cols) a multiple of " + std::to_string(kk) +
                  " (cuBLASLt 16-byte leading dimensions), got K = " + std::to_string(s.k));
    }
  }

  // Output.
  if (s.fp8) {
    check_matrix(kFn, "d", &a.d, kOperand);
  } else {
    check_matrix(kFn, "d", &a.d, {a.a.dtype, FUS_FLOAT32});
  }
  check_same_shape(kFn, "d", &a.d, s.m, s.n);
  const bool d_fp8 = is_fp8(a.d.dtype);
  if (d_fp8) {
    require(a.d_scale != nullptr, "d_scale is NULL; an FP8 output d needs float[1]");
  } else {
    require(a.d_scale == nullptr, "d_scale must be NULL for a high-precision output d");
    require(a.d_amax == nullptr,
            "d_amax must be NULL for a high-precision output d (the amax "
            "output exists for FP8 outputs only)");
  }

  // Epilogue.
  const EpilogueRow* er = epilogue_row(a.epilogue);
  require(er != nullptr, "epilogue must be a fus_gemm_epilogue value, got " +
                             std::to_string(static_cast<int>(a.epilogue)));
  const fus_gemm_epilogue_info* row = &er->info;
  const char* ep = er->c_name;
  s.uses_bias = row->bias != 0;
  s.gelu = row->gelu != 0;
  s.writes_aux = row->writes_aux != 0;
  s.dgelu = row->reads_aux != 0;
  s.bgrad = row->bgrad != 0;

  // FP8 combinations cuBLASLt has no kernel for (measured on an H200 with cuBLAS 13.0; every
  // other combination of fusible/gemm.h was run there). Refused on every backend, so CPU runs
  // fail where GPU runs would.
  if (s.fp8) {
    require(fp8_output_pair_has_kernel(a.a.dtype, a.b.dtype, a.d.dtype), FUS_ERROR_UNSUPPORTED,
            "an float8_e5m2 output d needs an E5M2 operand; E4M3 x E4M3 GEMMs write E4M3, bf16, "
            "fp16 or fp32");
    require(a.d.dtype != FUS_FLOAT32 || fp8_epilogue_has_kernel(*row, a.d.dtype),
            FUS_ERROR_UNSUPPORTED,
            std::string("epilogue ") + ep +
                " with FP8 operands needs a bfloat16 or float16 output d (cuBLASLt has no FP8 "
                "kernel with a float32 output for it)");
    require(fp8_epilogue_has_kernel(*row, a.d.dtype), FUS_ERROR_UNSUPPORTED,
            std::string("epilogue ") + ep +
                " cannot write an FP8 output d (cuBLASLt has no such FP8 kernel); use a bfloat16 "
                "or float16 output");
  }

  // Linear combination with C.
  s.has_c = a.beta != 0.0f;
  if (s.has_c) {
    require(row->c != 0,
            std::string("c (beta != 0) is supported with epilogues NONE and BIAS only, not ") + ep);
    require(!d_fp8, "c (beta != 0) cannot accumulate into an FP8 output d");
    if (present(a.c)) {
      check_matrix(kFn, "c", &a.c, {a.d.dtype});
      check_same_shape(kFn, "c", &a.c, s.m, s.n);
    } else {
      require(s.m * s.n == 0,
              "c is required when beta != 0: expected " + dims(s.m, s.n) + " of d's dtype");
      s.has_c = false;
    }
    if (a.c.data != nullptr && a.c.data != a.d.data && s.m * s.n > 0) {
      const size_t bytes = static_cast<size_t>(s.m * s.n) * fus_dtype_size(a.d.dtype);
      const uintptr_t c0 = reinterpret_cast<uintptr_t>(a.c.data);
      const uintptr_t d0 = reinterpret_cast<uintptr_t>(a.d.data);
      require(c0 + bytes <= d0 || d0 + bytes <= c0,
              "c partially overlaps d; c must be d itself or not overlap it");
    }
  }

  // Dtypes of the epilogue tensors (cuBLASLt's rules, see gemm.h).
  std::initializer_list<fus_dtype> hp_of_d = {a.d.dtype};
  std::initializer_list<fus_dtype> half_types = {FUS_BFLOAT16, FUS_FLOAT16};
  std::initializer_list<fus_dtype> bf16_only = {FUS_BFLOAT16};
  const bool fp32_out_fp8 = s.fp8 && a.d.dtype == FUS_FLOAT32;
  const auto bias_types = d_fp8 ? half_types : (fp32_out_fp8 ? bf16_only : hp_of_d);
  const char* bias_rule =
      d_fp8 ? "expected bfloat16 or float16 (an FP8 output's epilogue type)"
            : (fp32_out_fp8 ? "expected bfloat16 (cuBLASLt's bias type for FP8 GEMMs with a "
                              "float32 output)"
                            : "expected d's dtype");
  const auto vec_types = d_fp8 ? half_types : hp_of_d;
  const char* vec_rule =
      d_fp8 ? "expected bfloat16 or float16 (an FP8 output's epilogue type)" : "expected d's dtype";
  check_epilogue_tensor("bias", a.bias, s.uses_bias, ep, 1, s.n, bias_types, bias_rule);
  check_epilogue_tensor("aux", a.aux, s.writes_aux || s.dgelu, ep, s.m, s.n, vec_types, vec_rule);
  check_epilogue_tensor("dbias", a.dbias, s.bgrad, ep, 1, s.n, vec_types, vec_rule);
  if (d_fp8 && s.uses_bias && s.writes_aux && present(a.aux) && present(a.bias))
    require(a.aux.dtype == a.bias.dtype,
            std::string("aux has dtype ") + dtype_name(a.aux.dtype) + " but bias has " +
                dtype_name(a.bias.dtype) +
                "; with an FP8 output d both are the epilogue type and must match");

  if (is_cuda(ctx)) check_cuda_alignment(a, s);
  return s;
}

}  // namespace
}  // namespace fusible

using namespace fusible;

extern "C" {

fus_status fus_gemm(const fus_gemm_args* args, const fus_context* ctx) {
  return guarded(kFn, [&] {
    GemmShape shape = validate(args, ctx);
    if (!is_cuda(ctx) && shape.blockwise) {
      gemm_blockwise_cpu(*args, shape);
    } else if (is_cuda(ctx)) {
#if defined(FUSIBLE_WITH_CUDA)
      if (shape.blockwise && shape.k == 0) shape.fp8 = false;  // t = beta * C: no scale is read
      gemm_cuda(*args, shape, *ctx);
#endif
    } else {
      gemm_cpu(*args, shape);
    }
    return FUS_SUCCESS;
  });
}

fus_status fus_gemm_grouped(const fus_gemm_args* args, int64_t count, const fus_context* ctx) {
  constexpr const char* fn = "fus_gemm_grouped";
  return guarded(fn, [&] {
    if (count < 0)
      throw Error(FUS_ERROR_INVALID_ARGUMENT,
                  std::string(fn) + ": count must be >= 0, got " + std::to_string(count));
    if (count == 0) return FUS_SUCCESS;
    if (args == nullptr)
      throw Error(FUS_ERROR_INVALID_ARGUMENT, std::string(fn) + ": args is NULL");
    // Everything is checked before the first GEMM runs.
    std::vector<GemmShape> shapes(static_cast<size_t>(count));
    for (int64_t i = 0; i < count; ++i) {
      try {
        shapes[static_cast<size_t>(i)] = validate(args + i, ctx);
      } catch (const Error& e) {
        throw Error(e.code, std::string(fn) + ": args[" + std::to_string(i) + "]: " + e.message);
      }
    }
    for (int64_t i = 0; i < count; ++i) {
      const auto& s = shapes[static_cast<size_t>(i)];
      if (is_cuda(ctx)) {
#if defined(FUSIBLE_WITH_CUDA)
        gemm_cuda(args[i], s, *ctx);
#endif
      } else {
        gemm_cpu(args[i], s);
      }
    }
    return FUS_SUCCESS;
  });
}

const fus_gemm_epilogue_info* fus_gemm_epilogue_row(fus_gemm_epilogue e) {
  const EpilogueRow* row = epilogue_row(e);
  return row != nullptr ? &row->info : nullptr;
}

int fus_gemm_supported(fus_dtype a, fus_dtype b, fus_dtype d, fus_gemm_epilogue e,
                       fus_gemm_scaling a_scaling, fus_gemm_scaling b_scaling) {
  const EpilogueRow* row = epilogue_row(e);
  if (row == nullptr || !valid_scaling(a_scaling) || !valid_scaling(b_scaling)) return 0;
  bool dtype_ok = false;
  for (fus_dtype t : kOperand) dtype_ok = dtype_ok || t == a;
  if (!dtype_ok || !operands_pair(a, b) || !output_allowed(a, d)) return 0;
  if (!is_fp8(a))
    return a_scaling == FUS_GEMM_SCALING_TENSOR && b_scaling == FUS_GEMM_SCALING_TENSOR;
  if (!fp8_pair_has_kernel(a, b) || !fp8_output_pair_has_kernel(a, b, d)) return 0;
  if (!fp8_epilogue_has_kernel(row->info, d)) return 0;
  if (a_scaling == FUS_GEMM_SCALING_TENSOR && b_scaling == FUS_GEMM_SCALING_TENSOR) return 1;
  return scaling_pair_has_kernel(a_scaling, b_scaling) && block_output_has_kernel(d) &&
         block_epilogue_has_kernel(e);
}

const fus_gemm_limits* fus_gemm_get_limits(void) { return &kLimits; }

int fus_gemm_has_cublaslt(void) {
#if defined(FUSIBLE_WITH_CUDA) && defined(FUSIBLE_WITH_CUBLASLT)
  return 1;
#else
  return 0;
#endif
}

}  // extern "C"
