// CPU backend of the shared casts (common/cast.h): the executable specification of the FP8,
// MXFP8 and blockwise FP8 casts of fusible/quantize.h, used by the quantize family and by the
// fused normalization and activation kernels alike.
//
// Every output element is computed on its own (the cast of one input element; a block scale from
// its block's amax), so the work is split over the CPU backend's threads by rows (row tiles of 64
// for the per-tensor transpose, MXFP8 blocks of 32 rows, bands of 128 rows for blockwise); amax
// is a max, combined over the tasks. Rows are processed in runs widened to fp32 buffers by loops
// the compiler vectorises for the processor's instruction set (with_cpu_isa). The results are those
// of the element-wise definitions, bit for bit.
//
// Blockwise: each band of 128 rows is read twice (block amaxes, then the casts of both copies)
// while it is in cache; the columnwise copy is cast into a band buffer and byte-transposed from
// there.
#include <algorithm>
#include <cstring>
#include <vector>

#include "common/cast.h"
#include "common/cpu_rows.h"
#include "common/cpu_runtime.h"
#include "common/dispatch.h"

namespace fusible {
namespace {

// out.amax (when given) receives the amax whose bits are `bits` (abs_bits), or with
// out.amax_accumulate the larger of those bits and *out.amax's, compared as uint32: the CUDA
// backend's atomicMax on the same bits (NaN wins; common.h).
void store_amax(const fus_quantized& out, uint32_t bits) {
  if (out.amax == nullptr) return;
  if (out.amax_accumulate) bits = std::max(bits, float_as_bits(*out.amax));
  *out.amax = bits_as_float(bits);
}

constexpr int64_t kTile = 64;  // transpose tile, keeps both copies' writes cache-friendly
// q[j] = fp8(scale_element(v[j], scale)); returns max(amax, max_j |v[j]|) (ordered bits).
template <Fp8Format F>
FUS_ALWAYS_INLINE uint32_t cast_run(const float* __restrict v, int64_t n, float scale,
                                    uint8_t* __restrict q, uint32_t amax) {
  for (int64_t j = 0; j < n; ++j) {
    amax = std::max(amax, abs_bits(v[j]));
    q[j] = float_to_fp8_sel<F>(scale_element_sel(v[j], scale));
  }
  return amax;
}

template <Fp8Format F>
void quantize_per_tensor(const fus_tensor& in, const fus_quantized& out) {
  uint8_t* row = static_cast<uint8_t*>(out.rowwise_data);
  uint8_t* col = static_cast<uint8_t*>(out.columnwise_data);
  const int64_t rows = in.rows, cols = in.cols;
  const float scale = *out.scale;
  const int64_t tiles = (rows + kTile - 1) / kTile;
  // With the transposed copy: a tile of 64 rows by up to kBand columns is cast row by row
  // (sequential reads) into a buffer whose row stride is off a power of two (no cache-set
  // conflicts), then transposed from there.
  constexpr int64_t kBand = 2048;
  const int64_t band = std::min(kBand, cols);
  const int64_t tstride = band + 64;
  TaskMax tm(tiles, cpu_min_units(kTile * cols));
  for_ranges(tiles, tm, [&](int64_t t0, int64_t t1) {
    uint32_t amax = 0;
    std::vector<uint8_t> tbuf(col ? static_cast<size_t>(kTile * tstride) : 0);
    with_cpu_isa([&]() FUS_INLINE_LAMBDA {
      float buf[kCpuSeg];
      uint32_t am = 0;
      for (int64_t r0 = t0 * kTile; r0 < std::min(rows, t1 * kTile); r0 += kTile) {
        const int64_t r1 = std::min(rows, r0 + kTile);
        for (int64_t b0 = 0; b0 < cols; b0 += band) {
          const int64_t bn = std::min(band, cols - b0);
          for (int64_t r = r0; r < r1; ++r) {
            uint8_t* q = col ? tbuf.data() + (r - r0) * tstride : row + r * cols + b0;
            for (int64_t c0 = 0; c0 < bn; c0 += kCpuSeg) {
              const int64_t n = std::min(kCpuSeg, bn - c0);
              const float* v = run_f32(in.dtype, in.data, r * cols + b0 + c0, n, buf);
              am = cast_run<F>(v, n, scale, q + c0, am);
            }
            if (col && row) std::memcpy(row + r * cols + b0, q, static_cast<size_t>(bn));
          }
          if (col) transpose_bytes(tbuf.data(), tstride, r1 - r0, bn, col + b0 * rows + r0, rows);
        }
      }
      amax = am;
    });
    tm.at(t0) = amax;
  });
  static_cast<float*>(out.rowwise_scale_inv)[0] = 1.0f / scale;
  store_amax(out, tm.max());
}

template <Fp8Format F>
void quantize_mxfp8(const fus_tensor& in, const fus_quantized& out) {
  const int64_t rows = in.rows, cols = in.cols;
  constexpr int64_t B = FUS_MXFP8_BLOCK;
  static_assert(kCpuSeg % B == 0, "a run holds whole blocks");
  const int64_t nb = ceil_div(cols, B);
  const int64_t blocks = ceil_div(rows, B);  // blocks of B rows
  TaskMax tm(blocks, cpu_min_units(B * cols));
  for_ranges(blocks, tm, [&](int64_t b0, int64_t b1) {
    uint32_t amax = 0;
    with_cpu_isa([&]() FUS_INLINE_LAMBDA {
      float buf[kCpuSeg], mult[kCpuSeg];
      uint32_t bmax[kCpuSeg];
      uint8_t e8[kCpuSeg];
      uint32_t am = 0;
      for (int64_t r0 = b0 * B; r0 < std::min(rows, b1 * B); r0 += B) {
        const int64_t r1 = std::min(rows, r0 + B);
        if (out.rowwise_data) {
          uint8_t* q = static_cast<uint8_t*>(out.rowwise_data);
          uint8_t* s = static_cast<uint8_t*>(out.rowwise_scale_inv);
          for (int64_t r = r0; r < r1; ++r) {
            for (int64_t c0 = 0; c0 < cols; c0 += kCpuSeg) {
              const int64_t n = std::min(kCpuSeg, cols - c0);
              const float* v = run_f32(in.dtype, in.data, r * cols + c0, n, buf);
              for (int64_t j0 = 0; j0 < n; j0 += B) {
                const int64_t w = std::min(B, n - j0);
                uint32_t m = 0;
                for (int64_t j = 0; j < w; ++j) m = std::max(m, abs_bits(v[j0 + j]));
                am = std::max(am, m);
                const uint8_t e = e8m0_from_amax<F>(bits_as_float(m));
                s[r * nb + (c0 + j0) / B] = e;
                const float mu = e8m0_inverse(e);
                uint8_t* qb = q + r * cols + c0 + j0;
                const float* vb = v + j0;
                for (int64_t j = 0; j < w; ++j)
                  qb[j] = float_to_fp8_sel<F>(scale_element_sel(vb[j], mu));
              }
            }
          }
        }
        if (out.columnwise_data) {
          uint8_t* q = static_cast<uint8_t*>(out.columnwise_data);
          uint8_t* s = static_cast<uint8_t*>(out.columnwise_scale_inv);
          for (int64_t c0 = 0; c0 < cols; c0 += kCpuSeg) {
            const int64_t n = std::min(kCpuSeg, cols - c0);
            for (int64_t j = 0; j < n; ++j) bmax[j] = 0;
            for (int64_t r = r0; r < r1; ++r) {
              const float* v = run_f32(in.dtype, in.data, r * cols + c0, n, buf);
              for (int64_t j = 0; j < n; ++j) bmax[j] = std::max(bmax[j], abs_bits(v[j]));
            }
            for (int64_t j = 0; j < n; ++j) {
              am = std::max(am, bmax[j]);
              e8[j] = e8m0_from_amax<F>(bits_as_float(bmax[j]));
              mult[j] = e8m0_inverse(e8[j]);
            }
            std::memcpy(s + (r0 / B) * cols + c0, e8, static_cast<size_t>(n));
            for (int64_t r = r0; r < r1; ++r) {
              const float* v = run_f32(in.dtype, in.data, r * cols + c0, n, buf);
              uint8_t* qr = q + r * cols + c0;
              for (int64_t j = 0; j < n; ++j)
                qr[j] = float_to_fp8_sel<F>(scale_element_sel(v[j], mult[j]));
            }
          }
        }
      }
      amax = am;
    });
    tm.at(b0) = amax;
  });
  store_amax(out, tm.max());
}

// Row r of the input as fp32 (the matrix itself for fp32, else widened into buf).
const float* row_f32(const fus_tensor& in, int64_t r, std::vector<float>& buf) {
  return run_f32(in.dtype, in.data, r * in.cols, in.cols, buf.data());
}

template <Fp8Format F>
void quantize_band(const fus_tensor& in, const fus_quantized& out, int64_t band,
                   uint32_t* band_amax) {
  constexpr int64_t B = FUS_FP8_BLOCK;
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
    return block_scale(bits_as_float(amax_bits), fmax, out.amax_epsilon, out.power_2_scale != 0);
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

}  // namespace

void cast_cpu(const fus_tensor& input, const fus_quantized& out) {
  const bool blockwise = out.mode == FUS_SCALING_BLOCK_1D || out.mode == FUS_SCALING_BLOCK_2D;
  if (input.rows * input.cols == 0) {
    store_amax(out, 0u);
    if (out.mode == FUS_SCALING_PER_TENSOR && out.scale && out.rowwise_scale_inv)
      static_cast<float*>(out.rowwise_scale_inv)[0] = 1.0f / *out.scale;
    return;
  }
  dispatch_hp(input.dtype, [&](auto) {});  // the input dtype is high precision
  dispatch_fp8(out.dtype, [&](auto f) {
    constexpr Fp8Format F = decltype(f)::value;
    if (out.mode == FUS_SCALING_PER_TENSOR) {
      quantize_per_tensor<F>(input, out);
    } else if (out.mode == FUS_SCALING_MXFP8) {
      quantize_mxfp8<F>(input, out);
    } else if (blockwise) {
      const int64_t bands = ceil_div(input.rows, FUS_FP8_BLOCK);
      std::vector<uint32_t> amax(static_cast<size_t>(bands), 0u);
      parallel_for(bands, [&](int64_t b) {
        quantize_band<F>(input, out, b, &amax[static_cast<size_t>(b)]);
      });
      store_amax(out, *std::max_element(amax.begin(), amax.end()));
    }
  });
}

void dequantize_blocks_cpu(fus_dtype fp8, const void* q, const float* scale_inv, bool two_d,
                           int64_t tile_stride, const fus_tensor& output) {
  const int64_t R = output.rows, C = output.cols, B = FUS_FP8_BLOCK;
  if (R * C == 0) return;
  const uint8_t* bytes = static_cast<const uint8_t*>(q);
  dispatch_fp8(fp8, [&](auto f) {
    constexpr Fp8Format F = decltype(f)::value;
    parallel_ranges(R, std::max<int64_t>(1, (int64_t{1} << 16) / C), [&](int64_t i0, int64_t i1) {
      std::vector<float> v(static_cast<size_t>(C));
      for (int64_t i = i0; i < i1; ++i) {
        for (int64_t j = 0; j < C; ++j) {
          const float s =
              two_d ? scale_inv[(i / B) * tile_stride + j / B] : scale_inv[(j / B) * R + i];
          v[static_cast<size_t>(j)] = scale_element_sel(fp8_to_float<F>(bytes[i * C + j]), s);
        }
        store_run(output.dtype, output.data, i * C, C, v.data());
      }
    });
  });
}

void transpose_fp8_cpu(const fus_tensor& input, const fus_tensor& output) {
  // A byte move: the dtype (E4M3 or E5M2) does not matter.
  const uint8_t* x = static_cast<const uint8_t*>(input.data);
  uint8_t* y = static_cast<uint8_t*>(output.data);
  const int64_t rows = input.rows, cols = input.cols;
  const int64_t tiles = (rows + kTile - 1) / kTile;
  parallel_ranges(tiles, cpu_min_units(kTile * cols), [&](int64_t t0, int64_t t1) {
    for (int64_t r0 = t0 * kTile; r0 < std::min(rows, t1 * kTile); r0 += kTile) {
      for (int64_t c0 = 0; c0 < cols; c0 += kTile) {
        const int64_t r1 = std::min(rows, r0 + kTile), c1 = std::min(cols, c0 + kTile);
        transpose_bytes(x + r0 * cols + c0, cols, r1 - r0, c1 - c0, y + c0 * rows + r0, rows);
      }
    }
  });
}

void scale_from_amax_cpu(const float* amax, float* scale, float* scale_inv, float fp8_max,
                         int margin, bool keep_previous) {
  const float s = compute_scale(*amax, fp8_max, margin, keep_previous ? *scale : 1.0f);
  *scale = s;
  if (scale_inv) *scale_inv = 1.0f / s;
}

}  // namespace fusible
