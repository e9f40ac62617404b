"""Decoding with a KV cache: `attention_with_kvcache` appends the new keys and values into
preallocated caches in place (rotated, when rotary tables are given), rotates the queries, and
attends over each sequence's cache with a split-K kernel (flash-decoding) when there are few
queries. Inference only (no autograd).

Backends: "cpu"/"cuda" run torch.ops.fastattn.attention_decode (the attention part; the
rotation and append run through fastattn's fused rotary kernel and one scatter), "triton"
torch.ops.fastattn.attention_with_kvcache_triton (fastattn/triton/attention_with_kvcache.py:
rotation and append in one kernel, q rotated inside the split-K attention kernel, splits merged
by a third), "torch" torch's scaled_dot_product_attention over the cache
(fastattn/aten/attention_with_kvcache.py; no softcap, sinks, or ALiBi in 16-bit), "reference"
fastattn/reference/attention_with_kvcache.py.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from .. import _backend, _native, speed_table
from ..aten import attention_with_kvcache as aten
from ..contracts import attention_with_kvcache as contract
from ..contracts.attention import MAX_HEAD_DIM, check_seqlen
from ..reference import attention_with_kvcache as ref
from ._common import (
    apply_sinks,
    canonical_sinks,
    check_same_device,
    check_tensor,
    device_check,
    device_check_range,
    device_checks_enabled,
    host_checks_enabled,
    register_native_fakes,
    register_triton_op,
    triton_kernels,
)
from .positional import apply_rotary, check_position_range
from .varlen_attention import causal_mode, window_sides


def _check_rotary_tables(
    op: str,
    D: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    length: int,
    on_device: bool,
    positions_range: tuple[int, int] | None = None,
) -> None:
    """The checks fastattn.apply_rotary makes of its tables and positions (the triton backend
    rotates inside its kernels): rotary_dim = 2 * cos.shape[1] even in [2, D], cos and sin
    alike, positions + length within the tables' rows (on the device for CUDA positions when
    on_device). Run before anything is appended."""
    rotary_dim = 2 * cos.shape[-1] if cos.dim() == 2 else D
    if rotary_dim < 2 or rotary_dim > D:
        raise ValueError(
            f"{op}: rotary_dim must be even and in [2, {D}] (head dim), got {rotary_dim}"
        )
    for name, t in (("rotary_cos", cos), ("rotary_sin", sin)):
        check_tensor(op, name, t, dims=2, float_dtype=True)
    if cos.shape != sin.shape:
        raise ValueError(
            f"{op}: rotary_cos and rotary_sin must have the same shape, got "
            f"{tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    check_position_range(
        op,
        0,
        positions,
        length,
        cos.shape[0],
        "cos/sin",
        on_device=on_device,
        offsets_range=positions_range,
    )


@torch.no_grad()
def attention_with_kvcache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    *,
    cache_seqlens: torch.Tensor,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    rotary_cos: torch.Tensor | None = None,
    rotary_sin: torch.Tensor | None = None,
    rotary_interleaved: bool = False,
    causal=True,
    window=None,
    softcap: float = 0.0,
    scale: float | None = None,
    alibi_slopes: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    num_splits: int = 0,
    block_table: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Attention of new tokens over a KV cache, appending them first (inference only).

    Query i of sequence b sits at position `cache_seqlens[b] + i`. The new keys and values are
    written into the caches in place (rotated first when rotary tables are given), then the
    queries attend over the valid cache. The keys are split into `num_splits` ranges computed in
    parallel and merged (flash-decoding).

    Args:
        q: (B, Hq, Lq, D), the queries of the new tokens.
        k_cache: (B, Hkv, Lmax, D), a preallocated cache (or, with `block_table`, a pool
            (num_blocks, Hkv, block_size, D) shared by the batch); written in place.
        v_cache: (B, Hkv, Lmax, Dv), or a pool (num_blocks, Hkv, block_size, Dv).
        cache_seqlens: Int32 (B,), the valid entries per sequence; not modified (the caller
            advances it by Lnew).
        k_new: (B, Hkv, Lnew, D) or None: written into the cache at
            `[cache_seqlens[b], cache_seqlens[b] + Lnew)`.
        v_new: (B, Hkv, Lnew, Dv) or None, written likewise.
        rotary_cos: (Lmax, rotary_dim / 2) table indexed by absolute position, or None; q and
            k_new are rotated.
        rotary_sin: (Lmax, rotary_dim / 2), with `rotary_cos`.
        rotary_interleaved: GPT-J pairs (2i, 2i + 1) instead of GPT-NeoX halves.
        causal: True (default): query i sees cache positions `<= cache_seqlens[b] + i`
            (speculative decoding, chunked prefill); False: the whole valid cache.
        window: (left, right) around the query's position; -1 = unbounded.
        softcap: As in `fastattn.attention`.
        scale: As in `fastattn.attention`.
        alibi_slopes: (Hq,) or (B, Hq), as in `fastattn.attention`.
        sinks: Float (Hq,) attention sinks, as in `fastattn.attention`.
        num_splits: Key ranges computed in parallel and merged; 0 chooses.
        block_table: Int32 (B, max_blocks_per_seq) or None: a paged cache. Position p of
            sequence b lives in block `block_table[b, p // block_size]` at row `p % block_size`;
            block_size is a multiple of 16 and the table's capacity
            `max_blocks_per_seq * block_size` plays Lmax's part. The entries a call reads or
            writes must be blocks of the pool; the others are ignored (-1 is customary).
            `fastattn.PagedKVCache` allocates the blocks.
        backend: The backend for this call; None chooses automatically.

    Returns:
        out, (B, Hq, Lq, Dv) in q's dtype.

    Raises:
        ValueError: A cache too small for the new tokens, a block index outside the pool, a block
            size that is not a multiple of 16, or shapes and dtypes that do not fit together. On
            CUDA the values in tensors are checked on the device instead (a device-side assert).
        BackendError: The backend asked for cannot run this call.
    """
    op = "attention_with_kvcache"
    check_tensor(op, "q", q, dims=4, float_dtype=True)
    check_tensor(op, "k_cache", k_cache, dims=4, float_dtype=True)
    check_tensor(op, "v_cache", v_cache, dims=4, float_dtype=True)
    check_tensor(op, "cache_seqlens", cache_seqlens, dims=1)
    check_same_device(
        op,
        "q",
        q,
        k_cache=k_cache,
        v_cache=v_cache,
        cache_seqlens=cache_seqlens,
        k_new=k_new,
        v_new=v_new,
        rotary_cos=rotary_cos,
        rotary_sin=rotary_sin,
        alibi_slopes=alibi_slopes,
    )
    B, Hq, Lq, D = q.shape
    Hkv, Dv = k_cache.shape[1], v_cache.shape[3]
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise TypeError(f"{op}: q, k_cache and v_cache must have the same dtype")
    if block_table is None:
        Lmax = k_cache.shape[2]
        if (
            k_cache.shape[0] != B
            or tuple(v_cache.shape[:3]) != (B, Hkv, Lmax)
            or k_cache.shape[3] != D
        ):
            raise ValueError(
                f"{op}: k_cache must be (B, Hkv, Lmax, D) = ({B}, Hkv, Lmax, {D}) and "
                f"v_cache (B, Hkv, Lmax, Dv), got {tuple(k_cache.shape)} and "
                f"{tuple(v_cache.shape)}"
            )
    else:
        Lmax = _check_block_table(op, block_table, q, k_cache, v_cache)
    if Hkv == 0 or Hq % Hkv:
        raise ValueError(f"{op}: q's heads ({Hq}) must be a multiple of the caches' ({Hkv})")
    if not (1 <= D <= MAX_HEAD_DIM and 1 <= Dv <= MAX_HEAD_DIM):
        raise ValueError(f"{op}: head dims must be in [1, {MAX_HEAD_DIM}], got {D} and {Dv}")
    # Every backend's band (the reference's too) holds sequences below 2**30.
    check_seqlen(op, "q's length (Lq)", Lq)
    check_seqlen(op, "k_cache's length (Lmax)", Lmax)
    if cache_seqlens.dtype != torch.int32 or cache_seqlens.shape[0] != B:
        raise TypeError(
            f"{op}: cache_seqlens must be int32 (B,) = ({B},), got "
            f"{cache_seqlens.dtype} {tuple(cache_seqlens.shape)}"
        )
    if (k_new is None) != (v_new is None):
        raise ValueError(f"{op}: k_new and v_new must be given together")
    Lnew = 0
    if k_new is not None:
        check_tensor(op, "k_new", k_new, dims=4, float_dtype=True)
        check_tensor(op, "v_new", v_new, dims=4, float_dtype=True)
        assert v_new is not None  # (checked with k_new above)
        Lnew = k_new.shape[2]
        if not (k_new.dtype == v_new.dtype == q.dtype):
            # Checked here: scatter_ would raise only after k_new was already appended.
            raise TypeError(
                f"{op}: k_new and v_new must have q's dtype {q.dtype}, got "
                f"{k_new.dtype} and {v_new.dtype}"
            )
        if tuple(k_new.shape) != (B, Hkv, Lnew, D) or tuple(v_new.shape) != (B, Hkv, Lnew, Dv):
            raise ValueError(
                f"{op}: k_new/v_new must be (B, Hkv, Lnew, D/Dv) = ({B}, {Hkv}, "
                f"Lnew, {D}/{Dv}), got {tuple(k_new.shape)} and {tuple(v_new.shape)}"
            )
    if (rotary_cos is None) != (rotary_sin is None):
        raise ValueError(f"{op}: rotary_cos and rotary_sin must be given together")

    def capacity() -> str:  # formatted only for an error: formatting a symbolic Lmax pins it
        if block_table is None:
            return f"Lmax = {Lmax}"
        return f"the block table's capacity max_blocks_per_seq * block_size = {Lmax}"

    if B > 0 and Lnew > Lmax:  # known without reading cache_seqlens
        raise ValueError(f"{op}: the cache is too small: {Lnew} new tokens exceed {capacity()}")
    key_bound = Lmax  # no sequence has more keys (less when cache_seqlens is read below)
    seqlens_range = None  # (min, max) of cache_seqlens where read on the host
    if B > 0 and host_checks_enabled(cache_seqlens):
        lo, hi = (int(x) for x in torch.aminmax(cache_seqlens))
        seqlens_range = (lo, hi)
        key_bound = min(max(hi + Lnew, 0), Lmax)
        if lo < 0:
            raise ValueError(f"{op}: cache_seqlens must be >= 0, got {lo}")
        if hi + Lnew > Lmax:
            raise ValueError(
                f"{op}: the cache is too small: cache_seqlens up to {hi} plus "
                f"{Lnew} new tokens exceed {capacity()}"
            )
    mode = 2 if causal_mode(causal) else 0
    left, right = window_sides(op, window)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    alibi = None
    if alibi_slopes is not None:
        check_tensor(op, "alibi_slopes", alibi_slopes, dims=(1, 2), float_dtype=True)
        if tuple(alibi_slopes.shape) not in ((Hq,), (B, Hq)):
            raise ValueError(
                f"{op}: alibi_slopes must be (Hq,) or (B, Hq), got {tuple(alibi_slopes.shape)}"
            )
        alibi = alibi_slopes.to(torch.float32).expand(B, Hq).contiguous()
    sinks = canonical_sinks(op, sinks, q, Hq)

    # The native backends attend with attention_decode (and fuse the append where their build
    # has attention_with_kvcache); the triton backend has the fused op only.
    limits = {}
    for name, kernel in (
        ("cpu", "attention_decode"),
        ("cuda", "attention_decode"),
        ("triton", "attention_with_kvcache"),
    ):
        why = _backend.missing_kernel(kernel, name)
        if why:
            limits[name] = why
    if softcap > 0:
        limits["torch"] = "softcap: torch's SDPA has no score capping"
    elif sinks is not None:
        limits["torch"] = "sinks: torch's SDPA returns no log-sum-exp to fold attention sinks into"
    elif alibi is not None and q.dtype in (torch.float16, torch.bfloat16):
        limits["torch"] = (
            f"alibi_slopes with {q.dtype} inputs: SDPA adds a float mask in q's dtype, which "
            f"would round the ALiBi bias (fastattn adds it in float32)"
        )
    speed_key = attention_with_kvcache_speed_key(
        q, k_cache, Lmax, mode, left, right, alibi, softcap, sinks, rotary_cos, block_table
    )
    chosen = _backend.select_backend(
        op, q.device, backend, limits=limits, dtype=q.dtype, speed_key=speed_key
    )
    # CUDA values are checked on the device, before anything is appended: by the native CUDA
    # op itself (a check kernel), here for the other backends.
    device_side = chosen != "cuda" and device_checks_enabled(cache_seqlens)
    if device_side:
        device_check_range(
            op,
            cache_seqlens,
            0,
            Lmax - Lnew,
            f"cache_seqlens must be in [0, Lmax - Lnew] = [0, {Lmax - Lnew}] "
            f"(the cache is too small for the new tokens otherwise; Lmax: {capacity()})",
        )
        if block_table is not None:
            bad = _bad_blocks(block_table, cache_seqlens, Lnew, k_cache.shape[2], k_cache.shape[0])
            device_check(
                op,
                ~bad.any(),
                f"block_table entries read or written must be block indices in "
                f"[0, num_blocks = {k_cache.shape[0]})",
            )
    if (
        block_table is not None
        and B > 0
        and chosen != "cpu"  # the native CPU op checks every entry it reads, before any write
        and host_checks_enabled(cache_seqlens)
    ):
        _host_check_blocks(op, block_table, cache_seqlens, Lnew, k_cache.shape[2], k_cache.shape[0])
    # One op for rotary, append and attention where the backend has it (triton; a native
    # build's attention_with_kvcache): a decoding step is short enough that a handful of ops'
    # dispatch and checks would cost more than the attention itself.
    if chosen == "torch":
        if rotary_cos is not None:  # before anything is appended
            assert rotary_sin is not None  # (given together, checked above)
            _check_rotary_tables(
                op,
                D,
                rotary_cos,
                rotary_sin,
                cache_seqlens,
                max(Lq, Lnew),
                on_device=True,
                positions_range=seqlens_range,
            )
        out = aten.attention_with_kvcache(
            q,
            k_cache,
            v_cache,
            cache_seqlens,
            k_new,
            v_new,
            rotary_cos,
            rotary_sin,
            bool(rotary_interleaved),
            alibi,
            scale,
            mode != 0,
            left,
            right,
            block_table,
            key_bound,
        )
        _backend.record_backend(op, chosen)
        return out
    if chosen != "reference" and not _backend.missing_kernel("attention_with_kvcache", chosen):
        if rotary_cos is not None:
            assert rotary_sin is not None  # (given together, checked above)
            _check_rotary_tables(
                op,
                D,
                rotary_cos,
                rotary_sin,
                cache_seqlens,
                max(Lq, Lnew),
                on_device=chosen != "cuda",
                positions_range=seqlens_range,
            )
            if chosen != "triton":  # the native op takes the tables in the compute dtype
                acc = torch.float64 if q.dtype == torch.float64 else torch.float32
                if rotary_cos.dtype != acc or not rotary_cos.is_contiguous():
                    rotary_cos = rotary_cos.to(acc).contiguous()
                if rotary_sin.dtype != acc or not rotary_sin.is_contiguous():
                    rotary_sin = rotary_sin.to(acc).contiguous()
        fused = (
            torch.ops.fastattn.attention_with_kvcache_triton
            if chosen == "triton"
            else torch.ops.fastattn.attention_with_kvcache
        )
        with _native.value_errors():  # the native op's paged-cache value checks
            out, lse = fused(
                q,
                k_cache,
                v_cache,
                cache_seqlens,
                k_new,
                v_new,
                rotary_cos,
                rotary_sin,
                bool(rotary_interleaved),
                alibi,
                scale,
                float(softcap),
                mode,
                left,
                right,
                int(num_splits),
                block_table,
            )
        if sinks is not None:
            out, _ = apply_sinks(out, lse, sinks, head_dim=1)
        _backend.record_backend(op, chosen)
        return out
    positions = cache_seqlens.to(torch.int64)
    rotary_backend = "reference" if chosen == "reference" else None
    if rotary_cos is not None:
        rot: dict[str, Any] = dict(
            cos=rotary_cos,
            sin=rotary_sin,
            interleaved=rotary_interleaved,
            offset=positions,
            backend=rotary_backend,
        )
        q = apply_rotary(q, **rot)
        if k_new is not None:
            k_new = apply_rotary(k_new, **rot)
    if k_new is not None and Lnew > 0:
        assert v_new is not None  # (given together, checked above)
        if block_table is not None:
            ref.append_paged(k_cache, v_cache, block_table, cache_seqlens, k_new, v_new)
        else:
            index = (positions.view(B, 1) + torch.arange(Lnew, device=q.device)).view(B, 1, Lnew, 1)
            k_cache.scatter_(2, index.expand(B, Hkv, Lnew, D), k_new)
            v_cache.scatter_(2, index.expand(B, Hkv, Lnew, Dv), v_new)
    k_lengths = (cache_seqlens + Lnew).to(torch.int32)
    q_positions = cache_seqlens.to(torch.int32)
    args = (
        q,
        k_cache,
        v_cache,
        k_lengths,
        q_positions,
        alibi,
        scale,
        float(softcap),
        mode,
        left,
        right,
    )
    if chosen == "reference":
        out, _ = ref.attention_decode(*args, sinks=sinks, block_table=block_table)
    else:
        with _native.value_errors():  # the native op's paged-cache value checks
            out, lse = torch.ops.fastattn.attention_decode(*args, int(num_splits), block_table)
        if sinks is not None:
            out, _ = apply_sinks(out, lse, sinks, head_dim=1)
    _backend.record_backend(op, chosen)
    return out


def attention_with_kvcache_speed_key(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    capacity: int,
    causal_mode: int,
    window_left: int,
    window_right: int,
    alibi_slopes: torch.Tensor | None,
    softcap: float,
    sinks: torch.Tensor | None,
    rotary_cos: torch.Tensor | None,
    block_table: torch.Tensor | None,
) -> tuple:
    """The call's key in the speed table (fastattn/speed_table.py), from static properties: the
    length class of the caches' capacity (Lmax; the lengths in use are tensor values), q's head
    dim, features "alibi", "causal", "gqa" (fewer cache heads than q's), "paged", "rotary",
    "sinks", "softcap", "window". Inference only: never a gradient."""
    # Plain conditionals, not tuple * bool: under torch.compile(dynamic=True) the head counts
    # are symbols, and torch 2.11 cannot repeat a tuple by a symbolic bool.
    flags = {
        "alibi": alibi_slopes is not None,
        "causal": causal_mode != 0,
        "gqa": k_cache.shape[1] != q.shape[1],
        "paged": block_table is not None,
        "rotary": rotary_cos is not None,
        "sinks": sinks is not None,
        "softcap": softcap > 0,
        "window": window_left >= 0 or window_right >= 0,
    }
    features = tuple(name for name, on in flags.items() if on)
    return speed_table.key(
        "attention_with_kvcache", q.dtype, length=capacity, head_dim=q.shape[3], features=features
    )


def _check_block_table(op, block_table, q, k_cache, v_cache) -> int:
    """Checks a paged call's block_table and pools; returns the table's capacity
    max_blocks_per_seq * block_size (the paged cache's Lmax)."""
    B, _, _, D = q.shape
    check_tensor(op, "block_table", block_table, dims=2)
    if block_table.dtype != torch.int32 or block_table.shape[0] != B:
        raise TypeError(
            f"{op}: block_table must be int32 (B, max_blocks_per_seq) with B = {B}, got "
            f"{block_table.dtype} {tuple(block_table.shape)}"
        )
    check_same_device(op, "q", q, block_table=block_table)
    num_blocks, Hkv, block_size = k_cache.shape[:3]
    if tuple(v_cache.shape[:3]) != (num_blocks, Hkv, block_size) or k_cache.shape[3] != D:
        raise ValueError(
            f"{op}: with block_table, k_cache must be a pool (num_blocks, Hkv, block_size, D) "
            f"with D = {D} and v_cache (num_blocks, Hkv, block_size, Dv) alike, got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if block_size <= 0 or block_size % 16:
        raise ValueError(
            f"{op}: the paged cache's block_size (k_cache.shape[2]) must be a positive "
            f"multiple of 16, got {block_size}"
        )
    capacity = block_table.shape[1] * block_size
    check_seqlen(op, "block_table's capacity (max_blocks_per_seq * block_size)", capacity)
    return capacity


def _bad_blocks(block_table, cache_seqlens, Lnew: int, block_size: int, num_blocks: int):
    """bool (B, max_blocks_per_seq): entries the call reads or writes (the first
    ceil((cache_seqlens[b] + Lnew) / block_size) of row b) that are not in [0, num_blocks)."""
    used = (cache_seqlens.to(torch.int64) + Lnew + block_size - 1) // block_size
    cols = torch.arange(block_table.shape[1], device=block_table.device)
    needed = cols.view(1, -1) < used.view(-1, 1)
    return needed & ((block_table < 0) | (block_table >= num_blocks))


def _host_check_blocks(op, block_table, cache_seqlens, Lnew, block_size, num_blocks) -> None:
    bad = _bad_blocks(block_table, cache_seqlens, Lnew, block_size, num_blocks)
    if bool(bad.any()):
        b, col = (int(x) for x in bad.nonzero()[0])
        raise ValueError(
            f"{op}: block_table[{b}, {col}] = {int(block_table[b, col])} is outside the pool: "
            f"block indices must be in [0, num_blocks = {num_blocks})"
        )


def _register() -> None:
    """Fakes of the native ops and the Triton op, from the contract
    (fastattn/contracts/attention_with_kvcache.py)."""
    _backend.register_torch_op("attention_with_kvcache")
    register_native_fakes(
        {
            "attention_decode": contract.decode_fake,
            "attention_with_kvcache": contract.attention_with_kvcache_fake,
        }
    )
    kernels = triton_kernels("attention_with_kvcache")
    if kernels is not None:
        register_triton_op(
            "fastattn::attention_with_kvcache_triton",
            kernels.attention_with_kvcache,
            contract.attention_with_kvcache_fake,
            mutates_args=("k_cache", "v_cache"),
        )


_register()
