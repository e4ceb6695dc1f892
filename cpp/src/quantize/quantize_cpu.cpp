// CPU backend of the quantize family: the executable specification of the numerics in
// fusible/quantize.h.
//
// Every output element is computed on its own (the cast of one input element; an MXFP8 block
// scale from its block's amax), so the work is split over the CPU backend's threads by rows (row
// tiles of 64 for the per-tensor transpose, MXFP8 blocks of 32 rows); amax is a max, combined over
// the tasks. Rows are processed in runs widened to fp32 buffers by loops the compiler vectorises
// for the processor's instruction set (with_cpu_isa). The results are those of the element-wise
// definitions, bit for bit.
#include <algorithm>
#include <cstring>
#include <vector>

#include "common/cpu_rows.h"
#include "common/cpu_runtime.h"
#include "common/dispatch.h"
#include "quantize/quantize_impl.h"

namespace fusible {
namespace {

constexpr int64_t kTile = 64;  // transpose tile, keeps both copies' writes cache-friendly

// Tasks of at least ~64K elements (all of them with set_cpu_force_split).
int64_t min_units(int64_t elems_per_unit) {
  if (cpu_force_split()) return 1;
  return std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(elems_per_unit, 1));
}

uint32_t max_of(const std::vector<uint32_t>& v) {
  uint32_t m = 0;
  for (uint32_t x : v) m = std::max(m, x);
  return m;
}

// Per-task partial maxima of a parallel_ranges over n units.
struct TaskMax {
  std::vector<uint32_t> v;
  int64_t chunk;
  TaskMax(int64_t n, int64_t min_chunk) {
    const int threads = cpu_threads();
    chunk =
        std::max<int64_t>(std::max<int64_t>(min_chunk, 1), (n + 4 * threads - 1) / (4 * threads));
    v.assign(static_cast<size_t>((n + chunk - 1) / chunk), 0u);
  }
  uint32_t& at(int64_t begin) { return v[static_cast<size_t>(begin / chunk)]; }
};

// f(begin, end) over [0, n) in the ranges of `tm` (the same as parallel_ranges with its chunk).
template <typename F>
void for_ranges(int64_t n, const TaskMax& tm, F&& f) {
  const int64_t chunk = tm.chunk;
  parallel_for(static_cast<int64_t>(tm.v.size()), [&](int64_t t) {
    const int64_t b = t * chunk;
    f(b, std::min(n, b + chunk));
  });
}

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
  TaskMax tm(tiles, min_units(kTile * cols));
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
  if (out.amax) *out.amax = bits_as_float(max_of(tm.v));
}

template <Fp8Format F>
void quantize_mxfp8(const fus_tensor& in, const fus_quantized& out) {
  const int64_t rows = in.rows, cols = in.cols;
  constexpr int64_t B = FUS_MXFP8_BLOCK;
  static_assert(kCpuSeg % B == 0, "a run holds whole blocks");
  const int64_t nb = ceil_div(cols, B);
  const int64_t blocks = ceil_div(rows, B);  // blocks of B rows
  TaskMax tm(blocks, min_units(B * cols));
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
  if (out.amax) *out.amax = bits_as_float(max_of(tm.v));
}

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
  parallel_ranges(rows, min_units(cols), [&](int64_t r0, int64_t r1) {
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

void quantize_cpu(const fus_tensor& input, const fus_quantized& out) {
  if (input.rows * input.cols == 0) {
    if (out.amax) *out.amax = 0.0f;
    if (out.mode == FUS_SCALING_PER_TENSOR && out.scale && out.rowwise_scale_inv)
      static_cast<float*>(out.rowwise_scale_inv)[0] = 1.0f / *out.scale;
    return;
  }
  dispatch_hp(input.dtype, [&](auto) {});  // the input dtype is high precision
  dispatch_fp8(out.dtype, [&](auto f) {
    constexpr Fp8Format F = decltype(f)::value;
    if (out.mode == FUS_SCALING_PER_TENSOR)
      quantize_per_tensor<F>(input, out);
    else
      quantize_mxfp8<F>(input, out);
  });
}

void amax_cpu(const fus_tensor& input, float* amax) {
  uint32_t m = 0;
  const int64_t n = input.rows * input.cols;
  if (n > 0) {
    dispatch_hp(input.dtype, [&](auto) {});
    TaskMax tm(n, min_units(1));
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
    m = max_of(tm.v);
  }
  *amax = bits_as_float(m);
}

void dequantize_cpu(const fus_quantized& in, bool columnwise, const fus_tensor& output) {
  if (output.rows * output.cols == 0) return;
  dispatch_hp(output.dtype, [&](auto) {});
  dispatch_fp8(in.dtype,
               [&](auto f) { dequantize_impl<decltype(f)::value>(in, columnwise, output); });
}

void transpose_fp8_cpu(const fus_tensor& input, const fus_tensor& output) {
  // A byte move: the dtype (E4M3 or E5M2) does not matter.
  const uint8_t* x = static_cast<const uint8_t*>(input.data);
  uint8_t* y = static_cast<uint8_t*>(output.data);
  const int64_t rows = input.rows, cols = input.cols;
  const int64_t tiles = (rows + kTile - 1) / kTile;
  parallel_ranges(tiles, min_units(kTile * cols), [&](int64_t t0, int64_t t1) {
    for (int64_t r0 = t0 * kTile; r0 < std::min(rows, t1 * kTile); r0 += kTile) {
      for (int64_t c0 = 0; c0 < cols; c0 += kTile) {
        const int64_t r1 = std::min(rows, r0 + kTile), c1 = std::min(cols, c0 + kTile);
        transpose_bytes(x + r0 * cols + c0, cols, r1 - r0, c1 - c0, y + c0 * rows + r0, rows);
      }
    }
  });
}

}  // namespace fusible
