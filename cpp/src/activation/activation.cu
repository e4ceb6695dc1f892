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
//
// Blockwise FP8 output (1x128 or 128x128 blocks) needs whole 128-element blocks along rows and
// down columns, which the 32 x 64 tiles do not hold: act_block_kernel computes the values of one
// 128 x 128 tile of the output at a time (a block walks the tiles of one column strip for a range
// of rows) and hands them to the shared blockwise tile cast (common/block_cast.cuh), which writes
// both copies; the high-precision output, amax and the dbias column sums (staged through shared
// memory and summed in row order, the ranges of rows aligned to activation.h's groups) as above.
//
// The backward with dbias and no transposed or MXFP8 copy may instead run act_walk_kernel (each
// thread walks the rows of its group down 8 columns, the column sums in registers: same order,
// same bits), where its grid fills the GPU; act_launch says when.
#include <cstdlib>

#include "activation/activation_impl.h"
#include "common/block_cast.cuh"
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
  int64_t groups, groups_per_block;  // row groups; consecutive ones a block walks (blockIdx.y)
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
  constexpr bool kReadX = !(kBwd && A == ActFn::kIdentity);  // identity's backward: grad only
  __shared__ EpilogueSmem sm;
  const int tid = threadIdx.x, tx = tid % 8, ty = tid / 8;
  const int64_t H = p.cols, in_cols = kGated ? 2 * H : H;
  const int64_t c0 = static_cast<int64_t>(blockIdx.x) * kTileCols;
  const int64_t g0 = static_cast<int64_t>(blockIdx.y) * p.groups_per_block;
  const int64_t g1 = fused::imin(p.groups, g0 + p.groups_per_block);
  const int64_t c = c0 + 8 * tx;
  const int strip_cols = static_cast<int>(fused::imin(kTileCols, H - c0));
  const int nc = k16 ? 8 : static_cast<int>(fused::imax(0, fused::imin(8, H - c)));
  EpilogueAcc acc0, acc1;

  // 16-bit path: the raw vectors of the thread's row in the next tile (zero past rend; those
  // rows are outside the matrix or another group's, and emit_tile skips them).
  uint4 ra{}, rb{}, rg{};
  int64_t rend = 0;
  auto load_raw = [&](int64_t r) {
    if constexpr (k16) {
      ra = rb = rg = make_uint4(0, 0, 0, 0);
      if (r >= rend) return;
      const T* x = static_cast<const T*>(p.x) + r * in_cols + c;
      if constexpr (kReadX) ra = __ldcs(reinterpret_cast<const uint4*>(x));
      if constexpr (kGated) rb = __ldcs(reinterpret_cast<const uint4*>(x + H));
      if constexpr (kBwd)
        rg = __ldcs(reinterpret_cast<const uint4*>(static_cast<const T*>(p.grad) + r * H + c));
    }
  };
  // Each group's column sums run over its rows in order and go to its own partial row, whichever
  // block walks it: the bits do not depend on groups_per_block.
  for (int64_t g = g0; g < g1; ++g) {
    const int64_t rbeg = g * p.rows_per_group;
    rend = fused::imin(p.rows, rbeg + p.rows_per_group);
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
        if constexpr (kReadX) fused::load8(p.x, p.x_dtype, r * in_cols + c, n, p.vec_x, a);
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
    acc0.colsum = acc1.colsum = 0.0f;
  }
  if (p.amax)
    fused::block_amax(max(fused::acc_amax_bits<T>(acc0), fused::acc_amax_bits<T>(acc1)), p.amax);
  if (p.scale_inv && blockIdx.x == 0 && blockIdx.y == 0 && tid == 0)
    *p.scale_inv = f_div(1.0f, *p.out.scale);
}

// The row-walking kernel: the common case without a transposed or MXFP8 copy (the 16-bit path's
// conditions, per-tensor FP8 rowwise or no quantized output) needs no exchange between threads,
// so each thread owns 8 consecutive columns and walks the rows of its group in order. dbias's
// column sums then run in registers in activation.h's order (the bits of act_kernel's shared-
// memory sums), and a tile's two barriers, its shared-memory staging and the 64-thread add chain
// are gone: about a fifth of act_kernel's instructions per element, which bound it (issue-bound:
// ncu at 2144 x 14336, an MoE expert's dGELU + FP8 + dbias, 88% issue-active, 0.49 of copy
// bandwidth). Same functions of the same values as act_kernel: same bits. kWalkThreads threads a
// block (blockIdx.x: a strip of 8 * kWalkThreads columns; blockIdx.y: groups_per_block
// consecutive row groups).
constexpr int kWalkThreads = 64;

template <typename T, ActFn A, bool kGated, bool kBwd, int kR>
__global__ void __launch_bounds__(kWalkThreads) act_walk_kernel(const ActParams p) {
  const int64_t H = p.cols, in_cols = kGated ? 2 * H : H;
  const EpilogueOut& o = p.out;
  const int64_t c = (static_cast<int64_t>(blockIdx.x) * kWalkThreads + threadIdx.x) * 8;
  const int64_t g0 = static_cast<int64_t>(blockIdx.y) * p.groups_per_block;
  const int64_t g1 = fused::imin(p.groups, g0 + p.groups_per_block);
  constexpr bool kReadX = !(kBwd && A == ActFn::kIdentity);  // identity's backward: grad only
  const bool active = c < H;  // H % 8 == 0: a thread's 8 columns are all inside or all outside
  const float scale = o.qmode == 1 ? *o.scale : 0.0f;
  uint32_t am0 = 0, am1 = 0;
  // kR rows a step: their loads are issued together (one step ahead) and their values computed
  // side by side (independent chains), then emitted in row order.
  uint4 ra[kR], rb[kR], rg[kR];
  auto load_rows = [&](int64_t r, int64_t rend) {
#pragma unroll
    for (int k = 0; k < kR; ++k) {
      ra[k] = rb[k] = rg[k] = make_uint4(0, 0, 0, 0);
      if (r + k >= rend) continue;
      const T* x = static_cast<const T*>(p.x) + (r + k) * in_cols + c;
      if constexpr (kReadX) ra[k] = __ldcs(reinterpret_cast<const uint4*>(x));
      if constexpr (kGated) rb[k] = __ldcs(reinterpret_cast<const uint4*>(x + H));
      if constexpr (kBwd)
        rg[k] =
            __ldcs(reinterpret_cast<const uint4*>(static_cast<const T*>(p.grad) + (r + k) * H + c));
    }
  };
  // One output strip of a row: round (and store) the 8 values, fold amax, cast, add to sums.
  auto emit = [&](int64_t r, int64_t col, float (&v)[8], uint32_t& am, float (&sum)[8]) {
    const int64_t at = r * o.out_cols + col;
    const uint4 packed = fused::round_pack8<T>(v);
    if (o.hp) *reinterpret_cast<uint4*>(static_cast<T*>(o.hp) + at) = packed;
    if (o.amax) am = fused::amax16_update(am, packed);
    if (o.q_row) *reinterpret_cast<uint2*>(o.q_row + at) = fused::cast8(o.e5m2, v, scale);
    if (o.colsum) {
#pragma unroll
      for (int j = 0; j < 8; ++j) sum[j] = f_add(sum[j], v[j]);
    }
  };
  auto store_sums = [&](int64_t g, int64_t col, const float (&sum)[8]) {
    float4* d = reinterpret_cast<float4*>(p.partial + g * o.out_cols + col);
    d[0] = make_float4(sum[0], sum[1], sum[2], sum[3]);
    d[1] = make_float4(sum[4], sum[5], sum[6], sum[7]);
  };
  if (active) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t rbeg = g * p.rows_per_group;
      const int64_t rend = fused::imin(p.rows, rbeg + p.rows_per_group);
      float s0[8] = {}, s1[8] = {};
      load_rows(rbeg, rend);
      for (int64_t r = rbeg; r < rend; r += kR) {
        float a[kR][8], b[kR][8], gr[kR][8], v0[kR][8], v1[kR][8];
#pragma unroll
        for (int k = 0; k < kR; ++k) {
          fused::unpack8<T>(ra[k], a[k]);
          if constexpr (kGated) fused::unpack8<T>(rb[k], b[k]);
          if constexpr (kBwd) fused::unpack8<T>(rg[k], gr[k]);
        }
        load_rows(r + kR, rend);
#pragma unroll
        for (int k = 0; k < kR; ++k) {
#pragma unroll
          for (int j = 0; j < 8; ++j) {
            if constexpr (!kBwd && kGated)
              v0[k][j] = gated_fwd<A>(a[k][j], b[k][j]);
            else if constexpr (!kBwd)
              v0[k][j] = act_fn<A>(a[k][j]);
            else if constexpr (kGated)
              gated_grad<A>(gr[k][j], a[k][j], b[k][j], &v0[k][j], &v1[k][j]);
            else
              v0[k][j] = act_grad<A>(gr[k][j], a[k][j]);
          }
        }
#pragma unroll
        for (int k = 0; k < kR; ++k) {
          if (r + k >= rend) break;
          emit(r + k, c, v0[k], am0, s0);
          if constexpr (kGated && kBwd) emit(r + k, H + c, v1[k], am1, s1);
        }
      }
      if (p.partial) {
        store_sums(g, c, s0);
        if (kGated && kBwd) store_sums(g, H + c, s1);
      }
    }
  }
  if (p.amax)
    fused::block_amax(max(fused::amax16_bits<T>(am0), fused::amax16_bits<T>(am1)), p.amax);
  if (p.scale_inv && blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0)
    *p.scale_inv = f_div(1.0f, *p.out.scale);
}

// Calls f(kGated, kBwd) with the two flags as std::bool_constant values (a kernel's template
// arguments).
template <typename F>
void with_flags(bool gated, bool bwd, F&& f) {
  using Yes = std::true_type;
  using No = std::false_type;
  if (bwd) {
    if (gated)
      f(Yes{}, Yes{});
    else
      f(No{}, Yes{});
  } else {
    if (gated)
      f(Yes{}, No{});
    else
      f(No{}, No{});
  }
}

// ---- blockwise output
// -------------------------------------------------------------------------------

struct ActBlockParams {
  const void* x;
  fus_dtype x_dtype;
  const void* grad;
  fus_dtype grad_dtype;
  int64_t rows, cols;  // cols = H
  fus_dtype round_dtype;
  void* hp;  // high-precision output [rows, out_cols] or null
  fus_dtype hp_dtype;
  block_cast::Out out;      // [rows, out_cols]
  int64_t tiles_per_block;  // 128-row tiles a block walks (blockIdx.y: its range)
  int64_t rows_per_group;   // dbias: activation.h's row groups
  float* amax;              // or null
  float* partial;           // dbias: [groups, out_cols] column sums, or null
};

// Output element (r, c) of the activation, rounded to round_dtype (act_kernel's values: the same
// functions of the same inputs).
template <ActFn A, bool kGated, bool kBwd>
__device__ __forceinline__ float act_value(const ActBlockParams& p, int64_t r, int64_t c) {
  const int64_t H = p.cols, in_cols = kGated ? 2 * H : H;
  float v;
  if constexpr (!kBwd) {
    const float a = load_hp(p.x, p.x_dtype, r * in_cols + c);
    if constexpr (kGated)
      v = gated_fwd<A>(a, load_hp(p.x, p.x_dtype, r * in_cols + H + c));
    else
      v = act_fn<A>(a);
  } else if constexpr (kGated) {
    const int64_t k = c < H ? c : c - H;  // dx = [da | db]
    float da, db;
    gated_grad<A>(load_hp(p.grad, p.grad_dtype, r * H + k),
                  load_hp(p.x, p.x_dtype, r * in_cols + k),
                  load_hp(p.x, p.x_dtype, r * in_cols + H + k), &da, &db);
    v = c < H ? da : db;
  } else {
    v = act_grad<A>(load_hp(p.grad, p.grad_dtype, r * H + c), load_hp(p.x, p.x_dtype, r * H + c));
  }
  return round_hp(p.round_dtype, v);
}

template <ActFn A, bool kGated, bool kBwd, Fp8Format F>
__global__ void __launch_bounds__(block_cast::kThreads) act_block_kernel(const ActBlockParams p) {
  constexpr int kT = block_cast::kTile;
  __shared__ block_cast::Smem sm;
  __shared__ float stage[32][kT + 1];  // dbias: 32 rows of the tile at a time
  const block_cast::Out& o = p.out;
  const int64_t tc = blockIdx.x, c0 = tc * kT;
  const int64_t t0 = static_cast<int64_t>(blockIdx.y) * p.tiles_per_block;
  const int64_t t1 = fused::imin(o.nbr, t0 + p.tiles_per_block);
  const int tid = threadIdx.x, warp = tid / 32;
  uint32_t amax = 0;
  float colsum = 0.0f;  // threads < 128: column c0 + tid's running sum over its current group
  int64_t group = t0 * kT / (p.rows_per_group > 0 ? p.rows_per_group : 1);
  for (int64_t tr = t0; tr < t1; ++tr) {
    const int64_t r0 = tr * kT;
    if (tr > t0) __syncthreads();  // the previous tile's cast_tile exchange
    block_cast::Chunks<float> raw;
    block_cast::compute_chunks(
        [&](int64_t r, int64_t c, int n, float (&v)[4]) {
#pragma unroll
          for (int e = 0; e < 4; ++e)
            if (e < n) {
              v[e] = act_value<A, kGated, kBwd>(p, r, c + e);
              if (p.hp) store_hp(p.hp, p.hp_dtype, r * o.cols + c + e, v[e]);
            }
        },
        o.rows, o.cols, r0, c0, raw);
    amax =
        max(amax, block_cast::cast_tile<float, F>(o, sm, raw, tr, tc, o.two_d, p.amax != nullptr));
    if (p.partial) {
      // Rows 32 q .. 32 q + 31 of the tile are held by warps 2 q and 2 q + 1 (warp w: rows
      // 16 w .. 16 w + 15, lane l: columns 4 l .. 4 l + 3).
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        if (warp / 2 == q) {
#pragma unroll
          for (int i = 0; i < block_cast::Geo<float>::kR; ++i) {
            float* row = &stage[16 * (warp % 2) + i][4 * (tid % 32)];
            row[0] = bits_as_float(raw[i].x);
            row[1] = bits_as_float(raw[i].y);
            row[2] = bits_as_float(raw[i].z);
            row[3] = bits_as_float(raw[i].w);
          }
        }
        __syncthreads();
        if (tid < kT) {
          for (int rr = 0; rr < 32; ++rr) {
            const int64_t r = r0 + 32 * q + rr;
            if (r >= o.rows) break;
            const int64_t g = r / p.rows_per_group;
            if (g != group) {  // the previous group is complete (rows are in order)
              if (c0 + tid < o.cols) p.partial[group * o.cols + c0 + tid] = colsum;
              colsum = 0.0f;
              group = g;
            }
            colsum = f_add(colsum, stage[rr][tid]);
          }
        }
        __syncthreads();
      }
    }
  }
  if (p.partial && tid < kT && c0 + tid < o.cols && t0 < t1)
    p.partial[group * o.cols + c0 + tid] = colsum;
  if (p.amax && tid == 0 && amax != 0) atomicMax(reinterpret_cast<unsigned int*>(p.amax), amax);
}

// Launches act_block_kernel for a blockwise q (rows > 0).
void act_block_launch(const ActArgs& a, bool bwd, int64_t out_cols, cudaStream_t stream) {
  const fus_quantized& q = *a.q;
  ActBlockParams p{};
  p.x = a.x.data;
  p.x_dtype = a.x.dtype;
  p.grad = bwd ? a.grad.data : nullptr;
  p.grad_dtype = a.grad.dtype;
  p.rows = a.rows;
  p.cols = a.cols;
  p.round_dtype = a.round_dtype;
  p.hp = a.out ? a.out->data : nullptr;
  p.hp_dtype = a.out ? a.out->dtype : a.round_dtype;
  p.out = block_cast::make_out<float>(q);
  p.amax = q.amax;
  const bool colsum = bwd && a.dbias != nullptr;
  constexpr int64_t kT = block_cast::kTile;
  if (colsum) {
    // A block's rows are whole groups: lcm(128, rows_per_group) rows (rows_per_group % 32 == 0).
    p.rows_per_group = act_dbias_rows_per_group(a.rows);
    int64_t g = kT, m = p.rows_per_group;
    while (m != 0) {
      const int64_t t = g % m;
      g = m;
      m = t;
    }
    p.tiles_per_block = p.rows_per_group / g;
    p.partial = static_cast<float*>(a.workspace);
  } else {
    p.rows_per_group = 0;
    p.tiles_per_block = (p.out.nbr + 65534) / 65535;  // grid.y <= 65535
  }
  const dim3 grid(static_cast<unsigned>(p.out.nbc),
                  static_cast<unsigned>((p.out.nbr + p.tiles_per_block - 1) / p.tiles_per_block));
  dispatch_act(a.fn, [&](auto tag) {
    constexpr ActFn A = decltype(tag)::value;
    dispatch_fp8(q.dtype, [&](auto f) {
      with_flags(a.gated, bwd, [&](auto gated, auto backward) {
        act_block_kernel<A, decltype(gated)::value, decltype(backward)::value, decltype(f)::value>
            <<<grid, block_cast::kThreads, 0, stream>>>(p);
      });
    });
  });
  FUS_CUDA_CHECK_LAUNCH("act_block_kernel");
  if (colsum) {
    const int64_t groups = act_dbias_groups(a.rows);
    fused::launch_colsum_finalize(p.partial, groups, out_cols, a.dbias->data, a.dbias->dtype,
                                  stream);
    FUS_CUDA_CHECK_LAUNCH("colsum_finalize_kernel");
  }
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
  fused::begin_cast(q, rows == 0, stream);

  if (rows == 0) {
    if (a.dbias)
      FUS_CUDA_CHECK(
          cudaMemsetAsync(a.dbias->data, 0, out_cols * fus_dtype_size(a.dbias->dtype), stream));
    return;
  }

  if (q && (q->mode == FUS_SCALING_BLOCK_1D || q->mode == FUS_SCALING_BLOCK_2D))
    return act_block_launch(a, bwd, out_cols, stream);

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
  p.groups = groups;
  // dbias on few rows makes groups of one or two tiles (a block each: a short block's launch and
  // partial store cost as much as its tile, 0.34 of copy bandwidth for an MoE expert's 2000 rows
  // on the H200): then a block walks several consecutive groups, about 8 tiles, while the grid
  // keeps at least 4 blocks per SM.
  p.groups_per_block = 1;
  if (colsum) {
    const int64_t tiles_per_group = p.rows_per_group / kTileRows;
    int64_t gpb = std::max<int64_t>(1, 8 / tiles_per_group);
    while (gpb > 1 && strips * ((groups + gpb - 1) / gpb) < 4 * int64_t{sm_count()}) gpb /= 2;
    p.groups_per_block = gpb;
  }

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
                  static_cast<unsigned>((groups + p.groups_per_block - 1) / p.groups_per_block));
  // The 16-bit path (act_kernel's T): every tensor of one 16-bit type, whole strips, vectors.
  const fus_dtype dt = a.x.dtype;
  const bool k16 = (dt == FUS_BFLOAT16 || dt == FUS_FLOAT16) && a.round_dtype == dt &&
                   (!bwd || a.grad.dtype == dt) && (!a.out || (a.out->dtype == dt && o.vec_hp)) &&
                   H % kTileCols == 0 && p.vec_x && (!bwd || p.vec_grad) && o.qmode != 2;
  // The row-walking kernel: the 16-bit path's inputs (H % 8 == 0 suffices) and no copy that
  // needs threads to exchange values (transposed, MXFP8). FUSIBLE_ACT_WALK: unset, the rule
  // below; 0, act_kernel only; 1 / 2, the row-walking kernel with 1 / 2 rows a step wherever it
  // applies (A/B timing, tests of both; the same bits either way).
  static const int walk_env = [] {
    const char* e = std::getenv("FUSIBLE_ACT_WALK");
    return e == nullptr ? -1 : std::atoi(e);
  }();
  const bool walk_ok =
      (dt == FUS_BFLOAT16 || dt == FUS_FLOAT16) && a.round_dtype == dt &&
      (!bwd || a.grad.dtype == dt) && (!a.out || (a.out->dtype == dt && o.vec_hp)) && H % 8 == 0 &&
      p.vec_x && (!bwd || p.vec_grad) &&
      (o.qmode == 0 || (o.qmode == 1 && !o.q_col && aligned(o.q_row, 8))) && aligned(p.partial, 16);
  const int64_t wstrips = (H + 8 * kWalkThreads - 1) / (8 * kWalkThreads);
  int64_t wgroups = groups, wrows = p.rows_per_group;
  if (walk_ok && !colsum) {
    // Free split: about 24 blocks (48 warps) per SM, each walking a run of rows.
    const int64_t ygroups = std::max<int64_t>(1, 24 * int64_t{sm_count()} / wstrips);
    wrows = std::max((rows + ygroups - 1) / ygroups, (rows + 65534) / 65535);
    wgroups = (rows + wrows - 1) / wrows;
  }
  // By default only the backward with dbias walks (its column sums move from shared memory into
  // registers: 2144 x 14336 dGELU + FP8 + dbias 0.073 -> 0.068 ms, 16384 x 14336 0.436 -> 0.422
  // on the H200), two rows a step, where the grid has at least 12 warps per SM (a colsum's row
  // groups cap the threads at H / 8 per group; below that act_kernel's tiles keep more loads in
  // flight). The forward walked was slower at large sizes (16384 x 14336 GELU + FP8 0.296 ->
  // 0.317 ms): act_kernel keeps it.
  const int64_t walk_warps = (H / 8 + 31) / 32 * wgroups;
  int walk_rows = 0;  // 0: act_kernel
  if (walk_ok && walk_env < 0 && bwd && colsum)
    walk_rows = walk_warps >= 12 * int64_t{sm_count()} ? 2 : 0;
  if (walk_ok && walk_env >= 0) walk_rows = walk_env == 0 ? 0 : walk_env == 1 ? 1 : 2;
  ActParams pw = p;  // the row-walking kernel's split
  pw.rows_per_group = wrows;
  pw.groups = wgroups;
  pw.groups_per_block = 1;
  const dim3 walk_grid(static_cast<unsigned>(wstrips), static_cast<unsigned>(wgroups));
  // A walking block lives for its whole row group, so a partial last wave leaves most SMs idle
  // for that long: by default the walk needs its waves at least 2/3 full (H200, dGELU + FP8 +
  // dbias at 14336 columns: 4256 rows, 45 groups in 1.19 waves of 8 blocks per SM, walked 0.140
  // ms against act_kernel's 0.129; 1728 rows, 1.43 waves, 0.057 against 0.071).
  auto walk_fills = [&](const void* kernel) {
    if (walk_env >= 0) return true;
    const int64_t cap = int64_t{resident_blocks_per_sm(kernel, kWalkThreads)} * sm_count();
    const int64_t blocks = wstrips * wgroups, waves = (blocks + cap - 1) / cap;
    return cap > 0 && 3 * blocks >= 2 * waves * cap;
  };
  auto launch = [&](auto t, auto tag) {
    using T = typename decltype(t)::type;
    constexpr ActFn A = decltype(tag)::value;
    with_flags(a.gated, bwd, [&](auto gated, auto backward) {
      constexpr bool kG = decltype(gated)::value, kB = decltype(backward)::value;
      if constexpr (!std::is_void_v<T>) {
        const auto walk1 = act_walk_kernel<T, A, kG, kB, 1>;
        const auto walk2 = act_walk_kernel<T, A, kG, kB, 2>;
        if (walk_rows == 1 && walk_fills(reinterpret_cast<const void*>(walk1))) {
          walk1<<<walk_grid, kWalkThreads, 0, stream>>>(pw);
          return;
        }
        if (walk_rows == 2 && walk_fills(reinterpret_cast<const void*>(walk2))) {
          walk2<<<walk_grid, kWalkThreads, 0, stream>>>(pw);
          return;
        }
        if (!k16) {  // the walk's 16-bit inputs, but not act_kernel's 16-bit path's
          act_kernel<void, A, kG, kB><<<grid, kTileThreads, 0, stream>>>(p);
          return;
        }
      }
      act_kernel<T, A, kG, kB><<<grid, kTileThreads, 0, stream>>>(p);
    });
  };
  dispatch_act(a.fn, [&](auto tag) {
    if (!k16 && !walk_rows)
      launch(TypeTag<void>{}, tag);
    else if (dt == FUS_BFLOAT16)
      launch(TypeTag<Bf16>{}, tag);
    else
      launch(TypeTag<Half>{}, tag);
  });
  FUS_CUDA_CHECK_LAUNCH("act_kernel");
  if (colsum) {
    fused::launch_colsum_finalize(p.partial, groups, out_cols, a.dbias->data, a.dbias->dtype,
                                  stream);
    FUS_CUDA_CHECK_LAUNCH("colsum_finalize_kernel");
  }
}

}  // namespace

void act_forward_cuda(const ActArgs& a, const fus_context& ctx) { act_launch(a, ctx, false); }
void act_backward_cuda(const ActArgs& a, const fus_context& ctx) { act_launch(a, ctx, true); }

}  // namespace fusible
