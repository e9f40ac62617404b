// Row conversions between storage dtypes and the compute dtype (float, or double for double),
// written as plain loops on bits so that every ISA copy vectorises them.
#pragma once
#include "common/cpu_target.h"
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>
#include <cstdint>
#include <cstring>
#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace fastattn::cpu {
inline namespace FASTATTN_TARGET_NAMESPACE {  // common/cpu_target.h

// Compute type: double for double storage, float otherwise.
template <typename T>
struct Acc {
  using type = float;
};
template <>
struct Acc<double> {
  using type = double;
};
template <typename T>
using acc_t = typename Acc<T>::type;

template <typename T>
inline void load_row(const T* src, acc_t<T>* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<acc_t<T>>(src[i]);
}

template <>
inline void load_row<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t w = static_cast<uint32_t>(bits[i]) << 16;
    std::memcpy(dst + i, &w, 4);
  }
}

template <>
inline void load_row<c10::Half>(const c10::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <typename T>
inline void store_row(const acc_t<T>* src, T* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<T>(src[i]);
}

template <>
inline void store_row<c10::BFloat16>(const float* src, c10::BFloat16* dst, int64_t n) {
  uint16_t* bits = reinterpret_cast<uint16_t*>(dst);
  for (int64_t i = 0; i < n; ++i) {
    uint32_t w;
    std::memcpy(&w, src + i, 4);
    // Round to nearest even; NaN keeps a quiet NaN payload.
    const bool is_nan = (w & 0x7FFFFFFFu) > 0x7F800000u;
    const uint32_t rounded = (w + 0x7FFFu + ((w >> 16) & 1u)) >> 16;
    bits[i] = is_nan ? static_cast<uint16_t>(0x7FC0u) : static_cast<uint16_t>(rounded);
  }
}

template <>
inline void store_row<c10::Half>(const float* src, c10::Half* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<c10::Half>(src[i]);
}

}  // namespace FASTATTN_TARGET_NAMESPACE
}  // namespace fastattn::cpu
