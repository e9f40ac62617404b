"""Contract of decoding with a KV cache: the ops fastattn::attention_decode (attention over the
caches), fastattn::attention_with_kvcache (rotary, append and attention in one op) and the
latter's Triton twin attention_with_kvcache_triton. Inference only: no backward.

    attention_decode(q (B, Hq, Lq, D), k_cache (B, Hkv, Lmax, D), v_cache (B, Hkv, Lmax, Dv),
        k_lengths int32 (B,), q_positions int32 (B,), alibi_slopes?, scale, softcap,
        causal_mode, window_left, window_right, num_splits, block_table?) -> (out, lse)
    attention_with_kvcache(q, k_cache!, v_cache!, cache_seqlens int32 (B,), k_new?, v_new?,
        rotary_cos?, rotary_sin?, rotary_interleaved, alibi_slopes?, scale, softcap,
        causal_mode, window_left, window_right, num_splits, block_table?) -> (out, lse)

block_table (int32 (B, max_blocks_per_seq), or None): a paged cache; k_cache/v_cache are then
pools (num_blocks, Hkv, block_size, D/Dv), block_size a multiple of 16, and position p of
sequence b is row p % block_size of block block_table[b, p // block_size] (read and written
through the table inside the kernels); max_blocks_per_seq * block_size plays Lmax's part.

out is (B, Hq, Lq, Dv) in q's layout and lse (B, Hq, Lq), as attention's
(contracts/attention.py: output_like, lse_dtype).
"""

from __future__ import annotations

from .attention import lse_dtype, output_like


def decode_fake(
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
    num_splits,
    block_table=None,
):
    """(out, lse) of attention_decode."""
    B, Hq, Lq, _ = q.shape
    return output_like(q, v_cache.shape[3]), q.new_empty((B, Hq, Lq), dtype=lse_dtype(q.dtype))


def attention_with_kvcache_fake(
    q,
    k_cache,
    v_cache,
    cache_seqlens,
    k_new,
    v_new,
    rotary_cos,
    rotary_sin,
    rotary_interleaved,
    alibi_slopes,
    scale,
    softcap,
    causal_mode,
    window_left,
    window_right,
    num_splits,
    block_table=None,
):
    """(out, lse) of attention_with_kvcache (the caches are written in place)."""
    B, Hq, Lq, _ = q.shape
    return output_like(q, v_cache.shape[3]), q.new_empty((B, Hq, Lq), dtype=lse_dtype(q.dtype))
