"""Plain-PyTorch additive (Bahdanau) attention, the "reference" backend. It materialises the
(B, Lq, Lk, A) tensor of tanh arguments that the fused kernels avoid."""

from __future__ import annotations

import torch

from ..contracts import compute_dtype


def additive_scores(qp: torch.Tensor, kp: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """S[b, i, j] = sum_a v[a] tanh(qp[b, i, a] + kp[b, j, a]) in the compute type.

    qp (B, Lq, A), kp (B, Lk, A), v (A,) -> (B, Lq, Lk) float32 (float64 for float64).
    """
    acc = compute_dtype(qp.dtype)
    t = torch.tanh(qp.to(acc).unsqueeze(2) + kp.to(acc).unsqueeze(1))
    return torch.matmul(t, v.to(acc))


def additive_context(
    scores: torch.Tensor, values: torch.Tensor, key_padding_mask: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The masked softmax of additive scores and the weighted sum of values.

    scores (B, Lq, Lk) in the compute type, values (B, Lk, Dv), key_padding_mask (B, Lk) bool
    (True = ignore that key) or None -> (context (B, Lq, Dv) in values' dtype, weights
    (B, Lq, Lk) in the scores' dtype). A query whose keys are all masked gets zero weights and
    a zero context.
    """
    B = scores.shape[0]
    if key_padding_mask is not None:
        # Masked keys get -inf in rows that keep a key; a row whose keys are all masked keeps
        # its finite scores (a softmax of -inf only would be NaN, in its gradient too) and gets
        # zero weights after the softmax.
        row_empty = key_padding_mask.all(dim=1).view(B, 1, 1)
        hidden = key_padding_mask.unsqueeze(1).logical_and(row_empty.logical_not())
        weights = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
        weights = weights.masked_fill(row_empty, 0.0)
    else:
        weights = torch.softmax(scores, dim=-1)
    return torch.matmul(weights.to(values.dtype), values), weights
