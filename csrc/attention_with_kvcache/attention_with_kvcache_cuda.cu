// CUDA body of attention over a KV cache (attention_decode, registered for the CUDA dispatch
// key). The op logic lives in attention_with_kvcache_cuda_ops.h (shared with the CPU emulator of
// tools/cuda_emu): the dense CUDA attention forward kernels of csrc/attention with per-sequence
// key lengths and query positions read on the device, split over the keys (flash-decoding) with
// float32 partials and a combine kernel. This file adds the device guard, the current stream and
// the device limits, and registers the op. The append of k_new/v_new and the rotary embedding
// run before it (fastattn/ops/attention_with_kvcache.py: fastattn's rotary kernel and a scatter).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include <torch/library.h>

#include "attention_with_kvcache/attention_with_kvcache_cuda_ops.h"

namespace fastattn::attention_with_kvcache {
namespace {

using at::Tensor;
using c10::optional;

std::tuple<Tensor, Tensor> attention_decode_cuda(const Tensor& q, const Tensor& k_cache,
                                                 const Tensor& v_cache, const Tensor& k_lengths,
                                                 const Tensor& q_positions,
                                                 const optional<Tensor>& alibi, double scale,
                                                 double softcap, int64_t causal_mode, int64_t wl,
                                                 int64_t wr, int64_t num_splits) {
  constexpr const char* op = "attention_decode";
  FASTATTN_CHECK(q.is_cuda(), op, "q must be a CUDA tensor, got ", q.device());
  c10::cuda::CUDAGuard guard(q.device());
  int device = 0, major = 0, smem = 0, sms = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  C10_CUDA_CHECK(
      cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  if (q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16) {
    FASTATTN_CHECK(major >= 8, op, "float16/bfloat16 attention on CUDA needs compute capability "
                   "8.0 or newer (tensor-core mma and cp.async), got ", major, ".x");
  }
  const fastattn::cuda::attn::Launch launch{
      static_cast<void*>(c10::cuda::getCurrentCUDAStream().stream()), smem};
  return cuda_impl::decode(q, k_cache, v_cache, k_lengths, q_positions, alibi, scale, softcap,
                           causal_mode, wl, wr, num_splits, sms, launch);
}

}  // namespace

TORCH_LIBRARY_IMPL(fastattn, CUDA, m) {
  m.impl("attention_decode", &attention_decode_cuda);
}

}  // namespace fastattn::attention_with_kvcache
