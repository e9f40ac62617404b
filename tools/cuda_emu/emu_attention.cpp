// The CUDA attention ops compiled for the CPU emulator: the same host bodies
// (csrc/attention/attention_cuda_ops.h), launchers and kernels as the CUDA build, run on CPU
// tensors by cuda_emu.h. Built and driven by tools/cuda_emu/run.py.
#include <torch/extension.h>

#define FASTATTN_CUDA_EMULATION 1
#include "cuda_emu.h"

#include <atomic>

#include "attention/attention_cuda_params.h"

namespace fastattn::cuda::attn {

namespace {

int elem_size(Dtype dt) {
  switch (dt) {
    case Dtype::f16:
    case Dtype::bf16:
      return 2;
    case Dtype::f32:
      return 4;
    default:
      return 8;
  }
}

int acc_size(Dtype dt) { return dt == Dtype::f64 ? 8 : 4; }

int mask_size(int kind) {
  switch (kind) {
    case kMaskBool:
      return 1;
    case kMaskF16:
    case kMaskBF16:
      return 2;
    case kMaskF32:
      return 4;
    default:
      return 8;
  }
}

// [ptr, ptr + span) of a 4-D view with non-negative strides (last stride 1).
emu::Range view(const void* ptr, int64_t s0, int64_t s1, int64_t s2, int64_t s3, int64_t st0,
                int64_t st1, int64_t st2, int64_t st3, int es, bool writable, const char* name) {
  const auto lo = reinterpret_cast<uintptr_t>(ptr);
  if (ptr == nullptr || s0 == 0 || s1 == 0 || s2 == 0 || s3 == 0) return {lo, lo, writable, name};
  const int64_t last = (s0 - 1) * st0 + (s1 - 1) * st1 + (s2 - 1) * st2 + (s3 - 1) * st3;
  return {lo, lo + static_cast<uintptr_t>((last + 1) * es), writable, name};
}

// Batches and rows of the (B, H, L, D) views: varlen tensors are packed (1 batch of total rows).
int64_t batches(const Problem& p) { return p.cu_q != nullptr ? 1 : p.B; }
int64_t q_rows(const Problem& p) { return p.cu_q != nullptr ? p.total_q : p.Lq; }
int64_t k_rows(const Problem& p) { return p.cu_q != nullptr ? p.total_k : p.Lk; }

void problem_ranges(const Problem& p, std::vector<emu::Range>& r) {
  const int es = elem_size(p.dtype);
  const int64_t nb = batches(p);
  r.push_back(view(p.q, nb, p.Hq, q_rows(p), p.D, p.q_sb, p.q_sh, p.q_sl, 1, es, false, "q"));
  if (p.block_table != nullptr) {  // paged: the pools (num_blocks, Hkv, page, D) and the table
    r.push_back(view(p.k, p.num_blocks, p.Hkv, p.page_size, p.D, p.k_sb, p.k_sh, p.k_sl, 1, es,
                     false, "k_cache pool"));
    r.push_back(view(p.v, p.num_blocks, p.Hkv, p.page_size, p.Dv, p.v_sb, p.v_sh, p.v_sl, 1, es,
                     false, "v_cache pool"));
    r.push_back(view(p.block_table, p.B, p.table_cols, 1, 1, p.block_table_stride, 1, 0, 0, 4,
                     false, "block_table"));
  } else {
    r.push_back(view(p.k, nb, p.Hkv, k_rows(p), p.D, p.k_sb, p.k_sh, p.k_sl, 1, es, false, "k"));
    r.push_back(view(p.v, nb, p.Hkv, k_rows(p), p.Dv, p.v_sb, p.v_sh, p.v_sl, 1, es, false, "v"));
  }
  if (p.cu_q != nullptr) {
    r.push_back(view(p.cu_q, p.B + 1, 1, 1, 1, 1, 0, 0, 0, 4, false, "cu_seqlens_q"));
    r.push_back(view(p.cu_k, p.B + 1, 1, 1, 1, 1, 0, 0, 0, 4, false, "cu_seqlens_k"));
  }
  if (p.k_lengths != nullptr) {
    r.push_back(view(p.k_lengths, p.B, 1, 1, 1, 1, 0, 0, 0, 4, false, "k_lengths"));
    r.push_back(view(p.q_positions, p.B, 1, 1, 1, 1, 0, 0, 0, 4, false, "q_positions"));
  }
  if (p.mask_kind != kMaskNone) {
    r.push_back(view(p.mask, p.B, p.Hq, p.Lq, p.Lk, p.mask_sb, p.mask_sh, p.mask_sq, p.mask_sk,
                     mask_size(p.mask_kind), false, "attn_mask"));
  }
  if (p.padding != nullptr) {
    r.push_back(view(p.padding, p.B, p.Lk, 1, 1, p.Lk, 1, 0, 0, 1, false, "key_padding_mask"));
  }
  if (p.alibi != nullptr) {
    r.push_back(view(p.alibi, p.B, p.Hq, 1, 1, p.alibi_sb, p.alibi_sh, 0, 0, 4, false, "alibi"));
  }
  if (p.seed != nullptr) r.push_back(view(p.seed, 2, 1, 1, 1, 1, 0, 0, 0, 8, false, "seed"));
}

}  // namespace

std::vector<emu::Range> emu_ranges(const FwdParams& fp) {
  const Problem& p = fp.p;
  std::vector<emu::Range> r;
  problem_ranges(p, r);
  r.push_back(view(fp.out, batches(p), p.Hq, q_rows(p), p.Dv, fp.o_sb, fp.o_sh, fp.o_sl, 1,
                   elem_size(p.dtype), true, "out"));
  const int64_t rows = batches(p) * p.Hq * q_rows(p);
  r.push_back(view(fp.lse, rows, 1, 1, 1, 1, 0, 0, 0, acc_size(p.dtype), true, "lse"));
  if (fp.num_splits > 1) {
    r.push_back(view(fp.part_out, int64_t{fp.num_splits} * rows, p.Dv, 1, 1, p.Dv, 1, 0, 0, 4, true,
                     "part_out"));
    r.push_back(
        view(fp.part_lse, int64_t{fp.num_splits} * rows, 1, 1, 1, 1, 0, 0, 0, 4, true, "part_lse"));
  }
  return r;
}

std::vector<emu::Range> emu_ranges(const BwdParams& bp) {
  const Problem& p = bp.p;
  const int es = elem_size(p.dtype), as = acc_size(p.dtype);
  std::vector<emu::Range> r;
  problem_ranges(p, r);
  const int64_t nb = batches(p), lq = q_rows(p), lk = k_rows(p);
  r.push_back(view(bp.out, nb, p.Hq, lq, p.Dv, bp.o_sb, bp.o_sh, bp.o_sl, 1, es, false, "out"));
  r.push_back(
      view(bp.dout, nb, p.Hq, lq, p.Dv, bp.do_sb, bp.do_sh, bp.do_sl, 1, es, false, "grad_out"));
  const int64_t rows = nb * p.Hq * lq;
  r.push_back(view(bp.lse, rows, 1, 1, 1, 1, 0, 0, 0, as, false, "lse"));
  if (bp.dlse != nullptr)
    r.push_back(view(bp.dlse, rows, 1, 1, 1, 1, 0, 0, 0, as, false, "grad_lse"));
  r.push_back(view(bp.delta, rows, 1, 1, 1, 1, 0, 0, 0, as, true, "delta"));
  r.push_back(view(bp.dq, nb, p.Hq, lq, p.D, bp.dq_sb, bp.dq_sh, bp.dq_sl, 1, es, true, "dq"));
  r.push_back(view(bp.dk, nb, p.Hkv, lk, p.D, bp.dk_sb, bp.dk_sh, bp.dk_sl, 1, es, true, "dk"));
  r.push_back(view(bp.dv, nb, p.Hkv, lk, p.Dv, bp.dv_sb, bp.dv_sh, bp.dv_sl, 1, es, true, "dv"));
  if (bp.dbias_mode != kDBiasNone) {
    r.push_back(view(bp.dbias, p.B, p.Hq, p.Lq, p.Lk, bp.dbias_sb, bp.dbias_sh, bp.dbias_sq,
                     bp.dbias_sk, as, true, "d attn_mask"));
  }
  return r;
}

}  // namespace fastattn::cuda::attn

// The kernel translation units of the CUDA build, verbatim.
#include "attention/attention_cuda_bwd_hd128_bf16.cu"
#include "attention/attention_cuda_bwd_hd128_f16.cu"
#include "attention/attention_cuda_bwd_hd256_bf16.cu"
#include "attention/attention_cuda_bwd_hd256_f16.cu"
#include "attention/attention_cuda_bwd_hd64_bf16.cu"
#include "attention/attention_cuda_bwd_hd64_f16.cu"
#include "attention/attention_cuda_fwd_hd128_bf16.cu"
#include "attention/attention_cuda_fwd_hd128_f16.cu"
#include "attention/attention_cuda_fwd_hd256_bf16.cu"
#include "attention/attention_cuda_fwd_hd256_f16.cu"
#include "attention/attention_cuda_fwd_hd64_bf16.cu"
#include "attention/attention_cuda_fwd_hd64_f16.cu"
#include "attention/attention_cuda_simt.cu"
#include "attention/attention_cuda_ops.h"
#include "attention_with_kvcache/attention_with_kvcache_cuda_ops.h"
#include "varlen_attention/varlen_attention_cuda_ops.h"

namespace fastattn {
std::atomic<bool>& poison_flag() {
  static std::atomic<bool> flag{false};
  return flag;
}
}  // namespace fastattn

#include "op_schemas.h"

namespace {

using fastattn::Tensor;
using std::optional;
namespace impl = fastattn::attention::cuda_impl;

// The emulated device: the shared memory a block may opt in to (the launchers pick their tile
// variants from it) and its streaming multiprocessors (the decode's split count). Set from
// Python (set_device) before a call; the CUDA build reads the same from the real device
// (attention/attention_cuda_device.h).
struct EmulatedDevice {
  int smem_optin = 227 * 1024;
  int sm_count = 132;
};

EmulatedDevice& device() {
  static EmulatedDevice emulated;
  return emulated;
}

fastattn::cuda::attn::Launch launch() { return {nullptr, device().smem_optin}; }

// The CUDA op bodies with the native ops' signatures (the CUDA build wraps the same functions
// with a device guard and the real device's preamble).
std::tuple<Tensor, Tensor> attention_forward(const Tensor& q, const Tensor& k, const Tensor& v,
                                             const optional<Tensor>& attn_mask,
                                             const optional<Tensor>& key_padding_mask,
                                             const optional<Tensor>& alibi_slopes, double scale,
                                             double softcap, int64_t window_lo, int64_t window_hi,
                                             double dropout_p, const optional<Tensor>& seed) {
  return impl::forward(q, k, v, attn_mask, key_padding_mask, alibi_slopes, scale, softcap,
                       window_lo, window_hi, dropout_p, seed, launch());
}

std::tuple<Tensor, Tensor, Tensor, Tensor> attention_backward(
    const Tensor& grad_out, const optional<Tensor>& grad_lse, const Tensor& q, const Tensor& k,
    const Tensor& v, const Tensor& out, const Tensor& lse, const optional<Tensor>& attn_mask,
    const optional<Tensor>& key_padding_mask, const optional<Tensor>& alibi_slopes, double scale,
    double softcap, int64_t window_lo, int64_t window_hi, double dropout_p,
    const optional<Tensor>& seed, bool deterministic, bool mask_grad) {
  return impl::backward(grad_out, grad_lse, q, k, v, out, lse, attn_mask, key_padding_mask,
                        alibi_slopes, scale, softcap, window_lo, window_hi, dropout_p, seed,
                        deterministic, mask_grad, launch());
}

std::tuple<Tensor, Tensor> varlen_attention_forward(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cu_q, const Tensor& cu_k,
    int64_t max_q, int64_t max_k, const optional<Tensor>& alibi, double scale, double softcap,
    int64_t causal_mode, int64_t wl, int64_t wr, double dropout_p, const optional<Tensor>& seed) {
  return fastattn::varlen_attention::cuda_impl::forward(q, k, v, cu_q, cu_k, max_q, max_k, alibi,
                                                        scale, softcap, causal_mode, wl, wr,
                                                        dropout_p, seed, launch());
}

std::tuple<Tensor, Tensor, Tensor> varlen_attention_backward(
    const Tensor& grad_out, const optional<Tensor>& grad_lse, const Tensor& q, const Tensor& k,
    const Tensor& v, const Tensor& out, const Tensor& lse, const Tensor& cu_q, const Tensor& cu_k,
    int64_t max_q, int64_t max_k, const optional<Tensor>& alibi, double scale, double softcap,
    int64_t causal_mode, int64_t wl, int64_t wr, double dropout_p, const optional<Tensor>& seed,
    bool deterministic) {
  (void)deterministic;  // always deterministic
  return fastattn::varlen_attention::cuda_impl::backward(
      grad_out, grad_lse, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, alibi, scale, softcap,
      causal_mode, wl, wr, dropout_p, seed, launch());
}

std::tuple<Tensor, Tensor> attention_decode(const Tensor& q, const Tensor& k_cache,
                                            const Tensor& v_cache, const Tensor& k_lengths,
                                            const Tensor& q_positions,
                                            const optional<Tensor>& alibi, double scale,
                                            double softcap, int64_t causal_mode, int64_t wl,
                                            int64_t wr, int64_t num_splits,
                                            const optional<Tensor>& block_table) {
  return fastattn::attention_with_kvcache::cuda_impl::decode(
      q, k_cache, v_cache, k_lengths, q_positions, alibi, scale, softcap, causal_mode, wl, wr,
      num_splits, device().sm_count, launch(), block_table);
}

}  // namespace

// The schemas of the native ops (csrc/op_schemas.h, as csrc/bindings.cpp declares them) under
// the library fastattn_emu_attention, so that the emulated ops sit next to the real ones.
// attention_with_kvcache is declared with the rest of its op's schemas but not emulated.
STABLE_TORCH_LIBRARY(fastattn_emu_attention, m) {
  fastattn::schemas::define_attention(m);
  fastattn::schemas::define_varlen_attention(m);
  fastattn::schemas::define_attention_with_kvcache(m);
}

STABLE_TORCH_LIBRARY_IMPL(fastattn_emu_attention, CPU, m) {
  m.impl("attention_forward", TORCH_BOX(&attention_forward));
  m.impl("attention_backward", TORCH_BOX(&attention_backward));
  m.impl("varlen_attention_forward", TORCH_BOX(&varlen_attention_forward));
  m.impl("varlen_attention_backward", TORCH_BOX(&varlen_attention_backward));
  m.impl("attention_decode", TORCH_BOX(&attention_decode));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def(
      "set_device",
      [](int smem_optin, int sm_count) {
        device().smem_optin = smem_optin;
        device().sm_count = sm_count;
      },
      pybind11::arg("smem_optin"), pybind11::arg("sm_count") = 132);
  m.def("set_poison", [](bool on) { fastattn::poison_flag().store(on); });
  // The launches since the previous call ("launcher signature | smem bytes"), then clears them.
  m.def("take_launches", []() {
    std::vector<std::string> out;
    out.swap(::emu::st().launches);
    return out;
  });
}
