// Instantiation of the float32/float64 (SIMT, exact FMA) attention kernels.
#include "attention/attention_cuda_launch.cuh"

namespace fastattn::cuda::attn {
void attention_fwd_simt(Dtype dtype, const FwdParams& params, const Launch& launch) {
  if (dtype == Dtype::f64) {
    run_fwd_simt<double>(params, launch);
  } else {
    run_fwd_simt<float>(params, launch);
  }
}

void attention_bwd_simt(Dtype dtype, const BwdParams& params, const Launch& launch) {
  if (dtype == Dtype::f64) {
    run_bwd_simt<double>(params, launch);
  } else {
    run_bwd_simt<float>(params, launch);
  }
}

void attention_combine(Dtype dtype, const FwdParams& params, const Launch& launch) {
  switch (dtype) {
    case Dtype::f16:
      run_combine<prim::F16, uint16_t>(params, launch);
      break;
    case Dtype::bf16:
      run_combine<prim::BF16, uint16_t>(params, launch);
      break;
    case Dtype::f32:
      run_combine<prim::F16, float>(params, launch);
      break;  // F16 unused
    default:
      FASTATTN_CHECK(false, "attention (cuda)", "split-K partials are not used for float64");
  }
}
}  // namespace fastattn::cuda::attn
