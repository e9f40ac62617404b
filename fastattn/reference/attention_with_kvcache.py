"""Plain-PyTorch attention over a KV cache (the "reference" backend of attention_decode):
sequence b's queries sit at positions q_positions[b] + i and see keys [0, k_lengths[b])."""

from __future__ import annotations

import torch

from ..contracts import compute_dtype
from ..contracts.attention import WINDOW_UNBOUNDED
from . import attention as dense


def attention_decode(
    q,
    k_cache,
    v_cache,
    k_lengths,
    q_positions,
    alibi_slopes,
    scale,
    softcap,
    causal_mode,
    window_left,
    window_right,
    sinks=None,
):
    """q (B, Hq, Lq, D), caches (B, Hkv, Lmax, D/Dv) -> out (B, Hq, Lq, Dv), lse (B, Hq, Lq).
    sinks: None or float (Hq,) attention sinks (reference.attention's)."""
    outs, lses = [], []
    for b, (length, pos) in enumerate(zip(k_lengths.tolist(), q_positions.tolist())):
        lo = pos - window_left if window_left >= 0 else -WINDOW_UNBOUNDED
        hi = pos + window_right if window_right >= 0 else WINDOW_UNBOUNDED
        if causal_mode:
            hi = min(hi, 0 if causal_mode == 1 else pos)
        # ALiBi distance |i + pos - j|: reference.attention uses i + Lk - Lq - j, so shift the
        # keys' view with a per-row bias instead when positions differ from Lk - Lq.
        kb, vb = k_cache[b : b + 1, :, :length], v_cache[b : b + 1, :, :length]
        alibi = None
        if alibi_slopes is not None:
            Lq = q.shape[2]
            i = torch.arange(Lq, device=q.device).view(Lq, 1)
            j = torch.arange(length, device=q.device).view(1, length)
            dist = (i + pos - j).abs().to(compute_dtype(q.dtype))
            bias = -alibi_slopes[b].to(dist.dtype).view(-1, 1, 1) * dist
            out, lse = dense.attention(
                q[b : b + 1],
                kb,
                vb,
                bias.unsqueeze(0),
                None,
                None,
                scale,
                softcap,
                lo,
                hi,
                0.0,
                None,
                sinks=sinks,
            )
        else:
            out, lse = dense.attention(
                q[b : b + 1],
                kb,
                vb,
                None,
                None,
                alibi,
                scale,
                softcap,
                lo,
                hi,
                0.0,
                None,
                sinks=sinks,
            )
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)
