"""Contract of packed variable-length attention: the ops fastattn::varlen_attention_forward /
varlen_attention_backward and their Triton twins (suffix _triton):

    varlen_attention_forward(q (total_q, Hq, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv),
        cu_seqlens_q, cu_seqlens_k int32 (B+1,), max_seqlen_q, max_seqlen_k, alibi_slopes?
        float32 (B, Hq), scale, softcap, causal_mode (0 none, 1 top-left, 2 bottom-right),
        window_left, window_right (-1 unbounded), dropout_p, seed?)
        -> (out (total_q, Hq, Dv) contiguous, lse (Hq, total_q))
    varlen_attention_backward(grad_out, grad_lse?, q, k, v, out, lse, <the forward's
        arguments>, deterministic) -> (dq, dk, dv), contiguous, shaped like q, k, v

Lengths and the lse dtype follow the dense attention contract (contracts/attention.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import backward_through_reference
from .attention import lse_dtype


def forward_fake(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    alibi_slopes,
    scale,
    softcap,
    causal_mode,
    window_left,
    window_right,
    dropout_p,
    seed,
):
    """(out, lse) as every backend's varlen_attention_forward returns them."""
    return (
        q.new_empty((q.shape[0], q.shape[1], v.shape[2])),
        q.new_empty((q.shape[1], q.shape[0]), dtype=lse_dtype(q.dtype)),
    )


def backward_fake(
    grad_out,
    grad_lse,
    q,
    k,
    v,
    out,
    lse,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    alibi_slopes,
    scale,
    softcap,
    causal_mode,
    window_left,
    window_right,
    dropout_p,
    seed,
    deterministic,
):
    """(dq, dk, dv), contiguous whatever the strides of q, k, v."""
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def autograd_formula(backward_op: Callable, reference: Callable):
    """(backward, setup_context) for a varlen_attention_forward op whose kernel backward is
    `backward_op`; a create_graph=True backward differentiates `reference`
    (fastattn.reference.varlen_attention.varlen_attention) instead."""

    def setup_context(ctx, inputs, output):
        (q, k, v, cu_q, cu_k, max_q, max_k, alibi, scale, softcap, mode, left, right, p, seed) = (
            inputs
        )
        out, lse = output
        ctx.set_materialize_grads(False)
        ctx.meta = (max_q, max_k, scale, softcap, mode, left, right, p)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, alibi, seed)

    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, cu_q, cu_k, alibi, seed = ctx.saved_tensors
        max_q, max_k, scale, softcap, mode, left, right, p = ctx.meta
        if grad_out is None and grad_lse is None:
            return (None,) * 15
        if torch.is_grad_enabled():  # create_graph=True: a backward that is differentiable
            args = (
                q,
                k,
                v,
                cu_q,
                cu_k,
                max_q,
                max_k,
                alibi,
                scale,
                softcap,
                mode,
                left,
                right,
                p,
                seed,
            )
            return backward_through_reference(
                reference, args, ctx.needs_input_grad, (grad_out, grad_lse)
            )
        if grad_out is None or grad_out.numel() == 0:
            # An empty expanded gradient (out.sum() with total_q = 0) keeps stride 0, which
            # .contiguous() does not change and the kernels refuse.
            grad_out = torch.zeros_like(out)
        elif grad_out.stride(-1) != 1:
            grad_out = grad_out.contiguous()
        dq, dk, dv = backward_op(
            grad_out,
            grad_lse,
            q,
            k,
            v,
            out,
            lse,
            cu_q,
            cu_k,
            max_q,
            max_k,
            alibi,
            scale,
            softcap,
            mode,
            left,
            right,
            p,
            seed,
            True,
        )
        return (dq, dk, dv) + (None,) * 12

    return backward, setup_context
