// Host-side pieces of the one-call decoding op (attention_with_kvcache) shared by its CPU and
// CUDA bodies: the argument checks made before the caches are written, and the rotary
// embedding through fastattn's own apply_rotary op (the device's kernel).
#pragma once
#include "common/tensor_api.h"

#include <tuple>
#include <utility>

#include "common/checks.h"

namespace fastattn::attention_with_kvcache {

// Checks cache_seqlens (int32 (B,)), k_new/v_new ((B, Hkv, Lnew, D/Dv), q's dtype and device,
// unit last strides, given together) and the rotary tables (given together); returns Lnew.
// The values of cache_seqlens are the caller's to check (reading them is device-specific).
inline int64_t check_new_tokens(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                const Tensor& cache_seqlens, const std::optional<Tensor>& k_new,
                                const std::optional<Tensor>& v_new,
                                const std::optional<Tensor>& rotary_cos,
                                const std::optional<Tensor>& rotary_sin, const char* op) {
  const int64_t B = q.size(0);
  FASTATTN_CHECK(cache_seqlens.scalar_type() == kInt && cache_seqlens.dim() == 1 &&
                     cache_seqlens.numel() == B && cache_seqlens.device() == q.device(),
                 op, "cache_seqlens must be an int32 (B,) = (", B, ",) tensor on ", q.device(),
                 ", got ", cache_seqlens.scalar_type(), " ", cache_seqlens.sizes(), " on ",
                 cache_seqlens.device());
  const bool append = k_new.has_value() && k_new->defined();
  FASTATTN_CHECK(append == (v_new.has_value() && v_new->defined()), op,
                 "k_new and v_new must be given together");
  const bool rotary = rotary_cos.has_value() && rotary_cos->defined();
  FASTATTN_CHECK(rotary == (rotary_sin.has_value() && rotary_sin->defined()), op,
                 "rotary_cos and rotary_sin must be given together");
  if (!append) return 0;
  const int64_t Lnew = k_new->size(2);
  for (const auto& [name, t, cache] :
       {std::tuple{"k_new", &*k_new, &k_cache}, std::tuple{"v_new", &*v_new, &v_cache}}) {
    FASTATTN_CHECK(t->dim() == 4 && t->size(0) == B && t->size(1) == cache->size(1) &&
                       t->size(2) == Lnew && t->size(3) == cache->size(3),
                   op, name, " must be (B, Hkv, Lnew, D/Dv) = (", B, ", ", cache->size(1), ", ",
                   Lnew, ", ", cache->size(3), "), got ", t->sizes());
    FASTATTN_CHECK(t->scalar_type() == q.scalar_type(), op, name, " must have q's dtype ",
                   q.scalar_type(), ", got ", t->scalar_type());
    FASTATTN_CHECK(t->device() == q.device(), op, name, " must be on q's device ", q.device(),
                   ", got ", t->device());
    check_unit_last_stride(*t, op, name);
  }
  return Lnew;
}

// x (B, H, L, D) rotated at positions[b] + l (int64 (B,)) with tables (max_position,
// rotary_dim / 2) in the compute dtype: fastattn::apply_rotary on x's device.
inline Tensor rotate_at_positions(const Tensor& x, const Tensor& cos, const Tensor& sin,
                                  const Tensor& positions, bool interleaved) {
  // Through the dispatcher's stable entry point: the op's autograd kernel is Python's
  // (registered by fastattn) and passes straight through for decoding's inputs (no grad).
  auto stack = detail::call_aten<1>(
      "fastattn::apply_rotary", "", detail::base(x), std::optional<Tensor>(cos),
      std::optional<Tensor>(sin), int64_t{0}, std::optional<Tensor>(positions),
      std::optional<Tensor>(), int64_t{2 * cos.size(1)}, 10000.0, interleaved, false);
  return detail::take_tensor(stack[0]);
}

// (q, k_new) rotated at positions seqlens[b] + i when the tables are given, else as given
// (k_new undefined without new tokens). seqlens: contiguous int32 (B,). rotate(x, cos, sin,
// positions, interleaved) is rotate_at_positions or a device's rotary body called directly.
template <typename Rotate>
std::pair<Tensor, Tensor> rotated_new_tokens(const Tensor& q, const std::optional<Tensor>& k_new,
                                             const std::optional<Tensor>& cos,
                                             const std::optional<Tensor>& sin,
                                             const Tensor& seqlens, bool interleaved,
                                             Rotate rotate) {
  const bool append = k_new.has_value() && k_new->defined();
  if (!cos.has_value() || !cos->defined()) return {q, append ? *k_new : Tensor()};
  const Tensor positions = seqlens.to(kLong);
  return {rotate(q, *cos, *sin, positions, interleaved),
          append ? rotate(*k_new, *cos, *sin, positions, interleaved) : Tensor()};
}

inline std::pair<Tensor, Tensor> rotated_new_tokens(const Tensor& q,
                                                    const std::optional<Tensor>& k_new,
                                                    const std::optional<Tensor>& cos,
                                                    const std::optional<Tensor>& sin,
                                                    const Tensor& seqlens, bool interleaved) {
  return rotated_new_tokens(q, k_new, cos, sin, seqlens, interleaved, rotate_at_positions);
}

}  // namespace fastattn::attention_with_kvcache
