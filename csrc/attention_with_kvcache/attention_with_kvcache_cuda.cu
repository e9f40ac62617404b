// CUDA body of attention over a KV cache (attention_decode, registered for the CUDA dispatch
// key). The op logic lives in attention_with_kvcache_cuda_ops.h (shared with the CPU emulator of
// tools/cuda_emu): the dense CUDA attention forward kernels of csrc/attention with per-sequence
// key lengths and query positions read on the device, split over the keys (flash-decoding) with
// float32 partials and a combine kernel. This file adds the device guard and the device
// preamble (attention/attention_cuda_device.h), and registers the op. attention_with_kvcache
// (the whole decoding step in one op, as on the CPU): fastattn's rotary kernel on q and k_new,
// an append kernel that writes the new rows at the positions it reads on the device (no host
// synchronisation), then attention_decode; one op call instead of the handful a Python
// composition dispatches.
#include "common/cuda_api.h"
#include <cuda_runtime_api.h>

#include "attention/attention_cuda_device.h"
#include "attention_with_kvcache/attention_with_kvcache.h"
#include "attention_with_kvcache/attention_with_kvcache_cuda_ops.h"
#include "common/cuda_utils.cuh"
#include "common/device_checks.h"

#include <limits>
#include <string>

namespace fastattn::attention_with_kvcache {
namespace {

using std::optional;

bool defined(const optional<Tensor>& t) { return t.has_value() && t->defined(); }

// attention_decode without the checks of k_lengths', q_positions' and block_table's values (the
// caller's).
std::tuple<Tensor, Tensor> decode(const Tensor& q, const Tensor& k_cache, const Tensor& v_cache,
                                  const Tensor& k_lengths, const Tensor& q_positions,
                                  const optional<Tensor>& alibi, double scale, double softcap,
                                  int64_t causal_mode, int64_t wl, int64_t wr, int64_t num_splits,
                                  const optional<Tensor>& block_table) {
  constexpr const char* op = "attention_decode";
  FASTATTN_CHECK(q.is_cuda(), op, "q must be a CUDA tensor, got ", q.device());
  CudaGuard guard(q);
  const fastattn::cuda::attn::Launch launch = fastattn::attention::cuda_impl::launch_for(q, op);
  const int sms = fastattn::attention::cuda_impl::sm_count();
  return cuda_impl::decode(q, k_cache, v_cache, k_lengths, q_positions, alibi, scale, softcap,
                           causal_mode, wl, wr, num_splits, sms, launch, block_table);
}

// out[b, j] = table[b, j] for the blocks sequence b reads or writes (j * block_size <
// lengths[b]), 0 for the others. table: int32 (B, max_blocks) with row stride t_b; out
// contiguous.
__global__ void used_blocks_kernel(const int32_t* __restrict__ table, int64_t t_b,
                                   const int32_t* __restrict__ lengths, int64_t B,
                                   int64_t max_blocks, int64_t block_size,
                                   int32_t* __restrict__ out) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < B * max_blocks;
       i += step) {
    const int64_t b = i / max_blocks, j = i % max_blocks;
    out[i] = j * block_size < lengths[b] ? table[b * t_b + j] : 0;
  }
}

// out[b] = lengths[b] + add (int32, contiguous).
__global__ void add_lengths_kernel(const int32_t* __restrict__ lengths, int64_t B, int32_t add,
                                   int32_t* __restrict__ out) {
  const int64_t b = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (b < B) out[b] = lengths[b] + add;
}

// Checks on the device (no host read) that the entries of block_table (B, max_blocks) that
// sequences of `lengths` keys read or write, the first ceil(lengths[b] / block_size) of row b,
// are blocks of the pool: the others are replaced by 0 before the range check.
void require_blocks_in_pool(const Tensor& table, const Tensor& lengths, int64_t block_size,
                            int64_t num_blocks, const char* op) {
  if (table.numel() == 0) return;
  const int64_t B = table.size(0), max_blocks = table.size(1);
  const Tensor used = empty({B, max_blocks}, table.options());
  const Tensor lens = lengths.contiguous();
  const int64_t n = B * max_blocks;
  used_blocks_kernel<<<static_cast<unsigned>(std::min<int64_t>((n + 255) / 256, 1024)), 256, 0,
                       current_cuda_stream()>>>(table.data_ptr<int32_t>(), table.stride(0),
                                                lens.data_ptr<int32_t>(), B, max_blocks, block_size,
                                                used.data_ptr<int32_t>());
  FASTATTN_CUDA_LAUNCH_CHECK();
  device_checks::require_in_range(used, 0, num_blocks - 1,
                                  std::string(op) +
                                      ": block_table entries read or written must be block "
                                      "indices in [0, num_blocks = " +
                                      std::to_string(num_blocks) + "); block_table");
}

// Checks the values of k_lengths (in [0, Lmax]) and q_positions (>= 0) on the device: the
// kernels read keys [0, k_lengths[b]) of the cache.
std::tuple<Tensor, Tensor> attention_decode_cuda(const Tensor& q, const Tensor& k_cache,
                                                 const Tensor& v_cache, const Tensor& k_lengths,
                                                 const Tensor& q_positions,
                                                 const optional<Tensor>& alibi, double scale,
                                                 double softcap, int64_t causal_mode, int64_t wl,
                                                 int64_t wr, int64_t num_splits,
                                                 const optional<Tensor>& block_table) {
  constexpr const char* op = "attention_decode";
  const bool paged = defined(block_table);
  bool well_formed = q.is_cuda() && k_cache.dim() == 4;
  for (const auto* t : {&k_lengths, &q_positions}) {
    well_formed = well_formed && t->device() == q.device() && t->scalar_type() == kInt;
  }
  if (paged) {
    well_formed = well_formed && block_table->device() == q.device() &&
                  block_table->scalar_type() == kInt && block_table->dim() == 2 &&
                  k_lengths.dim() == 1 && block_table->size(0) == k_lengths.size(0);
  }
  // Otherwise decode() raises, naming the argument and the rule.
  if (well_formed) {
    const int64_t Lmax = paged ? block_table->size(1) * k_cache.size(2) : k_cache.size(2);
    if (paged)
      require_blocks_in_pool(*block_table, k_lengths, k_cache.size(2), k_cache.size(0), op);
    device_checks::require_in_range(k_lengths, 0, Lmax,
                                    std::string(op) + ": k_lengths must be in [0, Lmax = " +
                                        std::to_string(Lmax) + "]; k_lengths");
    device_checks::require_in_range(q_positions, 0, std::numeric_limits<int32_t>::max(),
                                    std::string(op) + ": q_positions must be >= 0; q_positions");
  }
  return decode(q, k_cache, v_cache, k_lengths, q_positions, alibi, scale, softcap, causal_mode, wl,
                wr, num_splits, block_table);
}

// Row (b, h, l) of src (B, H, L, W) -> row positions[b] + l of cache (B, H, Lmax, W); one block
// a row, elements copied as raw 16-bit or 32-bit words (same dtype on both sides). Paged (table
// non-null): cache is a pool (num_blocks, H, page, W), c_b the stride of one block, and position
// p of sequence b is row p % page of block table[b * t_b + p / page]; Lmax is the table's
// capacity and num_blocks the pool's size.
template <typename word>
__global__ void append_rows_kernel(const word* __restrict__ src, word* __restrict__ cache,
                                   const int32_t* __restrict__ positions, int64_t H, int64_t L,
                                   int64_t W, int64_t Lmax, int64_t s_b, int64_t s_h, int64_t s_l,
                                   int64_t c_b, int64_t c_h, int64_t c_l,
                                   const int32_t* __restrict__ table, int64_t t_b, int64_t page,
                                   int64_t num_blocks) {
  const int64_t row = blockIdx.x;
  const int64_t l = row % L, h = (row / L) % H, b = row / (L * H);
  int64_t at = static_cast<int64_t>(positions[b]) + l;
  // The op checks the positions (and the table's entries) on the device before this kernel
  // runs; rows outside the cache are skipped all the same (nothing is ever written out of range).
  if (at < 0 || at >= Lmax) return;
  int64_t block = b;
  if (table != nullptr) {
    block = table[b * t_b + at / page];
    at %= page;
    if (block < 0 || block >= num_blocks) return;
  }
  const word* from = src + b * s_b + h * s_h + l * s_l;
  word* to = cache + block * c_b + h * c_h + at * c_l;
  for (int64_t i = threadIdx.x; i < W; i += blockDim.x) to[i] = from[i];
}

void append_rows(const Tensor& src, const Tensor& cache, const Tensor& positions,
                 const optional<Tensor>& block_table) {
  const int64_t B = src.size(0), H = src.size(1), L = src.size(2), W = src.size(3);
  if (B * H * L == 0 || W == 0) return;
  const auto stream = current_cuda_stream();
  const int threads = static_cast<int>(std::min<int64_t>(256, (W + 31) / 32 * 32));
  const unsigned blocks = cuda::grid_x(B * H * L, "attention_with_kvcache", "B * Hkv * Lnew");
  const int32_t* pos = positions.data_ptr<int32_t>();
  const bool paged = defined(block_table);
  const int32_t* table = paged ? block_table->data_ptr<int32_t>() : nullptr;
  const int64_t t_b = paged ? block_table->stride(0) : 0;
  const int64_t page = cache.size(2);
  const int64_t Lmax = paged ? block_table->size(1) * page : page;
  auto launch = [&](auto word_tag) {
    using word = decltype(word_tag);
    append_rows_kernel<word><<<blocks, threads, 0, stream>>>(
        static_cast<const word*>(src.data_ptr()), static_cast<word*>(cache.data_ptr()), pos, H, L,
        W, Lmax, src.stride(0), src.stride(1), src.stride(2), cache.stride(0), cache.stride(1),
        cache.stride(2), table, t_b, page, cache.size(0));
  };
  switch (src.element_size()) {
    case 2:
      launch(uint16_t{});
      break;
    case 4:
      launch(uint32_t{});
      break;
    case 8:
      launch(uint64_t{});
      break;
    default:
      FASTATTN_CHECK(false, "attention_with_kvcache", "unsupported element size");
  }
  FASTATTN_CUDA_LAUNCH_CHECK();
}

std::tuple<Tensor, Tensor> attention_with_kvcache_cuda(
    const Tensor& q, const Tensor& k_cache, const Tensor& v_cache, const Tensor& cache_seqlens,
    const optional<Tensor>& k_new, const optional<Tensor>& v_new,
    const optional<Tensor>& rotary_cos, const optional<Tensor>& rotary_sin, bool rotary_interleaved,
    const optional<Tensor>& alibi, double scale, double softcap, int64_t causal_mode, int64_t wl,
    int64_t wr, int64_t num_splits, const optional<Tensor>& block_table) {
  constexpr const char* op = "attention_with_kvcache";
  FASTATTN_CHECK(q.is_cuda(), op, "q must be a CUDA tensor, got ", q.device());
  CudaGuard guard(q);
  // Every check before the caches are written. The values of cache_seqlens are checked on the
  // device (reading them here would synchronise the stream, and forbid CUDA-graph capture).
  FASTATTN_CHECK(q.dim() == 4 && k_cache.dim() == 4 && v_cache.dim() == 4, op,
                 "q, k_cache and v_cache must be 4-D");
  for (const auto* t : {&k_cache, &v_cache}) {
    FASTATTN_CHECK(t->device() == q.device() && t->scalar_type() == q.scalar_type(), op,
                   "k_cache and v_cache must have q's device and dtype");
    check_unit_last_stride(*t, op, t == &k_cache ? "k_cache" : "v_cache");
  }
  const bool paged = defined(block_table);
  const int64_t B = q.size(0);
  const Tensor k_view = paged ? cuda_impl::per_sequence_view(k_cache, B, op, "k_cache") : k_cache;
  const Tensor v_view = paged ? cuda_impl::per_sequence_view(v_cache, B, op, "v_cache") : v_cache;
  const int64_t Lnew =
      check_new_tokens(q, k_view, v_view, cache_seqlens, k_new, v_new, rotary_cos, rotary_sin, op);
  const bool append = k_new.has_value() && k_new->defined();
  const int64_t Lmax =
      paged ? cuda_impl::check_block_table(*block_table, k_cache, v_cache, q, op) : k_cache.size(2);
  const std::string capacity =
      paged ? "the block table's capacity max_blocks_per_seq * block_size = " : "Lmax = ";
  FASTATTN_CHECK(q.size(0) == 0 || Lnew <= Lmax, op, "the cache is too small: ", Lnew,
                 " new tokens exceed ", capacity, Lmax);
  device_checks::require_in_range(
      cache_seqlens, 0, Lmax - Lnew,
      std::string(op) + ": cache_seqlens must be in [0, Lmax - Lnew] = [0, " +
          std::to_string(Lmax - Lnew) + "] (the cache is too small otherwise; Lmax: " + capacity +
          std::to_string(Lmax) + "); cache_seqlens");
  const Tensor seqlens = cache_seqlens.contiguous();
  Tensor k_lengths = seqlens;
  if (Lnew > 0 && B > 0) {
    k_lengths = empty({B}, seqlens.options());
    add_lengths_kernel<<<static_cast<unsigned>((B + 255) / 256), 256, 0, current_cuda_stream()>>>(
        seqlens.data_ptr<int32_t>(), B, static_cast<int32_t>(Lnew), k_lengths.data_ptr<int32_t>());
    FASTATTN_CUDA_LAUNCH_CHECK();
  }
  if (paged) require_blocks_in_pool(*block_table, k_lengths, k_cache.size(2), k_cache.size(0), op);
  const auto [q_rot, k_append] =
      rotated_new_tokens(q, k_new, rotary_cos, rotary_sin, seqlens, rotary_interleaved);
  if (append && Lnew > 0) {
    append_rows(k_append, k_cache, seqlens, block_table);
    append_rows(*v_new, v_cache, seqlens, block_table);
  }
  // k_lengths = cache_seqlens + Lnew <= Lmax and q_positions = cache_seqlens >= 0: checked above.
  return decode(q_rot, k_cache, v_cache, k_lengths, seqlens, alibi, scale, softcap, causal_mode, wl,
                wr, num_splits, block_table);
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fastattn, CUDA, m) {
  m.impl("attention_decode", TORCH_BOX(&attention_decode_cuda));
  m.impl("attention_with_kvcache", TORCH_BOX(&attention_with_kvcache_cuda));
}

}  // namespace fastattn::attention_with_kvcache
