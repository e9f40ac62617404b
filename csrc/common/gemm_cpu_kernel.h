// The large CPU GEMM of the recurrent layers (input projections, weight and input gradients
// over all time steps): a packed, cache-blocked, parallel driver of common/cpu_gemm.h's
// register-blocked micro-kernel, compiled once per x86 ISA (the AVX-512 copies and the AVX2
// copy have a micro-kernel; common/gemm_cpu.h's matmul_into calls them there and ATen's GEMM
// on the baseline copy). The vector copies read the operands of products with few rows in
// place.
#pragma once
#include <cstdint>

namespace fastattn::cpu {

// C (M x N, row-major, leading dimension ldc) = A B (+ bias on every row) (+ C if accumulate),
// A(m, k) = A[m * a_m + k * a_k], B(k, n) = B[k * b_k + n * b_n]: float, any strides.
struct GemmParams {
  int64_t M, N, K;
  const float* A;
  int64_t a_m, a_k;
  const float* B;
  int64_t b_k, b_n;
  const int64_t* b_cols;  // (N,) column n of the product reads column b_cols[n] of B, or nullptr
  float* C;
  int64_t ldc;
  const float* bias;  // (N,) or nullptr
  bool accumulate;
  int64_t k_block = 0;  // > 0: sum k_block products per register pass (long K: less rounding)
};

#define FASTATTN_DECLARE_GEMM_KERNELS(ISA) \
  namespace ISA {                          \
  void gemm_large(const GemmParams&);      \
  }

// C (M x N, row-major, leading dimension ldc) = A W^T (+ bias on every row) (+ C if
// accumulate) from bfloat16 operands (bits as uint16), summed in float by AVX512-BF16 dot
// products: A(m, k) = A[m * lda + k], and column n of the product reads row w_rows[n] (or n)
// of the row-major weight W (N' x K, leading dimension ldw). The input projection of a
// bfloat16 recurrent layer; only the avx512bf16 copy has it. With A_split (AMX only: see
// amx_products), A is float instead, A(m, k) = A_split[m * lda + k], each element split into
// two bfloat16 parts, hi = bf16(a) and lo = bf16(a - hi) (a to 2^-18 of |a|), both multiplying
// W: the input gradient of a bfloat16 layer (float gate gradients, bfloat16 W_ih).
struct GemmBf16Params {
  int64_t M, N, K;
  const uint16_t* A;
  int64_t lda;
  const uint16_t* W;
  int64_t ldw;
  const int64_t* w_rows;  // (N,) or nullptr
  float* C;
  int64_t ldc;
  const float* bias;  // (N,) or nullptr
  bool accumulate;
  const float* A_split = nullptr;  // float A (then A is unused), or nullptr
};

namespace avx512bf16 {
void gemm_large_bf16(const GemmBf16Params&);
// Whether gemm_large_bf16 runs on AMX tiles here (and so takes A_split).
bool amx_products();
}  // namespace avx512bf16

FASTATTN_DECLARE_GEMM_KERNELS(avx512bf16)
FASTATTN_DECLARE_GEMM_KERNELS(avx512)
FASTATTN_DECLARE_GEMM_KERNELS(avx2)
FASTATTN_DECLARE_GEMM_KERNELS(base)

}  // namespace fastattn::cpu
