// CPU bodies of the attention ops: checks, allocation, and the ISA-dispatched FlashAttention-2
// loops of attention_forward_cpu_kernel.cpp and attention_backward_cpu_kernel.cpp.
#include "common/tensor_api.h"

#include "attention/attention.h"
#include "attention/attention_cpu_common.h"
#include "attention/attention_cpu_kernel.h"
#include "common/cpu_isa.h"
#include "common/debug.h"

namespace fastattn::attention {
namespace {

using std::optional;

#define FASTATTN_DISPATCH_ATTENTION(TYPE, ...) \
  FASTATTN_DISPATCH_FLOATING(TYPE, "attention_cpu", __VA_ARGS__)

std::tuple<Tensor, Tensor> attention_forward_cpu(const Tensor& q, const Tensor& k, const Tensor& v,
                                                 const optional<Tensor>& attn_mask,
                                                 const optional<Tensor>& key_padding_mask,
                                                 const optional<Tensor>& alibi_slopes, double scale,
                                                 double softcap, int64_t window_lo,
                                                 int64_t window_hi, double dropout_p,
                                                 const optional<Tensor>& seed) {
  constexpr const char* op = "attention_forward";
  check_problem(q, k, v, attn_mask, key_padding_mask, alibi_slopes, dropout_p, seed, op);
  Tensor out = output_like(q, v.size(3));
  Tensor lse = empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(lse_dtype(q)));
  poison(out);
  poison(lse);
  if (out.numel() == 0) return {out, lse};
  cpu::AttentionForwardParams fp{
      make_problem(q, k, v, attn_mask, key_padding_mask, alibi_slopes, scale, softcap, window_lo,
                   window_hi, dropout_p, seed),
      out.data_ptr(), strides_of(out), lse.data_ptr()};
  FASTATTN_DISPATCH_ATTENTION(q.scalar_type(),
                              [&] { FASTATTN_CPU_ISA_CALL(attention_forward<scalar_t>, fp); });
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor, Tensor> attention_backward_cpu(
    const Tensor& grad_out, const optional<Tensor>& grad_lse, const Tensor& q, const Tensor& k,
    const Tensor& v, const Tensor& out, const Tensor& lse, const optional<Tensor>& attn_mask,
    const optional<Tensor>& key_padding_mask, const optional<Tensor>& alibi_slopes, double scale,
    double softcap, int64_t window_lo, int64_t window_hi, double dropout_p,
    const optional<Tensor>& seed, bool deterministic, bool mask_grad) {
  // The CPU backward is always deterministic (fixed summation order, no atomics), d mask
  // included: each of its elements is summed by one task (attention_backward_cpu_kernel.cpp).
  (void)deterministic;
  constexpr const char* op = "attention_backward";
  check_backward(grad_out, grad_lse, q, k, v, out, lse, attn_mask, key_padding_mask, alibi_slopes,
                 dropout_p, seed, op);
  check_mask_grad(attn_mask, mask_grad, op);
  // d mask accumulates in the compute type (zeros: keys outside the band get no gradient) and
  // is rounded to the mask's dtype at the end; shaped like the mask, never expanded.
  Tensor dmask_acc = mask_grad ? zeros(attn_mask->sizes(), q.options().dtype(lse_dtype(q)))
                               : empty({0}, q.options());
  const auto dmask = [&] { return mask_grad ? dmask_acc.to(attn_mask->scalar_type()) : dmask_acc; };
  Tensor dlse;
  if (grad_lse.has_value() && grad_lse->defined()) dlse = grad_lse->to(lse_dtype(q)).contiguous();
  Tensor dq = empty(q.sizes(), q.options());
  Tensor dk = empty(k.sizes(), k.options());
  Tensor dv = empty(v.sizes(), v.options());
  poison(dq);
  poison(dk);
  poison(dv);
  if (dq.numel() == 0 && dk.numel() == 0) return {dq, dk, dv, dmask()};
  if (q.size(2) == 0 || k.size(2) == 0) {  // nothing attends: every gradient is zero
    dq.zero_();
    dk.zero_();
    dv.zero_();
    return {dq, dk, dv, dmask()};
  }
  cpu::AttentionBackwardParams bp{
      make_problem(q, k, v, attn_mask, key_padding_mask, alibi_slopes, scale, softcap, window_lo,
                   window_hi, dropout_p, seed),
      out.data_ptr(),
      strides_of(out),
      grad_out.data_ptr(),
      strides_of(grad_out),
      lse.data_ptr(),
      dlse.defined() ? dlse.data_ptr() : nullptr,
      dq.data_ptr(),
      dk.data_ptr(),
      dv.data_ptr(),
      strides_of(dq),
      strides_of(dk),
      strides_of(dv)};
  if (mask_grad && dmask_acc.numel() > 0) {
    const Tensor view = expanded_mask(dmask_acc, q, k);  // stride 0 on the broadcast dims
    bp.dmask = dmask_acc.data_ptr();
    bp.dmask_sb = view.stride(0);
    bp.dmask_sh = view.stride(1);
    bp.dmask_sq = view.stride(2);
    bp.dmask_sk = view.stride(3);
  }
  FASTATTN_DISPATCH_ATTENTION(q.scalar_type(),
                              [&] { FASTATTN_CPU_ISA_CALL(attention_backward<scalar_t>, bp); });
  return {dq, dk, dv, dmask()};
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fastattn, CPU, m) {
  m.impl("attention_forward", TORCH_BOX(&attention_forward_cpu));
  m.impl("attention_backward", TORCH_BOX(&attention_backward_cpu));
}

}  // namespace fastattn::attention
