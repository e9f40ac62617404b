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

// additive_context's arguments: scores (B, Lq, Lk) in the compute type of values (B, Lk, Dv),
// key_padding_mask bool (B, Lk).
inline void check_context_args(const Tensor& scores, const Tensor& values,
                               const std::optional<Tensor>& key_padding_mask, const char* op) {
  check_float_dtype(values, op, "values");
  FASTATTN_CHECK(scores.dim() == 3 && values.dim() == 3 && scores.size(0) == values.size(0) &&
                     scores.size(2) == values.size(1),
                 op, "expected scores (B, Lq, Lk) and values (B, Lk, Dv), got ", scores.sizes(),
                 ", ", values.sizes());
  FASTATTN_CHECK(scores.scalar_type() == compute_dtype(values), op, "scores must be ",
                 compute_dtype(values), " for ", values.scalar_type(), " values, got ",
                 scores.scalar_type());
  check_same_device(scores, values, op, "scores", "values");
  if (key_padding_mask.has_value()) {
    const Tensor& mask = *key_padding_mask;
    FASTATTN_CHECK(mask.scalar_type() == kBool && mask.dim() == 2 &&
                       mask.size(0) == values.size(0) && mask.size(1) == values.size(1),
                   op, "key_padding_mask must be bool (B, Lk) = (", values.size(0), ", ",
                   values.size(1), "), got ", mask.scalar_type(), " ", mask.sizes());
    check_same_device(mask, values, op, "key_padding_mask", "values");
  }
}

}  // namespace fastattn::additive_attention
