"""Positional encodings: sinusoidal tables, fused add-sinusoid, fused embedding + positions,
and rotary embeddings (public functions, backend choice, registration with the contract).

Backends: "cpu" and "cuda" run the native ops torch.ops.fastattn.<name> (csrc/positional),
"triton" runs torch.ops.fastattn.<name>_triton (fastattn/triton/positional.py), "torch" runs
torch's own elementwise kernels over a cached table (fastattn/aten/positional.py), "reference"
runs fastattn/reference/positional.py. All compute the same numbers: angles
pos * base^(-2i/dim) (inverse frequencies from float64, rounded once), arithmetic in float32
(float64 for float64 inputs), and dropout from fastattn's Philox stream, so a seeded call gives
the same mask on every backend (the torch backend refuses dropout: torch's dropout draws
another mask).
"""

from __future__ import annotations

import torch

from .. import _backend, speed_table
from ..aten import positional as aten
from ..contracts import positional as contract
from ..contracts import unit_last_stride
from ..reference import positional as ref
from ._common import (
    check_dropout,
    check_same_device,
    check_tensor,
    check_unit_last_stride,
    device_check_range,
    device_checks_enabled,
    dropout_seed,
    host_checks_enabled,
    kernel_op,
    register_autograd,
    register_native_fakes,
    register_triton_op,
    triton_kernels,
)

Offset = int | torch.Tensor

# Why the torch backend refuses a call with dropout (fastattn/aten/positional.py).
TORCH_NO_DROPOUT = (
    "dropout_p > 0: fastattn draws its dropout mask from its Philox stream (the same mask on "
    "every backend), which torch's dropout does not reproduce"
)


def _torch_limits(dropout_p: float) -> dict[str, str]:
    """The `limits` of a call with dropout probability dropout_p (select_backend)."""
    return {"torch": TORCH_NO_DROPOUT} if dropout_p > 0 else {}


def _features(*named: tuple[str, bool]) -> tuple[str, ...]:
    """The speed-table feature words of a call: the names whose flag is set."""
    return tuple(name for name, present in named if present)


def _needs_grad(*tensors: torch.Tensor | None) -> bool:
    """Whether autograd will record this call (a gradient pass follows, for the speed key)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# The calls' keys in the speed table (fastattn/speed_table.py), from the canonical arguments the
# public functions build (the benchmarks compute theirs with these): static properties only.


def sinusoidal_table_speed_key(num_positions: int, dtype: torch.dtype) -> tuple:
    return speed_table.key("sinusoidal_table", dtype, length=num_positions)


def add_sinusoidal_speed_key(
    x3: torch.Tensor, offsets: torch.Tensor | None, inplace: bool, dropout_p: float
) -> tuple:
    """x3 (N, L, D); features "offsets" (per-sequence starts), "inplace", "dropout"."""
    features = _features(
        ("offsets", offsets is not None), ("inplace", inplace), ("dropout", dropout_p > 0)
    )
    return speed_table.key(
        "add_sinusoidal", x3.dtype, length=x3.shape[1], features=features, grad=_needs_grad(x3)
    )


def embed_with_positions_speed_key(
    tokens: torch.Tensor,
    weight: torch.Tensor,
    table: torch.Tensor | None,
    offsets: torch.Tensor | None,
    dropout_p: float,
) -> tuple:
    """tokens (N, L); features "learned" (a positions table), "offsets", "dropout"."""
    features = _features(
        ("learned", table is not None), ("offsets", offsets is not None), ("dropout", dropout_p > 0)
    )
    grad = _needs_grad(weight, table)
    return speed_table.key(
        "embed_with_positions", weight.dtype, length=tokens.shape[1], features=features, grad=grad
    )


def apply_rotary_speed_key(
    x: torch.Tensor,
    cos: torch.Tensor | None,
    offsets: torch.Tensor | None,
    position_ids: torch.Tensor | None,
    rotary_dim: int,
    interleaved: bool,
    inplace: bool,
) -> tuple:
    """x (B, H, L, D); features "tables" (cos/sin given), "offsets", "position_ids",
    "interleaved" (GPT-J pairs), "partial" (rotary_dim < D), "inplace"."""
    features = _features(
        ("tables", cos is not None),
        ("offsets", offsets is not None),
        ("position_ids", position_ids is not None),
        ("interleaved", interleaved),
        ("partial", rotary_dim < x.shape[3]),
        ("inplace", inplace),
    )
    return speed_table.key(
        "apply_rotary",
        x.dtype,
        length=x.shape[2],
        head_dim=x.shape[3],
        features=features,
        grad=_needs_grad(x),
    )


def _native_op(name: str, backend: str):
    """The registered op that `backend` ("cpu", "cuda" or "triton") runs for `name`."""
    return kernel_op(name + "_triton" if backend == "triton" else name)


def _split_offset(
    op: str, offset: Offset, batch: int, device: torch.device, what: str = "batch size"
) -> tuple[int, torch.Tensor | None]:
    """offset -> (int part, int64 (batch,) tensor part or None)."""
    if isinstance(offset, torch.Tensor):
        check_tensor(op, "offset", offset, dims=(0, 1), int_dtype=True)
        if offset.device != device:
            raise ValueError(
                f"{op}: offset must be on the input's device ({device}), got {offset.device}"
            )
        if offset.dim() == 1 and offset.shape[0] != batch:
            raise ValueError(
                f"{op}: a tensor offset must have shape ({batch},) (the {what}), "
                f"got {tuple(offset.shape)}"
            )
        return 0, offset.to(torch.int64).expand(batch).contiguous()
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise TypeError(
            f"{op}: offset must be an int or an integer tensor, got {type(offset).__name__}"
        )
    if offset < 0:
        raise ValueError(f"{op}: offset must be >= 0, got {offset}")
    return offset, None


def _is_view_of(view: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether `view`, reshaped from a view of x, is a view of x's memory rather than a copy."""
    return view._base is not None and view._base is (x if x._base is None else x._base)


def check_position_range(
    op: str,
    offset: int,
    offsets: torch.Tensor | None,
    length: int,
    rows: int | None,
    what: str,
    *,
    on_device: bool = True,
    offsets_range: tuple[int, int] | None = None,
) -> None:
    """Positions offset + offsets[n] + l (l < length) must lie in [0, rows) (rows None: >= 0).

    CPU offsets (or FASTATTN_HOST_CHECKS=1) are read on the host and raise ValueError; CUDA
    offsets are checked asynchronously on the device (device_check), unless on_device is False
    (the caller's native CUDA op checks them itself). offsets_range: (min, max) of offsets, when
    the caller has already read them on the host (one read fewer per decoding step)."""
    if length == 0:
        return
    if offsets is not None and offsets.numel() > 0 and not host_checks_enabled(offsets):
        if on_device and device_checks_enabled(offsets):
            hi = None if rows is None else rows - length - offset
            allowed = ">= 0" if rows is None else f"in [0, {rows}) ({what} rows)"
            device_check_range(
                op,
                offsets,
                -offset,
                hi,
                f"positions offset + offsets[b] + l (l < {length}) must be {allowed}",
            )
        return
    if not host_checks_enabled():
        return
    lo = hi = offset
    if offsets is not None and offsets.numel() > 0:
        omin, omax = torch.aminmax(offsets) if offsets_range is None else offsets_range
        lo, hi = lo + int(omin), hi + int(omax)
    if lo < 0:
        raise ValueError(f"{op}: positions must be >= 0, got a smallest position of {lo}")
    if rows is not None and hi + length > rows:
        raise ValueError(f"{op}: positions reach {hi + length - 1} but {what} has {rows} rows")


# ---------------------------------------------------------------------------------------------
# sinusoidal_table


def sinusoidal_table(
    num_positions: int,
    dim: int,
    *,
    base: float = 10000.0,
    offset: int = 0,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """The sinusoidal position table of "Attention Is All You Need", interleaved.

    `PE[r, 2i] = sin(p / base^(2i / dim))` and `PE[r, 2i + 1] = cos(p / base^(2i / dim))` with
    `p = offset + r`.

    Args:
        num_positions: The rows of the table.
        dim: The features.
        base: The wavelength base.
        offset: The position of row 0.
        dtype: The table's dtype; default float32.
        device: The table's device.
        backend: The backend for this call ("cpu", "triton", "cuda", "torch", "reference");
            None chooses automatically.

    Returns:
        PE, (num_positions, dim).

    Raises:
        ValueError: A negative num_positions or a dim below 1.
    """
    op = "sinusoidal_table"
    if num_positions < 0 or dim < 1:
        raise ValueError(
            f"{op}: num_positions must be >= 0 and dim >= 1, got {num_positions} and {dim}"
        )
    if base <= 0:
        raise ValueError(f"{op}: base must be > 0, got {base}")
    if offset < 0:
        raise ValueError(f"{op}: offset must be >= 0, got {offset}")
    dtype = torch.float32 if dtype is None else dtype
    if dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        raise TypeError(f"{op}: dtype must be a floating dtype, got {dtype}")
    device = torch.device("cpu") if device is None else torch.device(device)
    speed_key = sinusoidal_table_speed_key(num_positions, dtype)
    chosen = _backend.select_backend(
        op, device, backend, kernel=op, dtype=dtype, speed_key=speed_key
    )
    _backend.record_backend(op, chosen)
    if chosen == "torch":
        return aten.sinusoidal_table(offset, num_positions, dim, float(base), dtype, device)
    positions = torch.arange(offset, offset + num_positions, dtype=torch.int64, device=device)
    if chosen == "reference":
        return ref.sinusoidal_table(positions, dim, float(base), dtype)
    return _native_op(op, chosen)(positions, dim, float(base), dtype)


# ---------------------------------------------------------------------------------------------
# add_sinusoidal


def _inplace_op(name: str, backend: str):
    """The in-place op (schema `name_(Tensor(a!) x, ...)`) that `backend` runs for `name`."""
    return getattr(torch.ops.fastattn, name + ("_triton_" if backend == "triton" else "_"))


class _InplaceAddSinusoidal(torch.autograd.Function):
    """add_sinusoidal(inplace=True) on a tensor that needs gradients: write x in place, mark it
    dirty; the gradient is the out-of-place op's (scale, then the forward's dropout mask)."""

    @staticmethod
    def forward(ctx, x, backend, offset, offsets, scale, base, dropout_p, seed):
        _inplace_op("add_sinusoidal", backend)(x, offset, offsets, scale, base, dropout_p, seed)
        ctx.mark_dirty(x)
        ctx.args = (backend, scale, dropout_p)
        ctx.save_for_backward(seed)
        return x

    @staticmethod
    def backward(ctx, grad):
        backend, scale, dropout_p = ctx.args
        (seed,) = ctx.saved_tensors
        g = _native_op("add_sinusoidal_backward", backend)(
            unit_last_stride(grad), scale, dropout_p, seed
        )
        return g, None, None, None, None, None, None, None


def add_sinusoidal(
    x: torch.Tensor,
    *,
    offset: Offset = 0,
    scale: float = 1.0,
    base: float = 10000.0,
    dropout_p: float = 0.0,
    seq_dim: int = 1,
    inplace: bool = False,
    backend: str | None = None,
) -> torch.Tensor:
    """`dropout(x * scale + PE)` in one pass, the sinusoid computed by the kernel.

    The caller passes no table; the CPU kernel computes the rows a batch shares once and keeps
    them.

    Args:
        x: (..., L, ..., D) with the sequence on `seq_dim` and the features last; typically
            (B, L, D) (seq_dim=1) or (L, B, D) (seq_dim=0). Any strides with a unit last stride.
        offset: An int, or an integer (B,) tensor of per-sequence start positions (for a 3-D x,
            B is the dimension that is not seq_dim; otherwise the product of the other leading
            dims).
        scale: Multiplies x first (`sqrt(d_model)` in the original Transformer).
        base: The wavelength base.
        dropout_p: Dropout on the sum, the kept elements scaled by `1 / (1 - p)`; reproducible
            under `torch.manual_seed`.
        seq_dim: The sequence dimension of x.
        inplace: Write the result into x and return x (no output is allocated; differentiable
            when x needs gradients, as long as x is not a leaf).
        backend: The backend for this call ("cpu", "triton", "cuda", "torch", "reference");
            None chooses automatically.

    Returns:
        A tensor shaped and laid out like x.

    Raises:
        ValueError: A bad seq_dim, or an offset tensor of the wrong shape.
        RuntimeError: Offsets out of range (on CUDA, a device-side assert).
    """
    op = "add_sinusoidal"
    check_tensor(op, "x", x, float_dtype=True)
    if x.dim() < 2:
        raise ValueError(f"{op}: x must have at least 2 dims (L, D), got shape {tuple(x.shape)}")
    check_unit_last_stride(op, "x", x)
    p = check_dropout(op, dropout_p)
    if base <= 0:
        raise ValueError(f"{op}: base must be > 0, got {base}")
    if inplace and any(st == 0 and n > 1 for st, n in zip(x.stride(), x.shape)):
        raise ValueError(
            f"{op}: inplace=True needs an x whose elements are distinct in memory, "
            f"got an expanded x (strides {tuple(x.stride())})"
        )
    nd = x.dim()
    if not -nd <= seq_dim < nd or seq_dim % nd == nd - 1:
        raise ValueError(
            f"{op}: seq_dim must index a dimension other than the last "
            f"(features) of a {nd}-D x, got {seq_dim}"
        )
    sd = seq_dim % nd
    if nd == 2:
        x3 = x.unsqueeze(0)
    elif nd == 3:
        x3 = x if sd == 1 else x.transpose(0, 1)
    else:
        moved = x.movedim(sd, -2)
        x3 = moved.reshape(-1, moved.shape[-2], moved.shape[-1])
        # In place needs x3 to be a view of x; otherwise the result is copied back into x.
        viewed = not inplace or _is_view_of(x3, x)
    off, offsets = _split_offset(op, offset, x3.shape[0], x.device)
    speed_key = add_sinusoidal_speed_key(x3, offsets, inplace, p)
    chosen = _backend.select_backend(
        op,
        x.device,
        backend,
        limits=_torch_limits(p),
        kernel=op,
        dtype=x.dtype,
        speed_key=speed_key,
    )
    seed = dropout_seed(p, x.device)
    args = (x3, off, offsets, float(scale), float(base), p, seed)
    # Every backend rejects per-sequence starts below 0 (the native kernels read no table, so
    # they do not check positions themselves): on the host for CPU tensors, on the device for
    # CUDA ones (no synchronisation).
    check_position_range(op, off, offsets, x3.shape[1], None, "")
    if inplace and (nd <= 3 or viewed):
        _backend.record_backend(op, chosen)
        if chosen == "reference":
            x3.copy_(ref.add_sinusoidal(*args))
        elif chosen == "torch":
            aten.add_sinusoidal(*args[:5], out=x3)
        elif x.requires_grad and torch.is_grad_enabled():
            _InplaceAddSinusoidal.apply(x3, chosen, *args[1:])
        else:
            _inplace_op(op, chosen)(*args)
        return x
    if chosen == "reference":
        out3 = ref.add_sinusoidal(*args)
    elif chosen == "torch":
        out3 = aten.add_sinusoidal(*args[:5])
    else:
        out3 = _native_op(op, chosen)(*args)
    _backend.record_backend(op, chosen)
    if inplace:  # x3 was a copy of a 4-D or larger x whose layout does not view as (N, L, D)
        return x.copy_(out3.reshape(moved.shape).movedim(-2, sd))
    if nd == 2:
        return out3[0]
    if nd == 3:
        return out3 if sd == 1 else out3.transpose(0, 1)
    return out3.reshape(moved.shape).movedim(-2, sd)


# ---------------------------------------------------------------------------------------------
# embed_with_positions


def embed_with_positions(
    tokens: torch.Tensor,
    weight: torch.Tensor,
    *,
    positions: str | torch.Tensor = "sinusoidal",
    scale: float = 1.0,
    offset: Offset = 0,
    padding_idx: int | None = None,
    dropout_p: float = 0.0,
    base: float = 10000.0,
    deterministic: bool = False,
    backend: str | None = None,
) -> torch.Tensor:
    """Token lookup, scale, positions and dropout in one pass.

    Computes `dropout(weight[tokens] * scale + P[offset + l])`, P the sinusoid or a learned table.

    Args:
        tokens: (B, L) or (L,) integer ids in [0, num_embeddings).
        weight: (num_embeddings, D), the embedding table; receives gradients (not at
            padding_idx).
        positions: "sinusoidal" (computed on the fly) or a learned (max_len, D) table with
            weight's dtype and device, which receives gradients.
        scale: Multiplies the looked-up embeddings.
        offset: An int or an integer (B,) tensor: token l of sequence b sits at `offset[b] + l`.
        padding_idx: As in `F.embedding`: that row gets no gradient (positions are still added).
        dropout_p: Dropout on the sum.
        base: The sinusoid's wavelength base.
        deterministic: Make the GPU backward bitwise reproducible (sorted sums instead of atomic
            adds; the CPU backward always is).
        backend: The backend for this call ("cpu", "triton", "cuda", "torch", "reference");
            None chooses automatically.

    Returns:
        (B, L, D), or (L, D) for (L,) tokens.

    Raises:
        ValueError: Shapes, dtypes or devices that do not fit together.
        RuntimeError: Token ids out of range, naming them (on CUDA, a device-side assert).
    """
    op = "embed_with_positions"
    check_tensor(op, "tokens", tokens, dims=(1, 2), int_dtype=True)
    check_tensor(op, "weight", weight, dims=2, float_dtype=True)
    check_unit_last_stride(op, "weight", weight)
    check_same_device(op, "weight", weight, tokens=tokens)
    p = check_dropout(op, dropout_p)
    table = None
    if isinstance(positions, torch.Tensor):
        table = positions
        check_tensor(op, "positions", table, dims=2, float_dtype=True)
        check_same_device(op, "weight", weight, positions=table)
        if table.dtype != weight.dtype or table.shape[1] != weight.shape[1]:
            raise ValueError(
                f"{op}: a learned positions table must be (max_len, "
                f"{weight.shape[1]}) with weight's dtype {weight.dtype}, got "
                f"{tuple(table.shape)} {table.dtype}"
            )
        check_unit_last_stride(op, "positions", table)
    elif positions != "sinusoidal":
        raise ValueError(
            f"{op}: positions must be 'sinusoidal' or a (max_len, D) tensor, got {positions!r}"
        )
    if base <= 0:
        raise ValueError(f"{op}: base must be > 0, got {base}")
    V = weight.shape[0]
    if padding_idx is None:
        pad = -1
    else:
        if not -V <= padding_idx < V:
            raise ValueError(f"{op}: padding_idx must be in [-{V}, {V}), got {padding_idx}")
        pad = padding_idx % V
    unbatched = tokens.dim() == 1
    tok = (tokens.unsqueeze(0) if unbatched else tokens).to(torch.int64)
    off, offsets = _split_offset(op, offset, tok.shape[0], weight.device)
    limits = _torch_limits(p)
    if (
        deterministic
        and _needs_grad(weight, table)
        and weight.device.type == "cuda"
        and not torch.are_deterministic_algorithms_enabled()
    ):
        limits["torch"] = (
            "deterministic=True on CUDA: torch's embedding backward is deterministic only "
            "under torch.use_deterministic_algorithms(True)"
        )
    speed_key = embed_with_positions_speed_key(tok, weight, table, offsets, p)
    chosen = _backend.select_backend(
        op,
        weight.device,
        backend,
        limits=limits,
        kernel=op,
        dtype=weight.dtype,
        speed_key=speed_key,
    )
    seed = dropout_seed(p, weight.device)
    args = (
        tok,
        weight,
        table,
        off,
        offsets,
        float(scale),
        float(base),
        p,
        seed,
        pad,
        bool(deterministic),
    )
    # The native ops check ranges themselves (on the host for CPU tensors, in a check kernel
    # for CUDA ones); FASTATTN_HOST_CHECKS=1 also checks CUDA tensors here, with Python errors.
    checked_here = ("triton", "torch", "reference")
    if chosen in checked_here or (chosen == "cuda" and host_checks_enabled(tok)):
        if tok.numel() > 0 and host_checks_enabled(tok):
            lo, hi = (int(v) for v in torch.aminmax(tok))
            if lo < 0 or hi >= V:
                raise IndexError(f"{op}: token ids must be in [0, {V}), got ids from {lo} to {hi}")
        elif device_checks_enabled(tok):
            device_check_range(op, tok, 0, V - 1, f"token ids must be in [0, {V})")
        check_position_range(
            op,
            off,
            offsets,
            tok.shape[1],
            None if table is None else table.shape[0],
            "the positions table",
        )
    if chosen == "reference":
        out = ref.embed_with_positions(*args)
    elif chosen == "torch":
        out = aten.embed_with_positions(tok, weight, table, off, offsets, *args[5:7], pad)
    else:
        out = _native_op(op, chosen)(*args)
    _backend.record_backend(op, chosen)
    return out[0] if unbatched else out


# ---------------------------------------------------------------------------------------------
# learned_positions


def learned_positions(
    table: torch.Tensor, offset: Offset, length: int, *, caller: str = "learned_positions"
) -> torch.Tensor:
    """Rows offset + l (l < length) of a learned positions table (max_len, D): (length, D) for
    an int offset, (B, length, D) for an integer (B,) tensor of per-sequence offsets.
    Differentiable in table. Positions outside [0, max_len) raise ValueError naming `caller`:
    on the host for an int or CPU offsets; for CUDA offsets asynchronously on the device (no
    synchronisation; indexing would assert too).
    """
    max_len = table.shape[0]
    if isinstance(offset, torch.Tensor):
        rows = offset.to(torch.int64).view(-1, 1) + torch.arange(length, device=table.device)
        if host_checks_enabled(rows):
            if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= max_len):
                raise ValueError(
                    f"{caller}: positions must be in [0, {max_len}), got offsets "
                    f"{offset.tolist()} with L={length}"
                )
        elif device_checks_enabled(rows):
            device_check_range(
                caller, rows, 0, max_len - 1, f"positions offset + l must be in [0, {max_len})"
            )
        return table[rows]
    if offset < 0 or offset + length > max_len:
        raise ValueError(
            f"{caller}: positions {offset}..{offset + length - 1} exceed max_len {max_len}"
        )
    return table[offset : offset + length]


# ---------------------------------------------------------------------------------------------
# apply_rotary


def _inplace_rotary_op(backend: str):
    ops = torch.ops.fastattn
    return ops.apply_rotary_triton_ if backend == "triton" else ops.apply_rotary_


class _InplaceRotary(torch.autograd.Function):
    """apply_rotary(inplace=True) on a tensor that needs gradients: rotate in place, mark x
    dirty, and rotate the gradient back in the backward."""

    @staticmethod
    def forward(
        ctx, x, backend, cos, sin, offset, offsets, position_ids, rotary_dim, base, interleaved
    ):
        _inplace_rotary_op(backend)(
            x, cos, sin, offset, offsets, position_ids, rotary_dim, base, interleaved, False
        )
        ctx.mark_dirty(x)
        ctx.args = (backend, offset, rotary_dim, base, interleaved)
        ctx.save_for_backward(cos, sin, offsets, position_ids)
        return x

    @staticmethod
    def backward(ctx, grad):
        backend, offset, rotary_dim, base, interleaved = ctx.args
        cos, sin, offsets, position_ids = ctx.saved_tensors
        g = _native_op("apply_rotary", backend)(
            unit_last_stride(grad),
            cos,
            sin,
            offset,
            offsets,
            position_ids,
            rotary_dim,
            base,
            interleaved,
            True,
        )
        return g, None, None, None, None, None, None, None, None, None


def apply_rotary(
    x: torch.Tensor,
    *,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    base: float = 10000.0,
    interleaved: bool = False,
    offset: Offset = 0,
    position_ids: torch.Tensor | None = None,
    rotary_dim: int | None = None,
    inplace: bool = False,
    backend: str | None = None,
) -> torch.Tensor:
    """Rotary position embedding (RoPE) of x.

    No gradient flows to cos and sin (pass tables that do not require grad).

    Args:
        x: (B, H, L, D), any strides with a unit last stride (a (B, L, H, D) tensor passed as
            `x.transpose(1, 2)` needs no copy).
        cos: (max_position, rotary_dim / 2) table indexed by absolute position, or None: the
            angles `pos * base^(-2i / rotary_dim)` are then computed in the kernel.
        sin: (max_position, rotary_dim / 2), with cos.
        base: The wavelength base, without tables.
        interleaved: False: GPT-NeoX layout (feature i pairs with `i + rotary_dim / 2`); True:
            GPT-J layout (features 2i and 2i + 1 pair).
        offset: An int or an integer (B,) tensor; token l of sequence b sits at `offset[b] + l`.
        position_ids: (B, L) or (L,) integer positions; overrides offset.
        rotary_dim: The features rotated (even, at most D; default D, or `2 * cos.shape[1]`); the
            others pass through unchanged.
        inplace: Rotate x in place and return it (differentiable when x needs gradients).
        backend: The backend for this call ("cpu", "triton", "cuda", "torch", "reference");
            None chooses automatically.

    Returns:
        The rotated tensor, shaped like x.

    Raises:
        ValueError: An odd or too large rotary_dim, or tables and positions of the wrong shape.
        RuntimeError: Positions beyond the tables (on CUDA, a device-side assert).
    """
    op = "apply_rotary"
    check_tensor(op, "x", x, dims=4, float_dtype=True)
    check_unit_last_stride(op, "x", x)
    B, H, L, D = x.shape
    if (cos is None) != (sin is None):
        raise ValueError(f"{op}: cos and sin must be given together")
    if rotary_dim is None:
        rotary_dim = 2 * cos.shape[-1] if cos is not None and cos.dim() == 2 else D
    if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > D:
        raise ValueError(
            f"{op}: rotary_dim must be even and in [2, {D}] (head dim), got {rotary_dim}"
        )
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    if cos is not None:
        for name, t in (("cos", cos), ("sin", sin)):
            check_tensor(op, name, t, dims=2, float_dtype=True)
            assert t is not None  # (check_tensor refuses None)
            if t.shape[1] != rotary_dim // 2:
                raise ValueError(
                    f"{op}: {name} must be (max_position, rotary_dim / 2 = "
                    f"{rotary_dim // 2}), got {tuple(t.shape)}"
                )
            if t.requires_grad and torch.is_grad_enabled():
                raise ValueError(f"{op}: no gradient flows to {name}; pass {name}.detach()")
        assert sin is not None  # (checked in the loop above)
        if cos.shape != sin.shape:
            raise ValueError(
                f"{op}: cos and sin must have the same shape, got "
                f"{tuple(cos.shape)} and {tuple(sin.shape)}"
            )
        check_same_device(op, "x", x, cos=cos, sin=sin)
        cos, sin = cos.to(acc).contiguous(), sin.to(acc).contiguous()
    elif base <= 0:
        raise ValueError(f"{op}: base must be > 0, got {base}")
    rows = None if cos is None else cos.shape[0]
    if position_ids is not None:
        check_tensor(op, "position_ids", position_ids, dims=(1, 2), int_dtype=True)
        check_same_device(op, "x", x, position_ids=position_ids)
        if position_ids.shape[-1] != L or (position_ids.dim() == 2 and position_ids.shape[0] != B):
            raise ValueError(
                f"{op}: position_ids must be (B, L) = ({B}, {L}) or (L,), got "
                f"{tuple(position_ids.shape)}"
            )
        position_ids = position_ids.to(torch.int64).expand(B, L).contiguous()
        off, offsets = 0, None
    else:
        off, offsets = _split_offset(op, offset, B, x.device)
    speed_key = apply_rotary_speed_key(
        x, cos, offsets, position_ids, rotary_dim, interleaved, inplace
    )
    chosen = _backend.select_backend(
        op, x.device, backend, kernel=op, dtype=x.dtype, speed_key=speed_key
    )
    # As in embed_with_positions: the native ops check positions themselves.
    ids_or_x = x if position_ids is None else position_ids
    if chosen in ("triton", "torch", "reference") or (
        chosen == "cuda" and host_checks_enabled(ids_or_x)
    ):
        if position_ids is not None:
            allowed = "be >= 0" if rows is None else f"be in [0, {rows}) (cos/sin rows)"
            if position_ids.numel() == 0:
                pass
            elif host_checks_enabled(position_ids):
                lo, hi = (int(v) for v in torch.aminmax(position_ids))
                if lo < 0 or (rows is not None and hi >= rows):
                    raise ValueError(
                        f"{op}: position_ids must {allowed}, got values from {lo} to {hi}"
                    )
            elif device_checks_enabled(position_ids):
                device_check_range(
                    op,
                    position_ids,
                    0,
                    None if rows is None else rows - 1,
                    f"position_ids must {allowed}",
                )
        else:
            check_position_range(op, off, offsets, L, rows, "cos/sin")
    args = (cos, sin, off, offsets, position_ids, rotary_dim, float(base), bool(interleaved))
    _backend.record_backend(op, chosen)
    if chosen in ("reference", "torch"):
        # Both compute a new tensor; in place, it is copied into x (differentiable).
        rotary = ref.apply_rotary if chosen == "reference" else aten.apply_rotary
        out = rotary(x, *args)
        if inplace:
            return x.copy_(out)
        return out
    if not inplace:
        return _native_op(op, chosen)(x, *args, False)
    if x.requires_grad and torch.is_grad_enabled():
        return _InplaceRotary.apply(x, chosen, *args)
    _inplace_rotary_op(chosen)(x, *args, False)
    return x


# ---------------------------------------------------------------------------------------------
# Registration: fakes and autograd of the native ops and of their Triton twins, from the
# contract (fastattn/contracts/positional.py)


def _triton_name(name: str) -> str:
    """The Triton op of native op `name`: add_sinusoidal_ -> add_sinusoidal_triton_."""
    return name[:-1] + "_triton_" if name.endswith("_") else name + "_triton"


def _register() -> None:
    for name in ("sinusoidal_table", "add_sinusoidal", "embed_with_positions", "apply_rotary"):
        _backend.register_torch_op(name)
    register_native_fakes(contract.FAKES)
    if _backend.has_op("apply_rotary"):
        formulas = contract.autograd_formulas(
            lambda name: getattr(torch.ops.fastattn, name), ref.embed_with_positions
        )
        for name, formula in formulas.items():
            register_autograd(name, formula)
    kernels = triton_kernels("positional")
    if kernels is None:
        return
    for name, fake in contract.FAKES.items():
        mutates = ("x",) if name.endswith("_") else ()
        register_triton_op(
            f"fastattn::{_triton_name(name)}", getattr(kernels, name), fake, mutates_args=mutates
        )
    formulas = contract.autograd_formulas(
        lambda name: getattr(torch.ops.fastattn, _triton_name(name)), ref.embed_with_positions
    )
    for name, formula in formulas.items():
        register_autograd(_triton_name(name), formula)


_register()
