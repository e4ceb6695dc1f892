// Tests of the recipe family: fus_delayed_scaling_update against a small reference of the rule in
// fusible/recipe.h, fus_compute_scale, argument validation, and CUDA vs CPU bit for bit.
#include <gtest/gtest.h>

#include <sstream>

#include "common/numerics.h"
#include "test_utils.h"

using namespace fustest;
namespace fu = fusible;

namespace {

std::string fdesc(float f) {
  std::ostringstream os;
  os.precision(9);
  os << f << " (0x" << std::hex << f2u(f) << ")";
  return os.str();
}

// ---- reference of the delayed-scaling update -------------------------------------------------------

struct RefGroup {
  int64_t history_len = 1, n = 0;
  float fp8_max = 448.0f;
  std::vector<float> history;  // [history_len, n]
  std::vector<float> scale;    // [n]
};

// The rule of fusible/recipe.h, written out plainly:
//  amax_i = max_k |H[k, i]| (MAX) or |H[0, i]| (MOST_RECENT), NaN if any reduced entry is NaN;
//  S[i] = ldexp(fp8_max / amax_i, -margin) if amax_i finite and > 0 (FLT_MAX on overflow), else S[i];
//  roll: H[k] = H[k + 1] for k < L - 1; H[L - 1] = old H[0]; H[0] = 0.
void ref_update(RefGroup& g, fus_amax_algo algo, int margin) {
  const int64_t L = g.history_len, n = g.n;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t rows = algo == FUS_AMAX_MOST_RECENT ? 1 : L;
    double amax = 0;
    bool nan = false;
    for (int64_t k = 0; k < rows; ++k) {
      const float h = g.history[k * n + i];
      if (std::isnan(h))
        nan = true;
      else
        amax = std::max(amax, std::fabs(static_cast<double>(h)));
    }
    const float a = nan ? std::numeric_limits<float>::quiet_NaN() : static_cast<float>(amax);
    g.scale[i] = ref::scale_from_amax(a, g.fp8_max, margin, g.scale[i]);
    std::vector<float> col(L);
    for (int64_t k = 0; k < L; ++k) col[k] = g.history[k * n + i];
    for (int64_t k = 0; k + 1 < L; ++k) g.history[k * n + i] = col[k + 1];
    g.history[(L - 1) * n + i] = col[0];
    g.history[i] = 0.0f;
  }
}

// Runs fus_delayed_scaling_update on host copies of groups (CPU backend).
fus_status api_update_cpu(std::vector<RefGroup>& groups, fus_amax_algo algo, int margin) {
  std::vector<fus_delayed_scaling_group> desc;
  for (auto& g : groups)
    desc.push_back({g.history.empty() ? nullptr : g.history.data(),
                    g.scale.empty() ? nullptr : g.scale.data(), g.history_len, g.n, g.fp8_max});
  const fus_context ctx = cpu_ctx();
  return fus_delayed_scaling_update(desc.data(), static_cast<int>(desc.size()), algo, margin, &ctx);
}

// Buffers layout for both backends: for group j, slot 2j = history, 2j + 1 = scale.
Buffers group_buffers(const std::vector<RefGroup>& groups) {
  Buffers b;
  for (const auto& g : groups) {
    b.add(g.history);
    b.add(g.scale);
  }
  return b;
}
ApiCall update_call(const std::vector<RefGroup>& groups, fus_amax_algo algo, int margin) {
  std::vector<std::pair<int64_t, int64_t>> dims;
  std::vector<float> maxes;
  for (const auto& g : groups) {
    dims.emplace_back(g.history_len, g.n);
    maxes.push_back(g.fp8_max);
  }
  return [dims, maxes, algo, margin](const std::vector<void*>& p, const fus_context& ctx) {
    std::vector<fus_delayed_scaling_group> desc;
    for (size_t j = 0; j < dims.size(); ++j)
      desc.push_back({static_cast<float*>(p[2 * j]), static_cast<float*>(p[2 * j + 1]),
                      dims[j].first, dims[j].second, maxes[j]});
    return fus_delayed_scaling_update(desc.data(), static_cast<int>(desc.size()), algo, margin,
                                      &ctx);
  };
}

::testing::AssertionResult same_floats(const std::vector<float>& got,
                                       const std::vector<float>& want, const char* what) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << what << ": size";
  for (size_t i = 0; i < got.size(); ++i) {
    const bool ok = std::isnan(want[i]) ? std::isnan(got[i]) : f2u(got[i]) == f2u(want[i]);
    if (!ok)
      return ::testing::AssertionFailure()
             << what << "[" << i << "]: got " << fdesc(got[i]) << " want " << fdesc(want[i]);
  }
  return ::testing::AssertionSuccess();
}

// Random positive amaxes spread over binades, with occasional 0.
float random_amax(std::mt19937& rng) {
  std::uniform_real_distribution<float> u(0.5f, 1.0f);
  std::uniform_int_distribution<int> e(-20, 20);
  return (rng() % 10 == 0) ? 0.0f : std::ldexp(u(rng), e(rng));
}

// =================================================================================================
// History roll and scale update over several steps
// =================================================================================================

using UpdateParam = std::tuple<fus_amax_algo, int, int64_t>;  // algo, margin, history_len
class DelayedScalingTest : public ::testing::TestWithParam<UpdateParam> {};

TEST_P(DelayedScalingTest, SeveralStepsSeveralGroupsMatchReference) {
  const auto [algo, margin, hlen] = GetParam();
  std::mt19937 rng(static_cast<uint32_t>(hlen * 100 + margin * 10 + algo));
  // Groups of different n, fp8_max and (for history_len 5) a second history length in one call.
  std::vector<RefGroup> groups(4);
  const int64_t ns[] = {1, 3, 7, 0};
  const float maxes[] = {448.0f, 57344.0f, 448.0f, 57344.0f};
  for (int j = 0; j < 4; ++j) {
    RefGroup& g = groups[j];
    g.n = ns[j];
    g.fp8_max = maxes[j];
    g.history_len = (j == 2 && hlen > 1) ? 2 : hlen;
    g.history.assign(static_cast<size_t>(g.history_len * g.n), 0.0f);
    g.scale.assign(static_cast<size_t>(g.n), 1.0f);
  }
  std::vector<RefGroup> expect = groups;
  for (int step = 0; step < 9; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    // The casts of this step write their amaxes into row 0.
    for (size_t j = 0; j < groups.size(); ++j)
      for (int64_t i = 0; i < groups[j].n; ++i) {
        const float a = random_amax(rng);
        groups[j].history[i] = a;
        expect[j].history[i] = a;
      }
    for (auto& g : expect) ref_update(g, algo, margin);
    ASSERT_EQ(api_update_cpu(groups, algo, margin), FUS_SUCCESS) << fus_last_error();
    for (size_t j = 0; j < groups.size(); ++j) {
      EXPECT_TRUE(same_floats(groups[j].history, expect[j].history,
                              ("history of group " + std::to_string(j)).c_str()));
      EXPECT_TRUE(same_floats(groups[j].scale, expect[j].scale,
                              ("scale of group " + std::to_string(j)).c_str()));
      for (int64_t i = 0; i < groups[j].n; ++i) {
        EXPECT_EQ(groups[j].history[i], 0.0f) << "row 0 is reset";
        EXPECT_TRUE(std::isfinite(groups[j].scale[i]) && groups[j].scale[i] > 0)
            << "scale stays finite and > 0";
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Variants, DelayedScalingTest,
    ::testing::Combine(::testing::Values(FUS_AMAX_MAX, FUS_AMAX_MOST_RECENT),
                       ::testing::Values(0, 2), ::testing::Values<int64_t>(1, 5)),
    [](const ::testing::TestParamInfo<UpdateParam>& info) {
      return std::string(std::get<0>(info.param) == FUS_AMAX_MAX ? "Max" : "MostRecent") +
             "_margin" + std::to_string(std::get<1>(info.param)) + "_len" +
             std::to_string(std::get<2>(info.param));
    });

// Hand-computed: one column, history_len 3, algo max, margin 0, fp8_max 448.
TEST(DelayedScaling, HandComputedRoll) {
  RefGroup g;
  g.history_len = 3;
  g.n = 1;
  g.history = {2.0f, 8.0f, 4.0f};
  g.scale = {1.0f};
  std::vector<RefGroup> none;
  ASSERT_EQ(api_update_cpu(none, FUS_AMAX_MAX, 0), FUS_SUCCESS);  // zero groups is fine
  std::vector<RefGroup> gs{g};
  ASSERT_EQ(api_update_cpu(gs, FUS_AMAX_MAX, 0), FUS_SUCCESS) << fus_last_error();
  EXPECT_EQ(gs[0].scale[0], 448.0f / 8.0f);                          // max of {2, 8, 4}
  EXPECT_EQ(gs[0].history, (std::vector<float>{0.0f, 4.0f, 2.0f}));  // [H1, H2, H0] then H[0] = 0
  gs[0].history[0] = 1.0f;                                           // the next step's amax
  ASSERT_EQ(api_update_cpu(gs, FUS_AMAX_MAX, 0), FUS_SUCCESS);
  EXPECT_EQ(gs[0].scale[0], 448.0f / 4.0f);
  EXPECT_EQ(gs[0].history, (std::vector<float>{0.0f, 2.0f, 1.0f}));
  gs[0].history[0] = 0.5f;
  ASSERT_EQ(api_update_cpu(gs, FUS_AMAX_MOST_RECENT, 2), FUS_SUCCESS);
  EXPECT_EQ(gs[0].scale[0], 448.0f / 0.5f / 4.0f);  // only row 0, margin 2
  EXPECT_EQ(gs[0].history, (std::vector<float>{0.0f, 1.0f, 0.5f}));
}

TEST(DelayedScaling, HistoryLenOneOnlyResets) {
  std::vector<RefGroup> gs(1);
  gs[0].history_len = 1;
  gs[0].n = 2;
  gs[0].history = {3.5f, 0.0f};
  gs[0].scale = {7.0f, 7.0f};
  ASSERT_EQ(api_update_cpu(gs, FUS_AMAX_MAX, 0), FUS_SUCCESS) << fus_last_error();
  EXPECT_EQ(gs[0].history, (std::vector<float>{0.0f, 0.0f}));
  EXPECT_EQ(gs[0].scale[0], 128.0f);
  EXPECT_EQ(gs[0].scale[1], 7.0f) << "amax 0 keeps the previous scale";
}

TEST(DelayedScaling, ZeroInfNanAmaxKeepPreviousScale) {
  for (fus_amax_algo algo : {FUS_AMAX_MAX, FUS_AMAX_MOST_RECENT}) {
    for (int margin : {0, 2}) {
      std::vector<RefGroup> gs(1);
      RefGroup& g = gs[0];
      g.history_len = 2;
      g.n = 6;
      //                 0      inf     -inf     NaN         -NaN        only old entries NaN
      g.history = {0.0f, inf(), -inf(), qnan(false), qnan(true), 1.0f,          // row 0
                   0.0f, 1.0f,  2.0f,   3.0f,        4.0f,       qnan(false)};  // row 1
      g.scale = {1.5f, 2.5f, 3.5f, 4.5f, 5.5f, 6.5f};
      std::vector<RefGroup> want = gs;
      ref_update(want[0], algo, margin);
      ASSERT_EQ(api_update_cpu(gs, algo, margin), FUS_SUCCESS) << fus_last_error();
      EXPECT_TRUE(same_floats(g.scale, want[0].scale, "scale"));
      EXPECT_TRUE(same_floats(g.history, want[0].history, "history"));
      for (int i = 0; i < 5; ++i)
        EXPECT_EQ(g.scale[i], 1.5f + i) << "column " << i << " keeps its scale";
      if (algo == FUS_AMAX_MAX)
        EXPECT_EQ(g.scale[5], 6.5f) << "NaN in an older history row makes amax NaN: keep";
      else
        EXPECT_EQ(g.scale[5], std::ldexp(448.0f, -margin)) << "most_recent ignores older rows";
      // Negative history values count by magnitude.
      EXPECT_EQ(g.history[6 + 2], -inf()) << "old row 0 moved to the end";
    }
  }
}

TEST(DelayedScaling, OverflowGivesFltMax) {
  std::vector<RefGroup> gs(1);
  gs[0].history_len = 1;
  gs[0].n = 4;
  gs[0].history = {u2f(1), 1e-39f, -1e-38f, FLT_MAX};
  gs[0].scale = {1.0f, 1.0f, 1.0f, 1.0f};
  std::vector<RefGroup> want = gs;
  ref_update(want[0], FUS_AMAX_MAX, -3);
  ASSERT_EQ(api_update_cpu(gs, FUS_AMAX_MAX, -3), FUS_SUCCESS) << fus_last_error();
  EXPECT_EQ(gs[0].scale[0], FLT_MAX);
  EXPECT_EQ(gs[0].scale[1], FLT_MAX);
  EXPECT_EQ(gs[0].scale[2], FLT_MAX) << "448 / 1e-38 * 8 overflows";
  EXPECT_TRUE(same_floats(gs[0].scale, want[0].scale, "scale"));
}

TEST(DelayedScaling, LargeGroupsMatchReference) {
  std::mt19937 rng(7);
  std::vector<RefGroup> gs(3);
  const int64_t ns[] = {1000, 1, 4097};
  const int64_t lens[] = {1024, 16, 3};
  for (int j = 0; j < 3; ++j) {
    gs[j].n = ns[j];
    gs[j].history_len = lens[j];
    gs[j].fp8_max = j == 1 ? 57344.0f : 448.0f;
    gs[j].history.resize(static_cast<size_t>(ns[j] * lens[j]));
    for (auto& h : gs[j].history) h = random_amax(rng) * (rng() % 2 ? 1.0f : -1.0f);
    gs[j].scale.assign(static_cast<size_t>(ns[j]), 3.0f);
  }
  std::vector<RefGroup> want = gs;
  for (int step = 0; step < 3; ++step) {
    for (auto& g : want) ref_update(g, FUS_AMAX_MAX, 1);
    ASSERT_EQ(api_update_cpu(gs, FUS_AMAX_MAX, 1), FUS_SUCCESS) << fus_last_error();
    for (int j = 0; j < 3; ++j) {
      ASSERT_TRUE(same_floats(gs[j].history, want[j].history, "history"));
      ASSERT_TRUE(same_floats(gs[j].scale, want[j].scale, "scale"));
    }
  }
}

// =================================================================================================
// fus_compute_scale and the shared compute_scale
// =================================================================================================

TEST(ComputeScale, RuleAndFallbacks) {
  const fus_context ctx = cpu_ctx();
  struct K {
    float amax;
    int margin;
  };
  const K ks[] = {{1.0f, 0},       {3.0f, 0},    {3.0f, 2},    {448.0f, 0}, {1e-3f, 5},
                  {7e4f, -2},      {FLT_MAX, 0}, {FLT_MAX, 3}, {u2f(1), 0}, {1e-39f, 2},
                  {0.0f, 0},       {-0.0f, 0},   {inf(), 0},   {-inf(), 1}, {qnan(false), 0},
                  {qnan(true), 2}, {-2.0f, 0}};
  for (float fp8_max : {448.0f, 57344.0f}) {
    for (const auto& k : ks) {
      for (int keep : {0, 1}) {
        SCOPED_TRACE("amax " + fdesc(k.amax) + " margin " + std::to_string(k.margin) + " keep " +
                     std::to_string(keep));
        float amax = k.amax, scale = 9.0f, scale_inv = -1.0f;
        ASSERT_EQ(fus_compute_scale(&amax, &scale, &scale_inv, fp8_max, k.margin, keep, &ctx),
                  FUS_SUCCESS)
            << fus_last_error();
        const float want = ref::scale_from_amax(k.amax, fp8_max, k.margin, keep ? 9.0f : 1.0f);
        EXPECT_EQ(f2u(scale), f2u(want)) << fdesc(scale);
        EXPECT_EQ(f2u(scale_inv), f2u(1.0f / want));
        EXPECT_TRUE(std::isfinite(scale));
        EXPECT_EQ(f2u(fu::compute_scale(k.amax, fp8_max, k.margin, keep ? 9.0f : 1.0f)), f2u(want));
        // scale_inv is optional.
        scale = 9.0f;
        ASSERT_EQ(fus_compute_scale(&amax, &scale, nullptr, fp8_max, k.margin, keep, &ctx),
                  FUS_SUCCESS);
        EXPECT_EQ(f2u(scale), f2u(want));
      }
    }
  }
  // By hand.
  float a = 2.0f, s = 0.0f;
  ASSERT_EQ(fus_compute_scale(&a, &s, nullptr, 448.0f, 0, 0, &ctx), FUS_SUCCESS);
  EXPECT_EQ(s, 224.0f);
  ASSERT_EQ(fus_compute_scale(&a, &s, nullptr, 448.0f, 2, 0, &ctx), FUS_SUCCESS);
  EXPECT_EQ(s, 56.0f);
  a = 1e-40f;
  ASSERT_EQ(fus_compute_scale(&a, &s, nullptr, 448.0f, 0, 0, &ctx), FUS_SUCCESS);
  EXPECT_EQ(s, FLT_MAX) << "tiny subnormal amax gives FLT_MAX, not inf";
}

// Every 65521st amax bit pattern through the shared rule, against the reference.
TEST(ComputeScale, BitPatternSampleMatchesReference) {
  int bad = 0;
  for (uint64_t u = 0; u <= 0xffffffffull; u += 65521) {
    const float a = u2f(static_cast<uint32_t>(u));
    for (int margin : {0, 1, 7, -4, 30}) {
      for (float fp8_max : {448.0f, 57344.0f}) {
        const float got = fu::compute_scale(a, fp8_max, margin, 2.0f);
        const float want = ref::scale_from_amax(a, fp8_max, margin, 2.0f);
        if (f2u(got) != f2u(want) && ++bad <= 10)
          ADD_FAILURE() << "amax " << fdesc(a) << " margin " << margin << ": got " << fdesc(got)
                        << " want " << fdesc(want);
      }
    }
  }
  EXPECT_EQ(bad, 0);
}

// =================================================================================================
// Argument validation
// =================================================================================================

struct RecipeErr : ::testing::Test {
  std::vector<float> hist = std::vector<float>(6, 1.0f), sc = std::vector<float>(3, 5.0f);
  fus_delayed_scaling_group g{hist.data(), sc.data(), 2, 3, 448.0f};
  fus_context ctx = cpu_ctx();
  const char* fn = "fus_delayed_scaling_update";
  void expect_untouched() {
    EXPECT_EQ(hist, std::vector<float>(6, 1.0f));
    EXPECT_EQ(sc, std::vector<float>(3, 5.0f));
  }
};

TEST_F(RecipeErr, UpdateArguments) {
  EXPECT_TRUE(is_error(fus_delayed_scaling_update(nullptr, 1, FUS_AMAX_MAX, 0, &ctx),
                       FUS_ERROR_INVALID_ARGUMENT, {fn, "groups"}));
  EXPECT_TRUE(is_error(fus_delayed_scaling_update(&g, -1, FUS_AMAX_MAX, 0, &ctx),
                       FUS_ERROR_INVALID_ARGUMENT, {fn, "num_groups"}));
  EXPECT_TRUE(is_error(fus_delayed_scaling_update(&g, 1, FUS_AMAX_MAX, 0, nullptr),
                       FUS_ERROR_INVALID_ARGUMENT, {fn, "ctx"}));
  EXPECT_TRUE(is_error(fus_delayed_scaling_update(&g, 1, static_cast<fus_amax_algo>(5), 0, &ctx),
                       FUS_ERROR_INVALID_ARGUMENT, {fn, "algo"}));
  fus_delayed_scaling_group two[2] = {g, g};
  two[1].history_len = 0;
  EXPECT_TRUE(is_error(fus_delayed_scaling_update(two, 2, FUS_AMAX_MAX, 0, &ctx),
                       FUS_ERROR_INVALID_ARGUMENT, {fn, "groups[1]", "history_len"}));
  two[1] = g;
  two[1].n = -2;
  EXPECT_TRUE(is_error(fus_delayed_scaling_update(two, 2, FUS_AMAX_MAX, 0, &ctx),
                       FUS_ERROR_INVALID_ARGUMENT, {fn, "groups[1]", "n"}));
  two[1] = g;
  two[1].amax_history = nullptr;
  EXPECT_TRUE(is_error(fus_delayed_scaling_update(two, 2, FUS_AMAX_MAX, 0, &ctx),
                       FUS_ERROR_INVALID_ARGUMENT, {fn, "groups[1]", "amax_history"}));
  two[1] = g;
  two[1].scale = nullptr;
  EXPECT_TRUE(is_error(fus_delayed_scaling_update(two, 2, FUS_AMAX_MAX, 0, &ctx),
                       FUS_ERROR_INVALID_ARGUMENT, {fn, "groups[1]", "scale"}));
  two[1] = g;
  for (float bad : {0.0f, -448.0f, qnan(false)}) {
    two[1].fp8_max = bad;
    EXPECT_TRUE(is_error(fus_delayed_scaling_update(two, 2, FUS_AMAX_MAX, 0, &ctx),
                         FUS_ERROR_INVALID_ARGUMENT, {fn, "groups[1]", "fp8_max"}));
  }
  // Validation happens before any group is updated.
  expect_untouched();
  // n == 0 with NULL pointers and num_groups == 0 are fine.
  fus_delayed_scaling_group empty{nullptr, nullptr, 4, 0, 448.0f};
  EXPECT_EQ(fus_delayed_scaling_update(&empty, 1, FUS_AMAX_MAX, 0, &ctx), FUS_SUCCESS)
      << fus_last_error();
  EXPECT_EQ(fus_delayed_scaling_update(nullptr, 0, FUS_AMAX_MAX, 0, &ctx), FUS_SUCCESS)
      << fus_last_error();
  EXPECT_STREQ(fus_last_error(), "");
}

TEST_F(RecipeErr, ComputeScaleArguments) {
  const char* f = "fus_compute_scale";
  float a = 1.0f, s = 5.0f, si = 0.0f;
  EXPECT_TRUE(is_error(fus_compute_scale(nullptr, &s, &si, 448.0f, 0, 0, &ctx),
                       FUS_ERROR_INVALID_ARGUMENT, {f, "amax"}));
  EXPECT_TRUE(is_error(fus_compute_scale(&a, nullptr, &si, 448.0f, 0, 0, &ctx),
                       FUS_ERROR_INVALID_ARGUMENT, {f, "scale"}));
  EXPECT_TRUE(is_error(fus_compute_scale(&a, &s, &si, 0.0f, 0, 0, &ctx), FUS_ERROR_INVALID_ARGUMENT,
                       {f, "fp8_max"}));
  EXPECT_TRUE(is_error(fus_compute_scale(&a, &s, &si, qnan(false), 0, 0, &ctx),
                       FUS_ERROR_INVALID_ARGUMENT, {f, "fp8_max"}));
  EXPECT_TRUE(is_error(fus_compute_scale(&a, &s, &si, 448.0f, 0, 0, nullptr),
                       FUS_ERROR_INVALID_ARGUMENT, {f, "ctx"}));
  EXPECT_EQ(s, 5.0f);
  EXPECT_EQ(si, 0.0f);
}

TEST_F(RecipeErr, CudaContextInCpuOnlyBuildIsUnsupported) {
  if (fus_has_cuda()) GTEST_SKIP() << "this build has the CUDA backend";
  ctx = cuda_ctx();
  EXPECT_TRUE(is_error(fus_delayed_scaling_update(&g, 1, FUS_AMAX_MAX, 0, &ctx),
                       FUS_ERROR_UNSUPPORTED, {fn, "CUDA"}));
  float a = 1.0f, s = 5.0f;
  EXPECT_TRUE(is_error(fus_compute_scale(&a, &s, nullptr, 448.0f, 0, 0, &ctx),
                       FUS_ERROR_UNSUPPORTED, {"fus_compute_scale", "CUDA"}));
  expect_untouched();
  EXPECT_EQ(s, 5.0f);
}

// =================================================================================================
// CUDA vs CPU
// =================================================================================================

void expect_same_groups(const DualResult& r, size_t num_groups) {
  ASSERT_EQ(r.cpu_status, FUS_SUCCESS);
  ASSERT_EQ(r.cuda_status, FUS_SUCCESS) << fus_last_error();
  for (size_t j = 0; j < num_groups; ++j) {
    EXPECT_TRUE(same_bits<uint32_t>(r.cpu, r.cuda, static_cast<int>(2 * j), "amax_history"))
        << "group " << j;
    EXPECT_TRUE(same_bits<uint32_t>(r.cpu, r.cuda, static_cast<int>(2 * j + 1), "scale"))
        << "group " << j;
  }
}

TEST(CudaVsCpu, DelayedScalingUpdateRandomAndEdgeHistories) {
  FUSTEST_REQUIRE_CUDA();
  std::mt19937 rng(2024);
  const float specials[] = {0.0f,       -0.0f,  inf(),   -inf(), qnan(false),
                            qnan(true), u2f(1), FLT_MAX, 1e-39f};
  for (fus_amax_algo algo : {FUS_AMAX_MAX, FUS_AMAX_MOST_RECENT}) {
    for (int margin : {0, 2, -3, 20}) {
      SCOPED_TRACE(std::string(algo == FUS_AMAX_MAX ? "max" : "most_recent") + " margin " +
                   std::to_string(margin));
      std::vector<RefGroup> gs(5);
      const int64_t ns[] = {1, 37, 10000, 0, 513};
      const int64_t lens[] = {1, 1024, 5, 3, 300};  // 300: a partial chunk of the CUDA roll
      for (int j = 0; j < 5; ++j) {
        gs[j].n = ns[j];
        gs[j].history_len = lens[j];
        gs[j].fp8_max = j % 2 ? 57344.0f : 448.0f;
        gs[j].history.resize(static_cast<size_t>(ns[j] * lens[j]));
        for (auto& h : gs[j].history)
          h = rng() % 50 == 0 ? specials[rng() % 9] : random_amax(rng) * (rng() % 2 ? 1.0f : -1.0f);
        gs[j].scale.resize(static_cast<size_t>(ns[j]));
        for (auto& s : gs[j].scale) s = random_amax(rng) + 0.5f;
      }
      Buffers b = group_buffers(gs);
      for (int step = 0; step < 3; ++step) {
        DualResult r = run_both(b, update_call(gs, algo, margin));
        expect_same_groups(r, gs.size());
        b = r.cpu;
        for (size_t j = 0; j < gs.size(); ++j)  // the next step's amaxes
          for (int64_t i = 0; i < gs[j].n; ++i) {
            const float a = random_amax(rng);
            std::memcpy(&b.b[2 * j][4 * i], &a, 4);
          }
      }
    }
  }
}

// The scale rule over a sample of amax bit patterns on the device (history_len 1: one column per
// pattern), margins that under- and overflow.
TEST(CudaVsCpu, ScaleRuleOverAmaxBitPatterns) {
  FUSTEST_REQUIRE_CUDA();
  std::vector<RefGroup> gs(2);
  for (int j = 0; j < 2; ++j) {
    gs[j].history_len = 1;
    gs[j].fp8_max = j ? 57344.0f : 448.0f;
    for (uint64_t u = 0; u <= 0xffffffffull; u += 4099)
      gs[j].history.push_back(u2f(static_cast<uint32_t>(u)));
    gs[j].n = static_cast<int64_t>(gs[j].history.size());
    gs[j].scale.assign(gs[j].history.size(), 0.75f);
  }
  for (int margin : {0, 1, 5, -5, 24}) {
    SCOPED_TRACE("margin " + std::to_string(margin));
    DualResult r = run_both(group_buffers(gs), update_call(gs, FUS_AMAX_MAX, margin));
    expect_same_groups(r, gs.size());
    // And the CPU result against the reference.
    for (int j = 0; j < 2; ++j) {
      std::vector<RefGroup> want{gs[j]};
      ref_update(want[0], FUS_AMAX_MAX, margin);
      EXPECT_TRUE(same_floats(r.cpu.get<float>(2 * j + 1), want[0].scale, "scale vs reference"));
    }
  }
}

TEST(CudaVsCpu, ComputeScale) {
  FUSTEST_REQUIRE_CUDA();
  const float amaxes[] = {1.0f, 3.0f, 0.0f, inf(), qnan(true), u2f(1), FLT_MAX, 1e-39f, 12345.678f};
  for (float a : amaxes) {
    for (int margin : {0, 3, -2}) {
      for (int keep : {0, 1}) {
        Buffers b;
        b.add(std::vector<float>{a});
        b.add(std::vector<float>{6.0f});
        b.add_filled(4);
        DualResult r =
            run_both(b, [margin, keep](const std::vector<void*>& p, const fus_context& ctx) {
              return fus_compute_scale(static_cast<float*>(p[0]), static_cast<float*>(p[1]),
                                       static_cast<float*>(p[2]), 448.0f, margin, keep, &ctx);
            });
        ASSERT_EQ(r.cpu_status, FUS_SUCCESS);
        ASSERT_EQ(r.cuda_status, FUS_SUCCESS) << fus_last_error();
        EXPECT_TRUE(same_bits<uint32_t>(r.cpu, r.cuda, 1, "scale"))
            << fdesc(a) << " margin " << margin;
        EXPECT_TRUE(same_bits<uint32_t>(r.cpu, r.cuda, 2, "scale_inv"))
            << fdesc(a) << " margin " << margin;
      }
    }
  }
}

}  // namespace
