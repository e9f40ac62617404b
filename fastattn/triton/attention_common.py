"""Device functions shared by the Triton kernels of softmax attention: the dense and varlen
kernels (fastattn/triton/attention.py) and the KV-cache decode kernel
(fastattn/triton/attention_with_kvcache.py). The score pipeline (scale, softcap, ALiBi, masks,
band), the key and query tile ranges a band leaves visible, where a packed (varlen) sequence
lives, and the online-softmax step and finish. Device functions shared by every op's kernels
are in fastattn/triton/_common.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import exp, exp2_flushed, round_to_bfloat16, tanh
from .random import dropout_multiplier

# ---------------------------------------------------------------------------------------------
# Scores and tile ranges


@triton.jit
def operand(x, other, UPCAST: tl.constexpr):
    """x (float32) as the left operand of a tl.dot with `other`: in other's dtype, as
    FlashAttention does (16-bit P and dS feed the tensor cores). Under the interpreter with
    bfloat16 inputs (UPCAST: everything is held in float32 there) x is rounded to the nearest
    bfloat16 by bit arithmetic instead, since the interpreter's own conversion truncates; the
    CPU run then rounds exactly where a GPU does."""
    if UPCAST:
        return round_to_bfloat16(x)
    else:
        return x.to(other.dtype)


@triton.jit
def capped_scores(qk, scale, softcap, HAS_SOFTCAP: tl.constexpr, ACCURATE: tl.constexpr):
    """scale * q.k, soft-capped: softcap * tanh(s / softcap)."""
    s = qk * scale
    if HAS_SOFTCAP:
        s = softcap * tanh(s / softcap, ACCURATE)
    return s


@triton.jit
def biased_masked_scores(
    s,
    i,
    j,
    b,
    h,
    mask_ptr,
    s_mb,
    s_mh,
    s_mi,
    s_mj,
    pad_ptr,
    slope,
    Lq,
    Lk,
    shift,
    window_lo,
    window_hi,
    MASK_KIND: tl.constexpr,
    HAS_PAD: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    BOUNDARY: tl.constexpr,
):
    """Adds ALiBi and the float mask to the (capped) scores s and sets hidden keys to -inf.

    i (query indices) and j (key indices) broadcast to s's shape in either orientation
    ((M, 1) x (1, N) in the forward and dQ kernels, (1, M) x (N, 1) in the dK/dV kernel).
    Query i sits at key position i + shift (Lk - Lq, or a KV cache's length before the new
    tokens), which is the ALiBi distance's origin. slope is a scalar or broadcasts like i.
    Out-of-range rows and columns are hidden too. Without BOUNDARY the caller guarantees that
    every key of the tile is in range and inside every query's band (interior_key_range), and
    only the masks are applied: a tile with neither mask comes back unchanged.
    """
    if HAS_ALIBI:
        s = s - slope * tl.abs(i + shift - j).to(tl.float32)
    inside = (i < Lq) & (j < Lk)
    if BOUNDARY:
        visible = inside & (j >= i + window_lo) & (j <= i + window_hi)
    else:
        visible = inside  # only read (as a load mask) where a mask is applied
    if MASK_KIND != 0:
        mptr = mask_ptr + b * s_mb + h * s_mh + i.to(tl.int64) * s_mi + j.to(tl.int64) * s_mj
        if MASK_KIND == 1:
            allowed = tl.load(mptr, mask=inside, other=0)
            visible = visible & (allowed != 0)
        else:
            s = s + tl.load(mptr, mask=inside, other=0.0).to(tl.float32)
    if HAS_PAD:
        padding = tl.load(pad_ptr + b * Lk + j, mask=j < Lk, other=1)
        visible = visible & (padding == 0)
    if BOUNDARY or MASK_KIND == 1 or HAS_PAD:
        s = tl.where(visible, s, float("-inf"))
    return s


@triton.jit
def key_tile(
    q,
    k_base,
    v_base,
    start_n,
    s_kn,
    s_vn,
    offs_d,
    offs_dv,
    d_valid,
    dv_valid,
    seq_k,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BOUNDARY: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """(offs_n, k (N, D), v (N, Dv), q @ k^T (M, N)) of keys [start_n, start_n + BLOCK_N) at
    k_base / v_base, for the forward and dQ kernels. Without BOUNDARY the tile is interior
    (interior_key_range): its rows load without a mask."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    rows_n = offs_n.to(tl.int64)[:, None]
    if BOUNDARY:
        n_valid = (offs_n < seq_k)[:, None]
    else:
        n_valid = tl.full([BLOCK_N, 1], True, tl.int1)
    k = tl.load(
        k_base + rows_n * s_kn + offs_d[None, :], mask=n_valid & d_valid[None, :], other=0.0
    )
    v = tl.load(
        v_base + rows_n * s_vn + offs_dv[None, :], mask=n_valid & dv_valid[None, :], other=0.0
    )
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return offs_n, k, v, tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)


@triton.jit
def tile_scores(
    qk,
    i,
    j,
    b,
    h,
    mask_ptr,
    s_mb,
    s_mh,
    s_mi,
    s_mj,
    pad_ptr,
    slope,
    Lq,
    Lk,
    window_lo,
    window_hi,
    scale,
    softcap,
    MASK_KIND: tl.constexpr,
    HAS_PAD: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    ACCURATE_EXP: tl.constexpr,
    LOG2: tl.constexpr,
    BOUNDARY: tl.constexpr,
):
    """(s, s with hidden keys at -inf) of the products qk of a dense or varlen tile, i and j
    broadcasting as in biased_masked_scores: s is capped_scores', or with LOG2 the raw products
    (the scale then goes into the exponent: online_softmax_step)."""
    if LOG2:
        s = qk
    else:
        s = capped_scores(qk, scale, softcap, HAS_SOFTCAP, ACCURATE_EXP)
    masked = biased_masked_scores(
        s,
        i,
        j,
        b,
        h,
        mask_ptr,
        s_mb,
        s_mh,
        s_mi,
        s_mj,
        pad_ptr,
        slope,
        Lq,
        Lk,
        Lk - Lq,
        window_lo,
        window_hi,
        MASK_KIND,
        HAS_PAD,
        HAS_ALIBI,
        BOUNDARY,
    )
    return s, masked


@triton.jit
def tile_of_program(length, BLOCK: tl.constexpr):
    """(first row of this program's tile, batch * head index) from a 1-D grid of
    B*H*cdiv(length, BLOCK) programs. The tiles of one head are consecutive programs, so they
    run together and share that head's K/V (or Q/dO) in L2; a 1-D grid also has no 65535 limit
    on B*H, unlike a grid's second axis."""
    tiles = tl.cdiv(length, BLOCK)
    pid = tl.program_id(0).to(tl.int64)
    return (pid % tiles).to(tl.int32) * BLOCK, pid // tiles


@triton.jit
def key_range(start_m, Lk, window_lo, window_hi, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[lo, hi) of the key tiles that queries [start_m, start_m + BLOCK_M) can see through the
    window; lo is a multiple of BLOCK_N. Tiles outside are never loaded."""
    lo = tl.maximum(start_m + window_lo, 0)
    lo = (lo // BLOCK_N) * BLOCK_N
    hi = tl.minimum(start_m + BLOCK_M + window_hi, Lk)
    return lo, hi


@triton.jit
def interior_key_range(
    start_m, Lk, window_lo, window_hi, lo, hi, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    """[int_lo, int_hi) within the key tiles [lo, hi) of key_range: the tiles (starting at lo +
    a multiple of BLOCK_N) whose every key is in range (< Lk) and inside the band of every
    query row of the tile [start_m, start_m + BLOCK_M), rows past the queries included (their
    results are never stored). Those tiles need no per-score band test; tiles in [lo, int_lo)
    and [int_hi, hi) do. lo <= int_lo <= int_hi and int_lo <= max(hi, lo); when no tile is
    interior, int_hi = int_lo, so that [lo, int_lo) and [int_hi, hi) still cover [lo, hi).
    [lo, int_lo) is empty when the band has no lower side (window_lo <= -2**30: lengths are
    below 2**30)."""
    # Key j is inside the band of every row iff start_m + BLOCK_M - 1 + window_lo <= j and
    # j <= start_m + window_hi.
    first = start_m + BLOCK_M - 1 + window_lo - lo
    int_lo = lo + tl.cdiv(tl.maximum(first, 0), BLOCK_N) * BLOCK_N
    int_lo = tl.minimum(int_lo, tl.maximum(hi, lo))  # hi < lo: no tile at all
    end = tl.minimum(start_m + window_hi + 1, Lk)  # keys before end are in range and band
    int_hi = lo + (tl.maximum(end - lo, 0) // BLOCK_N) * BLOCK_N
    int_hi = tl.maximum(int_hi, int_lo)
    return int_lo, int_hi


@triton.jit
def interior_query_range(
    start_n, window_lo, window_hi, lo, hi, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr
):
    """[int_lo, int_hi) within the query tiles [lo, hi) of query_range: the tiles (starting at
    lo + a multiple of BLOCK_M) whose every row has every key of [start_n, start_n + BLOCK_N)
    inside its band. Rows and keys out of range may be in them: the dK/dV kernel loads them as
    zeros, which adds nothing to the keys it stores. lo <= int_lo <= int_hi; [lo, int_lo),
    [int_lo, int_hi) and [int_hi, hi) walk exactly the tiles of [lo, hi) (int_hi may lie past
    hi), and [int_hi, hi) is empty when the band has no lower side (window_lo <= -2**30)."""
    # Row i sees every key of the tile iff start_n + BLOCK_N - 1 - window_hi <= i and
    # i <= start_n - window_lo.
    walked_end = lo + tl.cdiv(tl.maximum(hi - lo, 0), BLOCK_M) * BLOCK_M
    first = start_n + BLOCK_N - 1 - window_hi - lo
    int_lo = tl.minimum(lo + tl.cdiv(tl.maximum(first, 0), BLOCK_M) * BLOCK_M, walked_end)
    end = start_n - window_lo + 1  # rows before end see the whole tile from below
    int_hi = tl.minimum(lo + (tl.maximum(end - lo, 0) // BLOCK_M) * BLOCK_M, walked_end)
    int_hi = tl.maximum(int_hi, int_lo)
    return int_lo, int_hi


@triton.jit
def query_range(start_n, Lq, window_lo, window_hi, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """[lo, hi) of the query tiles that can see keys [start_n, start_n + BLOCK_N): query i sees
    key j iff j - window_hi <= i <= j - window_lo."""
    lo = tl.maximum(start_n - window_hi, 0)
    lo = (lo // BLOCK_M) * BLOCK_M
    hi = tl.minimum(start_n + BLOCK_N - window_lo, Lq)
    return lo, hi


# ---------------------------------------------------------------------------------------------
# Packed (varlen) sequences


@triton.jit
def varlen_sequence(Cu_q, Cu_k, b, Lq, Lk, window_lo, window_hi, causal_mode, VARLEN: tl.constexpr):
    """Where sequence b lives and which keys its queries see:
    (first query row, first key row, its Lq, its Lk, band lo, band hi), key j visible to
    query i iff i + lo <= j <= i + hi.

    Dense: rows 0, the call's lengths and band (window_lo/hi). Varlen: rows and lengths from
    cu_seqlens (int32 (B+1,)); window_lo/hi then hold the window's sides (-1 unbounded) and
    the band is derived from this sequence's own lengths, as reference/varlen_attention.band
    does (causal_mode 1 top-left, 2 bottom-right)."""
    if VARLEN:
        q0 = tl.load(Cu_q + b).to(tl.int64)
        k0 = tl.load(Cu_k + b).to(tl.int64)
        seq_q = tl.load(Cu_q + b + 1) - tl.load(Cu_q + b)
        seq_k = tl.load(Cu_k + b + 1) - tl.load(Cu_k + b)
        # fastattn.varlen_attention checks cu_seqlens on the host, except under torch.compile;
        # this assert (active under TRITON_DEBUG=1) catches them there.
        tl.device_assert(
            (seq_q >= 0) & (seq_q <= Lq) & (seq_k >= 0) & (seq_k <= Lk),
            "cu_seqlens must be non-decreasing with lengths <= max_seqlen",
        )
        shift = seq_k - seq_q
        lo = tl.where(window_lo >= 0, shift - window_lo, -1073741824)
        hi = tl.where(window_hi >= 0, shift + window_hi, 1073741824)
        causal_hi = tl.where(causal_mode == 1, 0, shift)
        hi = tl.where(causal_mode != 0, tl.minimum(hi, causal_hi), hi)
        return q0, k0, seq_q, seq_k, lo, hi
    else:
        return 0, 0, Lq, Lk, window_lo, window_hi


@triton.jit
def row_base(b, h, q0, Hq, Lq, total_q, VARLEN: tl.constexpr):
    """Offset of the lse (and delta, grad_lse) entry of query 0 of head (b, h): lse is
    (B, Hq, Lq) dense and (Hq, total_q) varlen, as the native ops."""
    if VARLEN:
        return h * total_q + q0
    else:
        return (b * Hq + h) * Lq


@triton.jit
def dropout_rows(b, h, q0, Hq, Lq, Lk, VARLEN: tl.constexpr):
    """(element of (i=0, j=0), element step per query row) of head (b, h) in fastattn's
    Philox numbering, so that probability (i, j) is element base + i * step + j:
    ((b*Hq + h)*Lq + i)*Lk + j dense, ((cu_seqlens_q[b] + i)*Hq + h)*max_seqlen_k + j varlen
    (the CPU varlen kernel's numbering)."""
    if VARLEN:
        return (q0 * Hq + h) * Lk, Hq * Lk
    else:
        return (b * Hq + h) * Lq * Lk, Lk


@triton.jit
def online_softmax_step(
    s,
    v,
    m_i,
    l_i,
    acc,
    Seed,
    element,
    threshold,
    keep_scale,
    log2_scale,
    HAS_DROPOUT: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ACCURATE_EXP: tl.constexpr,
    LOG2: tl.constexpr,
):
    """One key tile of the online softmax: s (M, N) final scores (-inf where hidden), v (N, Dv);
    returns the updated running max m_i, sum l_i (of undropped probabilities, so lse ignores
    dropout) and accumulator acc (M, Dv). element (M, N): Philox elements of the tile.

    LOG2: s holds the raw products q.k, the scores are log2_scale * s in base 2 (log2_scale =
    scale * log2(e) > 0, so the maximum of s is that of the scores) and m_i is the maximum of
    s: each probability is exp2(s * log2_scale - m * log2_scale), one FFMA and one MUFU.EX2 on
    a GPU, and lse = scale * m + log(l) (softmax_finish's m: scale * m_i)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # While a row has seen no visible key its max is -inf: subtract 0 instead, so that
    # exp(-inf - -inf) = NaN never appears (p and alpha are then 0).
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    if LOG2:
        m_scaled = m_safe * log2_scale
        p = exp2_flushed(s * log2_scale - m_scaled[:, None])
        alpha = exp2_flushed(m_i * log2_scale - m_scaled)
    else:
        # The running max is subtracted in natural units ((s - m) is exact near the max), so
        # lse = m + log(l) keeps full precision (float32, and scores with a bias or cap).
        p = exp(s - m_safe[:, None], ACCURATE_EXP)
        alpha = exp(m_i - m_safe, ACCURATE_EXP)
    l_i = l_i * alpha + tl.sum(p, 1)
    if HAS_DROPOUT:
        p = p * dropout_multiplier(Seed, element, threshold, keep_scale)
    acc = acc * alpha[:, None] + tl.dot(operand(p, v, UPCAST), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def softmax_finish(m_i, l_i, acc):
    """(out = acc / l, lse = m + log l) of an online softmax; rows that saw no visible key
    (l = 0) give out 0 and lse -inf (set, not divided: a masked key's NaN value leaves 0 * NaN
    in acc)."""
    empty = l_i == 0.0
    out = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, l_i)[:, None])
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    return out, lse
