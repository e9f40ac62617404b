"""Triton kernels of softmax attention (FlashAttention-2), forward and backward, registered as
torch ops fastattn::attention_forward_triton / attention_backward_triton.

Canonical arguments (fastattn/ops/attention.py builds them, fastattn/reference/attention.py
defines the result): q (B, Hq, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv) with any strides
and a unit last stride; query head h reads kv head h // (Hq // Hkv). Key j is visible to query
i iff i + window_lo <= j <= i + window_hi, the bool attn_mask allows it and the key is not
padding. Score pipeline: s = scale * q.k; softcap * tanh(s / softcap); - slope * |i + Lk - Lq - j|;
+ float attn_mask; hidden keys -> -inf.

Kernels:
- forward: one program per (BLOCK_M queries, batch * query head); online softmax over the key
  tiles that the window leaves visible (tiles entirely outside it are never loaded, which halves
  causal attention); saves lse (natural log) for the backward. INTERIOR (16-bit inputs without
  an attn_mask): the key tiles are walked in up to three stretches
  (attention_common.interior_key_range); the interior, whose every key is in range and visible
  to every row, is scored without a per-score band test or row mask, and only the edges of the
  band (a window's lower side, the causal diagonal, the last partial tile) test each score.
  LOG2 (16-bit inputs, no bias or cap, scale > 0): the scores stay raw products and the scale
  times log2(e) is folded into the exponent, one FFMA and one MUFU.EX2 per probability
  (FlashAttention-2's form; docs/design/attention_triton.md).
- backward (fastattn/triton/attention_backward.py, with its launcher `launch_backward`):
  `_bwd_preprocess` computes delta_i = rowsum(dO * O) - grad_lse_i; `_bwd_dkdv`
  owns BLOCK_N keys of one kv head and loops over every query head of its GQA group and the
  query tiles that can see those keys, so dK and dV are reduced in registers in a fixed order;
  `_bwd_dq` owns BLOCK_M queries and loops over the visible key tiles. Both recompute P from
  q, k and lse, in the forward's stretches and base. No atomics anywhere: the backward is
  bitwise reproducible.
- dropout draws element ((b*Hq + h)*Lq + i)*Lk + j of fastattn's Philox stream (as every other
  backend), so the backward regenerates the forward's mask; lse is that of undropped scores.
- VARLEN (constexpr): the same three kernels run packed sequences (fastattn/triton/
  varlen_attention.py): batch stride 0, each program reads its sequence's first rows and
  lengths from cu_seqlens (`varlen_sequence`), exits at once when its tile lies past them, derives
  the band from those lengths and numbers lse and dropout as the native varlen op
  (`row_base`, `dropout_rows`). The dense path is the same code with rows 0 and the call's
  lengths. The online-softmax step is shared with the KV-cache decode kernel (these device
  functions: fastattn/triton/attention_common.py).

Rows that see no key give out 0 and lse -inf: the running maximum is replaced by 0 while it is
-inf, so exp(-inf - -inf) never happens. On CUDA the tile sizes are autotuned per head-dim
class (smaller tiles above 128, so shared memory and registers fit on an H100); under the CPU
interpreter one tile shape is chosen from the lengths, inputs are upcast to float32 right after
loading bfloat16 (the interpreter's bfloat16 arithmetic is broken), P and dS are rounded to
bfloat16 by bit arithmetic where a GPU casts them for its tensor cores, and bfloat16 results go
through a float32 buffer that torch rounds.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from .._debug import poison
from ..contracts.attention import WINDOW_UNBOUNDED, check_seqlen, output_like
from . import dot_precision, finish, grid_x, interpreting, on_device, output_buffer
from ._common import LOG2_E
from .attention_backward import MaskGrad, launch_backward
from .attention_common import (
    dropout_rows,
    interior_key_range,
    key_range,
    key_tile,
    online_softmax_step,
    row_base,
    softmax_finish,
    tile_of_program,
    tile_scores,
    varlen_sequence,
)
from .attention_tuning import head_class, interpreter_block, length_class, tuned

# attn_mask kinds (constexpr MASK_KIND)
_NO_MASK, _BOOL_MASK, _FLOAT_MASK = 0, 1, 2

# ---------------------------------------------------------------------------------------------
# Forward (the device functions it shares with the backward and the KV-cache decode kernel:
# fastattn/triton/attention_common.py)


@triton.jit
def _fwd_key_tile(
    q,
    k_base,
    v_base,
    start_n,
    s_kn,
    s_vn,
    offs_m,
    offs_d,
    offs_dv,
    d_valid,
    dv_valid,
    row_element,
    b,
    h,
    Mask,
    s_mb,
    s_mh,
    s_mi,
    s_mj,
    Pad,
    slope,
    seq_q,
    seq_k,
    lo_w,
    hi_w,
    scale,
    softcap,
    log2_scale,
    Seed,
    threshold,
    keep_scale,
    m_i,
    l_i,
    acc,
    MASK_KIND: tl.constexpr,
    HAS_PAD: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ACCURATE_EXP: tl.constexpr,
    LOG2: tl.constexpr,
    BOUNDARY: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The forward's online softmax over keys [start_n, start_n + BLOCK_N): q (M, D) against
    the k (N, D) and v (N, Dv) tiles at k_base / v_base; returns (m_i, l_i, acc) updated.
    Without BOUNDARY the tile is interior (interior_key_range): its keys are loaded without a
    row mask and scored without the band test."""
    offs_n, k, v, qk = key_tile(
        q, k_base, v_base, start_n, s_kn, s_vn, offs_d, offs_dv, d_valid, dv_valid, seq_k,
        UPCAST, DOT_PRECISION, BOUNDARY, BLOCK_N,
    )  # fmt: skip
    _, s = tile_scores(
        qk, offs_m[:, None], offs_n[None, :], b, h, Mask, s_mb, s_mh, s_mi, s_mj, Pad, slope,
        seq_q, seq_k, lo_w, hi_w, scale, softcap, MASK_KIND, HAS_PAD, HAS_ALIBI, HAS_SOFTCAP,
        ACCURATE_EXP, LOG2, BOUNDARY,
    )  # fmt: skip
    return online_softmax_step(
        s,
        v,
        m_i,
        l_i,
        acc,
        Seed,
        row_element[:, None] + offs_n[None, :],
        threshold,
        keep_scale,
        log2_scale,
        HAS_DROPOUT,
        UPCAST,
        DOT_PRECISION,
        ACCURATE_EXP,
        LOG2,
    )


@triton.jit
def _fwd_kernel(
    Q,
    K,
    V,
    Mask,
    Pad,
    Alibi,
    Seed,
    Cu_q,
    Cu_k,
    Out,
    Lse,
    s_qb,
    s_qh,
    s_qm,
    s_kb,
    s_kh,
    s_kn,
    s_vb,
    s_vh,
    s_vn,
    s_ob,
    s_oh,
    s_om,
    s_mb,
    s_mh,
    s_mi,
    s_mj,
    s_ab,
    s_ah,
    Hq,
    GROUP,
    Lq,
    Lk,
    D,
    Dv,
    scale,
    softcap,
    window_lo,
    window_hi,
    total_q,
    causal_mode,
    threshold,
    keep_scale,
    LQ_CLASS,
    LK_CLASS,
    MASK_KIND: tl.constexpr,
    HAS_PAD: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ACCURATE_EXP: tl.constexpr,
    LOG2: tl.constexpr,
    LOWER_EDGE: tl.constexpr,
    INTERIOR: tl.constexpr,
    VARLEN: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """out and lse of BLOCK_M queries of head (b, h). Varlen: Lq/Lk are the largest lengths
    and the program exits at once when its tile lies past its sequence's queries."""
    start_m, bh = tile_of_program(Lq, BLOCK_M)
    b = bh // Hq
    h = bh % Hq
    kvh = h // GROUP
    q0, k0, seq_q, seq_k, lo_w, hi_w = varlen_sequence(
        Cu_q, Cu_k, b, Lq, Lk, window_lo, window_hi, causal_mode, VARLEN
    )
    if start_m >= seq_q:
        return
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_valid = offs_m < seq_q
    d_valid = offs_d < D
    dv_valid = offs_dv < Dv
    rows_m = (q0 + offs_m).to(tl.int64)[:, None]

    q = tl.load(
        Q + b * s_qb + h * s_qh + rows_m * s_qm + offs_d[None, :],
        mask=m_valid[:, None] & d_valid[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    k_base = K + b * s_kb + kvh * s_kh + k0 * s_kn
    v_base = V + b * s_vb + kvh * s_vh + k0 * s_vn
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(Alibi + b * s_ab + h * s_ah)
    drop0, drop_step = dropout_rows(b, h, q0, Hq, Lq, Lk, VARLEN)
    row_element = drop0 + offs_m.to(tl.int64) * drop_step  # dropout element of (i, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max of the scores
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    log2_scale = scale * LOG2_E  # LOG2: the scores in base 2
    lo, hi = key_range(start_m, seq_k, lo_w, hi_w, BLOCK_M, BLOCK_N)
    # Unless INTERIOR, every tile an edge tile (float32, masks: the stretches cost more than
    # they save).
    int_lo, int_hi = lo, lo
    # Three stretches of key tiles: the band's lower edge before the interior (compiled only for
    # a band with a lower side: its registers would count against the other two), the interior
    # (every key visible to every row: no per-score band test), the edge after it (the causal
    # diagonal, the last partial tile).
    if INTERIOR:
        int_lo, int_hi = interior_key_range(start_m, seq_k, lo_w, hi_w, lo, hi, BLOCK_M, BLOCK_N)
        if LOWER_EDGE:
            for start_n in range(lo, int_lo, BLOCK_N):
                m_i, l_i, acc = _fwd_key_tile(
                    q, k_base, v_base, start_n, s_kn, s_vn, offs_m, offs_d, offs_dv, d_valid,
                    dv_valid, row_element, b, h, Mask, s_mb, s_mh, s_mi, s_mj, Pad, slope, seq_q,
                    seq_k, lo_w, hi_w, scale, softcap, log2_scale, Seed, threshold, keep_scale, m_i,
                    l_i, acc, MASK_KIND, HAS_PAD, HAS_ALIBI, HAS_SOFTCAP, HAS_DROPOUT, UPCAST,
                    DOT_PRECISION, ACCURATE_EXP, LOG2, True, BLOCK_N,
                )  # fmt: skip
        for start_n in range(int_lo, int_hi, BLOCK_N):
            m_i, l_i, acc = _fwd_key_tile(
                q, k_base, v_base, start_n, s_kn, s_vn, offs_m, offs_d, offs_dv, d_valid, dv_valid,
                row_element, b, h, Mask, s_mb, s_mh, s_mi, s_mj, Pad, slope, seq_q, seq_k, lo_w,
                hi_w, scale, softcap, log2_scale, Seed, threshold, keep_scale, m_i, l_i, acc,
                MASK_KIND, HAS_PAD, HAS_ALIBI, HAS_SOFTCAP, HAS_DROPOUT, UPCAST, DOT_PRECISION,
                ACCURATE_EXP, LOG2, False, BLOCK_N,
            )  # fmt: skip
    for start_n in range(int_hi, hi, BLOCK_N):
        m_i, l_i, acc = _fwd_key_tile(
            q, k_base, v_base, start_n, s_kn, s_vn, offs_m, offs_d, offs_dv, d_valid, dv_valid,
            row_element, b, h, Mask, s_mb, s_mh, s_mi, s_mj, Pad, slope, seq_q, seq_k, lo_w, hi_w,
            scale, softcap, log2_scale, Seed, threshold, keep_scale, m_i, l_i, acc, MASK_KIND,
            HAS_PAD, HAS_ALIBI, HAS_SOFTCAP, HAS_DROPOUT, UPCAST, DOT_PRECISION, ACCURATE_EXP, LOG2,
            True, BLOCK_N,
        )  # fmt: skip

    if LOG2:
        m_i = m_i * scale  # the max of the raw products, as a natural-log score
    out, lse = softmax_finish(m_i, l_i, acc)
    tl.store(
        Out + b * s_ob + h * s_oh + (q0 + offs_m).to(tl.int64)[:, None] * s_om + offs_dv[None, :],
        out.to(Out.dtype.element_ty),
        mask=m_valid[:, None] & dv_valid[None, :],
    )
    tl.store(Lse + row_base(b, h, q0, Hq, Lq, total_q, VARLEN) + offs_m, lse, mask=m_valid)


# ---------------------------------------------------------------------------------------------
# Tile shapes (fastattn/triton/attention_tuning.py): autotuned copies of the kernels on CUDA


_FWD_TUNED = tuned(_fwd_kernel, "fwd")

_MAX_PACKED_ROWS = 2**31 - 1 - 1024  # 1024: more than any BLOCK_M of _bwd_preprocess


class Launch:
    """Everything the three main kernels share: pointers for optional tensors, strides,
    constexpr flags, and whether to launch the raw kernel (interpreter) or the tuned one.

    Dense: q (B, Hq, Lq, D), k/v (B, Hkv, Lk, D/Dv), window_lo/hi the band. Varlen (`varlen`
    = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal_mode)): q (total_q, Hq,
    D), k/v (total_k, Hkv, D/Dv), window_lo/hi the window's sides; B = len(cu_seqlens) - 1 and
    Lq/Lk are the largest lengths (the grid covers them; shorter sequences' tiles exit)."""

    def __init__(
        self,
        q,
        k,
        v,
        attn_mask,
        key_padding_mask,
        alibi_slopes,
        scale,
        softcap,
        window_lo,
        window_hi,
        dropout_p,
        seed,
        varlen=None,
    ):
        self.varlen = varlen is not None
        if self.varlen:
            cu_q, cu_k, max_q, max_k, causal_mode = varlen
            B, Hq, D = cu_q.numel() - 1, q.shape[1], q.shape[2]
            Hkv, Lq, Lk, Dv = k.shape[1], int(max_q), int(max_k), v.shape[2]
            total_q = q.shape[0]
        else:
            B, Hq, Lq, D = q.shape
            Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
            cu_q = cu_k = q  # unused pointers
            causal_mode, total_q = 0, 0
        # Offsets in the kernels are int32 within a sequence (tile starts plus window bounds).
        self.op = "varlen_attention" if self.varlen else "attention"
        check_seqlen(self.op, "max_seqlen_q" if self.varlen else "q's length (Lq)", Lq)
        check_seqlen(self.op, "max_seqlen_k" if self.varlen else "k's length (Lk)", Lk)
        if self.varlen and total_q > _MAX_PACKED_ROWS:
            # _bwd_preprocess tiles the packed rows with int32 offsets (start + BLOCK_M).
            raise ValueError(
                f"{self.op} (triton): total_q (q.shape[0]) must be <= "
                f"{_MAX_PACKED_ROWS} (int32 row offsets), got {total_q}"
            )
        self.shape = (B, Hq, Hkv, Lq, Lk, D, Dv)
        self.interpret = interpreting(q.device)
        if attn_mask is None:
            mask_kind, mask_arg, mask_strides = _NO_MASK, q, (0, 0, 0, 0)
        else:
            mask_kind = _BOOL_MASK if attn_mask.dtype == torch.bool else _FLOAT_MASK
            # 4-D with size-1 broadcast dims: read through the stride-0 view
            mask_arg, mask_strides = attn_mask, tuple(attn_mask.expand(B, Hq, Lq, Lk).stride())
        if alibi_slopes is None:
            alibi_arg, alibi_strides = q, (0, 0)
        else:
            alibi_arg, alibi_strides = alibi_slopes, tuple(alibi_slopes.stride())
        has_dropout = dropout_p > 0.0
        self.optional = (
            mask_arg,
            key_padding_mask if key_padding_mask is not None else q,
            alibi_arg,
            seed if has_dropout else q,
            cu_q,
            cu_k,
        )
        self.trailing_strides = mask_strides + alibi_strides
        # Triton passes floats as float32, which rounds p and 1/(1-p) exactly as the other
        # backends do.
        self.scalars = (
            Hq,
            Hq // Hkv,
            Lq,
            Lk,
            D,
            Dv,
            float(scale),
            float(softcap),
            int(window_lo),
            int(window_hi),
            int(total_q),
            int(causal_mode),
            float(dropout_p) if has_dropout else 0.0,
            1.0 / (1.0 - dropout_p) if has_dropout else 1.0,
            length_class(Lq),
            length_class(Lk),
        )
        block_d = max(16, triton.next_power_of_2(D))
        block_dv = max(16, triton.next_power_of_2(Dv))
        precision = dot_precision(q.dtype)
        self.meta = dict(
            MASK_KIND=mask_kind,
            HAS_PAD=key_padding_mask is not None,
            HAS_ALIBI=alibi_slopes is not None,
            HAS_SOFTCAP=softcap > 0.0,
            HAS_DROPOUT=has_dropout,
            UPCAST=self.interpret and q.dtype == torch.bfloat16,
            DOT_PRECISION=precision,
            ACCURATE_EXP=q.dtype == torch.float32 and not self.interpret,
            # 16-bit scores with neither a bias nor a cap: the scale folded into the exponent
            # (online_softmax_step), scale > 0 so that it keeps the maximum where it is.
            LOG2=q.dtype != torch.float32
            and mask_kind != _FLOAT_MASK
            and alibi_slopes is None
            and softcap <= 0.0
            and scale > 0.0,
            # Whether the band has a lower side, which cuts key tiles ahead of the interior
            # (interior_key_range) and query tiles after it (interior_query_range): a window.
            LOWER_EDGE=window_lo >= 0 if self.varlen else window_lo > -WINDOW_UNBOUNDED,
            # Walk the interior tiles apart (interior_key_range) for 16-bit inputs without an
            # attn_mask: float32's dots and a mask's loads dwarf the band test it saves, and
            # its extra loop spilled their registers (docs/design/attention_triton.md).
            INTERIOR=q.dtype != torch.float32 and mask_kind == _NO_MASK,
            VARLEN=self.varlen,
            BLOCK_D=block_d,
            BLOCK_DV=block_dv,
        )
        self.head_class = head_class(block_d, block_dv)
        self.fp32 = q.dtype == torch.float32
        self.interpreter_blocks = dict(BLOCK_M=interpreter_block(Lq), BLOCK_N=interpreter_block(Lk))

    def strides(self, t: torch.Tensor) -> tuple[int, int, int]:
        """(batch, head, row) strides of q, k, v or a tensor shaped like them: a packed
        (total, H, D) tensor has batch stride 0 (sequences are told apart by cu_seqlens)."""
        if self.varlen:
            return 0, t.stride(1), t.stride(0)
        return t.stride(0), t.stride(1), t.stride(2)

    def kernel(self, raw, tuned_copies):
        """(kernel, extra meta-parameters) for this device: `raw` with the interpreter's tile
        shape, or its autotuned copy (attention_tuning.tuned) for this dtype and head dims."""
        if self.interpret:
            return wrap_triton(raw), self.interpreter_blocks
        return wrap_triton(tuned_copies[(self.fp32, self.head_class)]), {}


# ---------------------------------------------------------------------------------------------
# The forward's launcher, shared by the dense ops (below) and the varlen ops (fastattn/triton/
# varlen_attention.py; the backward's: fastattn/triton/attention_backward.py)


def launch_forward(launch: Launch, q, k, v, out, lse) -> None:
    """Runs the forward kernel into out (shaped like q with Dv) and lse (float32, the op's
    layout); out may be a float32 buffer for bfloat16 under the interpreter."""
    B, Hq, Hkv, Lq, Lk, D, Dv = launch.shape
    if B * Hq * Lq == 0 or out.numel() == 0:
        return
    kernel, blocks = launch.kernel(_fwd_kernel, _FWD_TUNED)

    def grid(meta):
        return (
            grid_x(
                launch.op, "B * Hq * ceil(Lq / BLOCK_M)", B * Hq * triton.cdiv(Lq, meta["BLOCK_M"])
            ),
        )

    with on_device(q):
        kernel[grid](
            q,
            k,
            v,
            *launch.optional,
            out,
            lse,
            *launch.strides(q),
            *launch.strides(k),
            *launch.strides(v),
            *launch.strides(out),
            *launch.trailing_strides,
            *launch.scalars,
            **launch.meta,
            **blocks,
        )


# ---------------------------------------------------------------------------------------------
# Launchers of the torch ops fastattn::attention_forward_triton / attention_backward_triton
# (the schemas of the native ops in csrc/bindings.cpp; fastattn/ops/attention.py registers
# them with the contract of fastattn/contracts/attention.py)


def attention_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    scale: float,
    softcap: float,
    window_lo: int,
    window_hi: int,
    dropout_p: float,
    seed: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, Hq, Lq, Dv) in q's layout, lse (B, Hq, Lq) float32) of the canonical
    arguments (module docstring)."""
    launch = Launch(
        q,
        k,
        v,
        attn_mask,
        key_padding_mask,
        alibi_slopes,
        scale,
        softcap,
        window_lo,
        window_hi,
        dropout_p,
        seed,
    )
    B, Hq, Hkv, Lq, Lk, D, Dv = launch.shape
    wide = q.dtype == torch.bfloat16 and launch.interpret  # float32 buffer, rounded by torch
    out = poison(output_like(q, Dv, torch.float32 if wide else None))
    lse = poison(torch.empty((B, Hq, Lq), dtype=torch.float32, device=q.device))
    launch_forward(launch, q, k, v, out, lse)
    return finish(out, q.dtype), lse


def attention_backward(
    grad_out: torch.Tensor,
    grad_lse: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    attn_mask: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    scale: float,
    softcap: float,
    window_lo: int,
    window_hi: int,
    dropout_p: float,
    seed: torch.Tensor | None,
    deterministic: bool,
    mask_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv, d attn_mask), dq/dk/dv contiguous and shaped like q, k, v, of <out,
    grad_out> + <lse, grad_lse>; d attn_mask (mask_grad, a float mask) shaped like the mask,
    dS summed over its broadcast dims, else empty. dq, dk, dv never use atomics; d attn_mask
    does only for a mask broadcast over batches or kv heads with deterministic=False
    (MaskGrad), so a deterministic backward is bitwise reproducible."""
    launch = Launch(
        q,
        k,
        v,
        attn_mask,
        key_padding_mask,
        alibi_slopes,
        scale,
        softcap,
        window_lo,
        window_hi,
        dropout_p,
        seed,
    )
    dq, dk, dv = (output_buffer(t.shape, t.dtype, t.device) for t in (q, k, v))
    if mask_grad:
        if attn_mask is None or not attn_mask.dtype.is_floating_point:
            raise ValueError(
                "attention_backward (triton): mask_grad needs a float attn_mask "
                "(a bool mask has no gradient)"
            )
        dmask = MaskGrad(attn_mask, launch, deterministic)
    else:
        dmask = None
    if grad_out.shape[-1] > 1 and grad_out.stride(-1) != 1:
        grad_out = grad_out.contiguous()
    launch_backward(
        launch,
        grad_out,
        None if grad_lse is None else grad_lse.contiguous(),
        q,
        k,
        v,
        out,
        lse.contiguous(),
        dq,
        dk,
        dv,
        dmask,
    )
    return (
        finish(dq, q.dtype),
        finish(dk, k.dtype),
        finish(dv, v.dtype),
        dmask.result() if dmask is not None else q.new_empty((0,)),
    )
