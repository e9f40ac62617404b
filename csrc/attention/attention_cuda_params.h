// Plain kernel arguments of the CUDA attention kernels and the entry points of the kernel
// translation units (attention_cuda_{fwd,bwd}_hd*_{f16,bf16}.cu, attention_cuda_simt.cu).
// No torch and no CUDA headers: the kernel TUs include only this and the .cuh bodies, which
// keeps each of them quick to compile (no torch header is parsed). attention_cuda.cu fills these
// from tensors (attention_cuda_ops.h) and calls the entry points.
#pragma once
#include <cstdint>

namespace fastattn::cuda::attn {

// Element type of q/k/v/out and their gradients.
enum class Dtype : int { f16 = 0, bf16 = 1, f32 = 2, f64 = 3 };

// attn_mask element type (cpu::MaskKind's numbering).
enum MaskKind : int {
  kMaskNone = 0,
  kMaskBool = 1,
  kMaskF32 = 2,
  kMaskF64 = 3,
  kMaskF16 = 4,
  kMaskBF16 = 5
};

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

  // Per-sequence geometry, the rule of cpu::AttentionProblem (all null: dense).
  //  - varlen (cu_q != null): q/k/v (and out, dO, dQ, dK, dV) are packed (total, H, D) seen with
  //    batch stride 0; sequence b owns query rows [cu_q[b], cu_q[b+1]) and key rows
  //    [cu_k[b], cu_k[b+1]); B is the number of sequences, Lq/Lk are max_seqlen_q/k (the grid
  //    covers Lq query tiles x B x H); lse is (Hq, total_q). Dropout element of (b, h, i, j) is
  //    ((cu_q[b] + i) * Hq + h) * Lk + j.
  //  - KV cache (k_lengths != null): sequence b sees keys [0, k_lengths[b]) of its (dense) cache
  //    rows and its query i sits at key position q_positions[b] + i. Forward only, no dropout.
  // The band of a sequence: causal_mode 0 off, 1 top-left, 2 at the query position (bottom-right
  // for varlen); window_left/right -1 = unbounded, else clamped to 2^30. The int32 arrays live
  // on the device; select_sequence() (attention_cuda_common.cuh) turns a kernel's copy of the
  // problem into the dense problem of its sequence.
  const int32_t* cu_q;
  const int32_t* cu_k;
  const int32_t* k_lengths;
  const int32_t* q_positions;
  //  - paged KV cache (block_table != null, with k_lengths): k/v are pools of blocks of page_size
  //    rows, k_sb/v_sb the stride of one block; key j of sequence b is row j % page_size of block
  //    block_table[b * block_table_stride + j / page_size] (device int32). Lk is the table's
  //    capacity. Forward only (the forward kernels address their K/V tiles through kv_rows).
  const int32_t* block_table;
  int64_t block_table_stride;
  int page_size;
  int num_blocks, table_cols;  // the pools' blocks and the table's width (the emulator's ranges)
  int total_q, total_k;        // varlen: packed row counts
  int drop_lk;                 // varlen: max_seqlen_k (the dropout numbering's key count)
  int causal_mode, window_left, window_right;
  // Set by select_sequence (dense: 0 and Lk - Lq): first packed query row of the sequence, and
  // the ALiBi shift (query i sits at key position i + shift).
  int q_row0;
  int shift;
};

struct FwdParams {
  Problem p;
  void* out;  // (B, Hq, Lq, Dv) view
  int64_t o_sb, o_sh, o_sl;
  void* lse;  // (B, Hq, Lq) contiguous (varlen: (Hq, total_q)), float (double for double)
  // Split-K (flash-decoding, KV cache): num_splits > 1 splits every row's visible key tiles into
  // that many ranges, one block each (grid x num_splits); block s writes its normalised partial
  // output and lse in float32 to part_out (num_splits, B, Hq, Lq, Dv) / part_lse (num_splits, B,
  // Hq, Lq), contiguous, instead of out/lse, and attention_combine_kernel merges them
  // (merge_attention's math). Not for float64.
  int num_splits;
  float* part_out;
  float* part_lse;
};

// BwdParams::dbias_mode.
enum DBiasMode : int { kDBiasNone = 0, kDBiasStore = 1, kDBiasAdd = 2, kDBiasAtomic = 3 };

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
  void* dq;          // (B, Hq, Lq, D) (varlen: packed (total_q, Hq, D)), strides below
  void* dk;          // (B, Hkv, Lk, D) (varlen: packed)
  void* dv;          // (B, Hkv, Lk, Dv) (varlen: packed)
  int64_t dq_sb, dq_sh, dq_sl;
  int64_t dk_sb, dk_sh, dk_sl;
  int64_t dv_sb, dv_sh, dv_sl;

  // d attn_mask (mask_grad; dense problems only): dS = P (dP * dropout - Delta), the gradient of
  // the masked score (after softcap, before the scale), summed into a zeroed buffer in the
  // compute type (float; double for float64) shaped like the mask, seen as (B, Hq, Lq, Lk)
  // through 4 strides (0 on the mask's broadcast dims). The dK/dV kernels add each (key tile)
  // block's dS (the mode of fastattn/triton/attention.py's _MaskGrad):
  //   kDBiasStore  every element gets one value: plain stores
  //   kDBiasAdd    the block owning an element adds to it (the same thread every time, in the
  //                block's fixed step order): deterministic
  //   kDBiasAtomic blocks of other batches / kv heads add to the same elements: atomicAdd
  // dbias_sum_q: the mask is broadcast over queries; a step's query columns are summed (fixed
  // order) before one add per key. loop_b / loop_h (B / Hkv or 1): a deterministic backward of
  // a mask broadcast over batches / kv heads runs blocks that walk them (b outer, kv head
  // inner), so that one block owns each element; the grid shrinks by those factors.
  void* dbias;
  int64_t dbias_sb, dbias_sh, dbias_sq, dbias_sk;
  int dbias_mode;
  bool dbias_sum_q;
  int loop_b = 1, loop_h = 1;
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
// every launch; a problem that does not fit the device raises a RuntimeError.
#define FASTATTN_ATTN_ENTRY(DT, HD)                                      \
  void attention_fwd_mma_##DT##_hd##HD(const FwdParams&, const Launch&); \
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

// Merges the split-K partials of a forward with num_splits > 1 into out/lse
// (attention_cuda_simt.cu).
void attention_combine(Dtype dtype, const FwdParams&, const Launch&);

}  // namespace fastattn::cuda::attn
