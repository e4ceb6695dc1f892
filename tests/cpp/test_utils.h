// Shared helpers of the fusible C++ test suites.
//
//  - ref::*  an independent reference of the numerics contract (fusible/quantize.h): every value is
//            computed from bit fields with ldexp in double, and every rounding with nearbyint on an
//            exactly scaled double, so nothing here reuses the bit tricks of common/numerics.h.
//  - Buffers / run_cpu / run_cuda: run one C API call on the CPU backend and, when this build has
//    the CUDA backend and a device is present, on the CUDA backend (cudaMalloc + cudaMemcpy), so
//    tests can compare the outputs of both bit for bit.
//  - expect_error: status + fus_last_error() checks for argument validation.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "fusible/common.h"
#include "fusible/quantize.h"
#include "fusible/recipe.h"

#if defined(FUSIBLE_WITH_CUDA)
#include <cuda_runtime.h>
#endif

namespace fustest {

// ---- bits ----------------------------------------------------------------------------------------

inline uint32_t f2u(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float u2f(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float qnan(bool negative = false) { return u2f(negative ? 0xffc00000u : 0x7fc00000u); }
inline float inf() { return std::numeric_limits<float>::infinity(); }

inline fus_context cpu_ctx() { return fus_context{FUS_DEVICE_CPU, 0, nullptr}; }
inline fus_context cuda_ctx() { return fus_context{FUS_DEVICE_CUDA, 0, nullptr}; }

inline const char* fmt_name(fus_dtype d) {
  switch (d) {
    case FUS_FLOAT8_E4M3: return "E4M3";
    case FUS_FLOAT8_E5M2: return "E5M2";
    case FUS_FLOAT32: return "F32";
    case FUS_FLOAT16: return "F16";
    case FUS_BFLOAT16: return "BF16";
    default: return "?";
  }
}

// ---- independent reference numerics --------------------------------------------------------------

namespace ref {

struct Fp8Spec {
  int mant;  // fraction bits
  int bias;
  int emax;    // exponent of the largest normal (OCP emax_elem)
  double max;  // largest finite
  uint8_t max_code;
  bool has_inf;
};

inline Fp8Spec spec(fus_dtype d) {
  if (d == FUS_FLOAT8_E4M3) return Fp8Spec{3, 7, 8, 448.0, 0x7e, false};
  return Fp8Spec{2, 15, 15, 57344.0, 0x7b, true};
}

// Decode from the bit fields: sign, exponent, mantissa; ldexp in double.
inline double fp8_decode(uint8_t code, fus_dtype d) {
  const Fp8Spec s = spec(d);
  const bool neg = (code & 0x80) != 0;
  const int expbits = 7 - s.mant;
  const int e = (code & 0x7f) >> s.mant;
  const int m = code & ((1 << s.mant) - 1);
  double v;
  if (!s.has_inf && (code & 0x7f) == 0x7f) {
    v = std::numeric_limits<double>::quiet_NaN();
  } else if (s.has_inf && e == (1 << expbits) - 1) {
    v = m == 0 ? std::numeric_limits<double>::infinity() : std::numeric_limits<double>::quiet_NaN();
  } else if (e == 0) {
    v = std::ldexp(static_cast<double>(m), 1 - s.bias - s.mant);
  } else {
    v = std::ldexp(1.0 + std::ldexp(static_cast<double>(m), -s.mant), e - s.bias);
  }
  return neg ? -v : v;
}

inline bool fp8_is_nan_code(uint8_t code, fus_dtype d) { return std::isnan(fp8_decode(code, d)); }

// Round a finite double to a binary format with `mant` fraction bits and minimum normal exponent
// emin, to nearest even, with an unbounded exponent range upwards (overflow is the caller's).
inline double round_to_format(double x, int mant, int emin) {
  if (x == 0.0 || !std::isfinite(x)) return x;
  int e2;
  std::frexp(x, &e2);  // |x| = f * 2^e2, f in [0.5, 1): floor(log2|x|) = e2 - 1
  const int exp = std::max(e2 - 1, emin);
  const int shift = mant - exp;  // x * 2^shift is exact in double for the inputs used here
  const double q = std::nearbyint(std::ldexp(x, shift));  // default mode: nearest even
  return std::ldexp(q, -shift);
}

// fp8 code of float f per the contract: RNE, saturate to +-max (inf too), NaN -> 0x7F | sign.
inline uint8_t fp8_encode(float f, fus_dtype d) {
  const Fp8Spec s = spec(d);
  const uint8_t sign = std::signbit(f) ? 0x80 : 0x00;
  if (std::isnan(f)) return static_cast<uint8_t>(sign | 0x7f);
  double v = std::fabs(static_cast<double>(f));
  if (std::isinf(v)) v = s.max;
  v = std::min(round_to_format(v, s.mant, 1 - s.bias), s.max);
  // Find the code whose value is v (the non-negative finite codes are monotone in their value).
  static const std::vector<double> e4m3 = [] {
    std::vector<double> t(128);
    for (int c = 0; c < 128; ++c) t[c] = fp8_decode(static_cast<uint8_t>(c), FUS_FLOAT8_E4M3);
    return t;
  }();
  static const std::vector<double> e5m2 = [] {
    std::vector<double> t(128);
    for (int c = 0; c < 128; ++c) t[c] = fp8_decode(static_cast<uint8_t>(c), FUS_FLOAT8_E5M2);
    return t;
  }();
  const std::vector<double>& table = d == FUS_FLOAT8_E4M3 ? e4m3 : e5m2;
  const auto it = std::lower_bound(table.begin(), table.begin() + s.max_code + 1, v);
  const int code = static_cast<int>(it - table.begin());
  if (code > s.max_code || table[code] != v) {
    ADD_FAILURE() << "reference encoder: " << v << " is not an fp8 value";
    return 0;
  }
  return static_cast<uint8_t>(sign | code);
}

// IEEE binary16.
inline double half_decode(uint16_t h) {
  const bool neg = (h & 0x8000) != 0;
  const int e = (h >> 10) & 0x1f, m = h & 0x3ff;
  double v;
  if (e == 0x1f)
    v = m ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity();
  else if (e == 0)
    v = std::ldexp(static_cast<double>(m), -24);
  else
    v = std::ldexp(1024.0 + m, e - 25);
  return neg ? -v : v;
}

// RNE to binary16 for non-NaN f; overflow gives inf.
inline uint16_t half_encode(float f) {
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  double v = std::fabs(static_cast<double>(f));
  if (std::isinf(v)) return sign | 0x7c00;
  v = round_to_format(v, 10, -14);
  if (v > 65504.0) return sign | 0x7c00;
  if (v < std::ldexp(1.0, -14))
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(std::ldexp(v, 24)));
  int e2;
  const double f2 = std::frexp(v, &e2);  // v = f2 * 2^e2, f2 in [0.5, 1)
  const int m = static_cast<int>(std::ldexp(f2, 11)) - 1024;
  return static_cast<uint16_t>(sign | ((e2 - 1 + 15) << 10) | m);
}

// bfloat16 = the top half of a float.
inline double bf16_decode(uint16_t b) {
  return static_cast<double>(u2f(static_cast<uint32_t>(b) << 16));
}

// RNE to bfloat16 for non-NaN f; overflow gives inf.
inline uint16_t bf16_encode(float f) {
  const uint16_t sign = std::signbit(f) ? 0x8000 : 0;
  double v = std::fabs(static_cast<double>(f));
  if (std::isinf(v)) return sign | 0x7f80;
  v = round_to_format(v, 7, -126);
  if (v > 3.3895313892515355e38) return sign | 0x7f80;
  // v is representable in bfloat16, hence exactly as a float: take its top 16 bits.
  return static_cast<uint16_t>(sign | (f2u(static_cast<float>(v)) >> 16));
}

// Per-tensor scale rule: ldexp(fp8_max / amax, -margin) for finite amax > 0, FLT_MAX on overflow,
// else fallback. fp8_max / amax is one float division (as the contract says); ldexp is done in
// double and rounded once, which is what a correctly rounded ldexpf gives.
inline float scale_from_amax(float amax, float fp8_max, int margin, float fallback) {
  if (!(amax > 0.0f) || !std::isfinite(amax)) return fallback;
  const float q = fp8_max / amax;
  if (std::isinf(q)) return FLT_MAX;
  const double s = std::ldexp(static_cast<double>(q), -margin);
  if (s > static_cast<double>(FLT_MAX)) {
    // Rounds to FLT_MAX when below FLT_MAX + half an ulp, else to inf: both are FLT_MAX here.
    return FLT_MAX;
  }
  return static_cast<float>(s);
}

// OCP MX E8M0 byte for a block amax: clamp(floor(log2(amax)) - emax + 127, 0, 254); 0 for amax 0,
// 0xFF for NaN / inf.
inline uint8_t e8m0_from_amax(double amax, fus_dtype d) {
  if (std::isnan(amax) || std::isinf(amax)) return 0xff;
  if (amax == 0.0) return 0;
  int e2;
  std::frexp(amax, &e2);
  const int biased = (e2 - 1) - spec(d).emax + 127;
  return static_cast<uint8_t>(std::min(254, std::max(0, biased)));
}

// 2^(s - 127) (NaN for 0xFF) as a float; exact for every s in [0, 254].
inline float e8m0_value(uint8_t s) {
  if (s == 0xff) return std::numeric_limits<float>::quiet_NaN();
  return static_cast<float>(std::ldexp(1.0, static_cast<int>(s) - 127));
}

// The multiplier elements are cast with: 2^(127 - s).
inline float e8m0_multiplier(uint8_t s) {
  if (s == 0xff) return std::numeric_limits<float>::quiet_NaN();
  return static_cast<float>(std::ldexp(1.0, 127 - static_cast<int>(s)));
}

}  // namespace ref

// ---- element storage by dtype --------------------------------------------------------------------

// Host storage for a high-precision matrix: the bits in the chosen dtype, and the float value each
// element loads as (exact, since fp16 / bf16 widen to fp32 exactly).
struct HostMatrix {
  fus_dtype dtype = FUS_FLOAT32;
  int64_t rows = 0, cols = 0;
  std::vector<uint8_t> bytes;
  std::vector<float> values;

  HostMatrix() = default;
  HostMatrix(fus_dtype dt, int64_t r, int64_t c, const std::vector<float>& v)
      : dtype(dt), rows(r), cols(c) {
    const size_t n = static_cast<size_t>(r * c);
    values.resize(n);
    bytes.resize(n * fus_dtype_size(dt));
    for (size_t i = 0; i < n; ++i) {
      const float f = v[i];
      if (dt == FUS_FLOAT32) {
        std::memcpy(&bytes[4 * i], &f, 4);
        values[i] = f;
      } else {
        uint16_t h;
        if (dt == FUS_FLOAT16) {
          h = std::isnan(f) ? static_cast<uint16_t>(std::signbit(f) ? 0xfe00 : 0x7e00)
                            : ref::half_encode(f);
          values[i] = static_cast<float>(ref::half_decode(h));
        } else {
          h = std::isnan(f) ? static_cast<uint16_t>((f2u(f) >> 16) | 0x40) : ref::bf16_encode(f);
          values[i] = static_cast<float>(ref::bf16_decode(h));
        }
        if (std::isnan(f)) values[i] = f;  // keep the sign for the reference
        std::memcpy(&bytes[2 * i], &h, 2);
      }
    }
  }
  fus_tensor tensor() {
    return fus_tensor{bytes.empty() ? nullptr : bytes.data(), dtype, rows, cols};
  }
};

// Bits of an output element stored in dtype (fp32, fp16 or bf16).
inline uint32_t stored_bits(const std::vector<uint8_t>& bytes, fus_dtype dt, size_t i) {
  if (dt == FUS_FLOAT32) {
    uint32_t u;
    std::memcpy(&u, &bytes[4 * i], 4);
    return u;
  }
  uint16_t h;
  std::memcpy(&h, &bytes[2 * i], 2);
  return h;
}

// Value of an output element stored in dtype (for dequantize outputs).
inline double load_as_double(const std::vector<uint8_t>& bytes, fus_dtype dt, size_t i) {
  const uint32_t u = stored_bits(bytes, dt, i);
  if (dt == FUS_FLOAT32) return u2f(u);
  const uint16_t h = static_cast<uint16_t>(u);
  return dt == FUS_FLOAT16 ? ref::half_decode(h) : ref::bf16_decode(h);
}

// Expected bits of an output element: float v rounded to dt. NaN is left to the caller.
inline uint32_t encode_output(float v, fus_dtype dt) {
  if (dt == FUS_FLOAT32) return f2u(v);
  if (dt == FUS_FLOAT16) return ref::half_encode(v);
  return ref::bf16_encode(v);
}

// ---- random data ---------------------------------------------------------------------------------

// Values spread over many binades (normal * 2^k, k in [lo_exp, hi_exp]) with some exact zeros and
// negative zeros, so fp8 subnormal, normal and saturating ranges all occur.
inline std::vector<float> random_values(size_t n, uint32_t seed, int lo_exp = -12,
                                        int hi_exp = 12) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_int_distribution<int> ed(lo_exp, hi_exp);
  std::uniform_int_distribution<int> pick(0, 99);
  std::vector<float> v(n);
  for (auto& x : v) {
    const int p = pick(rng);
    if (p == 0)
      x = 0.0f;
    else if (p == 1)
      x = -0.0f;
    else
      x = std::ldexp(nd(rng), ed(rng));
  }
  return v;
}

// ---- running a call on both backends -------------------------------------------------------------

// A list of byte buffers a call reads and writes. An empty buffer is passed as NULL.
struct Buffers {
  std::vector<std::vector<uint8_t>> b;
  template <typename T>
  int add(const std::vector<T>& v) {
    std::vector<uint8_t> bytes(v.size() * sizeof(T));
    if (!bytes.empty()) std::memcpy(bytes.data(), v.data(), bytes.size());
    b.push_back(std::move(bytes));
    return static_cast<int>(b.size() - 1);
  }
  int add_bytes(std::vector<uint8_t> v) {
    b.push_back(std::move(v));
    return static_cast<int>(b.size() - 1);
  }
  // n bytes of a fill pattern, so that an element a backend forgets to write differs from the other.
  int add_filled(size_t n, uint8_t fill = 0xA5) { return add_bytes(std::vector<uint8_t>(n, fill)); }
  template <typename T>
  std::vector<T> get(int i) const {
    std::vector<T> v(b[i].size() / sizeof(T));
    if (!v.empty()) std::memcpy(v.data(), b[i].data(), v.size() * sizeof(T));
    return v;
  }
};

// The call: given one pointer per buffer (host or device) and the context, issue the C API call.
using ApiCall = std::function<fus_status(const std::vector<void*>& ptrs, const fus_context& ctx)>;

inline fus_status run_cpu(Buffers& bufs, const ApiCall& call) {
  std::vector<void*> ptrs;
  for (auto& v : bufs.b) ptrs.push_back(v.empty() ? nullptr : v.data());
  const fus_context ctx = cpu_ctx();
  return call(ptrs, ctx);
}

// Whether a CUDA device can run the CUDA backend here.
inline bool cuda_device_present() {
#if defined(FUSIBLE_WITH_CUDA)
  static const bool present = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      (void)cudaGetLastError();
      return false;
    }
    return n > 0;
  }();
  return present;
#else
  return false;
#endif
}

#define FUSTEST_REQUIRE_CUDA()                                             \
  do {                                                                     \
    if (!::fustest::cuda_device_present())                                 \
      GTEST_SKIP() << (fus_has_cuda() ? "no CUDA device present"           \
                                      : "this build has no CUDA backend"); \
  } while (0)

#if defined(FUSIBLE_WITH_CUDA)
// Device copies of host buffers: the constructor allocates and copies every non-empty buffer (an
// empty one stays NULL) and waits for the copies (a pageable-memory cudaMemcpy may return before
// its DMA lands, and a non-blocking stream does not order after the legacy default stream);
// copy_back() copies every buffer back into host buffers of the same sizes; the destructor frees.
// A CUDA runtime failure is reported as a test failure: ok() / copy_back() return false.
class DeviceBuffers {
 public:
  std::vector<void*> ptrs;

  explicit DeviceBuffers(const Buffers& host) : ptrs(host.b.size(), nullptr) {
    cudaError_t e = cudaSuccess;
    for (size_t i = 0; i < host.b.size() && e == cudaSuccess; ++i) {
      if (host.b[i].empty()) continue;
      e = cudaMalloc(&ptrs[i], host.b[i].size());
      if (e == cudaSuccess)
        e = cudaMemcpy(ptrs[i], host.b[i].data(), host.b[i].size(), cudaMemcpyHostToDevice);
    }
    if (e == cudaSuccess) e = cudaDeviceSynchronize();
    if (e != cudaSuccess) {
      ADD_FAILURE() << "harness: cudaMalloc/cudaMemcpy failed: " << cudaGetErrorString(e);
      ok_ = false;
    }
  }
  DeviceBuffers(const DeviceBuffers&) = delete;
  DeviceBuffers& operator=(const DeviceBuffers&) = delete;
  ~DeviceBuffers() {
    for (void* p : ptrs)
      if (p) cudaFree(p);
  }

  bool ok() const { return ok_; }
  bool copy_back(Buffers& host) const {
    for (size_t i = 0; i < host.b.size(); ++i) {
      if (host.b[i].empty()) continue;
      const cudaError_t e =
          cudaMemcpy(host.b[i].data(), ptrs[i], host.b[i].size(), cudaMemcpyDeviceToHost);
      if (e != cudaSuccess) {
        ADD_FAILURE() << "harness: cudaMemcpy back failed: " << cudaGetErrorString(e);
        return false;
      }
    }
    return true;
  }

 private:
  bool ok_ = true;
};
#endif

// Copies bufs to the device, runs the call with a CUDA context, synchronises and copies every
// buffer back into bufs. The context's stream is the legacy default stream, or with own_stream a
// non-blocking stream of the harness's own, which alone it then waits for (cudaStreamSynchronize):
// for tests that the backend honours ctx->stream. Returns the call's status; a CUDA runtime
// failure in the harness itself is reported as a test failure and FUS_ERROR_CUDA.
inline fus_status run_cuda(Buffers& bufs, const ApiCall& call, bool own_stream = false) {
#if defined(FUSIBLE_WITH_CUDA)
  DeviceBuffers dev(bufs);
  if (!dev.ok()) return FUS_ERROR_CUDA;
  cudaStream_t stream = nullptr;
  cudaError_t e = cudaSuccess;
  if (own_stream) e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking);
  if (e != cudaSuccess) {
    ADD_FAILURE() << "harness: cudaStreamCreateWithFlags failed: " << cudaGetErrorString(e);
    return FUS_ERROR_CUDA;
  }
  const fus_context ctx{FUS_DEVICE_CUDA, 0, stream};
  const fus_status st = call(dev.ptrs, ctx);
  e = own_stream ? cudaStreamSynchronize(stream) : cudaDeviceSynchronize();
  if (e == cudaSuccess) e = cudaGetLastError();
  if (own_stream) cudaStreamDestroy(stream);
  if (e != cudaSuccess) {
    ADD_FAILURE() << "CUDA error after the call: " << cudaGetErrorString(e);
    return FUS_ERROR_CUDA;
  }
  if (!dev.copy_back(bufs)) return FUS_ERROR_CUDA;
  return st;
#else
  (void)bufs;
  (void)call;
  (void)own_stream;
  ADD_FAILURE() << "run_cuda called in a build without the CUDA backend";
  return FUS_ERROR_UNSUPPORTED;
#endif
}

// Runs the call on both backends from the same initial buffers.
struct DualResult {
  Buffers cpu, cuda;
  fus_status cpu_status = FUS_ERROR_INTERNAL, cuda_status = FUS_ERROR_INTERNAL;
};
inline DualResult run_both(const Buffers& init, const ApiCall& call) {
  DualResult r;
  r.cpu = init;
  r.cuda = init;
  r.cpu_status = run_cpu(r.cpu, call);
  r.cuda_status = run_cuda(r.cuda, call);
  return r;
}

// Bitwise comparison of one buffer; reports the first few differing elements of width T.
template <typename T>
::testing::AssertionResult same_bits(const Buffers& a, const Buffers& b, int idx,
                                     const char* what) {
  if (a.b[idx].size() != b.b[idx].size())
    return ::testing::AssertionFailure() << what << ": sizes differ";
  const std::vector<T> x = a.get<T>(idx), y = b.get<T>(idx);
  size_t bad = 0;
  ::testing::AssertionResult res = ::testing::AssertionFailure();
  for (size_t i = 0; i < x.size(); ++i) {
    if (std::memcmp(&x[i], &y[i], sizeof(T)) != 0) {
      if (bad < 8) {
        uint64_t ux = 0, uy = 0;
        std::memcpy(&ux, &x[i], sizeof(T));
        std::memcpy(&uy, &y[i], sizeof(T));
        char buf[96];
        std::snprintf(buf, sizeof(buf), "]: cpu 0x%llx cuda 0x%llx",
                      static_cast<unsigned long long>(ux), static_cast<unsigned long long>(uy));
        res << "\n  " << what << "[" << i << buf;
      }
      ++bad;
    }
  }
  if (bad == 0) return ::testing::AssertionSuccess();
  return res << "\n  " << what << ": " << bad << " of " << x.size() << " elements differ";
}

// ---- per-tensor outputs ----------------------------------------------------------------------

// A per-tensor scaled FP8 output over caller buffers (columnwise copy optional).
inline fus_quantized per_tensor_out(fus_dtype fmt, int64_t rows, int64_t cols, void* row, void* col,
                                    float* scale_inv, float* scale, float* amax,
                                    int amax_accumulate = 0) {
  return fus_quantized{
      FUS_SCALING_PER_TENSOR, fmt, rows, cols, row, col, scale_inv, nullptr, scale, amax, 0, 0.0f,
      amax_accumulate};
}

// amax_accumulate: run(amax, acc) (one cast into a per-tensor output) with acc 0 writes its own
// amax (> 0); with acc 1 it stores max(preset, own) for every preset (NaN: the larger bits). Wrap
// the call in ASSERT_NO_FATAL_FAILURE.
template <typename Run>
void expect_amax_accumulates(Run run) {
  float own = -1.0f;
  ASSERT_EQ(run(&own, 0), FUS_SUCCESS) << fus_last_error();
  ASSERT_GT(own, 0.0f);
  for (float preset : {0.0f, own / 2, own * 2, qnan()}) {
    float amax = preset;
    ASSERT_EQ(run(&amax, 1), FUS_SUCCESS) << fus_last_error();
    EXPECT_EQ(f2u(amax), std::max(f2u(preset), f2u(own))) << preset;
  }
}

// ---- errors --------------------------------------------------------------------------------------

// status == expected, and fus_last_error() names every word in `words`.
inline ::testing::AssertionResult is_error(fus_status st, fus_status expected,
                                           std::initializer_list<const char*> words) {
  const std::string msg = fus_last_error();
  if (st != expected)
    return ::testing::AssertionFailure()
           << "status " << st << ", expected " << expected << " (message: \"" << msg << "\")";
  for (const char* w : words)
    if (msg.find(w) == std::string::npos)
      return ::testing::AssertionFailure()
             << "message \"" << msg << "\" does not mention \"" << w << "\"";
  return ::testing::AssertionSuccess();
}

}  // namespace fustest
