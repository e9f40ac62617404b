// Launchers of the CUDA attention kernels: tile configuration per head-dim bucket, grid sizes,
// dynamic shared memory, launch checks. Included by one translation unit per (direction, bucket,
// dtype) (attention_cuda_{fwd,bwd}_hd{64,128,256}_{f16,bf16}.cu) and attention_cuda_simt.cu,
// and by tools/cuda_emu, which runs the same launchers on the CPU.
#pragma once
#include <algorithm>
#include <cstdint>

#include "attention/attention_cuda_bwd.cuh"
#include "attention/attention_cuda_fwd.cuh"
#include "attention/attention_cuda_params.h"
#include "attention/attention_cuda_simt.cuh"

#if !defined(FASTATTN_CUDA_EMULATION)
// Raises the block's dynamic shared-memory limit when it needs more than the default 48 KB.
#define FASTATTN_SET_KERNEL_SMEM(kernel, bytes)                                            \
  do {                                                                                      \
    if ((bytes) > 48 * 1024) {                                                              \
      C10_CUDA_CHECK(cudaFuncSetAttribute((kernel), cudaFuncAttributeMaxDynamicSharedMemorySize, \
                                          (bytes)));                                        \
    }                                                                                       \
  } while (0)
#endif

namespace fastattn::cuda::attn {

// Tile configurations per head-dim bucket, chosen so that no kernel spills registers (ptxas -v,
// sm_90; see benchmarks/notes/attention_cuda.md):
//   forward  64: 128 queries (2 m16 tiles per warp, 4 warps) x 64 keys
//           128: 128 queries (8 warps)                       x 64 keys
//           256:  64 queries (4 warps)                       x 32 keys
//   dK/dV    64 keys per block, 64 queries per step; Q/dO double buffered at 64; dK and dV in
//            separate launches at 256 (their accumulators would not fit together)
//   dQ       64 queries per block; 64 keys per step (32 at 256); K/V double buffered
//            up to 128
template <int kHD>
struct MmaConfigs;
template <>
struct MmaConfigs<64> {
  using Fwd = FwdConfig<64, 2, 4, 64>;
  using KV = BwdKVConfig<64, 2, kOutBoth>;
  using Q = BwdQConfig<64, 2, 64>;
};
template <>
struct MmaConfigs<128> {
  using Fwd = FwdConfig<128, 1, 8, 64>;
  using KV = BwdKVConfig<128, 1, kOutBoth>;
  using Q = BwdQConfig<128, 2, 64>;
};
template <>
struct MmaConfigs<256> {
  using Fwd = FwdConfig<256, 1, 4, 32>;
  using KV = BwdKVConfig<256, 1, kOutDV>;
  using KV2 = BwdKVConfig<256, 1, kOutDK>;
  using Q = BwdQConfig<256, 1, 32>;
};

inline void check_smem(int bytes, const Launch& launch, const char* kernel) {
  TORCH_CHECK(bytes <= launch.smem_optin, "attention (cuda): kernel ", kernel, " needs ", bytes,
              " bytes of shared memory per block, the device allows ", launch.smem_optin,
              " (head dims too large for this GPU)");
}

inline unsigned grid_size(int64_t blocks, const char* kernel) {
  TORCH_CHECK(blocks > 0 && blocks <= INT32_MAX, "attention (cuda): kernel ", kernel,
              " would need ", blocks, " blocks");
  return static_cast<unsigned>(blocks);
}

template <typename Elem, int kHD>
void run_fwd_mma(const FwdParams& fp, const Launch& launch) {
  using Cfg = typename MmaConfigs<kHD>::Fwd;
  const Problem& p = fp.p;
  auto kernel = attention_fwd_mma_kernel<Elem, Cfg>;
  const int64_t blocks = static_cast<int64_t>((p.Lq + Cfg::kBlockM - 1) / Cfg::kBlockM) * p.B *
                         p.Hq * std::max(fp.num_splits, 1);
  check_smem(Cfg::kSmemBytes, launch, "attention_fwd_mma");
  FASTATTN_SET_KERNEL_SMEM(kernel, Cfg::kSmemBytes);
  FASTATTN_LAUNCH_KERNEL(kernel, grid_size(blocks, "attention_fwd_mma"), Cfg::kThreads,
                         Cfg::kSmemBytes, launch.stream, fp);
  FASTATTN_CUDA_LAUNCH_CHECK();
}

template <typename Elem, typename acc, typename Storage>
void run_bwd_delta(const BwdParams& bp, const Launch& launch) {
  const Problem& p = bp.p;
  // lse's rows: (B, Hq, Lq), varlen (Hq, total_q)
  const int64_t rows = p.cu_q != nullptr ? static_cast<int64_t>(p.Hq) * p.total_q
                                         : static_cast<int64_t>(p.B) * p.Hq * p.Lq;
  if (rows == 0) return;
  auto kernel = attention_bwd_delta_kernel<Elem, acc, Storage>;
  FASTATTN_LAUNCH_KERNEL(kernel, grid_size((rows + 7) / 8, "attention_bwd_delta"), 256, 0,
                         launch.stream, bp);
  FASTATTN_CUDA_LAUNCH_CHECK();
}

template <typename Elem, typename Cfg>
void run_bwd_dkdv_mma(const BwdParams& bp, const Launch& launch) {
  const Problem& p = bp.p;
  auto kernel = attention_bwd_dkdv_mma_kernel<Elem, Cfg>;
  const int64_t blocks =
      static_cast<int64_t>((p.Lk + Cfg::kBlockN - 1) / Cfg::kBlockN) * p.B * p.Hkv;
  check_smem(Cfg::kSmemBytes, launch, "attention_bwd_dkdv_mma");
  FASTATTN_SET_KERNEL_SMEM(kernel, Cfg::kSmemBytes);
  FASTATTN_LAUNCH_KERNEL(kernel, grid_size(blocks, "attention_bwd_dkdv_mma"), Cfg::kThreads,
                         Cfg::kSmemBytes, launch.stream, bp);
  FASTATTN_CUDA_LAUNCH_CHECK();
}

template <typename Elem, int kHD>
void run_bwd_mma(const BwdParams& bp, const Launch& launch) {
  const Problem& p = bp.p;
  run_bwd_delta<Elem, float, uint16_t>(bp, launch);
  run_bwd_dkdv_mma<Elem, typename MmaConfigs<kHD>::KV>(bp, launch);
  if constexpr (kHD == 256) run_bwd_dkdv_mma<Elem, typename MmaConfigs<kHD>::KV2>(bp, launch);
  using QCfg = typename MmaConfigs<kHD>::Q;
  auto kernel = attention_bwd_dq_mma_kernel<Elem, QCfg>;
  const int64_t blocks =
      static_cast<int64_t>((p.Lq + QCfg::kBlockM - 1) / QCfg::kBlockM) * p.B * p.Hq;
  check_smem(QCfg::kSmemBytes, launch, "attention_bwd_dq_mma");
  FASTATTN_SET_KERNEL_SMEM(kernel, QCfg::kSmemBytes);
  FASTATTN_LAUNCH_KERNEL(kernel, grid_size(blocks, "attention_bwd_dq_mma"), QCfg::kThreads,
                         QCfg::kSmemBytes, launch.stream, bp);
  FASTATTN_CUDA_LAUNCH_CHECK();
}

template <typename T>
void run_fwd_simt(const FwdParams& fp, const Launch& launch) {
  using Cfg = SimtConfig<T>;
  const Problem& p = fp.p;
  auto kernel = attention_fwd_simt_kernel<T>;
  const int smem = SimtSmem<T>::fwd(p.D, p.Dv);
  const int64_t blocks = static_cast<int64_t>((p.Lq + Cfg::kRows - 1) / Cfg::kRows) * p.B * p.Hq *
                         std::max(fp.num_splits, 1);
  check_smem(smem, launch, "attention_fwd_simt");
  FASTATTN_SET_KERNEL_SMEM(kernel, smem);
  FASTATTN_LAUNCH_KERNEL(kernel, grid_size(blocks, "attention_fwd_simt"), Cfg::kThreads, smem,
                         launch.stream, fp);
  FASTATTN_CUDA_LAUNCH_CHECK();
}

template <typename T>
void run_bwd_simt(const BwdParams& bp, const Launch& launch) {
  using Cfg = SimtConfig<T>;
  const Problem& p = bp.p;
  run_bwd_delta<prim::F16, T, T>(bp, launch);  // prim::F16 is unused for float storage
  {
    auto kernel = attention_bwd_dkdv_simt_kernel<T>;
    const int smem = SimtSmem<T>::dkdv(p.D, p.Dv);
    const int64_t blocks =
        static_cast<int64_t>((p.Lk + Cfg::kRows - 1) / Cfg::kRows) * p.B * p.Hkv;
    check_smem(smem, launch, "attention_bwd_dkdv_simt");
    FASTATTN_SET_KERNEL_SMEM(kernel, smem);
    FASTATTN_LAUNCH_KERNEL(kernel, grid_size(blocks, "attention_bwd_dkdv_simt"), Cfg::kThreads,
                           smem, launch.stream, bp);
    FASTATTN_CUDA_LAUNCH_CHECK();
  }
  {
    auto kernel = attention_bwd_dq_simt_kernel<T>;
    const int smem = SimtSmem<T>::dq(p.D, p.Dv);
    const int64_t blocks =
        static_cast<int64_t>((p.Lq + Cfg::kRows - 1) / Cfg::kRows) * p.B * p.Hq;
    check_smem(smem, launch, "attention_bwd_dq_simt");
    FASTATTN_SET_KERNEL_SMEM(kernel, smem);
    FASTATTN_LAUNCH_KERNEL(kernel, grid_size(blocks, "attention_bwd_dq_simt"), Cfg::kThreads,
                           smem, launch.stream, bp);
    FASTATTN_CUDA_LAUNCH_CHECK();
  }
}

// Merge of the split-K partials: one warp per row (8 rows per block).
template <typename Elem, typename Storage>
void run_combine(const FwdParams& fp, const Launch& launch) {
  const Problem& p = fp.p;
  const int64_t rows = static_cast<int64_t>(p.B) * p.Hq * p.Lq;
  if (rows == 0) return;
  auto kernel = attention_combine_kernel<Elem, Storage>;
  FASTATTN_LAUNCH_KERNEL(kernel, grid_size((rows + 7) / 8, "attention_combine"), 256, 0,
                         launch.stream, fp);
  FASTATTN_CUDA_LAUNCH_CHECK();
}

}  // namespace fastattn::cuda::attn
