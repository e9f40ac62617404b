// Argument checks shared by the op bodies (CPU and CUDA). Every failure names the argument and
// the rule it broke, e.g. "apply_rotary: cos must be a floating tensor, got Long".
#pragma once
#include "common/tensor_api.h"

namespace fastattn {

inline void check_float_dtype(const Tensor& t, const char* op, const char* name) {
  const auto dt = t.scalar_type();
  FASTATTN_CHECK(dt == kFloat || dt == kDouble || dt == kHalf || dt == kBFloat16, op, name,
                 " must be float32, float64, float16 or bfloat16, got ", dt);
}

inline void check_same_device(const Tensor& a, const Tensor& b, const char* op, const char* name_a,
                              const char* name_b) {
  FASTATTN_CHECK(a.device() == b.device(), op, name_a, " and ", name_b,
                 " must be on the same device, got ", a.device(), " and ", b.device());
}

inline void check_unit_last_stride(const Tensor& t, const char* op, const char* name) {
  FASTATTN_CHECK(t.dim() == 0 || t.size(-1) <= 1 || t.stride(-1) == 1, op, name,
                 " must have a unit stride in its last dimension, got strides ", t.strides());
}

// Per-call dropout seed: int64 (2,) = (seed, stream) on the data's device (see philox.h).
inline void check_seed(const std::optional<Tensor>& seed, double p, const Tensor& like,
                       const char* op) {
  FASTATTN_CHECK(p >= 0.0 && p < 1.0, op, "dropout_p must be in [0, 1), got ", p);
  if (p > 0.0) {
    FASTATTN_CHECK(seed.has_value() && seed->defined(), op,
                   "a seed tensor is required when dropout_p > 0");
    FASTATTN_CHECK(seed->scalar_type() == kLong && seed->numel() == 2 && seed->is_contiguous(), op,
                   "seed must be a contiguous int64 tensor of 2 elements, got ",
                   seed->scalar_type(), " ", seed->sizes());
    check_same_device(*seed, like, op, "seed", "the input");
  }
}

}  // namespace fastattn
