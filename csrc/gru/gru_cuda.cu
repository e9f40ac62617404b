// CUDA bodies of the GRU layer ops (G = 3 gates r, z, n; reset after or before W_hn): checks,
// then the recurrent engine's driver (csrc/recurrent/recurrent_cuda.cu). The CPU bodies:
// csrc/gru/gru_cpu.cpp.
#include "recurrent/recurrent_cuda.h"

namespace fastattn::recurrent {
namespace {

Cell gru_cell_kind(bool reset_after) { return reset_after ? Cell::gru : Cell::gru_reset_before; }

std::tuple<Tensor, Tensor, Tensor> gru_layer_cuda(
    const Tensor& input, const Tensor& h0, const Tensor& w_ih, const Tensor& w_hh,
    const optional<Tensor>& b_ih, const optional<Tensor>& b_hh, const optional<Tensor>& lengths,
    double dropout_p, const optional<Tensor>& seed, bool reset_after, bool save_workspace) {
  return gated_layer_cuda(gru_cell_kind(reset_after), input, h0, w_ih, w_hh, b_ih, b_hh, lengths,
                          dropout_p, seed, save_workspace, "gru_layer");
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> gru_layer_backward_cuda(
    const optional<Tensor>& grad_output, const optional<Tensor>& grad_h_n, const Tensor& input,
    const Tensor& h0, const Tensor& w_ih, const Tensor& w_hh, const optional<Tensor>& lengths,
    const Tensor& workspace, double dropout_p, const optional<Tensor>& seed, bool reset_after,
    bool has_bias, bool input_grad, bool weight_grad) {
  return gated_layer_backward_cuda(gru_cell_kind(reset_after), grad_output, grad_h_n, input, h0,
                                   w_ih, w_hh, lengths, workspace, dropout_p, seed, has_bias,
                                   input_grad, weight_grad, "gru_layer_backward");
}

}  // namespace

#if !defined(FASTATTN_CUDA_EMULATION)
STABLE_TORCH_LIBRARY_IMPL(fastattn, CUDA, m) {
  m.impl("gru_layer", TORCH_BOX(&gru_layer_cuda));
  m.impl("gru_layer_backward", TORCH_BOX(&gru_layer_backward_cuda));
}
#endif

}  // namespace fastattn::recurrent
