// CPU bodies of attention over a KV cache (decoding). attention_decode: the tiled kernels of
// csrc/attention/attention_forward_cpu_kernel.cpp with per-sequence key lengths and query
// positions, the keys split into ranges computed in parallel and merged (flash-decoding) when there
// are too few (batch, head, query block) tasks to keep the threads busy. attention_with_kvcache:
// rotary, the in-place append and attention_decode in one call, so a decoding step pays for one
// op's overhead instead of a handful (at one new token the overhead is most of the step).
#include "common/tensor_api.h"

#include <cstring>

#include "attention/attention.h"
#include "attention/attention_cpu_common.h"
#include "attention_with_kvcache/attention_with_kvcache.h"
#include "common/cpu_isa.h"
#include "common/debug.h"
#include "positional/positional_cpu.h"

namespace fastattn::attention {
namespace {

namespace kvcache = fastattn::attention_with_kvcache;

// The rules of a paged cache's values that the Python layer leaves to this op for the cpu
// backend raise its ValueError, with the same messages: the stable ABI carries only
// RuntimeError, so the message is tagged and fastattn._native.value_errors() re-raises it.
#define FASTATTN_CHECK_VALUE(cond, op, ...) \
  FASTATTN_CHECK((cond), "[ValueError] " + std::string(op), __VA_ARGS__)

// Paged caches: the (B, Hkv, block_size, W) view of the pool's first block repeated for every
// sequence, so that check_problem and make_problem see the batch's shapes (the kernels then
// address the pool through the table); refuses an empty pool.
Tensor per_sequence_view(const Tensor& pool, int64_t B, const char* op, const char* name) {
  FASTATTN_CHECK(pool.dim() == 4 && pool.size(0) > 0, op, name,
                 " must be a non-empty pool (num_blocks, Hkv, block_size, D) with block_table, "
                 "got ",
                 pool.sizes());
  return pool.narrow(0, 0, 1).expand({B, pool.size(1), pool.size(2), pool.size(3)});
}

// Checks block_table (int32 (B, max_blocks), contiguous rows, CPU) against the pools and the
// sequences' lengths: block_size a multiple of 16, every entry the call reads or writes (the
// first ceil(lengths[b] / block_size) of row b) a block of the pool. Returns the capacity.
int64_t check_block_table(const Tensor& table, const Tensor& k_pool, const Tensor& v_pool,
                          int64_t B, const int32_t* lengths, const char* op) {
  FASTATTN_CHECK(table.scalar_type() == kInt && table.dim() == 2 && table.size(0) == B &&
                     table.device().is_cpu() && (table.size(1) <= 1 || table.stride(1) == 1),
                 op, "block_table must be an int32 (B, max_blocks_per_seq) = (", B,
                 ", ...) CPU tensor with unit last stride, got ", table.scalar_type(), " ",
                 table.sizes(), " on ", table.device());
  const int64_t blocks = k_pool.size(0), bs = k_pool.size(2);
  FASTATTN_CHECK(v_pool.size(0) == blocks && v_pool.size(2) == bs, op,
                 "k_cache and v_cache must be pools of the same blocks, got ", k_pool.sizes(),
                 " and ", v_pool.sizes());
  FASTATTN_CHECK_VALUE(
      bs > 0 && bs % 16 == 0, op,
      "the paged cache's block_size (k_cache.size(2)) must be a positive multiple of "
      "16, got ",
      bs);
  const int64_t capacity = table.size(1) * bs;
  const int32_t* t = table.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    FASTATTN_CHECK_VALUE(
        lengths[b] >= 0 && lengths[b] <= capacity, op, "sequence ", b, "'s ", lengths[b],
        " keys exceed the block table's capacity max_blocks_per_seq * ", "block_size = ", capacity);
    for (int64_t i = 0; i < (lengths[b] + bs - 1) / bs; ++i) {
      const int32_t blk = t[b * table.stride(0) + i];
      FASTATTN_CHECK_VALUE(
          blk >= 0 && blk < blocks, op, "block_table[", b, ", ", i, "] = ", blk,
          " is outside the pool: block indices must be in [0, num_blocks = ", blocks, ")");
    }
  }
  return capacity;
}

std::tuple<Tensor, Tensor> attention_decode_cpu(const Tensor& q, const Tensor& k_cache,
                                                const Tensor& v_cache, const Tensor& k_lengths,
                                                const Tensor& q_positions,
                                                const optional<Tensor>& alibi, double scale,
                                                double softcap, int64_t causal_mode, int64_t wl,
                                                int64_t wr, int64_t num_splits,
                                                const optional<Tensor>& block_table) {
  constexpr const char* op = "attention_decode";
  const int64_t B = q.size(0);
  const bool paged = defined(block_table);
  const Tensor k_view = paged ? per_sequence_view(k_cache, B, op, "k_cache") : k_cache;
  const Tensor v_view = paged ? per_sequence_view(v_cache, B, op, "v_cache") : v_cache;
  check_problem(q, k_view, v_view, std::nullopt, std::nullopt, alibi, 0.0, std::nullopt, op);
  for (const auto* t : {&k_lengths, &q_positions}) {
    FASTATTN_CHECK(t->scalar_type() == kInt && t->dim() == 1 && t->numel() == B &&
                       t->is_contiguous() && t->device().is_cpu(),
                   op, "k_lengths and q_positions must be contiguous int32 (B,) CPU tensors");
  }
  const int32_t* lens = k_lengths.data_ptr<int32_t>();
  const int64_t Lmax =
      paged ? check_block_table(*block_table, k_cache, v_cache, B, lens, op) : k_cache.size(2);
  for (int64_t b = 0; b < B; ++b) {
    FASTATTN_CHECK(lens[b] >= 0 && lens[b] <= Lmax, op, "k_lengths[", b, "] = ", lens[b],
                   " is outside [0, ", Lmax, "]");
  }
  Tensor out = output_like(q, v_cache.size(3));
  Tensor lse = empty({B, q.size(1), q.size(2)}, q.options().dtype(lse_dtype(q)));
  poison(out);
  poison(lse);
  if (out.numel() == 0) return {out, lse};
  const int32_t* positions = q_positions.data_ptr<int32_t>();
  // One new token per sequence with grouped heads: the group's query heads become the rows of
  // one query block (q viewed as (B, Hkv, group, D)), so each cached key and value is read once
  // per KV head instead of once per query head. Only where no mask depends on the query row or
  // head: no ALiBi (a slope per head), no window, and causal a no-op (each sequence's keys end
  // at or before its query's position, as when the new token was just appended).
  const int64_t Hq = q.size(1), Hkv = k_cache.size(1), group = Hq / Hkv;
  bool pack_group = q.size(2) == 1 && group > 1 && !defined(alibi) && wl < 0 && wr < 0;
  for (int64_t b = 0; pack_group && causal_mode != 0 && b < B; ++b) {
    pack_group = lens[b] <= int64_t(positions[b]) + 1;
  }
  const Tensor q_rows =
      pack_group ? q.as_strided({B, Hkv, group, q.size(3)},
                                {q.stride(0), group * q.stride(1), q.stride(1), q.stride(3)})
                 : q;
  const Tensor out_rows =
      pack_group
          ? out.as_strided({B, Hkv, group, out.size(3)},
                           {out.stride(0), group * out.stride(1), out.stride(1), out.stride(3)})
          : out;
  cpu::AttentionProblem p = make_problem(q_rows, k_view, v_view, std::nullopt, std::nullopt, alibi,
                                         scale, softcap, 0, 0, 0.0, std::nullopt);
  if (paged) {  // the pools through the table: block strides, the table's capacity
    p.k_s.b = k_cache.stride(0);
    p.v_s.b = v_cache.stride(0);
    p.Lk = Lmax;
    p.block_table = block_table->data_ptr<int32_t>();
    p.block_table_stride = block_table->stride(0);
    p.page_size = k_cache.size(2);
  }
  p.k_lengths = lens;
  p.q_positions = positions;
  // Packed rows i > 0 would otherwise sit at positions + i; causal is a no-op there (above).
  p.causal_mode = pack_group ? 0 : static_cast<int>(causal_mode);
  p.window_left = wl;
  p.window_right = wr;
  if (num_splits <= 0) {
    // Enough tasks for every thread twice over; each split still gets >= 4 key blocks.
    const int64_t tasks = B * q_rows.size(1) * ((q_rows.size(2) + 63) / 64);
    const int64_t want = (2 * get_num_threads() + tasks - 1) / tasks;
    const int64_t most = std::max<int64_t>(1, (Lmax + 255) / 256);
    num_splits = std::clamp<int64_t>(want, 1, most);
  }
  p.kv_splits = num_splits;
  // lse (B, Hq, 1) is contiguous: the same memory as (B, Hkv, group).
  cpu::AttentionForwardParams fp{p, out.data_ptr(), strides_of(out_rows), lse.data_ptr()};
  FASTATTN_DISPATCH_FLOATING(q.scalar_type(), "decode_cpu",
                             [&] { FASTATTN_CPU_ISA_CALL(attention_forward<scalar_t>, fp); });
  return {out, lse};
}

// Copies src (B, H, L, W) into rows [positions[b], positions[b] + L) of cache (B, H, Lmax, W),
// one W-element row at a time (both have unit last strides and the same dtype). Paged (table
// non-null, row stride table_stride): cache is a pool (num_blocks, H, block_size, W) and
// position p of sequence b is row p % block_size of block table[b, p / block_size] (entries
// checked by the caller).
void append_rows(const Tensor& src, const Tensor& cache, const int32_t* positions,
                 const int32_t* table = nullptr, int64_t table_stride = 0) {
  const int64_t H = src.size(1), L = src.size(2), W = src.size(3);
  const int64_t item = src.element_size();
  const char* from = static_cast<const char*>(src.data_ptr());
  char* to = static_cast<char*>(cache.data_ptr());
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(1, L * W));
  parallel_for(0, src.size(0) * H, grain, [&](int64_t begin, int64_t end) {
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      for (int64_t l = 0; l < L; ++l) {
        int64_t block = b, row = positions[b] + l;
        if (table != nullptr) {
          const int64_t bs = cache.size(2);
          block = table[b * table_stride + row / bs];
          row %= bs;
        }
        std::memcpy(
            to + (block * cache.stride(0) + h * cache.stride(1) + row * cache.stride(2)) * item,
            from + (b * src.stride(0) + h * src.stride(1) + l * src.stride(2)) * item, W * item);
      }
    }
  });
}

// rotate_at_positions on the CPU rotary body itself, not through the dispatcher (whose Python
// autograd kernel for apply_rotary costs more than the rotation of a decoding step).
Tensor rotate_on_cpu(const Tensor& x, const Tensor& cos, const Tensor& sin, const Tensor& positions,
                     bool interleaved) {
  return positional::apply_rotary_cpu(x, cos, sin, 0, positions, std::nullopt, 2 * cos.size(1),
                                      10000.0, interleaved, false);
}

std::tuple<Tensor, Tensor> attention_with_kvcache_cpu(
    const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& cache_seqlens,
    const optional<Tensor>& k_new, const optional<Tensor>& v_new,
    const optional<Tensor>& rotary_cos, const optional<Tensor>& rotary_sin, bool rotary_interleaved,
    const optional<Tensor>& alibi, double scale, double softcap, int64_t causal_mode, int64_t wl,
    int64_t wr, int64_t num_splits, const optional<Tensor>& block_table) {
  constexpr const char* op = "attention_with_kvcache";
  // Every check before the caches are written.
  const int64_t B = q.size(0);
  const bool paged = defined(block_table);
  const Tensor k_view = paged ? per_sequence_view(k_cache, B, op, "k_cache") : k_cache;
  const Tensor v_view = paged ? per_sequence_view(v_cache, B, op, "v_cache") : v_cache;
  check_problem(q, k_view, v_view, std::nullopt, std::nullopt, alibi, 0.0, std::nullopt, op);
  const int64_t Lnew = kvcache::check_new_tokens(q, k_view, v_view, cache_seqlens, k_new, v_new,
                                                 rotary_cos, rotary_sin, op);
  const bool append = defined(k_new);
  const Tensor seqlens = cache_seqlens.contiguous();
  const int32_t* starts = seqlens.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    FASTATTN_CHECK(starts[b] >= 0, op, "cache_seqlens must be >= 0, got ", starts[b]);
  }
  Tensor k_lengths = seqlens;
  if (Lnew > 0) {
    k_lengths = empty({B}, seqlens.options());
    int32_t* lengths = k_lengths.data_ptr<int32_t>();
    for (int64_t b = 0; b < B; ++b) lengths[b] = static_cast<int32_t>(starts[b] + Lnew);
  }
  const int64_t Lmax = paged ? check_block_table(*block_table, k_cache, v_cache, B,
                                                 k_lengths.data_ptr<int32_t>(), op)
                             : k_cache.size(2);
  for (int64_t b = 0; b < B; ++b) {
    FASTATTN_CHECK_VALUE(starts[b] + Lnew <= Lmax, op, "the cache is too small: cache_seqlens[", b,
                         "] = ", starts[b], " plus ", Lnew, " new tokens exceed ",
                         paged ? "the block table's capacity " : "Lmax = ", Lmax);
  }
  const auto [q_rot, k_append] = kvcache::rotated_new_tokens(
      q, k_new, rotary_cos, rotary_sin, seqlens, rotary_interleaved, rotate_on_cpu);
  if (append && Lnew > 0) {
    const int32_t* table = paged ? block_table->data_ptr<int32_t>() : nullptr;
    const int64_t table_stride = paged ? block_table->stride(0) : 0;
    append_rows(k_append, k_cache, starts, table, table_stride);
    append_rows(*v_new, v_cache, starts, table, table_stride);
  }
  return attention_decode_cpu(q_rot, k_cache, v_cache, k_lengths, seqlens, alibi, scale, softcap,
                              causal_mode, wl, wr, num_splits, block_table);
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fastattn, CPU, m) {
  m.impl("attention_decode", TORCH_BOX(&attention_decode_cpu));
  m.impl("attention_with_kvcache", TORCH_BOX(&attention_with_kvcache_cpu));
}

}  // namespace fastattn::attention
