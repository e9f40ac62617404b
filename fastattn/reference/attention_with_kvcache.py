"""Plain-PyTorch attention over a KV cache (the "reference" backend of attention_decode):
sequence b's queries sit at positions q_positions[b] + i and see keys [0, k_lengths[b]).

Paged caches (block_table int32 (B, max_blocks_per_seq), pools (num_blocks, Hkv, block_size,
D/Dv)): position p of sequence b is row p % block_size of block block_table[b, p // block_size].
The reference gathers each sequence's blocks into a dense cache (the kernels read through the
table instead)."""

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
    block_table=None,
):
    """q (B, Hq, Lq, D), caches (B, Hkv, Lmax, D/Dv) -> out (B, Hq, Lq, Dv), lse (B, Hq, Lq).
    sinks: None or float (Hq,) attention sinks (reference.attention's).
    block_table: None, or int32 (B, max_blocks_per_seq) with pools for caches (paged)."""
    if block_table is not None:
        k_cache, v_cache = gather_paged(k_cache, block_table), gather_paged(v_cache, block_table)
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


def gather_paged(pool: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """The dense cache (B, Hkv, max_blocks_per_seq * block_size, W) of a pool
    (num_blocks, Hkv, block_size, W) read through block_table (B, max_blocks_per_seq). Entries
    outside the pool (unused table slots) read block 0: the caller never looks at them."""
    num_blocks, H, bs, W = pool.shape
    B, nb = block_table.shape
    index = block_table.long().clamp(0, max(num_blocks - 1, 0))
    blocks = pool[index.reshape(-1)].view(B, nb, H, bs, W)
    return blocks.permute(0, 2, 1, 3, 4).reshape(B, H, nb * bs, W)


def append_paged(k_pool, v_pool, block_table, cache_seqlens, k_new, v_new) -> None:
    """Writes k_new/v_new (B, Hkv, Lnew, D/Dv) at positions cache_seqlens[b] + l of the paged
    pools (in place): row p % block_size of block block_table[b, p // block_size]."""
    B, H, Lnew, _ = k_new.shape
    bs = k_pool.shape[2]
    pos = cache_seqlens.to(torch.int64).view(B, 1) + torch.arange(Lnew, device=k_new.device)
    blocks = block_table.long().gather(1, pos // bs)  # (B, Lnew)
    rows = pos % bs
    for pool, new in ((k_pool, k_new), (v_pool, v_new)):
        # pool[blocks[b, l], h, rows[b, l]] = new[b, h, l]
        heads = torch.arange(H, device=new.device).view(1, H, 1)
        pool[blocks.view(B, 1, Lnew), heads, rows.view(B, 1, Lnew)] = new
