"""Tests of fastattn.varlen_attention (packed variable-length attention), pack_padded /
unpack_padded, and nn.MultiheadAttention's varlen path (heavy key padding).

varlen_attention is defined as attention run on every packed sequence on its own, so each
kernel backend (cpu, cuda, triton) is compared with fastattn.attention (reference backend,
float64) applied sequence by sequence, under FlashAttention's rule (tests/tolerance.py): the
error must be at most 2x (outputs, lse) or 3x (gradients) the error of the same per-sequence
reference run in the input's dtype, plus a rounding floor. (The reference backend is that very
definition: test_reference_oracles.py checks it against an independent loop.) float64 results
must agree to ~1e-12. The packs hold empty sequences (no queries, no keys, neither), single
tokens, odd lengths and Lq != Lk both ways, so bottom-right causal masks and windows leave rows
without a visible key (out 0, lse -inf). Every test asserts
`fastattn.last_backend("varlen_attention")`.

Dropout cannot go through dense attention's own dropout (its Philox numbering is that of a
padded batch). The per-sequence expectation is built from dense attention's probabilities
(v = identity) and the keep-mask of the documented packed numbering (reference/varlen_attention
.py): probability (b, h, i, j) is element ((cu_seqlens_q[b] + i) * Hq + h) * max_seqlen_k + j
of fastattn's Philox stream.

The Triton backend (fastattn/triton/varlen_attention.py) runs under Triton's CPU interpreter
here, which is slow: its cases use smaller packs (TRITON_LENGTHS: lengths 0, 1, 4, 5, 17) and
float32, float16 and bfloat16 (it refuses float64, checked in
test_triton_request_raises_backend_error); its dropout drops exactly the cpu backend's elements.
The triton cases of this file and of test_attention_with_kvcache.py take about 60 s of CPU
time together under the interpreter (measured on the idle 2-core build machine).
The CUDA backend runs the dense CUDA attention kernels with per-sequence offsets (cu_seqlens
read on the device); every backend-parametrised test runs it on a GPU, and the CUDA-only tests
at the end add the tensor-core head-dim buckets in float16/bfloat16, the dropout mask against
the CPU kernel's, bitwise-reproducible 16-bit gradients and device errors (they skip without a
GPU).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, replace

import pytest
import torch
from conftest import backend_device, require_kernel
from host_reads import (
    assert_no_device_sync,
    assert_no_host_reads,
    device_checks,
    fake_cuda,
    force_device_checks,
)
from tolerance import assert_fa_close, assert_grad_close, assert_lse_close, float32_floor
from torch import nn

import fastattn
from fastattn import _backend
from fastattn._backend import missing_kernel
from fastattn.nn import MultiheadAttention
from fastattn.ops import varlen_attention as varlen_ops
from fastattn.ops._common import dropout_seed
from fastattn.reference.random import dropout_uniform

pytestmark = pytest.mark.usefixtures("one_thread")

F64 = torch.float64
DTYPES = (F64, torch.float32, torch.bfloat16, torch.float16)
_DT = {F64: "f64", torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
# The backends compared with the per-sequence reference. The reference backend runs that very
# reference (fastattn/reference/varlen_attention.py calls reference.attention per sequence), so
# it is checked against an independent loop instead (test_reference_oracles.py).
KERNEL_BACKENDS = ("cpu", "cuda", "triton")

# (Lq, Lk) of each packed sequence: no queries, no keys, neither, single tokens, Lq > Lk (the
# first Lq - Lk rows see nothing under bottom-right causal), Lq < Lk, odd lengths.
LENGTHS = ((37, 53), (0, 11), (1, 1), (19, 0), (64, 45), (0, 0), (5, 70), (1, 23))
# The same kinds of sequences, small enough for Triton's interpreter.
TRITON_LENGTHS = ((5, 17), (0, 4), (1, 1), (4, 0), (17, 5), (0, 0))

FEATURES = (
    "plain",
    "causal",
    "causal_top_left",
    "causal_bottom_right",
    "window",
    "window_causal",
    "window_right",
    "gqa",
    "mqa",
    "dv",
    "alibi_heads",
    "alibi_batch_heads",
    "softcap",
    "scale",
    "dropout",
    "everything",
)


# ---------------------------------------------------------------------------------------------
# Helpers


def varlen_device(backend: str) -> torch.device:
    """The device for `backend`'s varlen tests; skips when the backend or its varlen kernel is
    missing (the limits varlen_attention itself applies; fails when the build claims the
    kernel but lost it: require_kernel)."""
    require_kernel("varlen_attention_forward", backend)
    return backend_device(backend)


def pack_lengths(backend: str, lengths=LENGTHS):
    """`lengths`, or TRITON_LENGTHS for the (interpreted, slow) Triton backend."""
    return TRITON_LENGTHS if backend == "triton" else lengths


def skip_float64_on_triton(backend: str, dtype: torch.dtype) -> None:
    if backend == "triton" and dtype == F64:
        pytest.skip(
            "backend triton: no float64 kernels (test_triton_request_raises_backend_"
            "error checks the refusal)"
        )


def cu_seqlens(lengths, device) -> torch.Tensor:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=torch.int32, device=device)


@dataclass
class Packed:
    q: torch.Tensor  # (total_q, Hq, D)
    k: torch.Tensor  # (total_k, Hkv, D)
    v: torch.Tensor  # (total_k, Hkv, Dv)
    cu_q: torch.Tensor
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    kw: dict


def make_case(
    feature: str, dtype: torch.dtype, device: torch.device, lengths=LENGTHS, seed: int = 0
) -> Packed:
    """Random packed q, k, v in `dtype` on `device` and varlen keywords for `feature`."""
    g = torch.Generator().manual_seed(seed * 7919 + sum(map(ord, feature)))
    B = len(lengths)
    Hq, Hkv, D, Dv = 2, 2, 40, 40
    kw: dict = {}
    if feature in ("gqa", "everything"):
        Hq, Hkv = 6, 2
    if feature == "mqa":
        Hq, Hkv = 3, 1
    if feature in ("dv", "everything"):
        D, Dv = 59, 24
    if feature == "causal":
        kw["causal"] = True
    if feature == "causal_top_left":
        kw["causal"] = "top_left"
    if feature in ("causal_bottom_right", "window_causal", "everything"):
        kw["causal"] = "bottom_right"
    if feature == "window":
        kw["window"] = (7, 3)
    if feature in ("window_causal", "everything"):
        kw["window"] = (11, -1)
    if feature == "window_right":
        kw["window"] = (-1, 2)
    if feature == "alibi_heads":
        kw["alibi_slopes"] = torch.rand(Hq, generator=g) * 0.3
    if feature in ("alibi_batch_heads", "everything"):
        kw["alibi_slopes"] = torch.rand(B, Hq, generator=g) * 0.3
    if feature in ("softcap", "everything"):
        kw["softcap"] = 2.5
        kw["scale"] = 0.5  # large scores, so that the cap bends them
    if feature == "scale":
        kw["scale"] = 0.37
    if feature in ("dropout", "everything"):
        kw["dropout_p"] = 0.17
    total_q = sum(lq for lq, _ in lengths)
    total_k = sum(lk for _, lk in lengths)
    q = torch.randn(total_q, Hq, D, generator=g)
    k = torch.randn(total_k, Hkv, D, generator=g)
    v = torch.randn(total_k, Hkv, Dv, generator=g)
    q, k, v = (t.to(dtype=dtype, device=device) for t in (q, k, v))
    kw = {n: x.to(device) if isinstance(x, torch.Tensor) else x for n, x in kw.items()}
    return Packed(
        q,
        k,
        v,
        cu_seqlens([lq for lq, _ in lengths], device),
        cu_seqlens([lk for _, lk in lengths], device),
        max(lq for lq, _ in lengths),
        max(lk for _, lk in lengths),
        kw,
    )


def leaves_of(c: Packed, cast):
    return [t.detach().to(cast or t.dtype).requires_grad_() for t in (c.q, c.k, c.v)]


def grads_of(outputs, grads, leaves):
    got = torch.autograd.grad(outputs, leaves, grads, allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for g, x in zip(got, leaves)]


def run_varlen(backend, c: Packed, grad_out=None, grad_lse=None, seed=1234, cast=None):
    """(out, lse, dq, dk, dv) of varlen_attention on `backend` (dq.. None without grad_out);
    gradients of <out, grad_out> + <lse, grad_lse>. Dropout draws under torch.manual_seed(seed).
    """
    leaves = leaves_of(c, cast)
    torch.manual_seed(seed)
    out, lse = fastattn.varlen_attention(
        *leaves, c.cu_q, c.cu_k, c.max_q, c.max_k, return_lse=True, backend=backend, **c.kw
    )
    assert fastattn.last_backend("varlen_attention") == backend
    if grad_out is None:
        return out.detach(), lse.detach(), None, None, None
    outputs, grads = [out], [grad_out.to(out.dtype)]
    if grad_lse is not None:
        outputs.append(lse)
        grads.append(grad_lse.to(lse.dtype))
    return (out.detach(), lse.detach(), *grads_of(outputs, grads, leaves))


def packed_keep(
    seed: torch.Tensor, start: int, Lq: int, Lk: int, Hq: int, max_k: int, p: float
) -> torch.Tensor:
    """(Hq, Lq, Lk) keep-mask of one sequence whose queries start at packed row `start`."""
    device = seed.device
    rows = (start + torch.arange(Lq, device=device)).view(1, Lq, 1)
    heads = torch.arange(Hq, device=device).view(Hq, 1, 1)
    element = (rows * Hq + heads) * max_k + torch.arange(Lk, device=device).view(1, 1, Lk)
    return dropout_uniform(seed, element) >= p


def dense_per_sequence(c: Packed, grad_out=None, grad_lse=None, seed=1234, cast=None):
    """The definition: fastattn.attention (reference backend) on each sequence, in q's dtype
    (or `cast`), packed back; (out, lse, dq, dk, dv) as run_varlen."""
    q, k, v = leaves = leaves_of(c, cast)
    kw = dict(c.kw)
    p = kw.pop("dropout_p", 0.0)
    alibi = kw.pop("alibi_slopes", None)
    Hq, Hkv = q.shape[1], k.shape[1]
    acc = F64 if q.dtype == F64 else torch.float32
    if p > 0:
        torch.manual_seed(seed)
        drop_seed = dropout_seed(p, q.device)  # the draw varlen_attention makes
    cq, ck = c.cu_q.tolist(), c.cu_k.tolist()
    outs, lses = [], []
    for b in range(len(cq) - 1):
        qb = q[cq[b] : cq[b + 1]].transpose(0, 1).unsqueeze(0)
        kb = k[ck[b] : ck[b + 1]].transpose(0, 1).unsqueeze(0)
        vb = v[ck[b] : ck[b + 1]].transpose(0, 1).unsqueeze(0)
        Lq, Lk = qb.shape[2], kb.shape[2]
        slopes = None if alibi is None else (alibi if alibi.dim() == 1 else alibi[b : b + 1])
        dense = dict(kw, alibi_slopes=slopes, return_lse=True, backend="reference")
        if p == 0.0 or Lq == 0 or Lk == 0:
            ob, lb = fastattn.attention(qb, kb, vb, **dense)
        else:
            # Probabilities from attention over v = identity, dropped with the packed mask.
            assert Lk <= 256, "v = identity needs Lk <= 256"
            eye = torch.eye(Lk, dtype=q.dtype, device=q.device).expand(1, Hkv, Lk, Lk)
            probs, lb = fastattn.attention(qb, kb, eye, **dense)
            keep = packed_keep(drop_seed, cq[b], Lq, Lk, Hq, c.max_k, p)
            vv = vb.to(acc).repeat_interleave(Hq // Hkv, dim=1)
            ob = torch.matmul(probs.to(acc) * keep / (1.0 - p), vv).to(q.dtype)
        outs.append(ob[0].transpose(0, 1))
        lses.append(lb[0])
    out, lse = torch.cat(outs, dim=0), torch.cat(lses, dim=1)
    if grad_out is None:
        return out.detach(), lse.detach(), None, None, None
    outputs, grads = [out], [grad_out.to(out.dtype)]
    if grad_lse is not None:
        outputs.append(lse)
        grads.append(grad_lse.to(lse.dtype))
    return (out.detach(), lse.detach(), *grads_of(outputs, grads, leaves))


def check_against_dense(backend, c: Packed, grads=True, lse_grad=True):
    """varlen_attention on `backend` vs the per-sequence dense reference: out, lse (shape
    (Hq, total_q), -inf exactly on rows without keys) and dq, dk, dv."""
    assert backend != "reference", "the reference compared with itself proves nothing"
    g = torch.Generator().manual_seed(99)
    total_q, Hq = c.q.shape[:2]
    Dv = c.v.shape[2]
    grad_out = grad_lse = None
    if grads:
        grad_out = torch.randn(total_q, Hq, Dv, generator=g).to(c.q.dtype).to(c.q.device)
        if lse_grad:
            grad_lse = (0.5 * torch.randn(Hq, total_q, generator=g)).to(c.q.device)
    got = run_varlen(backend, c, grad_out, grad_lse)
    ref64 = dense_per_sequence(
        c,
        None if grad_out is None else grad_out.double(),
        None if grad_lse is None else grad_lse.double(),
        cast=F64,
    )
    out, lse = got[0], got[1]
    lse_dtype = F64 if c.q.dtype == F64 else torch.float32
    assert out.dtype == c.q.dtype and out.shape == (total_q, Hq, Dv)
    assert lse.dtype == lse_dtype and lse.shape == (Hq, total_q)
    empty = torch.isneginf(ref64[1])  # (Hq, total_q)
    assert torch.all(out.transpose(0, 1)[empty] == 0), "rows without a visible key must be 0"
    if c.q.dtype == F64:  # the same math in the same precision: agreement to rounding
        assert torch.equal(torch.isneginf(lse), empty)
        torch.testing.assert_close(out, ref64[0], rtol=1e-10, atol=1e-12, msg="out")
        torch.testing.assert_close(
            lse.masked_fill(empty, 0),
            ref64[1].masked_fill(empty, 0),
            rtol=1e-10,
            atol=1e-12,
            msg="lse",
        )
        if grads:
            for name, a, b in zip(("dq", "dk", "dv"), got[2:], ref64[2:]):
                torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=name)
        return
    low = dense_per_sequence(c, grad_out, grad_lse)
    assert_fa_close("out", out, ref64[0], low[0], floor=float32_floor(ref64[0], out.dtype))
    assert_lse_close(lse, ref64[1], low[1])
    if grads:
        for name, i, x in (("dq", 2, c.q), ("dk", 3, c.k), ("dv", 4, c.v)):
            assert got[i].shape == x.shape and got[i].dtype == x.dtype, name
            assert_grad_close(
                name, got[i], ref64[i], low[i], floor=float32_floor(ref64[i], x.dtype)
            )


# ---------------------------------------------------------------------------------------------
# Accuracy against per-sequence dense attention


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=[_DT[t] for t in DTYPES])
@pytest.mark.parametrize("feature", FEATURES)
def test_varlen_matches_dense_per_sequence(backend, feature, dtype):
    device = varlen_device(backend)
    skip_float64_on_triton(backend, dtype)
    c = make_case(feature, dtype, device, lengths=pack_lengths(backend))
    check_against_dense(backend, c)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_backward_without_lse_gradient(backend):
    """The usual path: only the output is used (the backward gets grad_lse = None)."""
    device = varlen_device(backend)
    c = make_case("everything", torch.float32, device, lengths=pack_lengths(backend), seed=1)
    check_against_dense(backend, c, lse_grad=False)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_forward_under_no_grad(backend):
    device = varlen_device(backend)
    c = make_case("everything", torch.bfloat16, device, lengths=pack_lengths(backend), seed=2)
    with torch.no_grad():
        check_against_dense(backend, c, grads=False)


def test_default_backend_for_cpu_tensors_is_cpu():
    varlen_device("cpu")
    c = make_case("causal", torch.float32, torch.device("cpu"))
    fastattn.varlen_attention(c.q, c.k, c.v, c.cu_q, c.cu_k, c.max_q, c.max_k, causal=True)
    assert fastattn.last_backend("varlen_attention") == "cpu"


def test_rows_without_keys(backend):
    """lse is (Hq, total_q) and exactly -inf on the rows that see no key (an empty key
    sequence; bottom-right causal with Lq > Lk; a window beyond the keys), found here by brute
    force from the definition; those rows give out 0, dq 0, every gradient finite, and keys
    that no query sees get dk = dv = 0."""
    device = varlen_device(backend)
    lengths = ((4, 0), (9, 3), (6, 6), (2, 5))
    window = (1, 0)
    c = make_case("plain", torch.float32, device, lengths=lengths, seed=3)
    c.kw = dict(causal="bottom_right", window=window)
    Hq = c.q.shape[1]
    empty_rows, unseen_keys = [], []
    for lq, lk in lengths:
        seen = torch.zeros(lk, dtype=torch.bool)
        for i in range(lq):
            visible = [
                j for j in range(lk) if i + lk - lq - window[0] <= j <= i + lk - lq
            ]  # causal bound wins
            empty_rows.append(not visible)
            seen[visible] = True
        unseen_keys.append(~seen)
    empty = torch.tensor(empty_rows, device=device)
    unseen = torch.cat(unseen_keys).to(device)
    assert empty.any() and (~empty).any() and unseen.any()
    if backend != "reference":  # (the reference would meet itself)
        check_against_dense(backend, c)

    g = torch.Generator().manual_seed(4)
    grad_out = torch.randn(c.q.shape[0], Hq, c.v.shape[2], generator=g).to(device)
    grad_lse = torch.randn(Hq, c.q.shape[0], generator=g).to(device)
    out, lse, dq, dk, dv = run_varlen(backend, c, grad_out, grad_lse)
    assert lse.shape == (Hq, c.q.shape[0]) and lse.dtype == torch.float32
    assert torch.equal(torch.isneginf(lse), empty.view(1, -1).expand(Hq, -1))
    assert torch.all(out[empty] == 0)
    for name, grad in (("out", out), ("dq", dq), ("dk", dk), ("dv", dv)):
        assert torch.isfinite(grad).all(), f"{name} has non-finite values"
    assert torch.all(dq[empty] == 0), "dq of rows without a visible key must be 0"
    assert torch.all(dk[unseen] == 0) and torch.all(dv[unseen] == 0)


@pytest.mark.parametrize("case", ["no-batch", "all-empty", "no-keys", "no-queries"])
def test_empty_packs(backend, case):
    """B = 0 (cu_seqlens = [0]), sequences that are all empty, no keys at all (out 0, lse
    -inf), no queries at all: results and gradients of the right shapes."""
    device = varlen_device(backend)
    lengths = {
        "no-batch": (),
        "all-empty": ((0, 0), (0, 0)),
        "no-keys": ((3, 0), (2, 0)),
        "no-queries": ((0, 4), (0, 1)),
    }[case]
    Hq, Hkv, D, Dv = 4, 2, 8, 6
    total_q = sum(lq for lq, _ in lengths)
    total_k = sum(lk for _, lk in lengths)
    q = torch.randn(total_q, Hq, D, device=device, requires_grad=True)
    k = torch.randn(total_k, Hkv, D, device=device, requires_grad=True)
    v = torch.randn(total_k, Hkv, Dv, device=device, requires_grad=True)
    cu_q = cu_seqlens([lq for lq, _ in lengths], device)
    cu_k = cu_seqlens([lk for _, lk in lengths], device)
    max_q = max((lq for lq, _ in lengths), default=0)
    max_k = max((lk for _, lk in lengths), default=0)
    out, lse = fastattn.varlen_attention(
        q, k, v, cu_q, cu_k, max_q, max_k, causal=True, return_lse=True, backend=backend
    )
    assert fastattn.last_backend("varlen_attention") == backend
    assert out.shape == (total_q, Hq, Dv) and lse.shape == (Hq, total_q)
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))
    dq, dk, dv = torch.autograd.grad(
        out.sum() + lse.masked_fill(lse.isneginf(), 0).sum(), (q, k, v)
    )
    for grad, x in ((dq, q), (dk, k), (dv, v)):
        assert grad.shape == x.shape and torch.all(grad == 0)


def test_strided_inputs(backend):
    """q, k, v sliced out of one packed (total, 3, H, D) projection and a non-contiguous output
    gradient: the same results as contiguous copies."""
    device = varlen_device(backend)
    lengths = ((13, 13), (0, 0), (30, 30), (1, 1))
    total, H, D = 44, 3, 24
    g = torch.Generator().manual_seed(6)
    qkv = torch.randn(total, 3, H, D, generator=g).to(device)
    q, k, v = qkv.unbind(1)
    assert not q.is_contiguous() and q.stride(-1) == 1
    grad_out = torch.randn(H, total, D, generator=g).to(device).transpose(0, 1)
    cu = cu_seqlens([n for n, _ in lengths], device)
    strided = Packed(q, k, v, cu, cu, 30, 30, dict(causal=True, window=(5, -1)))
    contiguous = replace(strided, q=q.contiguous(), k=k.contiguous(), v=v.contiguous())
    a = run_varlen(backend, strided, grad_out)
    b = run_varlen(backend, contiguous, grad_out.contiguous())
    for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), a, b):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6, msg=name)
    if backend != "reference":  # (the reference would meet itself)
        check_against_dense(backend, strided)


def test_alibi_slopes_gradient_runs_on_the_reference():
    """Slopes that require grad: the automatic choice takes the reference backend (the kernels
    give no slope gradient), an explicit kernel request raises, and the slope gradient equals
    the per-sequence dense one."""
    varlen_device("cpu")
    c = make_case("alibi_batch_heads", F64, torch.device("cpu"), lengths=((7, 9), (0, 3), (5, 2)))
    c.kw["causal"] = "bottom_right"
    slopes = c.kw.pop("alibi_slopes").requires_grad_()
    with pytest.raises(fastattn.BackendError, match="alibi_slopes need the reference backend"):
        fastattn.varlen_attention(
            c.q,
            c.k,
            c.v,
            c.cu_q,
            c.cu_k,
            c.max_q,
            c.max_k,
            alibi_slopes=slopes,
            backend="cpu",
            **c.kw,
        )
    out = fastattn.varlen_attention(
        c.q, c.k, c.v, c.cu_q, c.cu_k, c.max_q, c.max_k, alibi_slopes=slopes, **c.kw
    )
    assert fastattn.last_backend("varlen_attention") == "reference"
    (grad,) = torch.autograd.grad(out.sum(), slopes)
    cq, ck = c.cu_q.tolist(), c.cu_k.tolist()
    expected = torch.zeros_like(slopes)
    for b in range(len(cq) - 1):
        s = slopes.detach()[b : b + 1].clone().requires_grad_()
        ob = fastattn.attention(
            c.q[cq[b] : cq[b + 1]].transpose(0, 1)[None],
            c.k[ck[b] : ck[b + 1]].transpose(0, 1)[None],
            c.v[ck[b] : ck[b + 1]].transpose(0, 1)[None],
            alibi_slopes=s,
            backend="reference",
            **c.kw,
        )
        if ob.numel():
            expected[b] = torch.autograd.grad(ob.sum(), s)[0][0]
    assert grad.abs().max() > 0
    torch.testing.assert_close(grad, expected, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# Dropout


def identity_values(c: Packed) -> Packed:
    """v = identity per sequence (key j of a sequence is e_j, Dv = max_k): the output is then
    the dropped-out probability matrix itself, zero exactly where an element was dropped."""
    ck = c.cu_k.tolist()
    Hkv = c.k.shape[1]
    v = torch.zeros(c.k.shape[0], Hkv, c.max_k, dtype=c.q.dtype, device=c.q.device)
    for b in range(len(ck) - 1):
        n = ck[b + 1] - ck[b]
        v[ck[b] : ck[b + 1]] = torch.eye(n, c.max_k, dtype=c.q.dtype).view(n, 1, c.max_k)
    return replace(c, v=v)


DROPOUT_LENGTHS = ((23, 40), (0, 5), (1, 1), (17, 9), (3, 0), (40, 33))


@pytest.mark.parametrize("extra_max_k", [0, 3], ids=["max_k", "max_k+3"])
def test_dropout_mask_is_the_packed_numbering(backend, extra_max_k):
    """The zeros of the output (v = identity) are exactly the elements that the documented
    packed numbering drops, for every sequence, head (GQA) and query, the numbering using the
    max_seqlen_k given (also when larger than needed); the kept ones are P / (1 - p); and the
    cpu and reference backends drop the same elements for the same seed."""
    device = varlen_device(backend)
    p, seed = 0.3, 42
    c = make_case("gqa", torch.float32, device, lengths=DROPOUT_LENGTHS, seed=7)
    c = identity_values(replace(c, max_k=c.max_k + extra_max_k))
    c.kw = dict(dropout_p=p)
    out = run_varlen(backend, c, seed=seed)[0]
    plain = run_varlen(backend, replace(c, kw={}))[0]
    torch.manual_seed(seed)
    drop_seed = dropout_seed(p, device)
    Hq = c.q.shape[1]
    cq, ck = c.cu_q.tolist(), c.cu_k.tolist()
    kept = total = 0
    for b in range(len(cq) - 1):
        Lq, Lk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        keep = packed_keep(drop_seed, cq[b], Lq, Lk, Hq, c.max_k, p)  # (Hq, Lq, Lk)
        ob = out[cq[b] : cq[b + 1]].transpose(0, 1)  # (Hq, Lq, Dv)
        pb = plain[cq[b] : cq[b + 1]].transpose(0, 1)
        assert torch.all(ob[..., Lk:] == 0)
        assert torch.equal(ob[..., :Lk] != 0, keep), f"sequence {b}: wrong elements dropped"
        torch.testing.assert_close(
            ob[..., :Lk], pb[..., :Lk] * keep / (1 - p), rtol=1e-5, atol=1e-6
        )
        kept += int(keep.sum())
        total += keep.numel()
    assert abs(kept / total - (1 - p)) < 0.05
    others = ["reference"]
    if backend == "triton" and device.type == "cpu" and varlen_ops.kernel_available(device):
        others.append("cpu")  # the Triton kernels drop exactly the CPU kernel's elements
    for other in others:
        if other == backend:
            continue
        ref = run_varlen(other, c, seed=seed)[0]
        assert torch.equal(out != 0, ref != 0), f"{backend} and {other} masks differ"
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_dropout_backward_uses_the_forward_mask(backend):
    """With one query per sequence, dv of key j is P_j * keep_j / (1 - p) * dO: exactly zero
    where the forward dropped (b, h, 0, j), so the backward regenerates the forward's mask;
    and the gradients agree with the per-sequence dense expectation at p = 0.5."""
    device = varlen_device(backend)
    p = 0.5
    lengths = ((1, 37), (1, 1), (0, 4), (1, 60), (1, 0))
    c = make_case("plain", torch.float32, device, lengths=lengths, seed=8)
    c.kw = dict(dropout_p=p)
    grad_out = torch.randn(c.q.shape[0], c.q.shape[1], c.v.shape[2]).to(device)
    _, _, _, _, dv = run_varlen(backend, c, grad_out, seed=5)
    torch.manual_seed(5)
    drop_seed = dropout_seed(p, device)
    cq, ck = c.cu_q.tolist(), c.cu_k.tolist()
    Hq = c.q.shape[1]
    for b in range(len(cq) - 1):
        Lq, Lk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        dvb = dv[ck[b] : ck[b + 1]].transpose(0, 1)  # (Hkv, Lk, Dv)
        if Lq == 0:
            assert torch.all(dvb == 0)
            continue
        keep = packed_keep(drop_seed, cq[b], Lq, Lk, Hq, c.max_k, p)[:, 0]  # (Hq, Lk)
        assert torch.equal((dvb != 0).all(-1), keep), f"sequence {b}: dv ignores the mask"
        assert torch.equal((dvb == 0).all(-1), ~keep)
    if backend != "reference":  # (the reference would meet itself)
        check_against_dense(backend, c)


def test_dropout_reproducible(backend):
    device = varlen_device(backend)
    c = make_case("dropout", torch.float32, device, lengths=pack_lengths(backend), seed=9)
    grad_out = torch.randn(c.q.shape[0], c.q.shape[1], c.v.shape[2]).to(device)
    first = run_varlen(backend, c, grad_out, seed=7)
    again = run_varlen(backend, c, grad_out, seed=7)
    other = run_varlen(backend, c, grad_out, seed=8)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), first, again):
        assert torch.equal(a, b), f"{name} differs under the same torch.manual_seed"
    assert not torch.equal(first[0], other[0]), "a different seed must drop other elements"
    assert torch.equal(first[1], other[1]), "lse is that of the undropped scores"


# ---------------------------------------------------------------------------------------------
# gradcheck, determinism, registration


GRADCHECK_LENGTHS = ((3, 5), (0, 2), (1, 1), (4, 3))


@pytest.mark.parametrize("feature", ["plain", "causal_top_left", "everything"])
def test_gradcheck_float64(feature):
    """float64 gradcheck of (out, lse) of the CPU kernels (rows all see a key: a row whose lse
    is -inf has no finite difference). Dropout runs under a fixed torch.manual_seed per call,
    so every evaluation drops the same elements."""
    varlen_device("cpu")
    c = make_case(feature, F64, torch.device("cpu"), lengths=GRADCHECK_LENGTHS, seed=10)
    if feature == "everything":
        c.kw.update(causal="top_left", window=(2, -1))
    c.q, c.k, c.v = (t[..., :n].contiguous() for t, n in ((c.q, 6), (c.k, 6), (c.v, 5)))

    def fn(q, k, v):
        torch.manual_seed(0)
        return fastattn.varlen_attention(
            q, k, v, c.cu_q, c.cu_k, c.max_q, c.max_k, return_lse=True, backend="cpu", **c.kw
        )

    leaves = leaves_of(c, None)
    out, lse = fn(*leaves)
    assert torch.isfinite(lse).all()
    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
def test_backward_is_bitwise_reproducible(backend, deterministic):
    device = varlen_device(backend)
    if backend == "triton" and not deterministic:
        pytest.skip(
            "backend triton: its kernels never use atomics and ignore the flag, so the "
            "deterministic case covers both (the interpreter is slow)"
        )
    torch.set_num_threads(2)  # the fixture restores it
    c = make_case(
        "everything",
        torch.float32,
        device,
        seed=11,
        lengths=pack_lengths(backend, LENGTHS)[:2] if backend == "triton" else LENGTHS,
    )
    c.kw["deterministic"] = deterministic
    g = torch.Generator().manual_seed(1)
    grad_out = torch.randn(c.q.shape[0], c.q.shape[1], c.v.shape[2], generator=g).to(device)
    grad_lse = torch.randn(c.q.shape[1], c.q.shape[0], generator=g).to(device)
    first = run_varlen(backend, c, grad_out, grad_lse)
    second = run_varlen(backend, c, grad_out, grad_lse)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), first, second):
        assert torch.equal(a, b), f"{name} is not bitwise reproducible"


def _op_args(dropout: bool):
    """Arguments of torch.ops.fastattn.varlen_attention_forward: an empty query sequence, a
    sequence without keys, GQA, Dv != D, ALiBi, bottom-right causal, a window."""
    g = torch.Generator().manual_seed(12)
    cu_q = torch.tensor([0, 3, 3, 10, 12], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 6, 13, 13], dtype=torch.int32)
    q = torch.randn(12, 4, 16, generator=g)
    k = torch.randn(13, 2, 16, generator=g)
    v = torch.randn(13, 2, 12, generator=g)
    alibi = torch.rand(4, 4, generator=g)
    seed = torch.tensor([123, 4], dtype=torch.int64) if dropout else None
    return [q, k, v, cu_q, cu_k, 7, 7, alibi, 0.3, 2.0, 2, 4, -1, 0.2 if dropout else 0.0, seed]


@pytest.mark.parametrize("dropout", [False, True], ids=["plain", "dropout"])
def test_opcheck_forward(dropout):
    varlen_device("cpu")
    args = _op_args(dropout)
    for t in args[:3]:
        t.requires_grad_()
    torch.library.opcheck(torch.ops.fastattn.varlen_attention_forward.default, args)


def test_opcheck_backward():
    varlen_device("cpu")
    args = _op_args(dropout=True)
    out, lse = torch.ops.fastattn.varlen_attention_forward(*args)
    grad_out = torch.randn_like(out)
    grad_lse = torch.randn_like(lse)
    torch.library.opcheck(
        torch.ops.fastattn.varlen_attention_backward.default,
        [grad_out, grad_lse, *args[:3], out, lse, *args[3:], True],
    )


def test_opcheck_triton_forward():
    """The Triton ops' registration (schema, fake implementation, autograd) as opcheck sees it,
    on the native op's check's arguments with dropout (one case: the interpreter is slow)."""
    device = varlen_device("triton")
    args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in _op_args(True)]
    for t in args[:3]:
        t.requires_grad_()
    torch.library.opcheck(torch.ops.fastattn.varlen_attention_forward_triton.default, args)


def test_opcheck_triton_backward():
    device = varlen_device("triton")
    args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in _op_args(dropout=True)]
    out, lse = torch.ops.fastattn.varlen_attention_forward_triton(*args)
    grad_out = torch.randn_like(out)
    grad_lse = torch.randn_like(lse)
    torch.library.opcheck(
        torch.ops.fastattn.varlen_attention_backward_triton.default,
        [grad_out, grad_lse, *args[:3], out, lse, *args[3:], True],
    )


@pytest.mark.parametrize("backend_name", ["cpu", "triton"])
def test_compile_fullgraph(backend_name):
    """varlen_attention traces into one graph on cpu and triton (the host-side cu_seqlens
    checks are skipped while compiling; the kernels check them), with the eager results
    forward and backward."""
    device = varlen_device(backend_name)
    c = make_case(
        "everything", torch.float32, device, lengths=((7, 9), (0, 4), (5, 3), (1, 1)), seed=13
    )
    del c.kw["dropout_p"]  # compiled code draws its seeds from another generator
    grad_out = torch.randn(c.q.shape[0], c.q.shape[1], c.v.shape[2]).to(device)

    def fn(q, k, v):
        return fastattn.varlen_attention(
            q, k, v, c.cu_q, c.cu_k, c.max_q, c.max_k, return_lse=True, backend=backend_name, **c.kw
        )

    compiled = torch.compile(fn, fullgraph=True)
    results = []
    for f in (compiled, fn):
        leaves = leaves_of(c, None)
        out, lse = f(*leaves)
        assert fastattn.last_backend("varlen_attention") == backend_name
        results.append((out, lse, *torch.autograd.grad(out, leaves, grad_out)))
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


# ---------------------------------------------------------------------------------------------
# Backend requests and argument checks


def _small():
    q = torch.randn(10, 4, 16)
    k = torch.randn(12, 2, 16)
    v = torch.randn(12, 2, 12)
    cu_q = torch.tensor([0, 3, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 12], dtype=torch.int32)
    return q, k, v, cu_q, cu_k


def test_triton_request_raises_backend_error():
    """Without a Triton varlen kernel, asking for it (argument or use_backend) is a
    BackendError that says so, never a silent fallback; float64 is refused with its own
    reason (the kernels have no float64 path)."""
    if fastattn.available_backends()["triton"] != "available":
        pytest.skip(f"backend triton: {fastattn.available_backends()['triton']}")
    q, k, v, cu_q, cu_k = _small()
    if not missing_kernel("varlen_attention_forward", "triton"):
        with pytest.raises(fastattn.BackendError, match="does not take float64"):
            fastattn.varlen_attention(
                q.double(), k.double(), v.double(), cu_q, cu_k, 7, 7, backend="triton"
            )
        return
    message = (
        "varlen_attention: backend 'triton' cannot run this call: no Triton varlen "
        "kernel in this version"
    )
    with pytest.raises(fastattn.BackendError, match=message):
        fastattn.varlen_attention(q, k, v, cu_q, cu_k, 7, 7, backend="triton")
    with fastattn.use_backend("triton"), pytest.raises(fastattn.BackendError, match=message):
        fastattn.varlen_attention(q, k, v, cu_q, cu_k, 7, 7)
    with pytest.raises(fastattn.BackendError, match="does not take float64"):
        fastattn.varlen_attention(
            q.double(), k.double(), v.double(), cu_q, cu_k, 7, 7, backend="triton"
        )


def test_cuda_request_for_cpu_tensors_raises():
    q, k, v, cu_q, cu_k = _small()
    with pytest.raises(fastattn.BackendError, match="varlen_attention: backend 'cuda' cannot"):
        fastattn.varlen_attention(q, k, v, cu_q, cu_k, 7, 7, backend="cuda")


I32 = torch.int32


@pytest.mark.parametrize(
    "case,error,match",
    [
        (
            "cu_q_decreasing",
            ValueError,
            r"cu_seqlens_q must be non-decreasing, got \[0, 6, 3, 10\]",
        ),
        ("cu_k_decreasing", ValueError, r"cu_seqlens_k must be non-decreasing, got \[0, 13, 12\]"),
        (
            "cu_q_start",
            ValueError,
            "cu_seqlens_q must start at 0 and end at the packed length 10, got 1 and 10",
        ),
        (
            "cu_k_end",
            ValueError,
            "cu_seqlens_k must start at 0 and end at the packed length 12, got 0 and 11",
        ),
        ("cu_q_int64", TypeError, "cu_seqlens_q must be int32, got torch.int64"),
        ("cu_k_int64", TypeError, "cu_seqlens_k must be int32, got torch.int64"),
        ("cu_2d", ValueError, "cu_seqlens_q must be 1-D"),
        ("cu_lengths", ValueError, "cu_seqlens_q and cu_seqlens_k must have the same length B"),
        (
            "max_seqlen_q",
            ValueError,
            r"a sequence of length 7 exceeds max_seqlen 6 \(cu_seqlens_q\)",
        ),
        (
            "max_seqlen_k",
            ValueError,
            r"a sequence of length 7 exceeds max_seqlen 5 \(cu_seqlens_k\)",
        ),
        ("attn_mask", ValueError, "attn_mask and key_padding_mask do not apply to packed"),
        ("key_padding_mask", ValueError, "attn_mask and key_padding_mask do not apply to packed"),
        ("heads", ValueError, r"q's heads \(4\) must be a multiple of k/v's heads \(3\)"),
        ("head_dim_256", ValueError, r"head dim of q/k must be in \[1, 256\], got 320"),
        ("v_head_dim_256", ValueError, r"head dim of v must be in \[1, 256\], got 300"),
        ("head_dim_mismatch", ValueError, "q and k must have the same head dim, got 16 and 15"),
        ("kv_length", ValueError, "k and v must have the same packed length and heads"),
        ("q_4d", ValueError, "q must be 3-D"),
        ("mixed_dtype", TypeError, "q, k and v must have the same dtype"),
        ("int_q", TypeError, "q must be float32, float16, bfloat16 or float64"),
        ("alibi_shape", ValueError, r"alibi_slopes must be \(Hq,\) or \(B, Hq\), got \(3,\)"),
        (
            "alibi_device",
            ValueError,
            r"alibi_slopes must be on the same device as q \(cpu\), got meta",
        ),
        ("causal", ValueError, "causal must be False, True, 'top_left' or 'bottom_right'"),
        ("window", ValueError, "window must be None or"),
        ("dropout", ValueError, r"dropout_p must be a float in \[0, 1\), got 1.0"),
        ("softcap", ValueError, "softcap must be >= 0, got -1.0"),
    ],
)
def test_bad_inputs_name_the_argument(case, error, match):
    q, k, v, cu_q, cu_k = _small()
    max_q = max_k = 7
    kw = {}
    if case == "cu_q_decreasing":
        cu_q = torch.tensor([0, 6, 3, 10], dtype=I32)
        cu_k = torch.tensor([0, 5, 5, 12], dtype=I32)
    elif case == "cu_k_decreasing":
        cu_k = torch.tensor([0, 13, 12], dtype=I32)
    elif case == "cu_q_start":
        cu_q = torch.tensor([1, 3, 10], dtype=I32)
    elif case == "cu_k_end":
        cu_k = torch.tensor([0, 5, 11], dtype=I32)
    elif case == "cu_q_int64":
        cu_q = cu_q.long()
    elif case == "cu_k_int64":
        cu_k = cu_k.long()
    elif case == "cu_2d":
        cu_q = cu_q.view(1, 3)
    elif case == "cu_lengths":
        cu_k = torch.tensor([0, 5, 6, 12], dtype=I32)
    elif case == "max_seqlen_q":
        max_q = 6
    elif case == "max_seqlen_k":
        max_k = 5
    elif case == "attn_mask":
        kw["attn_mask"] = torch.ones(10, 12, dtype=torch.bool)
    elif case == "key_padding_mask":
        kw["key_padding_mask"] = torch.zeros(2, 7, dtype=torch.bool)
    elif case == "heads":
        k, v = torch.randn(12, 3, 16), torch.randn(12, 3, 12)
    elif case == "head_dim_256":
        q, k = torch.randn(10, 4, 320), torch.randn(12, 2, 320)
    elif case == "v_head_dim_256":
        v = torch.randn(12, 2, 300)
    elif case == "head_dim_mismatch":
        k = torch.randn(12, 2, 15)
    elif case == "kv_length":
        v = torch.randn(11, 2, 12)
    elif case == "q_4d":
        q = q.view(1, 10, 4, 16)
    elif case == "mixed_dtype":
        k = k.double()
    elif case == "int_q":
        q = q.to(torch.int32)
    elif case == "alibi_shape":
        kw["alibi_slopes"] = torch.rand(3)
    elif case == "alibi_device":
        kw["alibi_slopes"] = torch.rand(4, device="meta")
    elif case == "causal":
        kw["causal"] = "top-left"
    elif case == "window":
        kw["window"] = (3, -2)
    elif case == "dropout":
        kw["dropout_p"] = 1.0
    elif case == "softcap":
        kw["softcap"] = -1.0
    with pytest.raises(error, match=match):
        fastattn.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, **kw)


def test_any_strides_are_copied_not_refused():
    q, k, v, cu_q, cu_k = _small()
    strided = torch.randn(q.shape[0], q.shape[1], 2 * q.shape[2])[..., ::2].requires_grad_()
    out = fastattn.varlen_attention(strided, k, v, cu_q, cu_k, 7, 7, causal=True)
    (grad,) = torch.autograd.grad(out.sum(), strided)
    leaf = strided.detach().contiguous().requires_grad_()
    want = fastattn.varlen_attention(leaf, k, v, cu_q, cu_k, 7, 7, causal=True)
    (want_grad,) = torch.autograd.grad(want.sum(), leaf)
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(grad, want_grad)


@pytest.mark.parametrize(
    "case,match",
    [
        ("not-ending", "cu_seqlens must end at the packed lengths"),
        ("decreasing", "cu_seqlens must be non-decreasing"),
        ("max_seqlen", "a sequence is longer than max_seqlen_q/max_seqlen_k"),
    ],
)
def test_kernel_checks_cu_seqlens_without_host_checks(monkeypatch, case, match):
    """Under torch.compile the Python wrapper skips its host-side cu_seqlens checks; the CPU
    kernel must still refuse bad ones rather than read out of bounds."""
    varlen_device("cpu")
    monkeypatch.setattr(varlen_ops, "host_checks_enabled", lambda t=None: False)
    q, k, v, cu_q, cu_k = _small()
    max_q = max_k = 7
    if case == "not-ending":
        cu_k = torch.tensor([0, 5, 11], dtype=I32)
    elif case == "decreasing":
        cu_q = torch.tensor([0, 6, 3], dtype=I32)
        q = q[:3]
    else:
        max_q = 3
    with pytest.raises(RuntimeError, match=match):
        fastattn.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, backend="cpu")


@pytest.mark.parametrize("backend_name", ["cuda", "triton"])
def test_no_host_reads_for_cuda_tensors(backend_name):
    """varlen_attention on CUDA tensors (fake ones: no GPU needed) reads no value on the host:
    cu_seqlens are checked on the device (torch._assert_async in front of triton; the CUDA
    op's check kernel, csrc/common/device_checks.h), max_seqlen is the caller's host-side
    metadata. Forward only: autograd's engine needs a CUDA device even for fake tensors."""
    with fake_cuda(backend_name) as recorder:
        q, k, v, cu_q, cu_k = (t.to("cuda") for t in _small())
        out = fastattn.varlen_attention(
            q, k, v, cu_q, cu_k, 7, 7, causal=True, backend=backend_name
        )
        assert out.shape == (10, 4, 12)
    assert fastattn.last_backend("varlen_attention") == backend_name
    assert_no_host_reads(recorder)
    assert device_checks(recorder) == (2 if backend_name == "triton" else 0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend_name", ["cuda", "triton"])
def test_cuda_no_synchronisation(backend_name):
    """torch.cuda.set_sync_debug_mode("error") raises on any synchronising call (C++ .item()
    included): varlen_attention on CUDA tensors, forward and backward, makes none."""
    device = varlen_device(backend_name)
    q, k, v, cu_q, cu_k = (t.to(device) for t in _small())
    q, k, v = (t.half().requires_grad_() for t in (q, k, v))
    grad = torch.randn(10, 4, 12, device=device, dtype=torch.float16)

    def run():
        out = fastattn.varlen_attention(
            q, k, v, cu_q, cu_k, 7, 7, causal=True, backend=backend_name
        )
        torch.autograd.grad(out, (q, k, v), grad)

    assert_no_device_sync(run)


@pytest.mark.parametrize(
    "case,match",
    [
        ("not-ending", r"cu_seqlens_k must start at 0, end at the packed length 12"),
        ("not-starting", r"cu_seqlens_q must start at 0"),
        ("decreasing", r"cu_seqlens_q must .* be non-decreasing"),
        ("max_seqlen", r"cu_seqlens_q .* with steps <= max_seqlen 3"),
    ],
)
def test_device_checks_catch_bad_cu_seqlens(monkeypatch, case, match):
    """The cu_seqlens rules checked on the device for CUDA tensors, run on CPU tensors through
    the same code (torch._assert_async raises at once on the CPU)."""
    force_device_checks(monkeypatch)
    q, k, v, cu_q, cu_k = _small()
    max_q = max_k = 7
    if case == "not-ending":
        cu_k = torch.tensor([0, 5, 11], dtype=I32)
    elif case == "not-starting":
        cu_q = torch.tensor([1, 3, 10], dtype=I32)
    elif case == "decreasing":
        cu_q = torch.tensor([0, 6, 3], dtype=I32)
        q = q[:3]
    else:
        max_q = 3
    with pytest.raises(RuntimeError, match=match):
        fastattn.varlen_attention(q, k, v, cu_q, cu_k, max_q, max_k, backend="reference")
    fastattn.varlen_attention(*_small(), 7, 7, backend="reference")  # valid ones pass


def test_multihead_attention_cuda_padding_reads_nothing_on_the_host():
    """fastattn.nn.MultiheadAttention with a key_padding_mask on CUDA tensors takes the padded
    kernel: the varlen route would read the mask on the host (varlen_on_cuda opts in)."""
    with fake_cuda() as recorder:
        mha = MultiheadAttention(16, 2, batch_first=True, device="cuda")
        x = torch.randn(3, 9, 16, device="cuda")
        padding = torch.zeros(3, 9, dtype=torch.bool, device="cuda")
        forget_last_backend("varlen_attention")
        out, _ = mha(x, x, x, key_padding_mask=padding, need_weights=False)
        assert out.shape == x.shape
    assert fastattn.last_backend("varlen_attention") is None
    assert_no_host_reads(recorder)


# ---------------------------------------------------------------------------------------------
# pack_padded / unpack_padded


def padding_mask(kind: str, B: int, L: int, g) -> torch.Tensor:
    if kind == "anywhere":  # padding at random places; row 1 all padding, row 2 none
        mask = torch.rand(B, L, generator=g) > 0.5
        mask[1] = True
        mask[2] = False
        return mask
    if kind == "trailing":  # the usual right-padded batch
        lengths = torch.tensor([L, 3, 0, 7][:B])
        return torch.arange(L).view(1, L) >= lengths.view(B, 1)
    if kind == "all":
        return torch.ones(B, L, dtype=torch.bool)
    if kind == "none":
        return torch.zeros(B, L, dtype=torch.bool)
    raise AssertionError(kind)


PACKINGS = [("anywhere", 4), ("trailing", 4), ("all", 3), ("none", 2), ("none", 0)]


@pytest.mark.parametrize("kind,B", PACKINGS, ids=[f"{k}-B{b}" for k, b in PACKINGS])
def test_pack_unpack_round_trip(kind, B):
    L, H, D = 9, 2, 5
    g = torch.Generator().manual_seed(14)
    x = torch.randn(B, L, H, D, generator=g, dtype=F64)
    mask = padding_mask(kind, B, L, g) if B else torch.zeros(0, L, dtype=torch.bool)
    packed, cu, max_seqlen, indices = fastattn.pack_padded(x, mask)
    keep = ~mask
    counts = keep.sum(1).tolist()
    assert cu.dtype == torch.int32 and cu.tolist() == cu_seqlens(counts, "cpu").tolist()
    assert max_seqlen == max(counts, default=0)
    assert packed.shape == (int(keep.sum()), H, D)
    assert torch.equal(packed, x[keep])  # row-major order: sequence by sequence
    assert torch.equal(indices, keep.reshape(-1).nonzero().squeeze(1))
    back = fastattn.unpack_padded(packed, indices, B, L)
    assert back.shape == x.shape
    assert torch.equal(back, x.masked_fill(mask.view(B, L, 1, 1), 0.0))


def test_pack_unpack_gradients():
    """Gradients flow through both: pack's gradient is the unpacked output gradient (zero at
    padding), unpack's the packed one; float64 gradcheck of each."""
    B, L, H, D = 4, 7, 2, 3
    g = torch.Generator().manual_seed(15)
    x = torch.randn(B, L, H, D, generator=g, dtype=F64, requires_grad=True)
    mask = padding_mask("anywhere", B, L, g)
    packed, cu, _, indices = fastattn.pack_padded(x, mask)
    grad_packed = torch.randn(packed.shape, generator=g, dtype=F64)
    (dx,) = torch.autograd.grad(packed, x, grad_packed)
    assert torch.equal(dx, fastattn.unpack_padded(grad_packed, indices, B, L))
    assert torch.all(dx[mask] == 0)
    p = packed.detach().requires_grad_()
    out = fastattn.unpack_padded(p, indices, B, L)
    grad_out = torch.randn(out.shape, generator=g, dtype=F64)
    (dp,) = torch.autograd.grad(out, p, grad_out)
    assert torch.equal(dp, grad_out[~mask])
    assert torch.autograd.gradcheck(lambda t: fastattn.pack_padded(t, mask)[0], (x,))
    assert torch.autograd.gradcheck(lambda t: fastattn.unpack_padded(t, indices, B, L), (p,))


def test_pack_padded_bad_mask():
    x = torch.randn(2, 5, 3)
    with pytest.raises(
        ValueError,
        match=r"key_padding_mask must be bool \(2, 5\), got "
        r"torch.int64",
    ):
        fastattn.pack_padded(x, torch.zeros(2, 5, dtype=torch.int64))
    with pytest.raises(
        ValueError,
        match=r"key_padding_mask must be bool \(2, 5\), got "
        r"torch.bool \(2, 4\)",
    ):
        fastattn.pack_padded(x, torch.zeros(2, 4, dtype=torch.bool))


def test_pack_then_varlen_equals_padded_attention(backend):
    """Packing a padded batch (padding anywhere) and running varlen_attention equals padded
    attention with key_padding_mask at every real query row, forward and backward (float64)."""
    device = varlen_device(backend)
    B, L, H, D = 4, 21, 2, 16
    dtype = torch.float32 if backend == "triton" else F64  # triton has no float64 kernels
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-10, atol=1e-12)
    g = torch.Generator().manual_seed(16)
    mask = padding_mask("anywhere", B, L, g)
    mask[1, :3] = False  # at least one key per row: an all-padding row is a 0-length sequence
    mask = mask.to(device)
    q, k, v = (
        torch.randn(B, L, H, D, generator=g, dtype=F64).to(device, dtype).requires_grad_()
        for _ in range(3)
    )
    grad_out = torch.randn(B, L, H, D, generator=g, dtype=F64).to(device, dtype)
    qp, cu, max_len, idx = fastattn.pack_padded(q, mask)
    kp, vp = fastattn.pack_padded(k, mask)[0], fastattn.pack_padded(v, mask)[0]
    out = fastattn.varlen_attention(qp, kp, vp, cu, cu, max_len, max_len, backend=backend)
    assert fastattn.last_backend("varlen_attention") == backend
    out = fastattn.unpack_padded(out, idx, B, L)
    dense = fastattn.attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        key_padding_mask=mask,
        backend="reference",
    ).transpose(1, 2)
    dense = dense.masked_fill(mask.view(B, L, 1, 1), 0.0)  # padded query rows are dropped
    torch.testing.assert_close(out, dense, **tol)
    got = torch.autograd.grad(out, (q, k, v), grad_out)
    want = torch.autograd.grad(dense, (q, k, v), grad_out)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        torch.testing.assert_close(a, b, msg=name, **tol)


# ---------------------------------------------------------------------------------------------
# nn.MultiheadAttention's varlen path


def forget_last_backend(op: str) -> None:
    last = getattr(_backend._state, "last", None)
    if last is not None:
        last.pop(op, None)
    assert fastattn.last_backend(op) is None


def make_mha_pair(E: int, H: int, batch_first: bool, seed: int = 0, **config):
    torch.manual_seed(seed)
    ref = nn.MultiheadAttention(E, H, batch_first=batch_first, dtype=F64, **config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in ref.parameters():  # torch starts the biases at zero, which hides bias bugs
            p.copy_(0.5 * torch.randn(p.shape, generator=g, dtype=F64))
    return ref, MultiheadAttention.from_torch(copy.deepcopy(ref))


def run_mha(module, query, key, value, padding, grad_out, need_weights=False):
    out, weights = module(query, key, value, key_padding_mask=padding, need_weights=need_weights)
    inputs = list(dict.fromkeys((query, key, value)))  # self-attention: one tensor
    grads = torch.autograd.grad(out, inputs + list(module.parameters()), grad_out)
    return out, weights, grads


MHA_CONFIGS = {
    "plain": {},
    "bias-kv+zero-attn": dict(add_bias_kv=True, add_zero_attn=True),
    "kdim-vdim": dict(kdim=7, vdim=11),
}


@pytest.mark.parametrize("config", list(MHA_CONFIGS))
@pytest.mark.parametrize("batch_first", [False, True], ids=["seq-first", "batch-first"])
@pytest.mark.parametrize("kind", ["self", "cross"])
@pytest.mark.parametrize(
    "padding_fraction,varlen", [(0.7, True), (0.2, False)], ids=["heavy-padding", "light-padding"]
)
def test_multihead_attention_varlen_path(kind, batch_first, config, padding_fraction, varlen):
    """With at least half of the keys padding (the appended bias_k / zero-attention keys
    counting as real keys) and need_weights=False, fastattn's MultiheadAttention runs
    varlen_attention (last_backend("varlen_attention") becomes set); with light padding it
    does not. Either way the output and the gradients of the inputs and of every parameter
    equal torch.nn.MultiheadAttention's (float64), padded query rows included."""
    varlen_device("cpu")
    config = MHA_CONFIGS[config]
    if kind == "self" and "kdim" in config:
        pytest.skip("self-attention needs kdim = vdim = embed_dim")
    E, H, N, L, S = 24, 3, 3, 9, 20
    if kind == "self":
        L = S
    ref, fast = make_mha_pair(E, H, batch_first, **config)
    g = torch.Generator().manual_seed(17)
    padding = torch.rand(N, S, generator=g) < padding_fraction
    padding[torch.arange(N), torch.arange(N)] = False  # every row keeps a key (torch: NaN)
    padding[0, -1] = True
    extra = int(config.get("add_bias_kv", False)) + int(config.get("add_zero_attn", False))
    assert (int(padding.sum()) / (N * (S + extra)) >= 0.5) == varlen

    def shaped(length, features=E):
        shape = (N, length, features) if batch_first else (length, N, features)
        return torch.randn(shape, generator=g, dtype=F64).requires_grad_()

    if kind == "self":
        x = shaped(S)
        query = key = value = x
    else:
        query = shaped(L)
        key, value = shaped(S, config.get("kdim", E)), shaped(S, config.get("vdim", E))
    grad_out = torch.randn(query.shape, generator=g, dtype=F64)

    forget_last_backend("varlen_attention")
    forget_last_backend("attention")
    out, weights, grads = run_mha(fast, query, key, value, padding, grad_out)
    assert weights is None
    if varlen:
        assert fastattn.last_backend("varlen_attention") == "cpu", "the varlen path did not run"
        assert fastattn.last_backend("attention") is None
    else:
        assert fastattn.last_backend("varlen_attention") is None, "light padding took varlen"
        assert fastattn.last_backend("attention") == "cpu"
    out_ref, _, grads_ref = run_mha(ref, query, key, value, padding, grad_out)
    torch.testing.assert_close(out, out_ref, rtol=1e-10, atol=1e-12)
    names = ["input"] * (len(grads) - len(list(fast.parameters()))) + [
        n for n, _ in fast.named_parameters()
    ]
    for name, a, b in zip(names, grads, grads_ref):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


def test_multihead_attention_heavy_padding_with_weights_takes_padded_path():
    """need_weights=True needs the padded kernel's lse: no varlen path, weights as torch's."""
    varlen_device("cpu")
    E, H, N, S = 12, 2, 2, 10
    ref, fast = make_mha_pair(E, H, batch_first=True, seed=1)
    g = torch.Generator().manual_seed(18)
    x = torch.randn(N, S, E, generator=g, dtype=F64)
    padding = torch.ones(N, S, dtype=torch.bool)
    padding[:, :3] = False
    forget_last_backend("varlen_attention")
    out, weights = fast(x, x, x, key_padding_mask=padding, need_weights=True)
    assert fastattn.last_backend("varlen_attention") is None
    out_ref, weights_ref = ref(x, x, x, key_padding_mask=padding, need_weights=True)
    torch.testing.assert_close(out, out_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(weights, weights_ref, rtol=1e-10, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# CUDA kernels (csrc/varlen_attention/varlen_attention_cuda.cu; skip without a GPU)

# Lengths 0, 1, 5, 17, 64, 70 for queries and keys, both ways round (Lq > Lk and Lq < Lk).
CUDA_LENGTHS = ((0, 5), (1, 1), (5, 0), (17, 17), (64, 70), (70, 64), (5, 17), (1, 64))


def cuda_varlen_device() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return varlen_device("cuda")


def with_head_dims(c: Packed, D: int, Dv: int, seed: int) -> Packed:
    """c with fresh q, k, v of head dims D and Dv (same packing, dtype and device)."""
    g = torch.Generator().manual_seed(seed)
    (tq, Hq, _), (tk, Hkv, _) = c.q.shape, c.k.shape

    def make(*shape):
        return torch.randn(*shape, generator=g).to(dtype=c.q.dtype, device=c.q.device)

    return replace(c, q=make(tq, Hq, D), k=make(tk, Hkv, D), v=make(tk, Hkv, Dv))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize(
    "dims", [(64, 64), (128, 96), (256, 256), (33, 150)], ids=["d64", "d128", "d256", "d33-dv150"]
)
@pytest.mark.parametrize(
    "feature", ["causal_top_left", "causal_bottom_right", "gqa", "window", "everything"]
)
def test_cuda_16bit_head_dim_buckets(feature, dims, dtype):
    """The tensor-core kernels (head-dim buckets 64/128/256, padded dims) on packs with
    lengths 0, 1, 5, 17, 64, 70 against the per-sequence float64 definition."""
    device = cuda_varlen_device()
    c = with_head_dims(make_case(feature, dtype, device, lengths=CUDA_LENGTHS), *dims, seed=5)
    check_against_dense("cuda", c)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_cuda_dropout_mask_equals_cpu_kernel(dtype):
    """The CUDA kernel drops exactly the probabilities the CPU kernel drops (the packed
    numbering): with v = identity per sequence, out = P * keep / (1 - p), so the zero patterns
    of both kernels' outputs must be equal."""
    device = cuda_varlen_device()
    varlen_device("cpu")
    lengths = CUDA_LENGTHS
    g = torch.Generator().manual_seed(17)
    Hq, Hkv, D = 4, 2, 32
    cq = cu_seqlens([a for a, _ in lengths], "cpu")
    ck = cu_seqlens([b for _, b in lengths], "cpu")
    max_q, max_k = max(a for a, _ in lengths), max(b for _, b in lengths)
    q = torch.randn(int(cq[-1]), Hq, D, generator=g).to(dtype)
    k = torch.randn(int(ck[-1]), Hkv, D, generator=g).to(dtype)
    v = torch.zeros(int(ck[-1]), Hkv, max_k, dtype=dtype)
    for b in range(len(lengths)):
        for j in range(int(ck[b + 1] - ck[b])):
            v[int(ck[b]) + j, :, j] = 1
    seed = torch.tensor([987654321, 3], dtype=torch.int64)
    args = (max_q, max_k, None, D**-0.5, 0.0, 2, -1, -1, 0.3)
    out_cpu, lse_cpu = torch.ops.fastattn.varlen_attention_forward(q, k, v, cq, ck, *args, seed)
    out_gpu, lse_gpu = torch.ops.fastattn.varlen_attention_forward(
        q.to(device),
        k.to(device),
        v.to(device),
        cq.to(device),
        ck.to(device),
        *args,
        seed.to(device),
    )
    out_gpu = out_gpu.cpu()
    assert torch.equal(out_gpu == 0, out_cpu == 0), "dropout masks differ"
    assert torch.equal(torch.isneginf(lse_gpu.cpu()), torch.isneginf(lse_cpu))
    torch.testing.assert_close(
        out_gpu.float(), out_cpu.float(), rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-5
    )


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_cuda_16bit_backward_is_bitwise_reproducible(dtype):
    device = cuda_varlen_device()
    c = make_case("everything", dtype, device, lengths=CUDA_LENGTHS, seed=4)
    g = torch.Generator().manual_seed(2)
    grad_out = torch.randn(c.q.shape[0], c.q.shape[1], c.v.shape[2], generator=g)
    grad_out = grad_out.to(dtype=dtype, device=device)
    first = run_varlen("cuda", c, grad_out)
    second = run_varlen("cuda", c, grad_out)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), first, second):
        assert torch.equal(a, b), f"{name} is not bitwise reproducible"


def test_cuda_runs_on_the_current_stream_and_device():
    """Results on a side stream equal those on the default stream (the kernels use the
    current stream), and a call from another current device runs on q's device."""
    device = cuda_varlen_device()
    c = make_case("causal_bottom_right", torch.bfloat16, device, lengths=CUDA_LENGTHS)
    expected = run_varlen("cuda", c)[0]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = run_varlen("cuda", c)[0]
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(got, expected)
    if torch.cuda.device_count() > 1:
        c1 = replace(
            c,
            q=c.q.to("cuda:1"),
            k=c.k.to("cuda:1"),
            v=c.v.to("cuda:1"),
            cu_q=c.cu_q.to("cuda:1"),
            cu_k=c.cu_k.to("cuda:1"),
        )
        assert torch.equal(run_varlen("cuda", c1)[0].to(device), expected)


def test_cuda_op_errors_name_the_argument():
    device = cuda_varlen_device()
    c = make_case("plain", torch.float16, device, lengths=CUDA_LENGTHS)
    op = torch.ops.fastattn.varlen_attention_forward
    rest = (c.max_q, c.max_k, None, 0.1, 0.0, 0, -1, -1, 0.0, None)
    with pytest.raises(RuntimeError, match="cu_seqlens_q and q must be on the same device"):
        op(c.q, c.k, c.v, c.cu_q.cpu(), c.cu_k, *rest)
    with pytest.raises(RuntimeError, match="cu_seqlens_k must be a contiguous int32"):
        op(c.q, c.k, c.v, c.cu_q, c.cu_k.long(), *rest)
    with pytest.raises(RuntimeError, match="max_seqlen_q/max_seqlen_k must be >= 1"):
        op(c.q, c.k, c.v, c.cu_q, c.cu_k, 0, c.max_k, *rest[2:])


# ---------------------------------------------------------------------------------------------
# Limits: sizes beyond the kernels' index types


@pytest.mark.parametrize("backend", ["cpu", "triton", "reference"])
def test_max_seqlen_of_2_pow_30_is_refused(backend):
    """Every backend's band treats +-2**30 as unbounded: a max_seqlen of 2**30 is refused by
    the argument checks, naming it, before cu_seqlens are read or a kernel runs."""
    device = varlen_device(backend)
    q = torch.randn(3, 2, 8, device=device)
    cu = cu_seqlens([3], device)
    with pytest.raises(ValueError, match=r"varlen_attention: max_seqlen_k must be < 2\*\*30"):
        fastattn.varlen_attention(q, q, q, cu, cu, 3, 2**30, backend=backend)


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_ops_refuse_max_seqlen_of_2_pow_30(backend):
    """The same rule in the native CPU op's check and the Triton launcher (direct op calls
    skip fastattn.varlen_attention's checks)."""
    varlen_device(backend)
    q = torch.randn(3, 2, 8)
    cu = cu_seqlens([3], q.device)
    args = (q, q, q, cu, cu, 2**30, 3, None, 1.0, 0.0, 0, -1, -1, 0.0, None)
    if backend == "cpu":
        with pytest.raises(RuntimeError, match=r"max_seqlen_q must be < 2\^30"):
            torch.ops.fastattn.varlen_attention_forward(*args)
    else:
        with pytest.raises(ValueError, match=r"max_seqlen_q must be < 2\*\*30"):
            torch.ops.fastattn.varlen_attention_forward_triton(*args)
