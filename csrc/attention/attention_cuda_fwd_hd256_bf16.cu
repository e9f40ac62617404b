// Instantiation of the forward tensor-core attention kernels for head-dim bucket 256, bf16
// (one translation unit per direction, bucket and dtype, so builds parallelise).
#include "attention/attention_cuda_launch.cuh"

namespace fastattn::cuda::attn {
void attention_fwd_mma_bf16_hd256(const FwdParams& params, const Launch& launch) {
  run_fwd_mma<prim::BF16, 256>(params, launch);
}
}  // namespace fastattn::cuda::attn
