// CPU backend of the activation family: the executable specification of fusible/activation.h.
//
// Values are computed with the shared math (common/activation_math.h), rounded to the output dtype
// and stored (in the caller's output, or a scratch matrix when only the quantized copy or dbias is
// wanted); the quantized output is then the quantize family's own CPU cast of that matrix, so
// "fused == unfused" holds by construction. The CUDA backend is tested against this.
#include <algorithm>
#include <vector>

#include "activation/activation_impl.h"
#include "common/hp_access.h"
#include "quantize/quantize_impl.h"

namespace fusible {
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
  if (a.q != nullptr) quantize_cpu(fus_tensor{out.data, a.round_dtype, rows, cols}, *a.q);
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
  if (a.q != nullptr) quantize_cpu(fus_tensor{out.data, a.round_dtype, rows, out_cols}, *a.q);
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

}  // namespace fusible
