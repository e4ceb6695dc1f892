// Backend entry points of the activation family. Arguments are validated by activation_api.cpp;
// backends throw fusible::Error on failure.
#pragma once

#include <type_traits>

#include "common/activation_math.h"
#include "common/status.h"
#include "fusible/activation.h"

namespace fusible {

struct ActArgs {
  ActFn fn;
  bool gated;
  int64_t rows;
  int64_t cols;             // H: columns of the forward output / of grad
  fus_tensor x;             // [rows, K], K = gated ? 2H : H
  fus_tensor grad;          // backward only: [rows, H]
  const fus_tensor* out;    // forward: y [rows, H]; backward: dx [rows, K]; NULL: not written
  fus_dtype round_dtype;    // out's dtype, else x's (forward) / grad's (backward)
  const fus_quantized* q;   // NULL: no quantized output
  const fus_tensor* dbias;  // backward only; NULL: not computed
  void* workspace;
  size_t workspace_bytes;
};

// Column-sum plan of dbias: groups of act_dbias_rows_per_group(N) consecutive rows (a multiple of
// 32), summed sequentially within a group, then group sums added sequentially.
constexpr int64_t kActMaxGroups = 64;
inline int64_t act_dbias_rows_per_group(int64_t rows) {
  const int64_t tiles = (rows + 31) / 32;
  return 32 * ((tiles + kActMaxGroups - 1) / kActMaxGroups);
}
inline int64_t act_dbias_groups(int64_t rows) {
  if (rows <= 0) return 0;
  const int64_t per = act_dbias_rows_per_group(rows);
  return (rows + per - 1) / per;
}

// Device workspace of the CUDA backward with dbias: [groups, K] fp32 partial sums.
inline size_t act_bwd_workspace_bytes(int64_t rows, int64_t out_cols) {
  return static_cast<size_t>(act_dbias_groups(rows)) * static_cast<size_t>(out_cols) *
         sizeof(float);
}

template <ActFn A>
using ActTag = std::integral_constant<ActFn, A>;

#if defined(__GNUC__) || defined(__clang__)
#define FUS_ACT_DISPATCH_INLINE inline __attribute__((always_inline))
#else
#define FUS_ACT_DISPATCH_INLINE inline
#endif

// Calls f(ActTag<A>{}) for the runtime function fn (one case a row of FUS_ACT_FUNCTIONS), so every
// backend runs the same template code. Always inlined, so that each instruction-set variant of the
// CPU backend (with_cpu_isa) compiles f's body for its own target.
template <typename F>
FUS_ACT_DISPATCH_INLINE void dispatch_act(ActFn fn, F&& f) {
  switch (fn) {
#define FUS_ACT_DISPATCH_CASE_(name, fwd, bwd) \
  case ActFn::k##name: f(ActTag<ActFn::k##name>{}); return;
    FUS_ACT_FUNCTIONS(FUS_ACT_DISPATCH_CASE_)
#undef FUS_ACT_DISPATCH_CASE_
  }
  throw Error(FUS_ERROR_INTERNAL, "activation: unknown function");
}

void act_forward_cpu(const ActArgs& a);
void act_backward_cpu(const ActArgs& a);

#if defined(FUSIBLE_WITH_CUDA)
void act_forward_cuda(const ActArgs& a, const fus_context& ctx);
void act_backward_cuda(const ActArgs& a, const fus_context& ctx);
#endif

}  // namespace fusible
