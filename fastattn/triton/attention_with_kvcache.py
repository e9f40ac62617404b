"""Triton decoding over a KV cache: the launcher of the torch op
fastattn::attention_with_kvcache_triton (inference only; fastattn/ops/attention_with_kvcache.py
checks the arguments, registers the op with the contract of
fastattn/contracts/attention_with_kvcache.py and calls it).

Three kernels, launched in order on one stream:
- `_append_kernel`: writes k_new / v_new (B, Hkv, Lnew, D/Dv) into k_cache / v_cache
  (B, Hkv, Lmax, D/Dv) in place at rows cache_seqlens[b] + l, rotating the keys at those
  positions on the way (GPT-NeoX halves or GPT-J pairs, the first rotary_dim features) with the
  arithmetic of fastattn's Triton apply_rotary, so the cache holds the same bits.
- `_decode_kernel` (split-K, flash-decoding): a program owns BLOCK_M rows of one kv head,
  the (query head of its GQA group, query) pairs, so the group reads each key and value once,
  and one of num_splits ranges of the cache; q is rotated as it is loaded (its position is
  pos = cache_seqlens[b] + i). Query i sees cache rows j < cache_seqlens[b] + Lnew with
  j <= pos (causal, bottom-right) and pos - left <= j <= pos + right (window); ALiBi adds
  -slope * |pos - j|; softcap as in attention. Each split writes its normalised partial out
  (float32) and lse; with one split the program writes the final out and lse directly.
- `_merge_kernel`: merge_attention's math over the splits of each row:
  lse = logsumexp_s lse_s, out = sum_s exp(lse_s - lse) out_s (0 and -inf where no split saw
  a key).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import wrap_triton

from .._debug import poison
from ..contracts.attention import check_seqlen, output_like
from . import (
    device_shared_memory,
    device_sm_count,
    dot_precision,
    finish,
    grid_x,
    interpreting,
    on_device,
    on_gpu,
    tile_budget,
)
from ._common import round_to_bfloat16
from .attention_common import (
    biased_masked_scores,
    capped_scores,
    online_softmax_step,
    softmax_finish,
)


@triton.jit
def _rotated_rows(
    row_ptrs,
    row_mask,
    pos,
    Cos,
    Sin,
    s_cos,
    rotary_dim,
    D,
    HAS_ROTARY: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Rows (R, BLOCK_D) float32 loaded from row_ptrs (R, 1) (pointers to feature 0), rotated
    at positions pos (R,) when HAS_ROTARY: feature d < rotary_dim pairs with its partner p
    (d +- rotary_dim/2 for GPT-NeoX, d ^ 1 for GPT-J) at frequency f, and
    x_d * cos[pos, f] -+ x_p * sin[pos, f] (minus for the first of the pair), as
    fastattn.apply_rotary; features from rotary_dim on pass through."""
    offs_d = tl.arange(0, BLOCK_D)
    mask = row_mask[:, None] & (offs_d < D)[None, :]
    x = tl.load(row_ptrs + offs_d[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_ROTARY:
        half = rotary_dim // 2
        rotated = offs_d < rotary_dim
        if INTERLEAVED:
            partner = offs_d ^ 1
            freq = offs_d // 2
            first = (offs_d % 2) == 0
        else:
            first = offs_d < half
            partner = tl.where(first, offs_d + half, offs_d - half)
            freq = tl.where(first, offs_d, offs_d - half)
        rmask = row_mask[:, None] & rotated[None, :]
        xp = tl.load(row_ptrs + partner[None, :], mask=rmask, other=0.0).to(tl.float32)
        table = pos.to(tl.int64)[:, None] * s_cos + freq[None, :]
        c = tl.load(Cos + table, mask=rmask, other=0.0)
        s = tl.load(Sin + table, mask=rmask, other=0.0)
        # One product pair per feature, x * c + xp * (-+s): the same bits as apply_rotary's
        # x1 * c - x2 * s and x2 * c + x1 * s (negating s is exact), also where a GPU fuses
        # them into an fma (the x * c product is single-use in both kernels).
        s = tl.where(first[None, :], -s, s)
        x = tl.where(rotated[None, :], x * c + xp * s, x)
    return x


@triton.jit
def _cache_rows(Table, b, s_tb, pos, s_b, s_n, valid, PAGE, PAGED: tl.constexpr):
    """Offsets (from the cache's base, excluding the head) of positions `pos` of sequence b:
    b * s_b + pos * s_n for a dense cache; through the block table for a paged one (pool block
    stride s_b): block Table[b, pos // PAGE], row pos % PAGE. Invalid lanes read no table
    entry."""
    if PAGED:
        blk = tl.load(Table + b * s_tb + pos // PAGE, mask=valid, other=0).to(tl.int64)
        return blk * s_b + (pos % PAGE).to(tl.int64) * s_n
    else:
        return b * s_b + pos.to(tl.int64) * s_n


@triton.jit
def _append_kernel(
    K_new,
    V_new,
    K_cache,
    V_cache,
    Seqlens,
    Cos,
    Sin,
    Table,
    s_tb,
    PAGE,
    s_nb,
    s_nh,
    s_nl,
    s_wb,
    s_wh,
    s_wl,
    s_cb,
    s_ch,
    s_cl,
    s_vb,
    s_vh,
    s_vl,
    s_cos,
    Hkv,
    Lnew,
    Lmax,
    D,
    Dv,
    rotary_dim,
    HAS_ROTARY: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    ROUND_BF16: tl.constexpr,
    PAGED: tl.constexpr,
    BLOCK_L: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """Program (b * Hkv + h) * tiles + tile, tile of BLOCK_L new tokens (one grid axis: the
    second holds only 65535 tiles): k_cache[b, h, seqlens[b] + l] = rotate(k_new[b, h, l]) and
    v_cache[b, h, seqlens[b] + l] = v_new[b, h, l] (paged: through the block table, Lmax its
    capacity)."""
    tiles = tl.cdiv(Lnew, BLOCK_L)
    pid = tl.program_id(0).to(tl.int64)
    bh = pid // tiles
    b = bh // Hkv
    h = bh % Hkv
    offs_l = (pid % tiles).to(tl.int32) * BLOCK_L + tl.arange(0, BLOCK_L)
    pos = tl.load(Seqlens + b) + offs_l
    # The caller checks cache_seqlens + Lnew <= Lmax on the host; when it cannot (under
    # torch.compile) rows outside the cache are never written (and TRITON_DEBUG=1 asserts).
    tl.device_assert(
        (offs_l >= Lnew) | ((pos >= 0) & (pos < Lmax)), "cache_seqlens + Lnew exceeds the cache"
    )
    l_valid = (offs_l < Lnew) & (pos >= 0) & (pos < Lmax)
    src = K_new + b * s_nb + h * s_nh + offs_l.to(tl.int64)[:, None] * s_nl
    k = _rotated_rows(
        src, l_valid, pos, Cos, Sin, s_cos, rotary_dim, D, HAS_ROTARY, INTERLEAVED, BLOCK_D
    )
    if ROUND_BF16:
        k = round_to_bfloat16(k)
    offs_d = tl.arange(0, BLOCK_D)
    k_rows = _cache_rows(Table, b, s_tb, pos, s_cb, s_cl, l_valid, PAGE, PAGED)
    dst = K_cache + h * s_ch + k_rows[:, None] + offs_d[None, :]
    tl.store(dst, k.to(K_cache.dtype.element_ty), mask=l_valid[:, None] & (offs_d < D)[None, :])
    # Values are copied as they are (no arithmetic, so no rounding question).
    offs_dv = tl.arange(0, BLOCK_DV)
    vmask = l_valid[:, None] & (offs_dv < Dv)[None, :]
    v = tl.load(
        V_new + b * s_wb + h * s_wh + offs_l.to(tl.int64)[:, None] * s_wl + offs_dv[None, :],
        mask=vmask,
    )
    v_rows = _cache_rows(Table, b, s_tb, pos, s_vb, s_vl, l_valid, PAGE, PAGED)
    tl.store(V_cache + h * s_vh + v_rows[:, None] + offs_dv[None, :], v, mask=vmask)


@triton.jit
def _decode_kernel(
    Q,
    K,
    V,
    Seqlens,
    Cos,
    Sin,
    Alibi,
    Out,
    Lse,
    Table,
    s_tb,
    PAGE,
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
    s_os,
    s_lb,
    s_lh,
    s_lm,
    s_ls,
    s_ab,
    s_ah,
    s_cos,
    Hq,
    GROUP,
    Lq,
    Lnew,
    Lmax,
    D,
    Dv,
    scale,
    softcap,
    window_left,
    window_right,
    causal_mode,
    split_len,
    rotary_dim,
    HAS_ROTARY: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    ACCURATE_EXP: tl.constexpr,
    PAGED: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Program (tile of GROUP * Lq rows, b * Hkv + kv head; split): the partial attention of
    row r = g * Lq + i (query head kvh * GROUP + g, query i) over the keys of this split.
    Out/Lse strides address (b, h, i, split), split stride 0 when there is one split. Paged
    (PAGED): K/V are pools read through the block table (_cache_rows), Lmax its capacity."""
    tiles = tl.cdiv(GROUP * Lq, BLOCK_M)
    pid = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    start_r = (pid % tiles).to(tl.int32) * BLOCK_M
    bkv = pid // tiles
    Hkv = Hq // GROUP
    b = bkv // Hkv
    kvh = bkv % Hkv
    rows = start_r + tl.arange(0, BLOCK_M)
    r_valid = rows < GROUP * Lq
    g = rows // Lq
    i = rows % Lq
    h = kvh * GROUP + g  # (BLOCK_M,)

    cached = tl.load(Seqlens + b)  # query i sits at position cached + i
    seq_k = tl.minimum(cached + Lnew, Lmax)  # never read past the cache (see _append_kernel)
    lo_w = tl.where(window_left >= 0, cached - window_left, -1073741824)
    hi_w = tl.where(window_right >= 0, cached + window_right, 1073741824)
    hi_w = tl.where(causal_mode != 0, tl.minimum(hi_w, tl.where(causal_mode == 1, 0, cached)), hi_w)
    # Keys any row of the tile can see, cut to this split's range.
    key_lo = tl.maximum(lo_w, 0)
    key_hi = tl.minimum(seq_k, Lq - 1 + hi_w + 1)
    key_lo = tl.maximum(key_lo, split * split_len)
    key_hi = tl.minimum(key_hi, (split + 1) * split_len)
    key_lo = (key_lo // BLOCK_N) * BLOCK_N

    q_ptrs = Q + b * s_qb + h.to(tl.int64)[:, None] * s_qh + i.to(tl.int64)[:, None] * s_qm
    q = _rotated_rows(
        q_ptrs,
        r_valid,
        cached + i,
        Cos,
        Sin,
        s_cos,
        rotary_dim,
        D,
        HAS_ROTARY,
        INTERLEAVED,
        BLOCK_D,
    )
    # The rotated q rounded to q's dtype, as the other backends rotate it before attending.
    if UPCAST:
        q = round_to_bfloat16(q)
    else:
        q = q.to(Q.dtype.element_ty)
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(Alibi + b * s_ab + h * s_ah, mask=r_valid, other=0.0)[:, None]
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_valid = offs_d < D
    dv_valid = offs_dv < Dv
    k_base = K + kvh * s_kh
    v_base = V + kvh * s_vh

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for start_n in range(key_lo, key_hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_valid = offs_n < key_hi
        k_rows = _cache_rows(Table, b, s_tb, offs_n, s_kb, s_kn, n_valid, PAGE, PAGED)[:, None]
        v_rows = _cache_rows(Table, b, s_tb, offs_n, s_vb, s_vn, n_valid, PAGE, PAGED)[:, None]
        k = tl.load(
            k_base + k_rows + offs_d[None, :],
            mask=n_valid[:, None] & d_valid[None, :],
            other=0.0,
        )
        v = tl.load(
            v_base + v_rows + offs_dv[None, :],
            mask=n_valid[:, None] & dv_valid[None, :],
            other=0.0,
        )
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        s = capped_scores(qk, scale, softcap, HAS_SOFTCAP, ACCURATE_EXP)
        # Keys past this split's range are hidden as "beyond the sequence" (Lk = key_hi).
        s = biased_masked_scores(
            s,
            i[:, None],
            offs_n[None, :],
            b,
            h,
            Q,
            0,
            0,
            0,
            0,
            Q,
            slope,
            Lq,
            key_hi,
            cached,
            lo_w,
            hi_w,
            0,
            False,
            HAS_ALIBI,
            True,
        )
        m_i, l_i, acc = online_softmax_step(
            s, v, m_i, l_i, acc, Q, 0, 0.0, 1.0, 1.0, False, UPCAST, DOT_PRECISION, ACCURATE_EXP,
            False,
        )  # fmt: skip
    out, lse = softmax_finish(m_i, l_i, acc)
    row_h = h.to(tl.int64)[:, None]
    row_i = i.to(tl.int64)[:, None]
    tl.store(
        Out + b * s_ob + row_h * s_oh + row_i * s_om + split * s_os + offs_dv[None, :],
        out.to(Out.dtype.element_ty),
        mask=r_valid[:, None] & dv_valid[None, :],
    )
    tl.store(
        Lse + b * s_lb + h.to(tl.int64) * s_lh + i.to(tl.int64) * s_lm + split * s_ls,
        lse,
        mask=r_valid,
    )


@triton.jit
def _merge_kernel(
    Part,
    PartLse,
    Out,
    Lse,
    s_ob,
    s_oh,
    s_om,
    Hq,
    Lq,
    splits,
    Dv,
    BLOCK_S: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    """Program per row (b, h, i): merges the `splits` partial results of contiguous
    Part (B, Hq, Lq, splits, Dv) float32 and PartLse (B, Hq, Lq, splits) into out and lse."""
    row = tl.program_id(0).to(tl.int64)  # (b * Hq + h) * Lq + i
    b = row // (Hq * Lq)
    h = (row // Lq) % Hq
    i = row % Lq
    offs_s = tl.arange(0, BLOCK_S)
    offs_dv = tl.arange(0, BLOCK_DV)
    s_valid = offs_s < splits
    lses = tl.load(PartLse + row * splits + offs_s, mask=s_valid, other=float("-inf"))
    m = tl.max(lses, 0)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    total = tl.sum(tl.exp(lses - m_safe), 0)
    lse = tl.where(total == 0.0, float("-inf"), m_safe + tl.log(tl.where(total == 0.0, 1.0, total)))
    lse_safe = tl.where(total == 0.0, 0.0, lse)
    weights = tl.exp(lses - lse_safe)  # 0 for splits without a visible key
    parts = tl.load(
        Part + (row * splits + offs_s)[:, None] * Dv + offs_dv[None, :],
        mask=s_valid[:, None] & (offs_dv < Dv)[None, :],
        other=0.0,
    )
    out = tl.sum(weights[:, None] * parts, 0)
    tl.store(
        Out + b * s_ob + h * s_oh + i * s_om + offs_dv,
        out.to(Out.dtype.element_ty),
        mask=offs_dv < Dv,
    )
    tl.store(Lse + row, lse)


# ---------------------------------------------------------------------------------------------
# Launcher


def _blocks(
    rows: int, Lmax: int, head: int, interpret: bool, fp32: bool = False
) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N) of the decode kernel: tl.dot needs 16 rows at least; under the
    interpreter larger key tiles mean fewer numpy calls. float32 dots run on FMA units with
    every tile in registers: half the key tile (64 x 128 spilled 600 B a thread on sm_90 with
    triton 3.6, tests/triton_aot.py)."""
    block_m = max(16, min(64, triton.next_power_of_2(max(rows, 1))))
    if interpret:
        return block_m, max(16, min(128, triton.next_power_of_2(max(Lmax, 1))))
    block_n = 64 if head <= 128 else 32
    return block_m, block_n // 2 if fp32 else block_n


_MAX_GRID_Y = 65535


def _stages(
    block_m: int, block_n: int, block_d: int, block_dv: int, itemsize: int, device: torch.device
) -> int:
    """Pipeline stages of the decode kernel's key/value tiles: 3 up to head dim 128, 2 above
    (at head dim 256 a 16-bit stage of 32 keys is 32 KB of k and v: three of them and the q
    tile would leave an sm_86/89/120 card's 99 KB no room), fewer still when the device's
    shared memory (tile_budget) holds fewer. Refused when one stage exceeds the device's
    whole limit."""
    stages = 3 if max(block_d, block_dv) <= 128 else 2
    resident = block_m * block_d * itemsize
    per_stage = block_n * (block_d + block_dv) * itemsize
    while stages > 1 and resident + stages * per_stage > tile_budget(device):
        stages -= 1
    limit = device_shared_memory(device)
    if resident + per_stage > limit:
        raise ValueError(
            f"attention_with_kvcache (triton): the decode tiles ({block_m} query rows, "
            f"{block_n} keys, head dims padded to {block_d}/{block_dv}) need "
            f"{resident + per_stage} bytes of shared memory, more than {device} offers "
            f"({limit} bytes a block)"
        )
    return stages


def _auto_splits(programs: int, Lmax: int, device: torch.device) -> int:
    """Enough programs to fill the device twice over, each split keeping >= 256 cache rows (the
    CPU kernel's rule, with streaming multiprocessors in place of threads)."""
    if on_gpu(device):
        units = device_sm_count(device)
    else:
        units = 1  # the interpreter runs programs one after another
    want = -(-2 * units // max(programs, 1))
    return max(1, min(want, max(1, -(-Lmax // 256))))


def attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    cache_seqlens: torch.Tensor,
    k_new: torch.Tensor | None,
    v_new: torch.Tensor | None,
    rotary_cos: torch.Tensor | None,
    rotary_sin: torch.Tensor | None,
    rotary_interleaved: bool,
    alibi_slopes: torch.Tensor | None,
    scale: float,
    softcap: float,
    causal_mode: int,
    window_left: int,
    window_right: int,
    num_splits: int,
    block_table: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Appends (rotated) k_new/v_new into the caches in place, then attends.

    q (B, Hq, Lq, D); k_cache/v_cache (B, Hkv, Lmax, D/Dv), unit last strides; cache_seqlens
    int32 (B,) (cache_seqlens[b] + Lnew <= Lmax, checked by the caller); k_new/v_new
    (B, Hkv, Lnew, D/Dv) or None; rotary_cos/sin (rows, rotary_dim / 2) or None; alibi_slopes
    float32 (B, Hq) or None; causal_mode 0 off, 1 top-left, 2 at the query position;
    window sides -1 = unbounded; num_splits <= 0 chooses; block_table int32
    (B, max_blocks_per_seq) or None: paged caches, pools (num_blocks, Hkv, block_size, D/Dv)
    read and written through the table (entries checked by the caller), Lmax its capacity.
    Returns out (B, Hq, Lq, Dv) in q's dtype and lse (B, Hq, Lq) float32.
    """
    op = "attention_with_kvcache"
    B, Hq, Lq, D = q.shape
    Hkv, Lmax, Dv = k_cache.shape[1], k_cache.shape[2], v_cache.shape[3]
    paged = block_table is not None
    if paged:
        page = k_cache.shape[2]
        table = block_table.to(torch.int32).contiguous()
        Lmax = table.shape[1] * page
        s_tb = table.stride(0)
    else:
        page, table, s_tb = 1, cache_seqlens, 0
    # Positions and key indices are int32 in the kernels, with +-2**30 as unbounded windows;
    # the decode kernel numbers a kv head's (query head, query) rows in int32 too.
    check_seqlen(op, "q's length (Lq)", Lq)
    check_seqlen(op, "k_cache's length (Lmax)", Lmax)
    check_seqlen(op, "(Hq // Hkv) * Lq (query rows per kv head)", Hq // max(Hkv, 1) * Lq)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.shape[3] > 1 and t.stride(3) != 1:
            raise ValueError(
                f"{op}: {name} must have a unit stride in its last "
                f"dimension (it is written in place), got strides {t.stride()}"
            )
    # The kernels address feature d of a row as row + d.
    q, k_new, v_new = (
        t if t is None or t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()
        for t in (q, k_new, v_new)
    )
    interpret = interpreting(q.device)
    upcast = interpret and q.dtype == torch.bfloat16
    seqlens = cache_seqlens.to(torch.int32).contiguous()
    has_rotary = rotary_cos is not None
    if has_rotary:
        # float32 tables, as fastattn.apply_rotary passes them to its kernels (same bits).
        cos = rotary_cos.to(torch.float32).contiguous()
        sin = rotary_sin.to(torch.float32).contiguous()
        rotary_dim = 2 * cos.shape[1]
    else:
        cos = sin = q
        rotary_dim = 0
    block_d = max(16, triton.next_power_of_2(D))
    block_dv = max(16, triton.next_power_of_2(Dv))
    Lnew = 0 if k_new is None else k_new.shape[2]

    with on_device(q):
        if Lnew > 0 and B * Hkv > 0:
            block_l = max(1, min(triton.next_power_of_2(Lnew), max(1, 4096 // block_d)))
            wrap_args = (
                k_new,
                v_new,
                k_cache,
                v_cache,
                seqlens,
                cos,
                sin,
                table,
                s_tb,
                page,
                *k_new.stride()[:3],
                *v_new.stride()[:3],
                *k_cache.stride()[:3],
                *v_cache.stride()[:3],
                cos.stride(0) if has_rotary else 0,
                Hkv,
                Lnew,
                Lmax,
                D,
                Dv,
                rotary_dim,
            )
            append_grid = grid_x(
                op, "B * Hkv * ceil(Lnew / BLOCK_L)", B * Hkv * triton.cdiv(Lnew, block_l)
            )
            wrap_triton(_append_kernel)[(append_grid,)](
                *wrap_args,
                HAS_ROTARY=has_rotary,
                INTERLEAVED=bool(rotary_interleaved),
                ROUND_BF16=upcast,
                PAGED=paged,
                BLOCK_L=block_l,
                BLOCK_D=block_d,
                BLOCK_DV=block_dv,
            )

        wide = upcast  # bfloat16 under the interpreter: a float32 buffer, rounded by torch
        out = poison(output_like(q, Dv, torch.float32 if wide else None))
        lse = poison(torch.empty((B, Hq, Lq), dtype=torch.float32, device=q.device))
        if out.numel() == 0:
            return finish(out, q.dtype), lse
        group = Hq // Hkv
        block_m, block_n = _blocks(
            group * Lq, Lmax, max(block_d, block_dv), interpret, q.dtype == torch.float32
        )
        programs = grid_x(
            op,
            "B * Hkv * ceil((Hq // Hkv) * Lq / BLOCK_M)",
            B * Hkv * triton.cdiv(group * Lq, block_m),
        )
        splits = num_splits if num_splits > 0 else _auto_splits(programs, Lmax, q.device)
        # Splits are the grid's second axis (65535 at most); the result does not depend on
        # their number.
        splits = min(splits, _MAX_GRID_Y)
        # Whole key tiles per split; splits that would start past Lmax are not launched.
        split_len = triton.cdiv(triton.cdiv(max(Lmax, 1), splits), block_n) * block_n
        splits = max(1, triton.cdiv(Lmax, split_len))
        if splits == 1:
            part, part_lse = out, lse
            part_strides = (*out.stride()[:3], 0)
            lse_strides = (*lse.stride(), 0)
        else:
            part = torch.empty((B, Hq, Lq, splits, Dv), dtype=torch.float32, device=q.device)
            part_lse = torch.empty((B, Hq, Lq, splits), dtype=torch.float32, device=q.device)
            part_strides = part.stride()[:4]
            lse_strides = part_lse.stride()
        if alibi_slopes is None:
            alibi, alibi_strides = q, (0, 0)
        else:
            alibi, alibi_strides = alibi_slopes, tuple(alibi_slopes.stride())
        precision = dot_precision(q.dtype)
        # (the interpreter has no pipeline)
        stages = (
            1
            if interpret
            else _stages(block_m, block_n, block_d, block_dv, q.element_size(), q.device)
        )
        wrap_triton(_decode_kernel)[(programs, splits)](
            q,
            k_cache,
            v_cache,
            seqlens,
            cos,
            sin,
            alibi,
            part,
            part_lse,
            table,
            s_tb,
            page,
            *q.stride()[:3],
            *k_cache.stride()[:3],
            *v_cache.stride()[:3],
            *part_strides,
            *lse_strides,
            *alibi_strides,
            cos.stride(0) if has_rotary else 0,
            Hq,
            group,
            Lq,
            Lnew,
            Lmax,
            D,
            Dv,
            float(scale),
            float(softcap),
            int(window_left),
            int(window_right),
            int(causal_mode),
            split_len,
            rotary_dim,
            HAS_ROTARY=has_rotary,
            INTERLEAVED=bool(rotary_interleaved),
            HAS_ALIBI=alibi_slopes is not None,
            HAS_SOFTCAP=softcap > 0.0,
            UPCAST=upcast,
            DOT_PRECISION=precision,
            ACCURATE_EXP=q.dtype == torch.float32 and not interpret,
            PAGED=paged,
            BLOCK_D=block_d,
            BLOCK_DV=block_dv,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            num_warps=4 if max(block_d, block_dv) <= 128 else 8,
            num_stages=stages,
        )
        if splits > 1:
            wrap_triton(_merge_kernel)[(grid_x(op, "B * Hq * Lq", B * Hq * Lq),)](
                part,
                part_lse,
                out,
                lse,
                *out.stride()[:3],
                Hq,
                Lq,
                splits,
                Dv,
                BLOCK_S=triton.next_power_of_2(splits),
                BLOCK_DV=block_dv,
            )
    return finish(out, q.dtype), lse
