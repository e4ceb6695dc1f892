// CPU backend of the blockwise FP8 dequantize (fusible/quantize.h: 1x128 and 128x128 blocks,
// fp32 scales; the cast itself is common/cast_cpu.cpp). Rows are split over the threads.
#include <algorithm>
#include <vector>

#include "common/cpu_rows.h"
#include "common/cpu_runtime.h"
#include "common/dispatch.h"
#include "quantize/quantize_impl.h"

namespace fusible {
namespace {

constexpr int64_t B = FUS_FP8_BLOCK;

// Index of element (i, j) of a copy [R, C]'s scale_inv matrix (common.h layouts).
inline int64_t scale_index(bool two_d, int64_t i, int64_t j, int64_t R, int64_t C) {
  return two_d ? (i / B) * ceil_div(C, B) + j / B : (j / B) * R + i;
}

template <Fp8Format F>
void dequantize_copy(const fus_quantized& in, bool columnwise, const fus_tensor& output) {
  const uint8_t* q = static_cast<const uint8_t*>(columnwise ? in.columnwise_data : in.rowwise_data);
  const float* s =
      static_cast<const float*>(columnwise ? in.columnwise_scale_inv : in.rowwise_scale_inv);
  const int64_t R = output.rows, C = output.cols;
  const bool two_d = in.mode == FUS_SCALING_BLOCK_2D;
  parallel_ranges(R, std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(C, 1)),
                  [&](int64_t i0, int64_t i1) {
                    std::vector<float> v(static_cast<size_t>(C));
                    for (int64_t i = i0; i < i1; ++i) {
                      for (int64_t j = 0; j < C; ++j)
                        v[static_cast<size_t>(j)] = scale_element_sel(
                            fp8_to_float<F>(q[i * C + j]), s[scale_index(two_d, i, j, R, C)]);
                      store_run(output.dtype, output.data, i * C, C, v.data());
                    }
                  });
}

}  // namespace

void dequantize_blockwise_cpu(const fus_quantized& in, bool columnwise, const fus_tensor& output) {
  if (output.rows * output.cols == 0) return;
  dispatch_hp(output.dtype, [&](auto) {});
  dispatch_fp8(in.dtype,
               [&](auto f) { dequantize_copy<decltype(f)::value>(in, columnwise, output); });
}

}  // namespace fusible
