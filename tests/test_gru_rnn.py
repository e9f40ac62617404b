"""Tests of the GRU and Elman RNN ops (fastattn/ops/gru.py, rnn.py, _recurrent.py) and their
modules (fastattn/nn/gru.py, rnn.py), on the LSTM tests' grid and helpers (tests/test_lstm.py).

Cells ("kinds"): gru (reset_after=True, torch's form), gru-textbook (reset_after=False, Cho et
al.; torch has no module for it: compared with an independent float64 loop written below),
rnn-tanh and rnn-relu.
1. Every backend against torch.nn.GRU / GRUCell / RNN / RNNCell in float64: outputs, h_n and
   every input and parameter gradient, over the LSTM tests' configurations (layers,
   bidirectional, batch_first, bias, odd sizes), unbatched input, PackedSequence, lengths.
2. float32 / float16 / bfloat16 under FlashAttention's rule (tests/tolerance.py).
3. Dropout: reproducible, the same Philox mask on every backend.
4. gradcheck and opcheck of the layer ops, torch.compile(fullgraph=True).
5. Errors (torch's own for the modules; clear ones naming the argument for the functions),
   backend refusals, state_dict both ways, swap/restore on a model with all seven recurrent
   module types.
6. The large grid (slow).
7. The triton backend (which refuses float64, so the float64 tests skip it): small cases under
   FlashAttention's rule against the reference in every dtype, several tiles, the dropout mask
   and values equal to the cpu backend's, cells, unbatched input, opcheck, compile, and the
   automatic choice on CUDA tensors (triton first).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from conftest import backend_device, require_kernel
from test_lstm import CONFIGS, REPO, close64, grads_of, slow
from tolerance import assert_fa_close, assert_grad_close, float32_floor, rounding_floor
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

import fastattn
from fastattn.ops import _recurrent

F64 = torch.float64
KINDS = ("gru", "gru-textbook", "rnn-tanh", "rnn-relu")
BACKENDS = ("cpu", "cuda", "triton", "reference")


def family(kind: str) -> str:
    return "gru" if kind.startswith("gru") else "rnn"


def variant_kw(kind: str) -> dict:
    """The keyword that selects the cell variant of fastattn.gru / fastattn.rnn."""
    return {
        "gru": dict(reset_after=True),
        "gru-textbook": dict(reset_after=False),
        "rnn-tanh": dict(nonlinearity="tanh"),
        "rnn-relu": dict(nonlinearity="relu"),
    }[kind]


def kind_device(backend: str, kind: str, dtype: torch.dtype = torch.float32) -> torch.device:
    """The device `backend`'s tests use; skips when it has no kernel for the family here
    (fails when the build claims one but lost it: require_kernel)."""
    require_kernel(f"{family(kind)}_layer", backend)
    device = backend_device(backend)
    reason = _recurrent.unsupported_backends(family(kind), dtype).get(backend)
    if reason is not None:
        pytest.skip(f"backend {backend}: {reason}")
    return device


def make_pair(kind, I, H, *, device, dtype=F64, seed=0, **kw):
    """(torch module or None for the textbook GRU, fastattn module) with the same parameters."""
    torch.manual_seed(seed)
    if family(kind) == "gru":
        ours = fastattn.nn.GRU(I, H, reset_after=kind == "gru", **kw)
        theirs = torch.nn.GRU(I, H, **kw) if kind == "gru" else None
    else:
        nl = kind.split("-")[1]
        ours = fastattn.nn.RNN(I, H, nonlinearity=nl, **kw)
        theirs = torch.nn.RNN(I, H, nonlinearity=nl, **kw)
    ours = ours.to(device=device, dtype=dtype)
    if theirs is not None:
        theirs = theirs.to(device=device, dtype=dtype)
        ours.load_state_dict(theirs.state_dict())
    return theirs, ours


# An independent float64 definition of the textbook GRU (Cho et al. 2014, in torch's gate
# order and h' = (1 - z) n + z h), written as textbooks write it, with the concatenated
# [x; h] input and one weight matrix per gate, rather than with the reference's code.
def _textbook_step(x, h, w_ih, w_hh, b_ih, b_hh):
    H = h.shape[-1]
    W = torch.cat([w_ih, w_hh], dim=1)  # (3H, I + H)
    b = (b_ih + b_hh) if b_ih is not None else torch.zeros(3 * H, dtype=x.dtype)
    xh = torch.cat([x, h], dim=-1)
    r = torch.sigmoid(xh @ W[:H].T + b[:H])
    z = torch.sigmoid(xh @ W[H : 2 * H].T + b[H : 2 * H])
    n = torch.tanh(torch.cat([x, r * h], dim=-1) @ W[2 * H :].T + b[2 * H :])
    return (1 - z) * n + z * h


class TextbookGRU(torch.nn.Module):
    """nn.GRU's parameters, run by the per-step loop above (float64, no lengths)."""

    def __init__(self, ours):
        super().__init__()
        self.m = ours

    def forward(self, x, h0=None):
        m = self.m
        D = 2 if m.bidirectional else 1
        batched = x.dim() == 3
        if not batched:
            x = x.unsqueeze(1 if not m.batch_first else 0)
            h0 = None if h0 is None else h0.unsqueeze(1)
        if m.batch_first:
            x = x.transpose(0, 1)
        T, B, _ = x.shape
        if h0 is None:
            h0 = x.new_zeros(m.num_layers * D, B, m.hidden_size)
        h_n = []
        for layer in range(m.num_layers):
            outs = []
            for d in range(D):
                sfx = f"_l{layer}" + ("_reverse" if d else "")
                w = [
                    getattr(m, f"{n}{sfx}", None)
                    for n in ("weight_ih", "weight_hh", "bias_ih", "bias_hh")
                ]
                h = h0[layer * D + d]
                seq = [None] * T
                for t in range(T) if d == 0 else range(T - 1, -1, -1):
                    h = _textbook_step(x[t], h, *w)
                    seq[t] = h
                outs.append(torch.stack(seq))
                h_n.append(h)
            x = torch.cat(outs, -1)
        out, h_n = x, torch.stack(h_n)
        if m.batch_first:
            out = out.transpose(0, 1)
        if not batched:
            out, h_n = out.squeeze(1 if not m.batch_first else 0), h_n.squeeze(1)
        return out, h_n


def expected_module(kind, theirs, ours):
    return TextbookGRU(ours) if kind == "gru-textbook" else theirs


def random_weights(*tensors):
    g = torch.Generator().manual_seed(123)
    return [torch.randn(t.shape, generator=g, dtype=F64).to(t) for t in tensors]


def run_and_grad(module, leaves, backend, params, call_args=None):
    """module(*call_args) (default: the leaves (x, h0)) under `backend`; returns (out, h_n,
    grads of leaves + params)."""
    with fastattn.use_backend(backend):
        out, h_n = module(*(leaves if call_args is None else call_args))
    data = out.data if hasattr(out, "batch_sizes") else out
    w = random_weights(data, h_n)
    loss = (data * w[0]).sum() + (h_n * w[1]).sum()
    return out, h_n, grads_of(loss, list(leaves) + params)


# ---------------------------------------------------------------------------------------------
# 1. float64 against torch (and the textbook loop)

NO_PROJ = [c for c in CONFIGS if c.values[6] == 0]


@pytest.mark.parametrize("T,B,I,H,layers,bidir,proj,batch_first,bias", NO_PROJ)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_matches_torch_float64(backend, kind, T, B, I, H, layers, bidir, proj, batch_first, bias):
    device = kind_device(backend, kind, F64)
    theirs, ours = make_pair(
        kind,
        I,
        H,
        device=device,
        num_layers=layers,
        bidirectional=bidir,
        batch_first=batch_first,
        bias=bias,
    )
    D = 2 if bidir else 1
    x = torch.randn((B, T, I) if batch_first else (T, B, I), dtype=F64, device=device)
    h0 = torch.randn(layers * D, B, H, dtype=F64, device=device)
    params = list(ours.parameters())
    ref = expected_module(kind, theirs, ours)
    ref_params = params if theirs is None else list(theirs.parameters())
    results = [
        run_and_grad(m, [t.clone().requires_grad_() for t in (x, h0)], backend, ps)
        for m, ps in ((ref, ref_params), (ours, params))
    ]
    assert fastattn.last_backend(family(kind)) == backend
    close64("output", results[1][0], results[0][0])
    close64("h_n", results[1][1], results[0][1])
    names = ["input", "h0"] + [n for n, _ in ours.named_parameters()]
    for name, a, b in zip(names, results[1][2], results[0][2]):
        close64(f"grad {name}", a, b)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", ("cpu", "reference"))
@pytest.mark.parametrize("batch_first", (False, True))
def test_unbatched_and_default_hx(backend, kind, batch_first):
    device = kind_device(backend, kind, F64)
    theirs, ours = make_pair(
        kind, 6, 5, device=device, num_layers=2, bidirectional=True, batch_first=batch_first
    )
    ref = expected_module(kind, theirs, ours)
    x = torch.randn(7, 6, dtype=F64)
    h = torch.randn(4, 5, dtype=F64)
    with fastattn.use_backend(backend):
        for args in ((x,), (x, h)):
            (o1, h1), (o2, h2) = ref(*args), ours(*args)
            assert o2.shape == o1.shape == (7, 10) and h2.shape == (4, 5)
            close64("output", o2, o1)
            close64("h_n", h2, h1)


@pytest.mark.parametrize("kind", ("gru", "rnn-tanh", "rnn-relu"))
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "bidir,batch_first,layers",
    [
        pytest.param(False, False, 1, id="plain"),
        pytest.param(True, True, 2, id="bidir-batchfirst-2layer"),
    ],
)
def test_packed_sequence_matches_torch(backend, kind, bidir, batch_first, layers):
    device = kind_device(backend, kind, F64)
    theirs, ours = make_pair(
        kind, 5, 8, device=device, num_layers=layers, bidirectional=bidir, batch_first=batch_first
    )
    D, B, T = 2 if bidir else 1, 6, 9
    lengths = torch.tensor([4, 9, 1, 9, 6, 2])
    x = torch.randn((B, T, 5) if batch_first else (T, B, 5), dtype=F64, device=device)
    h0 = torch.randn(layers * D, B, 8, dtype=F64, device=device)
    results = []
    for module in (theirs, ours):
        leaves = [t.clone().requires_grad_() for t in (x, h0)]
        packed = pack_padded_sequence(
            leaves[0], lengths, batch_first=batch_first, enforce_sorted=False
        )
        out, h_n, grads = run_and_grad(
            module, leaves, backend, list(module.parameters()), call_args=(packed, leaves[1])
        )
        assert isinstance(out, torch.nn.utils.rnn.PackedSequence)
        results.append((out, h_n, grads))
    (o1, h1, g1), (o2, h2, g2) = results
    assert torch.equal(o2.batch_sizes, o1.batch_sizes)
    assert torch.equal(o2.sorted_indices, o1.sorted_indices)
    assert torch.equal(o2.unsorted_indices, o1.unsorted_indices)
    close64("packed output", o2.data, o1.data)
    close64("h_n", h2, h1)
    for i, (a, b) in enumerate(zip(g2, g1)):
        close64(f"grad {i}", a, b)
    pad1, len1 = pad_packed_sequence(o1, batch_first=batch_first)
    pad2, len2 = pad_packed_sequence(o2, batch_first=batch_first)
    assert torch.equal(len1, len2)
    close64("padded output", pad2, pad1)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", ("cpu", "cuda", "triton"))
def test_functional_lengths_match_reference(backend, kind):
    """Unsorted lengths with a zero and a full length: outputs 0 past each end, h_n at each
    true end (h0 for length 0), every gradient as the reference loop's."""
    device = kind_device(backend, kind, F64)
    _, ours = make_pair(kind, 4, 7, device=device, num_layers=2, bidirectional=True)
    T, B = 11, 5
    lengths = torch.tensor([3, 11, 0, 7, 11], device=device)
    x = torch.randn(T, B, 4, dtype=F64, device=device)
    h0 = torch.randn(4, B, 7, dtype=F64, device=device)
    weights = ours._weights()
    fn = fastattn.gru if family(kind) == "gru" else fastattn.rnn
    results = {}
    for be in (backend, "reference"):
        leaves = [t.clone().requires_grad_() for t in (x, h0)]
        out, h_n = fn(
            leaves[0],
            leaves[1],
            weights,
            num_layers=2,
            bidirectional=True,
            lengths=lengths,
            backend=be,
            **variant_kw(kind),
        )
        assert fastattn.last_backend(family(kind)) == be
        w = random_weights(out, h_n)
        results[be] = (
            out,
            h_n,
            grads_of((out * w[0]).sum() + (h_n * w[1]).sum(), leaves + weights),
        )
    out = results[backend][0]
    for b in range(B):
        if lengths[b] < T:
            assert out[int(lengths[b]) :, b].abs().max() == 0
    close64("h_n of the zero-length row", results[backend][1][:, 2], h0[:, 2])
    close64("output", results[backend][0], results["reference"][0])
    close64("h_n", results[backend][1], results["reference"][1])
    for i, (a, b) in enumerate(zip(results[backend][2], results["reference"][2])):
        close64(f"grad {i}", a, b)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "B,I,H,bias,batched",
    [
        pytest.param(1, 1, 1, True, True, id="B1-I1-H1"),
        pytest.param(5, 300, 37, True, True, id="B5-I300-H37"),
        pytest.param(33, 7, 37, False, True, id="B33-nobias"),
        pytest.param(1, 9, 16, True, False, id="unbatched"),
    ],
)
def test_cell_matches_torch(backend, kind, B, I, H, bias, batched):
    device = kind_device(backend, kind, F64)
    torch.manual_seed(0)
    if family(kind) == "gru":
        ours = fastattn.nn.GRUCell(I, H, bias=bias, reset_after=kind == "gru")
        theirs = torch.nn.GRUCell(I, H, bias=bias)
    else:
        nl = kind.split("-")[1]
        ours = fastattn.nn.RNNCell(I, H, bias=bias, nonlinearity=nl)
        theirs = torch.nn.RNNCell(I, H, bias=bias, nonlinearity=nl)
    ours, theirs = ours.to(device=device, dtype=F64), theirs.to(device=device, dtype=F64)
    ours.load_state_dict(theirs.state_dict())
    if kind == "gru-textbook":

        def theirs(x, h=None):  # noqa: F811 - the textbook step on the same parameters
            h = torch.zeros(*x.shape[:-1], H, dtype=F64) if h is None else h
            return _textbook_step(x, h, ours.weight_ih, ours.weight_hh, ours.bias_ih, ours.bias_hh)

    shape = (B,) if batched else ()
    x = torch.randn(*shape, I, dtype=F64, device=device)
    h = torch.randn(*shape, H, dtype=F64, device=device)
    results = []
    for module in (theirs, ours):
        leaves = [t.clone().requires_grad_() for t in (x, h)]
        with fastattn.use_backend(backend):
            hy = module(*leaves)
        wh = torch.linspace(-1, 1, hy.numel(), dtype=F64).view_as(hy)
        params = list((module if isinstance(module, torch.nn.Module) else ours).parameters())
        results.append((hy, grads_of((hy * wh).sum(), leaves + params)))
    assert fastattn.last_backend(f"{family(kind)}_cell") == backend
    close64("hy", results[1][0], results[0][0])
    for i, (a, b) in enumerate(zip(results[1][1], results[0][1])):
        close64(f"grad {i}", a, b)
    with fastattn.use_backend(backend):
        close64("default hx", ours(x), theirs(x))


# ---------------------------------------------------------------------------------------------
# 2. Low precision: FlashAttention's rule against the float64 reference


def _run_functional(kind, backend, dtype, inputs, params, *, lengths=None, **kw):
    leaves = [t.detach().to(dtype).requires_grad_() for t in list(inputs) + list(params)]
    x, h0, *weights = leaves
    fn = fastattn.gru if family(kind) == "gru" else fastattn.rnn
    out, h_n = fn(x, h0, weights, lengths=lengths, backend=backend, **variant_kw(kind), **kw)
    assert fastattn.last_backend(family(kind)) == backend
    g = torch.Generator().manual_seed(7)
    loss = sum(
        (t.double() * torch.randn(t.shape, generator=g, dtype=F64).to(t.device)).sum()
        for t in (out, h_n)
    )
    return (out.detach(), h_n.detach()), torch.autograd.grad(loss, leaves)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", ("cpu", "cuda", "triton"))
@pytest.mark.parametrize(
    "dtype", (torch.float32, torch.float16, torch.bfloat16), ids=("fp32", "fp16", "bf16")
)
@pytest.mark.parametrize(
    "case",
    [
        pytest.param(dict(T=37, B=33, I=300, H=37), id="T37-B33-I300-H37"),
        pytest.param(
            dict(T=20, B=9, I=16, H=64, num_layers=2, bidirectional=True, lengths=True),
            id="2layer-bidir-lengths",
        ),
        # bfloat16 on AMX: the per-step product's two 64-row groups (the second partial; with
        # more than 2 threads the grid splits the rows instead), H past 128 (two chunks of 64
        # pair rows) and a last unit block of 22 (a two-tile column tail)
        pytest.param(dict(T=6, B=70, I=40, H=150), id="T6-B70-I40-H150"),
        # ... and up to 8 rows, each row's hi and lo words in consecutive tile rows
        pytest.param(dict(T=5, B=3, I=24, H=40), id="T5-B3-I24-H40"),
        # odd sizes: bfloat16 pair words padded along I and H (AVX512-BF16 products)
        pytest.param(
            dict(T=9, B=11, I=17, H=19, num_layers=2, bidirectional=True, lengths=True),
            id="odd-2layer-bidir-lengths",
        ),
    ],
)
def test_low_precision_fa_rule(backend, kind, dtype, case, run_all_slow):
    device = kind_device(backend, kind, dtype)
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
    layers, bidir = case.get("num_layers", 1), case.get("bidirectional", False)
    _, module = make_pair(kind, I, H, device=device, num_layers=layers, bidirectional=bidir)
    D = 2 if bidir else 1
    torch.manual_seed(1)
    inputs = [
        torch.randn(T, B, I, dtype=F64).to(device),
        torch.randn(layers * D, B, H, dtype=F64).to(device),
    ]
    lengths = torch.randint(1, T + 1, (B,), device=device) if use_lengths else None
    kw = dict(case, num_layers=layers)
    inputs = [t.to(dtype).to(F64) for t in inputs]
    params = [t.detach().to(dtype).to(F64) for t in module._weights()]
    outs, grads = _run_functional(kind, backend, dtype, inputs, params, lengths=lengths, **kw)
    outs64, grads64 = _run_functional(kind, "reference", F64, inputs, params, lengths=lengths, **kw)
    outs_lp, grads_lp = _run_functional(
        kind, "reference", dtype, inputs, params, lengths=lengths, **kw
    )
    # Triton's tanh is within 2 float32 ulps (torch's 1.4), which the gradients through 1 - n^2
    # sum over T * B rows: float32 results get tolerance.py's float32 floor (a few ulps of the
    # magnitude) there.
    floor = (lambda ref: float32_floor(ref, dtype)) if backend == "triton" else (lambda ref: None)
    for name, a, b, c in zip(("output", "h_n"), outs, outs64, outs_lp):
        assert a.dtype == dtype
        assert_fa_close(f"{kind} [{backend}, {dtype}] {name}", a, b, c, floor=floor(b))
    names = ["input", "h0"] + [f"weights[{i}]" for i in range(len(params))]
    for name, a, b, c in zip(names, grads, grads64, grads_lp):
        assert_grad_close(f"{kind} [{backend}, {dtype}] grad {name}", a, b, c, floor=floor(b))


# ---------------------------------------------------------------------------------------------
# 3. Dropout


def _dropout_run(kind, backend, seed, *, training=True, p=0.4):
    _, module = make_pair(
        kind, 6, 9, device="cpu", num_layers=3, bidirectional=True, dropout=p, seed=3
    )
    module.train(training)
    x = torch.randn(8, 4, 6, dtype=F64, generator=torch.Generator().manual_seed(5))
    x.requires_grad_()
    torch.manual_seed(seed)
    with fastattn.use_backend(backend):
        out, h_n = module(x)
    grads = torch.autograd.grad(out.sum() + h_n.sum(), [x] + list(module.parameters()))
    return out, h_n, grads


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_dropout_reproducible_and_same_mask_as_reference(backend, kind):
    kind_device(backend, kind, F64)
    out1, h1, g1 = _dropout_run(kind, backend, seed=11)
    out2, h2, g2 = _dropout_run(kind, backend, seed=11)
    assert torch.equal(out1, out2) and torch.equal(h1, h2)
    for a, b in zip(g1, g2):
        assert torch.equal(a, b)
    out3, _, _ = _dropout_run(kind, backend, seed=12)
    assert not torch.allclose(out1, out3)
    if backend != "reference":  # a kernel against the reference's Philox mask
        ref_out, ref_h, ref_g = _dropout_run(kind, "reference", seed=11)
        close64("output vs reference (same Philox mask)", out1, ref_out)
        close64("h_n vs reference", h1, ref_h)
        for i, (a, b) in enumerate(zip(g1, ref_g)):
            close64(f"grad {i} vs reference", a, b)
    no_drop, _, _ = _dropout_run(kind, backend, seed=11, p=0.0)
    assert not torch.allclose(out1, no_drop)
    eval_out, _, _ = _dropout_run(kind, backend, seed=11, training=False)
    close64("eval mode ignores dropout", eval_out, no_drop)


# ---------------------------------------------------------------------------------------------
# 4. gradcheck, opcheck, compile


def _layer_args(kind, T=4, B=3, I=3, H=4, D=2, lengths=True, bias=True, grad=True, dtype=F64):
    G = 3 if family(kind) == "gru" else 1
    g = torch.Generator().manual_seed(0)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=dtype) * scale).requires_grad_(grad)

    return [
        r(T, B, I),
        r(D, B, H),
        r(D, G * H, I, scale=0.5),
        r(D, G * H, H, scale=0.5),
        r(D, G * H) if bias else None,
        r(D, G * H) if bias else None,
        torch.tensor([2, 4, 1][:B]) if lengths else None,
    ]


def _variant(kind):
    return {"gru": True, "gru-textbook": False, "rnn-tanh": "tanh", "rnn-relu": "relu"}[kind]


def _layer_op(kind, suffix=""):
    return getattr(torch.ops.fastattn, f"{family(kind)}_layer{suffix}")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", ("cpu", "cuda"))
@pytest.mark.parametrize("case", ["plain", "bidir-lengths", "dropout-lengths-nobias"])
def test_layer_gradcheck(backend, kind, case):
    device = kind_device(backend, kind, F64)
    if case == "plain":
        args, p, seed = _layer_args(kind, D=1, lengths=False), 0.0, None
    elif case == "bidir-lengths":
        args, p, seed = _layer_args(kind), 0.0, None
    else:
        args, p, seed = _layer_args(kind, bias=False), 0.3, torch.tensor([5, 6])
    if kind == "rnn-relu":  # keep the pre-activations away from relu's kink
        args[1] = (args[1].detach().abs() + 0.5).requires_grad_()
    args = [a.to(device) if a is not None else None for a in args]
    seed = seed.to(device) if seed is not None else None

    def fn(*tensors):
        out, h_n, _ = _layer_op(kind)(*tensors, p, seed, _variant(kind), True)
        return out, h_n

    assert torch.autograd.gradcheck(fn, tuple(args))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", ("cpu", "cuda"))
def test_cell_gradcheck(backend, kind):
    device = kind_device(backend, kind, F64)
    G = 3 if family(kind) == "gru" else 1
    g = torch.Generator().manual_seed(0)
    shapes = [(3, 4), (3, 5), (G * 5, 4), (G * 5, 5), (G * 5,), (G * 5,)]
    args = [torch.randn(*s, generator=g, dtype=F64).to(device).requires_grad_() for s in shapes]
    fn = fastattn.gru_cell if family(kind) == "gru" else fastattn.rnn_cell
    assert torch.autograd.gradcheck(lambda *a: fn(*a, backend=backend, **variant_kw(kind)), args)


def _opcheck_cases(kind, device):
    name = f"{family(kind)}_layer"
    v = _variant(kind)
    cases = {
        "layer": (name, _layer_args(kind, lengths=False, D=1) + [0.0, None, v, True]),
        "layer-bidir-lengths": (name, _layer_args(kind) + [0.0, None, v, True]),
        "layer-dropout-nobias": (
            name,
            _layer_args(kind, bias=False) + [0.2, torch.tensor([1, 2]), v, True],
        ),
        "layer-fp32": (name, _layer_args(kind, dtype=torch.float32) + [0.0, None, v, True]),
        "layer-inference": (name, _layer_args(kind, grad=False) + [0.0, None, v, False]),
    }
    args = _layer_args(kind, grad=False)
    _, _, ws = _layer_op(kind)(*args, 0.0, None, v, True)
    T, B, _ = args[0].shape
    cases["layer_backward"] = (
        f"{name}_backward",
        [
            torch.randn(T, B, 8, dtype=F64),
            torch.randn(2, B, 4, dtype=F64),
            *args[:4],
            args[6],
            ws,
            0.0,
            None,
            v,
            True,
            True,
            True,
        ],
    )
    return {
        k: (n, [a.to(device) if isinstance(a, torch.Tensor) else a for a in a_])
        for k, (n, a_) in cases.items()
    }


@pytest.mark.parametrize("case", list(_opcheck_cases("gru", "cpu")))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", ("cpu", "cuda"))
def test_opcheck(backend, kind, case):
    device = kind_device(backend, kind)
    name, args = _opcheck_cases(kind, device)[case]
    torch.library.opcheck(getattr(torch.ops.fastattn, name), args)


class _Encoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(30, 12)
        self.gru = fastattn.nn.GRU(12, 16, num_layers=2, bidirectional=True, batch_first=True)
        self.rnn = fastattn.nn.RNN(32, 8, nonlinearity="relu", batch_first=True)
        self.gru_cell = fastattn.nn.GRUCell(8, 10, reset_after=False)
        self.rnn_cell = fastattn.nn.RNNCell(10, 6)
        self.head = torch.nn.Linear(6, 5)

    def forward(self, tokens, lengths):
        h, _ = self.gru(self.embed(tokens))
        y, _ = fastattn.gru(
            self.embed(tokens),
            None,
            self.gru._weights(),
            num_layers=2,
            bidirectional=True,
            batch_first=True,
            lengths=lengths,
        )
        r, _ = self.rnn(h + y)
        return self.head(self.rnn_cell(self.gru_cell(r[:, -1])))


def test_compile_fullgraph():
    assert not torch._dynamo.config.allow_rnn
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Encoder()
    tokens = torch.randint(0, 30, (3, 9))
    lengths = torch.tensor([9, 4, 6])
    out = torch.compile(model, fullgraph=True)(tokens, lengths)
    for op in ("gru", "rnn", "gru_cell", "rnn_cell"):
        assert fastattn.last_backend(op) == "cpu", op
    eager = model(tokens, lengths)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-5)
    params = list(model.parameters())
    for g, e in zip(
        torch.autograd.grad(out.square().sum(), params),
        torch.autograd.grad(eager.square().sum(), params),
    ):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# 5. Backends, errors, state_dict, swapping


@pytest.mark.parametrize("kind", KINDS)
def test_default_backend_and_explicit_refusals(kind):
    _, module = make_pair(kind, 3, 4, device="cpu", dtype=torch.float32)
    x = torch.randn(5, 2, 3)
    module(x)
    assert fastattn.last_backend(family(kind)) == "cpu"
    with fastattn.use_backend("reference"):
        module(x)
    assert fastattn.last_backend(family(kind)) == "reference"
    limits = _recurrent.unsupported_backends(family(kind))
    for backend in ("cuda", "triton"):
        if backend in limits or backend_unusable(backend, x):
            with pytest.raises(fastattn.BackendError, match=family(kind)):
                with fastattn.use_backend(backend):
                    module(x)


def backend_unusable(backend, x):
    return fastattn._backend._can_run_device(backend, x.device) is not None


def _same_error(call_ours, call_theirs):
    with pytest.raises(Exception) as theirs:
        call_theirs()
    with pytest.raises(type(theirs.value)) as ours:
        call_ours()
    assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("kind", ("gru", "rnn-tanh"))
@pytest.mark.parametrize(
    "case",
    [
        "input_size",
        "h0_shape",
        "hx_dims",
        "dtype",
        "input_dims",
        "unsorted_enforce_sorted",
        "proj_size",
        "bad_dropout",
        "hidden_device",
        "nonlinearity",
    ],
)
def test_module_errors_match_torch(kind, case):
    theirs, ours = make_pair(kind, 5, 4, device="cpu", dtype=torch.float32, num_layers=2)
    cls_t, cls_o = type(theirs), type(ours)
    x = torch.randn(6, 3, 5)
    if case == "input_size":
        _same_error(lambda: ours(torch.randn(6, 3, 7)), lambda: theirs(torch.randn(6, 3, 7)))
    elif case == "h0_shape":
        bad = torch.zeros(2, 3, 5)
        _same_error(lambda: ours(x, bad), lambda: theirs(x, bad))
    elif case == "hx_dims":
        bad = torch.zeros(3, 4)
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
    elif case == "proj_size":
        _same_error(lambda: cls_o(5, 4, proj_size=2), lambda: cls_t(5, 4, proj_size=2))
    elif case == "bad_dropout":
        _same_error(lambda: cls_o(5, 4, dropout=1.5), lambda: cls_t(5, 4, dropout=1.5))
    elif case == "hidden_device":
        hm = torch.zeros(2, 3, 4, device="meta")
        _same_error(lambda: ours(x, hm), lambda: theirs(x, hm))
    elif case == "nonlinearity":
        _same_error(
            lambda: fastattn.nn.RNN(5, 4, nonlinearity="gelu"),
            lambda: torch.nn.RNN(5, 4, nonlinearity="gelu"),
        )


@pytest.mark.parametrize("cls", ("GRUCell", "RNNCell"))
@pytest.mark.parametrize("case", ["input_size", "batch", "hidden_size", "dims"])
def test_cell_module_errors_match_torch(cls, case):
    torch.manual_seed(0)
    theirs, ours = getattr(torch.nn, cls)(5, 4), getattr(fastattn.nn, cls)(5, 4)
    x, h = torch.randn(3, 5), torch.zeros(3, 4)
    if case == "input_size":
        _same_error(lambda: ours(torch.randn(3, 6), h), lambda: theirs(torch.randn(3, 6), h))
    elif case == "batch":
        _same_error(lambda: ours(x, torch.zeros(2, 4)), lambda: theirs(x, torch.zeros(2, 4)))
    elif case == "hidden_size":
        _same_error(lambda: ours(x, torch.zeros(3, 6)), lambda: theirs(x, torch.zeros(3, 6)))
    else:
        _same_error(lambda: ours(torch.randn(2, 3, 5)), lambda: theirs(torch.randn(2, 3, 5)))


def test_functional_errors():
    torch.manual_seed(0)
    gru_m = torch.nn.GRU(3, 4, num_layers=2)
    rnn_m = torch.nn.RNN(3, 4)
    x = torch.randn(5, 2, 3)
    w = list(gru_m._flat_weights)
    with pytest.raises(ValueError, match="expected 4 or 8 weight tensors"):
        fastattn.gru(x, None, w[:5], num_layers=2)
    with pytest.raises(TypeError, match="weights must be a list"):
        fastattn.gru(x, None, iter(w), num_layers=2)
    with pytest.raises(ValueError, match="w_hh of layer 1 must have shape"):
        fastattn.gru(x, None, w[:5] + [torch.randn(12, 5)] + w[6:], num_layers=2)
    with pytest.raises(ValueError, match="input.size\\(-1\\) must be equal to input_size"):
        fastattn.gru(torch.randn(5, 2, 6), None, w, num_layers=2)
    with pytest.raises(ValueError, match="hidden size"):
        fastattn.gru(x, torch.zeros(2, 3, 4), w, num_layers=2)
    with pytest.raises(ValueError, match="lengths must be in \\[0, T\\]"):
        fastattn.gru(x, None, w, num_layers=2, lengths=torch.tensor([6, 2]))
    with pytest.raises(ValueError, match="lengths must have shape"):
        fastattn.gru(x, None, w, num_layers=2, lengths=torch.tensor([1, 2, 3]))
    with pytest.raises(TypeError, match="lengths must be an integer tensor"):
        fastattn.gru(x, None, w, num_layers=2, lengths=torch.tensor([1.0, 2.0]))
    with pytest.raises(TypeError, match="reset_after must be a bool"):
        fastattn.gru(x, None, w, num_layers=2, reset_after="yes")
    with pytest.raises(ValueError, match="nonlinearity must be 'tanh' or 'relu'"):
        fastattn.rnn(x, None, list(rnn_m._flat_weights), num_layers=1, nonlinearity="gelu")
    with pytest.raises(ValueError, match="nonlinearity must be 'tanh' or 'relu'"):
        fastattn.rnn_cell(
            x[0], None, rnn_m.weight_ih_l0, rnn_m.weight_hh_l0, nonlinearity="sigmoid"
        )
    with pytest.raises(ValueError, match="w_ih must have shape"):
        fastattn.gru_cell(torch.randn(2, 5), None, gru_m.weight_ih_l0, gru_m.weight_hh_l0)
    with pytest.raises(ValueError, match="hidden0 has inconsistent hidden_size"):
        fastattn.gru_cell(x[0], torch.zeros(2, 5), gru_m.weight_ih_l0, gru_m.weight_hh_l0)
    with pytest.raises(ValueError, match="b_ih and b_hh must be given together"):
        fastattn.rnn_cell(x[0], None, rnn_m.weight_ih_l0, rnn_m.weight_hh_l0, rnn_m.bias_ih_l0)
    with pytest.raises(TypeError, match="must have the input's dtype"):
        fastattn.gru(x.double(), None, w, num_layers=2)
    # the native ops' own checks (direct calls)
    with pytest.raises(RuntimeError, match="rnn_layer: nonlinearity must be 'tanh' or 'relu'"):
        torch.ops.fastattn.rnn_layer(
            x,
            torch.zeros(1, 2, 4),
            rnn_m.weight_ih_l0[None],
            rnn_m.weight_hh_l0[None],
            None,
            None,
            None,
            0.0,
            None,
            "gelu",
            False,
        )
    with pytest.raises(RuntimeError, match="gru_layer: w_ih must have shape"):
        torch.ops.fastattn.gru_layer(
            x,
            torch.zeros(1, 2, 4),
            torch.randn(1, 12, 5),
            gru_m.weight_hh_l0[None],
            None,
            None,
            None,
            0.0,
            None,
            True,
            False,
        )


@pytest.mark.parametrize("kind", ("gru", "rnn-relu"))
def test_state_dict_and_parameters_match_torch(kind):
    kw = dict(num_layers=2, bidirectional=True)
    theirs, ours = make_pair(kind, 5, 6, device="cpu", dtype=torch.float32, **kw)
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in theirs.named_parameters()]
    theirs2 = type(theirs)(5, 6, **kw, **({} if kind == "gru" else {"nonlinearity": "relu"}))
    theirs2.load_state_dict(ours.state_dict())
    for (n, a), (_, b) in zip(theirs.state_dict().items(), theirs2.state_dict().items()):
        assert torch.equal(a, b), n
    assert isinstance(ours, torch.nn.RNNBase) and not isinstance(ours, type(theirs))
    assert repr(ours).replace("fastattn.nn.", "") == repr(theirs).replace("torch.nn.", "")
    x = torch.randn(4, 2, 5)
    torch.testing.assert_close(ours(x)[0], theirs(x)[0], rtol=1e-5, atol=1e-6)
    textbook = fastattn.nn.GRU(5, 6, reset_after=False, **kw)
    textbook.load_state_dict(torch.nn.GRU(5, 6, **kw).state_dict())  # the same state_dict
    assert "reset_after=False" in repr(textbook)
    assert isinstance(fastattn.nn.GRUCell(2, 3), torch.nn.GRUCell)
    assert isinstance(fastattn.nn.RNNCell(2, 3), torch.nn.RNNCell)


class _AllRecurrent(torch.nn.Module):
    """All seven recurrent module types of torch.nn in one model."""

    def __init__(self):
        super().__init__()
        self.lstm = torch.nn.LSTM(4, 6, batch_first=True)
        self.gru = torch.nn.GRU(6, 6, num_layers=2, bidirectional=True, batch_first=True)
        self.rnn = torch.nn.RNN(12, 5, nonlinearity="relu", batch_first=True)
        self.lstm_cell = torch.nn.LSTMCell(5, 5)
        self.gru_cell = torch.nn.GRUCell(5, 5)
        self.rnn_cell = torch.nn.RNNCell(5, 3)
        self.attn = torch.nn.MultiheadAttention(3, 1, batch_first=True)

    def forward(self, x):
        y, _ = self.lstm(x)
        y, _ = self.gru(y)
        y, _ = self.rnn(y)
        h, _ = self.lstm_cell(y[:, -1])
        z = self.rnn_cell(self.gru_cell(h))[:, None]
        return self.attn(z, z, z)[0].sum(1)


def test_swap_and_restore_all_recurrent_modules():
    torch.manual_seed(0)
    model = _AllRecurrent().double()
    x = torch.randn(3, 7, 4, dtype=F64)
    expected = model(x)
    g_expected = torch.autograd.grad(expected.square().sum(), list(model.parameters()))
    keys = list(model.state_dict())
    params = [id(p) for p in model.parameters()]
    fastattn.swap_modules(model)
    kinds = {name: cls for name, _, cls in fastattn.swap_summary(model)}
    assert kinds == {
        "lstm": "LSTM",
        "gru": "GRU",
        "rnn": "RNN",
        "lstm_cell": "LSTMCell",
        "gru_cell": "GRUCell",
        "rnn_cell": "RNNCell",
        "attn": "MultiheadAttention",
    }
    assert list(model.state_dict()) == keys and [id(p) for p in model.parameters()] == params
    out = model(x)
    for op in ("gru", "rnn", "gru_cell", "rnn_cell"):
        assert fastattn.last_backend(op) == "cpu", op
    close64("swapped output", out, expected)
    for a, b in zip(torch.autograd.grad(out.square().sum(), list(model.parameters())), g_expected):
        close64("swapped grad", a, b)
    fastattn.restore_modules(model)
    assert type(model.gru) is torch.nn.GRU and type(model.rnn_cell) is torch.nn.RNNCell
    close64("restored output", model(x), expected)
    # gru=False / rnn=False leave those families alone
    fastattn.swap_modules(model, gru=False, rnn=False)
    assert type(model.gru) is torch.nn.GRU and type(model.gru_cell) is torch.nn.GRUCell
    assert type(model.rnn) is torch.nn.RNN and type(model.lstm) is fastattn.nn.LSTM
    fastattn.restore_modules(model)
    # the backend= of swap_modules reaches the GRU / RNN modules
    fastattn.swap_modules(model, backend="reference")
    model(x)
    assert fastattn.last_backend("gru") == "reference"
    assert fastattn.last_backend("rnn_cell") == "reference"
    fastattn.restore_modules(model)


def test_other_isa_copies_match():
    """The avx2 and baseline copies of the CPU engine compute the same GRU / RNN."""
    code = (
        "import torch, fastattn, sys\n"
        "torch.manual_seed(0)\n"
        "err = 0.0\n"
        "L = torch.tensor([7, 2, 5])\n"
        "for fn, kw, G in ((fastattn.gru, dict(reset_after=True), 3),"
        " (fastattn.gru, dict(reset_after=False), 3),"
        " (fastattn.rnn, dict(nonlinearity='relu'), 1)):\n"
        "    m = torch.nn.GRU(5, 9, num_layers=2, bidirectional=True) if G == 3 else"
        " torch.nn.RNN(5, 9, num_layers=2, bidirectional=True)\n"
        "    x = torch.randn(7, 3, 5, requires_grad=True)\n"
        "    res = []\n"
        "    for be in ('cpu', 'reference'):\n"
        "        o, h = fn(x, None, list(m._flat_weights), num_layers=2, bidirectional=True,"
        " lengths=L, backend=be, **kw)\n"
        "        res.append((o, h) + torch.autograd.grad(o.sum() + h.sum(),"
        " [x] + list(m.parameters())))\n"
        "    err = max([err] + [float((a - b).abs().max()) for a, b in zip(*res)])\n"
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
# 6. The large grid (slow)


@pytest.mark.parametrize("T", (1, 2, 37, 100))
@pytest.mark.parametrize("B", (1, 33))
@pytest.mark.parametrize("I,H", [(1, 1), (300, 37), (16, 64)])
@pytest.mark.parametrize("bidir,batch_first", [(False, False), (True, True)])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("backend", ("cpu", "cuda", "triton"))
@pytest.mark.parametrize("_slow", [pytest.param(None, marks=slow)])
def test_grid_against_torch_float64(backend, kind, bidir, batch_first, I, H, B, T, _slow):
    device = kind_device(backend, kind, F64)
    theirs, ours = make_pair(
        kind, I, H, device=device, num_layers=2, bidirectional=bidir, batch_first=batch_first
    )
    ref = expected_module(kind, theirs, ours)
    ref_params = list(ours.parameters()) if theirs is None else list(theirs.parameters())
    D = 2 if bidir else 1
    x = torch.randn((B, T, I) if batch_first else (T, B, I), dtype=F64, device=device)
    h0 = torch.randn(2 * D, B, H, dtype=F64, device=device)
    results = [
        run_and_grad(m, [t.clone().requires_grad_() for t in (x, h0)], backend, ps)
        for m, ps in ((ref, ref_params), (ours, list(ours.parameters())))
    ]
    close64("output", results[1][0], results[0][0])
    close64("h_n", results[1][1], results[0][1])
    for i, (a, b) in enumerate(zip(results[1][2], results[0][2])):
        close64(f"grad {i}", a, b)


# ---------------------------------------------------------------------------------------------
# 7. The triton backend: small cases (the interpreter runs them on the CPU; float64 is refused,
# so the float64 tests above skip it and these compare with the reference under FlashAttention's
# rule, and with the cpu backend where both compute the same float32 values)

TRITON_CASES = [
    # T, B, I, H, layers, bidir, lengths, batch_first, bias
    pytest.param(1, 1, 1, 1, 1, False, None, False, True, id="T1-B1-I1-H1"),
    pytest.param(5, 3, 5, 7, 1, True, [5, 0, 2], False, True, id="T5-B3-bidir-lengths"),
    pytest.param(
        4, 3, 5, 7, 2, True, [3, 4, 1], True, False, id="T4-B3-2layer-bidir-lengths-bf-nobias"
    ),
    pytest.param(6, 2, 3, 9, 2, False, None, False, True, id="T6-B2-2layer"),
]


def _triton_floor(ref64: torch.Tensor, dtype: torch.dtype) -> float | None:
    """float32: tolerance.py's float32 floor (Triton's tanh is within 2 ulps, torch's 1.4;
    the orders of the sums differ). 16-bit: the rounding floor, but at least one ulp at the
    largest value (a handful of elements make the baseline a lucky sample of few roundings)."""
    if dtype == torch.float32:
        return float32_floor(ref64, dtype)
    top = float(ref64.abs().max()) if ref64.numel() else 0.0
    return max(rounding_floor(ref64, dtype), torch.finfo(dtype).eps * top)


def _triton_fa_rule(kind, dtype, T, B, I, H, layers, bidir, lengths, batch_first, bias):
    device = kind_device("triton", kind, dtype)
    _, module = make_pair(
        kind, I, H, device=device, num_layers=layers, bidirectional=bidir, bias=bias
    )
    D = 2 if bidir else 1
    g = torch.Generator().manual_seed(T * 100 + B * 10 + H)
    shape = (B, T, I) if batch_first else (T, B, I)
    inputs = [
        torch.randn(*s, generator=g, dtype=F64).to(dtype).to(device=device, dtype=F64)
        for s in (shape, (layers * D, B, H))
    ]
    params = [t.detach().to(dtype).to(F64) for t in module._weights()]
    lengths = torch.tensor(lengths, device=device) if lengths is not None else None
    kw = dict(num_layers=layers, bidirectional=bidir, batch_first=batch_first)
    outs, grads = _run_functional(kind, "triton", dtype, inputs, params, lengths=lengths, **kw)
    outs64, grads64 = _run_functional(kind, "reference", F64, inputs, params, lengths=lengths, **kw)
    outs_lp, grads_lp = _run_functional(
        kind, "reference", dtype, inputs, params, lengths=lengths, **kw
    )
    label = f"{kind} [triton, {dtype}]"
    for name, a, b, c in zip(("output", "h_n"), outs, outs64, outs_lp):
        assert a.dtype == dtype
        assert_fa_close(f"{label} {name}", a, b, c, floor=_triton_floor(b, dtype))
    names = ["input", "h0"] + [f"weights[{i}]" for i in range(len(params))]
    for name, a, b, c in zip(names, grads, grads64, grads_lp):
        assert_grad_close(f"{label} grad {name}", a, b, c, floor=_triton_floor(b, dtype))
    if lengths is not None:
        out = outs[0] if not batch_first else outs[0].transpose(0, 1)
        for row, n in enumerate(lengths.tolist()):
            if n < T:
                assert out[n:, row].abs().max() == 0, f"row {row}: output past its end"


@pytest.mark.parametrize(
    "dtype", (torch.float32, torch.float16, torch.bfloat16), ids=("fp32", "fp16", "bf16")
)
@pytest.mark.parametrize("T,B,I,H,layers,bidir,lengths,batch_first,bias", TRITON_CASES)
@pytest.mark.parametrize("kind", KINDS)
def test_triton_small_fa_rule(kind, dtype, T, B, I, H, layers, bidir, lengths, batch_first, bias):
    """fastattn.gru / fastattn.rnn on the triton backend (the kernels ran: last_backend)
    against the float64 reference under FlashAttention's rule, every output and gradient
    (input, h0, every weight and bias); the output is exactly 0 past each sequence's end."""
    _triton_fa_rule(kind, dtype, T, B, I, H, layers, bidir, lengths, batch_first, bias)


@pytest.mark.parametrize("kind", KINDS)
def test_triton_several_tiles(kind, monkeypatch):
    """Tiles of 16 under the interpreter: several tiles along the batch, hidden and reduction
    dimensions (B = 33, H = 37, 3H = 111), lengths with zeros, both directions."""
    from fastattn.triton import recurrent as triton_lstm

    kind_device("triton", kind)
    monkeypatch.setattr(triton_lstm, "INTERPRETER_MAX_BLOCK", 16)
    lengths = torch.randint(0, 4, (33,), generator=torch.Generator().manual_seed(0)).tolist()
    _triton_fa_rule(kind, torch.float32, 3, 33, 5, 37, 1, True, lengths, False, True)


@pytest.mark.parametrize("kind", KINDS)
def test_triton_dropout_mask_matches_cpu(kind):
    """Input dropout of the layer op: the triton kernels drop exactly the elements of
    fastattn's Philox mask (the cpu backend's and the reference's), and compute the values and
    gradients of the float64 op with that mask (the cpu backend's, itself checked against the
    reference by gradcheck) within the float32 floor: a different mask element moves them by
    orders of magnitude more."""
    device = kind_device("triton", kind)
    kind_device("cpu", kind)
    args = [
        a.detach() if a is not None and a.is_floating_point() else a
        for a in _layer_args(kind, T=5, B=3, I=5, H=7, dtype=F64)
    ]
    args[6] = torch.tensor([5, 2, 4])
    seed, p = torch.tensor([1234, 7]), 0.4
    results = {}
    for suffix, dev, dtype in (
        ("_triton", device, torch.float32),
        ("", torch.device("cpu"), torch.float32),
        ("", torch.device("cpu"), F64),
    ):
        leaves = [
            a.to(dev, dtype).requires_grad_() if a is not None and a.is_floating_point() else a
            for a in args
        ]
        out, h_n, _ = _layer_op(kind, suffix)(*leaves, p, seed.to(dev), _variant(kind), True)
        w = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dev, dtype)
        grads = torch.autograd.grad((out * w).sum() + h_n.sum(), leaves[:6])
        results[suffix, dtype] = tuple(t.detach().cpu() for t in (out, h_n) + grads)
    keep = fastattn.reference.random.dropout_keep_mask(seed, (5, 3, 5), p)
    alive = torch.arange(5)[:, None] < args[6][None, :]
    # grad_input vanishes exactly where the input was dropped (and past each row's end)
    for key in (("_triton", torch.float32), ("", torch.float32)):
        assert torch.equal(results[key][2] != 0, keep & alive[:, :, None]), key
    names = ("output", "h_n", "input", "h0", "w_ih", "w_hh", "b_ih", "b_hh")
    for name, a, b in zip(names, results["_triton", torch.float32], results["", F64]):
        assert_fa_close(f"{kind} [triton] {name}", a, b, b, floor=float32_floor(b))


@pytest.mark.parametrize("kind", KINDS)
def test_triton_dropout_between_layers_matches_cpu(kind):
    """fastattn.nn.GRU / RNN in training with inter-layer dropout, h0 zero (not given): the
    same mask (same seeds from torch's generator) and values on triton as on cpu."""
    runs = {}
    for backend in ("triton", "cpu"):
        device = kind_device(backend, kind)
        _, module = make_pair(
            kind, 4, 5, device=device, dtype=torch.float32, num_layers=2, dropout=0.5, seed=2
        )
        module.train()
        x = torch.randn(4, 2, 4, generator=torch.Generator().manual_seed(4)).to(device)
        x.requires_grad_()
        torch.manual_seed(21)  # seeds the dropout stream on either device
        with fastattn.use_backend(backend):
            out, h_n = module(x)
        assert fastattn.last_backend(family(kind)) == backend
        runs[backend] = tuple(
            t.cpu()
            for t in (out, h_n)
            + torch.autograd.grad(out.sum() + h_n.square().sum(), [x] + list(module.parameters()))
        )
    for i, (a, b) in enumerate(zip(runs["triton"], runs["cpu"])):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-6, msg=lambda m: f"{i}: {m}")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("batch_first", (False, True))
def test_triton_unbatched_matches_reference(kind, batch_first):
    """Unbatched input, with and without h0, through the modules on triton; the first call
    under torch.no_grad (the kernels save no workspace)."""
    device = kind_device("triton", kind)
    _, module = make_pair(
        kind,
        6,
        5,
        device=device,
        dtype=torch.float32,
        num_layers=2,
        bidirectional=True,
        batch_first=batch_first,
    )
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 6, generator=g).to(device)
    h = torch.randn(4, 5, generator=g).to(device)
    for args, grad in (((x,), False), ((x, h), True)):
        with fastattn.use_backend("triton"), torch.set_grad_enabled(grad):
            out, h_n = module(*args)
        assert fastattn.last_backend(family(kind)) == "triton"
        with fastattn.use_backend("reference"):
            ref_out, ref_h = module(*args)
        assert out.shape == (7, 10) and h_n.shape == (4, 5)
        torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(h_n, ref_h, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("fp32", "bf16"))
@pytest.mark.parametrize(
    "bias,batched",
    [(True, True), (False, True), (True, False)],
    ids=("bias", "nobias", "unbatched"),
)
def test_triton_cell_small(kind, dtype, bias, batched):
    """fastattn.gru_cell / rnn_cell on triton (B = 3, I = 5, H = 7) under FlashAttention's
    rule, every gradient; hx=None (zeros) as the reference."""
    device = kind_device("triton", kind, dtype)
    G = 3 if family(kind) == "gru" else 1
    g = torch.Generator().manual_seed(9)
    lead = (3,) if batched else ()
    shapes = [lead + (5,), lead + (7,), (G * 7, 5), (G * 7, 7)] + (
        [(G * 7,), (G * 7,)] if bias else []
    )
    tensors = [
        torch.randn(*s, generator=g, dtype=F64).to(dtype).to(device=device, dtype=F64)
        for s in shapes
    ]
    fn = fastattn.gru_cell if family(kind) == "gru" else fastattn.rnn_cell
    op = f"{family(kind)}_cell"
    runs = {}
    for label, be, dt in (
        ("out", "triton", dtype),
        ("ref64", "reference", F64),
        ("ref_lowp", "reference", dtype),
    ):
        leaves = [t.to(dt).requires_grad_() for t in tensors]
        hy = fn(*leaves, backend=be, **variant_kw(kind))
        assert fastattn.last_backend(op) == be
        wave = torch.cos(torch.arange(hy.numel(), dtype=F64, device=device)).view_as(hy)
        runs[label] = (hy.detach(), torch.autograd.grad((hy.double() * wave).sum(), leaves))
        with torch.no_grad():
            runs[label + "_zero_hx"] = fn(
                leaves[0], None, *leaves[2:], backend=be, **variant_kw(kind)
            )
    for suffix in ("", "_zero_hx"):
        out = runs["out" + suffix] if suffix else runs["out"][0]
        ref64 = runs["ref64" + suffix] if suffix else runs["ref64"][0]
        lowp = runs["ref_lowp" + suffix] if suffix else runs["ref_lowp"][0]
        assert_fa_close(
            f"{op} [triton] hy{suffix}", out, ref64, lowp, floor=_triton_floor(ref64, dtype)
        )
    for i in range(len(tensors)):
        ref64 = runs["ref64"][1][i]
        assert_grad_close(
            f"{op} [triton] grad {i}",
            runs["out"][1][i],
            ref64,
            runs["ref_lowp"][1][i],
            floor=_triton_floor(ref64, dtype),
        )


def _triton_opcheck_cases(kind, device):
    name = f"{family(kind)}_layer_triton"
    v = _variant(kind)
    f32 = torch.float32
    cases = {
        "layer-bidir-lengths": (name, _layer_args(kind, dtype=f32) + [0.0, None, v, True]),
        "layer-dropout-nobias": (
            name,
            _layer_args(kind, bias=False, dtype=f32) + [0.2, torch.tensor([1, 2]), v, True],
        ),
        "layer-inference-bf16": (
            name,
            [
                a.to(torch.bfloat16) if a is not None and a.is_floating_point() else a
                for a in _layer_args(kind, grad=False)
            ]
            + [0.0, None, v, False],
        ),
    }
    cases = {
        k: (n, [a.to(device) if isinstance(a, torch.Tensor) else a for a in args])
        for k, (n, args) in cases.items()
    }
    args = [
        a.to(device) if a is not None else None for a in _layer_args(kind, grad=False, dtype=f32)
    ]
    _, _, ws = _layer_op(kind, "_triton")(*args, 0.0, None, v, True)
    T, B, _ = args[0].shape
    cases["layer_backward"] = (
        f"{family(kind)}_layer_backward_triton",
        [
            torch.randn(T, B, 8, device=device),
            torch.randn(2, B, 4, device=device),
            *args[:4],
            args[6],
            ws,
            0.0,
            None,
            v,
            True,
            True,
            True,
        ],
    )
    return cases


@pytest.mark.parametrize(
    "case",
    ["layer-bidir-lengths", "layer-dropout-nobias", "layer-inference-bf16", "layer_backward"],
)
@pytest.mark.parametrize("kind", KINDS)
def test_triton_opcheck(kind, case):
    """torch.library.opcheck of the Triton layer ops: schema, fake implementation (what
    torch.compile traces), autograd registration."""
    device = kind_device("triton", kind)
    name, args = _triton_opcheck_cases(kind, device)[case]
    torch.library.opcheck(getattr(torch.ops.fastattn, name), args)


def test_triton_compile_fullgraph():
    """fastattn.gru (textbook form, lengths), fastattn.rnn (relu) and the cells on the triton
    backend compile without graph breaks; outputs and gradients equal eager."""
    device = kind_device("triton", "gru")
    torch._dynamo.reset()
    torch.manual_seed(0)
    gru = fastattn.nn.GRU(4, 6, num_layers=2, bidirectional=True, reset_after=False).to(device)
    rnn = fastattn.nn.RNN(12, 5, nonlinearity="relu").to(device)
    cell = fastattn.nn.GRUCell(5, 3).to(device)
    params = list(gru.parameters()) + list(rnn.parameters()) + list(cell.parameters())

    def model(x, lengths):
        y, _ = fastattn.gru(
            x,
            None,
            gru._weights(),
            num_layers=2,
            bidirectional=True,
            lengths=lengths,
            reset_after=False,
            backend="triton",
        )
        z, _ = fastattn.rnn(
            y, None, rnn._weights(), num_layers=1, nonlinearity="relu", backend="triton"
        )
        return fastattn.gru_cell(
            z[-1],
            None,
            cell.weight_ih,
            cell.weight_hh,
            cell.bias_ih,
            cell.bias_hh,
            backend="triton",
        )

    x = torch.randn(5, 3, 4, device=device)
    lengths = torch.tensor([5, 2, 4])
    out = torch.compile(model, fullgraph=True)(x, lengths)
    for op in ("gru", "rnn", "gru_cell"):
        assert fastattn.last_backend(op) == "triton", op
    eager = model(x, lengths)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-6)
    for g, e in zip(
        torch.autograd.grad(out.square().sum(), params),
        torch.autograd.grad(eager.square().sum(), params),
    ):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("kind", KINDS)
def test_triton_limits_and_automatic_order(kind):
    """float64 is refused by triton with its reason (an explicit request raises, the automatic
    choice on CPU tensors stays cpu); on CUDA tensors the automatic choice tries triton first,
    as for the LSTM, then cuda."""
    device = kind_device("triton", kind)
    fam = family(kind)
    assert "float64" in _recurrent.unsupported_backends(fam, F64)["triton"]
    assert "triton" not in _recurrent.unsupported_backends(fam, torch.bfloat16)
    _, module = make_pair(kind, 3, 4, device=device)
    x = torch.randn(5, 2, 3, dtype=F64, device=device)
    with pytest.raises(fastattn.BackendError, match="float64"):
        with fastattn.use_backend("triton"):
            module(x)
    module(x)  # CPU tensors: cpu; CUDA tensors: not triton (float64), so the cuda kernels
    assert fastattn.last_backend(fam) == ("cpu" if device.type == "cpu" else "cuda")
    for op in (fam, f"{fam}_cell"):
        assert fastattn._backend.automatic_order(op, "cuda")[0] == "triton", op
    # A build with the CUDA kernels (not FASTATTN_CUDA=0) has this family's (the LSTM's engine,
    # generic over the cell).
    if fastattn.build_info().get("cuda"):
        assert "cuda" not in _recurrent.unsupported_backends(fam)
        assert "cuda" not in _recurrent.unsupported_backends(fam, F64)
    else:
        assert "no CUDA" in _recurrent.unsupported_backends(fam).get("cuda", "no CUDA")


def test_triton_layer_ops_reject_bad_arguments(monkeypatch):
    """The Triton layer ops name the argument and the rule: float64, a w_hh without G H rows,
    a mismatched h0, a bad nonlinearity, lengths out of range, a foreign workspace."""
    device = kind_device("triton", "gru")
    if device.type != "cpu":  # eager range errors for CUDA tensors: host checks (opt-in)
        monkeypatch.setenv("FASTATTN_HOST_CHECKS", "1")
    ops = torch.ops.fastattn
    x, h = torch.randn(5, 2, 3, device=device), torch.zeros(1, 2, 4, device=device)
    w_ih, w_hh = torch.randn(1, 12, 3, device=device), torch.randn(1, 12, 4, device=device)
    with pytest.raises(TypeError, match="triton backend takes float32, float16 or bfloat16"):
        ops.gru_layer_triton(
            x.double(),
            h.double(),
            w_ih.double(),
            w_hh.double(),
            None,
            None,
            None,
            0.0,
            None,
            True,
            False,
        )
    with pytest.raises(ValueError, match=r"w_hh \(D, 3H, P\)"):
        ops.gru_layer_triton(x, h, w_ih, w_hh[:, :10], None, None, None, 0.0, None, True, False)
    with pytest.raises(ValueError, match=r"h0 must have shape \(1, 2, 4\)"):
        ops.gru_layer_triton(x, h[:, :1], w_ih, w_hh, None, None, None, 0.0, None, False, False)
    with pytest.raises(ValueError, match="nonlinearity must be 'tanh' or 'relu'"):
        ops.rnn_layer_triton(
            x, h, w_ih[:, :4], w_hh[:, :4], None, None, None, 0.0, None, "gelu", False
        )
    with pytest.raises(ValueError, match=r"lengths must be in \[0, T\]"):
        ops.rnn_layer_triton(
            x,
            h,
            w_ih[:, :4],
            w_hh[:, :4],
            None,
            None,
            torch.tensor([6, 1]),
            0.0,
            None,
            "tanh",
            False,
        )
    with pytest.raises(ValueError, match="dropout_p > 0 needs seed"):
        ops.gru_layer_triton(x, h, w_ih, w_hh, None, None, None, 0.5, None, True, False)
    _, _, ws = ops.rnn_layer_triton(
        x, h, w_ih[:, :4], w_hh[:, :4], None, None, None, 0.0, None, "tanh", True
    )
    with pytest.raises(ValueError, match="workspace must be the contiguous float32"):
        ops.gru_layer_backward_triton(
            None, h, x, h, w_ih, w_hh, None, ws, 0.0, None, True, False, True, True
        )


# ---------------------------------------------------------------------------------------------
# 8. The cuda backend specifics (skip without a GPU; tools/cuda_emu/run_lstm.py runs the same
#    kernels on the CPU): the recurrent path query (fastattn.ops.gru/rnn.cuda_recurrent_path),
#    persistent vs per-step agreement, the layer ops against the CPU kernels in float64 (the same
#    Philox mask), the automatic choice on CUDA tensors.

_CUDA_CELLS = {
    "gru": ("gru", True, 3),
    "gru-textbook": ("gru", False, 3),
    "rnn-tanh": ("rnn", "tanh", 1),
    "rnn-relu": ("rnn", "relu", 1),
}


def _cuda_kind_or_skip(kind):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return kind_device("cuda", kind)


def _gated_args(kind, T, B, I, H, D, *, lengths=None, dtype=F64, device="cuda", seed=0):
    _, _, G = _CUDA_CELLS[kind]
    g = torch.Generator().manual_seed(seed)

    def r(*s):
        return (torch.randn(*s, generator=g, dtype=F64) * 0.5).to(device=device, dtype=dtype)

    args = [r(T, B, I), r(D, B, H), r(D, G * H, I), r(D, G * H, H), r(D, G * H), r(D, G * H)]
    lens = None if lengths is None else torch.tensor(lengths, dtype=torch.int64, device=device)
    return args, lens


def _gated_fwd_bwd(kind, args, lens, p=0.0, seed=None):
    """X_layer + X_layer_backward with fixed incoming gradients: 2 outputs, 6 grads."""
    fam, variant, _ = _CUDA_CELLS[kind]
    ops = torch.ops.fastattn
    out, h_n, ws = getattr(ops, f"{fam}_layer")(*args, lens, p, seed, variant, True)
    g = torch.Generator().manual_seed(7)
    gouts = [torch.randn(t.shape, generator=g, dtype=F64).to(t) for t in (out, h_n)]
    grads = getattr(ops, f"{fam}_layer_backward")(
        *gouts, *args[:4], lens, ws, p, seed, variant, True, True, True
    )
    return [out, h_n], list(grads)


def _path(kind, x, w_hh, backward=False):
    fam, variant, _ = _CUDA_CELLS[kind]
    return _recurrent.cuda_recurrent_path(fam, x, w_hh, variant, backward)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "T,B,H,D,expected",
    [
        (5, 4, 32, 1, "persistent"),
        (5, 64, 512, 2, "persistent"),
        (5, 33, 37, 2, "persistent"),
        (5, 64, 4096, 1, "per_step"),  # the W_hh slice no longer fits shared memory
    ],
)
def test_cuda_recurrent_path_query(kind, T, B, H, D, expected, monkeypatch):
    _cuda_kind_or_skip(kind)
    G = _CUDA_CELLS[kind][2]
    x = torch.empty(T, B, 8, device="cuda")
    w_hh = torch.empty(D, G * H, H, device="cuda")
    assert _path(kind, x, w_hh) == expected
    assert _path(kind, x, w_hh, backward=True) == expected
    if expected == "persistent":
        assert _path(kind, x, w_hh[0]) == "persistent"
        monkeypatch.setenv("FASTATTN_LSTM_CUDA_PATH", "per_step")
        assert _path(kind, x, w_hh) == "per_step"
        assert _path(kind, x, w_hh, backward=True) == "per_step"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", (F64, torch.float32, torch.bfloat16), ids=("f64", "f32", "bf16"))
@pytest.mark.parametrize(
    "D,lengths,p", [(1, None, 0.0), (2, [9, 0, 4, 1, 9], 0.0), (2, [3, 9, 9, 7, 2], 0.3)]
)
def test_cuda_persistent_matches_per_step(kind, dtype, D, lengths, p, monkeypatch):
    _cuda_kind_or_skip(kind)
    args, lens = _gated_args(kind, 9, 5, 6, 40, D, lengths=lengths, dtype=dtype)
    seed = torch.tensor([5, 6], dtype=torch.int64, device="cuda") if p else None
    assert _path(kind, args[0], args[3]) == "persistent"
    assert _path(kind, args[0], args[3], backward=True) == "persistent"
    outs_p, grads_p = _gated_fwd_bwd(kind, args, lens, p, seed)
    monkeypatch.setenv("FASTATTN_LSTM_CUDA_PATH", "per_step")
    assert _path(kind, args[0], args[3]) == "per_step"
    outs_s, grads_s = _gated_fwd_bwd(kind, args, lens, p, seed)
    tol = {F64: 1e-10, torch.float32: 2e-5, torch.bfloat16: 3e-2}[dtype]
    names = ["output", "h_n"] + [f"grad{i}" for i in range(6)]
    for name, a, b in zip(names, outs_p + grads_p, outs_s + grads_s):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("path", ("persistent", "per_step"))
def test_cuda_layer_matches_cpu_kernels_float64(kind, path, monkeypatch):
    """Every output and gradient of the CUDA layer ops against the CPU ops on the same float64
    arguments: lengths in any order (0 and T included), both directions, dropout (the same
    Philox elements dropped)."""
    _cuda_kind_or_skip(kind)
    if path == "per_step":
        monkeypatch.setenv("FASTATTN_LSTM_CUDA_PATH", "per_step")
    args, lens = _gated_args(kind, 7, 6, 4, 12, 2, lengths=[7, 0, 3, 7, 1, 5])
    assert _path(kind, args[0], args[3]) == path
    seed = torch.tensor([123, 4], dtype=torch.int64)
    outs_g, grads_g = _gated_fwd_bwd(kind, args, lens, 0.4, seed.cuda())
    cpu_args = [t.cpu() for t in args]
    outs_c, grads_c = _gated_fwd_bwd(kind, cpu_args, lens.cpu(), 0.4, seed)
    names = ["output", "h_n"] + [f"grad{i}" for i in range(6)]
    for name, a, b in zip(names, outs_g + grads_g, outs_c + grads_c):
        close64(name, a.cpu(), b)


@pytest.mark.parametrize("kind", KINDS)
def test_cuda_backend_runs_the_modules(kind):
    """fastattn.nn modules on CUDA tensors with backend="cuda": the cuda kernels ran
    (last_backend), same results as torch (float64)."""
    _cuda_kind_or_skip(kind)
    theirs, ours = make_pair(kind, 5, 16, device="cuda", dtype=F64, num_layers=2)
    if theirs is None:
        theirs = TextbookGRU(ours)
    x = torch.randn(6, 3, 5, device="cuda", dtype=F64)
    with fastattn.use_backend("cuda"):
        out, h = ours(x)
    assert fastattn.last_backend(family(kind)) == "cuda"
    out_t, h_t = theirs(x)
    close64("output", out, out_t)
    close64("h_n", h, h_t)


@pytest.mark.parametrize("kind", ("lstm", "lstm-proj") + KINDS)
@pytest.mark.parametrize("dtype", (torch.float32, torch.float64), ids=("fp32", "fp64"))
def test_cpu_inference_states_match_training_path(kind, dtype):
    """The CPU kernels keep only the last two steps' states under no_grad (a ring in the
    workspace) and every step's when the workspace is saved: both give the same outputs and
    final states, and match the reference, with lengths (sequences ending and, in reverse,
    starting at different steps; an empty one), two bidirectional layers, and T = 1."""
    lstm = kind.startswith("lstm")
    op = "lstm" if lstm else family(kind)
    fn = getattr(fastattn, op)
    extra = dict(proj_size=5 if kind == "lstm-proj" else 0) if lstm else variant_kw(kind)
    g = torch.Generator().manual_seed(5)
    for T, lengths in ((9, [9, 3, 7, 1, 9, 4]), (1, [1, 1, 1, 1, 1, 1]), (6, [6, 0, 2, 6, 5, 1])):
        torch.manual_seed(1)
        if lstm:
            module = fastattn.nn.LSTM(7, 12, num_layers=2, bidirectional=True, **extra)
        else:
            module = make_pair(kind, 7, 12, device="cpu", num_layers=2, bidirectional=True)[1]
        weights = [w.detach().to(dtype) for w in module._flat_weights]
        x = torch.randn(T, 6, 7, generator=g, dtype=dtype)
        runs = {}
        for label, backend, grad in (
            ("ring", "cpu", False),
            ("saved", "cpu", True),
            ("reference", "reference", False),
        ):
            leaves = [w.clone().requires_grad_(grad) for w in weights]
            with torch.set_grad_enabled(grad):
                out, h = fn(
                    x,
                    None,
                    leaves,
                    num_layers=2,
                    bidirectional=True,
                    lengths=torch.tensor(lengths),
                    backend=backend,
                    **extra,
                )
            assert fastattn.last_backend(op) == backend
            runs[label] = [t.detach() for t in (out,) + (h if isinstance(h, tuple) else (h,))]
        for a, b, c in zip(runs["ring"], runs["saved"], runs["reference"]):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
            torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)
