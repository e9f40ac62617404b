"""Triton kernels of the GRU: the launchers of the torch ops fastattn::gru_layer_triton and
gru_layer_backward_triton (registered by fastattn/ops/gru.py with the contract in
fastattn/contracts/recurrent.py). `gru_cell` runs the layer op with T = 1.

The recurrence runs on the recurrent engine (fastattn/triton/recurrent.py), generic over the
cell: the input projection of all T steps is one GEMM, then one fused step kernel per time step
computes the r, z, n products with h_{t-1} W_hh^T and the cell in the GEMM's epilogue.
- reset_after=True (torch's and cuDNN's form): W_hn h_{t-1} + b_hn is a third accumulator of
  the same step, kept apart from the input projection because r multiplies it;
- reset_after=False (Cho et al. 2014): n's product is (r * h_{t-1}) W_hn^T, which needs r of
  every unit first (a grid-wide dependency), so a step is two launches of the same kernel
  (phase 0: r, z and r * h_{t-1} into a scratch; phase 1: n and h_t).
Backward per step: the gates' gradient (dh_t (1 - z) etc.), for reset-before one more kernel
for the gradient through r * h_{t-1} (g = da_n W_hn over every unit), then dh_{t-1} as a product
with W_hh plus the direct term dh_t z. Weight gradients are GEMMs over all T * B rows.
Workspace (D, T * B * 5H) float32, per (direction, step, row): r | z | n | X | h_t with X =
W_hn h_{t-1} + b_hn (reset-after) or r * h_{t-1} (reset-before), h_t the state carried past a
row's end.
"""

from __future__ import annotations

import torch

from .recurrent import (
    CELL_GRU,
    CELL_GRU_RESET_BEFORE,
    dropped_input,
    input_gradient,
    layer_backward,
    layer_forward,
    previous_states,
    seed_arg,
)


def gru_layer(
    input: torch.Tensor,
    h0: torch.Tensor,
    w_ih: torch.Tensor,
    w_hh: torch.Tensor,
    b_ih: torch.Tensor | None,
    b_hh: torch.Tensor | None,
    lengths: torch.Tensor | None,
    dropout_p: float,
    seed: torch.Tensor | None,
    reset_after: bool,
    save_workspace: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer, D directions: input (T, B, I), h0 (D, B, H), w_ih (D, 3H, I), w_hh
    (D, 3H, H), b_ih / b_hh (D, 3H) or None, lengths (B,) or None -> output (T, B, D * H),
    h_n (D, B, H), workspace (D, T * B * 5H) float32 ((0,) unless save_workspace)."""
    cell = CELL_GRU if reset_after else CELL_GRU_RESET_BEFORE
    out, h_n, _, ws = layer_forward(
        cell,
        "gru_layer_triton",
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


def gru_layer_backward(
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
    reset_after: bool,
    has_bias: bool,
    input_grad: bool,
    weight_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> grad_input (T, B, I), grad_h0 (D, B, H), grad_w_ih (D, 3H, I), grad_w_hh (D, 3H, H),
    grad_b_ih, grad_b_hh (D, 3H); grad_input (0,) unless input_grad, the weight and bias
    gradients (0,) unless weight_grad (and has_bias)."""
    op = "gru_layer_backward_triton"
    seed = seed_arg(dropout_p, seed, op)
    cell = CELL_GRU if reset_after else CELL_GRU_RESET_BEFORE
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
    D, T, B, _ = dgates.shape
    H = h0.shape[2]
    dtype = input.dtype
    ws = workspace.view(D, T, B, 5 * H)
    # dgates: da_r | da_z | da_n (the input side's gradient) | the gradient of the n block of
    # h W_hh^T + b_hh (r * da_n reset-after, da_n reset-before).
    dg = dgates.view(D, T * B, 4 * H)
    dg_x = dg[..., : 3 * H]

    def empty():  # a fresh one per output: a custom op's outputs must not alias each other
        return input.new_empty((0,))

    grad_input = (
        input_gradient(dg_x, w_ih, tuple(input.shape), dropout_p, seed).to(dtype)
        if input_grad
        else empty()
    )
    grad_w_ih, grad_w_hh, grad_b_ih, grad_b_hh = empty(), empty(), empty(), empty()
    if weight_grad:
        grad_w_ih = torch.matmul(dg_x.transpose(1, 2), dropped_input(input, dropout_p, seed))
        grad_w_ih = grad_w_ih.to(dtype)
        h_prev = previous_states(ws[..., 4 * H :], h0)  # (D, T * B, H)
        # n's rows multiply h_{t-1} (reset-after) or r * h_{t-1} (reset-before, saved)
        n_in = h_prev if reset_after else ws[..., 3 * H : 4 * H].reshape(D, T * B, H)
        grad_w_hh = torch.cat(
            [
                torch.matmul(dg[..., : 2 * H].transpose(1, 2), h_prev),
                torch.matmul(dg[..., 3 * H :].transpose(1, 2), n_in),
            ],
            dim=1,
        ).to(dtype)
        if has_bias:
            grad_b_ih = dg_x.sum(1).to(dtype)
            grad_b_hh = torch.cat([dg[..., : 2 * H], dg[..., 3 * H :]], dim=2).sum(1).to(dtype)
    return grad_input, dh.to(dtype), grad_w_ih, grad_w_hh, grad_b_ih, grad_b_hh
