// Branch-free exp and tanh for float that every ISA copy vectorises (the softmax and softcap
// of the CPU attention kernel); double keeps std::exp / std::tanh (gradcheck precision).
// Every clamp puts its bound first: x86 min and max return their second operand when either is
// NaN, so a NaN argument stays NaN, as in torch, instead of becoming a finite bound.
#pragma once
#include "common/cpu_target.h"
#include "common/cpu_vec.h"
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace fastattn::cpu {
inline namespace FASTATTN_TARGET_NAMESPACE {  // common/cpu_target.h

// 2^f for f in [-0.5, 0.5]: Taylor coefficients of f^7 down to f^0 (relative error < 2e-8),
// evaluated by Horner's rule in every exp_approx and exp2_approx below (scalar and vector).
constexpr float kExp2Fraction[8] = {1.525273380405984e-05f,  1.5403530393381606e-04f,
                                    1.3333558146428443e-03f, 9.6181291076284772e-03f,
                                    5.5504108664821580e-02f, 2.4022650695910071e-01f,
                                    6.9314718055994531e-01f, 1.0f};
// 2^f for f in [-0.5, 0.5] to about one float ulp (relative error 7.5e-8): coefficients of f^5
// down to f^0, for the exponentials that need no more (probabilities rounded to bfloat16, the
// key-major softmax).
constexpr float kExp2FractionShort[6] = {1.3276444402170206e-03f, 9.6755376971673600e-03f,
                                         5.5507133152376880e-02f, 2.4022119793277966e-01f,
                                         6.9314696706794910e-01f, 1.0000000716400320e+00f};
// tanh's odd series near 0 by Horner's rule in x^2, innermost coefficient first:
// tanh x ~ x + x^3 (-1/3 + x^2 (2/15 + x^2 (-17/315 + x^2 62/2835))).
constexpr float kTanhSeries[4] = {62.0f / 2835.0f, -17.0f / 315.0f, 2.0f / 15.0f, -1.0f / 3.0f};

// exp(x) with about 2 ulp of relative error for x in [-87, 88]; 0 below -87.3 and for -inf.
// The base copy (no FMA) calls libm instead: there each Horner step rounds twice, which put
// a recurrent weight gradient (a sum over T * B rows) past the tests' rule
// (docs/design/cpu_kernels.md, "The base copy's recurrent gradients").
inline float exp_approx(float x) {
#if !defined(FASTATTN_CPU_VEC)
  return std::exp(x);
#else
  const float t = x * 1.44269504088896341f;  // x / ln 2
  const float clamped = t < -126.0f ? -126.0f : (t > 127.0f ? 127.0f : t);
  const float n = std::nearbyint(clamped);
  const float f = clamped - n;  // in [-0.5, 0.5]
  float p = kExp2Fraction[0];   // 2^f
#pragma GCC unroll 8
  for (int i = 1; i < 8; ++i) p = p * f + kExp2Fraction[i];
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  const float result = p * scale;
  return x < -87.3f ? 0.0f : result;
#endif
}

inline double exp_approx(double x) { return std::exp(x); }

// tanh(x): odd Taylor series near 0 (where 1 - e^{-2|x|} would cancel), else
// (1 - e) / (1 + e) with e = exp(-2|x|) <= 0.55. The base copy calls libm (as exp_approx).
inline float tanh_approx(float x) {
#if !defined(FASTATTN_CPU_VEC)
  return std::tanh(x);
#else
  const float ax = std::fabs(x);
  const float x2 = x * x;
  float small = kTanhSeries[0];
#pragma GCC unroll 4
  for (int i = 1; i < 4; ++i) small = small * x2 + kTanhSeries[i];
  small = x + x * x2 * small;
  const float e = exp_approx(-2.0f * ax);
  const float large = std::copysign((1.0f - e) / (1.0f + e), x);
  return ax < 0.3f ? small : large;
#endif
}

inline double tanh_approx(double x) { return std::tanh(x); }

#if defined(FASTATTN_CPU_VEC)
// 2^f for f in [-0.5, 0.5]: the degree-7 polynomial of exp_approx.
inline VecF exp2_fraction(VecF f) {
  VecF p = VecF::set1(kExp2Fraction[0]);
#pragma GCC unroll 8
  for (int i = 1; i < 8; ++i) p = fma(p, f, VecF::set1(kExp2Fraction[i]));
  return p;
}

// exp_approx on every lane (same algorithm and constants).
inline VecF exp_approx(VecF x) {
  const VecF t = x * VecF::set1(1.44269504088896341f);
  const VecF clamped = min(VecF::set1(127.0f), max(VecF::set1(-126.0f), t));
  const VecF n = round_nearest(clamped);
  const VecF result = scale_by_pow2(exp2_fraction(clamped - n), n);
  return select_less(x, VecF::set1(-87.3f), VecF::zero(), result);
}

// 2^t on every lane for t <= 0 (the key-major attention softmax: scores in log2 units, less
// their running maximum) with kExp2FractionShort, about one float ulp. t at or below -127 (and
// -inf) gives 0 with no compare: there n = -127 builds the bits of +0.
inline VecF exp2_nonpositive(VecF t) {
  t = max(VecF::set1(-127.0f), t);
  const VecF n = round_nearest(t);
  const VecF f = t - n;
  VecF p = VecF::set1(kExp2FractionShort[0]);
#pragma GCC unroll 6
  for (int i = 1; i < 6; ++i) p = fma(p, f, VecF::set1(kExp2FractionShort[i]));
  return scale_by_pow2(p, n);
}

// tanh_approx on every lane (same algorithm: odd series below 0.3, exp formula above).
inline VecF tanh_approx(VecF x) {
  const VecF ax = abs(x);
  const VecF x2 = x * x;
  VecF small = VecF::set1(kTanhSeries[0]);
#pragma GCC unroll 4
  for (int i = 1; i < 4; ++i) small = fma(small, x2, VecF::set1(kTanhSeries[i]));
  small = fma(x * x2, small, x);
  const VecF e = exp_approx(VecF::set1(-2.0f) * ax);
  const VecF one = VecF::set1(1.0f);
  const VecF large = copysign((one - e) / (one + e), x);
  return select_less(ax, VecF::set1(0.3f), small, large);
}
#endif

// max over x[0, n) (-inf when n == 0).
inline float row_max(const float* x, int64_t n) {
#if defined(FASTATTN_CPU_VEC)
  constexpr int W = VecF::kWidth;
  VecF m = VecF::set1(-std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + W <= n; i += W) m = max(m, VecF::load(x + i));
  if (i < n) {
    m = max(m, VecF::load(x + i, VecF::tail(n - i), -std::numeric_limits<float>::infinity()));
  }
  return reduce_max(m);
#else
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) m = std::max(m, x[i]);
  return m;
#endif
}

inline double row_max(const double* x, int64_t n) {
  double m = -std::numeric_limits<double>::infinity();
  for (int64_t i = 0; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

#if defined(__AVX512F__)
// exp(x - shift) on 16 lanes for probabilities that are rounded to bfloat16 before their
// products (the bfloat16 attention tiles): a degree-5 polynomial for 2^f (relative error
// 7.5e-8, about one float ulp, where bfloat16 rounding is 2^-9) scaled by 2^n with vscalefps,
// half the instructions of exp_approx. Results below 2^-126 (masked scores among them) are 0,
// computed under a mask: an underflowing vscalefps takes a microcode assist of ~100 cycles,
// which made the diagonal tiles of causal attention as slow as the whole softmax.
// exp2_for_bf16 is 2^t (t in log2 units: the callers fold the log2(e) factor, and the softmax
// scale, into the multiply that forms t).
inline __m512 exp2_for_bf16(__m512 t) {
  t = _mm512_max_ps(_mm512_set1_ps(-200.0f), t);  // no inf - inf below
  const __mmask16 normal = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-126.0f), _CMP_NLT_UQ);
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(kExp2FractionShort[0]);
#pragma GCC unroll 6
  for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(kExp2FractionShort[i]));
  return _mm512_maskz_scalef_ps(normal, p, n);
}

inline __m512 exp_shifted_for_bf16(__m512 x, __m512 shift) {
  return exp2_for_bf16(
      _mm512_mul_ps(_mm512_sub_ps(x, shift), _mm512_set1_ps(1.44269504088896341f)));
}

// 2^t on 16 lanes with exp_approx's polynomial (about 2 ulp); 0 below 2^-126 and for -inf.
inline __m512 exp2_approx(__m512 t) {
  const __m512 clamped =
      _mm512_min_ps(_mm512_set1_ps(127.0f), _mm512_max_ps(_mm512_set1_ps(-126.0f), t));
  const __m512 n = _mm512_roundscale_ps(clamped, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(clamped, n);
  const __m512 p = exp2_fraction(VecF{f}).v;
  const __mmask16 normal = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-126.0f), _CMP_NLT_UQ);
  return _mm512_maskz_scalef_ps(normal, p, n);
}

// x[i] = exp(x[i] - shift) for i < n with exp_shifted_for_bf16; returns their sum.
inline float exp_shift_sum_for_bf16(float* x, int64_t n, float shift) {
  const __m512 s = _mm512_set1_ps(shift);
  __m512 sum = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp_shifted_for_bf16(_mm512_loadu_ps(x + i), s);
    _mm512_storeu_ps(x + i, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (i < n) {
    const __mmask16 k = static_cast<__mmask16>((1u << (n - i)) - 1u);
    const __m512 e = exp_shifted_for_bf16(_mm512_maskz_loadu_ps(k, x + i), s);
    _mm512_mask_storeu_ps(x + i, k, e);
    sum = _mm512_mask_add_ps(sum, k, sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}
#endif

// sum_i x[i] * y[i] over i < n, in vector lanes (a scalar loop would not vectorise: the
// compiler keeps the sum's order).
inline float dot(const float* x, const float* y, int64_t n) {
#if defined(FASTATTN_CPU_VEC)
  constexpr int W = VecF::kWidth;
  VecF sum = VecF::zero();
  int64_t i = 0;
  for (; i + W <= n; i += W) sum = fma(VecF::load(x + i), VecF::load(y + i), sum);
  if (i < n) {
    const TailF t = VecF::tail(n - i);
    sum = fma(VecF::load(x + i, t), VecF::load(y + i, t), sum);
  }
  return reduce_add(sum);
#else
  float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    for (int r = 0; r < 8; ++r) part[r] += x[i + r] * y[i + r];
  }
  for (; i < n; ++i) part[0] += x[i] * y[i];
  return ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
#endif
}

inline double dot(const double* x, const double* y, int64_t n) {
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) sum += x[i] * y[i];
  return sum;
}

// x[i] = exp(x[i] - shift) for i < n; returns their sum.
inline float exp_shift_sum(float* x, int64_t n, float shift) {
#if defined(FASTATTN_CPU_VEC)
  constexpr int W = VecF::kWidth;
  const VecF s = VecF::set1(shift);
  VecF sum = VecF::zero();
  int64_t i = 0;
  for (; i + W <= n; i += W) {
    const VecF e = exp_approx(VecF::load(x + i) - s);
    e.store(x + i);
    sum = sum + e;
  }
  if (i < n) {
    const TailF t = VecF::tail(n - i);
    // masked lanes load 0 and give exp(-shift): only the stored lanes are summed
    const VecF e = exp_approx(VecF::load(x + i, t) - s);
    e.store(x + i, t);
    sum = sum + keep(e, t);
  }
  return reduce_add(sum);
#else
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = exp_approx(x[i] - shift);
    sum += x[i];
  }
  return sum;
#endif
}

inline double exp_shift_sum(double* x, int64_t n, double shift) {
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) {
    x[i] = std::exp(x[i] - shift);
    sum += x[i];
  }
  return sum;
}

}  // namespace FASTATTN_TARGET_NAMESPACE
}  // namespace fastattn::cpu
