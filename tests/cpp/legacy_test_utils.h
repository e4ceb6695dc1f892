// Shared helpers of the *_legacy tests, which compare a CPU kernel with the scalar implementation
// it replaced (kept verbatim in the test file), byte for byte, for every instruction set this
// processor runs and several thread counts, with small problems split into tasks as large ones
// are (common/cpu_runtime.h).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

#include "common/cpu_runtime.h"
#include "common/numerics.h"
#include "fusible/common.h"

namespace legacy_test {

using fusible::CpuIsa;

// The instruction sets this processor runs.
inline std::vector<CpuIsa> isas() {
  std::vector<CpuIsa> v{CpuIsa::kBaseline};
#if FUS_CPU_X86
  if (fusible::cpu_isa_detected() >= CpuIsa::kAvx2) v.push_back(CpuIsa::kAvx2);
  if (fusible::cpu_isa_detected() >= CpuIsa::kAvx512) v.push_back(CpuIsa::kAvx512);
#endif
  return v;
}

// Sets an instruction set and thread count (splitting small problems) for a scope, and restores
// the defaults after it.
struct Runtime {
  Runtime(CpuIsa isa, int threads) {
    fusible::set_cpu_isa_cap(isa);
    fusible::set_cpu_threads(threads);
    fusible::set_cpu_force_split(true);
  }
  ~Runtime() {
    fusible::set_cpu_threads(0);
    fusible::set_cpu_isa_cap(CpuIsa::kAvx512);
    fusible::set_cpu_force_split(false);
  }
  static std::string name(CpuIsa isa, int threads) {
    return std::string(" isa=") + fusible::cpu_isa_name(isa) +
           " threads=" + std::to_string(threads);
  }
};

// Every byte equal.
inline ::testing::AssertionResult same_bytes(const char* what, const std::vector<uint8_t>& want,
                                             const std::vector<uint8_t>& got) {
  if (want.size() != got.size())
    return ::testing::AssertionFailure()
           << what << ": " << got.size() << " bytes, expected " << want.size();
  for (size_t i = 0; i < want.size(); ++i) {
    if (want[i] == got[i]) continue;
    std::ostringstream o;
    o << what << " differs first at byte " << i << ": want 0x" << std::hex << int(want[i])
      << ", got 0x" << int(got[i]);
    return ::testing::AssertionFailure() << o.str();
  }
  return ::testing::AssertionSuccess();
}

inline bool is_nan(fus_dtype dt, const uint8_t* e) {
  switch (dt) {
    case FUS_FLOAT32: {
      uint32_t u;
      std::memcpy(&u, e, 4);
      return (u & 0x7fffffffu) > 0x7f800000u;
    }
    case FUS_BFLOAT16:
    case FUS_FLOAT16: {
      uint16_t h;
      std::memcpy(&h, e, 2);
      return dt == FUS_BFLOAT16 ? (h & 0x7fffu) > 0x7f80u : (h & 0x7fffu) > 0x7c00u;
    }
    case FUS_FLOAT8_E4M3: return (e[0] & 0x7f) == 0x7f;
    case FUS_FLOAT8_E5M2: return (e[0] & 0x7f) > 0x7c;
    default: return false;
  }
}

// Every element of dtype dt equal byte for byte, except that a NaN matches any NaN. Which NaN an
// fp32 operation on two NaN operands returns is the operand order the compiler picks (x86
// returns the first operand's), which neither implementation specifies: the legacy build itself
// differs between the rows of its vectorised GEMM loop (tests/cpp/gemm/test_gemm_legacy.cpp).
inline ::testing::AssertionResult same_values(const char* what, fus_dtype dt,
                                              const std::vector<uint8_t>& want,
                                              const std::vector<uint8_t>& got) {
  if (want.size() != got.size())
    return ::testing::AssertionFailure()
           << what << ": " << got.size() << " bytes, expected " << want.size();
  const size_t es = fus_dtype_size(dt);
  for (size_t e = 0; e * es < want.size(); ++e) {
    const uint8_t* w = &want[e * es];
    const uint8_t* g = &got[e * es];
    if (std::memcmp(w, g, es) == 0 || (is_nan(dt, w) && is_nan(dt, g))) continue;
    uint32_t wv = 0, gv = 0;
    std::memcpy(&wv, w, es);
    std::memcpy(&gv, g, es);
    std::ostringstream o;
    o << what << " differs first at element " << e << ": want 0x" << std::hex << wv << ", got 0x"
      << gv;
    return ::testing::AssertionFailure() << o.str();
  }
  return ::testing::AssertionSuccess();
}

inline bool same_float(float want, float got) {
  const uint32_t w = fusible::float_as_bits(want), g = fusible::float_as_bits(got);
  return w == g || (fusible::is_nan_bits(w) && fusible::is_nan_bits(g));
}

// The buffers of a quantized output (fusible/common.h's fus_quantized), prefilled with a pattern.
struct QuantOut {
  std::vector<uint8_t> row, col, rs, cs;
  float scale = 0, amax = -1.0f;
  fus_quantized q{};
  QuantOut(fus_scaling_mode mode, fus_dtype fp8, int64_t rows, int64_t cols, bool rowwise,
           bool colwise, float sc) {
    const size_t n = static_cast<size_t>(rows * cols);
    scale = sc;
    q.mode = mode;
    q.dtype = fp8;
    q.rows = rows;
    q.cols = cols;
    if (rowwise) row.assign(n, 0xcd);
    if (colwise) col.assign(n, 0xcd);
    if (mode == FUS_SCALING_PER_TENSOR) {
      rs.assign(4, 0xcd);
    } else {
      if (rowwise) rs.assign(static_cast<size_t>(rows * ((cols + 31) / 32)), 0xcd);
      if (colwise) cs.assign(static_cast<size_t>(((rows + 31) / 32) * cols), 0xcd);
    }
    q.rowwise_data = row.empty() ? nullptr : row.data();
    q.columnwise_data = col.empty() ? nullptr : col.data();
    q.rowwise_scale_inv = rs.empty() ? nullptr : rs.data();
    q.columnwise_scale_inv = cs.empty() ? nullptr : cs.data();
    q.scale = &scale;
    q.amax = &amax;
  }
  QuantOut(const QuantOut&) = delete;
  QuantOut& operator=(const QuantOut&) = delete;

  // The FP8 data byte for byte, or (nan_equal) with a NaN matching any NaN; scales and amax
  // exactly (amax: any NaN with nan_equal).
  ::testing::AssertionResult same(const QuantOut& w, bool nan_equal = false) const {
    for (auto [name, a, b] : {std::make_tuple("q rowwise data", &w.row, &row),
                              std::make_tuple("q columnwise data", &w.col, &col)}) {
      auto r = nan_equal ? same_values(name, q.dtype, *a, *b) : same_bytes(name, *a, *b);
      if (!r) return r;
    }
    for (auto [name, a, b] : {std::make_tuple("q rowwise scale", &w.rs, &rs),
                              std::make_tuple("q columnwise scale", &w.cs, &cs)}) {
      auto r = same_bytes(name, *a, *b);
      if (!r) return r;
    }
    const bool ok = nan_equal ? same_float(w.amax, amax)
                              : fusible::float_as_bits(w.amax) == fusible::float_as_bits(amax);
    if (!ok) return ::testing::AssertionFailure() << "amax differs";
    return ::testing::AssertionSuccess();
  }
};

// Value sets of the inputs: normals, or normals mixed with zeros of both signs, fp32 subnormals,
// huge values, infinities and NaNs of both signs.
enum class Values { kNormal, kSpecial };

inline float special_value(std::mt19937& g) {
  switch (g() % 10) {
    case 0: return 0.0f;
    case 1: return -0.0f;
    case 2: return 1e-40f;
    case 3: return -3e38f;
    case 4: return 7e4f;  // above fp16's range
    case 5: return std::numeric_limits<float>::infinity();
    case 6: return -std::numeric_limits<float>::infinity();
    case 7: return fusible::bits_as_float(0x7fc00001u);  // a NaN with a payload
    case 8: return fusible::bits_as_float(0xffc00000u);  // -NaN
    default: return 3e-6f;
  }
}

// Element i of a high-precision byte buffer of dtype dt = x (rounded to fp16 / bf16).
inline void store_hp_bytes(std::vector<uint8_t>& out, fus_dtype dt, int64_t i, float x) {
  if (dt == FUS_FLOAT32) {
    std::memcpy(&out[i * 4], &x, 4);
  } else {
    const uint16_t h = dt == FUS_BFLOAT16 ? fusible::float_to_bf16(x) : fusible::float_to_half(x);
    std::memcpy(&out[i * 2], &h, 2);
  }
}

// n elements of a high-precision dtype, as bytes.
inline std::vector<uint8_t> random_hp(fus_dtype dt, int64_t n, Values v, std::mt19937& g,
                                      float scale = 1.0f) {
  std::vector<uint8_t> out(static_cast<size_t>(n) * fus_dtype_size(dt));
  std::normal_distribution<float> nd(0.0f, scale);
  for (int64_t i = 0; i < n; ++i) {
    float x = nd(g);
    if (v == Values::kSpecial && g() % 8 == 0) x = special_value(g);
    store_hp_bytes(out, dt, i, x);
  }
  return out;
}

}  // namespace legacy_test
