// Additive (Bahdanau) attention scores on raw pointers, compiled once per x86 ISA.
//   S[b, i, j] = sum_a v[a] * tanh(Qp[b, i, a] + Kp[b, j, a])
// Qp = query W_q^T and Kp = keys W_k^T + bias are computed by the caller; the (B, Lq, Lk, A)
// tensor of tanh arguments is never formed: each score is a fused reduction over a.
#pragma once
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Half.h>
#include <cstdint>

namespace fastattn::cpu {

struct AdditiveScoresParams {
  const void* qp;  // (B, Lq, A) contiguous
  const void* kp;  // (B, Lk, A) contiguous
  const void* v;   // (A,)
  int64_t B, Lq, Lk, A;
  void* scores;          // (B, Lq, Lk) contiguous, compute type (float, double for double)
  const void* grad;      // backward: dL/dS, (B, Lq, Lk) contiguous, compute type
  void *dqp, *dkp, *dv;  // backward outputs, input dtype, contiguous
};

#define FASTATTN_DECLARE_ADDITIVE_KERNELS(ISA)                \
  namespace ISA {                                             \
  template <typename T>                                       \
  void additive_scores(const AdditiveScoresParams&);          \
  template <typename T>                                       \
  void additive_scores_backward(const AdditiveScoresParams&); \
  }

FASTATTN_DECLARE_ADDITIVE_KERNELS(avx512bf16)
FASTATTN_DECLARE_ADDITIVE_KERNELS(avx512)
FASTATTN_DECLARE_ADDITIVE_KERNELS(avx2)
FASTATTN_DECLARE_ADDITIVE_KERNELS(base)

}  // namespace fastattn::cpu
