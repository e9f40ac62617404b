// CUDA bodies of packed variable-length attention (registered for the CUDA dispatch key). The op
// logic lives in varlen_attention_cuda_ops.h (shared with the CPU emulator of tools/cuda_emu):
// it runs the dense CUDA attention kernels of csrc/attention with per-sequence offsets read from
// cu_seqlens on the device (one grid over max_seqlen query tiles x B x H; tiles past the end
// of their sequence exit at once). This file adds the device guard and the device preamble
// (attention/attention_cuda_device.h), and registers the ops. The backward is always deterministic.
#include "common/cuda_api.h"

#include "attention/attention_cuda_device.h"
#include "common/device_checks.h"
#include "varlen_attention/varlen_attention_cuda_ops.h"

#include <string>

namespace fastattn::varlen_attention {
namespace {

using std::optional;

using fastattn::attention::cuda_impl::launch_for;

// The values of cu_seqlens, checked on the device (no host read): the kernels read rows
// [cu[b], cu[b+1]) of the packed tensors and size their grids by max_seqlen.
void check_cu_seqlens_on_device(const Tensor& q, const Tensor& k, const Tensor& cu_q,
                                const Tensor& cu_k, int64_t max_q, int64_t max_k, const char* op) {
  const std::string rule =
      " must start at 0, end at the packed length and be non-decreasing "
      "with steps <= max_seqlen";
  device_checks::require_prefix_sums(cu_q, q.size(0), max_q,
                                     std::string(op) + ": cu_seqlens_q" + rule + "_q");
  device_checks::require_prefix_sums(cu_k, k.size(0), max_k,
                                     std::string(op) + ": cu_seqlens_k" + rule + "_k");
}

std::tuple<Tensor, Tensor> varlen_attention_forward_cuda(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_q, const Tensor& cu_k,
    int64_t max_q, int64_t max_k, const optional<Tensor>& alibi, double scale, double softcap,
    int64_t causal_mode, int64_t wl, int64_t wr, double dropout_p, const optional<Tensor>& seed) {
  FASTATTN_CHECK(q.is_cuda(), "varlen_attention_forward", "q must be a CUDA tensor, got ",
                 q.device());
  CudaGuard guard(q);
  check_varlen(q, k, v, cu_q, cu_k, max_q, max_k, alibi, dropout_p, seed,
               "varlen_attention_forward");
  check_cu_seqlens_on_device(q, k, cu_q, cu_k, max_q, max_k, "varlen_attention_forward");
  return cuda_impl::forward(q, k, v, cu_q, cu_k, max_q, max_k, alibi, scale, softcap, causal_mode,
                            wl, wr, dropout_p, seed, launch_for(q, "varlen_attention_forward"));
}

std::tuple<Tensor, Tensor, Tensor> varlen_attention_backward_cuda(
    const Tensor& grad_out, const optional<Tensor>& grad_lse, const Tensor& q, const Tensor& k,
    const Tensor& v, const Tensor& out, const Tensor& lse, const Tensor& cu_q, const Tensor& cu_k,
    int64_t max_q, int64_t max_k, const optional<Tensor>& alibi, double scale, double softcap,
    int64_t causal_mode, int64_t wl, int64_t wr, double dropout_p, const optional<Tensor>& seed,
    bool deterministic) {
  // Always deterministic: dK/dV and dQ are reduced in a fixed order by separate kernels.
  (void)deterministic;
  FASTATTN_CHECK(q.is_cuda(), "varlen_attention_backward", "q must be a CUDA tensor, got ",
                 q.device());
  CudaGuard guard(q);
  check_varlen(q, k, v, cu_q, cu_k, max_q, max_k, alibi, dropout_p, seed,
               "varlen_attention_backward");
  check_cu_seqlens_on_device(q, k, cu_q, cu_k, max_q, max_k, "varlen_attention_backward");
  return cuda_impl::backward(grad_out, grad_lse, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, alibi,
                             scale, softcap, causal_mode, wl, wr, dropout_p, seed,
                             launch_for(q, "varlen_attention_backward"));
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fastattn, CUDA, m) {
  m.impl("varlen_attention_forward", TORCH_BOX(&varlen_attention_forward_cuda));
  m.impl("varlen_attention_backward", TORCH_BOX(&varlen_attention_backward_cuda));
}

}  // namespace fastattn::varlen_attention
