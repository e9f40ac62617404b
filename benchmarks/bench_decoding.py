"""Decoding latency per token: fastattn.attention_with_kvcache (append the new token's rotated
key/value into the cache, attend with split-K) vs torch SDPA over the cache (append with an
index copy, rotary by Hugging Face's rotate_half, then SDPA over the valid prefix), one new
token per sequence, GQA 32/8 heads (GPU) or 8/2 (CPU), head dim 128 (GPU) or 64 (CPU).
Bytes: the cache read once (keys and values) per token.

"decoding paged" rows: the same decode step over a paged cache (fastattn.PagedKVCache's
layout: pools of 16- or 64-token blocks) against the dense cache holding the same rows, both
through fastattn on the same backend; speedup = dense time / paged time, target 0.9 (the paged
cache within 10% of the dense one). Two block placements: "random" scatters each
sequence's blocks through the pool by a random permutation (a long-running server's fragmented
pool, the worst case for the memory system: no two consecutive blocks of a sequence are
neighbours), "lockstep" takes the table from fastattn.PagedKVCache after the batch's
sequences grew together one block at a time (decoding in lockstep: sequence b's blocks lie B
blocks apart).

Beside fastattn's kernels, each case times the same call through fastattn's torch backend
(fastattn:torch: the append and rotation with torch ops, SDPA over the cache; on a paged case
the cache gathered into a dense copy first) and the automatic choice (fastattn (auto), speed
table included), and carries the call's speed key: a dense case, where fastattn's kernel row is
named after its backend alone, gives `--write-speed-table` an entry.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from common import AUTO, TORCH_BACKEND, Case, automatic_kernel, fastattn_backends

import fastattn
from fastattn.ops.attention_with_kvcache import attention_with_kvcache_speed_key
from fastattn.ops.varlen_attention import causal_mode, window_sides

OP = "attention_with_kvcache"


def speed_key(q, k_cache, capacity, *, rotary_cos=None, block_table=None) -> tuple:
    """fastattn.attention_with_kvcache's speed key for the benchmarked calls: causal (the
    default), no window, ALiBi, softcap or sinks."""
    return attention_with_kvcache_speed_key(
        q,
        k_cache,
        capacity,
        causal_mode(True),
        *window_sides(OP, None),
        None,
        0.0,
        None,
        rotary_cos,
        block_table,
    )


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def decoding_case(batch, cache_len, hq, hkv, head_dim, dtype, device) -> Case:
    Lmax = cache_len + 8
    k_cache = torch.randn(batch, hkv, Lmax, head_dim, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(batch, hq, 1, head_dim, device=device, dtype=dtype)
    k_new = torch.randn(batch, hkv, 1, head_dim, device=device, dtype=dtype)
    v_new = torch.randn_like(k_new)
    seqlens = torch.full((batch,), cache_len, dtype=torch.int32, device=device)
    pe = fastattn.sinusoidal_table(Lmax, head_dim, device=device)
    cos, sin = pe[:, 1::2].contiguous(), pe[:, 0::2].contiguous()
    cos_full = torch.cat((cos, cos), -1).to(dtype)
    sin_full = torch.cat((sin, sin), -1).to(dtype)

    def call(backend=None):
        return fastattn.attention_with_kvcache(
            q,
            k_cache,
            v_cache,
            cache_seqlens=seqlens,
            k_new=k_new,
            v_new=v_new,
            rotary_cos=cos,
            rotary_sin=sin,
            backend=backend,
        )

    providers = {f"fastattn:{b}": (lambda b=b: call(b)) for b in fastattn_backends(device)}
    providers[TORCH_BACKEND] = lambda: call("torch")
    providers[AUTO] = call

    def sdpa():
        pos = cache_len
        qr = q * cos_full[pos] + rotate_half(q) * sin_full[pos]
        kr = k_new * cos_full[pos] + rotate_half(k_new) * sin_full[pos]
        k_cache[:, :, pos : pos + 1] = kr
        v_cache[:, :, pos : pos + 1] = v_new
        return F.scaled_dot_product_attention(
            qr, k_cache[:, :, : pos + 1], v_cache[:, :, : pos + 1], enable_gqa=True
        )

    providers["sdpa over cache"] = sdpa
    size = torch.tensor([], dtype=dtype).element_size()
    nbytes = 2 * batch * hkv * (cache_len + 1) * head_dim * size
    return Case(
        op="decoding",
        name=f"B={batch} cache={cache_len} hq={hq} hkv={hkv} d={head_dim}",
        providers=providers,
        reference="sdpa over cache",
        baselines=("sdpa over cache",),
        bytes=nbytes,
        check=lambda o, r: float((o.double() - r.double()).abs().max()),
        tolerance=1e-4 if dtype == torch.float32 else 3e-2,
        dtype=str(dtype)[6:],
        speed_key=speed_key(q, k_cache, Lmax, rotary_cos=cos),
        kernel=automatic_kernel(OP, device),
    )


def paged_table(batch, blocks_per_seq, block_size, placement, device) -> torch.Tensor:
    """int32 (batch, blocks_per_seq): the block table of `placement` ("random" or "lockstep",
    the module docstring)."""
    num_blocks = batch * blocks_per_seq
    if placement == "random":
        g = torch.Generator().manual_seed(0)
        return torch.randperm(num_blocks, generator=g).view(batch, blocks_per_seq).int().to(device)
    if placement != "lockstep":
        raise ValueError(f"placement must be 'random' or 'lockstep', got {placement!r}")
    # the allocator's own order: every sequence takes its next block in turn
    cache = fastattn.PagedKVCache(
        num_layers=1,
        num_blocks=num_blocks,
        block_size=block_size,
        num_kv_heads=1,
        head_dim=16,
        max_blocks_per_seq=blocks_per_seq,
        device=device,
    )
    for _ in range(batch):
        cache.allocate()
    for _ in range(blocks_per_seq):
        cache.append(block_size)
        cache.advance(block_size)
    return cache.block_table_of().contiguous()


def paged_case(
    batch, cache_len, hq, hkv, head_dim, block_size, dtype, device, placement="random"
) -> Case:
    blocks_per_seq = -(-(cache_len + 8) // block_size)
    num_blocks = batch * blocks_per_seq
    table = paged_table(batch, blocks_per_seq, block_size, placement, device)
    k_pool = torch.randn(num_blocks, hkv, block_size, head_dim, device=device, dtype=dtype)
    v_pool = torch.randn_like(k_pool)
    k_dense = (
        k_pool[table.long()].permute(0, 2, 1, 3, 4).reshape(batch, hkv, -1, head_dim).contiguous()
    )
    v_dense = (
        v_pool[table.long()].permute(0, 2, 1, 3, 4).reshape(batch, hkv, -1, head_dim).contiguous()
    )
    q = torch.randn(batch, hq, 1, head_dim, device=device, dtype=dtype)
    k_new = torch.randn(batch, hkv, 1, head_dim, device=device, dtype=dtype)
    v_new = torch.randn_like(k_new)
    seqlens = torch.full((batch,), cache_len, dtype=torch.int32, device=device)
    providers = {}
    for b in fastattn_backends(device):
        if b == "reference":
            continue
        kw = dict(cache_seqlens=seqlens, k_new=k_new, v_new=v_new, backend=b)
        providers[f"fastattn:{b} dense"] = lambda kw=kw: fastattn.attention_with_kvcache(
            q, k_dense, v_dense, **kw
        )
        providers[f"fastattn:{b} paged"] = lambda kw=kw: fastattn.attention_with_kvcache(
            q, k_pool, v_pool, block_table=table, **kw
        )
    # The paged call through the torch backend (the pool gathered into a dense copy, then
    # SDPA) and the automatic choice. No fastattn row is named after its backend alone, so
    # these cases give the speed table no entry (speed_table_writer.py).
    paged_kw = dict(cache_seqlens=seqlens, k_new=k_new, v_new=v_new, block_table=table)
    providers[TORCH_BACKEND] = lambda: fastattn.attention_with_kvcache(
        q, k_pool, v_pool, backend="torch", **paged_kw
    )
    providers[AUTO] = lambda: fastattn.attention_with_kvcache(q, k_pool, v_pool, **paged_kw)
    dense = [n for n in providers if n.endswith("dense")]
    size = torch.tensor([], dtype=dtype).element_size()
    kernel = automatic_kernel(OP, device)
    return Case(
        op="decoding paged",
        name=f"B={batch} cache={cache_len} hq={hq} hkv={hkv} d={head_dim} block={block_size} "
        f"{placement}",
        providers=providers,
        reference=dense[0],
        baselines=tuple(dense),
        judged=tuple(n for n in providers if n.endswith("paged") or n in (TORCH_BACKEND, AUTO)),
        bytes=2 * batch * hkv * (cache_len + 1) * head_dim * size,
        check=lambda o, r: float((o.double() - r.double()).abs().max()),
        tolerance=1e-5 if dtype == torch.float32 else 3e-2,
        dtype=str(dtype)[6:],
        speed_key=speed_key(q, k_pool, blocks_per_seq * block_size, block_table=table),
        kernel=kernel,
        kernel_row=f"fastattn:{kernel} paged",
    )


def target(op: str) -> float:
    """The paged cache within 10% of the dense one; elsewhere at least SDPA's speed."""
    return 0.9 if op == "decoding paged" else 1.0


def cases(profile: str, device: torch.device) -> list[Case]:
    return dense_cases(profile, device) + paged_cases(profile, device)


def paged_cases(profile: str, device: torch.device) -> list[Case]:
    if device.type == "cuda":
        shapes = [(8, 4096)] if profile == "quick" else [(8, 4096), (64, 4096), (8, 32768)]
        return [
            paged_case(b, n, 32, 8, 128, bs, torch.bfloat16, device, placement)
            for b, n in shapes
            for bs in (16, 64)
            for placement in ("random", "lockstep")
        ]
    shapes = [(8, 4096)] if profile == "quick" else [(8, 4096), (8, 1024)]
    return [
        paged_case(b, n, 8, 2, 64, bs, torch.float32, device, placement)
        for b, n in shapes
        for bs in (16, 64)
        for placement in ("random", "lockstep")
    ]


def dense_cases(profile: str, device: torch.device) -> list[Case]:
    if device.type == "cuda":
        batches = [1, 8, 64] if profile == "quick" else [1, 4, 16, 64]
        lengths = [1024, 8192, 32768] if profile == "quick" else [1024, 4096, 16384, 32768]
        return [
            decoding_case(b, n, 32, 8, 128, torch.bfloat16, device)
            for b in batches
            for n in lengths
        ]
    batches = [1, 8]
    lengths = [1024, 4096] if profile == "quick" else [1024, 4096, 16384]
    return [decoding_case(b, n, 8, 2, 64, torch.float32, device) for b in batches for n in lengths]
