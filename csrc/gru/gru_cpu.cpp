// CPU bodies of the GRU layer ops (contract: fastattn/ops/_recurrent.py): checks, then the
// recurrent engine shared with the LSTM and the RNN (csrc/recurrent/recurrent_cpu.cpp, the cell a
// template parameter of the kernel: RecurrentCell::gru, or gru_reset_before for the textbook
// form of Cho et al.).
#include "common/tensor_api.h"

#include "common/checks.h"
#include "recurrent/recurrent.h"
#include "recurrent/recurrent_cpu.h"

namespace fastattn::recurrent {
namespace {

using std::optional;

cpu::RecurrentCell gru_cell_kind(bool reset_after) {
  return reset_after ? cpu::RecurrentCell::gru : cpu::RecurrentCell::gru_reset_before;
}

std::tuple<Tensor, Tensor, Tensor> gru_layer_cpu(
    const Tensor& input, const Tensor& h0, const Tensor& w_ih, const Tensor& w_hh,
    const optional<Tensor>& b_ih, const optional<Tensor>& b_hh, const optional<Tensor>& lengths,
    double dropout_p, const optional<Tensor>& seed, bool reset_after, bool save_workspace) {
  constexpr const char* op = "gru_layer";
  const LayerDims d = check_gated_layer(input, h0, w_ih, w_hh, b_ih, b_hh, lengths, 3, 1, op);
  check_seed(seed, dropout_p, input, op);
  LayerOutputs out =
      layer_forward_cpu(gru_cell_kind(reset_after), d, input, h0, Tensor(), w_ih, w_hh, b_ih, b_hh,
                        std::nullopt, lengths, dropout_p, seed, save_workspace, op);
  return {out.output, out.h_n, out.workspace};
}

std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor, Tensor> gru_layer_backward_cpu(
    const optional<Tensor>& grad_output, const optional<Tensor>& grad_h_n, const Tensor& input,
    const Tensor& h0, const Tensor& w_ih, const Tensor& w_hh, const optional<Tensor>& lengths,
    const Tensor& workspace, double dropout_p, const optional<Tensor>& seed, bool reset_after,
    bool has_bias, bool input_grad, bool weight_grad) {
  constexpr const char* op = "gru_layer_backward";
  const LayerDims d =
      check_gated_layer(input, h0, w_ih, w_hh, std::nullopt, std::nullopt, lengths, 3, 1, op);
  check_seed(seed, dropout_p, input, op);
  const auto [gout, ghn, gcn] =
      check_layer_backward(grad_output, grad_h_n, std::nullopt, input, workspace, d, op);
  LayerGrads g = layer_backward_cpu(gru_cell_kind(reset_after), d, gout, ghn, Tensor(), input, h0,
                                    Tensor(), w_ih, w_hh, std::nullopt, lengths, workspace,
                                    dropout_p, seed, has_bias, input_grad, weight_grad, op);
  return {g.input, g.h0, g.w_ih, g.w_hh, g.b_ih, g.b_hh};
}

}  // namespace

STABLE_TORCH_LIBRARY_IMPL(fastattn, CPU, m) {
  m.impl("gru_layer", TORCH_BOX(&gru_layer_cpu));
  m.impl("gru_layer_backward", TORCH_BOX(&gru_layer_backward_cpu));
}

}  // namespace fastattn::recurrent
