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

// The masked softmax of the scores and the weighted sum of values (additive_context):
//   W[b, i, j] = softmax_j(S[b, i, j] over the keys j that key_padding_mask keeps), 0 for a
//   query whose keys are all masked;  C[b, i, :] = sum_j W[b, i, j] Values[b, j, :].
// Backward, with dC and (optional) dW:
//   dP[b, i, j] = dC[b, i, :] . Values[b, j, :] + dW[b, i, j]
//   dS[b, i, j] = W[b, i, j] (dP[b, i, j] - sum_j' W[b, i, j'] dP[b, i, j'])
//   dValues[b, j, :] = sum_i W[b, i, j] dC[b, i, :]
struct AdditiveContextParams {
  int64_t B, Lq, Lk, Dv;
  const void* scores;        // (B, Lq, Lk) contiguous, compute type
  const void* values;        // (B, Lk, Dv) contiguous, values' dtype T
  const bool* mask;          // (B, Lk) contiguous, true = ignore that key; nullptr: none
  void* weights;             // (B, Lq, Lk) contiguous, compute type (forward out, backward in)
  void* context;             // forward out: (B, Lq, Dv) contiguous, T
  const void* grad_context;  // backward: (B, Lq, Dv) contiguous, T
  const void* grad_weights;  // backward: (B, Lq, Lk) contiguous, compute type; nullptr: none
  void* grad_scores;         // backward out: (B, Lq, Lk), compute type
  void* grad_values;         // backward out: (B, Lk, Dv), T
};

#define FASTATTN_DECLARE_ADDITIVE_KERNELS(ISA)                  \
  namespace ISA {                                               \
  template <typename T>                                         \
  void additive_scores(const AdditiveScoresParams&);            \
  template <typename T>                                         \
  void additive_scores_backward(const AdditiveScoresParams&);   \
  template <typename T>                                         \
  void additive_context(const AdditiveContextParams&);          \
  template <typename T>                                         \
  void additive_context_backward(const AdditiveContextParams&); \
  }

FASTATTN_DECLARE_ADDITIVE_KERNELS(avx512bf16)
FASTATTN_DECLARE_ADDITIVE_KERNELS(avx512)
FASTATTN_DECLARE_ADDITIVE_KERNELS(avx2)
FASTATTN_DECLARE_ADDITIVE_KERNELS(base)

}  // namespace fastattn::cpu
