// Branch-free exp and tanh for float that every ISA copy vectorises (the softmax and softcap
// of the CPU attention kernel); double keeps std::exp / std::tanh (gradcheck precision).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

namespace fastattn::cpu {

// exp(x) with about 2 ulp of relative error for x in [-87, 88]; 0 below -87.3 and for -inf.
inline float exp_approx(float x) {
  const float t = x * 1.44269504088896341f;          // x / ln 2
  const float clamped = t < -126.0f ? -126.0f : (t > 127.0f ? 127.0f : t);
  const float n = std::nearbyint(clamped);
  const float f = clamped - n;                        // in [-0.5, 0.5]
  // 2^f, Taylor series to f^7 (relative error < 2e-8 on [-0.5, 0.5])
  float p = 1.525273380405984e-05f;
  p = p * f + 1.5403530393381606e-04f;
  p = p * f + 1.3333558146428443e-03f;
  p = p * f + 9.6181291076284772e-03f;
  p = p * f + 5.5504108664821580e-02f;
  p = p * f + 2.4022650695910071e-01f;
  p = p * f + 6.9314718055994531e-01f;
  p = p * f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  const float result = p * scale;
  return x < -87.3f ? 0.0f : result;
}

inline double exp_approx(double x) { return std::exp(x); }

// tanh(x): odd Taylor series near 0 (where 1 - e^{-2|x|} would cancel), else
// (1 - e) / (1 + e) with e = exp(-2|x|) <= 0.55.
inline float tanh_approx(float x) {
  const float ax = std::fabs(x);
  const float x2 = x * x;
  float small = 62.0f / 2835.0f;
  small = small * x2 - 17.0f / 315.0f;
  small = small * x2 + 2.0f / 15.0f;
  small = small * x2 - 1.0f / 3.0f;
  small = x + x * x2 * small;
  const float e = exp_approx(-2.0f * ax);
  const float large = std::copysign((1.0f - e) / (1.0f + e), x);
  return ax < 0.3f ? small : large;
}

inline double tanh_approx(double x) { return std::tanh(x); }

}  // namespace fastattn::cpu
