"""`attention` on the torch backend: torch's scaled_dot_product_attention (its flash kernel on
CPU; flash, cuDNN or memory-efficient on CUDA, as SDPA picks) for the calls it computes exactly
as fastattn defines them.

fastattn's canonical arguments (fastattn/reference/attention.py) map onto SDPA so:
- the causal band of top-left alignment with nothing else masked is SDPA's is_causal;
- any other band (bottom-right alignment, a sliding window) is a (Lq, Lk) bool mask, the key
  padding a (B, 1, 1, Lk) bool mask, and a bool attn_mask is joined to them with `&`: SDPA
  reads one mask, broadcast, never expanded per head;
- a float attn_mask (a bias) takes the bool masks as -inf where hidden;
- GQA / MQA is SDPA's enable_gqa.
Refused (`unsupported` says why): dropout (SDPA draws its own mask; fastattn's is keyed by its
seed, so the two are different random draws), ALiBi slopes and softcap (SDPA has neither), a
learned bias (an attn_mask that requires grad: SDPA's fused kernels do not differentiate
it), sinks and every use of the log-sum-exp (SDPA returns none), and on CUDA every mask but
SDPA's own causal one. Rows with no visible key give 0, forward and backward, on SDPA's CPU
kernels (flash and math), as fastattn defines them (tests/test_torch_backend_attention.py);
SDPA's CUDA kernels (flash, cuDNN, memory-efficient) have not been checked on such rows on a
GPU yet, so masks that could make one stay on fastattn's kernels there.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..contracts.attention import WINDOW_UNBOUNDED, AttentionArgs


def unsupported(args: AttentionArgs, *, lse_needed: bool, sinks: bool) -> str | None:
    """Why the torch backend cannot compute this call exactly (None: it can). `args` are the
    canonical arguments (q, k, v, attn_mask, key_padding_mask, alibi_slopes, scale, softcap,
    window_lo, window_hi, dropout_p, seed)."""
    q, mask, padding, alibi = args.q, args.attn_mask, args.key_padding_mask, args.alibi_slopes
    softcap, window_lo, window_hi, p = args.softcap, args.window_lo, args.window_hi, args.dropout_p
    if p > 0.0:
        return (
            "dropout: torch's SDPA draws its own dropout mask, not fastattn's (keyed by the "
            "call's seed)"
        )
    if alibi is not None:
        return "alibi_slopes: torch's SDPA has no ALiBi"
    if softcap > 0.0:
        return "softcap: torch's SDPA has no score capping"
    if sinks:
        return "sinks: torch's SDPA has no attention sinks"
    if lse_needed:
        return "the log-sum-exp (return_lse, weights, merges): torch's SDPA returns none"
    learned = mask is not None and mask.requires_grad and torch.is_grad_enabled()
    if learned and mask is not None and mask.dtype.is_floating_point:
        return (
            "a learned bias (attn_mask that requires grad): SDPA's fused kernels do not "
            "differentiate it"
        )
    if q.device.type == "cuda":
        sdpa_band = window_lo <= -WINDOW_UNBOUNDED and window_hi in (0, WINDOW_UNBOUNDED)
        if mask is not None or padding is not None or not sdpa_band:
            return (
                "masks on CUDA (attn_mask, key_padding_mask, bottom-right causal, window): "
                "SDPA's CUDA kernels are not yet checked on rows with no visible key"
            )
    if mask is not None and mask.dtype.is_floating_point and mask.dtype != q.dtype:
        return (
            f"a {mask.dtype} bias with {q.dtype} inputs: SDPA adds the bias in the inputs' "
            "dtype, fastattn in float32"
        )
    return None


def _band_mask(Lq: int, Lk: int, lo: int, hi: int, device: torch.device) -> torch.Tensor:
    """(Lq, Lk) bool: key j visible to query i iff i + lo <= j <= i + hi."""
    offset = torch.arange(Lk, device=device)[None, :] - torch.arange(Lq, device=device)[:, None]
    return (offset >= lo) & (offset <= hi)


def attention(args: AttentionArgs) -> torch.Tensor:
    """out (B, Hq, Lq, Dv) in q's dtype for canonical `args` that `unsupported` accepts;
    differentiable by torch's autograd (SDPA's own backward)."""
    q, k, v, mask, padding = args.q, args.k, args.v, args.attn_mask, args.key_padding_mask
    scale, window_lo, window_hi = args.scale, args.window_lo, args.window_hi
    B, Hq, Lq, _ = q.shape
    Lk = k.shape[2]
    unbounded_lo = window_lo <= -WINDOW_UNBOUNDED
    unbounded_hi = window_hi >= WINDOW_UNBOUNDED
    is_causal = unbounded_lo and window_hi == 0 and mask is None and padding is None
    visible = None  # bool, broadcasting to (B, Hq, Lq, Lk)
    if not is_causal and not (unbounded_lo and unbounded_hi):
        visible = _band_mask(Lq, Lk, window_lo, window_hi, q.device)
    if padding is not None:
        keys = ~padding[:, None, None, :]
        visible = keys if visible is None else visible & keys
    attn_mask = mask
    if mask is not None and mask.dtype == torch.bool:
        attn_mask = mask if visible is None else mask & visible
    elif visible is not None:
        zero = torch.zeros((), dtype=q.dtype, device=q.device)
        hidden = torch.full((), float("-inf"), dtype=q.dtype, device=q.device)
        additive = torch.where(visible, zero, hidden)
        attn_mask = additive if mask is None else mask + additive
    return F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=attn_mask,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=k.shape[1] != Hq,
    )
