// Argument checks of the additive-attention score ops, shared by the CPU and CUDA bodies.
#pragma once
#include "common/tensor_api.h"

#include "common/checks.h"

namespace fastattn::additive_attention {

inline ScalarType compute_dtype(const Tensor& t) {
  return t.scalar_type() == kDouble ? kDouble : kFloat;
}

inline void check_scores_args(const Tensor& qp, const Tensor& kp, const Tensor& v, const char* op) {
  check_float_dtype(qp, op, "qp");
  FASTATTN_CHECK(qp.dim() == 3 && kp.dim() == 3 && v.dim() == 1, op,
                 "expected qp (B, Lq, A), kp (B, Lk, A), v (A,), got ", qp.sizes(), ", ",
                 kp.sizes(), ", ", v.sizes());
  FASTATTN_CHECK(kp.scalar_type() == qp.scalar_type() && v.scalar_type() == qp.scalar_type(), op,
                 "qp, kp and v must have the same dtype");
  FASTATTN_CHECK(kp.size(0) == qp.size(0) && kp.size(2) == qp.size(2) && v.size(0) == qp.size(2),
                 op, "qp, kp and v must agree in batch and attention dim, got ", qp.sizes(), ", ",
                 kp.sizes(), ", ", v.sizes());
  check_same_device(qp, kp, op, "qp", "kp");
  check_same_device(qp, v, op, "qp", "v");
}

}  // namespace fastattn::additive_attention
