// The device preamble of every CUDA op that runs the attention kernels (attention,
// varlen_attention, attention_decode / attention_with_kvcache), in one place: the current
// stream, the shared memory a block may opt in to (capped by FASTATTN_CUDA_SMEM_LIMIT:
// smem_limit), and the compute capability the tensor-core kernels need. Included by the .cu op
// bodies only; the CPU emulator (tools/cuda_emu) builds its Launch from the emulated device.
#pragma once
#include "common/tensor_api.h"
#include <cuda_runtime_api.h>

#include "attention/attention_cuda_ops.h"

namespace fastattn::attention::cuda_impl {

// Streaming multiprocessors of the current device (the split-K decode sizes its splits by it).
inline int sm_count() {
  int device = 0, sms = 0;
  FASTATTN_CUDA_CHECK(cudaGetDevice(&device));
  FASTATTN_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return sms;
}

// Stream and shared-memory limit of the current device (the caller's device guard has made it
// q's); float16/bfloat16 need sm_80+ (tensor-core mma and cp.async).
inline Launch launch_for(const Tensor& q, const char* op) {
  int device = 0, major = 0, smem = 0;
  FASTATTN_CUDA_CHECK(cudaGetDevice(&device));
  FASTATTN_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  FASTATTN_CUDA_CHECK(
      cudaDeviceGetAttribute(&smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  if (q.scalar_type() == kHalf || q.scalar_type() == kBFloat16) {
    FASTATTN_CHECK(major >= 8, op,
                   "float16/bfloat16 attention on CUDA needs compute capability "
                   "8.0 or newer (tensor-core mma and cp.async), got ",
                   major, ".x");
  }
  return {static_cast<void*>(current_cuda_stream()), smem_limit(smem)};
}

}  // namespace fastattn::attention::cuda_impl
