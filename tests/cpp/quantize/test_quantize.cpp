// Tests of the quantize family: the shared numerics (common/numerics.h) against an independent
// reference, the CPU backend through the C API against that reference, argument validation, and,
// where a CUDA device is present, the CUDA backend against the CPU backend bit for bit.
#include <gtest/gtest.h>

#include <array>
#include <climits>
#include <sstream>
#include <tuple>

#include "common/numerics.h"
#include "test_utils.h"

using namespace fustest;
namespace fu = fusible;

namespace {

constexpr fus_dtype kE4M3 = FUS_FLOAT8_E4M3;
constexpr fus_dtype kE5M2 = FUS_FLOAT8_E5M2;

// ---- numerics.h by runtime format ----------------------------------------------------------------

uint8_t nx_encode(float f, fus_dtype d) {
  return d == kE4M3 ? fu::float_to_fp8<fu::Fp8Format::kE4M3>(f)
                    : fu::float_to_fp8<fu::Fp8Format::kE5M2>(f);
}
uint8_t nx_encode_soft(float f, fus_dtype d) {
  return d == kE4M3 ? fu::float_to_fp8_soft<fu::Fp8Format::kE4M3>(f)
                    : fu::float_to_fp8_soft<fu::Fp8Format::kE5M2>(f);
}
float nx_decode(uint8_t q, fus_dtype d) {
  return d == kE4M3 ? fu::fp8_to_float<fu::Fp8Format::kE4M3>(q)
                    : fu::fp8_to_float<fu::Fp8Format::kE5M2>(q);
}
uint8_t nx_e8m0(float amax, fus_dtype d) {
  return d == kE4M3 ? fu::e8m0_from_amax<fu::Fp8Format::kE4M3>(amax)
                    : fu::e8m0_from_amax<fu::Fp8Format::kE5M2>(amax);
}

std::string hex(uint32_t v) {
  std::ostringstream os;
  os << "0x" << std::hex << v;
  return os.str();
}
std::string fdesc(float f) {
  std::ostringstream os;
  os.precision(9);
  os << f << " (" << hex(f2u(f)) << ")";
  return os.str();
}

int64_t ceil32(int64_t n) { return (n + FUS_MXFP8_BLOCK - 1) / FUS_MXFP8_BLOCK; }

// Expected code of a decoded value encoded again: itself, except NaN -> 0x7F | sign and, for E5M2,
// inf -> the saturated max.
uint8_t expected_reencode(uint8_t c, fus_dtype d) {
  const double v = ref::fp8_decode(c, d);
  if (std::isnan(v)) return static_cast<uint8_t>((c & 0x80) | 0x7f);
  if (std::isinf(v)) return static_cast<uint8_t>((c & 0x80) | ref::spec(d).max_code);
  return c;
}

// ---- C API plumbing ------------------------------------------------------------------------------

// Buffer slots of a quantize call.
enum QSlot { kIn = 0, kRow, kCol, kRowS, kColS, kScale, kAmax };

struct QuantizeSetup {
  fus_dtype in_dtype = FUS_FLOAT32;
  int64_t rows = 0, cols = 0;
  fus_dtype fmt = kE4M3;
  fus_scaling_mode mode = FUS_SCALING_PER_TENSOR;
  bool row = true, col = true, amax = true;
  float scale = 1.0f;
};

Buffers quantize_buffers(const HostMatrix& in, const QuantizeSetup& s) {
  Buffers b;
  const size_t n = static_cast<size_t>(s.rows * s.cols);
  b.add_bytes(in.bytes);
  b.add_filled(s.row ? n : 0);
  b.add_filled(s.col ? n : 0);
  if (s.mode == FUS_SCALING_PER_TENSOR) {
    b.add_filled(4);  // rowwise_scale_inv: float[1]
    b.add_filled(0);
    b.add(std::vector<float>{s.scale});
  } else {
    b.add_filled(s.row ? static_cast<size_t>(s.rows * ceil32(s.cols)) : 0);
    b.add_filled(s.col ? static_cast<size_t>(ceil32(s.rows) * s.cols) : 0);
    b.add_filled(0);
  }
  b.add_filled(s.amax ? 4 : 0);
  return b;
}

// margin == INT_MIN: fus_quantize; otherwise fus_quantize_current_scaling with that margin.
ApiCall quantize_call(const QuantizeSetup& s, int margin = INT_MIN) {
  return [s, margin](const std::vector<void*>& p, const fus_context& ctx) {
    fus_tensor t{p[kIn], s.in_dtype, s.rows, s.cols};
    fus_quantized q{s.mode,
                    s.fmt,
                    s.rows,
                    s.cols,
                    p[kRow],
                    p[kCol],
                    p[kRowS],
                    p[kColS],
                    static_cast<float*>(p[kScale]),
                    static_cast<float*>(p[kAmax]),
                    0,
                    0.0f};
    return margin == INT_MIN ? fus_quantize(&t, &q, &ctx)
                             : fus_quantize_current_scaling(&t, &q, margin, &ctx);
  };
}

float get_float(const Buffers& b, int slot) { return b.get<float>(slot).at(0); }

// Buffer slots of a dequantize call.
enum DSlot { kDRow = 0, kDCol, kDRowS, kDColS, kDOut };

struct DequantizeSetup {
  fus_dtype fmt = kE4M3;
  fus_scaling_mode mode = FUS_SCALING_PER_TENSOR;
  int64_t rows = 0, cols = 0;
  int columnwise = 0;
  fus_dtype out_dtype = FUS_FLOAT32;
};

ApiCall dequantize_call(const DequantizeSetup& s) {
  return [s](const std::vector<void*>& p, const fus_context& ctx) {
    fus_quantized q{s.mode,    s.fmt,     s.rows,  s.cols,  p[kDRow], p[kDCol],
                    p[kDRowS], p[kDColS], nullptr, nullptr, 0,        0.0f};
    const bool transposed = s.columnwise && s.mode == FUS_SCALING_PER_TENSOR;
    fus_tensor out{p[kDOut], s.out_dtype, transposed ? s.cols : s.rows,
                   transposed ? s.rows : s.cols};
    return fus_dequantize(&q, s.columnwise, &out, &ctx);
  };
}

// Dequantizes whatever copy `columnwise` selects out of a finished quantize run (CPU).
std::vector<float> dequantize_fp32_cpu(const Buffers& qb, const QuantizeSetup& s, int columnwise) {
  Buffers d;
  d.add_bytes(qb.b[kRow]);
  d.add_bytes(qb.b[kCol]);
  d.add_bytes(qb.b[kRowS]);
  d.add_bytes(qb.b[kColS]);
  d.add_filled(static_cast<size_t>(s.rows * s.cols) * 4);
  DequantizeSetup ds{s.fmt, s.mode, s.rows, s.cols, columnwise, FUS_FLOAT32};
  EXPECT_EQ(run_cpu(d, dequantize_call(ds)), FUS_SUCCESS) << fus_last_error();
  return d.get<float>(kDOut);
}

float max_abs(const std::vector<float>& v) {
  uint32_t m = 0;  // NaN-propagating max over |x|, like the contract
  for (float x : v) m = std::max(m, f2u(x) & 0x7fffffffu);
  return u2f(m);
}

// ---- parameter names -----------------------------------------------------------------------------

const std::vector<fus_dtype> kFormats = {kE4M3, kE5M2};
const std::vector<fus_dtype> kHpTypes = {FUS_FLOAT32, FUS_FLOAT16, FUS_BFLOAT16};

std::string shape_name(int64_t r, int64_t c) { return std::to_string(r) + "x" + std::to_string(c); }

using Shape = std::pair<int64_t, int64_t>;

// Parameters (shape, input dtype, FP8 format), named "RxC_<input>_<format>".
using ShapeTypeFormat = std::tuple<Shape, fus_dtype, fus_dtype>;
std::string ShapeTypeFormatName(const ::testing::TestParamInfo<ShapeTypeFormat>& info) {
  return shape_name(std::get<0>(info.param).first, std::get<0>(info.param).second) + "_" +
         fmt_name(std::get<1>(info.param)) + "_" + fmt_name(std::get<2>(info.param));
}

// Every shape with every high-precision input dtype and every FP8 format.
auto shapes_types_formats(const std::vector<Shape>& shapes) {
  return ::testing::Combine(::testing::ValuesIn(shapes), ::testing::ValuesIn(kHpTypes),
                            ::testing::ValuesIn(kFormats));
}

class Fp8FormatTest : public ::testing::TestWithParam<fus_dtype> {};
std::string FormatName(const ::testing::TestParamInfo<fus_dtype>& info) {
  return fmt_name(info.param);
}

// =================================================================================================
// FP8 codes: decode, encode, round trips
// =================================================================================================

TEST_P(Fp8FormatTest, DecodeAll256CodesMatchesBitFieldReference) {
  const fus_dtype d = GetParam();
  for (int c = 0; c < 256; ++c) {
    const float got = nx_decode(static_cast<uint8_t>(c), d);
    const double want = ref::fp8_decode(static_cast<uint8_t>(c), d);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << "code " << hex(c);
      EXPECT_EQ(std::signbit(got), (c & 0x80) != 0) << "NaN code " << hex(c) << " lost its sign";
    } else {
      EXPECT_EQ(f2u(got), f2u(static_cast<float>(want)))
          << "code " << hex(c) << " decoded to " << fdesc(got);
    }
  }
}

TEST_P(Fp8FormatTest, DecodeThenEncodeRoundTripsAll256Codes) {
  const fus_dtype d = GetParam();
  for (int c = 0; c < 256; ++c) {
    const float v = nx_decode(static_cast<uint8_t>(c), d);
    const uint8_t want = expected_reencode(static_cast<uint8_t>(c), d);
    EXPECT_EQ(nx_encode_soft(v, d), want) << "code " << hex(c) << " value " << fdesc(v);
    EXPECT_EQ(nx_encode(v, d), want) << "code " << hex(c) << " value " << fdesc(v);
    EXPECT_EQ(ref::fp8_encode(v, d), want) << "reference encoder, code " << hex(c);
  }
}

TEST_P(Fp8FormatTest, SpecialCodeValues) {
  const fus_dtype d = GetParam();
  if (d == kE4M3) {
    EXPECT_EQ(nx_decode(0x7e, d), 448.0f);
    EXPECT_EQ(nx_decode(0xfe, d), -448.0f);
    EXPECT_EQ(nx_decode(0x01, d), std::ldexp(1.0f, -9));  // smallest subnormal
    EXPECT_EQ(nx_decode(0x08, d), std::ldexp(1.0f, -6));  // smallest normal
    EXPECT_TRUE(std::isnan(nx_decode(0x7f, d)));
    EXPECT_TRUE(std::isnan(nx_decode(0xff, d)));
  } else {
    EXPECT_EQ(nx_decode(0x7b, d), 57344.0f);
    EXPECT_EQ(nx_decode(0x7c, d), inf());
    EXPECT_EQ(nx_decode(0xfc, d), -inf());
    EXPECT_EQ(nx_decode(0x01, d), std::ldexp(1.0f, -16));
    EXPECT_EQ(nx_decode(0x04, d), std::ldexp(1.0f, -14));
    for (int c : {0x7d, 0x7e, 0x7f, 0xfd, 0xfe, 0xff})
      EXPECT_TRUE(std::isnan(nx_decode(static_cast<uint8_t>(c), d)));
  }
  EXPECT_EQ(f2u(nx_decode(0x80, d)), 0x80000000u) << "code 0x80 is -0";
  EXPECT_EQ(nx_encode(-0.0f, d), 0x80);
  EXPECT_EQ(nx_encode(0.0f, d), 0x00);
  EXPECT_EQ(fus_fp8_max(d), static_cast<float>(ref::spec(d).max));
}

// All 256 decoded values, as fp32 / fp16 / bf16 input, through fus_quantize with scale 1: the codes
// come back (every fp8 value is exact in fp16 and bf16, so the loads must be exact too).
TEST_P(Fp8FormatTest, QuantizeApiRoundTripsAllCodesFromEachInputType) {
  const fus_dtype d = GetParam();
  std::vector<float> vals(256);
  for (int c = 0; c < 256; ++c)
    vals[c] = static_cast<float>(ref::fp8_decode(static_cast<uint8_t>(c), d));
  for (fus_dtype in_dt : kHpTypes) {
    SCOPED_TRACE(fmt_name(in_dt));
    HostMatrix in(in_dt, 1, 256, vals);
    for (int c = 0; c < 256; ++c) {
      if (!std::isnan(vals[c])) {
        ASSERT_EQ(f2u(in.values[c]), f2u(vals[c])) << "fp8 value not exact in input dtype";
      }
    }
    QuantizeSetup s{in_dt, 1, 256, d, FUS_SCALING_PER_TENSOR};
    Buffers b = quantize_buffers(in, s);
    ASSERT_EQ(run_cpu(b, quantize_call(s)), FUS_SUCCESS) << fus_last_error();
    const auto row = b.get<uint8_t>(kRow), col = b.get<uint8_t>(kCol);
    for (int c = 0; c < 256; ++c) {
      EXPECT_EQ(row[c], expected_reencode(static_cast<uint8_t>(c), d)) << "code " << hex(c);
      EXPECT_EQ(col[c], row[c]);
    }
    EXPECT_TRUE(std::isnan(get_float(b, kAmax))) << "input holds NaN codes";
    EXPECT_EQ(get_float(b, kRowS), 1.0f);
  }
}

// =================================================================================================
// Round to nearest even
// =================================================================================================

struct RneCase {
  float x;
  uint8_t want;
};

// Midpoints between every pair of adjacent finite codes (subnormal and normal ranges), the float
// just above and just below each, both signs.
std::vector<RneCase> rne_cases(fus_dtype d) {
  std::vector<RneCase> cases;
  const auto sp = ref::spec(d);
  for (int c = 0; c < sp.max_code; ++c) {
    const double lo = ref::fp8_decode(static_cast<uint8_t>(c), d);
    const double hi = ref::fp8_decode(static_cast<uint8_t>(c + 1), d);
    const double mid = (lo + hi) / 2;
    const float m = static_cast<float>(mid);
    EXPECT_EQ(static_cast<double>(m), mid) << "midpoint not exact in fp32";
    const uint8_t even = static_cast<uint8_t>((c & 1) ? c + 1 : c);
    for (int sign : {0, 0x80}) {
      const float sg = sign ? -1.0f : 1.0f;
      cases.push_back({sg * m, static_cast<uint8_t>(sign | even)});
      cases.push_back({sg * std::nextafter(m, inf()), static_cast<uint8_t>(sign | (c + 1))});
      cases.push_back({sg * std::nextafter(m, 0.0f), static_cast<uint8_t>(sign | c)});
    }
  }
  return cases;
}

TEST_P(Fp8FormatTest, MidpointsRoundToEvenNeighboursRoundAway) {
  const fus_dtype d = GetParam();
  const auto cases = rne_cases(d);
  ASSERT_EQ(cases.size(), static_cast<size_t>(ref::spec(d).max_code) * 6);
  for (const auto& k : cases) {
    EXPECT_EQ(nx_encode_soft(k.x, d), k.want) << fdesc(k.x);
    EXPECT_EQ(nx_encode(k.x, d), k.want) << fdesc(k.x);
    EXPECT_EQ(ref::fp8_encode(k.x, d), k.want) << "reference encoder: " << fdesc(k.x);
  }
  // A few by hand. E4M3: 1.0625 is between 1 (0x38) and 1.125 (0x39) -> 0x38; 1.1875 -> 1.25 (0x3a).
  // Subnormal: 2^-10 is between 0 and 2^-9 -> 0; 3 * 2^-10 -> 2 * 2^-9 (0x02).
  if (d == kE4M3) {
    EXPECT_EQ(nx_encode(1.0625f, d), 0x38);
    EXPECT_EQ(nx_encode(1.1875f, d), 0x3a);
    EXPECT_EQ(nx_encode(std::ldexp(1.0f, -10), d), 0x00);
    EXPECT_EQ(nx_encode(std::ldexp(3.0f, -10), d), 0x02);
    EXPECT_EQ(nx_encode(std::ldexp(15.0f, -10), d), 0x08);  // between 7*2^-9 (0x07) and 2^-6 (0x08)
  } else {
    EXPECT_EQ(nx_encode(1.125f, d), 0x3c);  // between 1 (0x3c) and 1.25 (0x3d)
    EXPECT_EQ(nx_encode(1.375f, d), 0x3e);
    EXPECT_EQ(nx_encode(std::ldexp(1.0f, -17), d), 0x00);
    EXPECT_EQ(nx_encode(std::ldexp(3.0f, -17), d), 0x02);
    EXPECT_EQ(nx_encode(std::ldexp(7.0f, -17), d), 0x04);  // between 3*2^-16 and 2^-14
  }
}

TEST_P(Fp8FormatTest, MidpointsThroughQuantizeApiWithScale) {
  const fus_dtype d = GetParam();
  const auto cases = rne_cases(d);
  // x * scale must be exact: inputs are the cases times 8, scale 1/8.
  std::vector<float> vals;
  for (const auto& k : cases) vals.push_back(k.x * 8.0f);
  HostMatrix in(FUS_FLOAT32, 1, static_cast<int64_t>(vals.size()), vals);
  QuantizeSetup s{FUS_FLOAT32, 1, static_cast<int64_t>(vals.size()), d, FUS_SCALING_PER_TENSOR};
  s.scale = 0.125f;
  Buffers b = quantize_buffers(in, s);
  ASSERT_EQ(run_cpu(b, quantize_call(s)), FUS_SUCCESS) << fus_last_error();
  const auto row = b.get<uint8_t>(kRow);
  for (size_t i = 0; i < cases.size(); ++i) EXPECT_EQ(row[i], cases[i].want) << fdesc(cases[i].x);
  EXPECT_EQ(get_float(b, kRowS), 8.0f);
}

// =================================================================================================
// Saturation and NaN
// =================================================================================================

TEST_P(Fp8FormatTest, SaturatesToMaxCode) {
  const fus_dtype d = GetParam();
  const uint8_t mc = ref::spec(d).max_code;
  std::vector<float> big;
  if (d == kE4M3) {
    big = {448.0f,
           std::nextafter(448.0f, inf()),
           449.0f,
           464.0f,
           std::nextafter(464.0f, inf()),
           480.0f,
           500.0f,
           1e6f,
           1e30f,
           FLT_MAX,
           inf()};
    EXPECT_EQ(nx_encode(std::nextafter(448.0f, 0.0f), d), 0x7e);
    EXPECT_EQ(nx_encode(432.0f, d), 0x7e);  // tie 416 (0x7d) / 448 (0x7e) -> even 448
    EXPECT_EQ(nx_encode(std::nextafter(432.0f, 0.0f), d), 0x7d);
    EXPECT_EQ(nx_encode(416.0f, d), 0x7d);
  } else {
    big = {57344.0f,
           std::nextafter(57344.0f, inf()),
           57345.0f,
           61440.0f,
           std::nextafter(61440.0f, inf()),
           65536.0f,
           1e6f,
           1e30f,
           FLT_MAX,
           inf()};
    EXPECT_EQ(nx_encode(std::nextafter(57344.0f, 0.0f), d), 0x7b);
    EXPECT_EQ(nx_encode(49152.0f, d), 0x7a);
    EXPECT_EQ(nx_encode(53248.0f, d), 0x7a);  // tie 49152 / 57344 -> even 0x7a
  }
  for (float x : big) {
    EXPECT_EQ(nx_encode_soft(x, d), mc) << fdesc(x);
    EXPECT_EQ(nx_encode(x, d), mc) << fdesc(x);
    EXPECT_EQ(nx_encode_soft(-x, d), mc | 0x80) << fdesc(-x);
    EXPECT_EQ(nx_encode(-x, d), mc | 0x80) << fdesc(-x);
  }
  // Through the API, with and without a scale that pushes finite values out of range.
  std::vector<float> vals = big;
  for (float x : big) vals.push_back(-x);
  HostMatrix in(FUS_FLOAT32, 1, static_cast<int64_t>(vals.size()), vals);
  QuantizeSetup s{FUS_FLOAT32, 1, static_cast<int64_t>(vals.size()), d, FUS_SCALING_PER_TENSOR};
  for (float scale : {1.0f, 1e6f, FLT_MAX}) {
    s.scale = scale;
    Buffers b = quantize_buffers(in, s);
    ASSERT_EQ(run_cpu(b, quantize_call(s)), FUS_SUCCESS) << fus_last_error();
    const auto row = b.get<uint8_t>(kRow);
    for (size_t i = 0; i < vals.size(); ++i)
      EXPECT_EQ(row[i], vals[i] < 0 ? (mc | 0x80) : mc) << fdesc(vals[i]) << " scale " << scale;
    EXPECT_EQ(get_float(b, kAmax), inf());
  }
}

TEST_P(Fp8FormatTest, NanEncodesAs7FWithSign) {
  const fus_dtype d = GetParam();
  const uint32_t nans[] = {0x7fc00000u, 0x7f800001u, 0x7fa00000u, 0x7fffffffu, 0x7f812345u};
  for (uint32_t u : nans) {
    for (uint32_t sign : {0u, 0x80000000u}) {
      const float x = u2f(u | sign);
      const uint8_t want = sign ? 0xff : 0x7f;
      EXPECT_EQ(nx_encode_soft(x, d), want) << hex(u | sign);
      EXPECT_EQ(nx_encode(x, d), want) << hex(u | sign);
    }
  }
  // Through the API: NaN * scale keeps x's sign, and amax is NaN wherever the NaN sits.
  for (float scale : {1.0f, 3.5f}) {
    for (int pos : {0, 5, 9}) {
      std::vector<float> vals = {1.0f, -2.0f, inf(), -inf(), 448.0f,
                                 0.5f, -0.0f, 3.0f,  1e-3f,  -7.0f};
      vals[pos] = qnan(pos == 5);
      vals.push_back(qnan(pos != 5));
      HostMatrix in(FUS_FLOAT32, 1, static_cast<int64_t>(vals.size()), vals);
      QuantizeSetup s{FUS_FLOAT32, 1, static_cast<int64_t>(vals.size()), d, FUS_SCALING_PER_TENSOR};
      s.scale = scale;
      Buffers b = quantize_buffers(in, s);
      ASSERT_EQ(run_cpu(b, quantize_call(s)), FUS_SUCCESS) << fus_last_error();
      const auto row = b.get<uint8_t>(kRow);
      EXPECT_EQ(row[pos], pos == 5 ? 0xff : 0x7f);
      EXPECT_EQ(row.back(), pos != 5 ? 0xff : 0x7f);
      EXPECT_TRUE(std::isnan(get_float(b, kAmax))) << "amax over input with a NaN";
      float amax = 0.0f;
      const fus_context ctx = cpu_ctx();
      fus_tensor t = in.tensor();
      ASSERT_EQ(fus_compute_amax(&t, &amax, &ctx), FUS_SUCCESS);
      EXPECT_TRUE(std::isnan(amax)) << "fus_compute_amax over input with a NaN";
    }
  }
}

// fp16 / bf16 NaN inputs load as NaN and keep their sign through the cast.
TEST_P(Fp8FormatTest, HalfAndBf16NanAndInfInputs) {
  const fus_dtype d = GetParam();
  for (fus_dtype in_dt : {FUS_FLOAT16, FUS_BFLOAT16}) {
    SCOPED_TRACE(fmt_name(in_dt));
    const std::vector<float> vals = {qnan(false), qnan(true), inf(), -inf(), 1.0f};
    HostMatrix in(in_dt, 1, 5, vals);
    QuantizeSetup s{in_dt, 1, 5, d, FUS_SCALING_PER_TENSOR};
    Buffers b = quantize_buffers(in, s);
    ASSERT_EQ(run_cpu(b, quantize_call(s)), FUS_SUCCESS) << fus_last_error();
    const auto row = b.get<uint8_t>(kRow);
    const uint8_t mc = ref::spec(d).max_code;
    EXPECT_EQ(row[0], 0x7f);
    EXPECT_EQ(row[1], 0xff);
    EXPECT_EQ(row[2], mc);
    EXPECT_EQ(row[3], mc | 0x80);
    EXPECT_EQ(row[4], ref::fp8_encode(1.0f, d));
    EXPECT_TRUE(std::isnan(get_float(b, kAmax)));
  }
}

// x * s before a cast (numerics.h scale_element): a NaN x keeps its sign (and bits), otherwise a NaN
// s gives +NaN, otherwise the plain fp32 product.
TEST(ScaleElement, NanRuleAndPlainProduct) {
  const float nan_s[] = {qnan(false), qnan(true), u2f(0x7f800001u), u2f(0xffa00000u)};
  for (float s : nan_s) {
    for (float x : {1.0f, -1.0f, 0.0f, -0.0f, inf(), -inf(), 448.0f, -1e-40f}) {
      EXPECT_EQ(f2u(fu::scale_element(x, s)), 0x7fc00000u) << fdesc(x) << " * " << fdesc(s);
      EXPECT_EQ(nx_encode(fu::scale_element(x, s), kE4M3), 0x7f);
    }
    for (float x : nan_s) {
      EXPECT_EQ(f2u(fu::scale_element(x, s)), f2u(x))
          << "NaN x wins: " << fdesc(x) << " * " << fdesc(s);
      EXPECT_EQ(nx_encode(fu::scale_element(x, s), kE5M2), std::signbit(x) ? 0xff : 0x7f);
    }
  }
  for (float x : nan_s)
    for (float s : {1.0f, -2.0f, 0.0f, inf()})
      EXPECT_EQ(f2u(fu::scale_element(x, s)), f2u(x)) << fdesc(x);
  for (float x : {1.5f, -3.0f, 1e-30f, 3e38f})
    for (float s : {0.375f, -2.0f, 1e10f, 0.0f})
      EXPECT_EQ(f2u(fu::scale_element(x, s)), f2u(x * s));
  EXPECT_TRUE(std::isnan(fu::scale_element(inf(), 0.0f)));
}

// =================================================================================================
// Every 251st fp32 bit pattern: the encoder against the reference (CPU), through the API
// =================================================================================================

std::vector<float> float_pattern_sample(uint32_t stride) {
  std::vector<float> v;
  v.reserve(static_cast<size_t>((uint64_t{1} << 32) / stride + 1));
  for (uint64_t u = 0; u <= 0xffffffffull; u += stride) v.push_back(u2f(static_cast<uint32_t>(u)));
  return v;
}

TEST(Fp8Sample, EncoderMatchesReferenceOnEvery251stFloatPattern) {
  const std::vector<float> sample = float_pattern_sample(251);
  for (fus_dtype d : kFormats) {
    SCOPED_TRACE(fmt_name(d));
    int bad = 0;
    for (float x : sample) {
      const uint8_t want = ref::fp8_encode(x, d);
      const uint8_t got = nx_encode_soft(x, d);
      if (got != want && ++bad <= 10)
        ADD_FAILURE() << fdesc(x) << ": got " << hex(got) << " want " << hex(want);
    }
    EXPECT_EQ(bad, 0);
  }
}

TEST(Fp8Sample, QuantizeApiMatchesReferenceOnEvery251stFloatPattern) {
  const std::vector<float> sample = float_pattern_sample(251);
  const int64_t n = static_cast<int64_t>(sample.size());
  HostMatrix in(FUS_FLOAT32, 1, n, sample);
  for (fus_dtype d : kFormats) {
    SCOPED_TRACE(fmt_name(d));
    QuantizeSetup s{FUS_FLOAT32, 1, n, d, FUS_SCALING_PER_TENSOR};
    s.col = false;
    Buffers b = quantize_buffers(in, s);
    ASSERT_EQ(run_cpu(b, quantize_call(s)), FUS_SUCCESS) << fus_last_error();
    const auto row = b.get<uint8_t>(kRow);
    int bad = 0;
    for (int64_t i = 0; i < n; ++i) {
      const uint8_t want = ref::fp8_encode(sample[i], d);
      if (row[i] != want && ++bad <= 10)
        ADD_FAILURE() << fdesc(sample[i]) << ": got " << hex(row[i]) << " want " << hex(want);
    }
    EXPECT_EQ(bad, 0);
    EXPECT_TRUE(std::isnan(get_float(b, kAmax)));
  }
}

// =================================================================================================
// fp16 and bf16 conversions
// =================================================================================================

// A float and the 16-bit code it rounds to.
struct Encode16 {
  float x;
  uint16_t want;
};

// enc (the library's encoding) and ref_enc (the reference) give k.want for every k.x, and enc
// the code with the sign bit flipped for -k.x.
template <size_t N, typename Enc, typename RefEnc>
void expect_encodes(const Encode16 (&ks)[N], Enc enc, RefEnc ref_enc) {
  for (const auto& k : ks) {
    EXPECT_EQ(enc(k.x), k.want) << fdesc(k.x);
    EXPECT_EQ(ref_enc(k.x), k.want) << "reference: " << fdesc(k.x);
    EXPECT_EQ(enc(-k.x), k.want ^ 0x8000u) << fdesc(-k.x);
  }
}

TEST(Half, DecodeAll65536CodesMatchesReference) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float got = fu::half_to_float(static_cast<uint16_t>(h));
    const double want = ref::half_decode(static_cast<uint16_t>(h));
    if (std::isnan(want)) {
      // NaN keeps sign and payload: sign | 0x7f800000 | mantissa << 13
      EXPECT_EQ(f2u(got), ((h & 0x8000u) << 16) | 0x7f800000u | ((h & 0x3ffu) << 13)) << hex(h);
    } else {
      ASSERT_EQ(f2u(got), f2u(static_cast<float>(want))) << hex(h);
    }
#if defined(__FLT16_MAX__)
    _Float16 hf;
    const uint16_t hb = static_cast<uint16_t>(h);
    std::memcpy(&hf, &hb, 2);
    if (!std::isnan(want)) {
      ASSERT_EQ(f2u(static_cast<float>(hf)), f2u(got)) << "vs compiler _Float16, " << hex(h);
    }
#endif
  }
}

TEST(Half, RoundTripsAll65536Codes) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const uint16_t back = fu::float_to_half(fu::half_to_float(static_cast<uint16_t>(h)));
    const bool is_nan = (h & 0x7c00u) == 0x7c00u && (h & 0x3ffu) != 0;
    if (is_nan) {
      EXPECT_EQ(back, h | 0x0200u)
          << "NaN " << hex(h) << " should stay NaN (quieted, same sign/payload)";
    } else {
      ASSERT_EQ(back, h) << hex(h);
    }
  }
}

TEST(Half, EncodeRoundsToNearestEven) {
  const Encode16 ks[] = {
      {1.0f + std::ldexp(1.0f, -11), 0x3c00},  // tie -> even 1.0
      {1.0f + std::ldexp(3.0f, -11), 0x3c02},  // tie -> even 0x3c02
      {std::nextafter(1.0f + std::ldexp(1.0f, -11), 2.0f), 0x3c01},
      {std::nextafter(1.0f + std::ldexp(3.0f, -11), 0.0f), 0x3c01},
      {65504.0f, 0x7bff},
      {std::nextafter(65520.0f, 0.0f), 0x7bff},
      {65520.0f, 0x7c00},  // tie between 65504 and 2^16 -> even -> inf
      {1e6f, 0x7c00},
      {FLT_MAX, 0x7c00},
      {inf(), 0x7c00},
      {std::ldexp(1.0f, -25), 0x0000},  // tie 0 / smallest subnormal -> 0
      {std::nextafter(std::ldexp(1.0f, -25), 1.0f), 0x0001},
      {std::ldexp(3.0f, -25), 0x0002},
      {std::ldexp(2047.0f, -25), 0x0400},  // tie largest subnormal / smallest normal -> even
      {std::ldexp(1.0f, -14), 0x0400},
      {1e-30f, 0x0000},
      {-1e-30f, 0x8000},
      {-0.0f, 0x8000},
  };
  expect_encodes(
      ks, [](float x) { return fu::float_to_half(x); },
      [](float x) { return ref::half_encode(x); });
  EXPECT_EQ(fu::float_to_half(qnan(false)) & 0xfe00u, 0x7e00u);
  EXPECT_EQ(fu::float_to_half(qnan(true)) & 0xfe00u, 0xfe00u);
}

TEST(Half, EncodeMatchesReferenceOnEvery251stFloatPattern) {
  int bad = 0;
  for (uint64_t u = 0; u <= 0xffffffffull; u += 251) {
    const float x = u2f(static_cast<uint32_t>(u));
    const uint16_t got = fu::float_to_half(x);
    if (std::isnan(x)) {
      if ((got & 0x7c00u) != 0x7c00u || (got & 0x3ffu) == 0 || ((got >> 15) != (u >> 31))) {
        if (++bad <= 10) ADD_FAILURE() << "NaN " << fdesc(x) << " -> " << hex(got);
      }
      continue;
    }
    uint16_t want = ref::half_encode(x);
#if defined(__FLT16_MAX__)
    const _Float16 hf = static_cast<_Float16>(x);
    uint16_t hb;
    std::memcpy(&hb, &hf, 2);
    EXPECT_EQ(hb, want) << "reference vs compiler _Float16 disagree on " << fdesc(x);
#endif
    if (got != want && ++bad <= 10)
      ADD_FAILURE() << fdesc(x) << ": got " << hex(got) << " want " << hex(want);
  }
  EXPECT_EQ(bad, 0);
}

TEST(Bf16, DecodeAndRoundTripAll65536Codes) {
  for (uint32_t b = 0; b < 65536; ++b) {
    const float f = fu::bf16_to_float(static_cast<uint16_t>(b));
    ASSERT_EQ(f2u(f), b << 16);
    const uint16_t back = fu::float_to_bf16(f);
    if (std::isnan(f))
      EXPECT_EQ(back, b | 0x40u) << "NaN " << hex(b) << " quieted, sign and payload kept";
    else
      ASSERT_EQ(back, b) << hex(b);
  }
}

TEST(Bf16, EncodeRoundsToNearestEven) {
  const Encode16 ks[] = {
      {1.0f + std::ldexp(1.0f, -8), 0x3f80},  // tie -> even
      {1.0f + std::ldexp(3.0f, -8), 0x3f82},  // tie -> even
      {std::nextafter(1.0f + std::ldexp(1.0f, -8), 2.0f), 0x3f81},
      {std::nextafter(1.0f + std::ldexp(3.0f, -8), 0.0f), 0x3f81},
      {u2f(0x7f7f0000u), 0x7f7f},  // largest bf16
      {u2f(0x7f7f7fffu), 0x7f7f},
      {u2f(0x7f7f8000u), 0x7f80},  // tie above the largest bf16 -> inf
      {FLT_MAX, 0x7f80},
      {inf(), 0x7f80},
      {u2f(0x00008000u), 0x0000},  // subnormal tie -> even 0
      {u2f(0x00018000u), 0x0002},
      {u2f(0x00008001u), 0x0001},
      {u2f(0x007fffffu), 0x0080},  // largest subnormal rounds up to the smallest normal
      {-0.0f, 0x8000},
  };
  expect_encodes(
      ks, [](float x) { return fu::float_to_bf16(x); },
      [](float x) { return ref::bf16_encode(x); });
  EXPECT_EQ(fu::float_to_bf16(qnan(false)), 0x7fc0);
  EXPECT_EQ(fu::float_to_bf16(qnan(true)), 0xffc0);
  EXPECT_EQ(fu::float_to_bf16(u2f(0x7f800001u)) & 0xffc0u, 0x7fc0u)
      << "signalling NaN must not become inf";
  int bad = 0;
  for (uint64_t u = 0; u <= 0xffffffffull; u += 251) {
    const float x = u2f(static_cast<uint32_t>(u));
    if (std::isnan(x)) continue;
    const uint16_t got = fu::float_to_bf16(x), want = ref::bf16_encode(x);
    if (got != want && ++bad <= 10)
      ADD_FAILURE() << fdesc(x) << ": got " << hex(got) << " want " << hex(want);
  }
  EXPECT_EQ(bad, 0);
}

// =================================================================================================
// Per-tensor quantize with a transposed copy
// =================================================================================================

using PerTensorParam = ShapeTypeFormat;
class PerTensorTest : public ::testing::TestWithParam<PerTensorParam> {};

TEST_P(PerTensorTest, RowwiseMatchesReferenceAndColumnwiseIsItsTranspose) {
  const auto [shape, in_dt, fmt] = GetParam();
  const auto [rows, cols] = shape;
  const size_t n = static_cast<size_t>(rows * cols);
  HostMatrix in(in_dt, rows, cols, random_values(n, static_cast<uint32_t>(rows * 7919 + cols)));
  const float amax_ref = max_abs(in.values);
  const float fmax = fus_fp8_max(fmt);
  // In range, saturating (scale 4x too large), and a scale that is not a power of two.
  const float base = amax_ref > 0 ? fmax / amax_ref : 1.0f;
  for (float scale : {base * 0.75f, base * 4.0f, 0.3f}) {
    SCOPED_TRACE("scale " + fdesc(scale));
    QuantizeSetup s{in_dt, rows, cols, fmt, FUS_SCALING_PER_TENSOR};
    s.scale = scale;
    Buffers b = quantize_buffers(in, s);
    ASSERT_EQ(run_cpu(b, quantize_call(s)), FUS_SUCCESS) << fus_last_error();
    const auto row = b.get<uint8_t>(kRow), col = b.get<uint8_t>(kCol);
    int bad = 0;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) {
        const size_t i = static_cast<size_t>(r * cols + c);
        const uint8_t want = ref::fp8_encode(in.values[i] * scale, fmt);
        if (row[i] != want && ++bad <= 10)
          ADD_FAILURE() << "rowwise[" << r << "," << c << "] x=" << fdesc(in.values[i]) << " got "
                        << hex(row[i]) << " want " << hex(want);
        if (col[static_cast<size_t>(c * rows + r)] != row[i] && ++bad <= 10)
          ADD_FAILURE() << "columnwise[" << c << "," << r << "] != rowwise[" << r << "," << c
                        << "]";
      }
    }
    EXPECT_EQ(bad, 0);
    EXPECT_EQ(f2u(get_float(b, kRowS)), f2u(1.0f / scale)) << "scale_inv == 1 / scale";
    EXPECT_EQ(f2u(get_float(b, kScale)), f2u(scale)) << "fus_quantize must not change out->scale";
    EXPECT_EQ(f2u(get_float(b, kAmax)), f2u(amax_ref)) << "amax";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, PerTensorTest,
    shapes_types_formats(
        {{1, 1}, {7, 13}, {127, 33}, {1, 4097}, {4097, 1}, {65, 129}, {0, 9}, {9, 0}}),
    ShapeTypeFormatName);

TEST(PerTensor, OnlyOneCopyRequestedAndAmaxOptional) {
  const int64_t rows = 19, cols = 70;
  HostMatrix in(FUS_FLOAT32, rows, cols, random_values(rows * cols, 5, -8, 4));
  for (fus_dtype fmt : kFormats) {
    QuantizeSetup both{FUS_FLOAT32, rows, cols, fmt, FUS_SCALING_PER_TENSOR};
    both.scale = 2.5f;
    Buffers full = quantize_buffers(in, both);
    ASSERT_EQ(run_cpu(full, quantize_call(both)), FUS_SUCCESS);

    QuantizeSetup only_row = both;
    only_row.col = false;
    only_row.amax = false;
    Buffers br = quantize_buffers(in, only_row);
    ASSERT_EQ(run_cpu(br, quantize_call(only_row)), FUS_SUCCESS) << fus_last_error();
    EXPECT_EQ(br.b[kRow], full.b[kRow]);
    EXPECT_EQ(get_float(br, kRowS), 0.4f);

    QuantizeSetup only_col = both;
    only_col.row = false;
    Buffers bc = quantize_buffers(in, only_col);
    ASSERT_EQ(run_cpu(bc, quantize_call(only_col)), FUS_SUCCESS) << fus_last_error();
    EXPECT_EQ(bc.b[kCol], full.b[kCol]);
    EXPECT_EQ(get_float(bc, kRowS), 0.4f);
    EXPECT_EQ(get_float(bc, kAmax), get_float(full, kAmax));
  }
}

TEST(PerTensor, EmptyInputWithNullData) {
  for (auto [rows, cols] : {std::pair<int64_t, int64_t>{0, 5}, {5, 0}, {0, 0}}) {
    float scale = 4.0f, scale_inv = -1.0f, amax = -1.0f;
    fus_tensor t{nullptr, FUS_FLOAT32, rows, cols};
    fus_quantized q =
        per_tensor_out(kE4M3, rows, cols, nullptr, nullptr, &scale_inv, &scale, &amax);
    const fus_context ctx = cpu_ctx();
    ASSERT_EQ(fus_quantize(&t, &q, &ctx), FUS_SUCCESS) << fus_last_error();
    EXPECT_EQ(amax, 0.0f);
    EXPECT_EQ(scale_inv, 0.25f);
    amax = -1.0f;
    ASSERT_EQ(fus_compute_amax(&t, &amax, &ctx), FUS_SUCCESS);
    EXPECT_EQ(amax, 0.0f);
    ASSERT_EQ(fus_quantize_current_scaling(&t, &q, 0, &ctx), FUS_SUCCESS) << fus_last_error();
    EXPECT_EQ(amax, 0.0f);
    EXPECT_EQ(scale, 1.0f) << "current scaling of an empty tensor: amax 0 -> scale 1";
    EXPECT_EQ(scale_inv, 1.0f);
    fus_tensor out{nullptr, FUS_FLOAT32, rows, cols};
    EXPECT_EQ(fus_dequantize(&q, 0, &out, &ctx), FUS_SUCCESS) << fus_last_error();
    q.mode = FUS_SCALING_MXFP8;
    EXPECT_EQ(fus_quantize(&t, &q, &ctx), FUS_SUCCESS) << fus_last_error();
  }
}

TEST(PerTensor, DequantizeErrorWithinHalfStep) {
  const int64_t rows = 77, cols = 301;
  HostMatrix in(FUS_FLOAT32, rows, cols, random_values(rows * cols, 99, -6, 6));
  for (fus_dtype fmt : kFormats) {
    SCOPED_TRACE(fmt_name(fmt));
    const auto sp = ref::spec(fmt);
    QuantizeSetup s{FUS_FLOAT32, rows, cols, fmt, FUS_SCALING_PER_TENSOR};
    Buffers b = quantize_buffers(in, s);
    ASSERT_EQ(run_cpu(b, quantize_call(s, 0)), FUS_SUCCESS) << fus_last_error();
    const float scale_inv = get_float(b, kRowS);
    for (int cw : {0, 1}) {
      const auto y = dequantize_fp32_cpu(b, s, cw);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) {
          const double x = in.values[r * cols + c];
          const double yy = cw ? y[c * rows + r] : y[r * cols + c];
          // half an ulp relative in the normal range, half the subnormal quantum below it; plus slack
          // for the two fp32 roundings (x * scale, q * scale_inv).
          const double bound =
              std::ldexp(std::fabs(x), -(sp.mant + 1)) * (1 + 1e-6) +
              std::ldexp(static_cast<double>(scale_inv), -sp.bias - sp.mant) * (1 + 1e-6);
          ASSERT_LE(std::fabs(yy - x), bound)
              << "x=" << x << " y=" << yy << " at " << r << "," << c;
        }
      }
    }
  }
}

// =================================================================================================
// Current scaling
// =================================================================================================

using CurrentParam = std::tuple<fus_dtype, fus_dtype, int>;
class CurrentScalingTest : public ::testing::TestWithParam<CurrentParam> {};

TEST_P(CurrentScalingTest, ScaleIsFp8MaxOverAmaxTimesTwoToMinusMargin) {
  const auto [in_dt, fmt, margin] = GetParam();
  const int64_t rows = 45, cols = 77;
  HostMatrix in(in_dt, rows, cols, random_values(rows * cols, 1234 + margin, -10, 10));
  QuantizeSetup s{in_dt, rows, cols, fmt, FUS_SCALING_PER_TENSOR};
  s.scale = -123.0f;  // ignored on input, overwritten
  Buffers b = quantize_buffers(in, s);
  ASSERT_EQ(run_cpu(b, quantize_call(s, margin)), FUS_SUCCESS) << fus_last_error();
  const float amax = max_abs(in.values);
  const float fmax = fus_fp8_max(fmt);
  const float want_scale =
      static_cast<float>(std::ldexp(static_cast<double>(fmax / amax), -margin));
  EXPECT_EQ(f2u(get_float(b, kAmax)), f2u(amax));
  EXPECT_EQ(f2u(get_float(b, kScale)), f2u(want_scale));
  EXPECT_EQ(f2u(get_float(b, kScale)), f2u(ref::scale_from_amax(amax, fmax, margin, 1.0f)));
  EXPECT_EQ(f2u(get_float(b, kRowS)), f2u(1.0f / want_scale));
  const auto row = b.get<uint8_t>(kRow), col = b.get<uint8_t>(kCol);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      ASSERT_EQ(row[r * cols + c], ref::fp8_encode(in.values[r * cols + c] * want_scale, fmt))
          << r << "," << c;
      ASSERT_EQ(col[c * rows + r], row[r * cols + c]);
    }
  // The largest element lands at fp8_max * 2^-margin (or one rounding step of it).
  if (margin >= 0) {
    const float top =
        static_cast<float>(ref::fp8_decode(ref::fp8_encode(amax * want_scale, fmt), fmt));
    EXPECT_LE(top, fmax);
  }
}

INSTANTIATE_TEST_SUITE_P(Margins, CurrentScalingTest,
                         ::testing::Combine(::testing::ValuesIn(kHpTypes),
                                            ::testing::ValuesIn(kFormats),
                                            ::testing::Values(0, 2, -1)),
                         [](const ::testing::TestParamInfo<CurrentParam>& info) {
                           const int m = std::get<2>(info.param);
                           return std::string(fmt_name(std::get<0>(info.param))) + "_" +
                                  fmt_name(std::get<1>(info.param)) + "_margin" +
                                  (m < 0 ? "M" : "") + std::to_string(std::abs(m));
                         });

// Runs current scaling on vals (1 row, fp32) and returns the buffers.
Buffers current_scaling_cpu(const std::vector<float>& vals, fus_dtype fmt, int margin) {
  HostMatrix in(FUS_FLOAT32, 1, static_cast<int64_t>(vals.size()), vals);
  QuantizeSetup s{FUS_FLOAT32, 1, static_cast<int64_t>(vals.size()), fmt, FUS_SCALING_PER_TENSOR};
  s.scale = 77.0f;
  Buffers b = quantize_buffers(in, s);
  EXPECT_EQ(run_cpu(b, quantize_call(s, margin)), FUS_SUCCESS) << fus_last_error();
  return b;
}

TEST(CurrentScaling, AmaxZeroGivesScaleOne) {
  for (fus_dtype fmt : kFormats) {
    Buffers b = current_scaling_cpu({0.0f, -0.0f, 0.0f}, fmt, 0);
    EXPECT_EQ(f2u(get_float(b, kAmax)), 0u);
    EXPECT_EQ(get_float(b, kScale), 1.0f);
    EXPECT_EQ(get_float(b, kRowS), 1.0f);
    EXPECT_EQ(b.get<uint8_t>(kRow), (std::vector<uint8_t>{0x00, 0x80, 0x00}));
  }
}

TEST(CurrentScaling, AmaxInfOrNanGivesScaleOne) {
  for (fus_dtype fmt : kFormats) {
    for (int margin : {0, 3}) {
      Buffers b = current_scaling_cpu({1.0f, -inf(), 0.5f}, fmt, margin);
      EXPECT_EQ(get_float(b, kAmax), inf());
      EXPECT_EQ(get_float(b, kScale), 1.0f) << "amax inf must not give scale 0";
      EXPECT_EQ(get_float(b, kRowS), 1.0f);
      const auto row = b.get<uint8_t>(kRow);
      EXPECT_EQ(row[0], ref::fp8_encode(1.0f, fmt));
      EXPECT_EQ(row[1], ref::spec(fmt).max_code | 0x80);
      EXPECT_EQ(row[2], ref::fp8_encode(0.5f, fmt));

      Buffers bn = current_scaling_cpu({1.0f, qnan(true), inf()}, fmt, margin);
      EXPECT_TRUE(std::isnan(get_float(bn, kAmax)));
      EXPECT_EQ(get_float(bn, kScale), 1.0f) << "amax NaN must not give a NaN scale";
      EXPECT_EQ(get_float(bn, kRowS), 1.0f);
      EXPECT_EQ(bn.get<uint8_t>(kRow)[1], 0xff);
    }
  }
}

TEST(CurrentScaling, TinySubnormalAmaxGivesFltMaxNotInf) {
  for (fus_dtype fmt : kFormats) {
    for (int margin : {0, 2}) {
      for (float tiny : {u2f(1), u2f(0x00000100u), u2f(0x007fffffu), 1e-38f / 4}) {
        Buffers b = current_scaling_cpu({tiny, -tiny / 2, 0.0f}, fmt, margin);
        EXPECT_EQ(f2u(get_float(b, kAmax)), f2u(tiny));
        const float scale = get_float(b, kScale);
        EXPECT_EQ(scale, FLT_MAX) << "amax " << fdesc(tiny) << " margin " << margin;
        EXPECT_EQ(f2u(get_float(b, kRowS)), f2u(1.0f / FLT_MAX));
        const auto row = b.get<uint8_t>(kRow);
        EXPECT_EQ(row[0], ref::fp8_encode(tiny * FLT_MAX, fmt));
      }
    }
  }
}

TEST(CurrentScaling, HugeAmax) {
  for (fus_dtype fmt : kFormats) {
    Buffers b = current_scaling_cpu({FLT_MAX, -1.0f}, fmt, 0);
    const float want = fus_fp8_max(fmt) / FLT_MAX;
    EXPECT_EQ(f2u(get_float(b, kScale)), f2u(want));
    EXPECT_EQ(b.get<uint8_t>(kRow)[0], ref::fp8_encode(FLT_MAX * want, fmt));
  }
}

// =================================================================================================
// MXFP8: E8M0 scale choice
// =================================================================================================

TEST_P(Fp8FormatTest, E8m0AtPowerOfTwoBoundaries) {
  const fus_dtype d = GetParam();
  const int emax = ref::spec(d).emax;
  auto expect_byte = [](int e) {
    return static_cast<uint8_t>(std::min(254, std::max(0, e + 127)));
  };
  for (int k = -149; k <= 127; ++k) {
    const float p = std::ldexp(1.0f, k);
    ASSERT_NE(p, 0.0f);
    EXPECT_EQ(nx_e8m0(p, d), expect_byte(k - emax)) << "amax 2^" << k;
    EXPECT_EQ(nx_e8m0(std::nextafter(p, inf()), d), expect_byte(k - emax)) << "just above 2^" << k;
    EXPECT_EQ(nx_e8m0(p * 1.75f, d), expect_byte(k - emax)) << "1.75 * 2^" << k;
    if (k > -149) {
      EXPECT_EQ(nx_e8m0(std::nextafter(p, 0.0f), d), expect_byte(k - 1 - emax))
          << "just below 2^" << k;
    }
    EXPECT_EQ(ref::e8m0_from_amax(p, d), expect_byte(k - emax));
  }
}

TEST_P(Fp8FormatTest, E8m0SpecialAmax) {
  const fus_dtype d = GetParam();
  const int emax = ref::spec(d).emax;
  EXPECT_EQ(nx_e8m0(0.0f, d), 0) << "amax 0 -> 2^-127";
  EXPECT_EQ(nx_e8m0(-0.0f, d), 0);
  EXPECT_EQ(nx_e8m0(qnan(false), d), 0xff);
  EXPECT_EQ(nx_e8m0(qnan(true), d), 0xff);
  EXPECT_EQ(nx_e8m0(inf(), d), 0xff);
  EXPECT_EQ(nx_e8m0(-inf(), d), 0xff);
  EXPECT_EQ(nx_e8m0(u2f(1), d), 0) << "smallest denormal clamps to 0";
  EXPECT_EQ(nx_e8m0(std::ldexp(1.0f, -130), d), 0) << "denormal amax clamps to 0";
  // The lowest exponent that needs no clamp: floor(log2 amax) - emax == -127.
  EXPECT_EQ(nx_e8m0(std::ldexp(1.0f, emax - 127), d), 0);
  EXPECT_EQ(nx_e8m0(std::ldexp(1.0f, emax - 126), d), 1);
  EXPECT_EQ(nx_e8m0(std::ldexp(1.0f, emax - 128), d), 0) << "one below: clamped to 0";
  // The largest finite amax: floor(log2 FLT_MAX) = 127, so byte 127 - emax + 127; the clamp at 254
  // cannot be reached from a finite fp32 amax.
  EXPECT_EQ(nx_e8m0(FLT_MAX, d), 254 - emax);
  EXPECT_EQ(nx_e8m0(1.0f, d), 127 - emax);
  EXPECT_EQ(nx_e8m0(static_cast<float>(ref::spec(d).max), d), 127) << "fp8 max needs no scaling";
}

TEST(E8m0, ValueAndInverseOfAll256Bytes) {
  for (int s = 0; s < 256; ++s) {
    const float v = fu::e8m0_to_float(static_cast<uint8_t>(s));
    const float m = fu::e8m0_inverse(static_cast<uint8_t>(s));
    if (s == 255) {
      EXPECT_TRUE(std::isnan(v));
      EXPECT_TRUE(std::isnan(m));
      continue;
    }
    EXPECT_EQ(f2u(v), f2u(static_cast<float>(std::ldexp(1.0, s - 127)))) << s;
    EXPECT_EQ(f2u(m), f2u(static_cast<float>(std::ldexp(1.0, 127 - s)))) << s;
  }
}

// =================================================================================================
// MXFP8 through the API: rowwise and columnwise scales for shapes not divisible by 32
// =================================================================================================

// Reference result of an MXFP8 cast.
struct MxRef {
  std::vector<uint8_t> row_s, col_s;
};
MxRef mx_reference_scales(const HostMatrix& in, fus_dtype fmt) {
  const int64_t rows = in.rows, cols = in.cols, nbr = ceil32(cols), nbc = ceil32(rows);
  MxRef m;
  m.row_s.resize(static_cast<size_t>(rows * nbr));
  m.col_s.resize(static_cast<size_t>(nbc * cols));
  auto block_amax = [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
    double a = 0;
    bool special = false;
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = c0; c < c1; ++c) {
        const double x = in.values[r * cols + c];
        if (!std::isfinite(x))
          special = true;
        else
          a = std::max(a, std::fabs(x));
      }
    return special ? std::numeric_limits<double>::infinity() : a;
  };
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < nbr; ++b)
      m.row_s[r * nbr + b] =
          ref::e8m0_from_amax(block_amax(r, r + 1, b * 32, std::min(cols, b * 32 + 32)), fmt);
  for (int64_t b = 0; b < nbc; ++b)
    for (int64_t c = 0; c < cols; ++c)
      m.col_s[b * cols + c] =
          ref::e8m0_from_amax(block_amax(b * 32, std::min(rows, b * 32 + 32), c, c + 1), fmt);
  return m;
}

// Data with varied block magnitudes plus special blocks: all zero, denormal only, a NaN, an inf.
// narrow: exponents kept inside the fp16 range (fp16 inputs would otherwise overflow to inf).
std::vector<float> mx_test_values(int64_t rows, int64_t cols, uint32_t seed, bool specials,
                                  bool narrow = false) {
  std::vector<float> v =
      random_values(static_cast<size_t>(rows * cols), seed, narrow ? -6 : -20, narrow ? 6 : 20);
  std::mt19937 rng(seed + 1);
  // Per-row exponent offsets so row blocks differ in scale.
  const int spread = narrow ? 4 : 30;
  for (int64_t r = 0; r < rows; ++r) {
    const int off = static_cast<int>(rng() % (2 * spread + 1)) - spread;
    for (int64_t c = 0; c < cols; ++c) v[r * cols + c] = std::ldexp(v[r * cols + c], off);
  }
  if (specials && rows >= 3 && cols >= 40) {
    for (int64_t c = 0; c < std::min<int64_t>(cols, 32); ++c) v[0 * cols + c] = 0.0f;  // zero block
    for (int64_t c = 0; c < std::min<int64_t>(cols, 32); ++c)
      v[1 * cols + c] = u2f(static_cast<uint32_t>(1 + (c * 977) % 0x7fffff)) *
                        (c & 1 ? -1.0f : 1.0f);  // denormals
    v[2 * cols + 35] = qnan(true);               // NaN in block (2, 1)
    v[(rows - 1) * cols + cols - 1] = inf();     // inf in the last (partial) blocks
    v[2 * cols + 0] = 2.0f;  // exactly a power of two as block amax (block (2, 0) has tiny rest)
    for (int64_t c = 1; c < 32; ++c) v[2 * cols + c] = 0.25f * static_cast<float>(c % 7) / 7.0f;
  }
  return v;
}

using MxParam = ShapeTypeFormat;
class Mxfp8Test : public ::testing::TestWithParam<MxParam> {};

TEST_P(Mxfp8Test, ScalesPerPartialBlockAndDataMatchReference) {
  const auto [shape, in_dt, fmt] = GetParam();
  const auto [rows, cols] = shape;
  HostMatrix in(in_dt, rows, cols,
                mx_test_values(rows, cols, static_cast<uint32_t>(rows * 31 + cols), true,
                               in_dt == FUS_FLOAT16));
  QuantizeSetup s{in_dt, rows, cols, fmt, FUS_SCALING_MXFP8};
  Buffers b = quantize_buffers(in, s);
  ASSERT_EQ(run_cpu(b, quantize_call(s)), FUS_SUCCESS) << fus_last_error();
  const MxRef m = mx_reference_scales(in, fmt);
  const auto row_s = b.get<uint8_t>(kRowS), col_s = b.get<uint8_t>(kColS);
  ASSERT_EQ(row_s.size(), m.row_s.size());
  ASSERT_EQ(col_s.size(), m.col_s.size());
  const int64_t nbr = ceil32(cols);
  for (size_t i = 0; i < row_s.size(); ++i)
    EXPECT_EQ(row_s[i], m.row_s[i]) << "rowwise scale [" << i / nbr << "," << i % nbr << "]";
  for (size_t i = 0; i < col_s.size(); ++i)
    EXPECT_EQ(col_s[i], m.col_s[i]) << "columnwise scale [" << i / cols << "," << i % cols << "]";
  const auto row = b.get<uint8_t>(kRow), col = b.get<uint8_t>(kCol);
  const auto y_row = dequantize_fp32_cpu(b, s, 0), y_col = dequantize_fp32_cpu(b, s, 1);
  int bad = 0;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const size_t i = static_cast<size_t>(r * cols + c);
      const float x = in.values[i];
      const uint8_t sr = m.row_s[r * nbr + c / 32], sc = m.col_s[(r / 32) * cols + c];
      // In a NaN block (byte 0xFF) a NaN element is 0x7F | sign(x), every other element 0x7F.
      const uint8_t nan_block_code =
          std::isnan(x) ? static_cast<uint8_t>(std::signbit(x) ? 0xff : 0x7f) : 0x7f;
      if (sr == 0xff) {
        EXPECT_EQ(row[i], nan_block_code)
            << "rowwise[" << r << "," << c << "] in a NaN block, x=" << fdesc(x);
        EXPECT_TRUE(std::isnan(y_row[i])) << "NaN block dequantizes to NaN";
      } else {
        const uint8_t want = ref::fp8_encode(x * ref::e8m0_multiplier(sr), fmt);
        if (row[i] != want && ++bad <= 10)
          ADD_FAILURE() << "rowwise[" << r << "," << c << "] x=" << fdesc(x) << " scale " << int(sr)
                        << " got " << hex(row[i]) << " want " << hex(want);
      }
      if (sc == 0xff) {
        EXPECT_EQ(col[i], nan_block_code)
            << "columnwise[" << r << "," << c << "] in a NaN block, x=" << fdesc(x);
        EXPECT_TRUE(std::isnan(y_col[i])) << "NaN block dequantizes to NaN";
      } else {
        const uint8_t want = ref::fp8_encode(x * ref::e8m0_multiplier(sc), fmt);
        if (col[i] != want && ++bad <= 10)
          ADD_FAILURE() << "columnwise[" << r << "," << c << "] x=" << fdesc(x) << " scale "
                        << int(sc) << " got " << hex(col[i]) << " want " << hex(want);
      }
    }
  }
  EXPECT_EQ(bad, 0);
  EXPECT_EQ(f2u(get_float(b, kAmax)), f2u(max_abs(in.values)));
  if (rows >= 3 && cols >= 40) {
    EXPECT_EQ(row_s[0 * nbr], 0) << "all-zero block";
    EXPECT_EQ(row_s[1 * nbr], 0) << "denormal block clamps to 0";
    EXPECT_EQ(row_s[2 * nbr + 1], 0xff) << "NaN block";
    EXPECT_EQ(row_s[2 * nbr], 1 - ref::spec(fmt).emax + 127) << "block amax exactly 2";
    EXPECT_EQ(row_s[(rows - 1) * nbr + nbr - 1], 0xff) << "inf block";
    EXPECT_EQ(col_s[(ceil32(rows) - 1) * cols + cols - 1], 0xff) << "inf block (columnwise)";
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, Mxfp8Test,
    shapes_types_formats(
        {{33, 65}, {1, 1}, {32, 32}, {31, 33}, {64, 96}, {1, 4097}, {97, 1}, {0, 7}}),
    ShapeTypeFormatName);

// Blocks whose amax is exactly a power of two, just below, just above: through the API.
TEST_P(Fp8FormatTest, Mxfp8BlockAmaxAtPowerOfTwoThroughApi) {
  const fus_dtype d = GetParam();
  const int emax = ref::spec(d).emax;
  std::vector<float> vals;
  std::vector<uint8_t> want;
  for (int k = -140; k <= 127; k += 3) {
    const float p = std::ldexp(1.0f, k);
    for (int which = 0; which < 3; ++which) {
      const float amax = which == 0   ? p
                         : which == 1 ? std::nextafter(p, 0.0f)
                                      : std::nextafter(p, inf());
      const int e = (which == 1 ? k - 1 : k) - emax;
      want.push_back(static_cast<uint8_t>(std::min(254, std::max(0, e + 127))));
      for (int j = 0; j < 32; ++j)
        vals.push_back(j == 17 ? -amax : amax * (static_cast<float>(j % 5) / 8.0f));
    }
  }
  const int64_t cols = static_cast<int64_t>(vals.size());
  HostMatrix in(FUS_FLOAT32, 1, cols, vals);
  QuantizeSetup s{FUS_FLOAT32, 1, cols, d, FUS_SCALING_MXFP8};
  s.col = false;
  Buffers b = quantize_buffers(in, s);
  ASSERT_EQ(run_cpu(b, quantize_call(s)), FUS_SUCCESS) << fus_last_error();
  const auto row_s = b.get<uint8_t>(kRowS), row = b.get<uint8_t>(kRow);
  ASSERT_EQ(row_s.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EXPECT_EQ(row_s[i], want[i]) << "block " << i << " amax "
                                 << fdesc(std::fabs(vals[i * 32 + 17]));
    for (int j = 0; j < 32; ++j) {
      const float x = vals[i * 32 + j];
      EXPECT_EQ(row[i * 32 + j], ref::fp8_encode(x * ref::e8m0_multiplier(want[i]), d)) << fdesc(x);
    }
  }
}

TEST(Mxfp8, DequantizeErrorWithinRelativeStep) {
  const int64_t rows = 130, cols = 200;
  for (fus_dtype in_dt : kHpTypes) {
    HostMatrix in(in_dt, rows, cols, mx_test_values(rows, cols, 4242, false, in_dt == FUS_FLOAT16));
    for (fus_dtype fmt : kFormats) {
      SCOPED_TRACE(std::string(fmt_name(in_dt)) + " -> " + fmt_name(fmt));
      const auto sp = ref::spec(fmt);
      QuantizeSetup s{in_dt, rows, cols, fmt, FUS_SCALING_MXFP8};
      Buffers b = quantize_buffers(in, s);
      ASSERT_EQ(run_cpu(b, quantize_call(s)), FUS_SUCCESS) << fus_last_error();
      const MxRef m = mx_reference_scales(in, fmt);
      for (int cw : {0, 1}) {
        const auto y = dequantize_fp32_cpu(b, s, cw);
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t c = 0; c < cols; ++c) {
            const double x = in.values[r * cols + c];
            const uint8_t sb =
                cw ? m.col_s[(r / 32) * cols + c] : m.row_s[r * ceil32(cols) + c / 32];
            const double unit = std::ldexp(1.0, sb - 127);
            const double scaled = std::fabs(x) / unit;
            // One relative step (2^-mant of |x|, which also bounds the saturation loss in
            // (max, 2^(emax+1))) plus half a subnormal quantum of the block scale.
            double rel = std::ldexp(1.0, -sp.mant);
            if (scaled <= sp.max)
              rel = std::ldexp(1.0, -(sp.mant + 1));  // no saturation: half a step
            const double bound = rel * std::fabs(x) + std::ldexp(unit, -sp.bias - sp.mant);
            ASSERT_LE(std::fabs(y[r * cols + c] - x), bound)
                << (cw ? "columnwise" : "rowwise") << " x=" << x << " y=" << y[r * cols + c]
                << " scale byte " << int(sb);
          }
        }
      }
    }
  }
}

TEST(Mxfp8, OnlyOneDirection) {
  const int64_t rows = 40, cols = 70;
  HostMatrix in(FUS_FLOAT32, rows, cols, mx_test_values(rows, cols, 17, true));
  for (fus_dtype fmt : kFormats) {
    QuantizeSetup both{FUS_FLOAT32, rows, cols, fmt, FUS_SCALING_MXFP8};
    Buffers full = quantize_buffers(in, both);
    ASSERT_EQ(run_cpu(full, quantize_call(both)), FUS_SUCCESS);
    QuantizeSetup r = both;
    r.col = false;
    Buffers br = quantize_buffers(in, r);
    ASSERT_EQ(run_cpu(br, quantize_call(r)), FUS_SUCCESS) << fus_last_error();
    EXPECT_EQ(br.b[kRow], full.b[kRow]);
    EXPECT_EQ(br.b[kRowS], full.b[kRowS]);
    EXPECT_TRUE(std::isnan(get_float(br, kAmax))) << "the data holds a NaN";
    QuantizeSetup c = both;
    c.row = false;
    c.amax = false;
    Buffers bc = quantize_buffers(in, c);
    ASSERT_EQ(run_cpu(bc, quantize_call(c)), FUS_SUCCESS) << fus_last_error();
    EXPECT_EQ(bc.b[kCol], full.b[kCol]);
    EXPECT_EQ(bc.b[kColS], full.b[kColS]);
  }
}

// =================================================================================================
// Dequantize: each format, each output dtype, both modes and copies
// =================================================================================================

using DequantParam = std::tuple<fus_dtype, fus_dtype>;
class DequantizeTest : public ::testing::TestWithParam<DequantParam> {};

// Checks out (in dtype dt) against decode(q) * factor rounded to dt; NaN -> NaN.
void expect_dequantized(const std::vector<uint8_t>& out, fus_dtype dt, size_t i, uint8_t q,
                        fus_dtype fmt, float factor, const std::string& where) {
  const float v = static_cast<float>(ref::fp8_decode(q, fmt)) * factor;
  if (std::isnan(v)) {
    EXPECT_TRUE(std::isnan(load_as_double(out, dt, i)))
        << where << ": code " << hex(q) << " must give NaN";
    return;
  }
  EXPECT_EQ(stored_bits(out, dt, i), encode_output(v, dt))
      << where << ": code " << hex(q) << " * " << fdesc(factor) << " = " << fdesc(v);
}

TEST_P(DequantizeTest, PerTensorAllCodesBothCopies) {
  const auto [fmt, out_dt] = GetParam();
  const int64_t rows = 8, cols = 32;  // all 256 codes
  std::vector<uint8_t> q(256), qt(256);
  for (int i = 0; i < 256; ++i) q[i] = static_cast<uint8_t>((i * 37 + 11) & 0xff);  // a permutation
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) qt[c * rows + r] = q[r * cols + c];
  for (float scale_inv : {1.0f, 0.375f, std::ldexp(1.0f, -10), 1000.0f, 3.0e-30f}) {
    for (int cw : {0, 1}) {
      Buffers d;
      d.add(q);
      d.add(qt);
      d.add(std::vector<float>{scale_inv});
      d.add_filled(0);
      d.add_filled(256 * fus_dtype_size(out_dt));
      DequantizeSetup ds{fmt, FUS_SCALING_PER_TENSOR, rows, cols, cw, out_dt};
      ASSERT_EQ(run_cpu(d, dequantize_call(ds)), FUS_SUCCESS) << fus_last_error();
      const auto& out = d.b[kDOut];
      for (int i = 0; i < 256; ++i)
        expect_dequantized(
            out, out_dt, i, cw ? qt[i] : q[i], fmt, scale_inv,
            std::string(cw ? "columnwise" : "rowwise") + " scale_inv " + fdesc(scale_inv));
    }
  }
}

TEST_P(DequantizeTest, Mxfp8AllCodesAndScaleBytes) {
  const auto [fmt, out_dt] = GetParam();
  const int64_t rows = 64, cols = 256;
  std::vector<uint8_t> q(rows * cols);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) q[r * cols + c] = static_cast<uint8_t>((c + 3 * r) & 0xff);
  const uint8_t bytes[] = {0, 1, 2, 100, 117, 120, 127, 128, 140, 200, 230, 253, 254, 255};
  std::vector<uint8_t> rs(rows * (cols / 32)), cs(2 * cols);
  for (size_t i = 0; i < rs.size(); ++i) rs[i] = bytes[(i * 5) % sizeof(bytes)];
  for (size_t i = 0; i < cs.size(); ++i) cs[i] = bytes[(i * 3) % sizeof(bytes)];
  for (int cw : {0, 1}) {
    Buffers d;
    d.add(q);
    d.add(q);
    d.add(rs);
    d.add(cs);
    d.add_filled(static_cast<size_t>(rows * cols) * fus_dtype_size(out_dt));
    DequantizeSetup ds{fmt, FUS_SCALING_MXFP8, rows, cols, cw, out_dt};
    ASSERT_EQ(run_cpu(d, dequantize_call(ds)), FUS_SUCCESS) << fus_last_error();
    const auto& out = d.b[kDOut];
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) {
        const uint8_t s = cw ? cs[(r / 32) * cols + c] : rs[r * (cols / 32) + c / 32];
        expect_dequantized(
            out, out_dt, static_cast<size_t>(r * cols + c), q[r * cols + c], fmt,
            ref::e8m0_value(s),
            std::string(cw ? "columnwise" : "rowwise") + " scale byte " + std::to_string(s));
      }
  }
}

INSTANTIATE_TEST_SUITE_P(Types, DequantizeTest,
                         ::testing::Combine(::testing::ValuesIn(kFormats),
                                            ::testing::ValuesIn(kHpTypes)),
                         [](const ::testing::TestParamInfo<DequantParam>& info) {
                           return std::string(fmt_name(std::get<0>(info.param))) + "_to_" +
                                  fmt_name(std::get<1>(info.param));
                         });

// quantize -> dequantize to fp16 / bf16 output of exactly representable values is exact.
TEST(Dequantize, RoundTripOfFp8ValuesIntoHalfAndBf16) {
  for (fus_dtype fmt : kFormats) {
    std::vector<float> vals;
    for (int c = 0; c < 256; ++c) {
      const double v = ref::fp8_decode(static_cast<uint8_t>(c), fmt);
      if (std::isfinite(v)) vals.push_back(static_cast<float>(v));
    }
    const int64_t n = static_cast<int64_t>(vals.size());
    HostMatrix in(FUS_FLOAT32, 1, n, vals);
    QuantizeSetup s{FUS_FLOAT32, 1, n, fmt, FUS_SCALING_PER_TENSOR};
    Buffers b = quantize_buffers(in, s);
    ASSERT_EQ(run_cpu(b, quantize_call(s)), FUS_SUCCESS);
    for (fus_dtype out_dt : kHpTypes) {
      Buffers d;
      d.add_bytes(b.b[kRow]);
      d.add_filled(0);
      d.add_bytes(b.b[kRowS]);
      d.add_filled(0);
      d.add_filled(static_cast<size_t>(n) * fus_dtype_size(out_dt));
      DequantizeSetup ds{fmt, FUS_SCALING_PER_TENSOR, 1, n, 0, out_dt};
      ASSERT_EQ(run_cpu(d, dequantize_call(ds)), FUS_SUCCESS) << fus_last_error();
      for (int64_t i = 0; i < n; ++i)
        EXPECT_EQ(load_as_double(d.b[kDOut], out_dt, static_cast<size_t>(i)), vals[i])
            << fmt_name(out_dt);
    }
  }
}

// =================================================================================================
// FP8 transpose
// =================================================================================================

// A fus_transpose_fp8 call on the buffers {input [rows, cols], output [cols, rows]}. in_off /
// out_off: the data starts that many bytes into its buffer (unaligned pointers).
struct TransposeSetup {
  int64_t rows = 0, cols = 0;
  fus_dtype fmt = kE4M3;
  int in_off = 0, out_off = 0;
};

// Random bytes (every code, NaN codes included) in front of and in the input, a fill pattern in
// the output buffer. Empty matrices get NULL data.
Buffers transpose_buffers(const TransposeSetup& s, uint32_t seed) {
  const size_t n = static_cast<size_t>(s.rows * s.cols);
  std::vector<uint8_t> in(n ? n + s.in_off : 0);
  std::mt19937 rng(seed);
  for (auto& v : in) v = static_cast<uint8_t>(rng());
  Buffers b;
  b.add_bytes(in);
  b.add_filled(n ? n + s.out_off : 0);
  return b;
}

ApiCall transpose_call(const TransposeSetup& s) {
  return [s](const std::vector<void*>& p, const fus_context& ctx) {
    auto at = [](void* q, int off) -> void* {
      return q ? static_cast<uint8_t*>(q) + off : nullptr;
    };
    fus_tensor in{at(p[0], s.in_off), s.fmt, s.rows, s.cols};
    fus_tensor out{at(p[1], s.out_off), s.fmt, s.cols, s.rows};
    return fus_transpose_fp8(&in, &out, &ctx);
  };
}

// output[c, r] == input[r, c] for every byte, and the bytes in front of the output untouched.
::testing::AssertionResult is_transpose(const Buffers& b, const TransposeSetup& s) {
  const std::vector<uint8_t>& in = b.b[0];
  const std::vector<uint8_t>& out = b.b[1];
  int64_t bad = 0;
  ::testing::AssertionResult res = ::testing::AssertionFailure();
  for (int64_t r = 0; r < s.rows; ++r) {
    for (int64_t c = 0; c < s.cols; ++c) {
      const uint8_t want = in[s.in_off + r * s.cols + c], got = out[s.out_off + c * s.rows + r];
      if (got != want && ++bad <= 8)
        res << "\n  output[" << c << ", " << r << "] = " << hex(got) << ", want input[" << r << ", "
            << c << "] = " << hex(want);
    }
  }
  for (int i = 0; i < s.out_off && !out.empty(); ++i)
    if (out[i] != 0xA5 && ++bad <= 8) res << "\n  byte " << i << " before the output written";
  if (bad == 0) return ::testing::AssertionSuccess();
  return res << "\n  " << bad << " bytes wrong";
}

using TransposeParam = std::tuple<Shape, fus_dtype>;
std::string TransposeParamName(const ::testing::TestParamInfo<TransposeParam>& info) {
  return shape_name(std::get<0>(info.param).first, std::get<0>(info.param).second) + "_" +
         fmt_name(std::get<1>(info.param));
}

class TransposeTest : public ::testing::TestWithParam<TransposeParam> {};

TEST_P(TransposeTest, EveryByteMovesToItsTransposedPlace) {
  const auto [shape, fmt] = GetParam();
  const auto [rows, cols] = shape;
  for (const auto& [in_off, out_off] : {std::pair<int, int>{0, 0}, {1, 3}}) {
    SCOPED_TRACE("offsets " + std::to_string(in_off) + ", " + std::to_string(out_off));
    const TransposeSetup s{rows, cols, fmt, in_off, out_off};
    Buffers b = transpose_buffers(s, static_cast<uint32_t>(rows * 31 + cols));
    ASSERT_EQ(run_cpu(b, transpose_call(s)), FUS_SUCCESS) << fus_last_error();
    EXPECT_TRUE(is_transpose(b, s));
  }
}

const std::vector<Shape> kTransposeShapes = {{1, 1},   {1, 17},     {17, 1},   {2, 3}, {31, 33},
                                             {64, 64}, {127, 4097}, {4097, 3}, {0, 5}, {5, 0}};

INSTANTIATE_TEST_SUITE_P(Shapes, TransposeTest,
                         ::testing::Combine(::testing::ValuesIn(kTransposeShapes),
                                            ::testing::ValuesIn(kFormats)),
                         TransposeParamName);

// The transpose of a per-tensor rowwise copy is the columnwise copy fus_quantize writes.
TEST(Transpose, OfRowwiseCopyIsTheQuantizedColumnwiseCopy) {
  for (fus_dtype fmt : kFormats) {
    for (const auto& [rows, cols] : {std::pair<int64_t, int64_t>{33, 65}, {1, 129}, {128, 16}}) {
      SCOPED_TRACE(std::string(fmt_name(fmt)) + " " + shape_name(rows, cols));
      HostMatrix in(FUS_BFLOAT16, rows, cols, random_values(static_cast<size_t>(rows * cols), 5));
      QuantizeSetup s{FUS_BFLOAT16, rows, cols, fmt, FUS_SCALING_PER_TENSOR};
      s.scale = 3.0f;
      Buffers q = quantize_buffers(in, s);
      ASSERT_EQ(run_cpu(q, quantize_call(s)), FUS_SUCCESS) << fus_last_error();
      std::vector<uint8_t> t(q.b[kRow].size(), 0xA5);
      fus_tensor src{q.b[kRow].data(), fmt, rows, cols}, dst{t.data(), fmt, cols, rows};
      const fus_context ctx = cpu_ctx();
      ASSERT_EQ(fus_transpose_fp8(&src, &dst, &ctx), FUS_SUCCESS) << fus_last_error();
      EXPECT_EQ(t, q.b[kCol]);
    }
  }
}

// =================================================================================================
// Argument validation
// =================================================================================================

struct ErrFixture : ::testing::Test {
  std::vector<float> x = std::vector<float>(12, 1.0f);
  std::vector<uint8_t> row = std::vector<uint8_t>(12), col = std::vector<uint8_t>(12),
                       rs = std::vector<uint8_t>(4), cs = std::vector<uint8_t>(4);
  float scale = 1.0f, scale_inv = 0.0f, amax = -7.0f;
  fus_tensor in{x.data(), FUS_FLOAT32, 3, 4};
  fus_quantized q = per_tensor_out(kE4M3, 3, 4, row.data(), col.data(), &scale_inv, &scale, &amax);
  fus_context ctx = cpu_ctx();
  std::vector<float> yv = std::vector<float>(12);
  fus_tensor out{yv.data(), FUS_FLOAT32, 3, 4};
};

TEST_F(ErrFixture, ValidCallSucceedsAndClearsLastError) {
  fus_tensor bad = in;
  bad.rows = -1;
  ASSERT_NE(fus_quantize(&bad, &q, &ctx), FUS_SUCCESS);
  ASSERT_STRNE(fus_last_error(), "");
  EXPECT_EQ(fus_quantize(&in, &q, &ctx), FUS_SUCCESS);
  EXPECT_STREQ(fus_last_error(), "");
  EXPECT_EQ(amax, 1.0f);
}

TEST_F(ErrFixture, QuantizeNullPointers) {
  EXPECT_TRUE(is_error(fus_quantize(nullptr, &q, &ctx), FUS_ERROR_INVALID_ARGUMENT,
                       {"fus_quantize", "input"}));
  EXPECT_TRUE(is_error(fus_quantize(&in, nullptr, &ctx), FUS_ERROR_INVALID_ARGUMENT,
                       {"fus_quantize", "out"}));
  EXPECT_TRUE(is_error(fus_quantize(&in, &q, nullptr), FUS_ERROR_INVALID_ARGUMENT,
                       {"fus_quantize", "ctx"}));
  in.data = nullptr;
  EXPECT_TRUE(is_error(fus_quantize(&in, &q, &ctx), FUS_ERROR_INVALID_ARGUMENT,
                       {"fus_quantize", "input", "NULL"}));
  EXPECT_EQ(amax, -7.0f) << "a failed call must not write outputs";
}

TEST_F(ErrFixture, QuantizeNegativeShape) {
  in.rows = -3;
  q.rows = -3;
  EXPECT_TRUE(is_error(fus_quantize(&in, &q, &ctx), FUS_ERROR_INVALID_ARGUMENT,
                       {"fus_quantize", "input", "negative"}));
  in.rows = 3;
  q.rows = 3;
  in.cols = -4;
  EXPECT_TRUE(
      is_error(fus_quantize(&in, &q, &ctx), FUS_ERROR_INVALID_ARGUMENT, {"fus_quantize", "input"}));
}

TEST_F(ErrFixture, QuantizeWrongDtypes) {
  in.dtype = FUS_FLOAT8_E4M3;
  EXPECT_TRUE(is_error(fus_quantize(&in, &q, &ctx), FUS_ERROR_INVALID_ARGUMENT,
                       {"fus_quantize", "input", "dtype"}));
  in.dtype = static_cast<fus_dtype>(42);
  EXPECT_TRUE(
      is_error(fus_quantize(&in, &q, &ctx), FUS_ERROR_INVALID_ARGUMENT, {"fus_quantize", "input"}));
  in.dtype = FUS_FLOAT32;
  q.dtype = FUS_BFLOAT16;
  EXPECT_TRUE(is_error(fus_quantize(&in, &q, &ctx), FUS_ERROR_INVALID_ARGUMENT,
                       {"fus_quantize", "out", "dtype"}));
  q.dtype = FUS_E8M0;
  EXPECT_TRUE(
      is_error(fus_quantize(&in, &q, &ctx), FUS_ERROR_INVALID_ARGUMENT, {"fus_quantize", "out"}));
  q.dtype = kE4M3;
  q.mode = static_cast<fus_scaling_mode>(9);
  EXPECT_TRUE(
      is_error(fus_quantize(&in, &q, &ctx), FUS_ERROR_INVALID_ARGUMENT, {"fus_quantize", "mode"}));
  EXPECT_EQ(amax, -7.0f);
}

TEST_F(ErrFixture, QuantizeMismatchedShapes) {
  q.rows = 4;
  q.cols = 3;
  EXPECT_TRUE(
      is_error(fus_quantize(&in, &q, &ctx), FUS_ERROR_INVALID_ARGUMENT, {"fus_quantize", "out"}));
  q.rows = 3;
  q.cols = 5;
  EXPECT_TRUE(
      is_error(fus_quantize(&in, &q, &ctx), FUS_ERROR_INVALID_ARGUMENT, {"fus_quantize", "out"}));
}

TEST_F(ErrFixture, QuantizeMissingScaleOrScaleInvOrData) {
  q.scale = nullptr;
  EXPECT_TRUE(
      is_error(fus_quantize(&in, &q, &ctx), FUS_ERROR_INVALID_ARGUMENT, {"fus_quantize", "scale"}));
  q.scale = &scale;
  q.rowwise_scale_inv = nullptr;
  EXPECT_TRUE(is_error(fus_quantize(&in, &q, &ctx), FUS_ERROR_INVALID_ARGUMENT,
                       {"fus_quantize", "rowwise_scale_inv"}));
  q.rowwise_scale_inv = &scale_inv;
  q.rowwise_data = nullptr;
  q.columnwise_data = nullptr;
  EXPECT_TRUE(is_error(fus_quantize(&in, &q, &ctx), FUS_ERROR_INVALID_ARGUMENT,
                       {"fus_quantize", "rowwise_data"}));
  // MXFP8 needs the E8M0 scale buffer of each copy it writes.
  q.mode = FUS_SCALING_MXFP8;
  q.rowwise_data = row.data();
  q.rowwise_scale_inv = nullptr;
  EXPECT_TRUE(is_error(fus_quantize(&in, &q, &ctx), FUS_ERROR_INVALID_ARGUMENT,
                       {"fus_quantize", "rowwise_scale_inv"}));
  q.rowwise_scale_inv = rs.data();
  q.columnwise_data = col.data();
  q.columnwise_scale_inv = nullptr;
  EXPECT_TRUE(is_error(fus_quantize(&in, &q, &ctx), FUS_ERROR_INVALID_ARGUMENT,
                       {"fus_quantize", "columnwise_scale_inv"}));
  q.columnwise_scale_inv = cs.data();
  q.scale = nullptr;  // unused by MXFP8
  EXPECT_EQ(fus_quantize(&in, &q, &ctx), FUS_SUCCESS) << fus_last_error();
  EXPECT_EQ(amax, 1.0f) << "amax of all-ones input";
}

TEST_F(ErrFixture, BadContext) {
  ctx.device = static_cast<fus_device_type>(7);
  EXPECT_TRUE(
      is_error(fus_quantize(&in, &q, &ctx), FUS_ERROR_INVALID_ARGUMENT, {"fus_quantize", "ctx"}));
  EXPECT_TRUE(is_error(fus_compute_amax(&in, &amax, &ctx), FUS_ERROR_INVALID_ARGUMENT,
                       {"fus_compute_amax", "ctx"}));
}

TEST_F(ErrFixture, CudaContextInCpuOnlyBuildIsUnsupported) {
  if (fus_has_cuda()) GTEST_SKIP() << "this build has the CUDA backend";
  ctx = cuda_ctx();
  EXPECT_TRUE(
      is_error(fus_quantize(&in, &q, &ctx), FUS_ERROR_UNSUPPORTED, {"fus_quantize", "CUDA"}));
  EXPECT_TRUE(is_error(fus_compute_amax(&in, &amax, &ctx), FUS_ERROR_UNSUPPORTED,
                       {"fus_compute_amax", "CUDA"}));
  EXPECT_TRUE(is_error(fus_quantize_current_scaling(&in, &q, 0, &ctx), FUS_ERROR_UNSUPPORTED,
                       {"fus_quantize_current_scaling", "CUDA"}));
  EXPECT_TRUE(is_error(fus_dequantize(&q, 0, &out, &ctx), FUS_ERROR_UNSUPPORTED,
                       {"fus_dequantize", "CUDA"}));
  fus_tensor t_in{row.data(), kE4M3, 3, 4}, t_out{col.data(), kE4M3, 4, 3};
  EXPECT_TRUE(is_error(fus_transpose_fp8(&t_in, &t_out, &ctx), FUS_ERROR_UNSUPPORTED,
                       {"fus_transpose_fp8", "CUDA"}));
  EXPECT_EQ(amax, -7.0f);
}

TEST_F(ErrFixture, ComputeAmaxArguments) {
  EXPECT_TRUE(is_error(fus_compute_amax(&in, nullptr, &ctx), FUS_ERROR_INVALID_ARGUMENT,
                       {"fus_compute_amax", "amax"}));
  EXPECT_TRUE(is_error(fus_compute_amax(nullptr, &amax, &ctx), FUS_ERROR_INVALID_ARGUMENT,
                       {"fus_compute_amax", "input"}));
  in.dtype = FUS_E8M0;
  EXPECT_TRUE(is_error(fus_compute_amax(&in, &amax, &ctx), FUS_ERROR_INVALID_ARGUMENT,
                       {"fus_compute_amax", "input"}));
  in.dtype = FUS_FLOAT32;
  in.cols = -1;
  EXPECT_TRUE(is_error(fus_compute_amax(&in, &amax, &ctx), FUS_ERROR_INVALID_ARGUMENT,
                       {"fus_compute_amax", "input"}));
  EXPECT_EQ(amax, -7.0f);
}

TEST_F(ErrFixture, CurrentScalingArguments) {
  const char* fn = "fus_quantize_current_scaling";
  EXPECT_TRUE(is_error(fus_quantize_current_scaling(nullptr, &q, 0, &ctx),
                       FUS_ERROR_INVALID_ARGUMENT, {fn, "input"}));
  EXPECT_TRUE(is_error(fus_quantize_current_scaling(&in, nullptr, 0, &ctx),
                       FUS_ERROR_INVALID_ARGUMENT, {fn, "out"}));
  q.amax = nullptr;
  EXPECT_TRUE(is_error(fus_quantize_current_scaling(&in, &q, 0, &ctx), FUS_ERROR_INVALID_ARGUMENT,
                       {fn, "amax"}));
  q.amax = &amax;
  q.scale = nullptr;
  EXPECT_TRUE(is_error(fus_quantize_current_scaling(&in, &q, 0, &ctx), FUS_ERROR_INVALID_ARGUMENT,
                       {fn, "scale"}));
  q.scale = &scale;
  q.rowwise_scale_inv = nullptr;
  EXPECT_TRUE(is_error(fus_quantize_current_scaling(&in, &q, 0, &ctx), FUS_ERROR_INVALID_ARGUMENT,
                       {fn, "scale_inv"}));
  q.rowwise_scale_inv = &scale_inv;
  q.mode = FUS_SCALING_MXFP8;
  q.columnwise_scale_inv = cs.data();
  EXPECT_TRUE(is_error(fus_quantize_current_scaling(&in, &q, 0, &ctx), FUS_ERROR_INVALID_ARGUMENT,
                       {fn, "mode"}));
  EXPECT_EQ(amax, -7.0f);
  EXPECT_EQ(scale, 1.0f);
}

TEST_F(ErrFixture, DequantizeArguments) {
  const char* fn = "fus_dequantize";
  // The rowwise call with q and out as they stand is refused, naming every word.
  auto refused = [&](std::initializer_list<const char*> words) {
    return is_error(fus_dequantize(&q, 0, &out, &ctx), FUS_ERROR_INVALID_ARGUMENT, words);
  };
  EXPECT_TRUE(
      is_error(fus_dequantize(nullptr, 0, &out, &ctx), FUS_ERROR_INVALID_ARGUMENT, {fn, "in"}));
  EXPECT_TRUE(
      is_error(fus_dequantize(&q, 0, nullptr, &ctx), FUS_ERROR_INVALID_ARGUMENT, {fn, "output"}));
  EXPECT_TRUE(
      is_error(fus_dequantize(&q, 0, &out, nullptr), FUS_ERROR_INVALID_ARGUMENT, {fn, "ctx"}));
  out.dtype = FUS_FLOAT8_E5M2;
  EXPECT_TRUE(refused({fn, "output", "dtype"}));
  out.dtype = FUS_FLOAT32;
  // Per-tensor columnwise output is the transpose, [cols, rows] = [4, 3]: [3, 4] is wrong.
  EXPECT_TRUE(is_error(fus_dequantize(&q, 1, &out, &ctx), FUS_ERROR_INVALID_ARGUMENT,
                       {fn, "output", "[4, 3]"}));
  out.rows = 4;
  out.cols = 3;
  EXPECT_EQ(fus_dequantize(&q, 1, &out, &ctx), FUS_SUCCESS) << fus_last_error();
  EXPECT_TRUE(refused({fn, "output"}));
  out.rows = 3;
  out.cols = 4;
  out.rows = -3;
  EXPECT_TRUE(refused({fn, "output", "negative"}));
  out.rows = 3;
  q.rowwise_data = nullptr;
  EXPECT_TRUE(refused({fn, "rowwise_data"}));
  q.rowwise_data = row.data();
  q.columnwise_data = nullptr;
  out.rows = 4;
  out.cols = 3;
  EXPECT_TRUE(is_error(fus_dequantize(&q, 1, &out, &ctx), FUS_ERROR_INVALID_ARGUMENT,
                       {fn, "columnwise_data"}));
  q.rowwise_scale_inv = nullptr;
  out.rows = 3;
  out.cols = 4;
  EXPECT_TRUE(refused({fn, "scale_inv"}));
  q.rowwise_scale_inv = &scale_inv;
  q.dtype = FUS_FLOAT16;
  EXPECT_TRUE(refused({fn, "in", "dtype"}));
  q.dtype = kE4M3;
  q.mode = FUS_SCALING_MXFP8;
  q.rowwise_scale_inv = nullptr;
  EXPECT_TRUE(refused({fn, "rowwise_scale_inv"}));
}

TEST_F(ErrFixture, TransposeArguments) {
  const char* fn = "fus_transpose_fp8";
  for (size_t i = 0; i < row.size(); ++i) row[i] = static_cast<uint8_t>(i + 1);
  std::fill(col.begin(), col.end(), 0xA5);
  fus_tensor src{row.data(), kE4M3, 3, 4}, dst{col.data(), kE4M3, 4, 3};
  // The call with src and dst as they stand is refused, naming every word.
  auto refused = [&](std::initializer_list<const char*> words) {
    return is_error(fus_transpose_fp8(&src, &dst, &ctx), FUS_ERROR_INVALID_ARGUMENT, words);
  };
  EXPECT_TRUE(is_error(fus_transpose_fp8(nullptr, &dst, &ctx), FUS_ERROR_INVALID_ARGUMENT,
                       {fn, "input", "NULL"}));
  EXPECT_TRUE(is_error(fus_transpose_fp8(&src, nullptr, &ctx), FUS_ERROR_INVALID_ARGUMENT,
                       {fn, "output", "NULL"}));
  EXPECT_TRUE(
      is_error(fus_transpose_fp8(&src, &dst, nullptr), FUS_ERROR_INVALID_ARGUMENT, {fn, "ctx"}));
  // The output of a [3, 4] input is [4, 3]: [3, 4] and [4, 4] are wrong.
  dst.rows = 3;
  dst.cols = 4;
  EXPECT_TRUE(refused({fn, "output", "[4, 3]"}));
  dst.rows = 4;
  EXPECT_TRUE(refused({fn, "output", "[4, 3]"}));
  dst.cols = 3;
  // FP8 only, and the same FP8 dtype on both sides.
  dst.dtype = kE5M2;
  EXPECT_TRUE(refused({fn, "output", "dtype"}));
  src.dtype = FUS_FLOAT32;
  dst.dtype = FUS_FLOAT32;
  EXPECT_TRUE(refused({fn, "input", "dtype"}));
  src.dtype = FUS_E8M0;
  EXPECT_TRUE(refused({fn, "input", "dtype"}));
  src.dtype = kE4M3;
  dst.dtype = FUS_BFLOAT16;
  EXPECT_TRUE(refused({fn, "output", "dtype"}));
  dst.dtype = kE4M3;
  src.rows = -3;
  EXPECT_TRUE(refused({fn, "input", "negative"}));
  src.rows = 3;
  src.data = nullptr;
  EXPECT_TRUE(refused({fn, "input", "NULL"}));
  src.data = row.data();
  dst.data = nullptr;
  EXPECT_TRUE(refused({fn, "output", "NULL"}));
  // No in-place transpose: overlapping buffers are rejected (before anything is written).
  dst.data = row.data() + 11;
  EXPECT_TRUE(refused({fn, "output", "overlaps"}));
  dst.data = row.data();
  EXPECT_TRUE(refused({fn, "output", "overlaps"}));
  for (size_t i = 0; i < row.size(); ++i)
    EXPECT_EQ(row[i], i + 1) << "a failed call must not write outputs";
  for (uint8_t b : col) EXPECT_EQ(b, 0xA5) << "a failed call must not write outputs";
  dst.data = col.data();
  EXPECT_EQ(fus_transpose_fp8(&src, &dst, &ctx), FUS_SUCCESS) << fus_last_error();
  EXPECT_EQ(col[1], row[4]) << "output[0, 1] = input[1, 0]";
  // Empty matrices need no data.
  fus_tensor e_src{nullptr, kE5M2, 0, 5}, e_dst{nullptr, kE5M2, 5, 0};
  EXPECT_EQ(fus_transpose_fp8(&e_src, &e_dst, &ctx), FUS_SUCCESS) << fus_last_error();
  e_dst.rows = 0;
  EXPECT_TRUE(is_error(fus_transpose_fp8(&e_src, &e_dst, &ctx), FUS_ERROR_INVALID_ARGUMENT,
                       {fn, "output", "[5, 0]"}));
}

// =================================================================================================
// CUDA backend against the CPU backend, bit for bit
// =================================================================================================

// Random values with edge cases sprinkled in: NaN of both signs, +-inf, FLT_MAX, denormals,
// midpoints and saturation thresholds of both formats.
std::vector<float> edgy_values(size_t n, uint32_t seed) {
  std::vector<float> v = random_values(n, seed, -24, 24);
  const float specials[] = {qnan(false),
                            qnan(true),
                            u2f(0x7f800001u),
                            inf(),
                            -inf(),
                            FLT_MAX,
                            -FLT_MAX,
                            u2f(1),
                            u2f(0x807fffffu),
                            1e-40f,
                            464.0f,
                            480.0f,
                            448.0f,
                            -464.0f,
                            57344.0f,
                            61440.0f,
                            -61440.0f,
                            65536.0f,
                            1.0625f,
                            1.125f,
                            std::ldexp(1.0f, -10),
                            std::ldexp(3.0f, -17),
                            std::ldexp(1.0f, -130),
                            0.0f,
                            -0.0f};
  std::mt19937 rng(seed ^ 0x9e3779b9u);
  if (n == 0) return v;
  const size_t count = std::min<size_t>(n / 16 + 1, 4096);
  for (size_t k = 0; k < count; ++k)
    v[rng() % n] = specials[k % (sizeof(specials) / sizeof(specials[0]))];
  return v;
}

const std::vector<std::pair<int64_t, int64_t>> kCudaShapes = {
    {1, 1}, {7, 13}, {33, 65}, {127, 33}, {1, 4097}, {4097, 1}, {257, 4099}, {1024, 1024}, {0, 5}};

using CudaParam = ShapeTypeFormat;
class CudaVsCpuTest : public ::testing::TestWithParam<CudaParam> {};

void expect_same_quantize(const DualResult& r, const QuantizeSetup& s) {
  ASSERT_EQ(r.cpu_status, FUS_SUCCESS);
  ASSERT_EQ(r.cuda_status, FUS_SUCCESS) << fus_last_error();
  EXPECT_TRUE(same_bits<uint8_t>(r.cpu, r.cuda, kRow, "rowwise_data"));
  EXPECT_TRUE(same_bits<uint8_t>(r.cpu, r.cuda, kCol, "columnwise_data"));
  if (s.mode == FUS_SCALING_PER_TENSOR) {
    EXPECT_TRUE(same_bits<uint32_t>(r.cpu, r.cuda, kRowS, "scale_inv"));
    EXPECT_TRUE(same_bits<uint32_t>(r.cpu, r.cuda, kScale, "scale"));
  } else {
    EXPECT_TRUE(same_bits<uint8_t>(r.cpu, r.cuda, kRowS, "rowwise_scale_inv (e8m0)"));
    EXPECT_TRUE(same_bits<uint8_t>(r.cpu, r.cuda, kColS, "columnwise_scale_inv (e8m0)"));
  }
  EXPECT_TRUE(same_bits<uint32_t>(r.cpu, r.cuda, kAmax, "amax"));
}

TEST_P(CudaVsCpuTest, PerTensorQuantize) {
  FUSTEST_REQUIRE_CUDA();
  const auto [shape, in_dt, fmt] = GetParam();
  const auto [rows, cols] = shape;
  for (bool edges : {false, true}) {
    const auto vals =
        edges ? edgy_values(rows * cols, static_cast<uint32_t>(rows + 3 * cols))
              : random_values(rows * cols, static_cast<uint32_t>(rows * 5 + cols), -10, 10);
    HostMatrix in(in_dt, rows, cols, vals);
    const float amax = max_abs(in.values);
    const float base = (std::isfinite(amax) && amax > 0) ? fus_fp8_max(fmt) / amax : 1.0f;
    // 0 and inf: inf * 0 makes a NaN out of a non-NaN element.
    for (float scale : {1.0f, base, 3.7f * base, 0.0f, inf()}) {
      SCOPED_TRACE(std::string(edges ? "edge values" : "random values") + ", scale " +
                   fdesc(scale));
      QuantizeSetup s{in_dt, rows, cols, fmt, FUS_SCALING_PER_TENSOR};
      s.scale = scale;
      expect_same_quantize(run_both(quantize_buffers(in, s), quantize_call(s)), s);
    }
  }
}

TEST_P(CudaVsCpuTest, CurrentScaling) {
  FUSTEST_REQUIRE_CUDA();
  const auto [shape, in_dt, fmt] = GetParam();
  const auto [rows, cols] = shape;
  for (int variant = 0; variant < 3; ++variant) {
    std::vector<float> vals =
        random_values(rows * cols, static_cast<uint32_t>(rows * 11 + cols + variant), -10, 10);
    if (variant == 1 && !vals.empty()) vals[vals.size() / 2] = inf();
    if (variant == 2 && !vals.empty()) vals[vals.size() / 3] = qnan(true);
    HostMatrix in(in_dt, rows, cols, vals);
    for (int margin : {0, 1}) {
      SCOPED_TRACE("variant " + std::to_string(variant) + " margin " + std::to_string(margin));
      QuantizeSetup s{in_dt, rows, cols, fmt, FUS_SCALING_PER_TENSOR};
      s.scale = 5.0f;
      expect_same_quantize(run_both(quantize_buffers(in, s), quantize_call(s, margin)), s);
    }
  }
}

TEST_P(CudaVsCpuTest, Mxfp8Quantize) {
  FUSTEST_REQUIRE_CUDA();
  const auto [shape, in_dt, fmt] = GetParam();
  const auto [rows, cols] = shape;
  for (bool edges : {false, true}) {
    SCOPED_TRACE(edges ? "edge values" : "block-structured values");
    const auto vals = edges ? edgy_values(rows * cols, static_cast<uint32_t>(rows * 3 + cols))
                            : mx_test_values(rows, cols, static_cast<uint32_t>(rows + cols), true,
                                             in_dt == FUS_FLOAT16);
    HostMatrix in(in_dt, rows, cols, vals);
    QuantizeSetup s{in_dt, rows, cols, fmt, FUS_SCALING_MXFP8};
    expect_same_quantize(run_both(quantize_buffers(in, s), quantize_call(s)), s);
    QuantizeSetup only_col = s;
    only_col.row = false;
    expect_same_quantize(run_both(quantize_buffers(in, only_col), quantize_call(only_col)),
                         only_col);
  }
}

TEST_P(CudaVsCpuTest, ComputeAmax) {
  FUSTEST_REQUIRE_CUDA();
  const auto [shape, in_dt, fmt] = GetParam();
  (void)fmt;
  const auto [rows, cols] = shape;
  for (bool edges : {false, true}) {
    HostMatrix in(in_dt, rows, cols,
                  edges ? edgy_values(rows * cols, 3) : random_values(rows * cols, 4, -30, 30));
    Buffers b;
    b.add_bytes(in.bytes);
    b.add_filled(4);
    const int64_t r = rows, c = cols;
    const fus_dtype dt = in_dt;
    DualResult res = run_both(b, [=](const std::vector<void*>& p, const fus_context& ctx) {
      fus_tensor t{p[0], dt, r, c};
      return fus_compute_amax(&t, static_cast<float*>(p[1]), &ctx);
    });
    ASSERT_EQ(res.cpu_status, FUS_SUCCESS);
    ASSERT_EQ(res.cuda_status, FUS_SUCCESS) << fus_last_error();
    EXPECT_TRUE(same_bits<uint32_t>(res.cpu, res.cuda, 1, "amax"));
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, CudaVsCpuTest, shapes_types_formats(kCudaShapes),
                         ShapeTypeFormatName);

TEST(CudaVsCpu, Every251stFloatPatternPerTensorAndMxfp8) {
  FUSTEST_REQUIRE_CUDA();
  const std::vector<float> sample = float_pattern_sample(251);
  const int64_t n = static_cast<int64_t>(sample.size());
  HostMatrix in(FUS_FLOAT32, 1, n, sample);
  for (fus_dtype fmt : kFormats) {
    SCOPED_TRACE(fmt_name(fmt));
    QuantizeSetup s{FUS_FLOAT32, 1, n, fmt, FUS_SCALING_PER_TENSOR};
    s.scale = 1.0f;
    expect_same_quantize(run_both(quantize_buffers(in, s), quantize_call(s)), s);
    QuantizeSetup m{FUS_FLOAT32, 1, n, fmt, FUS_SCALING_MXFP8};
    m.col = false;
    expect_same_quantize(run_both(quantize_buffers(in, m), quantize_call(m)), m);
  }
}

TEST(CudaVsCpu, AllHalfAndBf16CodesAsInput) {
  FUSTEST_REQUIRE_CUDA();
  std::vector<uint8_t> bytes(65536 * 2);
  for (uint32_t h = 0; h < 65536; ++h) {
    const uint16_t v = static_cast<uint16_t>(h);
    std::memcpy(&bytes[2 * h], &v, 2);
  }
  for (fus_dtype in_dt : {FUS_FLOAT16, FUS_BFLOAT16}) {
    HostMatrix in;
    in.dtype = in_dt;
    in.rows = 256;
    in.cols = 256;
    in.bytes = bytes;
    for (fus_dtype fmt : kFormats) {
      SCOPED_TRACE(std::string(fmt_name(in_dt)) + " -> " + fmt_name(fmt));
      for (float scale : {1.0f, 0.0078125f, 3.0f}) {
        QuantizeSetup s{in_dt, 256, 256, fmt, FUS_SCALING_PER_TENSOR};
        s.scale = scale;
        expect_same_quantize(run_both(quantize_buffers(in, s), quantize_call(s)), s);
      }
      QuantizeSetup m{in_dt, 256, 256, fmt, FUS_SCALING_MXFP8};
      expect_same_quantize(run_both(quantize_buffers(in, m), quantize_call(m)), m);
    }
  }
}

// Dequantize outputs: bits equal, NaN outputs included.
TEST(CudaVsCpu, DequantizeAllCodesEachFormatAndOutputType) {
  FUSTEST_REQUIRE_CUDA();
  const int64_t rows = 64, cols = 256;
  std::vector<uint8_t> q(rows * cols);
  for (size_t i = 0; i < q.size(); ++i) q[i] = static_cast<uint8_t>((i * 7 + i / 256) & 0xff);
  std::vector<uint8_t> rs(rows * 8), cs(2 * cols);
  for (size_t i = 0; i < rs.size(); ++i) rs[i] = static_cast<uint8_t>((i * 37) & 0xff);
  for (size_t i = 0; i < cs.size(); ++i) cs[i] = static_cast<uint8_t>((i * 53 + 1) & 0xff);
  for (fus_dtype fmt : kFormats) {
    for (fus_dtype out_dt : kHpTypes) {
      for (fus_scaling_mode mode : {FUS_SCALING_PER_TENSOR, FUS_SCALING_MXFP8}) {
        for (int cw : {0, 1}) {
          SCOPED_TRACE(std::string(fmt_name(fmt)) + " -> " + fmt_name(out_dt) +
                       (mode ? " mxfp8" : " per-tensor") + (cw ? " columnwise" : " rowwise"));
          Buffers d;
          d.add(q);
          d.add(q);
          if (mode == FUS_SCALING_PER_TENSOR) {
            d.add(std::vector<float>{0.3f});
            d.add_filled(0);
          } else {
            d.add(rs);
            d.add(cs);
          }
          d.add_filled(static_cast<size_t>(rows * cols) * fus_dtype_size(out_dt));
          DequantizeSetup ds{fmt, mode, rows, cols, cw, out_dt};
          DualResult r = run_both(d, dequantize_call(ds));
          ASSERT_EQ(r.cpu_status, FUS_SUCCESS);
          ASSERT_EQ(r.cuda_status, FUS_SUCCESS) << fus_last_error();
          int bad = 0;
          for (size_t i = 0; i < static_cast<size_t>(rows * cols); ++i) {
            if (stored_bits(r.cpu.b[kDOut], out_dt, i) != stored_bits(r.cuda.b[kDOut], out_dt, i) &&
                ++bad <= 8)
              ADD_FAILURE() << "element " << i << ": cpu "
                            << hex(stored_bits(r.cpu.b[kDOut], out_dt, i)) << " cuda "
                            << hex(stored_bits(r.cuda.b[kDOut], out_dt, i));
          }
          EXPECT_EQ(bad, 0);
        }
      }
    }
  }
}

// Transpose: the CUDA bytes equal the CPU bytes, over aligned (16-byte pieces), unaligned and
// degenerate shapes, and with data pointers off the 16-byte alignment.
class CudaVsCpuTransposeTest : public ::testing::TestWithParam<TransposeParam> {};

TEST_P(CudaVsCpuTransposeTest, SameBytes) {
  FUSTEST_REQUIRE_CUDA();
  const auto [shape, fmt] = GetParam();
  const auto [rows, cols] = shape;
  for (const auto& [in_off, out_off] :
       {std::pair<int, int>{0, 0}, {1, 0}, {0, 1}, {3, 5}, {16, 32}}) {
    SCOPED_TRACE("offsets " + std::to_string(in_off) + ", " + std::to_string(out_off));
    const TransposeSetup s{rows, cols, fmt, in_off, out_off};
    const DualResult r =
        run_both(transpose_buffers(s, static_cast<uint32_t>(rows * 7 + cols)), transpose_call(s));
    ASSERT_EQ(r.cpu_status, FUS_SUCCESS) << fus_last_error();
    ASSERT_EQ(r.cuda_status, FUS_SUCCESS) << fus_last_error();
    EXPECT_TRUE(same_bits<uint8_t>(r.cpu, r.cuda, 1, "output"));
    EXPECT_TRUE(is_transpose(r.cuda, s));
  }
}

const std::vector<Shape> kCudaTransposeShapes = {{1, 1},     {256, 512}, {129, 77},   {4096, 16},
                                                 {16, 4096}, {1, 4097},  {4097, 1},   {127, 128},
                                                 {128, 127}, {144, 272}, {255, 1023}, {0, 5}};

INSTANTIATE_TEST_SUITE_P(Shapes, CudaVsCpuTransposeTest,
                         ::testing::Combine(::testing::ValuesIn(kCudaTransposeShapes),
                                            ::testing::ValuesIn(kFormats)),
                         TransposeParamName);

// More tiles than resident blocks: every block walks several, full and partial (1040 = 8 * 128 +
// 16 rows, 16400 = 128 * 128 + 16 columns), on the 16-byte path.
TEST(CudaVsCpu, TransposeSeveralTilesPerBlock) {
  FUSTEST_REQUIRE_CUDA();
  const TransposeSetup s{1040, 16400, kE4M3};
  const DualResult r = run_both(transpose_buffers(s, 17), transpose_call(s));
  ASSERT_EQ(r.cpu_status, FUS_SUCCESS) << fus_last_error();
  ASSERT_EQ(r.cuda_status, FUS_SUCCESS) << fus_last_error();
  EXPECT_TRUE(same_bits<uint8_t>(r.cpu, r.cuda, 1, "output"));
  EXPECT_TRUE(is_transpose(r.cuda, s));
}

#if defined(FUSIBLE_WITH_CUDA)
// The CUDA backend honours ctx->stream.
TEST(CudaVsCpu, NonDefaultStream) {
  FUSTEST_REQUIRE_CUDA();
  const int64_t rows = 300, cols = 517;
  HostMatrix in(FUS_BFLOAT16, rows, cols, random_values(rows * cols, 77));
  QuantizeSetup s{FUS_BFLOAT16, rows, cols, kE4M3, FUS_SCALING_PER_TENSOR};
  Buffers cpu = quantize_buffers(in, s);
  ASSERT_EQ(run_cpu(cpu, quantize_call(s, 0)), FUS_SUCCESS);
  Buffers dev = quantize_buffers(in, s);
  ASSERT_EQ(run_cuda(dev, quantize_call(s, 0), /*own_stream=*/true), FUS_SUCCESS)
      << fus_last_error();
  for (int slot : {kRow, kCol, kRowS, kScale, kAmax})
    EXPECT_EQ(dev.b[slot], cpu.b[slot]) << "slot " << slot;
}

// The transpose honours ctx->stream too.
TEST(CudaVsCpu, TransposeOnNonDefaultStream) {
  FUSTEST_REQUIRE_CUDA();
  const int64_t rows = 384, cols = 1040;
  const TransposeSetup s{rows, cols, kE5M2};
  Buffers cpu = transpose_buffers(s, 91);
  ASSERT_EQ(run_cpu(cpu, transpose_call(s)), FUS_SUCCESS) << fus_last_error();
  Buffers dev = transpose_buffers(s, 91);
  ASSERT_EQ(run_cuda(dev, transpose_call(s), /*own_stream=*/true), FUS_SUCCESS) << fus_last_error();
  EXPECT_TRUE(same_bits<uint8_t>(cpu, dev, 1, "output"));
  EXPECT_TRUE(is_transpose(dev, s));
}
#endif

INSTANTIATE_TEST_SUITE_P(Fp8, Fp8FormatTest, ::testing::ValuesIn(kFormats), FormatName);

}  // namespace

// ---- amax_accumulate ---------------------------------------------------------------------------

namespace {

// A cast of x [rows, cols] in `mode` (rowwise copy; scale 1) writing or accumulating into *amax.
fus_status accumulate_cast(const std::vector<float>& x, int64_t rows, int64_t cols,
                           fus_scaling_mode mode, float* amax, int accumulate,
                           std::vector<uint8_t>* bytes) {
  static std::vector<float> scales(4096);
  float scale = 1.0f;
  bytes->assign(static_cast<size_t>(rows * cols), 0);
  const fus_tensor in{x.empty() ? nullptr : const_cast<float*>(x.data()), FUS_FLOAT32, rows, cols};
  fus_quantized q{mode,
                  FUS_FLOAT8_E4M3,
                  rows,
                  cols,
                  bytes->empty() ? nullptr : bytes->data(),
                  nullptr,
                  scales.data(),
                  nullptr,
                  &scale,
                  amax,
                  0,
                  0.0f,
                  accumulate};
  const fus_context ctx = cpu_ctx();
  return fus_quantize(&in, &q, &ctx);
}

}  // namespace

TEST(AmaxAccumulate, MaxCombinesIntoPresetValueOnTheBitsInEveryMode) {
  const int64_t rows = 7, cols = 33;
  std::vector<float> x(static_cast<size_t>(rows * cols));
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(static_cast<int>(i % 13) - 6) / 4;
  for (fus_scaling_mode mode :
       {FUS_SCALING_PER_TENSOR, FUS_SCALING_MXFP8, FUS_SCALING_BLOCK_1D, FUS_SCALING_BLOCK_2D}) {
    float own = -1.0f;
    std::vector<uint8_t> ref, got;
    ASSERT_EQ(accumulate_cast(x, rows, cols, mode, &own, 0, &ref), FUS_SUCCESS) << fus_last_error();
    EXPECT_EQ(own, 1.5f);
    // Smaller, larger, NaN (either sign bit clear), inf and zero presets.
    for (float preset : {0.0f, 0.5f, 1.5f, 4.0f, inf(), qnan(), u2f(0x7fa00001u)}) {
      float amax = preset;
      ASSERT_EQ(accumulate_cast(x, rows, cols, mode, &amax, 1, &got), FUS_SUCCESS)
          << fus_last_error();
      EXPECT_EQ(f2u(amax), std::max(f2u(preset), f2u(own))) << mode << " " << preset;
      EXPECT_EQ(got, ref);  // the cast itself is unchanged
    }
  }
  // A NaN in x wins over any finite preset, as the reset-then-max path's.
  x[5] = -qnan();
  float amax = 3.0f;
  std::vector<uint8_t> got;
  ASSERT_EQ(accumulate_cast(x, rows, cols, FUS_SCALING_PER_TENSOR, &amax, 1, &got), FUS_SUCCESS);
  EXPECT_EQ(f2u(amax), 0x7fc00000u);
  // Two casts accumulate (micro-batches of one step): the max over both.
  std::vector<float> small(x.size(), 0.25f);
  amax = 0.0f;
  ASSERT_EQ(accumulate_cast(small, rows, cols, FUS_SCALING_PER_TENSOR, &amax, 1, &got),
            FUS_SUCCESS);
  x[5] = 2.0f;
  ASSERT_EQ(accumulate_cast(x, rows, cols, FUS_SCALING_PER_TENSOR, &amax, 1, &got), FUS_SUCCESS);
  EXPECT_EQ(amax, 2.0f);
  ASSERT_EQ(accumulate_cast(small, rows, cols, FUS_SCALING_PER_TENSOR, &amax, 1, &got),
            FUS_SUCCESS);
  EXPECT_EQ(amax, 2.0f);
}

TEST(AmaxAccumulate, EmptyInputLeavesThePresetAndOverwriteWritesZero) {
  std::vector<float> none;
  std::vector<uint8_t> got;
  float amax = 0.75f;
  ASSERT_EQ(accumulate_cast(none, 0, 8, FUS_SCALING_PER_TENSOR, &amax, 1, &got), FUS_SUCCESS);
  EXPECT_EQ(amax, 0.75f);
  ASSERT_EQ(accumulate_cast(none, 0, 8, FUS_SCALING_PER_TENSOR, &amax, 0, &got), FUS_SUCCESS);
  EXPECT_EQ(amax, 0.0f);
}

TEST(AmaxAccumulate, BadFlagNullAmaxAndCurrentScalingAreRejected) {
  std::vector<float> x(16, 1.0f);
  std::vector<uint8_t> got;
  float amax = 0.0f;
  EXPECT_EQ(accumulate_cast(x, 4, 4, FUS_SCALING_PER_TENSOR, &amax, 2, &got),
            FUS_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fus_last_error()).find("amax_accumulate must be 0 or 1"),
            std::string::npos);
  EXPECT_EQ(accumulate_cast(x, 4, 4, FUS_SCALING_PER_TENSOR, nullptr, 1, &got),
            FUS_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fus_last_error()).find("amax is NULL"), std::string::npos);

  float scale = 1.0f, scale_inv = 0.0f;
  std::vector<uint8_t> data(16);
  const fus_tensor in{x.data(), FUS_FLOAT32, 4, 4};
  fus_quantized q =
      per_tensor_out(FUS_FLOAT8_E4M3, 4, 4, data.data(), nullptr, &scale_inv, &scale, &amax, 1);
  const fus_context ctx = cpu_ctx();
  EXPECT_EQ(fus_quantize_current_scaling(&in, &q, 0, &ctx), FUS_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fus_last_error()).find("amax_accumulate must be 0"), std::string::npos);
  EXPECT_EQ(fus_quantize_grouped(&in, &q, 1, 1, 0, &ctx), FUS_ERROR_INVALID_ARGUMENT);
}

TEST(AmaxAccumulate, GroupedDelayedCastsAccumulatePerGroup) {
  const int64_t rows = 5, cols = 16;
  std::vector<float> a(rows * cols, 0.5f), b(rows * cols, -3.0f);
  std::vector<uint8_t> da(rows * cols), db(rows * cols);
  float scale[2] = {1.0f, 1.0f}, scale_inv[2] = {0.0f, 0.0f};
  float hist[4] = {1.0f, -7.0f, 2.0f, -7.0f};  // groups' slots at a stride of 2
  const fus_tensor in[2] = {{a.data(), FUS_FLOAT32, rows, cols},
                            {b.data(), FUS_FLOAT32, rows, cols}};
  fus_quantized q[2] = {{FUS_SCALING_PER_TENSOR, FUS_FLOAT8_E4M3, rows, cols, da.data(), nullptr,
                         &scale_inv[0], nullptr, &scale[0], &hist[0], 0, 0.0f, 1},
                        {FUS_SCALING_PER_TENSOR, FUS_FLOAT8_E4M3, rows, cols, db.data(), nullptr,
                         &scale_inv[1], nullptr, &scale[1], &hist[2], 0, 0.0f, 1}};
  const fus_context ctx = cpu_ctx();
  ASSERT_EQ(fus_quantize_grouped(in, q, 2, 0, 0, &ctx), FUS_SUCCESS) << fus_last_error();
  EXPECT_EQ(hist[0], 1.0f);  // max(1, 0.5)
  EXPECT_EQ(hist[2], 3.0f);  // max(2, 3)
  EXPECT_EQ(hist[1], -7.0f);
  EXPECT_EQ(hist[3], -7.0f);
}
