// A float vector of the including file's ISA (common/cpu_target.h), for kernels written once
// for every vector width: VecF::kWidth lanes, loads and stores with a masked tail, FMA,
// min/max, reductions, rounding and bit-level scaling (the exponentials of cpu_math.h), and a
// kWidth x kWidth register transpose. VecF::kRegisters is the register file the micro-kernels
// size their blocks by.
//
// FASTATTN_CPU_VEC is defined where VecF exists: AVX2 (8 lanes, 16 ymm registers) and AVX-512
// (16 lanes, 32 zmm registers). Every float kernel of both copies is written on it; only the
// bfloat16 and AMX tiles, AVX-512 by nature, use intrinsics directly
// (docs/design/cpu_kernels.md).
#pragma once
#include "common/cpu_target.h"
#include <cstdint>
#include <type_traits>
#if defined(__AVX512F__)
#include <immintrin.h>
#define FASTATTN_CPU_VEC 1
#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FASTATTN_CPU_VEC 1
#endif

namespace fastattn::cpu {
inline namespace FASTATTN_TARGET_NAMESPACE {  // common/cpu_target.h

#if defined(__AVX512F__)
// Lanes [0, n) of a vector (a right edge): n >= kWidth is every lane, n <= 0 none.
struct TailF {
  __mmask16 lanes;
  bool full;
};

struct VecF {
  static constexpr int kWidth = 16;
  static constexpr int kRegisters = 32;
  __m512 v;

  VecF() = default;
  VecF(__m512 x) : v(x) {}                 // NOLINT: implicit, as the intrinsics' results
  VecF(float x) : v(_mm512_set1_ps(x)) {}  // NOLINT: a scalar broadcast to every lane

  static VecF zero() { return {_mm512_setzero_ps()}; }
  static VecF set1(float x) { return {_mm512_set1_ps(x)}; }
  static VecF load(const float* p) { return {_mm512_loadu_ps(p)}; }
  // Masked lanes read nothing (no fault past an allocation's end) and are 0. A full tail takes
  // plain loads and stores: on Zen 5 masked ones cost more even with every lane set.
  static VecF load(const float* p, TailF t) {
    return t.full ? load(p) : VecF{_mm512_maskz_loadu_ps(t.lanes, p)};
  }
  // As load(p, t), with `fill` in the masked lanes.
  static VecF load(const float* p, TailF t, float fill) {
    if (t.full) return load(p);
    return {_mm512_mask_loadu_ps(_mm512_set1_ps(fill), t.lanes, p)};
  }
  static TailF tail(int64_t n) {
    const int lanes = n >= kWidth ? kWidth : (n <= 0 ? 0 : static_cast<int>(n));
    return {static_cast<__mmask16>((1u << lanes) - 1u), lanes == kWidth};
  }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
  void store(float* p, TailF t) const {
    if (t.full) {
      store(p);
    } else {
      _mm512_mask_storeu_ps(p, t.lanes, v);
    }
  }

  friend VecF operator-(VecF a) {
    return {_mm512_castsi512_ps(
        _mm512_xor_si512(_mm512_castps_si512(a.v), _mm512_set1_epi32(INT32_MIN)))};
  }
  friend VecF operator+(VecF a, VecF b) { return {_mm512_add_ps(a.v, b.v)}; }
  friend VecF operator-(VecF a, VecF b) { return {_mm512_sub_ps(a.v, b.v)}; }
  friend VecF operator*(VecF a, VecF b) { return {_mm512_mul_ps(a.v, b.v)}; }
  friend VecF operator/(VecF a, VecF b) { return {_mm512_div_ps(a.v, b.v)}; }
  // a * b + c, one rounding.
  friend VecF fma(VecF a, VecF b, VecF c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  friend VecF max(VecF a, VecF b) { return {_mm512_max_ps(a.v, b.v)}; }
  friend VecF min(VecF a, VecF b) { return {_mm512_min_ps(a.v, b.v)}; }
  friend VecF abs(VecF a) { return {_mm512_abs_ps(a.v)}; }
  // |a| with the sign of b.
  friend VecF copysign(VecF a, VecF b) {
    const __m512i sign = _mm512_set1_epi32(INT32_MIN);
    return {_mm512_castsi512_ps(_mm512_or_si512(_mm512_andnot_si512(sign, _mm512_castps_si512(a.v)),
                                                _mm512_and_si512(sign, _mm512_castps_si512(b.v))))};
  }
  // a in the lanes of t, 0 in the others.
  friend VecF keep(VecF a, TailF t) { return {_mm512_maskz_mov_ps(t.lanes, a.v)}; }
  // Lanes where a < b take x, the others y.
  friend VecF select_less(VecF a, VecF b, VecF x, VecF y) {
    return {_mm512_mask_mov_ps(y.v, _mm512_cmp_ps_mask(a.v, b.v, _CMP_LT_OQ), x.v)};
  }
  // Round to the nearest integer, ties to even (as std::nearbyint in the default mode).
  friend VecF round_nearest(VecF a) {
    return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)};
  }
  // a * 2^n for integral n in [-126, 127] (n as floats): builds 2^n's bits (n = -127: +0).
  friend VecF scale_by_pow2(VecF a, VecF n) {
    const __m512i bits =
        _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n.v), _mm512_set1_epi32(127)), 23);
    return {_mm512_mul_ps(a.v, _mm512_castsi512_ps(bits))};
  }
  // Sums in a fixed order: the two 256-bit halves, then as the 8-lane vector does.
  friend float reduce_add(VecF a) {
    const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(a.v), upper_half(a.v));
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
  friend float reduce_max(VecF a) {
    const __m256 h = _mm256_max_ps(_mm512_castps512_ps256(a.v), upper_half(a.v));
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }

 private:
  static __m256 upper_half(__m512 x) {  // AVX-512F only (extractf32x8 needs DQ)
    return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1));
  }
};

inline VecF load_lanes(const float* p, TailF t) { return VecF::load(p, t); }
inline void store_lanes(float* p, VecF x, TailF t) { x.store(p, t); }

// dst[c * ldd + r] = src[r * lds + c] for r < rows, c < cols (both at most kWidth): one
// kWidth x kWidth block through registers (unpack 32-bit, unpack 64-bit, then two 128-bit
// lane shuffles). A partial block (the tails of a tile, or a decoder's few keys) goes through
// the same shuffles with masked loads and stores: element by element, a 12 x 128 tile cost
// more than its products.
inline void transpose_block(const float* src, int64_t lds, float* dst, int64_t ldd, int rows,
                            int cols) {
  __m512 r[16], t[16];
  const bool full = rows == 16 && cols == 16;
  const TailF col_tail = VecF::tail(cols), row_tail = VecF::tail(rows);
  for (int i = 0; i < 16; ++i) {
    r[i] = i < rows ? VecF::load(src + i * lds, col_tail).v : _mm512_setzero_ps();
  }
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  const auto pd = [](__m512 x) { return _mm512_castps_pd(x); };
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[i]), pd(t[i + 2])));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[i]), pd(t[i + 2])));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(t[i + 1]), pd(t[i + 3])));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(t[i + 1]), pd(t[i + 3])));
  }
  // r[4g + j] holds, in 128-bit lane L, column 4L + j of rows 4g..4g+3. Output row
  // c = 4L + j needs lane g = lane L of r[4g + j]: a 4 x 4 transpose of 128-bit lanes.
  const auto store = [&](int c, __m512 value) {
    if (full) {
      _mm512_storeu_ps(dst + c * ldd, value);
    } else if (c < cols) {
      VecF{value}.store(dst + c * ldd, row_tail);
    }
  };
  for (int j = 0; j < 4; ++j) {
    const __m512 x0 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0x44);
    const __m512 x1 = _mm512_shuffle_f32x4(r[j], r[4 + j], 0xEE);
    const __m512 x2 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0x44);
    const __m512 x3 = _mm512_shuffle_f32x4(r[8 + j], r[12 + j], 0xEE);
    store(0 + j, _mm512_shuffle_f32x4(x0, x2, 0x88));
    store(4 + j, _mm512_shuffle_f32x4(x0, x2, 0xDD));
    store(8 + j, _mm512_shuffle_f32x4(x1, x3, 0x88));
    store(12 + j, _mm512_shuffle_f32x4(x1, x3, 0xDD));
  }
}
#elif defined(FASTATTN_CPU_VEC)
// Lanes [0, n) of a vector (a right edge): n >= kWidth is every lane, n <= 0 none.
struct TailF {
  __m256i lanes;
  bool full;
};

struct VecF {
  static constexpr int kWidth = 8;
  static constexpr int kRegisters = 16;
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
