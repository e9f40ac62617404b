// A float vector of the including file's ISA (common/cpu_target.h), for kernels written once
// for every vector width: VecF::kWidth lanes, loads and stores with a masked tail, FMA,
// min/max, reductions, rounding and bit-level scaling (the exponentials of cpu_math.h).
//
// FASTATTN_CPU_VEC is defined where VecF exists. The AVX2 copy (8 lanes, 16 ymm registers) is
// built on it today; the AVX-512 copies keep their hand-written 16-lane kernels until the
// width-generic ones are measured against them on an AVX-512 machine (docs/design/cpu_kernels.md).
#pragma once
#include "common/cpu_target.h"
#include <cstdint>
#include <type_traits>
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#include <immintrin.h>
#define FASTATTN_CPU_VEC 1
#endif

namespace fastattn::cpu {
inline namespace FASTATTN_TARGET_NAMESPACE {  // common/cpu_target.h

#if defined(FASTATTN_CPU_VEC)
// Lanes [0, n) of a vector (a right edge): n >= kWidth is every lane, n <= 0 none.
struct TailF {
  __m256i lanes;
  bool full;
};

struct VecF {
  static constexpr int kWidth = 8;
  __m256 v;

  VecF() = default;
  VecF(__m256 x) : v(x) {}                 // NOLINT: implicit, as the intrinsics' results
  VecF(float x) : v(_mm256_set1_ps(x)) {}  // NOLINT: a scalar broadcast to every lane

  static VecF zero() { return {_mm256_setzero_ps()}; }
  static VecF set1(float x) { return {_mm256_set1_ps(x)}; }
  static VecF load(const float* p) { return {_mm256_loadu_ps(p)}; }
  // Masked lanes read nothing (no fault past an allocation's end) and are 0.
  static VecF load(const float* p, TailF t) {
    return t.full ? load(p) : VecF{_mm256_maskload_ps(p, t.lanes)};
  }
  // As load(p, t), with `fill` in the masked lanes.
  static VecF load(const float* p, TailF t, float fill) {
    if (t.full) return load(p);
    return {_mm256_blendv_ps(_mm256_set1_ps(fill), _mm256_maskload_ps(p, t.lanes),
                             _mm256_castsi256_ps(t.lanes))};
  }
  static TailF tail(int64_t n) {
    const int lanes = n >= kWidth ? kWidth : (n <= 0 ? 0 : static_cast<int>(n));
    const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return {_mm256_cmpgt_epi32(_mm256_set1_epi32(lanes), index), lanes == kWidth};
  }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
  void store(float* p, TailF t) const {
    if (t.full) {
      store(p);
    } else {
      _mm256_maskstore_ps(p, t.lanes, v);
    }
  }

  friend VecF operator-(VecF a) { return {_mm256_xor_ps(a.v, _mm256_set1_ps(-0.0f))}; }
  friend VecF operator+(VecF a, VecF b) { return {_mm256_add_ps(a.v, b.v)}; }
  friend VecF operator-(VecF a, VecF b) { return {_mm256_sub_ps(a.v, b.v)}; }
  friend VecF operator*(VecF a, VecF b) { return {_mm256_mul_ps(a.v, b.v)}; }
  friend VecF operator/(VecF a, VecF b) { return {_mm256_div_ps(a.v, b.v)}; }
  // a * b + c, one rounding.
  friend VecF fma(VecF a, VecF b, VecF c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  friend VecF max(VecF a, VecF b) { return {_mm256_max_ps(a.v, b.v)}; }
  friend VecF min(VecF a, VecF b) { return {_mm256_min_ps(a.v, b.v)}; }
  friend VecF abs(VecF a) {
    return {_mm256_andnot_ps(_mm256_set1_ps(-0.0f), a.v)};  // clear the sign bit
  }
  // |a| with the sign of b.
  friend VecF copysign(VecF a, VecF b) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    return {_mm256_or_ps(_mm256_andnot_ps(sign, a.v), _mm256_and_ps(sign, b.v))};
  }
  // a in the lanes of t, 0 in the others.
  friend VecF keep(VecF a, TailF t) { return {_mm256_and_ps(a.v, _mm256_castsi256_ps(t.lanes))}; }
  // Lanes where a < b take x, the others y.
  friend VecF select_less(VecF a, VecF b, VecF x, VecF y) {
    return {_mm256_blendv_ps(y.v, x.v, _mm256_cmp_ps(a.v, b.v, _CMP_LT_OQ))};
  }
  // Round to the nearest integer, ties to even (as std::nearbyint in the default mode).
  friend VecF round_nearest(VecF a) {
    return {_mm256_round_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
  }
  // a * 2^n for integral n in [-126, 127] (n as floats): builds 2^n's bits (n = -127: +0).
  friend VecF scale_by_pow2(VecF a, VecF n) {
    const __m256i bits =
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n.v), _mm256_set1_epi32(127)), 23);
    return {_mm256_mul_ps(a.v, _mm256_castsi256_ps(bits))};
  }
  // Sums in a fixed order: the two 128-bit halves, then pairs.
  friend float reduce_add(VecF a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  friend float reduce_max(VecF a) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(a.v), _mm256_extractf128_ps(a.v, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
};

inline VecF load_lanes(const float* p, TailF t) { return VecF::load(p, t); }
inline void store_lanes(float* p, VecF x, TailF t) { x.store(p, t); }

// dst[c * ldd + r] = src[r * lds + c] for r < rows, c < cols (both at most kWidth): one
// kWidth x kWidth block through registers, masked loads and stores at the edges.
inline void transpose_block(const float* src, int64_t lds, float* dst, int64_t ldd, int rows,
                            int cols) {
  __m256 r[8], t[8];
  const bool full = rows == 8 && cols == 8;
  const TailF col_tail = VecF::tail(cols), row_tail = VecF::tail(rows);
  for (int i = 0; i < 8; ++i) {
    r[i] = i < rows ? VecF::load(src + i * lds, col_tail).v : _mm256_setzero_ps();
  }
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  // r[4g + j] holds, in 128-bit half H, column 4H + j of rows 4g..4g+3.
  for (int j = 0; j < 4; ++j) {
    const VecF lo{_mm256_permute2f128_ps(r[j], r[4 + j], 0x20)};
    const VecF hi{_mm256_permute2f128_ps(r[j], r[4 + j], 0x31)};
    if (full) {
      lo.store(dst + j * ldd);
      hi.store(dst + (4 + j) * ldd);
    } else {
      if (j < cols) lo.store(dst + j * ldd, row_tail);
      if (4 + j < cols) hi.store(dst + (4 + j) * ldd, row_tail);
    }
  }
}
#endif

// Element loops written once for every width: for_lanes<T>(n, f) calls f(L{}, u, tail) for
// chunks of [0, n), L the chunk's lane type: VecF over kWidth floats where the copy has it
// (the last chunk masked by tail), else T one element at a time. The body reads and writes
// through load_lanes(p + u, tail) and store_lanes(p + u, x, tail), and builds constants as L(c).
struct OneLane {};
template <typename T>
inline T load_lanes(const T* p, OneLane) {
  return *p;
}
template <typename T>
inline void store_lanes(T* p, T x, OneLane) {
  *p = x;
}

template <typename T, typename F>
inline void for_lanes(int64_t n, F&& f) {
#if defined(FASTATTN_CPU_VEC)
  if constexpr (std::is_same_v<T, float>) {
    constexpr int W = VecF::kWidth;
    const TailF full = VecF::tail(W);
    int64_t u = 0;
    for (; u + W <= n; u += W) f(VecF{}, u, full);
    if (u < n) f(VecF{}, u, VecF::tail(n - u));
    return;
  }
#endif
  for (int64_t u = 0; u < n; ++u) f(T{}, u, OneLane{});
}

}  // namespace FASTATTN_TARGET_NAMESPACE
}  // namespace fastattn::cpu
