"""Plain-PyTorch packed variable-length attention (the "reference" backend): every sequence
run through reference.attention on its own.

Dropout numbering for packed rows: probability (sequence b, head h, query i, key j) is
element ((cu_seqlens_q[b] + i) * Hq + h) * max_seqlen_k + j of fastattn's Philox stream.
"""

from __future__ import annotations

import torch

from ..contracts.attention import WINDOW_UNBOUNDED
from . import attention as dense
from .random import dropout_uniform


def band(
    causal_mode: int, window_left: int, window_right: int, Lq: int, Lk: int
) -> tuple[int, int]:
    """(window_lo, window_hi) of one sequence: causal_mode 0 off, 1 top-left, 2 bottom-right;
    window sides -1 = unbounded (bottom-right aligned, as attention's window)."""
    shift = Lk - Lq
    lo = shift - window_left if window_left >= 0 else -WINDOW_UNBOUNDED
    hi = shift + window_right if window_right >= 0 else WINDOW_UNBOUNDED
    if causal_mode:
        hi = min(hi, 0 if causal_mode == 1 else shift)
    return lo, hi


def varlen_attention(
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
    sinks=None,
):
    """q (total_q, Hq, D), k/v (total_k, Hkv, D/Dv) -> out (total_q, Hq, Dv), lse (Hq, total_q).
    sinks: None or float (Hq,) attention sinks (reference.attention's)."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    Hq = q.shape[1]
    outs, lses = [], []
    for b in range(len(cq) - 1):
        qb = q[cq[b] : cq[b + 1]].transpose(0, 1).unsqueeze(0)  # (1, Hq, Lq, D)
        kb = k[ck[b] : ck[b + 1]].transpose(0, 1).unsqueeze(0)
        vb = v[ck[b] : ck[b + 1]].transpose(0, 1).unsqueeze(0)
        Lq, Lk = qb.shape[2], kb.shape[2]
        lo, hi = band(causal_mode, window_left, window_right, Lq, Lk)
        alibi = None if alibi_slopes is None else alibi_slopes[b : b + 1]
        keep = None
        if dropout_p > 0.0:
            rows = (cq[b] + torch.arange(Lq, device=q.device)).view(1, Lq, 1) * Hq
            heads = torch.arange(Hq, device=q.device).view(Hq, 1, 1)
            element = (rows + heads) * max_seqlen_k + torch.arange(Lk, device=q.device)
            keep = (dropout_uniform(seed, element) >= dropout_p).unsqueeze(0)
        out, lse = dense.attention(
            qb,
            kb,
            vb,
            None,
            None,
            alibi,
            scale,
            softcap,
            lo,
            hi,
            dropout_p,
            seed,
            keep=keep,
            sinks=sinks,
        )
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    if not outs:  # B = 0 (cu_seqlens = [0]): q, k and v are empty; results stay in the graph
        out, lse = dense.attention(
            q.transpose(0, 1).unsqueeze(0),
            k.transpose(0, 1).unsqueeze(0),
            v.transpose(0, 1).unsqueeze(0),
            None,
            None,
            None,
            scale,
            softcap,
            -WINDOW_UNBOUNDED,
            WINDOW_UNBOUNDED,
            0.0,
            None,
            sinks=sinks,
        )
        return out[0].transpose(0, 1), lse[0]
    return torch.cat(outs, dim=0), torch.cat(lses, dim=1)
