// CPU bodies of the LSTM ops: checks, the sorted/packed view of a variable-length batch,
// weight packing, the large GEMMs (input projection for all time steps before the recurrence,
// weight gradients over all time steps after it) and the ISA-dispatched recurrence loops of
// lstm_cpu_kernel.cpp.
#include <ATen/Dispatch.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/sum.h>
#include <ATen/ops/zeros_like.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>
#include <cstdlib>
#include <mutex>

#include "common/cpu_isa.h"
#include "common/debug.h"
#include "lstm/lstm.h"
#include "lstm/lstm_cpu_kernel.h"

namespace fastattn::lstm {
namespace {

using at::Tensor;
using c10::optional;

#define FASTATTN_DISPATCH_LSTM(TYPE, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, TYPE, "lstm_cpu", __VA_ARGS__)

// Host-side sorted/packed description of the batch (see lstm_cpu_kernel.h). Reading lengths
// here, inside the op, keeps the Python driver free of data-dependent control flow.
struct Packing {
  std::vector<int64_t> perm, lengths, batch_sizes, offsets;
  bool identity = true;  // no lengths (or all equal to T, already in order)

  cpu::LstmPacking view(int64_t T, int64_t B) const {
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
      FASTATTN_CHECK(l[b] >= 0 && l[b] <= T, op, "lengths must be in [0, T] = [0, ", T,
                     "], got ", l[b], " for batch entry ", b);
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
// above glibc's mmap threshold is page-faulted and zero-filled on every call (78 MB: 42 ms
// here, as much as a tenth of the forward). At most kMaxCachedBytes stay cached.
class BlockCache {
 public:
  static BlockCache& get() {
    static BlockCache* cache = new BlockCache();  // never destroyed: tensors may outlive exit
    return *cache;
  }

  Tensor empty(at::IntArrayRef sizes, const at::TensorOptions& options) {
    int64_t numel = 1;
    for (int64_t s : sizes) numel *= s;
    const size_t bytes =
        static_cast<size_t>(numel) * c10::elementSize(options.dtype().toScalarType());
    if (bytes < (size_t(1) << 22) || bytes > kMaxCachedBytes) return at::empty(sizes, options);
    auto [ptr, capacity] = take(bytes);
    return at::from_blob(
        ptr, sizes, [capacity = capacity](void* p) { BlockCache::get().give(p, capacity); },
        options);
  }

 private:
  static constexpr size_t kMaxCachedBytes = size_t(1) << 30;

  std::pair<void*, size_t> take(size_t bytes) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      size_t best = blocks_.size();
      for (size_t i = 0; i < blocks_.size(); ++i) {  // smallest block that fits, within 2x
        const size_t cap = blocks_[i].second;
        if (cap >= bytes && cap <= 2 * bytes && (best == blocks_.size() || cap < blocks_[best].second)) {
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
    TORCH_CHECK(p != nullptr, "lstm: out of memory allocating a ", bytes, "-byte workspace");
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

// Grow-only per-thread buffers for the large temporaries that never leave an op call (the
// packed input, dgates, ...): a fresh allocation above glibc's mmap threshold is page-faulted
// and zero-filled by the kernel on every call (about 0.45 ms per MB here, 35 ms for the 78 MB
// workspace of the fastrnns case). At most kScratchBytes are kept per thread; larger requests
// are plain allocations.
enum Scratch : int {
  kPackedInput, kWorkspace, kGrads, kHprev, kProjGrads, kProjInputs, kInputGrad, kSlots
};
constexpr int64_t kScratchBytes = int64_t(1) << 29;

Tensor scratch(Scratch slot, at::IntArrayRef sizes, const at::TensorOptions& options) {
  thread_local Tensor cache[kSlots];
  int64_t numel = 1;
  for (int64_t s : sizes) numel *= s;
  const int64_t bytes = numel * static_cast<int64_t>(c10::elementSize(options.dtype().toScalarType()));
  int64_t held = 0;
  for (const Tensor& t : cache) held += t.defined() && &t != &cache[slot] ? t.nbytes() : 0;
  if (held + bytes > kScratchBytes) return at::empty(sizes, options);
  Tensor& buf = cache[slot];
  if (!buf.defined() || static_cast<int64_t>(buf.nbytes()) < bytes) {
    buf = Tensor();  // free first
    buf = at::empty({std::max<int64_t>(bytes, 1)}, options.dtype(at::kByte));
  }
  return buf.narrow(0, 0, bytes).view(options.dtype().toScalarType()).view(sizes);
}

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
  cpu::LstmGatherParams p{pk.view(T, B), x.data_ptr(), I, x.stride(0), x.stride(1),
                          xp.data_ptr(), dropout_p, s, stream};
  FASTATTN_DISPATCH_LSTM(input.scalar_type(), [&] {
    FASTATTN_CPU_ISA_CALL(lstm_gather_input<scalar_t>, p);
  });
  return xp;
}

// Row order of the blocked gate layout: blocked row 4*u0 + g*hb + u is natural row g*H + u0 + u
// for the unit block starting at u0 with hb units.
Tensor blocked_gate_order(int64_t H, const at::TensorOptions& options) {
  std::vector<int64_t> order(4 * H);
  for (int64_t u0 = 0; u0 < H; u0 += cpu::kLstmUnitBlock) {
    const int64_t hb = std::min(cpu::kLstmUnitBlock, H - u0);
    for (int64_t g = 0; g < 4; ++g) {
      for (int64_t u = 0; u < hb; ++u) order[4 * u0 + g * hb + u] = g * H + u0 + u;
    }
  }
  Tensor t = at::empty({4 * H}, options.dtype(at::kLong));
  std::copy(order.begin(), order.end(), t.data_ptr<int64_t>());
  return t;
}

// out (+)= a @ b (+ bias on every row), all in the compute type, out with a unit column stride.
// Float GEMMs run fastattn's packed AVX-512 driver (lstm_gemm) where that micro-kernel exists:
// on AMD CPUs MKL's sgemm takes a slower, non-AVX-512 path (about 70% of the FMA peak here).
// b_cols (optional, int64): column n of the product uses column b_cols[n] of b.
void matmul_into(Tensor out, const Tensor& a, const Tensor& b, const Tensor& bias,
                 bool accumulate, const Tensor& b_cols = Tensor()) {
  if (out.scalar_type() == at::kFloat && cpu::cpu_isa() >= cpu::Isa::avx512 &&
      out.stride(1) == 1) {
    const int64_t N = out.size(1);
    cpu::LstmGemmParams p{a.size(0), N, a.size(1), a.data_ptr<float>(), a.stride(0), a.stride(1),
                          b.data_ptr<float>(), b.stride(0), b.stride(1),
                          b_cols.defined() ? b_cols.data_ptr<int64_t>() : nullptr,
                          out.data_ptr<float>(), out.stride(0),
                          bias.defined() ? bias.data_ptr<float>() : nullptr, accumulate};
    cpu::avx512::lstm_gemm(p);
    return;
  }
  if (b_cols.defined()) {
    matmul_into(out, a, b.index_select(1, b_cols), bias, accumulate);
    return;
  }
  if (accumulate) {
    out.addmm_(a, b);
    if (bias.defined()) out.add_(bias);
  } else if (bias.defined()) {
    at::addmm_out(out, bias, a, b);
  } else {
    at::mm_out(out, a, b);
  }
}

// out = a @ b for an output in the storage type (converted when that is not the compute type).
void mm_into(Tensor out, const Tensor& a, const Tensor& b) {
  if (out.scalar_type() == a.scalar_type()) {
    matmul_into(out, a, b, Tensor(), false);
  } else {
    Tensor tmp = at::empty({a.size(0), b.size(1)}, a.options());  // weight-sized
    matmul_into(tmp, a, b, Tensor(), false);
    out.copy_(tmp);
  }
}

// The recurrent weights in the compute type, contiguous (no copy for contiguous float32 /
// float64 parameters), kept alive while the kernel reads them.
struct LayerWeights {
  Tensor w_hh, w_hr;
  LayerWeights(const Tensor& hh, const optional<Tensor>& hr, at::ScalarType acc)
      : w_hh(hh.to(acc).contiguous()) {
    if (defined(hr)) w_hr = hr->to(acc).contiguous();
  }
  cpu::LstmLayerWeights view(const LayerDims& d) const {
    return {d.D, d.H, d.P, w_hh.data_ptr(), w_hr.defined() ? w_hr.data_ptr() : nullptr};
  }
};

std::tuple<Tensor, Tensor, Tensor, Tensor> lstm_layer_cpu(
    const Tensor& input, const Tensor& h0, const Tensor& c0, const Tensor& w_ih,
    const Tensor& w_hh, const optional<Tensor>& b_ih, const optional<Tensor>& b_hh,
    const optional<Tensor>& w_hr, const optional<Tensor>& lengths, double dropout_p,
    const optional<Tensor>& seed, bool save_workspace) {
  constexpr const char* op = "lstm_layer";
  const LayerDims d = check_layer(input, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr, lengths, op);
  check_seed(seed, dropout_p, input, op);
  const auto acc = compute_dtype(input.scalar_type());
  const auto opts = input.options();
  Tensor output = at::empty({d.T, d.B, d.D * d.P}, opts);
  Tensor h_n = at::empty({d.D, d.B, d.P}, opts);
  Tensor c_n = at::empty({d.D, d.B, d.H}, opts);
  // Without save_workspace (inference) the kernel's states live in a reused scratch buffer and
  // an empty workspace is returned.
  Tensor saved = save_workspace
      ? BlockCache::get().empty({d.D, workspace_per_direction(d)}, opts.dtype(acc))
      : at::empty({0}, opts.dtype(acc));
  Tensor workspace = save_workspace
      ? saved
      : scratch(kWorkspace, {d.D, workspace_per_direction(d)}, opts.dtype(acc));
  poison(output);
  poison(h_n);
  poison(c_n);
  poison(saved);
  if (d.T == 0 || d.B == 0) {
    h_n.copy_(h0);
    c_n.copy_(c0);
    saved.zero_();
    return {output, h_n, c_n, saved};
  }
  const Packing pk = make_packing(lengths, d.T, d.B, op);
  const int64_t total = pk.total();
  if (!pk.identity) {
    output.zero_();                  // positions past a sequence's end
    if (total < d.T * d.B && save_workspace) saved.zero_();  // rows no step writes
  }

  // The input projection of every step of both directions: one large GEMM per direction,
  // with the gate rows of W_ih in the kernel's blocked order and both biases folded in.
  const Tensor order = blocked_gate_order(d.H, opts);
  const Tensor xp = packed_input(input, pk, dropout_p, seed);
  const Tensor w_ih_acc = w_ih.to(acc);
  Tensor bias_blk;
  if (defined(b_ih)) bias_blk = b_ih->to(acc).add(b_hh->to(acc)).index_select(1, order);
  for (int64_t dir = 0; dir < d.D; ++dir) {
    Tensor gates = workspace[dir].narrow(0, 0, total * 4 * d.H).view({total, 4 * d.H});
    matmul_into(gates, xp, w_ih_acc[dir].t(), bias_blk.defined() ? bias_blk[dir] : Tensor(),
                false, order);
  }

  // The kernel packs W_hh^T (blocked gate columns) into the panels its per-step GEMM streams.
  const LayerWeights pw(w_hh, w_hr, acc);
  const Tensor h0c = h0.contiguous(), c0c = c0.contiguous();
  cpu::LstmForwardParams p{pk.view(d.T, d.B), pw.view(d), h0c.data_ptr(), c0c.data_ptr(),
                           workspace.data_ptr(), output.data_ptr(), h_n.data_ptr(),
                           c_n.data_ptr()};
  FASTATTN_DISPATCH_LSTM(input.scalar_type(), [&] {
    FASTATTN_CPU_ISA_CALL(lstm_layer_forward<scalar_t>, p);
  });
  return {output, h_n, c_n, saved};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> lstm_layer_backward_cpu(
    const optional<Tensor>& grad_output, const optional<Tensor>& grad_h_n,
    const optional<Tensor>& grad_c_n, const Tensor& input, const Tensor& h0, const Tensor& c0,
    const Tensor& w_ih, const Tensor& w_hh, const optional<Tensor>& w_hr,
    const optional<Tensor>& lengths, const Tensor& workspace, double dropout_p,
    const optional<Tensor>& seed, bool has_bias, bool input_grad, bool weight_grad) {
  constexpr const char* op = "lstm_layer_backward";
  const LayerDims d = check_layer(input, h0, c0, w_ih, w_hh, c10::nullopt, c10::nullopt, w_hr,
                                  lengths, op);
  check_seed(seed, dropout_p, input, op);
  const auto acc = compute_dtype(input.scalar_type());
  const auto opts = input.options();
  const auto [gout, ghn, gcn] =
      check_layer_backward(grad_output, grad_h_n, grad_c_n, input, workspace, d, op);

  Tensor grad_h0 = at::empty({d.D, d.B, d.P}, opts);
  Tensor grad_c0 = at::empty({d.D, d.B, d.H}, opts);
  // Gradients that were not asked for are returned as empty (0,) tensors.
  auto maybe_empty = [&](std::vector<int64_t> shape, bool wanted) {
    return at::empty(wanted ? shape : std::vector<int64_t>{0}, opts);
  };
  Tensor grad_input = maybe_empty({d.T, d.B, d.I}, input_grad);
  const bool proj = defined(w_hr);
  auto weight_shape = [&](std::vector<int64_t> shape, bool present) {
    return maybe_empty(std::move(shape), weight_grad && present);
  };
  Tensor grad_w_ih = weight_shape({d.D, 4 * d.H, d.I}, true);
  Tensor grad_w_hh = weight_shape({d.D, 4 * d.H, d.P}, true);
  Tensor grad_b = weight_shape({d.D, 4 * d.H}, has_bias);
  Tensor grad_w_hr = weight_shape({d.D, d.P, d.H}, proj);
  for (Tensor* t : {&grad_h0, &grad_c0, &grad_input, &grad_w_ih, &grad_w_hh, &grad_b, &grad_w_hr}) {
    poison(*t);
  }
  const Packing pk = make_packing(lengths, d.T, d.B, op);
  const int64_t total = pk.total();
  const auto acc_opts = opts.dtype(acc);
  Tensor dgates = scratch(kGrads, {d.D, total, 4 * d.H}, acc_opts);
  Tensor hprev = scratch(kHprev, {d.D, total, d.P}, acc_opts);
  Tensor dh, r;
  if (proj) {
    dh = scratch(kProjGrads, {d.D, total, d.P}, acc_opts);
    r = scratch(kProjInputs, {d.D, total, d.H}, acc_opts);
  }
  if (d.T > 0 && d.B > 0) {
    const LayerWeights pw(w_hh, w_hr, acc);
    const Tensor h0c = h0.contiguous(), c0c = c0.contiguous();
    cpu::LstmBackwardParams p{pk.view(d.T, d.B),
                              pw.view(d),
                              h0c.data_ptr(),
                              c0c.data_ptr(),
                              workspace.data_ptr(),
                              gout.defined() ? gout.data_ptr() : nullptr,
                              ghn.defined() ? ghn.data_ptr() : nullptr,
                              gcn.defined() ? gcn.data_ptr() : nullptr,
                              dgates.data_ptr(),
                              proj ? dh.data_ptr() : nullptr,
                              proj ? r.data_ptr() : nullptr,
                              hprev.data_ptr(),
                              grad_h0.data_ptr(),
                              grad_c0.data_ptr()};
    FASTATTN_DISPATCH_LSTM(input.scalar_type(), [&] {
      FASTATTN_CPU_ISA_CALL(lstm_layer_backward<scalar_t>, p);
    });
  } else {
    grad_h0.copy_(defined(grad_h_n) ? *grad_h_n : at::zeros_like(h0));
    grad_c0.copy_(defined(grad_c_n) ? *grad_c_n : at::zeros_like(c0));
  }

  // Weight gradients: one GEMM over all time steps per direction.
  if (weight_grad) {
    const Tensor xp = packed_input(input, pk, dropout_p, seed);
    for (int64_t dir = 0; dir < d.D; ++dir) {
      const Tensor dg_t = dgates[dir].t();
      mm_into(grad_w_ih[dir], dg_t, xp);
      mm_into(grad_w_hh[dir], dg_t, hprev[dir]);
      if (proj) mm_into(grad_w_hr[dir], dh[dir].t(), r[dir]);
    }
    if (has_bias) grad_b.copy_(dgates.sum(1));
  }
  // Input gradient: one GEMM (both directions summed), scattered back with the dropout mask.
  if (input_grad && input.numel() > 0) {
    const Tensor w = w_ih.to(acc);
    Tensor dx = scratch(kInputGrad, {total, d.I}, acc_opts);
    for (int64_t dir = 0; dir < d.D; ++dir) matmul_into(dx, dgates[dir], w[dir], Tensor(), dir > 0);
    auto [s, stream] = read_seed(seed, dropout_p);
    cpu::LstmScatterParams sp{pk.view(d.T, d.B), dx.data_ptr(), grad_input.data_ptr(), d.I,
                              dropout_p, s, stream};
    FASTATTN_DISPATCH_LSTM(input.scalar_type(), [&] {
      FASTATTN_CPU_ISA_CALL(lstm_scatter_grad_input<scalar_t>, sp);
    });
  }
  return {grad_input, grad_h0, grad_c0, grad_w_ih, grad_w_hh, grad_b, grad_w_hr};
}

// ---------------------------------------------------------------------------------------------
// Cell

// Batches up to this size run the fused cell (dot products of the weight rows, one pass over
// the weights); larger ones a GEMM (MKL) for the pre-activations, then the fused pointwise cell.
constexpr int64_t kCellFusedMaxBatch = 8;

std::tuple<Tensor, Tensor, Tensor> lstm_cell_cpu(const Tensor& input, const Tensor& hx,
                                                 const Tensor& cx, const Tensor& w_ih,
                                                 const Tensor& w_hh, const optional<Tensor>& b_ih,
                                                 const optional<Tensor>& b_hh) {
  constexpr const char* op = "lstm_cell";
  check_cell(input, hx, cx, w_ih, w_hh, b_ih, b_hh, op);
  const int64_t B = input.size(0), I = input.size(1), H = w_hh.size(1);
  const auto acc = compute_dtype(input.scalar_type());
  Tensor hy = at::empty({B, H}, input.options());
  Tensor cy = at::empty({B, H}, input.options());
  Tensor workspace = at::empty({B, 5 * H}, input.options().dtype(acc));
  poison(hy);
  poison(cy);
  poison(workspace);
  if (B == 0) return {hy, cy, workspace};
  const Tensor x = input.to(acc).contiguous(), h = hx.to(acc).contiguous();
  const Tensor c = cx.contiguous();
  Tensor bias;
  if (defined(b_ih)) bias = b_ih->to(acc).add(b_hh->to(acc));
  Tensor pre, wi, wh;
  if (B > kCellFusedMaxBatch) {
    pre = bias.defined() ? at::addmm(bias, x, w_ih.to(acc).t()) : at::mm(x, w_ih.to(acc).t());
    pre.addmm_(h, w_hh.to(acc).t());
  } else {
    wi = w_ih.to(acc).contiguous();
    wh = w_hh.to(acc).contiguous();
  }
  cpu::LstmCellParams p{B,
                        I,
                        H,
                        pre.defined() ? pre.data_ptr() : nullptr,
                        x.data_ptr(),
                        h.data_ptr(),
                        c.data_ptr(),
                        wi.defined() ? wi.data_ptr() : nullptr,
                        wh.defined() ? wh.data_ptr() : nullptr,
                        bias.defined() ? bias.data_ptr() : nullptr,
                        workspace.data_ptr(),
                        hy.data_ptr(),
                        cy.data_ptr()};
  FASTATTN_DISPATCH_LSTM(input.scalar_type(), [&] {
    FASTATTN_CPU_ISA_CALL(lstm_cell_forward<scalar_t>, p);
  });
  return {hy, cy, workspace};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> lstm_cell_backward_cpu(
    const optional<Tensor>& grad_hy, const optional<Tensor>& grad_cy, const Tensor& input,
    const Tensor& hx, const Tensor& cx, const Tensor& w_ih, const Tensor& w_hh,
    const Tensor& workspace, bool has_bias) {
  constexpr const char* op = "lstm_cell_backward";
  check_cell(input, hx, cx, w_ih, w_hh, c10::nullopt, c10::nullopt, op);
  const int64_t B = input.size(0), H = w_hh.size(1);
  const auto acc = compute_dtype(input.scalar_type());
  const auto [ghy, gcy] = check_cell_backward(grad_hy, grad_cy, input, workspace, B, H, op);
  Tensor dgates = at::empty({B, 4 * H}, input.options().dtype(acc));
  Tensor grad_cx = at::empty({B, H}, input.options());
  poison(grad_cx);
  const Tensor c = cx.contiguous();
  cpu::LstmCellBackwardParams p{B,
                                H,
                                ghy.defined() ? ghy.data_ptr() : nullptr,
                                gcy.defined() ? gcy.data_ptr() : nullptr,
                                c.data_ptr(),
                                workspace.data_ptr(),
                                dgates.data_ptr(),
                                grad_cx.data_ptr()};
  if (B > 0) {
    FASTATTN_DISPATCH_LSTM(input.scalar_type(), [&] {
      FASTATTN_CPU_ISA_CALL(lstm_cell_backward<scalar_t>, p);
    });
  }
  const auto dtype = input.scalar_type();
  const Tensor wi = w_ih.to(acc), wh = w_hh.to(acc);
  Tensor grad_input = at::mm(dgates, wi).to(dtype);
  Tensor grad_hx = at::mm(dgates, wh).to(dtype);
  Tensor grad_w_ih = at::mm(dgates.t(), input.to(acc)).to(dtype);
  Tensor grad_w_hh = at::mm(dgates.t(), hx.to(acc)).to(dtype);
  Tensor grad_bias = has_bias ? dgates.sum(0).to(dtype) : at::empty({0}, input.options());
  return {grad_input, grad_hx, grad_cx, grad_w_ih, grad_w_hh, grad_bias};
}

}  // namespace

TORCH_LIBRARY_IMPL(fastattn, CPU, m) {
  m.impl("lstm_cell", &lstm_cell_cpu);
  m.impl("lstm_cell_backward", &lstm_cell_backward_cpu);
  m.impl("lstm_layer", &lstm_layer_cpu);
  m.impl("lstm_layer_backward", &lstm_layer_backward_cpu);
}

}  // namespace fastattn::lstm
