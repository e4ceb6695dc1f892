// CPU backend of the quantize family: the executable specification of the numerics in
// fusible/quantize.h. Straightforward loops; blocked only where the transpose needs it.
#include <algorithm>
#include <vector>

#include "common/dispatch.h"
#include "quantize/quantize_impl.h"

namespace fusible {
namespace {

constexpr int64_t kTile = 64;  // transpose tile, keeps both copies' writes cache-friendly

template <typename T, Fp8Format F>
void quantize_per_tensor(const fus_tensor& in, const fus_quantized& out) {
  const T* x = static_cast<const T*>(in.data);
  uint8_t* row = static_cast<uint8_t*>(out.rowwise_data);
  uint8_t* col = static_cast<uint8_t*>(out.columnwise_data);
  const int64_t rows = in.rows, cols = in.cols;
  const float scale = *out.scale;
  uint32_t amax = 0;
  for (int64_t r0 = 0; r0 < rows; r0 += kTile) {
    for (int64_t c0 = 0; c0 < cols; c0 += kTile) {
      const int64_t r1 = std::min(rows, r0 + kTile), c1 = std::min(cols, c0 + kTile);
      for (int64_t r = r0; r < r1; ++r) {
        for (int64_t c = c0; c < c1; ++c) {
          const float v = Element<T>::load(x, r * cols + c);
          amax = std::max(amax, abs_bits(v));
          const uint8_t q = float_to_fp8<F>(scale_element(v, scale));
          if (row) row[r * cols + c] = q;
          if (col) col[c * rows + r] = q;
        }
      }
    }
  }
  static_cast<float*>(out.rowwise_scale_inv)[0] = 1.0f / scale;
  if (out.amax) *out.amax = bits_as_float(amax);
}

template <typename T, Fp8Format F>
void quantize_mxfp8(const fus_tensor& in, const fus_quantized& out) {
  const T* x = static_cast<const T*>(in.data);
  const int64_t rows = in.rows, cols = in.cols;
  constexpr int64_t B = FUS_MXFP8_BLOCK;
  uint32_t amax = 0;
  if (out.rowwise_data) {
    uint8_t* q = static_cast<uint8_t*>(out.rowwise_data);
    uint8_t* s = static_cast<uint8_t*>(out.rowwise_scale_inv);
    const int64_t nb = ceil_div(cols, B);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t c0 = b * B, c1 = std::min(cols, c0 + B);
        uint32_t block_amax = 0;
        for (int64_t c = c0; c < c1; ++c)
          block_amax = std::max(block_amax, abs_bits(Element<T>::load(x, r * cols + c)));
        amax = std::max(amax, block_amax);
        const uint8_t e = e8m0_from_amax<F>(bits_as_float(block_amax));
        const float mult = e8m0_inverse(e);
        s[r * nb + b] = e;
        for (int64_t c = c0; c < c1; ++c)
          q[r * cols + c] = float_to_fp8<F>(scale_element(Element<T>::load(x, r * cols + c), mult));
      }
    }
  }
  if (out.columnwise_data) {
    uint8_t* q = static_cast<uint8_t*>(out.columnwise_data);
    uint8_t* s = static_cast<uint8_t*>(out.columnwise_scale_inv);
    std::vector<uint32_t> block_amax(cols);
    std::vector<float> mult(cols);
    for (int64_t r0 = 0; r0 < rows; r0 += B) {
      const int64_t r1 = std::min(rows, r0 + B);
      std::fill(block_amax.begin(), block_amax.end(), 0u);
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = 0; c < cols; ++c)
          block_amax[c] = std::max(block_amax[c], abs_bits(Element<T>::load(x, r * cols + c)));
      for (int64_t c = 0; c < cols; ++c) {
        amax = std::max(amax, block_amax[c]);
        const uint8_t e = e8m0_from_amax<F>(bits_as_float(block_amax[c]));
        s[(r0 / B) * cols + c] = e;
        mult[c] = e8m0_inverse(e);
      }
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t c = 0; c < cols; ++c)
          q[r * cols + c] =
              float_to_fp8<F>(scale_element(Element<T>::load(x, r * cols + c), mult[c]));
    }
  }
  if (out.amax) *out.amax = bits_as_float(amax);
}

template <typename T, Fp8Format F>
void dequantize_impl(const fus_quantized& in, bool columnwise, const fus_tensor& output) {
  const uint8_t* q = static_cast<const uint8_t*>(columnwise ? in.columnwise_data : in.rowwise_data);
  T* y = static_cast<T*>(output.data);
  const int64_t rows = output.rows, cols = output.cols;
  if (in.mode == FUS_SCALING_PER_TENSOR) {
    const float scale_inv = static_cast<const float*>(in.rowwise_scale_inv)[0];
    for (int64_t i = 0; i < rows * cols; ++i)
      Element<T>::store(y, i, scale_element(fp8_to_float<F>(q[i]), scale_inv));
    return;
  }
  constexpr int64_t B = FUS_MXFP8_BLOCK;
  const uint8_t* s =
      static_cast<const uint8_t*>(columnwise ? in.columnwise_scale_inv : in.rowwise_scale_inv);
  const int64_t nb = ceil_div(cols, B);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const uint8_t e = columnwise ? s[(r / B) * cols + c] : s[r * nb + c / B];
      Element<T>::store(y, r * cols + c,
                        scale_element(fp8_to_float<F>(q[r * cols + c]), e8m0_to_float(e)));
    }
  }
}

}  // namespace

void quantize_cpu(const fus_tensor& input, const fus_quantized& out) {
  if (input.rows * input.cols == 0) {
    if (out.amax) *out.amax = 0.0f;
    if (out.mode == FUS_SCALING_PER_TENSOR && out.scale && out.rowwise_scale_inv)
      static_cast<float*>(out.rowwise_scale_inv)[0] = 1.0f / *out.scale;
    return;
  }
  dispatch_hp(input.dtype, [&](auto t) {
    using T = decltype(t);
    dispatch_fp8(out.dtype, [&](auto f) {
      constexpr Fp8Format F = decltype(f)::value;
      if (out.mode == FUS_SCALING_PER_TENSOR)
        quantize_per_tensor<T, F>(input, out);
      else
        quantize_mxfp8<T, F>(input, out);
    });
  });
}

void amax_cpu(const fus_tensor& input, float* amax) {
  uint32_t m = 0;
  if (input.rows * input.cols > 0) {
    dispatch_hp(input.dtype, [&](auto t) {
      using T = decltype(t);
      const T* x = static_cast<const T*>(input.data);
      for (int64_t i = 0; i < input.rows * input.cols; ++i)
        m = std::max(m, abs_bits(Element<T>::load(x, i)));
    });
  }
  *amax = bits_as_float(m);
}

void dequantize_cpu(const fus_quantized& in, bool columnwise, const fus_tensor& output) {
  if (output.rows * output.cols == 0) return;
  dispatch_hp(output.dtype, [&](auto t) {
    using T = decltype(t);
    dispatch_fp8(in.dtype,
                 [&](auto f) { dequantize_impl<T, decltype(f)::value>(in, columnwise, output); });
  });
}

void transpose_fp8_cpu(const fus_tensor& input, const fus_tensor& output) {
  // A byte move: the dtype (E4M3 or E5M2) does not matter.
  const uint8_t* x = static_cast<const uint8_t*>(input.data);
  uint8_t* y = static_cast<uint8_t*>(output.data);
  const int64_t rows = input.rows, cols = input.cols;
  for (int64_t r0 = 0; r0 < rows; r0 += kTile) {
    for (int64_t c0 = 0; c0 < cols; c0 += kTile) {
      const int64_t r1 = std::min(rows, r0 + kTile), c1 = std::min(cols, c0 + kTile);
      for (int64_t c = c0; c < c1; ++c)
        for (int64_t r = r0; r < r1; ++r) y[c * rows + r] = x[r * cols + c];
    }
  }
}

}  // namespace fusible
