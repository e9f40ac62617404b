// Argument checks and output allocation of the attention ops, shared by the CPU and CUDA op
// bodies (and the CUDA emulator): one check per rule, whatever the device.
// fastattn/ops/attention.py checks the same rules first with friendlier messages and builds the
// canonical arguments; these guard direct calls of torch.ops.fastattn.*.
#pragma once
#include "common/tensor_api.h"

#include "common/checks.h"

namespace fastattn::attention {

constexpr int64_t kMaxHeadDim = 256;

// Sequence lengths must stay below 2^30 on every backend: the canonical band encodes
// "unbounded" as +-2^30 (fastattn/reference/attention.py), so a longer sequence would hide
// keys, and the CUDA and Triton kernels add window bounds to int32 indices
// (fastattn/contracts/attention.py: MAX_SEQLEN, the same rule).
constexpr int64_t kMaxSeqLen = (int64_t{1} << 30) - 1;

inline void check_seqlen(int64_t length, const char* op, const char* name) {
  FASTATTN_CHECK(length <= kMaxSeqLen, op, name, " must be < 2^30 = ", kMaxSeqLen + 1,
                 " (the band's unbounded bound and the GPU kernels' int32 indices), got ", length);
}

inline ScalarType lse_dtype(const Tensor& q) {
  return q.scalar_type() == kDouble ? kDouble : kFloat;
}

inline void check_problem(const Tensor& q, const Tensor& k, const Tensor& v,
                          const std::optional<Tensor>& attn_mask,
                          const std::optional<Tensor>& key_padding_mask,
                          const std::optional<Tensor>& alibi_slopes, double dropout_p,
                          const std::optional<Tensor>& seed, const char* op) {
  check_float_dtype(q, op, "q");
  FASTATTN_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, op,
                 "q, k and v must be 4-D (B, H, L, D), got ", q.sizes(), ", ", k.sizes(), ", ",
                 v.sizes());
  FASTATTN_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), op,
                 "q, k and v must have the same dtype, got ", q.scalar_type(), ", ",
                 k.scalar_type(), ", ", v.scalar_type());
  check_same_device(q, k, op, "q", "k");
  check_same_device(q, v, op, "q", "v");
  const int64_t B = q.size(0), Hq = q.size(1), Lq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), Lk = k.size(2), Dv = v.size(3);
  FASTATTN_CHECK(k.size(0) == B && v.size(0) == B, op, "q, k and v must have the same batch");
  FASTATTN_CHECK(v.size(1) == Hkv && Hkv > 0 && Hq % Hkv == 0, op,
                 "q's heads must be a multiple of k/v's heads, got ", Hq, " and ", Hkv);
  FASTATTN_CHECK(v.size(2) == Lk, op, "k and v must have the same length, got ", Lk, " and ",
                 v.size(2));
  FASTATTN_CHECK(k.size(3) == D, op, "q and k must have the same head dim, got ", D, " and ",
                 k.size(3));
  FASTATTN_CHECK(D >= 1 && D <= kMaxHeadDim && Dv >= 1 && Dv <= kMaxHeadDim, op,
                 "head dims must be in [1, ", kMaxHeadDim, "], got ", D, " and ", Dv);
  check_seqlen(Lq, op, "q's length (Lq)");
  check_seqlen(Lk, op, "k's length (Lk)");
  check_unit_last_stride(q, op, "q");
  check_unit_last_stride(k, op, "k");
  check_unit_last_stride(v, op, "v");
  if (attn_mask.has_value() && attn_mask->defined()) {
    const auto& m = *attn_mask;
    FASTATTN_CHECK(
        m.scalar_type() == kBool || m.scalar_type() == kFloat || m.scalar_type() == q.scalar_type(),
        op, "attn_mask must be bool, float32 or q's dtype, got ", m.scalar_type());
    const auto fits = [&](int64_t d, int64_t full) { return m.size(d) == full || m.size(d) == 1; };
    FASTATTN_CHECK(m.dim() == 4 && fits(0, B) && fits(1, Hq) && fits(2, Lq) && fits(3, Lk), op,
                   "attn_mask must be 4-D and broadcast to (B, Hq, Lq, Lk) = (", B, ", ", Hq, ", ",
                   Lq, ", ", Lk, ") (each dim 1 or full), got ", m.sizes());
    check_same_device(m, q, op, "attn_mask", "q");
  }
  if (key_padding_mask.has_value() && key_padding_mask->defined()) {
    const auto& m = *key_padding_mask;
    FASTATTN_CHECK(m.scalar_type() == kBool && m.dim() == 2 && m.size(0) == B && m.size(1) == Lk &&
                       m.is_contiguous(),
                   op, "key_padding_mask must be a contiguous bool (B, Lk) = (", B, ", ", Lk,
                   "), got ", m.scalar_type(), " ", m.sizes());
    check_same_device(m, q, op, "key_padding_mask", "q");
  }
  if (alibi_slopes.has_value() && alibi_slopes->defined()) {
    const auto& a = *alibi_slopes;
    FASTATTN_CHECK(a.scalar_type() == kFloat && a.dim() == 2 && a.size(0) == B && a.size(1) == Hq,
                   op, "alibi_slopes must be float32 viewed as (B, Hq) = (", B, ", ", Hq, "), got ",
                   a.scalar_type(), " ", a.sizes());
    check_same_device(a, q, op, "alibi_slopes", "q");
  }
  check_seed(seed, dropout_p, q, op);
}

// attention_backward's arguments, on every device: the forward's problem (check_problem), then
// grad_out and out (B, Hq, Lq, Dv) in q's dtype with unit last strides, lse a contiguous
// (B, Hq, Lq) tensor of lse_dtype, grad_lse (when given) (B, Hq, Lq); all on q's device.
inline void check_backward(const Tensor& grad_out, const std::optional<Tensor>& grad_lse,
                           const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                           const Tensor& lse, const std::optional<Tensor>& attn_mask,
                           const std::optional<Tensor>& key_padding_mask,
                           const std::optional<Tensor>& alibi_slopes, double dropout_p,
                           const std::optional<Tensor>& seed, const char* op) {
  check_problem(q, k, v, attn_mask, key_padding_mask, alibi_slopes, dropout_p, seed, op);
  FASTATTN_CHECK(
      grad_out.sizes() == out.sizes() && out.dim() == 4 && out.size(0) == q.size(0) &&
          out.size(1) == q.size(1) && out.size(2) == q.size(2) && out.size(3) == v.size(3),
      op, "grad_out and out must be (B, Hq, Lq, Dv), got ", grad_out.sizes(), " and ", out.sizes());
  FASTATTN_CHECK(grad_out.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(),
                 op, "grad_out and out must have q's dtype");
  check_same_device(grad_out, q, op, "grad_out", "q");
  check_same_device(out, q, op, "out", "q");
  check_same_device(lse, q, op, "lse", "q");
  check_unit_last_stride(grad_out, op, "grad_out");
  check_unit_last_stride(out, op, "out");
  FASTATTN_CHECK(lse.scalar_type() == lse_dtype(q) && lse.is_contiguous() && lse.dim() == 3 &&
                     lse.size(0) == q.size(0) && lse.size(1) == q.size(1) &&
                     lse.size(2) == q.size(2),
                 op, "lse must be a contiguous ", lse_dtype(q), " (B, Hq, Lq) tensor");
  if (grad_lse.has_value() && grad_lse->defined()) {
    check_same_device(*grad_lse, q, op, "grad_lse", "q");
    FASTATTN_CHECK(grad_lse->sizes() == lse.sizes(), op, "grad_lse must be (B, Hq, Lq)");
  }
}

// attn_mask viewed as (B, Hq, Lq, Lk): stride 0 along its broadcast (size-1) dims.
inline Tensor expanded_mask(const Tensor& mask, const Tensor& q, const Tensor& k) {
  return mask.expand({q.size(0), q.size(1), q.size(2), k.size(2)});
}

// attention_backward's mask_grad: only a float attn_mask has a gradient.
inline void check_mask_grad(const std::optional<Tensor>& attn_mask, bool mask_grad,
                            const char* op) {
  if (!mask_grad) return;
  FASTATTN_CHECK(
      attn_mask.has_value() && attn_mask->defined() && is_floating_type(attn_mask->scalar_type()),
      op, "mask_grad needs a float attn_mask (a bool mask has no gradient)");
}

// (B, Hq, Lq, Dv) output following q's layout: (B, Lq, Hq, Dv) in memory when q's heads are
// inner to its sequence (a transposed (B, L, H, D) input). Same rule as
// fastattn.contracts.attention.output_like.
inline Tensor output_like(const Tensor& q, int64_t Dv) {
  const int64_t B = q.size(0), Hq = q.size(1), Lq = q.size(2);
  if (q.stride(1) < q.stride(2)) {
    return empty({B, Lq, Hq, Dv}, q.options()).transpose(1, 2);
  }
  return empty({B, Hq, Lq, Dv}, q.options());
}

}  // namespace fastattn::attention
