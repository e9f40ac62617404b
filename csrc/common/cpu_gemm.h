// Small dense matrix products for the CPU attention tiles (compiled into each ISA copy).
//
//   C[m, n] (+)= alpha * sum_k A(m, k) * B[k, n]      for m < M, n < N, k < K
//
// A is read through two strides (a_m, a_k), so A, A^T and row-major or column-major tiles all
// work without copies; B is row-major with leading dimension ldb (the operand the vector
// lanes run along); C is row-major with leading dimension ldc. The float product is a
// register-blocked micro-kernel on the width-generic vector of common/cpu_vec.h (A broadcast
// from memory, B loaded as two vectors per k; AVX-512: 8 rows x 32 columns of accumulators,
// AVX2: 6 rows x 16 columns, 12 of the 16 ymm registers); everything else is plain loops the
// compiler vectorises. Every call is deterministic: the k-sum runs in order.
#pragma once
#include "common/cpu_target.h"
#include "common/cpu_vec.h"
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace fastattn::cpu {
inline namespace FASTATTN_TARGET_NAMESPACE {  // common/cpu_target.h

// dst[c * ldd + r] = src[r * lds + c] for r < rows, c < cols.
template <typename acc>
inline void transpose_generic(const acc* src, int64_t lds, acc* dst, int64_t ldd, int64_t rows,
                              int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) dst[c * ldd + r] = src[r * lds + c];
  }
}

#if defined(FASTATTN_CPU_VEC)
// transpose() in kWidth x kWidth register blocks; after_block(rows_here) runs after each block
// (the attention tiles prefetch the next tile's lines there).
template <typename AfterBlock>
inline void transpose_blocks(const float* src, int64_t lds, float* dst, int64_t ldd, int64_t rows,
                             int64_t cols, const AfterBlock& after_block) {
  constexpr int W = VecF::kWidth;
  for (int64_t r = 0; r < rows; r += W) {
    const int rows_here = static_cast<int>(std::min<int64_t>(W, rows - r));
    for (int64_t c = 0; c < cols; c += W) {
      const int cols_here = static_cast<int>(std::min<int64_t>(W, cols - c));
      transpose_block(src + r * lds + c, lds, dst + c * ldd + r, ldd, rows_here, cols_here);
      after_block(rows_here);
    }
  }
}

inline void transpose(const float* src, int64_t lds, float* dst, int64_t ldd, int64_t rows,
                      int64_t cols) {
  transpose_blocks(src, lds, dst, ldd, rows, cols, [](int) {});
}
#else
inline void transpose(const float* src, int64_t lds, float* dst, int64_t ldd, int64_t rows,
                      int64_t cols) {
  transpose_generic<float>(src, lds, dst, ldd, rows, cols);
}
#endif

inline void transpose(const double* src, int64_t lds, double* dst, int64_t ldd, int64_t rows,
                      int64_t cols) {
  transpose_generic<double>(src, lds, dst, ldd, rows, cols);
}

// A (M x K, A(m, k) = A[m * a_m + k * a_k]) as a k-major matrix: A itself when a_m == 1, else
// a per-thread copy (register transposes when a_k == 1), with a_k set to its stride (M).
inline const float* k_major(const float* A, int64_t a_m, int64_t& a_k, int64_t M, int64_t K) {
  if (a_m == 1) return A;
  static thread_local std::vector<float> buffer;
  if (static_cast<int64_t>(buffer.size()) < M * K) buffer.resize(M * K);
  if (a_k == 1) {
    transpose(A, a_m, buffer.data(), M, M, K);
  } else {
    for (int64_t k = 0; k < K; ++k) {
      for (int64_t m = 0; m < M; ++m) buffer[k * M + m] = A[m * a_m + k * a_k];
    }
  }
  a_k = M;
  return buffer.data();
}

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
// For the kernels that are AVX-512 by nature (the bfloat16 dot-product tiles): a 16-lane store
// or add and a tail mask.
namespace detail {

// dst[0, 16) = x, or += x with accumulate, through the lanes of mask: plain loads and stores
// when it has all 16 (every full tile), masked ones only at a right edge. On Zen 5 masked
// loads and stores cost more than plain ones even with all-ones masks (the recurrent step's
// 8 x 32 tile lost a seventh of its rate to a masked epilogue).
__attribute__((always_inline)) inline void store_or_add(float* dst, __m512 x, bool accumulate,
                                                        __mmask16 mask) {
  if (mask == static_cast<__mmask16>(0xFFFF)) {
    if (accumulate) x = _mm512_add_ps(x, _mm512_loadu_ps(dst));
    _mm512_storeu_ps(dst, x);
  } else {
    if (accumulate) x = _mm512_add_ps(x, _mm512_maskz_loadu_ps(mask, dst));
    _mm512_mask_storeu_ps(dst, mask, x);
  }
}

// Lanes [0, remaining) of 16.
inline __mmask16 tail_mask(int64_t remaining) {
  return remaining >= 16 ? static_cast<__mmask16>(0xFFFF)
                         : static_cast<__mmask16>((1u << std::max<int64_t>(remaining, 0)) - 1u);
}

}  // namespace detail
#endif

#if defined(FASTATTN_CPU_VEC)
// Rows of C per micro-kernel block: AVX2, 6 x 2 accumulators, 2 B vectors and a broadcast fill
// 15 of the 16 ymm registers; AVX-512, 8 x 2 of 32 zmm registers.
constexpr int kGemmRowsVec = VecF::kRegisters >= 32 ? 8 : 6;

namespace detail {

// dst = x, or += x with accumulate, through the first `n` lanes (kFull: all of them, plain
// loads and stores).
template <bool kFull>
__attribute__((always_inline)) inline void store_or_add(float* dst, VecF x, bool accumulate,
                                                        int64_t n) {
  if constexpr (kFull) {
    if (accumulate) x = x + VecF::load(dst);
    x.store(dst);
  } else {
    const TailF tail = VecF::tail(n);
    if (accumulate) x = x + VecF::load(dst, tail);
    x.store(dst, tail);
  }
}

// One MR x (NV kWidth) block of C; A k-major (A(m, k) = A[m + k * a_step]), or with kARows
// row-major (A(m, k) = A[m * a_step + k]: broadcast from its MR rows in place); columns past
// `n` masked (kFull: n >= NV kWidth, plain loads). The loops over MR and NV are unrolled so the
// accumulators stay in registers. Not inlined, and the tail masks built where they are used:
// inlined into the column loop, GCC kept alpha's broadcast (and the masks) live across the k
// loop, and 12 accumulators + 2 B vectors + a broadcast + those spilled a B vector to the
// stack (docs/design/cpu_kernels.md). kAhead > 0 prefetches B's lines kAhead rows ahead, for a
// B that streams from L3 past the hardware prefetcher's 4 KB page (the recurrent step's W_hh).
template <int MR, int NV, bool kFull, bool kARows, int64_t kAhead = 0>
__attribute__((noinline)) void gemm_block_vec(int64_t K, float alpha, const float* A,
                                              int64_t a_step, const float* B, int64_t ldb, float* C,
                                              int64_t ldc, bool accumulate, int64_t n) {
  constexpr int W = VecF::kWidth;
  constexpr int64_t kLines = (NV * W * sizeof(float) + 63) / 64;
  VecF c[MR][NV];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) c[r][v] = VecF::zero();
  }
  for (int64_t k = 0; k < K; ++k) {
    const float* b = B + k * ldb;
    if constexpr (kAhead > 0) {
#pragma GCC unroll 4
      for (int64_t line = 0; line < kLines; ++line) {
        __builtin_prefetch(b + kAhead * ldb + 16 * line, 0, 3);
      }
    }
    VecF bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
      bv[v] = kFull ? VecF::load(b + W * v) : VecF::load(b + W * v, VecF::tail(n - W * v));
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
      const VecF ar = VecF::set1(kARows ? A[r * a_step + k] : A[k * a_step + r]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) c[r][v] = fma(ar, bv[v], c[r][v]);
    }
  }
  const VecF va = VecF::set1(alpha);
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v)
      store_or_add<kFull>(C + r * ldc + W * v, c[r][v] * va, accumulate, n - W * v);
  }
}

// Columns NV vectors at a time: 2 for 3..6 rows; 4 for one or two rows (a matrix-vector
// product such as a recurrent step at batch 1), whose few accumulators would otherwise wait on
// the FMA latency.
template <int MR, bool kARows>
inline void gemm_rows_vec(int64_t N, int64_t K, float alpha, const float* A, int64_t a_step,
                          const float* B, int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  constexpr int W = VecF::kWidth;
  constexpr int NV = MR <= 2 ? 4 : 2;
  int64_t n0 = 0;
  for (; n0 + NV * W <= N; n0 += NV * W) {
    gemm_block_vec<MR, NV, true, kARows>(K, alpha, A, a_step, B + n0, ldb, C + n0, ldc, accumulate,
                                         NV * W);
  }
  if (N - n0 > W) {
    gemm_block_vec<MR, NV, false, kARows>(K, alpha, A, a_step, B + n0, ldb, C + n0, ldc, accumulate,
                                          N - n0);
  } else if (n0 < N) {
    gemm_block_vec<MR, 1, false, kARows>(K, alpha, A, a_step, B + n0, ldb, C + n0, ldc, accumulate,
                                         N - n0);
  }
}

// gemm_rows_vec for `rows` rows (1 to MR).
template <int MR, bool kARows>
inline void gemm_rows_of(int64_t rows, int64_t N, int64_t K, float alpha, const float* A,
                         int64_t a_step, const float* B, int64_t ldb, float* C, int64_t ldc,
                         bool accumulate) {
  if constexpr (MR > 1) {
    if (rows != MR) {
      return gemm_rows_of<MR - 1, kARows>(rows, N, K, alpha, A, a_step, B, ldb, C, ldc, accumulate);
    }
  }
  gemm_rows_vec<MR, kARows>(N, K, alpha, A, a_step, B, ldb, C, ldc, accumulate);
}

// Every row of C: blocks of kGemmRowsVec rows; with 6-row blocks, 7 or 8 left run as 4 + 3 or
// 4 + 4 (8 accumulators each keep both FMA pipes busy, a 2-row block would not).
template <bool kARows>
inline void gemm_vec(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t a_step,
                     const float* B, int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  const int64_t a_row_step = kARows ? a_step : 1;
  for (int64_t m0 = 0; m0 < M;) {
    const int64_t left = M - m0;
    const bool split = kGemmRowsVec == 6 && (left == 7 || left == 8);
    const int64_t rows = split ? 4 : std::min<int64_t>(left, kGemmRowsVec);
    gemm_rows_of<kGemmRowsVec, kARows>(rows, N, K, alpha, A + m0 * a_row_step, a_step, B, ldb,
                                       C + m0 * ldc, ldc, accumulate);
    m0 += rows;
  }
}

}  // namespace detail

inline void gemm(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t a_m,
                 int64_t a_k, const float* B, int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  // A k-major or row-major is read in place: the micro-kernel broadcasts from MR consecutive
  // elements or from MR rows, at the same rate, so a row-major A is not copied first (the copy
  // cost more than it saved: docs/design/cpu_kernels.md). Any other layout is copied k-major.
  if (a_m != 1 && a_k == 1) {
    detail::gemm_vec<true>(M, N, K, alpha, A, a_m, B, ldb, C, ldc, accumulate);
    return;
  }
  A = k_major(A, a_m, a_k, M, K);
  detail::gemm_vec<false>(M, N, K, alpha, A, a_k, B, ldb, C, ldc, accumulate);
}
#else
// The copy without vector instructions (no FMA): products of two floats are exact in double,
// so each row sums in double and rounds once. In float, every product and sum would round (a
// chain of K), some ulps over torch's blocked MKL sums at K = 300 (docs/design/cpu_kernels.md).
inline void gemm(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t a_m,
                 int64_t a_k, const float* B, int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  static thread_local std::vector<double> row;
  if (static_cast<int64_t>(row.size()) < N) row.resize(N);
  for (int64_t m = 0; m < M; ++m) {
    float* c = C + m * ldc;
    std::fill(row.begin(), row.begin() + N, 0.0);
    for (int64_t k = 0; k < K; ++k) {
      const double a = double(A[m * a_m + k * a_k]);
      const float* b = B + k * ldb;
      for (int64_t n = 0; n < N; ++n) row[n] += a * double(b[n]);
    }
    for (int64_t n = 0; n < N; ++n) {
      c[n] = static_cast<float>((accumulate ? double(c[n]) : 0.0) + double(alpha) * row[n]);
    }
  }
}
#endif

inline void gemm(int64_t M, int64_t N, int64_t K, double alpha, const double* A, int64_t a_m,
                 int64_t a_k, const double* B, int64_t ldb, double* C, int64_t ldc,
                 bool accumulate) {
  gemm_generic<double>(M, N, K, alpha, A, a_m, a_k, B, ldb, C, ldc, accumulate);
}

}  // namespace FASTATTN_TARGET_NAMESPACE
}  // namespace fastattn::cpu
