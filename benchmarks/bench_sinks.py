"""Attention with sinks (GPT-OSS): fastattn.attention(..., sinks=) vs the eager GPT-OSS
formula (scores, a concatenated column of sink logits, softmax, the column dropped), and vs
fastattn without sinks (the cost of the sink: one rescale of out and lse per row). Causal,
GQA 8/2 heads (CPU) or 64/8 (GPU), head dim 64, forward and forward+backward (gradients to
q, k, v and the sinks). FLOPs as attention's (4 * b * h * s^2 * d, half when causal; backward
2.5x forward).
"""

from __future__ import annotations

import math

import torch
from common import Case, fastattn_backends, relative_error

import fastattn


def eager_sinks(q, k, v, sinks):
    """transformers' GPT-OSS eager attention, causal (materialises the scores)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    L = q.shape[-2]
    s = s.masked_fill(torch.ones(L, L, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    col = sinks.to(s.dtype).view(1, -1, 1, 1).expand(q.shape[0], -1, L, 1)
    full = torch.cat([s, col], dim=-1)
    p = torch.softmax(full - full.amax(-1, keepdim=True), dim=-1)[..., :-1]
    return torch.matmul(p, v)


def sinks_case(batch, seqlen, hq, hkv, head_dim, dtype, device, backward) -> Case:
    q = torch.randn(batch, hq, seqlen, head_dim, device=device, dtype=dtype)
    k = torch.randn(batch, hkv, seqlen, head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    sinks = torch.randn(hq, device=device, dtype=torch.float32)
    leaves = (q, k, v, sinks)
    for t in leaves:
        t.requires_grad_(backward)
    grad = torch.randn_like(q)

    def wrap(fwd, inputs=leaves):
        if not backward:

            def run():
                with torch.no_grad():
                    return fwd()

            return run
        return lambda: torch.autograd.grad(fwd(), inputs, grad)

    providers = {}
    for b in fastattn_backends(device):
        providers[f"fastattn:{b}"] = wrap(
            lambda b=b: fastattn.attention(q, k, v, causal=True, sinks=sinks, backend=b)
        )
        providers[f"fastattn:{b} no sinks"] = wrap(
            lambda b=b: fastattn.attention(q, k, v, causal=True, backend=b), (q, k, v)
        )
    providers["eager"] = wrap(lambda: eager_sinks(q, k, v, sinks))
    flops = 4 * batch * hq * seqlen * seqlen * head_dim / 2
    return Case(
        op="sinks" + (" fwd+bwd" if backward else " fwd"),
        name=f"b={batch} s={seqlen} hq={hq} hkv={hkv} d={head_dim} causal",
        providers=providers,
        reference="eager",
        baselines=("eager",),
        flops=flops * (3.5 if backward else 1.0),
        check=relative_error,
        # The "no sinks" rows compute another function: shown, not judged.
        judged=tuple(n for n in providers if n.startswith("fastattn") and "no sinks" not in n),
        tolerance=2e-5 if dtype == torch.float32 else 3e-2,
        dtype=str(dtype)[6:],
    )


def cases(profile: str, device: torch.device) -> list[Case]:
    if device.type == "cuda":
        shapes = [(4, 1024), (1, 4096)] if profile == "quick" else [(8, 1024), (2, 4096), (1, 8192)]
        heads, dtype = (64, 8), torch.bfloat16
    else:
        shapes = [(2, 512)] if profile == "quick" else [(4, 512), (1, 2048)]
        heads, dtype = (8, 2), torch.float32
    return [
        sinks_case(b, s, *heads, 64, dtype, device, backward)
        for backward in (False, True)
        for b, s in shapes
    ]
