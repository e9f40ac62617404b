// CUDA bodies of the Elman RNN layer ops (tanh or relu): checks, then the recurrent engine's
// driver (csrc/recurrent/recurrent_cuda.cu). The CPU bodies: csrc/rnn/rnn_cpu.cpp.
#include "recurrent/recurrent_cuda.h"

namespace fastattn::recurrent {
namespace {

Cell rnn_cell_kind(std::string_view nonlinearity, const char* op) {
  if (nonlinearity == "tanh") return Cell::rnn_tanh;
  FASTATTN_CHECK(nonlinearity == "relu", op, "nonlinearity must be 'tanh' or 'relu', got '",
                 std::string(nonlinearity), "'");
  return Cell::rnn_relu;
}

std::tuple<Tensor, Tensor, Tensor> rnn_layer_cuda(
    const Tensor& input, const Tensor& h0, const Tensor& w_ih, const Tensor& w_hh,
    const optional<Tensor>& b_ih, const optional<Tensor>& b_hh, const optional<Tensor>& lengths,
    double dropout_p, const optional<Tensor>& seed, std::string_view nonlinearity,
    bool save_workspace) {
  constexpr const char* op = "rnn_layer";
  return gated_layer_cuda(rnn_cell_kind(nonlinearity, op), input, h0, w_ih, w_hh, b_ih, b_hh,
                          lengths, dropout_p, seed, save_workspace, op);
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> rnn_layer_backward_cuda(
    const optional<Tensor>& grad_output, const optional<Tensor>& grad_h_n, const Tensor& input,
    const Tensor& h0, const Tensor& w_ih, const Tensor& w_hh, const optional<Tensor>& lengths,
    const Tensor& workspace, double dropout_p, const optional<Tensor>& seed,
    std::string_view nonlinearity, bool has_bias, bool input_grad, bool weight_grad) {
  constexpr const char* op = "rnn_layer_backward";
  return gated_layer_backward_cuda(rnn_cell_kind(nonlinearity, op), grad_output, grad_h_n, input,
                                   h0, w_ih, w_hh, lengths, workspace, dropout_p, seed, has_bias,
                                   input_grad, weight_grad, op);
}

}  // namespace

#if !defined(FASTATTN_CUDA_EMULATION)
STABLE_TORCH_LIBRARY_IMPL(fastattn, CUDA, m) {
  m.impl("rnn_layer", TORCH_BOX(&rnn_layer_cuda));
  m.impl("rnn_layer_backward", TORCH_BOX(&rnn_layer_backward_cuda));
}
#endif

}  // namespace fastattn::recurrent
