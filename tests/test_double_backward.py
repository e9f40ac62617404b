"""Second-order gradients: a backward taken with create_graph=True (gradient penalties, MAML)
must itself be differentiable and correct on every backend, never silently None or zero.

The kernels' backward ops have no derivative; with grad mode on inside the backward the ops
differentiate their reference composition instead (ops/_common.backward_through_reference).
Checked with gradgradcheck in float64 (cpu, reference) and against the reference in float32
(triton, which takes no float64), at the op level (explicit dropout seeds) and through the
drop-in modules against torch's own."""

import pytest
import torch
from conftest import backend_device

import fastattn
import fastattn.reference.attention

F64 = torch.float64
GG = dict(eps=1e-6, atol=1e-5, rtol=1e-4)


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
    if variant == "causal-softcap-alibi":
        hi, softcap = Lk - Lq, 2.0
        alibi = torch.rand(B, Hq, dtype=torch.float32).to(device)
    elif variant == "float-mask-padding":
        mask = torch.randn(B, Hq, Lq, Lk, dtype=dtype).to(device)
        padding = torch.zeros(B, Lk, dtype=torch.bool, device=device)
        padding[1, -2:] = True
    elif variant == "dropout":
        p, seed = 0.3, torch.tensor([3, 4], dtype=torch.int64, device=device)
    return (q, k, v), (mask, padding, alibi, scale, softcap, lo, hi, p, seed)


def _attention_fn(backend, rest):
    op = (
        torch.ops.fastattn.attention_forward_triton
        if backend == "triton"
        else torch.ops.fastattn.attention_forward
    )
    mask, padding, alibi, scale, softcap, lo, hi, p, seed = rest

    def fn(q, k, v):
        if backend == "reference":
            out, lse = fastattn.reference.attention.attention(
                q, k, v, mask, padding, alibi, scale, softcap, lo, hi, p, seed
            )
        else:
            out, lse = op(q, k, v, mask, padding, alibi, scale, softcap, lo, hi, p, seed)
        return out, lse

    return fn


VARIANTS = ["plain", "causal-softcap-alibi", "float-mask-padding", "dropout"]


@pytest.mark.parametrize("backend", ["cpu", "reference", "cuda"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_attention_gradgradcheck(backend, variant):
    device = backend_device(backend)
    inputs, rest = _attention_args(device, F64, variant)
    assert torch.autograd.gradgradcheck(_attention_fn(backend, rest), inputs, **GG)


def _second_order(fn, inputs):
    """Gradient penalty: d/d inputs of sum((d loss / d inputs)^2)."""
    out, lse = fn(*inputs)
    loss = (out.float() ** 2).sum() + lse.float().sum()
    grads = torch.autograd.grad(loss, inputs, create_graph=True)
    penalty = sum((g.float() ** 2).sum() for g in grads)
    return [g.detach() for g in grads], torch.autograd.grad(penalty, inputs)


@pytest.mark.parametrize("variant", VARIANTS)
def test_attention_second_order_triton_matches_reference(variant):
    device = backend_device("triton")
    inputs, rest = _attention_args(device, torch.float32, variant)
    first, second = _second_order(_attention_fn("triton", rest), inputs)
    ref_inputs = [t.detach().double().requires_grad_() for t in inputs]
    rest64 = tuple(
        r.double()
        if isinstance(r, torch.Tensor) and r.is_floating_point() and r.dtype != torch.float32
        else r
        for r in rest
    )
    ref_first, ref_second = _second_order(_attention_fn("reference", rest64), ref_inputs)
    for got, want in zip(first + list(second), ref_first + list(ref_second)):
        torch.testing.assert_close(got.double(), want, atol=2e-4, rtol=2e-3)


def test_attention_public_api_second_order_is_not_silent():
    q, k, v = (_rand(1, 2, 4, 8, seed=i) for i in range(3))
    out = fastattn.attention(q, k, v, causal=True, backend="cpu")
    (gq,) = torch.autograd.grad(out.pow(2).sum(), q, create_graph=True)
    assert gq.requires_grad
    (second,) = torch.autograd.grad(gq.pow(2).sum(), k)
    ref_out = fastattn.attention(q, k, v, causal=True, backend="reference")
    (ref_gq,) = torch.autograd.grad(ref_out.pow(2).sum(), q, create_graph=True)
    (ref_second,) = torch.autograd.grad(ref_gq.pow(2).sum(), k)
    assert second.abs().max() > 0
    torch.testing.assert_close(second, ref_second)


def test_varlen_attention_gradgradcheck():
    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    q, k = _rand(7, 2, 4), _rand(7, 1, 4, seed=1)
    v = _rand(7, 1, 3, seed=2)

    def fn(q, k, v):
        return fastattn.varlen_attention(
            q, k, v, cu, cu, 4, 4, causal=True, return_lse=True, backend="cpu"
        )

    assert torch.autograd.gradgradcheck(fn, (q, k, v), **GG)


def test_additive_attention_gradgradcheck():
    query, keys, values = _rand(2, 3, 4), _rand(2, 5, 4, seed=1), _rand(2, 5, 3, seed=2)
    w_query, w_keys, v = _rand(6, 4, seed=3), _rand(6, 4, seed=4), _rand(6, seed=5)

    def fn(query, keys, values, w_query, w_keys, v):
        return fastattn.additive_attention(
            query, keys, values, w_query=w_query, w_keys=w_keys, v=v, backend="cpu"
        )

    assert torch.autograd.gradgradcheck(fn, (query, keys, values, w_query, w_keys, v), **GG)


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
@pytest.mark.parametrize("bias", [True, False])
def test_lstm_cell_gradgradcheck(backend, bias):
    device = backend_device(backend)
    shapes = [(3, 4), (3, 5), (3, 5), (20, 4), (20, 5)] + ([(20,), (20,)] if bias else [])
    args = [_rand(*s, device=device, scale=0.5, seed=i) for i, s in enumerate(shapes)]
    args += [] if bias else [None, None]
    assert torch.autograd.gradgradcheck(
        lambda *a: fastattn.lstm_cell(*a, backend=backend), args, **GG
    )


@pytest.mark.parametrize("backend", ["cpu", "cuda"])
@pytest.mark.parametrize("variant", ["plain", "bidir-proj-lengths", "dropout"])
def test_lstm_layer_gradgradcheck(backend, variant):
    device = backend_device(backend)
    T, B, I, H = 4, 3, 3, 4
    D, P = (2, 2) if variant == "bidir-proj-lengths" else (1 if variant == "plain" else 2, H)
    tensors = [
        _rand(T, B, I, device=device),
        _rand(D, B, P, device=device, seed=1),
        _rand(D, B, H, device=device, seed=2),
        _rand(D, 4 * H, I, device=device, scale=0.5, seed=3),
        _rand(D, 4 * H, P, device=device, scale=0.5, seed=4),
        _rand(D, 4 * H, device=device, seed=5),
        _rand(D, 4 * H, device=device, seed=6),
        _rand(D, P, H, device=device, scale=0.5, seed=7) if P != H else None,
    ]
    lengths = torch.tensor([4, 2, 1]) if variant == "bidir-proj-lengths" else None
    p, seed = (0.3, torch.tensor([5, 6], device=device)) if variant == "dropout" else (0.0, None)

    def fn(*ts):
        out, h_n, c_n, _ = torch.ops.fastattn.lstm_layer(*ts, lengths, p, seed, True)
        return out, h_n, c_n

    assert torch.autograd.gradgradcheck(fn, tensors, **GG)


@pytest.mark.parametrize("backend", ["cpu", "reference", "cuda"])
@pytest.mark.parametrize("learned", [False, True])
def test_embed_with_positions_gradgradcheck(backend, learned):
    device = backend_device(backend)
    tokens = torch.tensor([[1, 0, 3, 4], [2, 2, 0, 1]], device=device)
    weight, table = _rand(5, 6, device=device), _rand(7, 6, device=device, seed=1)

    def fn(weight, table):
        positions = table if learned else "sinusoidal"
        # (no padding_idx: its zero gradient row is by design not the derivative)
        y = fastattn.embed_with_positions(
            tokens, weight, positions=positions, scale=1.5, offset=2, backend=backend
        )
        return y.sin()  # nonlinear, so the second derivative is not zero

    assert torch.autograd.gradgradcheck(fn, (weight, table if learned else table.detach()), **GG)


@pytest.mark.parametrize("backend", ["cpu", "reference", "cuda"])
@pytest.mark.parametrize("tables", [False, True])
def test_apply_rotary_gradgradcheck(backend, tables):
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
