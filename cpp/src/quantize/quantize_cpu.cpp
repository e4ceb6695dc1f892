// CPU backend of the quantize family's own kernels: amax and the per-tensor / MXFP8 dequantize
// (the casts, which other families share, are common/cast_cpu.cpp; blockwise dequantize is
// blockwise_cpu.cpp). Work is split over the CPU backend's threads by rows; amax is a max,
// combined over the tasks. The results are those of the element-wise definitions, bit for bit.
#include <algorithm>
#include <vector>

#include "common/cpu_rows.h"
#include "common/cpu_runtime.h"
#include "common/dispatch.h"
#include "quantize/quantize_impl.h"

namespace fusible {
namespace {

// Every FP8 code decoded (fp8_to_float, exact).
template <Fp8Format F>
const float* fp8_values() {
  struct Table {
    float v[256];
    Table() {
      for (int i = 0; i < 256; ++i) v[i] = fp8_to_float<F>(static_cast<uint8_t>(i));
    }
  };
  static const Table t;
  return t.v;
}

template <Fp8Format F>
void dequantize_impl(const fus_quantized& in, bool columnwise, const fus_tensor& output) {
  const uint8_t* q = static_cast<const uint8_t*>(columnwise ? in.columnwise_data : in.rowwise_data);
  const int64_t rows = output.rows, cols = output.cols;
  const float* tab = fp8_values<F>();
  constexpr int64_t B = FUS_MXFP8_BLOCK;
  const bool per_tensor = in.mode == FUS_SCALING_PER_TENSOR;
  const float scale_inv = per_tensor ? static_cast<const float*>(in.rowwise_scale_inv)[0] : 0.0f;
  const uint8_t* s =
      static_cast<const uint8_t*>(columnwise ? in.columnwise_scale_inv : in.rowwise_scale_inv);
  const int64_t nb = ceil_div(cols, B);
  parallel_ranges(rows, cpu_min_units(cols), [&](int64_t r0, int64_t r1) {
    with_cpu_isa([&]() FUS_INLINE_LAMBDA {
      float v[kCpuSeg], sc[kCpuSeg];
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c0 = 0; c0 < cols; c0 += kCpuSeg) {
          const int64_t n = std::min(kCpuSeg, cols - c0);
          const uint8_t* qr = q + r * cols + c0;
          if (per_tensor) {
            for (int64_t j = 0; j < n; ++j) v[j] = scale_element_sel(tab[qr[j]], scale_inv);
          } else {
            if (columnwise) {
              const uint8_t* sr = s + (r / B) * cols + c0;
              for (int64_t j = 0; j < n; ++j) sc[j] = e8m0_to_float(sr[j]);
            } else {
              for (int64_t j = 0; j < n; ++j) sc[j] = e8m0_to_float(s[r * nb + (c0 + j) / B]);
            }
            for (int64_t j = 0; j < n; ++j) v[j] = scale_element_sel(tab[qr[j]], sc[j]);
          }
          store_run(output.dtype, output.data, r * cols + c0, n, v);
        }
      }
    });
  });
}

}  // namespace

void amax_cpu(const fus_tensor& input, float* amax) {
  uint32_t m = 0;
  const int64_t n = input.rows * input.cols;
  if (n > 0) {
    dispatch_hp(input.dtype, [&](auto) {});
    TaskMax tm(n, cpu_min_units(1));
    for_ranges(n, tm, [&](int64_t i0, int64_t i1) {
      uint32_t amax = 0;
      with_cpu_isa([&]() FUS_INLINE_LAMBDA {
        float buf[kCpuSeg];
        uint32_t am = 0;
        for (int64_t i = i0; i < i1; i += kCpuSeg) {
          const int64_t k = std::min(kCpuSeg, i1 - i);
          const float* v = run_f32(input.dtype, input.data, i, k, buf);
          for (int64_t j = 0; j < k; ++j) am = std::max(am, abs_bits(v[j]));
        }
        amax = am;
      });
      tm.at(i0) = amax;
    });
    m = tm.max();
  }
  *amax = bits_as_float(m);
}

void dequantize_cpu(const fus_quantized& in, bool columnwise, const fus_tensor& output) {
  if (output.rows * output.cols == 0) return;
  dispatch_hp(output.dtype, [&](auto) {});
  dispatch_fp8(in.dtype,
               [&](auto f) { dequantize_impl<decltype(f)::value>(in, columnwise, output); });
}

}  // namespace fusible
