// Backend entry points of the quantize family. Arguments are validated by quantize_api.cpp;
// backends throw fusible::Error on failure. The casts themselves (every mode on the CPU, the FP8
// transpose and the scale rule on both backends) are shared with the other families:
// common/cast.h.
#pragma once

#include "common/cast.h"
#include "fusible/quantize.h"

namespace fusible {

void amax_cpu(const fus_tensor& input, float* amax);
void dequantize_cpu(const fus_quantized& in, bool columnwise, const fus_tensor& output);
void dequantize_blockwise_cpu(const fus_quantized& in, bool columnwise, const fus_tensor& output);

#if defined(FUSIBLE_WITH_CUDA)
// The current-scaling scale rule applied inside a per-tensor cast: scale = compute_scale(*amax,
// fp8_max, margin) (the reduced amax of the input), written to *scale.
struct CurrentScale {
  const float* amax;
  float* scale;
  float fp8_max;
  int margin;
};

// Per-tensor and MXFP8 casts; with `current` (per tensor, non-empty input, out.amax null) the
// cast derives out.scale from current->amax first (one launch instead of two).
void quantize_cuda(const fus_tensor& input, const fus_quantized& out, const fus_context& ctx,
                   const CurrentScale* current = nullptr);
// Blockwise casts (out.power_2_scale, out.amax_epsilon).
void quantize_blockwise_cuda(const fus_tensor& input, const fus_quantized& out,
                             const fus_context& ctx);
void amax_cuda(const fus_tensor& input, float* amax, const fus_context& ctx);
void dequantize_cuda(const fus_quantized& in, bool columnwise, const fus_tensor& output,
                     const fus_context& ctx);
// Grouped per-tensor casts (fus_quantize_grouped; arguments validated).
void quantize_grouped_cuda(const fus_tensor* inputs, const fus_quantized* outs, int64_t count,
                           bool current_scaling, int margin, const fus_context& ctx);
void dequantize_blockwise_cuda(const fus_quantized& in, bool columnwise, const fus_tensor& output,
                               const fus_context& ctx);
#endif

}  // namespace fusible
