"""LSTM benchmarks: fastattn's fused LSTM against torch.nn.LSTM (oneDNN on CPU, cuDNN on GPU)
and the plain per-step reference loop (fastattn's "reference" backend).

Run through the CLI (`python benchmarks/run.py --ops lstm`). Cases: fastrnns' default
(T=100, B=64, I=H=512), small batches (B=1, 4, 8), large hidden sizes (H=1024; 2048 in the
full profile), a 2-layer bidirectional LSTM, variable lengths drawn from U[30, 100)
(PackedSequence in and out), and on the CPU bfloat16 at B=8 and 64. On a GPU the cuda backend
runs too; its provider name says which recurrent path it takes
(fastattn.ops.lstm.cuda_recurrent_path). "fwd" is inference
(torch.no_grad); "fwd+bwd" follows fastrnns:
the inputs and initial states need no gradient, the parameters do (their gradients are
returned and checked). Throughput counts the GEMM work: 2 * rows * 4H * (I + P) per layer
and direction forward (rows = sum of the lengths), three times that for forward+backward.
Beside the kernels: torch's LSTM through fastattn's torch backend (fastattn:torch, where that
backend takes the call: on CUDA it refuses float32 while cuDNN's RNNs run in TF32, torch's
default) and the automatic choice (fastattn (auto), speed table included). Each case carries
the call's speed key, so `--write-speed-table` records which of the two kernels was faster.
"""

from __future__ import annotations

import copy

import torch
from common import AUTO, TORCH_BACKEND, Case, automatic_kernel, fastattn_backends, relative_error
from torch.nn.utils.rnn import pack_padded_sequence

import fastattn
from fastattn import _backend
from fastattn.aten import lstm as aten_lstm
from fastattn.ops._recurrent import speed_key
from fastattn.ops.lstm import cuda_recurrent_path, unsupported_backends


def _lstm_backends(device: torch.device, dtype: torch.dtype) -> list[str]:
    limits = unsupported_backends(dtype)
    return [b for b in fastattn_backends(device) if b not in limits]


def lstm_case(
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
    reference: bool = True,
    dtype: torch.dtype = torch.float32,
) -> Case:
    torch.manual_seed(0)
    D = 2 if bidirectional else 1
    theirs = torch.nn.LSTM(I, H, num_layers=layers, bidirectional=bidirectional).to(device, dtype)
    ours = fastattn.nn.LSTM(I, H, num_layers=layers, bidirectional=bidirectional).to(device, dtype)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(T, B, I, device=device, dtype=dtype)
    hx = (
        torch.randn(layers * D, B, H, device=device, dtype=dtype),
        torch.randn(layers * D, B, H, device=device, dtype=dtype),
    )
    if varlen:
        lengths = torch.randint(30, 100, (B,), generator=torch.Generator().manual_seed(1))
        lengths[0] = T  # the padded batch is T long
        inp = pack_padded_sequence(x, lengths, enforce_sorted=False)
        rows = int(lengths.sum())
    else:
        lengths, inp, rows = None, x, T * B

    def run(module, backend=None, inp=inp, hx=hx):
        def fwd():
            with fastattn.use_backend(backend):
                return module(inp, hx)

        if not backward:

            def call():
                with torch.no_grad():
                    out, (h, c) = fwd()
                return (out.data if varlen else out), h, c

            return call
        params = list(module.parameters())

        def call():
            out, (h, c) = fwd()
            out = out.data if varlen else out
            # A fixed, data-independent incoming gradient for every output.
            grads = torch.autograd.grad(
                (out, h, c),
                params,
                (torch.ones_like(out) * 1e-2, torch.ones_like(h), torch.ones_like(c)),
            )
            return tuple(grads)

        return call

    providers = {}
    for b in _lstm_backends(device, dtype):
        label = f"fastattn:{b}"
        if b == "cuda":
            # which recurrent path the CUDA kernels take (layer 0; the backward runs per step)
            w_hh = torch.stack(
                [ours.weight_hh_l0] + ([ours.weight_hh_l0_reverse] if bidirectional else [])
            )
            label += f" ({cuda_recurrent_path(x, w_hh)})"
        providers[label] = run(ours, b)
    # The torch backend's refusal as fastattn.lstm reads it (the module passes the unpacked
    # lengths, on the host; no dropout: one layer, or not training).
    if _backend.cannot_run("torch", device) is None and (
        aten_lstm.refusal(device, dtype, seq_len=T, dropout_p=0.0, lengths=lengths) is None
    ):
        providers[TORCH_BACKEND] = run(ours, "torch")
    providers[AUTO] = run(ours)
    providers["torch.nn.LSTM"] = run(theirs)
    if reference:
        providers["reference loop"] = run(ours, "reference")
    ground_truth = None
    if dtype != torch.float32:  # torch's bfloat16 LSTM rounds h each step: judge by float32
        x32 = x.float()
        inp32 = pack_padded_sequence(x32, lengths, enforce_sorted=False) if varlen else x32
        hx32 = tuple(t.float() for t in hx)
        ground_truth = run(copy.deepcopy(theirs).float(), None, inp32, hx32)
    flops = 2.0 * rows * 4 * H * (I + H) * D + 2.0 * rows * 4 * H * (D * H + H) * D * (layers - 1)
    if backward:
        flops *= 3
    name = (
        f"T={T} B={B} I={I} H={H}"
        + (f" layers={layers}" if layers > 1 else "")
        + (" bidir" if bidirectional else "")
        + (" lengths~U[30,100)" if varlen else "")
    )
    return Case(
        op="lstm " + ("fwd+bwd" if backward else "fwd"),
        name=name,
        providers=providers,
        reference="torch.nn.LSTM",
        baselines=("torch.nn.LSTM",),
        flops=flops,
        check=relative_error,
        ground_truth=ground_truth,
        tolerance=2e-3 if dtype == torch.float32 else 1e-2,
        dtype=str(dtype).removeprefix("torch."),
        # fastattn.lstm's key for this call: forward cases run under no_grad, forward+backward
        # ones with parameters that need gradients
        speed_key=speed_key(
            "lstm",
            dtype,
            T,
            hidden=H,
            grad=backward,
            bidirectional=bidirectional,
            num_layers=layers,
            lengths=varlen,
        ),
        kernel=automatic_kernel("lstm", device),
    )


def cases(profile: str, device: torch.device) -> list[Case]:
    """The quick profile times the per-step reference loop on a few cases only (it is slow);
    the full profile adds H=2048, B=4 forward+backward and the loop everywhere."""
    full = profile == "full"
    out = []
    for backward in (False, True):
        out.append(
            lstm_case(100, 64, 512, 512, device, backward=backward, reference=full or not backward)
        )
        for B in (1, 4, 8):
            if backward and B == 4 and not full:
                continue
            out.append(
                lstm_case(100, B, 512, 512, device, backward=backward, reference=full or B == 8)
            )
        out.append(lstm_case(100, 64, 1024, 1024, device, backward=backward, reference=full))
        if full:
            out.append(lstm_case(100, 64, 2048, 2048, device, backward=backward))
        out.append(
            lstm_case(
                100,
                64,
                512,
                512,
                device,
                layers=2,
                bidirectional=True,
                backward=backward,
                reference=full,
            )
        )
        out.append(
            lstm_case(100, 64, 512, 512, device, varlen=True, backward=backward, reference=full)
        )
        if device.type == "cpu":  # bfloat16: AVX512-BF16 products on both sides where present
            for B in (8, 64):
                out.append(
                    lstm_case(
                        100,
                        B,
                        512,
                        512,
                        device,
                        backward=backward,
                        reference=False,
                        dtype=torch.bfloat16,
                    )
                )
    return out
