"""Contract of softmax attention: the ops fastattn::attention_forward / attention_backward and
their Triton twins (suffix _triton), with the canonical arguments of
fastattn/reference/attention.py:

    attention_forward(q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv), attn_mask?,
                      key_padding_mask?, alibi_slopes?, scale, softcap, window_lo, window_hi,
                      dropout_p, seed?) -> (out (B, Hq, Lq, Dv) in q's layout, lse (B, Hq, Lq))
    attention_backward(grad_out, grad_lse?, q, k, v, out, lse, <the forward's arguments>,
                       deterministic, mask_grad=False) -> (dq, dk, dv, d attn_mask):
        dq, dk, dv contiguous, shaped like q, k, v; d attn_mask (mask_grad with a float mask)
        contiguous, shaped like attn_mask and in its dtype: dS (the gradient of the biased
        scores) summed over the mask's broadcast dims; an empty tensor without mask_grad

attn_mask is 4-D and broadcasts to (B, Hq, Lq, Lk) (each dim 1 or full): it is passed with its
broadcast dims of size 1, so that its gradient has the bias's own shape.

The rules every backend shares (csrc/attention/attention.h states the same for the native
kernels): head dims up to MAX_HEAD_DIM, sequences shorter than 2**30, lse in float32 (float64
for float64 inputs), and the output layout of `output_like`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from . import backward_through_reference, compute_dtype

MAX_HEAD_DIM = 256
WINDOW_UNBOUNDED = 1 << 30
# Longest query or key sequence of every backend: with +-WINDOW_UNBOUNDED as "unbounded", a
# longer one would hide keys, and the CUDA and Triton kernels add window bounds to int32
# indices. (csrc/attention/attention.h: kMaxSeqLen, the same rule.)
MAX_SEQLEN = WINDOW_UNBOUNDED - 1


_T = torch.Tensor
# attention_backward's arguments up to `deterministic` (AttentionArgs.backward_inputs).
BackwardInputs = tuple[
    _T, _T | None, _T, _T, _T, _T, _T, _T | None, _T | None, _T | None, float, float, int, int,
    float, _T | None,
]  # fmt: skip


class AttentionArgs(NamedTuple):
    """The canonical arguments of one attention call, in the order of attention_forward's
    schema (the module docstring): what the op layer (fastattn/ops/attention.py) builds from a
    public call and hands to a backend. A tuple, so `op(*args)` calls a forward op or the
    reference; `backward_inputs` orders them for attention_backward."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    attn_mask: torch.Tensor | None
    key_padding_mask: torch.Tensor | None
    alibi_slopes: torch.Tensor | None
    scale: float
    softcap: float
    window_lo: int
    window_hi: int
    dropout_p: float
    seed: torch.Tensor | None

    def backward_inputs(
        self,
        grad_out: torch.Tensor,
        grad_lse: torch.Tensor | None,
        out: torch.Tensor,
        lse: torch.Tensor,
    ) -> BackwardInputs:
        """(grad_out, grad_lse, q, k, v, out, lse, attn_mask, ..., seed): attention_backward's
        arguments up to `deterministic`."""
        return (grad_out, grad_lse, self.q, self.k, self.v, out, lse, *self[3:])


def check_seqlen(op: str, name: str, length: int) -> None:
    """Refuses a sequence length of MAX_SEQLEN + 1 = 2**30 or more, naming the argument."""
    if length > MAX_SEQLEN:
        raise ValueError(
            f"{op}: {name} must be < 2**30 = {MAX_SEQLEN + 1} (the band's unbounded "
            f"bound and the GPU kernels' int32 indices), got {length}"
        )


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    """lse is float32, or float64 for float64 inputs (so gradcheck can see through it)."""
    return compute_dtype(dtype)


def output_like(q: torch.Tensor, Dv: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The attention output buffer (B, Hq, Lq, Dv). It follows q's layout: when q's heads are
    inner to its sequence (q is a (B, L, H, D) tensor transposed), out is (B, Lq, Hq, Dv) in
    memory, so out.transpose(1, 2).reshape(B, Lq, Hq * Dv) is free (nn.MultiheadAttention).
    The native kernels apply the same rule (csrc/attention/attention.h)."""
    B, Hq, Lq, _ = q.shape
    dtype = q.dtype if dtype is None else dtype
    if q.stride(1) < q.stride(2):
        return q.new_empty((B, Lq, Hq, Dv), dtype=dtype).transpose(1, 2)
    return q.new_empty((B, Hq, Lq, Dv), dtype=dtype)


def forward_fake(
    q,
    k,
    v,
    attn_mask,
    key_padding_mask,
    alibi_slopes,
    scale,
    softcap,
    window_lo,
    window_hi,
    dropout_p,
    seed,
):
    """(out, lse) as every backend's attention_forward returns them."""
    B, Hq, Lq, _ = q.shape
    return output_like(q, v.shape[3]), q.new_empty((B, Hq, Lq), dtype=lse_dtype(q.dtype))


def backward_fake(
    grad_out,
    grad_lse,
    q,
    k,
    v,
    out,
    lse,
    attn_mask,
    key_padding_mask,
    alibi_slopes,
    scale,
    softcap,
    window_lo,
    window_hi,
    dropout_p,
    seed,
    deterministic,
    mask_grad=False,
):
    """(dq, dk, dv, d attn_mask): contiguous whatever q's strides (the kernels allocate them so;
    empty_like would keep a transposed q's strides, and Inductor asserts the fake's); d
    attn_mask shaped like the mask with mask_grad, else empty."""
    dmask = attn_mask.new_empty(attn_mask.shape) if mask_grad else q.new_empty((0,))
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dmask


def autograd_formula(backward_op: Callable, reference: Callable):
    """(backward, setup_context) for torch.library.register_autograd of an attention_forward
    op whose kernel backward is `backward_op` (the same backend's attention_backward).
    `reference` is fastattn.reference.attention.attention: a backward taken with
    create_graph=True differentiates it instead (the kernels have no double backward)."""

    def setup_context(ctx, inputs, output):
        args = AttentionArgs(*inputs)
        out, lse = output
        ctx.set_materialize_grads(False)
        ctx.meta = (args.scale, args.softcap, args.window_lo, args.window_hi, args.dropout_p)
        ctx.save_for_backward(
            args.q,
            args.k,
            args.v,
            out,
            lse,
            args.attn_mask,
            args.key_padding_mask,
            args.alibi_slopes,
            args.seed,
        )

    def backward(ctx, grad_out, grad_lse):
        q, k, v, out, lse, attn_mask, key_padding_mask, alibi_slopes, seed = ctx.saved_tensors
        scale, softcap, window_lo, window_hi, dropout_p = ctx.meta
        if grad_out is None and grad_lse is None:
            return (None,) * 12
        args = AttentionArgs(
            q,
            k,
            v,
            attn_mask,
            key_padding_mask,
            alibi_slopes,
            scale,
            softcap,
            window_lo,
            window_hi,
            dropout_p,
            seed,
        )
        if torch.is_grad_enabled():  # create_graph=True: a backward that is differentiable
            return backward_through_reference(
                reference, args, ctx.needs_input_grad, (grad_out, grad_lse)
            )
        if grad_out is None or grad_out.numel() == 0:
            grad_out = torch.zeros_like(out)  # an empty expanded grad keeps stride 0 otherwise
        elif grad_out.stride(-1) != 1:
            grad_out = grad_out.contiguous()
        if grad_lse is not None:
            grad_lse = grad_lse.contiguous()
        # A float mask that requires grad is a learned bias: the kernel sums its gradient.
        mask_grad = bool(
            ctx.needs_input_grad[3] and attn_mask is not None and attn_mask.dtype.is_floating_point
        )
        dq, dk, dv, dmask = backward_op(
            *args.backward_inputs(grad_out, grad_lse, out, lse), True, mask_grad
        )
        return (dq, dk, dv, dmask if mask_grad else None) + (None,) * 8

    return backward, setup_context
