// Helpers of the fused-kernel suites (normalization, activation): buffers of a quantized output,
// the unfused reference "quantize the high-precision output with fus_quantize", and tolerances
// against FP64 references.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "test_utils.h"

namespace fustest {

// What quantized output a call asks for.
struct QSpec {
  int mode = 0;  // 0 none, 1 per tensor, 2 MXFP8, 3 blockwise 1x128, 4 blockwise 128x128
  fus_dtype fmt = FUS_FLOAT8_E4M3;
  bool row = true, col = true, amax = true;
  float scale = 1.0f;
  bool pow2 = true;  // blockwise: power_2_scale, amax_epsilon
  float eps = 0.0f;
};

inline const char* qmode_name(int m) {
  static const char* const names[] = {"none", "fp8", "mxfp8", "block1d", "block2d"};
  return names[m];
}

inline bool blockwise(const QSpec& q) { return q.mode == 3 || q.mode == 4; }

inline int64_t ceil32(int64_t n) { return (n + 31) / 32; }
inline int64_t ceil128(int64_t n) { return (n + 127) / 128; }

// Floats in the scale_inv matrix of a blockwise copy [R, C] (fusible/common.h layouts).
inline size_t block_scales(int mode, int64_t R, int64_t C) {
  return static_cast<size_t>(mode == 3 ? ceil128(C) * R : ceil128(R) * ceil128(C));
}

// Slots of a quantized output inside a Buffers, in this order.
enum QOff { kQRow = 0, kQCol, kQRowS, kQColS, kQScale, kQAmax, kQSlots };
inline const char* const kQNames[kQSlots] = {
    "q.rowwise_data",         "q.columnwise_data", "q.rowwise_scale_inv",
    "q.columnwise_scale_inv", "q.scale",           "q.amax"};

// Appends the 6 buffers of q (empty ones when absent), filled with a pattern; returns the first.
inline int add_q_buffers(Buffers& b, int64_t rows, int64_t cols, const QSpec& q) {
  const int first = static_cast<int>(b.b.size());
  const size_t n = static_cast<size_t>(rows * cols);
  const bool on = q.mode != 0;
  b.add_filled(on && q.row ? n : 0);
  b.add_filled(on && q.col ? n : 0);
  if (q.mode == 2) {
    b.add_filled(q.row ? static_cast<size_t>(rows * ceil32(cols)) : 0);
    b.add_filled(q.col ? static_cast<size_t>(ceil32(rows) * cols) : 0);
    b.add_filled(0);
  } else if (blockwise(q)) {
    b.add_filled(q.row ? 4 * block_scales(q.mode, rows, cols) : 0);
    b.add_filled(q.col ? 4 * block_scales(q.mode, cols, rows) : 0);
    b.add_filled(0);
  } else {
    b.add_filled(on ? 4 : 0);
    b.add_filled(0);
    if (on)
      b.add(std::vector<float>{q.scale});
    else
      b.add_filled(0);
  }
  b.add_filled(on && q.amax ? 4 : 0);
  return first;
}

inline fus_quantized make_q(const std::vector<void*>& p, int first, int64_t rows, int64_t cols,
                            const QSpec& q) {
  static const fus_scaling_mode modes[] = {FUS_SCALING_PER_TENSOR, FUS_SCALING_PER_TENSOR,
                                           FUS_SCALING_MXFP8, FUS_SCALING_BLOCK_1D,
                                           FUS_SCALING_BLOCK_2D};
  return fus_quantized{modes[q.mode],
                       q.fmt,
                       rows,
                       cols,
                       p[first + kQRow],
                       p[first + kQCol],
                       p[first + kQRowS],
                       p[first + kQColS],
                       static_cast<float*>(p[first + kQScale]),
                       static_cast<float*>(p[first + kQAmax]),
                       q.pow2 ? 1 : 0,
                       q.eps};
}

// A per-tensor E4M3 rowwise output over data / scale_inv, no scale or amax (the argument tests).
inline fus_quantized rowwise_q(void* data, void* scale_inv, int64_t rows, int64_t cols) {
  return fus_quantized{FUS_SCALING_PER_TENSOR,
                       FUS_FLOAT8_E4M3,
                       rows,
                       cols,
                       data,
                       nullptr,
                       scale_inv,
                       nullptr,
                       nullptr,
                       nullptr,
                       0,
                       0.0f};
}

// The unfused path: fus_quantize (CPU) of a stored high-precision matrix; returns its buffers
// laid out as add_q_buffers (first slot 1; slot 0 is the input).
inline Buffers quantize_of(const std::vector<uint8_t>& hp, fus_dtype dt, int64_t rows, int64_t cols,
                           const QSpec& q) {
  Buffers b;
  b.add_bytes(hp);
  add_q_buffers(b, rows, cols, q);
  const fus_status st = run_cpu(b, [&](const std::vector<void*>& p, const fus_context& ctx) {
    fus_tensor t{p[0], dt, rows, cols};
    fus_quantized qq = make_q(p, 1, rows, cols, q);
    return fus_quantize(&t, &qq, &ctx);
  });
  EXPECT_EQ(st, FUS_SUCCESS) << fus_last_error();
  return b;
}

// Every quantized buffer of a (at slot qa) equals b's (at slot qb) bit for bit.
inline void expect_same_q(const Buffers& a, int qa, const Buffers& b, int qb,
                          const std::string& what) {
  for (int k = 0; k < kQSlots; ++k) {
    ASSERT_EQ(a.b[qa + k].size(), b.b[qb + k].size()) << what << " " << kQNames[k];
    if (a.b[qa + k] != b.b[qb + k]) {
      size_t i = 0;
      while (a.b[qa + k][i] == b.b[qb + k][i]) ++i;
      ADD_FAILURE() << what << ": " << kQNames[k] << " differs first at byte " << i << " (0x"
                    << std::hex << int(a.b[qa + k][i]) << " vs 0x" << int(b.b[qb + k][i])
                    << std::dec << ")";
    }
  }
}

// Values of a stored matrix as doubles.
inline std::vector<double> as_doubles(const std::vector<uint8_t>& bytes, fus_dtype dt) {
  const size_t n = bytes.size() / fus_dtype_size(dt);
  std::vector<double> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = load_as_double(bytes, dt, i);
  return v;
}

// Bitwise equality of buffer idx of a and b (elements of dt, FP8 included), except that NaN on
// both sides matches whatever its bits. NaN made by arithmetic differs between the backends in sign
// and payload (x86 propagates an operand's NaN, NVIDIA GPUs return the canonical 0x7fffffff), and
// an FP8 cast keeps that sign.
inline ::testing::AssertionResult same_bits_or_both_nan(const Buffers& a, const Buffers& b, int idx,
                                                        fus_dtype dt, const std::string& what) {
  const std::vector<uint8_t>&x = a.b[idx], &y = b.b[idx];
  const size_t w = fus_dtype_size(dt), n = x.size() / w;
  if (x.size() != y.size() || x.size() % w != 0)
    return ::testing::AssertionFailure() << what << ": sizes differ or are not whole elements";
  auto value = [&](const std::vector<uint8_t>& v, size_t i) {
    return w == 1 ? ref::fp8_decode(v[i], dt) : load_as_double(v, dt, i);
  };
  size_t bad = 0;
  ::testing::AssertionResult res = ::testing::AssertionFailure();
  for (size_t i = 0; i < n; ++i) {
    if (std::memcmp(&x[i * w], &y[i * w], w) == 0) continue;
    if (std::isnan(value(x, i)) && std::isnan(value(y, i))) continue;
    if (bad++ < 8)
      res << "\n  " << what << "[" << i << "]: cpu " << value(x, i) << " cuda " << value(y, i);
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return res << "\n  " << what << ": " << bad << " of " << n << " elements differ";
}

// Every quantized buffer of a and b (add_q_buffers slots from `first`) under the rule of
// same_bits_or_both_nan: FP8 data and fp32 scalars; MXFP8's E8M0 scales bit for bit.
inline void expect_q_same_or_both_nan(const Buffers& a, const Buffers& b, int first,
                                      const QSpec& q) {
  for (int k = 0; k < kQSlots; ++k) {
    if (k <= kQCol)
      EXPECT_TRUE(same_bits_or_both_nan(a, b, first + k, q.fmt, kQNames[k]));
    else if (q.mode == 2 && k <= kQColS)
      EXPECT_TRUE(same_bits<uint8_t>(a, b, first + k, kQNames[k]));
    else
      EXPECT_TRUE(same_bits_or_both_nan(a, b, first + k, FUS_FLOAT32, kQNames[k]));
  }
}

// Normal(mean, stddev) samples, exactly representable in dt (so references see the stored values).
inline HostMatrix random_matrix(fus_dtype dt, int64_t rows, int64_t cols, uint32_t seed,
                                float mean = 0.0f, float stddev = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(mean, stddev);
  std::vector<float> v(static_cast<size_t>(rows * cols));
  for (auto& x : v) x = nd(rng);
  return HostMatrix(dt, rows, cols, v);
}

// Relative step of a high-precision dtype (2^-mantissa bits).
inline double dtype_eps(fus_dtype dt) {
  return dt == FUS_FLOAT32 ? std::ldexp(1.0, -23)
                           : (dt == FUS_FLOAT16 ? std::ldexp(1.0, -10) : std::ldexp(1.0, -7));
}

// Spacing of the subnormals of a dtype (the absolute rounding step near zero).
inline double dtype_atom(fus_dtype dt) {
  return dt == FUS_FLOAT32 ? std::ldexp(1.0, -149)
                           : (dt == FUS_FLOAT16 ? std::ldexp(1.0, -24) : std::ldexp(1.0, -133));
}

// |got - ref| <= atol + rtol |ref| everywhere (NaN only where ref is NaN); reports the worst.
inline ::testing::AssertionResult all_close(const std::vector<double>& got,
                                            const std::vector<double>& ref, double rtol,
                                            double atol, const std::string& what) {
  if (got.size() != ref.size()) return ::testing::AssertionFailure() << what << ": size mismatch";
  size_t bad = 0, worst = 0;
  double worst_excess = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    if (std::isnan(ref[i]) || std::isnan(got[i])) {
      if (std::isnan(ref[i]) != std::isnan(got[i])) ++bad, worst = i, worst_excess = 1e300;
      continue;
    }
    const double err = std::fabs(got[i] - ref[i]), lim = atol + rtol * std::fabs(ref[i]);
    if (!(err <= lim)) {
      ++bad;
      if (err / lim > worst_excess) worst_excess = err / lim, worst = i;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": " << bad << " of " << got.size() << " outside tolerance; worst [" << worst
         << "] got " << got[worst] << " ref " << ref[worst] << " (rtol " << rtol << ", atol "
         << atol << ")";
}

// Expected value of fp32 math rounded once more to dt: tolerance rtol for the output dtype.
inline double out_rtol(fus_dtype dt, double fp32_rtol) {
  return fp32_rtol + (dt == FUS_FLOAT32 ? 0.0 : dtype_eps(dt));
}

inline std::string dt_name(fus_dtype d) { return fmt_name(d); }

}  // namespace fustest
