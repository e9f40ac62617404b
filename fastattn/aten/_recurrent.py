"""The torch backend's recurrent driver, shared by the LSTM, GRU and Elman RNN
(fastattn/aten/lstm.py, gru.py, rnn.py): torch's own multi-layer kernels (torch._VF.lstm, gru,
rnn_tanh, rnn_relu: cuDNN on CUDA, oneDNN or ATen's loop on the CPU) run on fastattn's
canonical arguments, and `refusal` names what those kernels cannot compute as fastattn
defines it.

How fastattn's definition is met (fastattn/contracts/lstm.py, fastattn/reference):
- compute type: float32 for float16 / bfloat16 / float32 storage (float64 for float64), every
  layer's results rounded once to the storage dtype. torch's 16-bit kernels keep the hidden
  state in 16 bits between steps, so a 16-bit call runs torch's float32 kernel on the upcast
  operands one layer at a time and rounds each layer's output and final states once.
- variable lengths: torch's kernels take them as a PackedSequence (sorted by length), whose
  semantics are fastattn's (no work past a sequence's end, h_n at its last step, the reverse
  direction starting there, outputs past the end 0); a length of 0, which packing refuses,
  runs one step whose results are discarded (outputs 0, final states h0 / c0).
Refused: dropout (torch draws its own mask; fastattn's is its Philox stream keyed by the
call's seed), T = 0 (torch's kernels raise), layers under torch.compile (Dynamo refuses
torch's RNN modules, and a traced torch._VF.lstm fails in Inductor on the CPU), lengths on a
CUDA device (packing reads them on the host: a device synchronisation), and float32 math that
torch's settings make reduced-precision where fastattn's is not (cuDNN's RNNs in TF32, torch's
default; oneDNN's LSTM in bf16 / TF32). The cells (torch._VF.lstm_cell, gru_cell,
rnn_tanh_cell, rnn_relu_cell: GEMMs and pointwise kernels) refuse nothing but the GRU's
reset-before form, and trace under torch.compile.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from ..contracts import compute_dtype

DROPOUT = (
    "dropout > 0 in training: torch draws its own dropout mask, fastattn's is its Philox "
    "stream keyed by the call's seed"
)
EMPTY_SEQUENCE = "T = 0 (an empty sequence): torch's recurrent kernels refuse it"
DEVICE_LENGTHS = (
    "lengths on a {device} device: torch's kernels take variable lengths only as a "
    "PackedSequence, whose batch sizes are read on the host (a device synchronisation); pass "
    "the lengths as a CPU tensor"
)
COMPILED = (
    "under torch.compile: Dynamo does not support torch's recurrent layers (it refuses "
    "torch.nn.LSTM / GRU / RNN; traced, oneDNN's LSTM fails in Inductor)"
)


def _fp32_precision(backend: str, op: str) -> str:
    """torch's float32 precision setting of `op` on `backend` ("cuda" for cuDNN, "mkldnn" for
    oneDNN): "ieee" / "none" (full float32), "tf32" or "bf16"."""
    getter = getattr(torch._C, "_get_fp32_precision_getter", None)
    if getter is not None:
        return getter(backend, op)
    if backend == "cuda":  # a torch before the fp32_precision settings (< 2.9)
        return "tf32" if torch.backends.cudnn.allow_tf32 else "ieee"
    return "ieee"


# Evaluated eagerly while torch.compile traces (the settings are read through torch._C); the
# arguments are strings, so is the result.
@torch.compiler.assume_constant_result
def reduced_precision(device_type: str, cudnn_layers: bool, onednn_layers: bool) -> str:
    """Why torch's float32 recurrent kernels on `device_type` would not compute in float32
    ("" when they would). cudnn_layers: the call runs whole layers, which torch runs with
    cuDNN when it is enabled; onednn_layers: an LSTM layer call, which torch runs with oneDNN on
    the CPU. fastattn's CUDA kernels multiply with cuBLAS under torch.backends.cuda.matmul's
    setting, the same one torch's per-step path and cells follow, so only the RNN-specific
    settings differ."""
    if device_type == "cuda" and cudnn_layers:
        if (
            torch.backends.cudnn.enabled
            and torch.backends.cudnn.is_available()
            and _fp32_precision("cuda", "rnn") == "tf32"
            and _fp32_precision("cuda", "matmul") != "tf32"
        ):
            return (
                "float32 math on CUDA: cuDNN's RNNs multiply in TF32 "
                "(torch.backends.cudnn.rnn.fp32_precision is 'tf32', torch's default), "
                "fastattn's kernels in float32; set it to 'ieee' to use the torch backend"
            )
    if (
        device_type == "cpu"
        and onednn_layers
        and torch.backends.mkldnn.enabled
        and torch.backends.mkldnn.is_available()
    ):
        precision = _fp32_precision("mkldnn", "rnn")
        if precision in ("bf16", "tf32"):
            return (
                f"float32 math on the CPU: oneDNN's LSTM computes in {precision} "
                f"(torch.backends.mkldnn.rnn.fp32_precision), fastattn's kernels in float32"
            )
    return ""


def refusal(
    device: torch.device,
    dtype: torch.dtype,
    *,
    seq_len: int,
    dropout_p: float,
    lengths: torch.Tensor | None,
    onednn_layers: bool = False,
) -> str | None:
    """Why torch's layer kernels cannot compute this call of a multi-layer op as fastattn
    defines it, or None. Static properties only (shapes, flags, devices, settings).

    dtype: the storage dtype; seq_len: T; dropout_p: the inter-layer dropout probability in
    effect (0 when not training or single-layer); lengths: the lengths as passed (any device)
    or None; onednn_layers: an LSTM (the one family torch runs with oneDNN on the CPU)."""
    if dropout_p > 0.0:
        return DROPOUT
    if seq_len == 0:
        return EMPTY_SEQUENCE
    if torch.compiler.is_compiling():
        return COMPILED
    if lengths is not None and lengths.device.type != "cpu":
        return DEVICE_LENGTHS.format(device=lengths.device.type)
    if compute_dtype(dtype) == torch.float32:
        return reduced_precision(device.type, True, onednn_layers) or None
    return None


def host_lengths(lengths: torch.Tensor | None) -> torch.Tensor | None:
    """The lengths as passed, as the int64 CPU tensor packing needs (None when not given or
    not on the host: `refusal` refuses those)."""
    if lengths is None or lengths.device.type != "cpu":
        return None
    return lengths.reshape(-1).to(torch.int64)


# torch._VF.lstm / gru / rnn_tanh / rnn_relu: (input, hx, params, has_biases, num_layers,
# dropout, train, bidirectional, batch_first) -> (output, *final states), and the packed
# overload (data, batch_sizes, hx, params, has_biases, num_layers, dropout, train,
# bidirectional).
Kernel = Callable[..., tuple[torch.Tensor, ...]]


def _hx(states: Sequence[torch.Tensor]):
    return tuple(states) if len(states) > 1 else states[0]


def _run(
    kernel: Kernel,
    x: torch.Tensor,
    states: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor],
    has_bias: bool,
    num_layers: int,
    bidirectional: bool,
    lengths: torch.Tensor | None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """One call of torch's kernel on num_layers layers, in x's dtype."""
    T, B, _ = x.shape
    weights = list(weights)
    # No dropout either way; "train" makes cuDNN keep what its backward needs (its backward
    # refuses an inference-mode forward), so it is set exactly when autograd will run.
    train = torch.is_grad_enabled() and any(t.requires_grad for t in (x, *states, *weights))
    if lengths is None or B == 0:
        output, *finals = kernel(
            x, _hx(states), weights, has_bias, num_layers, 0.0, train, bidirectional, False
        )
        return output, tuple(finals)
    # Packing refuses a length of 0: such rows run one step, whose results are discarded.
    packed = pack_padded_sequence(x, lengths.clamp(min=1), enforce_sorted=False)
    # enforce_sorted=False: the permutations are always there
    assert packed.sorted_indices is not None and packed.unsorted_indices is not None
    sorted_states = [s.index_select(1, packed.sorted_indices) for s in states]
    data, *finals = kernel(
        packed.data,
        packed.batch_sizes,
        _hx(sorted_states),
        weights,
        has_bias,
        num_layers,
        0.0,
        train,
        bidirectional,
    )
    output, _ = pad_packed_sequence(
        PackedSequence(data, packed.batch_sizes, packed.sorted_indices, packed.unsorted_indices),
        total_length=T,
    )
    finals = [f.index_select(1, packed.unsorted_indices) for f in finals]
    empty = lengths == 0
    if bool(empty.any()):  # a host tensor: no synchronisation
        rows = empty.to(x.device).view(1, B, 1)
        output = output.masked_fill(rows, 0.0)
        finals = [torch.where(rows, s, f) for s, f in zip(states, finals)]
    return output, tuple(finals)


def run_layers(
    kernel: Kernel,
    x: torch.Tensor,
    states: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor],
    *,
    has_bias: bool,
    num_layers: int,
    bidirectional: bool,
    lengths: torch.Tensor | None,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
    """A multi-layer recurrent op on torch's kernel, as fastattn defines it.

    x: (T, B, I) time-major, T > 0; states: the initial states, each (num_layers * D, B, S)
    (LSTM: h0 (.., P), c0 (.., H); GRU / RNN: h0 (.., H)); weights: nn.LSTM's / nn.GRU's /
    nn.RNN's _flat_weights order; lengths: int64 (B,) on the host, values in [0, T], or None.
    Every tensor has x's dtype and device. Returns (output (T, B, D * P), final states shaped
    like `states`), in x's dtype.
    """
    acc = compute_dtype(x.dtype)
    # fastattn's definition fixes the compute type: an enclosing autocast must not change it
    with torch.autocast(x.device.type, enabled=False):
        if acc == x.dtype:
            return _run(kernel, x, states, weights, has_bias, num_layers, bidirectional, lengths)
        D = 2 if bidirectional else 1
        per_layer = len(weights) // num_layers
        finals: list[list[torch.Tensor]] = [[] for _ in states]
        for layer in range(num_layers):
            rows = slice(layer * D, (layer + 1) * D)
            layer_weights = [
                w.to(acc) for w in weights[layer * per_layer : (layer + 1) * per_layer]
            ]
            output, layer_finals = _run(
                kernel,
                x.to(acc),
                [s[rows].to(acc) for s in states],
                layer_weights,
                has_bias,
                1,
                bidirectional,
                lengths,
            )
            x = output.to(x.dtype)  # each layer's results rounded once, as fastattn's kernels
            for collected, final in zip(finals, layer_finals):
                collected.append(final.to(x.dtype))
        return x, tuple(torch.cat(f) if num_layers > 1 else f[0] for f in finals)


def run_cell(cell: Callable[..., Any], x: torch.Tensor, *args: Any):
    """One step of torch's cell function `cell` (torch._VF.lstm_cell, gru_cell, ...) on x
    (B, I) and the states and weights in `args`, computed in fastattn's compute type and
    rounded once to x's dtype. Returns what `cell` returns."""
    acc = compute_dtype(x.dtype)
    with torch.autocast(x.device.type, enabled=False):
        if acc == x.dtype:
            return cell(x, *args)

        def up(t):
            if isinstance(t, tuple):
                return tuple(up(s) for s in t)
            return None if t is None else t.to(acc)

        result = cell(up(x), *(up(a) for a in args))
        if isinstance(result, tuple):
            return tuple(r.to(x.dtype) for r in result)
        return result.to(x.dtype)
