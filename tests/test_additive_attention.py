"""Tests of fastattn.additive_attention (fused Bahdanau scores) and fastattn.nn.AdditiveAttention.

The definition of correct is the straightforward PyTorch implementation written below
(`straightforward`): score_ij = v . tanh(W_q q_i + W_k k_j + b) through the full
(B, Lq, Lk, A) tensor, softmax over the keys, weighted sum of the values. Every backend (cpu,
cuda, triton under the interpreter, reference) is compared with it run in float64 under
FlashAttention's rule (tests/tolerance.py), with the same implementation run in the input's
dtype as the baseline: outputs, weights, and the gradients of every input and weight. A
profiler run proves that the cpu backend never allocates the (B, Lq, Lk, A) tensor the
straightforward implementation (and the reference backend) builds.
"""

from __future__ import annotations

import pytest
import torch
from conftest import backend_device, require_kernel, requires_cuda
from tolerance import assert_fa_close, assert_grad_close, rounding_floor
from torch.profiler import ProfilerActivity, profile

import fastattn
from fastattn.nn import AdditiveAttention
from fastattn.reference.additive_attention import additive_context as ref_additive_context

pytestmark = pytest.mark.usefixtures("one_thread")

F64 = torch.float64
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f64": F64}
GRAD_NAMES = ("query", "keys", "values", "w_query", "w_keys", "v", "bias")


# ---------------------------------------------------------------------------------------------
# The straightforward implementation (what users write today) and helpers


def straightforward(
    query, keys, values=None, *, w_query, w_keys, v, bias=None, key_padding_mask=None
):
    """Bahdanau attention as written in tutorials, in the inputs' dtype: (context, weights).
    Queries whose keys are all masked get zero weights and a zero context (the naive softmax
    would give NaN; fastattn's documented behaviour is zeros)."""
    values = keys if values is None else values
    single = query.dim() == 2
    q = query.unsqueeze(1) if single else query
    kp = keys @ w_keys.T
    if bias is not None:
        kp = kp + bias
    e = torch.tanh((q @ w_query.T).unsqueeze(2) + kp.unsqueeze(1)) @ v  # (B, Lq, Lk)
    if key_padding_mask is not None:
        e = e.masked_fill(key_padding_mask.unsqueeze(1), float("-inf"))
        empty = key_padding_mask.all(dim=1).view(-1, 1, 1)
        weights = torch.softmax(e.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    else:
        weights = torch.softmax(e, dim=-1)
    context = weights @ values
    if single:
        context, weights = context.squeeze(1), weights.squeeze(1)
    return context, weights


def randn(shape, dtype, device, g):
    return torch.randn(shape, generator=g, dtype=F64).to(device=device, dtype=dtype)


def make_inputs(shape: dict, dtype, device, seed=0):
    """Leaves of the call for a CASES entry (weights scaled like nn.Linear's init)."""
    g = torch.Generator().manual_seed(seed)
    B, Lq, Lk, Dq, Dk, Dv, A = (shape[k] for k in ("B", "Lq", "Lk", "Dq", "Dk", "Dv", "A"))
    inputs = {
        "query": randn((B, Dq) if Lq is None else (B, Lq, Dq), dtype, device, g),
        "keys": randn((B, Lk, Dk), dtype, device, g),
        "values": None if Dv is None else randn((B, Lk, Dv), dtype, device, g),
        "w_query": randn((A, Dq), dtype, device, g) / Dq**0.5,
        "w_keys": randn((A, Dk), dtype, device, g) / Dk**0.5,
        "v": randn((A,), dtype, device, g),
        "bias": randn((A,), dtype, device, g) if shape.get("bias", True) else None,
    }
    mask = None
    if shape.get("mask"):
        mask = torch.rand(B, Lk, generator=g) > 0.6
        mask[:, 0] = False
        if shape["mask"] == "empty-row":
            mask[B - 1] = True
        mask = mask.to(device)
    return inputs, mask


CASES = {
    "odd": dict(B=2, Lq=7, Lk=13, Dq=11, Dk=9, Dv=None, A=17),
    "values-differ-mask": dict(B=3, Lq=5, Lk=19, Dq=8, Dk=6, Dv=10, A=33, mask="random"),
    "single-step": dict(B=4, Lq=None, Lk=23, Dq=12, Dk=7, Dv=None, A=40, mask="random"),
    "L1-no-bias": dict(B=2, Lq=1, Lk=1, Dq=3, Dk=3, Dv=None, A=5, bias=False),
    "empty-row": dict(B=3, Lq=6, Lk=9, Dq=5, Dk=4, Dv=3, A=7, mask="empty-row"),
    "A1": dict(B=2, Lq=4, Lk=5, Dq=3, Dk=2, Dv=None, A=1),
    "larger": dict(B=2, Lq=33, Lk=65, Dq=16, Dk=24, Dv=24, A=64, mask="random"),
}


def skip_unavailable(backend: str, dtype: torch.dtype) -> torch.device:
    require_kernel("additive_scores", backend)  # fails if the build lost it
    device = backend_device(backend)
    if backend == "triton" and dtype == F64:
        pytest.skip("the triton backend refuses float64 (test_triton_refuses_float64)")
    return device


def float_floor(ref64: torch.Tensor, dtype: torch.dtype) -> float | None:
    """float64: the baseline is 0, so allow 64 ulps of the largest magnitude (sums of A tanh
    terms in another order); float32: the rule's floor plus 16 ulps (tests/test_attention.py's
    float32 floor); lower precisions: the rule's own floor."""
    ref64 = ref64.detach()
    scale = float(ref64.abs().max()) if ref64.numel() else 0.0
    if dtype == F64:
        return 64 * torch.finfo(F64).eps * (1.0 + scale)
    if dtype == torch.float32:
        return rounding_floor(ref64, dtype) + 16 * torch.finfo(torch.float32).eps * scale
    return None


def run_fastattn(inputs, mask, backend, grads=True, seed=1):
    args = {
        n: (None if t is None else t.detach().clone().requires_grad_(grads))
        for n, t in inputs.items()
    }
    ctx, w = fastattn.additive_attention(
        args["query"],
        args["keys"],
        args["values"],
        w_query=args["w_query"],
        w_keys=args["w_keys"],
        v=args["v"],
        bias=args["bias"],
        key_padding_mask=mask,
        return_weights=True,
        backend=backend,
    )
    return ctx, w, args


def run_straightforward(inputs, mask, dtype, grads=True):
    args = {
        n: (None if t is None else t.detach().to(dtype).requires_grad_(grads))
        for n, t in inputs.items()
    }
    ctx, w = straightforward(
        args["query"],
        args["keys"],
        args["values"],
        w_query=args["w_query"],
        w_keys=args["w_keys"],
        v=args["v"],
        bias=args["bias"],
        key_padding_mask=mask,
    )
    return ctx, w, args


def backward(ctx, w, seed=1):
    g = torch.Generator().manual_seed(seed)
    loss = (ctx * randn(ctx.shape, ctx.dtype, ctx.device, g)).sum() + (
        w * randn(w.shape, w.dtype, w.device, g)
    ).sum()
    loss.backward()


# ---------------------------------------------------------------------------------------------
# 1. Every backend against the float64 straightforward implementation


@pytest.mark.parametrize("dtype_name", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_matches_straightforward(backend, dtype_name, case):
    dtype = DTYPES[dtype_name]
    device = skip_unavailable(backend, dtype)
    inputs, mask = make_inputs(CASES[case], dtype, device)
    ctx, w, args = run_fastattn(inputs, mask, backend)
    assert fastattn.last_backend("additive_attention") == backend
    ctx64, w64, args64 = run_straightforward(inputs, mask, F64)
    ctx_lp, w_lp, args_lp = run_straightforward(inputs, mask, dtype)
    B, Lq, Lk = CASES[case]["B"], CASES[case]["Lq"], CASES[case]["Lk"]
    Dv = CASES[case]["Dv"] or CASES[case]["Dk"]
    lead = (B,) if Lq is None else (B, Lq)
    assert ctx.shape == (*lead, Dv) and ctx.dtype == dtype
    assert w.shape == (*lead, Lk)
    assert w.dtype == (F64 if dtype == F64 else torch.float32)  # the compute type
    d = torch.Tensor.detach
    assert_fa_close(
        f"context [{backend}]", d(ctx), d(ctx64), d(ctx_lp), floor=float_floor(ctx64, dtype)
    )
    assert_fa_close(f"weights [{backend}]", d(w), d(w64), d(w_lp), floor=float_floor(w64, w.dtype))
    for c, ww in ((ctx, w), (ctx64, w64), (ctx_lp, w_lp)):
        backward(c, ww)
    for name in GRAD_NAMES:
        if args[name] is None:
            continue
        g, g64, g_lp = args[name].grad, args64[name].grad, args_lp[name].grad
        assert g is not None, f"no gradient reached {name}"
        assert g.dtype == dtype and g.shape == args[name].shape
        assert_grad_close(f"grad {name} [{backend}]", g, g64, g_lp, floor=float_floor(g64, dtype))


@pytest.mark.parametrize("with_values", (False, True), ids=("values=keys", "values"))
def test_empty_row_zero_context_weights_and_finite_grads(backend, with_values):
    """A batch entry whose keys are all padding: zero context, zero weights, finite gradients
    (and none at all to that entry's keys and values)."""
    device = skip_unavailable(backend, torch.float32)
    shape = dict(CASES["empty-row"], Dv=3 if with_values else None)
    inputs, mask = make_inputs(shape, torch.float32, device)
    assert mask[-1].all() and not mask[0].all()
    ctx, w, args = run_fastattn(inputs, mask, backend)
    assert (ctx[-1] == 0).all() and (w[-1] == 0).all()
    assert torch.isfinite(ctx).all() and torch.isfinite(w).all()
    backward(ctx, w)
    for name in GRAD_NAMES:
        if args[name] is not None:
            assert torch.isfinite(args[name].grad).all(), name
    assert (args["keys"].grad[-1] == 0).all()
    if with_values:
        assert (args["values"].grad[-1] == 0).all()


# ---------------------------------------------------------------------------------------------
# 2. gradcheck (float64), values and single steps


@pytest.mark.parametrize("backend", ("cpu", "reference"))
@pytest.mark.parametrize("case", ("values-mask-empty-row", "single-step", "no-bias"))
def test_gradcheck(backend, case):
    device = skip_unavailable(backend, F64)
    shape = {
        "values-mask-empty-row": dict(B=3, Lq=3, Lk=4, Dq=3, Dk=2, Dv=3, A=5, mask="empty-row"),
        "single-step": dict(B=2, Lq=None, Lk=5, Dq=3, Dk=3, Dv=None, A=4, mask="random"),
        "no-bias": dict(B=2, Lq=2, Lk=3, Dq=2, Dk=3, Dv=2, A=6, bias=False),
    }[case]
    inputs, mask = make_inputs(shape, F64, device)
    names = [n for n in GRAD_NAMES if inputs[n] is not None]
    leaves = [inputs[n].requires_grad_() for n in names]

    def fn(*tensors):
        kw = dict(zip(names, tensors))
        return fastattn.additive_attention(
            kw["query"],
            kw["keys"],
            kw.get("values"),
            w_query=kw["w_query"],
            w_keys=kw["w_keys"],
            v=kw["v"],
            bias=kw.get("bias"),
            key_padding_mask=mask,
            return_weights=True,
            backend=backend,
        )

    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-8)
    assert fastattn.last_backend("additive_attention") == backend


def test_single_step_equals_one_query_row(backend):
    """A (B, Dq) query gives exactly row 0 of the same query as (B, 1, Dq)."""
    device = skip_unavailable(backend, torch.float32)
    inputs, mask = make_inputs(CASES["single-step"], torch.float32, device)
    ctx, w, _ = run_fastattn(inputs, mask, backend, grads=False)
    batched = dict(inputs, query=inputs["query"].unsqueeze(1))
    ctx3, w3, _ = run_fastattn(batched, mask, backend, grads=False)
    torch.testing.assert_close(ctx, ctx3[:, 0], rtol=0, atol=0)
    torch.testing.assert_close(w, w3[:, 0], rtol=0, atol=0)


def test_default_values_are_keys(backend):
    device = skip_unavailable(backend, torch.float32)
    inputs, mask = make_inputs(CASES["odd"], torch.float32, device)
    ctx, _, _ = run_fastattn(inputs, mask, backend, grads=False)
    explicit = dict(inputs, values=inputs["keys"])
    ctx2, _, _ = run_fastattn(explicit, mask, backend, grads=False)
    torch.testing.assert_close(ctx, ctx2, rtol=0, atol=0)
    only_ctx = fastattn.additive_attention(
        inputs["query"],
        inputs["keys"],
        w_query=inputs["w_query"],
        w_keys=inputs["w_keys"],
        v=inputs["v"],
        bias=inputs["bias"],
        backend=backend,
    )
    assert isinstance(only_ctx, torch.Tensor)  # return_weights=False: the context alone
    torch.testing.assert_close(only_ctx, ctx, rtol=0, atol=0)


def test_backends_agree_on_scores():
    """cpu and reference compute the same float64 scores to a few ulps (and triton the same
    float32 scores within float32 rounding), the op every backend fuses."""
    inputs, mask = make_inputs(CASES["larger"], F64, "cpu")
    require_kernel("additive_scores", "cpu")
    got = {}
    for backend in ("cpu", "reference"):
        got[backend] = run_fastattn(inputs, mask, backend, grads=False)[1]
    torch.testing.assert_close(got["cpu"], got["reference"], rtol=1e-13, atol=1e-14)


# ---------------------------------------------------------------------------------------------
# 3. The module


def test_module_parameters_and_forward():
    torch.manual_seed(0)
    module = AdditiveAttention(12, 7, 20, value_dim=5)
    names = [n for n, _ in module.named_parameters()]
    assert sorted(names) == ["key_proj.bias", "key_proj.weight", "query_proj.weight", "v"]
    assert set(module.state_dict()) == {
        "query_proj.weight",
        "key_proj.weight",
        "key_proj.bias",
        "v",
    }
    assert module.query_proj.weight.shape == (20, 12) and module.query_proj.bias is None
    assert module.key_proj.weight.shape == (20, 7) and module.v.shape == (20,)
    with torch.no_grad():  # random, nonzero everything
        for p in module.parameters():
            p.normal_()
    g = torch.Generator().manual_seed(1)
    query = torch.randn(3, 4, 12, generator=g)
    keys = torch.randn(3, 9, 7, generator=g)
    values = torch.randn(3, 9, 5, generator=g)
    mask = torch.rand(3, 9, generator=g) > 0.6
    mask[:, 0] = False
    out = module(query, keys, values, key_padding_mask=mask)
    assert isinstance(out, torch.Tensor) and out.shape == (3, 4, 5)
    ctx, w = module(query, keys, values, key_padding_mask=mask, need_weights=True)
    assert fastattn.last_backend("additive_attention") == "cpu"
    ref_ctx, ref_w = straightforward(
        query.double(),
        keys.double(),
        values.double(),
        w_query=module.query_proj.weight.double(),
        w_keys=module.key_proj.weight.double(),
        v=module.v.double(),
        bias=module.key_proj.bias.double(),
        key_padding_mask=mask,
    )
    torch.testing.assert_close(ctx, out, rtol=0, atol=0)
    torch.testing.assert_close(ctx.double(), ref_ctx, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w.double(), ref_w, rtol=1e-5, atol=1e-5)
    (ctx.square().sum() + w.square().sum()).backward()
    assert all(
        p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0
        for p in module.parameters()
    )
    step = module(query[:, 0], keys)  # one decoder step, values = keys (key_dim features)
    assert step.shape == (3, 7)
    assert "attn_dim=20" in repr(module)


def test_module_state_dict_round_trip():
    torch.manual_seed(0)
    a, b = AdditiveAttention(6, 5, 8), AdditiveAttention(6, 5, 8)
    b.load_state_dict(a.state_dict(), strict=True)
    q, k = torch.randn(2, 3, 6), torch.randn(2, 4, 5)
    torch.testing.assert_close(a(q, k), b(q, k), rtol=0, atol=0)


def _decode(module, keys, mask, steps=4, backward_each_step=False):
    """A teacher-forced decoder's calls: one query per step, the same keys every step."""
    g = torch.Generator().manual_seed(1)
    h = torch.randn(keys.shape[0], module.query_dim, dtype=keys.dtype, generator=g)
    contexts = []
    for t in range(steps):
        context = module(h * (t + 1), keys, key_padding_mask=mask)
        if backward_each_step:
            context.square().sum().backward()
        contexts.append(context)
    return contexts


def test_module_reuses_the_key_projection_across_decoder_steps():
    """A decoder step after step with the same keys projects them once; the outputs and
    gradients are those of projecting at every step (float64)."""
    from fastattn.nn import additive_attention as module_file

    torch.manual_seed(0)
    module = AdditiveAttention(8, 6, 5).double()
    keys = torch.randn(3, 7, 6, dtype=F64, requires_grad=True)
    mask = torch.zeros(3, 7, dtype=torch.bool)
    mask[1, 4:] = True
    mask[2] = True  # a row without keys
    params = [keys, *module.parameters()]
    calls = []
    original = module.project_keys
    module.project_keys = lambda k: calls.append(1) or original(k)
    contexts = _decode(module, keys, mask)
    assert len(calls) == 1
    grads = torch.autograd.grad(sum(c.square().sum() for c in contexts), params)
    module_file._KEY_PROJECTIONS.clear()
    module.project_keys = original
    expected = []
    g = torch.Generator().manual_seed(1)
    h = torch.randn(3, 8, dtype=F64, generator=g)
    for t in range(4):
        expected.append(
            module(
                h * (t + 1), keys, key_padding_mask=mask, projected_keys=module.project_keys(keys)
            )
        )
    expected_grads = torch.autograd.grad(sum(c.square().sum() for c in expected), params)
    for got, want in zip(contexts + list(grads), expected + list(expected_grads)):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_module_projects_anew_when_the_reused_projection_is_no_longer_valid():
    """New keys, keys or weights changed in place, a backward that freed the graph (a backward
    after every step), or no_grad after grad mode: the keys are projected again."""
    torch.manual_seed(0)
    module = AdditiveAttention(8, 6, 5).double()
    mask = torch.zeros(3, 7, dtype=torch.bool)
    keys = torch.randn(3, 7, 6, dtype=F64)
    calls = []
    original = module.project_keys
    module.project_keys = lambda k: calls.append(1) or original(k)
    _decode(module, keys, mask, backward_each_step=True)  # no retain_graph: must not fail
    assert len(calls) == 4
    with torch.no_grad():
        calls.clear()
        _decode(module, keys, mask)
        assert len(calls) == 1  # no graph: reused while keys live
        keys.add_(1.0)
        _decode(module, keys, mask, steps=1)
        module.key_proj.weight.mul_(0.5)
        _decode(module, keys, mask, steps=1)
        _decode(module, keys.clone(), mask, steps=1)
        assert len(calls) == 4
    reference = module(
        torch.ones(3, 8, dtype=F64), keys, key_padding_mask=mask, projected_keys=original(keys)
    )
    torch.testing.assert_close(
        module(torch.ones(3, 8, dtype=F64), keys, key_padding_mask=mask), reference, rtol=0, atol=0
    )


def test_module_rejects_wrong_value_features():
    module = AdditiveAttention(6, 5, 8, value_dim=3)
    with pytest.raises(ValueError, match="values"):
        module(torch.randn(2, 3, 6), torch.randn(2, 4, 5), torch.randn(2, 4, 4))


# ---------------------------------------------------------------------------------------------
# 4. Registration: opcheck, torch.compile, last_backend


def _opcheck_args(device, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    qp = randn((2, 5, 7), dtype, device, g).requires_grad_()
    kp = randn((2, 6, 7), dtype, device, g).requires_grad_()
    v = randn((7,), dtype, device, g).requires_grad_()
    acc = F64 if dtype == F64 else torch.float32
    grad = randn((2, 5, 6), acc, device, g)
    scores = randn((2, 5, 6), acc, device, g).requires_grad_()
    values = randn((2, 6, 3), dtype, device, g).requires_grad_()
    mask = torch.tensor([[False] * 6, [False, True, False, True, True, True]], device=device)
    weights = torch.softmax(scores.detach(), -1)
    return {
        "additive_scores": (qp, kp, v),
        "additive_scores_backward": (grad, qp.detach(), kp.detach(), v.detach()),
        "additive_context": (scores, values, mask),
        "additive_context_backward": (
            randn((2, 5, 3), dtype, device, g),
            randn((2, 5, 6), acc, device, g),
            weights,
            values.detach(),
        ),
    }


@pytest.mark.parametrize("dtype_name", ("f32", "f64", "bf16"))
@pytest.mark.parametrize("op", ("additive_scores", "additive_scores_backward"))
@pytest.mark.parametrize("backend", ("cpu", "cuda"))
def test_opcheck_native(backend, op, dtype_name):
    device = skip_unavailable(backend, torch.float32)
    torch.library.opcheck(
        getattr(torch.ops.fastattn, op), _opcheck_args(device, DTYPES[dtype_name])[op]
    )


@pytest.mark.parametrize("dtype_name", ("f32", "f64", "bf16"))
@pytest.mark.parametrize("op", ("additive_context", "additive_context_backward"))
def test_opcheck_cpu_context(op, dtype_name):
    """The masked softmax and weighted sum that the cpu backend fuses (the other backends run
    them as torch ops)."""
    device = skip_unavailable("cpu", torch.float32)
    torch.library.opcheck(
        getattr(torch.ops.fastattn, op), _opcheck_args(device, DTYPES[dtype_name])[op]
    )


@pytest.mark.parametrize("with_mask", (True, False))
@pytest.mark.parametrize("dtype_name", ("f32", "bf16", "f16", "f64"))
def test_cpu_context_matches_reference(with_mask, dtype_name):
    """fastattn::additive_context and its backward (with and without a weights gradient)
    against the reference composition in float64: an odd Dv (a masked 16-lane tail), a row
    whose keys are all masked (zero weights and context, zero gradients)."""
    skip_unavailable("cpu", torch.float32)
    dtype = {**DTYPES, "f16": torch.float16}[dtype_name]
    acc = F64 if dtype == F64 else torch.float32
    g = torch.Generator().manual_seed(3)
    B, Lq, Lk, Dv = 3, 4, 37, 21
    scores = (3 * torch.randn(B, Lq, Lk, generator=g)).to(acc).requires_grad_()
    values = torch.randn(B, Lk, Dv, generator=g).to(dtype).requires_grad_()
    mask = torch.rand(B, Lk, generator=g) < 0.3
    mask[1] = True
    mask = mask if with_mask else None
    g_ctx = torch.randn(B, Lq, Dv, generator=g).to(dtype)
    g_w = torch.randn(B, Lq, Lk, generator=g).to(acc)
    ctx, w = torch.ops.fastattn.additive_context(scores, values, mask)
    torch.autograd.backward((ctx, w), (g_ctx, g_w))
    s64, v64 = (
        scores.detach().double().requires_grad_(),
        values.detach().double().requires_grad_(),
    )
    ctx_ref, w_ref = ref_additive_context(s64, v64, mask)
    torch.autograd.backward((ctx_ref, w_ref), (g_ctx.double(), g_w.double()))
    tol = {F64: 1e-12, torch.float32: 1e-5}.get(dtype, 2e-2)
    tol = dict(atol=tol, rtol=tol)
    torch.testing.assert_close(w.double(), w_ref, **tol)
    torch.testing.assert_close(ctx.double(), ctx_ref, **tol)
    torch.testing.assert_close(scores.grad.double(), s64.grad, **tol)
    torch.testing.assert_close(values.grad.double(), v64.grad, **tol)
    if with_mask:
        assert (w[1] == 0).all() and (ctx[1] == 0).all() and (scores.grad[1] == 0).all()


@pytest.mark.parametrize("op", ("additive_scores", "additive_scores_backward"))
def test_opcheck_triton(op):
    device = skip_unavailable("triton", torch.float32)
    args = _opcheck_args(device)[op]
    fn = getattr(torch.ops.fastattn, op + "_triton")
    if device.type == "cpu":
        # Under TRITON_INTERPRET=1 the fake pass of a triton_op launches the interpreter on
        # FakeTensors (see tests/test_positional.py::test_opcheck_triton): only the schema and
        # the autograd registration can be checked here; on a GPU every check runs.
        torch.library.opcheck(fn, args, test_utils=("test_schema", "test_autograd_registration"))
    else:
        torch.library.opcheck(fn, args)


class _Seq2SeqStep(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = AdditiveAttention(10, 6, 12, value_dim=6)
        self.out = torch.nn.Linear(6, 3)

    def forward(self, query, keys, mask):
        ctx, w = self.attn(query, keys, keys, key_padding_mask=mask, need_weights=True)
        return self.out(ctx) + w.sum(-1, keepdim=True)


def test_compile_fullgraph_module():
    require_kernel("additive_scores", "cpu")
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _Seq2SeqStep()
    query, keys = torch.randn(2, 4, 10), torch.randn(2, 7, 6)
    mask = torch.zeros(2, 7, dtype=torch.bool)
    mask[1, 5:] = True
    compiled = torch.compile(model, fullgraph=True)
    out = compiled(query, keys, mask)
    assert fastattn.last_backend("additive_attention") == "cpu"
    eager = model(query, keys, mask)
    torch.testing.assert_close(out, eager, rtol=1e-6, atol=1e-6)
    grads = torch.autograd.grad(out.square().sum(), list(model.parameters()))
    eager_grads = torch.autograd.grad(eager.square().sum(), list(model.parameters()))
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_last_backend_names_the_backend_that_ran(backend):
    device = skip_unavailable(backend, torch.float32)
    inputs, mask = make_inputs(CASES["L1-no-bias"], torch.float32, device)
    other = "cpu" if backend == "reference" else "reference"
    run_fastattn(inputs, mask, other, grads=False)
    assert fastattn.last_backend("additive_attention") == other
    with fastattn.use_backend(backend):
        run_fastattn(inputs, mask, None, grads=False)
    assert fastattn.last_backend("additive_attention") == backend


def test_default_backend_on_cpu_is_cpu():
    require_kernel("additive_scores", "cpu")
    inputs, mask = make_inputs(CASES["odd"], torch.float32, "cpu")
    run_fastattn(inputs, mask, None, grads=False)
    expected = "cpu"
    assert fastattn.last_backend("additive_attention") == expected
    run_fastattn(
        {n: (t.double() if t is not None else None) for n, t in inputs.items()},
        mask,
        None,
        grads=False,
    )
    assert fastattn.last_backend("additive_attention") == expected  # float64 too


def test_triton_refuses_float64():
    # On the device Triton runs on (a GPU, or the CPU under the interpreter), so that the
    # refusal is the dtype's and not the device's.
    device = skip_unavailable("triton", torch.float32)
    inputs, mask = make_inputs(CASES["odd"], F64, device)
    with pytest.raises(fastattn.BackendError, match="float64"):
        run_fastattn(inputs, mask, "triton", grads=False)


# ---------------------------------------------------------------------------------------------
# 5. Bad inputs: errors name the argument


def _bad(**changes):
    def make():
        inputs, _ = make_inputs(CASES["values-differ-mask"], torch.float32, "cpu")
        kw = dict(inputs)
        kw["key_padding_mask"] = None
        for name, fn in changes.items():
            kw[name] = fn(kw)
        return kw

    return make


BAD_INPUTS = {
    "query-4d": (_bad(query=lambda kw: kw["query"][None]), ValueError, "query"),
    "query-int": (_bad(query=lambda kw: kw["query"].long()), TypeError, "query"),
    "keys-2d": (_bad(keys=lambda kw: kw["keys"][0]), ValueError, "keys"),
    "values-length": (_bad(values=lambda kw: kw["values"][:, :-1]), ValueError, "values"),
    "values-batch": (_bad(values=lambda kw: kw["values"][:-1]), ValueError, "values"),
    "w_query-shape": (_bad(w_query=lambda kw: kw["w_query"][:, :-1]), ValueError, "w_query"),
    "w_keys-shape": (_bad(w_keys=lambda kw: kw["w_keys"][:-1]), ValueError, "w_keys"),
    "v-2d": (_bad(v=lambda kw: kw["v"][None]), ValueError, "v"),
    "bias-shape": (_bad(bias=lambda kw: kw["bias"][:-1]), ValueError, "bias"),
    "dtype-mix": (_bad(keys=lambda kw: kw["keys"].double()), TypeError, "dtype"),
    "mask-float": (
        _bad(key_padding_mask=lambda kw: torch.zeros(3, 19)),
        ValueError,
        "key_padding_mask",
    ),
    "mask-shape": (
        _bad(key_padding_mask=lambda kw: torch.zeros(3, 18, dtype=torch.bool)),
        ValueError,
        "key_padding_mask",
    ),
    "keys-device": (_bad(keys=lambda kw: kw["keys"].to("meta")), ValueError, "keys"),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_raises_clear_error(case):
    make, exc, match = BAD_INPUTS[case]
    kw = make()
    with pytest.raises(exc, match=match):
        fastattn.additive_attention(kw.pop("query"), kw.pop("keys"), kw.pop("values"), **kw)


def test_unknown_backend_raises():
    inputs, _ = make_inputs(CASES["odd"], torch.float32, "cpu")
    with pytest.raises(ValueError, match="backend"):
        run_fastattn(inputs, None, "tpu", grads=False)


# ---------------------------------------------------------------------------------------------
# 6. Memory: no (B, Lq, Lk, A) tensor


MEM_SHAPE = dict(B=4, Lq=64, Lk=64, Dq=32, Dk=32, Dv=None, A=128, mask="random")


def largest_allocation(backend: str) -> tuple[int, int]:
    """(largest allocation made by one op, largest net allocation of one op with its children)
    during forward + backward, from torch.profiler's memory events, in bytes."""
    inputs, mask = make_inputs(MEM_SHAPE, torch.float32, "cpu")
    args = {n: (None if t is None else t.requires_grad_()) for n, t in inputs.items()}
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        ctx, w = fastattn.additive_attention(
            args["query"],
            args["keys"],
            w_query=args["w_query"],
            w_keys=args["w_keys"],
            v=args["v"],
            bias=args["bias"],
            key_padding_mask=mask,
            return_weights=True,
            backend=backend,
        )
        (ctx.sum() + w.sum()).backward()
    events = prof.events()
    return (max(e.self_cpu_memory_usage for e in events), max(e.cpu_memory_usage for e in events))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_cpu_backend_never_allocates_the_4d_tensor():
    require_kernel("additive_scores", "cpu")
    s = MEM_SHAPE
    four_d = s["B"] * s["Lq"] * s["Lk"] * s["A"] * 4
    cpu_self, cpu_incl = largest_allocation("cpu")
    ref_self, ref_incl = largest_allocation("reference")
    print(
        f"(B, Lq, Lk, A) float32: {four_d} bytes; largest allocation: cpu {cpu_self} "
        f"(op with children {cpu_incl}), reference {ref_self} (op with children {ref_incl})"
    )
    assert ref_self >= four_d  # the measurement sees the 4-D tensor when there is one
    assert cpu_self <= four_d // 16 and cpu_incl <= four_d // 16


@requires_cuda()
def test_cuda_backend_never_allocates_the_4d_tensor():
    require_kernel("additive_scores", "cuda")
    s = dict(MEM_SHAPE, B=32, Lq=400, Lk=400)
    four_d = s["B"] * s["Lq"] * s["Lk"] * s["A"] * 4
    peaks = {}
    for backend in ("cuda", "reference"):
        inputs, mask = make_inputs(s, torch.float32, "cuda")
        args = {n: (None if t is None else t.requires_grad_()) for n, t in inputs.items()}
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        ctx = fastattn.additive_attention(
            args["query"],
            args["keys"],
            w_query=args["w_query"],
            w_keys=args["w_keys"],
            v=args["v"],
            bias=args["bias"],
            key_padding_mask=mask,
            backend=backend,
        )
        ctx.sum().backward()
        torch.cuda.synchronize()
        peaks[backend] = torch.cuda.max_memory_allocated() - base
    print(f"(B, Lq, Lk, A) float32: {four_d} bytes; peak: {peaks}")
    assert peaks["reference"] >= four_d
    assert peaks["cuda"] <= four_d // 16
