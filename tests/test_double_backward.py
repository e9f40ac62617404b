"""Second-order gradients: a backward taken with create_graph=True (gradient penalties, MAML)
must itself be differentiable and correct, never silently None or zero.

What is tested, and how often: the kernels' backward ops have no derivative. With grad mode on
inside the backward, an op's autograd formula differentiates the op's plain-PyTorch reference
instead (fastattn/contracts/__init__.py: backward_through_reference). That formula is one
function per op (fastattn/contracts/<op>.py), registered with the same reference for the native
op (cpu and cuda: one op, dispatched by device) and for its Triton twin (ops/_common.py:
register_forward_backward; ops/lstm.py, ops/positional.py, ops/_recurrent.py: _register). So
every backend's second derivative is the reference's double backward: gradgradcheck checks it
once per op and variant (float64, through the cpu op, i.e. through the formula and
backward_through_reference), and `test_*_create_graph_reaches_the_reference` checks per kernel
backend only that its create_graph backward is routed there (a second derivative exists, is not
zero, and is the reference's). The exceptions are the ops whose backward is itself a kernel
with its own derivative (apply_rotary: a rotation by the opposite angle; add_sinusoidal, linear
in the gradient): their gradgradchecks test each kernel backend (test_positional.py for
add_sinusoidal). The drop-in modules' gradient penalties are compared with torch's own."""

import pytest
import torch
from conftest import backend_device

import fastattn
import fastattn.reference.attention

F64 = torch.float64
GG = dict(eps=1e-6, atol=1e-5, rtol=1e-4)
KERNEL_BACKENDS = ("cpu", "cuda", "triton")


def _rand(*shape, dtype=F64, device="cpu", scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed + sum(shape))
    return (torch.randn(*shape, generator=g, dtype=dtype) * scale).to(device).requires_grad_()


def _attention_args(device, dtype, variant):
    B, Hq, Hkv, Lq, Lk, D, Dv = 2, 4, 2, 5, 6, 8, 4
    q = _rand(B, Hq, Lq, D, dtype=dtype, device=device)
    k = _rand(B, Hkv, Lk, D, dtype=dtype, device=device, seed=1)
    v = _rand(B, Hkv, Lk, Dv, dtype=dtype, device=device, seed=2)
    mask = padding = alibi = seed = None
    scale, softcap, lo, hi, p = D**-0.5, 0.0, -(1 << 30), 1 << 30, 0.0
    if variant in ("causal-softcap-alibi", "everything"):
        hi, softcap = Lk - Lq, 2.0
        alibi = torch.rand(B, Hq, dtype=torch.float32).to(device)
    if variant in ("float-mask-padding", "everything"):
        mask = torch.randn(B, Hq, Lq, Lk, dtype=dtype).to(device)
        padding = torch.zeros(B, Lk, dtype=torch.bool, device=device)
        padding[1, -2:] = True
    if variant in ("dropout", "everything"):
        p, seed = 0.3, torch.tensor([3, 4], dtype=torch.int64, device=device)
    return (q, k, v), (mask, padding, alibi, scale, softcap, lo, hi, p, seed)


def _attention_fn(backend, rest):
    """fn(q, k, v) -> (out, lse) of backend's attention op on the canonical arguments `rest`
    (the reference's function for backend "reference")."""
    mask, padding, alibi, scale, softcap, lo, hi, p, seed = rest
    op = (
        torch.ops.fastattn.attention_forward_triton
        if backend == "triton"
        else torch.ops.fastattn.attention_forward
    )

    def fn(q, k, v):
        if backend == "reference":
            return fastattn.reference.attention.attention(
                q, k, v, mask, padding, alibi, scale, softcap, lo, hi, p, seed
            )
        return op(q, k, v, mask, padding, alibi, scale, softcap, lo, hi, p, seed)

    return fn


VARIANTS = ["plain", "causal-softcap-alibi", "float-mask-padding", "dropout"]


@pytest.mark.parametrize("variant", VARIANTS)
def test_attention_reference_double_backward_gradgradcheck(variant):
    """The reference's double backward of attention (out and lse), reached through the
    attention op's autograd formula (the cpu op here; cuda and triton register the same
    formula with the same reference), against finite differences of its backward."""
    device = backend_device("cpu")
    inputs, rest = _attention_args(device, F64, variant)
    assert torch.autograd.gradgradcheck(_attention_fn("cpu", rest), inputs, **GG)


def _second_order(fn, inputs):
    """Gradient penalty: (d loss / d inputs, d/d inputs of sum((d loss / d inputs)^2))."""
    out, lse = fn(*inputs)
    loss = (out.float() ** 2).sum() + lse.float().sum()
    grads = torch.autograd.grad(loss, inputs, create_graph=True)
    assert all(g.requires_grad for g in grads), "the create_graph backward is not differentiable"
    penalty = sum((g.float() ** 2).sum() for g in grads)
    return [g.detach() for g in grads], torch.autograd.grad(penalty, inputs)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_attention_create_graph_reaches_the_reference(backend):
    """Routing, not accuracy (the gradgradcheck above covers the reference's double
    backward): a kernel backend's create_graph=True backward is differentiable, its second
    derivative is not zero, and it is the reference's on the same inputs (float32: the kernel's
    forward output enters the loss, so within float32 rounding), masks, ALiBi, softcap and the
    dropout seed all passed on."""
    device = backend_device(backend)
    inputs, rest = _attention_args(device, torch.float32, "everything")
    first, second = _second_order(_attention_fn(backend, rest), inputs)
    ref_first, ref_second = _second_order(_attention_fn("reference", rest), inputs)
    assert all(float(s.abs().max()) > 0 for s in second)
    for got, want in zip(first + list(second), ref_first + list(ref_second)):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_varlen_attention_reference_double_backward_gradgradcheck():
    """The reference's double backward of varlen_attention, through the cpu op's formula."""
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    q, k = _rand(7, 2, 4), _rand(7, 1, 4, seed=1)
    v = _rand(7, 1, 3, seed=2)

    def fn(q, k, v):
        return fastattn.varlen_attention(
            q, k, v, cu, cu, 4, 4, causal=True, return_lse=True, backend="cpu"
        )

    assert torch.autograd.gradgradcheck(fn, (q, k, v), **GG)


def test_additive_attention_reference_double_backward_gradgradcheck():
    """The reference's double backward of additive (Bahdanau) attention, through the cpu
    ops' formulas (additive_scores, additive_context)."""
    query, keys, values = _rand(2, 3, 4), _rand(2, 5, 4, seed=1), _rand(2, 5, 3, seed=2)
    w_query, w_keys, v = _rand(6, 4, seed=3), _rand(6, 4, seed=4), _rand(6, seed=5)

    def fn(query, keys, values, w_query, w_keys, v):
        return fastattn.additive_attention(
            query, keys, values, w_query=w_query, w_keys=w_keys, v=v, backend="cpu"
        )

    assert torch.autograd.gradgradcheck(fn, (query, keys, values, w_query, w_keys, v), **GG)


@pytest.mark.parametrize("bias", [True, False])
def test_lstm_cell_reference_double_backward_gradgradcheck(bias):
    """The reference's double backward of lstm_cell, through the cpu op's formula (the cuda
    op is the same op and formula)."""
    shapes = [(3, 4), (3, 5), (3, 5), (20, 4), (20, 5)] + ([(20,), (20,)] if bias else [])
    args = [_rand(*s, scale=0.5, seed=i) for i, s in enumerate(shapes)]
    args += [] if bias else [None, None]
    assert torch.autograd.gradgradcheck(
        lambda *a: fastattn.lstm_cell(*a, backend="cpu"), args, **GG
    )


@pytest.mark.parametrize("variant", ["plain", "bidir-proj-lengths", "dropout"])
def test_lstm_layer_reference_double_backward_gradgradcheck(variant):
    """The reference's double backward of lstm_layer (projections, lengths, dropout), through
    the native op's formula on CPU tensors."""
    backend_device("cpu")
    T, B, I, H = 4, 3, 3, 4
    D, P = (2, 2) if variant == "bidir-proj-lengths" else (1 if variant == "plain" else 2, H)
    tensors = [
        _rand(T, B, I),
        _rand(D, B, P, seed=1),
        _rand(D, B, H, seed=2),
        _rand(D, 4 * H, I, scale=0.5, seed=3),
        _rand(D, 4 * H, P, scale=0.5, seed=4),
        _rand(D, 4 * H, seed=5),
        _rand(D, 4 * H, seed=6),
        _rand(D, P, H, scale=0.5, seed=7) if P != H else None,
    ]
    lengths = torch.tensor([4, 2, 1]) if variant == "bidir-proj-lengths" else None
    p, seed = (0.3, torch.tensor([5, 6])) if variant == "dropout" else (0.0, None)

    def fn(*ts):
        out, h_n, c_n, _ = torch.ops.fastattn.lstm_layer(*ts, lengths, p, seed, True)
        return out, h_n, c_n

    assert torch.autograd.gradgradcheck(fn, tensors, **GG)


@pytest.mark.parametrize("family", ["gru", "gru-textbook", "rnn-tanh", "rnn-relu"])
def test_gru_rnn_reference_double_backward_gradgradcheck(family):
    """The reference's double backward of the GRU and RNN layers (bidirectional, lengths),
    through the cpu ops' formula (ops/_recurrent.py). Small: gradgradcheck's cost grows with
    the square of the number of input elements."""
    backend_device("cpu")
    T, B, I, H = 3, 3, 2, 2
    gates = 3 if family.startswith("gru") else 1
    weights = []
    for d in range(2):
        weights += [
            _rand(gates * H, I, scale=0.5, seed=4 * d),
            _rand(gates * H, H, scale=0.5, seed=4 * d + 1),
            _rand(gates * H, seed=4 * d + 2),
            _rand(gates * H, seed=4 * d + 3),
        ]
    x, h0 = _rand(T, B, I, seed=50), _rand(2, B, H, seed=51)
    lengths = torch.tensor([3, 1, 2])

    def fn(x, h0, *weights):
        kw = dict(num_layers=1, bidirectional=True, lengths=lengths, backend="cpu")
        if family.startswith("gru"):
            return fastattn.gru(x, h0, weights, reset_after=family == "gru", **kw)
        return fastattn.rnn(x, h0, weights, nonlinearity=family[4:], **kw)

    assert torch.autograd.gradgradcheck(fn, (x, h0, *weights), **GG)


@pytest.mark.parametrize("learned", [False, True])
def test_embed_with_positions_reference_double_backward_gradgradcheck(learned):
    """The reference's double backward of embed_with_positions, through the cpu op's formula
    (contracts/positional.py: embed_backward)."""
    tokens = torch.tensor([[1, 0, 3, 4], [2, 2, 0, 1]])
    weight, table = _rand(5, 6), _rand(7, 6, seed=1)

    def fn(weight, table):
        positions = table if learned else "sinusoidal"
        # (no padding_idx: its zero gradient row is by design not the derivative)
        y = fastattn.embed_with_positions(
            tokens, weight, positions=positions, scale=1.5, offset=2, backend="cpu"
        )
        return y.sin()  # nonlinear, so the second derivative is not zero

    assert torch.autograd.gradgradcheck(fn, (weight, table if learned else table.detach()), **GG)


@pytest.mark.parametrize("backend", ["cpu", "cuda", "reference"])
@pytest.mark.parametrize("tables", [False, True])
def test_apply_rotary_gradgradcheck(backend, tables):
    """apply_rotary's backward is the kernel itself (the rotation by the opposite angle, an op
    with its own autograd), so this checks each kernel's first and second derivative; on the
    reference it checks torch's autograd of the reference's formula (triton takes no
    float64)."""
    device = backend_device(backend)
    x = _rand(2, 2, 5, 8, device=device)
    angles = torch.randn(9, 4, dtype=F64, generator=torch.Generator().manual_seed(1))
    cos, sin = (angles.cos().to(device), angles.sin().to(device)) if tables else (None, None)

    def fn(x):
        return fastattn.apply_rotary(x, cos=cos, sin=sin, offset=1, backend=backend).sin()

    assert torch.autograd.gradgradcheck(fn, (x,), **GG)


def _penalty_param_grads(module, x, call):
    """WGAN-GP style: the gradient of ||d out / d x||^2 with respect to the parameters."""
    x = x.detach().requires_grad_()
    out = call(module, x)
    (gx,) = torch.autograd.grad(out.pow(2).sum(), x, create_graph=True)
    params = [p for p in module.parameters() if p.requires_grad]
    return torch.autograd.grad(gx.pow(2).sum(), params, allow_unused=True)


def _assert_same_grads(got, want):
    for g, w in zip(got, want):
        if w is None:
            assert g is None or g.abs().max() == 0
        else:
            assert g is not None
            torch.testing.assert_close(g, w)


def test_multihead_attention_gradient_penalty_matches_torch():
    torch.manual_seed(0)
    theirs = torch.nn.MultiheadAttention(8, 2, batch_first=True, dtype=F64)
    ours = fastattn.nn.MultiheadAttention(8, 2, batch_first=True, dtype=F64)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 5, 8, dtype=F64)
    call = lambda m, x: m(x, x, x, need_weights=False)[0]
    # torch's flash path has no double backward; its math path is the one to match
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        want = _penalty_param_grads(theirs, x, call)
    _assert_same_grads(_penalty_param_grads(ours, x, call), want)


@pytest.mark.parametrize("bidirectional", [False, True])
def test_lstm_module_gradient_penalty_matches_torch(bidirectional):
    torch.manual_seed(0)
    theirs = torch.nn.LSTM(3, 4, num_layers=2, bidirectional=bidirectional, dtype=F64)
    ours = fastattn.nn.LSTM(3, 4, num_layers=2, bidirectional=bidirectional, dtype=F64)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(5, 2, 3, dtype=F64)
    call = lambda m, x: m(x)[0]
    _assert_same_grads(_penalty_param_grads(ours, x, call), _penalty_param_grads(theirs, x, call))
