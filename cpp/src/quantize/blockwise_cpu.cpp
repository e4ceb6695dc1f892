// CPU backend of the blockwise FP8 dequantize (fusible/quantize.h: 1x128 and 128x128 blocks,
// fp32 scales): the shared dequantize of common/cast_cpu.cpp with the quantize layout's scales.
#include "common/cast.h"
#include "common/dispatch.h"
#include "quantize/quantize_impl.h"

namespace fusible {

void dequantize_blockwise_cpu(const fus_quantized& in, bool columnwise, const fus_tensor& output) {
  if (output.rows * output.cols == 0) return;
  dispatch_hp(output.dtype, [&](auto) {});
  const void* q = columnwise ? in.columnwise_data : in.rowwise_data;
  const float* s =
      static_cast<const float*>(columnwise ? in.columnwise_scale_inv : in.rowwise_scale_inv);
  dequantize_blocks_cpu(in.dtype, q, s, in.mode == FUS_SCALING_BLOCK_2D,
                        ceil_div(output.cols, int64_t{FUS_FP8_BLOCK}), output);
}

}  // namespace fusible
