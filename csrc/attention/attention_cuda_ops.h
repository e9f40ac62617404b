// Bodies of the CUDA attention ops: argument checks (attention.h: check_problem for the
// forward, check_backward for the backward, shared with the CPU ops),
// output allocation and poisoning, kernel arguments, and the choice of kernel (dtype and head-dim
// bucket). attention_cuda.cu wraps these with the device guard and the current stream; the CPU
// emulator of tools/cuda_emu calls the very same functions on CPU tensors.
#pragma once
#include "common/tensor_api.h"

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <tuple>
#include <vector>

#include "attention/attention.h"
#include "attention/attention_cuda_params.h"
#include "common/debug.h"

namespace fastattn::attention::cuda_impl {

using fastattn::cuda::attn::BwdParams;
using fastattn::cuda::attn::Dtype;
using fastattn::cuda::attn::FwdParams;
using fastattn::cuda::attn::Launch;
using fastattn::cuda::attn::Problem;
using std::optional;

inline bool defined(const optional<Tensor>& t) { return t.has_value() && t->defined(); }

// The shared memory per block the launchers may use: the device's opt-in limit, capped by
// FASTATTN_CUDA_SMEM_LIMIT (bytes) when set, so that a large GPU runs the smaller-tile variants
// of smaller ones (e.g. 101376 for sm_86/89/120, 166912 for sm_80) in tests. Read per call.
inline int smem_limit(int device_optin) {
  const char* env = std::getenv("FASTATTN_CUDA_SMEM_LIMIT");
  if (env == nullptr || *env == '\0') return device_optin;
  char* end = nullptr;
  errno = 0;
  const long cap = std::strtol(env, &end, 10);
  FASTATTN_CHECK(errno == 0 && *end == '\0' && cap > 0 && cap <= (1L << 30),
                 "FASTATTN_CUDA_SMEM_LIMIT", "must be a positive number of bytes, got '", env, "'");
  return static_cast<int>(std::min<long>(cap, device_optin));
}

// Rows of a 16-bit (B, H, L, D) tensor start on 16-byte boundaries (cp.async tiles): the base
// pointer and every stride of a dimension that is not 1 long are multiples of 8 elements.
inline bool rows_aligned16(const Tensor& t) {
  if (reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 != 0) return false;
  const int64_t per16 = 16 / static_cast<int64_t>(t.element_size());
  for (int d = 0; d < 3; ++d) {
    if (t.size(d) > 1 && t.stride(d) % per16 != 0) return false;
  }
  return true;
}

inline Dtype dtype_of(const Tensor& t) {
  switch (t.scalar_type()) {
    case kHalf:
      return Dtype::f16;
    case kBFloat16:
      return Dtype::bf16;
    case kFloat:
      return Dtype::f32;
    case kDouble:
      return Dtype::f64;
    default:
      FASTATTN_CHECK(false, "attention (cuda)", "unsupported dtype ", t.scalar_type());
  }
}

inline int mask_kind_of(const optional<Tensor>& mask) {
  using namespace fastattn::cuda::attn;
  if (!defined(mask)) return kMaskNone;
  switch (mask->scalar_type()) {
    case kBool:
      return kMaskBool;
    case kFloat:
      return kMaskF32;
    case kDouble:
      return kMaskF64;
    case kHalf:
      return kMaskF16;
    case kBFloat16:
      return kMaskBF16;
    default:
      FASTATTN_CHECK(false, "attention (cuda)", "unsupported attn_mask dtype ",
                     mask->scalar_type());
  }
}

inline Problem make_problem(const Tensor& q, const Tensor& k, const Tensor& v,
                            const optional<Tensor>& attn_mask,
                            const optional<Tensor>& key_padding_mask,
                            const optional<Tensor>& alibi_slopes, double scale, double softcap,
                            int64_t window_lo, int64_t window_hi, double dropout_p,
                            const optional<Tensor>& seed, const char* op) {
  // Indices are int inside the kernels (i + window bounds included), tile counts int64;
  // check_problem (attention.h) keeps the lengths below 2^30.
  constexpr int64_t kMaxLen = int64_t{1} << 30;
  FASTATTN_CHECK(q.size(0) * q.size(1) < kMaxLen, op, "B * Hq must be < 2^30 on CUDA, got ",
                 q.size(0) * q.size(1));
  Problem p{};
  p.dtype = dtype_of(q);
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.q_sb = q.stride(0);
  p.q_sh = q.stride(1);
  p.q_sl = q.stride(2);
  p.k_sb = k.stride(0);
  p.k_sh = k.stride(1);
  p.k_sl = k.stride(2);
  p.v_sb = v.stride(0);
  p.v_sh = v.stride(1);
  p.v_sl = v.stride(2);
  p.B = static_cast<int>(q.size(0));
  p.Hq = static_cast<int>(q.size(1));
  p.Hkv = static_cast<int>(k.size(1));
  p.Lq = static_cast<int>(q.size(2));
  p.Lk = static_cast<int>(k.size(2));
  p.D = static_cast<int>(q.size(3));
  p.Dv = static_cast<int>(v.size(3));
  p.group = p.Hq / p.Hkv;
  p.mask_kind = mask_kind_of(attn_mask);
  if (defined(attn_mask)) {  // read through its broadcast view (stride 0 on size-1 dims)
    const Tensor m = expanded_mask(*attn_mask, q, k);
    p.mask = m.data_ptr();
    p.mask_sb = m.stride(0);
    p.mask_sh = m.stride(1);
    p.mask_sq = m.stride(2);
    p.mask_sk = m.stride(3);
  }
  p.padding = defined(key_padding_mask)
                  ? reinterpret_cast<const uint8_t*>(key_padding_mask->data_ptr<bool>())
                  : nullptr;
  if (defined(alibi_slopes)) {
    p.alibi = alibi_slopes->data_ptr<float>();
    p.alibi_sb = alibi_slopes->stride(0);
    p.alibi_sh = alibi_slopes->stride(1);
  }
  p.scale = scale;
  p.softcap = softcap;
  // Same visibility with bounds in [-Lq, Lk]: j >= i + lo always holds for lo <= -Lq, never for
  // lo >= Lk (and likewise for hi), so the kernels' i + lo and i + hi stay small ints.
  p.window_lo = static_cast<int>(std::clamp<int64_t>(window_lo, -q.size(2), k.size(2)));
  p.window_hi = static_cast<int>(std::clamp<int64_t>(window_hi, -q.size(2), k.size(2)));
  p.shift = p.Lk - p.Lq;  // ALiBi: query i sits at key position i + Lk - Lq
  p.dropout = dropout_p > 0.0;
  p.dropout_threshold = static_cast<float>(dropout_p);
  p.keep_scale = 1.0 / (1.0 - dropout_p);
  p.seed = p.dropout ? seed->data_ptr<int64_t>() : nullptr;
  const bool sixteen_bit = q.element_size() == 2;
  p.q_aligned = sixteen_bit && rows_aligned16(q);
  p.k_aligned = sixteen_bit && rows_aligned16(k);
  p.v_aligned = sixteen_bit && rows_aligned16(v);
  return p;
}

// dQ, dK, dV of a backward (strides of dims 0..2; the last is 1). Dense: contiguous
// (B, H, L, D); varlen: packed (total, H, D) seen as batch stride 0, head, row.
inline void set_grad_outputs(BwdParams& bp, const Tensor& dq, const Tensor& dk, const Tensor& dv) {
  bp.dq = dq.data_ptr();
  bp.dk = dk.data_ptr();
  bp.dv = dv.data_ptr();
  if (dq.dim() == 3) {
    bp.dq_sb = 0;
    bp.dq_sh = dq.stride(1);
    bp.dq_sl = dq.stride(0);
    bp.dk_sb = 0;
    bp.dk_sh = dk.stride(1);
    bp.dk_sl = dk.stride(0);
    bp.dv_sb = 0;
    bp.dv_sh = dv.stride(1);
    bp.dv_sl = dv.stride(0);
  } else {
    bp.dq_sb = dq.stride(0);
    bp.dq_sh = dq.stride(1);
    bp.dq_sl = dq.stride(2);
    bp.dk_sb = dk.stride(0);
    bp.dk_sh = dk.stride(1);
    bp.dk_sl = dk.stride(2);
    bp.dv_sb = dv.stride(0);
    bp.dv_sh = dv.stride(1);
    bp.dv_sl = dv.stride(2);
  }
}

inline void launch_forward(const FwdParams& fp, Dtype dt, const Launch& launch) {
  using namespace fastattn::cuda::attn;
  if (dt == Dtype::f32 || dt == Dtype::f64) {
    attention_fwd_simt(dt, fp, launch);
    return;
  }
  const int bucket = mma_head_dim_bucket(std::max(fp.p.D, fp.p.Dv));
  const bool half = dt == Dtype::f16;
  switch (bucket) {
    case 64:
      half ? attention_fwd_mma_f16_hd64(fp, launch) : attention_fwd_mma_bf16_hd64(fp, launch);
      break;
    case 128:
      half ? attention_fwd_mma_f16_hd128(fp, launch) : attention_fwd_mma_bf16_hd128(fp, launch);
      break;
    default:
      half ? attention_fwd_mma_f16_hd256(fp, launch) : attention_fwd_mma_bf16_hd256(fp, launch);
      break;
  }
}

inline void launch_backward(const BwdParams& bp, Dtype dt, const Launch& launch) {
  using namespace fastattn::cuda::attn;
  if (dt == Dtype::f32 || dt == Dtype::f64) {
    attention_bwd_simt(dt, bp, launch);
    return;
  }
  const int bucket = mma_head_dim_bucket(std::max(bp.p.D, bp.p.Dv));
  const bool half = dt == Dtype::f16;
  switch (bucket) {
    case 64:
      half ? attention_bwd_mma_f16_hd64(bp, launch) : attention_bwd_mma_bf16_hd64(bp, launch);
      break;
    case 128:
      half ? attention_bwd_mma_f16_hd128(bp, launch) : attention_bwd_mma_bf16_hd128(bp, launch);
      break;
    default:
      half ? attention_bwd_mma_f16_hd256(bp, launch) : attention_bwd_mma_bf16_hd256(bp, launch);
      break;
  }
}

// `launch` is filled by the caller (stream and shared-memory limit of q's device).
inline std::tuple<Tensor, Tensor> forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                          const optional<Tensor>& attn_mask,
                                          const optional<Tensor>& key_padding_mask,
                                          const optional<Tensor>& alibi_slopes, double scale,
                                          double softcap, int64_t window_lo, int64_t window_hi,
                                          double dropout_p, const optional<Tensor>& seed,
                                          const Launch& launch) {
  constexpr const char* op = "attention_forward";
  check_problem(q, k, v, attn_mask, key_padding_mask, alibi_slopes, dropout_p, seed, op);
  Tensor out = output_like(q, v.size(3));
  Tensor lse = empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(lse_dtype(q)));
  poison(out);
  poison(lse);
  if (out.numel() == 0) return {out, lse};
  FwdParams fp{};
  fp.p = make_problem(q, k, v, attn_mask, key_padding_mask, alibi_slopes, scale, softcap, window_lo,
                      window_hi, dropout_p, seed, op);
  fp.out = out.data_ptr();
  fp.o_sb = out.stride(0);
  fp.o_sh = out.stride(1);
  fp.o_sl = out.stride(2);
  fp.lse = lse.data_ptr();
  launch_forward(fp, dtype_of(q), launch);
  return {out, lse};
}

// d attn_mask of a backward (mask_grad): the zeroed buffer the dK/dV kernels add dS to, and how
// (BwdParams::dbias_*; fastattn/triton/attention.py's _MaskGrad has the same modes). The buffer
// is shaped like the mask (as 4-D) in the compute type (float; double for float64 inputs), except
// that a mask broadcast over keys gets its key dim materialised (such a bias is softmax-invariant,
// a rare case) and summed at the end (mask_grad_result). Deterministic: no atomics; blocks walk
// the batches (a mask shared by the batch: T5, Swin) and kv heads (a mask shared by the heads:
// AlphaFold's pair bias) the mask is broadcast over, so one thread adds to each element in a
// fixed order. Otherwise those dims are split across blocks that add atomically.
struct MaskGrad {
  Tensor buffer;
  bool sum_k = false;
};

inline MaskGrad setup_mask_grad(BwdParams& bp, const Tensor& mask, const Tensor& q, const Tensor& k,
                                bool deterministic) {
  using namespace fastattn::cuda::attn;
  const int64_t B = q.size(0), Hq = q.size(1), Hkv = k.size(1), Lq = q.size(2), Lk = k.size(2);
  std::vector<int64_t> shape(4 - mask.dim(), 1);
  for (int64_t d : mask.sizes()) shape.push_back(d);
  MaskGrad mg;
  mg.sum_k = shape[3] == 1 && Lk > 1;
  if (mg.sum_k) shape[3] = Lk;
  const auto acc = q.scalar_type() == kDouble ? kDouble : kFloat;
  mg.buffer = zeros(shape, q.options().dtype(acc));
  const Tensor view = mg.buffer.expand({B, Hq, Lq, Lk});
  bp.dbias = mg.buffer.data_ptr();
  bp.dbias_sb = view.stride(0);
  bp.dbias_sh = view.stride(1);
  bp.dbias_sq = view.stride(2);
  bp.dbias_sk = view.stride(3);
  const bool across_b = shape[0] == 1 && B > 1;
  const bool across_h = shape[1] == 1 && Hkv > 1;
  bp.dbias_sum_q = shape[2] == 1 && Lq > 1;
  const bool within = (shape[1] == 1 && Hq > Hkv) || bp.dbias_sum_q;  // inside one block
  if ((across_b || across_h) && !deterministic) {
    bp.dbias_mode = kDBiasAtomic;
  } else {
    bp.loop_b = across_b ? static_cast<int>(B) : 1;
    bp.loop_h = across_h ? static_cast<int>(Hkv) : 1;
    bp.dbias_mode = (across_b || across_h || within) ? kDBiasAdd : kDBiasStore;
  }
  return mg;
}

// The gradient shaped like the mask, in its dtype.
inline Tensor mask_grad_result(const MaskGrad& mg, const Tensor& mask) {
  const Tensor g = mg.sum_k ? mg.buffer.sum(3, /*keepdim=*/true) : mg.buffer;
  return g.reshape(mask.sizes()).to(mask.scalar_type());
}

inline std::tuple<Tensor, Tensor, Tensor, Tensor> backward(
    const Tensor& grad_out, const optional<Tensor>& grad_lse, const Tensor& q, const Tensor& k,
    const Tensor& v, const Tensor& out, const Tensor& lse, const optional<Tensor>& attn_mask,
    const optional<Tensor>& key_padding_mask, const optional<Tensor>& alibi_slopes, double scale,
    double softcap, int64_t window_lo, int64_t window_hi, double dropout_p,
    const optional<Tensor>& seed, bool deterministic, bool mask_grad, const Launch& launch) {
  constexpr const char* op = "attention_backward";
  check_backward(grad_out, grad_lse, q, k, v, out, lse, attn_mask, key_padding_mask, alibi_slopes,
                 dropout_p, seed, op);
  check_mask_grad(attn_mask, mask_grad, op);
  // d attn_mask where nothing attends (no kernel runs): zero.
  const Tensor none =
      mask_grad ? zeros(attn_mask->sizes(), attn_mask->options()) : empty({0}, q.options());
  Tensor dlse;
  if (defined(grad_lse)) dlse = grad_lse->to(lse_dtype(q)).contiguous();
  Tensor dq = empty(q.sizes(), q.options());
  Tensor dk = empty(k.sizes(), k.options());
  Tensor dv = empty(v.sizes(), v.options());
  poison(dq);
  poison(dk);
  poison(dv);
  if (dq.numel() == 0 && dk.numel() == 0) return {dq, dk, dv, none};
  if (q.size(2) == 0 || k.size(2) == 0) {  // nothing attends: every gradient is zero
    dq.zero_();
    dk.zero_();
    dv.zero_();
    return {dq, dk, dv, none};
  }
  Tensor delta = empty(lse.sizes(), lse.options());
  BwdParams bp{};
  bp.p = make_problem(q, k, v, attn_mask, key_padding_mask, alibi_slopes, scale, softcap, window_lo,
                      window_hi, dropout_p, seed, op);
  bp.out = out.data_ptr();
  bp.o_sb = out.stride(0);
  bp.o_sh = out.stride(1);
  bp.o_sl = out.stride(2);
  bp.dout = grad_out.data_ptr();
  bp.do_sb = grad_out.stride(0);
  bp.do_sh = grad_out.stride(1);
  bp.do_sl = grad_out.stride(2);
  bp.do_aligned = grad_out.element_size() == 2 && rows_aligned16(grad_out);
  bp.lse = lse.data_ptr();
  bp.dlse = dlse.defined() ? dlse.data_ptr() : nullptr;
  bp.delta = delta.data_ptr();
  set_grad_outputs(bp, dq, dk, dv);
  MaskGrad mg;
  if (mask_grad) mg = setup_mask_grad(bp, *attn_mask, q, k, deterministic);
  launch_backward(bp, dtype_of(q), launch);
  return {dq, dk, dv, mask_grad ? mask_grad_result(mg, *attn_mask) : none};
}

}  // namespace fastattn::attention::cuda_impl
