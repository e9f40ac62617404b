"""Attention benchmarks: FlashAttention's sweep at constant tokens.

(batch, seqlen) pairs keep batch * seqlen constant (16K tokens on GPU as FlashAttention's
benchmark; 4K on this CPU, whose profile caps tokens), model width 2048 on GPU (512 on CPU) so
heads = width / head_dim, head dims 64 and 128, causal and not, forward and forward+backward.
FLOPs: 4 * b * h * s^2 * d (half when causal); backward 2.5x forward, so forward+backward is
3.5x. Providers: each fastattn kernel backend, torch's SDPA through fastattn's torch backend
(fastattn:torch), the automatic choice (fastattn (auto), speed table included), torch SDPA
with each backend it has on the device (flash, efficient, math, cuDNN on GPU; flash and math on
CPU), and the eager reference (materialised softmax) where it fits. Each case carries its speed
key, so `--write-speed-table` records which of fastattn's kernel and torch's was faster.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from common import AUTO, Case, automatic_kernel, fastattn_backends, relative_error
from torch.nn.attention import SDPBackend, sdpa_kernel

import fastattn
from fastattn.contracts.attention import WINDOW_UNBOUNDED
from fastattn.ops.attention import attention_speed_key


def eager_attention(q, k, v, causal):
    s = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        L = q.shape[-2]
        s = s.masked_fill(
            torch.ones(L, L, dtype=torch.bool, device=q.device).triu(1), float("-inf")
        )
    return torch.matmul(torch.softmax(s, dim=-1), v)


def sdpa_backends(device: torch.device) -> dict[str, SDPBackend]:
    if device.type == "cuda":
        return {
            "sdpa:flash": SDPBackend.FLASH_ATTENTION,
            "sdpa:efficient": SDPBackend.EFFICIENT_ATTENTION,
            "sdpa:cudnn": SDPBackend.CUDNN_ATTENTION,
            "sdpa:math": SDPBackend.MATH,
        }
    return {"sdpa:flash": SDPBackend.FLASH_ATTENTION, "sdpa:math": SDPBackend.MATH}


def attention_case(
    batch, seqlen, head_dim, width, causal, dtype, device, backward, with_math=True
) -> Case:
    heads = width // head_dim
    shape = (batch, heads, seqlen, head_dim)
    q, k, v = (
        torch.randn(shape, device=device, dtype=dtype, requires_grad=backward) for _ in range(3)
    )
    grad = torch.randn(shape, device=device, dtype=dtype)

    def wrap(fwd):
        if not backward:

            def run():
                with torch.no_grad():
                    return fwd()

            return run
        return lambda: torch.autograd.grad(fwd(), (q, k, v), grad)

    providers = {
        f"fastattn:{b}": wrap(lambda b=b: fastattn.attention(q, k, v, causal=causal, backend=b))
        for b in [*fastattn_backends(device), "torch"]
    }
    providers[AUTO] = wrap(lambda: fastattn.attention(q, k, v, causal=causal))
    for name, sdp in sdpa_backends(device).items():
        if name == "sdpa:math" and not with_math:
            continue

        def call(sdp=sdp):
            with sdpa_kernel(sdp):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

        providers[name] = wrap(call)
    if with_math:
        providers["eager"] = wrap(lambda: eager_attention(q, k, v, causal))
    flops = 4 * batch * heads * seqlen * seqlen * head_dim / (2 if causal else 1)
    baselines = tuple(n for n in providers if n.startswith("sdpa:"))
    reference = "sdpa:math" if "sdpa:math" in providers else "sdpa:flash"
    return Case(
        op="attention" + (" fwd+bwd" if backward else " fwd"),
        name=f"b={batch} s={seqlen} h={heads} d={head_dim}{' causal' if causal else ''}",
        providers=providers,
        reference=reference,
        baselines=baselines,
        flops=flops * (3.5 if backward else 1.0),
        check=relative_error,
        tolerance=2e-5 if dtype == torch.float32 else 3e-2,
        dtype=str(dtype)[6:],
        speed_key=attention_speed_key(
            q, k, v, None, None, -WINDOW_UNBOUNDED, 0 if causal else WINDOW_UNBOUNDED
        ),
        kernel=automatic_kernel("attention", device),
    )


def cases(profile: str, device: torch.device) -> list[Case]:
    if device.type == "cuda":
        tokens, width = 16384, 2048
        seqlens = [512, 1024, 2048, 4096, 8192, 16384]
        dtypes = [torch.bfloat16] if profile == "quick" else [torch.bfloat16, torch.float16]
    else:
        tokens, width = 4096, 512
        seqlens = [512, 1024, 2048] if profile == "quick" else [512, 1024, 2048, 4096]
        # bfloat16 too: its kernels differ by ISA (AVX512-BF16, AMX tiles), and the speed table
        # needs their keys
        dtypes = [torch.float32, torch.bfloat16]
    out = []
    for dtype in dtypes:
        for backward in (False, True):
            for head_dim in (64, 128):
                for causal in (False, True):
                    for seqlen in seqlens:
                        # The materialising providers get too slow or too big at long lengths.
                        with_math = seqlen <= (4096 if device.type == "cuda" else 1024)
                        out.append(
                            attention_case(
                                tokens // seqlen,
                                seqlen,
                                head_dim,
                                width,
                                causal,
                                dtype,
                                device,
                                backward,
                                with_math,
                            )
                        )
    return out


def summary(rows: list[dict]) -> list[str]:
    """Median and minimum speedup of each fastattn backend over the best SDPA backend."""
    lines = []
    groups: dict[tuple[str, str, str], list[float]] = {}
    for r in rows:
        if r.get("provider", "").startswith("fastattn:") and "speedup" in r:
            groups.setdefault((r["op"], r["dtype"], r["provider"]), []).append(r["speedup"])
    for (op, dtype, provider), values in sorted(groups.items()):
        values.sort()
        median = (
            values[len(values) // 2]
            if len(values) % 2
            else 0.5 * (values[len(values) // 2 - 1] + values[len(values) // 2])
        )
        lines.append(
            f"{op} {dtype} {provider}: median {median:.2f}x, min {values[0]:.2f}x "
            f"over the best SDPA backend ({len(values)} rows)"
        )
    return lines
