"""Contract of the GRU and Elman RNN layer ops: fastattn::gru_layer, gru_layer_backward,
rnn_layer and rnn_layer_backward (csrc/bindings.cpp declares the schemas) and their Triton
twins (suffix _triton): the fake implementations and the backward formula, shared by the two
families (fastattn/ops/_recurrent.py registers them for every backend).

Both families have one hidden state and G gate blocks per weight matrix (GRU: G = 3, gates r, z, n;
RNN: G = 1); their layer ops share one signature, the last argument before save_workspace being the
cell's variant (`reset_after` for the GRU, `nonlinearity` for the RNN), and one engine per backend
(csrc/recurrent/recurrent_cpu.cpp on the CPU, generic over the cell;
csrc/recurrent/recurrent_cuda.cu's driver on CUDA, the cell a template parameter of its kernels;
fastattn/triton/recurrent.py's layer driver for the Triton twins X_layer_triton /
X_layer_backward_triton, same schemas). Op contract, with X = gru or rnn and "variant" that
argument:

fastattn::X_layer(Tensor input, Tensor h0, Tensor w_ih, Tensor w_hh, Tensor? b_ih,
                  Tensor? b_hh, Tensor? lengths, float dropout_p, Tensor? seed, variant,
                  bool save_workspace) -> (Tensor output, Tensor h_n, Tensor workspace)
    One layer with D = 1 or 2 directions (direction 1 runs backwards in time): input (T, B, I)
    time-major, unit last stride; h0 (D, B, H); w_ih (D, G H, I); w_hh (D, G H, H); b_ih, b_hh
    (D, G H) (both or none); lengths int64 (B,) in [0, T] or None; dropout_p in [0, 1) with
    seed int64 (2,) when > 0 (applied to the layer's input, fastattn's Philox stream, as
    lstm_layer). output (T, B, D H) (0 past a sequence's end), h_n (D, B, H), contiguous,
    storage dtype. workspace (D, T * B * W * H) in the compute type when save_workspace, else
    (0,); W = 5 for the GRU, 2 for the RNN; its layout is private to the backend.
fastattn::X_layer_backward(Tensor? grad_output, Tensor? grad_h_n, Tensor input, Tensor h0,
                           Tensor w_ih, Tensor w_hh, Tensor? lengths, Tensor workspace,
                           float dropout_p, Tensor? seed, variant, bool has_bias,
                           bool input_grad, bool weight_grad)
    -> (grad_input (T, B, I), grad_h0 (D, B, H), grad_w_ih (D, G H, I), grad_w_hh (D, G H, H),
        grad_b_ih (D, G H), grad_b_hh (D, G H)), storage dtype, contiguous. grad_input is (0,)
    unless input_grad; the weight and bias grads are (0,) unless weight_grad (and has_bias).
    The two bias gradients differ for the reset-after GRU (b_hn sits inside r * (.)).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import backward_through_reference, compute_dtype

# Workspace columns per (row, hidden unit) of one direction, per family.
WORKSPACE_WIDTH = {"gru": 5, "rnn": 2}


def layer_fake_for(family: str):
    width = WORKSPACE_WIDTH[family]

    def layer_fake(
        input, h0, w_ih, w_hh, b_ih, b_hh, lengths, dropout_p, seed, variant, save_workspace
    ):
        T, B, _ = input.shape
        D, _, H = w_hh.shape
        workspace = (D, T * B * width * H) if save_workspace else (0,)
        return (
            input.new_empty((T, B, D * H)),
            input.new_empty((D, B, H)),
            input.new_empty(workspace, dtype=compute_dtype(input.dtype)),
        )

    return layer_fake


def layer_backward_fake(
    grad_output,
    grad_h_n,
    input,
    h0,
    w_ih,
    w_hh,
    lengths,
    workspace,
    dropout_p,
    seed,
    variant,
    has_bias,
    input_grad,
    weight_grad,
):
    T, B, I = input.shape
    D, GH, H = w_hh.shape

    def maybe(shape, wanted):
        return input.new_empty(shape if wanted else (0,))

    return (
        maybe((T, B, I), input_grad),
        input.new_empty((D, B, H)),
        maybe((D, GH, I), weight_grad),
        maybe((D, GH, H), weight_grad),
        maybe((D, GH), weight_grad and has_bias),
        maybe((D, GH), weight_grad and has_bias),
    )


def autograd_formula(
    name: str, backward_op: Callable, reference_layer: Callable
) -> tuple[Callable, Callable]:
    """(backward, setup_context) of the layer op `name` (fastattn::<family>_layer, or its Triton
    twin) whose kernel backward is `backward_op` (the same backend's <family>_layer_backward). A
    backward taken with create_graph=True differentiates `reference_layer` (the family's
    reference layer, fastattn.reference.gru.gru_layer / rnn.rnn_layer) instead."""

    def setup(ctx, inputs, output):
        (input, h0, w_ih, w_hh, b_ih, b_hh, lengths, dropout_p, seed, variant, save_workspace) = (
            inputs
        )
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(output[2])
        ctx.meta = (dropout_p, variant, b_ih is not None, save_workspace)
        ctx.save_for_backward(input, h0, w_ih, w_hh, b_ih, b_hh, lengths, seed, output[2])

    def backward(ctx, grad_output, grad_h_n, _grad_workspace):
        if grad_output is None and grad_h_n is None:
            return (None,) * 11
        input, h0, w_ih, w_hh, b_ih, b_hh, lengths, seed, workspace = ctx.saved_tensors
        dropout_p, variant, has_bias, saved = ctx.meta
        if torch.is_grad_enabled():  # create_graph=True: a backward that is differentiable
            args = (input, h0, w_ih, w_hh, b_ih, b_hh, lengths, dropout_p, seed, variant)
            return backward_through_reference(
                reference_layer, args, ctx.needs_input_grad, (grad_output, grad_h_n)
            ) + (None,)
        if not saved:
            raise RuntimeError(
                f"{name} was called with save_workspace=False, so it cannot be "
                "differentiated: pass save_workspace=True"
            )
        needs = ctx.needs_input_grad
        gi, gh0, gwih, gwhh, gbih, gbhh = backward_op(
            grad_output,
            grad_h_n,
            input,
            h0,
            w_ih,
            w_hh,
            lengths,
            workspace,
            dropout_p,
            seed,
            variant,
            has_bias,
            needs[0],
            any(needs[2:6]),
        )
        return (
            gi if needs[0] else None,
            gh0 if needs[1] else None,
            gwih if needs[2] else None,
            gwhh if needs[3] else None,
            gbih if has_bias and needs[4] else None,
            gbhh if has_bias and needs[5] else None,
            None,
            None,
            None,
            None,
            None,
        )

    return backward, setup
