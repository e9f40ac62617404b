// CPU bodies of the additive-attention score ops.
#include "common/tensor_api.h"

#include "additive_attention/additive_attention.h"
#include "additive_attention/additive_attention_cpu_kernel.h"
#include "common/cpu_isa.h"
#include "common/debug.h"

namespace fastattn::additive_attention {
namespace {

#define FASTATTN_DISPATCH_ADDITIVE(TYPE, ...) \
  FASTATTN_DISPATCH_FLOATING(TYPE, "additive_cpu", __VA_ARGS__)

Tensor additive_scores_cpu(const Tensor& qp_in, const Tensor& kp_in, const Tensor& v_in) {
  constexpr const char* op = "additive_scores";
  check_scores_args(qp_in, kp_in, v_in, op);
  Tensor qp = qp_in.contiguous(), kp = kp_in.contiguous(), v = v_in.contiguous();
  Tensor scores =
      empty({qp.size(0), qp.size(1), kp.size(1)}, qp.options().dtype(compute_dtype(qp)));
  poison(scores);
  if (scores.numel() == 0) return scores;
  cpu::AdditiveScoresParams p{qp.data_ptr(), kp.data_ptr(), v.data_ptr(), qp.size(0),
                              qp.size(1),    kp.size(1),    qp.size(2),   scores.data_ptr(),
                              nullptr,       nullptr,       nullptr,      nullptr};
  FASTATTN_DISPATCH_ADDITIVE(qp.scalar_type(),
                             [&] { FASTATTN_CPU_ISA_CALL(additive_scores<scalar_t>, p); });
  return scores;
}

std::tuple<Tensor, Tensor, Tensor> additive_scores_backward_cpu(const Tensor& grad_in,
                                                                const Tensor& qp_in,
                                                                const Tensor& kp_in,
                                                                const Tensor& v_in) {
  constexpr const char* op = "additive_scores_backward";
  check_scores_args(qp_in, kp_in, v_in, op);
  FASTATTN_CHECK(grad_in.dim() == 3 && grad_in.size(0) == qp_in.size(0) &&
                     grad_in.size(1) == qp_in.size(1) && grad_in.size(2) == kp_in.size(1),
                 op, "grad must be (B, Lq, Lk), got ", grad_in.sizes());
  Tensor qp = qp_in.contiguous(), kp = kp_in.contiguous(), v = v_in.contiguous();
  Tensor grad = grad_in.to(compute_dtype(qp)).contiguous();
  Tensor dqp = empty(qp.sizes(), qp.options());
  Tensor dkp = empty(kp.sizes(), kp.options());
  Tensor dv = empty(v.sizes(), v.options());
  poison(dqp);
  poison(dkp);
  poison(dv);
  cpu::AdditiveScoresParams p{qp.data_ptr(),   kp.data_ptr(),  v.data_ptr(),   qp.size(0),
                              qp.size(1),      kp.size(1),     qp.size(2),     nullptr,
                              grad.data_ptr(), dqp.data_ptr(), dkp.data_ptr(), dv.data_ptr()};
  FASTATTN_DISPATCH_ADDITIVE(qp.scalar_type(),
                             [&] { FASTATTN_CPU_ISA_CALL(additive_scores_backward<scalar_t>, p); });
  return {dqp, dkp, dv};
}

std::tuple<Tensor, Tensor> additive_context_cpu(const Tensor& scores_in, const Tensor& values_in,
                                                const std::optional<Tensor>& key_padding_mask) {
  constexpr const char* op = "additive_context";
  check_context_args(scores_in, values_in, key_padding_mask, op);
  Tensor scores = scores_in.contiguous(), values = values_in.contiguous();
  Tensor mask = key_padding_mask.has_value() ? key_padding_mask->contiguous() : Tensor();
  const int64_t B = scores.size(0), Lq = scores.size(1), Lk = scores.size(2);
  Tensor context = empty({B, Lq, values.size(2)}, values.options());
  Tensor weights = empty(scores.sizes(), scores.options());
  poison(context);
  poison(weights);
  if (context.numel() == 0 && weights.numel() == 0) return {context, weights};
  cpu::AdditiveContextParams p{};
  p.B = B, p.Lq = Lq, p.Lk = Lk, p.Dv = values.size(2);
  p.scores = scores.data_ptr(), p.values = values.data_ptr();
  p.mask = mask.defined() ? mask.data_ptr<bool>() : nullptr;
  p.weights = weights.data_ptr(), p.context = context.data_ptr();
  FASTATTN_DISPATCH_ADDITIVE(values.scalar_type(),
                             [&] { FASTATTN_CPU_ISA_CALL(additive_context<scalar_t>, p); });
  return {context, weights};
}

std::tuple<Tensor, Tensor> additive_context_backward_cpu(
    const Tensor& grad_context_in, const std::optional<Tensor>& grad_weights_in,
    const Tensor& weights_in, const Tensor& values_in) {
  constexpr const char* op = "additive_context_backward";
  check_context_args(weights_in, values_in, std::nullopt, op);
  const int64_t B = weights_in.size(0), Lq = weights_in.size(1), Lk = weights_in.size(2);
  FASTATTN_CHECK(grad_context_in.dim() == 3 && grad_context_in.size(0) == B &&
                     grad_context_in.size(1) == Lq && grad_context_in.size(2) == values_in.size(2),
                 op, "grad_context must be (B, Lq, Dv) = (", B, ", ", Lq, ", ", values_in.size(2),
                 "), got ", grad_context_in.sizes());
  Tensor values = values_in.contiguous(), weights = weights_in.contiguous();
  Tensor grad_context = grad_context_in.to(values.scalar_type()).contiguous();
  Tensor grad_weights;
  if (grad_weights_in.has_value()) {
    FASTATTN_CHECK(grad_weights_in->sizes() == weights.sizes(), op,
                   "grad_weights must be shaped like weights ", weights.sizes(), ", got ",
                   grad_weights_in->sizes());
    grad_weights = grad_weights_in->to(weights.scalar_type()).contiguous();
  }
  Tensor grad_scores = empty(weights.sizes(), weights.options());
  Tensor grad_values = empty(values.sizes(), values.options());
  poison(grad_scores);
  poison(grad_values);
  if (grad_scores.numel() == 0 && grad_values.numel() == 0) return {grad_scores, grad_values};
  cpu::AdditiveContextParams p{};
  p.B = B, p.Lq = Lq, p.Lk = Lk, p.Dv = values.size(2);
  p.values = values.data_ptr(), p.weights = weights.data_ptr();
  p.grad_context = grad_context.data_ptr();
  p.grad_weights = grad_weights.defined() ? grad_weights.data_ptr() : nullptr;
  p.grad_scores = grad_scores.data_ptr(), p.grad_values = grad_values.data_ptr();
  FASTATTN_DISPATCH_ADDITIVE(
      values.scalar_type(), [&] { FASTATTN_CPU_ISA_CALL(additive_context_backward<scalar_t>, p); });
  return {grad_scores, grad_values};
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fastattn, CPU, m) {
  m.impl("additive_scores", TORCH_BOX(&additive_scores_cpu));
  m.impl("additive_scores_backward", TORCH_BOX(&additive_scores_backward_cpu));
  m.impl("additive_context", TORCH_BOX(&additive_context_cpu));
  m.impl("additive_context_backward", TORCH_BOX(&additive_context_backward_cpu));
}

}  // namespace fastattn::additive_attention
