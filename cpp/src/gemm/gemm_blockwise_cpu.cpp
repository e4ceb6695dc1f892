// CPU backend of blockwise FP8 GEMMs (fusible/gemm.h): both operands dequantized exactly to fp32
// (fp32(float(q) * scale_inv) per element, the rule of fusible/quantize.h), then the fp32 GEMM of
// gemm_cpu.cpp on them, so the result is the specification's GEMM of the dequantized operands.
#include <algorithm>
#include <vector>

#include "common/cpu_runtime.h"
#include "common/dispatch.h"
#include "gemm/gemm_impl.h"

namespace fusible {
namespace {

// X [R, K] (FP8, K-contiguous) dequantized into out [R, K] with its block scales (gemm.h layouts).
template <Fp8Format F>
void dequantize_operand(const fus_tensor& x, const float* s, fus_gemm_scaling scaling,
                        std::vector<float>& out) {
  const int64_t R = x.rows, K = x.cols;
  out.resize(static_cast<size_t>(R * K));
  const uint8_t* q = static_cast<const uint8_t*>(x.data);
  const int64_t stride = block2d_scale_stride(K);
  const bool two_d = scaling == FUS_GEMM_SCALING_BLOCK_2D;
  parallel_ranges(R, std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(K, 1)),
                  [&](int64_t r0, int64_t r1) {
                    for (int64_t r = r0; r < r1; ++r)
                      for (int64_t k = 0; k < K; ++k) {
                        const float si = two_d ? s[(r / FUS_FP8_BLOCK) * stride + k / FUS_FP8_BLOCK]
                                               : s[(k / FUS_FP8_BLOCK) * R + r];
                        out[static_cast<size_t>(r * K + k)] =
                            scale_element(fp8_to_float<F>(q[r * K + k]), si);
                      }
                  });
}

void dequantize_any(const fus_tensor& x, const float* s, fus_gemm_scaling scaling,
                    std::vector<float>& out) {
  dispatch_fp8(x.dtype,
               [&](auto f) { dequantize_operand<decltype(f)::value>(x, s, scaling, out); });
}

}  // namespace

void gemm_blockwise_cpu(const fus_gemm_args& args, const GemmShape& shape) {
  std::vector<float> a, b;
  dequantize_any(args.a, args.a_scale_inv, args.a_scaling, a);
  dequantize_any(args.b, args.b_scale_inv, args.b_scaling, b);
  fus_gemm_args hp = args;
  hp.a = fus_tensor{a.empty() ? nullptr : a.data(), FUS_FLOAT32, args.a.rows, args.a.cols};
  hp.b = fus_tensor{b.empty() ? nullptr : b.data(), FUS_FLOAT32, args.b.rows, args.b.cols};
  hp.a_scale_inv = hp.b_scale_inv = nullptr;
  hp.a_scaling = hp.b_scaling = FUS_GEMM_SCALING_TENSOR;
  GemmShape s = shape;
  s.fp8 = false;
  s.blockwise = false;
  gemm_cpu(hp, s);
}

}  // namespace fusible
