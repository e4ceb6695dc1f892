// CPU backend of the blockwise FP8 casts (fusible/quantize.h: 1x128 and 128x128 blocks, fp32
// scales): the executable specification. Work is split over the CPU backend's threads by bands of
// 128 rows; each band is read twice (block amaxes, then the casts of both copies) while it is in
// cache. The columnwise copy is cast into a band buffer and byte-transposed from there.
#include <algorithm>
#include <vector>

#include "common/cpu_rows.h"
#include "common/cpu_runtime.h"
#include "common/dispatch.h"
#include "quantize/quantize_impl.h"

namespace fusible {
namespace {

constexpr int64_t B = FUS_FP8_BLOCK;

// Row r of the input as fp32 (the matrix itself for fp32, else widened into buf).
const float* row_f32(const fus_tensor& in, int64_t r, std::vector<float>& buf) {
  return run_f32(in.dtype, in.data, r * in.cols, in.cols, buf.data());
}

template <Fp8Format F>
void quantize_band(const fus_tensor& in, const fus_quantized& out, const BlockScaling& p,
                   int64_t band, uint32_t* band_amax) {
  const int64_t rows = in.rows, cols = in.cols;
  const int64_t r0 = band * B, r1 = std::min(rows, r0 + B), h = r1 - r0;
  const int64_t nb = ceil_div(cols, B);  // blocks along a row
  const bool two_d = out.mode == FUS_SCALING_BLOCK_2D;
  const float fmax = fp8_max_value<F>();
  uint8_t* row_q = static_cast<uint8_t*>(out.rowwise_data);
  uint8_t* col_q = static_cast<uint8_t*>(out.columnwise_data);
  float* row_s = static_cast<float*>(out.rowwise_scale_inv);
  float* col_s = static_cast<float*>(out.columnwise_scale_inv);
  std::vector<float> buf(static_cast<size_t>(cols));
  // Pass 1: amaxes of the row blocks (1D rowwise), of the column blocks (1D columnwise) and of the
  // tiles (2D), as ordered bits (NaN above everything).
  std::vector<uint32_t> rmax(static_cast<size_t>(h * nb), 0u), cmax(static_cast<size_t>(cols), 0u),
      tmax(static_cast<size_t>(nb), 0u);
  uint32_t am = 0;
  for (int64_t r = r0; r < r1; ++r) {
    const float* v = row_f32(in, r, buf);
    for (int64_t c = 0; c < cols; ++c) {
      const uint32_t a = abs_bits(v[c]);
      uint32_t& m = rmax[static_cast<size_t>((r - r0) * nb + c / B)];
      m = std::max(m, a);
      cmax[static_cast<size_t>(c)] = std::max(cmax[static_cast<size_t>(c)], a);
    }
  }
  for (int64_t r = 0; r < h; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const uint32_t m = rmax[static_cast<size_t>(r * nb + b)];
      tmax[static_cast<size_t>(b)] = std::max(tmax[static_cast<size_t>(b)], m);
      am = std::max(am, m);
    }
  *band_amax = am;
  auto scale_of = [&](uint32_t amax_bits) {
    return block_scale(bits_as_float(amax_bits), fmax, p.epsilon, p.pow2);
  };
  // Multipliers: per row block (rowwise), per column (columnwise), per tile (2D, both copies).
  std::vector<float> rmul(static_cast<size_t>(h * nb)), cmul(static_cast<size_t>(cols));
  for (int64_t r = 0; r < h; ++r)
    for (int64_t b = 0; b < nb; ++b) {
      const size_t i = static_cast<size_t>(r * nb + b);
      const float s = scale_of(two_d ? tmax[static_cast<size_t>(b)] : rmax[i]);
      rmul[i] = s;
      if (row_q && !two_d) row_s[b * rows + r0 + r] = 1.0f / s;  // [ceil(cols/128), rows]
    }
  if (two_d) {
    const int64_t nbr = ceil_div(rows, B);
    for (int64_t b = 0; b < nb; ++b) {
      const float inv = 1.0f / scale_of(tmax[static_cast<size_t>(b)]);
      if (row_q) row_s[band * nb + b] = inv;   // [ceil(rows/128), ceil(cols/128)]
      if (col_q) col_s[b * nbr + band] = inv;  // [ceil(cols/128), ceil(rows/128)]
    }
    for (int64_t c = 0; c < cols; ++c)
      cmul[static_cast<size_t>(c)] = rmul[static_cast<size_t>(c / B)];
  } else if (col_q) {
    for (int64_t c = 0; c < cols; ++c) {
      const float s = scale_of(cmax[static_cast<size_t>(c)]);
      cmul[static_cast<size_t>(c)] = s;
      col_s[band * cols + c] = 1.0f / s;  // [ceil(rows/128), cols]
    }
  }
  // Pass 2: the casts. The columnwise copy goes through a band buffer [h, cols] and is transposed
  // into columnwise_data [cols, rows] at columns r0 .. r1 - 1.
  std::vector<uint8_t> tbuf(col_q ? static_cast<size_t>(h * cols) : 0);
  for (int64_t r = r0; r < r1; ++r) {
    const float* v = row_f32(in, r, buf);
    if (row_q) {
      uint8_t* q = row_q + r * cols;
      const float* mul = rmul.data() + (r - r0) * nb;
      for (int64_t c = 0; c < cols; ++c)
        q[c] = float_to_fp8_sel<F>(scale_element_sel(v[c], mul[c / B]));
    }
    if (col_q) {
      uint8_t* q = tbuf.data() + (r - r0) * cols;
      for (int64_t c = 0; c < cols; ++c)
        q[c] = float_to_fp8_sel<F>(scale_element_sel(v[c], cmul[static_cast<size_t>(c)]));
    }
  }
  if (col_q) transpose_bytes(tbuf.data(), cols, h, cols, col_q + r0, rows);
}

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

void quantize_blockwise_cpu(const fus_tensor& input, const fus_quantized& out,
                            const BlockScaling& p) {
  if (input.rows * input.cols == 0) {
    if (out.amax) *out.amax = 0.0f;
    return;
  }
  dispatch_hp(input.dtype, [&](auto) {});
  const int64_t bands = ceil_div(input.rows, B);
  std::vector<uint32_t> amax(static_cast<size_t>(bands), 0u);
  dispatch_fp8(out.dtype, [&](auto f) {
    constexpr Fp8Format F = decltype(f)::value;
    parallel_for(bands, [&](int64_t b) {
      quantize_band<F>(input, out, p, b, &amax[static_cast<size_t>(b)]);
    });
  });
  if (out.amax) *out.amax = bits_as_float(*std::max_element(amax.begin(), amax.end()));
}

void dequantize_blockwise_cpu(const fus_quantized& in, bool columnwise, const fus_tensor& output) {
  if (output.rows * output.cols == 0) return;
  dispatch_hp(output.dtype, [&](auto) {});
  dispatch_fp8(in.dtype,
               [&](auto f) { dequantize_copy<decltype(f)::value>(in, columnwise, output); });
}

}  // namespace fusible
