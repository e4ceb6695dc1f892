// CPU backend of the gemm family: the reference of the numerics in fusible/gemm.h.
//
// Blocked for cache: the output is computed in tiles of kMc x kNc fp32 accumulators; for each tile
// the K dimension is walked in panels of kKc, packing op(A) [kMc, kKc] and op(B) [kKc, kNc] into
// row-major float buffers (FP8 decoded exactly through a 256-entry table, fp16/bf16 widened
// exactly). The inner loop runs over the columns of the tile, so every accumulator receives its
// products one at a time in ascending k: blocking changes only the memory order, never the
// summation order, and the compiler's vectorisation of the column loop is exact. The library is
// built with -ffp-contract=off (CMakeLists.txt), so a product and its addition round separately
// on every compiler and target.
#include <algorithm>
#include <cstring>
#include <vector>

#include "common/activation_math.h"
#include "common/dispatch.h"
#include "common/fp32_ops.h"
#include "gemm/gemm_impl.h"

namespace fusible {
namespace {

constexpr int64_t kMc = 64;   // rows of a tile
constexpr int64_t kNc = 256;  // columns of a tile
constexpr int64_t kKc = 256;  // depth of a packed panel

// Value table of an FP8 dtype: every code decoded exactly.
struct Fp8Table {
  float v[256];
  explicit Fp8Table(fus_dtype dtype) {
    for (int i = 0; i < 256; ++i) {
      const uint8_t q = static_cast<uint8_t>(i);
      v[i] = dtype == FUS_FLOAT8_E4M3 ? fp8_to_float<Fp8Format::kE4M3>(q)
                                      : fp8_to_float<Fp8Format::kE5M2>(q);
    }
  }
};

// Calls f(load) with load(i) -> float for element i of a matrix stored as dtype.
template <typename F>
void with_loader(fus_dtype dtype, const void* data, F&& f) {
  switch (dtype) {
    case FUS_FLOAT32: {
      const float* p = static_cast<const float*>(data);
      f([p](int64_t i) { return p[i]; });
      return;
    }
    case FUS_FLOAT16: {
      const Half* p = static_cast<const Half*>(data);
      f([p](int64_t i) { return Element<Half>::load(p, i); });
      return;
    }
    case FUS_BFLOAT16: {
      const Bf16* p = static_cast<const Bf16*>(data);
      f([p](int64_t i) { return Element<Bf16>::load(p, i); });
      return;
    }
    case FUS_FLOAT8_E4M3:
    case FUS_FLOAT8_E5M2: {
      static const Fp8Table e4m3(FUS_FLOAT8_E4M3), e5m2(FUS_FLOAT8_E5M2);
      const float* table = dtype == FUS_FLOAT8_E4M3 ? e4m3.v : e5m2.v;
      const uint8_t* p = static_cast<const uint8_t*>(data);
      f([p, table](int64_t i) { return table[p[i]]; });
      return;
    }
    default: throw Error(FUS_ERROR_INTERNAL, "fus_gemm: unexpected dtype in the CPU backend");
  }
}

float load_one(fus_dtype dtype, const void* data, int64_t i) {
  switch (dtype) {
    case FUS_FLOAT32: return static_cast<const float*>(data)[i];
    case FUS_FLOAT16: return Element<Half>::load(static_cast<const Half*>(data), i);
    case FUS_BFLOAT16: return Element<Bf16>::load(static_cast<const Bf16*>(data), i);
    default: throw Error(FUS_ERROR_INTERNAL, "fus_gemm: unexpected epilogue dtype");
  }
}

// Rounds v to dtype (RNE); FP8 stores fp8(v * fp8_scale) with the saturating cast of quantize.h.
void store_one(fus_dtype dtype, void* data, int64_t i, float v, float fp8_scale) {
  switch (dtype) {
    case FUS_FLOAT32: static_cast<float*>(data)[i] = v; return;
    case FUS_FLOAT16: Element<Half>::store(static_cast<Half*>(data), i, v); return;
    case FUS_BFLOAT16: Element<Bf16>::store(static_cast<Bf16*>(data), i, v); return;
    case FUS_FLOAT8_E4M3:
      static_cast<uint8_t*>(data)[i] = float_to_fp8<Fp8Format::kE4M3>(v * fp8_scale);
      return;
    case FUS_FLOAT8_E5M2:
      static_cast<uint8_t*>(data)[i] = float_to_fp8<Fp8Format::kE5M2>(v * fp8_scale);
      return;
    default: throw Error(FUS_ERROR_INTERNAL, "fus_gemm: unexpected output dtype");
  }
}

// ap[i * kc + k] = op(A)[i0 + i, k0 + k] for i < mc, k < kc.
void pack_a(const fus_gemm_args& args, const GemmShape& s, int64_t i0, int64_t mc, int64_t k0,
            int64_t kc, float* ap) {
  with_loader(args.a.dtype, args.a.data, [&](auto load) {
    if (args.transa) {  // A stored [K, M]
      for (int64_t k = 0; k < kc; ++k)
        for (int64_t i = 0; i < mc; ++i) ap[i * kc + k] = load((k0 + k) * s.m + i0 + i);
    } else {  // A stored [M, K]
      for (int64_t i = 0; i < mc; ++i)
        for (int64_t k = 0; k < kc; ++k) ap[i * kc + k] = load((i0 + i) * s.k + k0 + k);
    }
  });
}

// bp[k * nc + j] = op(B)[k0 + k, j0 + j] for k < kc, j < nc.
void pack_b(const fus_gemm_args& args, const GemmShape& s, int64_t k0, int64_t kc, int64_t j0,
            int64_t nc, float* bp) {
  with_loader(args.b.dtype, args.b.data, [&](auto load) {
    if (args.transb) {  // B stored [N, K]
      for (int64_t j = 0; j < nc; ++j)
        for (int64_t k = 0; k < kc; ++k) bp[k * nc + j] = load((j0 + j) * s.k + k0 + k);
    } else {  // B stored [K, N]
      for (int64_t k = 0; k < kc; ++k)
        for (int64_t j = 0; j < nc; ++j) bp[k * nc + j] = load((k0 + k) * s.n + j0 + j);
    }
  });
}

// acc[i * nc + j] += sum_k ap[i * kc + k] * bp[k * nc + j], k ascending, one rounding per product
// and one per addition. Four rows at a time share each row of bp.
void multiply_panel(const float* ap, const float* bp, float* acc, int64_t mc, int64_t nc,
                    int64_t kc) {
  int64_t i = 0;
  for (; i + 4 <= mc; i += 4) {
    float* c0 = acc + i * nc;
    float* c1 = c0 + nc;
    float* c2 = c1 + nc;
    float* c3 = c2 + nc;
    const float* a0 = ap + i * kc;
    for (int64_t k = 0; k < kc; ++k) {
      const float x0 = a0[k], x1 = a0[kc + k], x2 = a0[2 * kc + k], x3 = a0[3 * kc + k];
      const float* b = bp + k * nc;
      for (int64_t j = 0; j < nc; ++j) {
        const float bj = b[j];
        c0[j] += x0 * bj;
        c1[j] += x1 * bj;
        c2[j] += x2 * bj;
        c3[j] += x3 * bj;
      }
    }
  }
  for (; i < mc; ++i) {
    float* c0 = acc + i * nc;
    const float* a0 = ap + i * kc;
    for (int64_t k = 0; k < kc; ++k) {
      const float x0 = a0[k];
      const float* b = bp + k * nc;
      for (int64_t j = 0; j < nc; ++j) c0[j] += x0 * b[j];
    }
  }
}

}  // namespace

void gemm_cpu(const fus_gemm_args& args, const GemmShape& s) {
  const int64_t M = s.m, N = s.n, K = s.k;
  const bool d_fp8 = args.d.dtype == FUS_FLOAT8_E4M3 || args.d.dtype == FUS_FLOAT8_E5M2;
  const float scale_ab =
      s.fp8 ? f_mul(args.alpha, f_mul(args.a_scale_inv[0], args.b_scale_inv[0])) : args.alpha;
  const float d_scale = d_fp8 ? args.d_scale[0] : 1.0f;
  uint32_t amax = 0;  // max |r| as ordered bits (NaN propagates, see numerics.h)
  std::vector<float> dbias_acc(s.bgrad ? static_cast<size_t>(N) : 0, 0.0f);

  if (M > 0 && N > 0) {
    std::vector<float> ap(static_cast<size_t>(kMc * std::min(kKc, std::max<int64_t>(K, 1))));
    std::vector<float> bp(static_cast<size_t>(std::min(kKc, std::max<int64_t>(K, 1)) * kNc));
    std::vector<float> acc(static_cast<size_t>(kMc * kNc));
    for (int64_t i0 = 0; i0 < M; i0 += kMc) {
      const int64_t mc = std::min(kMc, M - i0);
      for (int64_t j0 = 0; j0 < N; j0 += kNc) {
        const int64_t nc = std::min(kNc, N - j0);
        std::fill(acc.begin(), acc.begin() + mc * nc, 0.0f);
        for (int64_t k0 = 0; k0 < K; k0 += kKc) {
          const int64_t kc = std::min(kKc, K - k0);
          pack_a(args, s, i0, mc, k0, kc, ap.data());
          pack_b(args, s, k0, kc, j0, nc, bp.data());
          multiply_panel(ap.data(), bp.data(), acc.data(), mc, nc, kc);
        }
        // Epilogue of the tile, element by element: C is read right before D is written, so C
        // may be D itself.
        for (int64_t i = 0; i < mc; ++i) {
          const int64_t row = i0 + i;
          for (int64_t j = 0; j < nc; ++j) {
            const int64_t col = j0 + j;
            const int64_t idx = row * N + col;
            float t = f_mul(scale_ab, acc[i * nc + j]);
            if (s.has_c) t = f_add(t, f_mul(args.beta, load_one(args.c.dtype, args.c.data, idx)));
            if (s.uses_bias) t = f_add(t, load_one(args.bias.dtype, args.bias.data, col));
            float r = t;
            if (s.gelu) {
              if (s.writes_aux) store_one(args.aux.dtype, args.aux.data, idx, t, 1.0f);
              r = gelu_tanh(t);
            } else if (s.dgelu) {
              r = f_mul(t, dgelu_tanh(load_one(args.aux.dtype, args.aux.data, idx)));
            }
            store_one(args.d.dtype, args.d.data, idx, r, d_scale);
            if (d_fp8) amax = std::max(amax, abs_bits(r));
            if (s.bgrad) dbias_acc[col] = f_add(dbias_acc[col], r);
          }
        }
      }
    }
  }

  if (s.bgrad)
    for (int64_t j = 0; j < N; ++j)
      store_one(args.dbias.dtype, args.dbias.data, j, dbias_acc[j], 1);
  if (d_fp8 && args.d_amax != nullptr) *args.d_amax = bits_as_float(amax);
}

}  // namespace fusible
