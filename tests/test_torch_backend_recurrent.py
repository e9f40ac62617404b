"""The torch backend of the recurrent ops (fastattn/aten/lstm.py, gru.py, rnn.py): torch's own
LSTM / GRU / Elman RNN kernels and cells, run through fastattn.lstm, gru, rnn and their cells.

1. Every call it accepts, on the CPU, against the float64 reference backend (an independent
   per-step loop, fastattn/reference): outputs, final states and the gradients of the input,
   the initial states and every weight, under FlashAttention's rule (tests/tolerance.py) in
   float32, bfloat16 and float16, and to float64 round-off in float64. The checks have teeth:
   a gradient or output scaled by 0 or 1.25 (16-bit), 1 + 1e-3 (float32) fails them.
2. Every refused feature raises BackendError naming it, one test per feature.
3. A forced call records "torch"; with no speed table the automatic choice keeps fastattn's
   kernel, and a table that measured torch faster for the call's key picks it (unless the call
   has a refused feature).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_check_teeth import assert_each_scaling_fails
from tolerance import assert_fa_close, assert_grad_close, float32_floor

import fastattn
from fastattn import _backend, speed_table
from fastattn.aten import _recurrent as aten_recurrent

pytestmark = pytest.mark.usefixtures("one_thread")

F64 = torch.float64
LOW = (torch.float32, torch.bfloat16, torch.float16)
DTYPE_IDS = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16", F64: "f64"}
KINDS = ("lstm", "gru", "rnn-tanh", "rnn-relu")


def op_name(kind: str) -> str:
    return kind.split("-")[0]


def variant_kw(kind: str) -> dict:
    return {"rnn-tanh": dict(nonlinearity="tanh"), "rnn-relu": dict(nonlinearity="relu")}.get(
        kind, {}
    )


def gates(kind: str) -> int:
    return {"lstm": 4, "gru": 3}.get(op_name(kind), 1)


# Small, odd sizes: the reference is a per-step Python loop. Lengths unsorted, with a 0 (the row
# torch's packing refuses) and a full-length row.
CASES = {
    "plain": dict(T=9, B=4, I=5, H=6),
    "deep-bidir-lengths": dict(
        T=8, B=5, I=4, H=6, num_layers=2, bidirectional=True, lengths=[3, 8, 0, 5, 1]
    ),
    "batch_first-nobias": dict(T=6, B=3, I=5, H=7, batch_first=True, bias=False),
    "unbatched-bidir": dict(T=7, B=None, I=3, H=5, bidirectional=True),
    "proj-deep-lengths": dict(
        T=7, B=4, I=5, H=6, num_layers=2, bidirectional=True, proj_size=4, lengths=[7, 2, 0, 4]
    ),
}
LSTM_ONLY = {"proj-deep-lengths"}
CASE_IDS = [
    (kind, case) for kind in KINDS for case in CASES if case not in LSTM_ONLY or kind == "lstm"
]


def make_case(kind: str, case: str, seed: int = 0):
    """(leaves in float64: input, initial states, weights; keyword arguments of the op)."""
    spec = dict(CASES[case])
    T, B, I, H = (spec.pop(k) for k in ("T", "B", "I", "H"))
    layers = spec.get("num_layers", 1)
    D = 2 if spec.get("bidirectional", False) else 1
    P = spec.get("proj_size", 0) or H
    bias = spec.pop("bias", True)
    lengths = spec.pop("lengths", None)
    G = gates(kind)
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(shape, generator=g, dtype=F64) * scale

    weights = []
    for layer in range(layers):
        for _ in range(D):
            weights += [
                randn(G * H, I if layer == 0 else D * P, scale=0.4),
                randn(G * H, P, scale=0.4),
            ]
            if bias:
                weights += [randn(G * H, scale=0.3), randn(G * H, scale=0.3)]
            if spec.get("proj_size", 0):
                weights.append(randn(P, H, scale=0.4))
    batch = () if B is None else (B,)
    x_shape = (*batch, T, I) if spec.get("batch_first") else (T, *batch, I)
    states = [randn(layers * D, *batch, P)]
    if kind == "lstm":
        states.append(randn(layers * D, *batch, H))
    kw = dict(spec, num_layers=layers, **variant_kw(kind))
    if lengths is not None:
        kw["lengths"] = torch.tensor(lengths)
    return [randn(*x_shape), *states, *weights], kw


def run_op(kind: str, backend: str, dtype: torch.dtype, leaves64, kw, forward_context=None):
    """The op on `backend` with every leaf cast to dtype: ({name: result}, {name: gradient})
    for a fixed random loss of every result. forward_context: a context manager the forward
    runs in (the backward runs outside it)."""
    leaves = [t.to(dtype).requires_grad_() for t in leaves64]
    n_states = 2 if kind == "lstm" else 1
    x, states, weights = leaves[0], leaves[1 : 1 + n_states], leaves[1 + n_states :]
    fn = getattr(fastattn, op_name(kind))
    with forward_context or contextlib.nullcontext():
        out, final = fn(
            x, tuple(states) if kind == "lstm" else states[0], weights, backend=backend, **kw
        )
    assert fastattn.last_backend(op_name(kind)) == backend
    finals = final if kind == "lstm" else (final,)
    results = {"output": out, "h_n": finals[0]}
    if kind == "lstm":
        results["c_n"] = finals[1]
    g = torch.Generator().manual_seed(7)
    loss = sum(
        (t.double() * torch.randn(t.shape, generator=g, dtype=F64)).sum() for t in results.values()
    )
    names = (
        ["input", "h0"]
        + (["c0"] if kind == "lstm" else [])
        + [f"w{i}" for i in range(len(weights))]
    )
    grads = torch.autograd.grad(loss, leaves)
    return (
        {k: v.detach() for k, v in results.items()},
        {f"grad_{name}": gr for name, gr in zip(names, grads)},
    )


def compare(kind: str, dtype: torch.dtype, leaves64, kw):
    """{name: (torch backend's result, float64 reference, reference in dtype)} over results and
    gradients, the inputs rounded to dtype first (both sides see the same values)."""
    leaves64 = [t.to(dtype).to(F64) for t in leaves64]
    return merge(
        [
            run_op(kind, be, dt, leaves64, kw)
            for be, dt in (("torch", dtype), ("reference", F64), ("reference", dtype))
        ]
    )


def merge(runs):
    """[(results, gradients) of the torch backend, the float64 reference, the reference in
    the input's dtype] -> {name: (ours, ref64, ref_lowp)}."""
    return {
        name: tuple(run[part][name] for run in runs) for part in range(2) for name in runs[0][part]
    }


def check(results, tamper=None):
    """FlashAttention's rule for every entry of `compare`'s results (float64: round-off);
    tamper {name: factor} scales that entry of the torch backend's side first."""
    tamper = tamper or {}
    for name, (ours, ref64, ref_lowp) in results.items():
        ours = ours * tamper[name] if name in tamper else ours
        assert ours.dtype == ref_lowp.dtype, f"{name}: dtype {ours.dtype} != {ref_lowp.dtype}"
        if ours.dtype == F64:
            torch.testing.assert_close(
                ours, ref64, rtol=1e-9, atol=1e-11, msg=lambda m, name=name: f"{name}: {m}"
            )
            continue
        # float32: a float32 accumulation in another order than the reference's (oneDNN's
        # GEMMs); tolerance.py's float32 floor allows a few ulps of the magnitude for that.
        floor = float32_floor(ref64, ours.dtype)
        assert_rule = assert_grad_close if name.startswith("grad_") else assert_fa_close
        assert_rule(name, ours, ref64, ref_lowp, floor=floor)


# ---------------------------------------------------------------------------------------------
# 1. Accuracy against the float64 reference


@pytest.mark.parametrize("dtype", (*LOW, F64), ids=lambda d: DTYPE_IDS[d])
@pytest.mark.parametrize("kind,case", CASE_IDS, ids=[f"{k}-{c}" for k, c in CASE_IDS])
@pytest.mark.parametrize("backend", ["torch"])
def test_layers_match_reference(backend, kind, case, dtype):
    leaves64, kw = make_case(kind, case)
    check(compare(kind, dtype, leaves64, kw))


CELL_KINDS = ("lstm", "gru", "rnn-tanh", "rnn-relu")


def make_cell(kind: str, B: int | None, bias: bool, seed: int = 1):
    I, H, G = 7, 6, gates(kind)
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0):
        return torch.randn(shape, generator=g, dtype=F64) * scale

    batch = () if B is None else (B,)
    leaves = [randn(*batch, I), randn(*batch, H)] + ([randn(*batch, H)] if kind == "lstm" else [])
    leaves += [randn(G * H, I, scale=0.4), randn(G * H, H, scale=0.4)]
    if bias:
        leaves += [randn(G * H, scale=0.3), randn(G * H, scale=0.3)]
    return leaves


def run_cell(kind: str, backend: str, dtype: torch.dtype, leaves64):
    leaves = [t.to(dtype).requires_grad_() for t in leaves64]
    fn = getattr(fastattn, op_name(kind) + "_cell")
    if kind == "lstm":
        hy, cy = fn(*leaves, backend=backend)
        results = {"hy": hy, "cy": cy}
    else:
        results = {"hy": fn(*leaves, backend=backend, **variant_kw(kind))}
    assert fastattn.last_backend(op_name(kind) + "_cell") == backend
    g = torch.Generator().manual_seed(7)
    loss = sum(
        (t.double() * torch.randn(t.shape, generator=g, dtype=F64)).sum() for t in results.values()
    )
    grads = torch.autograd.grad(loss, leaves)
    return {k: v.detach() for k, v in results.items()}, {
        f"grad_{i}": gr for i, gr in enumerate(grads)
    }


@pytest.mark.parametrize("dtype", (*LOW, F64), ids=lambda d: DTYPE_IDS[d])
@pytest.mark.parametrize(
    "B,bias", [(5, True), (3, False), (None, True)], ids=["b5", "nobias", "unbatched"]
)
@pytest.mark.parametrize("kind", CELL_KINDS)
@pytest.mark.parametrize("backend", ["torch"])
def test_cells_match_reference(backend, kind, B, bias, dtype):
    check(compare_cell(kind, dtype, B, bias))


def compare_cell(kind: str, dtype: torch.dtype, B: int | None, bias: bool):
    leaves64 = [t.to(dtype).to(F64) for t in make_cell(kind, B, bias)]
    return merge(
        [
            run_cell(kind, be, dt, leaves64)
            for be, dt in (("torch", dtype), ("reference", F64), ("reference", dtype))
        ]
    )


@pytest.mark.parametrize("dtype", (*LOW, F64), ids=lambda d: DTYPE_IDS[d])
@pytest.mark.parametrize("kind", KINDS)
def test_checks_catch_scaled_results(kind, dtype):
    """Each result and gradient of the torch backend, scaled, fails `check` (the unscaled
    ones pass): the rule's floors leave no room for a wrong factor."""
    case = "proj-deep-lengths" if kind == "lstm" else "deep-bidir-lengths"
    leaves64, kw = make_case(kind, case)
    results = compare(kind, dtype, leaves64, kw)
    # float64 gets the 16-bit factors (tests/test_check_teeth.py: all but float32)
    assert_each_scaling_fails(check, results, tuple(results), dtype)


@pytest.mark.parametrize("dtype", (*LOW, F64), ids=lambda d: DTYPE_IDS[d])
@pytest.mark.parametrize("kind", CELL_KINDS)
def test_cell_checks_catch_scaled_results(kind, dtype):
    results = compare_cell(kind, dtype, 5, True)
    assert_each_scaling_fails(check, results, tuple(results), dtype)


@pytest.mark.parametrize("backend", ["torch"])
def test_autocast_leaves_the_compute_type(backend):
    """Under an enclosing CPU autocast (bfloat16) the torch backend still computes fastattn's
    definition for the tensors' dtype (float32 here), as the other backends do: its float32
    results pass the float32 rule against the references run without autocast."""
    kind = "lstm"
    leaves64, kw = make_case(kind, "deep-bidir-lengths")
    leaves64 = [t.float().double() for t in leaves64]
    # the backward outside autocast, as torch recommends (inside, every backend's backward
    # runs its GEMMs in bfloat16)
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    ours = run_op(kind, backend, torch.float32, leaves64, kw, forward_context=autocast)
    results = merge(
        [ours] + [run_op(kind, "reference", dt, leaves64, kw) for dt in (F64, torch.float32)]
    )
    assert all(r[0].dtype == torch.float32 for r in results.values())
    check(results)


@pytest.mark.parametrize("backend", ["torch"])
def test_modules_run_on_the_torch_backend(backend):
    """fastattn.nn's drop-ins under use_backend("torch"), PackedSequence included (its
    lengths reach the op on the host), against the reference backend in float64."""
    torch.manual_seed(3)
    seqs = [torch.randn(n, 4, dtype=F64) for n in (5, 2, 4)]
    packed = torch.nn.utils.rnn.pack_sequence(seqs, enforce_sorted=False)
    for module in (
        fastattn.nn.LSTM(4, 6, num_layers=2, bidirectional=True),
        fastattn.nn.GRU(4, 6, bidirectional=True),
        fastattn.nn.RNN(4, 6, nonlinearity="relu"),
    ):
        module = module.double()
        name = type(module).__name__.lower()
        with fastattn.use_backend("reference"):
            expected, expected_final = module(packed)
        with fastattn.use_backend(backend):
            got, final = module(packed)
        assert fastattn.last_backend(name) == backend
        torch.testing.assert_close(got.data, expected.data, rtol=1e-9, atol=1e-11)
        torch.testing.assert_close(final, expected_final, rtol=1e-9, atol=1e-11)


# ---------------------------------------------------------------------------------------------
# 2. Refusals: each raises BackendError naming the feature


def _stack(kind: str, layers: int):
    """(x, hx, weights) of a `layers`-deep float32 call from fastattn.nn's parameters."""
    H = 4
    if kind == "lstm":
        module = fastattn.nn.LSTM(3, H, num_layers=layers)
    elif kind == "gru":
        module = fastattn.nn.GRU(3, H, num_layers=layers)
    else:
        module = fastattn.nn.RNN(3, H, num_layers=layers, **variant_kw(kind))
    x = torch.randn(5, 2, 3)
    h0 = torch.randn(layers, 2, H)
    hx = (h0, torch.randn(layers, 2, H)) if kind == "lstm" else h0
    return x, hx, [w.detach() for w in module._weights()]


@pytest.mark.parametrize("kind", KINDS)
def test_refuses_dropout_in_training(kind):
    x, hx, weights = _stack(kind, 2)
    fn = getattr(fastattn, op_name(kind))
    kw = dict(num_layers=2, dropout=0.3, **variant_kw(kind))
    with pytest.raises(fastattn.BackendError, match="dropout > 0 in training"):
        fn(x, hx, weights, training=True, backend="torch", **kw)
    # no dropout in effect: outside training, or one layer (no layer in between)
    fn(x, hx, weights, training=False, backend="torch", **kw)
    assert fastattn.last_backend(op_name(kind)) == "torch"
    x1, hx1, w1 = _stack(kind, 1)
    fn(x1, hx1, w1, num_layers=1, dropout=0.3, training=True, backend="torch", **variant_kw(kind))
    assert fastattn.last_backend(op_name(kind)) == "torch"


def test_refuses_reset_before_gru():
    x, hx, weights = _stack("gru", 1)
    with pytest.raises(fastattn.BackendError, match="reset_after=False"):
        fastattn.gru(x, hx, weights, num_layers=1, reset_after=False, backend="torch")


def test_refuses_reset_before_gru_cell():
    w_ih, w_hh = torch.randn(12, 3), torch.randn(12, 4)
    with pytest.raises(fastattn.BackendError, match="reset_after=False"):
        fastattn.gru_cell(torch.randn(2, 3), None, w_ih, w_hh, reset_after=False, backend="torch")


@pytest.mark.parametrize("kind", KINDS)
def test_refuses_an_empty_sequence(kind):
    x, hx, weights = _stack(kind, 1)
    fn = getattr(fastattn, op_name(kind))
    with pytest.raises(fastattn.BackendError, match=r"T = 0"):
        fn(x[:0], hx, weights, num_layers=1, backend="torch", **variant_kw(kind))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", KINDS)
def test_refuses_lengths_on_a_cuda_device(kind):
    x, hx, weights = _stack(kind, 1)
    hx = tuple(h.cuda() for h in hx) if kind == "lstm" else hx.cuda()
    weights = [w.detach().cuda() for w in weights]
    lengths = torch.tensor([5, 3], device="cuda")
    fn = getattr(fastattn, op_name(kind))
    with pytest.raises(fastattn.BackendError, match="lengths on a cuda device"):
        fn(
            x.cuda(),
            hx,
            weights,
            num_layers=1,
            lengths=lengths,
            backend="torch",
            **variant_kw(kind),
        )


@pytest.mark.parametrize("kind", KINDS)
def test_refuses_layers_under_compile(kind, monkeypatch):
    """Dynamo refuses torch's RNN modules and Inductor fails on oneDNN's LSTM: the layers are
    refused while torch.compile traces (simulated: the refusal reads
    torch.compiler.is_compiling; a real trace of a refused forced call would fall back to
    eager, where the call is accepted)."""
    x, hx, weights = _stack(kind, 1)
    fn = getattr(fastattn, op_name(kind))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with pytest.raises(fastattn.BackendError, match="under torch.compile"):
        fn(x, hx, weights, num_layers=1, backend="torch", **variant_kw(kind))


def test_cells_compile_fullgraph():
    """The cells are GEMMs and pointwise ops: they trace whole under torch.compile."""
    torch.manual_seed(4)
    H = 6
    w = [torch.randn(4 * H, 5), torch.randn(4 * H, H), torch.randn(3 * H, 5), torch.randn(3 * H, H)]
    w = [t.double() for t in w]

    def step(x, h, backend):
        hy, cy = fastattn.lstm_cell(x, h, h, w[0], w[1], backend=backend)
        return fastattn.gru_cell(x, hy + cy, w[2], w[3], backend=backend)

    x, h = torch.randn(3, 5, dtype=F64), torch.randn(3, H, dtype=F64)
    compiled = torch.compile(step, fullgraph=True, backend="eager")
    got = compiled(x, h, "torch")
    assert fastattn.last_backend("gru_cell") == "torch"
    torch.testing.assert_close(got, step(x, h, "reference"), rtol=1e-9, atol=1e-11)


def test_refuses_onednn_reduced_precision_lstm():
    """oneDNN's LSTM set to bf16 float32 math (torch.backends.mkldnn.rnn.fp32_precision) is not
    fastattn's float32: refused for float32 (and 16-bit, computed in float32), not float64; the
    GRU and RNN, which torch runs without oneDNN, are unaffected."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.backends.mkldnn, "rnn"):
        pytest.skip("no oneDNN RNN precision setting in this torch")
    before = torch.backends.mkldnn.rnn.fp32_precision
    x, hx, weights = _stack("lstm", 1)
    try:
        torch.backends.mkldnn.rnn.fp32_precision = "bf16"
        for dtype in (torch.float32, torch.bfloat16):
            cast = (x.to(dtype), tuple(h.to(dtype) for h in hx), [w.to(dtype) for w in weights])
            with pytest.raises(fastattn.BackendError, match="oneDNN's LSTM computes in bf16"):
                fastattn.lstm(*cast, num_layers=1, backend="torch")
        cast = (x.double(), tuple(h.double() for h in hx), [w.double() for w in weights])
        fastattn.lstm(*cast, num_layers=1, backend="torch")
        gx, gh, gw = _stack("gru", 1)
        fastattn.gru(gx, gh, gw, num_layers=1, backend="torch")
        assert fastattn.last_backend("gru") == "torch"
    finally:
        torch.backends.mkldnn.rnn.fp32_precision = before


def test_refuses_cudnn_tf32():
    """cuDNN's RNNs in TF32 (torch's default setting) are not fastattn's float32: the reason
    for CUDA layer calls, which no GPU is needed to ask; 'ieee' clears it, and neither cells
    nor float64 are concerned."""
    if not hasattr(torch.backends.cudnn, "rnn") or not torch.backends.cudnn.is_available():
        pytest.skip("no cuDNN RNN precision setting here")
    before = torch.backends.cudnn.rnn.fp32_precision
    cuda = torch.device("cuda")
    try:
        torch.backends.cudnn.rnn.fp32_precision = "tf32"
        why = aten_recurrent.refusal(cuda, torch.float32, seq_len=5, dropout_p=0.0, lengths=None)
        assert why is not None and "TF32" in why and "fp32_precision" in why
        assert aten_recurrent.refusal(cuda, torch.bfloat16, seq_len=5, dropout_p=0.0, lengths=None)
        assert aten_recurrent.refusal(cuda, F64, seq_len=5, dropout_p=0.0, lengths=None) is None
        torch.backends.cudnn.rnn.fp32_precision = "ieee"
        assert (
            aten_recurrent.refusal(cuda, torch.float32, seq_len=5, dropout_p=0.0, lengths=None)
            is None
        )
    finally:
        torch.backends.cudnn.rnn.fp32_precision = before


# ---------------------------------------------------------------------------------------------
# 3. Backend choice


def _all_six_calls():
    """One small float32 call of each recurrent op: {op name: call(**backend kwargs)}."""
    calls = {}
    for kind in ("lstm", "gru", "rnn-tanh"):
        x, hx, weights = _stack(kind, 1)
        fn = getattr(fastattn, op_name(kind))
        calls[op_name(kind)] = lambda fn=fn, x=x, hx=hx, w=weights, **kw: fn(
            x, hx, w, num_layers=1, **kw
        )
    B, I, H = 2, 3, 4
    x, h = torch.randn(B, I), torch.randn(B, H)
    calls["lstm_cell"] = lambda **kw: fastattn.lstm_cell(
        x, h, h, torch.randn(4 * H, I), torch.randn(4 * H, H), **kw
    )
    calls["gru_cell"] = lambda **kw: fastattn.gru_cell(
        x, h, torch.randn(3 * H, I), torch.randn(3 * H, H), **kw
    )
    calls["rnn_cell"] = lambda **kw: fastattn.rnn_cell(
        x, h, torch.randn(H, I), torch.randn(H, H), **kw
    )
    return calls


def test_forced_calls_record_torch():
    for op, call in _all_six_calls().items():
        assert _backend.torch_implements(op), op
        call(backend="torch")
        assert fastattn.last_backend(op) == "torch", op
        call(backend="cpu")
        with fastattn.use_backend("torch"):
            call()
        assert fastattn.last_backend(op) == "torch", op


@pytest.fixture
def speed_tables(monkeypatch):
    """Installs speed tables for this test (a list the test fills), restored after."""
    installed: list[dict] = []
    monkeypatch.setattr(speed_table, "tables", lambda: installed)
    monkeypatch.setattr(_backend, "AUTO_MODE", "table")
    speed_table.reset()
    yield installed
    speed_table.reset()


def _entry(op, features="plain", grad=False, faster="torch"):
    return {
        "op": op,
        "dtype": "float32",
        "head_dim": "<=64",  # the hidden size's class (the calls below: H = 4)
        "length": "<=256",
        "features": features,
        "pass": "fwd+bwd" if grad else "fwd",
        "faster": faster,
    }


def test_default_choice_keeps_the_kernel_without_a_table(speed_tables):
    if fastattn.available_backends()["cpu"] != "available":
        pytest.skip("no cpu backend in this build")
    for op, call in _all_six_calls().items():
        call()
        assert fastattn.last_backend(op) == "cpu", op


def test_a_table_that_measured_torch_faster_picks_it(speed_tables):
    """The call's key (op, dtype, the hidden size's class, the length class of T, the
    features, the pass)
    matches the table's entry field by field; a refused call keeps the kernel."""
    if fastattn.available_backends()["cpu"] != "available":
        pytest.skip("no cpu backend in this build")
    calls = _all_six_calls()
    speed_tables.append(
        {
            "device_class": speed_table.device_class(torch.device("cpu")),
            "module": "synthetic",
            "entries": [_entry(op) for op in calls]
            + [_entry("gru", "multilayer"), _entry("gru", "dropout+multilayer")],
        }
    )
    for op, call in calls.items():
        call()
        assert fastattn.last_backend(op) == "torch", op
    # another key (a gradient is needed): not in the table, the kernel runs
    x, hx, weights = _stack("gru", 1)
    fastattn.gru(x.requires_grad_(), hx, weights, num_layers=1)
    assert fastattn.last_backend("gru") == "cpu"
    # in the table, but dropout in training is refused by the torch backend
    x, hx, weights = _stack("gru", 2)
    fastattn.gru(x, hx, weights, num_layers=2)
    assert fastattn.last_backend("gru") == "torch"
    fastattn.gru(x, hx, weights, num_layers=2, dropout=0.5, training=True)
    assert fastattn.last_backend("gru") == "cpu"
