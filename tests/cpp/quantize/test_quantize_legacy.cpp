// The CPU quantize kernels (the casts of cpp/src/common/cast_cpu.cpp, amax / dequantize of
// cpp/src/quantize/quantize_cpu.cpp: split over threads, vectorised per instruction set, casts in
// select form) against the scalar implementation they replaced, kept
// below verbatim as legacy:: (703b091): every output byte must be equal, for every instruction set
// this processor runs and 1, 2 and 3 threads, at odd sizes, every dtype, FP8 format, scaling mode
// and copy, with special values (NaN, inf, subnormal, huge) and scales that overflow or are NaN.
// Also: the casts in select form (common/cpu_rows.h) equal numerics.h's on sampled floats (every
// float with the disabled test).
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <tuple>
#include <vector>

#include "common/cpu_rows.h"
#include "common/dispatch.h"
#include "legacy_test_utils.h"
#include "quantize/quantize_impl.h"

// ---- legacy: cpp/src/quantize/quantize_cpu.cpp at 703b091, verbatim ------------------------------

namespace legacy {
using namespace fusible;
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

}  // namespace legacy

// ---- the casts in select form (common/cpu_rows.h) against numerics.h ----------------------------

namespace {

using legacy_test::CpuIsa;
using legacy_test::Runtime;
using legacy_test::Values;

constexpr fus_dtype kF32 = FUS_FLOAT32, kF16 = FUS_FLOAT16, kBF16 = FUS_BFLOAT16,
                    kE4M3 = FUS_FLOAT8_E4M3, kE5M2 = FUS_FLOAT8_E5M2;

// Compares every cast on the float with bits u; returns false on the first difference.
bool casts_agree(uint32_t u, std::string* why) {
  using namespace fusible;
  const float f = bits_as_float(u);
  const char* what = nullptr;
  if (float_to_fp8_sel<Fp8Format::kE4M3>(f) != float_to_fp8_soft<Fp8Format::kE4M3>(f))
    what = "float_to_fp8<E4M3>";
  else if (float_to_fp8_sel<Fp8Format::kE5M2>(f) != float_to_fp8_soft<Fp8Format::kE5M2>(f))
    what = "float_to_fp8<E5M2>";
  else if (float_to_bf16_sel(f) != float_to_bf16(f))
    what = "float_to_bf16";
  else if (float_to_half_sel(f) != float_to_half(f))
    what = "float_to_half";
  else
    return true;
  std::ostringstream o;
  o << what << " differs at 0x" << std::hex << u;
  *why = o.str();
  return false;
}

// Scales of the per-tensor casts, including ones that overflow, underflow, NaN and zero.
const float kScales[] = {1.0f,
                         2.0f,
                         0.375f,
                         448.0f / 3.0f,
                         1e-30f,
                         3e30f,
                         1e-45f,
                         0.0f,
                         -1.5f,
                         std::numeric_limits<float>::infinity(),
                         fusible::bits_as_float(0x7fc00000u)};

bool scale_agrees(uint32_t u, std::string* why) {
  using namespace fusible;
  const float f = bits_as_float(u);
  for (float s : kScales) {
    const float a = scale_element_sel(f, s), b = scale_element(f, s);
    if (float_as_bits(a) != float_as_bits(b)) {
      std::ostringstream o;
      o << "scale_element(0x" << std::hex << u << ", " << s << ") differs";
      *why = o.str();
      return false;
    }
  }
  return true;
}

}  // namespace

// Every high half (sign, exponent, top 7 significand bits) with low halves around every rounding
// boundary and random ones; every half-precision code for the widening.
TEST(QuantizeCpuLegacy, CastsInSelectFormEqualTheOriginals) {
  std::mt19937 g(7);
  std::vector<uint32_t> lows = {0x0000, 0x0001, 0x0fff, 0x1000, 0x1001, 0x7fff,
                                0x8000, 0x8001, 0xefff, 0xf000, 0xffff};
  for (int i = 0; i < 24; ++i) lows.push_back(g() & 0xffffu);
  std::string why;
  for (uint32_t hi = 0; hi < 0x10000u; ++hi) {
    for (uint32_t lo : lows) {
      const uint32_t u = (hi << 16) | lo;
      ASSERT_TRUE(casts_agree(u, &why)) << why;
      if (lo < 0x1000) {
        ASSERT_TRUE(scale_agrees(u, &why)) << why;
      }
    }
  }
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const float a = fusible::half_to_float_sel(static_cast<uint16_t>(h));
    const float b = fusible::half_to_float(static_cast<uint16_t>(h));
    ASSERT_EQ(fusible::float_as_bits(a), fusible::float_as_bits(b)) << "half 0x" << std::hex << h;
  }
}

// Every float (about 25 s of CPU; run with --gtest_also_run_disabled_tests; passed at the commit
// that added it).
TEST(QuantizeCpuLegacy, DISABLED_CastsInSelectFormEqualTheOriginalsOnEveryFloat) {
  std::string why;
  uint32_t u = 0;
  do {
    ASSERT_TRUE(casts_agree(u, &why)) << why;
  } while (++u != 0);
}

// ---- the kernels against legacy:: --------------------------------------------------------------

namespace {

struct Sizes {
  int64_t rows, cols;
};
// 1, primes, 2^n - 1 / 2^n + 1 around the tiles (64), MXFP8 blocks (32), runs (512) and bands
// (2048), and the README block's activation.
const Sizes kSizes[] = {{1, 1},    {1, 7},     {7, 1},    {31, 33},   {63, 65},  {64, 64},
                        {65, 127}, {127, 255}, {33, 513}, {97, 2049}, {257, 31}, {1024, 4096}};

}  // namespace

TEST(QuantizeCpuLegacy, PerTensorAndMxfp8EveryCopyDtypeAndSize) {
  uint32_t seed = 1;
  for (const Sizes& sz : kSizes) {
    for (fus_dtype in : {kF32, kBF16, kF16}) {
      for (fus_dtype fp8 : {kE4M3, kE5M2}) {
        for (fus_scaling_mode mode : {FUS_SCALING_PER_TENSOR, FUS_SCALING_MXFP8}) {
          const bool big = sz.rows * sz.cols > 100000;
          if (big && (seed % 3 != 0)) {  // the block size: a third of the combinations
            ++seed;
            continue;
          }
          const int copies = 1 + seed % 3;  // 1 row, 2 col, 3 both
          const Values v = seed % 2 ? Values::kSpecial : Values::kNormal;
          const float sc = kScales[seed % 7];
          std::mt19937 g(seed++);
          std::vector<uint8_t> x = legacy_test::random_hp(in, sz.rows * sz.cols, v, g, 3.0f);
          const fus_tensor t{x.data(), in, sz.rows, sz.cols};
          legacy_test::QuantOut want(mode, fp8, sz.rows, sz.cols, copies & 1, copies & 2, sc);
          legacy::quantize_cpu(t, want.q);
          for (CpuIsa isa : legacy_test::isas()) {
            for (int threads : {1, 2, 3}) {
              Runtime rt(isa, threads);
              legacy_test::QuantOut got(mode, fp8, sz.rows, sz.cols, copies & 1, copies & 2, sc);
              fusible::cast_cpu(t, got.q);
              EXPECT_TRUE(got.same(want))
                  << sz.rows << "x" << sz.cols << " in=" << in << " fp8=" << fp8 << " mode=" << mode
                  << " copies=" << copies << " scale=" << sc << Runtime::name(isa, threads);
            }
          }
        }
      }
    }
  }
}

TEST(QuantizeCpuLegacy, AmaxDequantizeAndTranspose) {
  uint32_t seed = 100;
  for (const Sizes& sz : kSizes) {
    const size_t n = static_cast<size_t>(sz.rows * sz.cols);
    for (fus_dtype hp : {kF32, kBF16, kF16}) {
      if (n > 100000 && hp != kF32) continue;  // the block size in fp32 only
      std::mt19937 g(seed++);
      const Values v = seed % 2 ? Values::kSpecial : Values::kNormal;
      std::vector<uint8_t> x = legacy_test::random_hp(hp, sz.rows * sz.cols, v, g, 3.0f);
      const fus_tensor t{x.data(), hp, sz.rows, sz.cols};
      // Random FP8 codes (NaNs included) with a per-tensor scale_inv and E8M0 scales.
      std::vector<uint8_t> codes(n);
      for (auto& c : codes) c = static_cast<uint8_t>(g());
      std::vector<uint8_t> rs(static_cast<size_t>(sz.rows * ((sz.cols + 31) / 32)));
      std::vector<uint8_t> cs(static_cast<size_t>(((sz.rows + 31) / 32) * sz.cols));
      for (auto& s : rs) s = static_cast<uint8_t>(g());
      for (auto& s : cs) s = static_cast<uint8_t>(g());
      float scale_inv = seed % 3 ? 0.0123f : 7.5e-39f;
      float want_amax = 0;
      legacy::amax_cpu(t, &want_amax);
      for (fus_dtype fp8 : {kE4M3, kE5M2}) {
        fus_quantized pt{};
        pt.mode = FUS_SCALING_PER_TENSOR;
        pt.dtype = fp8;
        pt.rowwise_data = codes.data();
        pt.columnwise_data = codes.data();
        pt.rowwise_scale_inv = &scale_inv;
        fus_quantized mx{};
        mx.mode = FUS_SCALING_MXFP8;
        mx.dtype = fp8;
        mx.rowwise_data = codes.data();
        mx.columnwise_data = codes.data();
        mx.rowwise_scale_inv = rs.data();
        mx.columnwise_scale_inv = cs.data();
        std::vector<std::vector<uint8_t>> want;
        for (const fus_quantized* q : {&pt, &mx})
          for (bool columnwise : {false, true}) {
            std::vector<uint8_t> y(n * fus_dtype_size(hp), 0xcd);
            legacy::dequantize_cpu(*q, columnwise, fus_tensor{y.data(), hp, sz.rows, sz.cols});
            want.push_back(std::move(y));
          }
        std::vector<uint8_t> want_t(n, 0xcd);
        legacy::transpose_fp8_cpu(fus_tensor{codes.data(), fp8, sz.rows, sz.cols},
                                  fus_tensor{want_t.data(), fp8, sz.cols, sz.rows});
        for (CpuIsa isa : legacy_test::isas()) {
          for (int threads : {1, 2, 3}) {
            Runtime rt(isa, threads);
            const std::string where = std::to_string(sz.rows) + "x" + std::to_string(sz.cols) +
                                      " hp=" + std::to_string(hp) + " fp8=" + std::to_string(fp8) +
                                      Runtime::name(isa, threads);
            float got_amax = -1.0f;
            fusible::amax_cpu(t, &got_amax);
            EXPECT_EQ(fusible::float_as_bits(want_amax), fusible::float_as_bits(got_amax)) << where;
            size_t k = 0;
            for (const fus_quantized* q : {&pt, &mx})
              for (bool columnwise : {false, true}) {
                std::vector<uint8_t> y(n * fus_dtype_size(hp), 0xcd);
                fusible::dequantize_cpu(*q, columnwise, fus_tensor{y.data(), hp, sz.rows, sz.cols});
                EXPECT_TRUE(legacy_test::same_bytes("dequantized", want[k++], y))
                    << where << " mode=" << q->mode << " columnwise=" << columnwise;
              }
            std::vector<uint8_t> got_t(n, 0xcd);
            fusible::transpose_fp8_cpu(fus_tensor{codes.data(), fp8, sz.rows, sz.cols},
                                       fus_tensor{got_t.data(), fp8, sz.cols, sz.rows});
            EXPECT_TRUE(legacy_test::same_bytes("transposed", want_t, got_t)) << where;
          }
        }
      }
    }
  }
}
