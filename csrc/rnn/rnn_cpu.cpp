// CPU bodies of the Elman RNN layer ops (contract: fastattn/ops/_recurrent.py): checks, then
// the recurrent engine shared with the LSTM and the GRU (csrc/recurrent/recurrent_cpu.cpp, the cell
// RecurrentCell::rnn_tanh or rnn_relu).
#include "common/tensor_api.h"

#include <string>

#include "common/checks.h"
#include "recurrent/recurrent.h"
#include "recurrent/recurrent_cpu.h"

namespace fastattn::recurrent {
namespace {

using std::optional;

cpu::RecurrentCell rnn_cell_kind(std::string_view nonlinearity, const char* op) {
  if (nonlinearity == "tanh") return cpu::RecurrentCell::rnn_tanh;
  FASTATTN_CHECK(nonlinearity == "relu", op, "nonlinearity must be 'tanh' or 'relu', got '",
                 std::string(nonlinearity), "'");
  return cpu::RecurrentCell::rnn_relu;
}

std::tuple<Tensor, Tensor, Tensor> rnn_layer_cpu(
    const Tensor& input, const Tensor& h0, const Tensor& w_ih, const Tensor& w_hh,
    const optional<Tensor>& b_ih, const optional<Tensor>& b_hh, const optional<Tensor>& lengths,
    double dropout_p, const optional<Tensor>& seed, std::string_view nonlinearity,
    bool save_workspace) {
  constexpr const char* op = "rnn_layer";
  const auto cell = rnn_cell_kind(nonlinearity, op);
  const LayerDims d = check_gated_layer(input, h0, w_ih, w_hh, b_ih, b_hh, lengths, 1, 0, op);
  check_seed(seed, dropout_p, input, op);
  LayerOutputs out = layer_forward_cpu(cell, d, input, h0, Tensor(), w_ih, w_hh, b_ih, b_hh,
                                       std::nullopt, lengths, dropout_p, seed, save_workspace, op);
  return {out.output, out.h_n, out.workspace};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> rnn_layer_backward_cpu(
    const optional<Tensor>& grad_output, const optional<Tensor>& grad_h_n, const Tensor& input,
    const Tensor& h0, const Tensor& w_ih, const Tensor& w_hh, const optional<Tensor>& lengths,
    const Tensor& workspace, double dropout_p, const optional<Tensor>& seed,
    std::string_view nonlinearity, bool has_bias, bool input_grad, bool weight_grad) {
  constexpr const char* op = "rnn_layer_backward";
  const auto cell = rnn_cell_kind(nonlinearity, op);
  const LayerDims d =
      check_gated_layer(input, h0, w_ih, w_hh, std::nullopt, std::nullopt, lengths, 1, 0, op);
  check_seed(seed, dropout_p, input, op);
  const auto [gout, ghn, gcn] =
      check_layer_backward(grad_output, grad_h_n, std::nullopt, input, workspace, d, op);
  LayerGrads g = layer_backward_cpu(cell, d, gout, ghn, Tensor(), input, h0, Tensor(), w_ih, w_hh,
                                    std::nullopt, lengths, workspace, dropout_p, seed, has_bias,
                                    input_grad, weight_grad, op);
  return {g.input, g.h0, g.w_ih, g.w_hh, g.b_ih, g.b_hh};
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fastattn, CPU, m) {
  m.impl("rnn_layer", TORCH_BOX(&rnn_layer_cpu));
  m.impl("rnn_layer_backward", TORCH_BOX(&rnn_layer_backward_cpu));
}

}  // namespace fastattn::recurrent
