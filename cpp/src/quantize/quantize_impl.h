// Backend entry points of the quantize family. Arguments are validated by quantize_api.cpp;
// backends throw fusible::Error on failure.
#pragma once

#include "fusible/quantize.h"

namespace fusible {

// The two parameters of a blockwise cast (fus_quantize_blockwise).
struct BlockScaling {
  bool pow2;
  float epsilon;
};

// Blockwise FP8 (blockwise_cpu.cpp, blockwise.cu).
void quantize_blockwise_cpu(const fus_tensor& input, const fus_quantized& out,
                            const BlockScaling& p);
void dequantize_blockwise_cpu(const fus_quantized& in, bool columnwise, const fus_tensor& output);

void quantize_cpu(const fus_tensor& input, const fus_quantized& out);
void amax_cpu(const fus_tensor& input, float* amax);
void dequantize_cpu(const fus_quantized& in, bool columnwise, const fus_tensor& output);
void transpose_fp8_cpu(const fus_tensor& input, const fus_tensor& output);

#if defined(FUSIBLE_WITH_CUDA)
void quantize_cuda(const fus_tensor& input, const fus_quantized& out, const fus_context& ctx);
void amax_cuda(const fus_tensor& input, float* amax, const fus_context& ctx);
void dequantize_cuda(const fus_quantized& in, bool columnwise, const fus_tensor& output,
                     const fus_context& ctx);
// Grouped per-tensor casts (fus_quantize_grouped; arguments validated).
void quantize_grouped_cuda(const fus_tensor* inputs, const fus_quantized* outs, int64_t count,
                           bool current_scaling, int margin, const fus_context& ctx);
void transpose_fp8_cuda(const fus_tensor& input, const fus_tensor& output, const fus_context& ctx);
void quantize_blockwise_cuda(const fus_tensor& input, const fus_quantized& out,
                             const BlockScaling& p, const fus_context& ctx);
void dequantize_blockwise_cuda(const fus_quantized& in, bool columnwise, const fus_tensor& output,
                               const fus_context& ctx);
#endif

}  // namespace fusible
