"""GRU benchmarks: fastattn's fused GRU (the CPU recurrent engine shared with the LSTM) against
torch.nn.GRU (oneDNN on CPU, cuDNN on GPU), the target grid: T=100, I=H=512, B = 1, 8
and 64, inference (torch.no_grad) and forward+backward (fastrnns' convention, as
bench_lstm.py: parameters need gradients, inputs and states do not), plus a 2-layer
bidirectional case with lengths ~ U[30, 100) (PackedSequence in and out), and on the CPU
bfloat16 at B = 8 and 64.
Throughput counts the GEMM work: 2 * rows * G H * (I + H) per layer and direction forward
(G = 3 gates), three times that for forward+backward. `recurrent_case` is shared with
bench_rnn.py. Every fastattn backend that runs the family on the device gets a row: cpu on the
CPU; on a GPU triton (the LSTM's Triton engine, generic over the cell) and cuda (the LSTM's
CUDA engine, generic over the cell; the row names its recurrent path, persistent or per_step).
Beside them: torch's kernel through fastattn's torch backend (fastattn:torch, where that backend
takes the call: on CUDA it refuses float32 while cuDNN's RNNs run in TF32, torch's default) and
the automatic choice (fastattn (auto), speed table included). Each case carries the call's speed
key, so `--write-speed-table` records which of the two kernels was faster.
"""

from __future__ import annotations

import copy

import torch
from common import AUTO, TORCH_BACKEND, Case, automatic_kernel, fastattn_backends, relative_error
from torch.nn.utils.rnn import pack_padded_sequence

import fastattn
from fastattn import _backend
from fastattn.aten import gru as aten_gru
from fastattn.aten import rnn as aten_rnn
from fastattn.ops import _recurrent


def torch_refusal(
    family: str,
    variant,
    device: torch.device,
    T: int,
    lengths: torch.Tensor | None,
    dtype: torch.dtype = torch.float32,
) -> str | None:
    """Why fastattn's torch backend refuses a benchmarked `family` call, as the op reads it
    (the module passes the unpacked lengths, on the host; no dropout: one layer, or not
    training), or None."""
    why = _backend.cannot_run("torch", device)
    if why is not None:
        return why
    kw = dict(seq_len=T, dropout_p=0.0, lengths=lengths)
    if family == "gru":
        return aten_gru.refusal(device, dtype, reset_after=variant, **kw)
    return aten_rnn.refusal(device, dtype, **kw)


def recurrent_case(
    kind: str,
    T: int,
    B: int,
    I: int,
    H: int,
    device: torch.device,
    *,
    layers: int = 1,
    bidirectional: bool = False,
    backward: bool = False,
    varlen: bool = False,
    reference: bool = False,
    dtype: torch.dtype = torch.float32,
) -> Case:
    """kind: "gru", "rnn_tanh" or "rnn_relu"."""
    torch.manual_seed(0)
    D = 2 if bidirectional else 1
    kw = dict(num_layers=layers, bidirectional=bidirectional)
    if kind == "gru":
        theirs, ours, G, label = torch.nn.GRU(I, H, **kw), fastattn.nn.GRU(I, H, **kw), 3, "GRU"
        family = "gru"
    else:
        nl = kind.split("_")[1]
        theirs = torch.nn.RNN(I, H, nonlinearity=nl, **kw)
        ours = fastattn.nn.RNN(I, H, nonlinearity=nl, **kw)
        G, label, family = 1, "RNN", "rnn"
    theirs, ours = theirs.to(device, dtype), ours.to(device, dtype)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(T, B, I, device=device, dtype=dtype)
    h0 = torch.randn(layers * D, B, H, device=device, dtype=dtype)
    if varlen:
        lengths = torch.randint(30, 100, (B,), generator=torch.Generator().manual_seed(1))
        lengths[0] = T
        inp = pack_padded_sequence(x, lengths, enforce_sorted=False)
        rows = int(lengths.sum())
    else:
        lengths, inp, rows = None, x, T * B

    def run(module, backend=None, inp=inp, h0=h0):
        def fwd():
            with fastattn.use_backend(backend):
                return module(inp, h0)

        if not backward:

            def call():
                with torch.no_grad():
                    out, h = fwd()
                return (out.data if varlen else out), h

            return call
        params = list(module.parameters())

        def call():
            out, h = fwd()
            out = out.data if varlen else out
            return tuple(
                torch.autograd.grad(
                    (out, h), params, (torch.ones_like(out) * 1e-2, torch.ones_like(h))
                )
            )

        return call

    # the cell's variant as the op takes it: reset_after (nn.GRU's) or the nonlinearity
    variant = True if family == "gru" else kind.split("_")[1]
    limits = _recurrent.unsupported_backends(family, dtype)
    providers = {}
    for b in fastattn_backends(device):
        if b in limits:
            continue
        label_b = f"fastattn:{b}"
        if b == "cuda":  # which recurrent path the cuda backend takes (layer 0)
            path = _recurrent.cuda_recurrent_path(
                family, x, ours.weight_hh_l0, variant, backward=backward
            )
            label_b += f" ({path})"
        providers[label_b] = run(ours, b)
    if torch_refusal(family, variant, device, T, lengths, dtype) is None:
        providers[TORCH_BACKEND] = run(ours, "torch")
    providers[AUTO] = run(ours)
    providers[f"torch.nn.{label}"] = run(theirs)
    if reference:
        providers["reference loop"] = run(ours, "reference")
    ground_truth = None
    if dtype != torch.float32:  # torch's bfloat16 layers round h each step: judge by float32
        x32 = x.float()
        inp32 = pack_padded_sequence(x32, lengths, enforce_sorted=False) if varlen else x32
        ground_truth = run(copy.deepcopy(theirs).float(), None, inp32, h0.float())
    flops = 2.0 * rows * G * H * (I + H) * D + 2.0 * rows * G * H * (D * H + H) * D * (layers - 1)
    if backward:
        flops *= 3
    name = (
        f"T={T} B={B} I={I} H={H}"
        + (f" layers={layers}" if layers > 1 else "")
        + (" bidir" if bidirectional else "")
        + (" lengths~U[30,100)" if varlen else "")
        + (f" {kind.split('_')[1]}" if kind != "gru" else "")
    )
    return Case(
        op=f"{family} " + ("fwd+bwd" if backward else "fwd"),
        name=name,
        providers=providers,
        reference=f"torch.nn.{label}",
        baselines=(f"torch.nn.{label}",),
        flops=flops,
        check=relative_error,
        ground_truth=ground_truth,
        tolerance=2e-3 if dtype == torch.float32 else 1e-2,
        dtype=str(dtype).removeprefix("torch."),
        # fastattn.gru's / fastattn.rnn's key for this call: forward cases run under no_grad,
        # forward+backward ones with parameters that need gradients
        speed_key=_recurrent.speed_key(
            family,
            dtype,
            T,
            hidden=H,
            grad=backward,
            bidirectional=bidirectional,
            num_layers=layers,
            lengths=varlen,
            variant=_recurrent._variant_word(family, variant),
        ),
        kernel=automatic_kernel(family, device),
    )


def cases(profile: str, device: torch.device) -> list[Case]:
    full = profile == "full"
    out = []
    for backward in (False, True):
        for B in (1, 8, 64):
            out.append(
                recurrent_case(
                    "gru", 100, B, 512, 512, device, backward=backward, reference=full and B == 8
                )
            )
        out.append(
            recurrent_case(
                "gru",
                100,
                64,
                512,
                512,
                device,
                layers=2,
                bidirectional=True,
                varlen=True,
                backward=backward,
            )
        )
        if device.type == "cpu":  # bfloat16: AVX512-BF16 products on both sides where present
            for B in (8, 64):
                out.append(
                    recurrent_case(
                        "gru", 100, B, 512, 512, device, backward=backward, dtype=torch.bfloat16
                    )
                )
    return out
