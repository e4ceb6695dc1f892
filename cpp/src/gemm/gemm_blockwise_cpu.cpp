// CPU backend of blockwise FP8 GEMMs (fusible/gemm.h): both operands dequantized exactly to fp32
// (fp32(float(q) * scale_inv) per element, the rule of fusible/quantize.h), then the fp32 GEMM of
// gemm_cpu.cpp on them, so the result is the specification's GEMM of the dequantized operands.
#include <vector>

#include "common/cast.h"
#include "gemm/gemm_impl.h"

namespace fusible {
namespace {

// X [R, K] (FP8, K-contiguous) dequantized into out [R, K] fp32 with its block scales (gemm.h
// layouts: the quantize family's, with the 128x128 tiles' padded row stride).
void dequantize_operand(const fus_tensor& x, const float* s, fus_gemm_scaling scaling,
                        std::vector<float>& out) {
  out.resize(static_cast<size_t>(x.rows * x.cols));
  const fus_tensor o{out.empty() ? nullptr : out.data(), FUS_FLOAT32, x.rows, x.cols};
  dequantize_blocks_cpu(x.dtype, x.data, s, scaling == FUS_GEMM_SCALING_BLOCK_2D,
                        block2d_scale_stride(x.cols), o);
}

}  // namespace

void gemm_blockwise_cpu(const fus_gemm_args& args, const GemmShape& shape) {
  std::vector<float> a, b;
  dequantize_operand(args.a, args.a_scale_inv, args.a_scaling, a);
  dequantize_operand(args.b, args.b_scale_inv, args.b_scaling, b);
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
