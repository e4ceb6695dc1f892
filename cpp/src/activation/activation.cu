// CUDA backend of the activation family. Bit-identical to activation_cpu.cpp: the values come from
// the shared math (common/activation_math.h), the casts from the shared numerics, and dbias is
// summed in the order activation.h fixes.
//
// One kernel per call: a block of 256 threads walks the 32 x 64 tiles of one column strip for a
// group of rows; each thread owns one row and 8 consecutive columns of a tile (16-byte vectors
// when aligned), computes its values, and hands them to the tile epilogue
// (common/fused_epilogue.cuh), which writes the high-precision output, the FP8 / MXFP8 copies
// (transposes and column-block scales through shared memory), amax, and the running column sums.
// Gated kinds read a and b from the two halves of x; their backward emits two strips (da, db).
// With dbias, each block leaves its group's column sums in the workspace and a small second
// kernel adds the groups in order.
#include "activation/activation_impl.h"
#include "common/cuda_utils.h"
#include "common/fused_epilogue.cuh"

namespace fusible {
namespace {

using fused::EpilogueAcc;
using fused::EpilogueOut;
using fused::EpilogueSmem;
using fused::kTileCols;
using fused::kTileRows;
using fused::kTileThreads;

struct ActParams {
  const void* x;
  fus_dtype x_dtype;
  const void* grad;
  fus_dtype grad_dtype;
  bool vec_x, vec_grad;
  int64_t rows, cols;  // cols = H
  int64_t rows_per_group;
  EpilogueOut out;
  float* amax;       // q's amax, or null
  float* partial;    // [groups, out_cols] column sums, or null
  float* scale_inv;  // per-tensor q: 1 / scale, or null
};

// T: void (run-time dtypes, any shape), or the 16-bit type of the common case (x, grad, the
// output and the rounding all of type T; H a multiple of 64; 16-byte aligned; not MXFP8), which
// reads packed vectors, loads a tile ahead, and uses the epilogue's 16-bit path. Same bits.
template <typename T, ActFn A, bool kGated, bool kBwd>
__global__ void __launch_bounds__(kTileThreads) act_kernel(const ActParams p) {
  constexpr bool k16 = !std::is_void_v<T>;
  __shared__ EpilogueSmem sm;
  const int tid = threadIdx.x, tx = tid % 8, ty = tid / 8;
  const int64_t H = p.cols, in_cols = kGated ? 2 * H : H;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kTileCols;
  const int64_t g = blockIdx.y;
  const int64_t rbeg = g * p.rows_per_group;
  const int64_t rend = fused::imin(p.rows, rbeg + p.rows_per_group);
  const int64_t c = c0 + 8 * tx;
  const int strip_cols = static_cast<int>(fused::imin(kTileCols, H - c0));
  const int nc = k16 ? 8 : static_cast<int>(fused::imax(0, fused::imin(8, H - c)));
  EpilogueAcc acc0, acc1;

  // 16-bit path: the raw vectors of the thread's row in the next tile (zero past rend; those
  // rows are outside the matrix or another group's, and emit_tile skips them).
  uint4 ra{}, rb{}, rg{};
  auto load_raw = [&](int64_t r) {
    if constexpr (k16) {
      ra = rb = rg = make_uint4(0, 0, 0, 0);
      if (r >= rend) return;
      const T* x = static_cast<const T*>(p.x) + r * in_cols + c;
      ra = __ldcs(reinterpret_cast<const uint4*>(x));
      if constexpr (kGated) rb = __ldcs(reinterpret_cast<const uint4*>(x + H));
      if constexpr (kBwd)
        rg = __ldcs(reinterpret_cast<const uint4*>(static_cast<const T*>(p.grad) + r * H + c));
    }
  };
  load_raw(rbeg + ty);

  for (int64_t r0 = rbeg; r0 < rend; r0 += kTileRows) {
    const int64_t r = r0 + ty;
    const int n = r < rend ? nc : 0;
    float a[8], b[8], gr[8], v0[8], v1[8];
    if constexpr (k16) {
      fused::unpack8<T>(ra, a);
      if constexpr (kGated) fused::unpack8<T>(rb, b);
      if constexpr (kBwd) fused::unpack8<T>(rg, gr);
      load_raw(r + kTileRows);
    } else {
      fused::load8(p.x, p.x_dtype, r * in_cols + c, n, p.vec_x, a);
      if constexpr (kGated) fused::load8(p.x, p.x_dtype, r * in_cols + H + c, n, p.vec_x, b);
      if constexpr (kBwd) fused::load8(p.grad, p.grad_dtype, r * H + c, n, p.vec_grad, gr);
    }
    if constexpr (!kBwd) {
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if constexpr (kGated)
          v0[j] = gated_fwd<A>(a[j], b[j]);
        else
          v0[j] = act_fn<A>(a[j]);
      }
      fused::emit_tile<T>(p.out, sm, acc0, r0, c0, strip_cols, v0, n);
    } else if constexpr (kGated) {
#pragma unroll
      for (int j = 0; j < 8; ++j) gated_grad<A>(gr[j], a[j], b[j], &v0[j], &v1[j]);
      fused::emit_tile<T>(p.out, sm, acc0, r0, c0, strip_cols, v0, n);
      fused::emit_tile<T>(p.out, sm, acc1, r0, H + c0, strip_cols, v1, n);
    } else {
#pragma unroll
      for (int j = 0; j < 8; ++j) v0[j] = act_grad<A>(gr[j], a[j]);
      fused::emit_tile<T>(p.out, sm, acc0, r0, c0, strip_cols, v0, n);
    }
  }

  if (p.partial && tid < strip_cols) {
    float* part = p.partial + g * p.out.out_cols;
    part[c0 + tid] = acc0.colsum;
    if (kGated && kBwd) part[H + c0 + tid] = acc1.colsum;
  }
  if (p.amax)
    fused::block_amax(max(fused::acc_amax_bits<T>(acc0), fused::acc_amax_bits<T>(acc1)), p.amax);
  if (p.scale_inv && blockIdx.x == 0 && blockIdx.y == 0 && tid == 0)
    *p.scale_inv = f_div(1.0f, *p.out.scale);
}

// Carries a kernel's type parameter through a generic lambda; void has no values to pass.
template <typename T>
struct TypeTag {
  using type = T;
};

bool aligned(const void* p, size_t bytes) { return p == nullptr || is_aligned(p, bytes); }

void act_launch(const ActArgs& a, const fus_context& ctx, bool bwd) {
  CudaDeviceGuard guard(ctx.device_index);
  cudaStream_t stream = stream_of(ctx);
  const int64_t rows = a.rows, H = a.cols;
  const int64_t in_cols = a.gated ? 2 * H : H;
  const int64_t out_cols = bwd ? in_cols : H;
  const fus_quantized* q = a.q;
  const bool per_tensor = q && q->mode == FUS_SCALING_PER_TENSOR;
  float* scale_inv = per_tensor ? static_cast<float*>(q->rowwise_scale_inv) : nullptr;
  float* amax = q ? q->amax : nullptr;
  if (amax) FUS_CUDA_CHECK(cudaMemsetAsync(amax, 0, sizeof(float), stream));

  if (rows == 0) {
    if (scale_inv) {
      fused::scale_inv_kernel<<<1, 1, 0, stream>>>(q->scale, scale_inv);
      FUS_CUDA_CHECK_LAUNCH("scale_inv_kernel");
    }
    if (a.dbias)
      FUS_CUDA_CHECK(
          cudaMemsetAsync(a.dbias->data, 0, out_cols * fus_dtype_size(a.dbias->dtype), stream));
    return;
  }

  ActParams p{};
  p.x = a.x.data;
  p.x_dtype = a.x.dtype;
  p.grad = bwd ? a.grad.data : nullptr;
  p.grad_dtype = a.grad.dtype;
  p.vec_x = H % 8 == 0 && aligned(a.x.data, 16);
  p.vec_grad = bwd && H % 8 == 0 && aligned(a.grad.data, 16);
  p.rows = rows;
  p.cols = H;
  const bool colsum = bwd && a.dbias != nullptr;
  const int64_t tiles = (rows + kTileRows - 1) / kTileRows;
  const int64_t strips = (H + kTileCols - 1) / kTileCols;
  // dbias fixes the row groups (activation.h's summation order). Without it the split is free:
  // about 32 blocks per SM in all, each walking several tiles on large inputs (fewer blocks to
  // schedule, fewer amax atomics).
  if (colsum) {
    p.rows_per_group = act_dbias_rows_per_group(rows);
  } else {
    const int64_t free_groups = std::max<int64_t>(1, 32 * int64_t{sm_count()} / strips);
    p.rows_per_group = kTileRows * std::max((tiles + free_groups - 1) / free_groups,
                                            (tiles + 65534) / 65535);  // grid.y <= 65535
  }
  const int64_t groups = (rows + p.rows_per_group - 1) / p.rows_per_group;

  EpilogueOut& o = p.out;
  o.hp = a.out ? a.out->data : nullptr;
  o.hp_dtype = a.out ? a.out->dtype : a.round_dtype;
  o.round_dtype = a.round_dtype;
  o.vec_hp = H % 8 == 0 && aligned(o.hp, 16);
  o.qmode = q ? (per_tensor ? 1 : 2) : 0;
  o.e5m2 = q && q->dtype == FUS_FLOAT8_E5M2;
  if (q) {
    o.q_row = static_cast<uint8_t*>(q->rowwise_data);
    o.q_col = static_cast<uint8_t*>(q->columnwise_data);
    if (!per_tensor) {
      o.s_row = static_cast<uint8_t*>(q->rowwise_scale_inv);
      o.s_col = static_cast<uint8_t*>(q->columnwise_scale_inv);
    }
    o.scale = q->scale;
    o.vec_q_row = H % 8 == 0 && aligned(o.q_row, 8) && (per_tensor || aligned(o.q_col, 8));
    o.vec_q_t = per_tensor && rows % 8 == 0 && aligned(o.q_col, 8);
  }
  o.amax = amax != nullptr;
  o.colsum = colsum;
  o.rows = rows;
  o.out_cols = out_cols;
  p.amax = amax;
  p.partial = colsum ? static_cast<float*>(a.workspace) : nullptr;
  p.scale_inv = scale_inv;

  const dim3 grid(static_cast<unsigned>((H + kTileCols - 1) / kTileCols),
                  static_cast<unsigned>(groups));
  // The 16-bit path (act_kernel's T): every tensor of one 16-bit type, whole strips, vectors.
  const fus_dtype dt = a.x.dtype;
  const bool k16 = (dt == FUS_BFLOAT16 || dt == FUS_FLOAT16) && a.round_dtype == dt &&
                   (!bwd || a.grad.dtype == dt) && (!a.out || (a.out->dtype == dt && o.vec_hp)) &&
                   H % kTileCols == 0 && p.vec_x && (!bwd || p.vec_grad) && o.qmode != 2;
  auto launch = [&](auto t, auto tag) {
    using T = typename decltype(t)::type;
    constexpr ActFn A = decltype(tag)::value;
    if (bwd) {
      if (a.gated)
        act_kernel<T, A, true, true><<<grid, kTileThreads, 0, stream>>>(p);
      else
        act_kernel<T, A, false, true><<<grid, kTileThreads, 0, stream>>>(p);
    } else {
      if (a.gated)
        act_kernel<T, A, true, false><<<grid, kTileThreads, 0, stream>>>(p);
      else
        act_kernel<T, A, false, false><<<grid, kTileThreads, 0, stream>>>(p);
    }
  };
  dispatch_act(a.fn, [&](auto tag) {
    if (!k16)
      launch(TypeTag<void>{}, tag);
    else if (dt == FUS_BFLOAT16)
      launch(TypeTag<Bf16>{}, tag);
    else
      launch(TypeTag<Half>{}, tag);
  });
  FUS_CUDA_CHECK_LAUNCH("act_kernel");
  if (colsum) {
    fused::
        colsum_finalize_kernel<<<static_cast<unsigned>((out_cols + 255) / 256), 256, 0, stream>>>(
            p.partial, groups, out_cols, a.dbias->data, a.dbias->dtype);
    FUS_CUDA_CHECK_LAUNCH("colsum_finalize_kernel");
  }
}

}  // namespace

void act_forward_cuda(const ActArgs& a, const fus_context& ctx) { act_launch(a, ctx, false); }
void act_backward_cuda(const ActArgs& a, const fus_context& ctx) { act_launch(a, ctx, true); }

}  // namespace fusible
