"""The multi-layer driver shared by the GRU and Elman RNN ops (fastattn/ops/gru.py, rnn.py):
argument checks with torch's wording, backend choice, one layer op per layer, and the
registration of the layer ops' autograd and fake implementations, which the op contract of
fastattn::gru_layer / rnn_layer and their backward ops defines (fastattn/contracts/recurrent.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .. import _backend, _native, speed_table
from ..aten import gru as aten_gru
from ..aten import rnn as aten_rnn
from ..aten._recurrent import host_lengths
from ..contracts import recurrent as contract
from ._common import (
    FLOAT_DTYPES,
    device_check_range,
    device_checks_enabled,
    dropout_seed,
    host_checks_enabled,
    kernel_op,
    register_triton_op,
    triton_kernels,
)

GATES = {"gru": 3, "rnn": 1}


def has_op(name: str, dispatch_key: str | None = None) -> bool:
    try:
        getattr(torch.ops.fastattn, name)
    except (AttributeError, RuntimeError):
        return False
    return dispatch_key is None or torch._C._dispatch_has_kernel_for_dispatch_key(
        f"fastattn::{name}", dispatch_key
    )


_reason_cache: dict[tuple[str, str, bool], str] = {}


@torch.compiler.assume_constant_result
def limit_reason(family: str, backend: str, float64: bool) -> str:
    """Why `backend` cannot run the `family` ("gru" or "rnn") layer ops ("" when it can)."""
    key = (family, backend, float64)
    if key not in _reason_cache:
        reason = ""
        upper = family.upper()
        if backend in ("cpu", "cuda"):
            dispatch_key = backend.upper()
            if _native.C is None or not has_op(f"{family}_layer", dispatch_key):
                reason = f"fastattn._C has no {dispatch_key} {upper} kernel in this build"
        elif backend == "triton":
            if not has_op(f"{family}_layer_triton"):
                reason = f"fastattn has no Triton {upper} kernel (fastattn/triton)"
            elif float64:
                reason = "the triton backend does not take float64"
        _reason_cache[key] = reason
    return _reason_cache[key]


def unsupported_backends(family: str, dtype: torch.dtype = torch.float32) -> dict[str, str]:
    """Backend -> why it cannot run the `family` ops on `dtype` here; the others can."""
    limits = {}
    for name in ("cuda", "triton", "cpu"):
        reason = limit_reason(family, name, dtype == torch.float64)
        if reason:
            limits[name] = reason
    return limits


def cuda_recurrent_path(
    family: str, input: torch.Tensor, w_hh: torch.Tensor, variant, backward: bool = False
) -> str:
    """Which recurrent path the CUDA backend's `family`_layer (`family`_layer_backward with
    backward=True) takes for one layer (as fastattn.ops.lstm.cuda_recurrent_path): "persistent"
    (one cooperative kernel for every step and direction, each block keeping its slice of W_hh
    in shared memory) or "per_step" (cuBLAS + a fused cell kernel per step; two of each per
    step for the reset-before GRU). input: the layer's time-major (T, B, I) CUDA input (shape,
    dtype, device only); w_hh (D, G H, H) or (G H, H); variant: reset_after (GRU) or the
    nonlinearity (RNN)."""
    reason = limit_reason(family, "cuda", False)
    if reason:
        raise RuntimeError(f"cuda_recurrent_path: {reason}")
    if w_hh.dim() == 2:
        w_hh = w_hh.unsqueeze(0)
    if family == "gru":
        cell = "gru" if variant else "gru_reset_before"
    else:
        cell = f"rnn_{variant}"
    code = torch.ops.fastattn.recurrent_cuda_path(input, w_hh, cell, backward)
    return "persistent" if code == 0 else "per_step"


def check_float(op: str, name: str, t, dtype: torch.dtype | None = None) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"{op}: {name} must be float32, float64, float16 or bfloat16, got {t.dtype}"
        )
    if dtype is not None and t.dtype != dtype:
        raise TypeError(f"{op}: {name} must have the input's dtype {dtype}, got {t.dtype}")


def check_cell_args(op: str, G: int, input, hx, w_ih, w_hh, b_ih, b_hh):
    """The checks of gru_cell / rnn_cell (torch.nn.GRUCell's wording for the states).
    Returns (x (B, I), h (B, H), batched)."""
    check_float(op, "input", input)
    if input.dim() not in (1, 2):
        raise ValueError(
            f"{op}: input must be (B, I) or unbatched (I,), got shape {tuple(input.shape)}"
        )
    for name, t in (("hx", hx), ("w_ih", w_ih), ("w_hh", w_hh), ("b_ih", b_ih), ("b_hh", b_hh)):
        if t is not None:
            check_float(op, name, t, input.dtype)
            if t.device != input.device:
                raise ValueError(
                    f"{op}: {name} must be on the same device as input "
                    f"({input.device}), got {t.device}"
                )
    if (b_ih is None) != (b_hh is None):
        raise ValueError(f"{op}: b_ih and b_hh must be given together")
    if w_hh.dim() != 2 or w_hh.shape[0] != G * w_hh.shape[1] or w_hh.shape[1] == 0:
        raise ValueError(f"{op}: w_hh must be ({G}H, H), got shape {tuple(w_hh.shape)}")
    H = w_hh.shape[1]
    batched = input.dim() == 2
    x = input if batched else input.unsqueeze(0)
    if hx is None:
        h = x.new_zeros((x.shape[0], H))
    else:
        if hx.dim() != input.dim():
            raise ValueError(
                f"{op}: hx must be {input.dim()}-D like input, got shape {tuple(hx.shape)}"
            )
        h = hx if batched else hx.unsqueeze(0)
    B, I = x.shape
    if tuple(w_ih.shape) != (G * H, I):
        raise ValueError(
            f"{op}: w_ih must have shape {(G * H, I)} (input size {I}), got {tuple(w_ih.shape)}"
        )
    if h.shape[0] != B:
        raise ValueError(
            f"{op}: Input batch size {B} doesn't match hidden0 batch size {h.shape[0]}"
        )
    if h.shape[1] != H:
        raise ValueError(
            f"{op}: hidden0 has inconsistent hidden_size: got {h.shape[1]}, expected {H}"
        )
    for name, b in (("b_ih", b_ih), ("b_hh", b_hh)):
        if b is not None and tuple(b.shape) != (G * H,):
            raise ValueError(f"{op}: {name} must have shape {(G * H,)}, got {tuple(b.shape)}")
    return x, h, batched


def split_weights(
    op: str, family: str, weights: Sequence[torch.Tensor], num_layers: int, D: int
) -> tuple[list[list[torch.Tensor]], bool]:
    """weights in nn.GRU's / nn.RNN's _flat_weights order -> per (layer, direction) lists,
    has_bias."""
    if not isinstance(weights, (list, tuple)):
        raise TypeError(
            f"{op}: weights must be a list or tuple of tensors (nn.{family.upper()}"
            f"'s _flat_weights order), got {type(weights).__name__}"
        )
    groups = num_layers * D
    per, rest = divmod(len(weights), groups)
    if rest or per not in (2, 4):
        raise ValueError(
            f"{op}: expected {2 * groups} or {4 * groups} weight tensors for "
            f"num_layers={num_layers}, "
            f"{'bidirectional' if D == 2 else 'unidirectional'} (w_ih, w_hh[, b_ih, "
            f"b_hh] per layer and direction), got {len(weights)}"
        )
    return [list(weights[g * per : (g + 1) * per]) for g in range(groups)], per == 4


def check_lengths(op: str, lengths, B: int, T: int, device: torch.device):
    """lengths (None, or an integer tensor of B sequence lengths in [0, T]) as the layer ops
    take it: int64 (B,) on `device`. Its values are checked on the host where
    host_checks_enabled allows, else on the device where device_checks_enabled does."""
    if lengths is None:
        return None
    if (
        not isinstance(lengths, torch.Tensor)
        or lengths.dtype.is_floating_point
        or lengths.dtype.is_complex
        or lengths.dtype == torch.bool
    ):
        raise TypeError(
            f"{op}: lengths must be an integer tensor, got "
            f"{getattr(lengths, 'dtype', type(lengths).__name__)}"
        )
    if lengths.dim() > 1 or lengths.numel() != B:
        raise ValueError(
            f"{op}: lengths must have shape ({B},) (the batch size), got {tuple(lengths.shape)}"
        )
    lengths = lengths.reshape(B)
    on_host = host_checks_enabled(lengths)
    if B > 0 and on_host:
        lo, hi = (int(v) for v in torch.aminmax(lengths))
        if lo < 0 or hi > T:
            raise ValueError(
                f"{op}: lengths must be in [0, T] = [0, {T}], got values from {lo} to {hi}"
            )
    lengths = lengths.to(device=device, dtype=torch.int64)
    if not on_host and device_checks_enabled(lengths):
        device_check_range(op, lengths, 0, T, f"lengths must be in [0, T] = [0, {T}]")
    return lengths


def needs_grad(*tensors) -> bool:
    """Whether autograd will differentiate a call on `tensors` (flags only, no values)."""
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tensors
    )


def speed_key(
    op: str,
    dtype: torch.dtype,
    seq_len: int,
    *,
    hidden: int,
    grad: bool,
    bidirectional: bool = False,
    num_layers: int = 1,
    projection: bool = False,
    lengths: bool = False,
    dropout: bool = False,
    variant: str | None = None,
) -> tuple:
    """The speed-table key of a recurrent call (fastattn/speed_table.py), from its static
    properties: the hidden size's class in the head-dim field; the length class of T (1 for a
    cell); the features "bidirectional",
    "multilayer", "projection", "lengths", "dropout" and the cell variant ("reset_before" for
    the textbook GRU, "relu" for the ReLU RNN; the default variants add no word)."""
    features = [
        name
        for name, present in (
            ("bidirectional", bidirectional),
            ("multilayer", num_layers > 1),
            ("projection", projection),
            ("lengths", lengths),
            ("dropout", dropout),
        )
        if present
    ]
    if variant is not None:
        features.append(variant)
    return speed_table.key(
        op, dtype, length=seq_len, head_dim=hidden, features=tuple(features), grad=grad
    )


def _variant_word(family: str, variant) -> str | None:
    """The speed-key word of a cell variant (None for torch's defaults)."""
    if family == "gru":
        return None if variant else "reset_before"
    return None if variant == "tanh" else variant


def layer_op(family: str, backend: str):
    name = f"{family}_layer"
    return kernel_op(name + "_triton" if backend == "triton" else name)


def run_layers(
    op: str,
    family: str,
    input,
    hx,
    weights,
    *,
    num_layers,
    bidirectional,
    batch_first,
    dropout,
    training,
    lengths,
    backend,
    variant,
    reference_layer: Callable,
):
    """The multi-layer GRU / RNN over whole sequences (see fastattn.gru for the arguments)."""
    G = GATES[family]
    check_float(op, "input", input)
    if input.dim() not in (2, 3):
        raise ValueError(
            f"{op}: input must be 3-D ({'B, T' if batch_first else 'T, B'}, I) or "
            f"unbatched 2-D (T, I), got {input.dim()}-D"
        )
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise ValueError(f"{op}: num_layers must be an int >= 1, got {num_layers!r}")
    if (
        isinstance(dropout, bool)
        or not isinstance(dropout, (int, float))
        or not 0.0 <= dropout <= 1.0
    ):
        raise ValueError(f"{op}: dropout must be a number in [0, 1], got {dropout!r}")
    D = 2 if bidirectional else 1
    groups, has_bias = split_weights(op, family, weights, num_layers, D)
    dtype, device = input.dtype, input.device
    w_hh0 = groups[0][1]
    check_float(op, "weights[1] (w_hh of layer 0)", w_hh0, dtype)
    if w_hh0.dim() != 2 or w_hh0.shape[0] == 0 or w_hh0.shape[0] != G * w_hh0.shape[1]:
        raise ValueError(
            f"{op}: w_hh must be ({G} * hidden_size, hidden_size), got {tuple(w_hh0.shape)}"
        )
    H = w_hh0.shape[1]
    names = ["w_ih", "w_hh"] + (["b_ih", "b_hh"] if has_bias else [])
    batched = input.dim() == 3
    x = input if batched else input.unsqueeze(1)
    if batched and batch_first:
        x = x.transpose(0, 1)
    T, B, I = x.shape
    for g, group in enumerate(groups):
        layer, direction = divmod(g, D)
        shapes = {
            "w_ih": (G * H, I if layer == 0 else D * H),
            "w_hh": (G * H, H),
            "b_ih": (G * H,),
            "b_hh": (G * H,),
        }
        for name, w in zip(names, group):
            label = f"{name} of layer {layer}{' (reverse)' if direction else ''}"
            check_float(op, label, w, dtype)
            if tuple(w.shape) != shapes[name]:
                if name == "w_ih" and layer == 0 and w.dim() == 2 and w.shape[0] == G * H:
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
        h0 = x.new_zeros((L, B, H))
    else:
        check_float(op, "hx", hx, dtype)
        if hx.device != device:
            raise ValueError(
                f"{op}: Input and hidden tensors are not at the same device, "
                f"found input tensor at {device} and hidden tensor at "
                f"{hx.device}"
            )
        if batched and hx.dim() != 3:
            raise ValueError(
                f"{op}: For batched 3-D input, hx should also be 3-D but got {hx.dim()}-D tensor"
            )
        if not batched and hx.dim() != 2:
            raise ValueError(
                f"{op}: For unbatched 2-D input, hx should also be 2-D but got {hx.dim()}-D tensor"
            )
        h0 = hx if batched else hx.unsqueeze(1)
        if tuple(h0.shape) != (L, B, H):
            raise ValueError(f"{op}: Expected hidden size {(L, B, H)}, got {list(h0.shape)}")
    given_lengths = lengths
    lengths = check_lengths(op, lengths, B, T, device)
    p = float(dropout) if training and num_layers > 1 else 0.0
    limits = unsupported_backends(family, dtype)
    refusal = _torch_refusal(family, variant, device, dtype, T, p, given_lengths)
    if refusal is not None:
        limits["torch"] = refusal
    key = speed_key(
        op,
        dtype,
        T,
        hidden=H,
        grad=needs_grad(input, hx, *weights),
        bidirectional=bidirectional,
        num_layers=num_layers,
        lengths=lengths is not None,
        dropout=p > 0.0,
        variant=_variant_word(family, variant),
    )
    chosen = _backend.select_backend(op, device, backend, limits=limits, speed_key=key)
    if chosen == "torch":
        x, h_n = _torch_layers(
            family,
            variant,
            x,
            h0,
            weights,
            has_bias=has_bias,
            num_layers=num_layers,
            bidirectional=bidirectional,
            lengths=host_lengths(given_lengths),
        )
        _backend.record_backend(op, chosen)
        if not batched:
            return x[:, 0], h_n[:, 0]
        return (x.transpose(0, 1) if batch_first else x), h_n
    h_n = []
    for layer in range(num_layers):
        per_dir = groups[layer * D : (layer + 1) * D]

        def stacked(i: int) -> torch.Tensor:
            ws = [group[i] for group in per_dir]  # noqa: B023 (called in this iteration)
            return ws[0].unsqueeze(0) if D == 1 else torch.stack(ws)

        w_ih, w_hh = stacked(0), stacked(1)
        b_ih, b_hh = (stacked(2), stacked(3)) if has_bias else (None, None)
        p_layer = p if layer > 0 else 0.0
        if p_layer >= 1.0:
            x, p_layer = torch.zeros_like(x), 0.0
        seed = dropout_seed(p_layer, device)
        args = (
            x,
            h0[layer * D : (layer + 1) * D],
            w_ih,
            w_hh,
            b_ih,
            b_hh,
            lengths,
            p_layer,
            seed,
            variant,
        )
        if chosen == "reference":
            x, hl = reference_layer(*args)
        else:
            save = torch.is_grad_enabled() and any(
                t is not None and t.requires_grad for t in args[:6]
            )
            x, hl, _ = layer_op(family, chosen)(*args, save)
        h_n.append(hl)
    _backend.record_backend(op, chosen)
    h_n = torch.cat(h_n) if num_layers > 1 else h_n[0]
    if not batched:
        return x[:, 0], h_n[:, 0]
    return (x.transpose(0, 1) if batch_first else x), h_n


def run_cell(
    op: str,
    family: str,
    input,
    hx,
    w_ih,
    w_hh,
    b_ih,
    b_hh,
    *,
    backend,
    variant,
    reference_cell: Callable,
):
    """One step of the GRU / RNN cell: the layer op with T = 1 and one direction."""
    G = GATES[family]
    x, h, batched = check_cell_args(op, G, input, hx, w_ih, w_hh, b_ih, b_hh)
    limits = unsupported_backends(family, x.dtype)
    refusal = aten_gru.cell_refusal(variant) if family == "gru" else None
    if refusal is not None:
        limits["torch"] = refusal
    key = speed_key(
        op,
        x.dtype,
        1,
        hidden=h.shape[-1],
        grad=needs_grad(x, h, w_ih, w_hh, b_ih, b_hh),
        variant=_variant_word(family, variant),
    )
    chosen = _backend.select_backend(op, x.device, backend, limits=limits, speed_key=key)
    if chosen == "torch":
        if family == "gru":
            hy = aten_gru.gru_cell(x, h, w_ih, w_hh, b_ih, b_hh)
        else:
            hy = aten_rnn.rnn_cell(x, h, w_ih, w_hh, b_ih, b_hh, nonlinearity=variant)
    elif chosen == "reference":
        hy = reference_cell(x, h, w_ih, w_hh, b_ih, b_hh, variant)
    else:
        ws = [None if w is None else w.unsqueeze(0) for w in (w_ih, w_hh, b_ih, b_hh)]
        args = (x.unsqueeze(0), h.unsqueeze(0), *ws, None, 0.0, None, variant)
        save = torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (x, h, w_ih, w_hh, b_ih, b_hh)
        )
        out, _, _ = layer_op(family, chosen)(*args, save)
        hy = out[0]
    _backend.record_backend(op, chosen)
    return hy if batched else hy[0]


def _torch_refusal(family, variant, device, dtype, seq_len, dropout_p, lengths) -> str | None:
    """Why the torch backend cannot run this `family` layers call (fastattn/aten), or None."""
    if family == "gru":
        return aten_gru.refusal(
            device,
            dtype,
            reset_after=variant,
            seq_len=seq_len,
            dropout_p=dropout_p,
            lengths=lengths,
        )
    return aten_rnn.refusal(device, dtype, seq_len=seq_len, dropout_p=dropout_p, lengths=lengths)


def _torch_layers(family, variant, x, h0, weights, **kw):
    """The `family` layers on the torch backend (fastattn/aten): (output, h_n)."""
    if family == "gru":
        return aten_gru.gru(x, h0, weights, **kw)
    return aten_rnn.rnn(x, h0, weights, nonlinearity=variant, **kw)


# ---------------------------------------------------------------------------------------------
# Registration: fakes and autograd of the layer ops, from the contract
# (fastattn/contracts/recurrent.py)


def register(family: str, suffix: str, reference_layer: Callable, fakes: bool) -> None:
    """Fake implementations (native ops: fakes=True) and autograd of fastattn::<family>_layer
    <suffix>."""
    name = f"fastattn::{family}_layer{suffix}"
    if fakes:
        torch.library.register_fake(name)(contract.layer_fake_for(family))
        torch.library.register_fake(f"fastattn::{family}_layer_backward{suffix}")(
            contract.layer_backward_fake
        )
    backward_op = f"{family}_layer_backward{suffix}"
    backward, setup = contract.autograd_formula(
        name, lambda *args: getattr(torch.ops.fastattn, backward_op)(*args), reference_layer
    )
    torch.library.register_autograd(name, backward, setup_context=setup)


def register_triton(family: str, reference_layer: Callable) -> None:
    """The Triton twins fastattn::<family>_layer_triton / _layer_backward_triton (launchers in
    fastattn/triton/<family>.py, same schemas and contract as the native ops), their fakes and
    autograd; nothing when the Triton kernels cannot be imported."""
    kernels = triton_kernels(family)
    if kernels is None:
        return
    forward = getattr(kernels, f"{family}_layer")
    backward = getattr(kernels, f"{family}_layer_backward")
    register_triton_op(f"fastattn::{family}_layer_triton", forward, contract.layer_fake_for(family))
    register_triton_op(
        f"fastattn::{family}_layer_backward_triton", backward, contract.layer_backward_fake
    )
    register(family, "_triton", reference_layer, fakes=False)
