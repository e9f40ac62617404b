"""Tests of the LSTM ops (fastattn/ops/lstm.py) and their modules (fastattn/nn/lstm.py).

1. Every backend against torch.nn.LSTM / torch.nn.LSTMCell in float64: outputs, h_n, c_n and
   the gradient of every parameter and input, over odd sizes and every feature (layers,
   bidirectional, proj_size, batch_first, unbatched, PackedSequence / lengths).
2. float32 / float16 / bfloat16 against the float64 reference under FlashAttention's rule
   (tests/tolerance.py): error <= 2x (3x for gradients) that of the reference run in the
   input's precision, plus a rounding floor.
3. Dropout (fastattn's Philox stream): reproducible under torch.manual_seed, the same mask on
   every backend, off in eval mode.
4. gradcheck, torch.library.opcheck, torch.compile(fullgraph=True), last_backend, errors
   (torch's own messages), state_dict both ways, a small swapped-model training run.
5. Section 9, the CUDA backend's own concerns (GPU only): the recurrent path query,
   persistent vs per-step paths, the CUDA ops against the CPU ops in float64 (dropout mask,
   lengths), lstm_cell's
   fused and GEMM paths, streams and devices.
The cuda tests skip without a GPU; the triton backend refuses float64, so its float64 tests
skip and section 8 runs its kernels on small cases (the CPU interpreter is slow). The large
grid is marked slow (FASTATTN_SLOW=1 runs it).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import backend_device, require_kernel
from host_reads import (
    assert_no_device_sync,
    assert_no_host_reads,
    device_checks,
    fake_cuda,
    force_device_checks,
)
from tolerance import assert_fa_close, assert_grad_close, rounding_floor
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import fastattn
from fastattn import _backend
from fastattn.ops.lstm import unsupported_backends

REPO = Path(__file__).resolve().parents[1]
F64 = torch.float64
# The slow grids only on request: on a GPU machine the lent time is too short for them (the
# first H100 run spent its whole test budget on the attention grid at ~23 s per test).
slow = [pytest.mark.slow]  # tests/conftest.py runs them on request


def lstm_device(backend: str, dtype: torch.dtype = torch.float32) -> torch.device:
    """The device `backend`'s LSTM tests use; skips when it has no LSTM kernel here (fails
    when the build claims one but lost it: require_kernel)."""
    require_kernel("lstm_layer", backend)
    device = backend_device(backend)
    reason = unsupported_backends(dtype).get(backend)
    if reason is not None:
        pytest.skip(f"backend {backend}: {reason}")
    return device


def close64(name, out, expected, rtol=1e-9, atol=1e-10):
    torch.testing.assert_close(out, expected, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def make_pair(I, H, *, device, dtype=F64, seed=0, **kw):
    """(torch.nn.LSTM, fastattn.nn.LSTM) with the same parameters."""
    torch.manual_seed(seed)
    theirs = torch.nn.LSTM(I, H, **kw).to(device=device, dtype=dtype)
    ours = fastattn.nn.LSTM(I, H, **kw).to(device=device, dtype=dtype)
    ours.load_state_dict(theirs.state_dict())
    return theirs, ours


def grads_of(loss, tensors):
    return torch.autograd.grad(loss, tensors, allow_unused=True)


def loss_of(output, h_n, c_n, weights):
    """A loss that touches every output with random weights (so no gradient is trivial)."""
    out = output.data if hasattr(output, "batch_sizes") else output
    return (out * weights[0]).sum() + (h_n * weights[1]).sum() + (c_n * weights[2]).sum()


def random_like_outputs(output, h_n, c_n):
    out = output.data if hasattr(output, "batch_sizes") else output
    g = torch.Generator().manual_seed(123)
    return [torch.randn(t.shape, generator=g, dtype=F64).to(t) for t in (out, h_n, c_n)]


# ---------------------------------------------------------------------------------------------
# 1. float64 against torch.nn.LSTM

# (T, B, I, H, num_layers, bidirectional, proj_size, batch_first, bias)
CONFIGS = [
    pytest.param(1, 1, 1, 1, 1, False, 0, False, True, id="T1-B1-I1-H1"),
    pytest.param(2, 33, 300, 37, 1, False, 0, False, True, id="T2-B33-I300-H37"),
    pytest.param(37, 33, 7, 37, 2, True, 0, True, True, id="T37-B33-2layer-bidir-batchfirst"),
    pytest.param(100, 1, 16, 24, 1, False, 0, False, True, id="T100-B1"),
    pytest.param(37, 5, 9, 37, 2, True, 11, False, True, id="T37-bidir-proj11"),
    pytest.param(2, 1, 1, 1, 1, True, 0, True, False, id="T2-H1-bidir-nobias"),
    pytest.param(37, 4, 3, 40, 3, False, 1, True, False, id="3layer-proj1-nobias"),
]


@pytest.mark.parametrize("T,B,I,H,layers,bidir,proj,batch_first,bias", CONFIGS)
@pytest.mark.parametrize("backend", ("cpu", "cuda", "triton", "reference"))
def test_lstm_matches_torch_float64(backend, T, B, I, H, layers, bidir, proj, batch_first, bias):
    device = lstm_device(backend, F64)
    theirs, ours = make_pair(
        I,
        H,
        device=device,
        num_layers=layers,
        bidirectional=bidir,
        proj_size=proj,
        batch_first=batch_first,
        bias=bias,
    )
    D, P = 2 if bidir else 1, proj or H
    x = torch.randn((B, T, I) if batch_first else (T, B, I), dtype=F64, device=device)
    h0 = torch.randn(layers * D, B, P, dtype=F64, device=device)
    c0 = torch.randn(layers * D, B, H, dtype=F64, device=device)
    results = []
    for module in (theirs, ours):
        leaves = [t.clone().requires_grad_() for t in (x, h0, c0)]
        with fastattn.use_backend(backend):
            out, (h_n, c_n) = module(leaves[0], (leaves[1], leaves[2]))
        weights = random_like_outputs(out, h_n, c_n)
        params = list(module.parameters())
        grads = grads_of(loss_of(out, h_n, c_n, weights), leaves + params)
        results.append((out, h_n, c_n, grads))
    assert fastattn.last_backend("lstm") == backend
    names = ["output", "h_n", "c_n"]
    for name, a, b in zip(names, results[1][:3], results[0][:3]):
        close64(name, a, b)
    grad_names = ["input", "h0", "c0"] + [n for n, _ in ours.named_parameters()]
    for name, a, b in zip(grad_names, results[1][3], results[0][3]):
        close64(f"grad {name}", a, b)


@pytest.mark.parametrize("backend", ("cpu", "reference"))
@pytest.mark.parametrize("batch_first", (False, True))
def test_lstm_unbatched_and_default_hx(backend, batch_first):
    device = lstm_device(backend, F64)
    theirs, ours = make_pair(
        6, 5, device=device, num_layers=2, bidirectional=True, batch_first=batch_first
    )
    x = torch.randn(7, 6, dtype=F64)
    h = (torch.randn(4, 5, dtype=F64), torch.randn(4, 5, dtype=F64))
    with fastattn.use_backend(backend):
        for args in ((x,), (x, h)):
            (o1, (h1, c1)), (o2, (h2, c2)) = theirs(*args), ours(*args)
            assert o2.shape == o1.shape == (7, 10) and h2.shape == (4, 5)
            for name, a, b in (("output", o2, o1), ("h_n", h2, h1), ("c_n", c2, c1)):
                close64(name, a, b)


@pytest.mark.parametrize("backend", ("cpu", "cuda", "triton", "reference"))
@pytest.mark.parametrize(
    "bidir,proj,batch_first,layers",
    [
        pytest.param(False, 0, False, 1, id="plain"),
        pytest.param(True, 0, True, 2, id="bidir-batchfirst-2layer"),
        pytest.param(True, 3, True, 2, id="bidir-proj-batchfirst-2layer"),
    ],
)
def test_packed_sequence_matches_torch(backend, bidir, proj, batch_first, layers):
    """PackedSequence in and out (enforce_sorted=False: sorted/unsorted indices as torch),
    initial states given, every gradient."""
    device = lstm_device(backend, F64)
    theirs, ours = make_pair(
        5,
        8,
        device=device,
        num_layers=layers,
        bidirectional=bidir,
        proj_size=proj,
        batch_first=batch_first,
    )
    D, P, B, T = 2 if bidir else 1, proj or 8, 6, 9
    lengths = torch.tensor([4, 9, 1, 9, 6, 2])
    x = torch.randn((B, T, 5) if batch_first else (T, B, 5), dtype=F64, device=device)
    h0 = torch.randn(layers * D, B, P, dtype=F64, device=device)
    c0 = torch.randn(layers * D, B, 8, dtype=F64, device=device)
    results = []
    for module in (theirs, ours):
        leaves = [t.clone().requires_grad_() for t in (x, h0, c0)]
        packed = pack_padded_sequence(
            leaves[0], lengths, batch_first=batch_first, enforce_sorted=False
        )
        with fastattn.use_backend(backend):
            out, (h_n, c_n) = module(packed, (leaves[1], leaves[2]))
        assert isinstance(out, torch.nn.utils.rnn.PackedSequence)
        weights = random_like_outputs(out, h_n, c_n)
        grads = grads_of(loss_of(out, h_n, c_n, weights), leaves + list(module.parameters()))
        results.append((out, h_n, c_n, grads))
    (o1, h1, c1, g1), (o2, h2, c2, g2) = results
    assert torch.equal(o2.batch_sizes, o1.batch_sizes)
    assert torch.equal(o2.sorted_indices, o1.sorted_indices)
    assert torch.equal(o2.unsorted_indices, o1.unsorted_indices)
    close64("packed output", o2.data, o1.data)
    close64("h_n", h2, h1)
    close64("c_n", c2, c1)
    for (name, _), a, b in zip(
        [("input", 0), ("h0", 0), ("c0", 0)] + list(ours.named_parameters()), g2, g1
    ):
        close64(f"grad {name}", a, b)
    # The padded view as torch returns it.
    pad1, len1 = pad_packed_sequence(o1, batch_first=batch_first)
    pad2, len2 = pad_packed_sequence(o2, batch_first=batch_first)
    assert torch.equal(len1, len2)
    close64("padded output", pad2, pad1)


@pytest.mark.parametrize("backend", ("cpu", "cuda", "triton"))
def test_functional_lengths_match_reference(backend):
    """fastattn.lstm(lengths=...) with unsorted lengths, a zero length and the full length:
    outputs 0 past each end, h_n/c_n at each true end (h0/c0 for length 0); the reference
    per-step loop defines it, torch's PackedSequence cannot hold a zero length."""
    device = lstm_device(backend, F64)
    _, ours = make_pair(4, 7, device=device, num_layers=2, bidirectional=True, proj_size=5)
    T, B = 11, 5
    lengths = torch.tensor([3, 11, 0, 7, 11], device=device)
    x = torch.randn(T, B, 4, dtype=F64, device=device)
    hx = (
        torch.randn(4, B, 5, dtype=F64, device=device),
        torch.randn(4, B, 7, dtype=F64, device=device),
    )
    weights = ours._weights()
    results = {}
    for be in (backend, "reference"):
        leaves = [t.clone().requires_grad_() for t in (x, *hx)]
        out, (h_n, c_n) = fastattn.lstm(
            leaves[0],
            (leaves[1], leaves[2]),
            weights,
            num_layers=2,
            bidirectional=True,
            proj_size=5,
            lengths=lengths,
            backend=be,
        )
        assert fastattn.last_backend("lstm") == be
        w = random_like_outputs(out, h_n, c_n)
        results[be] = (out, h_n, c_n, grads_of(loss_of(out, h_n, c_n, w), leaves + weights))
    out = results[backend][0]
    for b in range(B):
        assert out[int(lengths[b]) :, b].abs().max() == 0 if lengths[b] < T else True
    close64("h_n of the zero-length row", results[backend][1][:, 2], hx[0][:, 2])
    for name, a, b in zip(("output", "h_n", "c_n"), results[backend][:3], results["reference"][:3]):
        close64(name, a, b)
    for i, (a, b) in enumerate(zip(results[backend][3], results["reference"][3])):
        close64(f"grad {i}", a, b)


@pytest.mark.parametrize("backend", ("cpu", "cuda", "triton", "reference"))
@pytest.mark.parametrize(
    "B,I,H,bias,batched",
    [
        pytest.param(1, 1, 1, True, True, id="B1-I1-H1"),
        pytest.param(5, 300, 37, True, True, id="B5-I300-H37"),
        pytest.param(33, 7, 37, False, True, id="B33-nobias"),
        pytest.param(1, 9, 16, True, False, id="unbatched"),
    ],
)
def test_lstm_cell_matches_torch(backend, B, I, H, bias, batched):
    device = lstm_device(backend, F64)
    torch.manual_seed(0)
    theirs = torch.nn.LSTMCell(I, H, bias=bias).to(device=device, dtype=F64)
    ours = fastattn.nn.LSTMCell(I, H, bias=bias).to(device=device, dtype=F64)
    ours.load_state_dict(theirs.state_dict())
    shape = (B,) if batched else ()
    x = torch.randn(*shape, I, dtype=F64, device=device)
    h = torch.randn(*shape, H, dtype=F64, device=device)
    c = torch.randn(*shape, H, dtype=F64, device=device)
    results = []
    for module in (theirs, ours):
        leaves = [t.clone().requires_grad_() for t in (x, h, c)]
        with fastattn.use_backend(backend):
            hy, cy = module(leaves[0], (leaves[1], leaves[2]))
        wh, wc = torch.linspace(-1, 1, hy.numel(), dtype=F64).view_as(hy), torch.cos(cy.detach())
        grads = grads_of((hy * wh).sum() + (cy * wc).sum(), leaves + list(module.parameters()))
        results.append((hy, cy, grads))
    assert fastattn.last_backend("lstm_cell") == backend
    close64("hy", results[1][0], results[0][0])
    close64("cy", results[1][1], results[0][1])
    for i, (a, b) in enumerate(zip(results[1][2], results[0][2])):
        close64(f"grad {i}", a, b)
    # hx=None: zeros, as torch
    with fastattn.use_backend(backend):
        for a, b in zip(ours(x), theirs(x)):
            close64("default hx", a, b)


# ---------------------------------------------------------------------------------------------
# 2. Low precision: FlashAttention's rule against the float64 reference


def _run_functional(backend, dtype, inputs, params, *, lengths=None, **kw):
    """fastattn.lstm on `backend` with every tensor cast to dtype; returns the outputs and the
    gradients of (input, h0, c0, *params) for a fixed random loss."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in list(inputs) + list(params)]
    x, h0, c0, *weights = leaves
    out, (h_n, c_n) = fastattn.lstm(x, (h0, c0), weights, lengths=lengths, backend=backend, **kw)
    assert fastattn.last_backend("lstm") == backend
    g = torch.Generator().manual_seed(7)
    loss = sum(
        (t.double() * torch.randn(t.shape, generator=g, dtype=F64).to(t.device)).sum()
        for t in (out, h_n, c_n)
    )
    return (out.detach(), h_n.detach(), c_n.detach()), torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("backend", ("cpu", "cuda", "triton"))
@pytest.mark.parametrize(
    "dtype", (torch.float32, torch.float16, torch.bfloat16), ids=("fp32", "fp16", "bf16")
)
@pytest.mark.parametrize(
    "case",
    [
        pytest.param(dict(T=37, B=33, I=300, H=37), id="T37-B33-I300-H37"),
        pytest.param(
            dict(
                T=20, B=9, I=16, H=64, num_layers=2, bidirectional=True, proj_size=24, lengths=True
            ),
            id="2layer-bidir-proj-lengths",
        ),
        # bfloat16 on AMX: the per-step product's two 64-row groups (the second partial; with
        # more than 2 threads the grid splits the rows instead), H past 128 (two chunks of 64
        # pair rows) and a last unit block of 22 (a two-tile column tail)
        pytest.param(dict(T=6, B=70, I=40, H=150), id="T6-B70-I40-H150"),
        # ... and up to 8 rows, each row's hi and lo words in consecutive tile rows
        pytest.param(dict(T=5, B=3, I=24, H=40), id="T5-B3-I24-H40"),
        # odd sizes: bfloat16 pair words padded along I, H and P (AVX512-BF16 products)
        pytest.param(
            dict(
                T=9, B=11, I=17, H=19, num_layers=2, bidirectional=True, proj_size=7, lengths=True
            ),
            id="odd-2layer-bidir-proj-lengths",
        ),
    ],
)
def test_low_precision_fa_rule(backend, dtype, case, run_all_slow):
    device = lstm_device(backend, dtype)
    if (
        backend == "triton"
        and device.type == "cpu"
        and not run_all_slow
        and (dtype != torch.float32 or case.get("num_layers", 1) > 1 or case["B"] != 33)
    ):
        pytest.skip(
            "the interpreter runs only the one-layer large case (T37-B33), in float32 (the rest: "
            "test_triton_small_fa_rule; all of them with FASTATTN_SLOW=1)"
        )
    case = dict(case)
    T, B, I, H = (case.pop(k) for k in ("T", "B", "I", "H"))
    use_lengths = case.pop("lengths", False)
    layers, bidir, proj = (
        case.get("num_layers", 1),
        case.get("bidirectional", False),
        case.get("proj_size", 0),
    )
    _, module = make_pair(
        I, H, device=device, num_layers=layers, bidirectional=bidir, proj_size=proj
    )
    D, P = 2 if bidir else 1, proj or H
    torch.manual_seed(1)
    inputs = (
        torch.randn(T, B, I, dtype=F64),
        torch.randn(layers * D, B, P, dtype=F64),
        torch.randn(layers * D, B, H, dtype=F64),
    )
    inputs = [t.to(device) for t in inputs]
    lengths = torch.randint(1, T + 1, (B,), device=device) if use_lengths else None
    kw = dict(case, num_layers=layers)
    params = module._weights()
    # The kernel and the reference both see the dtype-rounded values.
    inputs = [t.to(dtype).to(F64) for t in inputs]
    params = [t.detach().to(dtype).to(F64) for t in params]
    outs, grads = _run_functional(backend, dtype, inputs, params, lengths=lengths, **kw)
    outs64, grads64 = _run_functional("reference", F64, inputs, params, lengths=lengths, **kw)
    outs_lp, grads_lp = _run_functional("reference", dtype, inputs, params, lengths=lengths, **kw)
    for name, a, b, c in zip(("output", "h_n", "c_n"), outs, outs64, outs_lp):
        assert a.dtype == dtype
        assert_fa_close(f"lstm [{backend}, {dtype}] {name}", a, b, c)
    names = ["input", "h0", "c0"] + [f"weights[{i}]" for i in range(len(params))]
    for name, a, b, c in zip(names, grads, grads64, grads_lp):
        assert_grad_close(f"lstm [{backend}, {dtype}] grad {name}", a, b, c)


# The CPU kernel's bfloat16 products carry their float operands as two bfloat16 parts (to 2^-18
# of them: h_{t-1} in the forward steps, the gate gradients in the input gradient on AMX) with
# float sums, so its bfloat16 results are the float64 result rounded once, except where that
# lies within the kernel's error of a rounding boundary: about 2 x 2^-18 / 2^-8 = 0.2% of the
# elements (measured: at most 0.3%, the input gradient at B = 70). Rounding h to bfloat16 once
# per step (dropping the lo products) changes 9-13% of the outputs, which the FA rule's bound
# (torch's error, from such rounding) does not notice. The loss's weights are bfloat16 values, so
# the backward starts from exact output gradients.
@pytest.mark.parametrize(
    "case",
    [
        pytest.param(dict(T=5, B=3, I=24, H=40), id="T5-B3-I24-H40"),
        pytest.param(dict(T=6, B=70, I=40, H=150), id="T6-B70-I40-H150"),
    ],
)
def test_cpu_bf16_results_rounded_once(case):
    device = lstm_device("cpu", torch.bfloat16)
    T, B, I, H = case["T"], case["B"], case["I"], case["H"]
    _, module = make_pair(I, H, device=device)
    torch.manual_seed(1)
    bf16_values = lambda *shape: torch.randn(*shape).to(torch.bfloat16).to(F64)  # noqa: E731
    inputs = [bf16_values(T, B, I), bf16_values(1, B, H), bf16_values(1, B, H)]
    params = [t.detach().to(torch.bfloat16).to(F64) for t in module._weights()]
    out_grads = [bf16_values(T, B, H), bf16_values(1, B, H), bf16_values(1, B, H)]
    names = ["output", "h_n", "c_n", "grad input", "grad h0", "grad c0"]
    names += [f"grad weights[{i}]" for i in range(len(params))]
    results = {}
    for backend, dtype in (("cpu", torch.bfloat16), ("reference", F64)):
        leaves = [t.detach().to(dtype).requires_grad_() for t in inputs + params]
        x, h0, c0, *weights = leaves
        out, (h_n, c_n) = fastattn.lstm(x, (h0, c0), weights, backend=backend, num_layers=1)
        grads = torch.autograd.grad((out, h_n, c_n), leaves, [g.to(dtype) for g in out_grads])
        results[backend] = [out, h_n, c_n, *grads]
    for name, a, b in zip(names, results["cpu"], results["reference"]):
        assert a.dtype == torch.bfloat16
        changed = (a != b.detach().to(torch.bfloat16)).double().mean().item()
        assert changed <= 0.02, f"{name}: {changed:.2%} differ from the float64 result rounded"


@pytest.mark.parametrize("backend", ("cpu", "cuda", "triton"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("fp32", "bf16"))
# B: the CPU cell's three paths: fused dot products (B <= 8), GEMMs that read the weights in
# place (B <= 32), packed GEMMs.
@pytest.mark.parametrize("B", (1, 5, 16, 33))
def test_lstm_cell_low_precision_fa_rule(backend, dtype, B):
    device = lstm_device(backend, dtype)
    torch.manual_seed(2)
    I, H = 300, 37
    tensors = [
        torch.randn(B, I),
        torch.randn(B, H),
        torch.randn(B, H),
        torch.randn(4 * H, I) * 0.1,
        torch.randn(4 * H, H) * 0.2,
        torch.randn(4 * H),
        torch.randn(4 * H),
    ]
    tensors = [t.to(dtype).to(device=device, dtype=F64) for t in tensors]
    runs = {}
    for label, be, dt in (
        ("out", backend, dtype),
        ("ref64", "reference", F64),
        ("ref_lowp", "reference", dtype),
    ):
        leaves = [t.to(dt).requires_grad_() for t in tensors]
        hy, cy = fastattn.lstm_cell(*leaves, backend=be)
        assert fastattn.last_backend("lstm_cell") == be
        loss = (hy.double() * torch.cos(torch.arange(hy.numel(), dtype=F64)).view_as(hy)).sum() + (
            cy.double() * 0.5
        ).sum()
        runs[label] = ((hy.detach(), cy.detach()), torch.autograd.grad(loss, leaves))
    for i, name in enumerate(("hy", "cy")):
        assert_fa_close(
            f"lstm_cell [{backend}] {name}",
            runs["out"][0][i],
            runs["ref64"][0][i],
            runs["ref_lowp"][0][i],
        )
    for i, name in enumerate(("input", "hx", "cx", "w_ih", "w_hh", "b_ih", "b_hh")):
        assert_grad_close(
            f"lstm_cell [{backend}] grad {name}",
            runs["out"][1][i],
            runs["ref64"][1][i],
            runs["ref_lowp"][1][i],
        )


# ---------------------------------------------------------------------------------------------
# 3. Dropout


def _dropout_run(backend, seed, *, training=True, p=0.4, dtype=F64):
    _, module = make_pair(
        6, 9, device="cpu", dtype=dtype, num_layers=3, bidirectional=True, dropout=p, seed=3
    )
    module.train(training)
    x = torch.randn(8, 4, 6, dtype=dtype, generator=torch.Generator().manual_seed(5))
    x.requires_grad_()
    torch.manual_seed(seed)
    with fastattn.use_backend(backend):
        out, (h_n, c_n) = module(x)
    grads = torch.autograd.grad(out.sum() + h_n.sum(), [x] + list(module.parameters()))
    return out, h_n, grads


@pytest.mark.parametrize("backend", ("cpu", "cuda", "triton", "reference"))
def test_dropout_reproducible_and_same_mask_as_reference(backend):
    lstm_device(backend, F64)
    out1, h1, g1 = _dropout_run(backend, seed=11)
    out2, h2, g2 = _dropout_run(backend, seed=11)
    assert torch.equal(out1, out2) and torch.equal(h1, h2)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)
    out3, _, _ = _dropout_run(backend, seed=12)
    assert not torch.allclose(out1, out3), "a different seed must drop different elements"
    if backend != "reference":  # a kernel against the reference's Philox mask
        ref_out, ref_h, ref_g = _dropout_run("reference", seed=11)
        close64("output vs reference (same Philox mask)", out1, ref_out)
        close64("h_n vs reference", h1, ref_h)
        for i, (a, b) in enumerate(zip(g1, ref_g)):
            close64(f"grad {i} vs reference", a, b)
    no_drop, _, _ = _dropout_run(backend, seed=11, p=0.0)
    assert not torch.allclose(out1, no_drop), "dropout must change the result in training"
    eval_out, _, _ = _dropout_run(backend, seed=11, training=False)
    close64("eval mode ignores dropout", eval_out, no_drop)


def test_dropout_rate_and_scale():
    """The layer op drops about p of its input and scales the rest by 1/(1-p): the layer's
    input gradient is exactly the mask times 1/(1-p) times the undropped gradient."""
    torch.manual_seed(0)
    T, B, I, H = 30, 16, 64, 8
    args = [
        torch.randn(T, B, I, dtype=F64, requires_grad=True),
        torch.zeros(1, B, H, dtype=F64),
        torch.zeros(1, B, H, dtype=F64),
        torch.randn(1, 4 * H, I, dtype=F64),
        torch.randn(1, 4 * H, H, dtype=F64),
        None,
        None,
        None,
        None,
    ]
    seed = torch.tensor([1234, 99])
    out, *_ = torch.ops.fastattn.lstm_layer(*args, 0.25, seed, True)
    (g_drop,) = torch.autograd.grad(out.sum(), args[0])
    out0, *_ = torch.ops.fastattn.lstm_layer(*args, 0.0, None, True)
    (g_full,) = torch.autograd.grad(out0.sum(), args[0])
    kept = g_drop != 0
    assert abs(1.0 - kept.double().mean().item() - 0.25) < 0.02
    # Row (t, b): all of x[t, b] either kept or dropped per element; where kept, the gradient
    # of a dropped-out input differs from the undropped one (other inputs changed), so check
    # the mask against the reference generator instead.
    keep_ref = fastattn.reference.random.dropout_keep_mask(seed, (T, B, I), 0.25)
    assert torch.equal(kept, keep_ref)
    assert g_full.ne(0).all()


# ---------------------------------------------------------------------------------------------
# 4. gradcheck, opcheck, compile


def _layer_args(T=4, B=3, I=3, H=4, D=2, P=3, lengths=True, bias=True, grad=True, dtype=F64):
    g = torch.Generator().manual_seed(0)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=dtype) * scale).requires_grad_(grad)

    return [
        r(T, B, I),
        r(D, B, P),
        r(D, B, H),
        r(D, 4 * H, I, scale=0.5),
        r(D, 4 * H, P, scale=0.5),
        r(D, 4 * H) if bias else None,
        r(D, 4 * H) if bias else None,
        r(D, P, H, scale=0.5) if P != H else None,
        torch.tensor([2, 4, 1][:B]) if lengths else None,
    ]


@pytest.mark.parametrize("backend", ("cpu", "cuda"))
@pytest.mark.parametrize("variant", ["plain", "bidir-proj-lengths", "dropout-lengths"])
def test_lstm_layer_gradcheck(backend, variant):
    device = lstm_device(backend, F64)
    if variant == "plain":
        args = _layer_args(D=1, P=4, lengths=False)
        p, seed = 0.0, None
    elif variant == "bidir-proj-lengths":
        args = _layer_args()
        p, seed = 0.0, None
    else:
        args = _layer_args(D=2, P=4)
        p, seed = 0.3, torch.tensor([5, 6])
    args = [a.to(device) if a is not None else None for a in args]
    seed = seed.to(device) if seed is not None else None

    def fn(*tensors):
        out, h_n, c_n, _ = torch.ops.fastattn.lstm_layer(*tensors, p, seed, True)
        return out, h_n, c_n

    assert torch.autograd.gradcheck(fn, tuple(args))


@pytest.mark.parametrize("backend", ("cpu", "cuda"))
@pytest.mark.parametrize("bias", (True, False))
def test_lstm_cell_gradcheck(backend, bias):
    device = lstm_device(backend, F64)
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 4), (3, 5), (3, 5), (20, 4), (20, 5)] + ([(20,), (20,)] if bias else [])
    args = [torch.randn(*s, generator=g, dtype=F64).to(device).requires_grad_() for s in shapes]
    if not bias:
        args += [None, None]
    assert torch.autograd.gradcheck(lambda *a: fastattn.lstm_cell(*a, backend=backend), args)


def _opcheck_cases(device):
    cases = {
        "layer": ("lstm_layer", _layer_args(lengths=False, D=1, P=4) + [0.0, None, True]),
        "layer-bidir-proj-lengths": ("lstm_layer", _layer_args() + [0.0, None, True]),
        "layer-dropout-nobias": (
            "lstm_layer",
            _layer_args(bias=False) + [0.2, torch.tensor([1, 2]), True],
        ),
        "layer-fp32": ("lstm_layer", _layer_args(dtype=torch.float32) + [0.0, None, True]),
        "layer-inference": ("lstm_layer", _layer_args(grad=False) + [0.0, None, False]),
        "cell": (
            "lstm_cell",
            [
                torch.randn(3, 4, requires_grad=True),
                torch.randn(3, 5, requires_grad=True),
                torch.randn(3, 5, requires_grad=True),
                torch.randn(20, 4, requires_grad=True),
                torch.randn(20, 5, requires_grad=True),
                torch.randn(20, requires_grad=True),
                torch.randn(20, requires_grad=True),
            ],
        ),
        "cell-large-batch": (
            "lstm_cell",
            [
                torch.randn(20, 4),
                torch.randn(20, 5),
                torch.randn(20, 5),
                torch.randn(20, 4),
                torch.randn(20, 5),
                None,
                None,
            ],
        ),
    }
    args = _layer_args(grad=False)
    _, _, _, ws = torch.ops.fastattn.lstm_layer(*args, 0.0, None, True)
    T, B, _ = args[0].shape
    cases["layer_backward"] = (
        "lstm_layer_backward",
        [
            torch.randn(T, B, 6, dtype=F64),
            None,
            torch.randn(2, B, 4, dtype=F64),
            *args[:5],
            args[7],
            args[8],
            ws,
            0.0,
            None,
            True,
            True,
            True,
        ],
    )
    cell = [
        torch.randn(3, 4),
        torch.randn(3, 5),
        torch.randn(3, 5),
        torch.randn(20, 4),
        torch.randn(20, 5),
    ]
    _, _, cws = torch.ops.fastattn.lstm_cell(*cell, None, None)
    cases["cell_backward"] = ("lstm_cell_backward", [torch.randn(3, 5), None, *cell, cws, False])
    return {
        k: (name, [a.to(device) if isinstance(a, torch.Tensor) else a for a in args])
        for k, (name, args) in cases.items()
    }


@pytest.mark.parametrize("case", list(_opcheck_cases("cpu")))
@pytest.mark.parametrize("backend", ("cpu", "cuda"))
def test_opcheck(backend, case):
    device = lstm_device(backend)
    name, args = _opcheck_cases(device)[case]
    torch.library.opcheck(getattr(torch.ops.fastattn, name), args)


class _Tagger(torch.nn.Module):
    """Embedding -> fastattn.nn.LSTM (2 layers, bidirectional, projected, batch first) ->
    linear; and a fastattn.nn.LSTMCell decoder step."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(30, 12)
        self.lstm = fastattn.nn.LSTM(
            12, 16, num_layers=2, bidirectional=True, proj_size=8, batch_first=True
        )
        self.cell = fastattn.nn.LSTMCell(16, 10)
        self.head = torch.nn.Linear(16 + 10, 5)

    def forward(self, tokens, lengths):
        h, _ = self.lstm(self.embed(tokens))
        y, _ = fastattn.lstm(
            self.embed(tokens),
            None,
            self.lstm._weights(),
            num_layers=2,
            bidirectional=True,
            batch_first=True,
            proj_size=8,
            lengths=lengths,
        )
        hc, _ = self.cell(y[:, -1])
        return self.head(torch.cat([h[:, 0], hc], -1))


def test_compile_fullgraph(monkeypatch):
    """A model with fastattn.nn.LSTM, fastattn.lstm(lengths=...) and fastattn.nn.LSTMCell
    compiles without graph breaks and without touching Dynamo's config (allow_rnn stays off);
    outputs and gradients equal eager. PackedSequence inputs cannot be traced fullgraph (torch's
    pack/pad functions are skipped by Dynamo and have data-dependent sizes): compiled models
    pass padded tensors with lengths= instead (next test)."""
    assert not torch._dynamo.config.allow_rnn
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Tagger()
    tokens = torch.randint(0, 30, (3, 9))
    lengths = torch.tensor([9, 4, 6])
    compiled = torch.compile(model, fullgraph=True)
    monkeypatch.setattr(_backend, "_availability_cache", None)  # as in a fresh process
    out = compiled(tokens, lengths)
    assert fastattn.last_backend("lstm") == "cpu" and fastattn.last_backend("lstm_cell") == "cpu"
    eager = model(tokens, lengths)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    params = [p for p in model.parameters()]
    g_compiled = torch.autograd.grad(out.square().sum(), params)
    g_eager = torch.autograd.grad(eager.square().sum(), params)
    for g, e in zip(g_compiled, g_eager):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)


def test_compile_packed_sequence_with_graph_breaks():
    """Without fullgraph, a PackedSequence forward compiles (torch's packing runs eagerly
    between graphs) and matches eager."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    module = fastattn.nn.LSTM(4, 6, bidirectional=True)
    x = torch.randn(7, 3, 4)
    packed = pack_padded_sequence(x, torch.tensor([7, 2, 5]), enforce_sorted=False)
    compiled = torch.compile(module)
    out, (h, c) = compiled(packed)
    eager, (he, ce) = module(packed)
    torch.testing.assert_close(out.data, eager.data)
    torch.testing.assert_close(h, he)


# ---------------------------------------------------------------------------------------------
# 5. Backend choice and errors


def test_default_backend_and_explicit_refusals():
    x = torch.randn(5, 2, 3)
    module = fastattn.nn.LSTM(3, 4)
    module(x)
    assert fastattn.last_backend("lstm") == "cpu"
    fastattn.lstm_cell(
        torch.randn(2, 3),
        torch.randn(2, 4),
        torch.randn(2, 4),
        module.weight_ih_l0,
        module.weight_hh_l0,
    )
    assert fastattn.last_backend("lstm_cell") == "cpu"
    with fastattn.use_backend("reference"):
        module(x)
    assert fastattn.last_backend("lstm") == "reference"
    # x is on the CPU: an explicit cuda (or kernel-less triton) backend refuses, with or
    # without a GPU here
    for backend in ("cuda", "triton"):
        reason = unsupported_backends().get(backend)
        if (
            backend == "triton"
            and reason is None
            and _backend._can_run_device("triton", x.device) is None
        ):
            # CPU tensors under the interpreter: an explicit request runs the Triton kernels
            # (the automatic choice above stayed cpu); float64 is refused.
            with fastattn.use_backend(backend):
                module(x)
            assert fastattn.last_backend("lstm") == "triton"
            with pytest.raises(fastattn.BackendError, match="float64"):
                with fastattn.use_backend(backend):
                    module.double()(x.double())
            module.float()
            continue
        with pytest.raises(fastattn.BackendError, match="lstm"):
            with fastattn.use_backend(backend):
                module(x)


def _same_error(call_ours, call_theirs):
    """Both calls raise the same exception type with the same message."""
    with pytest.raises(Exception) as theirs:
        call_theirs()
    with pytest.raises(type(theirs.value)) as ours:
        call_ours()
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize(
    "case",
    [
        "input_size",
        "h0_shape",
        "c0_shape",
        "hx_dims",
        "dtype",
        "input_dims",
        "unsorted_enforce_sorted",
        "proj_too_big",
        "bad_dropout",
        "input_device",
        "hidden_device",
    ],
)
def test_module_errors_match_torch(case):
    theirs, ours = make_pair(5, 4, device="cpu", dtype=torch.float32, num_layers=2)
    x = torch.randn(6, 3, 5)
    h = (torch.zeros(2, 3, 4), torch.zeros(2, 3, 4))
    if case == "input_size":
        _same_error(lambda: ours(torch.randn(6, 3, 7)), lambda: theirs(torch.randn(6, 3, 7)))
    elif case == "h0_shape":
        bad = (torch.zeros(2, 3, 5), h[1])
        _same_error(lambda: ours(x, bad), lambda: theirs(x, bad))
    elif case == "c0_shape":
        bad = (h[0], torch.zeros(1, 3, 4))
        _same_error(lambda: ours(x, bad), lambda: theirs(x, bad))
    elif case == "hx_dims":
        bad = (torch.zeros(3, 4), torch.zeros(3, 4))
        _same_error(lambda: ours(x, bad), lambda: theirs(x, bad))
    elif case == "dtype":
        xi = torch.ones(6, 3, 5, dtype=torch.int64)
        _same_error(lambda: ours(xi), lambda: theirs(xi))
    elif case == "input_dims":
        _same_error(lambda: ours(torch.randn(5)), lambda: theirs(torch.randn(5)))
    elif case == "unsorted_enforce_sorted":
        _same_error(
            lambda: ours(pack_padded_sequence(x, torch.tensor([3, 6, 2]))),
            lambda: theirs(pack_padded_sequence(x, torch.tensor([3, 6, 2]))),
        )
    elif case == "proj_too_big":
        _same_error(
            lambda: fastattn.nn.LSTM(5, 4, proj_size=4), lambda: torch.nn.LSTM(5, 4, proj_size=4)
        )
    elif case == "bad_dropout":
        _same_error(
            lambda: fastattn.nn.LSTM(5, 4, dropout=1.5), lambda: torch.nn.LSTM(5, 4, dropout=1.5)
        )
    elif case == "input_device":  # "meta" stands in for a second device without a GPU
        xm = x.to("meta")
        _same_error(lambda: ours(xm), lambda: theirs(xm))
    elif case == "hidden_device":
        hm = (h[0].to("meta"), h[1].to("meta"))
        _same_error(lambda: ours(x, hm), lambda: theirs(x, hm))


@pytest.mark.parametrize("case", ["input_size", "batch", "hidden_size"])
def test_cell_module_errors_match_torch(case):
    torch.manual_seed(0)
    theirs, ours = torch.nn.LSTMCell(5, 4), fastattn.nn.LSTMCell(5, 4)
    x, h = torch.randn(3, 5), (torch.zeros(3, 4), torch.zeros(3, 4))
    if case == "input_size":
        _same_error(lambda: ours(torch.randn(3, 6), h), lambda: theirs(torch.randn(3, 6), h))
    elif case == "batch":
        bad = (torch.zeros(2, 4), torch.zeros(2, 4))
        _same_error(lambda: ours(x, bad), lambda: theirs(x, bad))
    else:
        bad = (torch.zeros(3, 4), torch.zeros(3, 6))
        _same_error(lambda: ours(x, bad), lambda: theirs(x, bad))


def test_functional_errors():
    w = list(torch.nn.LSTM(3, 4)._flat_weights)
    x = torch.randn(5, 2, 3)
    with pytest.raises(TypeError, match="lstm: input must be float32"):
        fastattn.lstm(x.long(), None, w, num_layers=1)
    with pytest.raises(ValueError, match="expected 2 or 4 weight tensors"):
        fastattn.lstm(x, None, w[:3], num_layers=1)
    with pytest.raises(
        ValueError, match="input.size\\(-1\\) must be equal to input_size. Expected 3, got 7"
    ):
        fastattn.lstm(torch.randn(5, 2, 7), None, w, num_layers=1)
    with pytest.raises(ValueError, match="Expected hidden\\[0\\] size \\(1, 2, 4\\), got"):
        fastattn.lstm(x, (torch.zeros(1, 3, 4), torch.zeros(1, 2, 4)), w, num_layers=1)
    with pytest.raises(ValueError, match="lengths must be in \\[0, T\\] = \\[0, 5\\]"):
        fastattn.lstm(x, None, w, num_layers=1, lengths=torch.tensor([6, 1]))
    with pytest.raises(ValueError, match="lengths must have shape \\(2,\\)"):
        fastattn.lstm(x, None, w, num_layers=1, lengths=torch.tensor([5, 1, 1]))
    with pytest.raises(TypeError, match="lengths must be an integer tensor"):
        fastattn.lstm(x, None, w, num_layers=1, lengths=torch.tensor([5.0, 1.0]))
    with pytest.raises(TypeError, match="must have the input's dtype"):
        fastattn.lstm(x, None, [t.double() for t in w], num_layers=1)
    with pytest.raises(ValueError, match="not at the same device"):
        fastattn.lstm(x, None, [w[0].to("meta")] + w[1:], num_layers=1)
    with pytest.raises(ValueError, match="hidden0 has inconsistent hidden_size"):
        fastattn.lstm_cell(torch.randn(2, 3), torch.randn(2, 5), torch.randn(2, 4), w[0], w[1])
    # The native op's own checks (direct calls)
    with pytest.raises(RuntimeError, match="lstm_layer: lengths must be in \\[0, T\\]"):
        torch.ops.fastattn.lstm_layer(
            x,
            torch.zeros(1, 2, 4),
            torch.zeros(1, 2, 4),
            w[0][None],
            w[1][None],
            None,
            None,
            None,
            torch.tensor([9, 1]),
            0.0,
            None,
            False,
        )
    with pytest.raises(RuntimeError, match="lstm_layer: w_ih must have shape"):
        torch.ops.fastattn.lstm_layer(
            x,
            torch.zeros(1, 2, 4),
            torch.zeros(1, 2, 4),
            w[0][None, :, :2],
            w[1][None],
            None,
            None,
            None,
            None,
            0.0,
            None,
            False,
        )


@pytest.mark.filterwarnings("ignore:Accessing the data pointer of FakeTensor")
@pytest.mark.parametrize("backend_name", ["cuda", "triton"])
def test_no_host_reads_for_cuda_tensors(backend_name):
    """fastattn.lstm with lengths on CUDA tensors (fake ones: no GPU needed) and the nn
    modules read no value on the host; the lengths are still checked, asynchronously on the
    device (and the kernels clamp them into [0, T]). Forward only: autograd's engine needs a
    CUDA device even for fake tensors (the backward formulas read no values either)."""
    with fake_cuda(backend_name) as recorder:
        weights = []
        for layer in range(2):
            for _ in range(2):  # directions
                weights += [
                    torch.randn(16, 3 if layer == 0 else 8, device="cuda"),
                    torch.randn(16, 4, device="cuda"),
                    torch.randn(16, device="cuda"),
                    torch.randn(16, device="cuda"),
                ]
        x = torch.randn(5, 2, 3, device="cuda")
        lengths = torch.tensor([5, 2], device="cuda")
        out, (h_n, c_n) = fastattn.lstm(
            x,
            None,
            weights,
            num_layers=2,
            bidirectional=True,
            lengths=lengths,
            backend=backend_name,
        )
        assert out.shape == (5, 2, 8) and h_n.shape == c_n.shape == (4, 2, 4)
        assert fastattn.last_backend("lstm") == backend_name
        cell = fastattn.nn.LSTMCell(3, 4, device="cuda")
        with fastattn.use_backend(backend_name):
            cell(x[0])
            fastattn.nn.LSTM(3, 4, device="cuda")(x)
    assert_no_host_reads(recorder)
    assert device_checks(recorder) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend_name", ["cuda", "triton"])
def test_cuda_no_synchronisation(backend_name):
    """torch.cuda.set_sync_debug_mode("error") raises on any synchronising call (C++ .item()
    included): fastattn.lstm with CUDA lengths, forward and backward, makes none."""
    device = lstm_device(backend_name)
    lstm = torch.nn.LSTM(3, 4, num_layers=2, bidirectional=True).to(device)
    x = torch.randn(5, 2, 3, device=device, requires_grad=True)
    lengths = torch.tensor([5, 2], device=device)
    weights = list(lstm._flat_weights)

    def run():
        out, (h_n, c_n) = fastattn.lstm(
            x,
            None,
            weights,
            num_layers=2,
            bidirectional=True,
            lengths=lengths,
            backend=backend_name,
        )
        torch.autograd.grad(out.sum() + h_n.sum() + c_n.sum(), [x] + weights)

    assert_no_device_sync(run)


def test_device_checks_catch_bad_lengths(monkeypatch):
    """The lengths rule checked on the device for CUDA tensors, run on CPU tensors through the
    same code (torch._assert_async raises at once on the CPU)."""
    force_device_checks(monkeypatch)
    w = list(torch.nn.LSTM(3, 4)._flat_weights)
    x = torch.randn(5, 2, 3)
    for bad in ([6, 1], [-1, 2]):
        with pytest.raises(RuntimeError, match=r"lstm: lengths must be in \[0, T\] = \[0, 5\]"):
            fastattn.lstm(x, None, w, num_layers=1, lengths=torch.tensor(bad), backend="reference")
    fastattn.lstm(x, None, w, num_layers=1, lengths=torch.tensor([5, 0]), backend="reference")


# ---------------------------------------------------------------------------------------------
# 6. Modules: state_dict, flatten_parameters, swapped-model training


def test_state_dict_and_parameters_match_torch():
    kw = dict(num_layers=2, bidirectional=True, proj_size=3)
    theirs, ours = torch.nn.LSTM(5, 6, **kw), fastattn.nn.LSTM(5, 6, **kw)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    assert "weight_hr_l1_reverse" in dict(ours.named_parameters())
    ours.load_state_dict(theirs.state_dict())
    theirs2 = torch.nn.LSTM(5, 6, **kw)
    theirs2.load_state_dict(ours.state_dict())
    for (n, a), (_, b) in zip(theirs.state_dict().items(), theirs2.state_dict().items()):
        assert torch.equal(a, b), n
    assert isinstance(ours, torch.nn.RNNBase) and not isinstance(ours, torch.nn.LSTM)
    assert isinstance(fastattn.nn.LSTMCell(2, 3), torch.nn.LSTMCell)
    assert repr(ours).replace("fastattn.nn.", "") == repr(theirs).replace("torch.nn.", "")
    ours.flatten_parameters()  # a no-op on CPU, as torch's
    x = torch.randn(4, 2, 5)
    torch.testing.assert_close(ours(x)[0], theirs(x)[0], rtol=1e-5, atol=1e-6)
    # Parameters replaced after construction are the ones used.
    with torch.no_grad():
        ours.weight_hh_l0 = torch.nn.Parameter(torch.zeros_like(ours.weight_hh_l0))
        theirs.weight_hh_l0 = torch.nn.Parameter(torch.zeros_like(theirs.weight_hh_l0))
    torch.testing.assert_close(ours(x)[0], theirs(x)[0], rtol=1e-5, atol=1e-6)


class _Classifier(torch.nn.Module):
    def __init__(self, lstm_cls):
        super().__init__()
        self.embed = torch.nn.Embedding(20, 8)
        self.lstm = lstm_cls(8, 12, num_layers=2, bidirectional=True, batch_first=True)
        self.head = torch.nn.Linear(24, 3)

    def forward(self, tokens):
        out, (h, _) = self.lstm(self.embed(tokens))
        return self.head(out.mean(1))


def test_swapped_model_trains_like_torch():
    """Liger's check: the same model with torch.nn.LSTM and with fastattn.nn.LSTM, same
    initial parameters, trained with the same batches, gives the same losses."""
    torch.manual_seed(0)
    theirs = _Classifier(torch.nn.LSTM).double()
    ours = _Classifier(fastattn.nn.LSTM).double()
    ours.load_state_dict(theirs.state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (theirs, ours)]
    g = torch.Generator().manual_seed(1)
    for step in range(8):
        tokens = torch.randint(0, 20, (6, 11), generator=g)
        labels = torch.randint(0, 3, (6,), generator=g)
        losses = []
        for model, opt in zip((theirs, ours), opts):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(tokens), labels)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert abs(losses[0] - losses[1]) < 1e-10, (step, losses)


def test_other_isa_copies_match():
    """The avx2 and baseline x86 copies of the CPU kernels (FASTATTN_CPU_ISA caps the choice
    at import) compute the same LSTM (they use ATen's GEMM for the large products)."""
    code = (
        "import torch, fastattn, sys\n"
        "torch.manual_seed(0)\n"
        "m = fastattn.nn.LSTM(5, 9, num_layers=2, bidirectional=True, proj_size=4)\n"
        "x = torch.randn(7, 3, 5, requires_grad=True)\n"
        "L = torch.tensor([7, 2, 5])\n"
        "o, (h, c) = fastattn.lstm(x, None, m._weights(), num_layers=2, bidirectional=True,"
        " proj_size=4, lengths=L)\n"
        "g = torch.autograd.grad(o.sum() + c.sum(), [x] + list(m.parameters()))\n"
        "with fastattn.use_backend('reference'):\n"
        "    o2, (h2, c2) = fastattn.lstm(x, None, m._weights(), num_layers=2,"
        " bidirectional=True, proj_size=4, lengths=L)\n"
        "g2 = torch.autograd.grad(o2.sum() + c2.sum(), [x] + list(m.parameters()))\n"
        "pairs = zip((o, h, c) + g, (o2, h2, c2) + g2)\n"
        "err = max([float((a - b).abs().max()) for a, b in pairs])\n"
        "print(fastattn.build_info()['cpu_isa'], err)\n"
        "sys.exit(0 if err < 1e-5 else 1)\n"
    )
    for isa in ("avx2", "base"):
        env = dict(os.environ, FASTATTN_CPU_ISA=isa)
        proc = subprocess.run(
            [sys.executable, "-c", code],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr


# ---------------------------------------------------------------------------------------------
# 7. The large grid (slow)


@pytest.mark.parametrize("T", (1, 2, 37, 100))
@pytest.mark.parametrize("B", (1, 33))
@pytest.mark.parametrize("I,H", [(1, 1), (300, 37), (16, 64)])
@pytest.mark.parametrize(
    "bidir,proj,batch_first,packed",
    [
        (False, 0, False, False),
        (True, 0, True, False),
        (True, 5, True, True),
        (False, 7, False, True),
    ],
)
@pytest.mark.parametrize("backend", ("cpu", "cuda", "triton"))
@pytest.mark.parametrize("_slow", [pytest.param(None, marks=slow)])
def test_grid_against_torch_float64(backend, bidir, proj, batch_first, packed, I, H, B, T, _slow):
    if proj >= H:
        pytest.skip("proj_size must be < hidden_size")
    device = lstm_device(backend, F64)
    theirs, ours = make_pair(
        I,
        H,
        device=device,
        num_layers=2,
        bidirectional=bidir,
        proj_size=proj,
        batch_first=batch_first,
    )
    x = torch.randn((B, T, I) if batch_first else (T, B, I), dtype=F64, device=device)
    lengths = torch.randint(1, T + 1, (B,)) if packed else None
    results = []
    for module in (theirs, ours):
        xl = x.clone().requires_grad_()
        inp = (
            pack_padded_sequence(xl, lengths, batch_first=batch_first, enforce_sorted=False)
            if packed
            else xl
        )
        with fastattn.use_backend(backend):
            out, (h_n, c_n) = module(inp)
        w = random_like_outputs(out, h_n, c_n)
        results.append(
            (
                (out.data if packed else out),
                h_n,
                c_n,
                grads_of(loss_of(out, h_n, c_n, w), [xl] + list(module.parameters())),
            )
        )
    for i, (a, b) in enumerate(zip(results[1][:3], results[0][:3])):
        close64(f"output {i}", a, b, rtol=1e-8, atol=1e-9)
    for i, (a, b) in enumerate(zip(results[1][3], results[0][3])):
        close64(f"grad {i}", a, b, rtol=1e-8, atol=1e-9)


# ---------------------------------------------------------------------------------------------
# 8. The Triton kernels on small cases (the CPU interpreter is slow; a GPU runs the grids above)

# (T, B, I, H, num_layers, bidirectional, proj_size, lengths, batch_first)
TRITON_CASES = [
    pytest.param(1, 1, 1, 1, 1, False, 0, None, False, id="T1-B1-I1-H1"),
    pytest.param(5, 3, 5, 7, 1, True, 0, [5, 0, 2], False, id="T5-B3-bidir-lengths"),
    pytest.param(5, 3, 5, 7, 2, True, 4, [3, 5, 1], True, id="T5-B3-2layer-bidir-proj-lengths-bf"),
    pytest.param(5, 1, 1, 7, 1, False, 3, None, False, id="T5-B1-I1-proj"),
    pytest.param(1, 3, 5, 1, 1, True, 0, None, True, id="T1-B3-H1-bidir-batchfirst"),
]


def _tiny_floor(ref64: torch.Tensor, dtype: torch.dtype) -> float:
    """The rounding floor, but at least one ulp at the largest value: on a handful of
    elements the baseline (the reference in `dtype`) is a lucky sample of a few roundings, and a
    correct kernel that rounds in another order is one ulp off (the CPU backend fails the
    T5-B1-I1-proj float32 case by the same 6.1e-8 without it)."""
    top = float(ref64.abs().max()) if ref64.numel() else 0.0
    return max(rounding_floor(ref64, dtype), torch.finfo(dtype).eps * top)


def _triton_fa_rule(dtype, T, B, I, H, layers, bidir, proj, lengths, batch_first):
    device = lstm_device("triton", dtype)
    _, module = make_pair(
        I, H, device=device, num_layers=layers, bidirectional=bidir, proj_size=proj
    )
    D, P = 2 if bidir else 1, proj or H
    g = torch.Generator().manual_seed(T * 100 + B * 10 + H)
    shape = (B, T, I) if batch_first else (T, B, I)
    inputs = [
        torch.randn(*s, generator=g, dtype=F64).to(dtype).to(device=device, dtype=F64)
        for s in (shape, (layers * D, B, P), (layers * D, B, H))
    ]
    params = [t.detach().to(dtype).to(F64) for t in module._weights()]
    lengths = torch.tensor(lengths, device=device) if lengths is not None else None
    kw = dict(num_layers=layers, bidirectional=bidir, proj_size=proj, batch_first=batch_first)
    outs, grads = _run_functional("triton", dtype, inputs, params, lengths=lengths, **kw)
    outs64, grads64 = _run_functional("reference", F64, inputs, params, lengths=lengths, **kw)
    outs_lp, grads_lp = _run_functional("reference", dtype, inputs, params, lengths=lengths, **kw)
    for name, a, b, c in zip(("output", "h_n", "c_n"), outs, outs64, outs_lp):
        assert a.dtype == dtype
        assert_fa_close(f"lstm [triton, {dtype}] {name}", a, b, c, floor=_tiny_floor(b, dtype))
    names = ["input", "h0", "c0"] + [f"weights[{i}]" for i in range(len(params))]
    for name, a, b, c in zip(names, grads, grads64, grads_lp):
        assert_grad_close(
            f"lstm [triton, {dtype}] grad {name}", a, b, c, floor=_tiny_floor(b, dtype)
        )
    if lengths is not None:
        out = outs[0] if not batch_first else outs[0].transpose(0, 1)
        for row, n in enumerate(lengths.tolist()):
            if n < T:
                assert out[n:, row].abs().max() == 0, f"row {row}: output past its end"


@pytest.mark.parametrize(
    "dtype", (torch.float32, torch.float16, torch.bfloat16), ids=("fp32", "fp16", "bf16")
)
@pytest.mark.parametrize("T,B,I,H,layers,bidir,proj,lengths,batch_first", TRITON_CASES)
def test_triton_small_fa_rule(dtype, T, B, I, H, layers, bidir, proj, lengths, batch_first):
    """fastattn.lstm on the triton backend (the kernels ran: last_backend) against the float64
    reference under FlashAttention's rule, every output and gradient; the output is exactly 0
    past each sequence's end."""
    _triton_fa_rule(dtype, T, B, I, H, layers, bidir, proj, lengths, batch_first)


def test_triton_several_tiles(monkeypatch):
    """Tiles of 16 under the interpreter: several tiles along the batch, hidden, projected and
    reduction dimensions (B = 33, H = 37, P = 20, 4H = 148), lengths, both directions."""
    from fastattn.triton import recurrent as triton_lstm

    lstm_device("triton")
    monkeypatch.setattr(triton_lstm, "INTERPRETER_MAX_BLOCK", 16)
    _triton_fa_rule(
        torch.float32,
        3,
        33,
        5,
        37,
        1,
        True,
        20,
        [int(v) for v in torch.randint(0, 4, (33,), generator=torch.Generator().manual_seed(0))],
        False,
    )


def test_triton_dropout_mask_matches_cpu():
    """Input dropout of the layer op: the triton kernels drop exactly the elements the CPU
    kernels (and the reference generator) drop, and compute the same values."""
    device = lstm_device("triton")
    lstm_device("cpu")
    g = torch.Generator().manual_seed(3)
    T, B, I, H, D, P = 5, 3, 5, 7, 2, 4
    args = [
        torch.randn(T, B, I, generator=g),
        torch.randn(D, B, P, generator=g),
        torch.randn(D, B, H, generator=g),
        torch.randn(D, 4 * H, I, generator=g) * 0.5,
        torch.randn(D, 4 * H, P, generator=g) * 0.5,
        torch.randn(D, 4 * H, generator=g),
        torch.randn(D, 4 * H, generator=g),
        torch.randn(D, P, H, generator=g) * 0.5,
        torch.tensor([5, 2, 4]),
    ]
    seed, p = torch.tensor([1234, 7]), 0.4
    results = {}
    for suffix, dev in (("_triton", device), ("", torch.device("cpu"))):
        leaves = [a.to(dev).requires_grad_(a.is_floating_point()) for a in args]
        out, h_n, c_n, _ = getattr(torch.ops.fastattn, "lstm_layer" + suffix)(
            *leaves, p, seed.to(dev), True
        )
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dev)
        grads = torch.autograd.grad((out * w).sum() + c_n.sum(), leaves[:8])
        results[suffix] = tuple(t.cpu() for t in (out, h_n, c_n) + grads)
    keep = fastattn.reference.random.dropout_keep_mask(seed, (T, B, I), p)
    # grad_input vanishes exactly where the input was dropped (and past each row's end)
    for suffix in ("_triton", ""):
        alive = torch.arange(T)[:, None] < args[8][None, :]
        assert torch.equal(results[suffix][3] != 0, keep & alive[:, :, None])
    for i, (a, b) in enumerate(zip(results["_triton"], results[""])):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6, msg=lambda m: f"{i}: {m}")


def test_triton_dropout_between_layers_matches_cpu():
    """fastattn.nn.LSTM in training with inter-layer dropout: the same mask (same seeds from
    torch's generator) and values on triton as on cpu."""
    runs = {}
    for backend in ("triton", "cpu"):
        device = lstm_device(backend)
        _, module = make_pair(
            4, 5, device=device, dtype=torch.float32, num_layers=2, dropout=0.5, seed=2
        )
        module.train()
        x = torch.randn(4, 2, 4, generator=torch.Generator().manual_seed(4)).to(device)
        x.requires_grad_()
        torch.manual_seed(21)  # seeds the dropout stream on either device
        with fastattn.use_backend(backend):
            out, (h_n, c_n) = module(x)
        assert fastattn.last_backend("lstm") == backend
        runs[backend] = tuple(
            t.cpu()
            for t in (out, h_n)
            + torch.autograd.grad(out.sum() + c_n.sum(), [x] + list(module.parameters()))
        )
    for i, (a, b) in enumerate(zip(runs["triton"], runs["cpu"])):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6, msg=lambda m: f"{i}: {m}")


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16), ids=("fp32", "fp16"))
@pytest.mark.parametrize(
    "bias,batched",
    [(True, True), (False, True), (True, False)],
    ids=("bias", "nobias", "unbatched"),
)
def test_triton_cell_small(dtype, bias, batched):
    """fastattn.lstm_cell on triton (B = 3, I = 5, H = 7) under FlashAttention's rule."""
    device = lstm_device("triton", dtype)
    g = torch.Generator().manual_seed(9)
    lead = (3,) if batched else ()
    shapes = [lead + (5,), lead + (7,), lead + (7,), (28, 5), (28, 7)] + (
        [(28,), (28,)] if bias else []
    )
    tensors = [
        torch.randn(*s, generator=g, dtype=F64).to(dtype).to(device=device, dtype=F64)
        for s in shapes
    ]
    runs = {}
    for label, be, dt in (
        ("out", "triton", dtype),
        ("ref64", "reference", F64),
        ("ref_lowp", "reference", dtype),
    ):
        leaves = [t.to(dt).requires_grad_() for t in tensors]
        hy, cy = fastattn.lstm_cell(*leaves, *([] if bias else [None, None]), backend=be)
        assert fastattn.last_backend("lstm_cell") == be
        wave = torch.cos(torch.arange(hy.numel(), dtype=F64, device=device)).view_as(hy)
        loss = (hy.double() * wave).sum() + (cy.double() * 0.5).sum()
        runs[label] = ((hy.detach(), cy.detach()), torch.autograd.grad(loss, leaves))
    for i, name in enumerate(("hy", "cy")):
        assert_fa_close(
            f"lstm_cell [triton] {name}",
            runs["out"][0][i],
            runs["ref64"][0][i],
            runs["ref_lowp"][0][i],
        )
    for i in range(len(tensors)):
        assert_grad_close(
            f"lstm_cell [triton] grad {i}",
            runs["out"][1][i],
            runs["ref64"][1][i],
            runs["ref_lowp"][1][i],
        )


def _triton_opcheck_cases(device):
    f32 = torch.float32
    cases = {
        "layer-bidir-proj-lengths": ("lstm_layer", _layer_args(dtype=f32) + [0.0, None, True]),
        "layer-dropout-nobias": (
            "lstm_layer",
            _layer_args(bias=False, dtype=f32) + [0.2, torch.tensor([1, 2]), True],
        ),
        "layer-inference-bf16": (
            "lstm_layer",
            [
                a.detach().to(torch.bfloat16) if a is not None and a.is_floating_point() else a
                for a in _layer_args(grad=False)
            ]
            + [0.0, None, False],
        ),
        "cell": (
            "lstm_cell",
            [
                torch.randn(3, 4, requires_grad=True),
                torch.randn(3, 5, requires_grad=True),
                torch.randn(3, 5, requires_grad=True),
                torch.randn(20, 4, requires_grad=True),
                torch.randn(20, 5, requires_grad=True),
                torch.randn(20, requires_grad=True),
                torch.randn(20, requires_grad=True),
            ],
        ),
    }
    cases = {
        k: (name, [a.to(device) if isinstance(a, torch.Tensor) else a for a in args])
        for k, (name, args) in cases.items()
    }
    # The backward ops take the workspace that the forward ops saved on this device.
    args = [a.to(device) if a is not None else None for a in _layer_args(grad=False, dtype=f32)]
    _, _, _, ws = torch.ops.fastattn.lstm_layer_triton(*args, 0.0, None, True)
    T, B, _ = args[0].shape
    cases["layer_backward"] = (
        "lstm_layer_backward",
        [
            torch.randn(T, B, 6, device=device),
            None,
            torch.randn(2, B, 4, device=device),
            *args[:5],
            args[7],
            args[8],
            ws,
            0.0,
            None,
            True,
            True,
            True,
        ],
    )
    cell = [torch.randn(*s, device=device) for s in ((3, 4), (3, 5), (3, 5), (20, 4), (20, 5))]
    _, _, cws = torch.ops.fastattn.lstm_cell_triton(*cell, None, None)
    cases["cell_backward"] = (
        "lstm_cell_backward",
        [torch.randn(3, 5, device=device), None, *cell, cws, False],
    )
    return cases


@pytest.mark.parametrize(
    "case",
    [
        "layer-bidir-proj-lengths",
        "layer-dropout-nobias",
        "layer-inference-bf16",
        "cell",
        "layer_backward",
        "cell_backward",
    ],
)
def test_triton_opcheck(case):
    device = lstm_device("triton")
    name, args = _triton_opcheck_cases(device)[case]
    torch.library.opcheck(getattr(torch.ops.fastattn, name + "_triton"), args)


def test_triton_limits_and_errors(monkeypatch):
    """float64 is refused with a reason (explicit requests raise, the automatic choice on CPU
    stays cpu); the ops reject bad arguments clearly."""
    device = lstm_device("triton")
    if device.type != "cpu":  # eager range errors for CUDA tensors: host checks (opt-in)
        monkeypatch.setenv("FASTATTN_HOST_CHECKS", "1")
    assert "float64" in unsupported_backends(F64)["triton"]
    assert "triton" not in unsupported_backends(torch.bfloat16)
    module = fastattn.nn.LSTM(3, 4).to(device=device, dtype=F64)
    with pytest.raises(fastattn.BackendError, match="float64"):
        with fastattn.use_backend("triton"):
            module(torch.randn(5, 2, 3, dtype=F64, device=device))
    ops = torch.ops.fastattn
    x, h, c = (
        torch.randn(5, 2, 3, device=device),
        torch.zeros(1, 2, 4, device=device),
        torch.zeros(1, 2, 4, device=device),
    )
    w_ih, w_hh = torch.randn(1, 16, 3, device=device), torch.randn(1, 16, 4, device=device)
    with pytest.raises(TypeError, match="triton backend takes float32, float16 or bfloat16"):
        ops.lstm_layer_triton(
            x.double(),
            h.double(),
            c.double(),
            w_ih.double(),
            w_hh.double(),
            None,
            None,
            None,
            None,
            0.0,
            None,
            False,
        )
    with pytest.raises(ValueError, match="lengths must be in \\[0, T\\] = \\[0, 5\\]"):
        ops.lstm_layer_triton(
            x,
            h,
            c,
            w_ih,
            w_hh,
            None,
            None,
            None,
            torch.tensor([6, 1], device=device),
            0.0,
            None,
            False,
        )
    with pytest.raises(ValueError, match="w_ih must have shape"):
        ops.lstm_layer_triton(
            x, h, c, w_ih[:, :, :2], w_hh, None, None, None, None, 0.0, None, False
        )
    with pytest.raises(ValueError, match="dropout_p > 0 needs seed"):
        ops.lstm_layer_triton(x, h, c, w_ih, w_hh, None, None, None, None, 0.5, None, False)
    with pytest.raises(ValueError, match="workspace must be the contiguous float32"):
        ops.lstm_layer_backward_triton(
            torch.randn(5, 2, 4, device=device),
            None,
            None,
            x,
            h,
            c,
            w_ih,
            w_hh,
            None,
            None,
            torch.zeros(0, device=device),
            0.0,
            None,
            False,
            True,
            True,
        )


@pytest.mark.parametrize("T,B", [(0, 3), (4, 0)])
def test_triton_empty_sizes(T, B):
    """T = 0 (h_n = h0) and B = 0: the same results and gradients as the CPU kernels."""
    device = lstm_device("triton")
    lstm_device("cpu")
    g = torch.Generator().manual_seed(0)
    D, I, H, P = 2, 3, 5, 2
    args = [
        torch.randn(T, B, I, generator=g),
        torch.randn(D, B, P, generator=g),
        torch.randn(D, B, H, generator=g),
        torch.randn(D, 4 * H, I, generator=g),
        torch.randn(D, 4 * H, P, generator=g),
        torch.randn(D, 4 * H, generator=g),
        torch.randn(D, 4 * H, generator=g),
        torch.randn(D, P, H, generator=g),
        None,
    ]
    results = {}
    for suffix, dev in (("_triton", device), ("", torch.device("cpu"))):
        leaves = [a.to(dev).requires_grad_() if a is not None else None for a in args]
        out, h_n, c_n, _ = getattr(torch.ops.fastattn, "lstm_layer" + suffix)(
            *leaves, 0.0, None, True
        )
        grads = torch.autograd.grad(out.sum() + h_n.sum() + c_n.sum(), leaves[:8])
        results[suffix] = tuple(t.cpu() for t in (out, h_n, c_n) + grads)
    for a, b in zip(results["_triton"], results[""]):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("_slow", [pytest.param(None, marks=slow)])
def test_triton_compile_fullgraph(_slow):
    """fastattn.lstm (2 layers, bidirectional, projected, lengths) and fastattn.lstm_cell on
    triton under torch.compile(fullgraph=True): the same outputs and gradients as eager
    (triton_ops on a GPU, opaque custom ops under the interpreter; ~15 s there)."""
    device = lstm_device("triton")
    torch._dynamo.reset()
    torch.manual_seed(0)
    module = fastattn.nn.LSTM(4, 6, num_layers=2, bidirectional=True, proj_size=3).to(device)
    cell = fastattn.nn.LSTMCell(6, 5).to(device)
    weights = module._weights()

    def f(x, lengths):
        y, (h, c) = fastattn.lstm(
            x,
            None,
            weights,
            num_layers=2,
            bidirectional=True,
            proj_size=3,
            lengths=lengths,
            backend="triton",
        )
        state = torch.zeros(2, 5, device=device)
        hy, _ = fastattn.lstm_cell(
            y[-1],
            state,
            state,
            cell.weight_ih,
            cell.weight_hh,
            cell.bias_ih,
            cell.bias_hh,
            backend="triton",
        )
        return (y * y).sum() + h.sum() + c.sum() + hy.sum()

    x = torch.randn(5, 2, 4, device=device, requires_grad=True)
    lengths = torch.tensor([5, 3], device=device)
    params = [x] + weights + list(cell.parameters())
    compiled = torch.compile(f, fullgraph=True)(x, lengths)
    assert fastattn.last_backend("lstm") == "triton"
    eager = f(x, lengths)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    for a, b in zip(torch.autograd.grad(compiled, params), torch.autograd.grad(eager, params)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("_slow", [pytest.param(None, marks=slow)])
def test_triton_kernels_compile_for_sm90(_slow):
    """Every Triton LSTM kernel compiles to a cubin for sm_90 without a GPU
    (tests/triton_lstm_aot.py; about a minute on two cores)."""
    pytest.importorskip("triton")
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "triton_lstm_aot.py")],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]


# ---------------------------------------------------------------------------------------------
# 9. CUDA backend specifics (skip without a GPU): recurrent path choice (a documented query,
#    fastattn.ops.lstm.cuda_recurrent_path), persistent vs per-step agreement, the dropout mask
#    bit-identical to the CPU kernels, lstm_cell's fused and GEMM paths, streams.


def _cuda_or_skip(dtype=F64):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return lstm_device("cuda", dtype)


def _cuda_layer_args(T, B, I, H, D, *, proj=0, lengths=None, dtype=F64, device="cuda", seed=0):
    g = torch.Generator().manual_seed(seed)
    P = proj or H

    def r(*s):
        return (torch.randn(*s, generator=g, dtype=F64) * 0.5).to(device=device, dtype=dtype)

    args = [
        r(T, B, I),
        r(D, B, P),
        r(D, B, H),
        r(D, 4 * H, I),
        r(D, 4 * H, P),
        r(D, 4 * H),
        r(D, 4 * H),
        r(D, P, H) if proj else None,
    ]
    lens = None if lengths is None else torch.tensor(lengths, dtype=torch.int64, device=device)
    return args, lens


def _layer_fwd_bwd(args, lens, p=0.0, seed=None):
    """lstm_layer + lstm_layer_backward with fixed incoming gradients: 3 outputs, 7 grads."""
    out, h_n, c_n, ws = torch.ops.fastattn.lstm_layer(*args, lens, p, seed, True)
    g = torch.Generator().manual_seed(7)
    gouts = [torch.randn(t.shape, generator=g, dtype=F64).to(t) for t in (out, h_n, c_n)]
    grads = torch.ops.fastattn.lstm_layer_backward(
        *gouts, *args[:5], args[7], lens, ws, p, seed, True, True, True
    )
    return [out, h_n, c_n], list(grads)


@pytest.mark.parametrize(
    "T,B,H,D,proj,expected",
    [
        (5, 4, 32, 1, 0, "persistent"),
        (5, 64, 512, 2, 0, "persistent"),  # U = 4: 256 blocks, 3 per SM co-resident
        (5, 33, 37, 2, 0, "persistent"),
        (5, 64, 2048, 1, 0, "per_step"),  # the W_hh slice no longer fits shared memory
        (5, 4096, 64, 1, 0, "per_step"),  # B * 4U > 4096 even for U = 1
        (5, 8, 64, 2, 16, "per_step"),  # projection: per step
    ],
)
def test_cuda_recurrent_path_query(T, B, H, D, proj, expected, monkeypatch):
    _cuda_or_skip()
    from fastattn.ops.lstm import cuda_recurrent_path

    x = torch.empty(T, B, 8, device="cuda")
    w_hh = torch.empty(D, 4 * H, proj or H, device="cuda")
    w_hr = torch.empty(D, proj, H, device="cuda") if proj else None
    assert cuda_recurrent_path(x, w_hh, w_hr) == expected
    assert cuda_recurrent_path(x, w_hh, w_hr, backward=True) == expected
    if expected == "persistent":
        # 2-D weights (one direction) are accepted too, and the override forces the fallback
        assert cuda_recurrent_path(x, w_hh[0]) == "persistent"
        monkeypatch.setenv("FASTATTN_LSTM_CUDA_PATH", "per_step")
        assert cuda_recurrent_path(x, w_hh, w_hr) == "per_step"
        assert cuda_recurrent_path(x, w_hh, w_hr, backward=True) == "per_step"


@pytest.mark.parametrize("dtype", (F64, torch.float32, torch.bfloat16), ids=("f64", "f32", "bf16"))
@pytest.mark.parametrize(
    "D,lengths,p",
    [
        (1, None, 0.0),
        (2, None, 0.0),
        (2, [9, 0, 4, 1, 9], 0.0),
        (2, [3, 9, 9, 7, 2], 0.3),
    ],
)
def test_cuda_persistent_matches_per_step(dtype, D, lengths, p, monkeypatch):
    """Both recurrent paths (forward and backward) of the same call agree (float64: to
    rounding; lower precision: to a few units of the storage precision, as the summation orders
    differ)."""
    _cuda_or_skip(dtype)
    from fastattn.ops.lstm import cuda_recurrent_path

    args, lens = _cuda_layer_args(9, 5, 6, 40, D, lengths=lengths, dtype=dtype)
    seed = torch.tensor([5, 6], dtype=torch.int64, device="cuda") if p else None
    assert cuda_recurrent_path(args[0], args[4]) == "persistent"
    assert cuda_recurrent_path(args[0], args[4], backward=True) == "persistent"
    outs_p, grads_p = _layer_fwd_bwd(args, lens, p, seed)
    monkeypatch.setenv("FASTATTN_LSTM_CUDA_PATH", "per_step")
    assert cuda_recurrent_path(args[0], args[4]) == "per_step"
    assert cuda_recurrent_path(args[0], args[4], backward=True) == "per_step"
    outs_s, grads_s = _layer_fwd_bwd(args, lens, p, seed)
    tol = {F64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 3e-2}[dtype]
    for name, a, b in zip(
        ["output", "h_n", "c_n"] + [f"grad{i}" for i in range(7)],
        outs_p + grads_p,
        outs_s + grads_s,
    ):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("path", ("persistent", "per_step"))
@pytest.mark.parametrize("proj", (0, 5))
def test_cuda_layer_matches_cpu_kernels_float64(path, proj, monkeypatch):
    """The CUDA ops against the CPU ops on the same float64 arguments: every output and
    gradient, lengths in any order (0 and T included), both directions, dropout on the input
    (the same Philox elements dropped: results agree to rounding)."""
    _cuda_or_skip()
    if path == "per_step":
        monkeypatch.setenv("FASTATTN_LSTM_CUDA_PATH", "per_step")
    lengths = [7, 0, 3, 7, 1, 5]
    args, lens = _cuda_layer_args(7, 6, 4, 12, 2, proj=proj, lengths=lengths)
    seed = torch.tensor([123, 4], dtype=torch.int64)
    outs_g, grads_g = _layer_fwd_bwd(args, lens, 0.4, seed.cuda())
    cpu_args = [t.cpu() if t is not None else None for t in args]
    outs_c, grads_c = _layer_fwd_bwd(cpu_args, lens.cpu(), 0.4, seed)
    for name, a, b in zip(
        ["output", "h_n", "c_n"] + [f"grad{i}" for i in range(7)],
        outs_g + grads_g,
        outs_c + grads_c,
    ):
        close64(name, a.cpu(), b)


def test_cuda_large_hidden_per_step_matches_cpu():
    """B=64, H=1100: past the persistent kernel's limits (the W_hh slice of a co-resident grid
    does not fit shared memory), so the fallback runs, says so, and matches the CPU kernels."""
    _cuda_or_skip(torch.float32)
    from fastattn.ops.lstm import cuda_recurrent_path

    args, lens = _cuda_layer_args(3, 64, 16, 1100, 1, dtype=torch.float32)
    assert cuda_recurrent_path(args[0], args[4]) == "per_step"
    assert cuda_recurrent_path(args[0], args[4], backward=True) == "per_step"
    outs_g, grads_g = _layer_fwd_bwd(args, lens)
    cpu_args = [t.cpu() if t is not None else None for t in args]
    outs_c, grads_c = _layer_fwd_bwd(cpu_args, None)
    for name, a, b in zip(
        ["output", "h_n", "c_n"] + [f"grad{i}" for i in range(7)],
        outs_g + grads_g,
        outs_c + grads_c,
    ):
        scale = float(b.abs().max()) if b.numel() else 1.0
        torch.testing.assert_close(
            a.cpu(), b, rtol=1e-3, atol=1e-3 * max(scale, 1.0), msg=lambda m: f"{name}: {m}"
        )


@pytest.mark.parametrize("B", (1, 8, 9, 64))  # <= 8: one fused kernel; above: GEMM + cell
@pytest.mark.parametrize("bias", (True, False))
def test_cuda_cell_paths_match_cpu(B, bias):
    _cuda_or_skip()
    g = torch.Generator().manual_seed(B)
    I, H = 19, 33
    args = [
        torch.randn(*s, generator=g, dtype=F64)
        for s in ((B, I), (B, H), (B, H), (4 * H, I), (4 * H, H))
    ]
    args += [torch.randn(4 * H, generator=g, dtype=F64) for _ in range(2)] if bias else [None] * 2
    results = []
    for device in ("cuda", "cpu"):
        a = [t.to(device) if t is not None else None for t in args]
        hy, cy, ws = torch.ops.fastattn.lstm_cell(*a)
        ghy, gcy = (
            torch.ones_like(hy) * 0.3,
            torch.linspace(-1, 1, B * H, dtype=F64, device=device).view(B, H),
        )
        grads = torch.ops.fastattn.lstm_cell_backward(ghy, gcy, *a[:5], ws, bias)
        results.append([hy, cy, ws] + list(grads))
    for i, (a, b) in enumerate(zip(*results)):
        close64(f"cell output {i}", a.cpu(), b)


def test_cuda_side_stream_and_second_device():
    """Kernels run on the caller's current stream (and device, when there are two)."""
    _cuda_or_skip()
    args, lens = _cuda_layer_args(6, 3, 5, 16, 2, lengths=[6, 2, 4])
    expected, _ = _layer_fwd_bwd(args, lens)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        got, _ = _layer_fwd_bwd(args, lens)
    torch.cuda.current_stream().wait_stream(stream)
    for a, b in zip(got, expected):
        close64("side stream", a, b)
    if torch.cuda.device_count() > 1:
        args1 = [t.to("cuda:1") if t is not None else None for t in args]
        got1, _ = _layer_fwd_bwd(args1, lens.to("cuda:1"))
        for a, b in zip(got1, expected):
            assert a.device == torch.device("cuda:1")
            close64("second device", a.cpu(), b.cpu())


def test_cuda_recurrent_path_without_cuda_kernel():
    """The query refuses (instead of guessing) when the build has no CUDA LSTM kernel."""
    from fastattn.ops.lstm import cuda_recurrent_path

    if "cuda" not in unsupported_backends(torch.float32):
        pytest.skip("this build has the CUDA LSTM kernels")
    with pytest.raises(RuntimeError, match="cuda_recurrent_path"):
        cuda_recurrent_path(torch.empty(2, 2, 2), torch.empty(1, 8, 2))


# ---------------------------------------------------------------------------------------------
# torch's contract: zero-length sequences, autocast


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("shape", [(0, 2, 3), (2, 0, 3), (0, 3)])
def test_zero_length_sequence_like_torch(batch_first, shape):
    outcomes = []
    for cls in (torch.nn.LSTM, fastattn.nn.LSTM):
        module = cls(3, 4, batch_first=batch_first)
        try:
            outcomes.append(("ok", tuple(module(torch.randn(*shape))[0].shape)))
        except RuntimeError as exc:
            outcomes.append(("RuntimeError", str(exc)))
    assert outcomes[1] == outcomes[0]


def _autocast_dtypes(module, device, packed):
    """(dtypes, float32 copies) of (out, h, c) of `module` under autocast. torch's own nn.LSTM
    runs in bfloat16 under CPU autocast through oneDNN, which has no bfloat16 LSTM on CPUs
    without AVX512-BF16 ("could not create a primitive descriptor", e.g. an AVX2 Zen 3): there
    torch's answer is taken as its policy's dtypes (bfloat16 for each output, as where oneDNN
    runs it) and its float32 values, within the test's bfloat16 tolerance."""
    x = torch.randn(5, 2, 8, device=device)
    try:
        return _autocast_run(module, x, packed)
    except RuntimeError as exc:
        if "primitive descriptor" not in str(exc) or isinstance(module, fastattn.nn.LSTM):
            raise
        dtypes, values = _autocast_run(module, x, packed, enabled=False)
        return [torch.bfloat16] * len(dtypes), values


def _autocast_run(module, x, packed, enabled=True):
    from torch.nn.utils.rnn import pack_padded_sequence

    device = x.device
    with torch.autocast(
        device.type,
        dtype=torch.bfloat16 if device.type == "cpu" else torch.float16,
        enabled=enabled,
    ):
        if packed:
            out, (h, c) = module(pack_padded_sequence(x, torch.tensor([5, 3])))
            out = out.data
        elif isinstance(module, torch.nn.LSTMCell):
            out = c = None
            h, c = module(x[0])
        else:
            out, (h, c) = module(x)
    return [t.dtype for t in (out, h, c) if t is not None], [
        t.float() for t in (out, h, c) if t is not None
    ]


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
@pytest.mark.parametrize("kind", ["lstm", "lstm-packed", "cell"])
def test_autocast_dtypes_like_torch(device_type, kind):
    """Under torch.autocast the drop-ins return torch's dtypes (nn.LSTM runs in bfloat16 under
    CPU autocast, its packed form and nn.LSTMCell do not; on CUDA all three run in float16)."""
    if device_type == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    device = torch.device(device_type)
    torch.manual_seed(0)
    if kind == "cell":
        theirs, ours = torch.nn.LSTMCell(8, 4), fastattn.nn.LSTMCell(8, 4)
    else:
        theirs = torch.nn.LSTM(8, 4, num_layers=2, bidirectional=True)
        ours = fastattn.nn.LSTM(8, 4, num_layers=2, bidirectional=True)
    ours.load_state_dict(theirs.state_dict())
    theirs, ours = theirs.to(device), ours.to(device)
    torch.manual_seed(1)
    want_dtypes, want = _autocast_dtypes(theirs, device, kind == "lstm-packed")
    torch.manual_seed(1)
    got_dtypes, got = _autocast_dtypes(ours, device, kind == "lstm-packed")
    assert got_dtypes == want_dtypes
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-2, rtol=2e-2)


def test_triton_layer_backward_without_bias_or_projection():
    """Regression (found by tests/test_fuzz.py): the Triton layer backward returned one empty
    tensor for every absent gradient (bias, projection), outputs that alias each other, which
    torch refuses for a custom op."""
    device = backend_device("triton")
    torch.manual_seed(0)
    module = torch.nn.LSTM(3, 4, bias=False).to(device)
    x = torch.randn(5, 2, 3, device=device, requires_grad=True)
    weights = [w.detach().requires_grad_() for w in module._flat_weights]
    out, (h_n, c_n) = fastattn.lstm(x, None, weights, num_layers=1, backend="triton")
    grads = torch.autograd.grad(out.sum() + h_n.sum() + c_n.sum(), [x, *weights])
    ref_w = [w.detach().requires_grad_() for w in module._flat_weights]
    ref_x = x.detach().requires_grad_()
    ref = fastattn.lstm(ref_x, None, ref_w, num_layers=1, backend="reference")
    want = torch.autograd.grad(ref[0].sum() + ref[1][0].sum() + ref[1][1].sum(), [ref_x, *ref_w])
    for g, w in zip(grads, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)
