"""Triton kernels of softmax attention's backward (FlashAttention-2: `_bwd_preprocess`,
`_bwd_dkdv_kernel`, `_bwd_dq_kernel`, described in fastattn/triton/attention.py's docstring)
and their launcher `launch_backward`, which the dense op (fastattn/triton/attention.py) and the
varlen op (fastattn/triton/varlen_attention.py) share, with `MaskGrad`, the gradient buffer of
a learned float attn_mask. The launch plan (`Launch`) is the forward's module's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from . import grid_x, on_device
from ._common import LOG2_E, exp, exp2_flushed
from .attention_common import (
    dropout_rows,
    interior_key_range,
    interior_query_range,
    key_range,
    key_tile,
    operand,
    query_range,
    row_base,
    tile_of_program,
    tile_scores,
    varlen_sequence,
)
from .attention_tuning import tuned
from .random import dropout_multiplier

if TYPE_CHECKING:
    from .attention import Launch

# ---------------------------------------------------------------------------------------------
# Backward


@triton.jit
def _bwd_preprocess(
    Out,
    DO,
    GradLse,
    Delta,
    s_ob,
    s_oh,
    s_om,
    s_dob,
    s_doh,
    s_dom,
    Hq,
    Lq,
    Dv,
    HAS_GRAD_LSE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """delta_i = rowsum(dO_i * O_i) - grad_lse_i, so that dS = P * (dP - delta) also carries
    the gradient of lse (d lse_i / d s_ij = P_ij). Rows are (B, Hq, Lq) with delta laid out as
    lse; varlen launches it as one batch of total_q rows (Hq, total_q), no per-sequence work."""
    start_m, bh = tile_of_program(Lq, BLOCK_M)
    b = bh // Hq
    h = bh % Hq
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_valid = offs_m < Lq
    mask = m_valid[:, None] & (offs_dv < Dv)[None, :]
    rows = offs_m.to(tl.int64)[:, None]
    o = tl.load(
        Out + b * s_ob + h * s_oh + rows * s_om + offs_dv[None, :], mask=mask, other=0.0
    ).to(tl.float32)
    do = tl.load(
        DO + b * s_dob + h * s_doh + rows * s_dom + offs_dv[None, :], mask=mask, other=0.0
    ).to(tl.float32)
    delta = tl.sum(o * do, 1)
    if HAS_GRAD_LSE:
        delta -= tl.load(GradLse + bh * Lq + offs_m, mask=m_valid, other=0.0).to(tl.float32)
    tl.store(Delta + bh * Lq + offs_m, delta, mask=m_valid)


@triton.jit
def _add_mask_grad(
    base, dsT, offs_m, offs_n, m_valid, n_valid, s_gi, s_gj, MODE: tl.constexpr, SUM_Q: tl.constexpr
):
    """Adds the (keys, queries) tile dsT to d attn_mask at base + i * s_gi + j * s_gj (the
    modes of _bwd_dkdv_kernel's BIAS_GRAD)."""
    if SUM_Q:
        vals = tl.sum(tl.where(m_valid[None, :], dsT, 0.0), axis=1)
        ptr = base + offs_n.to(tl.int64) * s_gj
        ok = n_valid
    else:
        vals = dsT
        ptr = base + offs_m.to(tl.int64)[None, :] * s_gi + offs_n.to(tl.int64)[:, None] * s_gj
        ok = n_valid[:, None] & m_valid[None, :]
    if MODE == 1:
        tl.store(ptr, vals, mask=ok)
    elif MODE == 2:
        tl.store(ptr, tl.load(ptr, mask=ok, other=0.0) + vals, mask=ok)
    else:
        tl.atomic_add(ptr, vals, mask=ok)


@triton.jit
def _dkdv_query_tile(
    k,
    v,
    dk,
    dv,
    q_base,
    do_base,
    s_qm,
    s_dom,
    start_m,
    Lse,
    Delta,
    row0,
    drop0,
    drop_step,
    offs_n,
    n_valid,
    offs_d,
    offs_dv,
    d_valid,
    dv_valid,
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
    DMask,
    s_gb,
    s_gh,
    s_gi,
    s_gj,
    MASK_KIND: tl.constexpr,
    HAS_PAD: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    HAS_DROPOUT: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ACCURATE_EXP: tl.constexpr,
    LOG2: tl.constexpr,
    BIAS_GRAD: tl.constexpr,
    BIAS_SUM_Q: tl.constexpr,
    BOUNDARY: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """(dk, dv) (N, D) and (N, Dv), float32, dk unscaled, plus the contributions of queries
    [start_m, start_m + BLOCK_M) of head (b, h) to the keys k (N, D) and values v (N, Dv) of
    this tile; d attn_mask's share with BIAS_GRAD. Without BOUNDARY the query tile is interior
    (interior_query_range): no band test."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    m_valid = offs_m < seq_q  # rows past the queries load as zeros: P dO and dS q add 0
    cols_m = offs_m.to(tl.int64)
    qT = tl.load(
        q_base + cols_m[None, :] * s_qm + offs_d[:, None],
        mask=m_valid[None, :] & d_valid[:, None],
        other=0.0,
    )
    do = tl.load(
        do_base + cols_m[:, None] * s_dom + offs_dv[None, :],
        mask=m_valid[:, None] & dv_valid[None, :],
        other=0.0,
    )
    if UPCAST:
        qT = qT.to(tl.float32)
        do = do.to(tl.float32)
    lse = tl.load(Lse + row0 + offs_m, mask=m_valid, other=0.0)
    # Rows without a visible key have lse -inf and only -inf scores: use
    # +inf so that their P is exp(-inf) = 0 rather than NaN.
    lse = tl.where(lse == float("-inf"), float("inf"), lse)
    if LOG2:
        lse = lse * LOG2_E  # in base 2, as the scores
    delta = tl.load(Delta + row0 + offs_m, mask=m_valid, other=0.0)
    qkT = tl.dot(k, qT, input_precision=DOT_PRECISION)
    sT, sT_masked = tile_scores(
        qkT, offs_m[None, :], offs_n[:, None], b, h, Mask, s_mb, s_mh, s_mi, s_mj, Pad, slope,
        seq_q, seq_k, lo_w, hi_w, scale, softcap, MASK_KIND, HAS_PAD, HAS_ALIBI, HAS_SOFTCAP,
        ACCURATE_EXP, LOG2, BOUNDARY,
    )  # fmt: skip
    if LOG2:
        pT = exp2_flushed(sT_masked * log2_scale - lse[None, :])
    else:
        pT = exp(sT_masked - lse[None, :], ACCURATE_EXP)
    dpT = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
    if HAS_DROPOUT:
        zT = dropout_multiplier(
            Seed,
            drop0 + cols_m[None, :] * drop_step + offs_n[:, None],
            threshold,
            keep_scale,
        )
        dv += tl.dot(operand(pT * zT, do, UPCAST), do, input_precision=DOT_PRECISION)
        dpT = dpT * zT
    else:
        dv += tl.dot(operand(pT, do, UPCAST), do, input_precision=DOT_PRECISION)
    dsT = pT * (dpT - delta[None, :])
    if BIAS_GRAD != 0:
        _add_mask_grad(
            # b is int64 (from the program id): 64-bit offsets
            DMask + b * s_gb + (b * 0 + h) * s_gh,
            dsT,
            offs_m,
            offs_n,
            m_valid,
            n_valid,
            s_gi,
            s_gj,
            BIAS_GRAD,
            BIAS_SUM_Q,
        )
    if HAS_SOFTCAP:
        t = sT / softcap
        dsT = dsT * (1.0 - t * t)
    dk += tl.dot(operand(dsT, qT, UPCAST), tl.trans(qT), input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    Lse,
    Delta,
    Mask,
    Pad,
    Alibi,
    Seed,
    Cu_q,
    Cu_k,
    DK,
    DV,
    DMask,
    s_qb,
    s_qh,
    s_qm,
    s_kb,
    s_kh,
    s_kn,
    s_vb,
    s_vh,
    s_vn,
    s_dob,
    s_doh,
    s_dom,
    s_dkb,
    s_dkh,
    s_dkn,
    s_dvb,
    s_dvh,
    s_dvn,
    s_mb,
    s_mh,
    s_mi,
    s_mj,
    s_ab,
    s_ah,
    s_gb,
    s_gh,
    s_gi,
    s_gj,
    loop_b,
    loop_h,
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
    BIAS_GRAD: tl.constexpr,
    BIAS_SUM_Q: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """dK, dV for BLOCK_N keys of kv head (b, kvh), summed over the GROUP query heads that
    share it. Scores are computed transposed, (keys, queries), so that every product is a
    plain tl.dot with one transposed operand (as in Triton's fused-attention tutorial).
    Varlen: tiles past the sequence's keys exit at once; a sequence without queries writes
    dK = dV = 0 for its keys.

    d attn_mask (BIAS_GRAD != 0): dS of the biased scores (before the softcap's factor) goes
    to DMask (float32, the mask's shape) addressed through s_g* (0 along broadcast dims):
    BIAS_GRAD 1 stores (each element is visited once), 2 adds by read-modify-write (this
    program owns the elements: it walks `loop_b` batches and `loop_h` kv heads, the mask's
    broadcast dims, so the sum has a fixed order), 3 adds atomically (broadcast dims split
    across programs; not reproducible). BIAS_SUM_Q: the mask broadcasts over queries, so a
    tile's dS is summed over its queries first."""
    start_n, pair = tile_of_program(Lk, BLOCK_N)
    Hkv = Hq // GROUP
    pairs_h = Hkv // loop_h
    b_first = (pair // pairs_h) * loop_b
    kvh_first = (pair % pairs_h) * loop_h
    # One (b, kv head) pair, or loop_b x loop_h of them when this program owns d mask's
    # elements along the mask's broadcast dims (BIAS_GRAD 2).
    for b in range(b_first, b_first + loop_b):
        for kvh in range(kvh_first, kvh_first + loop_h):
            q0, k0, seq_q, seq_k, lo_w, hi_w = varlen_sequence(
                Cu_q, Cu_k, b, Lq, Lk, window_lo, window_hi, causal_mode, VARLEN
            )
            if start_n < seq_k:
                offs_n = start_n + tl.arange(0, BLOCK_N)
                offs_d = tl.arange(0, BLOCK_D)
                offs_dv = tl.arange(0, BLOCK_DV)
                n_valid = offs_n < seq_k
                d_valid = offs_d < D
                dv_valid = offs_dv < Dv
                rows_n = (k0 + offs_n).to(tl.int64)[:, None]
                k = tl.load(
                    K + b * s_kb + kvh * s_kh + rows_n * s_kn + offs_d[None, :],
                    mask=n_valid[:, None] & d_valid[None, :],
                    other=0.0,
                )
                v = tl.load(
                    V + b * s_vb + kvh * s_vh + rows_n * s_vn + offs_dv[None, :],
                    mask=n_valid[:, None] & dv_valid[None, :],
                    other=0.0,
                )
                if UPCAST:
                    k = k.to(tl.float32)
                    v = v.to(tl.float32)
                log2_scale = scale * LOG2_E  # LOG2: the scores in base 2
                dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
                dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
                lo, hi = query_range(start_n, seq_q, lo_w, hi_w, BLOCK_M, BLOCK_N)
                if INTERIOR:
                    int_lo, int_hi = interior_query_range(
                        start_n, lo_w, hi_w, lo, hi, BLOCK_M, BLOCK_N
                    )
                else:  # every tile an edge tile (_fwd_kernel)
                    int_lo, int_hi = hi, hi
                for g in range(0, GROUP):
                    h = kvh * GROUP + g
                    row0 = row_base(b, h, q0, Hq, Lq, total_q, VARLEN)
                    drop0, drop_step = dropout_rows(b, h, q0, Hq, Lq, Lk, VARLEN)
                    slope = 0.0
                    if HAS_ALIBI:
                        slope = tl.load(Alibi + b * s_ab + h * s_ah)
                    q_base = Q + b * s_qb + h * s_qh + q0 * s_qm
                    do_base = DO + b * s_dob + h * s_doh + q0 * s_dom
                    # The forward's three stretches (_fwd_kernel), over query tiles here: the
                    # causal diagonal, the interior, the window's lower edge.
                    for start_m in range(lo, int_lo, BLOCK_M):
                        dk, dv = _dkdv_query_tile(
                            k, v, dk, dv, q_base, do_base, s_qm, s_dom, start_m, Lse, Delta, row0,
                            drop0, drop_step, offs_n, n_valid, offs_d, offs_dv, d_valid, dv_valid,
                            b, h, Mask, s_mb, s_mh, s_mi, s_mj, Pad, slope, seq_q, seq_k, lo_w,
                            hi_w, scale, softcap, log2_scale, Seed, threshold, keep_scale, DMask,
                            s_gb, s_gh, s_gi, s_gj, MASK_KIND, HAS_PAD, HAS_ALIBI, HAS_SOFTCAP,
                            HAS_DROPOUT, UPCAST, DOT_PRECISION, ACCURATE_EXP, LOG2, BIAS_GRAD,
                            BIAS_SUM_Q, True, BLOCK_M,
                        )  # fmt: skip
                    if INTERIOR:
                        for start_m in range(int_lo, int_hi, BLOCK_M):
                            dk, dv = _dkdv_query_tile(
                                k, v, dk, dv, q_base, do_base, s_qm, s_dom, start_m, Lse, Delta,
                                row0, drop0, drop_step, offs_n, n_valid, offs_d, offs_dv, d_valid,
                                dv_valid, b, h, Mask, s_mb, s_mh, s_mi, s_mj, Pad, slope, seq_q,
                                seq_k, lo_w, hi_w, scale, softcap, log2_scale, Seed, threshold,
                                keep_scale, DMask, s_gb, s_gh, s_gi, s_gj, MASK_KIND, HAS_PAD,
                                HAS_ALIBI, HAS_SOFTCAP, HAS_DROPOUT, UPCAST, DOT_PRECISION,
                                ACCURATE_EXP, LOG2, BIAS_GRAD, BIAS_SUM_Q, False, BLOCK_M,
                            )  # fmt: skip
                    if LOWER_EDGE:
                        for start_m in range(int_hi, hi, BLOCK_M):
                            dk, dv = _dkdv_query_tile(
                                k, v, dk, dv, q_base, do_base, s_qm, s_dom, start_m, Lse, Delta,
                                row0, drop0, drop_step, offs_n, n_valid, offs_d, offs_dv, d_valid,
                                dv_valid, b, h, Mask, s_mb, s_mh, s_mi, s_mj, Pad, slope, seq_q,
                                seq_k, lo_w, hi_w, scale, softcap, log2_scale, Seed, threshold,
                                keep_scale, DMask, s_gb, s_gh, s_gi, s_gj, MASK_KIND, HAS_PAD,
                                HAS_ALIBI, HAS_SOFTCAP, HAS_DROPOUT, UPCAST, DOT_PRECISION,
                                ACCURATE_EXP, LOG2, BIAS_GRAD, BIAS_SUM_Q, True, BLOCK_M,
                            )  # fmt: skip
                dk = dk * scale
                tl.store(
                    DK + b * s_dkb + kvh * s_dkh + rows_n * s_dkn + offs_d[None, :],
                    dk.to(DK.dtype.element_ty),
                    mask=n_valid[:, None] & d_valid[None, :],
                )
                tl.store(
                    DV + b * s_dvb + kvh * s_dvh + rows_n * s_dvn + offs_dv[None, :],
                    dv.to(DV.dtype.element_ty),
                    mask=n_valid[:, None] & dv_valid[None, :],
                )


@triton.jit
def _dq_key_tile(
    q,
    do,
    lse,
    delta,
    dq,
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
    """dq (M, D, float32, unscaled) plus dS @ k over keys [start_n, start_n + BLOCK_N), from q
    (M, D), do (M, Dv) and the rows' lse (base 2 with LOG2) and delta. Without BOUNDARY the
    tile is interior (interior_key_range): no row mask on its loads, no band test."""
    offs_n, k, v, qk = key_tile(
        q, k_base, v_base, start_n, s_kn, s_vn, offs_d, offs_dv, d_valid, dv_valid, seq_k,
        UPCAST, DOT_PRECISION, BOUNDARY, BLOCK_N,
    )  # fmt: skip
    s, s_masked = tile_scores(
        qk, offs_m[:, None], offs_n[None, :], b, h, Mask, s_mb, s_mh, s_mi, s_mj, Pad, slope,
        seq_q, seq_k, lo_w, hi_w, scale, softcap, MASK_KIND, HAS_PAD, HAS_ALIBI, HAS_SOFTCAP,
        ACCURATE_EXP, LOG2, BOUNDARY,
    )  # fmt: skip
    if LOG2:
        p = exp2_flushed(s_masked * log2_scale - lse[:, None])
    else:
        p = exp(s_masked - lse[:, None], ACCURATE_EXP)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    if HAS_DROPOUT:
        dp = dp * dropout_multiplier(
            Seed, row_element[:, None] + offs_n[None, :], threshold, keep_scale
        )
    ds = p * (dp - delta[:, None])
    if HAS_SOFTCAP:
        t = s / softcap
        ds = ds * (1.0 - t * t)
    return dq + tl.dot(operand(ds, k, UPCAST), k, input_precision=DOT_PRECISION)


@triton.jit
def _bwd_dq_kernel(
    Q,
    K,
    V,
    DO,
    Lse,
    Delta,
    Mask,
    Pad,
    Alibi,
    Seed,
    Cu_q,
    Cu_k,
    DQ,
    s_qb,
    s_qh,
    s_qm,
    s_kb,
    s_kh,
    s_kn,
    s_vb,
    s_vh,
    s_vn,
    s_dob,
    s_doh,
    s_dom,
    s_dqb,
    s_dqh,
    s_dqm,
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
    """dQ for BLOCK_M queries of head (b, h), over the key tiles they can see."""
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
    do = tl.load(
        DO + b * s_dob + h * s_doh + rows_m * s_dom + offs_dv[None, :],
        mask=m_valid[:, None] & dv_valid[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
        do = do.to(tl.float32)
    row0 = row_base(b, h, q0, Hq, Lq, total_q, VARLEN)
    lse = tl.load(Lse + row0 + offs_m, mask=m_valid, other=0.0)
    lse = tl.where(lse == float("-inf"), float("inf"), lse)  # see _bwd_dkdv_kernel
    log2_scale = scale * LOG2_E  # LOG2: the scores in base 2
    if LOG2:
        lse = lse * LOG2_E
    delta = tl.load(Delta + row0 + offs_m, mask=m_valid, other=0.0)
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(Alibi + b * s_ab + h * s_ah)
    k_base = K + b * s_kb + kvh * s_kh + k0 * s_kn
    v_base = V + b * s_vb + kvh * s_vh + k0 * s_vn
    drop0, drop_step = dropout_rows(b, h, q0, Hq, Lq, Lk, VARLEN)
    row_element = drop0 + offs_m.to(tl.int64) * drop_step

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    lo, hi = key_range(start_m, seq_k, lo_w, hi_w, BLOCK_M, BLOCK_N)
    int_lo, int_hi = lo, lo  # unless INTERIOR, every tile an edge tile (_fwd_kernel)
    # The forward's three stretches of key tiles (_fwd_kernel): the interior without band tests.
    if INTERIOR:
        int_lo, int_hi = interior_key_range(start_m, seq_k, lo_w, hi_w, lo, hi, BLOCK_M, BLOCK_N)
        if LOWER_EDGE:
            for start_n in range(lo, int_lo, BLOCK_N):
                dq = _dq_key_tile(
                    q, do, lse, delta, dq, k_base, v_base, start_n, s_kn, s_vn, offs_m, offs_d,
                    offs_dv, d_valid, dv_valid, row_element, b, h, Mask, s_mb, s_mh, s_mi, s_mj,
                    Pad, slope, seq_q, seq_k, lo_w, hi_w, scale, softcap, log2_scale, Seed,
                    threshold, keep_scale, MASK_KIND, HAS_PAD, HAS_ALIBI, HAS_SOFTCAP, HAS_DROPOUT,
                    UPCAST, DOT_PRECISION, ACCURATE_EXP, LOG2, True, BLOCK_N,
                )  # fmt: skip
        for start_n in range(int_lo, int_hi, BLOCK_N):
            dq = _dq_key_tile(
                q, do, lse, delta, dq, k_base, v_base, start_n, s_kn, s_vn, offs_m, offs_d, offs_dv,
                d_valid, dv_valid, row_element, b, h, Mask, s_mb, s_mh, s_mi, s_mj, Pad, slope,
                seq_q, seq_k, lo_w, hi_w, scale, softcap, log2_scale, Seed, threshold, keep_scale,
                MASK_KIND, HAS_PAD, HAS_ALIBI, HAS_SOFTCAP, HAS_DROPOUT, UPCAST, DOT_PRECISION,
                ACCURATE_EXP, LOG2, False, BLOCK_N,
            )  # fmt: skip
    for start_n in range(int_hi, hi, BLOCK_N):
        dq = _dq_key_tile(
            q, do, lse, delta, dq, k_base, v_base, start_n, s_kn, s_vn, offs_m, offs_d, offs_dv,
            d_valid, dv_valid, row_element, b, h, Mask, s_mb, s_mh, s_mi, s_mj, Pad, slope, seq_q,
            seq_k, lo_w, hi_w, scale, softcap, log2_scale, Seed, threshold, keep_scale, MASK_KIND,
            HAS_PAD, HAS_ALIBI, HAS_SOFTCAP, HAS_DROPOUT, UPCAST, DOT_PRECISION, ACCURATE_EXP, LOG2,
            True, BLOCK_N,
        )  # fmt: skip
    dq = dq * scale
    tl.store(
        DQ + b * s_dqb + h * s_dqh + rows_m * s_dqm + offs_d[None, :],
        dq.to(DQ.dtype.element_ty),
        mask=m_valid[:, None] & d_valid[None, :],
    )


# ---------------------------------------------------------------------------------------------
# Tile shapes (fastattn/triton/attention_tuning.py): autotuned copies of the kernels on CUDA


_DKDV_TUNED = tuned(_bwd_dkdv_kernel, "dkdv", reset_to_zero=["DMask"])
_DQ_TUNED = tuned(_bwd_dq_kernel, "dq")


# ---------------------------------------------------------------------------------------------
# The launcher shared by the dense op and the varlen op


class MaskGrad:
    """d attn_mask of a dense call: a zeroed float32 (float64 for a float64 mask) buffer shaped
    like the mask, except that a mask broadcast over keys gets its key dim materialised (and
    summed by torch at the end: such a bias is softmax-invariant, a rare case), and how the
    dK/dV kernel adds to it (its BIAS_GRAD modes).

    deterministic: a program walks the batches (a mask shared by the batch, T5/Swin) and the
    kv heads (a mask shared by the heads, AlphaFold's pair bias) its elements gather, so
    every element is summed by one program in a fixed order (fewer, longer programs: the grid
    shrinks by those factors). Otherwise those dims are split across programs that add
    atomically (full grid; the float sums' order varies)."""

    def __init__(self, attn_mask: torch.Tensor, launch: Launch, deterministic: bool):
        B, Hq, Hkv, Lq, Lk, _, _ = launch.shape
        mB, mH, mQ, mK = attn_mask.shape
        self.sum_k = mK == 1 and Lk > 1
        dtype = torch.float64 if attn_mask.dtype == torch.float64 else torch.float32
        self.dtype = attn_mask.dtype
        self.buffer = torch.zeros(
            (mB, mH, mQ, Lk if self.sum_k else mK), dtype=dtype, device=attn_mask.device
        )
        view = self.buffer.expand(B, Hq, Lq, Lk)
        self.strides = tuple(view.stride())
        across_b = mB == 1 and B > 1
        across_h = mH == 1 and Hkv > 1
        self.sum_q = mQ == 1 and Lq > 1
        within = (mH == 1 and Hq > Hkv) or self.sum_q  # sums inside one program
        if (across_b or across_h) and not deterministic:
            self.mode, self.loop_b, self.loop_h = 3, 1, 1
        else:
            self.loop_b = B if across_b else 1
            self.loop_h = Hkv if across_h else 1
            self.mode = 2 if (across_b or across_h or within) else 1

    def result(self) -> torch.Tensor:
        g = self.buffer.sum(3, keepdim=True) if self.sum_k else self.buffer
        return g.to(self.dtype)


def launch_backward(
    launch: Launch, grad_out, grad_lse, q, k, v, out, lse, dq, dk, dv, mask_grad=None
) -> None:
    """Runs the backward kernels into dq, dk, dv (shaped like q, k, v; float32 buffers for
    bfloat16 under the interpreter) and, with mask_grad (a MaskGrad), d attn_mask. grad_out
    has a unit last stride; lse and grad_lse (or None) are contiguous in the op's lse layout."""
    B, Hq, Hkv, Lq, Lk, D, Dv = launch.shape
    total_q = q.shape[0] if launch.varlen else B * Lq
    delta = torch.empty(lse.shape, dtype=torch.float32, device=q.device)
    has_grad_lse = grad_lse is not None
    grad_lse_arg = grad_lse if has_grad_lse else lse
    common = (q, k, v, grad_out, lse, delta, *launch.optional)
    q_k_v_do_strides = (
        *launch.strides(q),
        *launch.strides(k),
        *launch.strides(v),
        *launch.strides(grad_out),
    )
    with on_device(q):
        if Hq * total_q > 0:
            block_dv = launch.meta["BLOCK_DV"]
            pre_m = max(16, 8192 // block_dv)  # 64 float32 registers a thread per tile
            # delta has lse's layout: (B, Hq, Lq) dense; varlen's (Hq, total_q) is the same
            # loop over one batch of total_q rows (batch stride 0), with no per-sequence work.
            pre_b, pre_l = (1, total_q) if launch.varlen else (B, Lq)
            pre_grid = grid_x(
                launch.op, "B * Hq * ceil(Lq / BLOCK_M)", pre_b * Hq * triton.cdiv(pre_l, pre_m)
            )
            wrap_triton(_bwd_preprocess)[(pre_grid,)](
                out,
                grad_out,
                grad_lse_arg,
                delta,
                *launch.strides(out),
                *launch.strides(grad_out),
                Hq,
                pre_l,
                Dv,
                HAS_GRAD_LSE=has_grad_lse,
                BLOCK_M=pre_m,
                BLOCK_DV=block_dv,
            )

            kernel, blocks = launch.kernel(_bwd_dq_kernel, _DQ_TUNED)

            def dq_grid(meta):
                return (
                    grid_x(
                        launch.op,
                        "B * Hq * ceil(Lq / BLOCK_M)",
                        B * Hq * triton.cdiv(Lq, meta["BLOCK_M"]),
                    ),
                )

            kernel[dq_grid](
                *common,
                dq,
                *q_k_v_do_strides,
                *launch.strides(dq),
                *launch.trailing_strides,
                *launch.scalars,
                **launch.meta,
                **blocks,
            )
        if B * Hkv * Lk > 0 and k.numel() > 0:
            kernel, blocks = launch.kernel(_bwd_dkdv_kernel, _DKDV_TUNED)

            if mask_grad is None:
                dmask, dmask_strides, loops = dk.new_empty(1, dtype=torch.float32), (0,) * 4, (1, 1)
                bias = dict(BIAS_GRAD=0, BIAS_SUM_Q=False)
            else:
                dmask, dmask_strides = mask_grad.buffer, mask_grad.strides
                loops = (mask_grad.loop_b, mask_grad.loop_h)
                bias = dict(BIAS_GRAD=mask_grad.mode, BIAS_SUM_Q=mask_grad.sum_q)
            pairs = (B // loops[0]) * (Hkv // loops[1])

            def dkdv_grid(meta):
                return (
                    grid_x(
                        launch.op,
                        "B * Hkv * ceil(Lk / BLOCK_N)",
                        pairs * triton.cdiv(Lk, meta["BLOCK_N"]),
                    ),
                )

            kernel[dkdv_grid](
                *common,
                dk,
                dv,
                dmask,
                *q_k_v_do_strides,
                *launch.strides(dk),
                *launch.strides(dv),
                *launch.trailing_strides,
                *dmask_strides,
                *loops,
                *launch.scalars,
                **launch.meta,
                **bias,
                **blocks,
            )
