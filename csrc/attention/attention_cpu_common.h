// Helpers of the CPU attention op bodies (dense, varlen, KV cache): tensors to the raw
// AttentionProblem the kernels of attention_*_cpu_kernel.cpp take.
#pragma once
#include "common/tensor_api.h"

#include "attention/attention.h"
#include "attention/attention_cpu_kernel.h"

namespace fastattn::attention {

using std::optional;

inline bool defined(const optional<Tensor>& t) { return t.has_value() && t->defined(); }

inline cpu::Strides4 strides_of(const Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

inline cpu::MaskKind mask_kind(const optional<Tensor>& mask) {
  if (!defined(mask)) return cpu::MaskKind::none;
  switch (mask->scalar_type()) {
    case kBool:
      return cpu::MaskKind::boolean;
    case kFloat:
      return cpu::MaskKind::float32;
    case kDouble:
      return cpu::MaskKind::float64;
    case kHalf:
      return cpu::MaskKind::float16;
    case kBFloat16:
      return cpu::MaskKind::bfloat16;
    default:
      FASTATTN_CHECK(false, "attention", "unsupported attn_mask dtype ", mask->scalar_type());
  }
}

inline cpu::AttentionProblem make_problem(const Tensor& q, const Tensor& k, const Tensor& v,
                                          const optional<Tensor>& attn_mask,
                                          const optional<Tensor>& key_padding_mask,
                                          const optional<Tensor>& alibi_slopes, double scale,
                                          double softcap, int64_t window_lo, int64_t window_hi,
                                          double dropout_p, const optional<Tensor>& seed) {
  cpu::AttentionProblem p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.q_s = strides_of(q);
  p.k_s = strides_of(k);
  p.v_s = strides_of(v);
  p.B = q.size(0);
  p.Hq = q.size(1);
  p.Hkv = k.size(1);
  p.Lq = q.size(2);
  p.Lk = k.size(2);
  p.D = q.size(3);
  p.Dv = v.size(3);
  p.mask_kind = mask_kind(attn_mask);
  if (defined(attn_mask)) {  // read through its broadcast view (stride 0 on size-1 dims)
    const Tensor m = expanded_mask(*attn_mask, q, k);
    p.mask = m.data_ptr();
    p.mask_sb = m.stride(0);
    p.mask_sh = m.stride(1);
    p.mask_sq = m.stride(2);
    p.mask_sk = m.stride(3);
  }
  p.key_padding = defined(key_padding_mask) ? key_padding_mask->data_ptr<bool>() : nullptr;
  if (defined(alibi_slopes)) {
    p.alibi = alibi_slopes->data_ptr<float>();
    p.alibi_sb = alibi_slopes->stride(0);
    p.alibi_sh = alibi_slopes->stride(1);
  }
  p.scale = scale;
  p.softcap = softcap;
  p.window_lo = window_lo;
  p.window_hi = window_hi;
  p.dropout_p = dropout_p;
  if (dropout_p > 0.0) {
    const int64_t* s = seed->data_ptr<int64_t>();
    p.seed = static_cast<uint64_t>(s[0]);
    p.stream = static_cast<uint64_t>(s[1]);
  }
  return p;
}

}  // namespace fastattn::attention
