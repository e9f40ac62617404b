// Host-side matrix products on ATen tensors for the CPU op bodies: fastattn's packed GEMM
// (common/gemm_cpu_kernel.h) for float where its micro-kernel exists (AVX2 and AVX-512),
// ATen's otherwise.
#pragma once
#include "common/tensor_api.h"

namespace fastattn::cpu {

// out (+)= a @ b (+ bias on every row), all in the compute type, out with a unit column
// stride. b_cols (optional, int64 (N,)): column n of the product uses column b_cols[n] of b.
// On AMD CPUs MKL's sgemm takes a generic path (about 70% of the FMA peak with AVX-512, 55% on
// an AVX2 Zen 3: docs/design/cpu_kernels.md), hence fastattn's own driver for float.
// k_block > 0 (float driver only): the products are summed in blocks of k_block terms, then
// the blocks (for long reductions such as weight gradients over all time steps: the rounding
// error grows with k_block + K / k_block instead of K).
void matmul_into(Tensor out, const Tensor& a, const Tensor& b, const Tensor& bias, bool accumulate,
                 const Tensor& b_cols = Tensor(), int64_t k_block = 0);

// out = a @ b for an output in the storage type (converted when that is not a's type); a
// reduction over rows (weight gradients), summed in blocks of kReductionBlock.
constexpr int64_t kReductionBlock = 32;
void mm_into(Tensor out, const Tensor& a, const Tensor& b);

// Whether this CPU runs bfloat16 dot products (AVX512-BF16, and the avx512bf16 copy is not
// forced off): bfloat16 recurrent layers then multiply in bfloat16 with float sums.
bool bf16_products();

// out (+)= a @ w^T (+ bias on every row) for bfloat16 a (M x K, unit column stride) and w (rows
// of K, unit column stride; column n of the product reads row w_rows[n], or n), summed in
// float; out float with a unit column stride. Only where bf16_products().
void matmul_bf16_into(Tensor out, const Tensor& a, const Tensor& w, const Tensor& bias,
                      bool accumulate, const Tensor& w_rows = Tensor());

// Whether bfloat16 products run on AMX tiles here (bf16_products() on a CPU with AMX-BF16,
// not capped below it by FASTATTN_CPU_ISA).
bool amx_products();

// out (+)= a @ w^T for float a (M x K, unit column stride), each element split into two
// bfloat16 parts (hi = bf16(a), lo = bf16(a - hi): a to 2^-18 of |a|), and bfloat16 w (N rows
// of K, unit column stride), summed in float on AMX tiles: twice the products of a bfloat16 a.
// Only where amx_products().
void matmul_split_bf16_into(Tensor out, const Tensor& a, const Tensor& w, bool accumulate);

}  // namespace fastattn::cpu
