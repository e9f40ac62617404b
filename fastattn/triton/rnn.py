"""Triton kernels of the Elman RNN: the launchers of the torch ops fastattn::rnn_layer_triton
and rnn_layer_backward_triton (registered by fastattn/ops/rnn.py with the contract in
fastattn/contracts/recurrent.py). `rnn_cell` runs the layer op with T = 1.

The recurrence runs on the recurrent engine (fastattn/triton/recurrent.py), generic over the
cell: the input projection of all T steps (both biases folded in) is one GEMM, then one fused
step kernel per time step computes h_{t-1} W_hh^T with the activation (tanh or relu) in its
epilogue.
Backward per step: the pre-activation gradient, then dh_{t-1} = da W_hh; the weight gradients
are GEMMs over all T * B rows.
Workspace (D, T * B * 2H) float32, per (direction, step, row): y | h_t, y the activation (0 past
a row's end), h_t the state carried past the end.
"""

from __future__ import annotations

import torch

from .recurrent import (
    CELL_RNN_RELU,
    CELL_RNN_TANH,
    dropped_input,
    input_gradient,
    layer_backward,
    layer_forward,
    previous_states,
    seed_arg,
)

_CELLS = {"tanh": CELL_RNN_TANH, "relu": CELL_RNN_RELU}


def _cell(op: str, nonlinearity: str) -> int:
    if nonlinearity not in _CELLS:
        raise ValueError(
            f"fastattn::{op}: nonlinearity must be 'tanh' or 'relu', got {nonlinearity!r}"
        )
    return _CELLS[nonlinearity]


def rnn_layer(
    input: torch.Tensor,
    h0: torch.Tensor,
    w_ih: torch.Tensor,
    w_hh: torch.Tensor,
    b_ih: torch.Tensor | None,
    b_hh: torch.Tensor | None,
    lengths: torch.Tensor | None,
    dropout_p: float,
    seed: torch.Tensor | None,
    nonlinearity: str,
    save_workspace: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer, D directions: input (T, B, I), h0 (D, B, H), w_ih (D, H, I), w_hh (D, H, H),
    b_ih / b_hh (D, H) or None, lengths (B,) or None -> output (T, B, D * H), h_n (D, B, H),
    workspace (D, T * B * 2H) float32 ((0,) unless save_workspace)."""
    op = "rnn_layer_triton"
    out, h_n, _, ws = layer_forward(
        _cell(op, nonlinearity),
        op,
        input,
        h0,
        None,
        w_ih,
        w_hh,
        b_ih,
        b_hh,
        None,
        lengths,
        dropout_p,
        seed,
        save_workspace,
    )
    return out, h_n, ws


def rnn_layer_backward(
    grad_output: torch.Tensor | None,
    grad_h_n: torch.Tensor | None,
    input: torch.Tensor,
    h0: torch.Tensor,
    w_ih: torch.Tensor,
    w_hh: torch.Tensor,
    lengths: torch.Tensor | None,
    workspace: torch.Tensor,
    dropout_p: float,
    seed: torch.Tensor | None,
    nonlinearity: str,
    has_bias: bool,
    input_grad: bool,
    weight_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> grad_input (T, B, I), grad_h0 (D, B, H), grad_w_ih (D, H, I), grad_w_hh (D, H, H),
    grad_b_ih, grad_b_hh (D, H) (equal values, separate tensors); grad_input (0,) unless
    input_grad, the weight and bias gradients (0,) unless weight_grad (and has_bias)."""
    op = "rnn_layer_backward_triton"
    cell = _cell(op, nonlinearity)
    seed = seed_arg(dropout_p, seed, op)
    dgates, dh, _, _ = layer_backward(
        cell,
        op,
        grad_output,
        grad_h_n,
        None,
        input,
        h0,
        None,
        w_ih,
        w_hh,
        None,
        lengths,
        workspace,
        dropout_p,
    )
    D, T, B, H = dgates.shape
    dtype = input.dtype
    dg = dgates.view(D, T * B, H)

    def empty():  # a fresh one per output: a custom op's outputs must not alias each other
        return input.new_empty((0,))

    grad_input = (
        input_gradient(dg, w_ih, tuple(input.shape), dropout_p, seed).to(dtype)
        if input_grad
        else empty()
    )
    grad_w_ih, grad_w_hh, grad_b_ih, grad_b_hh = empty(), empty(), empty(), empty()
    if weight_grad:
        xd = dropped_input(input, dropout_p, seed)
        grad_w_ih = torch.matmul(dg.transpose(1, 2), xd).to(dtype)
        h_prev = previous_states(workspace.view(D, T, B, 2 * H)[..., H:], h0)
        grad_w_hh = torch.matmul(dg.transpose(1, 2), h_prev).to(dtype)
        if has_bias:
            grad_b_ih = dg.sum(1).to(dtype)
            grad_b_hh = grad_b_ih.clone()
    return grad_input, dh.to(dtype), grad_w_ih, grad_w_hh, grad_b_ih, grad_b_hh
