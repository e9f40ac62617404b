"""Plain-PyTorch definition of softmax attention (the "reference" backend).

Canonical arguments, as fastattn/ops/attention.py builds them for every backend:
  q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv); Hq % Hkv == 0 (GQA/MQA)
  attn_mask     None, or a 4-D bool / float tensor broadcasting to (B, Hq, Lq, Lk) (each dim
                1 or full, any strides)
  key_padding_mask None or bool (B, Lk), True = ignore that key
  alibi_slopes  None or float32 (B, Hq) (expanded)
  scale, softcap (0 = off), dropout_p, seed (int64 (2,) when dropout_p > 0)
  window_lo, window_hi: key j is visible to query i iff i + window_lo <= j <= i + window_hi
      (causal alignment and sliding windows are folded into these two numbers; +-2**30 means
      unbounded)
Score pipeline: s = scale * q.k; softcap * tanh(s / softcap); - slope * |i + Lk - Lq - j|;
+ float mask; then bool mask, key padding and the window set s = -inf. Rows with no visible
key give out 0 and lse -inf. Dropout drops probabilities (element ((b*Hq + h)*Lq + i)*Lk + j of
fastattn's Philox stream) and scales the kept ones by 1/(1-p); lse is that of the undropped
scores. Everything is computed in float32 (float64 for float64 inputs) and materialises the
(Lq, Lk) scores: this is the definition, not a fast path.
"""

from __future__ import annotations

import torch

from ..contracts import compute_dtype
from ..contracts.attention import lse_dtype
from .random import dropout_keep_mask


def scores(
    q: torch.Tensor,
    k: torch.Tensor,
    attn_mask,
    key_padding_mask,
    alibi_slopes,
    scale: float,
    softcap: float,
    window_lo: int,
    window_hi: int,
) -> torch.Tensor:
    """Masked scores (B, Hq, Lq, Lk) in the compute type, -inf where a key is not visible."""
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    acc = compute_dtype(q.dtype)
    kk = k.to(acc).repeat_interleave(Hq // Hkv, dim=1)
    s = torch.matmul(q.to(acc), kk.transpose(-1, -2)) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(Lq, device=q.device).view(Lq, 1)
    j = torch.arange(Lk, device=q.device).view(1, Lk)
    if alibi_slopes is not None:
        distance = (i + (Lk - Lq) - j).abs().to(acc)
        s = s - alibi_slopes.to(acc).view(B, Hq, 1, 1) * distance
    visible = (j >= i + window_lo) & (j <= i + window_hi)
    visible = visible.view(1, 1, Lq, Lk)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            visible = visible & attn_mask
        else:
            s = s + attn_mask.to(acc)
    if key_padding_mask is not None:
        visible = visible & ~key_padding_mask.view(B, 1, 1, Lk)
    return s.masked_fill(~visible, float("-inf"))


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask,
    key_padding_mask,
    alibi_slopes,
    scale: float,
    softcap: float,
    window_lo: int,
    window_hi: int,
    dropout_p: float,
    seed,
    keep: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, Hq, Lq, Dv) in q's dtype, lse (B, Hq, Lq) float32, float64 for float64 inputs).
    Differentiable by autograd in every tensor argument, the float attn_mask included.
    keep: an explicit dropout keep-mask (B, Hq, Lq, Lk) for layouts that number the Philox
    stream differently (varlen); by default element ((b*Hq + h)*Lq + i)*Lk + j.
    sinks: None or float (Hq,): attention sinks, one extra logit per head in every row's
    softmax denominator with no value (GPT-OSS): p_j = exp(s_j) / (sum_j exp(s_j) + exp(sink));
    lse includes it, so a row with no visible key has lse = sink and output 0."""
    B, Hq, Lq, _ = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    acc = compute_dtype(q.dtype)
    s = scores(
        q, k, attn_mask, key_padding_mask, alibi_slopes, scale, softcap, window_lo, window_hi
    )
    # The sink is one more column of the softmax, with no value (it only joins the lse).
    s_all = s
    if sinks is not None:
        sink = sinks.to(acc).view(1, Hq, 1, 1).expand(B, Hq, Lq, 1)
        s_all = torch.cat([s, sink], dim=-1)
    # Rows with no visible key (every score -inf, also through a float mask of -inf): their
    # lse is -inf, and logsumexp's own backward would give them NaN (exp(-inf - -inf)), so it
    # runs on zeros there, whose gradient does not reach s.
    if s_all.shape[-1] > 0:
        empty = torch.isneginf(s_all.amax(dim=-1))
    else:  # no keys at all
        empty = torch.ones(s.shape[:-1], dtype=torch.bool, device=s.device)
    lse = torch.logsumexp(s_all.masked_fill(empty.unsqueeze(-1), 0.0), dim=-1)
    lse = lse.masked_fill(empty, float("-inf"))
    # exp(s - lse) with fully masked rows (lse = -inf) giving 0 instead of NaN.
    safe_lse = torch.where(empty, torch.zeros_like(lse), lse)
    p = torch.exp(s - safe_lse.unsqueeze(-1))
    if dropout_p > 0.0:
        if keep is None:
            keep = dropout_keep_mask(seed, (B, Hq, Lq, Lk), dropout_p, q.device)
        p = p * keep * (1.0 / (1.0 - dropout_p))
    vv = v.to(acc).repeat_interleave(Hq // Hkv, dim=1)
    out = torch.matmul(p, vv)
    return out.to(q.dtype), lse.to(lse_dtype(q.dtype))


def attention_backward(
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
    scale: float,
    softcap: float,
    window_lo: int,
    window_hi: int,
    dropout_p: float,
    seed,
    keep: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashAttention's backward from the saved (out, lse), which may be those of a longer row
    merged over other key blocks: P = exp(s - lse), dV = (P o keep)^T dO,
    dS = P o (dP o keep - (rowsum(dO o out) - dlse)), dQ/dK through the scores' own autograd
    (softcap, scale). keep: an explicit dropout keep-mask (B, Hq, Lq, Lk), as `attention`'s.
    Returns (dq, dk, dv) in the inputs' dtypes; dk/dv summed over GQA groups."""
    B, Hq, Lq, _ = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    acc = compute_dtype(q.dtype)
    with torch.enable_grad():
        qq = q.detach().requires_grad_(True)
        kk = k.detach().requires_grad_(True)
        s = scores(
            qq, kk, attn_mask, key_padding_mask, alibi_slopes, scale, softcap, window_lo, window_hi
        )
    lse = lse.to(acc)
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse).unsqueeze(-1)
    p = torch.exp(s.detach() - safe).masked_fill(torch.isneginf(lse).unsqueeze(-1), 0.0)
    do = grad_out.to(acc)
    vv = v.to(acc).repeat_interleave(Hq // Hkv, dim=1)
    dp = torch.matmul(do, vv.transpose(-1, -2))
    pd = p
    if dropout_p > 0.0:
        if keep is None:
            keep = dropout_keep_mask(seed, (B, Hq, Lq, Lk), dropout_p, q.device)
        scaled = keep.to(acc) * (1.0 / (1.0 - dropout_p))
        pd = p * scaled
        dp = dp * scaled
    dv = torch.matmul(pd.transpose(-1, -2), do)
    dv = dv.view(B, Hkv, Hq // Hkv, Lk, -1).sum(2)
    delta = (do * out.to(acc)).sum(-1)
    if grad_lse is not None:
        delta = delta - grad_lse.to(acc)
    ds = p * (dp - delta.unsqueeze(-1))
    dq, dk = torch.autograd.grad(s, (qq, kk), ds)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def merge_attention(outs, lses) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attentions of the same queries over disjoint key sets.

    outs: sequence of (..., Lq, Dv); lses: sequence of (..., Lq) natural-log sum-exp of each
    part's scores. Returns (out in outs[0]'s dtype, lse float32 (float64 for float64)); all
    -inf parts give 0, -inf.
    """
    acc = torch.float64 if outs[0].dtype == torch.float64 else torch.float32
    lse_stack = torch.stack([l.to(acc) for l in lses])
    lse = torch.logsumexp(lse_stack, dim=0)
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    weights = torch.exp(lse_stack - safe)  # 0 for -inf parts
    out = sum(w.unsqueeze(-1) * o.to(acc) for w, o in zip(weights.unbind(0), outs))
    return out.to(outs[0].dtype), lse.to(lse_dtype(outs[0].dtype))
