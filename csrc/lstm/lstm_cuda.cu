// CUDA bodies of the LSTM ops: lstm_layer and its backward (checks, then the recurrent engine's
// driver, csrc/recurrent/recurrent_cuda.cu), and lstm_cell with its fused cell kernels. The op
// contract: fastattn/ops/lstm.py.
#include "recurrent/recurrent_cuda.h"

namespace fastattn::recurrent {
namespace {

std::tuple<Tensor, Tensor, Tensor, Tensor> lstm_layer_cuda(
    const Tensor& input, const Tensor& h0, const Tensor& c0, const Tensor& w_ih, const Tensor& w_hh,
    const optional<Tensor>& b_ih, const optional<Tensor>& b_hh, const optional<Tensor>& w_hr,
    const optional<Tensor>& lengths, double dropout_p, const optional<Tensor>& seed,
    bool save_workspace) {
  constexpr const char* op = "lstm_layer";
  const LayerDims d = check_layer(input, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr, lengths, op);
  check_seed(seed, dropout_p, input, op);
  LayerOutputs o = layer_forward_cuda(Cell::lstm, d, input, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr,
                                      lengths, dropout_p, seed, save_workspace, op);
  return {o.output, o.h_n, o.c_n, o.workspace};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> lstm_layer_backward_cuda(
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
  LayerGrads g =
      layer_backward_cuda(Cell::lstm, d, gout, ghn, gcn, input, h0, c0, w_ih, w_hh, w_hr, lengths,
                          workspace, dropout_p, seed, has_bias, input_grad, weight_grad, op);
  return {g.input, g.h0, g.c0, g.w_ih, g.w_hh, g.b_ih, g.w_hr};
}

// ---------------------------------------------------------------------------------------------
// Cell

std::tuple<Tensor, Tensor, Tensor> lstm_cell_cuda(const Tensor& input, const Tensor& hx,
                                                  const Tensor& cx, const Tensor& w_ih,
                                                  const Tensor& w_hh, const optional<Tensor>& b_ih,
                                                  const optional<Tensor>& b_hh) {
  constexpr const char* op = "lstm_cell";
  check_cell(input, hx, cx, w_ih, w_hh, b_ih, b_hh, op);
  CudaGuard guard(input);
  const int64_t B = input.size(0), I = input.size(1), H = w_hh.size(1);
  const auto acc = compute_dtype(input.scalar_type());
  Tensor hy = empty({B, H}, input.options());
  Tensor cy = empty({B, H}, input.options());
  Tensor workspace = empty({B, 5 * H}, input.options().dtype(acc));
  poison(hy);
  poison(cy);
  poison(workspace);
  if (B == 0) return {hy, cy, workspace};
  auto stream = current_cuda_stream();
  const Tensor x = input.to(acc).contiguous(), h = hx.to(acc).contiguous();
  const Tensor c = cx.contiguous();
  const Tensor wi = w_ih.to(acc).contiguous(), wh = w_hh.to(acc).contiguous();
  Tensor bias;
  if (defined(b_ih)) bias = b_ih->to(acc).add(b_hh->to(acc));
  FASTATTN_DISPATCH_LSTM_CUDA(input.scalar_type(), [&] {
    using a = acc_t<scalar_t>;
    if (B <= k::kCellFusedMaxBatch) {
      FASTATTN_LSTM_LAUNCH_WARPSYNC(
          k::cell_fused_kernel<scalar_t>, static_cast<unsigned>(ceil_div(H, k::kCellWarps)),
          k::kCellWarps * 32, 0, stream, B, I, H, x.data_ptr<a>(), h.data_ptr<a>(),
          c.data_ptr<scalar_t>(), wi.data_ptr<a>(), wh.data_ptr<a>(),
          bias.defined() ? bias.data_ptr<a>() : nullptr, workspace.data_ptr<a>(),
          hy.data_ptr<scalar_t>(), cy.data_ptr<scalar_t>());
      FASTATTN_CUDA_LAUNCH_CHECK();
    } else {
      Tensor pre = bias.defined() ? mm(x, wi.t()).add(bias) : mm(x, wi.t());
      pre.addmm_(h, wh.t());
      FASTATTN_LSTM_LAUNCH(k::cell_pointwise_kernel<scalar_t>, grid_for(B * H), kThreads, 0, stream,
                           B, H, pre.data_ptr<a>(), c.data_ptr<scalar_t>(), workspace.data_ptr<a>(),
                           hy.data_ptr<scalar_t>(), cy.data_ptr<scalar_t>());
      FASTATTN_CUDA_LAUNCH_CHECK();
    }
  });
  return {hy, cy, workspace};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> lstm_cell_backward_cuda(
    const optional<Tensor>& grad_hy, const optional<Tensor>& grad_cy, const Tensor& input,
    const Tensor& hx, const Tensor& cx, const Tensor& w_ih, const Tensor& w_hh,
    const Tensor& workspace, bool has_bias) {
  constexpr const char* op = "lstm_cell_backward";
  check_cell(input, hx, cx, w_ih, w_hh, std::nullopt, std::nullopt, op);
  CudaGuard guard(input);
  const int64_t B = input.size(0), H = w_hh.size(1);
  const auto acc = compute_dtype(input.scalar_type());
  const auto [ghy, gcy] = check_cell_backward(grad_hy, grad_cy, input, workspace, B, H, op);
  Tensor dgates = empty({B, 4 * H}, input.options().dtype(acc));
  Tensor grad_cx = empty({B, H}, input.options());
  poison(grad_cx);
  const Tensor c = cx.contiguous();
  if (B > 0) {
    auto stream = current_cuda_stream();
    FASTATTN_DISPATCH_LSTM_CUDA(input.scalar_type(), [&] {
      using a = acc_t<scalar_t>;
      FASTATTN_LSTM_LAUNCH(k::cell_backward_kernel<scalar_t>, grid_for(B * H), kThreads, 0, stream,
                           B, H, ghy.defined() ? ghy.data_ptr<scalar_t>() : nullptr,
                           gcy.defined() ? gcy.data_ptr<scalar_t>() : nullptr,
                           c.data_ptr<scalar_t>(), workspace.data_ptr<a>(), dgates.data_ptr<a>(),
                           grad_cx.data_ptr<scalar_t>());
      FASTATTN_CUDA_LAUNCH_CHECK();
    });
  }
  const auto dtype = input.scalar_type();
  const Tensor wi = w_ih.to(acc), wh = w_hh.to(acc);
  Tensor grad_input = mm(dgates, wi).to(dtype);
  Tensor grad_hx = mm(dgates, wh).to(dtype);
  Tensor grad_w_ih = mm(dgates.t(), input.to(acc)).to(dtype);
  Tensor grad_w_hh = mm(dgates.t(), hx.to(acc)).to(dtype);
  Tensor grad_bias = has_bias ? dgates.sum(0).to(dtype) : empty({0}, input.options());
  return {grad_input, grad_hx, grad_cx, grad_w_ih, grad_w_hh, grad_bias};
}

}  // namespace

#if !defined(FASTATTN_CUDA_EMULATION)
STABLE_TORCH_LIBRARY_IMPL(fastattn, CUDA, m) {
  m.impl("lstm_cell", TORCH_BOX(&lstm_cell_cuda));
  m.impl("lstm_cell_backward", TORCH_BOX(&lstm_cell_backward_cuda));
  m.impl("lstm_layer", TORCH_BOX(&lstm_layer_cuda));
  m.impl("lstm_layer_backward", TORCH_BOX(&lstm_layer_backward_cuda));
}
#endif

}  // namespace fastattn::recurrent
