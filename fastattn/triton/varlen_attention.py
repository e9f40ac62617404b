"""Triton packed variable-length attention: the launchers of the torch ops
fastattn::varlen_attention_forward_triton / varlen_attention_backward_triton (the schemas of
the native varlen ops in csrc/bindings.cpp; fastattn/ops/varlen_attention.py registers them
with the contract of fastattn/contracts/varlen_attention.py).

The kernels are the FlashAttention-2 kernels of fastattn/triton/attention.py run with their
VARLEN path: q (total_q, Hq, D), k/v (total_k, Hkv, D/Dv) with batch stride 0; programs index
(tile, sequence b * heads + head) over the largest lengths, each program reads its sequence's
rows and lengths from cu_seqlens and exits at once when its tile lies past them, so no work is
spent on padding. Causal alignment, windows and ALiBi distances use each sequence's own
lengths; dropout numbers probability (b, h, i, j) as element
((cu_seqlens_q[b] + i) * Hq + h) * max_seqlen_k + j, the CPU varlen kernel's numbering, so
both backends drop the same elements; lse is (Hq, total_q) float32.
"""

from __future__ import annotations

import torch

from .._debug import poison
from . import finish, output_buffer
from .attention import Launch, launch_forward
from .attention_backward import launch_backward


def _launch(
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
) -> Launch:
    # fastattn.varlen_attention checks cu_seqlens on the host (values, max_seqlen); the kernels
    # trust them, as the CUDA kernels do.
    return Launch(
        q,
        k,
        v,
        None,
        None,
        alibi_slopes,
        scale,
        softcap,
        window_left,
        window_right,
        dropout_p,
        seed,
        varlen=(
            cu_seqlens_q.contiguous(),
            cu_seqlens_k.contiguous(),
            max_seqlen_q,
            max_seqlen_k,
            causal_mode,
        ),
    )


def varlen_attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    alibi_slopes: torch.Tensor | None,
    scale: float,
    softcap: float,
    causal_mode: int,
    window_left: int,
    window_right: int,
    dropout_p: float,
    seed: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (total_q, Hq, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv), cu_seqlens int32 (B+1,),
    alibi_slopes float32 (B, Hq) view or None -> out (total_q, Hq, Dv), lse (Hq, total_q)."""
    launch = _launch(
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
    )
    total_q, Hq = q.shape[0], q.shape[1]
    wide = q.dtype == torch.bfloat16 and launch.interpret  # float32 buffer, rounded by torch
    out = poison(q.new_empty((total_q, Hq, v.shape[2]), dtype=torch.float32 if wide else q.dtype))
    lse = poison(torch.empty((Hq, total_q), dtype=torch.float32, device=q.device))
    launch_forward(launch, q, k, v, out, lse)
    return finish(out, q.dtype), lse


def varlen_attention_backward(
    grad_out: torch.Tensor,
    grad_lse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    alibi_slopes: torch.Tensor | None,
    scale: float,
    softcap: float,
    causal_mode: int,
    window_left: int,
    window_right: int,
    dropout_p: float,
    seed: torch.Tensor | None,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dq, dk, dv), contiguous and shaped like q, k, v, of <out, grad_out> +
    <lse, grad_lse>. Always deterministic (no atomics): `deterministic` needs nothing."""
    launch = _launch(
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
    )
    dq, dk, dv = (output_buffer(t.shape, t.dtype, t.device) for t in (q, k, v))
    if grad_out.shape[-1] > 1 and grad_out.stride(-1) != 1:
        grad_out = grad_out.contiguous()
    if grad_lse is not None:
        grad_lse = grad_lse.to(torch.float32).contiguous()
    launch_backward(launch, grad_out, grad_lse, q, k, v, out, lse.contiguous(), dq, dk, dv)
    return finish(dq, q.dtype), finish(dk, k.dtype), finish(dv, v.dtype)
