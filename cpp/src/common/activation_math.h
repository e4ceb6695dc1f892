// Activation functions and their derivatives in fp32, shared by every backend that evaluates them
// (the activation family's CPU and CUDA kernels, and the GEMM family's CPU epilogues).
//
// Every function is built from correctly rounded single-precision operations only (common/
// fp32_ops.h: add, sub, mul, fma, the reciprocal of [1, 8], clamps, selects, integer bit
// operations; no division, no library transcendental), in a fixed order and without branches, so
// the host and the device compute the same bits for the same input; only the sign and payload of a
// NaN may differ.
//
// How (issue 18: the activation kernels are issue-bound, so the operations per element are their
// speed):
//   e^x, x <= 0   k = round(x log2 e), r = x - k ln2 (Cody-Waite, two fmas), e^r by a degree-6
//                 polynomial, 2^k built from k's bits by one shift, one multiply   (exp_neg_f)
//   2^a, a <= 0   k = round(a), f = a - k exactly, 2^f by a degree-5 polynomial  (exp2_neg_f, for
//                 the tanh GELU, whose computed argument makes the Cody-Waite split moot)
//   sigmoid(v)    e = e^-|v|: 1 / (1 + e) (rcp.approx and one Newton step on the device, correctly
//                 rounded) and e / (1 + e), chosen by the sign of v
//   gelu_tanh     x sigmoid(v), the constants of v scaled by log2 e for the base-2 exp
//   gelu_erf      Phi(-|x|) = e^(-x^2/2) P(t), t = 1 / (1 + 0.295 |x|), P of degree 8, for every
//                 x (the formula before issue 18 branched at |x / sqrt 2| = 0.75 and divided)
// Operations per element (PTX arithmetic instructions for sm_90a, not counting moves, negations
// and |.|, which ptxas folds into operands; `python3 benchmarks/act_math.py` counts them), before
// issue 18 (commit 2d81a10) and now:
//   exp_neg_f(-|x|) 23 -> 13, sigmoid 31 -> 20, gelu_tanh 35 -> 22, dgelu_tanh 41 -> 26,
//   gelu_erf 97 -> 33 (7 branches and a division -> none), dgelu_erf 116 -> 34, silu 32 -> 21,
//   dsilu 32 -> 22.
//
// Accuracy against long double references over every float of the range with |x| >= 2^-10 and
// every 61st below (ulp: the float spacing at the exact value, 2^-149 below the normal range):
//   exp_neg_f (e^x)    <= 1.05 ulp for x >= -87.68 (subnormal results from -87.34 on); +0 below
//   exp2_neg_f (2^a)   <= 2.05 ulp for a >= -126.49; +0 below -126.5
//   sigmoid            <= 2.8 ulp for x >= -87.68; +0 below (the exact value is below 8.3e-39)
//   silu               <= 3.7 ulp for x >= -87.68; -0 below (|silu| < 7.3e-37 there)
//   gelu_tanh          <= 14.1 ulp for x >= -3; down to -9.9, 2.6 |v| ulp: the fp32 rounding of
//                      the tanh argument v ~ 0.0714 x^3 dominates (relative error ~ |v| 2^-24), as
//                      in any fp32 evaluation of the formula; -0 below -10.016 (|gelu| < 8.4e-38)
//   gelu_erf           <= 7.3 ulp for x >= -13 (the lower tail keeps relative accuracy); -0 below
//                      -13.243 (|gelu| < 3.3e-39, a subnormal)
//   dgelu_tanh         <= 7.5e-7 relative to max(|d|, 0.1)
//   dgelu_erf          <= 1.15e-6 relative to max(|d|, 0.1)
//   dsilu              <= 5e-7 relative to max(|d|, 0.1)
// (The same measurement of the functions before issue 18: e^x 1.07, sigmoid 2.8, silu 3.61,
// gelu_tanh 14.1, gelu_erf 6.6 ulp, dgelu_tanh 7.5e-7, dgelu_erf 7.9e-7, dsilu 4.0e-7; their
// comment, from 6M sampled points, had stated 3.5, 13 and 6 ulp for silu, gelu_tanh and
// gelu_erf. The tests check the bounds above on a dense sample: test_activation.cpp.)
// Special values: the forward functions map +-0 to +-0, are x / 2 exactly for |x| <= 1e-9, x
// from where the sigmoid or Phi rounds to 1, inf at +inf and NaN at -inf (-inf * 0, as torch);
// the derivatives are 1/2 at +-0, 1 and 0 in the saturated ranges, NaN at +-inf (inf * 0, as
// torch's backward); NaN gives NaN.
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
  X(Silu, silu, dsilu)               \
  X(Identity, identity_f, didentity_f)

// The elementwise function of an activation, in FUS_ACT_FUNCTIONS order (kGeluTanh = 0, ...).
enum class ActFn : int {
#define FUS_ACT_FN_ENUMERATOR_(name, fwd, bwd) k##name,
  FUS_ACT_FUNCTIONS(FUS_ACT_FN_ENUMERATOR_)
#undef FUS_ACT_FN_ENUMERATOR_
};

// ---- exp
// ------------------------------------------------------------------------------------------

// Range reduction to the nearest integer k: fl(a + kRound) = kRound + round(a) for |a| < 2^22
// (kRound = 1.5 * 2^23 + 127 has unit spacing; its + 127 is 2^k's exponent bias).
constexpr float kRound = 12583039.0f;

// 2^k from t = fl(a + kRound), for k in [-127, 128]: t's bits are 0x4b400000 + 127 + k, so its
// low 9 bits shifted to the exponent field are 2^k's bit pattern (k = -127 gives +0, so the product
// flushes to zero; k = 128 gives inf). One shift; a NaN t gives some pattern, harmless since the
// value it scales is then NaN too.
FUS_HD float exp_scale(float t) { return bits_as_float(float_as_bits(t) << 23); }

// e^r = exp_poly(r) for |r| <= ln2 / 2: degree-6 minimax fit of the relative error (fp32
// coefficients, 1.7e-8; the functions built on e^r need it relative).
constexpr float kExp6 = 0.00138436526f, kExp5 = 0.00837415643f, kExp4 = 0.0416680016f,
                kExp3 = 0.166664317f, kExp2 = 0.49999994f;
FUS_HD float exp_poly(float r) {
  float p = kExp6;
  p = f_fma(p, r, kExp5);
  p = f_fma(p, r, kExp4);
  p = f_fma(p, r, kExp3);
  p = f_fma(p, r, kExp2);
  p = f_fma(p, r, 1.0f);
  return f_fma(p, r, 1.0f);
}

// e^x for x <= 0 (and NaN: NaN). x = k ln2 + r with |r| <= ln2 / 2: k from one fma (x log2(e)
// rounded to the nearest integer), r from two fmas (Cody-Waite: the first is exact), e^r from
// exp_poly, 2^k by exp_scale. Results below 2^-126.5 (x < -87.68) flush to 0; between that and
// 2^-126 the last multiply rounds them into the subnormal range correctly; below -88 the argument
// is clamped. 13 operations (a degree-5 polynomial would do for e^x alone, 2 ulp, but sigmoid
// and SiLU would lose their bounds).
FUS_HD float exp_neg_f(float x) {
  x = f_max_nan(x, -88.0f);
  const float t = f_fma(x, 1.44269502f, kRound);
  const float k = f_sub(t, kRound);
  float r = f_fma(k, -0.693145752f, x);  // ln2 hi (0x3f317200)
  r = f_fma(k, -1.42860677e-06f, r);     // ln2 lo (0x35bfbe8e)
  return f_mul(exp_poly(r), exp_scale(t));
}

// e^(-(q + lo) / 2) for 0 <= q <= 175.6 and |lo| <= 2^-24 q: the normal density's exponential,
// where q = fl(x^2) and lo = x^2 - q exactly (from an fma), so that the rounding of the square is
// not magnified by the exp. The same computation as exp_neg_f(-q / 2) with r scaled by -2 (exact,
// so the bits are those of that evaluation), which saves the multiply by -1/2: s = -2r = q + 2k ln2
// in two fmas, plus lo, and exp_poly's coefficients times (-1/2)^i. No clamp: k >= -127 for q in
// the range. 14 operations.
FUS_HD float exp_neg_half(float q, float lo) {
  const float t = f_fma(q, -0.5f * 1.44269502f, kRound);
  const float k = f_sub(t, kRound);
  float s = f_fma(k, 2.0f * 0.693145752f, q);
  s = f_fma(k, 2.0f * 1.42860677e-06f, s);
  s = f_add(s, lo);
  float p = kExp6 * 0.015625f;
  p = f_fma(p, s, kExp5 * -0.03125f);
  p = f_fma(p, s, kExp4 * 0.0625f);
  p = f_fma(p, s, kExp3 * -0.125f);
  p = f_fma(p, s, kExp2 * 0.25f);
  p = f_fma(p, s, -0.5f);
  return f_mul(f_fma(p, s, 1.0f), exp_scale(t));
}

// 2^f = exp2_poly(f) for |f| <= 1/2: degree-5 minimax fit of the relative error (fp32
// coefficients, 1.1e-7).
FUS_HD float exp2_poly(float f) {
  float p = 0.00132647238f;
  p = f_fma(p, f, 0.00967151485f);
  p = f_fma(p, f, 0.0555073395f);
  p = f_fma(p, f, 0.240222424f);
  p = f_fma(p, f, 0.693147004f);
  return f_fma(p, f, 1.0f);
}

// 2^a for a <= 0 (and NaN: NaN), for an argument that is itself a computed value (the GELU's tanh
// argument in base 2): a = k + f exactly (k = round(a), f = a - k), 2^f from exp2_poly, 2^k by
// exp_scale. Results below 2^-126.5 flush to 0. 11 operations: exp_neg_f's Cody-Waite split of
// k ln2 costs one more, and buys nothing for an argument that already carries a rounding error.
FUS_HD float exp2_neg_f(float a) {
  a = f_max_nan(a, -127.0f);
  const float t = f_add(a, kRound);
  const float f = f_sub(a, f_sub(t, kRound));
  return f_mul(exp2_poly(f), exp_scale(t));
}

// ---- sigmoid
// ----------------------------------------------------------------------------------------

// With e = e^-|v| (never overflows): the larger of s = sigmoid(v) and 1 - s is 1 / (1 + e), the
// smaller e / (1 + e), so both keep their relative accuracy in the tails; s (1 - s) = big * small
// whatever the sign.
struct SigmoidParts {
  float big;    // 1 / (1 + e) = max(s, 1 - s)
  float small;  // e / (1 + e) = min(s, 1 - s)
};

FUS_HD SigmoidParts sigmoid_parts(float e) {
  const float big = f_rcp_1to8(f_add(1.0f, e));
  return SigmoidParts{big, f_mul(e, big)};
}

FUS_HD float sigmoid_f(float x) {
  const SigmoidParts p = sigmoid_parts(exp_neg_f(-f_abs(x)));
  return f_select(x < 0.0f, p.small, p.big);
}

// ---- GELU (tanh approximation)
// --------------------------------------------------------------------

// tanh(u) = 2 sigmoid(2u) - 1, so gelu_tanh(x) = x sigmoid(v), v = x (c0 + c1 x^2) with
// c0 = 2 sqrt(2/pi), c1 = 0.044715 c0. The exp takes v in base 2, u = v log2(e) = x (l0 + l1 x^2)
// with the constants scaled (all correctly rounded from the exact values).
constexpr float kGeluC0 = 1.59576917f;     // 2 sqrt(2/pi)
constexpr float kGeluC1x3 = 0.214064449f;  // 3 * 0.044715 * 2 sqrt(2/pi)
constexpr float kGeluL0 = 2.30220819f;     // 2 sqrt(2/pi) log2(e)
constexpr float kGeluL1 = 0.102943242f;    // 0.044715 * 2 sqrt(2/pi) log2(e)

FUS_HD float gelu_tanh(float x) {
  const float u = f_mul(x, f_fma(kGeluL1, f_mul(x, x), kGeluL0));
  const SigmoidParts p = sigmoid_parts(exp2_neg_f(-f_abs(u)));
  return f_mul(x, f_select(x < 0.0f, p.small, p.big));
}

// d/dx [x s(v)] = s + x s (1 - s) v',  v' = c0 + 3 c1 x^2, as s + (x small) (v' big). x^2 is
// taken of min(|x|, 20) (beyond 20 the derivative is 1 or 0 in fp32, e^-|v| is 0 and so is
// x small): x^2 and v' stay finite, and so does x small for every finite x. At x = +-inf,
// x small = inf * 0 makes the derivative NaN (as torch's gelu_backward); a NaN x gives NaN.
struct GeluTanhParts {
  float s;  // sigmoid(v)
  float d;  // the derivative
};
FUS_HD GeluTanhParts gelu_tanh_parts(float x) {
  const float ac = f_min_num(f_abs(x), 20.0f);
  const float x2 = f_mul(ac, ac);
  const float u = f_mul(x, f_fma(kGeluL1, x2, kGeluL0));
  const SigmoidParts p = sigmoid_parts(exp2_neg_f(-f_abs(u)));
  const float s = f_select(x < 0.0f, p.small, p.big);
  return GeluTanhParts{s, f_fma(f_mul(x, p.small), f_mul(f_fma(kGeluC1x3, x2, kGeluC0), p.big), s)};
}

FUS_HD float dgelu_tanh(float x) { return gelu_tanh_parts(x).d; }

// gelu_tanh(x) and dgelu_tanh(x) from one exp (the GEGLU backward needs both), the same bits as
// the two functions: x s(v) with this s is gelu_tanh's (for |x| <= 20, min(|x|, 20)^2 = x^2;
// beyond, both sigmoids are exactly 0 or 1).
FUS_HD void gelu_tanh_and_d(float x, float* y, float* d) {
  const GeluTanhParts g = gelu_tanh_parts(x);
  *y = f_mul(x, g.s);
  *d = g.d;
}

// ---- GELU (erf)
// -----------------------------------------------------------------------------------

// Phi(-a) = 0.5 erfc(a / sqrt 2) = e^(-a^2/2) R(a) for a >= 0, R(a) = 0.5 erfcx(a / sqrt 2) (from
// 0.5 at a = 0 down like 1 / (a sqrt(2 pi))), as a polynomial in t = 1 / (1 + c a) on
// 0 <= a <= 13.25 (t in [0.204, 1]; degree-8 minimax fit of the relative error, fp32
// coefficients, 3.4e-8 relative). One formula for every x: no branch, no division.
constexpr float kErfcC = 0.294999987f;
constexpr float kCdfAMax = 13.25f;  // e^(-a^2/2) flushes to 0 beyond (a > 13.243)
FUS_HD float mills_poly(float t) {
  float p = 0.0397217907f;
  p = f_fma(p, t, -0.184764475f);
  p = f_fma(p, t, 0.273616314f);
  p = f_fma(p, t, -0.119817652f);
  p = f_fma(p, t, 0.168036923f);
  p = f_fma(p, t, 0.0840599835f);
  p = f_fma(p, t, 0.121860422f);
  p = f_fma(p, t, 0.117268577f);
  return f_fma(p, t, 1.81301875e-05f);
}

struct NormalCdf {
  float cdf;  // Phi(x)
  float e;    // e^(-x^2/2) = sqrt(2 pi) phi(x)
};
constexpr float kInvSqrt2Pi = 0.398942292f;

// Phi(x) with relative accuracy in the lower tail (no 1 + erf cancellation for x < 0): with
// a = min(|x|, 13.25), h = e^(-a^2/2) R(a) = Phi(-|x|) and Phi(x) = h or 1 - h by the sign. The
// square is split (a^2 = q + lo exactly, lo from an fma) so its rounding is not magnified by the
// exp. Beyond |x| = 13.243, h = 0: Phi is 0 or 1. R(0) evaluates to 0.5 exactly, so Phi(0) = 1/2.
// A NaN x gives finite parts (the callers' products with x make the result NaN).
FUS_HD NormalCdf normal_cdf(float x) {
  const float a = f_min_num(f_abs(x), kCdfAMax);
  const float q = f_mul(a, a);
  const float e = exp_neg_half(q, f_fma(a, a, -q));
  const float h = f_mul(e, mills_poly(f_rcp_1to8(f_fma(kErfcC, a, 1.0f))));
  return NormalCdf{f_select(x < 0.0f, h, f_sub(1.0f, h)), e};
}

FUS_HD float gelu_erf(float x) { return f_mul(x, normal_cdf(x).cdf); }

// d/dx [x Phi(x)] = Phi(x) + x phi(x).
FUS_HD float dgelu_erf(float x) {
  const NormalCdf n = normal_cdf(x);
  return f_fma(f_mul(x, n.e), kInvSqrt2Pi, n.cdf);
}

// ---- ReLU, SiLU
// -----------------------------------------------------------------------------------

FUS_HD float relu(float x) { return x < 0.0f ? 0.0f : x; }
FUS_HD float drelu(float x) { return x > 0.0f ? 1.0f : 0.0f; }

FUS_HD float silu(float x) { return f_mul(x, sigmoid_f(x)); }

// d/dx [x s(x)] = s (1 + x (1 - s)) = s + x s (1 - s).
FUS_HD float dsilu(float x) {
  const SigmoidParts p = sigmoid_parts(exp_neg_f(-f_abs(x)));
  const float s = f_select(x < 0.0f, p.small, p.big);
  return f_fma(f_mul(x, p.small), p.big, s);
}

// ---- identity (the bias gradient beside a gradient's cast; activation.h)
// -----------------------------------------------------------------------------------

FUS_HD float identity_f(float x) { return x; }
FUS_HD float didentity_f(float) { return 1.0f; }

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
  if constexpr (A == ActFn::kIdentity) return grad;  // x unread (the CUDA kernels skip its load)
  return f_mul(grad, dact_fn<A>(x));
}

// act(x) and act'(x) together: the two functions, or one evaluation where a function has one
// (gelu_tanh_and_d; SiLU's two share sigmoid_parts, which the compiler evaluates once).
template <ActFn A>
FUS_HD void act_and_dact(float x, float* y, float* d) {
  if constexpr (A == ActFn::kGeluTanh) {
    gelu_tanh_and_d(x, y, d);
  } else {
    *y = act_fn<A>(x);
    *d = dact_fn<A>(x);
  }
}

// Gated: y = act(a) * b; da = (grad * act'(a)) * b; db = grad * act(a).
template <ActFn A>
FUS_HD float gated_fwd(float a, float b) {
  return f_mul(act_fn<A>(a), b);
}
template <ActFn A>
FUS_HD void gated_grad(float grad, float a, float b, float* da, float* db) {
  float act, dact;
  act_and_dact<A>(a, &act, &dact);
  *da = f_mul(f_mul(grad, dact), b);
  *db = f_mul(grad, act);
}

}  // namespace fusible
