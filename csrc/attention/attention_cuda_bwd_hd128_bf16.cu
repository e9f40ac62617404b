// Instantiation of the backward tensor-core attention kernels for head-dim bucket 128, bf16
// (one translation unit per direction, bucket and dtype, so builds parallelise).
#include "attention/attention_cuda_launch.cuh"

namespace fastattn::cuda::attn {
void attention_bwd_mma_bf16_hd128(const BwdParams& params, const Launch& launch) {
  run_bwd_mma<prim::BF16, 128>(params, launch);
}
}  // namespace fastattn::cuda::attn
