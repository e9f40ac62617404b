// The CPU recurrent engine's host side, shared by the layer ops of every cell (lstm_layer,
// gru_layer, rnn_layer): argument-independent setup (the sorted/packed view of a
// variable-length batch, workspaces), the large GEMMs (input projection for all time steps
// before the recurrence, weight and input gradients over all time steps after it) and the
// ISA-dispatched recurrence of recurrent_cpu_kernel.cpp, generic over the cell.
#pragma once
#include "common/tensor_api.h"

#include "recurrent/recurrent.h"
#include "recurrent/recurrent_cpu_kernel.h"

namespace fastattn::recurrent {

// Grow-only per-thread buffers for the large temporaries that never leave an op call (the
// packed input, dgates, ...): a fresh allocation above glibc's mmap threshold is page-faulted
// and zero-filled by the kernel on every call (docs/design/cpu_kernels.md). A slot holds one
// buffer at a time, on the calling thread; contents are undefined.
enum Scratch : int {
  kPackedInput,
  kWorkspace,
  kGrads,
  kAux,
  kHprev,
  kProjGrads,
  kProjInputs,
  kInputGrad,
  kCellWeightIh,  // the lstm_cell backward's float copies of bfloat16 / half weights
  kCellWeightHh,
  kCellProduct,  // and its float weight-gradient products before rounding
  kSlots
};
Tensor scratch(Scratch slot, IntArrayRef sizes, const Options& options);

struct LayerOutputs {
  Tensor output, h_n, c_n, workspace;  // c_n undefined unless LSTM
};

// One layer's forward (the checks are the caller's: d from check_layer / check_gated_layer).
// c0 and w_hr only for the LSTM (undefined / nullopt otherwise).
LayerOutputs layer_forward_cpu(cpu::RecurrentCell cell, const LayerDims& d, const Tensor& input,
                               const Tensor& h0, const Tensor& c0, const Tensor& w_ih,
                               const Tensor& w_hh, const std::optional<Tensor>& b_ih,
                               const std::optional<Tensor>& b_hh, const std::optional<Tensor>& w_hr,
                               const std::optional<Tensor>& lengths, double dropout_p,
                               const std::optional<Tensor>& seed, bool save_workspace,
                               const char* op);

struct LayerGrads {
  Tensor input, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr;  // (0,) where not asked for
};

// One layer's backward; the incoming gradients are checked and contiguous (undefined: zeros).
LayerGrads layer_backward_cpu(cpu::RecurrentCell cell, const LayerDims& d,
                              const Tensor& grad_output, const Tensor& grad_h_n,
                              const Tensor& grad_c_n, const Tensor& input, const Tensor& h0,
                              const Tensor& c0, const Tensor& w_ih, const Tensor& w_hh,
                              const std::optional<Tensor>& w_hr,
                              const std::optional<Tensor>& lengths, const Tensor& workspace,
                              double dropout_p, const std::optional<Tensor>& seed, bool has_bias,
                              bool input_grad, bool weight_grad, const char* op);

}  // namespace fastattn::recurrent
