"""`attention` on the torch backend (torch's SDPA, fastattn/aten/attention.py) against the float64
reference, under FlashAttention's rule (tests/tolerance.py, tests/attention_floors.py), for
every feature it accepts, forward and backward, every dtype; and its refusals, each with the
feature named. SDPA's backward reads Delta = rowsum(dO * O) from its own rounded output as
fastattn's kernels do, so the same derived model of that term applies."""

from __future__ import annotations

import pytest
import torch
from attention_floors import assert_gradient_close, delta_model
from test_attention import make_case
from tolerance import assert_fa_close, assert_grad_close, float32_floor

import fastattn
from fastattn import BackendError
from fastattn.ops.attention import attention_with_weights

ACCEPTED = (
    "plain",
    "causal",
    "causal_br",
    "bool_mask",
    "float_mask",
    "padding",
    "gqa",
    "mqa",
    "dv",
    "window",
    "scale",
)
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_DT = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64"}
# (D, (Lq, Lk)) spread over head-dim and length classes, one per accepted feature and dtype.
SHAPES = ((32, (113, 203)), (64, (1, 128)), (80, (128, 1)), (111, (256, 512)), (128, (203, 113)))


def _cases():
    cases = []
    for f, feature in enumerate(ACCEPTED):
        for t, dtype in enumerate(DTYPES):
            D, lengths = SHAPES[(2 * f + t) % len(SHAPES)]
            cases.append(
                pytest.param(feature, D, lengths, dtype, id=f"{feature}-D{D}-{_DT[dtype]}")
            )
    cases.append(pytest.param("causal", 256, (512, 512), torch.bfloat16, id="causal-D256-bf16"))
    return cases


def _run(backend, q, k, v, kw, grad_out, cast=None):
    """(out, dq, dk, dv) of `backend` on copies of q, k, v (cast to `cast` if given)."""
    leaves = [t.detach().to(cast or t.dtype).requires_grad_() for t in (q, k, v)]
    kw = {
        name: value.double()
        if cast and isinstance(value, torch.Tensor) and value.is_floating_point()
        else value
        for name, value in kw.items()
    }
    out = fastattn.attention(*leaves, backend=backend, **kw)
    assert fastattn.last_backend("attention") == backend
    grads = torch.autograd.grad(out, leaves, grad_out.to(out.dtype))
    return (out.detach(), *grads)


def compare(q, k, v, kw, tamper=None):
    """The torch backend against the float64 reference: out (2x rule) and dq, dk, dv (3x, with
    the Delta model of tests/attention_floors.py). tamper scales its gradients first."""
    g = torch.Generator().manual_seed(99)
    B, Hq, Lq, _ = q.shape
    grad_out = torch.randn(B, Hq, Lq, v.shape[3], generator=g).to(q.dtype)
    got = _run("torch", q, k, v, kw, grad_out)
    ref64 = _run("reference", q, k, v, kw, grad_out.double(), cast=torch.float64)
    low = _run("reference", q, k, v, kw, grad_out)
    assert got[0].dtype == q.dtype and got[0].shape == ref64[0].shape
    if q.dtype == torch.float64:
        # The baseline is the reference itself (error 0): the floor is float64's rounding of
        # the longest sum in the computation, n ulps of the larger of the result and the
        # size of its terms (dq and dk are differences that cancel: with one key, dq = 0).
        n = max(q.shape[2], k.shape[2], q.shape[3] + v.shape[3])
        scale = kw.get("scale") or q.shape[3] ** -0.5
        big = {name: float(t.abs().max()) for name, t in zip("qkv", (q, k, v))}
        big_do = float(grad_out.abs().max())
        terms = {
            "out": big["v"],
            "dq": 2 * scale * big["k"] * big_do * big["v"],
            "dk": 2 * scale * big["q"] * big_do * big["v"],
            "dv": big_do,
        }
        for name, i in (("out", 0), ("dq", 1), ("dk", 2), ("dv", 3)):
            grad = got[i] * (tamper or {}).get(name, 1.0)
            floor = n * 2.0**-53 * (float(ref64[i].abs().max()) + terms[name])
            assert_grad_close(name, grad, ref64[i], low[i], floor=floor)
        return
    assert_fa_close("out", got[0], ref64[0], low[0], floor=float32_floor(ref64[0], q.dtype))
    model = delta_model(q, k, v, kw, grad_out, ref64[0], got[0])
    for name, i in (("dq", 1), ("dk", 2), ("dv", 3)):
        assert_gradient_close(name, got[i], ref64[i], low[i], model, tamper)


@pytest.mark.parametrize("feature,D,lengths,dtype", _cases())
def test_torch_backend_matches_reference(feature, D, lengths, dtype):
    q, k, v, kw = make_case(feature, D, *lengths, dtype, torch.device("cpu"))
    compare(q, k, v, kw)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32, torch.float64))
@pytest.mark.parametrize("name", ("dq", "dk", "dv"))
def test_the_check_has_teeth(name, dtype):
    q, k, v, kw = make_case("causal_br", 64, 113, 203, dtype, torch.device("cpu"))
    for factor in (0.0, 1.25 if dtype == torch.bfloat16 else 1.0 + 1e-3):
        with pytest.raises(AssertionError):
            compare(q, k, v, kw, tamper={name: factor})


def test_rows_without_a_visible_key_give_zero_and_finite_gradients():
    q, k, v, _ = make_case("plain", 64, 7, 5, torch.float32, torch.device("cpu"))
    mask = torch.ones(1, 1, 7, 5, dtype=torch.bool)
    mask[..., 2, :] = False
    padding = torch.zeros(2, 5, dtype=torch.bool)
    padding[1] = True  # the second batch sees no key at all
    # bottom-right causal with Lq > Lk: the first Lq - Lk queries see no key
    for kw in (dict(attn_mask=mask), dict(key_padding_mask=padding), dict(causal="bottom_right")):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out = fastattn.attention(*leaves, backend="torch", **kw)
        ref = fastattn.attention(*leaves, backend="reference", **kw)
        empty = (ref == 0).all(-1)
        assert empty.any() and torch.all(out[empty] == 0), kw
        grads = torch.autograd.grad(out.square().sum(), leaves)
        assert all(torch.isfinite(g).all() for g in grads), kw


REFUSED = {
    "dropout": (dict(dropout_p=0.1), "dropout"),
    "alibi": (dict(alibi_slopes=torch.full((2,), 0.1)), "ALiBi"),
    "softcap": (dict(softcap=5.0), "softcap"),
    "sinks": (dict(sinks=torch.zeros(2)), "sinks"),
    "return_lse": (dict(return_lse=True), "log-sum-exp"),
    "learned_bias": (dict(attn_mask=torch.zeros(4, 6, requires_grad=True)), "learned bias"),
    "bias_dtype": (dict(attn_mask=torch.zeros(4, 6)), "float32 bias with torch.bfloat16"),
}


@pytest.mark.parametrize("feature", REFUSED)
def test_refusals_name_the_feature(feature):
    kw, words = REFUSED[feature]
    dtype = torch.bfloat16 if feature == "bias_dtype" else torch.float32
    q, k, v = (torch.randn(1, 2, n, 8, dtype=dtype) for n in (4, 6, 6))
    with pytest.raises(BackendError, match=f"backend 'torch' cannot run this call: .*{words}"):
        fastattn.attention(q, k, v, backend="torch", **kw)


def test_weights_and_merges_are_refused():
    q, k, v = (torch.randn(1, 2, n, 8) for n in (4, 6, 6))
    with pytest.raises(BackendError, match="log-sum-exp"):
        attention_with_weights(q, k, v, backend="torch")


def test_without_a_table_the_automatic_choice_is_fastattns_kernel():
    q, k, v = (torch.randn(1, 2, n, 8) for n in (4, 6, 6))
    fastattn.attention(q, k, v)
    assert fastattn.last_backend("attention") == "cpu"
