"""Tests of fastattn.attention and merge_attention on every backend.

Each backend is compared with the reference backend run on float64 copies of the inputs, under
FlashAttention's tolerance rule (tests/tolerance.py): the error must be at most 2x (outputs,
lse) or 3x (gradients) the error of the reference run in the input's dtype, plus a rounding
floor. Every test asserts `fastattn.last_backend("attention")` so it is known which kernel ran.

The Triton backend runs under Triton's CPU interpreter here (slow), so the quick tests use a
representative subset of the grid; the full cross-product (HEAD_DIMS x LENGTHS x FEATURES x
dtypes) is marked slow (tests/conftest.py: FASTATTN_SLOW=1 or -m slow runs it).
"""

from __future__ import annotations

import time
import types

import pytest
import torch
from attention_floors import assert_gradient_close, delta_model
from conftest import backend_device, require_kernel
from tolerance import (
    assert_fa_close,
    assert_lse_close,
    float32_floor,
)

import fastattn
from fastattn.ops._common import dropout_seed
from fastattn.reference.random import dropout_keep_mask

HEAD_DIMS = (32, 40, 59, 64, 80, 96, 111, 128, 160, 192, 224, 256)
LENGTHS = (
    (1, 1),
    (1, 128),
    (128, 1),
    (113, 203),
    (128, 217),
    (113, 211),
    (108, 256),
    (256, 512),
    (512, 256),
    (1023, 1024),
    (1024, 1023),
)
FEATURES = (
    "plain",
    "causal",
    "causal_br",
    "bool_mask",
    "float_mask",
    "padding",
    "gqa",
    "mqa",
    "dv",
    "alibi",
    "window",
    "softcap",
    "dropout",
    "scale",
    "everything",
)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The backends compared with the reference (the reference's own checks: test_reference_oracles)
KERNEL_BACKENDS = ("cpu", "cuda", "triton")
_DT = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


# ---------------------------------------------------------------------------------------------
# Helpers


def attention_device(backend: str) -> torch.device:
    """The device for `backend`'s attention tests; skips when the backend cannot run here
    (fails when the build claims its attention kernel but lost it: require_kernel)."""
    require_kernel("attention_forward", backend)
    return backend_device(backend)


def make_case(
    feature: str, D: int, Lq: int, Lk: int, dtype: torch.dtype, device: torch.device, seed: int = 0
):
    """Random q, k, v (leaves in `dtype` on `device`) and attention keywords for `feature`."""
    g = torch.Generator().manual_seed(seed * 7919 + D * 31 + Lq * 17 + Lk)
    big = Lq * Lk >= 1 << 17 or feature == "everything"  # keep the interpreter's work small
    B, Hq, Hkv, Dv = (1 if big else 2), 2, 2, D
    if Lq * Lk >= 1 << 19:
        Hq = Hkv = 1
    kw: dict = {}
    if feature in ("gqa", "everything"):
        Hq, Hkv = 2 * Hq, Hkv
    if feature == "mqa":
        Hq, Hkv = 3, 1
    if feature in ("dv", "everything"):
        Dv = 40 if D > 100 else 200 if D <= 40 else D + 17
    if feature == "causal":
        kw["causal"] = True
    if feature in ("causal_br", "everything"):
        kw["causal"] = "bottom_right"
    if feature == "bool_mask":
        kw["attn_mask"] = torch.rand(B, 1, Lq, Lk, generator=g) > 0.3
    if feature in ("float_mask", "everything"):
        mask_dtype = torch.float32 if dtype == torch.float32 else dtype
        kw["attn_mask"] = torch.randn(1, Hq, Lq, Lk, generator=g).to(mask_dtype)
    if feature in ("padding", "everything"):
        kw["key_padding_mask"] = torch.rand(B, Lk, generator=g) > 0.7
    if feature in ("alibi", "everything"):
        kw["alibi_slopes"] = torch.rand(B, Hq, generator=g) * 0.3
    if feature == "window":
        kw["window"] = (37, 11)
    if feature in ("softcap", "everything"):
        kw["softcap"] = 2.5
        kw["scale"] = 0.5  # large scores, so that the cap bends them
    if feature in ("dropout", "everything"):
        kw["dropout_p"] = 0.17
    if feature == "scale":
        kw["scale"] = 0.37
    q = torch.randn(B, Hq, Lq, D, generator=g)
    k = torch.randn(B, Hkv, Lk, D, generator=g)
    v = torch.randn(B, Hkv, Lk, Dv, generator=g)
    q, k, v = (t.to(dtype=dtype, device=device) for t in (q, k, v))
    kw = {
        name: value.to(device) if isinstance(value, torch.Tensor) else value
        for name, value in kw.items()
    }
    return q, k, v, kw


def run_attention(backend, q, k, v, kw, grad_out=None, grad_lse=None, seed=1234, cast=None):
    """(out, lse, dq, dk, dv) of `backend` on copies of q, k, v (cast to `cast` if given);
    gradients of <out, grad_out> + <lse, grad_lse>. Dropout uses torch.manual_seed(seed)."""
    leaves = [t.detach().to(cast or t.dtype).requires_grad_() for t in (q, k, v)]
    torch.manual_seed(seed)
    out, lse = fastattn.attention(*leaves, return_lse=True, backend=backend, **kw)
    assert fastattn.last_backend("attention") == backend
    if grad_out is None:
        return out.detach(), lse.detach(), None, None, None
    outputs, grads = [out], [grad_out.to(out.dtype)]
    if grad_lse is not None:
        outputs.append(lse)
        grads.append(grad_lse.to(lse.dtype))
    dq, dk, dv = torch.autograd.grad(outputs, leaves, grads)
    return out.detach(), lse.detach(), dq, dk, dv


def compare_with_reference(backend, q, k, v, kw, grads=True, lse_grad=True) -> dict:
    """Run `backend`, the float64 reference and the reference in q's dtype (the rule's
    baseline) on the same inputs and output gradients. Returns what assert_matches_reference
    checks: {"got", "ref64", "low"} as (out, lse, dq, dk, dv), the inputs and the extra floors
    of tests/attention_floors.py."""
    assert backend != "reference", "the reference is compared with itself: use a kernel backend"
    g = torch.Generator().manual_seed(99)
    B, Hq, Lq, _ = q.shape
    Dv = v.shape[3]
    grad_out = grad_lse = None
    if grads:
        grad_out = torch.randn(B, Hq, Lq, Dv, generator=g).to(q.dtype).to(q.device)
        if lse_grad:
            grad_lse = (0.5 * torch.randn(B, Hq, Lq, generator=g)).to(q.device)
    got = run_attention(backend, q, k, v, kw, grad_out, grad_lse)
    ref64 = run_attention(
        "reference",
        q,
        k,
        v,
        kw,
        None if grad_out is None else grad_out.double(),
        None if grad_lse is None else grad_lse.double(),
        cast=torch.float64,
    )
    low = run_attention("reference", q, k, v, kw, grad_out, grad_lse)
    model = (
        delta_model(q, k, v, kw, grad_out, ref64[0], got[0], grad_lse=grad_lse) if grads else None
    )
    return {"got": got, "ref64": ref64, "low": low, "inputs": (q, k, v), "model": model}


def assert_matches_reference(results: dict, tamper: dict | None = None) -> None:
    """FlashAttention's rule on compare_with_reference's results: out and lse (2x), dq, dk, dv
    (3x) with the rule's rounding floor plus the one derived extra term of
    tests/attention_floors.py (the residue of Delta read from the saved output), which must
    stay below 5% of the gradient's largest magnitude in 16-bit. tamper: {"dq": factor, ...}
    scales the backend's gradients first (tests of this check: tests/test_check_teeth.py)."""
    got, ref64, low = results["got"], results["ref64"], results["low"]
    q, k, v = results["inputs"]
    B, Hq, Lq, _ = q.shape
    Dv = v.shape[3]
    out, lse = got[0], got[1]
    assert out.dtype == q.dtype and out.shape == (B, Hq, Lq, Dv)
    assert lse.dtype == torch.float32 and lse.shape == (B, Hq, Lq)
    assert_fa_close("out", out, ref64[0], low[0], floor=float32_floor(ref64[0], out.dtype))
    assert_lse_close(lse, ref64[1], low[1])
    empty = torch.isneginf(ref64[1])
    assert torch.all(out[empty] == 0), "rows without a visible key must give out 0"
    if results["model"] is None:
        return
    for name, i, x in (("dq", 2, q), ("dk", 3, k), ("dv", 4, v)):
        assert got[i].dtype == x.dtype, name
        assert_gradient_close(name, got[i], ref64[i], low[i], results["model"], tamper)


def check_against_reference(backend, q, k, v, kw, grads=True, lse_grad=True):
    """`backend` against the float64 reference under FlashAttention's rule (out, lse, and the
    gradients of q, k, v): compare_with_reference, then assert_matches_reference."""
    assert_matches_reference(compare_with_reference(backend, q, k, v, kw, grads, lse_grad))


# ---------------------------------------------------------------------------------------------
# Accuracy against the reference: a quick representative subset, and the full grid (slow)


def _quick_cases():
    """Every feature in every dtype (45 cases), head dims and lengths spread over the
    grid so that each appears about four times, plus a few hand-picked cases."""
    cases = []
    for f, feature in enumerate(FEATURES):
        for t, dtype in enumerate(DTYPES):
            n = 3 * f + t
            cases.append(
                (
                    feature,
                    HEAD_DIMS[(5 * n) % len(HEAD_DIMS)],
                    LENGTHS[(7 * n + f) % len(LENGTHS)],
                    dtype,
                )
            )
    cases += [
        ("causal", 64, (1023, 1024), torch.float16),
        ("causal_br", 80, (1024, 1023), torch.float32),
        ("plain", 256, (108, 256), torch.float32),
        ("window", 64, (512, 256), torch.bfloat16),
        ("everything", 111, (113, 203), torch.float32),
    ]
    return cases


QUICK_CASES = _quick_cases()


@pytest.mark.parametrize(
    "feature,D,lengths,dtype",
    QUICK_CASES,
    ids=[f"{f}-D{d}-{lq}x{lk}-{_DT[t]}" for f, d, (lq, lk), t in QUICK_CASES],
)
# Kernel backends only: the reference is the definition compared with (its own checks against
# SDPA and a textbook loop: test_reference_oracles.py).
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_attention_matches_reference(backend, feature, D, lengths, dtype):
    device = attention_device(backend)
    q, k, v, kw = make_case(feature, D, *lengths, dtype, device)
    check_against_reference(backend, q, k, v, kw)


@pytest.mark.slow
@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("D", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=[_DT[t] for t in DTYPES])
@pytest.mark.parametrize("feature", FEATURES)
def test_attention_grid(backend, feature, dtype, D):
    """The full grid: every (Lq, Lk) of LENGTHS for this feature, dtype and head dim."""
    device = attention_device(backend)
    failures = []
    for Lq, Lk in LENGTHS:
        q, k, v, kw = make_case(feature, D, Lq, Lk, dtype, device)
        try:
            check_against_reference(backend, q, k, v, kw)
        except AssertionError as exc:
            failures.append(f"(Lq, Lk) = ({Lq}, {Lk}): {exc}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_backward_without_lse_gradient(backend):
    """The usual path: only the output is used, so the backward receives grad_lse = None."""
    device = attention_device(backend)
    q, k, v, kw = make_case("causal", 64, 113, 203, torch.float32, device)
    check_against_reference(backend, q, k, v, kw, lse_grad=False)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_forward_without_gradients(backend):
    device = attention_device(backend)
    q, k, v, kw = make_case("everything", 59, 113, 211, torch.float16, device)
    with torch.no_grad():
        check_against_reference(backend, q, k, v, kw, grads=False)


# ---------------------------------------------------------------------------------------------
# Semantics


@pytest.mark.parametrize("dtype", DTYPES, ids=[_DT[t] for t in DTYPES])
def test_causal_worked_example(backend, dtype):
    """A worked causal example of 4 tokens, its scores and probabilities written out by hand.
    With keys k_j = e_j and scale 1, q_i . k_j is the j-th score of row i; with v = identity
    the output rows are the probabilities."""
    device = attention_device(backend)
    scores = torch.tensor(
        [[0.7, 0.0, 0.0, 0.0], [0.1, 0.6, 0.0, 0.0], [0.1, 0.3, 0.6, 0.0], [0.1, 0.3, 0.3, 0.3]]
    )
    expected = torch.tensor(
        [
            [1.0, 0.0, 0.0, 0.0],
            [0.3775, 0.6225, 0.0, 0.0],
            [0.2584, 0.3156, 0.4260, 0.0],
            [0.2144, 0.2619, 0.2619, 0.2619],
        ]
    )
    q = scores.view(1, 1, 4, 4).to(dtype=dtype, device=device)
    eye = torch.eye(4).view(1, 1, 4, 4).to(dtype=dtype, device=device)
    out, lse = fastattn.attention(
        q, eye, eye, causal=True, scale=1.0, return_lse=True, backend=backend
    )
    assert fastattn.last_backend("attention") == backend
    atol = 1e-4 if dtype == torch.float32 else 5e-3
    torch.testing.assert_close(out.float().cpu().view(4, 4), expected, atol=atol, rtol=0)
    # Exactly: the softmax of the scores as rounded to dtype.
    hidden = torch.ones(4, 4).triu(1).bool()
    rounded = q.float().cpu().view(4, 4).masked_fill(hidden, float("-inf"))
    exact = torch.softmax(rounded, -1).to(dtype).float()
    torch.testing.assert_close(
        out.float().cpu().view(4, 4), exact, atol=1e-6 if dtype == torch.float32 else 4e-3, rtol=0
    )
    torch.testing.assert_close(lse.cpu().view(4), torch.logsumexp(rounded, -1), atol=1e-6, rtol=0)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_fully_masked_rows(backend):
    """Rows with no visible key (bool mask, key padding, window) give out 0 and lse -inf, never
    NaN; their dq is 0 and every gradient stays finite, with or without an lse gradient."""
    device = attention_device(backend)
    B, H, Lq, Lk, D = 2, 2, 70, 90, 48
    g = torch.Generator().manual_seed(5)
    q = torch.randn(B, H, Lq, D, generator=g).to(device)
    k = torch.randn(B, H, Lk, D, generator=g).to(device)
    v = torch.randn(B, H, Lk, D, generator=g).to(device)
    mask = torch.rand(B, H, Lq, Lk, generator=g) > 0.2
    mask[:, :, 3] = False  # row 3: every key masked
    mask[0, 1, 40:60] = False  # a block of rows in one head
    padding = torch.zeros(B, Lk, dtype=torch.bool)
    padding[1] = True  # batch 1: every key is padding
    kw = dict(attn_mask=mask.to(device), key_padding_mask=padding.to(device))
    check_against_reference(backend, q, k, v, kw)
    # The same with a window that hides every key of the first rows (bottom-right, Lq > Lk).
    check_against_reference(
        backend,
        q[..., :45, :],
        k[..., :30, :],
        v[..., :30, :],
        dict(causal="bottom_right", window=(5, 0)),
    )

    empty = ~mask.any(-1) | padding.all(-1).view(B, 1, 1)
    grad_out = torch.randn(B, H, Lq, D, generator=g).to(device)
    grad_lse = torch.randn(B, H, Lq, generator=g).to(device)
    out, lse, dq, dk, dv = run_attention(backend, q, k, v, kw, grad_out, grad_lse)
    empty = empty.to(device)
    assert torch.all(out[empty] == 0) and torch.all(torch.isneginf(lse[empty]))
    assert torch.isfinite(out).all() and torch.isfinite(lse[~empty]).all()
    for name, grad in (("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.isfinite(grad).all(), f"{name} has non-finite values"
    assert torch.all(dq[empty] == 0), "dq of rows without a visible key must be 0"
    assert torch.all(dk[1] == 0) and torch.all(dv[1] == 0), "padded keys get no gradient"


@pytest.mark.parametrize(
    "B,Lq,Lk", [(2, 5, 0), (2, 0, 7), (0, 3, 4)], ids=["no-keys", "no-queries", "no-batch"]
)
def test_empty_shapes(backend, B, Lq, Lk):
    """Zero keys: every row sees nothing (out 0, lse -inf); zero queries or batch: empty
    results; gradients have the inputs' shapes."""
    device = attention_device(backend)
    q = torch.randn(B, 2, Lq, 8, device=device, requires_grad=True)
    k = torch.randn(B, 2, Lk, 8, device=device, requires_grad=True)
    v = torch.randn(B, 2, Lk, 6, device=device, requires_grad=True)
    out, lse = fastattn.attention(q, k, v, return_lse=True, backend=backend)
    assert fastattn.last_backend("attention") == backend
    assert out.shape == (B, 2, Lq, 6) and lse.shape == (B, 2, Lq)
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))
    dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert torch.all(dq == 0)


def test_gqa_matches_repeated_heads(backend):
    """Grouped-query attention equals multi-head attention over repeated k/v heads, and dk/dv
    are the sums of the repeated heads' gradients."""
    device = attention_device(backend)
    B, Hq, Hkv, Lq, Lk, D = 1, 6, 2, 67, 131, 40
    g = torch.Generator().manual_seed(3)
    q = torch.randn(B, Hq, Lq, D, generator=g).to(device)
    k = torch.randn(B, Hkv, Lk, D, generator=g).to(device)
    v = torch.randn(B, Hkv, Lk, D + 8, generator=g).to(device)
    grad_out = torch.randn(B, Hq, Lq, D + 8, generator=g).to(device)
    kw = dict(causal="bottom_right", softcap=3.0)
    out, lse, dq, dk, dv = run_attention(backend, q, k, v, kw, grad_out)
    group = Hq // Hkv
    kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    out_r, lse_r, dq_r, dk_r, dv_r = run_attention(backend, q, kr, vr, kw, grad_out)
    torch.testing.assert_close(out, out_r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, lse_r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dq, dq_r, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dk, dk_r.view(B, Hkv, group, Lk, D).sum(2), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(dv, dv_r.view(B, Hkv, group, Lk, D + 8).sum(2), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("Lq", [77, 5], ids=["two-query-blocks", "one-query-block"])
def test_strided_inputs(backend, Lq):
    """(B, L, H, D) tensors transposed to (B, H, L, D), a k sliced out of a wider tensor, and a
    non-contiguous output gradient: no copies needed, same results as contiguous inputs, and
    the output follows q's layout. (One query block: the CPU forward streams K and V row by row
    with their prefetches.)"""
    device = attention_device(backend)
    B, H, Lk, D = 2, 3, 140, 64
    g = torch.Generator().manual_seed(11)
    q = torch.randn(B, Lq, H, D, generator=g).to(device).transpose(1, 2)
    k = torch.randn(B, H, Lk, 2 * D, generator=g).to(device)[..., :D]
    v = torch.randn(B, Lk, H, D, generator=g).to(device).transpose(1, 2)
    grad_out = torch.randn(B, Lq, H, D, generator=g).to(device).transpose(1, 2)
    assert not q.is_contiguous() and not k.is_contiguous() and not grad_out.is_contiguous()
    kw = dict(causal=True)
    strided = run_attention(backend, q, k, v, kw, grad_out)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = fastattn.attention(*leaves, backend=backend, **kw)
    assert out.transpose(1, 2).is_contiguous(), "out must follow q's (B, L, H, D) layout"
    contiguous = run_attention(
        backend, q.contiguous(), k.contiguous(), v.contiguous(), kw, grad_out.contiguous()
    )
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), strided, contiguous):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    check_against_reference(backend, q, k, v, kw)


# Under Triton's interpreter the 20000 keys take a minute: a slow case there.
@pytest.mark.parametrize(
    "backend",
    [pytest.param(b, marks=pytest.mark.slow) if b == "triton" else b for b in KERNEL_BACKENDS],
)
def test_long_keys_stream_with_prefetches(backend, one_thread):
    """Keys and values larger than a CPU core's L2 cache (20 MiB of float32 here, one thread)
    with one query block: the CPU forward prefetches the next key tile's cache lines while it
    computes the current one, row by row for these strided (B, L, H, D) tensors. Forward and
    backward match the reference, GQA and causal included."""
    device = attention_device(backend)
    B, Hq, Hkv, Lq, Lk, D, Dv = 1, 4, 2, 3, 20000, 64, 64
    g = torch.Generator().manual_seed(12)
    q = torch.randn(B, Lq, Hq, D, generator=g).to(device).transpose(1, 2)
    k = torch.randn(B, Lk, Hkv, D, generator=g).to(device).transpose(1, 2)
    v = torch.randn(B, Lk, Hkv, Dv, generator=g).to(device).transpose(1, 2)
    for kw in ({}, dict(causal=True)):
        check_against_reference(backend, q, k, v, kw)


# ---------------------------------------------------------------------------------------------
# Dropout


def test_dropout_mask_is_the_reference_mask(backend):
    """With v = identity the output is P * keep / (1 - p): its zeros are exactly the dropped
    elements, which must be those of fastattn's Philox stream (the reference's mask)."""
    device = attention_device(backend)
    B, H, Lq, Lk, D, p = 2, 2, 37, 48, 32, 0.3
    g = torch.Generator().manual_seed(2)
    q = torch.randn(B, H, Lq, D, generator=g).to(device)
    k = torch.randn(B, H, Lk, D, generator=g).to(device)
    v = torch.eye(Lk).expand(B, H, Lk, Lk).to(device)
    torch.manual_seed(42)
    out = fastattn.attention(q, k, v, dropout_p=p, backend=backend)
    assert fastattn.last_backend("attention") == backend
    torch.manual_seed(42)
    seed = dropout_seed(p, device)  # the draw attention made
    keep = dropout_keep_mask(seed, (B, H, Lq, Lk), p, device)
    assert torch.equal(out != 0, keep)
    assert abs(keep.float().mean().item() - (1 - p)) < 0.05
    if backend == "reference":
        return  # the reference's own mask is checked above; what follows compares with it
    torch.manual_seed(42)
    ref = fastattn.attention(q, k, v, dropout_p=p, backend="reference")
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_dropout_reproducible(backend):
    device = attention_device(backend)
    q, k, v, kw = make_case("dropout", 64, 64, 100, torch.float32, device)
    grad_out = torch.randn(q.shape[:3] + (v.shape[3],)).to(device)
    first = run_attention(backend, q, k, v, kw, grad_out, seed=7)
    again = run_attention(backend, q, k, v, kw, grad_out, seed=7)
    other = run_attention(backend, q, k, v, kw, grad_out, seed=8)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), first, again):
        assert torch.equal(a, b), f"{name} differs under the same torch.manual_seed"
    assert not torch.equal(first[0], other[0]), "a different seed must drop other elements"
    assert torch.equal(first[1], other[1]), "lse is that of the undropped scores"


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_dropout_backward_uses_forward_mask(backend):
    """Gradients under dropout agree with the reference under the same seed, which is only
    possible if the backward regenerates the forward's mask."""
    device = attention_device(backend)
    q, k, v, kw = make_case("dropout", 40, 128, 217, torch.float32, device, seed=3)
    kw["dropout_p"] = 0.5
    check_against_reference(backend, q, k, v, kw)


# ---------------------------------------------------------------------------------------------
# Determinism, merge_attention


def test_backward_is_deterministic(backend):
    device = attention_device(backend)
    q, k, v, kw = make_case("everything", 64, 113, 211, torch.float32, device)
    kw["deterministic"] = True
    g = torch.Generator().manual_seed(1)
    grad_out = torch.randn(q.shape[:3] + (v.shape[3],), generator=g).to(device)
    grad_lse = torch.randn(q.shape[:3], generator=g).to(device)
    first = run_attention(backend, q, k, v, kw, grad_out, grad_lse)
    second = run_attention(backend, q, k, v, kw, grad_out, grad_lse)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), first, second):
        assert torch.equal(a, b), f"{name} is not bitwise reproducible"


@pytest.mark.parametrize("all_masked_chunk", [False, True], ids=["chunks", "masked-chunk"])
def test_merge_attention_of_key_chunks(backend, all_masked_chunk):
    """Attention over disjoint key chunks, merged with their lse, equals attention over all
    keys, forward and backward (gradients flow through the partial outs and lses)."""
    device = attention_device(backend)
    B, H, Lq, Lk, D = 2, 2, 53, 200, 40
    g = torch.Generator().manual_seed(17)
    q = torch.randn(B, H, Lq, D, generator=g).to(device).requires_grad_()
    k = torch.randn(B, H, Lk, D, generator=g).to(device).requires_grad_()
    v = torch.randn(B, H, Lk, D, generator=g).to(device).requires_grad_()
    grad_out = torch.randn(B, H, Lq, D, generator=g).to(device)
    grad_lse = torch.randn(B, H, Lq, generator=g).to(device)
    padding = torch.rand(B, Lk, generator=g) > 0.8
    bounds = [(0, 70), (70, 150), (150, Lk)]
    if all_masked_chunk:
        padding[:, 70:150] = True
    padding = padding.to(device)

    outs, lses = [], []
    for lo, hi in bounds:
        o, l = fastattn.attention(
            q,
            k[:, :, lo:hi],
            v[:, :, lo:hi],
            key_padding_mask=padding[:, lo:hi].contiguous(),
            return_lse=True,
            backend=backend,
        )
        assert fastattn.last_backend("attention") == backend
        outs.append(o)
        lses.append(l)
    if all_masked_chunk:
        assert torch.all(torch.isneginf(lses[1])) and torch.all(outs[1] == 0)
    out, lse = fastattn.merge_attention(outs, lses)
    merged = torch.autograd.grad((out, lse), (q, k, v), (grad_out, grad_lse))

    full_out, full_lse = fastattn.attention(
        q, k, v, key_padding_mask=padding, return_lse=True, backend=backend
    )
    full = torch.autograd.grad((full_out, full_lse), (q, k, v), (grad_out, grad_lse))
    torch.testing.assert_close(out, full_out, rtol=1e-5, atol=2e-6)
    torch.testing.assert_close(lse, full_lse, rtol=1e-5, atol=2e-6)
    for name, a, b in zip(("dq", "dk", "dv"), merged, full):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=name)


# ---------------------------------------------------------------------------------------------
# Registration


def _op_args(device, dtype=torch.float32, dropout=False):
    g = torch.Generator().manual_seed(8)
    q = torch.randn(1, 2, 19, 24, generator=g).to(dtype=dtype, device=device)
    k = torch.randn(1, 1, 33, 24, generator=g).to(dtype=dtype, device=device)
    v = torch.randn(1, 1, 33, 16, generator=g).to(dtype=dtype, device=device)
    mask = (torch.rand(1, 1, 19, 33, generator=g) > 0.2).to(device).expand(1, 2, 19, 33)
    padding = (torch.rand(1, 33, generator=g) > 0.8).to(device)
    alibi = torch.rand(1, 2, generator=g).to(device)
    seed = torch.tensor([123, 4], dtype=torch.int64, device=device) if dropout else None
    return [q, k, v, mask, padding, alibi, 0.2, 0.0, -(1 << 30), 14, 0.25 if dropout else 0.0, seed]


@pytest.mark.parametrize("dropout", [False, True], ids=["plain", "dropout"])
def test_opcheck_triton_forward(dropout):
    device = backend_device("triton")
    args = _op_args(device, dropout=dropout)
    for t in args[:3]:
        t.requires_grad_()
    torch.library.opcheck(torch.ops.fastattn.attention_forward_triton.default, args)


def test_opcheck_triton_backward():
    device = backend_device("triton")
    args = _op_args(device, dropout=True)
    out, lse = torch.ops.fastattn.attention_forward_triton(*args)
    grad_out = torch.randn_like(out)
    grad_lse = torch.randn_like(lse)
    torch.library.opcheck(
        torch.ops.fastattn.attention_backward_triton.default,
        [grad_out, grad_lse, *args[:3], out, lse, *args[3:], True],
    )


def test_compile_fullgraph(backend):
    """fastattn.attention traces into one graph (the op, its fake implementation and its
    autograd formula) and gives the eager results, forward and backward."""
    if backend == "reference":
        pytest.skip("the reference backend is plain PyTorch; this checks the registered ops")
    device = attention_device(backend)
    q, k, v, kw = make_case("padding", 40, 37, 45, torch.float32, device)
    kw.update(causal="bottom_right", alibi_slopes=torch.rand(2, device=device))
    grad_out = torch.randn(q.shape[:3] + (v.shape[3],)).to(device)

    def fn(q, k, v):
        return fastattn.attention(q, k, v, return_lse=True, backend=backend, **kw)

    compiled = torch.compile(fn, fullgraph=True)
    results = []
    for f in (compiled, fn):
        leaves = [t.detach().requires_grad_() for t in (q, k, v)]
        out, lse = f(*leaves)
        assert fastattn.last_backend("attention") == backend
        results.append((out, lse, *torch.autograd.grad(out, leaves, grad_out)))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


# ---------------------------------------------------------------------------------------------
# Argument checks (ops/attention.py, before any backend runs)


def _bad_inputs():
    q = torch.randn(2, 4, 8, 16)
    k = torch.randn(2, 2, 10, 16)
    v = torch.randn(2, 2, 10, 12)
    return q, k, v


@pytest.mark.parametrize(
    "case,error,match",
    [
        ("batch", ValueError, "same batch size"),
        ("kv_heads", ValueError, "k and v must have the same number of heads"),
        ("group", ValueError, r"q's heads \(4\) must be a multiple of k/v's heads \(3\)"),
        ("head_dim", ValueError, "q and k must have the same head dim"),
        ("head_dim_256", ValueError, r"head dim of q/k must be in \[1, 256\], got 320"),
        ("v_head_dim_256", ValueError, r"head dim of v must be in \[1, 256\], got 300"),
        ("mask_shape", ValueError, "attn_mask must broadcast to"),
        ("mask_dtype", TypeError, "attn_mask must be bool .* got torch.int64"),
        ("padding_shape", ValueError, r"key_padding_mask must be \(B, Lk\) = \(2, 10\)"),
        ("padding_dtype", TypeError, "key_padding_mask must be bool"),
        ("alibi_shape", ValueError, "alibi_slopes must be"),
        ("int_q", TypeError, "q must be float32, float16, bfloat16 or float64"),
        ("mixed_dtype", TypeError, "q, k and v must have the same dtype"),
        ("device", ValueError, "k must be on the same device as q"),
        ("window_len", ValueError, "window must be None or"),
        ("window_neg", ValueError, "window must be None or"),
        ("causal", ValueError, "causal must be False, True, 'top_left' or 'bottom_right'"),
        ("dropout", ValueError, r"dropout_p must be a float in \[0, 1\), got 1.0"),
    ],
)
def test_bad_inputs_name_the_argument(case, error, match):
    q, k, v = _bad_inputs()
    kw = {}
    if case == "batch":
        k = torch.randn(3, 2, 10, 16)
    elif case == "kv_heads":
        v = torch.randn(2, 1, 10, 12)
    elif case == "group":
        k, v = torch.randn(2, 3, 10, 16), torch.randn(2, 3, 10, 12)
    elif case == "head_dim":
        k = torch.randn(2, 2, 10, 15)
    elif case == "head_dim_256":
        q, k = torch.randn(2, 4, 8, 320), torch.randn(2, 2, 10, 320)
    elif case == "v_head_dim_256":
        v = torch.randn(2, 2, 10, 300)
    elif case == "mask_shape":
        kw["attn_mask"] = torch.ones(8, 11, dtype=torch.bool)
    elif case == "mask_dtype":
        kw["attn_mask"] = torch.ones(8, 10, dtype=torch.int64)
    elif case == "padding_shape":
        kw["key_padding_mask"] = torch.zeros(2, 9, dtype=torch.bool)
    elif case == "padding_dtype":
        kw["key_padding_mask"] = torch.zeros(2, 10)
    elif case == "alibi_shape":
        kw["alibi_slopes"] = torch.ones(3)
    elif case == "int_q":
        q = torch.ones(2, 4, 8, 16, dtype=torch.int32)
    elif case == "mixed_dtype":
        k = k.half()
    elif case == "device":
        k = torch.randn(2, 2, 10, 16, device="meta")
    elif case == "window_len":
        kw["window"] = (3,)
    elif case == "window_neg":
        kw["window"] = (-2, 3)
    elif case == "causal":
        kw["causal"] = "sideways"
    elif case == "dropout":
        kw["dropout_p"] = 1.0
    with pytest.raises(error, match=match):
        fastattn.attention(q, k, v, backend="reference", **kw)


@pytest.mark.parametrize("backend", ["cpu", "triton", "reference"])
def test_any_strides_are_copied_not_refused(backend):
    """A last dimension with a stride other than 1 is copied (as SDPA does), forward and
    backward equal to the same call on contiguous inputs."""
    device = backend_device(backend)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 16, 8, generator=g).transpose(-1, -2).to(device)  # (2, 4, 8, 16)
    k = torch.randn(2, 2, 9, 32, generator=g)[..., ::2].to(device)  # (2, 2, 9, 16)
    v = torch.randn(2, 2, 9, 12, generator=g).to(device)
    for t in (q, k, v):
        t.requires_grad_()
    out = fastattn.attention(q, k, v, causal="bottom_right", backend=backend)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    leaves = [t.detach().contiguous().requires_grad_() for t in (q, k, v)]
    want = fastattn.attention(*leaves, causal="bottom_right", backend=backend)
    want_grads = torch.autograd.grad(want.square().sum(), leaves)
    torch.testing.assert_close(out, want)
    for got, exp in zip(grads, want_grads):
        torch.testing.assert_close(got, exp)


def test_triton_refuses_float64():
    backend_device("triton")
    q, k, v = (t.double() for t in _bad_inputs())
    with pytest.raises(fastattn.BackendError, match="float64"):
        fastattn.attention(q, k, v, backend="triton")


# ---------------------------------------------------------------------------------------------
# Memory: no (Lq, Lk) tensor, forward or backward (native CPU kernels)


def largest_allocation(fn) -> int:
    """Bytes of the largest tensor allocation (torch's CPU allocator, as seen by the profiler's
    memory events) made while fn() runs, transient allocations inside kernels included."""
    from torch.profiler import ProfilerActivity, profile

    with profile(
        activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True
    ) as prof:
        fn()
    sizes = [e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    assert sizes, "the profiler recorded no allocation: it cannot check anything"
    return max(sizes)


def _forward_backward(backend, L, D=64):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, L, D, generator=g).requires_grad_() for _ in range(3))

    def fn():
        out = fastattn.attention(q, k, v, backend=backend)
        assert fastattn.last_backend("attention") == backend
        out.backward(torch.ones_like(out))

    return fn


def test_memory_probe_detects_quadratic_allocations():
    """The probe of test_cpu_attention_allocates_no_score_matrix flags the reference backend,
    which materialises the (L, L) scores."""
    L = 2048
    assert largest_allocation(_forward_backward("reference", L)) >= L * L


def test_cpu_attention_allocates_no_score_matrix():
    attention_device("cpu")
    L = 8192
    largest = largest_allocation(_forward_backward("cpu", L))
    # Lq * Lk bytes: not even a bool (L, L) tensor may appear.
    assert largest < L * L, f"an allocation of {largest} bytes (>= Lq*Lk = {L * L})"


@pytest.mark.parametrize("backend", ["cpu", "triton", "reference"])
def test_rows_hidden_by_a_float_mask_of_minus_inf_have_finite_gradients(backend):
    """A float attn_mask of -inf over a whole row: out 0, lse -inf, and every gradient finite
    (the reference's logsumexp used to give dq = NaN there), equal across backends."""
    device = backend_device(backend)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 5, 8, generator=g).to(device).requires_grad_() for _ in range(3))
    mask = torch.zeros(2, 1, 5, 5)
    mask[:, :, 2] = float("-inf")
    mask[1, :, 4, 1:] = float("-inf")
    mask = mask.to(device)
    out, lse = fastattn.attention(q, k, v, attn_mask=mask, return_lse=True, backend=backend)
    assert torch.isneginf(lse[:, :, 2]).all() and (out[:, :, 2] == 0).all()
    grads = torch.autograd.grad(
        out.square().sum() + lse.masked_fill(lse.isinf(), 0).sum(), (q, k, v)
    )
    for grad in grads:
        assert torch.isfinite(grad).all()
    if backend != "reference":
        want_out = fastattn.attention(q, k, v, attn_mask=mask, return_lse=True, backend="reference")
        want = torch.autograd.grad(
            want_out[0].square().sum() + want_out[1].masked_fill(want_out[1].isinf(), 0).sum(),
            (q, k, v),
        )
        for got, exp in zip(grads, want):
            torch.testing.assert_close(got, exp, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# Sizes beyond the kernels' index types are refused before any work

# A key longer than int32 indices hold, in no memory: a stride-0 expansion of one row.
_HUGE = 2**31 + 5


def _huge_key_inputs(D=8):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 1, 1, D, generator=g)
    k = torch.randn(1, 1, 1, D, generator=g).expand(1, 1, _HUGE, D)
    v = torch.randn(1, 1, 1, D, generator=g).expand(1, 1, _HUGE, D)
    return q, k, v


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_key_length_beyond_int32_is_refused(backend):
    """The CPU kernel used to return a wrong result in seconds here (keys past 2**30 fell
    outside the band's "unbounded" bound); every backend now refuses at the argument check,
    so the call returns at once instead of running a kernel."""
    attention_device(backend)
    q, k, v = _huge_key_inputs()
    start = time.monotonic()
    with pytest.raises(
        ValueError,
        match=r"k's length \(Lk\) must be < 2\*\*30 = 1073741824.*"
        r"got 2147483653",
    ):
        fastattn.attention(q, k, v, backend=backend)
    assert time.monotonic() - start < 5.0, "the refusal came after the kernel ran"


def test_native_op_refuses_key_length_beyond_int32():
    """The shared C++ check (csrc/attention/attention.h) refuses a direct op call too, before
    the kernel runs, naming the op and the argument."""
    attention_device("cpu")
    q, k, v = _huge_key_inputs()
    start = time.monotonic()
    with pytest.raises(
        RuntimeError,
        match=r"attention_forward: k's length \(Lk\) must be < "
        r"2\^30 = 1073741824.*got 2147483653",
    ):
        torch.ops.fastattn.attention_forward(
            q, k, v, None, None, None, 1.0, 0.0, -(2**30), 2**30, 0.0, None
        )
    assert time.monotonic() - start < 5.0, "the refusal came after the kernel ran"


def test_triton_op_refuses_query_length_beyond_int32():
    """The Triton launcher checks the lengths itself (direct op calls skip fastattn.attention's
    checks); q is a stride-0 expansion too, so no output is allocated before the refusal."""
    backend_device("triton")
    q = torch.randn(1, 1, 1, 8).expand(1, 1, 2**30, 8)
    k = v = torch.randn(1, 1, 4, 8)
    with pytest.raises(ValueError, match=r"q's length \(Lq\) must be < 2\*\*30"):
        torch.ops.fastattn.attention_forward_triton(
            q, k, v, None, None, None, 1.0, 0.0, -(2**30), 2**30, 0.0, None
        )


def test_sequence_length_limit_is_2_pow_30():
    """The limit is the band encoding's: 2**30 - 1 passes the check, 2**30 does not (not run:
    a kernel over 2**30 keys takes seconds)."""
    from fastattn.contracts.attention import MAX_SEQLEN, WINDOW_UNBOUNDED, check_seqlen

    assert MAX_SEQLEN == WINDOW_UNBOUNDED - 1 == 2**30 - 1
    check_seqlen("attention", "k's length (Lk)", 2**30 - 1)
    with pytest.raises(ValueError, match=r"attention: k's length \(Lk\) must be < 2\*\*30"):
        check_seqlen("attention", "k's length (Lk)", 2**30)


# ---------------------------------------------------------------------------------------------
# Triton tiles against the device's shared memory

# Opt-in shared memory a block of an sm_86/89/120 card, an A100 and an H100.
_SHARED_MEMORY = {"99KB": 101376, "163KB": 166912, "227KB": 232448}


def _triton_attention_module():
    pytest.importorskip("triton")
    import fastattn.triton as fa_triton
    import fastattn.triton.attention_tuning as tri

    return fa_triton, tri


@pytest.mark.parametrize("device_kind", list(_SHARED_MEMORY))
def test_triton_pruning_fits_the_device_shared_memory(monkeypatch, device_kind):
    """Every autotune list, pruned for a device with this much shared memory, keeps at least
    one config and only configs whose tiles fit (the budget used to be a fixed 192 KB, which
    kept 160 KB tiles on 99 KB cards)."""
    fa_triton, tri = _triton_attention_module()
    shared = _SHARED_MEMORY[device_kind]
    monkeypatch.setattr(fa_triton, "ASSUMED_SHARED_MEMORY", shared)
    monkeypatch.setattr(tri, "_AUTOTUNE", True)
    budget = shared - fa_triton.SHARED_MEMORY_MARGIN
    for kernel, (table16, table32) in tri.TABLES.items():
        for dtype, table in ((torch.float16, table16), (torch.float32, table32)):
            for head, configs in table.items():
                q = torch.empty(0, dtype=dtype)
                kept = tri.pruner(kernel)(configs, {"Q": q}, BLOCK_D=head, BLOCK_DV=head)
                assert kept, f"{kernel} {dtype} head {head}: no config left"
                for c in kept:
                    m, n = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]
                    need = tri.tile_shared_bytes(
                        kernel, m, n, c.num_stages, head, head, dtype.itemsize
                    )
                    assert need <= budget, f"{kernel} {dtype} head {head}: {c} needs {need} B"


def test_triton_pruning_refuses_when_nothing_fits(monkeypatch):
    fa_triton, tri = _triton_attention_module()
    monkeypatch.setattr(fa_triton, "ASSUMED_SHARED_MEMORY", 32 * 1024)
    q = torch.empty(0, dtype=torch.float32)
    with pytest.raises(ValueError, match="no fwd tile configuration fits the shared memory"):
        tri.pruner("fwd")(tri._FWD_CONFIGS_FP32[256], {"Q": q}, BLOCK_D=256, BLOCK_DV=256)
    # Below the margin but within the whole limit, the smallest config is kept.
    monkeypatch.setattr(fa_triton, "ASSUMED_SHARED_MEMORY", 50 * 1024)
    kept = tri.pruner("fwd")(tri._FWD_CONFIGS_FP32[256], {"Q": q}, BLOCK_D=256, BLOCK_DV=256)
    assert [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_stages) for c in kept] == [(16, 16, 1)]


def test_triton_shared_memory_comes_from_the_device(monkeypatch):
    """A CUDA device's budget is its opt-in shared memory per block, read once per device."""
    fa_triton, _ = _triton_attention_module()
    calls = []

    def props(index):
        calls.append(index)
        return types.SimpleNamespace(shared_memory_per_block_optin=101376 + index)

    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    fa_triton._shared_memory_of.cache_clear()
    try:
        assert fa_triton.device_shared_memory(torch.device("cuda", 1)) == 101377
        assert fa_triton.device_shared_memory(torch.device("cuda", 1)) == 101377
        assert fa_triton.tile_budget(torch.device("cuda", 0)) == (
            101376 - fa_triton.SHARED_MEMORY_MARGIN
        )
        assert calls == [1, 0]
    finally:
        fa_triton._shared_memory_of.cache_clear()
