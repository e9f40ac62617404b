"""Differential fuzzing: hypothesis draws valid argument combinations and every backend must
match the reference under FlashAttention's rule, forward and backward.

attention: shapes (odd lengths, GQA/MQA, Dv != D), dtypes, masks of every broadcast shape
(bool and float), key padding, causal forms, windows, ALiBi, softcap, dropout with a seed,
strided layouts. lstm: layers, directions, projections, lengths, dropout, batch_first, dtypes.
CI runs a fixed budget (FASTATTN_FUZZ_EXAMPLES, default 25 per test, derandomized so a run is
reproducible); FASTATTN_FUZZ=long runs 1000 per test with a random seed. A failure prints the
drawn arguments (hypothesis shrinks them): each becomes a regression test.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import backend_device
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_attention import check_against_reference

import fastattn

LONG = os.environ.get("FASTATTN_FUZZ") == "long"
FUZZ = settings(
    max_examples=1000 if LONG else int(os.environ.get("FASTATTN_FUZZ_EXAMPLES", 25)),
    deadline=None,
    derandomize=not LONG,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# triton runs bf16 arithmetic wrongly under the interpreter (TOOLCHAIN.md): only on a GPU.
_DTYPES = {
    "cpu": (torch.float32, torch.float16, torch.bfloat16, torch.float64),
    "triton": (
        (torch.float32, torch.float16, torch.bfloat16)
        if torch.cuda.is_available()
        else (torch.float32, torch.float16)
    ),
    "cuda": (torch.float32, torch.float16, torch.bfloat16, torch.float64),
}


@st.composite
def attention_cases(draw, backend):
    """(q, k, v, keywords) for `backend`: tensors on its device, valid by the API's rules.
    float64 attention is left to gradcheck (test_attention, test_double_backward): the rule's
    baseline, the reference in the input's dtype, is then the float64 reference itself."""
    dtype = draw(st.sampled_from([t for t in _DTYPES[backend] if t != torch.float64]))
    B = draw(st.integers(1, 2))
    Hkv = draw(st.integers(1, 2))
    Hq = Hkv * draw(st.sampled_from([1, 2, 3]))
    Lq, Lk = draw(st.integers(1, 19)), draw(st.integers(1, 19))
    D = draw(st.sampled_from([1, 3, 8, 16, 24, 33, 40, 64]))
    Dv = draw(st.sampled_from([D, D, 5, 16, 48]))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    kw: dict = {}
    causal = draw(st.sampled_from([False, True, "bottom_right"]))
    if causal:
        kw["causal"] = causal
    if draw(st.booleans()):
        kw["window"] = (draw(st.integers(-1, 12)), draw(st.integers(-1, 12)))
    mask_kind = draw(st.sampled_from([None, "bool", "float"]))
    if mask_kind is not None:
        # every shape that broadcasts to (B, Hq, Lq, Lk)
        shape = draw(
            st.sampled_from(
                [
                    (Lk,),
                    (Lq, Lk),
                    (1, Lk),
                    (Hq, Lq, Lk),
                    (1, 1, Lq, Lk),
                    (B, 1, Lq, Lk),
                    (B, Hq, Lq, Lk),
                    (1, Hq, 1, Lk),
                    (B, 1, 1, Lk),
                ]
            )
        )
        if mask_kind == "bool":
            kw["attn_mask"] = torch.rand(shape, generator=g) > 0.25
        else:
            mask = torch.randn(shape, generator=g)
            if draw(st.booleans()):  # -inf entries, whole rows sometimes
                mask = mask.masked_fill(torch.rand(shape, generator=g) < 0.3, float("-inf"))
            kw["attn_mask"] = mask.to(dtype if dtype != torch.float64 else torch.float64)
    if draw(st.booleans()):
        kw["key_padding_mask"] = torch.rand(B, Lk, generator=g) > 0.7
    if draw(st.booleans()):
        kw["alibi_slopes"] = (
            torch.rand((Hq,) if draw(st.booleans()) else (B, Hq), generator=g) * 0.5
        )
    if draw(st.booleans()):
        kw["softcap"] = draw(st.sampled_from([1.0, 5.0, 30.0]))
    if draw(st.booleans()):
        kw["scale"] = draw(st.sampled_from([0.1, 0.5, 1.3]))
    if draw(st.booleans()):
        kw["dropout_p"] = draw(st.sampled_from([0.1, 0.5]))
    layout = draw(st.sampled_from(["contiguous", "blhd", "strided"]))

    def make(*shape):
        t = torch.randn(*shape, generator=g)
        if layout == "blhd":  # (B, L, H, D) memory seen as (B, H, L, D)
            t = t.transpose(1, 2).contiguous().transpose(1, 2)
        elif layout == "strided":  # a last dimension with stride 2: copied by the op
            t = torch.stack([t, t], dim=-1)[..., 0]
        return t

    device = backend_device(backend)
    q, k, v = make(B, Hq, Lq, D), make(B, Hkv, Lk, D), make(B, Hkv, Lk, Dv)
    q, k, v = (t.to(dtype=dtype, device=device) for t in (q, k, v))
    kw = {n: x.to(device) if isinstance(x, torch.Tensor) else x for n, x in kw.items()}
    return q, k, v, kw


@pytest.mark.parametrize("backend", ["cpu", "triton", "cuda"])
def test_fuzz_attention(backend):
    backend_device(backend)  # skips where the backend cannot run

    @FUZZ
    @given(case=attention_cases(backend))
    def check(case):
        q, k, v, kw = case
        check_against_reference(backend, q, k, v, kw)

    check()


@st.composite
def lstm_cases(draw, backend):
    dtype = draw(st.sampled_from(_DTYPES[backend]))
    T, B = draw(st.integers(1, 7)), draw(st.integers(1, 4))
    I, H = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    layers = draw(st.integers(1, 3))
    bidirectional = draw(st.booleans())
    proj = draw(st.sampled_from([0, 0, max(1, H - 2)])) if H > 1 else 0
    bias = draw(st.booleans())
    batch_first = draw(st.booleans())
    lengths = None
    if draw(st.booleans()):
        lengths = torch.tensor(draw(st.lists(st.integers(0, T), min_size=B, max_size=B)))
    dropout = draw(st.sampled_from([0.0, 0.0, 0.3])) if layers > 1 else 0.0
    with_state = draw(st.booleans())
    seed = draw(st.integers(0, 2**16))
    return dict(
        dtype=dtype,
        T=T,
        B=B,
        I=I,
        H=H,
        layers=layers,
        bidirectional=bidirectional,
        proj=proj,
        bias=bias,
        batch_first=batch_first,
        lengths=lengths,
        dropout=dropout,
        with_state=with_state,
        seed=seed,
    )


def _run_lstm(backend, case, module, x, hx, cast=None):
    weights = [w.detach().to(cast or w.dtype).requires_grad_() for w in module._flat_weights]
    x = x.detach().to(cast or x.dtype).requires_grad_()
    hx = None if hx is None else tuple(h.detach().to(cast or h.dtype).requires_grad_() for h in hx)
    torch.manual_seed(case["seed"])
    out, (h_n, c_n) = fastattn.lstm(
        x,
        hx,
        weights,
        num_layers=case["layers"],
        bidirectional=case["bidirectional"],
        batch_first=case["batch_first"],
        dropout=case["dropout"],
        training=True,
        proj_size=case["proj"],
        lengths=case["lengths"],
        backend=backend,
    )
    assert fastattn.last_backend("lstm") == backend
    g = torch.Generator().manual_seed(7)
    grads = [torch.randn(t.shape, generator=g).to(t) for t in (out, h_n, c_n)]
    leaves = [x, *weights] + ([] if hx is None else list(hx))
    d = torch.autograd.grad((out, h_n, c_n), leaves, grads, allow_unused=True)
    return [out, h_n, c_n] + [torch.zeros_like(l) if gl is None else gl for l, gl in zip(leaves, d)]


@pytest.mark.parametrize("backend", ["cpu", "triton", "cuda"])
def test_fuzz_lstm(backend):
    device = backend_device(backend)
    from tolerance import assert_fa_close

    @FUZZ
    @given(case=lstm_cases(backend))
    def check(case):
        torch.manual_seed(case["seed"])
        module = torch.nn.LSTM(
            case["I"],
            case["H"],
            num_layers=case["layers"],
            bias=case["bias"],
            bidirectional=case["bidirectional"],
            proj_size=case["proj"],
        )
        module = module.to(device=device, dtype=case["dtype"])
        D, P = 1 + case["bidirectional"], case["proj"] or case["H"]
        shape = (
            (case["B"], case["T"], case["I"])
            if case["batch_first"]
            else (case["T"], case["B"], case["I"])
        )
        x = torch.randn(shape).to(device=device, dtype=case["dtype"])
        hx = None
        if case["with_state"]:
            hx = (
                torch.randn(case["layers"] * D, case["B"], P),
                torch.randn(case["layers"] * D, case["B"], case["H"]),
            )
            hx = tuple(h.to(device=device, dtype=case["dtype"]) for h in hx)
        got = _run_lstm(backend, case, module, x, hx)
        ref64 = _run_lstm("reference", case, module, x, hx, cast=torch.float64)
        low = _run_lstm("reference", case, module, x, hx)
        names = ["out", "h_n", "c_n", "dx"] + [f"dw{i}" for i in range(len(got) - 4)]
        for name, a, b, c in zip(names, got, ref64, low):
            assert a.dtype == case["dtype"], name
            floor = None
            if case["dtype"] in (torch.float32, torch.float64):
                # sums in another order than the reference's: a few ulps (the baseline, the
                # reference in the same dtype, can be exact)
                eps = torch.finfo(case["dtype"]).eps
                floor = 64 * eps * (float(b.abs().max()) + 1.0) if b.numel() else 0.0
            assert_fa_close(
                name, a, b, c, factor=2.0 if name in ("out", "h_n", "c_n") else 3.0, floor=floor
            )

    check()
