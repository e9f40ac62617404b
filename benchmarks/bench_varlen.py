"""Packed variable-length attention against padded dense attention.

A batch of sequences with lengths drawn uniformly from [64, 2048] (GPU, 16K tokens) or
[64, 1024] (CPU, 4K tokens): fastattn.varlen_attention on the packed tokens vs attention on
the padded batch with a key_padding_mask (fastattn and torch SDPA, which needs a boolean
mask: its math/efficient backends), causal. FLOPs count only the real (unpadded) work, so
the padded providers' TFLOP/s shows how much of their time is wasted.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from common import Case, fastattn_backends

import fastattn


def lengths_for(tokens: int, low: int, high: int, gen: torch.Generator) -> list[int]:
    out, total = [], 0
    while total < tokens:
        n = int(torch.randint(low, high + 1, (1,), generator=gen))
        n = min(n, tokens - total) if tokens - total >= low else n
        out.append(n)
        total += n
    return out


def varlen_case(tokens, low, high, heads, head_dim, dtype, device, backward) -> Case:
    gen = torch.Generator().manual_seed(0)
    lens = lengths_for(tokens, low, high, gen)
    B, L, total = len(lens), max(lens), sum(lens)
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    padding = torch.arange(L).unsqueeze(0) >= torch.tensor(lens).unsqueeze(1)  # True = pad
    padding = padding.to(device)
    dense = [torch.randn(B, heads, L, head_dim, device=device, dtype=dtype) for _ in range(3)]
    for t in dense:
        t.masked_fill_(padding.view(B, 1, L, 1), 0.0)
        t.requires_grad_(backward)
    packed = [t.detach().transpose(1, 2)[~padding].clone().requires_grad_(backward) for t in dense]
    grad_dense = torch.randn_like(dense[0]).masked_fill(padding.view(B, 1, L, 1), 0.0)
    grad_packed = grad_dense.transpose(1, 2)[~padding].clone()
    sdpa_mask = (~padding).view(B, 1, 1, L)

    def wrap(fwd, inputs, grad):
        if not backward:

            def run():
                with torch.no_grad():
                    return fwd()

            return run
        return lambda: torch.autograd.grad(fwd(), inputs, grad)

    providers, checks = {}, {}
    for b in fastattn_backends(device):
        providers[f"fastattn:{b} varlen"] = wrap(
            lambda b=b: fastattn.varlen_attention(*packed, cu, cu, L, L, causal=True, backend=b),
            packed,
            grad_packed,
        )
        providers[f"fastattn:{b} padded"] = wrap(
            lambda b=b: fastattn.attention(
                *dense, causal=True, key_padding_mask=padding, backend=b
            ),
            dense,
            grad_dense,
        )
    causal = torch.ones(L, L, dtype=torch.bool, device=device).tril()
    providers["sdpa padded"] = wrap(
        lambda: F.scaled_dot_product_attention(*dense, attn_mask=sdpa_mask & causal),
        dense,
        grad_dense,
    )

    # The check compares outputs at real tokens only, packed form.
    def as_packed(out):
        o = out[0] if isinstance(out, tuple) else out
        return o if o.dim() == 3 else o.transpose(1, 2)[~padding]

    for name, fn in providers.items():
        if backward:
            checks[name] = fn
        else:
            checks[name] = lambda fn=fn: as_packed(fn())

    def error(out, ref):
        if isinstance(out, tuple):  # gradients: compare dq only at real tokens
            out, ref = out[0], ref[0]
        out, ref = as_packed(out), as_packed(ref)
        return float((out.double() - ref.double()).abs().max() / ref.double().abs().max())

    real = sum(n * (n + 1) / 2 for n in lens)  # causal pairs
    flops = 4 * heads * head_dim * real * (3.5 if backward else 1.0)
    return Case(
        op="varlen" + (" fwd+bwd" if backward else " fwd"),
        name=f"{B} seqs U[{low},{high}] {total} tok h={heads} d={head_dim} causal",
        providers=providers,
        check_providers=checks,
        reference="sdpa padded",
        baselines=tuple(n for n in providers if "padded" in n),
        flops=flops,
        check=error,
        tolerance=2e-5 if dtype == torch.float32 else 3e-2,
        dtype=str(dtype)[6:],
    )


def cases(profile: str, device: torch.device) -> list[Case]:
    if device.type == "cuda":
        spec = (16384, 64, 2048, 16, 128, torch.bfloat16)
    else:
        spec = (4096, 64, 1024, 4, 64, torch.float32)
    tokens, low, high, heads, head_dim, dtype = spec
    out = [varlen_case(tokens, low, high, heads, head_dim, dtype, device, False)]
    if profile == "full":
        out.append(varlen_case(tokens, low, high, heads, head_dim, dtype, device, True))
    return out
