// bfloat16 matrix products with AVX512-BF16 (vdpbf16ps: 16 lanes, each adding the dot product
// of two bfloat16 pairs to a float accumulator), for the bfloat16 attention tiles.
//
// Operands are "pair matrices" of uint32, each word holding two bfloat16 values that are
// consecutive along the summation (k) dimension:
//   A2 is k-major:      A2[kk * a_k + m] = (A(m, 2kk), A(m, 2kk+1))
//   B2 is "VNNI":       B2[kk * ldb + n] = (B(2kk, n), B(2kk+1, n))
//   C[m * ldc + n] (+)= alpha * sum_kk A2 . B2 (float accumulation, in k order)
// A "split" A2 carries a float A as two bfloat16 parts, hi = bf16(A) and lo = bf16(A - hi)
// (split_pair_words below), the lo words at a fixed offset from the hi words: each product then
// takes two dot products against the same B2 words, and A's rounding error shrinks from 2^-9
// to 2^-18 of |A| (the product of a float state and bfloat16 weights, to float accuracy).
// Odd k is padded with a zero bfloat16. Helpers below build these layouts from row-major
// bfloat16 tiles or float tiles (rounded to nearest even, as the GPU kernels round P and dS).
#pragma once
#include "common/cpu_target.h"
#if defined(__AVX512BF16__)
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "common/cpu_gemm.h"

namespace fastattn::cpu {
inline namespace FASTATTN_TARGET_NAMESPACE {  // common/cpu_target.h

namespace detail {

// kAhead > 0: prefetch the B rows kAhead pair rows ahead (a panel streaming from L3: the
// hardware prefetcher stops at 4 KB pages). kSplit: A2 is split, its lo words at A2 + lo.
// With few rows there are too few accumulators to cover the dot product's latency (6 cycles
// at one per cycle): then the lo parts get their own, and consecutive pair rows alternate
// between kPhases sets.
template <int MR, int kAhead, bool kSplit>
__attribute__((always_inline)) inline void gemm_bf16_block(
    int64_t K2, float alpha, const uint32_t* A2, int64_t a_k, int64_t lo, const uint32_t* B2,
    int64_t ldb, float* C, int64_t ldc, bool accumulate, __mmask16 mask0, __mmask16 mask1) {
  constexpr int kParts = kSplit && MR <= 3 ? 2 : 1;
  constexpr int kChains = 2 * MR * kParts;
  constexpr int kPhases = kChains >= 6 ? 1 : (kChains >= 3 ? 2 : 3);
  __m512 c[kPhases][kParts][MR][2];
#pragma GCC unroll 16
  for (int ph = 0; ph < kPhases; ++ph) {
#pragma GCC unroll 16
    for (int q = 0; q < kParts; ++q) {
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) c[ph][q][r][0] = c[ph][q][r][1] = _mm512_setzero_ps();
    }
  }
  auto step = [&](int ph, int64_t kk) __attribute__((always_inline)) {
    const uint32_t* b = B2 + kk * ldb;
    if constexpr (kAhead > 0) {
      _mm_prefetch(reinterpret_cast<const char*>(b + kAhead * ldb), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(b + kAhead * ldb + 16), _MM_HINT_T0);
    }
    const __m512bh b0 = (__m512bh)_mm512_maskz_loadu_epi32(mask0, b);
    const __m512bh b1 = (__m512bh)_mm512_maskz_loadu_epi32(mask1, b + 16);
    const uint32_t* a = A2 + kk * a_k;
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const __m512bh ar = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[r]));
      c[ph][0][r][0] = _mm512_dpbf16_ps(c[ph][0][r][0], ar, b0);
      c[ph][0][r][1] = _mm512_dpbf16_ps(c[ph][0][r][1], ar, b1);
    }
    if constexpr (kSplit) {
#pragma GCC unroll 16
      for (int r = 0; r < MR; ++r) {
        const __m512bh ar = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[lo + r]));
        c[ph][kParts - 1][r][0] = _mm512_dpbf16_ps(c[ph][kParts - 1][r][0], ar, b0);
        c[ph][kParts - 1][r][1] = _mm512_dpbf16_ps(c[ph][kParts - 1][r][1], ar, b1);
      }
    }
  };
  int64_t kk = 0;
  for (; kk + kPhases <= K2; kk += kPhases) {
#pragma GCC unroll 4
    for (int ph = 0; ph < kPhases; ++ph) step(ph, kk + ph);
  }
  for (; kk < K2; ++kk) step(0, kk);
  const __m512 va = _mm512_set1_ps(alpha);
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
    __m512 s0 = c[0][0][r][0], s1 = c[0][0][r][1];
#pragma GCC unroll 16
    for (int ph = 0; ph < kPhases; ++ph) {
#pragma GCC unroll 16
      for (int q = ph == 0 ? 1 : 0; q < kParts; ++q) {
        s0 = _mm512_add_ps(s0, c[ph][q][r][0]);
        s1 = _mm512_add_ps(s1, c[ph][q][r][1]);
      }
    }
    float* cr = C + r * ldc;
    __m512 r0 = _mm512_mul_ps(s0, va), r1 = _mm512_mul_ps(s1, va);
    if (accumulate) {
      r0 = _mm512_add_ps(r0, _mm512_maskz_loadu_ps(mask0, cr));
      r1 = _mm512_add_ps(r1, _mm512_maskz_loadu_ps(mask1, cr + 16));
    }
    _mm512_mask_storeu_ps(cr, mask0, r0);
    _mm512_mask_storeu_ps(cr + 16, mask1, r1);
  }
}

template <int MR, int kAhead, bool kSplit>
inline void gemm_bf16_rows(int64_t N, int64_t K2, float alpha, const uint32_t* A2, int64_t a_k,
                           int64_t lo, const uint32_t* B2, int64_t ldb, float* C, int64_t ldc,
                           bool accumulate) {
  for (int64_t n0 = 0; n0 < N; n0 += 32) {
    gemm_bf16_block<MR, kAhead, kSplit>(K2, alpha, A2, a_k, lo, B2 + n0, ldb, C + n0, ldc,
                                        accumulate, tail_mask(N - n0), tail_mask(N - n0 - 16));
  }
}

}  // namespace detail

// kAhead, kSplit and lo: gemm_bf16_block's.
template <int kAhead = 0, bool kSplit = false>
inline void gemm_bf16(int64_t M, int64_t N, int64_t K2, float alpha, const uint32_t* A2,
                      int64_t a_k, const uint32_t* B2, int64_t ldb, float* C, int64_t ldc,
                      bool accumulate, int64_t lo = 0) {
  constexpr int MR = 8;
  int64_t m0 = 0;
  for (; m0 + MR <= M; m0 += MR) {
    detail::gemm_bf16_rows<MR, kAhead, kSplit>(N, K2, alpha, A2 + m0, a_k, lo, B2, ldb,
                                               C + m0 * ldc, ldc, accumulate);
  }
  const uint32_t* Ar = A2 + m0;
  float* Cr = C + m0 * ldc;
  switch (M - m0) {
    case 7:
      detail::gemm_bf16_rows<7, kAhead, kSplit>(N, K2, alpha, Ar, a_k, lo, B2, ldb, Cr, ldc,
                                                accumulate);
      break;
    case 6:
      detail::gemm_bf16_rows<6, kAhead, kSplit>(N, K2, alpha, Ar, a_k, lo, B2, ldb, Cr, ldc,
                                                accumulate);
      break;
    case 5:
      detail::gemm_bf16_rows<5, kAhead, kSplit>(N, K2, alpha, Ar, a_k, lo, B2, ldb, Cr, ldc,
                                                accumulate);
      break;
    case 4:
      detail::gemm_bf16_rows<4, kAhead, kSplit>(N, K2, alpha, Ar, a_k, lo, B2, ldb, Cr, ldc,
                                                accumulate);
      break;
    case 3:
      detail::gemm_bf16_rows<3, kAhead, kSplit>(N, K2, alpha, Ar, a_k, lo, B2, ldb, Cr, ldc,
                                                accumulate);
      break;
    case 2:
      detail::gemm_bf16_rows<2, kAhead, kSplit>(N, K2, alpha, Ar, a_k, lo, B2, ldb, Cr, ldc,
                                                accumulate);
      break;
    case 1:
      detail::gemm_bf16_rows<1, kAhead, kSplit>(N, K2, alpha, Ar, a_k, lo, B2, ldb, Cr, ldc,
                                                accumulate);
      break;
    default:
      break;
  }
}

// Row-major bfloat16 rows (rows x cols, row stride ld in elements) as pair words along the
// columns: out[r * ld_out + kk] = (X[r][2kk], X[r][2kk+1]), odd cols padded with 0.
inline void pair_columns(const uint16_t* X, int64_t ld, int64_t rows, int64_t cols, uint32_t* out,
                         int64_t ld_out) {
  const int64_t cols2 = (cols + 1) / 2;
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* x = X + r * ld;
    uint32_t* o = out + r * ld_out;
    if ((cols & 1) == 0 && (reinterpret_cast<uintptr_t>(x) & 3) == 0) {
      std::memcpy(o, x, cols2 * 4);
    } else {
      for (int64_t kk = 0; kk < cols2; ++kk) {
        const uint32_t lo = x[2 * kk];
        const uint32_t hi = 2 * kk + 1 < cols ? x[2 * kk + 1] : 0;
        o[kk] = lo | (hi << 16);
      }
    }
  }
}

// Pairs of consecutive rows (the k dimension) interleaved: out[kk * ld_out + c] =
// (X[2kk][c], X[2kk+1][c]) for kk < ceil(rows / 2); a missing last row is zero.
inline void pair_rows(const uint16_t* X, int64_t ld, int64_t rows, int64_t cols, uint32_t* out,
                      int64_t ld_out) {
  const int64_t rows2 = (rows + 1) / 2;
  for (int64_t kk = 0; kk < rows2; ++kk) {
    const uint16_t* x0 = X + 2 * kk * ld;
    const bool has1 = 2 * kk + 1 < rows;
    const uint16_t* x1 = has1 ? x0 + ld : nullptr;
    uint32_t* o = out + kk * ld_out;
    int64_t c = 0;
    for (; c + 16 <= cols; c += 16) {
      const __m512i lo =
          _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x0 + c)));
      const __m512i hi =
          has1 ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x1 + c)))
               : _mm512_setzero_si512();
      _mm512_storeu_si512(o + c, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
    for (; c < cols; ++c)
      o[c] = static_cast<uint32_t>(x0[c]) | (has1 ? static_cast<uint32_t>(x1[c]) << 16 : 0u);
  }
}

// float -> bfloat16 (round to nearest even) of a rows x cols tile, row-major both sides.
inline void round_to_bf16(const float* X, int64_t ld, int64_t rows, int64_t cols, uint16_t* out,
                          int64_t ld_out) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = X + r * ld;
    uint16_t* o = out + r * ld_out;
    int64_t c = 0;
    for (; c + 16 <= cols; c += 16) {
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_loadu_ps(x + c));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + c), (__m256i)h);
    }
    if (c < cols) {
      const __mmask16 m = detail::tail_mask(cols - c);
      const __m256bh h = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(m, x + c));
      _mm256_mask_storeu_epi16(o + c, m, (__m256i)h);
    }
  }
}

// uint32 transpose (the float transpose moves bits unchanged).
inline void transpose_words(const uint32_t* src, int64_t lds, uint32_t* dst, int64_t ldd,
                            int64_t rows, int64_t cols) {
  transpose(reinterpret_cast<const float*>(src), lds, reinterpret_cast<float*>(dst), ldd, rows,
            cols);
}

// Row-major bfloat16 rows as pairs along the columns, k-major (the A2 / B2 layout of a matrix
// whose rows are its m / n): out[kk * ld_out + r] = (X[r][2kk], X[r][2kk+1]), odd cols padded
// with 0. tmp holds rows x ceil(cols / 2) words.
inline void pair_columns_transposed(const uint16_t* X, int64_t ld, int64_t rows, int64_t cols,
                                    uint32_t* tmp, uint32_t* out, int64_t ld_out) {
  const int64_t cols2 = (cols + 1) / 2;
  pair_columns(X, ld, rows, cols, tmp, cols2);
  transpose_words(tmp, cols2, out, ld_out, rows, cols2);
}

// n <= 32 floats split into bfloat16 hi = bf16(x) and lo = bf16(x - hi) (lo = 0 where x == hi:
// infinities stay infinite), each as 32 bfloat16 in order (zero past n).
inline void split_bf16(const float* x, int64_t n, __m512i& hi, __m512i& lo) {
  const __m512 x0 = _mm512_maskz_loadu_ps(detail::tail_mask(n), x);
  const __m512 x1 = _mm512_maskz_loadu_ps(detail::tail_mask(n - 16), x + 16);
  const __m256bh h0 = _mm512_cvtneps_pbh(x0), h1 = _mm512_cvtneps_pbh(x1);
  const __m512 f0 = _mm512_cvtpbh_ps(h0), f1 = _mm512_cvtpbh_ps(h1);
  const __m512 r0 = _mm512_maskz_sub_ps(_mm512_cmp_ps_mask(x0, f0, _CMP_NEQ_UQ), x0, f0);
  const __m512 r1 = _mm512_maskz_sub_ps(_mm512_cmp_ps_mask(x1, f1, _CMP_NEQ_UQ), x1, f1);
  hi = _mm512_inserti64x4(_mm512_castsi256_si512((__m256i)h0), (__m256i)h1, 1);
  lo = (__m512i)_mm512_cvtne2ps_pbh(r1, r0);
}

// split_bf16 as pair words hi_words[w], lo_words[w], w < (n + 1) / 2.
inline void split_pair_words(const float* x, int64_t n, uint32_t* hi_words, uint32_t* lo_words) {
  __m512i hi, lo;
  split_bf16(x, n, hi, lo);
  const __mmask16 words = detail::tail_mask((n + 1) / 2);
  _mm512_mask_storeu_epi32(hi_words, words, hi);
  _mm512_mask_storeu_epi32(lo_words, words, lo);
}

// sum_k a[k] * b[k] of two bfloat16 vectors (bits as uint16), in float: 32 products per dot
// product instruction, two accumulators, one reduction.
inline float dot_bf16(const uint16_t* a, const uint16_t* b, int64_t K) {
  __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
  auto load = [](const uint16_t* p, __mmask32 m) {
    return (__m512bh)_mm512_maskz_loadu_epi16(m, p);
  };
  int64_t k = 0;
  for (; k + 64 <= K; k += 64) {
    s0 = _mm512_dpbf16_ps(s0, load(a + k, ~0u), load(b + k, ~0u));
    s1 = _mm512_dpbf16_ps(s1, load(a + k + 32, ~0u), load(b + k + 32, ~0u));
  }
  for (; k < K; k += 32) {
    const __mmask32 m = K - k >= 32 ? ~0u : (1u << (K - k)) - 1u;
    s0 = _mm512_dpbf16_ps(s0, load(a + k, m), load(b + k, m));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(s0, s1));
}

// Columns per panel of a packed B2 operand (gemm_bf16's two vectors).
constexpr int64_t kPairPanel = 32;

// Panels [first, last) of B2 = W^T for a row-major bfloat16 W (leading dimension ldw, K
// columns; column n of B reads row row_of(n) of W, for n < N), each K2 x kPairPanel words at
// out + panel * kPairPanel * K2; columns past N are zero. K2 defaults to ceil(K / 2); a larger
// one (AMX tiles take 16 pair rows at a time) pads the panels with zero pair rows.
template <typename RowOf>
inline void pack_pair_panels(const uint16_t* W, int64_t ldw, int64_t K, int64_t N,
                             const RowOf& row_of, int64_t first, int64_t last, uint32_t* out,
                             int64_t K2 = 0) {
  if (K2 == 0) K2 = (K + 1) / 2;
  std::vector<uint32_t> rows(kPairPanel * K2, 0u);  // a column's pad words stay zero
  for (int64_t pn = first; pn < last; ++pn) {
    for (int64_t c = 0; c < kPairPanel; ++c) {
      const int64_t n = pn * kPairPanel + c;
      uint32_t* words = rows.data() + c * K2;
      if (n < N) {
        pair_columns(W + row_of(n) * ldw, ldw, 1, K, words, K2);
      } else {
        std::fill(words, words + K2, 0u);
      }
    }
    transpose_words(rows.data(), K2, out + pn * kPairPanel * K2, kPairPanel, kPairPanel, K2);
  }
}

}  // namespace FASTATTN_TARGET_NAMESPACE
}  // namespace fastattn::cpu
#endif  // __AVX512BF16__
