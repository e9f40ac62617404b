// CPU body of attention over a KV cache (decoding): the tiled kernels of
// csrc/attention/attention_cpu_kernel.cpp with per-sequence key lengths and query positions,
// the keys split into ranges computed in parallel and merged (flash-decoding) when there are
// too few (batch, head, query block) tasks to keep the threads busy.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include "attention/attention.h"
#include "attention/attention_cpu_common.h"
#include "common/cpu_isa.h"
#include "common/debug.h"

namespace fastattn::attention {
namespace {

std::tuple<Tensor, Tensor> attention_decode_cpu(const Tensor& q, const Tensor& k_cache,
                                                const Tensor& v_cache, const Tensor& k_lengths,
                                                const Tensor& q_positions,
                                                const optional<Tensor>& alibi, double scale,
                                                double softcap, int64_t causal_mode, int64_t wl,
                                                int64_t wr, int64_t num_splits) {
  constexpr const char* op = "attention_decode";
  check_problem(q, k_cache, v_cache, c10::nullopt, c10::nullopt, alibi, 0.0, c10::nullopt, op);
  const int64_t B = q.size(0);
  for (const auto* t : {&k_lengths, &q_positions}) {
    FASTATTN_CHECK(t->scalar_type() == at::kInt && t->dim() == 1 && t->numel() == B &&
                       t->is_contiguous() && t->device().is_cpu(),
                   op, "k_lengths and q_positions must be contiguous int32 (B,) CPU tensors");
  }
  const int32_t* lens = k_lengths.data_ptr<int32_t>();
  for (int64_t b = 0; b < B; ++b) {
    FASTATTN_CHECK(lens[b] >= 0 && lens[b] <= k_cache.size(2), op, "k_lengths[", b, "] = ",
                   lens[b], " is outside [0, ", k_cache.size(2), "]");
  }
  Tensor out = output_like(q, v_cache.size(3));
  Tensor lse = at::empty({B, q.size(1), q.size(2)}, q.options().dtype(lse_dtype(q)));
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
  const Tensor q_rows = pack_group
      ? q.as_strided({B, Hkv, group, q.size(3)}, {q.stride(0), group * q.stride(1), q.stride(1),
                                                  q.stride(3)})
      : q;
  const Tensor out_rows = pack_group
      ? out.as_strided({B, Hkv, group, out.size(3)},
                       {out.stride(0), group * out.stride(1), out.stride(1), out.stride(3)})
      : out;
  cpu::AttentionProblem p = make_problem(q_rows, k_cache, v_cache, c10::nullopt, c10::nullopt,
                                         alibi, scale, softcap, 0, 0, 0.0, c10::nullopt);
  p.k_lengths = lens;
  p.q_positions = positions;
  // Packed rows i > 0 would otherwise sit at positions + i; causal is a no-op there (above).
  p.causal_mode = pack_group ? 0 : static_cast<int>(causal_mode);
  p.window_left = wl;
  p.window_right = wr;
  if (num_splits <= 0) {
    // Enough tasks for every thread twice over; each split still gets >= 4 key blocks.
    const int64_t tasks = B * q_rows.size(1) * ((q_rows.size(2) + 63) / 64);
    const int64_t want = (2 * at::get_num_threads() + tasks - 1) / tasks;
    const int64_t most = std::max<int64_t>(1, (k_cache.size(2) + 255) / 256);
    num_splits = std::clamp<int64_t>(want, 1, most);
  }
  p.kv_splits = num_splits;
  // lse (B, Hq, 1) is contiguous: the same memory as (B, Hkv, group).
  cpu::AttentionForwardParams fp{p, out.data_ptr(), strides_of(out_rows), lse.data_ptr()};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "decode_cpu", [&] {
    FASTATTN_CPU_ISA_CALL(attention_forward<scalar_t>, fp);
  });
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_IMPL(fastattn, CPU, m) {
  m.impl("attention_decode", &attention_decode_cpu);
}

}  // namespace fastattn::attention
