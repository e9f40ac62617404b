// CPU bodies of the LSTM ops: checks, then the recurrent engine (recurrent_cpu.cpp, generic
// over the cell) for the layer ops, and the fused cell loops of recurrent_cpu_kernel.cpp for the
// cell ops.
#include "common/tensor_api.h"

#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>
#include <cstdlib>
#include <mutex>

#include "common/cpu_isa.h"
#include "common/debug.h"
#include "common/gemm_cpu.h"
#include "recurrent/recurrent.h"
#include "recurrent/recurrent_cpu_kernel.h"
#include "recurrent/recurrent_cpu.h"

namespace fastattn::recurrent {
namespace {

using std::optional;

#define FASTATTN_DISPATCH_LSTM(TYPE, ...) FASTATTN_DISPATCH_FLOATING(TYPE, "lstm_cpu", __VA_ARGS__)

std::tuple<Tensor, Tensor, Tensor, Tensor> lstm_layer_cpu(
    const Tensor& input, const Tensor& h0, const Tensor& c0, const Tensor& w_ih, const Tensor& w_hh,
    const optional<Tensor>& b_ih, const optional<Tensor>& b_hh, const optional<Tensor>& w_hr,
    const optional<Tensor>& lengths, double dropout_p, const optional<Tensor>& seed,
    bool save_workspace) {
  constexpr const char* op = "lstm_layer";
  const LayerDims d = check_layer(input, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr, lengths, op);
  check_seed(seed, dropout_p, input, op);
  LayerOutputs out = layer_forward_cpu(cpu::RecurrentCell::lstm, d, input, h0, c0, w_ih, w_hh, b_ih,
                                       b_hh, w_hr, lengths, dropout_p, seed, save_workspace, op);
  return {out.output, out.h_n, out.c_n, out.workspace};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> lstm_layer_backward_cpu(
    const optional<Tensor>& grad_output, const optional<Tensor>& grad_h_n,
    const optional<Tensor>& grad_c_n, const Tensor& input, const Tensor& h0, const Tensor& c0,
    const Tensor& w_ih, const Tensor& w_hh, const optional<Tensor>& w_hr,
    const optional<Tensor>& lengths, const Tensor& workspace, double dropout_p,
    const optional<Tensor>& seed, bool has_bias, bool input_grad, bool weight_grad) {
  constexpr const char* op = "lstm_layer_backward";
  const LayerDims d =
      check_layer(input, h0, c0, w_ih, w_hh, std::nullopt, std::nullopt, w_hr, lengths, op);
  check_seed(seed, dropout_p, input, op);
  const auto [gout, ghn, gcn] =
      check_layer_backward(grad_output, grad_h_n, grad_c_n, input, workspace, d, op);
  LayerGrads g = layer_backward_cpu(cpu::RecurrentCell::lstm, d, gout, ghn, gcn, input, h0, c0,
                                    w_ih, w_hh, w_hr, lengths, workspace, dropout_p, seed, has_bias,
                                    input_grad, weight_grad, op);
  return {g.input, g.h0, g.c0, g.w_ih, g.w_hh, g.b_ih, g.w_hr};
}

// ---------------------------------------------------------------------------------------------
// Cell

// Batches up to this size run the fused cell (dot products of the weight rows, one pass over
// the weights); larger ones a GEMM for the pre-activations, then the fused pointwise cell.
constexpr int64_t kCellFusedMaxBatch = 8;

std::tuple<Tensor, Tensor, Tensor> lstm_cell_cpu(const Tensor& input, const Tensor& hx,
                                                 const Tensor& cx, const Tensor& w_ih,
                                                 const Tensor& w_hh, const optional<Tensor>& b_ih,
                                                 const optional<Tensor>& b_hh) {
  constexpr const char* op = "lstm_cell";
  check_cell(input, hx, cx, w_ih, w_hh, b_ih, b_hh, op);
  const int64_t B = input.size(0), I = input.size(1), H = w_hh.size(1);
  const auto acc = compute_dtype(input.scalar_type());
  Tensor hy = empty({B, H}, input.options());
  Tensor cy = empty({B, H}, input.options());
  Tensor workspace = empty({B, 5 * H}, input.options().dtype(acc));
  poison(hy);
  poison(cy);
  poison(workspace);
  if (B == 0) return {hy, cy, workspace};
  // bfloat16 on AVX512-BF16: x, h and the weights are bfloat16, so their products are exact in
  // bfloat16 dot products (float sums): no float copies of the weights.
  const bool bf16 = input.scalar_type() == kBFloat16 && cpu::bf16_products();
  const Tensor x = bf16 ? input.contiguous() : input.to(acc).contiguous();
  const Tensor h = bf16 ? hx.contiguous() : hx.to(acc).contiguous();
  const Tensor c = cx.contiguous();
  Tensor bias;
  if (defined(b_ih)) bias = b_ih->to(acc).add(b_hh->to(acc));
  Tensor pre, wi, wh;
  if (bf16 && B > kCellFusedMaxBatch) {
    pre = empty({B, 4 * H}, input.options().dtype(acc));
    cpu::matmul_bf16_into(pre, x, w_ih.contiguous(), bias, false);
    cpu::matmul_bf16_into(pre, h, w_hh.contiguous(), Tensor(), true);
  } else if (bf16) {
    wi = w_ih.contiguous();
    wh = w_hh.contiguous();
  } else if (B > kCellFusedMaxBatch) {
    // fastattn's GEMM (common/gemm_cpu.h: MKL's float path on AMD CPUs is a generic one).
    pre = empty({B, 4 * H}, x.options());
    cpu::matmul_into(pre, x, w_ih.to(acc).t(), bias, false);
    cpu::matmul_into(pre, h, w_hh.to(acc).t(), Tensor(), true);
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
                        cy.data_ptr(),
                        bf16};
  FASTATTN_DISPATCH_LSTM(input.scalar_type(),
                         [&] { FASTATTN_CPU_ISA_CALL(lstm_cell_forward<scalar_t>, p); });
  return {hy, cy, workspace};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> lstm_cell_backward_cpu(
    const optional<Tensor>& grad_hy, const optional<Tensor>& grad_cy, const Tensor& input,
    const Tensor& hx, const Tensor& cx, const Tensor& w_ih, const Tensor& w_hh,
    const Tensor& workspace, bool has_bias) {
  constexpr const char* op = "lstm_cell_backward";
  check_cell(input, hx, cx, w_ih, w_hh, std::nullopt, std::nullopt, op);
  const int64_t B = input.size(0), H = w_hh.size(1);
  const auto acc = compute_dtype(input.scalar_type());
  const auto [ghy, gcy] = check_cell_backward(grad_hy, grad_cy, input, workspace, B, H, op);
  Tensor dgates = empty({B, 4 * H}, input.options().dtype(acc));
  Tensor grad_cx = empty({B, H}, input.options());
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
    FASTATTN_DISPATCH_LSTM(input.scalar_type(),
                           [&] { FASTATTN_CPU_ISA_CALL(lstm_cell_backward<scalar_t>, p); });
  }
  const auto dtype = input.scalar_type();
  // 16-bit storage: float copies of the weights and float products go through per-thread
  // buffers (recurrent_cpu.h: scratch), not fresh 4 MB allocations at I = H = 512.
  const bool low = dtype != acc;
  auto in_float = [&](const Tensor& w, Scratch slot) {
    if (!low) return w;
    Tensor f = scratch(slot, {w.size(0), w.size(1)}, dgates.options());
    f.copy_(w);
    return f;
  };
  const Tensor wi = in_float(w_ih, kCellWeightIh), wh = in_float(w_hh, kCellWeightHh);
  // The four products through fastattn's GEMM (see the forward), in the compute type.
  auto product = [&](const Tensor& a, const Tensor& b) {
    const std::vector<int64_t> shape{a.size(0), b.size(1)};
    Tensor out =
        low ? scratch(kCellProduct, shape, dgates.options()) : empty(shape, dgates.options());
    cpu::matmul_into(out, a, b, Tensor(), false);
    return out.to(dtype);
  };
  Tensor grad_input = product(dgates, wi);
  Tensor grad_hx = product(dgates, wh);
  Tensor grad_w_ih = product(dgates.t(), input.to(acc));
  Tensor grad_w_hh = product(dgates.t(), hx.to(acc));
  Tensor grad_bias = has_bias ? dgates.sum(0).to(dtype) : empty({0}, input.options());
  return {grad_input, grad_hx, grad_cx, grad_w_ih, grad_w_hh, grad_bias};
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fastattn, CPU, m) {
  m.impl("lstm_cell", TORCH_BOX(&lstm_cell_cpu));
  m.impl("lstm_cell_backward", TORCH_BOX(&lstm_cell_backward_cpu));
  m.impl("lstm_layer", TORCH_BOX(&lstm_layer_cpu));
  m.impl("lstm_layer_backward", TORCH_BOX(&lstm_layer_backward_cpu));
}

}  // namespace fastattn::recurrent
