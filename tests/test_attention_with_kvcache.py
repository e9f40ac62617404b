"""Tests of fastattn.attention_with_kvcache (decoding over a KV cache; inference only).

The definition: the Lq queries of sequence b sit at positions cache_seqlens[b] + i and attend
over the sequence's keys: the cache's first cache_seqlens[b] entries followed by the Lnew new
(rotated) keys; query i sees key j iff j <= cache_seqlens[b] + i (causal) and j lies in the
window around its position. The expected output is dense fastattn.attention (reference backend)
over that concatenated sequence with a mask built here from the positions (ALiBi as a float
mask of -slope * |position - j|), with the queries and new keys rotated by a plain-PyTorch
rotary written here. float64 results must agree to ~1e-12; float32 ones meet FlashAttention's
rule (tests/tolerance.py) against the float64 definition, with the definition run in float32
as the baseline.

The caches must hold, at [cache_seqlens[b], cache_seqlens[b] + Lnew), exactly the new values
and the new keys rotated at their positions (checked element by element against
fastattn.apply_rotary), every other cache entry unchanged bit for bit, and cache_seqlens itself
unmodified. Every test asserts `fastattn.last_backend("attention_with_kvcache")`.

The Triton backend (fastattn/triton/attention_with_kvcache.py) rotates and appends inside its
kernels: its caches must equal fastattn.apply_rotary's Triton kernel bit for bit. It has no
float64 kernels (refusal checked in test_triton_request_raises_backend_error); its float32,
float16 and bfloat16 results meet the same rule (16-bit runs cover the cpu backend too).
examples/decoding.py (run by tests/test_examples.py) checks whole-model decoding.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import pytest
import torch
from conftest import backend_device, require_kernel
from host_reads import (
    ValueReadError,
    assert_no_host_reads,
    device_checks,
    fake_cuda,
    force_device_checks,
    run_failing_cuda_script,
)
from tolerance import F32_ULP, assert_fa_close, rounding_floor

import fastattn
from fastattn._backend import missing_kernel

pytestmark = pytest.mark.usefixtures("one_thread")

F64, F32, F16, BF16 = torch.float64, torch.float32, torch.float16, torch.bfloat16
_DT = {F64: "f64", F32: "f32", F16: "f16", BF16: "bf16"}
DTYPES = [F64, F32, F16, BF16]


# ---------------------------------------------------------------------------------------------
# Helpers


def kvcache_device(backend: str) -> torch.device:
    """The device for `backend`'s tests; skips when it cannot run attention_with_kvcache
    (fails when the build claims the kernel but lost it: require_kernel)."""
    require_kernel("attention_with_kvcache" if backend == "triton" else "attention_decode", backend)
    return backend_device(backend)


def skip_unsupported_dtype(backend: str, dtype: torch.dtype) -> None:
    if backend == "triton" and dtype == F64:
        pytest.skip(
            "backend triton: no float64 kernels (test_triton_request_raises_backend_"
            "error checks the refusal)"
        )


@dataclass
class Decode:
    q: torch.Tensor  # (B, Hq, Lq, D)
    k_cache: torch.Tensor  # (B, Hkv, Lmax, D)
    v_cache: torch.Tensor  # (B, Hkv, Lmax, Dv)
    cache_seqlens: torch.Tensor  # int32 (B,)
    k_new: torch.Tensor | None  # (B, Hkv, Lnew, D)
    v_new: torch.Tensor | None
    cos: torch.Tensor | None = None  # (rows, rotary_dim / 2)
    sin: torch.Tensor | None = None
    interleaved: bool = False
    kw: dict | None = None

    @property
    def lnew(self) -> int:
        return 0 if self.k_new is None else self.k_new.shape[2]

    def call(self, backend=None, **kw):
        rotary = {}
        if self.cos is not None:
            rotary = dict(
                rotary_cos=self.cos, rotary_sin=self.sin, rotary_interleaved=self.interleaved
            )
        return fastattn.attention_with_kvcache(
            self.q,
            self.k_cache,
            self.v_cache,
            cache_seqlens=self.cache_seqlens,
            k_new=self.k_new,
            v_new=self.v_new,
            backend=backend,
            **rotary,
            **(self.kw or {}),
            **kw,
        )


def rotary_tables(rows: int, rotary_dim: int, dtype, device, base: float = 10000.0):
    """cos/sin (rows, rotary_dim / 2) of angle p * base^(-2i / rotary_dim)."""
    inv = base ** (-torch.arange(0, rotary_dim, 2, dtype=F64) / rotary_dim)
    angles = torch.arange(rows, dtype=F64).view(rows, 1) * inv.view(1, -1)
    return angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device)


def make_decode(
    *,
    B=3,
    Hq=6,
    Hkv=2,
    Lmax=67,
    D=40,
    Dv=24,
    Lq=1,
    Lnew=1,
    cache_lens=None,
    rotary=None,
    dtype=F64,
    device="cpu",
    seed=0,
    kw=None,
) -> Decode:
    """Random inputs. cache_lens default: 0, mid and full-minus-new (one per sequence). The
    caches are random everywhere, so entries past a sequence's length that leaked into the
    result would show. rotary: None, "neox", "gptj" or "neox_partial" (rotary_dim about D / 2);
    the tables have Lmax + 8 rows (queries sit past Lmax when Lnew = 0 and the cache is full).
    """
    g = torch.Generator().manual_seed(seed * 7919 + Lq * 31 + Lnew)
    if cache_lens is None:
        cache_lens = [0, Lmax // 2 - 3, Lmax - Lnew][:B]
    q = torch.randn(B, Hq, Lq, D, generator=g, dtype=F64)
    k_cache = torch.randn(B, Hkv, Lmax, D, generator=g, dtype=F64)
    v_cache = torch.randn(B, Hkv, Lmax, Dv, generator=g, dtype=F64)
    k_new = torch.randn(B, Hkv, Lnew, D, generator=g, dtype=F64)
    v_new = torch.randn(B, Hkv, Lnew, Dv, generator=g, dtype=F64)
    q, k_cache, v_cache, k_new, v_new = (
        t.to(dtype=dtype, device=device) for t in (q, k_cache, v_cache, k_new, v_new)
    )
    d = Decode(
        q,
        k_cache,
        v_cache,
        torch.tensor(cache_lens, dtype=torch.int32, device=device),
        k_new,
        v_new,
        kw=dict(kw or {}),
    )
    if rotary is not None:
        rotary_dim = D // 2 if rotary == "neox_partial" else D
        rotary_dim -= rotary_dim % 2  # odd head dims: the last feature passes through
        d.cos, d.sin = rotary_tables(Lmax + 8, rotary_dim, dtype, device)
        d.interleaved = rotary == "gptj"
    return d


def rope(x: torch.Tensor, cos, sin, positions: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Plain rotary of x (B, H, L, D) at positions (B, L), computed in x's dtype: GPT-NeoX
    halves (feature i pairs with i + r/2) or GPT-J pairs (2i, 2i + 1), r = 2 * cos.shape[1]."""
    r = 2 * cos.shape[1]
    c = cos.to(x.dtype)[positions].unsqueeze(1)  # (B, 1, L, r/2)
    s = sin.to(x.dtype)[positions].unsqueeze(1)
    rot, rest = x[..., :r], x[..., r:]
    if interleaved:
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    else:
        x1, x2 = rot[..., : r // 2], rot[..., r // 2 :]
    o1, o2 = x1 * c - x2 * s, x2 * c + x1 * s
    out = torch.stack((o1, o2), dim=-1).flatten(-2) if interleaved else torch.cat((o1, o2), -1)
    return torch.cat((out, rest), dim=-1)


def dense_expected(d: Decode, k_cache: torch.Tensor, v_cache: torch.Tensor, dtype):
    """The definition in `dtype`, from the caches as they were before the call."""
    kw = dict(d.kw or {})
    causal = kw.pop("causal", True)
    left, right = kw.pop("window", None) or (-1, -1)
    alibi = kw.pop("alibi_slopes", None)
    kw.pop("num_splits", None)
    k_new, v_new = d.k_new, d.v_new
    if k_new is None:  # nothing appended: the same as Lnew = 0
        k_new, v_new = k_cache[:, :, :0], v_cache[:, :, :0]
    q, k_new, v_new = (t.to(dtype) for t in (d.q, k_new, v_new))
    k_cache, v_cache = k_cache.to(dtype), v_cache.to(dtype)
    B, Hq, Lq, _ = q.shape
    Lnew = k_new.shape[2]
    lens = d.cache_seqlens.tolist()
    start = d.cache_seqlens.to(torch.int64).view(B, 1)
    if d.cos is not None:
        q = rope(q, d.cos, d.sin, start + torch.arange(Lq, device=q.device), d.interleaved)
        k_new = rope(
            k_new, d.cos, d.sin, start + torch.arange(Lnew, device=q.device), d.interleaved
        )
    outs = []
    for b, s in enumerate(lens):
        K = torch.cat((k_cache[b : b + 1, :, :s], k_new[b : b + 1]), dim=2)
        V = torch.cat((v_cache[b : b + 1, :, :s], v_new[b : b + 1]), dim=2)
        Lk = s + Lnew
        pos = s + torch.arange(Lq, device=q.device).view(Lq, 1)
        j = torch.arange(Lk, device=q.device).view(1, Lk)
        visible = torch.ones(Lq, Lk, dtype=torch.bool, device=q.device)
        if causal:
            visible &= j <= pos
        if left >= 0:
            visible &= j >= pos - left
        if right >= 0:
            visible &= j <= pos + right
        mask = visible.view(1, 1, Lq, Lk)
        if alibi is not None:
            slopes = (alibi if alibi.dim() == 1 else alibi[b]).to(dtype).view(1, Hq, 1, 1)
            bias = -slopes * (pos - j).abs().to(dtype)
            mask = bias.masked_fill(~mask, float("-inf"))
        outs.append(
            fastattn.attention(q[b : b + 1], K, V, attn_mask=mask, backend="reference", **kw)
        )
    return torch.cat(outs)


def check_caches(d: Decode, k_before, v_before, backend):
    """The caches changed exactly at [cache_seqlens[b], cache_seqlens[b] + Lnew): the new values
    and the new keys rotated at those positions (element by element against
    fastattn.apply_rotary, and against the plain rotary)."""
    B, Hkv, Lmax, _ = d.k_cache.shape
    lens = d.cache_seqlens.tolist()
    untouched = torch.ones(B, Lmax, dtype=torch.bool)
    # The backend's own rotary kernel: the triton kernels rotate with the arithmetic of
    # fastattn's Triton apply_rotary, the cpu path calls fastattn's CPU one.
    rotary_backend = backend if backend in ("reference", "triton") else None
    for b, s in enumerate(lens):
        for i in range(d.lnew):
            untouched[b, s + i] = False
            k_i = d.k_new[b : b + 1, :, i : i + 1]
            if d.cos is not None:
                k_i = fastattn.apply_rotary(
                    k_i,
                    cos=d.cos,
                    sin=d.sin,
                    offset=s + i,
                    interleaved=d.interleaved,
                    backend=rotary_backend,
                )
            assert torch.equal(d.k_cache[b, :, s + i], k_i[0, :, 0]), (
                f"k_cache[{b}, :, {s + i}] is not the (rotated) new key {i}"
            )
            assert torch.equal(d.v_cache[b, :, s + i], d.v_new[b, :, i]), (
                f"v_cache[{b}, :, {s + i}] is not the new value {i}"
            )
    untouched = untouched.to(d.k_cache.device)
    assert torch.equal(d.k_cache.transpose(1, 2)[untouched], k_before.transpose(1, 2)[untouched])
    assert torch.equal(d.v_cache.transpose(1, 2)[untouched], v_before.transpose(1, 2)[untouched])
    if d.cos is not None and d.lnew:
        start = d.cache_seqlens.to(torch.int64).view(B, 1)
        rotated = rope(
            d.k_new.double(),
            d.cos.double(),
            d.sin.double(),
            start + torch.arange(d.lnew, device=start.device),
            d.interleaved,
        )
        tol = {F64: 1e-12, F32: 2e-6, F16: 2e-3, BF16: 1.6e-2}[d.q.dtype]
        for b, s in enumerate(lens):
            torch.testing.assert_close(
                d.k_cache[b, :, s : s + d.lnew].double(), rotated[b], rtol=tol, atol=tol
            )


def run_and_check(backend, d: Decode, **kw):
    """Call on `backend` and check everything the definition says; returns the output."""
    k_before, v_before = d.k_cache.clone(), d.v_cache.clone()
    lens_before = d.cache_seqlens.clone()
    out = d.call(backend, **kw)
    assert fastattn.last_backend("attention_with_kvcache") == backend
    B, Hq, Lq, _ = d.q.shape
    assert out.shape == (B, Hq, Lq, d.v_cache.shape[3]) and out.dtype == d.q.dtype
    assert not out.requires_grad
    assert torch.equal(d.cache_seqlens, lens_before), "cache_seqlens must not be modified"
    assert d.cache_seqlens.dtype == torch.int32
    check_caches(d, k_before, v_before, backend)
    d = replace(d, kw=dict(d.kw or {}, **kw))
    ref64 = dense_expected(d, k_before, v_before, F64)
    if d.q.dtype == F64:
        torch.testing.assert_close(out, ref64, rtol=1e-10, atol=1e-12)
    else:
        low = dense_expected(d, k_before, v_before, d.q.dtype)
        floor = (
            rounding_floor(ref64, out.dtype) + 16 * F32_ULP * float(ref64.abs().max())
            if ref64.numel()
            else None
        )
        assert_fa_close("out", out, ref64, low, floor=floor)
    return out


# ---------------------------------------------------------------------------------------------
# Against the definition


LQ_LNEW = [(0, 0), (2, 0), (1, 1), (4, 4)]
ROTARY = [None, "neox", "gptj"]


@pytest.mark.parametrize("dtype", DTYPES, ids=[_DT[t] for t in DTYPES])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("rotary", ROTARY, ids=["norotary", "neox", "gptj"])
@pytest.mark.parametrize("lq,lnew", LQ_LNEW, ids=[f"Lq{a}-Lnew{b}" for a, b in LQ_LNEW])
def test_kvcache_matches_dense(backend, lq, lnew, rotary, causal, dtype):
    """GQA (6 query heads over 2), Dv != D, cache lengths 0 / mid / full-minus-new in one
    batch, with or without rotary (both layouts), causal or not; Lq = Lnew, and Lq > 0 with
    nothing appended."""
    device = kvcache_device(backend)
    skip_unsupported_dtype(backend, dtype)
    d = make_decode(
        Lq=lq, Lnew=lnew, rotary=rotary, dtype=dtype, device=device, kw=dict(causal=causal)
    )
    run_and_check(backend, d)


def test_without_new_tokens(backend):
    """k_new = v_new = None appends nothing and equals passing empty (Lnew = 0) tensors."""
    device = kvcache_device(backend)
    d = make_decode(
        Lq=3,
        Lnew=0,
        rotary="neox",
        dtype=F32 if backend == "triton" else F64,
        device=device,
        seed=5,
    )
    with_empty = run_and_check(backend, d)
    without = run_and_check(backend, replace(d, k_new=None, v_new=None))
    assert torch.equal(with_empty, without)


KV_FEATURES = {
    "mha": dict(Hq=4, Hkv=4),
    "mqa": dict(Hq=5, Hkv=1),
    "window": dict(kw=dict(window=(5, 0))),
    "window-noncausal": dict(kw=dict(causal=False, window=(3, 2))),
    "window-left-unbounded": dict(kw=dict(causal=False, window=(-1, 1))),
    "softcap-scale": dict(kw=dict(softcap=2.0, scale=0.6)),
    "alibi-heads": dict(kw=dict(alibi_slopes=torch.rand(6) * 0.3)),
    "alibi-batch-heads": dict(kw=dict(alibi_slopes=torch.rand(3, 6) * 0.3)),
    "partial-rotary": dict(rotary="neox_partial"),
    "odd-head-dims": dict(D=59, Dv=111, rotary="gptj"),
    "causal-bottom-right": dict(kw=dict(causal="bottom_right")),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=[_DT[t] for t in DTYPES])
# Lq=1: one-token decoding, where the cpu kernels take a KV group's query heads as the rows of
# one tile (every feature that keeps the heads' scores alike: windows, softcap, causal forms)
@pytest.mark.parametrize(
    "lq,lnew", [(3, 3), (2, 0), (1, 1)], ids=["Lq3-Lnew3", "Lq2-Lnew0", "Lq1-Lnew1"]
)
@pytest.mark.parametrize("feature", list(KV_FEATURES))
def test_kvcache_features(backend, feature, lq, lnew, dtype):
    device = kvcache_device(backend)
    skip_unsupported_dtype(backend, dtype)
    spec = dict(KV_FEATURES[feature])
    kw = {
        n: x.to(device) if isinstance(x, torch.Tensor) else x for n, x in spec.pop("kw", {}).items()
    }
    d = make_decode(Lq=lq, Lnew=lnew, dtype=dtype, device=device, seed=1, kw=kw, **spec)
    run_and_check(backend, d)


@pytest.mark.parametrize("window", [None, (37, 0)], ids=["full", "window"])
@pytest.mark.parametrize("lq", [1, 4])
@pytest.mark.parametrize("num_splits", [1, 2, 7, 0])
@pytest.mark.parametrize("backend_name", ["cpu", "triton"])
def test_num_splits(backend_name, num_splits, lq, window):
    """Split-K (flash-decoding): any number of key ranges, merged, gives the definition's
    result, including splits that hold no valid or no visible key (short caches, windows).
    The triton backend's splits are merged by its own kernel (float32; bfloat16 with 7 splits,
    to keep the interpreted runs short)."""
    device = kvcache_device(backend_name)
    kw = dict(window=window) if window else {}
    dtypes = (F64, F32)
    if backend_name == "triton":
        dtypes = (F32, BF16) if num_splits == 7 else (F32,)
    for dtype in dtypes:
        d = make_decode(
            B=3,
            Lmax=300,
            Lq=lq,
            Lnew=lq,
            cache_lens=[5, 150, 300 - lq],
            rotary="neox",
            dtype=dtype,
            device=device,
            seed=2,
            kw=kw,
        )
        run_and_check(backend_name, d, num_splits=num_splits)


@pytest.mark.parametrize("backend_name", ["cpu", "triton"])
def test_num_splits_agree(backend_name):
    """Every split count gives the same result to float32 rounding."""
    device = kvcache_device(backend_name)
    results = []
    for num_splits in (1, 2, 7, 0):
        d = make_decode(
            B=2, Lmax=300, Lq=1, Lnew=1, cache_lens=[299, 123], dtype=F32, device=device, seed=3
        )
        results.append(d.call(backend_name, num_splits=num_splits))
    for other in results[1:]:
        torch.testing.assert_close(other, results[0], rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("backend_name", ["cpu", "reference", "triton"])
def test_incremental_decoding_equals_causal_attention(backend_name):
    """Prefill 7 tokens, then decode 5 one by one (the caller advancing cache_seqlens): every
    step's output equals causal attention over the whole rotated sequence so far, and the cache
    holds the rotated keys of every token."""
    device = kvcache_device(backend_name)
    B, Hq, Hkv, D, Lmax, T = 2, 4, 2, 16, 32, 12
    dtype = F32 if backend_name == "triton" else F64  # triton has no float64 kernels
    tol = dict(rtol=2e-5, atol=2e-6) if dtype == F32 else dict(rtol=1e-10, atol=1e-12)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(B, Hq, T, D, generator=g, dtype=F64).to(device, dtype)
    k = torch.randn(B, Hkv, T, D, generator=g, dtype=F64).to(device, dtype)
    v = torch.randn(B, Hkv, T, D, generator=g, dtype=F64).to(device, dtype)
    cos, sin = rotary_tables(Lmax, D, dtype, device)
    # NaN everywhere: never read unwritten
    k_cache = torch.full((B, Hkv, Lmax, D), float("nan"), dtype=dtype, device=device)
    v_cache = torch.full((B, Hkv, Lmax, D), float("nan"), dtype=dtype, device=device)
    seqlens = torch.zeros(B, dtype=torch.int32, device=device)
    positions = torch.arange(T, device=device).expand(B, T)
    q_rot, k_rot = rope(q, cos, sin, positions, False), rope(k, cos, sin, positions, False)
    full = fastattn.attention(q_rot, k_rot, v, causal=True, backend="reference")
    steps = [(0, 7)] + [(t, t + 1) for t in range(7, T)]
    for lo, hi in steps:
        out = fastattn.attention_with_kvcache(
            q[:, :, lo:hi],
            k_cache,
            v_cache,
            cache_seqlens=seqlens,
            k_new=k[:, :, lo:hi],
            v_new=v[:, :, lo:hi],
            rotary_cos=cos,
            rotary_sin=sin,
            backend=backend_name,
        )
        assert fastattn.last_backend("attention_with_kvcache") == backend_name
        torch.testing.assert_close(out, full[:, :, lo:hi], **tol)
        seqlens += hi - lo
    torch.testing.assert_close(k_cache[:, :, :T], k_rot, **tol)
    assert torch.equal(v_cache[:, :, :T], v)
    assert torch.isnan(k_cache[:, :, T:]).all()


def test_inference_only():
    """Inference only: under grad mode with inputs that require grad, the output does not
    require grad (the op runs under torch.no_grad) and grad mode is restored."""
    device = kvcache_device("cpu")
    d = make_decode(Lq=2, Lnew=2, rotary="neox", dtype=F32, device=device)
    d.q.requires_grad_()
    d.k_new.requires_grad_()
    d.v_new.requires_grad_()
    with torch.enable_grad():
        out = d.call()
        assert torch.is_grad_enabled()
    assert fastattn.last_backend("attention_with_kvcache") == "cpu"
    assert not out.requires_grad and out.grad_fn is None
    assert not d.k_cache.requires_grad and not d.v_cache.requires_grad


def test_default_backend_for_cpu_tensors_is_cpu():
    device = kvcache_device("cpu")
    make_decode(device=device).call()
    assert fastattn.last_backend("attention_with_kvcache") == "cpu"


def test_compile_fullgraph():
    """attention_with_kvcache traces into one graph on cpu (its host-side length checks are
    skipped while compiling): the eager output and the same in-place appends."""
    device = kvcache_device("cpu")
    eager = make_decode(
        Lq=2, Lnew=2, rotary="gptj", dtype=F32, device=device, seed=6, kw=dict(window=(9, 0))
    )
    traced = replace(eager, k_cache=eager.k_cache.clone(), v_cache=eager.v_cache.clone())

    def fn(q, k_cache, v_cache, k_new, v_new):
        return fastattn.attention_with_kvcache(
            q,
            k_cache,
            v_cache,
            cache_seqlens=eager.cache_seqlens,
            k_new=k_new,
            v_new=v_new,
            rotary_cos=eager.cos,
            rotary_sin=eager.sin,
            rotary_interleaved=True,
            window=(9, 0),
        )

    out = torch.compile(fn, fullgraph=True)(
        traced.q, traced.k_cache, traced.v_cache, traced.k_new, traced.v_new
    )
    assert fastattn.last_backend("attention_with_kvcache") == "cpu"
    expected = fn(eager.q, eager.k_cache, eager.v_cache, eager.k_new, eager.v_new)
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(traced.k_cache, eager.k_cache, rtol=1e-6, atol=1e-6)
    assert torch.equal(traced.v_cache, eager.v_cache)


def test_opcheck_triton():
    """The Triton op's registration as opcheck sees it: the caches declared as written in
    place, the fake implementation's shapes and dtypes."""
    device = kvcache_device("triton")
    d = make_decode(Lq=2, Lnew=2, Lmax=20, rotary="gptj", dtype=F32, device=device, seed=7)
    alibi = torch.rand(3, 6).to(device)
    args = [
        d.q,
        d.k_cache,
        d.v_cache,
        d.cache_seqlens,
        d.k_new,
        d.v_new,
        d.cos.float(),
        d.sin.float(),
        True,
        alibi,
        0.3,
        2.0,
        2,
        5,
        -1,
        2,
    ]
    torch.library.opcheck(torch.ops.fastattn.attention_with_kvcache_triton.default, args)


def test_opcheck_native_cpu():
    """The native ops as opcheck sees them: attention_with_kvcache (rotary, append and decode in
    one call, the caches declared as written in place) and attention_decode."""
    require_kernel("attention_with_kvcache", "cpu")
    d = make_decode(Lq=2, Lnew=2, Lmax=20, rotary="gptj", dtype=F32, seed=7)
    alibi = torch.rand(3, 6)
    args = [
        d.q,
        d.k_cache,
        d.v_cache,
        d.cache_seqlens,
        d.k_new,
        d.v_new,
        d.cos.float(),
        d.sin.float(),
        True,
        alibi,
        0.3,
        2.0,
        2,
        5,
        -1,
        2,
    ]
    torch.library.opcheck(torch.ops.fastattn.attention_with_kvcache.default, args)
    lengths = (d.cache_seqlens + 2).to(torch.int32)
    torch.library.opcheck(
        torch.ops.fastattn.attention_decode.default,
        [d.q, d.k_cache, d.v_cache, lengths, d.cache_seqlens, alibi, 0.3, 2.0, 2, 5, -1, 2],
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_opcheck_native_cuda():
    """The CUDA registration of the one-call op: opcheck, and the same output and caches as the
    CPU op in float32."""
    require_kernel("attention_with_kvcache", "cuda")
    d = make_decode(Lq=2, Lnew=2, Lmax=20, rotary="gptj", dtype=F32, seed=7)
    alibi = torch.rand(3, 6)
    cpu_args = [
        d.q,
        d.k_cache.clone(),
        d.v_cache.clone(),
        d.cache_seqlens,
        d.k_new,
        d.v_new,
        d.cos.float(),
        d.sin.float(),
        True,
        alibi,
        0.3,
        2.0,
        2,
        5,
        -1,
        2,
    ]
    cuda_args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in cpu_args]
    torch.library.opcheck(
        torch.ops.fastattn.attention_with_kvcache.default,
        [a.clone() if isinstance(a, torch.Tensor) else a for a in cuda_args],
    )
    out_cpu, _ = torch.ops.fastattn.attention_with_kvcache(*cpu_args)
    out_cuda, _ = torch.ops.fastattn.attention_with_kvcache(*cuda_args)
    torch.testing.assert_close(out_cuda.cpu(), out_cpu, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(cuda_args[1].cpu(), cpu_args[1], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cuda_args[2].cpu(), cpu_args[2], rtol=0, atol=0)


def test_native_op_checks_before_appending():
    """Called directly (no Python checks), the CPU op refuses a cache too small for the new
    tokens, and a k_new of the wrong dtype, before writing anything."""
    require_kernel("attention_with_kvcache", "cpu")
    d = make_decode(Lnew=3, Lmax=20, dtype=F32, seed=3)
    k_before, v_before = d.k_cache.clone(), d.v_cache.clone()
    full = torch.full_like(d.cache_seqlens, 18)
    op = torch.ops.fastattn.attention_with_kvcache
    # fastattn._native.value_errors(): the op's tagged RuntimeError as the Python layer's
    # ValueError (the stable ABI carries only RuntimeError).
    with (
        pytest.raises(
            ValueError,
            match=r"the cache is too small: cache_seqlens\[0\] = 18 plus "
            r"3 new tokens exceed Lmax = 20",
        ),
        fastattn._native.value_errors(),
    ):
        op(
            d.q,
            d.k_cache,
            d.v_cache,
            full,
            d.k_new,
            d.v_new,
            None,
            None,
            False,
            None,
            0.5,
            0.0,
            2,
            -1,
            -1,
            0,
        )
    with pytest.raises(RuntimeError, match="k_new must have q's dtype"):
        op(
            d.q,
            d.k_cache,
            d.v_cache,
            d.cache_seqlens,
            d.k_new.double(),
            d.v_new,
            None,
            None,
            False,
            None,
            0.5,
            0.0,
            2,
            -1,
            -1,
            0,
        )
    assert torch.equal(d.k_cache, k_before) and torch.equal(d.v_cache, v_before)


def test_triton_request_raises_backend_error():
    """A Triton request that cannot run is a clear BackendError and leaves the caches alone:
    float64 (no float64 kernels), or any call when there is no Triton implementation."""
    if not missing_kernel("attention_with_kvcache", "triton"):
        if fastattn.available_backends()["triton"] != "available":
            pytest.skip(f"backend triton: {fastattn.available_backends()['triton']}")
        d = make_decode(dtype=F64)
        k_before = d.k_cache.clone()
        with pytest.raises(
            fastattn.BackendError,
            match="attention_with_kvcache: backend "
            "'triton' cannot run this call: the triton backend does not take "
            "float64",
        ):
            d.call("triton")
        assert torch.equal(d.k_cache, k_before)
        return
    d = make_decode(dtype=F32)
    k_before = d.k_cache.clone()
    with pytest.raises(
        fastattn.BackendError, match="attention_with_kvcache: backend 'triton' does not implement"
    ):
        d.call("triton")
    with fastattn.use_backend("triton"), pytest.raises(fastattn.BackendError):
        d.call()
    assert torch.equal(d.k_cache, k_before)


def test_cuda_request_for_cpu_tensors_raises():
    d = make_decode(dtype=F32)
    with pytest.raises(
        fastattn.BackendError, match="attention_with_kvcache: backend 'cuda' cannot run this call"
    ):
        d.call("cuda")


# ---------------------------------------------------------------------------------------------
# Argument checks: clear errors, and nothing appended when a call is refused


@pytest.mark.parametrize(
    "case,error,match",
    [
        (
            "too_small",
            ValueError,
            "the cache is too small: cache_seqlens up to 15 plus 2 new tokens exceed Lmax = 16",
        ),
        ("too_small_one_row", ValueError, "the cache is too small"),
        ("negative", ValueError, "cache_seqlens must be >= 0, got -1"),
        (
            "seqlens_int64",
            TypeError,
            r"cache_seqlens must be int32 \(B,\) = \(2,\), got torch.int64",
        ),
        (
            "seqlens_length",
            TypeError,
            r"cache_seqlens must be int32 \(B,\) = \(2,\), got "
            r"torch.int32 \(3,\)",
        ),
        ("seqlens_2d", ValueError, "cache_seqlens must be 1-D"),
        ("k_new_only", ValueError, "k_new and v_new must be given together"),
        ("v_new_only", ValueError, "k_new and v_new must be given together"),
        ("cos_only", ValueError, "rotary_cos and rotary_sin must be given together"),
        ("sin_only", ValueError, "rotary_cos and rotary_sin must be given together"),
        ("k_cache_batch", ValueError, r"k_cache must be \(B, Hkv, Lmax, D\) = \(2, Hkv, Lmax, 8\)"),
        ("k_cache_head_dim", ValueError, r"k_cache must be \(B, Hkv, Lmax, D\)"),
        (
            "v_cache_length",
            ValueError,
            r"v_cache \(B, Hkv, Lmax, Dv\), got \(2, 2, 16, 8\) and "
            r"\(2, 2, 17, 8\)",
        ),
        ("k_new_heads", ValueError, r"k_new/v_new must be \(B, Hkv, Lnew, D/Dv\) = \(2, 2, Lnew"),
        ("v_new_length", ValueError, r"k_new/v_new must be \(B, Hkv, Lnew, D/Dv\)"),
        (
            "new_dtype",
            TypeError,
            "k_new and v_new must have q's dtype torch.float32, got "
            "torch.float32 and torch.float64",
        ),
        ("heads", ValueError, r"q's heads \(4\) must be a multiple of the caches' \(3\)"),
        ("head_dim", ValueError, r"head dims must be in \[1, 256\], got 320 and 8"),
        ("cache_dtype", TypeError, "q, k_cache and v_cache must have the same dtype"),
        ("q_3d", ValueError, "q must be 4-D"),
        ("int_cache", TypeError, "k_cache must be float32, float16, bfloat16 or float64"),
        ("alibi_shape", ValueError, r"alibi_slopes must be \(Hq,\) or \(B, Hq\), got \(3,\)"),
        ("rotary_rows", (ValueError, RuntimeError), "positions reach 16 but cos/sin has 16 rows"),
        ("rotary_width", ValueError, r"rotary_dim must be even and in \[2, 8\]"),
        ("causal", ValueError, "causal must be False, True, 'top_left' or 'bottom_right'"),
        ("window", ValueError, "window must be None or"),
    ],
)
@pytest.mark.parametrize("backend_name", [None, "triton"], ids=["default", "triton"])
def test_bad_inputs(backend_name, case, error, match):
    """The same errors on the default backend and on triton (which checks the rotary tables
    itself, as it rotates inside its kernels), before anything is appended."""
    if backend_name == "triton" and kvcache_device("triton").type != "cpu":
        pytest.skip("these inputs are CPU tensors, which triton runs only under the interpreter")
    B, H, Lmax, D = 2, 2, 16, 8
    g = torch.Generator().manual_seed(5)
    q = torch.randn(B, 4, 2, D, generator=g)
    k_cache = torch.randn(B, H, Lmax, D, generator=g)
    v_cache = torch.randn(B, H, Lmax, D, generator=g)
    k_new = torch.randn(B, H, 2, D, generator=g)
    v_new = torch.randn(B, H, 2, D, generator=g)
    seqlens = torch.tensor([3, 14], dtype=torch.int32)
    cos, sin = rotary_tables(Lmax, D, F32, "cpu")
    kw = dict(k_new=k_new, v_new=v_new, rotary_cos=cos, rotary_sin=sin)
    if case == "too_small":
        seqlens = torch.tensor([3, 15], dtype=torch.int32)
    elif case == "too_small_one_row":
        seqlens = torch.tensor([15, 0], dtype=torch.int32)
    elif case == "negative":
        seqlens = torch.tensor([-1, 3], dtype=torch.int32)
    elif case == "seqlens_int64":
        seqlens = seqlens.long()
    elif case == "seqlens_length":
        seqlens = torch.tensor([3, 4, 5], dtype=torch.int32)
    elif case == "seqlens_2d":
        seqlens = seqlens.view(2, 1)
    elif case == "k_new_only":
        kw["v_new"] = None
    elif case == "v_new_only":
        kw["k_new"] = None
    elif case == "cos_only":
        kw["rotary_sin"] = None
    elif case == "sin_only":
        kw["rotary_cos"] = None
    elif case == "k_cache_batch":
        k_cache = torch.randn(3, H, Lmax, D)
    elif case == "k_cache_head_dim":
        k_cache = torch.randn(B, H, Lmax, D + 1)
    elif case == "v_cache_length":
        v_cache = torch.randn(B, H, Lmax + 1, D)
    elif case == "k_new_heads":
        kw["k_new"] = torch.randn(B, 1, 2, D)
    elif case == "v_new_length":
        kw["v_new"] = torch.randn(B, H, 3, D)
    elif case == "new_dtype":
        kw["v_new"] = v_new.double()
    elif case == "heads":
        k_cache, v_cache = torch.randn(B, 3, Lmax, D), torch.randn(B, 3, Lmax, D)
    elif case == "head_dim":
        q, k_cache = torch.randn(B, 4, 2, 320), torch.randn(B, H, Lmax, 320)
    elif case == "cache_dtype":
        v_cache = v_cache.double()
    elif case == "q_3d":
        q = q[0]
    elif case == "int_cache":
        k_cache = k_cache.to(torch.int32)
    elif case == "alibi_shape":
        kw["alibi_slopes"] = torch.rand(3)
    elif case == "rotary_rows":
        kw.update(k_new=None, v_new=None)  # nothing appended: the queries sit at 14, 15, 16
        q = torch.randn(B, 4, 3, D)
    elif case == "rotary_width":
        kw["rotary_cos"], kw["rotary_sin"] = rotary_tables(Lmax, 2 * D, F32, "cpu")
    elif case == "causal":
        kw["causal"] = "top-left"
    elif case == "window":
        kw["window"] = (2, -3)
    k_before = k_cache.clone()
    v_before = v_cache.clone()
    seqlens_before = seqlens.clone()
    with pytest.raises(error, match=match):
        fastattn.attention_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=seqlens, backend=backend_name, **kw
        )
    assert torch.equal(k_cache, k_before) and torch.equal(v_cache, v_before), (
        "a refused call must not append anything"
    )
    assert torch.equal(seqlens, seqlens_before)


# ---------------------------------------------------------------------------------------------
# No host synchronisation: CUDA values are checked on the device (fastattn/ops/_common.py)


@pytest.mark.parametrize("backend_name", ["cuda", "triton"])
@pytest.mark.parametrize("rotary", [None, "neox"], ids=["norotary", "rotary"])
def test_no_host_reads_for_cuda_tensors(backend_name, rotary):
    """A decoding step on CUDA tensors (fake ones: no GPU needed) reads no value on the host
    (no .item()/.tolist()/nonzero/copy to the CPU): it could be captured in a CUDA graph. The
    triton backend's values are still checked, asynchronously (the cuda op checks them in C++,
    test_cuda_bad_cache_seqlens_fail_on_the_device)."""
    with fake_cuda(backend_name) as recorder:
        d = make_decode(Lq=1, Lnew=1, rotary=rotary, dtype=F16, device="cuda")
        out = d.call(backend_name)
        assert out.shape == (*d.q.shape[:3], d.v_cache.shape[3]) and out.device.type == "cuda"
    assert fastattn.last_backend("attention_with_kvcache") == backend_name
    assert_no_host_reads(recorder)
    if backend_name == "triton":
        assert device_checks(recorder) >= (2 if rotary else 1)


def test_host_checks_switch_reads_cuda_values(monkeypatch):
    """FASTATTN_HOST_CHECKS=1 restores the eager host checks for CUDA tensors (a fake tensor
    has no value to read, so the read raises here)."""
    monkeypatch.setenv("FASTATTN_HOST_CHECKS", "1")
    with pytest.raises(ValueReadError), fake_cuda() as recorder:
        make_decode(Lq=1, Lnew=1, dtype=F16, device="cuda").call("triton")
    assert any("_local_scalar_dense" in r for r in recorder.reads)


@pytest.mark.parametrize("backend_name", ["reference", "triton"])
@pytest.mark.parametrize(
    "case,match",
    [
        ("too_small", r"cache_seqlens must be in \[0, Lmax - Lnew\] = \[0, 14\]"),
        ("negative", r"cache_seqlens must be in \[0, Lmax - Lnew\]"),
        ("rotary_rows", r"positions offset \+ offsets\[b\] \+ l \(l < 2\) must be in \[0, 12\)"),
    ],
)
def test_device_checks_catch_bad_values(monkeypatch, backend_name, case, match):
    """The rules checked on the device for CUDA tensors, run on CPU tensors through the same
    code (torch._assert_async raises at once on the CPU), before anything is appended."""
    device = kvcache_device(backend_name)
    if device.type != "cpu":
        pytest.skip("the device-side rules are run on CPU tensors here")
    force_device_checks(monkeypatch)
    d = make_decode(B=2, Lmax=16, Lq=2, Lnew=2, cache_lens=[3, 14], rotary="neox", dtype=F32)
    if case == "too_small":
        d.cache_seqlens = torch.tensor([3, 15], dtype=torch.int32)
    elif case == "negative":
        d.cache_seqlens = torch.tensor([-1, 3], dtype=torch.int32)
    else:
        d.cos, d.sin = d.cos[:12], d.sin[:12]
        d.cache_seqlens = torch.tensor([3, 11], dtype=torch.int32)
    k_before, v_before = d.k_cache.clone(), d.v_cache.clone()
    with pytest.raises(RuntimeError, match=match):
        d.call(backend_name)
    assert torch.equal(d.k_cache, k_before) and torch.equal(d.v_cache, v_before)


# ---------------------------------------------------------------------------------------------
# CUDA kernel (csrc/attention_with_kvcache/attention_with_kvcache_cuda.cu; skip without a GPU).
# The backend-parametrised tests above run it in float32/float64; these add the tensor-core
# head-dim buckets in float16/bfloat16 and split-K.


def cuda_kvcache_device() -> torch.device:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return kvcache_device("cuda")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
@pytest.mark.parametrize(
    "D,Dv", [(64, 64), (128, 128), (256, 200), (40, 24)], ids=["d64", "d128", "d256", "d40-dv24"]
)
@pytest.mark.parametrize("lq", [1, 5])
@pytest.mark.parametrize("num_splits", [1, 3, 0])
def test_cuda_16bit_decode(num_splits, lq, D, Dv, dtype):
    """GQA decoding (and 5-token speculative steps) over caches of lengths 0, mid and full in
    the tensor-core kernels, with and without split-K, against the float64 definition."""
    device = cuda_kvcache_device()
    # No rotary: check_caches compares rotated 16-bit keys with a float64 rotation at float32
    # tolerances (the float32 tests above cover the rotary path on CUDA).
    d = make_decode(
        B=3, Hq=8, Hkv=2, Lmax=300, D=D, Dv=Dv, Lq=lq, Lnew=lq, dtype=dtype, device=device, seed=5
    )
    run_and_check("cuda", d, num_splits=num_splits)


@pytest.mark.parametrize("feature", [f for f, spec in KV_FEATURES.items() if "rotary" not in spec])
def test_cuda_16bit_features(feature):
    device = cuda_kvcache_device()
    spec = dict(KV_FEATURES[feature])
    kw = {
        n: x.to(device) if isinstance(x, torch.Tensor) else x for n, x in spec.pop("kw", {}).items()
    }
    d = make_decode(Lq=3, Lnew=3, dtype=torch.bfloat16, device=device, seed=6, kw=kw, **spec)
    run_and_check("cuda", d, num_splits=2)


def test_cuda_num_splits_agree():
    """Every split count gives the same result to float32 rounding of the partials."""
    device = cuda_kvcache_device()
    results = []
    for num_splits in (1, 2, 7, 0):
        d = make_decode(
            B=2, Lmax=300, Lq=1, Lnew=1, cache_lens=[299, 123], dtype=F32, device=device, seed=3
        )
        results.append(d.call("cuda", num_splits=num_splits))
    for other in results[1:]:
        torch.testing.assert_close(other, results[0], rtol=2e-5, atol=2e-6)


def test_cuda_decode_op_errors_name_the_argument():
    device = cuda_kvcache_device()
    d = make_decode(dtype=torch.float16, device=device)
    op = torch.ops.fastattn.attention_decode
    lens = d.cache_seqlens + 1
    rest = (None, 0.1, 0.0, 2, -1, -1, 0)
    with pytest.raises(RuntimeError, match="k_lengths and q must be on the same device"):
        op(d.q, d.k_cache, d.v_cache, lens.cpu(), d.cache_seqlens, *rest)
    with pytest.raises(RuntimeError, match="q_positions must be a contiguous int32"):
        op(d.q, d.k_cache, d.v_cache, lens, d.cache_seqlens.long(), *rest)


@pytest.mark.parametrize("backend_name", ["cuda", "triton"])
def test_cuda_graph_decode_step(backend_name):
    """One decoding step (rotary on q and k_new, append, split-K attention) captured in a CUDA
    graph and replayed with new tokens copied into its static inputs and cache_seqlens
    advanced in place: the same outputs and caches as eager calls. Capture fails on any host
    synchronisation (a host read of a device value) inside the step."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    device = kvcache_device(backend_name)
    B, Hq, Hkv, Lmax, D = 3, 8, 2, 160, 64
    g = torch.Generator().manual_seed(11)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=F16)

    k0, v0 = rand(B, Hkv, Lmax, D), rand(B, Hkv, Lmax, D)
    cos, sin = rotary_tables(Lmax, D, F16, device)
    lens0 = torch.tensor([0, 37, 120], dtype=torch.int32, device=device)
    # Static buffers of the graph, and the eager run's own caches and lengths.
    q, k_new, v_new = rand(B, Hq, 1, D), rand(B, Hkv, 1, D), rand(B, Hkv, 1, D)
    k_cache, v_cache, lens = k0.clone(), v0.clone(), lens0.clone()
    ek_cache, ev_cache, elens = k0.clone(), v0.clone(), lens0.clone()

    def step(q, k_new, v_new, k_cache, v_cache, lens):
        return fastattn.attention_with_kvcache(
            q,
            k_cache,
            v_cache,
            cache_seqlens=lens,
            k_new=k_new,
            v_new=v_new,
            rotary_cos=cos,
            rotary_sin=sin,
            backend=backend_name,
        )

    # Warm-up on a side stream (Triton compiles, allocator pools), as torch.cuda.graphs asks.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(q, k_new, v_new, k_cache, v_cache, lens)
    torch.cuda.current_stream().wait_stream(side)
    k_cache.copy_(k0)
    v_cache.copy_(v0)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(q, k_new, v_new, k_cache, v_cache, lens)
    for it in range(6):
        tokens = rand(B, Hq, 1, D), rand(B, Hkv, 1, D), rand(B, Hkv, 1, D)
        for static, new in zip((q, k_new, v_new), tokens):
            static.copy_(new)
        graph.replay()
        expected = step(*tokens, ek_cache, ev_cache, elens)
        torch.cuda.synchronize()
        # The same kernels on the same values: equal up to float16 rounding at most.
        torch.testing.assert_close(out, expected, msg=f"replay {it}")
        assert torch.equal(k_cache, ek_cache) and torch.equal(v_cache, ev_cache), f"replay {it}"
        lens += 1  # in place: the graph reads the new lengths
        elens += 1
    assert fastattn.last_backend("attention_with_kvcache") == backend_name


@pytest.mark.parametrize("backend_name", ["cuda", "triton"])
def test_cuda_bad_cache_seqlens_fail_on_the_device(backend_name):
    """A cache too small for the new tokens fails as a device-side assert (in a subprocess:
    the assert ends its CUDA context), with no host read before it."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    kvcache_device(backend_name)
    output = run_failing_cuda_script(f"""
        import torch, fastattn
        B, H, Lmax, D = 2, 2, 16, 8
        q = torch.randn(B, H, 2, D, device="cuda")
        k = torch.randn(B, H, Lmax, D, device="cuda")
        v = torch.randn(B, H, Lmax, D, device="cuda")
        new = torch.randn(B, H, 2, D, device="cuda")
        lens = torch.tensor([3, 15], dtype=torch.int32, device="cuda")
        fastattn.attention_with_kvcache(q, k, v, cache_seqlens=lens, k_new=new, v_new=new,
                                        backend={backend_name!r})
        torch.cuda.synchronize()
    """)
    if backend_name == "cuda":  # fastattn's check kernel prints the rule and the value
        assert "cache_seqlens must be in [0, Lmax - Lnew] = [0, 14]" in output, output


# ---------------------------------------------------------------------------------------------
# Limits: shared memory per device and sizes beyond the kernels' index types


@pytest.mark.parametrize("backend_name", ["cpu", "triton"])
def test_cache_longer_than_int32_indices_is_refused(backend_name):
    """A cache of 2**31 + 5 rows (a stride-0 expansion: no memory) is refused by the argument
    checks, naming the cache's length, before any kernel runs."""
    device = kvcache_device(backend_name)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 1, 8, generator=g).to(device)
    k_cache = torch.randn(1, 1, 1, 8, generator=g).to(device).expand(1, 1, 2**31 + 5, 8)
    v_cache = torch.randn(1, 1, 1, 8, generator=g).to(device).expand(1, 1, 2**31 + 5, 8)
    seqlens = torch.tensor([7], dtype=torch.int32, device=device)
    start = time.monotonic()
    with pytest.raises((ValueError, RuntimeError), match=r"length.* must be < 2(\*\*|\^)30"):
        fastattn.attention_with_kvcache(
            q, k_cache, v_cache, cache_seqlens=seqlens, backend=backend_name
        )
    assert time.monotonic() - start < 5.0, "the refusal came after the kernel ran"


def test_triton_decode_stages_follow_head_dim_and_shared_memory(monkeypatch):
    """Three pipeline stages up to head dim 128, two above; fewer on a device whose shared
    memory holds fewer; refused when one stage exceeds the device's whole limit."""
    pytest.importorskip("triton")
    import fastattn.triton as fa_triton
    from fastattn.triton.attention_with_kvcache import _stages

    cpu = torch.device("cpu")  # planned for fastattn.triton.ASSUMED_SHARED_MEMORY
    monkeypatch.setattr(fa_triton, "ASSUMED_SHARED_MEMORY", 232448)  # H100
    assert _stages(16, 64, 128, 128, 2, cpu) == 3
    assert _stages(16, 32, 256, 256, 2, cpu) == 2
    assert _stages(16, 16, 256, 256, 4, cpu) == 2
    monkeypatch.setattr(fa_triton, "ASSUMED_SHARED_MEMORY", 101376)  # sm_86/89/120
    assert _stages(16, 64, 128, 128, 2, cpu) == 2
    assert _stages(64, 16, 256, 256, 4, cpu) == 1
    monkeypatch.setattr(fa_triton, "ASSUMED_SHARED_MEMORY", 48 * 1024)
    with pytest.raises(ValueError, match="decode tiles .* need .* shared memory"):
        _stages(64, 16, 256, 256, 4, cpu)
