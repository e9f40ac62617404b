"""Packed variable-length attention (`varlen_attention`) and the helpers that pack a padded
batch (`pack_padded`, `unpack_padded`).

Sequences are packed one after another without padding: q (total_q, Hq, D), k/v (total_k, Hkv,
D/Dv); sequence b owns rows [cu_seqlens[b], cu_seqlens[b+1]). Every feature of `attention`
that makes sense without padding applies per sequence (causal alignments, GQA, ALiBi, sliding
window, softcap, dropout, lse); attn_mask and key_padding_mask do not (there is no padding).
Backends: "cpu"/"cuda" run torch.ops.fastattn.varlen_attention_forward/_backward, "triton" the
same ops suffixed _triton where present, "reference" fastattn/reference/varlen_attention.py.
"""

from __future__ import annotations

import math

import torch

from .. import _backend
from ..contracts import varlen_attention as contract
from ..contracts.attention import MAX_HEAD_DIM, check_seqlen
from ..reference import varlen_attention as ref
from ._common import (
    apply_sinks,
    canonical_sinks,
    check_dropout,
    check_same_device,
    check_tensor,
    device_check,
    device_checks_enabled,
    dropout_seed,
    host_checks_enabled,
    register_forward_backward,
)
from .attention import Causal


def kernel_available(device: torch.device) -> bool:
    """Whether a varlen kernel (not only the reference) can run tensors on `device` here: the
    automatic backend choice for that device would not fall back to the reference."""
    candidates = ("cpu",) if device.type == "cpu" else ("cuda", "triton")
    return any(
        _backend.cannot_run(backend, device, "varlen_attention_forward") is None
        for backend in candidates
    )


def causal_mode(causal: Causal) -> int:
    """0 no causal mask, 1 top-left, 2 bottom-right (the kernels' encoding)."""
    if causal not in (False, True, "top_left", "bottom_right"):
        raise ValueError(
            f"causal must be False, True, 'top_left' or 'bottom_right', got {causal!r}"
        )
    return 0 if not causal else (2 if causal == "bottom_right" else 1)


def window_sides(op: str, window) -> tuple[int, int]:
    if window is None:
        return -1, -1
    if (
        not isinstance(window, (tuple, list))
        or len(window) != 2
        or not all(isinstance(w, int) and w >= -1 for w in window)
    ):
        raise ValueError(
            f"{op}: window must be None or (left, right) ints >= -1 "
            f"(-1 = unbounded), got {window!r}"
        )
    return int(window[0]), int(window[1])


def _as_int(n):
    """An int argument, kept symbolic under torch.compile(dynamic=True) (int() would
    specialize the graph on its value)."""
    return n if isinstance(n, torch.SymInt) else int(n)


def check_cu_seqlens(
    op: str, name: str, cu: torch.Tensor, total: int, max_seqlen: int, device: torch.device
) -> None:
    check_tensor(op, name, cu, dims=1)
    if cu.dtype != torch.int32:
        raise TypeError(f"{op}: {name} must be int32, got {cu.dtype}")
    if cu.device != device:
        raise ValueError(f"{op}: {name} must be on {device}, got {cu.device}")
    if cu.numel() < 1:
        raise ValueError(f"{op}: {name} must have B+1 >= 1 entries")
    if not host_checks_enabled(cu):
        return  # CUDA: device_check_cu_seqlens, or the native CUDA op's own check kernel
    values = cu.tolist()
    if values[0] != 0 or values[-1] != total:
        raise ValueError(
            f"{op}: {name} must start at 0 and end at the packed length {total}, "
            f"got {values[0]} and {values[-1]}"
        )
    lengths = [b - a for a, b in zip(values, values[1:])]
    if any(n < 0 for n in lengths):
        raise ValueError(f"{op}: {name} must be non-decreasing, got {values}")
    if lengths and max(lengths) > max_seqlen:
        raise ValueError(
            f"{op}: a sequence of length {max(lengths)} exceeds max_seqlen {max_seqlen} ({name})"
        )


def device_check_cu_seqlens(
    op: str, name: str, cu: torch.Tensor, total: int, max_seqlen: int
) -> None:
    """check_cu_seqlens's value rules, checked asynchronously on cu's device (no host read)."""
    lengths = cu[1:] - cu[:-1]
    ok = (cu[0] == 0) & (cu[-1] == total) & ((lengths >= 0) & (lengths <= max_seqlen)).all()
    device_check(
        op,
        ok,
        f"{name} must start at 0, end at the packed length {total} and be "
        f"non-decreasing with steps <= max_seqlen {max_seqlen}",
    )


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: Causal = False,
    attn_mask=None,
    key_padding_mask=None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    window=None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
    deterministic: bool = False,
    backend: str | None = None,
):
    """Attention of packed variable-length sequences, no work spent on padding.

    Sequence b owns rows `[cu_seqlens[b], cu_seqlens[b + 1])` of the packed tensors. Every keyword
    of `fastattn.attention` applies per sequence with that sequence's own lengths (bottom-right
    alignment uses its own `Lk - Lq`).

    Args:
        q: (total_q, Hq, D); any strides with a unit last stride.
        k: (total_k, Hkv, D).
        v: (total_k, Hkv, Dv).
        cu_seqlens_q: Int32 (B + 1,) prefix sums of the query lengths (a sequence may be empty).
        cu_seqlens_k: Int32 (B + 1,) prefix sums of the key lengths.
        max_seqlen_q: The largest query length, a Python int.
        max_seqlen_k: The largest key length, a Python int.
        causal: As in `fastattn.attention`.
        attn_mask: Not accepted (pad and use `fastattn.attention` for arbitrary masks).
        key_padding_mask: Not accepted (packed sequences have no padding).
        dropout_p: As in `fastattn.attention`.
        scale: As in `fastattn.attention`.
        alibi_slopes: (Hq,) or (B, Hq).
        window: As in `fastattn.attention`, per sequence.
        softcap: As in `fastattn.attention`.
        sinks: Float (Hq,) attention sinks, as in `fastattn.attention` (differentiable).
        return_lse: Also return the log-sum-exp of each row.
        deterministic: As in `fastattn.attention`.
        backend: The backend for this call; None chooses automatically.

    Returns:
        out, (total_q, Hq, Dv); with `return_lse`, (out, lse) with lse (Hq, total_q) float32.

    Raises:
        ValueError: An `attn_mask` or `key_padding_mask`, or shapes, dtypes or prefix sums that
            do not fit together.
        BackendError: The backend asked for cannot run this call.
    """
    op = "varlen_attention"
    if attn_mask is not None or key_padding_mask is not None:
        raise ValueError(
            f"{op}: attn_mask and key_padding_mask do not apply to packed "
            "sequences (there is no padding); use causal/window, or attention() "
            "on a padded batch for arbitrary masks"
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(op, name, t, dims=3, float_dtype=True)
    # The kernels read rows with a unit stride; other layouts are copied, as SDPA does.
    q, k, v = (t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"{op}: q, k and v must have the same dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    check_same_device(op, "q", q, k=k, v=v)
    total_q, Hq, D = q.shape
    total_k, Hkv, Dv = k.shape[0], k.shape[1], v.shape[2]
    if v.shape[0] != total_k or v.shape[1] != Hkv:
        raise ValueError(
            f"{op}: k and v must have the same packed length and heads, got "
            f"{tuple(k.shape)} and {tuple(v.shape)}"
        )
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"{op}: q's heads ({Hq}) must be a multiple of k/v's heads ({Hkv})")
    if k.shape[2] != D:
        raise ValueError(f"{op}: q and k must have the same head dim, got {D} and {k.shape[2]}")
    for name, d in (("head dim of q/k", D), ("head dim of v", Dv)):
        if not 1 <= d <= MAX_HEAD_DIM:
            raise ValueError(f"{op}: {name} must be in [1, {MAX_HEAD_DIM}], got {d}")
    # Every backend's band (the reference's too) holds sequences below 2**30.
    check_seqlen(op, "max_seqlen_q", max_seqlen_q)
    check_seqlen(op, "max_seqlen_k", max_seqlen_k)
    check_cu_seqlens(op, "cu_seqlens_q", cu_seqlens_q, total_q, max_seqlen_q, q.device)
    check_cu_seqlens(op, "cu_seqlens_k", cu_seqlens_k, total_k, max_seqlen_k, q.device)
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"{op}: cu_seqlens_q and cu_seqlens_k must have the same length B+1")
    B = cu_seqlens_q.numel() - 1
    mode = causal_mode(causal)
    left, right = window_sides(op, window)
    p = check_dropout(op, dropout_p)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    softcap = float(softcap)
    if softcap < 0:
        raise ValueError(f"{op}: softcap must be >= 0, got {softcap}")
    alibi = None
    if alibi_slopes is not None:
        check_tensor(op, "alibi_slopes", alibi_slopes, dims=(1, 2), float_dtype=True)
        check_same_device(op, "q", q, alibi_slopes=alibi_slopes)
        if tuple(alibi_slopes.shape) not in ((Hq,), (B, Hq)):
            raise ValueError(
                f"{op}: alibi_slopes must be (Hq,) or (B, Hq), got {tuple(alibi_slopes.shape)}"
            )
        alibi = alibi_slopes.to(torch.float32).expand(B, Hq)
    sinks = canonical_sinks(op, sinks, q, Hq)
    limits: dict[str, str] = {}
    if torch.is_grad_enabled() and alibi is not None and alibi.requires_grad:
        for name in ("cpu", "cuda", "triton"):
            limits[name] = "gradients with respect to alibi_slopes need the reference backend"
    chosen = _backend.select_backend(
        op, q.device, backend, limits=limits, kernel="varlen_attention_forward", dtype=q.dtype
    )
    if chosen != "cuda" and device_checks_enabled(cu_seqlens_q):  # the CUDA op checks itself
        device_check_cu_seqlens(op, "cu_seqlens_q", cu_seqlens_q, total_q, max_seqlen_q)
        device_check_cu_seqlens(op, "cu_seqlens_k", cu_seqlens_k, total_k, max_seqlen_k)
    seed = dropout_seed(p, q.device)
    args = (
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        _as_int(max_seqlen_q),
        _as_int(max_seqlen_k),
        alibi,
        scale,
        softcap,
        mode,
        left,
        right,
        p,
        seed,
    )
    if chosen == "reference":
        out, lse = ref.varlen_attention(*args, sinks=sinks)
    else:
        name = "varlen_attention_forward" + ("_triton" if chosen == "triton" else "")
        out, lse = getattr(torch.ops.fastattn, name)(*args)
        if sinks is not None:
            out, lse = apply_sinks(out, lse, sinks, head_dim=0)
    _backend.record_backend(op, chosen)
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------------
# Padded <-> packed


def pack_padded(x: torch.Tensor, key_padding_mask: torch.Tensor):
    """Pack a padded batch into the layout of `varlen_attention`.

    Differentiable in x. The packed size depends on the mask's values, so on CUDA this reads them
    on the host (a synchronisation): pack once per batch, not per layer or step.

    Args:
        x: (B, L, ...), the padded batch.
        key_padding_mask: Bool (B, L), True = padding (anywhere in a row).

    Returns:
        (packed, cu_seqlens, max_seqlen, indices): packed (total, ...), the kept rows in order;
        cu_seqlens int32 (B + 1,); max_seqlen, the longest sequence, an int; indices (total,), the
        flat positions `b * L + l` of the kept rows, for `unpack_padded`.

    Raises:
        ValueError: A mask whose shape does not match x's first two dims.
    """
    check_tensor("pack_padded", "key_padding_mask", key_padding_mask, dims=2)
    if key_padding_mask.dtype != torch.bool or tuple(key_padding_mask.shape) != tuple(x.shape[:2]):
        raise ValueError(
            f"pack_padded: key_padding_mask must be bool {tuple(x.shape[:2])}, got "
            f"{key_padding_mask.dtype} {tuple(key_padding_mask.shape)}"
        )
    B, L = key_padding_mask.shape
    keep = ~key_padding_mask
    lengths = keep.sum(dim=1, dtype=torch.int32)
    cu_seqlens = torch.zeros(B + 1, dtype=torch.int32, device=x.device)
    cu_seqlens[1:] = torch.cumsum(lengths, dim=0)
    indices = keep.reshape(-1).nonzero().squeeze(1)
    packed = x.reshape(B * L, *x.shape[2:]).index_select(0, indices)
    max_seqlen = int(lengths.max()) if B else 0
    return packed, cu_seqlens, max_seqlen, indices


def unpack_padded(
    packed: torch.Tensor, indices: torch.Tensor, batch: int, seqlen: int
) -> torch.Tensor:
    """Inverse of `pack_padded`: scatter packed rows back into a padded batch.

    Args:
        packed: (total, ...), rows in the order `pack_padded` gave.
        indices: (total,), the flat positions `b * seqlen + l` that `pack_padded` returned.
        batch: B of the padded batch.
        seqlen: L of the padded batch.

    Returns:
        (batch, seqlen, ...) with zeros at the padding; differentiable in packed.
    """
    out = packed.new_zeros((batch * seqlen, *packed.shape[1:]))
    out = out.index_copy(0, indices, packed)
    return out.view(batch, seqlen, *packed.shape[1:])


# ---------------------------------------------------------------------------------------------
# Registration: fakes and autograd of the native ops and of their Triton twins, from the
# contract (fastattn/contracts/varlen_attention.py)


def _register() -> None:
    register_forward_backward(
        "varlen_attention_forward",
        "varlen_attention_backward",
        contract.forward_fake,
        contract.backward_fake,
        contract.autograd_formula,
        ref.varlen_attention,
        "varlen_attention",
    )


_register()
