"""Contract of the fused additive-attention scores: the ops fastattn::additive_scores /
additive_scores_backward and their Triton twins (suffix _triton):

    additive_scores(qp (B, Lq, A), kp (B, Lk, A), v (A,))
        -> scores (B, Lq, Lk) = sum_a v[a] tanh(qp[b, i, a] + kp[b, j, a]), float32 (float64
           for float64 inputs), contiguous
    additive_scores_backward(grad (B, Lq, Lk) contiguous, qp, kp, v)
        -> (grad_qp, grad_kp, grad_v), contiguous, in the inputs' dtype
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
