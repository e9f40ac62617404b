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

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fastattn, CPU, m) {
  m.impl("additive_scores", TORCH_BOX(&additive_scores_cpu));
  m.impl("additive_scores_backward", TORCH_BOX(&additive_scores_backward_cpu));
}

}  // namespace fastattn::additive_attention
