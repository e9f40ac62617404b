"""Contract of the LSTM ops: fastattn::lstm_cell, lstm_cell_backward, lstm_layer and
lstm_layer_backward (csrc/bindings.cpp declares the schemas) and their Triton twins (suffix
_triton). What a "cuda" or "triton" implementation provides; the CPU one is the model.

All tensors on one device; "acc" is float32 (float64 for float64 storage); the storage
dtype is float32, float64, float16 or bfloat16, the same for every input; the math is done in
acc and rounded once to the storage dtype. Gates are in torch's order i, f, g, o:

    gates = x W_ih^T + b_ih + h W_hh^T + b_hh;  i, f, o = sigmoid(.), g = tanh(.)
    c' = f * c + i * g;  h' = o * tanh(c')   (then h' = h' W_hr^T with a projection)

fastattn::lstm_cell(Tensor input, Tensor hx, Tensor cx, Tensor w_ih, Tensor w_hh,
                    Tensor? b_ih, Tensor? b_hh) -> (Tensor hy, Tensor cy, Tensor workspace)
    input (B, I), hx/cx (B, H), w_ih (4H, I), w_hh (4H, H), b_ih/b_hh (4H,) (both or none).
    hy, cy (B, H) storage dtype; workspace (B, 5H) acc, contiguous = [i | f | g | o | tanh(cy)]
    (activated gates, torch order).
fastattn::lstm_cell_backward(Tensor? grad_hy, Tensor? grad_cy, Tensor input, Tensor hx,
                             Tensor cx, Tensor w_ih, Tensor w_hh, Tensor workspace,
                             bool has_bias)
    -> (grad_input (B, I), grad_hx (B, H), grad_cx (B, H), grad_w_ih (4H, I),
        grad_w_hh (4H, H), grad_bias (4H,) or (0,) without bias), storage dtype.
    grad_bias is the gradient of b_ih and of b_hh (the same values). Missing grads are zeros.

fastattn::lstm_layer(Tensor input, Tensor h0, Tensor c0, Tensor w_ih, Tensor w_hh,
                     Tensor? b_ih, Tensor? b_hh, Tensor? w_hr, Tensor? lengths,
                     float dropout_p, Tensor? seed, bool save_workspace)
    -> (Tensor output, Tensor h_n, Tensor c_n, Tensor workspace)
    One layer with D = 1 or 2 directions (direction 1 runs backwards in time):
    input (T, B, I) time-major, any strides with a unit last stride; h0 (D, B, P), c0 (D, B, H);
    w_ih (D, 4H, I); w_hh (D, 4H, P); b_ih, b_hh (D, 4H) (both or none); w_hr (D, P, H) or None
    (then P = H); lengths int64 (B,) on the input's device, values in [0, T], any order, or None
    (all T). dropout_p in [0, 1) with seed int64 (2,) = (seed, stream) when > 0: dropout is
    applied to the layer's *input* (fastattn's Philox stream, csrc/common/philox.h, element
    e = (t * B + b) * I + i of the (T, B, I) input; kept elements scaled by 1/(1 - p)).
    output (T, B, D * P): direction d in columns [d * P, (d + 1) * P), 0 at t >= lengths[b];
    h_n (D, B, P), c_n (D, B, H): the state after each sequence's last step (t = lengths[b] - 1
    forward, t = 0 reverse; h0/c0 for a length of 0); contiguous, storage dtype.
    workspace (D, T * B * (5H + P)) acc, contiguous, when save_workspace, else (0,) (inference:
    the driver asks for it only when autograd will need it): whatever the same backend's
    lstm_layer_backward needs; its layout is private to the backend, only its shape is part of
    the contract (`layer_fake` below). The CPU backend stores, per direction, the
    activated gates (T * B, 4H), c_t (T * B, H) and h_t (T * B, P) of every packed row (time-
    major rows of the batch sorted by length; unused rows zero), so its backward recomputes no
    GEMM. The CUDA backend stores the same three arrays with unsorted time-major rows t * B + b
    (gates in the natural i, f, g, o order; rows past a sequence's end zero): it masks rows
    per step instead of sorting (csrc/recurrent/recurrent_cuda_kernels.cuh).
    With lengths, no work happens past a sequence's end (the CPU backend sorts the batch by
    length and shrinks the active rows per step, as PackedSequence's batch_sizes do).
fastattn::lstm_layer_backward(Tensor? grad_output, Tensor? grad_h_n, Tensor? grad_c_n,
                              Tensor input, Tensor h0, Tensor c0, Tensor w_ih, Tensor w_hh,
                              Tensor? w_hr, Tensor? lengths, Tensor workspace, float dropout_p,
                              Tensor? seed, bool has_bias, bool input_grad, bool weight_grad)
    -> (grad_input (T, B, I), grad_h0 (D, B, P), grad_c0 (D, B, H), grad_w_ih (D, 4H, I),
        grad_w_hh (D, 4H, P), grad_bias (D, 4H), grad_w_hr (D, P, H)), storage dtype, contiguous.
    Missing incoming grads are zeros. grad_input is (0,) unless input_grad (it includes the
    dropout mask); the weight grads are (0,) unless weight_grad; grad_bias is (0,) without
    bias and is the gradient of b_ih and of b_hh; grad_w_hr is (0,) without projection.

A new backend registers kernels for these four ops (CUDA: TORCH_LIBRARY_IMPL(fastattn, CUDA,
...)), or defines launchers with the same signatures that fastattn/ops/lstm.py registers as
lstm_*_triton ops with FAKES and autograd_formulas below; fastattn._backend.cannot_run then
lets `lstm`/`lstm_cell` choose it.
"""

from __future__ import annotations

from collections.abc import Callable
from types import ModuleType

import torch

from . import backward_through_reference, compute_dtype


def cell_fake(input, hx, cx, w_ih, w_hh, b_ih, b_hh):
    B, H = input.shape[0], w_hh.shape[1]
    return (
        input.new_empty((B, H)),
        input.new_empty((B, H)),
        input.new_empty((B, 5 * H), dtype=compute_dtype(input.dtype)),
    )


def cell_backward_fake(grad_hy, grad_cy, input, hx, cx, w_ih, w_hh, workspace, has_bias):
    H = w_hh.shape[1]
    return (
        torch.empty_like(input, memory_format=torch.contiguous_format),
        input.new_empty(hx.shape),
        input.new_empty(cx.shape),
        input.new_empty(w_ih.shape),
        input.new_empty(w_hh.shape),
        input.new_empty((4 * H,) if has_bias else (0,)),
    )


def layer_fake(
    input, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr, lengths, dropout_p, seed, save_workspace
):
    T, B, _ = input.shape
    D, G, P = w_hh.shape
    H = G // 4
    workspace = (D, T * B * (5 * H + P)) if save_workspace else (0,)
    return (
        input.new_empty((T, B, D * P)),
        input.new_empty((D, B, P)),
        input.new_empty((D, B, H)),
        input.new_empty(workspace, dtype=compute_dtype(input.dtype)),
    )


def layer_backward_fake(
    grad_output,
    grad_h_n,
    grad_c_n,
    input,
    h0,
    c0,
    w_ih,
    w_hh,
    w_hr,
    lengths,
    workspace,
    dropout_p,
    seed,
    has_bias,
    input_grad,
    weight_grad,
):
    T, B, I = input.shape
    D, G, P = w_hh.shape
    H = G // 4

    def maybe(shape, wanted):
        return input.new_empty(shape if wanted else (0,))

    return (
        maybe((T, B, I), input_grad),
        input.new_empty((D, B, P)),
        input.new_empty((D, B, H)),
        maybe((D, G, I), weight_grad),
        maybe((D, G, P), weight_grad),
        maybe((D, G), weight_grad and has_bias),
        maybe((D, P, H), weight_grad and w_hr is not None),
    )


# Op name -> fake implementation
FAKES: dict[str, Callable] = {
    "lstm_cell": cell_fake,
    "lstm_cell_backward": cell_backward_fake,
    "lstm_layer": layer_fake,
    "lstm_layer_backward": layer_backward_fake,
}


def autograd_formulas(
    op: Callable[[str], Callable], reference: ModuleType
) -> dict[str, tuple[Callable, Callable]]:
    """Op name -> (backward, setup_context) for one backend's lstm_cell and lstm_layer; op(name)
    is that backend's op for a native op name ("lstm_layer_backward" -> its kernel). A
    create_graph=True backward differentiates the reference (fastattn.reference.lstm:
    lstm_cell, lstm_layer) instead."""

    def cell_setup(ctx, inputs, output):
        input, hx, cx, w_ih, w_hh, b_ih, b_hh = inputs
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(output[2])
        ctx.has_bias = b_ih is not None
        ctx.save_for_backward(input, hx, cx, w_ih, w_hh, b_ih, b_hh, output[2])

    def cell_backward(ctx, grad_hy, grad_cy, _grad_workspace):
        if grad_hy is None and grad_cy is None:
            return (None,) * 7
        input, hx, cx, w_ih, w_hh, b_ih, b_hh, workspace = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: a backward that is differentiable
            return backward_through_reference(
                reference.lstm_cell,
                (input, hx, cx, w_ih, w_hh, b_ih, b_hh),
                ctx.needs_input_grad,
                (grad_hy, grad_cy),
            )
        gi, ghx, gcx, gwih, gwhh, gb = op("lstm_cell_backward")(
            grad_hy, grad_cy, input, hx, cx, w_ih, w_hh, workspace, ctx.has_bias
        )
        needs = ctx.needs_input_grad
        return (
            gi if needs[0] else None,
            ghx if needs[1] else None,
            gcx if needs[2] else None,
            gwih if needs[3] else None,
            gwhh if needs[4] else None,
            gb if ctx.has_bias and needs[5] else None,
            gb.clone() if ctx.has_bias and needs[6] else None,
        )

    def layer_setup(ctx, inputs, output):
        (input, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr, lengths, dropout_p, seed, save_workspace) = (
            inputs
        )
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(output[3])
        ctx.meta = (dropout_p, b_ih is not None, w_hr is not None, save_workspace)
        ctx.save_for_backward(input, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr, lengths, seed, output[3])

    def layer_backward(ctx, grad_output, grad_h_n, grad_c_n, _grad_workspace):
        if grad_output is None and grad_h_n is None and grad_c_n is None:
            return (None,) * 12
        input, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr, lengths, seed, workspace = ctx.saved_tensors
        dropout_p, has_bias, has_proj, saved = ctx.meta
        if torch.is_grad_enabled():  # create_graph=True: a backward that is differentiable
            args = (input, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr, lengths, dropout_p, seed)
            return backward_through_reference(
                reference.lstm_layer, args, ctx.needs_input_grad, (grad_output, grad_h_n, grad_c_n)
            ) + (None,)
        if not saved:
            raise RuntimeError(
                "fastattn::lstm_layer was called with save_workspace=False, so "
                "it cannot be differentiated: pass save_workspace=True"
            )
        needs = ctx.needs_input_grad
        weight_grad = any(needs[3:8])
        gi, gh0, gc0, gwih, gwhh, gb, gwhr = op("lstm_layer_backward")(
            grad_output,
            grad_h_n,
            grad_c_n,
            input,
            h0,
            c0,
            w_ih,
            w_hh,
            w_hr,
            lengths,
            workspace,
            dropout_p,
            seed,
            has_bias,
            needs[0],
            weight_grad,
        )
        return (
            gi if needs[0] else None,
            gh0 if needs[1] else None,
            gc0 if needs[2] else None,
            gwih if needs[3] else None,
            gwhh if needs[4] else None,
            gb if has_bias and needs[5] else None,
            gb.clone() if has_bias and needs[6] else None,
            gwhr if has_proj and needs[7] else None,
            None,
            None,
            None,
            None,
        )

    return {"lstm_cell": (cell_backward, cell_setup), "lstm_layer": (layer_backward, layer_setup)}
