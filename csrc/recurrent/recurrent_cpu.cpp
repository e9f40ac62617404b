// The CPU recurrent engine's host side (recurrent_cpu.h): one forward and one backward for
// every cell (LSTM, GRU with either reset placement, tanh / relu RNN).
#include "recurrent/recurrent_cpu.h"

#include "common/tensor_api.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <mutex>
#include <numeric>
#include <vector>

#include "common/cpu_isa.h"
#include "common/debug.h"
#include "common/gemm_cpu.h"

namespace fastattn::recurrent {
namespace {

using cpu::RecurrentCell;
using std::optional;

#define FASTATTN_DISPATCH_RECURRENT(TYPE, ...) \
  FASTATTN_DISPATCH_FLOATING(TYPE, "recurrent_cpu", __VA_ARGS__)

// Host-side sorted/packed description of the batch (see recurrent_cpu_kernel.h). Reading lengths
// here, inside the op, keeps the Python driver free of data-dependent control flow.
struct Packing {
  std::vector<int64_t> perm, lengths, batch_sizes, offsets;
  bool identity = true;  // no lengths (or all equal to T, already in order)

  cpu::RecurrentPacking view(int64_t T, int64_t B) const {
    return {T, B, perm.data(), lengths.data(), batch_sizes.data(), offsets.data()};
  }
  int64_t total() const { return offsets.back(); }
};

Packing make_packing(const optional<Tensor>& lengths, int64_t T, int64_t B, const char* op) {
  Packing pk;
  pk.perm.resize(B);
  std::iota(pk.perm.begin(), pk.perm.end(), 0);
  pk.lengths.assign(B, T);
  if (defined(lengths)) {
    const Tensor len = lengths->contiguous();
    const int64_t* l = len.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      FASTATTN_CHECK(l[b] >= 0 && l[b] <= T, op, "lengths must be in [0, T] = [0, ", T, "], got ",
                     l[b], " for batch entry ", b);
    }
    std::stable_sort(pk.perm.begin(), pk.perm.end(),
                     [&](int64_t a, int64_t b) { return l[a] > l[b]; });
    for (int64_t j = 0; j < B; ++j) {
      pk.lengths[j] = l[pk.perm[j]];
      pk.identity = pk.identity && pk.perm[j] == j && pk.lengths[j] == T;
    }
  }
  pk.batch_sizes.assign(T, 0);
  for (int64_t j = 0; j < B; ++j) {
    for (int64_t t = 0; t < pk.lengths[j]; ++t) ++pk.batch_sizes[t];
  }
  pk.offsets.assign(T + 1, 0);
  for (int64_t t = 0; t < T; ++t) pk.offsets[t + 1] = pk.offsets[t] + pk.batch_sizes[t];
  return pk;
}

// Saved workspaces come from a small cache of freed blocks (the backward frees the block,
// the next forward reuses it), as torch's CUDA caching allocator does: a fresh allocation
// above glibc's mmap threshold is page-faulted and zero-filled on every call, as much as a
// tenth of the forward (docs/design/cpu_kernels.md). At most kMaxCachedBytes stay cached.
class BlockCache {
 public:
  static BlockCache& get() {
    static BlockCache* cache = new BlockCache();  // never destroyed: tensors may outlive exit
    return *cache;
  }

  Tensor empty(IntArrayRef sizes, const Options& options) {
    int64_t numel = 1;
    for (int64_t s : sizes) numel *= s;
    const size_t bytes = static_cast<size_t>(numel) * element_size(options.dtype());
    if (bytes < (size_t(1) << 22) || bytes > kMaxCachedBytes) {
      return fastattn::empty(sizes, options);
    }
    auto [ptr, capacity] = take(bytes);
    std::vector<int64_t> strides(sizes.size());
    int64_t stride = 1;
    for (size_t d = sizes.size(); d-- > 0;) {
      strides[d] = stride;
      stride *= sizes[d];
    }
    return torch::stable::from_blob(
        ptr, sizes, torch::headeronly::IntHeaderOnlyArrayRef(strides), options.device(),
        options.dtype(), [capacity = capacity](void* p) { BlockCache::get().give(p, capacity); });
  }

 private:
  static constexpr size_t kMaxCachedBytes = size_t(1) << 30;

  std::pair<void*, size_t> take(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      size_t best = blocks_.size();
      for (size_t i = 0; i < blocks_.size(); ++i) {  // smallest block that fits, within 2x
        const size_t cap = blocks_[i].second;
        if (cap >= bytes && cap <= 2 * bytes &&
            (best == blocks_.size() || cap < blocks_[best].second)) {
          best = i;
        }
      }
      if (best < blocks_.size()) {
        auto block = blocks_[best];
        blocks_.erase(blocks_.begin() + best);
        cached_ -= block.second;
        return block;
      }
    }
    void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
    FASTATTN_CHECK(p != nullptr, "lstm", "out of memory allocating a ", bytes, "-byte workspace");
    return {p, bytes};
  }

  void give(void* p, size_t capacity) {
    std::lock_guard<std::mutex> lock(mutex_);
    while (!blocks_.empty() && cached_ + capacity > kMaxCachedBytes) {  // evict the oldest
      std::free(blocks_.front().first);
      cached_ -= blocks_.front().second;
      blocks_.erase(blocks_.begin());
    }
    if (capacity > kMaxCachedBytes) {
      std::free(p);
      return;
    }
    blocks_.emplace_back(p, capacity);
    cached_ += capacity;
  }

  std::mutex mutex_;
  std::vector<std::pair<void*, size_t>> blocks_;
  size_t cached_ = 0;
};

std::pair<uint64_t, uint64_t> read_seed(const optional<Tensor>& seed, double p) {
  if (p <= 0.0) return {0, 0};
  const int64_t* s = seed->data_ptr<int64_t>();
  return {static_cast<uint64_t>(s[0]), static_cast<uint64_t>(s[1])};
}

// The (total, I) packed, dropped-out input in the compute type; a view of the input itself
// when it already is that (float storage, no lengths, no dropout, contiguous).
Tensor packed_input(const Tensor& input, const Packing& pk, double dropout_p,
                    const optional<Tensor>& seed) {
  const int64_t T = input.size(0), B = input.size(1), I = input.size(2);
  const auto acc = compute_dtype(input.scalar_type());
  if (input.scalar_type() == acc && pk.identity && dropout_p <= 0.0 && input.is_contiguous()) {
    return input.view({T * B, I});
  }
  Tensor x = input.stride(2) == 1 || I <= 1 ? input : input.contiguous();
  Tensor xp = scratch(kPackedInput, {pk.total(), I}, input.options().dtype(acc));
  auto [s, stream] = read_seed(seed, dropout_p);
  cpu::RecurrentGatherParams p{pk.view(T, B), x.data_ptr(), I, x.stride(0), x.stride(1),
                               xp.data_ptr(), dropout_p,    s, stream};
  FASTATTN_DISPATCH_RECURRENT(input.scalar_type(),
                              [&] { FASTATTN_CPU_ISA_CALL(recurrent_gather_input<scalar_t>, p); });
  return xp;
}

// Row order of the blocked gate layout of G gates: blocked row G*u0 + g*hb + u is natural row
// g*H + u0 + u for the unit block starting at u0 with hb units.
Tensor blocked_gate_order(int64_t H, int64_t G, const Options& options) {
  std::vector<int64_t> order(G * H);
  for (int64_t u0 = 0; u0 < H; u0 += cpu::kRecurrentUnitBlock) {
    const int64_t hb = std::min(cpu::kRecurrentUnitBlock, H - u0);
    for (int64_t g = 0; g < G; ++g) {
      for (int64_t u = 0; u < hb; ++u) order[G * u0 + g * hb + u] = g * H + u0 + u;
    }
  }
  Tensor t = empty({G * H}, options.dtype(kLong));
  std::copy(order.begin(), order.end(), t.data_ptr<int64_t>());
  return t;
}

// The recurrent weights in the compute type, contiguous (no copy for contiguous float32 /
// float64 parameters), kept alive while the kernel reads them. With bf16 (the forward's
// bfloat16 per-step products) W_hh stays bfloat16, and is converted only where a float
// product reads it too (the reset-before GRU's W_hn).
struct LayerWeights {
  Tensor w_hh, w_hh_bf16, w_hr, b_hn;
  LayerWeights(RecurrentCell cell, const Tensor& hh, const optional<Tensor>& hr, ScalarType acc,
               bool bf16 = false) {
    if (bf16) w_hh_bf16 = hh.contiguous();
    if (!bf16 || cell == RecurrentCell::gru_reset_before) w_hh = hh.to(acc).contiguous();
    if (defined(hr)) w_hr = hr->to(acc).contiguous();
  }
  cpu::RecurrentWeights view(RecurrentCell cell, const LayerDims& d) const {
    auto ptr = [](const Tensor& t) -> const void* { return t.defined() ? t.data_ptr() : nullptr; };
    return {cell, d.D, d.H, d.P, ptr(w_hh), ptr(w_hh_bf16), ptr(w_hr), ptr(b_hn)};
  }
};

}  // namespace

// At most kScratchBytes are kept per thread; larger requests are plain allocations.
constexpr int64_t kScratchBytes = int64_t(1) << 29;

Tensor scratch(Scratch slot, IntArrayRef sizes, const Options& options) {
  thread_local Tensor cache[kSlots];
  int64_t numel = 1;
  for (int64_t s : sizes) numel *= s;
  const int64_t bytes = numel * static_cast<int64_t>(element_size(options.dtype()));
  int64_t held = 0;
  for (const Tensor& t : cache) held += t.defined() && &t != &cache[slot] ? t.nbytes() : 0;
  if (held + bytes > kScratchBytes) return empty(sizes, options);
  Tensor& buf = cache[slot];
  if (!buf.defined() || static_cast<int64_t>(buf.nbytes()) < bytes) {
    buf = Tensor();  // free first
    buf = empty({std::max<int64_t>(bytes, 1)}, options.dtype(kByte));
  }
  return buf.narrow(0, 0, bytes).view(options.dtype()).view(sizes);
}

LayerOutputs layer_forward_cpu(RecurrentCell cell, const LayerDims& d, const Tensor& input,
                               const Tensor& h0, const Tensor& c0, const Tensor& w_ih,
                               const Tensor& w_hh, const optional<Tensor>& b_ih,
                               const optional<Tensor>& b_hh, const optional<Tensor>& w_hr,
                               const optional<Tensor>& lengths, double dropout_p,
                               const optional<Tensor>& seed, bool save_workspace, const char* op) {
  const bool lstm = cell == RecurrentCell::lstm;
  const int64_t GH = d.G * d.H;
  const auto acc = compute_dtype(input.scalar_type());
  const auto opts = input.options();
  Tensor output = empty({d.T, d.B, d.D * d.P}, opts);
  Tensor h_n = empty({d.D, d.B, d.P}, opts);
  Tensor c_n = lstm ? empty({d.D, d.B, d.H}, opts) : Tensor();
  // Without save_workspace (inference) the kernel's states live in a reused scratch buffer and
  // an empty workspace is returned.
  Tensor saved = save_workspace
                     ? BlockCache::get().empty({d.D, workspace_per_direction(d)}, opts.dtype(acc))
                     : empty({0}, opts.dtype(acc));
  Tensor workspace = save_workspace
                         ? saved
                         : scratch(kWorkspace, {d.D, workspace_per_direction(d)}, opts.dtype(acc));
  poison(output);
  poison(h_n);
  poison(c_n);
  poison(saved);
  if (d.T == 0 || d.B == 0) {
    h_n.copy_(h0);
    if (lstm) c_n.copy_(c0);
    saved.zero_();
    return {output, h_n, c_n, saved};
  }
  const Packing pk = make_packing(lengths, d.T, d.B, op);
  const int64_t total = pk.total();
  if (!pk.identity) {
    output.zero_();                                          // positions past a sequence's end
    if (total < d.T * d.B && save_workspace) saved.zero_();  // rows no step writes
  }

  // The input projection of every step of both directions: one large GEMM per direction,
  // with the gate rows of W_ih in the kernel's blocked order and the biases folded in (the
  // reset-after GRU's b_hn stays apart: it sits inside r * (W_hn h + b_hn)).
  // bfloat16 layers on AVX512-BF16 multiply in bfloat16 dot products (float sums) where every
  // product stays exact: the per-step products (recurrent_cpu_kernel.h: h in two bfloat16
  // parts) and, without dropout, this projection (dropout's 1 / (1 - p) would be rounded).
  const bool bf16 = input.scalar_type() == kBFloat16 && cpu::bf16_products();
  const bool bf16_input = bf16 && dropout_p <= 0.0;
  LayerWeights pw(cell, w_hh, w_hr, acc, bf16);
  const Tensor order = blocked_gate_order(d.H, d.G, opts);
  const Tensor xp = bf16_input && pk.identity && input.is_contiguous()
                        ? input.view({d.T * d.B, d.I})
                        : packed_input(input, pk, dropout_p, seed);
  const Tensor w_ih_mm = bf16_input ? w_ih.contiguous() : w_ih.to(acc);
  Tensor bias_blk;
  if (defined(b_ih)) {
    Tensor hh = b_hh->to(acc);
    if (cell == RecurrentCell::gru) {
      pw.b_hn = hh.narrow(1, 2 * d.H, d.H).contiguous();
      hh = cat({hh.narrow(1, 0, 2 * d.H), zeros({d.D, d.H}, hh.options())}, 1);
    }
    bias_blk = b_ih->to(acc).add(hh).index_select(1, order);
  }
  // exact: without dropout xp holds bfloat16 values (no copy when it is the input itself)
  const Tensor x_bf16 = bf16_input ? xp.to(kBFloat16) : Tensor();
  for (int64_t dir = 0; dir < d.D; ++dir) {
    Tensor gates = workspace[dir].narrow(0, 0, total * GH).view({total, GH});
    const Tensor bias = bias_blk.defined() ? bias_blk[dir] : Tensor();
    if (bf16_input) {
      cpu::matmul_bf16_into(gates, x_bf16, w_ih_mm[dir], bias, false, order);
    } else {
      cpu::matmul_into(gates, xp, w_ih_mm[dir].t(), bias, false, order);
    }
  }

  // The kernel packs W_hh^T (blocked gate columns) into the panels its per-step GEMM streams.
  const Tensor h0c = h0.contiguous();
  const Tensor c0c = lstm ? c0.contiguous() : Tensor();
  cpu::RecurrentForwardParams p{pk.view(d.T, d.B),
                                pw.view(cell, d),
                                h0c.data_ptr(),
                                lstm ? c0c.data_ptr() : nullptr,
                                workspace.data_ptr(),
                                save_workspace,
                                output.data_ptr(),
                                h_n.data_ptr(),
                                lstm ? c_n.data_ptr() : nullptr};
  FASTATTN_DISPATCH_RECURRENT(input.scalar_type(),
                              [&] { FASTATTN_CPU_ISA_CALL(recurrent_layer_forward<scalar_t>, p); });
  return {output, h_n, c_n, saved};
}

LayerGrads layer_backward_cpu(RecurrentCell cell, const LayerDims& d, const Tensor& gout,
                              const Tensor& ghn, const Tensor& gcn, const Tensor& input,
                              const Tensor& h0, const Tensor& c0, const Tensor& w_ih,
                              const Tensor& w_hh, const optional<Tensor>& w_hr,
                              const optional<Tensor>& lengths, const Tensor& workspace,
                              double dropout_p, const optional<Tensor>& seed, bool has_bias,
                              bool input_grad, bool weight_grad, const char* op) {
  const bool lstm = cell == RecurrentCell::lstm;
  const int64_t GH = d.G * d.H;
  const auto acc = compute_dtype(input.scalar_type());
  const auto opts = input.options();
  LayerGrads g;
  g.h0 = empty({d.D, d.B, d.P}, opts);
  g.c0 = empty({lstm ? d.D : 0, d.B, d.H}, opts);
  // Gradients that were not asked for are returned as empty (0,) tensors.
  auto maybe_empty = [&](std::vector<int64_t> shape, bool wanted) {
    return empty(wanted ? shape : std::vector<int64_t>{0}, opts);
  };
  g.input = maybe_empty({d.T, d.B, d.I}, input_grad);
  const bool proj = defined(w_hr);
  g.w_ih = maybe_empty({d.D, GH, d.I}, weight_grad);
  g.w_hh = maybe_empty({d.D, GH, d.P}, weight_grad);
  g.b_ih = maybe_empty({d.D, GH}, weight_grad && has_bias);
  g.w_hr = maybe_empty({d.D, d.P, d.H}, weight_grad && proj);
  for (Tensor* t : {&g.h0, &g.c0, &g.input, &g.w_ih, &g.w_hh, &g.b_ih, &g.w_hr}) poison(*t);
  const Packing pk = make_packing(lengths, d.T, d.B, op);
  const int64_t total = pk.total();
  const auto acc_opts = opts.dtype(acc);
  Tensor dgates = scratch(kGrads, {d.D, total, GH}, acc_opts);
  Tensor hprev = scratch(kHprev, {d.D, total, d.P}, acc_opts);
  Tensor aux, dh, r;
  if (cell == RecurrentCell::gru) aux = scratch(kAux, {d.D, total, d.H}, acc_opts);
  if (proj) {
    dh = scratch(kProjGrads, {d.D, total, d.P}, acc_opts);
    r = scratch(kProjInputs, {d.D, total, d.H}, acc_opts);
  }
  if (d.T > 0 && d.B > 0) {
    const LayerWeights pw(cell, w_hh, w_hr, acc);
    const Tensor h0c = h0.contiguous();
    const Tensor c0c = lstm ? c0.contiguous() : Tensor();
    cpu::RecurrentBackwardParams p{pk.view(d.T, d.B),
                                   pw.view(cell, d),
                                   h0c.data_ptr(),
                                   lstm ? c0c.data_ptr() : nullptr,
                                   workspace.data_ptr(),
                                   gout.defined() ? gout.data_ptr() : nullptr,
                                   ghn.defined() ? ghn.data_ptr() : nullptr,
                                   lstm && gcn.defined() ? gcn.data_ptr() : nullptr,
                                   dgates.data_ptr(),
                                   aux.defined() ? aux.data_ptr() : nullptr,
                                   proj ? dh.data_ptr() : nullptr,
                                   proj ? r.data_ptr() : nullptr,
                                   hprev.data_ptr(),
                                   g.h0.data_ptr(),
                                   lstm ? g.c0.data_ptr() : nullptr};
    FASTATTN_DISPATCH_RECURRENT(
        input.scalar_type(), [&] { FASTATTN_CPU_ISA_CALL(recurrent_layer_backward<scalar_t>, p); });
  } else {
    g.h0.copy_(ghn.defined() ? ghn : zeros_like(h0));
    if (lstm) g.c0.copy_(gcn.defined() ? gcn : zeros_like(c0));
  }

  // Weight gradients: GEMMs over all time steps per direction. The GRU's n rows of W_hh read
  // another operand: the gradient of W_hn h + b_hn with h (reset-after), the gradient of n's
  // pre-activation with r * h (reset-before, saved in the workspace).
  g.b_hh = g.b_ih;
  if (weight_grad) {
    const Tensor xp = packed_input(input, pk, dropout_p, seed);
    const int64_t Bt = d.T * d.B, H = d.H;
    for (int64_t dir = 0; dir < d.D; ++dir) {
      const Tensor dg_t = dgates[dir].t();
      cpu::mm_into(g.w_ih[dir], dg_t, xp);
      if (cell == RecurrentCell::gru || cell == RecurrentCell::gru_reset_before) {
        cpu::mm_into(g.w_hh[dir].narrow(0, 0, 2 * H), dg_t.narrow(0, 0, 2 * H), hprev[dir]);
        if (cell == RecurrentCell::gru) {
          cpu::mm_into(g.w_hh[dir].narrow(0, 2 * H, H), aux[dir].t(), hprev[dir]);
        } else {
          const Tensor rh = workspace[dir].narrow(0, Bt * GH, total * H).view({total, H});
          cpu::mm_into(g.w_hh[dir].narrow(0, 2 * H, H), dg_t.narrow(0, 2 * H, H), rh);
        }
      } else {
        cpu::mm_into(g.w_hh[dir], dg_t, hprev[dir]);
      }
      if (proj) cpu::mm_into(g.w_hr[dir], dh[dir].t(), r[dir]);
    }
    if (has_bias) {
      g.b_ih.copy_(dgates.sum(1));
      if (cell == RecurrentCell::gru) {
        g.b_hh = cat({g.b_ih.narrow(1, 0, 2 * H), aux.sum(1).to(g.b_ih.scalar_type())}, 1);
      } else {
        g.b_hh = g.b_ih.clone();
      }
    }
  }
  // Input gradient: one GEMM (both directions summed), scattered back with the dropout mask.
  if (input_grad && input.numel() > 0) {
    Tensor dx = scratch(kInputGrad, {total, d.I}, acc_opts);
    // bfloat16 layers on AMX: the float gate gradients split in two bfloat16 parts against
    // W_ih in bfloat16 (exact), twice the products at the tiles' rate (docs/design/cpu_kernels.md).
    const bool split = input.scalar_type() == kBFloat16 && cpu::amx_products();
    const Tensor w = split ? w_ih.transpose(1, 2).contiguous() : w_ih.to(acc);
    for (int64_t dir = 0; dir < d.D; ++dir) {
      if (split) {
        cpu::matmul_split_bf16_into(dx, dgates[dir], w[dir], dir > 0);
      } else {
        cpu::matmul_into(dx, dgates[dir], w[dir], Tensor(), dir > 0);
      }
    }
    auto [s, stream] = read_seed(seed, dropout_p);
    cpu::RecurrentScatterParams sp{
        pk.view(d.T, d.B), dx.data_ptr(), g.input.data_ptr(), d.I, dropout_p, s, stream};
    FASTATTN_DISPATCH_RECURRENT(input.scalar_type(), [&] {
      FASTATTN_CPU_ISA_CALL(recurrent_scatter_grad_input<scalar_t>, sp);
    });
  }
  return g;
}

}  // namespace fastattn::recurrent
