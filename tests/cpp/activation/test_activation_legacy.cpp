// The CPU activation kernels (cpp/src/activation/activation_cpu.cpp: rows split over threads,
// vectorised per instruction set, dbias split by columns in its fixed order) against the scalar
// implementation they replaced, kept below verbatim as legacy:: (703b091): every output byte (the
// output, the quantized copies and their scales, amax, dbias) must be equal, for every
// instruction set this processor runs and 1, 2 and 3 threads, at odd sizes, for every function,
// gated or not, every dtype, with special values. (Both call the current shared CPU cast,
// common/cast.h cast_cpu, for the quantized output -- the legacy code called it quantize_cpu;
// tests/cpp/quantize/test_quantize_legacy.cpp checks that one against its legacy code.)
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <string>
#include <vector>

#include "activation/activation_impl.h"
#include "common/cast.h"
#include "common/hp_access.h"
#include "legacy_test_utils.h"

// ---- legacy: cpp/src/activation/activation_cpu.cpp at 703b091, verbatim --------------------------

namespace legacy {
using namespace fusible;
namespace {

// Where the rounded result goes: the caller's output, or scratch.
struct OutBuffer {
  std::vector<uint8_t> scratch;
  void* data = nullptr;
  OutBuffer(const ActArgs& a, int64_t rows, int64_t cols) {
    if (a.out != nullptr) {
      data = a.out->data;
    } else if (rows * cols > 0) {
      scratch.resize(static_cast<size_t>(rows * cols) * fus_dtype_size(a.round_dtype));
      data = scratch.data();
    }
  }
};

}  // namespace

void act_forward_cpu(const ActArgs& a) {
  const int64_t rows = a.rows, cols = a.cols, in_cols = a.gated ? 2 * cols : cols;
  OutBuffer out(a, rows, cols);
  if (rows * cols > 0) {
    dispatch_act(a.fn, [&](auto tag) {
      constexpr ActFn A = decltype(tag)::value;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) {
          const float x = load_hp(a.x.data, a.x.dtype, r * in_cols + c);
          const float v =
              a.gated ? gated_fwd<A>(x, load_hp(a.x.data, a.x.dtype, r * in_cols + cols + c))
                      : act_fn<A>(x);
          store_hp(out.data, a.round_dtype, r * cols + c, v);
        }
    });
  }
  if (a.q != nullptr) cast_cpu(fus_tensor{out.data, a.round_dtype, rows, cols}, *a.q);
}

void act_backward_cpu(const ActArgs& a) {
  const int64_t rows = a.rows, cols = a.cols, out_cols = a.gated ? 2 * cols : cols;
  OutBuffer out(a, rows, out_cols);
  if (rows * cols > 0) {
    dispatch_act(a.fn, [&](auto tag) {
      constexpr ActFn A = decltype(tag)::value;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) {
          const float g = load_hp(a.grad.data, a.grad.dtype, r * cols + c);
          const float x = load_hp(a.x.data, a.x.dtype, r * out_cols + c);
          if (a.gated) {
            float da, db;
            gated_grad<A>(g, x, load_hp(a.x.data, a.x.dtype, r * out_cols + cols + c), &da, &db);
            store_hp(out.data, a.round_dtype, r * out_cols + c, da);
            store_hp(out.data, a.round_dtype, r * out_cols + cols + c, db);
          } else {
            store_hp(out.data, a.round_dtype, r * cols + c, act_grad<A>(g, x));
          }
        }
    });
  }
  if (a.q != nullptr) cast_cpu(fus_tensor{out.data, a.round_dtype, rows, out_cols}, *a.q);
  if (a.dbias != nullptr) {
    // Sequential sums within groups of rows, then over the groups (activation.h).
    const int64_t per = act_dbias_rows_per_group(rows);
    std::vector<float> total(out_cols, 0.0f), group(out_cols);
    for (int64_t r0 = 0; r0 < rows; r0 += per) {
      std::fill(group.begin(), group.end(), 0.0f);
      for (int64_t r = r0; r < std::min(rows, r0 + per); ++r)
        for (int64_t c = 0; c < out_cols; ++c)
          group[c] = f_add(group[c], load_hp(out.data, a.round_dtype, r * out_cols + c));
      for (int64_t c = 0; c < out_cols; ++c) total[c] = f_add(total[c], group[c]);
    }
    for (int64_t c = 0; c < out_cols; ++c) store_hp(a.dbias->data, a.dbias->dtype, c, total[c]);
  }
}

}  // namespace legacy

// ---- the comparison ----------------------------------------------------------------------------

namespace {

using fusible::ActArgs;
using fusible::ActFn;
using legacy_test::CpuIsa;
using legacy_test::Runtime;
using legacy_test::Values;

constexpr fus_dtype kF32 = FUS_FLOAT32, kF16 = FUS_FLOAT16, kBF16 = FUS_BFLOAT16,
                    kE4M3 = FUS_FLOAT8_E4M3;

struct Case {
  ActFn fn;
  bool gated;
  int64_t rows, cols;  // cols: H
  fus_dtype xt, gt;    // x, grad
  fus_dtype out;       // output dtype; kNone: no output (round to the input's)
  int quant;           // 0 none, 1 per-tensor (row + col), 2 MXFP8 (row + col)
  bool dbias;
  Values values;
  std::string str() const {
    return "fn=" + std::to_string(static_cast<int>(fn)) + " gated=" + std::to_string(gated) + " " +
           std::to_string(rows) + "x" + std::to_string(cols) + " x=" + std::to_string(xt) +
           " grad=" + std::to_string(gt) + " out=" + std::to_string(out) +
           " quant=" + std::to_string(quant) + " dbias=" + std::to_string(dbias);
  }
};
constexpr fus_dtype kNone = static_cast<fus_dtype>(-1);

// One run's buffers (outputs prefilled with a pattern).
struct Run {
  std::vector<uint8_t> out, dbias;
  fus_tensor out_t{}, dbias_t{};
  std::unique_ptr<legacy_test::QuantOut> q;

  Run(const Case& c, bool backward) {
    const int64_t oc = backward && c.gated ? 2 * c.cols : c.cols;  // columns of the output
    const fus_dtype round = c.out != kNone ? c.out : (backward ? c.gt : c.xt);
    if (c.out != kNone) {
      out.assign(static_cast<size_t>(c.rows * oc) * fus_dtype_size(c.out), 0xcd);
      out_t = fus_tensor{out.data(), c.out, c.rows, oc};
    }
    if (c.quant)
      q = std::make_unique<legacy_test::QuantOut>(
          c.quant == 1 ? FUS_SCALING_PER_TENSOR : FUS_SCALING_MXFP8, kE4M3, c.rows, oc, true, true,
          0.75f);
    if (backward && c.dbias) {
      dbias.assign(static_cast<size_t>(oc) * fus_dtype_size(round), 0xcd);
      dbias_t = fus_tensor{dbias.data(), round, 1, oc};
    }
  }
  ActArgs args(const Case& c, bool backward, const fus_tensor& x, const fus_tensor& g) {
    ActArgs a{};
    a.fn = c.fn;
    a.gated = c.gated;
    a.rows = c.rows;
    a.cols = c.cols;
    a.x = x;
    a.grad = g;
    a.out = c.out != kNone ? &out_t : nullptr;
    a.round_dtype = c.out != kNone ? c.out : (backward ? c.gt : c.xt);
    a.q = q ? &q->q : nullptr;
    a.dbias = backward && c.dbias ? &dbias_t : nullptr;
    return a;
  }
  // Values (NaN matches NaN, see legacy_test_utils.h); the E8M0 scales exactly.
  ::testing::AssertionResult same(const Run& w) const {
    auto r = legacy_test::same_values("out", out_t.dtype, w.out, out);
    if (r) r = legacy_test::same_values("dbias", dbias_t.dtype, w.dbias, dbias);
    if (r && q) r = q->same(*w.q, true);
    return r;
  }
};

void check(const Case& c, uint32_t seed) {
  std::mt19937 g(seed);
  const int64_t xc = c.gated ? 2 * c.cols : c.cols;
  std::vector<uint8_t> x = legacy_test::random_hp(c.xt, c.rows * xc, c.values, g, 3.0f);
  std::vector<uint8_t> gr = legacy_test::random_hp(c.gt, c.rows * c.cols, c.values, g);
  const fus_tensor xt{x.data(), c.xt, c.rows, xc}, gt{gr.data(), c.gt, c.rows, c.cols};
  for (bool backward : {false, true}) {
    if (!backward && c.out == kNone && !c.quant) continue;  // nothing to compare
    Run want(c, backward);
    {
      const ActArgs a = want.args(c, backward, xt, gt);
      backward ? legacy::act_backward_cpu(a) : legacy::act_forward_cpu(a);
    }
    for (CpuIsa isa : legacy_test::isas()) {
      for (int threads : {1, 2, 3}) {
        Runtime rt(isa, threads);
        Run got(c, backward);
        const ActArgs a = got.args(c, backward, xt, gt);
        backward ? fusible::act_backward_cpu(a) : fusible::act_forward_cpu(a);
        EXPECT_TRUE(got.same(want))
            << c.str() << (backward ? " backward" : " forward") << Runtime::name(isa, threads);
      }
    }
  }
}

struct Size {
  int64_t rows, cols;
};
const Size kSizes[] = {{1, 1}, {1, 7}, {7, 1}, {3, 31}, {33, 65}, {31, 513}, {97, 127}, {257, 33}};

}  // namespace

TEST(ActivationCpuLegacy, EveryFunctionGatedDtypeOutputAndQuantization) {
  uint32_t seed = 1;
  for (const Size& sz : kSizes) {
    for (ActFn fn : {ActFn::kGeluTanh, ActFn::kGeluErf, ActFn::kRelu, ActFn::kSilu}) {
      for (bool gated : {false, true}) {
        for (fus_dtype xt : {kF32, kBF16, kF16}) {
          Case c{fn,      gated,
                 sz.rows, sz.cols,
                 xt,      seed % 2 ? xt : kF32,
                 kNone,   0,
                 false,   seed % 3 == 0 ? Values::kSpecial : Values::kNormal};
          c.out = seed % 4 == 0 ? kNone : (seed % 4 == 1 ? kF32 : (seed % 4 == 2 ? kBF16 : kF16));
          c.quant = static_cast<int>(seed % 3);
          if (c.out == kNone && c.quant == 0) c.quant = 1;
          c.dbias = seed % 2 == 0;
          check(c, seed++);
        }
      }
    }
  }
}

TEST(ActivationCpuLegacy, TheBlockSize) {
  // The README block's GELU: [1024 tokens, 4096], fp32, forward with an FP8 cast, backward with
  // dbias.
  const Case cases[] = {
      {ActFn::kGeluTanh, false, 1024, 4096, kF32, kF32, kF32, 1, true, Values::kNormal},
      {ActFn::kGeluTanh, false, 1024, 4096, kBF16, kBF16, kNone, 2, true, Values::kNormal},
  };
  uint32_t seed = 500;
  for (const Case& c : cases) check(c, seed++);
}
