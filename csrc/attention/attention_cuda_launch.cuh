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
#include "common/check.h"

#if !defined(FASTATTN_CUDA_EMULATION)
// Raises the block's dynamic shared-memory limit when it needs more than the default 48 KB.
#define FASTATTN_SET_KERNEL_SMEM(kernel, bytes)                                                  \
  do {                                                                                           \
    if ((bytes) > 48 * 1024) {                                                                   \
      FASTATTN_CUDA_CHECK(                                                                       \
          cudaFuncSetAttribute((kernel), cudaFuncAttributeMaxDynamicSharedMemorySize, (bytes))); \
    }                                                                                            \
  } while (0)
#endif

namespace fastattn::cuda::attn {

// The smallest opt-in shared memory per block of the GPUs the kernels support (sm_80+):
// sm_86/89/120 (RTX 30xx-50xx, A10, L4, L40) allow 99 KB; sm_80 (A100) 163 KB; sm_90/100
// (H100, H200, B200) 227 KB. Every case must run on each: the smallest variant of every kernel
// fits kSmemMinOptin (static_asserts below), larger variants are used where the device allows.
constexpr int kSmemMinOptin = 101376;

// Tile configurations per head-dim bucket, chosen so that no kernel spills registers (ptxas -v,
// sm_90; see docs/design/attention_cuda.md). Bytes of shared memory per block in [].
//   forward  64: 128 queries (2 m16 tiles per warp, 4 warps) x 64 keys            [36 KB]
//           128: 128 queries (8 warps)                       x 64 keys            [68 KB]
//           256:  64 queries (4 warps)                       x 32 keys            [66 KB]
//   dK/dV    64 keys per block, 64 queries per step; Q/dO double buffered at 64 [55 KB], single
//            at 128 [68.5 KB]; dK and dV in separate launches at 256 (their accumulators would
//            not fit together) [132.5 KB each]; below 132.5 KB (99 KB devices) steps of 16
//            queries at 256 [82.6 KB] (KVSmall)
//   dQ       64 queries per block; 64 keys per step (32 at 256); K/V double buffered up to 128
//            [54 / 102 / 99 KB]; below 102 KB (99 KB devices) K/V single buffered at 128
//            [68 KB] (QSmall)
// A Small config equal to the large one adds no instantiation; the launcher takes the large one
// whenever it fits the device (run_bwd_mma). The dK/dV kernels that also add d attn_mask
// (kDBias, mask_grad only) are separate instantiations; their dS adds spill a little at 128
// (28 bytes) and at 256 with 64 queries (12/44 bytes stores/loads; 12/12 without d attn_mask),
// ptxas -v, sm_90, CUDA 13.0.
template <int kHD>
struct MmaConfigs;
template <>
struct MmaConfigs<64> {
  using Fwd = FwdConfig<64, 2, 4, 64>;
  using KV = BwdKVConfig<64, 2, kOutBoth>;
  using KVSmall = KV;
  using Q = BwdQConfig<64, 2, 64>;
  using QSmall = Q;
};
template <>
struct MmaConfigs<128> {
  using Fwd = FwdConfig<128, 1, 8, 64>;
  using KV = BwdKVConfig<128, 1, kOutBoth>;
  using KVSmall = KV;
  using Q = BwdQConfig<128, 2, 64>;
  // Single-buffered K/V (as dQ at 256). 32-key steps double buffered (same bytes) would keep
  // the prefetch but spill 108 bytes on sm_120 (ptxas -v, CUDA 13.0), where it runs.
  using QSmall = BwdQConfig<128, 1, 64>;
};
template <>
struct MmaConfigs<256> {
  using Fwd = FwdConfig<256, 1, 4, 32>;
  using KV = BwdKVConfig<256, 1, kOutDV>;
  using KV2 = BwdKVConfig<256, 1, kOutDK>;
  // 32 queries per step would need 101632 bytes (256 over): 16 it is.
  using KVSmall = BwdKVConfig<256, 1, kOutDV, 16>;
  using KV2Small = BwdKVConfig<256, 1, kOutDK, 16>;
  using Q = BwdQConfig<256, 1, 32>;  // exactly 101376 bytes
  using QSmall = Q;
};

template <int kHD>
constexpr bool mma_bucket_fits_min_optin() {
  using C = MmaConfigs<kHD>;
  bool ok = C::Fwd::kSmemBytes <= kSmemMinOptin && C::KVSmall::kSmemBytes <= kSmemMinOptin &&
            C::QSmall::kSmemBytes <= kSmemMinOptin;
  if constexpr (kHD == 256) ok = ok && C::KV2Small::kSmemBytes <= kSmemMinOptin;
  return ok;
}
static_assert(mma_bucket_fits_min_optin<64>(), "bucket 64 must run on 99 KB devices");
static_assert(mma_bucket_fits_min_optin<128>(), "bucket 128 must run on 99 KB devices");
static_assert(mma_bucket_fits_min_optin<256>(), "bucket 256 must run on 99 KB devices");

inline void check_smem(int bytes, const Launch& launch, const char* kernel) {
  FASTATTN_CHECK(bytes <= launch.smem_optin, "attention (cuda)", "kernel ", kernel, " needs ",
                 bytes, " bytes of shared memory per block, the device allows ", launch.smem_optin,
                 " (head dims too large for this GPU)");
}

inline unsigned grid_size(int64_t blocks, const char* kernel) {
  FASTATTN_CHECK(blocks > 0 && blocks <= INT32_MAX, "attention (cuda)", "kernel ", kernel,
                 " would need ", blocks, " blocks");
  return static_cast<unsigned>(blocks);
}

template <typename Elem, int kHD>
void run_fwd_mma(const FwdParams& fp, const Launch& launch) {
  using Cfg = typename MmaConfigs<kHD>::Fwd;
  const Problem& p = fp.p;
  const bool features = needs_features(p);
  auto kernel = features ? attention_fwd_mma_kernel<Elem, Cfg, true>
                         : attention_fwd_mma_kernel<Elem, Cfg, false>;
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

// The (batch, kv head) groups of the dK/dV grid: B * Hkv, fewer when blocks walk the batches or
// kv heads (loop_b / loop_h of a deterministic d attn_mask; dkdv_pair).
inline int64_t dkdv_pair_groups(const BwdParams& bp) {
  FASTATTN_CHECK(
      bp.loop_b >= 1 && bp.loop_h >= 1 && bp.p.B % bp.loop_b == 0 && bp.p.Hkv % bp.loop_h == 0,
      "attention (cuda)", "dK/dV loops must divide B and Hkv");
  return static_cast<int64_t>(bp.p.B / bp.loop_b) * (bp.p.Hkv / bp.loop_h);
}

template <typename Elem, typename Cfg>
void run_bwd_dkdv_mma(const BwdParams& bp, const Launch& launch) {
  const Problem& p = bp.p;
  const bool features = needs_features(p);
  auto kernel = features ? attention_bwd_dkdv_mma_kernel<Elem, Cfg, true, false>
                         : attention_bwd_dkdv_mma_kernel<Elem, Cfg, false, false>;
  int64_t groups = static_cast<int64_t>(p.B) * p.Hkv;
  if constexpr ((Cfg::kOut & kOutDK) != 0) {  // d attn_mask comes with dS, i.e. with dK
    if (bp.dbias_mode != kDBiasNone) {
      FASTATTN_CHECK(features, "attention (cuda)", "a mask gradient without a mask");
      kernel = attention_bwd_dkdv_mma_kernel<Elem, Cfg, true, true>;
      groups = dkdv_pair_groups(bp);
    }
  }
  const int64_t blocks = static_cast<int64_t>((p.Lk + Cfg::kBlockN - 1) / Cfg::kBlockN) * groups;
  check_smem(Cfg::kSmemBytes, launch, "attention_bwd_dkdv_mma");
  FASTATTN_SET_KERNEL_SMEM(kernel, Cfg::kSmemBytes);
  FASTATTN_LAUNCH_KERNEL(kernel, grid_size(blocks, "attention_bwd_dkdv_mma"), Cfg::kThreads,
                         Cfg::kSmemBytes, launch.stream, bp);
  FASTATTN_CUDA_LAUNCH_CHECK();
}

template <typename Elem, typename Cfg>
void run_bwd_dq_mma(const BwdParams& bp, const Launch& launch) {
  const Problem& p = bp.p;
  const bool features = needs_features(p);
  auto kernel = features ? attention_bwd_dq_mma_kernel<Elem, Cfg, true>
                         : attention_bwd_dq_mma_kernel<Elem, Cfg, false>;
  const int64_t blocks =
      static_cast<int64_t>((p.Lq + Cfg::kBlockM - 1) / Cfg::kBlockM) * p.B * p.Hq;
  check_smem(Cfg::kSmemBytes, launch, "attention_bwd_dq_mma");
  FASTATTN_SET_KERNEL_SMEM(kernel, Cfg::kSmemBytes);
  FASTATTN_LAUNCH_KERNEL(kernel, grid_size(blocks, "attention_bwd_dq_mma"), Cfg::kThreads,
                         Cfg::kSmemBytes, launch.stream, bp);
  FASTATTN_CUDA_LAUNCH_CHECK();
}

// Each kernel takes the large configuration when the device allows it, else the small one.
template <typename Elem, int kHD>
void run_bwd_mma(const BwdParams& bp, const Launch& launch) {
  using C = MmaConfigs<kHD>;
  run_bwd_delta<Elem, float, uint16_t>(bp, launch);
  if (C::KV::kSmemBytes <= launch.smem_optin) {
    run_bwd_dkdv_mma<Elem, typename C::KV>(bp, launch);
  } else {
    run_bwd_dkdv_mma<Elem, typename C::KVSmall>(bp, launch);
  }
  if constexpr (kHD == 256) {
    if (C::KV2::kSmemBytes <= launch.smem_optin) {
      run_bwd_dkdv_mma<Elem, typename C::KV2>(bp, launch);
    } else {
      run_bwd_dkdv_mma<Elem, typename C::KV2Small>(bp, launch);
    }
  }
  if (C::Q::kSmemBytes <= launch.smem_optin) {
    run_bwd_dq_mma<Elem, typename C::Q>(bp, launch);
  } else {
    run_bwd_dq_mma<Elem, typename C::QSmall>(bp, launch);
  }
}

// SIMT (float32/float64) variants. Forward: kR rows per warp, fewer for float64 where the
// default tile does not fit (above D ~ 252 on 99 KB devices). Backward: the D-split (kChunked)
// where the whole-row tiles do not fit (float32 above D + Dv = 361-377 on 99 KB devices, float64
// above 239-250 on 99 KB and 410-421 on 163 KB; dK/dV first). float32 has no smaller forward
// (kR equal: no second instantiation).
template <typename T>
inline constexpr int kSimtFwdSmallR = sizeof(T) == 4 ? kSimtR<T> : 2;

static_assert(SimtSmem<float, kSimtFwdSmallR<float>>::fwd(256, 256) <= kSmemMinOptin &&
                  SimtSmem<double, kSimtFwdSmallR<double>>::fwd(256, 256) <= kSmemMinOptin,
              "the small SIMT forward must run D = Dv = 256 on 99 KB devices");
static_assert(SimtSmem<float>::dkdv(256, 256, true) <= kSmemMinOptin &&
                  SimtSmem<double>::dkdv(256, 256, true) <= kSmemMinOptin &&
                  SimtSmem<float>::dq(256, 256, true) <= kSmemMinOptin &&
                  SimtSmem<double>::dq(256, 256, true) <= kSmemMinOptin,
              "the D-split SIMT backward must run D = Dv = 256 on 99 KB devices");

template <typename T, int kR>
void run_fwd_simt_tile(const FwdParams& fp, const Launch& launch) {
  using Cfg = SimtConfig<T, kR>;
  const Problem& p = fp.p;
  auto kernel = attention_fwd_simt_kernel<T, kR>;
  const int smem = SimtSmem<T, kR>::fwd(p.D, p.Dv);
  const int64_t blocks = static_cast<int64_t>((p.Lq + Cfg::kRows - 1) / Cfg::kRows) * p.B * p.Hq *
                         std::max(fp.num_splits, 1);
  check_smem(smem, launch, "attention_fwd_simt");
  FASTATTN_SET_KERNEL_SMEM(kernel, smem);
  FASTATTN_LAUNCH_KERNEL(kernel, grid_size(blocks, "attention_fwd_simt"), Cfg::kThreads, smem,
                         launch.stream, fp);
  FASTATTN_CUDA_LAUNCH_CHECK();
}

template <typename T>
void run_fwd_simt(const FwdParams& fp, const Launch& launch) {
  if (SimtSmem<T>::fwd(fp.p.D, fp.p.Dv) <= launch.smem_optin) {
    run_fwd_simt_tile<T, kSimtR<T>>(fp, launch);
  } else {
    run_fwd_simt_tile<T, kSimtFwdSmallR<T>>(fp, launch);
  }
}

template <typename T, bool kChunked>
void run_bwd_dkdv_simt(const BwdParams& bp, const Launch& launch) {
  using Cfg = SimtConfig<T>;
  const Problem& p = bp.p;
  auto kernel = attention_bwd_dkdv_simt_kernel<T, kChunked>;
  const int smem = SimtSmem<T>::dkdv(p.D, p.Dv, kChunked);
  const int64_t blocks =
      static_cast<int64_t>((p.Lk + Cfg::kRows - 1) / Cfg::kRows) * dkdv_pair_groups(bp);
  check_smem(smem, launch, "attention_bwd_dkdv_simt");
  FASTATTN_SET_KERNEL_SMEM(kernel, smem);
  FASTATTN_LAUNCH_KERNEL(kernel, grid_size(blocks, "attention_bwd_dkdv_simt"), Cfg::kThreads, smem,
                         launch.stream, bp);
  FASTATTN_CUDA_LAUNCH_CHECK();
}

template <typename T, bool kChunked>
void run_bwd_dq_simt(const BwdParams& bp, const Launch& launch) {
  using Cfg = SimtConfig<T>;
  const Problem& p = bp.p;
  auto kernel = attention_bwd_dq_simt_kernel<T, kChunked>;
  const int smem = SimtSmem<T>::dq(p.D, p.Dv, kChunked);
  const int64_t blocks = static_cast<int64_t>((p.Lq + Cfg::kRows - 1) / Cfg::kRows) * p.B * p.Hq;
  check_smem(smem, launch, "attention_bwd_dq_simt");
  FASTATTN_SET_KERNEL_SMEM(kernel, smem);
  FASTATTN_LAUNCH_KERNEL(kernel, grid_size(blocks, "attention_bwd_dq_simt"), Cfg::kThreads, smem,
                         launch.stream, bp);
  FASTATTN_CUDA_LAUNCH_CHECK();
}

template <typename T>
void run_bwd_simt(const BwdParams& bp, const Launch& launch) {
  const Problem& p = bp.p;
  run_bwd_delta<prim::F16, T, T>(bp, launch);  // prim::F16 is unused for float storage
  if (SimtSmem<T>::dkdv(p.D, p.Dv, false) <= launch.smem_optin) {
    run_bwd_dkdv_simt<T, false>(bp, launch);
  } else {
    run_bwd_dkdv_simt<T, true>(bp, launch);
  }
  if (SimtSmem<T>::dq(p.D, p.Dv, false) <= launch.smem_optin) {
    run_bwd_dq_simt<T, false>(bp, launch);
  } else {
    run_bwd_dq_simt<T, true>(bp, launch);
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
