// Instantiation of the forward tensor-core attention kernels for head-dim bucket 64, f16
// (one translation unit per direction, bucket and dtype, so builds parallelise).
#include "attention/attention_cuda_launch.cuh"

namespace fastattn::cuda::attn {
void attention_fwd_mma_f16_hd64(const FwdParams& params, const Launch& launch) {
  run_fwd_mma<prim::F16, 64>(params, launch);
}
}  // namespace fastattn::cuda::attn
