// Blockwise FP8 casts (fus_quantize_blockwise, fusible/quantize.h): the CPU backend against an
// independent reference of the rule (double arithmetic and the reference encoder of
// test_utils.h), both copies, both block shapes, partial edge blocks, scale edge cases, the
// dequantize round trip, argument validation, and CUDA == CPU bit for bit (skipped without a GPU):
// every input dtype, both formats, each usage, edge shapes and misaligned pointers, the amax, and
// the dequantize of every code.
#include <cmath>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "test_utils.h"

namespace fustest {
namespace {

constexpr int64_t B = FUS_FP8_BLOCK;

// The reference scale of one block: the per-tensor rule on max(amax, eps), then rounded down to a
// power of two when pow2.
float ref_block_scale(float amax, float fmax, float eps, bool pow2) {
  const float m = std::isnan(amax) ? amax : std::max(amax, eps);
  float s = ref::scale_from_amax(m, fmax, 0, 1.0f);
  if (pow2) s = std::ldexp(1.0f, std::ilogb(s));
  return s;
}

struct RefCopy {
  std::vector<uint8_t> q;
  std::vector<float> scale_inv;
};

// The reference copy [R, C] of the matrix m (row-major R x C), blocks along its rows.
RefCopy ref_copy(const std::vector<float>& m, int64_t R, int64_t C, bool two_d, fus_dtype fp8,
                 bool pow2, float eps) {
  const float fmax = fus_fp8_max(fp8);
  const int64_t nr = (R + B - 1) / B, nc = (C + B - 1) / B;
  RefCopy out;
  out.q.resize(static_cast<size_t>(R * C));
  out.scale_inv.resize(static_cast<size_t>(two_d ? nr * nc : nc * R));
  auto block_amax = [&](int64_t r0, int64_t r1, int64_t c0, int64_t c1) {
    float a = 0.0f;
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t c = c0; c < c1; ++c) {
        const float v = std::fabs(m[static_cast<size_t>(r * C + c)]);
        if (std::isnan(v)) return v;
        a = std::max(a, v);
      }
    return a;
  };
  for (int64_t r = 0; r < R; ++r)
    for (int64_t b = 0; b < nc; ++b) {
      const int64_t c0 = b * B, c1 = std::min(C, c0 + B);
      const float amax = two_d ? block_amax((r / B) * B, std::min(R, (r / B) * B + B), c0, c1)
                               : block_amax(r, r + 1, c0, c1);
      const float s = ref_block_scale(amax, fmax, eps, pow2);
      if (two_d)
        out.scale_inv[static_cast<size_t>((r / B) * nc + b)] = 1.0f / s;
      else
        out.scale_inv[static_cast<size_t>(b * R + r)] = 1.0f / s;
      for (int64_t c = c0; c < c1; ++c) {
        const float x = m[static_cast<size_t>(r * C + c)];
        const float p = std::isnan(x) ? x : static_cast<float>(double(x) * double(s));
        out.q[static_cast<size_t>(r * C + c)] = ref::fp8_encode(p, fp8);
      }
    }
  return out;
}

std::vector<float> transpose(const std::vector<float>& m, int64_t R, int64_t C) {
  std::vector<float> t(m.size());
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c)
      t[static_cast<size_t>(c * R + r)] = m[static_cast<size_t>(r * C + c)];
  return t;
}

// Buffers: 0 input (fp32), 1 rowwise data, 2 columnwise data, 3 rowwise scales, 4 columnwise
// scales, 5 amax.
Buffers make_buffers(const std::vector<float>& x, int64_t rows, int64_t cols, bool two_d) {
  Buffers b;
  b.add(x);
  const size_t n = static_cast<size_t>(rows * cols);
  b.add_filled(n);
  b.add_filled(n);
  const int64_t nr = (rows + B - 1) / B, nc = (cols + B - 1) / B;
  b.add_filled(4 * static_cast<size_t>(two_d ? nr * nc : nc * rows));
  b.add_filled(4 * static_cast<size_t>(two_d ? nc * nr : nr * cols));
  b.add_filled(4);
  return b;
}

// The fus_quantized over make_buffers' buffers (power_2_scale / amax_epsilon as given).
fus_quantized block_q(const std::vector<void*>& p, int64_t rows, int64_t cols, bool two_d,
                      fus_dtype fp8, int pow2 = 0, float eps = 0.0f) {
  return fus_quantized{two_d ? FUS_SCALING_BLOCK_2D : FUS_SCALING_BLOCK_1D,
                       fp8,
                       rows,
                       cols,
                       p[1],
                       p[2],
                       p[3],
                       p[4],
                       nullptr,
                       static_cast<float*>(p[5]),
                       pow2,
                       eps};
}

ApiCall quantize_call(int64_t rows, int64_t cols, bool two_d, fus_dtype fp8, bool pow2, float eps) {
  return [=](const std::vector<void*>& p, const fus_context& ctx) {
    fus_tensor in{p[0], FUS_FLOAT32, rows, cols};
    fus_quantized q = block_q(p, rows, cols, two_d, fp8);
    return fus_quantize_blockwise(&in, &q, pow2 ? 1 : 0, eps, &ctx);
  };
}

using Case = std::tuple<std::pair<int64_t, int64_t>, bool, fus_dtype, bool>;

class BlockwiseTest : public ::testing::TestWithParam<Case> {};

TEST_P(BlockwiseTest, CpuMatchesReferenceBothCopies) {
  const auto [shape, two_d, fp8, pow2] = GetParam();
  const auto [rows, cols] = shape;
  std::vector<float> x = random_values(static_cast<size_t>(rows * cols), 7u + rows * 31 + cols);
  Buffers b = make_buffers(x, rows, cols, two_d);
  ASSERT_EQ(run_cpu(b, quantize_call(rows, cols, two_d, fp8, pow2, 0.0f)), FUS_SUCCESS)
      << fus_last_error();
  const RefCopy row = ref_copy(x, rows, cols, two_d, fp8, pow2, 0.0f);
  const RefCopy col = ref_copy(transpose(x, rows, cols), cols, rows, two_d, fp8, pow2, 0.0f);
  EXPECT_EQ(b.get<uint8_t>(1), row.q);
  EXPECT_EQ(b.get<uint8_t>(2), col.q);
  const auto s = b.get<float>(3), cs = b.get<float>(4);
  ASSERT_EQ(s.size(), row.scale_inv.size());
  ASSERT_EQ(cs.size(), col.scale_inv.size());
  for (size_t i = 0; i < s.size(); ++i) EXPECT_EQ(f2u(s[i]), f2u(row.scale_inv[i])) << i;
  for (size_t i = 0; i < cs.size(); ++i) EXPECT_EQ(f2u(cs[i]), f2u(col.scale_inv[i])) << i;
  float amax = 0.0f;
  for (float v : x) amax = std::max(amax, std::fabs(v));
  EXPECT_EQ(f2u(b.get<float>(5)[0]), f2u(amax));
}

TEST_P(BlockwiseTest, CudaEqualsCpuBitForBit) {
  FUSTEST_REQUIRE_CUDA();
  const auto [shape, two_d, fp8, pow2] = GetParam();
  const auto [rows, cols] = shape;
  std::vector<float> x = random_values(static_cast<size_t>(rows * cols), 11u + rows + cols);
  const DualResult r =
      run_both(make_buffers(x, rows, cols, two_d), quantize_call(rows, cols, two_d, fp8, pow2, 0));
  ASSERT_EQ(r.cpu_status, FUS_SUCCESS);
  ASSERT_EQ(r.cuda_status, FUS_SUCCESS) << fus_last_error();
  for (int i = 1; i <= 5; ++i) EXPECT_TRUE(same_bits<uint8_t>(r.cpu, r.cuda, i, "buffer"));
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, BlockwiseTest,
    ::testing::Combine(::testing::Values(std::pair<int64_t, int64_t>{1, 1},
                                         std::pair<int64_t, int64_t>{7, 13},
                                         std::pair<int64_t, int64_t>{1, 300},
                                         std::pair<int64_t, int64_t>{128, 128},
                                         std::pair<int64_t, int64_t>{127, 255},
                                         std::pair<int64_t, int64_t>{130, 257},
                                         std::pair<int64_t, int64_t>{257, 131}),
                       ::testing::Bool(), ::testing::Values(FUS_FLOAT8_E4M3, FUS_FLOAT8_E5M2),
                       ::testing::Bool()));

// ---- CUDA == CPU: every input dtype, both formats, each usage, misaligned pointers ----------

// Random values over many binades with specials mixed in: zeros of both signs, NaNs of either sign
// with payloads, infinities, fp32 subnormals, values in the fp16 subnormal range and values that
// saturate either FP8 format (after the block scale of a block's other elements).
std::vector<float> special_values(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_int_distribution<int> ed(-20, 20), pick(0, 999);
  std::vector<float> v(n);
  for (auto& x : v) {
    const int p = pick(rng);
    x = std::ldexp(nd(rng), ed(rng));
    if (p < 10)
      x = 0.0f;
    else if (p < 15)
      x = -0.0f;
    else if (p < 17)
      x = u2f(0x7fc00000u | (rng() & 0x3fffffu) | ((rng() & 1u) << 31));
    else if (p < 19)
      x = (rng() & 1u) ? inf() : -inf();
    else if (p < 25)
      x = std::ldexp(nd(rng), -140);
    else if (p < 31)
      x = std::ldexp(nd(rng), -20);
    else if (p < 35)
      x = std::ldexp(nd(rng), 100);
  }
  return v;
}

// One blockwise cast as the CUDA kernels see it: which copies, and pointer offsets (input by
// in_off elements, both code buffers by out_off bytes) that turn the 16-byte paths off.
struct CastCase {
  int64_t rows, cols;
  fus_dtype in_dt, fp8;
  bool two_d, row, col;
  int in_off, out_off;
};

// Buffers: 0 input, 1 rowwise data, 2 columnwise data, 3 rowwise scales, 4 columnwise scales,
// 5 amax (every output filled, so an element one backend skips differs).
Buffers cast_case_buffers(const HostMatrix& in, const CastCase& c) {
  Buffers b;
  const size_t es = fus_dtype_size(c.in_dt);
  std::vector<uint8_t> x(static_cast<size_t>(c.in_off) * es, 0);
  x.insert(x.end(), in.bytes.begin(), in.bytes.end());
  b.add_bytes(x);
  const size_t n = static_cast<size_t>(c.rows * c.cols) + static_cast<size_t>(c.out_off);
  b.add_filled(c.row ? n : 0);
  b.add_filled(c.col ? n : 0);
  const int64_t nr = (c.rows + B - 1) / B, nc = (c.cols + B - 1) / B;
  b.add_filled(c.row ? 4 * static_cast<size_t>(c.two_d ? nr * nc : nc * c.rows) : 0);
  b.add_filled(c.col ? 4 * static_cast<size_t>(c.two_d ? nc * nr : nr * c.cols) : 0);
  b.add_filled(4);
  return b;
}

ApiCall cast_case_call(const CastCase& c) {
  return [=](const std::vector<void*>& p, const fus_context& ctx) {
    auto at = [](void* base, size_t off) {
      return base ? static_cast<void*>(static_cast<uint8_t*>(base) + off) : nullptr;
    };
    fus_tensor in{at(p[0], c.in_off * fus_dtype_size(c.in_dt)), c.in_dt, c.rows, c.cols};
    fus_quantized q{c.two_d ? FUS_SCALING_BLOCK_2D : FUS_SCALING_BLOCK_1D,
                    c.fp8,
                    c.rows,
                    c.cols,
                    at(p[1], c.out_off),
                    at(p[2], c.out_off),
                    p[3],
                    p[4],
                    nullptr,
                    static_cast<float*>(p[5])};
    return fus_quantize_blockwise(&in, &q, 1, 0.0f, &ctx);
  };
}

using CudaCase = std::tuple<std::pair<int64_t, int64_t>, fus_dtype, fus_dtype, bool>;

class BlockwiseCudaTest : public ::testing::TestWithParam<CudaCase> {};

TEST_P(BlockwiseCudaTest, EqualsCpuEveryUsageAndAlignment) {
  FUSTEST_REQUIRE_CUDA();
  const auto [shape, in_dt, fp8, two_d] = GetParam();
  const auto [rows, cols] = shape;
  const size_t n = static_cast<size_t>(rows * cols);
  for (bool specials : {false, true}) {
    const uint32_t seed = static_cast<uint32_t>(rows * 7 + cols * 3 + (specials ? 1 : 0));
    const HostMatrix in(in_dt, rows, cols,
                        specials ? special_values(n, seed) : random_values(n, seed));
    for (int usage = 0; usage < 3; ++usage)
      for (int misaligned = 0; misaligned < 2; ++misaligned) {
        const CastCase c{rows,       cols,       in_dt,      fp8,       two_d,
                         usage != 2, usage != 1, misaligned, misaligned};
        SCOPED_TRACE(std::string(specials ? "special" : "random") + " values, " +
                     (usage == 0   ? "both copies"
                      : usage == 1 ? "rowwise only"
                                   : "columnwise only") +
                     (misaligned ? ", misaligned pointers" : ""));
        const DualResult r = run_both(cast_case_buffers(in, c), cast_case_call(c));
        ASSERT_EQ(r.cpu_status, FUS_SUCCESS) << fus_last_error();
        ASSERT_EQ(r.cuda_status, FUS_SUCCESS) << fus_last_error();
        for (int i = 1; i <= 5; ++i)
          EXPECT_TRUE(same_bits<uint8_t>(r.cpu, r.cuda, i, "buffer")) << i;
      }
  }
}

// 1 row, primes, 2^n - 1, widths below one 16-byte chunk (< 4 fp32 / < 8 16-bit elements) and
// not a multiple of it, widths a multiple of 8 but not 16, rows % 16 != 0 (no 16-byte stores of
// the transposed copy), full tiles.
INSTANTIATE_TEST_SUITE_P(
    Shapes, BlockwiseCudaTest,
    ::testing::Combine(
        ::testing::Values(
            std::pair<int64_t, int64_t>{1, 1}, std::pair<int64_t, int64_t>{1, 4096},
            std::pair<int64_t, int64_t>{5, 3}, std::pair<int64_t, int64_t>{17, 7},
            std::pair<int64_t, int64_t>{31, 127}, std::pair<int64_t, int64_t>{300, 2},
            std::pair<int64_t, int64_t>{1000, 12}, std::pair<int64_t, int64_t>{136, 200},
            std::pair<int64_t, int64_t>{144, 264}, std::pair<int64_t, int64_t>{128, 128},
            std::pair<int64_t, int64_t>{256, 384}, std::pair<int64_t, int64_t>{255, 513},
            std::pair<int64_t, int64_t>{513, 1031}),
        ::testing::Values(FUS_FLOAT32, FUS_BFLOAT16, FUS_FLOAT16),
        ::testing::Values(FUS_FLOAT8_E4M3, FUS_FLOAT8_E5M2), ::testing::Bool()));

// Dequantize of random codes (every code, NaN codes included) with scales that include 0, inf,
// NaN and negative values, into every output dtype; 16-byte paths (C % 16 == 0, aligned) and the
// element path (odd C, or the codes misaligned by a few bytes).
TEST(BlockwiseCuda, DequantizeEqualsCpu) {
  FUSTEST_REQUIRE_CUDA();
  const float specials[] = {1.0f, 0.0f, inf(), qnan(), -2.0f, 1e-30f, 3e38f, 0.75f};
  const std::pair<int64_t, int64_t> shapes[] = {{130, 256}, {3, 200}, {257, 16},
                                                {64, 4096}, {1, 5},   {129, 129}};
  for (const auto& [R, C] : shapes)
    for (fus_dtype fp8 : {FUS_FLOAT8_E4M3, FUS_FLOAT8_E5M2})
      for (bool two_d : {false, true})
        for (int off : {0, 3})
          for (fus_dtype out_dt : {FUS_FLOAT32, FUS_BFLOAT16, FUS_FLOAT16}) {
            SCOPED_TRACE(std::to_string(R) + "x" + std::to_string(C) + " " + fmt_name(fp8) +
                         (two_d ? " 2D" : " 1D") + " offset " + std::to_string(off) + " -> " +
                         fmt_name(out_dt));
            std::mt19937 rng(static_cast<uint32_t>(R * 131 + C + off));
            std::vector<uint8_t> codes(static_cast<size_t>(R * C + off));
            for (auto& b : codes) b = static_cast<uint8_t>(rng());
            const int64_t nb = (C + B - 1) / B, nr = (R + B - 1) / B;
            std::vector<float> s(static_cast<size_t>(two_d ? nr * nb : nb * R));
            for (auto& x : s)
              x = specials[rng() % 8] * std::ldexp(1.0f, static_cast<int>(rng() % 41) - 20);
            Buffers b;
            b.add_bytes(codes);
            b.add(s);
            b.add_filled(static_cast<size_t>(R * C) * fus_dtype_size(out_dt));
            const DualResult r =
                run_both(b, [=](const std::vector<void*>& p, const fus_context& ctx) {
                  fus_quantized q{two_d ? FUS_SCALING_BLOCK_2D : FUS_SCALING_BLOCK_1D,
                                  fp8,
                                  R,
                                  C,
                                  static_cast<uint8_t*>(p[0]) + off,
                                  nullptr,
                                  p[1],
                                  nullptr,
                                  nullptr,
                                  nullptr};
                  fus_tensor o{p[2], out_dt, R, C};
                  return fus_dequantize(&q, 0, &o, &ctx);
                });
            ASSERT_EQ(r.cpu_status, FUS_SUCCESS) << fus_last_error();
            ASSERT_EQ(r.cuda_status, FUS_SUCCESS) << fus_last_error();
            EXPECT_TRUE(same_bits<uint8_t>(r.cpu, r.cuda, 2, "output"));
          }
}

TEST(Blockwise, ScaleEdgeCasesAndEpsilon) {
  // Row 0: zeros and row 2: tiny values (both floored to eps); row 1: an inf (scale 1, saturates).
  const int64_t rows = 3, cols = 128;
  std::vector<float> x(static_cast<size_t>(rows * cols), 0.0f);
  x[128] = inf();
  x[129] = 2.0f;
  for (int64_t c = 0; c < cols; ++c) x[static_cast<size_t>(256 + c)] = 1e-6f;
  Buffers b = make_buffers(x, rows, cols, false);
  ASSERT_EQ(run_cpu(b, quantize_call(rows, cols, false, FUS_FLOAT8_E4M3, true, 1e-3f)),
            FUS_SUCCESS);
  const auto s = b.get<float>(3);
  const auto q = b.get<uint8_t>(1);
  EXPECT_EQ(s[0], std::ldexp(1.0f, -18));
  EXPECT_EQ(s[1], 1.0f);
  EXPECT_EQ(q[128], 0x7e);  // inf saturates to 448
  // eps 1e-3: scale = 2^floor(log2(448 / 1e-3)) = 2^18.
  EXPECT_EQ(s[2], std::ldexp(1.0f, -18));
  const RefCopy ref = ref_copy(x, rows, cols, false, FUS_FLOAT8_E4M3, true, 1e-3f);
  EXPECT_EQ(q, ref.q);
}

TEST(Blockwise, DequantizeRoundTripsBothCopies) {
  const int64_t rows = 130, cols = 257;
  for (bool two_d : {false, true}) {
    std::vector<float> x = random_values(static_cast<size_t>(rows * cols), 3u);
    Buffers b = make_buffers(x, rows, cols, two_d);
    ASSERT_EQ(run_cpu(b, quantize_call(rows, cols, two_d, FUS_FLOAT8_E4M3, true, 0.0f)),
              FUS_SUCCESS);
    for (int columnwise : {0, 1}) {
      std::vector<float> out(static_cast<size_t>(rows * cols));
      const fus_quantized q{two_d ? FUS_SCALING_BLOCK_2D : FUS_SCALING_BLOCK_1D,
                            FUS_FLOAT8_E4M3,
                            rows,
                            cols,
                            b.b[1].data(),
                            b.b[2].data(),
                            b.b[3].data(),
                            b.b[4].data(),
                            nullptr,
                            nullptr,
                            0,
                            0.0f};
      const int64_t R = columnwise ? cols : rows, C = columnwise ? rows : cols;
      fus_tensor o{out.data(), FUS_FLOAT32, R, C};
      const fus_context ctx = cpu_ctx();
      ASSERT_EQ(fus_dequantize(&q, columnwise, &o, &ctx), FUS_SUCCESS) << fus_last_error();
      const auto codes = b.get<uint8_t>(columnwise ? 2 : 1);
      const auto s = b.get<float>(columnwise ? 4 : 3);
      const int64_t nc = (C + B - 1) / B;
      for (int64_t i = 0; i < R; ++i)
        for (int64_t j = 0; j < C; ++j) {
          const float si = two_d ? s[static_cast<size_t>((i / B) * nc + j / B)]
                                 : s[static_cast<size_t>((j / B) * R + i)];
          const double want =
              ref::fp8_decode(codes[static_cast<size_t>(i * C + j)], FUS_FLOAT8_E4M3) * si;
          ASSERT_EQ(out[static_cast<size_t>(i * C + j)], static_cast<float>(want)) << i << "," << j;
        }
    }
  }
}

TEST(Blockwise, QuantizeReadsTheParametersFromOut) {
  // fus_quantize_blockwise(in, out, p, e) is fus_quantize with out->power_2_scale = p and
  // out->amax_epsilon = e: the same bits.
  const int64_t rows = 130, cols = 257;
  std::vector<float> x = random_values(static_cast<size_t>(rows * cols), 5u);
  for (bool two_d : {false, true}) {
    for (bool pow2 : {false, true}) {
      Buffers want = make_buffers(x, rows, cols, two_d), got = want;
      ASSERT_EQ(run_cpu(want, quantize_call(rows, cols, two_d, FUS_FLOAT8_E4M3, pow2, 1e-3f)),
                FUS_SUCCESS);
      auto via_quantize = [&](const std::vector<void*>& p, const fus_context& ctx) {
        fus_tensor in{p[0], FUS_FLOAT32, rows, cols};
        fus_quantized q = block_q(p, rows, cols, two_d, FUS_FLOAT8_E4M3, pow2 ? 1 : 0, 1e-3f);
        return fus_quantize(&in, &q, &ctx);
      };
      ASSERT_EQ(run_cpu(got, via_quantize), FUS_SUCCESS) << fus_last_error();
      for (int i = 1; i <= 5; ++i)
        EXPECT_EQ(want.get<uint8_t>(i), got.get<uint8_t>(i)) << "buffer " << i;
    }
  }
}

TEST(Blockwise, RejectsBadArguments) {
  std::vector<float> x(16, 1.0f);
  Buffers b = make_buffers(x, 4, 4, false);
  EXPECT_TRUE(is_error(run_cpu(b, quantize_call(4, 4, false, FUS_FLOAT8_E4M3, true, -1.0f)),
                       FUS_ERROR_INVALID_ARGUMENT, {"fus_quantize_blockwise", "amax_epsilon"}));
  // fus_quantize reads the parameters from out (power_2_scale must be 0 or 1).
  auto via_quantize = [](const std::vector<void*>& p, const fus_context& ctx) {
    fus_tensor in{p[0], FUS_FLOAT32, 4, 4};
    fus_quantized q = block_q(p, 4, 4, false, FUS_FLOAT8_E4M3, 2);
    q.columnwise_data = q.columnwise_scale_inv = nullptr;
    q.amax = nullptr;
    return fus_quantize(&in, &q, &ctx);
  };
  EXPECT_TRUE(is_error(run_cpu(b, via_quantize), FUS_ERROR_INVALID_ARGUMENT,
                       {"fus_quantize", "power_2_scale"}));
  auto missing_scale = [](const std::vector<void*>& p, const fus_context& ctx) {
    fus_tensor in{p[0], FUS_FLOAT32, 4, 4};
    fus_quantized q = block_q(p, 4, 4, true, FUS_FLOAT8_E4M3);
    q.columnwise_data = q.rowwise_scale_inv = q.columnwise_scale_inv = nullptr;
    q.amax = nullptr;
    return fus_quantize_blockwise(&in, &q, 1, 0.0f, &ctx);
  };
  EXPECT_TRUE(
      is_error(run_cpu(b, missing_scale), FUS_ERROR_INVALID_ARGUMENT, {"rowwise_scale_inv"}));
}

}  // namespace
}  // namespace fustest
