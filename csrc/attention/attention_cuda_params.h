// Plain kernel arguments of the CUDA attention kernels and the entry points of the kernel
// translation units (attention_cuda_{fwd,bwd}_hd*_{f16,bf16}.cu, attention_cuda_simt.cu).
// No torch and no CUDA headers: the kernel TUs include only this and the .cuh bodies, which
// keeps each of them quick to compile (shared/TOOLCHAIN.md). attention_cuda.cu fills these
// from tensors (attention_cuda_ops.h) and calls the entry points.
#pragma once
#include <cstdint>

namespace fastattn::cuda::attn {

// Element type of q/k/v/out and their gradients.
enum class Dtype : int { f16 = 0, bf16 = 1, f32 = 2, f64 = 3 };

// attn_mask element type (cpu::MaskKind's numbering).
enum MaskKind : int { kMaskNone = 0, kMaskBool = 1, kMaskF32 = 2, kMaskF64 = 3, kMaskF16 = 4,
                      kMaskBF16 = 5 };

// What every kernel reads: the problem as the canonical arguments describe it
// (fastattn/reference/attention.py). Strides are in elements; every last stride is 1.
struct Problem {
  Dtype dtype;  // of q, k, v, out and the gradients
  const void* q;
  const void* k;
  const void* v;
  int64_t q_sb, q_sh, q_sl;
  int64_t k_sb, k_sh, k_sl;
  int64_t v_sb, v_sh, v_sl;
  int B, Hq, Hkv, Lq, Lk, D, Dv;
  int group;  // Hq / Hkv: query head h reads kv head h / group

  // attn_mask viewed as (B, Hq, Lq, Lk) through 4 strides (any of them may be 0).
  const void* mask;
  int mask_kind;
  int64_t mask_sb, mask_sh, mask_sq, mask_sk;
  const uint8_t* padding;  // key_padding_mask (B, Lk) contiguous bool, true = ignore; or null
  const float* alibi;      // (B, Hq) float32 view; or null
  int64_t alibi_sb, alibi_sh;

  double scale;    // s = scale * q.k
  double softcap;  // > 0: s = softcap * tanh(s / softcap)
  // Key j is visible to query i iff i + window_lo <= j <= i + window_hi. Clamped on the host to
  // [-Lq, Lk] (the same visibility), so i + window_* never overflows an int.
  int window_lo, window_hi;

  // Dropout: element e = ((b*Hq + h)*Lq + i)*Lk + j of the Philox stream (common/philox.h) is
  // kept iff uniform(e) >= dropout_threshold, and kept probabilities are scaled by keep_scale.
  bool dropout;
  float dropout_threshold;  // (float) p
  double keep_scale;        // 1 / (1 - p), rounded to the compute type in the kernel
  const int64_t* seed;      // device int64 (2,) = (seed, stream), read inside the kernels

  // 16-byte alignment of every row of q, k, v (base pointer and the three outer strides):
  // tiles of an aligned tensor are copied with cp.async, others with scalar loads.
  bool q_aligned, k_aligned, v_aligned;
};

struct FwdParams {
  Problem p;
  void* out;  // (B, Hq, Lq, Dv) view
  int64_t o_sb, o_sh, o_sl;
  void* lse;  // (B, Hq, Lq) contiguous, float (double for double inputs)
};

struct BwdParams {
  Problem p;
  const void* out;
  int64_t o_sb, o_sh, o_sl;
  const void* dout;  // grad_out, (B, Hq, Lq, Dv) view (outer strides may be 0)
  int64_t do_sb, do_sh, do_sl;
  bool do_aligned;
  const void* lse;   // (B, Hq, Lq) contiguous, compute type
  const void* dlse;  // grad_lse, (B, Hq, Lq) contiguous compute type, or null
  void* delta;       // workspace (B, Hq, Lq) compute type: rowsum(dO * O) - grad_lse
  void* dq;          // contiguous (B, Hq, Lq, D)
  void* dk;          // contiguous (B, Hkv, Lk, D)
  void* dv;          // contiguous (B, Hkv, Lk, Dv)
};

// Head-dim buckets of the tensor-core kernels: max(D, Dv) is padded to the next bucket with
// zero-filled loads; the inner loops still stop at D and Dv rounded up to 16.
inline int mma_head_dim_bucket(int max_head_dim) {
  return max_head_dim <= 64 ? 64 : max_head_dim <= 128 ? 128 : 256;
}

// Launch context: the stream (cudaStream_t) and the device's opt-in shared memory per block.
struct Launch {
  void* stream;
  int smem_optin;  // bytes
};

// Entry points, one per translation unit. Each launches its kernels on launch.stream and checks
// every launch; a problem that does not fit the device raises a c10::Error.
#define FASTATTN_ATTN_ENTRY(DT, HD)                                              \
  void attention_fwd_mma_##DT##_hd##HD(const FwdParams&, const Launch&);         \
  void attention_bwd_mma_##DT##_hd##HD(const BwdParams&, const Launch&);
FASTATTN_ATTN_ENTRY(f16, 64)
FASTATTN_ATTN_ENTRY(f16, 128)
FASTATTN_ATTN_ENTRY(f16, 256)
FASTATTN_ATTN_ENTRY(bf16, 64)
FASTATTN_ATTN_ENTRY(bf16, 128)
FASTATTN_ATTN_ENTRY(bf16, 256)
#undef FASTATTN_ATTN_ENTRY

// float32 / float64: SIMT kernels with exact FMA arithmetic (attention_cuda_simt.cu).
void attention_fwd_simt(Dtype dtype, const FwdParams&, const Launch&);
void attention_bwd_simt(Dtype dtype, const BwdParams&, const Launch&);

}  // namespace fastattn::cuda::attn
