"""attention_with_kvcache on the torch backend: the rotation and the append with torch ops, the
attention with torch's scaled_dot_product_attention (SDPA) over each sequence's cache.

What fastattn defines (fastattn/reference/attention_with_kvcache.py) maps onto SDPA so:
- sequence b's keys are its cache's first cache_seqlens[b] + Lnew rows; its query i sits at
  position cache_seqlens[b] + i. Which keys a query sees (the valid length, the causal limit
  j <= position, a window around the position) is one bool mask (B, 1, Lq, Lk) built from
  cache_seqlens on the device (no host read; see the CPU decoding step below), broadcast over
  the heads;
- ALiBi (float32 and float64 inputs) is a float mask -slope * |position - j| in the input's
  dtype with -inf where hidden: SDPA adds a float mask to the scaled scores, as fastattn adds
  the bias;
- GQA / MQA is SDPA's enable_gqa; the scale is SDPA's scale;
- a paged cache is gathered through its block table into a dense copy first;
- on CPU, one decoding query per sequence that sees its whole prefix (the common decoding step)
  skips all of that: SDPA reads views of each sequence's first cache_seqlens[b] + Lnew rows,
  unmasked (rows past them are never read, so no zeroing either).
Two post-processing steps keep fastattn's definition on every SDPA kernel: the cache rows past
a sequence's length are zeroed in the copy SDPA reads (they may hold anything, NaN included,
and a masked key still enters SDPA's products, where 0 * NaN = NaN), and rows with no visible
key are set to 0 after SDPA (fastattn's definition; SDPA's CPU kernels already give 0, its CUDA
kernels are not relied on for it).

The op layer (fastattn/ops/attention_with_kvcache.py) refuses what SDPA cannot compute as
fastattn defines it: softcap (SDPA has no score capping), attention sinks (SDPA returns no
log-sum-exp to fold them into), and ALiBi with float16/bfloat16 inputs (SDPA's CUDA kernels
take a float mask only in q's dtype, where the bias would be rounded to 16 bits; fastattn adds
it in float32). num_splits is a schedule of fastattn's split-K kernels and changes no result:
SDPA picks its own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..contracts import compute_dtype
from . import positional


def _append(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    block_table: torch.Tensor | None,
) -> None:
    """Writes k_new/v_new (B, Hkv, Lnew, D/Dv) at positions[b] + l of the caches (in place):
    dense caches (B, Hkv, Lmax, D/Dv), or pools (num_blocks, Hkv, block_size, D/Dv) read
    through block_table (B, max_blocks_per_seq)."""
    B, Hkv, Lnew, _ = k_new.shape
    at = positions.view(B, 1) + torch.arange(Lnew, device=positions.device)  # (B, Lnew)
    if block_table is None:
        for cache, new in ((k_cache, k_new), (v_cache, v_new)):
            index = at.view(B, 1, Lnew, 1).expand(B, Hkv, Lnew, new.shape[3])
            cache.scatter_(2, index, new)
        return
    block_size = k_cache.shape[2]
    blocks = block_table.gather(1, at // block_size).to(torch.int64).view(B, 1, Lnew)
    rows = (at % block_size).view(B, 1, Lnew)
    heads = torch.arange(Hkv, device=positions.device).view(1, Hkv, 1)
    for pool, new in ((k_cache, k_new), (v_cache, v_new)):
        pool[blocks, heads, rows] = new  # pool[blocks[b, l], h, rows[b, l]] = new[b, h, l]


def _keys(
    cache: torch.Tensor,
    block_table: torch.Tensor | None,
    key_bound: int,
    valid: torch.Tensor,
) -> torch.Tensor:
    """The first Lk >= key_bound rows of every sequence's cache, (B, Hkv, Lk, W), as a new
    tensor with the rows where valid (B, 1, Lk, 1) is false set to 0."""
    if block_table is None:
        return torch.where(valid, cache[:, :, :key_bound], 0)
    num_blocks, H, block_size, W = cache.shape
    B = block_table.shape[0]
    used = -(-key_bound // block_size)  # the blocks holding rows below key_bound
    # Unused table entries may hold anything: they read block 0, whose rows are zeroed below.
    index = block_table[:, :used].to(torch.int64).clamp(0, max(num_blocks - 1, 0))
    gathered = cache[index.reshape(-1)].view(B, used, H, block_size, W)
    dense = gathered.permute(0, 2, 1, 3, 4).reshape(B, H, used * block_size, W)
    return dense[:, :, : valid.shape[2]].masked_fill_(~valid, 0)


def _host_values(cache_seqlens: torch.Tensor) -> list[int] | None:
    """cache_seqlens as a list where reading it costs no synchronisation (a CPU tensor, outside
    torch.compile, where a read would break the graph); None elsewhere."""
    if cache_seqlens.device.type != "cpu" or torch.compiler.is_compiling():
        return None
    return cache_seqlens.tolist()


def _sees_whole_prefix(
    q: torch.Tensor,
    block_table: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    causal: bool,
    window_left: int,
    window_right: int,
    Lnew: int,
) -> bool:
    """Whether a call is one decoding query per sequence that sees its whole cache prefix (no
    window, no ALiBi; causal hides nothing when at most one token is appended) on a dense
    cache: SDPA then runs on views of each prefix with no mask and no copy of the cache."""
    return (
        q.shape[2] == 1
        and block_table is None
        and alibi_slopes is None
        and (not causal or Lnew <= 1)
        and window_left < 0
        and window_right < 0
    )


def _attend_prefixes(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lengths: list[int],
    scale: float,
) -> torch.Tensor:
    """out (B, Hq, 1, Dv): sequence b's query over the first lengths[b] cache rows (0 where
    that is none). Equal lengths take one SDPA call, others one call per run of equal ones."""
    B, Hq = q.shape[:2]
    gqa = Hq != k_cache.shape[1]
    n = lengths[0]
    if n > 0 and min(lengths) == max(lengths):
        return F.scaled_dot_product_attention(
            q, k_cache[:, :, :n], v_cache[:, :, :n], scale=scale, enable_gqa=gqa
        )
    out = q.new_zeros((B, Hq, 1, v_cache.shape[3]))
    b = 0
    while b < B:
        end = b + 1
        while end < B and lengths[end] == lengths[b]:
            end += 1
        n = lengths[b]
        if n > 0:
            out[b:end] = F.scaled_dot_product_attention(
                q[b:end], k_cache[b:end, :, :n], v_cache[b:end, :, :n], scale=scale, enable_gqa=gqa
            )
        b = end
    return out


def attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    k_new: torch.Tensor | None,
    v_new: torch.Tensor | None,
    rotary_cos: torch.Tensor | None,
    rotary_sin: torch.Tensor | None,
    rotary_interleaved: bool,
    alibi_slopes: torch.Tensor | None,
    scale: float,
    causal: bool,
    window_left: int,
    window_right: int,
    block_table: torch.Tensor | None,
    key_bound: int,
) -> torch.Tensor:
    """Rotate q and k_new, append k_new/v_new to the caches (in place), attend: out (B, Hq, Lq,
    Dv) in q's dtype and layout (fastattn.attention_with_kvcache's arguments, checked by the op
    layer).

    cache_seqlens: int32 (B,). rotary_cos/sin: (rows, rotary_dim / 2) or None.
    alibi_slopes: float32 (B, Hq) or None (float32 and float64 inputs only).
    causal: query i of sequence b sees keys j <= cache_seqlens[b] + i. window_left/right: keys
        within that many positions before/after the query (-1: unbounded).
    key_bound: no sequence has more keys than this (cache_seqlens[b] + Lnew <= key_bound; the
        cache's capacity, or less when the op layer read cache_seqlens on the host), so SDPA
        reads only the first key_bound rows.
    """
    B, Hq, Lq, D = q.shape
    Hkv, Dv = k_cache.shape[1], v_cache.shape[3]
    Lnew = 0 if k_new is None else k_new.shape[2]
    heads_inner = q.stride(1) < q.stride(2)  # q is a (B, Lq, Hq, D) tensor transposed
    positions = cache_seqlens.to(torch.int64)
    # On CPU (outside torch.compile) the lengths are host values, free to read: when they are
    # all equal (a batch decoding in step), the rotation and the append use plain slices.
    host_lengths = _host_values(cache_seqlens)
    same = host_lengths[0] if host_lengths and min(host_lengths) == max(host_lengths) else None
    if rotary_cos is not None:
        assert rotary_sin is not None, "rotary_cos and rotary_sin are given together"
        acc = compute_dtype(q.dtype)
        cos, sin = rotary_cos.to(acc), rotary_sin.to(acc)
        where = (0, positions) if same is None else (same, None)
        rotary = (cos, sin, *where, None, 2 * cos.shape[1], 0.0, bool(rotary_interleaved))
        q = positional.apply_rotary(q, *rotary)
        if k_new is not None:
            k_new = positional.apply_rotary(k_new, *rotary)
    if Lnew > 0:
        assert k_new is not None and v_new is not None
        if same is not None and block_table is None:
            k_cache[:, :, same : same + Lnew] = k_new
            v_cache[:, :, same : same + Lnew] = v_new
        else:
            _append(k_cache, v_cache, positions, k_new, v_new, block_table)

    Lk = key_bound
    if B == 0 or Lq == 0 or Lk == 0:  # nothing to attend to: every row is empty
        out = q.new_zeros((B, Lq, Hq, Dv) if heads_inner else (B, Hq, Lq, Dv), dtype=q.dtype)
        return out.transpose(1, 2) if heads_inner else out

    device = q.device
    if host_lengths and _sees_whole_prefix(
        q, block_table, alibi_slopes, causal, window_left, window_right, Lnew
    ):
        out = _attend_prefixes(q, k_cache, v_cache, [n + Lnew for n in host_lengths], scale)
        return out.transpose(1, 2).contiguous().transpose(1, 2) if heads_inner else out
    key_lengths = (positions + Lnew).view(B, 1, 1)
    j = torch.arange(Lk, device=device).view(1, 1, Lk)
    query_positions = positions.view(B, 1, 1) + torch.arange(Lq, device=device).view(1, Lq, 1)
    visible = (j < key_lengths).expand(B, Lq, Lk)
    if causal:
        visible = visible & (j <= query_positions)
    if window_left >= 0:
        visible = visible & (j >= query_positions - window_left)
    if window_right >= 0:
        visible = visible & (j <= query_positions + window_right)
    valid_keys = (j < key_lengths).view(B, 1, Lk, 1)
    keys = _keys(k_cache, block_table, Lk, valid_keys)
    values = _keys(v_cache, block_table, Lk, valid_keys)

    mask = visible.unsqueeze(1)  # (B, 1, Lq, Lk): one mask for every head
    if alibi_slopes is not None:
        distance = (query_positions - j).abs().to(q.dtype).unsqueeze(1)  # (B, 1, Lq, Lk)
        bias = -alibi_slopes.to(q.dtype).view(B, Hq, 1, 1) * distance
        mask = bias.masked_fill(~mask, float("-inf"))
    out = F.scaled_dot_product_attention(
        q, keys, values, attn_mask=mask, scale=scale, enable_gqa=Hq != Hkv
    )
    # fastattn's rows with no visible key are 0, whatever the SDPA kernel gave them.
    out = out.masked_fill(~visible.any(-1).view(B, 1, Lq, 1), 0.0)
    if heads_inner:
        return out.transpose(1, 2).contiguous().transpose(1, 2)
    return out.contiguous()
