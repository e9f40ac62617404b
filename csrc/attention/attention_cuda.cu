// CUDA bodies of the attention ops (registered for the CUDA dispatch key). The op logic lives in
// attention_cuda_ops.h (shared with the CPU emulator of tools/cuda_emu); this file adds the
// device guard and the device preamble (attention_cuda_device.h), and registers the ops.
//
// Kernels: fp16/bf16 run FlashAttention-2 style tensor-core kernels (mma.sync m16n8k16,
// attention_cuda_{fwd,bwd}.cuh), instantiated per head-dim bucket 64/128/256 in
// attention_cuda_{fwd,bwd}_hd*_*.cu; float32/float64 run SIMT kernels with exact FMA arithmetic
// (attention_cuda_simt.cuh). The backward is deterministic (no atomics) except for d attn_mask
// of a mask broadcast over batches or kv heads with deterministic=False (atomic adds).
#include "common/cuda_api.h"

#include "attention/attention_cuda_device.h"
#include "attention/attention_cuda_ops.h"

namespace fastattn::attention {
namespace {

using std::optional;

using cuda_impl::launch_for;

std::tuple<Tensor, Tensor> attention_forward_cuda(const Tensor& q, const Tensor& k, const Tensor& v,
                                                  const optional<Tensor>& attn_mask,
                                                  const optional<Tensor>& key_padding_mask,
                                                  const optional<Tensor>& alibi_slopes,
                                                  double scale, double softcap, int64_t window_lo,
                                                  int64_t window_hi, double dropout_p,
                                                  const optional<Tensor>& seed) {
  CudaGuard guard(q);
  return cuda_impl::forward(q, k, v, attn_mask, key_padding_mask, alibi_slopes, scale, softcap,
                            window_lo, window_hi, dropout_p, seed,
                            launch_for(q, "attention_forward"));
}

std::tuple<Tensor, Tensor, Tensor, Tensor> attention_backward_cuda(
    const Tensor& grad_out, const optional<Tensor>& grad_lse, const Tensor& q, const Tensor& k,
    const Tensor& v, const Tensor& out, const Tensor& lse, const optional<Tensor>& attn_mask,
    const optional<Tensor>& key_padding_mask, const optional<Tensor>& alibi_slopes, double scale,
    double softcap, int64_t window_lo, int64_t window_hi, double dropout_p,
    const optional<Tensor>& seed, bool deterministic, bool mask_grad) {
  // dQ, dK, dV are always deterministic (reduced in a fixed order by separate kernels);
  // `deterministic` picks how d attn_mask (mask_grad) is summed (cuda_impl::setup_mask_grad).
  CudaGuard guard(q);
  return cuda_impl::backward(grad_out, grad_lse, q, k, v, out, lse, attn_mask, key_padding_mask,
                             alibi_slopes, scale, softcap, window_lo, window_hi, dropout_p, seed,
                             deterministic, mask_grad, launch_for(q, "attention_backward"));
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fastattn, CUDA, m) {
  m.impl("attention_forward", TORCH_BOX(&attention_forward_cuda));
  m.impl("attention_backward", TORCH_BOX(&attention_backward_cuda));
}

}  // namespace fastattn::attention
