"""LSTM: `lstm_cell` and the multi-layer `lstm` (public functions, argument checks, backend
choice, registration with the contract of fastattn/contracts/lstm.py).

The multi-layer driver below is plain Python (layers, directions, inter-layer dropout, batch_first,
unbatched input): it calls one op per layer, which runs every direction of that layer, and stays
torch.compile(fullgraph=True)-traceable (no host reads of tensor values: lengths are read inside
the op). Backends: "cpu"/"cuda" run the native ops below (csrc/lstm on the recurrent engine of
csrc/recurrent), "triton" runs the same ops suffixed _triton (fastattn/triton/lstm.py), "reference"
runs fastattn/reference/lstm.py (a per-step loop) under torch autograd, "torch" torch's own LSTM
and LSTM cell (fastattn/aten/lstm.py) for the calls they compute as fastattn defines them (not
dropout; see there), chosen automatically only where a speed table measured them faster.

The ops' contract (schemas, shapes, workspaces, fakes, backward formulas) is
fastattn/contracts/lstm.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import _backend
from ..aten import lstm as aten_lstm
from ..aten._recurrent import host_lengths
from ..contracts import lstm as contract
from ..reference import lstm as ref
from ._common import (
    check_same_device,
    dropout_seed,
    kernel_op,
    register_autograd,
    register_native_fakes,
    register_triton_op,
    triton_kernels,
)
from ._recurrent import check_float, check_lengths, needs_grad, speed_key


def unsupported_backends(dtype: torch.dtype = torch.float32) -> dict[str, str]:
    """Backend -> why it cannot run the LSTM ops on `dtype` here (no kernel, or a dtype it
    refuses); the backends not named can."""
    limits = {}
    for name in ("cuda", "triton", "cpu"):
        reason = _backend.missing_kernel("lstm_layer", name)
        if not reason and name == "triton" and dtype == torch.float64:
            reason = _backend.TRITON_NO_FLOAT64
        if reason:
            limits[name] = reason
    return limits


def cuda_recurrent_path(
    input: torch.Tensor,
    w_hh: torch.Tensor,
    w_hr: torch.Tensor | None = None,
    *,
    backward: bool = False,
) -> str:
    """Which recurrent path the CUDA backend's lstm_layer (or, with backward=True,
    lstm_layer_backward) takes for one layer: a documented query, so a slow fallback is never
    silent.

    input: the layer's time-major (T, B, I) CUDA input (only its shape, dtype, device matter);
    w_hh: (D, 4H, P) or (4H, P); w_hr: the projection (D, P, H) / (P, H) or None.
    Returns "persistent" (one cooperative kernel runs every step of every direction, each block
    keeping its slice of W_hh in shared memory across the steps) or "per_step" (per step a
    cuBLAS GEMM with W_hh and a fused cell kernel). The persistent path needs: no projection,
    a device with cooperative launch, and, for some unit block U in 1, 2, 4, ..., 64, a
    co-resident grid of D * ceil(H / U) blocks with the block's W_hh slice ((H, 4U) forward,
    (4H, U) backward) in shared memory and B * 4U (forward) / B * U (backward) <= 4096.
    FASTATTN_LSTM_CUDA_PATH=per_step in the environment forces the per-step path. The answer is
    the occupancy query's, which assumes the whole GPU: if the cooperative launch still fails
    (cudaErrorCooperativeLaunchTooLarge, e.g. under MPS) the op runs the per-step path and warns
    once (TORCH_WARN_ONCE).
    """
    reason = _backend.missing_kernel("lstm_layer", "cuda")
    if reason:
        raise RuntimeError(f"cuda_recurrent_path: {reason}")
    if w_hh.dim() == 2:
        w_hh = w_hh.unsqueeze(0)
    if w_hr is not None and w_hr.dim() == 2:
        w_hr = w_hr.unsqueeze(0)
    code = torch.ops.fastattn.lstm_cuda_path(input, w_hh, w_hr, backward)
    return "persistent" if code == 0 else "per_step"


def _op(name: str, backend: str):
    return kernel_op(name + "_triton" if backend == "triton" else name)


def _check_shape(op: str, name: str, t: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{op}: {name} must have shape {tuple(shape)}, got {tuple(t.shape)}")


# ---------------------------------------------------------------------------------------------
# lstm_cell


def lstm_cell(
    input: torch.Tensor,
    hx: torch.Tensor,
    cx: torch.Tensor,
    w_ih: torch.Tensor,
    w_hh: torch.Tensor,
    b_ih: torch.Tensor | None = None,
    b_hh: torch.Tensor | None = None,
    *,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One LSTM step, fused (`torch.nn.LSTMCell`'s math and gate order i, f, g, o).

    `cy = f * cx + i * g` and `hy = o * tanh(cy)`, with (i, f, g, o) the sigmoid, sigmoid, tanh
    and sigmoid of `x W_ih^T + b_ih + hx W_hh^T + b_hh`. Every tensor has the same floating dtype
    and device.

    Args:
        input: (B, I), or unbatched (I,).
        hx: (B, H) or (H,), the previous hidden state.
        cx: (B, H) or (H,), the previous cell state.
        w_ih: (4H, I).
        w_hh: (4H, H).
        b_ih: (4H,) or None (both biases or neither).
        b_hh: (4H,) or None.
        backend: The backend for this call ("cpu", "triton", "cuda", "torch", "reference");
            None chooses automatically.

    Returns:
        (hy, cy), each shaped like hx.

    Raises:
        ValueError: Shapes, sizes, dtypes or devices that do not fit together (the messages read as
            torch's).
        BackendError: The backend asked for cannot run this call; the message says why.
    """
    op = "lstm_cell"
    check_float(op, "input", input)
    if input.dim() not in (1, 2):
        raise ValueError(
            f"{op}: input must be (B, I) or unbatched (I,), got shape {tuple(input.shape)}"
        )
    for name, t in (
        ("hx", hx),
        ("cx", cx),
        ("w_ih", w_ih),
        ("w_hh", w_hh),
        ("b_ih", b_ih),
        ("b_hh", b_hh),
    ):
        if t is not None:
            check_float(op, name, t, input.dtype)
    if (b_ih is None) != (b_hh is None):
        raise ValueError(f"{op}: b_ih and b_hh must be given together")
    check_same_device(op, "input", input, hx=hx, cx=cx, w_ih=w_ih, w_hh=w_hh, b_ih=b_ih, b_hh=b_hh)
    if w_hh.dim() != 2 or w_hh.shape[0] != 4 * w_hh.shape[1] or w_hh.shape[1] == 0:
        raise ValueError(f"{op}: w_hh must be (4H, H), got shape {tuple(w_hh.shape)}")
    H = w_hh.shape[1]
    batched = input.dim() == 2
    x = input if batched else input.unsqueeze(0)
    h = hx if batched else hx.unsqueeze(0)
    c = cx if batched else cx.unsqueeze(0)
    B, I = x.shape
    _check_shape(op, "w_ih", w_ih, (4 * H, I))
    # torch.nn.LSTMCell's (ATen's) wording for mismatched states
    for label, t in (("0", h), ("1", c)):
        if t.dim() != 2 or t.shape[0] != B:
            raise ValueError(
                f"{op}: Input batch size {B} doesn't match hidden{label} batch "
                f"size {t.shape[0] if t.dim() else 'of a 0-d tensor'}"
            )
        if t.shape[1] != H:
            raise ValueError(
                f"{op}: hidden{label} has inconsistent hidden_size: got {t.shape[1]}, expected {H}"
            )
    if b_ih is not None:
        assert b_hh is not None  # (given together, checked above)
        _check_shape(op, "b_ih", b_ih, (4 * H,))
        _check_shape(op, "b_hh", b_hh, (4 * H,))
    key = speed_key(op, x.dtype, 1, hidden=H, grad=needs_grad(x, h, c, w_ih, w_hh, b_ih, b_hh))
    chosen = _backend.select_backend(
        op, input.device, backend, limits=unsupported_backends(input.dtype), speed_key=key
    )
    if chosen == "torch":
        hy, cy = aten_lstm.lstm_cell(x, h, c, w_ih, w_hh, b_ih, b_hh)
    elif chosen == "reference":
        hy, cy = ref.lstm_cell(x, h, c, w_ih, w_hh, b_ih, b_hh)
    else:
        hy, cy, _ = _op("lstm_cell", chosen)(x, h, c, w_ih, w_hh, b_ih, b_hh)
    _backend.record_backend(op, chosen)
    return (hy, cy) if batched else (hy[0], cy[0])


# ---------------------------------------------------------------------------------------------
# lstm


def _split_weights(
    op: str, weights: Sequence[torch.Tensor], num_layers: int, D: int, proj_size: int
) -> tuple[list[list[torch.Tensor]], bool]:
    """weights in nn.LSTM's _flat_weights order -> per (layer, direction) lists, has_bias."""
    if not isinstance(weights, (list, tuple)):
        raise TypeError(
            f"{op}: weights must be a list or tuple of tensors (nn.LSTM's "
            f"_flat_weights order), got {type(weights).__name__}"
        )
    groups = num_layers * D
    per, rest = divmod(len(weights), groups)
    base = per - (1 if proj_size > 0 else 0)
    if rest or base not in (2, 4):
        want = " or ".join(str(groups * (n + (1 if proj_size > 0 else 0))) for n in (2, 4))
        raise ValueError(
            f"{op}: expected {want} weight tensors for num_layers={num_layers}, "
            f"{'bidirectional' if D == 2 else 'unidirectional'}, "
            f"proj_size={proj_size} (w_ih, w_hh[, b_ih, b_hh][, w_hr] per layer "
            f"and direction), got {len(weights)}"
        )
    return [list(weights[g * per : (g + 1) * per]) for g in range(groups)], base == 4


def lstm(
    input: torch.Tensor,
    hx: tuple[torch.Tensor, torch.Tensor] | None,
    weights: Sequence[torch.Tensor],
    *,
    num_layers: int,
    bidirectional: bool = False,
    batch_first: bool = False,
    dropout: float = 0.0,
    training: bool = False,
    proj_size: int = 0,
    lengths: torch.Tensor | None = None,
    backend: str | None = None,
):
    """A multi-layer (bidirectional, projected) LSTM over whole sequences, fused per layer.

    Computes what `torch.nn.LSTM` computes, with its weights. D below is 2 if bidirectional else
    1, and P is proj_size or H; layer l, direction d is row `l * D + d` of the states.

    Args:
        input: (T, B, I), (B, T, I) with `batch_first`, or unbatched (T, I).
        hx: (h0, c0) or None (zeros): h0 (num_layers * D, B, P), c0 (num_layers * D, B, H)
            ((num_layers * D, P) and (num_layers * D, H) for unbatched input).
        weights: In `nn.LSTM`'s `_flat_weights` order: per layer, per direction (forward, then
            reverse): w_ih (4H, I_l), w_hh (4H, P), [b_ih (4H,), b_hh (4H,)], [w_hr (P, H) with
            proj_size]; I_0 = I, then I_l = D * P.
        num_layers: The number of layers.
        bidirectional: Run a reverse direction too.
        batch_first: The input and output are (B, T, ...).
        dropout: The probability of dropping each output of every layer but the last, when
            training (fastattn's Philox stream: reproducible under `torch.manual_seed`, the same
            elements dropped on every backend).
        training: Whether dropout applies.
        proj_size: If > 0, projects h to proj_size features (`nn.LSTM`'s proj_size).
        lengths: (B,) integer sequence lengths (any order, each in [0, T]) of a padded batch: no
            work past a sequence's end, h_n and c_n taken at each sequence's last step, outputs
            past the end 0.
        backend: The backend for this call ("cpu", "triton", "cuda", "torch", "reference");
            None chooses automatically.

    Returns:
        (output, (h_n, c_n)) as `torch.nn.LSTM`: output (T, B, D * P) ((B, T, D * P) with
        `batch_first`, (T, D * P) unbatched), h_n (num_layers * D, B, P), c_n
        (num_layers * D, B, H).

    Raises:
        ValueError: Shapes, sizes, dtypes or devices that do not fit together (the messages read as
            torch's).
        BackendError: The backend asked for cannot run this call; the message says why.
    """
    op = "lstm"
    check_float(op, "input", input)
    if input.dim() not in (2, 3):
        raise ValueError(
            f"{op}: input must be 3-D ({'B, T' if batch_first else 'T, B'}, I) or "
            f"unbatched 2-D (T, I), got {input.dim()}-D"
        )
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"{op}: num_layers must be an int >= 1, got {num_layers!r}")
    if isinstance(proj_size, bool) or not isinstance(proj_size, int) or proj_size < 0:
        raise ValueError(f"{op}: proj_size must be an int >= 0, got {proj_size!r}")
    if (
        isinstance(dropout, bool)
        or not isinstance(dropout, (int, float))
        or not 0.0 <= dropout <= 1.0
    ):
        raise ValueError(f"{op}: dropout must be a number in [0, 1], got {dropout!r}")
    D = 2 if bidirectional else 1
    groups, has_bias = _split_weights(op, weights, num_layers, D, proj_size)
    dtype, device = input.dtype, input.device
    w_hh0 = groups[0][1]
    check_float(op, "weights[1] (w_hh of layer 0)", w_hh0, dtype)
    if w_hh0.dim() != 2 or w_hh0.shape[0] % 4 or w_hh0.shape[0] == 0:
        raise ValueError(
            f"{op}: w_hh must be (4 * hidden_size, proj_size or hidden_size), got "
            f"{tuple(w_hh0.shape)}"
        )
    H = w_hh0.shape[0] // 4
    P = proj_size if proj_size > 0 else H
    if proj_size >= H and proj_size > 0:
        raise ValueError(
            f"{op}: proj_size has to be smaller than hidden_size ({H}), got {proj_size}"
        )
    names = (
        ["w_ih", "w_hh"] + (["b_ih", "b_hh"] if has_bias else []) + (["w_hr"] if proj_size else [])
    )
    batched = input.dim() == 3
    x = input if batched else input.unsqueeze(1)  # (T, B, I) / (B, T, I)
    if batched and batch_first:
        x = x.transpose(0, 1)  # time-major, no copy
    T, B, I = x.shape
    for g, group in enumerate(groups):
        layer, direction = divmod(g, D)
        shapes = {
            "w_ih": (4 * H, I if layer == 0 else D * P),
            "w_hh": (4 * H, P),
            "b_ih": (4 * H,),
            "b_hh": (4 * H,),
            "w_hr": (P, H),
        }
        for name, w in zip(names, group):
            label = f"{name} of layer {layer}{' (reverse)' if direction else ''}"
            check_float(op, label, w, dtype)
            if tuple(w.shape) != shapes[name]:
                if name == "w_ih" and layer == 0 and w.dim() == 2 and w.shape[0] == 4 * H:
                    # torch.nn.LSTM's wording for the most common mistake
                    raise ValueError(
                        f"{op}: input.size(-1) must be equal to input_size. "
                        f"Expected {w.shape[1]}, got {I}"
                    )
                raise ValueError(
                    f"{op}: {label} must have shape {shapes[name]}, got {tuple(w.shape)}"
                )
            if w.device != device:
                raise ValueError(
                    f"{op}: Input and parameter tensors are not at the same "
                    f"device, found input tensor at {device} and parameter "
                    f"tensor ({label}) at {w.device}"
                )
    L = num_layers * D
    if hx is None:
        h0 = x.new_zeros((L, B, P))
        c0 = x.new_zeros((L, B, H))
    else:
        if not isinstance(hx, (tuple, list)) or len(hx) != 2:
            raise TypeError(f"{op}: hx must be a tuple (h0, c0) or None, got {type(hx).__name__}")
        h0, c0 = hx
        for i, t in enumerate((h0, c0)):
            check_float(op, f"hx[{i}]", t, dtype)
            if t.device != device:
                raise ValueError(
                    f"{op}: Input and hidden tensors are not at the same device, "
                    f"found input tensor at {device} and hidden tensor at "
                    f"{t.device}"
                )
        if batched:
            if h0.dim() != 3 or c0.dim() != 3:
                raise ValueError(
                    f"{op}: For batched 3-D input, hx and cx should also be 3-D but "
                    f"got ({h0.dim()}-D, {c0.dim()}-D) tensors"
                )
        else:
            if h0.dim() != 2 or c0.dim() != 2:
                raise ValueError(
                    f"{op}: For unbatched 2-D input, hx and cx should also be 2-D "
                    f"but got ({h0.dim()}-D, {c0.dim()}-D) tensors"
                )
            h0, c0 = h0.unsqueeze(1), c0.unsqueeze(1)
        if tuple(h0.shape) != (L, B, P):
            raise ValueError(f"{op}: Expected hidden[0] size {(L, B, P)}, got {list(h0.shape)}")
        if tuple(c0.shape) != (L, B, H):
            raise ValueError(f"{op}: Expected hidden[1] size {(L, B, H)}, got {list(c0.shape)}")
    given_lengths = lengths
    # The lengths rule of every recurrent op (ops/_recurrent.py). CPU lengths (as
    # pad_packed_sequence returns them) are checked on the host before they are copied, also for
    # CUDA inputs: reading them costs no synchronisation; no host read on CUDA, where the CUDA and
    # Triton kernels also clamp lengths into [0, T], so nothing is read or written out of bounds
    # even without the check.
    lengths = check_lengths(op, lengths, B, T, device)
    p = float(dropout) if training and num_layers > 1 else 0.0
    limits = unsupported_backends(dtype)
    refusal = aten_lstm.refusal(device, dtype, seq_len=T, dropout_p=p, lengths=given_lengths)
    if refusal is not None:
        limits["torch"] = refusal
    key = speed_key(
        op,
        dtype,
        T,
        hidden=H,
        grad=needs_grad(input, h0, c0, *weights),
        bidirectional=bidirectional,
        num_layers=num_layers,
        projection=proj_size > 0,
        lengths=lengths is not None,
        dropout=p > 0.0,
    )
    chosen = _backend.select_backend(op, device, backend, limits=limits, speed_key=key)
    if chosen == "torch":
        x, h_n, c_n = aten_lstm.lstm(
            x,
            h0,
            c0,
            weights,
            has_bias=has_bias,
            num_layers=num_layers,
            bidirectional=bidirectional,
            lengths=host_lengths(given_lengths),
        )
        _backend.record_backend(op, chosen)
        if not batched:
            return x[:, 0], (h_n[:, 0], c_n[:, 0])
        return (x.transpose(0, 1) if batch_first else x), (h_n, c_n)
    h_layers, c_layers = [], []
    for layer in range(num_layers):
        per_dir = groups[layer * D : (layer + 1) * D]

        def stacked(i: int) -> torch.Tensor:
            ws = [group[i] for group in per_dir]  # noqa: B023 (called in this iteration)
            return ws[0].unsqueeze(0) if D == 1 else torch.stack(ws)

        w_ih, w_hh = stacked(0), stacked(1)
        b_ih, b_hh = (stacked(2), stacked(3)) if has_bias else (None, None)
        w_hr = stacked(len(names) - 1) if proj_size else None
        p_layer = p if layer > 0 else 0.0
        if p_layer >= 1.0:  # F.dropout(p=1): every input of the layer is dropped
            x, p_layer = torch.zeros_like(x), 0.0
        seed = dropout_seed(p_layer, device)
        rows = slice(layer * D, (layer + 1) * D)
        args = (x, h0[rows], c0[rows], w_ih, w_hh, b_ih, b_hh, w_hr, lengths, p_layer, seed)
        if chosen == "reference":
            x, hl, cl = ref.lstm_layer(*args)
        else:
            # The states the backward needs are saved only when autograd will run it.
            save = torch.is_grad_enabled() and any(
                t is not None and t.requires_grad for t in args[:8]
            )
            x, hl, cl, _ = _op("lstm_layer", chosen)(*args, save)
        h_layers.append(hl)
        c_layers.append(cl)
    _backend.record_backend(op, chosen)
    h_n = torch.cat(h_layers) if num_layers > 1 else h_layers[0]
    c_n = torch.cat(c_layers) if num_layers > 1 else c_layers[0]
    if not batched:
        return x[:, 0], (h_n[:, 0], c_n[:, 0])
    return (x.transpose(0, 1) if batch_first else x), (h_n, c_n)


# ---------------------------------------------------------------------------------------------
# Registration: fakes and autograd of the native ops and of their Triton twins, from the
# contract (fastattn/contracts/lstm.py)


def _register() -> None:
    register_native_fakes(contract.FAKES)
    if _backend.has_op("lstm_layer"):
        for name, formula in contract.autograd_formulas(
            lambda name: getattr(torch.ops.fastattn, name), ref
        ).items():
            register_autograd(name, formula)
    kernels = triton_kernels("lstm")
    if kernels is None:
        return
    for name, fake in contract.FAKES.items():
        register_triton_op(f"fastattn::{name}_triton", getattr(kernels, name + "_triton"), fake)
    for name, formula in contract.autograd_formulas(
        lambda name: getattr(torch.ops.fastattn, name + "_triton"), ref
    ).items():
        register_autograd(name + "_triton", formula)


_register()
_backend.register_torch_op("lstm")
_backend.register_torch_op("lstm_cell")
