// fus_quantize_grouped: every group is the per-tensor cast it stands for, bit for bit (delayed
// scaling: fus_quantize with the group's scale; current scaling: fus_quantize_current_scaling),
// on the CPU backend and, where a CUDA device is present, on the CUDA backend against the CPU;
// empty groups; argument validation.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "fusible/quantize.h"
#include "test_utils.h"

using namespace fustest;

namespace {

struct GroupSpec {
  int64_t rows, cols;
};

// One grouped call's buffers: per group the input, rowwise data, transposed data, scale,
// scale_inv and amax (six buffers a group, in that order).
struct GroupedCase {
  fus_dtype in_dtype, fp8;
  std::vector<GroupSpec> groups;
  std::vector<HostMatrix> inputs;
  Buffers bufs;

  GroupedCase(fus_dtype in, fus_dtype f, std::vector<GroupSpec> g, uint32_t seed)
      : in_dtype(in), fp8(f), groups(std::move(g)) {
    for (size_t i = 0; i < groups.size(); ++i) {
      const auto [r, c] = groups[i];
      inputs.emplace_back(in, r, c, random_values(static_cast<size_t>(r * c), seed + 7 * i, -6, 6));
      bufs.add_bytes(inputs.back().bytes);
      bufs.add_filled(static_cast<size_t>(r * c));
      bufs.add_filled(static_cast<size_t>(r * c));
      bufs.add(std::vector<float>{0.25f * static_cast<float>(i + 1) + 3.0f});  // delayed scale
      bufs.add(std::vector<float>{-1.0f});
      bufs.add(std::vector<float>{-1.0f});
    }
  }

  // The grouped call, or (per_tensor) one per-tensor call per group, on the given pointers.
  ApiCall call(bool current, int margin, bool per_tensor) const {
    return [=, this](const std::vector<void*>& p, const fus_context& ctx) {
      std::vector<fus_tensor> in;
      std::vector<fus_quantized> out;
      for (size_t i = 0; i < groups.size(); ++i) {
        const auto [r, c] = groups[i];
        const size_t b = 6 * i;
        in.push_back(fus_tensor{p[b], in_dtype, r, c});
        out.push_back(fus_quantized{FUS_SCALING_PER_TENSOR, fp8, r, c, p[b + 1], p[b + 2], p[b + 4],
                                    nullptr, static_cast<float*>(p[b + 3]),
                                    static_cast<float*>(p[b + 5]), 0, 0.0f});
      }
      if (!per_tensor)
        return fus_quantize_grouped(in.data(), out.data(), static_cast<int64_t>(in.size()),
                                    current ? 1 : 0, margin, &ctx);
      for (size_t i = 0; i < in.size(); ++i) {
        const fus_status st = current ? fus_quantize_current_scaling(&in[i], &out[i], margin, &ctx)
                                      : fus_quantize(&in[i], &out[i], &ctx);
        if (st != FUS_SUCCESS) return st;
      }
      return FUS_SUCCESS;
    };
  }
};

const std::vector<GroupSpec> kGroups = {{0, 17}, {1, 17}, {7, 17}, {31, 17}, {0, 17}, {130, 17}};
const std::vector<GroupSpec> kWeights = {{17, 64}, {33, 1}, {64, 127}};

void expect_same(const Buffers& a, const Buffers& b, const std::string& what) {
  ASSERT_EQ(a.b.size(), b.b.size());
  for (size_t i = 0; i < a.b.size(); ++i) EXPECT_EQ(a.b[i], b.b[i]) << what << ": buffer " << i;
}

class QuantizeGrouped
    : public ::testing::TestWithParam<std::tuple<fus_dtype, fus_dtype, bool, bool>> {};

TEST_P(QuantizeGrouped, CpuEqualsPerTensorCalls) {
  const auto [in, fp8, current, packed_like] = GetParam();
  GroupedCase grouped(in, fp8, packed_like ? kGroups : kWeights, 11);
  GroupedCase single = grouped;
  ASSERT_EQ(run_cpu(grouped.bufs, grouped.call(current, 1, false)), FUS_SUCCESS)
      << fus_last_error();
  ASSERT_EQ(run_cpu(single.bufs, single.call(current, 1, true)), FUS_SUCCESS) << fus_last_error();
  expect_same(grouped.bufs, single.bufs, "grouped vs per-tensor");
  // Empty groups: amax 0, scale_inv 1 / scale (current scaling: scale 1).
  for (size_t i = 0; i < grouped.groups.size(); ++i) {
    if (grouped.groups[i].rows * grouped.groups[i].cols != 0) continue;
    EXPECT_EQ(grouped.bufs.get<float>(6 * i + 5)[0], 0.0f);
    const float scale = grouped.bufs.get<float>(6 * i + 3)[0];
    if (current) {
      EXPECT_EQ(scale, 1.0f);
    }
    EXPECT_EQ(grouped.bufs.get<float>(6 * i + 4)[0], 1.0f / scale);
  }
}

TEST_P(QuantizeGrouped, CudaEqualsCpu) {
  FUSTEST_REQUIRE_CUDA();
  const auto [in, fp8, current, packed_like] = GetParam();
  GroupedCase cpu(in, fp8, packed_like ? kGroups : kWeights, 5);
  GroupedCase gpu = cpu;
  ASSERT_EQ(run_cpu(cpu.bufs, cpu.call(current, 0, false)), FUS_SUCCESS) << fus_last_error();
  ASSERT_EQ(run_cuda(gpu.bufs, gpu.call(current, 0, false)), FUS_SUCCESS) << fus_last_error();
  expect_same(gpu.bufs, cpu.bufs, "CUDA vs CPU");
}

INSTANTIATE_TEST_SUITE_P(All, QuantizeGrouped,
                         ::testing::Combine(::testing::Values(FUS_FLOAT32, FUS_BFLOAT16,
                                                              FUS_FLOAT16),
                                            ::testing::Values(FUS_FLOAT8_E4M3, FUS_FLOAT8_E5M2),
                                            ::testing::Bool(), ::testing::Bool()));

TEST(QuantizeGroupedCuda, ManyGroupsEqualCpu) {
  // More groups than one launch takes (32): the chunks agree with the CPU too.
  FUSTEST_REQUIRE_CUDA();
  std::vector<GroupSpec> g;
  for (int i = 0; i < 70; ++i) g.push_back({(i * 37) % 67, 48});
  GroupedCase cpu(FUS_BFLOAT16, FUS_FLOAT8_E4M3, g, 3);
  GroupedCase gpu = cpu;
  for (bool current : {false, true}) {
    ASSERT_EQ(run_cpu(cpu.bufs, cpu.call(current, 0, false)), FUS_SUCCESS) << fus_last_error();
    ASSERT_EQ(run_cuda(gpu.bufs, gpu.call(current, 0, false)), FUS_SUCCESS) << fus_last_error();
    expect_same(gpu.bufs, cpu.bufs, current ? "current" : "delayed");
  }
}

TEST(QuantizeGroupedArgs, Validation) {
  const fus_context ctx = cpu_ctx();
  std::vector<float> x(8, 1.0f), s{1.0f}, si{0.0f}, am{0.0f};
  std::vector<uint8_t> d(8), dt(8);
  fus_tensor in[2] = {{x.data(), FUS_FLOAT32, 2, 4}, {x.data(), FUS_FLOAT16, 2, 4}};
  fus_quantized out[2];
  for (auto& o : out)
    o = fus_quantized{FUS_SCALING_PER_TENSOR,
                      FUS_FLOAT8_E4M3,
                      2,
                      4,
                      d.data(),
                      dt.data(),
                      si.data(),
                      nullptr,
                      s.data(),
                      am.data(),
                      0,
                      0.0f};
  EXPECT_EQ(fus_quantize_grouped(in, out, 2, 0, 0, &ctx), FUS_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fus_last_error()).find("inputs[1] has dtype"), std::string::npos)
      << fus_last_error();
  in[1].dtype = FUS_FLOAT32;
  out[1].mode = FUS_SCALING_MXFP8;
  EXPECT_EQ(fus_quantize_grouped(in, out, 2, 0, 0, &ctx), FUS_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fus_last_error()).find("outs[1]"), std::string::npos);
  out[1].mode = FUS_SCALING_PER_TENSOR;
  out[0].scale = nullptr;
  EXPECT_EQ(fus_quantize_grouped(in, out, 2, 0, 0, &ctx), FUS_ERROR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(fus_last_error()).find("outs[0].scale is NULL"), std::string::npos);
  EXPECT_EQ(fus_quantize_grouped(in, out, -1, 0, 0, &ctx), FUS_ERROR_INVALID_ARGUMENT);
  EXPECT_EQ(fus_quantize_grouped(nullptr, nullptr, 0, 0, 0, &ctx), FUS_SUCCESS);
}

}  // namespace
