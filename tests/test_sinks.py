"""Attention sinks (`sinks=`, GPT-OSS) on attention, varlen_attention and
attention_with_kvcache, every backend.

The reference backend computes the sink in its own math (one more softmax column with no value,
fastattn/reference/attention.py); the kernel backends run their kernels unchanged and the op
layer rescales their (out, lse) exactly (fastattn/ops/_common.py: apply_sinks). The reference
itself is checked against the definition written out here (`definition`), and every backend
against the reference in float64 with FlashAttention's tolerance rule: out, lse, and the
gradients of q, k, v and the sinks. Rows with no visible key give 0 (lse = the sink), with
finite gradients.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import backend_device, require_kernel
from tolerance import assert_fa_close, assert_grad_close, float32_floor, rounding_floor

import fastattn

F64 = torch.float64
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_DT = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", F64: "f64"}

pytestmark = pytest.mark.usefixtures("one_thread")


def sinks_device(backend: str, kernel: str = "attention_forward") -> torch.device:
    require_kernel(kernel, backend)  # fails if the build lost it
    return backend_device(backend)


def definition(q, k, v, sinks, *, scale=None, visible=None, bias=None):
    """Attention with sinks written out in float64: scores, one column of sink logits,
    softmax over both, the sink's column dropped. visible: bool (B, Hq, Lq, Lk) or None."""
    B, Hq, Lq, D = q.shape
    group = Hq // k.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    kk = k.double().repeat_interleave(group, dim=1)
    vv = v.double().repeat_interleave(group, dim=1)
    s = q.double() @ kk.transpose(-1, -2) * scale
    if bias is not None:
        s = s + bias.double()
    if visible is not None:
        s = s.masked_fill(~visible, float("-inf"))
    col = sinks.double().view(1, Hq, 1, 1).expand(B, Hq, Lq, 1)
    full = torch.cat([s, col], dim=-1)
    lse = torch.logsumexp(full, dim=-1)
    p = torch.softmax(full, dim=-1)[..., :-1]
    return p @ vv, lse


# ---------------------------------------------------------------------------------------------
# attention


FEATURES = ("plain", "causal", "gqa", "bool_mask", "float_mask", "padding", "window", "dropout")


def make_case(feature, dtype, device, seed=0, B=2, Hq=4, Lq=13, Lk=29, D=24):
    g = torch.Generator().manual_seed(seed * 131 + len(feature))
    Hkv, Dv = Hq, D
    kw: dict = {}
    if feature == "gqa":
        Hkv, Dv = 1, D + 9
        kw["causal"] = "bottom_right"
    if feature == "causal":
        kw["causal"] = True
    if feature == "bool_mask":
        mask = torch.rand(B, 1, Lq, Lk, generator=g) > 0.4
        mask[0, 0, 3] = False  # a fully masked row
        kw["attn_mask"] = mask
    if feature == "float_mask":
        kw["attn_mask"] = torch.randn(1, Hq, Lq, Lk, generator=g).to(
            torch.float32 if dtype == torch.float32 else dtype
        )
    if feature == "padding":
        pad = torch.rand(B, Lk, generator=g) > 0.6
        pad[1] = True  # sequence 1 sees no key at all
        kw["key_padding_mask"] = pad
    if feature == "window":
        kw["window"] = (5, 2)
        kw["softcap"] = 3.0
        kw["alibi_slopes"] = torch.rand(Hq, generator=g) * 0.2
    if feature == "dropout":
        kw["dropout_p"] = 0.2
    q = torch.randn(B, Hq, Lq, D, generator=g)
    k = torch.randn(B, Hkv, Lk, D, generator=g)
    v = torch.randn(B, Hkv, Lk, Dv, generator=g)
    sinks = torch.randn(Hq, generator=g) * 2.0
    q, k, v = (t.to(dtype=dtype, device=device) for t in (q, k, v))
    kw = {n: x.to(device) if isinstance(x, torch.Tensor) else x for n, x in kw.items()}
    return q, k, v, sinks.to(device), kw


def run(backend, q, k, v, sinks, kw, grad_out, grad_lse, cast=None, sinks_dtype=torch.float32):
    leaves = [t.detach().to(cast or t.dtype).requires_grad_() for t in (q, k, v)]
    s = sinks.detach().to(F64 if cast == F64 else sinks_dtype).requires_grad_()
    torch.manual_seed(77)
    out, lse = fastattn.attention(*leaves, sinks=s, return_lse=True, backend=backend, **kw)
    assert fastattn.last_backend("attention") == backend
    grads = torch.autograd.grad(
        (out, lse), (*leaves, s), (grad_out.to(out.dtype), grad_lse.to(lse.dtype))
    )
    return (out.detach(), lse.detach(), *grads)


def check(backend, q, k, v, sinks, kw, **run_kw):
    """backend vs the float64 reference, with the reference in q's dtype as the baseline."""
    g = torch.Generator().manual_seed(5)
    B, Hq, Lq, _ = q.shape
    grad_out = torch.randn(B, Hq, Lq, v.shape[3], generator=g).to(q.device)
    grad_lse = (0.5 * torch.randn(B, Hq, Lq, generator=g)).to(q.device)
    got = run(backend, q, k, v, sinks, kw, grad_out, grad_lse, **run_kw)
    ref64 = run("reference", q, k, v, sinks, kw, grad_out, grad_lse, cast=F64)
    low = run("reference", q, k, v, sinks, kw, grad_out, grad_lse, **run_kw)
    names = ("out", "lse", "dq", "dk", "dv", "dsinks")
    for i, name in enumerate(names):
        assert not torch.isnan(got[i]).any(), f"{name}: NaN"
        assert got[i].dtype == low[i].dtype, name
        floor = float32_floor(ref64[i], got[i].dtype)
        if floor is None:
            floor = rounding_floor(ref64[i], got[i].dtype)
        if i == 0:
            assert_fa_close(name, got[i], ref64[i], low[i], floor=floor)
        else:
            # dsinks sums over every row: a few float32 ulps of that sum's terms' magnitudes.
            extra = 0.0
            if name == "dsinks" and got[i].dtype == torch.float32:
                extra = 64 * 2.0**-23 * float(grad_lse.abs().sum() + grad_out.abs().sum())
            assert_grad_close(name, got[i], ref64[i], low[i], floor=floor + extra)
    return got, ref64


def test_reference_matches_the_definition():
    """The reference's sink (one more softmax column) against the definition written out,
    with a fully masked row (output 0, lse = the sink)."""
    q, k, v, sinks, _ = make_case("gqa", F64, torch.device("cpu"))
    visible = torch.rand(q.shape[0], 1, q.shape[2], k.shape[2]) > 0.3
    visible[1, 0, 4] = False
    visible = visible.expand(-1, q.shape[1], -1, -1)
    out, lse = fastattn.attention(
        q, k, v, attn_mask=visible, sinks=sinks.double(), return_lse=True, backend="reference"
    )
    want_out, want_lse = definition(q, k, v, sinks, visible=visible)
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(lse, want_lse)
    assert torch.all(out[1, :, 4] == 0)
    torch.testing.assert_close(lse[1, :, 4], sinks.double())


@pytest.mark.parametrize("dtype", DTYPES, ids=[_DT[t] for t in DTYPES])
@pytest.mark.parametrize("feature", FEATURES)
def test_attention_sinks_match_reference(backend, feature, dtype):
    device = sinks_device(backend)
    if backend == "reference":
        pytest.skip("the reference is the definition these compare with")
    q, k, v, sinks, kw = make_case(feature, dtype, device)
    got, ref64 = check(backend, q, k, v, sinks, kw)
    empty = ref64[1] == sinks.double().view(1, -1, 1).expand_as(ref64[1])
    if feature in ("bool_mask", "padding"):
        assert empty.any() and torch.all(got[0][empty] == 0)


@pytest.mark.parametrize("sinks_dtype", (torch.float32, torch.bfloat16, F64))
def test_sinks_dtype_may_differ_from_q(backend, sinks_dtype):
    """float32 (or float64, or bf16) sinks beside bf16 activations: the gradient comes back in
    the sinks' dtype, the output in q's."""
    device = sinks_device(backend)
    q, k, v, sinks, kw = make_case("causal", torch.bfloat16, device, B=1, Hq=2, Lq=7, Lk=9)
    s = sinks.to(sinks_dtype).requires_grad_()
    out, lse = fastattn.attention(q, k, v, sinks=s, causal=True, return_lse=True, backend=backend)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    (ds,) = torch.autograd.grad(out.float().sum() + lse.sum(), s)
    assert ds.dtype == sinks_dtype and torch.isfinite(ds).all()
    ref_out, ref_lse = fastattn.attention(
        q.double(),
        k.double(),
        v.double(),
        sinks=s.double(),
        causal=True,
        return_lse=True,
        backend="reference",
    )
    assert (out.double() - ref_out).abs().max() < 0.03
    assert (lse.double() - ref_lse).abs().max() < 0.03


@pytest.mark.parametrize("be", ("reference", "cpu"))
def test_gradcheck_float64_with_sinks(be):
    """gradcheck (float64) of q, k, v and the sinks, with fully masked rows present, and
    gradgradcheck where the backward is differentiable (the reference)."""
    sinks_device(be)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 2, 5, 6, generator=g, dtype=F64, requires_grad=True)
    k = torch.randn(2, 1, 7, 6, generator=g, dtype=F64, requires_grad=True)
    v = torch.randn(2, 1, 7, 5, generator=g, dtype=F64, requires_grad=True)
    s = torch.randn(2, generator=g, dtype=F64, requires_grad=True)
    pad = torch.zeros(2, 7, dtype=torch.bool)
    pad[1, :] = True  # a sequence whose rows see nothing

    def fn(q, k, v, s):
        out, lse = fastattn.attention(
            q,
            k,
            v,
            sinks=s,
            causal="bottom_right",
            key_padding_mask=pad,
            return_lse=True,
            backend=be,
        )
        return out, lse

    assert torch.autograd.gradcheck(fn, (q, k, v, s))
    if be == "reference":
        assert torch.autograd.gradgradcheck(fn, (q, k, v, s))


def test_fully_masked_rows_give_zero_and_finite_gradients(backend):
    """Rows with no visible key: output 0, lse the sink, every gradient finite; also with a
    sink of -inf (no sink: lse stays -inf, no NaN anywhere)."""
    device = sinks_device(backend)
    dtype = torch.float32
    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 3, 4, 8, generator=g).to(device).requires_grad_()
    k = torch.randn(1, 3, 6, 8, generator=g).to(device).requires_grad_()
    v = torch.randn(1, 3, 6, 8, generator=g).to(device).requires_grad_()
    s = torch.tensor([0.5, -1.0, float("-inf")], dtype=dtype, device=device, requires_grad=True)
    mask = torch.ones(1, 1, 4, 6, dtype=torch.bool, device=device)
    mask[..., 1, :] = False
    out, lse = fastattn.attention(
        q, k, v, attn_mask=mask, sinks=s, return_lse=True, backend=backend
    )
    assert torch.all(out[:, :, 1] == 0)
    assert lse[0, 0, 1] == 0.5 and lse[0, 1, 1] == -1.0 and torch.isneginf(lse[0, 2, 1])
    plain = fastattn.attention(q, k, v, attn_mask=mask, backend=backend)
    torch.testing.assert_close(out[:, 2], plain[:, 2])  # a -inf sink is no sink
    total = out.sum() + lse.masked_fill(lse.isneginf(), 0).sum()
    grads = torch.autograd.grad(total, (q, k, v, s), retain_graph=True)
    for name, gr in zip("qkvs", grads):
        assert torch.isfinite(gr).all(), f"d{name} has NaN/inf"
    # The sinks' gradient of a fully masked row's lse is 1 (lse = sink there).
    (ds,) = torch.autograd.grad(lse[0, :2, 1].sum(), s)
    torch.testing.assert_close(ds, torch.tensor([1.0, 1.0, 0.0], device=device))


def test_compile_fullgraph_with_sinks():
    """attention with sinks traces into one graph and matches eager, forward and backward."""
    sinks_device("cpu")
    q, k, v, sinks, kw = make_case("causal", torch.float32, torch.device("cpu"), B=1, Lq=9, Lk=11)

    def fn(q, k, v, s):
        return fastattn.attention(q, k, v, sinks=s, return_lse=True, backend="cpu", **kw)

    compiled = torch.compile(fn, fullgraph=True)
    results = []
    for f in (compiled, fn):
        leaves = [t.detach().requires_grad_() for t in (q, k, v, sinks)]
        out, lse = f(*leaves)
        results.append((out, lse, *torch.autograd.grad(out.sum() + lse.sum(), leaves)))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "sinks,match",
    [
        (torch.zeros(3), r"sinks must be \(Hq,\) = \(4,\)"),
        (torch.zeros(1, 4), r"sinks must be \(Hq,\)"),
        (torch.zeros(4, dtype=torch.int32), r"sinks must be float32"),
        (torch.zeros(4, device="meta"), r"sinks must be on q's device"),
        ([0.0] * 4, r"sinks must be a torch.Tensor"),
    ],
)
@pytest.mark.parametrize("op", ("attention", "varlen_attention", "attention_with_kvcache"))
def test_bad_sinks_name_the_argument(op, sinks, match):
    q = torch.randn(1, 4, 3, 8)
    k = v = torch.randn(1, 2, 5, 8)
    error = TypeError if isinstance(sinks, list) else ValueError
    with pytest.raises(error, match=match):
        if op == "attention":
            fastattn.attention(q, k, v, sinks=sinks)
        elif op == "varlen_attention":
            cu_q = torch.tensor([0, 3], dtype=torch.int32)
            cu_k = torch.tensor([0, 5], dtype=torch.int32)
            fastattn.varlen_attention(
                q[0].transpose(0, 1),
                k[0].transpose(0, 1),
                v[0].transpose(0, 1),
                cu_q,
                cu_k,
                3,
                5,
                sinks=sinks,
            )
        else:
            fastattn.attention_with_kvcache(
                q[:, :, :1],
                k.clone(),
                v.clone(),
                cache_seqlens=torch.tensor([4], dtype=torch.int32),
                sinks=sinks,
            )


# ---------------------------------------------------------------------------------------------
# varlen_attention


def varlen_case(dtype, device, lengths=((5, 9), (0, 4), (11, 3), (1, 1), (7, 0))):
    g = torch.Generator().manual_seed(11)
    Hq, Hkv, D = 4, 2, 16
    lq = [a for a, _ in lengths]
    lk = [b for _, b in lengths]

    def cu(ls):
        return torch.tensor([0] + list(torch.tensor(ls).cumsum(0)), dtype=torch.int32)

    q = torch.randn(sum(lq), Hq, D, generator=g).to(dtype=dtype, device=device)
    k = torch.randn(sum(lk), Hkv, D, generator=g).to(dtype=dtype, device=device)
    v = torch.randn(sum(lk), Hkv, D, generator=g).to(dtype=dtype, device=device)
    sinks = torch.randn(Hq, generator=g).to(device)
    return q, k, v, sinks, cu(lq).to(device), cu(lk).to(device), max(lq), max(lk)


@pytest.mark.parametrize("dtype", (*DTYPES, F64), ids=[_DT[t] for t in (*DTYPES, F64)])
@pytest.mark.parametrize("backend", ("cpu", "cuda", "triton"))  # the reference is the oracle
def test_varlen_sinks_match_reference(backend, dtype):
    device = sinks_device(backend, "varlen_attention_forward")
    if backend == "triton" and dtype == F64:
        pytest.skip("the triton backend has no float64 kernels")
    q, k, v, sinks, cu_q, cu_k, mq, mk = varlen_case(dtype, device)
    g = torch.Generator().manual_seed(12)
    grad_out = torch.randn(q.shape[0], q.shape[1], v.shape[2], generator=g).to(device)
    grad_lse = torch.randn(q.shape[1], q.shape[0], generator=g).to(device)

    def go(be, cast=None):
        leaves = [t.detach().to(cast or t.dtype).requires_grad_() for t in (q, k, v, sinks)]
        out, lse = fastattn.varlen_attention(
            *leaves[:3],
            cu_q,
            cu_k,
            mq,
            mk,
            causal="bottom_right",
            sinks=leaves[3],
            return_lse=True,
            backend=be,
        )
        assert fastattn.last_backend("varlen_attention") == be
        gr = torch.autograd.grad(
            (out, lse), leaves, (grad_out.to(out.dtype), grad_lse.to(lse.dtype))
        )
        return (out.detach(), lse.detach(), *gr)

    got, ref64, low = go(backend), go("reference", F64), go("reference")
    for i, name in enumerate(("out", "lse", "dq", "dk", "dv", "dsinks")):
        assert not torch.isnan(got[i]).any(), name
        floor = float32_floor(ref64[i], got[i].dtype) or rounding_floor(ref64[i], got[i].dtype)
        if dtype == F64:  # float64 kernels: sums in another order than the reference's
            floor = 1e-12 * (1.0 + float(ref64[i].masked_fill(ref64[i].isinf(), 0).abs().max()))
        if name == "dsinks":
            floor += 64 * 2.0**-23 * float(grad_lse.abs().sum() + grad_out.abs().sum())
        assert_fa_close(name, got[i], ref64[i], low[i], factor=2.0 if i < 2 else 3.0, floor=floor)
    # Sequence 4 has queries and no keys: output 0, lse = the sink.
    rows = slice(int(cu_q[4]), int(cu_q[5]))
    assert torch.all(got[0][rows] == 0)
    torch.testing.assert_close(got[1][:, rows], sinks.view(-1, 1).expand(-1, 7).to(got[1].dtype))


def test_varlen_gradcheck_float64_with_sinks():
    sinks_device("cpu", "varlen_attention_forward")
    q, k, v, sinks, cu_q, cu_k, mq, mk = varlen_case(F64, torch.device("cpu"), ((3, 4), (2, 0)))
    leaves = [t.requires_grad_() for t in (q, k, v, sinks.double())]

    def fn(q, k, v, s):
        return fastattn.varlen_attention(
            q, k, v, cu_q, cu_k, mq, mk, causal=True, sinks=s, return_lse=True, backend="cpu"
        )

    assert torch.autograd.gradcheck(fn, leaves)


# ---------------------------------------------------------------------------------------------
# attention_with_kvcache


@pytest.mark.parametrize("num_splits", (1, 3))
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16))
def test_kvcache_sinks_match_reference(backend, dtype, num_splits):
    kernel = "attention_with_kvcache" if backend == "triton" else "attention_decode"
    device = sinks_device(backend, kernel)
    g = torch.Generator().manual_seed(21)
    B, Hq, Hkv, Lmax, D, Lq = 3, 4, 2, 40, 16, 2
    k_cache = torch.randn(B, Hkv, Lmax, D, generator=g).to(dtype=dtype, device=device)
    v_cache = torch.randn(B, Hkv, Lmax, D, generator=g).to(dtype=dtype, device=device)
    q = torch.randn(B, Hq, Lq, D, generator=g).to(dtype=dtype, device=device)
    k_new = torch.randn(B, Hkv, Lq, D, generator=g).to(dtype=dtype, device=device)
    v_new = torch.randn(B, Hkv, Lq, D, generator=g).to(dtype=dtype, device=device)
    seqlens = torch.tensor([0, 17, 33], dtype=torch.int32, device=device)
    sinks = torch.randn(Hq, generator=g).to(device)
    outs = {}
    for be in (backend, "reference"):
        kc, vc = k_cache.clone(), v_cache.clone()
        outs[be] = fastattn.attention_with_kvcache(
            q,
            kc,
            vc,
            cache_seqlens=seqlens,
            k_new=k_new,
            v_new=v_new,
            sinks=sinks,
            window=(20, -1),
            num_splits=num_splits,
            backend=be,
        )
        assert fastattn.last_backend("attention_with_kvcache") == be
    # Definition: dense attention with sinks over each sequence's valid cache.
    kc, vc = k_cache.clone(), v_cache.clone()
    for b in range(B):
        n = int(seqlens[b])
        kc[b, :, n : n + Lq], vc[b, :, n : n + Lq] = k_new[b], v_new[b]
    for b in range(B):
        n = int(seqlens[b]) + Lq
        pos = torch.arange(Lq).view(Lq, 1) + int(seqlens[b])
        j = torch.arange(n).view(1, n)
        visible = ((j <= pos) & (j >= pos - 20)).to(device).expand(1, Hq, Lq, n)
        want, _ = definition(
            q[b : b + 1], kc[b : b + 1, :, :n], vc[b : b + 1, :, :n], sinks, visible=visible
        )
        for be, out in outs.items():
            tol = 1e-5 if dtype == torch.float32 else 3e-3
            torch.testing.assert_close(out[b].double(), want[0], rtol=tol, atol=tol, msg=be)
