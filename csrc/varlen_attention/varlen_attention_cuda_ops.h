// Bodies of the CUDA varlen_attention ops: argument checks, outputs, and the kernel arguments of
// the dense CUDA attention kernels (csrc/attention/attention_cuda_*.cuh) with per-sequence
// geometry (Problem::cu_q/cu_k, read by the kernels: select_sequence). varlen_attention_cuda.cu
// wraps these with the device guard and the current stream; tools/cuda_emu calls them on CPU
// tensors. cu_seqlens live on the device, so their values are checked by the Python wrapper
// (fastattn/ops/varlen_attention.py) and, with FASTATTN_DEBUG_CHECKS, inside the kernels.
#pragma once
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <tuple>

#include "attention/attention.h"
#include "attention/attention_cuda_ops.h"
#include "common/debug.h"

namespace fastattn::varlen_attention::cuda_impl {

using at::Tensor;
using c10::optional;
namespace attn_impl = fastattn::attention::cuda_impl;
using fastattn::cuda::attn::BwdParams;
using fastattn::cuda::attn::FwdParams;
using fastattn::cuda::attn::Launch;
using fastattn::cuda::attn::Problem;

constexpr int64_t kMaxRows = int64_t{1} << 30;

// (total, H, D) rows start on 16-byte boundaries (16-bit types: cp.async tiles).
inline bool packed_rows_aligned16(const Tensor& t) {
  if (t.element_size() != 2 || reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) return false;
  for (int d = 0; d < 2; ++d) {
    if (t.size(d) > 1 && t.stride(d) % 8 != 0) return false;
  }
  return true;
}

inline void check_varlen(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_q,
                         const Tensor& cu_k, int64_t max_q, int64_t max_k,
                         const optional<Tensor>& alibi, double dropout_p,
                         const optional<Tensor>& seed, const char* op) {
  check_float_dtype(q, op, "q");
  FASTATTN_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, op,
                 "q, k and v must be packed (total, H, D), got ", q.sizes(), ", ", k.sizes(),
                 ", ", v.sizes());
  FASTATTN_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(), op,
                 "q, k and v must have the same dtype, got ", q.scalar_type(), ", ",
                 k.scalar_type(), ", ", v.scalar_type());
  check_same_device(q, k, op, "q", "k");
  check_same_device(q, v, op, "q", "v");
  FASTATTN_CHECK(k.size(1) == v.size(1) && k.size(1) > 0 && q.size(1) % k.size(1) == 0, op,
                 "q's heads must be a multiple of k/v's heads, got ", q.size(1), " and ",
                 k.size(1));
  FASTATTN_CHECK(k.size(2) == q.size(2), op, "q and k must have the same head dim, got ",
                 q.size(2), " and ", k.size(2));
  FASTATTN_CHECK(k.size(0) == v.size(0), op, "k and v must have the same total length, got ",
                 k.size(0), " and ", v.size(0));
  FASTATTN_CHECK(q.size(2) >= 1 && q.size(2) <= attention::kMaxHeadDim && v.size(2) >= 1 &&
                     v.size(2) <= attention::kMaxHeadDim,
                 op, "head dims must be in [1, ", attention::kMaxHeadDim, "], got ", q.size(2),
                 " and ", v.size(2));
  check_unit_last_stride(q, op, "q");
  check_unit_last_stride(k, op, "k");
  check_unit_last_stride(v, op, "v");
  for (const auto& [t, name] : {std::pair<const Tensor*, const char*>{&cu_q, "cu_seqlens_q"},
                                std::pair<const Tensor*, const char*>{&cu_k, "cu_seqlens_k"}}) {
    FASTATTN_CHECK(t->scalar_type() == at::kInt && t->dim() == 1 && t->numel() >= 1 &&
                       t->is_contiguous(),
                   op, name, " must be a contiguous int32 (B+1,) tensor, got ", t->scalar_type(),
                   " ", t->sizes());
    check_same_device(*t, q, op, name, "q");
  }
  FASTATTN_CHECK(cu_q.numel() == cu_k.numel(), op,
                 "cu_seqlens_q and cu_seqlens_k must have the same length B+1, got ",
                 cu_q.numel(), " and ", cu_k.numel());
  FASTATTN_CHECK(q.size(0) < kMaxRows && k.size(0) < kMaxRows, op,
                 "total_q and total_k must be < 2^30 on CUDA, got ", q.size(0), " and ",
                 k.size(0));
  FASTATTN_CHECK(max_q >= 0 && max_q < kMaxRows && max_k >= 0 && max_k < kMaxRows, op,
                 "max_seqlen_q and max_seqlen_k must be in [0, 2^30), got ", max_q, " and ",
                 max_k);
  // A non-empty packed tensor has a sequence of length >= 1 (the kernels' grid covers
  // max_seqlen tiles; the lengths themselves are checked on the device).
  FASTATTN_CHECK((q.size(0) == 0 || max_q >= 1) && (k.size(0) == 0 || max_k >= 1), op,
                 "max_seqlen_q/max_seqlen_k must be >= 1 when q/k have rows, got ", max_q,
                 " and ", max_k);
  FASTATTN_CHECK((cu_q.numel() - 1) * q.size(1) < kMaxRows, op,
                 "B * Hq must be < 2^30 on CUDA, got ", (cu_q.numel() - 1) * q.size(1));
  if (alibi.has_value() && alibi->defined()) {
    FASTATTN_CHECK(alibi->scalar_type() == at::kFloat && alibi->dim() == 2 &&
                       alibi->size(0) == cu_q.numel() - 1 && alibi->size(1) == q.size(1),
                   op, "alibi_slopes must be float32 (B, Hq) = (", cu_q.numel() - 1, ", ",
                   q.size(1), "), got ", alibi->scalar_type(), " ", alibi->sizes());
    check_same_device(*alibi, q, op, "alibi_slopes", "q");
  }
  check_seed(seed, dropout_p, q, op);
}

// The dense kernels' problem for packed tensors: (total, H, D) seen as (B, H, L, D) with batch
// stride 0 and L = max_seqlen; select_sequence moves each block to its sequence.
inline Problem varlen_problem(const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& cu_q, const Tensor& cu_k, int64_t max_q,
                              int64_t max_k, const optional<Tensor>& alibi, double scale,
                              double softcap, int64_t causal_mode, int64_t wl, int64_t wr,
                              double dropout_p, const optional<Tensor>& seed, const char* op) {
  // (1, H, total, D) views give make_problem the strides (the window is set per sequence).
  auto view4 = [](const Tensor& t) { return t.unsqueeze(0).transpose(1, 2); };
  const Tensor q4 = view4(q), k4 = view4(k), v4 = view4(v);
  const int B = static_cast<int>(cu_q.numel() - 1);
  optional<Tensor> alibi4;
  if (alibi.has_value() && alibi->defined()) alibi4 = *alibi;
  // make_problem checks the batch of its views against nothing but q's: pass the alibi only
  // through its pointer and strides.
  Problem p = attn_impl::make_problem(q4, k4, v4, c10::nullopt, c10::nullopt, alibi4, scale,
                                      softcap, 0, 0, dropout_p, seed, op);
  p.q_sb = p.k_sb = p.v_sb = 0;
  p.B = B;
  p.Lq = static_cast<int>(max_q);
  p.Lk = static_cast<int>(max_k);
  p.cu_q = cu_q.data_ptr<int32_t>();
  p.cu_k = cu_k.data_ptr<int32_t>();
  p.total_q = static_cast<int>(q.size(0));
  p.total_k = static_cast<int>(k.size(0));
  p.drop_lk = static_cast<int>(max_k);
  FASTATTN_CHECK(causal_mode >= 0 && causal_mode <= 2, op,
                 "causal_mode must be 0 (off), 1 (top-left) or 2 (bottom-right), got ",
                 causal_mode);
  FASTATTN_CHECK(wl >= -1 && wr >= -1, op, "window_left/window_right must be >= -1, got ", wl,
                 " and ", wr);
  p.causal_mode = static_cast<int>(causal_mode);
  p.window_left = static_cast<int>(std::min<int64_t>(wl, kMaxRows));
  p.window_right = static_cast<int>(std::min<int64_t>(wr, kMaxRows));
  p.q_aligned = packed_rows_aligned16(q);
  p.k_aligned = packed_rows_aligned16(k);
  p.v_aligned = packed_rows_aligned16(v);
  return p;
}

inline std::tuple<Tensor, Tensor> forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                          const Tensor& cu_q, const Tensor& cu_k, int64_t max_q,
                                          int64_t max_k, const optional<Tensor>& alibi,
                                          double scale, double softcap, int64_t causal_mode,
                                          int64_t wl, int64_t wr, double dropout_p,
                                          const optional<Tensor>& seed, const Launch& launch) {
  constexpr const char* op = "varlen_attention_forward";
  check_varlen(q, k, v, cu_q, cu_k, max_q, max_k, alibi, dropout_p, seed, op);
  Tensor out = at::empty({q.size(0), q.size(1), v.size(2)}, q.options());
  Tensor lse = at::empty({q.size(1), q.size(0)}, q.options().dtype(attention::lse_dtype(q)));
  poison(out);
  poison(lse);
  if (out.numel() == 0 || cu_q.numel() == 1) return {out, lse};
  FwdParams fp{};
  fp.p = varlen_problem(q, k, v, cu_q, cu_k, max_q, max_k, alibi, scale, softcap, causal_mode,
                        wl, wr, dropout_p, seed, op);
  fp.out = out.data_ptr();
  fp.o_sb = 0;
  fp.o_sh = out.stride(1);
  fp.o_sl = out.stride(0);
  fp.lse = lse.data_ptr();
  attn_impl::launch_forward(fp, attn_impl::dtype_of(q), launch);
  return {out, lse};
}

inline std::tuple<Tensor, Tensor, Tensor> backward(
    const Tensor& grad_out, const optional<Tensor>& grad_lse, const Tensor& q, const Tensor& k,
    const Tensor& v, const Tensor& out, const Tensor& lse, const Tensor& cu_q, const Tensor& cu_k,
    int64_t max_q, int64_t max_k, const optional<Tensor>& alibi, double scale, double softcap,
    int64_t causal_mode, int64_t wl, int64_t wr, double dropout_p, const optional<Tensor>& seed,
    const Launch& launch) {
  constexpr const char* op = "varlen_attention_backward";
  check_varlen(q, k, v, cu_q, cu_k, max_q, max_k, alibi, dropout_p, seed, op);
  FASTATTN_CHECK(out.dim() == 3 && out.size(0) == q.size(0) && out.size(1) == q.size(1) &&
                     out.size(2) == v.size(2) && grad_out.sizes() == out.sizes(),
                 op, "grad_out and out must be (total_q, Hq, Dv) = (", q.size(0), ", ",
                 q.size(1), ", ", v.size(2), "), got ", grad_out.sizes(), " and ", out.sizes());
  FASTATTN_CHECK(grad_out.scalar_type() == q.scalar_type() && out.scalar_type() == q.scalar_type(),
                 op, "grad_out and out must have q's dtype ", q.scalar_type(), ", got ",
                 grad_out.scalar_type(), " and ", out.scalar_type());
  check_same_device(grad_out, q, op, "grad_out", "q");
  check_same_device(out, q, op, "out", "q");
  check_same_device(lse, q, op, "lse", "q");
  check_unit_last_stride(grad_out, op, "grad_out");
  check_unit_last_stride(out, op, "out");
  FASTATTN_CHECK(lse.scalar_type() == attention::lse_dtype(q) && lse.is_contiguous() &&
                     lse.dim() == 2 && lse.size(0) == q.size(1) && lse.size(1) == q.size(0),
                 op, "lse must be a contiguous ", attention::lse_dtype(q), " (Hq, total_q) = (",
                 q.size(1), ", ", q.size(0), ") tensor, got ", lse.scalar_type(), " ",
                 lse.sizes());
  Tensor dlse;
  if (grad_lse.has_value() && grad_lse->defined()) {
    check_same_device(*grad_lse, q, op, "grad_lse", "q");
    dlse = grad_lse->to(attention::lse_dtype(q)).contiguous();
    FASTATTN_CHECK(dlse.sizes() == lse.sizes(), op, "grad_lse must be (Hq, total_q), got ",
                   grad_lse->sizes());
  }
  Tensor dq = at::empty(q.sizes(), q.options());
  Tensor dk = at::empty(k.sizes(), k.options());
  Tensor dv = at::empty(v.sizes(), v.options());
  poison(dq);
  poison(dk);
  poison(dv);
  if (q.size(0) == 0 || k.size(0) == 0 || cu_q.numel() == 1) {  // nothing attends
    dq.zero_();
    dk.zero_();
    dv.zero_();
    return {dq, dk, dv};
  }
  Tensor delta = at::empty(lse.sizes(), lse.options());
  BwdParams bp{};
  bp.p = varlen_problem(q, k, v, cu_q, cu_k, max_q, max_k, alibi, scale, softcap, causal_mode,
                        wl, wr, dropout_p, seed, op);
  bp.out = out.data_ptr();
  bp.o_sb = 0;
  bp.o_sh = out.stride(1);
  bp.o_sl = out.stride(0);
  bp.dout = grad_out.data_ptr();
  bp.do_sb = 0;
  bp.do_sh = grad_out.stride(1);
  bp.do_sl = grad_out.stride(0);
  bp.do_aligned = packed_rows_aligned16(grad_out);
  bp.lse = lse.data_ptr();
  bp.dlse = dlse.defined() ? dlse.data_ptr() : nullptr;
  bp.delta = delta.data_ptr();
  attn_impl::set_grad_outputs(bp, dq, dk, dv);
  attn_impl::launch_backward(bp, attn_impl::dtype_of(q), launch);
  return {dq, dk, dv};
}

}  // namespace fastattn::varlen_attention::cuda_impl
