"""Softmax attention: `attention`, `attention_with_weights` and `merge_attention` (public
functions, argument checks, backend choice, registration with the contract of
fastattn/contracts/attention.py).

Every backend receives the same canonical arguments (see fastattn/reference/attention.py):
q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv) with unit last strides; attn_mask
4-D, broadcasting to (B, Hq, Lq, Lk) (each dim 1 or full; never expanded in memory);
key_padding_mask bool (B, Lk);
alibi_slopes float32 (B, Hq); causal alignment and the sliding window folded into
(window_lo, window_hi): key j is visible to query i iff i + window_lo <= j <= i + window_hi.

Backends: "cpu"/"cuda" run torch.ops.fastattn.attention_forward / attention_backward
(csrc/attention), "triton" runs the same ops suffixed _triton (fastattn/triton/attention.py),
"torch" runs torch's SDPA for the calls it computes exactly (fastattn/aten/attention.py),
"reference" runs fastattn/reference/attention.py under torch autograd.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from .. import _backend, speed_table
from ..aten import attention as aten_attention
from ..contracts import attention as contract
from ..contracts.attention import MAX_HEAD_DIM, WINDOW_UNBOUNDED, AttentionArgs, check_seqlen
from ..reference import attention as ref
from ..reference.random import dropout_keep_mask, dropout_uniform
from ._common import (
    apply_sinks,
    canonical_sinks,
    check_dropout,
    check_same_device,
    check_tensor,
    kernel_op,
    register_forward_backward,
)
from ._common import dropout_seed as dropout_seed  # public here: fastattn.distributed draws seeds

Causal = bool | str


def _op(name: str, backend: str):
    return kernel_op(name + "_triton" if backend == "triton" else name)


def window_bounds(causal: Causal, window, Lq: int, Lk: int) -> tuple[int, int]:
    """(window_lo, window_hi) relative to the query index, from `causal` and `window`."""
    lo, hi = -WINDOW_UNBOUNDED, WINDOW_UNBOUNDED
    shift = Lk - Lq  # bottom-right alignment: the last query sees the last key
    if window is not None:
        left, right = window
        if left >= 0:
            lo = shift - left
        if right >= 0:
            hi = shift + right
    if causal:
        hi = min(hi, shift if causal == "bottom_right" else 0)
    return max(lo, -WINDOW_UNBOUNDED), min(hi, WINDOW_UNBOUNDED)


def _check_inputs(op, q, k, v):
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(op, name, t, dims=4, float_dtype=True)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"{op}: q, k and v must have the same dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    check_same_device(op, "q", q, k=k, v=v)
    B, Hq, Lq, D = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(
            f"{op}: q, k and v must have the same batch size, got {q.shape[0]}, "
            f"{k.shape[0]}, {v.shape[0]}"
        )
    if k.shape[1] != v.shape[1]:
        raise ValueError(
            f"{op}: k and v must have the same number of heads, got {k.shape[1]} and {v.shape[1]}"
        )
    if k.shape[1] == 0 or Hq % k.shape[1] != 0:
        raise ValueError(
            f"{op}: q's heads ({Hq}) must be a multiple of k/v's heads ({k.shape[1]}) (GQA/MQA)"
        )
    if k.shape[2] != v.shape[2]:
        raise ValueError(
            f"{op}: k and v must have the same length, got {k.shape[2]} and {v.shape[2]}"
        )
    if k.shape[3] != D:
        raise ValueError(f"{op}: q and k must have the same head dim, got {D} and {k.shape[3]}")
    for name, d in (("head dim of q/k", D), ("head dim of v", v.shape[3])):
        if not 1 <= d <= MAX_HEAD_DIM:
            raise ValueError(f"{op}: {name} must be in [1, {MAX_HEAD_DIM}], got {d}")
    check_seqlen(op, "q's length (Lq)", Lq)
    check_seqlen(op, "k's length (Lk)", k.shape[2])
    # The kernels read rows with a unit stride; other layouts are copied, as SDPA does.
    return tuple(t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))


def _canonical_mask(op, attn_mask, q, B, Hq, Lq, Lk):
    if attn_mask is None:
        return None
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(f"{op}: attn_mask must be a tensor, got {type(attn_mask).__name__}")
    if attn_mask.dtype != torch.bool and not attn_mask.dtype.is_floating_point:
        raise TypeError(
            f"{op}: attn_mask must be bool (True = may attend) or floating "
            f"(added to the scores), got {attn_mask.dtype}"
        )
    check_same_device(op, "q", q, attn_mask=attn_mask)
    if attn_mask.dim() > 4:
        raise ValueError(
            f"{op}: attn_mask must broadcast to (B, Hq, Lq, Lk) = "
            f"({B}, {Hq}, {Lq}, {Lk}), got shape {tuple(attn_mask.shape)}"
        )
    try:
        attn_mask.expand(B, Hq, Lq, Lk)
    except RuntimeError:
        raise ValueError(
            f"{op}: attn_mask must broadcast to (B, Hq, Lq, Lk) = "
            f"({B}, {Hq}, {Lq}, {Lk}), got shape {tuple(attn_mask.shape)}"
        ) from None
    # 4-D with its broadcast dims of size 1, not expanded: the backends read it through a
    # stride-0 view, and the kernels' gradient of a learned bias is then shaped like the bias
    # (summed over the broadcast dims) instead of (B, Hq, Lq, Lk).
    mask = attn_mask[(None,) * (4 - attn_mask.dim())]
    if mask.dtype.is_floating_point and mask.dtype not in (q.dtype, torch.float32):
        mask = mask.to(torch.float32)
    return mask


def _canonical_padding(op, key_padding_mask, q, B, Lk):
    if key_padding_mask is None:
        return None
    check_tensor(op, "key_padding_mask", key_padding_mask, dims=2)
    if key_padding_mask.dtype != torch.bool:
        raise TypeError(
            f"{op}: key_padding_mask must be bool (True = padding to ignore), got "
            f"{key_padding_mask.dtype}"
        )
    if tuple(key_padding_mask.shape) != (B, Lk):
        raise ValueError(
            f"{op}: key_padding_mask must be (B, Lk) = ({B}, {Lk}), got "
            f"{tuple(key_padding_mask.shape)}"
        )
    check_same_device(op, "q", q, key_padding_mask=key_padding_mask)
    return key_padding_mask.contiguous()


def _canonical_alibi(op, alibi_slopes, q, B, Hq):
    if alibi_slopes is None:
        return None
    check_tensor(op, "alibi_slopes", alibi_slopes, dims=(1, 2), float_dtype=True)
    if tuple(alibi_slopes.shape) not in ((Hq,), (B, Hq)):
        raise ValueError(
            f"{op}: alibi_slopes must be (Hq,) = ({Hq},) or (B, Hq) = ({B}, {Hq}),"
            f" got {tuple(alibi_slopes.shape)}"
        )
    check_same_device(op, "q", q, alibi_slopes=alibi_slopes)
    return alibi_slopes.to(torch.float32).expand(B, Hq)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: Causal = False,
    attn_mask: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    window: tuple[int, int] | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    return_lse: bool = False,
    deterministic: bool = False,
    backend: str | None = None,
):
    """Softmax attention, fused and tiled (FlashAttention-2 style).

    Computes `softmax(q k^T * scale + bias) v` without allocating an (Lq, Lk) tensor, forward or
    backward. The score pipeline is: `s = scale * q.k`; softcap; plus ALiBi; plus a float
    `attn_mask`; then the boolean masks. Rows with no visible key give output 0 (and lse -inf),
    never NaN.

    With Lq = 2 and Lk = 5, the two causal alignments (x = visible)::

        top_left       bottom_right
        x . . . .      x x x x .
        x x . . .      x x x x x

    Args:
        q: Queries, (B, Hq, Lq, D). Any strides with a unit last stride (a (B, L, H, D) tensor
            transposed to (B, H, L, D) needs no copy); float32, float16, bfloat16 (float64 on the
            cpu and reference backends).
        k: Keys, (B, Hkv, Lk, D); Hq must be a multiple of Hkv (grouped-query or multi-query
            attention). D and Dv in [1, 256]; Lq and Lk below 2^30.
        v: Values, (B, Hkv, Lk, Dv).
        causal: False; True or "top_left": query i sees keys `j <= i` (SDPA's `is_causal`);
            "bottom_right": query i sees keys `j <= i + Lk - Lq` (the last query sees every key,
            as in decoding with a cache).
        attn_mask: Bool (True = may attend) or float (added to the scores), broadcastable to
            (B, Hq, Lq, Lk); read through its strides, never expanded in memory. A float mask
            that requires grad is a learned bias (T5's relative position bias, Swin's relative
            bias, AlphaFold's pair bias): it receives the gradient of the biased scores, summed
            over its broadcast dims in a fixed order (reproducible), from the cpu, triton and cuda
            kernels.
        key_padding_mask: Bool (B, Lk), True = padding to ignore (`nn.MultiheadAttention`'s rule).
        dropout_p: Dropout on the attention probabilities (training). Reproducible under
            `torch.manual_seed`; the backward regenerates the same mask.
        scale: Multiplies `q.k`; default `1 / sqrt(D)`.
        alibi_slopes: Float (Hq,) or (B, Hq): adds `-slope * abs(i + Lk - Lq - j)` to the scores
            (slopes that require grad run on the reference backend).
        window: (left, right) sliding window: query i sees keys j with
            `i + Lk - Lq - left <= j <= i + Lk - Lq + right`; -1 leaves a side unbounded.
        softcap: If > 0, replaces scores s by `softcap * tanh(s / softcap)` (Gemma 2).
        sinks: Float (Hq,) attention sinks (GPT-OSS): a learned logit per query head that joins
            every row's softmax denominator with no value,
            `p_j = exp(s_j) / (sum_j exp(s_j) + exp(sinks[h]))`. Differentiable; float32 sinks
            beside bfloat16 queries are computed in float32.
        return_lse: Also return the log-sum-exp of each row's scores.
        deterministic: Ask for a bitwise reproducible backward (fastattn's kernels always are:
            dQ and dK/dV are reduced in a fixed order, without atomics).
        backend: The backend for this call ("cpu", "triton", "cuda", "torch", "reference");
            None chooses automatically.

    Returns:
        out, (B, Hq, Lq, Dv) in q's dtype; with `return_lse`, the pair (out, lse), lse
        (B, Hq, Lq) float32 (float64 for float64 inputs): the natural log of each row's sum of
        `exp(scores)` (plus `exp(sink)` with sinks), -inf for rows with no visible key.

    Raises:
        ValueError: Shapes, dtypes or devices that do not fit together, or values out of range
            (head dims, lengths, window, dropout probability).
        BackendError: The backend asked for cannot run this call (not built, wrong device, or a
            feature it does not implement); the message says why.
    """
    out, lse, _, _ = attention_band(
        q,
        k,
        v,
        causal=causal,
        attn_mask=attn_mask,
        key_padding_mask=key_padding_mask,
        dropout_p=dropout_p,
        scale=scale,
        alibi_slopes=alibi_slopes,
        window=window,
        softcap=softcap,
        sinks=sinks,
        backend=backend,
        lse_needed=return_lse,
    )
    return (out, lse) if return_lse else out


def attention_with_weights(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: Causal = False,
    attn_mask: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    window: tuple[int, int] | None = None,
    softcap: float = 0.0,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`attention` (same arguments and output) that also returns the attention weights, as
    torch's nn.MultiheadAttention returns them with need_weights=True.

    Returns (out (B, Hq, Lq, Dv), weights (B, Hq, Lq, Lk) in q's dtype): the probabilities
    exactly as the kernel defined them (recomputed from its scores and lse), multiplied by this
    call's dropout mask and 1 / (1 - dropout_p); rows with no visible key are 0. Unlike
    `attention` this materialises (Lq, Lk) per head; differentiable in q, k (and the masks
    the reference differentiates).
    """
    out, lse, canonical = _attention(
        q,
        k,
        v,
        causal=causal,
        attn_mask=attn_mask,
        key_padding_mask=key_padding_mask,
        dropout_p=dropout_p,
        scale=scale,
        alibi_slopes=alibi_slopes,
        window=window,
        softcap=softcap,
        backend=backend,
    )
    return out, _weights(lse, canonical)


def _weights(lse: torch.Tensor, canonical: AttentionArgs) -> torch.Tensor:
    """The probabilities of a call with canonical arguments `canonical` and log-sum-exp `lse`.

    softmax(scores) rather than exp(scores - lse): in float32, exp(s - lse) carries the
    rounding of |lse| (about ulp(max score)) into every weight, 4-5x the error of torch's
    weights for scores of a few units, while the softmax subtracts the row maximum exactly.
    Empty rows are given zero scores before the softmax so that no NaN (exp(-inf + inf))
    exists even in the branch that is masked out: it would reach the gradients."""
    c = canonical
    s = ref.scores(
        c.q,
        c.k,
        c.attn_mask,
        c.key_padding_mask,
        c.alibi_slopes,
        c.scale,
        c.softcap,
        c.window_lo,
        c.window_hi,
    )
    empty = torch.isneginf(lse).unsqueeze(-1)
    probs = torch.softmax(s.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    p = c.dropout_p
    if p > 0.0:
        assert c.seed is not None  # drawn for every call with dropout
        probs = (
            probs
            * dropout_keep_mask(c.seed, tuple(probs.shape), p, probs.device)
            * (1.0 / (1.0 - p))
        )
    return probs.to(c.q.dtype)


def _attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: Causal = False,
    attn_mask: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    window: tuple[int, int] | None = None,
    softcap: float = 0.0,
    backend: str | None = None,
):
    """`attention` that also returns the canonical arguments every backend received:
    (out, lse, (q, k, v, attn_mask, key_padding_mask, alibi_slopes, scale, softcap, window_lo,
    window_hi, dropout_p, seed)), from which `_weights` recomputes the probabilities."""
    out, lse, args, _ = attention_band(
        q,
        k,
        v,
        causal=causal,
        attn_mask=attn_mask,
        key_padding_mask=key_padding_mask,
        dropout_p=dropout_p,
        scale=scale,
        alibi_slopes=alibi_slopes,
        window=window,
        softcap=softcap,
        backend=backend,
    )
    return out, lse, args


def attention_band(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: Causal = False,
    attn_mask: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    window: tuple[int, int] | None = None,
    softcap: float = 0.0,
    backend: str | None = None,
    seed: torch.Tensor | None = None,
    band: tuple[int, int] | None = None,
    keep: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    lse_needed: bool = True,
):
    """`attention` that also returns the canonical arguments every backend received and the
    backend that ran: (out, lse, args, backend), args = (q, k, v, attn_mask, key_padding_mask,
    alibi_slopes, scale, softcap, window_lo, window_hi, dropout_p, seed). `seed` fixes the
    dropout draw (default: drawn from torch's generator, as `attention` draws it).

    band: (window_lo, window_hi) given directly instead of `causal` and `window` (which must
        then be left at their defaults): key j is visible to query i iff
        i + window_lo <= j <= i + window_hi, any ints (+-2**30 = unbounded). Blocks of a longer
        sequence (context parallelism, fastattn.distributed) use it to place a global causal
        mask or window on a block whose queries and keys start at different positions; the
        public `window` cannot express a band that excludes the diagonal's own side.
    keep: an explicit dropout keep-mask (B, Hq, Lq, Lk) bool, for blocks of a longer matrix
        whose Philox numbering is the whole matrix's (`dropout_keep`); only the reference
        backend takes one (the kernels number a call's own elements), so backend must be None
        or "reference" and is then "reference".
    sinks: `attention`'s; (out, lse) then include them (the reference computes them in its
        math, the kernels' results go through `apply_sinks`), so a backward from the returned
        (out, lse) by `attention_backward_canonical` treats the sink as one more key block.
    lse_needed: whether the caller uses lse (False: `attention` without return_lse). The torch
        backend returns no lse (lse is then None), so it runs only calls that need none.
    `attention_backward_canonical(..., args, backend, keep=keep)` runs the matching backward.
    """
    op = "attention"
    if keep is not None:
        if backend not in (None, "reference"):
            raise ValueError(
                f"{op}: an explicit dropout keep-mask runs on the reference "
                f"backend only, got backend={backend!r}"
            )
        backend = "reference"
    q, k, v = _check_inputs(op, q, k, v)
    B, Hq, Lq, D = q.shape
    Lk = k.shape[2]
    if causal not in (False, True, "top_left", "bottom_right"):
        raise ValueError(
            f"{op}: causal must be False, True, 'top_left' or 'bottom_right', got {causal!r}"
        )
    if window is not None:
        if (
            not isinstance(window, (tuple, list))
            or len(window) != 2
            or not all(isinstance(w, int) and w >= -1 for w in window)
        ):
            raise ValueError(
                f"{op}: window must be None or (left, right) ints >= -1 "
                f"(-1 = unbounded), got {window!r}"
            )
    p = check_dropout(op, dropout_p)
    if scale is None:
        scale = 1.0 / math.sqrt(D)  # symbolic under torch.compile(dynamic=True): no check
    else:
        scale = float(scale)
        if not -math.inf < scale < math.inf:  # (math.isfinite does not trace: dynamic=True)
            raise ValueError(f"{op}: scale must be finite, got {scale}")
    softcap = float(softcap)
    if not 0.0 <= softcap < math.inf:
        raise ValueError(f"{op}: softcap must be >= 0 (0 = off), got {softcap}")
    mask = _canonical_mask(op, attn_mask, q, B, Hq, Lq, Lk)
    padding = _canonical_padding(op, key_padding_mask, q, B, Lk)
    alibi = _canonical_alibi(op, alibi_slopes, q, B, Hq)
    sinks = canonical_sinks(op, sinks, q, Hq)
    if band is None:
        window_lo, window_hi = window_bounds(causal, window, Lq, Lk)
    else:
        if causal is not False or window is not None:
            raise ValueError(f"{op}: band replaces causal and window; pass only one of them")
        window_lo = max(int(band[0]), -WINDOW_UNBOUNDED)
        window_hi = min(int(band[1]), WINDOW_UNBOUNDED)

    limits: dict[str, str] = {}
    if torch.is_grad_enabled() and alibi is not None and alibi.requires_grad:
        for name in ("cpu", "cuda", "triton"):
            limits[name] = (
                "gradients with respect to alibi_slopes are computed by the reference backend only"
            )
    # The canonical arguments; the dropout seed is drawn once the backend is chosen.
    args = AttentionArgs(
        q, k, v, mask, padding, alibi, scale, softcap, window_lo, window_hi, p, None
    )
    unsupported = aten_attention.unsupported(args, lse_needed=lse_needed, sinks=sinks is not None)
    if unsupported is not None:
        limits["torch"] = unsupported
    chosen = _backend.select_backend(
        op,
        q.device,
        backend,
        limits=limits,
        kernel="attention_forward",
        dtype=q.dtype,
        speed_key=attention_speed_key(q, k, v, mask, padding, window_lo, window_hi),
    )
    if seed is None:
        seed = dropout_seed(p, q.device)
    args = args._replace(seed=seed)
    if chosen == "torch":
        _backend.record_backend(op, chosen)
        return aten_attention.attention(args), None, args, chosen
    if chosen == "reference":
        out, lse = ref.attention(*args, keep=keep, sinks=sinks)
    else:
        out, lse = _op("attention_forward", chosen)(*args)
        if sinks is not None:
            out, lse = apply_sinks(out, lse, sinks, head_dim=1)
    _backend.record_backend(op, chosen)
    return out, lse, args, chosen


def attention_speed_key(q, k, v, mask, padding, window_lo, window_hi) -> tuple:
    """The call's key in the speed table (fastattn/speed_table.py), from canonical arguments:
    features "causal" (the top-left causal band alone), "band" (any other band: bottom-right
    causal, a window), "bool_mask" or "bias" (attn_mask), "padding", "gqa" (Hkv < Hq), "dv"
    (Dv != D); a gradient is needed when one of q, k, v requires grad under grad mode."""
    features = []
    unbounded_lo = window_lo <= -WINDOW_UNBOUNDED
    if unbounded_lo and window_hi == 0:
        features.append("causal")
    elif not (unbounded_lo and window_hi >= WINDOW_UNBOUNDED):
        features.append("band")
    if mask is not None:
        features.append("bool_mask" if mask.dtype == torch.bool else "bias")
    if padding is not None:
        features.append("padding")
    if k.shape[1] != q.shape[1]:
        features.append("gqa")
    if v.shape[3] != q.shape[3]:
        features.append("dv")
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    return speed_table.key(
        "attention",
        q.dtype,
        length=max(q.shape[2], k.shape[2]),
        head_dim=max(q.shape[3], v.shape[3]),
        features=tuple(features),
        grad=grad,
    )


def attention_backward_canonical(
    grad_out: torch.Tensor,
    grad_lse: torch.Tensor | None,
    out: torch.Tensor,
    lse: torch.Tensor,
    args: AttentionArgs | tuple,
    backend: str,
    keep: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashAttention's backward for one block of a longer row: (dq, dk, dv) of the canonical
    call `args` (from `attention_band`) given the row's final out (B, Hq, Lq, Dv) in q's dtype
    and lse (B, Hq, Lq) in lse's dtype, possibly merged over other key blocks. The
    probabilities are exp(s - lse) and the row term rowsum(grad_out * out) - grad_lse, so the
    gradients are the block's share of the gradients of the merged attention (ring attention's
    backward). keep: the forward's explicit dropout keep-mask (reference backend). No autograd
    graph is built (first-order only)."""
    if grad_out.stride(-1) != 1:
        grad_out = grad_out.contiguous()
    if out.stride(-1) != 1:
        out = out.contiguous()
    lse = lse.contiguous()
    if grad_lse is not None:
        grad_lse = grad_lse.contiguous()
    inputs = AttentionArgs(*args).backward_inputs(grad_out, grad_lse, out, lse)
    if backend == "reference":
        return ref.attention_backward(*inputs, keep=keep)
    return _op("attention_backward", backend)(*inputs, True)[:3]


def dropout_keep(seed: torch.Tensor, element: torch.Tensor, p: float) -> torch.Tensor:
    """fastattn's dropout decisions (True = keep) for logical element indices `element` (int64,
    any shape) of the stream keyed by `seed` (int64 (2,), as the ops draw it): a call numbers
    element ((b*Hq + h)*Lq + i)*Lk + j. For blocks of a longer matrix numbered as the whole."""
    return dropout_uniform(seed, element) >= p


def merge_attention(
    outs: Sequence[torch.Tensor], lses: Sequence[torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine attentions of the same queries over disjoint key sets.

    Used for split-K decoding and context parallelism: `out = sum_i exp(lse_i - lse) out_i` with
    `lse = logsumexp_i lse_i`. Parts with lse -inf (no visible key) contribute nothing; if all are
    -inf the result is 0 with lse -inf. Differentiable with respect to every out and lse.

    Args:
        outs: Partial outputs, each (..., Lq, Dv), of the same shape and dtype.
        lses: The log-sum-exp of each part, each (..., Lq), float (what
            `attention(..., return_lse=True)` returns).

    Returns:
        (out, lse): out (..., Lq, Dv) in `outs[0]`'s dtype; lse (..., Lq) float32 (float64 for
        float64 outs).

    Raises:
        ValueError: No parts, or parts whose shapes, dtypes or devices differ.
    """
    op = "merge_attention"
    if len(outs) == 0 or len(outs) != len(lses):
        raise ValueError(
            f"{op}: outs and lses must be non-empty sequences of the same length, "
            f"got {len(outs)} and {len(lses)}"
        )
    for i, (o, l) in enumerate(zip(outs, lses)):
        check_tensor(op, f"outs[{i}]", o, float_dtype=True)
        check_tensor(op, f"lses[{i}]", l, float_dtype=True)
        if o.shape != outs[0].shape or o.dtype != outs[0].dtype:
            raise ValueError(
                f"{op}: every out must match outs[0] ({tuple(outs[0].shape)}, "
                f"{outs[0].dtype}), got outs[{i}] {tuple(o.shape)}, {o.dtype}"
            )
        if tuple(l.shape) != tuple(o.shape[:-1]):
            raise ValueError(
                f"{op}: lses[{i}] must have shape {tuple(o.shape[:-1])} (outs "
                f"without the last dim), got {tuple(l.shape)}"
            )
        check_same_device(op, "outs[0]", outs[0], **{f"outs[{i}]": o, f"lses[{i}]": l})
    return ref.merge_attention(list(outs), list(lses))


# ---------------------------------------------------------------------------------------------
# Registration: fakes and autograd of the native ops and of their Triton twins, from the
# contract (fastattn/contracts/attention.py)


def _register() -> None:
    _backend.register_torch_op("attention")
    register_forward_backward(
        "attention_forward",
        "attention_backward",
        contract.forward_fake,
        contract.backward_fake,
        contract.autograd_formula,
        ref.attention,
        "attention",
    )


_register()
