// CPU backend of the activation family: the executable specification of fusible/activation.h.
//
// Values are computed with the shared math (common/activation_math.h), rounded to the output dtype
// and stored (in the caller's output, or a scratch matrix when only the quantized copy or dbias is
// wanted); the quantized output (per tensor, MXFP8 or blockwise) is then the shared CPU cast the
// quantize family runs too (cast_cpu, common/cast.h) of that matrix, so "fused == unfused" holds
// by construction. The CUDA backend is tested against this.
//
// Speed without changing a bit: rows are split over the CPU backend's threads (every element is
// computed on its own, so the split does not matter), each row in runs of kCpuSeg elements widened
// to fp32 buffers, the function applied by a loop the compiler vectorises for the processor's
// instruction set (with_cpu_isa), and the results rounded and stored. dbias keeps its fixed order
// (activation.h: sequential within groups of rows, then over the groups) and is split by columns.
#include <algorithm>
#include <vector>

#include "activation/activation_impl.h"
#include "common/cast.h"
#include "common/cpu_rows.h"
#include "common/cpu_runtime.h"

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

// Rows per task: at least ~32K elements a task.
int64_t min_rows(int64_t cols) {
  if (cpu_force_split()) return 1;
  return std::max<int64_t>(1, (int64_t{1} << 15) / std::max<int64_t>(cols, 1));
}

}  // namespace

void act_forward_cpu(const ActArgs& a) {
  const int64_t rows = a.rows, cols = a.cols, in_cols = a.gated ? 2 * cols : cols;
  OutBuffer out(a, rows, cols);
  if (rows * cols > 0) {
    parallel_ranges(rows, min_rows(in_cols), [&](int64_t r0, int64_t r1) {
      with_cpu_isa([&]() FUS_INLINE_LAMBDA {
        float x[kCpuSeg], b[kCpuSeg], y[kCpuSeg];
        for (int64_t r = r0; r < r1; ++r) {
          for (int64_t c0 = 0; c0 < cols; c0 += kCpuSeg) {
            const int64_t n = std::min(kCpuSeg, cols - c0);
            load_run(a.x.dtype, a.x.data, r * in_cols + c0, n, x);
            if (a.gated) load_run(a.x.dtype, a.x.data, r * in_cols + cols + c0, n, b);
            dispatch_act(a.fn, [&](auto tag) FUS_INLINE_LAMBDA {
              constexpr ActFn A = decltype(tag)::value;
              if (a.gated) {
                for (int64_t j = 0; j < n; ++j) y[j] = gated_fwd<A>(x[j], b[j]);
              } else {
                for (int64_t j = 0; j < n; ++j) y[j] = act_fn<A>(x[j]);
              }
            });
            store_run(a.round_dtype, out.data, r * cols + c0, n, y);
          }
        }
      });
    });
  }
  if (a.q != nullptr) cast_cpu(fus_tensor{out.data, a.round_dtype, rows, cols}, *a.q);
}

void act_backward_cpu(const ActArgs& a) {
  const int64_t rows = a.rows, cols = a.cols, out_cols = a.gated ? 2 * cols : cols;
  OutBuffer out(a, rows, out_cols);
  if (rows * cols > 0) {
    parallel_ranges(rows, min_rows(out_cols), [&](int64_t r0, int64_t r1) {
      with_cpu_isa([&]() FUS_INLINE_LAMBDA {
        float g[kCpuSeg], x[kCpuSeg], b[kCpuSeg], da[kCpuSeg], db[kCpuSeg];
        for (int64_t r = r0; r < r1; ++r) {
          for (int64_t c0 = 0; c0 < cols; c0 += kCpuSeg) {
            const int64_t n = std::min(kCpuSeg, cols - c0);
            load_run(a.grad.dtype, a.grad.data, r * cols + c0, n, g);
            load_run(a.x.dtype, a.x.data, r * out_cols + c0, n, x);
            if (a.gated) load_run(a.x.dtype, a.x.data, r * out_cols + cols + c0, n, b);
            dispatch_act(a.fn, [&](auto tag) FUS_INLINE_LAMBDA {
              constexpr ActFn A = decltype(tag)::value;
              if (a.gated) {
                for (int64_t j = 0; j < n; ++j) gated_grad<A>(g[j], x[j], b[j], &da[j], &db[j]);
              } else {
                for (int64_t j = 0; j < n; ++j) da[j] = act_grad<A>(g[j], x[j]);
              }
            });
            store_run(a.round_dtype, out.data, r * out_cols + c0, n, da);
            if (a.gated) store_run(a.round_dtype, out.data, r * out_cols + cols + c0, n, db);
          }
        }
      });
    });
  }
  if (a.q != nullptr) cast_cpu(fus_tensor{out.data, a.round_dtype, rows, out_cols}, *a.q);
  if (a.dbias != nullptr) {
    // Sequential sums within groups of rows, then over the groups (activation.h), for each
    // column; the columns are split over the threads.
    const int64_t per = act_dbias_rows_per_group(rows);
    const int64_t min_cols =
        cpu_force_split() ? 1
                          : std::max<int64_t>(64, (int64_t{1} << 15) / std::max<int64_t>(rows, 1));
    parallel_ranges(out_cols, min_cols, [&](int64_t b0, int64_t b1) {
      with_cpu_isa([&]() FUS_INLINE_LAMBDA {
        float total[kCpuSeg], group[kCpuSeg], v[kCpuSeg];
        for (int64_t c0 = b0; c0 < b1; c0 += kCpuSeg) {
          const int64_t n = std::min(kCpuSeg, b1 - c0);
          for (int64_t j = 0; j < n; ++j) total[j] = 0.0f;
          for (int64_t r0 = 0; r0 < rows; r0 += per) {
            for (int64_t j = 0; j < n; ++j) group[j] = 0.0f;
            for (int64_t r = r0; r < std::min(rows, r0 + per); ++r) {
              load_run(a.round_dtype, out.data, r * out_cols + c0, n, v);
              for (int64_t j = 0; j < n; ++j) group[j] = f_add(group[j], v[j]);
            }
            for (int64_t j = 0; j < n; ++j) total[j] = f_add(total[j], group[j]);
          }
          store_run(a.dbias->dtype, a.dbias->data, c0, n, total);
        }
      });
    });
  }
}

}  // namespace fusible
