// Argument checks and output shapes of the recurrent ops (LSTM, GRU, Elman RNN), shared by the
// CPU and CUDA op bodies of every cell. fastattn/ops/lstm.py (and the GRU/RNN ops) check the same
// rules first with torch.nn's messages and document the op contract; these guard direct calls of
// torch.ops.fastattn.*.
#pragma once
#include "common/tensor_api.h"

#include <tuple>
#include <utility>

#include "common/checks.h"

namespace fastattn::recurrent {

// Sizes of one layer call: T steps, B rows, I input features, D directions, H hidden units,
// P = projection size (H without projection); the cell's G gate blocks and E extra saved
// columns per unit (LSTM 4 and 1, GRU 3 and 1, RNN 1 and 0; csrc/recurrent/recurrent_cpu_kernel.h).
struct LayerDims {
  int64_t T, B, I, D, H, P;
  int64_t G = 4, E = 1;
};

inline bool defined(const std::optional<Tensor>& t) { return t.has_value() && t->defined(); }

inline ScalarType compute_dtype(ScalarType t) { return t == kDouble ? kDouble : kFloat; }

// Elements of the forward workspace of one direction (see fastattn/ops/lstm.py): T * B rows of
// G H activated gates, E H extra values (the LSTM's cell) and P hidden values.
inline int64_t workspace_per_direction(const LayerDims& d) {
  return d.T * d.B * ((d.G + d.E) * d.H + d.P);
}

inline void check_same(const Tensor& t, const Tensor& input, const char* op, const char* name) {
  FASTATTN_CHECK(t.scalar_type() == input.scalar_type(), op, name, " must have the input's dtype ",
                 input.scalar_type(), ", got ", t.scalar_type());
  check_same_device(t, input, op, name, "input");
}

inline void check_shape(const Tensor& t, IntArrayRef want, const char* op, const char* name) {
  FASTATTN_CHECK(t.sizes() == want, op, name, " must have shape ", want, ", got ", t.sizes());
}

// input (T, B, I); w_ih (D, 4H, I); w_hh (D, 4H, P); b_ih/b_hh (D, 4H); w_hr (D, P, H);
// h0 (D, B, P); c0 (D, B, H); lengths int64 (B,).
inline LayerDims check_layer(const Tensor& input, const Tensor& h0, const Tensor& c0,
                             const Tensor& w_ih, const Tensor& w_hh,
                             const std::optional<Tensor>& b_ih, const std::optional<Tensor>& b_hh,
                             const std::optional<Tensor>& w_hr,
                             const std::optional<Tensor>& lengths, const char* op) {
  check_float_dtype(input, op, "input");
  FASTATTN_CHECK(input.dim() == 3, op, "input must be 3-D (T, B, I), got ", input.sizes());
  FASTATTN_CHECK(w_ih.dim() == 3 && (w_ih.size(0) == 1 || w_ih.size(0) == 2), op,
                 "w_ih must be (D, 4H, I) with D = 1 or 2 directions, got ", w_ih.sizes());
  FASTATTN_CHECK(w_hh.dim() == 3, op, "w_hh must be (D, 4H, P), got ", w_hh.sizes());
  LayerDims d{input.size(0), input.size(1),    input.size(2),
              w_ih.size(0),  w_hh.size(1) / 4, w_hh.size(2)};
  FASTATTN_CHECK(d.H >= 1 && w_hh.size(1) == 4 * d.H && w_hh.size(0) == d.D, op,
                 "w_hh must be (D, 4H, P) with H >= 1, got ", w_hh.sizes());
  check_shape(w_ih, {d.D, 4 * d.H, d.I}, op, "w_ih");
  check_same(w_ih, input, op, "w_ih");
  check_same(w_hh, input, op, "w_hh");
  FASTATTN_CHECK(defined(b_ih) == defined(b_hh), op, "b_ih and b_hh must be given together");
  if (defined(b_ih)) {
    check_shape(*b_ih, {d.D, 4 * d.H}, op, "b_ih");
    check_shape(*b_hh, {d.D, 4 * d.H}, op, "b_hh");
    check_same(*b_ih, input, op, "b_ih");
    check_same(*b_hh, input, op, "b_hh");
  }
  if (defined(w_hr)) {
    FASTATTN_CHECK(d.P >= 1 && d.P < d.H, op, "the projection size must be in [1, H) = [1, ", d.H,
                   "), got ", d.P);
    check_shape(*w_hr, {d.D, d.P, d.H}, op, "w_hr");
    check_same(*w_hr, input, op, "w_hr");
  } else {
    FASTATTN_CHECK(d.P == d.H, op, "without w_hr, w_hh must be (D, 4H, H), got ", w_hh.sizes());
  }
  check_shape(h0, {d.D, d.B, d.P}, op, "h0");
  check_shape(c0, {d.D, d.B, d.H}, op, "c0");
  check_same(h0, input, op, "h0");
  check_same(c0, input, op, "c0");
  if (defined(lengths)) {
    FASTATTN_CHECK(
        lengths->scalar_type() == kLong && lengths->dim() == 1 && lengths->size(0) == d.B, op,
        "lengths must be an int64 (B,) = (", d.B, ",) tensor, got ", lengths->scalar_type(), " ",
        lengths->sizes());
    check_same_device(*lengths, input, op, "lengths", "input");
  }
  return d;
}

// The GRU / RNN layer ops (one state, no projection): input (T, B, I); w_ih (D, G H, I);
// w_hh (D, G H, H); b_ih/b_hh (D, G H); h0 (D, B, H); lengths int64 (B,).
inline LayerDims check_gated_layer(const Tensor& input, const Tensor& h0, const Tensor& w_ih,
                                   const Tensor& w_hh, const std::optional<Tensor>& b_ih,
                                   const std::optional<Tensor>& b_hh,
                                   const std::optional<Tensor>& lengths, int64_t G, int64_t E,
                                   const char* op) {
  check_float_dtype(input, op, "input");
  FASTATTN_CHECK(input.dim() == 3, op, "input must be 3-D (T, B, I), got ", input.sizes());
  FASTATTN_CHECK(w_ih.dim() == 3 && (w_ih.size(0) == 1 || w_ih.size(0) == 2), op,
                 "w_ih must be (D, ", G, "H, I) with D = 1 or 2 directions, got ", w_ih.sizes());
  FASTATTN_CHECK(w_hh.dim() == 3, op, "w_hh must be (D, ", G, "H, H), got ", w_hh.sizes());
  LayerDims d{
      input.size(0), input.size(1), input.size(2), w_ih.size(0), w_hh.size(2), w_hh.size(2), G, E};
  FASTATTN_CHECK(d.H >= 1 && w_hh.size(1) == G * d.H && w_hh.size(0) == d.D, op,
                 "w_hh must be (D, ", G, "H, H) with H >= 1, got ", w_hh.sizes());
  check_shape(w_ih, {d.D, G * d.H, d.I}, op, "w_ih");
  check_same(w_ih, input, op, "w_ih");
  check_same(w_hh, input, op, "w_hh");
  FASTATTN_CHECK(defined(b_ih) == defined(b_hh), op, "b_ih and b_hh must be given together");
  if (defined(b_ih)) {
    check_shape(*b_ih, {d.D, G * d.H}, op, "b_ih");
    check_shape(*b_hh, {d.D, G * d.H}, op, "b_hh");
    check_same(*b_ih, input, op, "b_ih");
    check_same(*b_hh, input, op, "b_hh");
  }
  check_shape(h0, {d.D, d.B, d.H}, op, "h0");
  check_same(h0, input, op, "h0");
  if (defined(lengths)) {
    FASTATTN_CHECK(
        lengths->scalar_type() == kLong && lengths->dim() == 1 && lengths->size(0) == d.B, op,
        "lengths must be an int64 (B,) = (", d.B, ",) tensor, got ", lengths->scalar_type(), " ",
        lengths->sizes());
    check_same_device(*lengths, input, op, "lengths", "input");
  }
  return d;
}

// input (B, I); hx, cx (B, H); w_ih (4H, I); w_hh (4H, H); b_ih/b_hh (4H,) (both or none).
inline void check_cell(const Tensor& input, const Tensor& hx, const Tensor& cx, const Tensor& w_ih,
                       const Tensor& w_hh, const std::optional<Tensor>& b_ih,
                       const std::optional<Tensor>& b_hh, const char* op) {
  check_float_dtype(input, op, "input");
  FASTATTN_CHECK(input.dim() == 2, op, "input must be 2-D (B, I), got ", input.sizes());
  FASTATTN_CHECK(w_ih.dim() == 2 && w_ih.size(0) % 4 == 0 && w_ih.size(0) >= 4 &&
                     w_ih.size(1) == input.size(1),
                 op, "w_ih must be (4H, I) = (4H, ", input.size(1), "), got ", w_ih.sizes());
  const int64_t H = w_ih.size(0) / 4, B = input.size(0);
  check_shape(w_hh, {4 * H, H}, op, "w_hh");
  check_shape(hx, {B, H}, op, "hx");
  check_shape(cx, {B, H}, op, "cx");
  for (auto [t, name] : {std::pair{&w_ih, "w_ih"}, {&w_hh, "w_hh"}, {&hx, "hx"}, {&cx, "cx"}}) {
    check_same(*t, input, op, name);
  }
  FASTATTN_CHECK(defined(b_ih) == defined(b_hh), op, "b_ih and b_hh must be given together");
  if (defined(b_ih)) {
    check_shape(*b_ih, {4 * H}, op, "b_ih");
    check_shape(*b_hh, {4 * H}, op, "b_hh");
    check_same(*b_ih, input, op, "b_ih");
    check_same(*b_hh, input, op, "b_hh");
  }
}

// An incoming gradient of the backward ops: undefined when not given, else checked (shape, the
// input's dtype and device) and made contiguous.
inline Tensor checked_grad(const std::optional<Tensor>& g, IntArrayRef shape, const Tensor& input,
                           const char* op, const char* name) {
  if (!defined(g)) return Tensor();
  check_shape(*g, shape, op, name);
  check_same(*g, input, op, name);
  return g->contiguous();
}

// lstm_cell_backward's checks past check_cell: the workspace must be what lstm_cell returned
// ((B, 5H) contiguous, compute dtype, input's device) and the incoming gradients (B, H).
// Returns (grad_hy, grad_cy) contiguous, undefined where not given.
inline std::pair<Tensor, Tensor> check_cell_backward(const std::optional<Tensor>& grad_hy,
                                                     const std::optional<Tensor>& grad_cy,
                                                     const Tensor& input, const Tensor& workspace,
                                                     int64_t B, int64_t H, const char* op) {
  const auto acc = compute_dtype(input.scalar_type());
  FASTATTN_CHECK(workspace.scalar_type() == acc && workspace.is_contiguous() &&
                     workspace.sizes() == IntArrayRef({B, 5 * H}),
                 op, "workspace must be the contiguous ", acc, " (", B, ", ", 5 * H,
                 ") tensor lstm_cell returned, got ", workspace.scalar_type(), " ",
                 workspace.sizes());
  check_same_device(workspace, input, op, "workspace", "input");
  return {checked_grad(grad_hy, {B, H}, input, op, "grad_hy"),
          checked_grad(grad_cy, {B, H}, input, op, "grad_cy")};
}

// lstm_layer_backward's checks past check_layer: the workspace must be what lstm_layer returned
// ((D, workspace_per_direction) contiguous, compute dtype, input's device) and the incoming
// gradients of output (T, B, D * P), h_n (D, B, P) and c_n (D, B, H). Returns them contiguous,
// undefined where not given.
inline std::tuple<Tensor, Tensor, Tensor> check_layer_backward(
    const std::optional<Tensor>& grad_output, const std::optional<Tensor>& grad_h_n,
    const std::optional<Tensor>& grad_c_n, const Tensor& input, const Tensor& workspace,
    const LayerDims& d, const char* op) {
  const auto acc = compute_dtype(input.scalar_type());
  FASTATTN_CHECK(
      workspace.scalar_type() == acc && workspace.is_contiguous() && workspace.dim() == 2 &&
          workspace.size(0) == d.D && workspace.size(1) == workspace_per_direction(d),
      op, "workspace must be the contiguous ", acc, " (", d.D, ", ", workspace_per_direction(d),
      ") tensor lstm_layer returned, got ", workspace.scalar_type(), " ", workspace.sizes());
  check_same_device(workspace, input, op, "workspace", "input");
  return {checked_grad(grad_output, {d.T, d.B, d.D * d.P}, input, op, "grad_output"),
          checked_grad(grad_h_n, {d.D, d.B, d.P}, input, op, "grad_h_n"),
          checked_grad(grad_c_n, {d.D, d.B, d.H}, input, op, "grad_c_n")};
}

}  // namespace fastattn::recurrent
