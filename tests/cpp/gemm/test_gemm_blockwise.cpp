// Blockwise FP8 GEMMs (fusible/gemm.h, a_scaling / b_scaling): the CPU backend equals the GEMM of
// the dequantized operands computed in double, with the documented scale layouts (1x128 "M-major",
// 128x128 with its row stride padded to 4), and the cuBLASLt rules are refused on every backend.
#include <cmath>
#include <random>
#include <tuple>
#include <vector>

#include "fusible/gemm.h"
#include "test_utils.h"

namespace fustest {
namespace {

constexpr int64_t B = FUS_FP8_BLOCK;

struct Operand {
  std::vector<uint8_t> q;  // E4M3 codes [R, K]
  std::vector<float> s;    // block scale_inv in the GEMM layout
};

// Random E4M3 codes and power-of-two block scales for an operand [R, K].
Operand make_operand(int64_t R, int64_t K, fus_gemm_scaling sc, uint32_t seed) {
  std::mt19937 rng(seed);
  std::uniform_int_distribution<int> code(0, 0x7d);  // finite, not the max, either sign below
  std::uniform_int_distribution<int> sign(0, 1), expo(-8, 8);
  Operand o;
  o.q.resize(static_cast<size_t>(R * K));
  for (auto& c : o.q) c = static_cast<uint8_t>(code(rng) | (sign(rng) ? 0x80 : 0));
  const int64_t nk = (K + B - 1) / B;
  const size_t n = sc == FUS_GEMM_SCALING_BLOCK_1D
                       ? static_cast<size_t>(nk * R)
                       : static_cast<size_t>((R + B - 1) / B * ((nk + 3) / 4 * 4));
  o.s.assign(n, -1.0f);  // padding entries are never read: a wrong read shows
  for (auto& v : o.s) v = std::ldexp(1.0f, expo(rng));
  return o;
}

double value(const Operand& o, fus_gemm_scaling sc, int64_t R, int64_t K, int64_t r, int64_t k) {
  const int64_t nk = (K + B - 1) / B;
  const float si = sc == FUS_GEMM_SCALING_BLOCK_1D
                       ? o.s[static_cast<size_t>((k / B) * R + r)]
                       : o.s[static_cast<size_t>((r / B) * ((nk + 3) / 4 * 4) + k / B)];
  return ref::fp8_decode(o.q[static_cast<size_t>(r * K + k)], FUS_FLOAT8_E4M3) * si;
}

fus_status run(const Operand& a, fus_gemm_scaling sa, const Operand& b, fus_gemm_scaling sb,
               int64_t m, int64_t n, int64_t k, std::vector<float>& d) {
  d.assign(static_cast<size_t>(m * n), 0.0f);
  fus_gemm_args args{};
  args.a = fus_tensor{const_cast<uint8_t*>(a.q.data()), FUS_FLOAT8_E4M3, m, k};
  args.b = fus_tensor{const_cast<uint8_t*>(b.q.data()), FUS_FLOAT8_E4M3, n, k};
  args.transa = 0;
  args.transb = 1;
  args.a_scale_inv = a.s.data();
  args.b_scale_inv = b.s.data();
  args.a_scaling = sa;
  args.b_scaling = sb;
  args.d = fus_tensor{d.data(), FUS_FLOAT32, m, n};
  args.alpha = 1.0f;
  const fus_context ctx = cpu_ctx();
  return fus_gemm(&args, &ctx);
}

TEST(GemmBlockwise, CpuIsTheDequantizedGemm) {
  const fus_gemm_scaling one = FUS_GEMM_SCALING_BLOCK_1D, two = FUS_GEMM_SCALING_BLOCK_2D;
  const fus_gemm_scaling pairs[][2] = {{one, one}, {one, two}, {two, one}};
  for (const auto& p : pairs) {
    for (const auto [m, n, k] :
         {std::tuple<int64_t, int64_t, int64_t>{4, 4, 16}, {132, 260, 144}, {16, 8, 656}}) {
      const Operand a = make_operand(m, k, p[0], 1), b = make_operand(n, k, p[1], 2);
      std::vector<float> d;
      ASSERT_EQ(run(a, p[0], b, p[1], m, n, k, d), FUS_SUCCESS) << fus_last_error();
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) {
          double ref = 0.0, mag = 0.0;
          for (int64_t t = 0; t < k; ++t) {
            const double x = value(a, p[0], m, k, i, t) * value(b, p[1], n, k, j, t);
            ref += x;
            mag += std::fabs(x);
          }
          ASSERT_NEAR(d[static_cast<size_t>(i * n + j)], ref, 1e-6 * mag + 1e-30) << i << "," << j;
        }
    }
  }
}

TEST(GemmBlockwise, RefusesWhatCublasLtCannotRun) {
  const fus_gemm_scaling one = FUS_GEMM_SCALING_BLOCK_1D, two = FUS_GEMM_SCALING_BLOCK_2D;
  std::vector<float> d;
  {
    const Operand a = make_operand(16, 32, two, 1), b = make_operand(16, 32, two, 2);
    EXPECT_TRUE(is_error(run(a, two, b, two, 16, 16, 32, d), FUS_ERROR_UNSUPPORTED,
                         {"fus_gemm", "128x128"}));
  }
  {
    const Operand a = make_operand(6, 32, one, 1), b = make_operand(16, 32, two, 2);
    EXPECT_TRUE(is_error(run(a, one, b, two, 6, 16, 32, d), FUS_ERROR_INVALID_ARGUMENT,
                         {"fus_gemm", "multiples of 4", "M = 6"}));
  }
  {
    const Operand a = make_operand(16, 24, one, 1), b = make_operand(16, 24, two, 2);
    EXPECT_TRUE(is_error(run(a, one, b, two, 16, 16, 24, d), FUS_ERROR_INVALID_ARGUMENT,
                         {"fus_gemm", "multiple of 16", "K = 24"}));
  }
  {
    const Operand a = make_operand(16, 32, one, 1), b = make_operand(16, 32, one, 2);
    fus_gemm_args args{};
    args.a = fus_tensor{const_cast<uint8_t*>(a.q.data()), FUS_FLOAT8_E4M3, 16, 32};
    args.b = fus_tensor{const_cast<uint8_t*>(b.q.data()), FUS_FLOAT8_E4M3, 16, 32};
    args.transb = 1;
    args.a_scale_inv = a.s.data();
    args.b_scale_inv = b.s.data();
    args.a_scaling = one;  // b per tensor: no mixing
    std::vector<float> out(256);
    args.d = fus_tensor{out.data(), FUS_FLOAT32, 16, 16};
    args.alpha = 1.0f;
    const fus_context ctx = cpu_ctx();
    EXPECT_TRUE(is_error(fus_gemm(&args, &ctx), FUS_ERROR_UNSUPPORTED, {"both operands"}));
  }
}

}  // namespace
}  // namespace fustest
