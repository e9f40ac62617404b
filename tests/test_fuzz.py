"""Differential fuzzing: hypothesis draws valid argument combinations and every kernel backend
must match the reference under FlashAttention's rule, forward and backward.

attention: lengths 1..300 (the CPU kernel's tiles are 64 queries x 64 keys, so up to five of
each, and below 16 queries it streams the keys instead), head dims 1..256 with odd ones, Dv !=
D, GQA/MQA ratios, masks of every broadcast shape (bool, float, -inf rows), key padding, causal
forms, windows, ALiBi, softcap, scale, dropout, strided layouts; float32, float16, bfloat16 and
(cpu, cuda) float64. lstm, gru, rnn: T 1..64, I and H 1..300 (the CPU kernel's gate blocks are
32 units, its GEMM panels 64 rows), 1..3 layers, bidirectional, projections (lstm), the GRU's
two forms and the RNN's two nonlinearities, lengths, dropout, batch_first, an initial state,
every dtype the backend takes.

Draws are biased towards small sizes and tile edges, and a work cap gives large lengths and
head dims small batches and head counts, so that a property costs a minute or two for 200
examples on a 2-core machine. CI runs FASTATTN_FUZZ_EXAMPLES per property (default 200),
derandomized so that a run is reproducible; `make fuzz` (FASTATTN_FUZZ=long) runs 5000 per
property with a random seed. Triton under the CPU interpreter costs seconds per example: its
properties run a sixteenth of the examples, on small sizes whose interpreter tiles are lowered to
16 and 32 so that they still cross tile edges (on a GPU: the full count and the CPU's sizes).
A failure prints the drawn arguments (hypothesis shrinks them): each becomes a regression test.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from conftest import backend_device
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_attention import check_against_reference, run_attention
from tolerance import assert_fa_close

import fastattn
from fastattn.ops import _recurrent
from fastattn.ops.attention import attention_with_weights

pytestmark = pytest.mark.usefixtures("one_thread")

LONG = os.environ.get("FASTATTN_FUZZ") == "long"
EXAMPLES = int(os.environ.get("FASTATTN_FUZZ_EXAMPLES", 5000 if LONG else 200))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=not LONG,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
INTERPRETED = not torch.cuda.is_available()  # triton runs under its CPU interpreter
# Triton's interpreter runs every tile operation as a numpy call: an example takes seconds.
TRITON_FUZZ = settings(FUZZ, max_examples=max(10, EXAMPLES // 16)) if INTERPRETED else FUZZ

_DTYPES = {
    "cpu": (torch.float32, torch.float16, torch.bfloat16, torch.float64),
    "triton": (torch.float32, torch.float16, torch.bfloat16),
    "cuda": (torch.float32, torch.float16, torch.bfloat16, torch.float64),
}
EPS64 = torch.finfo(torch.float64).eps  # 2^-52, twice float64's unit roundoff


def biased(hi: int, edges=(), small: int = 16):
    """Integers in [1, hi]: small ones, tile edges and anything up to hi, about a third each."""
    edges = sorted({e for e in edges if 1 <= e <= hi})
    options = [st.integers(1, min(small, hi)), st.integers(1, hi)]
    if edges:
        options.insert(1, st.sampled_from(edges))
    return st.one_of(*options)


def _amax(t) -> float:
    if t is None or not isinstance(t, torch.Tensor) or t.numel() == 0:
        return 0.0
    t = t.detach().double()
    finite = t[torch.isfinite(t)]
    return float(finite.abs().max()) if finite.numel() else 0.0


# ---------------------------------------------------------------------------------------------
# attention

# The CPU kernel's 64 x 64 tiles, and its short-query path below 16 queries.
CPU_LENGTH_EDGES = (15, 16, 17, 63, 64, 65, 127, 128, 129, 191, 192, 193, 255, 256, 257, 300)
HEAD_DIM_EDGES = (1, 2, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64, 65, 80, 96, 111, 127, 128)
HEAD_DIM_EDGES += (129, 160, 192, 255, 256)
# B * Hq * Lq * Lk * (D + Dv) at most, a GQA group always fitting: 0.2 s an example at the cap,
# 1 s for the largest draw (one group of 4 heads, 300 x 300, D = Dv = 256; one thread).
ATTENTION_WORK = 1 << 25


def _attention_sizes(backend: str) -> tuple[int, tuple, int]:
    """(largest length, length edges, largest head dim) drawn for `backend`."""
    if backend == "triton" and INTERPRETED:
        return 70, (15, 16, 17, 31, 32, 33, 63, 64, 65), 64  # tiles lowered to 16/32
    return 300, CPU_LENGTH_EDGES, 256


@st.composite
def attention_cases(draw, backend):
    """(q, k, v, keywords) for `backend`: tensors on its device, valid by the API's rules."""
    dtype = draw(st.sampled_from(_DTYPES[backend]))
    max_len, edges, max_d = _attention_sizes(backend)
    Lq, Lk = draw(biased(max_len, edges)), draw(biased(max_len, edges))
    D = draw(biased(max_d, HEAD_DIM_EDGES))
    Dv = draw(st.one_of(st.just(D), biased(max_d, HEAD_DIM_EDGES)))
    B, Hkv = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    group = draw(st.sampled_from([1, 2, 3, 4]))  # Hq / Hkv: MHA, GQA, MQA when Hkv = 1
    while B * Hkv * group * Lq * Lk * (D + Dv) > ATTENTION_WORK and B * Hkv > 1:
        B, Hkv = (1, Hkv) if B > 1 else (B, 1)
    Hq = Hkv * group
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    kw: dict = {}
    causal = draw(st.sampled_from([False, True, "bottom_right"]))
    if causal:
        kw["causal"] = causal
    if draw(st.booleans()):
        side = st.one_of(st.just(-1), st.integers(0, 8), st.integers(0, max_len))
        kw["window"] = (draw(side), draw(side))
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
            kw["attn_mask"] = mask.to(dtype)
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


def float64_floors(q, k, v, kw, grad_out, grad_lse) -> dict[str, float]:
    """Rounding floors of float64 attention results (out, lse, dq, dk, dv).

    For float64 the rule's baseline, the reference in the input's precision, is the float64
    reference itself (error 0), so a kernel is held to what two float64 evaluations of the same
    formula in different orders may differ by. Bounds with u = eps / 2 and gamma_n = n u, the
    error of an n-term sum relative to the sum of its terms' magnitudes, which Cauchy-Schwarz
    bounds by the product of the vectors' norms (|.| below: the largest row norm):
    - a score s = scale q.k differs by at most 2 gamma_D qk = D eps qk, qk = scale |q| |k|;
      softcap's tanh, ALiBi, the float mask and the row maximum's subtraction each round once
      more on scores up to s_max: ds;
    - a probability p = exp(s - lse) moves by ds through s and through lse, by the Lk-term sum
      of the normaliser and by exp's few ulps: relative error dp;
    - out = sum_j p_j v_j / (1 - dropout) with sum_j p_j = 1: dp of max|v| and the Lk-term sum;
    - backward: dS = P (dP - delta) with |dP - delta| <= G (dP = dO . v and delta =
      rowsum(dO * O) - dlse, Dv-term dot products); dq sums a row's keys (sum_j P_ij = 1); dk
      and dv sum a key's rows (Lq queries times the GQA group), whose probabilities add up to
      col (the largest column sum of P, from the reference's weights).
    Real differences are far smaller (rounding errors add like sqrt(n)); a kernel that
    computes any of these in float32 is about 1e-7 relative off, a wrong mask element or tile
    edge 1e-3 and more, against floors of 1e-14 to 1e-9 here.
    """
    B, Hq, Lq, D = q.shape
    Hkv, Lk, Dv = k.shape[1], k.shape[2], v.shape[3]
    group = Hq // Hkv

    def norm(t):
        return float(t.detach().double().norm(dim=-1).max()) if t.numel() else 0.0

    scale = abs(kw.get("scale", 1.0 / math.sqrt(D)))
    keep = 1.0 / (1.0 - kw.get("dropout_p", 0.0))
    qk = scale * norm(q) * norm(k)
    s_max = min(qk, kw["softcap"]) if kw.get("softcap") else qk
    s_max += _amax(kw.get("alibi_slopes")) * max(Lq, Lk)
    mask = kw.get("attn_mask")
    if mask is not None and mask.dtype.is_floating_point:
        s_max += _amax(mask)
    ds = EPS64 * (D * qk + 8 * s_max)
    dp = 2 * ds + EPS64 * (Lk + 8)
    rows = Lq * group
    _, weights = attention_with_weights(
        q.detach(), k.detach(), v.detach(), backend="reference", **dict(kw, dropout_p=0.0)
    )  # (B, Hq, Lq, Lk): the undropped probabilities
    col = float(weights.view(B, Hkv, rows, Lk).sum(2).max()) if weights.numel() else 0.0
    G = 2 * keep * norm(grad_out) * norm(v) + _amax(grad_lse)
    dS = G * (dp + 2 * EPS64 * (Dv + 2))  # per unit of probability
    return {
        "out": keep * _amax(v) * (dp + EPS64 * Lk),
        "lse": ds + EPS64 * (Lk + 8 + s_max + math.log(Lk + 1)),
        "dq": scale * _amax(k) * (dS + G * EPS64 * Lk),
        "dk": scale * _amax(q) * col * (dS + G * EPS64 * rows),
        "dv": keep * _amax(grad_out) * col * (dp + EPS64 * rows),
    }


def check_float64(backend, q, k, v, kw):
    """A float64 kernel against the float64 reference: the rule with baseline 0 and the
    floors of float64_floors; rows without a visible key exactly out 0 and lse -inf."""
    g = torch.Generator().manual_seed(99)
    B, Hq, Lq, _ = q.shape
    grad_out = torch.randn(B, Hq, Lq, v.shape[3], generator=g, dtype=q.dtype).to(q.device)
    grad_lse = (0.5 * torch.randn(B, Hq, Lq, generator=g, dtype=q.dtype)).to(q.device)
    got = run_attention(backend, q, k, v, kw, grad_out, grad_lse)
    ref = run_attention("reference", q, k, v, kw, grad_out, grad_lse)
    empty = torch.isneginf(ref[1])
    assert torch.equal(torch.isneginf(got[1]), empty), "lse -inf exactly on rows without a key"
    assert torch.all(got[0][empty] == 0), "rows without a visible key must give out 0"
    floors = float64_floors(q, k, v, kw, grad_out, grad_lse)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, ref):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        if name == "lse":
            a, b = a.masked_fill(empty, 0.0), b.masked_fill(empty, 0.0)
        assert_fa_close(name, a, b, b, floor=floors[name])


@pytest.mark.parametrize("backend", ["cpu", "triton", "cuda"])
def test_fuzz_attention(backend, monkeypatch):
    backend_device(backend)  # skips where the backend cannot run
    fuzz = FUZZ
    if backend == "triton" and INTERPRETED:
        import fastattn.triton.attention as triton_attention

        # Tiles of 16 and 32 rows (a tl.dot needs 16) instead of up to 128, so the small
        # lengths the interpreter can afford still cross tile edges.
        monkeypatch.setattr(triton_attention, "interpreter_block", lambda n: 16 if n <= 16 else 32)
        fuzz = TRITON_FUZZ

    @fuzz
    @given(case=attention_cases(backend))
    def check(case):
        q, k, v, kw = case
        if q.dtype == torch.float64:
            check_float64(backend, q, k, v, kw)
        else:
            check_against_reference(backend, q, k, v, kw)

    check()


@pytest.mark.parametrize("backend", ["cpu", "triton", "cuda"])
def test_fuzz_regression_one_key_lse_gradient(backend):
    """Found by test_fuzz_attention on an AVX512-BF16 CPU: one key, three queries, D = 1 in
    bfloat16 with an lse gradient. dk is then scale * sum_i g_i q_i (the softmax part is 0), a
    sum that cancels to 6% of its terms, and a kernel that rounds dS to bfloat16 before dK
    missed the rule by that rounding (tests/attention_floors.py: the rounding slack)."""
    device = backend_device(backend)
    rows = ([1.5391, -0.2930, -2.1719], [0.5703], [-1.0859])
    q, k, v = (torch.tensor(r).view(1, 1, -1, 1).to(torch.bfloat16).to(device) for r in rows)
    check_against_reference(backend, q, k, v, {})


# ---------------------------------------------------------------------------------------------
# lstm, gru, rnn

FAMILIES = ("lstm", "gru", "rnn")
GATES = {"lstm": 4, "gru": 3, "rnn": 1}
# The CPU kernel's 32-unit gate blocks and 64-row GEMM panels.
UNIT_EDGES = (31, 32, 33, 63, 64, 65, 95, 96, 97, 127, 128, 129, 255, 256, 257, 300)
STEP_EDGES = (1, 2, 15, 16, 17, 31, 32, 33, 63, 64)
# T * B * layers * directions * gates * H * (I + H) at most (one sequence of one layer always
# fits). The reference's per-step loop dominates: the largest draws (64 steps, 3 layers, both
# directions) take under a second (one thread).
RECURRENT_WORK = 1 << 27


@st.composite
def recurrent_cases(draw, backend, family):
    dtype = draw(st.sampled_from(_DTYPES[backend]))
    if backend == "triton" and INTERPRETED:  # tiles lowered to 16 units
        T, I, H = draw(biased(8, (1, 2))), draw(biased(40, (15, 16, 17, 33))), draw(biased(40))
    else:
        T = draw(biased(64, STEP_EDGES, small=8))
        I, H = draw(biased(300, UNIT_EDGES, small=12)), draw(biased(300, UNIT_EDGES, small=12))
    B = draw(st.integers(1, 4))
    layers = draw(st.integers(1, 3))
    bidirectional = draw(st.booleans())

    def work():
        dirs = 1 + bidirectional
        return T * B * layers * dirs * GATES[family] * H * (max(I, dirs * H) + H)

    while work() > RECURRENT_WORK and (B > 1 or layers > 1 or bidirectional):
        if B > 1:
            B = 1
        elif layers > 1:
            layers = 1
        else:
            bidirectional = False
    proj = 0
    if family == "lstm" and H > 1 and draw(st.booleans()):
        proj = draw(st.one_of(st.integers(1, min(H - 1, 16)), st.integers(1, H - 1)))
    lengths = None
    if draw(st.booleans()):
        lengths = torch.tensor(
            draw(st.lists(st.one_of(st.just(T), st.integers(0, T)), min_size=B, max_size=B))
        )
    variant = None  # the GRU's reset_after, the RNN's nonlinearity
    if family == "gru":
        variant = draw(st.booleans())
    elif family == "rnn":
        variant = draw(st.sampled_from(["tanh", "relu"]))
    return dict(
        family=family,
        dtype=dtype,
        T=T,
        B=B,
        I=I,
        H=H,
        layers=layers,
        bidirectional=bidirectional,
        proj=proj,
        variant=variant,
        bias=draw(st.booleans()),
        batch_first=draw(st.booleans()),
        lengths=lengths,
        dropout=draw(st.sampled_from([0.0, 0.0, 0.3])) if layers > 1 else 0.0,
        with_state=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )


def _module(case, device):
    """A torch module whose _flat_weights are the weights (torch's initialisation)."""
    torch.manual_seed(case["seed"])
    kw = dict(
        num_layers=case["layers"],
        bias=case["bias"],
        bidirectional=case["bidirectional"],
    )
    if case["family"] == "lstm":
        module = torch.nn.LSTM(case["I"], case["H"], proj_size=case["proj"], **kw)
    elif case["family"] == "gru":
        module = torch.nn.GRU(case["I"], case["H"], **kw)
    else:
        module = torch.nn.RNN(case["I"], case["H"], nonlinearity=case["variant"], **kw)
    return module.to(device=device, dtype=case["dtype"])


def _run_recurrent(backend, case, module, x, hx, cast=None):
    """[out, h_n(, c_n), dx, d weights..., d hx...] of fastattn.<family> on `backend`, for
    fixed random output gradients; inputs cast to `cast` when given."""
    family = case["family"]
    weights = [w.detach().to(cast or w.dtype).requires_grad_() for w in module._flat_weights]
    x = x.detach().to(cast or x.dtype).requires_grad_()
    hx = None if hx is None else [h.detach().to(cast or h.dtype).requires_grad_() for h in hx]
    kw = dict(
        num_layers=case["layers"],
        bidirectional=case["bidirectional"],
        batch_first=case["batch_first"],
        dropout=case["dropout"],
        training=True,
        lengths=case["lengths"],
        backend=backend,
    )
    torch.manual_seed(case["seed"])
    if family == "lstm":
        out, (h_n, c_n) = fastattn.lstm(
            x, None if hx is None else tuple(hx), weights, proj_size=case["proj"], **kw
        )
        outputs = (out, h_n, c_n)
    elif family == "gru":
        out, h_n = fastattn.gru(
            x, None if hx is None else hx[0], weights, reset_after=case["variant"], **kw
        )
        outputs = (out, h_n)
    else:
        out, h_n = fastattn.rnn(
            x, None if hx is None else hx[0], weights, nonlinearity=case["variant"], **kw
        )
        outputs = (out, h_n)
    assert fastattn.last_backend(family) == backend
    g = torch.Generator().manual_seed(7)
    grads = [torch.randn(t.shape, generator=g).to(t) for t in outputs]
    leaves = [x, *weights] + ([] if hx is None else hx)
    d = torch.autograd.grad(outputs, leaves, grads, allow_unused=True)
    grads = [torch.zeros_like(l) if gl is None else gl for l, gl in zip(leaves, d)]
    return [t.detach() for t in outputs] + grads


def recurrent_floor(case, ref64: torch.Tensor, dtype: torch.dtype) -> float | None:
    """The floor added to the rule for float32 and float64 results (16-bit: the rule's own).

    The reference in the same dtype (the baseline) can be exact where the kernel sums in
    another order, float64 always is. A gate's preactivation is a dot product of at most
    n = max(I, D P) + P + 2 terms (gamma_n of the sum of their magnitudes, which the
    result's magnitude, + 1, stands for: torch's init keeps |W| <= 1/sqrt(H)); the
    recurrence is contractive at that init (sigmoid' <= 1/4, tanh' <= 1, spectral radius of
    W_hh about 1/sqrt(3)), so the errors of T steps and L layers add without growing; weight
    gradients sum B T more products. A wrong gate, step or tile edge is off by 1e-3 and more."""
    if dtype not in (torch.float32, torch.float64) or ref64.numel() == 0:
        return None
    P = case["proj"] or case["H"]
    dirs = 1 + case["bidirectional"]
    n = max(case["I"], dirs * P) + P + 2 + case["B"] * case["T"]
    eps = torch.finfo(dtype).eps
    if dtype == torch.float32:  # as before: 64 ulps of the magnitude
        return 64 * eps * (_amax(ref64) + 1.0)
    return 4 * eps * n * case["T"] * case["layers"] * (_amax(ref64) + 1.0)


def check_recurrent_case(backend, family, case, device):
    """One recurrent fuzz case: `backend` against the float64 reference under FlashAttention's
    rule with recurrent_floor."""
    module = _module(case, device)
    D, P = 1 + case["bidirectional"], case["proj"] or case["H"]
    B, T, I = case["B"], case["T"], case["I"]
    shape = (B, T, I) if case["batch_first"] else (T, B, I)
    x = torch.randn(shape).to(device=device, dtype=case["dtype"])
    hx = None
    if case["with_state"]:
        hx = [torch.randn(case["layers"] * D, B, P)]
        if family == "lstm":
            hx.append(torch.randn(case["layers"] * D, B, case["H"]))
        hx = [h.to(device=device, dtype=case["dtype"]) for h in hx]
    got = _run_recurrent(backend, case, module, x, hx)
    ref64 = _run_recurrent("reference", case, module, x, hx, cast=torch.float64)
    low = _run_recurrent("reference", case, module, x, hx)
    states = ["h_n", "c_n"] if family == "lstm" else ["h_n"]
    names = ["out", *states, "dx"] + [f"d{i}" for i in range(len(got) - 2 - len(states))]
    for name, a, b, c in zip(names, got, ref64, low):
        assert a.dtype == case["dtype"], name
        floor = recurrent_floor(case, b, a.dtype)
        factor = 2.0 if name in ("out", "h_n", "c_n") else 3.0
        assert_fa_close(name, a, b, c, factor=factor, floor=floor)


def test_fuzz_regression_bf16_dropout_between_layers():
    """Found by test_fuzz_recurrent on an AVX512-BF16 CPU: a two-layer bfloat16 tanh RNN with
    dropout 0.3 between the layers. The second layer's input projection ran in bfloat16 dot
    products on the dropped-out input rounded back to bfloat16, so the 1 / (1 - p) scale was
    rounded and a weight gradient missed the rule (9.2e-3 against 4.2e-3); the bfloat16
    projection now takes bfloat16 inputs only without dropout."""
    case = dict(
        family="rnn",
        dtype=torch.bfloat16,
        T=29,
        B=1,
        I=2,
        H=1,
        layers=2,
        bidirectional=False,
        proj=0,
        variant="tanh",
        bias=False,
        batch_first=False,
        lengths=None,
        dropout=0.3,
        with_state=False,
        seed=0,
    )
    check_recurrent_case("cpu", "rnn", case, torch.device("cpu"))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("backend", ["cpu", "triton", "cuda"])
def test_fuzz_recurrent(backend, family, monkeypatch):
    device = backend_device(backend)
    if family != "lstm":
        reason = _recurrent.unsupported_backends(family).get(backend)
        if reason is not None:
            pytest.skip(f"backend {backend}: {reason}")
    fuzz = FUZZ
    if backend == "triton" and INTERPRETED:
        import fastattn.triton.recurrent as triton_lstm

        # 16-unit tiles, so the small sizes the interpreter can afford cross tile edges.
        monkeypatch.setattr(triton_lstm, "INTERPRETER_MAX_BLOCK", 16)
        fuzz = TRITON_FUZZ

    @fuzz
    @given(case=recurrent_cases(backend, family))
    def check(case):
        check_recurrent_case(backend, family, case, device)

    check()
