// CPU bodies of packed variable-length attention: the tiled kernels of
// csrc/attention/attention_forward_cpu_kernel.cpp with per-sequence geometry (cu_seqlens), so no
// work is spent on padding.
#include "common/tensor_api.h"

#include "attention/attention.h"
#include "attention/attention_cpu_common.h"
#include "varlen_attention/varlen_attention.h"
#include "common/cpu_isa.h"
#include "common/debug.h"

namespace fastattn::attention {
namespace {

// (total, H, D) viewed by the kernels as (batch stride 0, head stride, row stride).
cpu::Strides4 packed_strides(const Tensor& t) { return {0, t.stride(1), t.stride(0)}; }

cpu::AttentionProblem varlen_problem(const Tensor& q, const Tensor& k, const Tensor& v,
                                     const Tensor& cu_q, const Tensor& cu_k, int64_t max_q,
                                     int64_t max_k, const optional<Tensor>& alibi, double scale,
                                     double softcap, int64_t causal_mode, int64_t wl, int64_t wr,
                                     double dropout_p, const optional<Tensor>& seed) {
  cpu::AttentionProblem p{};
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.q_s = packed_strides(q);
  p.k_s = packed_strides(k);
  p.v_s = packed_strides(v);
  p.B = cu_q.numel() - 1;
  p.Hq = q.size(1);
  p.Hkv = k.size(1);
  p.Lq = max_q;
  p.Lk = max_k;
  p.D = q.size(2);
  p.Dv = v.size(2);
  p.mask_kind = cpu::MaskKind::none;
  if (defined(alibi)) {  // float32 (B, Hq): varlen_attention::check_varlen
    p.alibi = alibi->data_ptr<float>();
    p.alibi_sb = alibi->stride(0);
    p.alibi_sh = alibi->stride(1);
  }
  p.scale = scale;
  p.softcap = softcap;
  p.dropout_p = dropout_p;
  if (dropout_p > 0.0) {
    const int64_t* s = seed->data_ptr<int64_t>();
    p.seed = static_cast<uint64_t>(s[0]);
    p.stream = static_cast<uint64_t>(s[1]);
  }
  p.cu_q = cu_q.data_ptr<int32_t>();
  p.cu_k = cu_k.data_ptr<int32_t>();
  p.total_q = q.size(0);
  p.causal_mode = static_cast<int>(causal_mode);
  p.window_left = wl;
  p.window_right = wr;
  return p;
}

#define FASTATTN_DISPATCH_VARLEN(TYPE, ...) \
  FASTATTN_DISPATCH_FLOATING(TYPE, "varlen_cpu", __VA_ARGS__)

std::tuple<Tensor, Tensor> varlen_attention_forward_cpu(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_q, const Tensor& cu_k,
    int64_t max_q, int64_t max_k, const optional<Tensor>& alibi, double scale, double softcap,
    int64_t causal_mode, int64_t wl, int64_t wr, double dropout_p, const optional<Tensor>& seed) {
  constexpr const char* op = "varlen_attention_forward";
  varlen_attention::check_varlen(q, k, v, cu_q, cu_k, max_q, max_k, alibi, dropout_p, seed, op);
  varlen_attention::check_cu_seqlens_on_host(q, k, cu_q, cu_k, max_q, max_k, op);
  Tensor out = empty({q.size(0), q.size(1), v.size(2)}, q.options());
  Tensor lse = empty({q.size(1), q.size(0)}, q.options().dtype(lse_dtype(q)));
  poison(out);
  poison(lse);
  if (out.numel() == 0 && lse.numel() == 0) return {out, lse};
  cpu::AttentionForwardParams fp{varlen_problem(q, k, v, cu_q, cu_k, max_q, max_k, alibi, scale,
                                                softcap, causal_mode, wl, wr, dropout_p, seed),
                                 out.data_ptr(), packed_strides(out), lse.data_ptr()};
  FASTATTN_DISPATCH_VARLEN(q.scalar_type(),
                           [&] { FASTATTN_CPU_ISA_CALL(attention_forward<scalar_t>, fp); });
  return {out, lse};
}

std::tuple<Tensor, Tensor, Tensor> varlen_attention_backward_cpu(
    const Tensor& grad_out, const optional<Tensor>& grad_lse, const Tensor& q, const Tensor& k,
    const Tensor& v, const Tensor& out, const Tensor& lse, const Tensor& cu_q, const Tensor& cu_k,
    int64_t max_q, int64_t max_k, const optional<Tensor>& alibi, double scale, double softcap,
    int64_t causal_mode, int64_t wl, int64_t wr, double dropout_p, const optional<Tensor>& seed,
    bool deterministic) {
  (void)deterministic;  // always deterministic (fixed summation order, no atomics)
  constexpr const char* op = "varlen_attention_backward";
  varlen_attention::check_varlen_backward(grad_out, grad_lse, q, k, v, out, lse, cu_q, cu_k, max_q,
                                          max_k, alibi, dropout_p, seed, op);
  varlen_attention::check_cu_seqlens_on_host(q, k, cu_q, cu_k, max_q, max_k, op);
  Tensor dlse;
  if (defined(grad_lse)) dlse = grad_lse->to(lse_dtype(q)).contiguous();
  Tensor dq = empty(q.sizes(), q.options());
  Tensor dk = empty(k.sizes(), k.options());
  Tensor dv = empty(v.sizes(), v.options());
  poison(dq);
  poison(dk);
  poison(dv);
  if (q.size(0) == 0 || k.size(0) == 0) {
    dq.zero_();
    dk.zero_();
    dv.zero_();
    return {dq, dk, dv};
  }
  cpu::AttentionBackwardParams bp{varlen_problem(q, k, v, cu_q, cu_k, max_q, max_k, alibi, scale,
                                                 softcap, causal_mode, wl, wr, dropout_p, seed),
                                  out.data_ptr(),
                                  packed_strides(out),
                                  grad_out.data_ptr(),
                                  packed_strides(grad_out),
                                  lse.data_ptr(),
                                  dlse.defined() ? dlse.data_ptr() : nullptr,
                                  dq.data_ptr(),
                                  dk.data_ptr(),
                                  dv.data_ptr(),
                                  packed_strides(dq),
                                  packed_strides(dk),
                                  packed_strides(dv)};
  FASTATTN_DISPATCH_VARLEN(q.scalar_type(),
                           [&] { FASTATTN_CPU_ISA_CALL(attention_backward<scalar_t>, bp); });
  return {dq, dk, dv};
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fastattn, CPU, m) {
  m.impl("varlen_attention_forward", TORCH_BOX(&varlen_attention_forward_cpu));
  m.impl("varlen_attention_backward", TORCH_BOX(&varlen_attention_backward_cpu));
}

}  // namespace fastattn::attention
