"""Attention with a learned additive bias that trains (T5's relative position bias, Swin's
relative bias: one (1, H, L, L) bias shared by the batch; AlphaFold's (B, 1, L, L) pair bias),
forward+backward: fastattn's fused kernels, whose backward sums dS over the bias's broadcast
dims tile by tile (only the bias-shaped gradient is allocated), against torch SDPA given the
same additive mask requiring grad (torch picks the SDPA backend that takes it) and the eager
formula (materialised scores + bias, softmax, gradients by autograd).

Every provider returns (dq, dk, dv, dbias) for the same output gradient; the check compares
them with the eager formula's. FLOPs: as bench_attention (4 * B * H * L^2 * D forward, 3.5x
for forward+backward).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from common import Case, fastattn_backends, relative_error

import fastattn


def eager(q, k, v, bias):
    s = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1]) + bias
    return torch.matmul(torch.softmax(s.float(), dim=-1).to(q.dtype), v)


def biased_case(B, H, L, D, bias_kind, dtype, device) -> Case:
    shape = (B, H, L, D)
    q, k, v = (torch.randn(shape, device=device, dtype=dtype, requires_grad=True) for _ in range(3))
    bias_shape = (1, H, L, L) if bias_kind == "t5" else (B, 1, L, L)
    bias = torch.randn(bias_shape, device=device, dtype=dtype, requires_grad=True)
    grad = torch.randn(shape, device=device, dtype=dtype)
    leaves = (q, k, v, bias)

    def wrap(fwd):
        return lambda: torch.autograd.grad(fwd(), leaves, grad)

    providers = {
        f"fastattn:{b}": wrap(lambda b=b: fastattn.attention(q, k, v, attn_mask=bias, backend=b))
        for b in fastattn_backends(device)
    }
    providers["sdpa"] = wrap(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias))
    providers["eager"] = wrap(lambda: eager(q, k, v, bias))
    label = "T5 (1, H, L, L) bias" if bias_kind == "t5" else "pair (B, 1, L, L) bias"
    return Case(
        op="biased attention fwd+bwd",
        name=f"b={B} h={H} s={L} d={D} {label}",
        providers=providers,
        reference="eager",
        baselines=("sdpa", "eager"),
        flops=4 * B * H * L * L * D * 3.5,
        check=relative_error,
        tolerance=1e-4 if dtype == torch.float32 else 3e-2,
        dtype=str(dtype)[6:],
    )


def cases(profile: str, device: torch.device) -> list[Case]:
    if device.type == "cuda":
        dtype, shapes = torch.bfloat16, [(8, 16, 1024, 64)]
        if profile != "quick":
            shapes += [(4, 16, 2048, 64), (2, 16, 4096, 128)]
    else:
        dtype, shapes = torch.float32, [(4, 8, 512, 64)]
        if profile != "quick":
            shapes += [(2, 8, 1024, 64), (1, 4, 1024, 128)]
    out = [biased_case(*s, "t5", dtype, device) for s in shapes]
    # the GPU suite's quick profile also times the pair bias (fastattn:cuda and :triton)
    if profile != "quick" or device.type == "cuda":
        out += [biased_case(*shapes[0], "pair", dtype, device)]
    return out


def summary(rows: list[dict]) -> list[str]:
    """Speedup of fastattn over the best PyTorch provider (SDPA or eager), per case."""
    return [
        f"{r['op']} {r['case']}: {r['provider']} {r['speedup']:.2f}x the best PyTorch provider"
        for r in rows
        if r.get("provider", "").startswith("fastattn:") and "speedup" in r
    ]
