// Bodies of the CUDA varlen_attention ops: argument checks (varlen_attention.h, shared with the
// CPU ops, plus the CUDA kernels' int32 limits), outputs, and the kernel arguments of
// the dense CUDA attention kernels (csrc/attention/attention_cuda_*.cuh) with per-sequence
// geometry (Problem::cu_q/cu_k, read by the kernels: select_sequence). varlen_attention_cuda.cu
// wraps these with the device guard and the current stream; tools/cuda_emu calls them on CPU
// tensors. cu_seqlens live on the device, so their values are checked by the Python wrapper
// (fastattn/ops/varlen_attention.py) and, with FASTATTN_DEBUG_CHECKS, inside the kernels.
#pragma once
#include "common/tensor_api.h"

#include <tuple>

#include "attention/attention.h"
#include "attention/attention_cuda_ops.h"
#include "varlen_attention/varlen_attention.h"
#include "common/debug.h"

namespace fastattn::varlen_attention::cuda_impl {

using std::optional;
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

// The CUDA kernels' own limits, beyond check_varlen's rules: int32 row indices of the packed
// tensors and of the (sequence, head) grid axis.
inline void check_cuda_limits(const Tensor& q, const Tensor& k, const Tensor& cu_q,
                              const char* op) {
  FASTATTN_CHECK(q.size(0) < kMaxRows && k.size(0) < kMaxRows, op,
                 "total_q and total_k must be < 2^30 on CUDA, got ", q.size(0), " and ", k.size(0));
  FASTATTN_CHECK((cu_q.numel() - 1) * q.size(1) < kMaxRows, op,
                 "B * Hq must be < 2^30 on CUDA, got ", (cu_q.numel() - 1) * q.size(1));
}

// The dense kernels' problem for packed tensors: (total, H, D) seen as (B, H, L, D) with batch
// stride 0 and L = max_seqlen; select_sequence moves each block to its sequence.
inline Problem varlen_problem(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_q,
                              const Tensor& cu_k, int64_t max_q, int64_t max_k,
                              const optional<Tensor>& alibi, double scale, double softcap,
                              int64_t causal_mode, int64_t wl, int64_t wr, double dropout_p,
                              const optional<Tensor>& seed, const char* op) {
  // (1, H, total, D) views give make_problem the strides (the window is set per sequence).
  auto view4 = [](const Tensor& t) { return t.unsqueeze(0).transpose(1, 2); };
  const Tensor q4 = view4(q), k4 = view4(k), v4 = view4(v);
  const int B = static_cast<int>(cu_q.numel() - 1);
  optional<Tensor> alibi4;
  if (alibi.has_value() && alibi->defined()) alibi4 = *alibi;
  // make_problem checks the batch of its views against nothing but q's: pass the alibi only
  // through its pointer and strides.
  Problem p = attn_impl::make_problem(q4, k4, v4, std::nullopt, std::nullopt, alibi4, scale,
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
  check_cuda_limits(q, k, cu_q, op);
  Tensor out = empty({q.size(0), q.size(1), v.size(2)}, q.options());
  Tensor lse = empty({q.size(1), q.size(0)}, q.options().dtype(attention::lse_dtype(q)));
  poison(out);
  poison(lse);
  if (out.numel() == 0 || cu_q.numel() == 1) return {out, lse};
  FwdParams fp{};
  fp.p = varlen_problem(q, k, v, cu_q, cu_k, max_q, max_k, alibi, scale, softcap, causal_mode, wl,
                        wr, dropout_p, seed, op);
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
  check_varlen_backward(grad_out, grad_lse, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, alibi,
                        dropout_p, seed, op);
  check_cuda_limits(q, k, cu_q, op);
  Tensor dlse;
  if (grad_lse.has_value() && grad_lse->defined()) {
    dlse = grad_lse->to(attention::lse_dtype(q)).contiguous();
  }
  Tensor dq = empty(q.sizes(), q.options());
  Tensor dk = empty(k.sizes(), k.options());
  Tensor dv = empty(v.sizes(), v.options());
  poison(dq);
  poison(dk);
  poison(dv);
  if (q.size(0) == 0 || k.size(0) == 0 || cu_q.numel() == 1) {  // nothing attends
    dq.zero_();
    dk.zero_();
    dv.zero_();
    return {dq, dk, dv};
  }
  Tensor delta = empty(lse.sizes(), lse.options());
  BwdParams bp{};
  bp.p = varlen_problem(q, k, v, cu_q, cu_k, max_q, max_k, alibi, scale, softcap, causal_mode, wl,
                        wr, dropout_p, seed, op);
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
