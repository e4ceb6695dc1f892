// Activation functions and their derivatives in fp32, shared by every backend that evaluates them
// (the activation family's CPU and CUDA kernels, and the GEMM family's CPU epilogues).
//
// Every function is built from correctly rounded single-precision operations only (common/
// fp32_ops.h: add, sub, mul, div, fma, sqrt, rint, no library transcendental), so the host and the
// device compute the same bits for the same input; only the sign and payload of a NaN may differ.
// Accuracy against the exact functions (measured against long double references over 6M points):
//   exp_neg_f (e^x, x <= 0)       <= 1.1 ulp, subnormal results included
//   sigmoid                       <= 3.5 ulp
//   silu                          <= 3.5 ulp for x >= -80 (below, e^x is subnormal and the
//                                 relative precision of x e^x / (1 + e^x) degrades gradually)
//   gelu_erf                      <= 6 ulp down to x = -13 (the lower tail keeps relative accuracy)
//   gelu_tanh                     <= 13 ulp for x >= -3; below, the fp32 rounding of the tanh
//                                 argument v ~ 0.0714 x^3 dominates (relative error ~ |v| 2^-24),
//                                 as in any fp32 evaluation of the formula
//   dgelu_tanh, dgelu_erf, dsilu  <= 8e-7 relative to max(|d|, 0.1)
//
// Definitions (x fp32):
//   sigmoid(x)   = 1 / (1 + exp(-x))
//   gelu_tanh(x) = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))   (cuBLASLt's GELU epilogue,
//                = x * sigmoid(2 sqrt(2/pi) (x + 0.044715 x^3))         torch approximate="tanh";
//                                                                     evaluated as the sigmoid
//                                                                     form)
//   gelu_erf(x)  = x * Phi(x),  Phi(x) = 0.5 (1 + erf(x / sqrt 2))     (torch approximate="none")
//   relu(x)      = x < 0 ? 0 : x   (NaN and -0 pass through, as torch.relu)
//   silu(x)      = x * sigmoid(x)
//   swiglu(a, b) = silu(a) * b,  geglu(a, b) = gelu_tanh(a) * b
// Derivatives: dgelu_tanh, dgelu_erf, drelu (1 for x > 0, else 0), dsilu. The gradient of a
// non-gated activation is grad * d(x) (relu: x > 0 ? grad : 0, like torch's threshold_backward);
// of a gated one: da = (grad * dact(a)) * b, db = grad * act(a).
#pragma once

#include "common/fp32_ops.h"

namespace fusible {

// The elementwise functions of the activations, one row each: X(Name, forward, derivative), both
// FUS_HD float(float) defined below. The kinds (fusible/activation.h, FUS_ACTIVATION_TABLE) name
// a row by Name; gated kinds apply it to their first half. ActFn, the compile-time and runtime
// selections below and every backend's dispatch (dispatch_act) are generated from this list.
#define FUS_ACT_FUNCTIONS(X)         \
  X(GeluTanh, gelu_tanh, dgelu_tanh) \
  X(GeluErf, gelu_erf, dgelu_erf)    \
  X(Relu, relu, drelu)               \
  X(Silu, silu, dsilu)

// The elementwise function of an activation, in FUS_ACT_FUNCTIONS order (kGeluTanh = 0, ...).
enum class ActFn : int {
#define FUS_ACT_FN_ENUMERATOR_(name, fwd, bwd) k##name,
  FUS_ACT_FUNCTIONS(FUS_ACT_FN_ENUMERATOR_)
#undef FUS_ACT_FN_ENUMERATOR_
};

// ---- exp
// ------------------------------------------------------------------------------------------

// 2^k for an integer k in [-126, 127], built from its exponent bits (exact).
FUS_HD float pow2i(uint32_t k) { return bits_as_float((k + 127u) << 23); }

// e^x for x <= 0 (and NaN; x > 0 is not supported). x = k ln2 + r with |r| <= ln2 / 2: k comes from
// one fma against 1.5 * 2^23 (which rounds x log2(e) to the nearest integer), r from two fmas
// (Cody-Waite), e^r from a degree-6 polynomial (minimax fit, 2e-8 relative). 2^k is applied as two
// power-of-two factors, the first exact, so that only the last multiply rounds: results in the
// subnormal range and underflow to 0 are correctly rounded too. About 20 instructions.
FUS_HD float exp_neg_f(float x) {
  x = x < -104.0f ? -104.0f : x;  // e^-104 rounds to 0; NaN passes
  const float t = f_fma(x, 1.44269502f, 12582912.0f);
  const float k = f_sub(t, 12582912.0f);
  float r = f_fma(-k, 0.693145752f, x);  // ln2 hi (0x3f317200)
  r = f_fma(-k, 1.42860677e-06f, r);     // ln2 lo (0x35bfbe8e)
  float p = 0.00138496398f;
  p = f_fma(p, r, 0.00837372988f);
  p = f_fma(p, r, 0.0416679271f);
  p = f_fma(p, r, 0.166664332f);
  p = f_fma(p, r, 0.49999994f);
  p = f_fma(p, r, 1.0f);
  p = f_fma(p, r, 1.0f);
  // k in [-150, 0] as an integer, read from t's low bits (unsigned arithmetic: NaN gives garbage
  // factors, but p is then NaN and so is the product).
  const uint32_t ki = float_as_bits(t) - 0x4b400000u;
  const uint32_t ka = static_cast<int32_t>(ki) < -100 ? static_cast<uint32_t>(-100) : ki;
  return f_mul(f_mul(p, pow2i(ka)), pow2i(ki - ka));
}

// e^(-x^2 / 2) with the square split so the rounding of x^2 is not magnified by exp: xh = x with
// its low 12 significand bits cleared (xh^2 is exact), x^2 = xh^2 + (x - xh)(x + xh).
FUS_HD float exp_neg_half_sq(float x) {
  const float xh = bits_as_float(float_as_bits(x) & 0xfffff000u);
  const float hi = f_mul(f_mul(-0.5f, xh), xh);
  const float lo = f_mul(f_mul(0.5f, f_sub(xh, x)), f_add(xh, x));
  return f_mul(exp_neg_f(hi), exp_neg_f(lo));
}

// ---- sigmoid
// ----------------------------------------------------------------------------------------

struct SigmoidPair {
  float s;    // sigmoid(x)
  float oms;  // 1 - sigmoid(x), without cancellation
};

// With e = e^-|x| (never overflows): the larger of s and 1 - s is 1 / (1 + e), the smaller
// e / (1 + e), so both keep their relative accuracy in the tails.
FUS_HD SigmoidPair sigmoid_pair(float x) {
  const float e = exp_neg_f(-f_abs(x));
  const float big = f_rcp_1to2(f_add(1.0f, e));
  const float small = f_mul(e, big);
  return x < 0.0f ? SigmoidPair{small, big} : SigmoidPair{big, small};
}

FUS_HD float sigmoid_f(float x) {
  const float e = exp_neg_f(-f_abs(x));
  const float big = f_rcp_1to2(f_add(1.0f, e));
  return x < 0.0f ? f_mul(e, big) : big;
}

// ---- GELU (tanh approximation)
// --------------------------------------------------------------------

// 2 sqrt(2/pi) and 2 sqrt(2/pi) * 0.044715: tanh(u) = 2 sigmoid(2u) - 1.
constexpr float kGeluC0 = 1.59576912f;
constexpr float kGeluC1 = 0.0713548162f;
constexpr float kGeluC1x3 = 0.214064449f;  // 3 * kGeluC1

FUS_HD float gelu_tanh(float x) {
  const float v = f_mul(x, f_fma(kGeluC1, f_mul(x, x), kGeluC0));
  return f_mul(x, sigmoid_f(v));
}

// d/dx [x s(v)] = s + x s (1 - s) v',  v' = c0 + 3 c1 x^2. Beyond |x| = 20 the derivative is 1 or
// 0 in fp32; clamping there keeps x^2 and v' finite (NaN passes through the clamp).
FUS_HD float dgelu_tanh(float x) {
  const float xc = x > 20.0f ? 20.0f : (x < -20.0f ? -20.0f : x);
  const float x2 = f_mul(xc, xc);
  const float v = f_mul(xc, f_fma(kGeluC1, x2, kGeluC0));
  const SigmoidPair sp = sigmoid_pair(v);
  const float t = f_mul(f_mul(xc, sp.s), sp.oms);
  return f_fma(t, f_fma(kGeluC1x3, x2, kGeluC0), sp.s);
}

// ---- GELU (erf)
// -----------------------------------------------------------------------------------

// erf(z) / z on |z| < 0.75 as a polynomial in z^2 (least-squares minimax fit, 1.4e-8 relative).
FUS_HD float erf_small(float z) {
  const float w = f_mul(z, z);
  float p = -0.000654679432f;
  p = f_fma(p, w, 0.00508256722f);
  p = f_fma(p, w, -0.0268164575f);
  p = f_fma(p, w, 0.112829201f);
  p = f_fma(p, w, -0.376125723f);
  p = f_fma(p, w, 1.12837911f);
  return f_mul(z, p);
}

// erfc(z) e^(z^2) on 0.75 <= z < 10 as a polynomial in t = 1 / (1 + z/2) (fit, 3.3e-9 relative).
FUS_HD float erfcx_mid(float z) {
  const float t = f_div(1.0f, f_fma(0.5f, z, 1.0f));
  float p = -0.0696962625f;
  p = f_fma(p, t, 0.333760947f);
  p = f_fma(p, t, -0.58302778f);
  p = f_fma(p, t, 0.381172895f);
  p = f_fma(p, t, -0.0940178558f);
  p = f_fma(p, t, 0.230362684f);
  p = f_fma(p, t, 0.235984519f);
  p = f_fma(p, t, 0.2834782f);
  p = f_fma(p, t, 0.28199327f);
  p = f_fma(p, t, 3.25955193e-06f);
  return p;
}

struct NormalCdf {
  float cdf;  // Phi(x)
  float pdf;  // phi(x) = e^(-x^2/2) / sqrt(2 pi)
};

// Phi(x) with relative accuracy in the lower tail (no 1 + erf cancellation for x < 0).
FUS_HD NormalCdf normal_cdf(float x) {
  const float z = f_mul(x, 0.707106769f);  // x / sqrt(2)
  const float az = f_abs(z);
  constexpr float kInvSqrt2Pi = 0.398942292f;
  if (az < 0.75f) {
    const float cdf = f_fma(0.5f, erf_small(z), 0.5f);
    return NormalCdf{cdf, f_mul(exp_neg_f(f_mul(f_mul(-0.5f, x), x)), kInvSqrt2Pi)};
  }
  if (az < 10.0f) {
    const float e = exp_neg_half_sq(x);  // e^(-z^2), from x directly to avoid z's rounding
    const float half_erfc = f_mul(0.5f, f_mul(e, erfcx_mid(az)));
    return NormalCdf{x < 0.0f ? half_erfc : f_sub(1.0f, half_erfc), f_mul(e, kInvSqrt2Pi)};
  }
  if (z != z) return NormalCdf{z, z};
  return NormalCdf{x < 0.0f ? 0.0f : 1.0f, 0.0f};
}

FUS_HD float gelu_erf(float x) { return f_mul(x, normal_cdf(x).cdf); }

// d/dx [x Phi(x)] = Phi(x) + x phi(x).
FUS_HD float dgelu_erf(float x) {
  const NormalCdf n = normal_cdf(x);
  return f_fma(x, n.pdf, n.cdf);
}

// ---- ReLU, SiLU
// -----------------------------------------------------------------------------------

FUS_HD float relu(float x) { return x < 0.0f ? 0.0f : x; }
FUS_HD float drelu(float x) { return x > 0.0f ? 1.0f : 0.0f; }

FUS_HD float silu(float x) { return f_mul(x, sigmoid_f(x)); }

// d/dx [x s(x)] = s (1 + x (1 - s)).
FUS_HD float dsilu(float x) {
  const SigmoidPair sp = sigmoid_pair(x);
  return f_mul(sp.s, f_fma(x, sp.oms, 1.0f));
}

// ---- dispatch by function
// -------------------------------------------------------------------------

template <ActFn A>
FUS_HD float act_fn(float x) {
#define FUS_ACT_FN_FWD_(name, fwd, bwd) \
  if constexpr (A == ActFn::k##name) return fwd(x);
  FUS_ACT_FUNCTIONS(FUS_ACT_FN_FWD_)
#undef FUS_ACT_FN_FWD_
  return x;
}

template <ActFn A>
FUS_HD float dact_fn(float x) {
#define FUS_ACT_FN_BWD_(name, fwd, bwd) \
  if constexpr (A == ActFn::k##name) return bwd(x);
  FUS_ACT_FUNCTIONS(FUS_ACT_FN_BWD_)
#undef FUS_ACT_FN_BWD_
  return 1.0f;
}

// Runtime-selected versions (host epilogues, tests).
FUS_HD float act_fn(ActFn a, float x) {
  switch (a) {
#define FUS_ACT_FN_CASE_(name, fwd, bwd) \
  case ActFn::k##name: return fwd(x);
    FUS_ACT_FUNCTIONS(FUS_ACT_FN_CASE_)
#undef FUS_ACT_FN_CASE_
  }
  return x;
}

FUS_HD float dact_fn(ActFn a, float x) {
  switch (a) {
#define FUS_ACT_FN_CASE_(name, fwd, bwd) \
  case ActFn::k##name: return bwd(x);
    FUS_ACT_FUNCTIONS(FUS_ACT_FN_CASE_)
#undef FUS_ACT_FN_CASE_
  }
  return 1.0f;
}

// Gradient of a non-gated activation: grad * act'(x); ReLU selects instead of multiplying (an inf
// or NaN gradient where x <= 0 gives 0, as torch's threshold_backward).
template <ActFn A>
FUS_HD float act_grad(float grad, float x) {
  if constexpr (A == ActFn::kRelu) return x > 0.0f ? grad : 0.0f;
  return f_mul(grad, dact_fn<A>(x));
}

// Gated: y = act(a) * b; da = (grad * act'(a)) * b; db = grad * act(a).
template <ActFn A>
FUS_HD float gated_fwd(float a, float b) {
  return f_mul(act_fn<A>(a), b);
}
template <ActFn A>
FUS_HD void gated_grad(float grad, float a, float b, float* da, float* db) {
  *da = f_mul(f_mul(grad, dact_fn<A>(a)), b);
  *db = f_mul(grad, act_fn<A>(a));
}

}  // namespace fusible
