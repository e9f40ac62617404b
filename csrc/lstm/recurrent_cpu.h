// The CPU recurrent engine's host side, shared by the layer ops of every cell (lstm_layer,
// gru_layer, rnn_layer): argument-independent setup (the sorted/packed view of a
// variable-length batch, workspaces), the large GEMMs (input projection for all time steps
// before the recurrence, weight and input gradients over all time steps after it) and the
// ISA-dispatched recurrence of lstm_cpu_kernel.cpp, generic over the cell.
#pragma once
#include <ATen/core/Tensor.h>

#include "lstm/lstm.h"
#include "lstm/lstm_cpu_kernel.h"

namespace fastattn::lstm {

struct LayerOutputs {
  at::Tensor output, h_n, c_n, workspace;  // c_n undefined unless LSTM
};

// One layer's forward (the checks are the caller's: d from check_layer / check_gated_layer).
// c0 and w_hr only for the LSTM (undefined / nullopt otherwise).
LayerOutputs layer_forward_cpu(cpu::RecurrentCell cell, const LayerDims& d, const at::Tensor& input,
                               const at::Tensor& h0, const at::Tensor& c0, const at::Tensor& w_ih,
                               const at::Tensor& w_hh, const c10::optional<at::Tensor>& b_ih,
                               const c10::optional<at::Tensor>& b_hh,
                               const c10::optional<at::Tensor>& w_hr,
                               const c10::optional<at::Tensor>& lengths, double dropout_p,
                               const c10::optional<at::Tensor>& seed, bool save_workspace,
                               const char* op);

struct LayerGrads {
  at::Tensor input, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr;  // (0,) where not asked for
};

// One layer's backward; the incoming gradients are checked and contiguous (undefined: zeros).
LayerGrads layer_backward_cpu(cpu::RecurrentCell cell, const LayerDims& d,
                              const at::Tensor& grad_output, const at::Tensor& grad_h_n,
                              const at::Tensor& grad_c_n, const at::Tensor& input,
                              const at::Tensor& h0, const at::Tensor& c0, const at::Tensor& w_ih,
                              const at::Tensor& w_hh, const c10::optional<at::Tensor>& w_hr,
                              const c10::optional<at::Tensor>& lengths, const at::Tensor& workspace,
                              double dropout_p, const c10::optional<at::Tensor>& seed,
                              bool has_bias, bool input_grad, bool weight_grad, const char* op);

}  // namespace fastattn::lstm
