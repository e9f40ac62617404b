"""Decoding latency per token: fastattn.attention_with_kvcache (append the new token's rotated
key/value into the cache, attend with split-K) vs torch SDPA over the cache (append with an
index copy, rotary by Hugging Face's rotate_half, then SDPA over the valid prefix), one new
token per sequence, GQA 32/8 heads (GPU) or 8/2 (CPU), head dim 128 (GPU) or 64 (CPU).
Bytes: the cache read once (keys and values) per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from common import Case, fastattn_backends

import fastattn


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

    providers = {
        f"fastattn:{b}": (
            lambda b=b: fastattn.attention_with_kvcache(
                q,
                k_cache,
                v_cache,
                cache_seqlens=seqlens,
                k_new=k_new,
                v_new=v_new,
                rotary_cos=cos,
                rotary_sin=sin,
                backend=b,
            )
        )
        for b in fastattn_backends(device)
    }

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
    )


def cases(profile: str, device: torch.device) -> list[Case]:
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
