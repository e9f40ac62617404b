// Body of the CUDA attention_decode op (attention over a KV cache): argument checks, outputs and
// the kernel arguments of the dense CUDA attention forward kernels with per-sequence key lengths
// and query positions (Problem::k_lengths/q_positions, read by the kernels: select_sequence),
// split over the keys (flash-decoding: FwdParams::num_splits, float32 partials merged by
// attention_combine_kernel). attention_with_kvcache_cuda.cu wraps it with the device guard and
// the current stream; tools/cuda_emu calls it on CPU tensors. k_lengths and q_positions live on
// the device: their values are checked by fastattn/ops/attention_with_kvcache.py and, with
// FASTATTN_DEBUG_CHECKS, inside the kernels.
#pragma once
#include "common/tensor_api.h"

#include <algorithm>
#include <tuple>

#include "attention/attention.h"
#include "attention/attention_cuda_ops.h"
#include "common/debug.h"

namespace fastattn::attention_with_kvcache::cuda_impl {

using std::optional;
namespace attn_impl = fastattn::attention::cuda_impl;
using fastattn::cuda::attn::Dtype;
using fastattn::cuda::attn::FwdParams;
using fastattn::cuda::attn::Launch;

constexpr int64_t kMaxSplits = 128;

// Splits of the keys when the caller leaves the choice (num_splits <= 0): enough blocks to fill
// the device twice, each split keeping >= 256 cache positions; none for float64 (its partials
// would be rounded to float32).
inline int64_t choose_splits(int64_t num_splits, int64_t blocks_per_split, int64_t Lmax,
                             int sm_count, bool f64) {
  if (f64) return 1;
  if (num_splits <= 0) {
    const int64_t want = (2 * std::max(sm_count, 1) + blocks_per_split - 1) / blocks_per_split;
    const int64_t most = std::max<int64_t>(1, (Lmax + 255) / 256);
    num_splits = std::clamp<int64_t>(want, 1, most);
  }
  return std::clamp<int64_t>(num_splits, 1, kMaxSplits);
}

// Paged caches: the (B, Hkv, block_size, W) view of the pool's first block repeated for every
// sequence, so that check_problem and make_problem see the batch's shapes (the kernels then
// address the pool through the table); refuses an empty pool.
inline Tensor per_sequence_view(const Tensor& pool, int64_t B, const char* op, const char* name) {
  FASTATTN_CHECK(pool.dim() == 4 && pool.size(0) > 0, op, name,
                 " must be a non-empty pool (num_blocks, Hkv, block_size, D) with block_table, "
                 "got ",
                 pool.sizes());
  return pool.narrow(0, 0, 1).expand({B, pool.size(1), pool.size(2), pool.size(3)});
}

// Checks a paged call's block_table (int32 (B, max_blocks_per_seq) on q's device, unit last
// stride) and pools (same blocks, block_size a multiple of 16); returns the table's capacity
// max_blocks_per_seq * block_size. The entries' values are checked on the device by the op
// (attention_with_kvcache_cuda.cu), never read here.
inline int64_t check_block_table(const Tensor& table, const Tensor& k_pool, const Tensor& v_pool,
                                 const Tensor& q, const char* op) {
  FASTATTN_CHECK(table.scalar_type() == kInt && table.dim() == 2 && table.size(0) == q.size(0) &&
                     (table.size(1) <= 1 || table.stride(1) == 1),
                 op, "block_table must be an int32 (B, max_blocks_per_seq) = (", q.size(0),
                 ", ...) tensor with unit last stride, got ", table.scalar_type(), " ",
                 table.sizes());
  check_same_device(table, q, op, "block_table", "q");
  FASTATTN_CHECK(
      v_pool.dim() == 4 && v_pool.size(0) == k_pool.size(0) && v_pool.size(2) == k_pool.size(2), op,
      "k_cache and v_cache must be pools of the same blocks, got ", k_pool.sizes(), " and ",
      v_pool.sizes());
  const int64_t bs = k_pool.size(2);
  FASTATTN_CHECK(bs > 0 && bs % 16 == 0, op,
                 "the paged cache's block_size (k_cache.size(2)) must be a positive multiple of "
                 "16, got ",
                 bs);
  const int64_t capacity = table.size(1) * bs;
  FASTATTN_CHECK(capacity <= attention::kMaxSeqLen, op,
                 "block_table's capacity max_blocks_per_seq * block_size must be < 2**30, got ",
                 capacity);
  return capacity;
}

// sm_count: the device's multiprocessors (the automatic split count). block_table: a paged
// cache (k_cache/v_cache pools), its entries checked by the caller.
inline std::tuple<Tensor, Tensor> decode(const Tensor& q, const Tensor& k_cache,
                                         const Tensor& v_cache, const Tensor& k_lengths,
                                         const Tensor& q_positions, const optional<Tensor>& alibi,
                                         double scale, double softcap, int64_t causal_mode,
                                         int64_t wl, int64_t wr, int64_t num_splits, int sm_count,
                                         const Launch& launch,
                                         const optional<Tensor>& block_table = std::nullopt) {
  constexpr const char* op = "attention_decode";
  const int64_t B = q.size(0);
  const bool paged = block_table.has_value() && block_table->defined();
  const Tensor k_view = paged ? per_sequence_view(k_cache, B, op, "k_cache") : k_cache;
  const Tensor v_view = paged ? per_sequence_view(v_cache, B, op, "v_cache") : v_cache;
  attention::check_problem(q, k_view, v_view, std::nullopt, std::nullopt, alibi, 0.0, std::nullopt,
                           op);
  const int64_t Lmax =
      paged ? check_block_table(*block_table, k_cache, v_cache, q, op) : k_cache.size(2);
  for (const auto& [t, name] :
       {std::pair<const Tensor*, const char*>{&k_lengths, "k_lengths"},
        std::pair<const Tensor*, const char*>{&q_positions, "q_positions"}}) {
    FASTATTN_CHECK(
        t->scalar_type() == kInt && t->dim() == 1 && t->numel() == B && t->is_contiguous(), op,
        name, " must be a contiguous int32 (B,) = (", B, ",) tensor, got ", t->scalar_type(), " ",
        t->sizes());
    check_same_device(*t, q, op, name, "q");
  }
  FASTATTN_CHECK(causal_mode >= 0 && causal_mode <= 2, op,
                 "causal_mode must be 0 (off), 1 (top-left) or 2 (at the query position), got ",
                 causal_mode);
  FASTATTN_CHECK(wl >= -1 && wr >= -1, op, "window_left/window_right must be >= -1, got ", wl,
                 " and ", wr);
  Tensor out = attention::output_like(q, v_cache.size(3));
  Tensor lse = empty({B, q.size(1), q.size(2)}, q.options().dtype(attention::lse_dtype(q)));
  poison(out);
  poison(lse);
  if (out.numel() == 0) return {out, lse};
  FwdParams fp{};
  fp.p = attn_impl::make_problem(q, k_view, v_view, std::nullopt, std::nullopt, alibi, scale,
                                 softcap, 0, 0, 0.0, std::nullopt, op);
  if (paged) {  // the pools through the table: block strides, the table's capacity
    fp.p.k_sb = k_cache.stride(0);
    fp.p.v_sb = v_cache.stride(0);
    const int64_t per16 = 16 / static_cast<int64_t>(q.element_size());
    fp.p.k_aligned = fp.p.k_aligned && k_cache.stride(0) % per16 == 0;
    fp.p.v_aligned = fp.p.v_aligned && v_cache.stride(0) % per16 == 0;
    fp.p.Lk = static_cast<int>(Lmax);
    fp.p.block_table = block_table->data_ptr<int32_t>();
    fp.p.block_table_stride = block_table->stride(0);
    fp.p.page_size = static_cast<int>(k_cache.size(2));
    fp.p.num_blocks = static_cast<int>(k_cache.size(0));
    fp.p.table_cols = static_cast<int>(block_table->size(1));
  }
  fp.p.k_lengths = k_lengths.data_ptr<int32_t>();
  fp.p.q_positions = q_positions.data_ptr<int32_t>();
  fp.p.causal_mode = static_cast<int>(causal_mode);
  constexpr int64_t kUnbounded = int64_t{1} << 30;
  fp.p.window_left = static_cast<int>(std::min(wl, kUnbounded));
  fp.p.window_right = static_cast<int>(std::min(wr, kUnbounded));
  fp.out = out.data_ptr();
  fp.o_sb = out.stride(0);
  fp.o_sh = out.stride(1);
  fp.o_sl = out.stride(2);
  fp.lse = lse.data_ptr();
  const Dtype dt = attn_impl::dtype_of(q);
  // Blocks of one split: query tiles of 64 rows (the tensor-core tiles are 64-128, SIMT 16-32)
  // times B * Hq.
  const int64_t blocks = (q.size(2) + 63) / 64 * B * q.size(1);
  const int64_t splits = choose_splits(num_splits, blocks, Lmax, sm_count, dt == Dtype::f64);
  Tensor part_out, part_lse;
  if (splits > 1) {
    part_out = empty({splits, B, q.size(1), q.size(2), v_cache.size(3)}, q.options().dtype(kFloat));
    part_lse = empty({splits, B, q.size(1), q.size(2)}, q.options().dtype(kFloat));
    poison(part_out);
    poison(part_lse);
    fp.num_splits = static_cast<int>(splits);
    fp.part_out = part_out.data_ptr<float>();
    fp.part_lse = part_lse.data_ptr<float>();
  }
  attn_impl::launch_forward(fp, dt, launch);
  if (splits > 1) fastattn::cuda::attn::attention_combine(dt, fp, launch);
  return {out, lse};
}

}  // namespace fastattn::attention_with_kvcache::cuda_impl
