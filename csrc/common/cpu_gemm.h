// Small dense matrix products for the CPU attention tiles (compiled into each ISA copy).
//
//   C[m, n] (+)= alpha * sum_k A(m, k) * B[k, n]      for m < M, n < N, k < K
//
// A is read through two strides (a_m, a_k), so A, A^T and row-major or column-major tiles all
// work without copies; B is row-major with leading dimension ldb (the operand the vector
// lanes run along); C is row-major with leading dimension ldc. With AVX-512 the float product
// is a register-blocked micro-kernel (8 rows x 32 columns of accumulators, A broadcast from
// memory, B loaded as two vectors per k); everything else is plain loops the compiler
// vectorises. Every call is deterministic: the k-sum runs in order.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace fastattn::cpu {

template <typename acc>
inline void gemm_generic(int64_t M, int64_t N, int64_t K, acc alpha, const acc* A, int64_t a_m,
                         int64_t a_k, const acc* B, int64_t ldb, acc* C, int64_t ldc,
                         bool accumulate) {
  for (int64_t m = 0; m < M; ++m) {
    acc* c = C + m * ldc;
    if (!accumulate) std::fill(c, c + N, acc(0));
    for (int64_t k = 0; k < K; ++k) {
      const acc a = alpha * A[m * a_m + k * a_k];
      const acc* b = B + k * ldb;
      for (int64_t n = 0; n < N; ++n) c[n] += a * b[n];
    }
  }
}

#if defined(__AVX512F__)
namespace detail {

// One MR x 32 block of C (columns masked by mask0/mask1 at the right edge).
template <int MR>
inline void gemm_block_avx512(int64_t K, float alpha, const float* A, int64_t a_m, int64_t a_k,
                              const float* B, int64_t ldb, float* C, int64_t ldc,
                              bool accumulate, __mmask16 mask0, __mmask16 mask1) {
  __m512 c0[MR], c1[MR];
  for (int r = 0; r < MR; ++r) {
    c0[r] = _mm512_setzero_ps();
    c1[r] = _mm512_setzero_ps();
  }
  for (int64_t k = 0; k < K; ++k) {
    const float* b = B + k * ldb;
    const __m512 b0 = _mm512_maskz_loadu_ps(mask0, b);
    const __m512 b1 = _mm512_maskz_loadu_ps(mask1, b + 16);
    const float* a = A + k * a_k;
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const __m512 ar = _mm512_set1_ps(a[r * a_m]);
      c0[r] = _mm512_fmadd_ps(ar, b0, c0[r]);
      c1[r] = _mm512_fmadd_ps(ar, b1, c1[r]);
    }
  }
  const __m512 va = _mm512_set1_ps(alpha);
  for (int r = 0; r < MR; ++r) {
    float* c = C + r * ldc;
    __m512 r0 = _mm512_mul_ps(c0[r], va), r1 = _mm512_mul_ps(c1[r], va);
    if (accumulate) {
      r0 = _mm512_add_ps(r0, _mm512_maskz_loadu_ps(mask0, c));
      r1 = _mm512_add_ps(r1, _mm512_maskz_loadu_ps(mask1, c + 16));
    }
    _mm512_mask_storeu_ps(c, mask0, r0);
    _mm512_mask_storeu_ps(c + 16, mask1, r1);
  }
}

inline __mmask16 tail_mask(int64_t remaining) {
  return remaining >= 16 ? static_cast<__mmask16>(0xFFFF)
                         : static_cast<__mmask16>((1u << std::max<int64_t>(remaining, 0)) - 1u);
}

template <int MR>
inline void gemm_rows_avx512(int64_t N, int64_t K, float alpha, const float* A, int64_t a_m,
                             int64_t a_k, const float* B, int64_t ldb, float* C, int64_t ldc,
                             bool accumulate, float* panel) {
  // Broadcasting A from rows far apart is slow (8 address streams); with A already k-major
  // (a_m == 1) it runs at the FMA rate. Pack the MR rows k-major once, reuse for every n.
  if (a_m != 1) {
    for (int64_t k = 0; k < K; ++k) {
      for (int r = 0; r < MR; ++r) panel[k * MR + r] = A[r * a_m + k * a_k];
    }
    A = panel;
    a_m = 1;
    a_k = MR;
  }
  for (int64_t n0 = 0; n0 < N; n0 += 32) {
    gemm_block_avx512<MR>(K, alpha, A, a_m, a_k, B + n0, ldb, C + n0, ldc, accumulate,
                          tail_mask(N - n0), tail_mask(N - n0 - 16));
  }
}

}  // namespace detail

inline void gemm(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t a_m,
                 int64_t a_k, const float* B, int64_t ldb, float* C, int64_t ldc,
                 bool accumulate) {
  constexpr int MR = 8;
  constexpr int64_t kPanelK = 512;
  if (K > kPanelK) {  // keep the packed panel on the stack: split long sums
    for (int64_t k0 = 0; k0 < K; k0 += kPanelK) {
      gemm(M, N, std::min(kPanelK, K - k0), alpha, A + k0 * a_k, a_m, a_k, B + k0 * ldb, ldb,
           C, ldc, accumulate || k0 > 0);
    }
    return;
  }
  alignas(64) float panel[kPanelK * MR];
  int64_t m0 = 0;
  for (; m0 + MR <= M; m0 += MR) {
    detail::gemm_rows_avx512<MR>(N, K, alpha, A + m0 * a_m, a_m, a_k, B, ldb, C + m0 * ldc, ldc,
                                 accumulate, panel);
  }
  const float* Ar = A + m0 * a_m;
  float* Cr = C + m0 * ldc;
  switch (M - m0) {  // remaining rows
    case 7: detail::gemm_rows_avx512<7>(N, K, alpha, Ar, a_m, a_k, B, ldb, Cr, ldc, accumulate, panel); break;
    case 6: detail::gemm_rows_avx512<6>(N, K, alpha, Ar, a_m, a_k, B, ldb, Cr, ldc, accumulate, panel); break;
    case 5: detail::gemm_rows_avx512<5>(N, K, alpha, Ar, a_m, a_k, B, ldb, Cr, ldc, accumulate, panel); break;
    case 4: detail::gemm_rows_avx512<4>(N, K, alpha, Ar, a_m, a_k, B, ldb, Cr, ldc, accumulate, panel); break;
    case 3: detail::gemm_rows_avx512<3>(N, K, alpha, Ar, a_m, a_k, B, ldb, Cr, ldc, accumulate, panel); break;
    case 2: detail::gemm_rows_avx512<2>(N, K, alpha, Ar, a_m, a_k, B, ldb, Cr, ldc, accumulate, panel); break;
    case 1: detail::gemm_rows_avx512<1>(N, K, alpha, Ar, a_m, a_k, B, ldb, Cr, ldc, accumulate, panel); break;
    default: break;
  }
}
#else
inline void gemm(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t a_m,
                 int64_t a_k, const float* B, int64_t ldb, float* C, int64_t ldc,
                 bool accumulate) {
  gemm_generic<float>(M, N, K, alpha, A, a_m, a_k, B, ldb, C, ldc, accumulate);
}
#endif

inline void gemm(int64_t M, int64_t N, int64_t K, double alpha, const double* A, int64_t a_m,
                 int64_t a_k, const double* B, int64_t ldb, double* C, int64_t ldc,
                 bool accumulate) {
  gemm_generic<double>(M, N, K, alpha, A, a_m, a_k, B, ldb, C, ldc, accumulate);
}

}  // namespace fastattn::cpu
