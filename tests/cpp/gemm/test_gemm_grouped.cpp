// fus_gemm_grouped: every problem gives the bits of its own fus_gemm call (FP8 "TN" with bias, as
// GroupedLinear's forward; high precision; M = 0 and K = 0 problems, the latter writing zeros),
// on the CPU backend and, where a CUDA device is present, on the CUDA backend against one
// fus_gemm per problem; validation of every problem before any runs.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "fusible/gemm.h"
#include "test_utils.h"

using namespace fustest;

namespace {

struct Problem {
  int64_t m, n, k;
};

// Per problem: A [m, k], B [n, k], D [m, n], bias [n], a_scale_inv, b_scale_inv (six buffers).
struct GroupedGemm {
  fus_dtype ab, d;
  bool bias;
  std::vector<Problem> probs;
  Buffers bufs;

  GroupedGemm(fus_dtype ab_, fus_dtype d_, bool bias_, std::vector<Problem> p, uint32_t seed)
      : ab(ab_), d(d_), bias(bias_), probs(std::move(p)) {
    const bool fp8 = ab == FUS_FLOAT8_E4M3 || ab == FUS_FLOAT8_E5M2;
    for (size_t i = 0; i < probs.size(); ++i) {
      const auto [m, n, k] = probs[i];
      auto operand = [&](int64_t r, int64_t c, uint32_t s) {
        const auto v = random_values(static_cast<size_t>(r * c), s, -3, 3);
        if (!fp8) return HostMatrix(ab, r, c, v).bytes;
        std::vector<uint8_t> q(v.size());
        for (size_t j = 0; j < v.size(); ++j) q[j] = ref::fp8_encode(v[j], ab);
        return q;
      };
      bufs.add_bytes(operand(m, k, seed + 10 * i));
      bufs.add_bytes(operand(n, k, seed + 10 * i + 1));
      bufs.add_filled(static_cast<size_t>(m * n) * fus_dtype_size(d));
      bufs.add_bytes(
          HostMatrix(d, 1, n, random_values(static_cast<size_t>(n), seed + 3, -2, 2)).bytes);
      bufs.add(std::vector<float>{0.5f + 0.125f * static_cast<float>(i)});
      bufs.add(std::vector<float>{2.0f});
    }
  }

  std::vector<fus_gemm_args> args(const std::vector<void*>& p) const {
    const bool fp8 = ab == FUS_FLOAT8_E4M3 || ab == FUS_FLOAT8_E5M2;
    std::vector<fus_gemm_args> out;
    for (size_t i = 0; i < probs.size(); ++i) {
      const auto [m, n, k] = probs[i];
      const size_t b = 6 * i;
      fus_gemm_args g{};
      g.a = fus_tensor{p[b], ab, m, k};
      g.b = fus_tensor{p[b + 1], ab, n, k};
      g.transa = 0;
      g.transb = 1;
      g.a_scale_inv = fp8 ? static_cast<const float*>(p[b + 4]) : nullptr;
      g.b_scale_inv = fp8 ? static_cast<const float*>(p[b + 5]) : nullptr;
      g.d = fus_tensor{p[b + 2], d, m, n};
      g.alpha = 1.0f;
      g.epilogue = bias ? FUS_GEMM_EPILOGUE_BIAS : FUS_GEMM_EPILOGUE_NONE;
      g.bias = bias ? fus_tensor{p[b + 3], d, 1, n} : fus_tensor{nullptr, FUS_FLOAT32, 0, 0};
      out.push_back(g);
    }
    return out;
  }
  ApiCall call(bool grouped) const {
    return [=, this](const std::vector<void*>& p, const fus_context& ctx) {
      auto a = args(p);
      if (grouped) return fus_gemm_grouped(a.data(), static_cast<int64_t>(a.size()), &ctx);
      for (auto& g : a) {
        const fus_status st = fus_gemm(&g, &ctx);
        if (st != FUS_SUCCESS) return st;
      }
      return FUS_SUCCESS;
    };
  }
};

// Expert-like problems: an empty expert (M = 0), one token, primes; CUDA needs K % 16 for FP8.
const std::vector<Problem> kCpu = {{0, 24, 32}, {1, 24, 32}, {7, 24, 33}, {31, 17, 5}, {13, 24, 0}};
const std::vector<Problem> kCuda = {
    {0, 32, 64}, {1, 32, 64}, {7, 32, 64}, {31, 48, 32}, {64, 32, 0}};

class GemmGrouped : public ::testing::TestWithParam<std::tuple<fus_dtype, fus_dtype, bool>> {};

// The grouped call and one call per problem, on the CUDA backend or the CPU's, write the same
// bytes; grouped.bufs then holds the grouped call's. Wrap in ASSERT_NO_FATAL_FAILURE.
void expect_grouped_equals_one_call_each(GroupedGemm& grouped, bool cuda) {
  auto run = [cuda](Buffers& b, const ApiCall& call) {
    return cuda ? run_cuda(b, call) : run_cpu(b, call);
  };
  GroupedGemm single = grouped;
  ASSERT_EQ(run(grouped.bufs, grouped.call(true)), FUS_SUCCESS) << fus_last_error();
  ASSERT_EQ(run(single.bufs, single.call(false)), FUS_SUCCESS) << fus_last_error();
  for (size_t i = 0; i < grouped.bufs.b.size(); ++i)
    EXPECT_EQ(grouped.bufs.b[i], single.bufs.b[i]) << i;
}

TEST_P(GemmGrouped, CpuEqualsOneCallEach) {
  const auto [ab, d, bias] = GetParam();
  GroupedGemm grouped(ab, d, bias, kCpu, 21);
  ASSERT_NO_FATAL_FAILURE(expect_grouped_equals_one_call_each(grouped, false));
  // K = 0 (an expert's weight gradient without tokens): zeros.
  const size_t last = 6 * (kCpu.size() - 1) + 2;
  if (!bias) {
    for (uint8_t byte : grouped.bufs.b[last]) EXPECT_EQ(byte, 0);
  }
}

TEST_P(GemmGrouped, CudaEqualsOneCallEach) {
  FUSTEST_REQUIRE_CUDA();
  const auto [ab, d, bias] = GetParam();
  GroupedGemm grouped(ab, d, bias, kCuda, 4);
  expect_grouped_equals_one_call_each(grouped, true);
}

INSTANTIATE_TEST_SUITE_P(All, GemmGrouped,
                         ::testing::Values(std::make_tuple(FUS_FLOAT8_E4M3, FUS_BFLOAT16, true),
                                           std::make_tuple(FUS_FLOAT8_E4M3, FUS_BFLOAT16, false),
                                           std::make_tuple(FUS_FLOAT8_E4M3, FUS_FLOAT32, false),
                                           std::make_tuple(FUS_FLOAT8_E4M3, FUS_FLOAT16, true),
                                           std::make_tuple(FUS_BFLOAT16, FUS_BFLOAT16, true),
                                           std::make_tuple(FUS_FLOAT32, FUS_FLOAT32, true)));

TEST(GemmGroupedArgs, OneBadProblemFailsTheCallBeforeAnyRuns) {
  GroupedGemm g(FUS_FLOAT8_E4M3, FUS_BFLOAT16, false, {{4, 8, 16}, {4, 8, 16}}, 9);
  const auto before = g.bufs.b[2];
  const fus_status st = run_cpu(g.bufs, [&](const std::vector<void*>& p, const fus_context& ctx) {
    auto a = g.args(p);
    a[1].a_scale_inv = nullptr;  // FP8 without its scale
    return fus_gemm_grouped(a.data(), 2, &ctx);
  });
  EXPECT_EQ(st, FUS_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fus_last_error()).find("fus_gemm_grouped: args[1]"), std::string::npos)
      << fus_last_error();
  EXPECT_EQ(g.bufs.b[2], before);  // problem 0 did not run
  const fus_context ctx = cpu_ctx();
  EXPECT_EQ(fus_gemm_grouped(nullptr, 0, &ctx), FUS_SUCCESS);
  EXPECT_EQ(fus_gemm_grouped(nullptr, -1, &ctx), FUS_ERROR_INVALID_ARGUMENT);
}

}  // namespace
