"""Contract of the fused additive-attention scores: the ops fastattn::additive_scores /
additive_scores_backward and their Triton twins (suffix _triton):

    additive_scores(qp (B, Lq, A), kp (B, Lk, A), v (A,))
        -> scores (B, Lq, Lk) = sum_a v[a] tanh(qp[b, i, a] + kp[b, j, a]), float32 (float64
           for float64 inputs), contiguous
    additive_scores_backward(grad (B, Lq, Lk) contiguous, qp, kp, v)
        -> (grad_qp, grad_kp, grad_v), contiguous, in the inputs' dtype

and of the fused masked softmax and weighted sum that follow them (cpu only: the other
backends run fastattn.reference.additive_attention.additive_context, plain torch ops):

    additive_context(scores (B, Lq, Lk) compute type, values (B, Lk, Dv), key_padding_mask
                     (B, Lk) bool or None)
        -> (context (B, Lq, Dv) in values' dtype, weights (B, Lq, Lk) in the scores' dtype),
           contiguous; a query whose keys are all masked gets zero weights and context
    additive_context_backward(grad_context (B, Lq, Dv), grad_weights (B, Lq, Lk) or None,
                              weights, values)
        -> (grad_scores like weights, grad_values like values), contiguous
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import backward_through_reference, compute_dtype


def scores_fake(qp, kp, v):
    """The scores as every backend's additive_scores returns them."""
    return qp.new_empty((qp.shape[0], qp.shape[1], kp.shape[1]), dtype=compute_dtype(qp.dtype))


def scores_backward_fake(grad, qp, kp, v):
    """(grad_qp, grad_kp, grad_v), contiguous (the kernels allocate at::empty(qp.sizes()))."""
    return qp.new_empty(qp.shape), kp.new_empty(kp.shape), v.new_empty(v.shape)


def autograd_formula(backward_op: Callable, reference: Callable):
    """(backward, setup_context) for an additive_scores op whose kernel backward is
    `backward_op`; a create_graph=True backward differentiates `reference`
    (fastattn.reference.additive_attention.additive_scores) instead."""

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def backward(ctx, grad):
        qp, kp, v = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: a backward that is differentiable
            return backward_through_reference(reference, (qp, kp, v), ctx.needs_input_grad, (grad,))
        return backward_op(grad.contiguous(), qp, kp, v)

    return backward, setup_context


def context_fake(scores, values, key_padding_mask):
    """(context, weights) as the cpu kernel returns them."""
    B, Lq, _ = scores.shape
    return values.new_empty((B, Lq, values.shape[2])), scores.new_empty(scores.shape)


def context_backward_fake(grad_context, grad_weights, weights, values):
    """(grad_scores, grad_values), contiguous."""
    return weights.new_empty(weights.shape), values.new_empty(values.shape)


def context_autograd_formula(backward_op: Callable, reference: Callable):
    """(backward, setup_context) of additive_context with the kernel backward `backward_op`;
    a create_graph=True backward differentiates `reference`
    (fastattn.reference.additive_attention.additive_context) instead."""

    def setup_context(ctx, inputs, output):
        scores, values, key_padding_mask = inputs
        ctx.save_for_backward(scores, values, key_padding_mask, output[1])

    def backward(ctx, grad_context, grad_weights):
        scores, values, key_padding_mask, weights = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: a backward that is differentiable
            return backward_through_reference(
                reference,
                (scores, values, key_padding_mask),
                ctx.needs_input_grad,
                (grad_context, grad_weights),
            )
        if grad_context is None:
            grad_context = values.new_zeros((*weights.shape[:2], values.shape[2]))
        grad_scores, grad_values = backward_op(grad_context, grad_weights, weights, values)
        return grad_scores, grad_values, None

    return backward, setup_context
