"""The positional encodings on the torch backend: torch's own elementwise kernels over a cached
sinusoid table, as PyTorch models write them ("the one-pass cached-table add"), with autograd
from torch.

The numbers are fastattn's (fastattn/reference/positional.py): angles pos * inv_freq with
inv_freq = base^(-2i/dim) from float64 rounded once, sin/cos and the add in the compute type
(float32 for float16/bfloat16/float32, float64 for float64), rounded once to the input's dtype.
A table row r holds exactly the values fastattn computes for position r, so rows of the cache
stand in for the sinusoid of the call's positions:
- add_sinusoidal: torch.add(PE[positions], x, alpha=scale), written straight into the output
  (or into x, in place) in x's dtype when no gradient is needed;
- embed_with_positions: F.embedding, then the same add;
- apply_rotary: the rotation of fastattn's definition with cos/sin gathered by position (the
  sinusoid table's odd and even columns, or the caller's tables);
- sinusoidal_table: a copy of the cached rows.
The cache holds one table per (device, compute dtype, dim, base), grown to the next power of two
of the rows a call reaches and kept up to MAX_CACHED_ELEMENTS values. Positions held in tensors
(per-sequence offsets, position_ids), rows past that size, and calls traced by torch.compile
or run under a FakeTensorMode compute the sinusoid of their positions in the call instead: the
cache's size would otherwise depend on tensor values (a host read), or be a tensor constant of
the graph (or a fake tensor in the cache).

Dropout is not here: fastattn's mask comes from its Philox stream, which torch's dropout does
not draw, so the op layer refuses dropout_p > 0 on this backend.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..contracts import compute_dtype

# A table is cached while it holds at most this many values (64 MiB in float32), and at most
# MAX_CACHED_TABLES tables are kept (the oldest is dropped first).
MAX_CACHED_ELEMENTS = 1 << 24
MAX_CACHED_TABLES = 16
MIN_CACHED_ROWS = 256

_tables: dict[tuple, torch.Tensor] = {}


def inverse_frequencies(
    dim: int, base: float, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """(ceil(dim / 2),) inv_freq[i] = base^(-2i/dim): fastattn's definition, evaluated in
    float64 and rounded once to `dtype` (every backend's angles start from these numbers)."""
    i2 = torch.arange(0, dim, 2, dtype=torch.float64, device=device)
    return torch.exp2(-(i2 / dim) * math.log2(base)).to(dtype)


def _sinusoid(positions: torch.Tensor, dim: int, base: float, dtype: torch.dtype) -> torch.Tensor:
    """(*positions.shape, dim) interleaved sinusoid in `dtype` (a compute type): column 2i holds
    sin(p * inv_freq[i]), column 2i + 1 cos(p * inv_freq[i])."""
    angle = positions.to(dtype).unsqueeze(-1) * inverse_frequencies(
        dim, base, dtype, positions.device
    )
    return torch.stack((angle.sin(), angle.cos()), dim=-1).flatten(-2)[..., :dim]


def _faking() -> bool:
    """Whether a FakeTensorMode is active: its tensors must not enter the cache, and the cache's
    real tensors must not enter its calls."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None


def _cached_table(rows: int, dim: int, base: float, dtype: torch.dtype, device: torch.device):
    """The cached sinusoid table (>= rows, dim) for (device, dtype, dim, base), built or grown
    as needed; None when a table of that size is not cached (too large), or when torch.compile
    traces or a FakeTensorMode runs the call."""
    if torch.compiler.is_compiling() or _faking():
        return None
    key = (device, dtype, dim, float(base))
    table = _tables.get(key)
    if table is not None and table.shape[0] >= rows:
        return table
    capacity = max(MIN_CACHED_ROWS, 1 << max(rows - 1, 0).bit_length())
    if capacity * dim > MAX_CACHED_ELEMENTS:
        return None
    # An ordinary tensor even under inference_mode: later calls may need it in autograd.
    with torch.inference_mode(False), torch.no_grad():
        positions = torch.arange(capacity, dtype=torch.int64, device=device)
        table = _sinusoid(positions, dim, base, dtype)
    _tables.pop(key, None)
    while len(_tables) >= MAX_CACHED_TABLES:
        _tables.pop(next(iter(_tables)))
    _tables[key] = table
    return table


def clear_cache() -> None:
    """Forget every cached table (their memory is freed once no output views them)."""
    _tables.clear()


def sinusoid_rows(
    offset: int, length: int, dim: int, base: float, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """(length, dim) sinusoid of positions offset .. offset + length - 1 in compute type `dtype`:
    a view of the cached table when it is cached (do not write into it)."""
    table = _cached_table(offset + length, dim, base, dtype, device)
    if table is not None:
        return table[offset : offset + length]
    positions = torch.arange(offset, offset + length, dtype=torch.int64, device=device)
    return _sinusoid(positions, dim, base, dtype)


def _positions(
    N: int, L: int, offset: int, offsets: torch.Tensor, device: torch.device
) -> torch.Tensor:
    """(N, L) int64 positions offset + offsets[n] + l."""
    steps = torch.arange(L, dtype=torch.int64, device=device)
    return offsets.to(torch.int64).view(N, 1) + (steps + offset)


def sinusoidal_table(
    offset: int,
    num_positions: int,
    dim: int,
    base: float,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """PE (num_positions, dim) for positions offset + r, in `dtype` (a new tensor)."""
    rows = sinusoid_rows(offset, num_positions, dim, base, compute_dtype(dtype), device)
    return rows.to(dtype, copy=True)


def add_sinusoidal(
    x: torch.Tensor,
    offset: int,
    offsets: torch.Tensor | None,
    scale: float,
    base: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """x * scale + PE[offset + offsets[n] + l] for x (N, L, D), laid out like x.

    out: None, or the tensor to write the result into (x itself for the in-place op); then it
        is returned. Differentiable in x (a written x is marked by autograd as usual: a leaf
        that requires grad raises).
    """
    N, L, D = x.shape
    acc = compute_dtype(x.dtype)
    if offsets is None:
        pe = sinusoid_rows(offset, L, D, base, acc, x.device)  # (L, D), broadcast over N
    elif x.stride(0) < x.stride(1):
        # A sequence-first x ((L, N, D) in memory): build PE in that order, so the sum keeps
        # x's layout (elementwise results follow their first full operand's strides).
        pe = _sinusoid(_positions(N, L, offset, offsets, x.device).t(), D, base, acc)
        pe = pe.transpose(0, 1)
    else:
        pe = _sinusoid(_positions(N, L, offset, offsets, x.device), D, base, acc)
    if torch.is_grad_enabled() and x.requires_grad:
        # out= takes no part in autograd: compute, then write (copy_ is differentiable).
        result = torch.add(pe, x, alpha=scale).to(x.dtype)
        return result if out is None else out.copy_(result)
    if out is None:
        out = torch.empty_like(x)
    # One pass: x is read in x's dtype, summed in the compute type, rounded into out.
    return torch.add(pe, x, alpha=scale, out=out)


def embed_with_positions(
    tokens: torch.Tensor,
    weight: torch.Tensor,
    table: torch.Tensor | None,
    offset: int,
    offsets: torch.Tensor | None,
    scale: float,
    base: float,
    padding_idx: int,
) -> torch.Tensor:
    """weight[tokens] * scale + P[offset + offsets[n] + l] for tokens (N, L): (N, L, D) in
    weight's dtype. P: the sinusoid (table None) or the learned table (rows, D). Differentiable
    in weight (no gradient at padding_idx >= 0) and in table."""
    N, L = tokens.shape
    D = weight.shape[1]
    acc = compute_dtype(weight.dtype)
    emb = F.embedding(tokens, weight, padding_idx=padding_idx if padding_idx >= 0 else None)
    if table is None:
        if offsets is None:
            pe = sinusoid_rows(offset, L, D, base, acc, weight.device)
        else:
            pe = _sinusoid(_positions(N, L, offset, offsets, weight.device), D, base, acc)
    elif offsets is None:
        pe = table[offset : offset + L]
    else:
        # F.embedding's backward: index_put with accumulation (table[positions]'s) is not
        # deterministic on the CPU.
        pe = F.embedding(_positions(N, L, offset, offsets, weight.device), table)
    # In the compute type: a 16-bit add would round alpha (the scale) to 16 bits.
    return torch.add(pe.to(acc), emb, alpha=scale).to(weight.dtype)


def _rotary_cos_sin(
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    offset: int,
    offsets: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    B: int,
    L: int,
    rotary_dim: int,
    base: float,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of the call's angles, each (L, rotary_dim / 2) when every sequence shares its
    positions, else (B, L, rotary_dim / 2), in compute type `dtype`."""
    if position_ids is None and offsets is None:
        if cos is not None:
            assert sin is not None, "cos and sin are given together"
            return cos[offset : offset + L], sin[offset : offset + L]
        rows = sinusoid_rows(offset, L, rotary_dim, base, dtype, device)
        return rows[:, 1::2], rows[:, 0::2]  # the sinusoid interleaves sin and cos
    positions = position_ids
    if positions is None:
        assert offsets is not None  # (position_ids and offsets both None returned above)
        positions = _positions(B, L, offset, offsets, device)
    if cos is not None:
        assert sin is not None, "cos and sin are given together"
        return cos[positions], sin[positions]
    angle = positions.to(dtype).unsqueeze(-1) * inverse_frequencies(rotary_dim, base, dtype, device)
    return angle.cos(), angle.sin()


def apply_rotary(
    x: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    offset: int,
    offsets: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    rotary_dim: int,
    base: float,
    interleaved: bool,
) -> torch.Tensor:
    """x (B, H, L, D) with its first rotary_dim features rotated by position (a new tensor, in
    x's dtype); the rest pass through unchanged. cos/sin: (rows, rotary_dim / 2) in the compute
    type, or None (angles pos * base^(-2i/rotary_dim)). NeoX layout pairs features i and
    i + rotary_dim / 2, GPT-J (interleaved) 2i and 2i + 1. Differentiable in x."""
    B, H, L, D = x.shape
    acc = compute_dtype(x.dtype)
    c, s = _rotary_cos_sin(
        cos, sin, offset, offsets, position_ids, B, L, rotary_dim, base, acc, x.device
    )
    if c.dim() == 3:  # per-sequence positions: (B, 1, L, rotary_dim / 2) over the heads
        c, s = c.unsqueeze(1), s.unsqueeze(1)
    rot = x[..., :rotary_dim].to(acc)
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        rotated = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2)
    else:
        x1, x2 = rot.chunk(2, dim=-1)
        rotated = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    if rotary_dim == D:
        return rotated.to(x.dtype)
    return torch.cat((rotated.to(x.dtype), x[..., rotary_dim:]), dim=-1)
