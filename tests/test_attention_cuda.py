"""CUDA-only tests of the attention kernels of the "cuda" backend (csrc/attention/*cuda*).

tests/test_attention.py runs the feature grid on every backend; this file targets what is
specific to the CUDA kernels: the head-dim buckets (64/128/256) and their edges, D != Dv across
buckets, layouts that take the cp.async path or the scalar fallback (16-byte aligned rows, partial
16-byte chunks, unaligned rows, transposed (B, L, H, D) inputs, stride-0 views), GQA/MQA, fully
masked rows, lse, dropout masks identical to the CPU kernels for one seed, a bitwise
deterministic backward, no (Lq, Lk) allocation, streams and devices, and float64 gradcheck.

Correct means FlashAttention's rule against the float64 reference (tests/tolerance.py): error at
most 2x (outputs, lse) or 3x (gradients) the error of the reference run in the input's dtype,
plus a rounding floor. Every test skips with a reason when the cuda backend cannot run.
"""

from __future__ import annotations

import pytest
import torch
from attention_floors import assert_gradient_close, delta_model
from conftest import backend_device, require_kernel
from tolerance import assert_fa_close, assert_grad_close, rounding_floor

import fastattn
from fastattn.reference.random import dropout_keep_mask

UNBOUNDED = 1 << 30


@pytest.fixture
def cuda() -> torch.device:
    require_kernel("attention_forward", "cuda")  # fails if a CUDA build lost it
    return backend_device("cuda")  # skips with the reason when the backend is unavailable


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(g, *shape, dtype, device, layout="bhld"):
    """(B, H, L, D) random tensor in one of the layouts the kernels branch on."""
    B, H, L, D = shape
    if layout == "blhd":  # a (B, L, H, D) tensor seen as (B, H, L, D)
        t = torch.randn(B, L, H, D, generator=g).transpose(1, 2)
    elif layout == "padded":  # rows 3 elements apart from the next: unaligned (scalar loads)
        t = torch.randn(B, H, L, D + 3, generator=g)[..., :D]
    elif layout == "padded8":  # 16-byte aligned rows, partial last 16-byte chunk
        t = torch.randn(B, H, L, (D + 7) // 8 * 8 + 8, generator=g)[..., :D]
    else:
        t = torch.randn(B, H, L, D, generator=g)
    return t.to(dtype=dtype, device=device)


def _floor(ref64, dtype, extra=0.0):
    """FlashAttention's rounding floor; for float32/float64 results also 16 ulps of the largest
    value (an accumulation in another order), plus `extra`."""
    floor = rounding_floor(ref64, dtype)
    if dtype in (torch.float32, torch.float64) and ref64.numel():
        floor += 16 * torch.finfo(dtype).eps * float(ref64.abs().max())
    return floor + extra


def _run(backend, q, k, v, kw, grad_out=None, grad_lse=None, cast=None, seed=1234):
    leaves = [t.detach().to(cast or t.dtype).requires_grad_() for t in (q, k, v)]
    torch.manual_seed(seed)
    out, lse = fastattn.attention(*leaves, return_lse=True, backend=backend, **kw)
    assert fastattn.last_backend("attention") == backend
    if grad_out is None:
        return out.detach(), lse.detach(), None
    outs, grads = [out], [grad_out.to(out.dtype)]
    if grad_lse is not None:
        outs.append(lse)
        grads.append(grad_lse.to(lse.dtype))
    return out.detach(), lse.detach(), torch.autograd.grad(outs, leaves, grads)


def _reference_on_same_seed(q, k, v, kw, grad_out, grad_lse, dtype):
    """The reference backend with the dropout seed the cuda call drew (same torch.manual_seed on
    the same device draws the same seed)."""
    return _run("reference", q, k, v, kw, grad_out, grad_lse, cast=dtype)


def check_cuda(q, k, v, kw, *, grads=True, lse_grad=True, seed=7):
    """cuda backend vs the float64 reference under FlashAttention's rule: out, lse, dq, dk, dv."""
    g = _gen(seed)
    B, Hq, Lq, _ = q.shape
    Dv = v.shape[3]
    grad_out = grad_lse = None
    if grads:
        grad_out = torch.randn(B, Hq, Lq, Dv, generator=g).to(q.dtype).to(q.device)
        if lse_grad:
            grad_lse = (0.5 * torch.randn(B, Hq, Lq, generator=g)).to(q.device)
    out, lse, gr = _run("cuda", q, k, v, kw, grad_out, grad_lse)
    o64, l64, g64 = _reference_on_same_seed(
        q,
        k,
        v,
        kw,
        None if grad_out is None else grad_out.double(),
        None if grad_lse is None else grad_lse.double(),
        torch.float64,
    )
    olow, llow, glow = _reference_on_same_seed(q, k, v, kw, grad_out, grad_lse, q.dtype)
    assert out.shape == (B, Hq, Lq, Dv) and out.dtype == q.dtype
    assert lse.shape == (B, Hq, Lq)
    assert lse.dtype == (torch.float64 if q.dtype == torch.float64 else torch.float32)
    assert_fa_close("out", out, o64, olow, floor=_floor(o64, out.dtype))
    empty = torch.isneginf(l64)
    assert not torch.isnan(lse).any(), "lse has NaN"
    assert torch.equal(torch.isneginf(lse), empty), "lse must be -inf exactly on empty rows"
    assert torch.all(out[empty] == 0), "rows without a visible key must give out 0"

    def finite(t):
        return t.masked_fill(torch.isneginf(t), 0.0)

    assert_fa_close(
        "lse", finite(lse), finite(l64), finite(llow), floor=_floor(finite(l64), torch.float32)
    )
    if grads:  # against the float64 gradient plus Delta's exact term (attention_floors.py)
        model = delta_model(q, k, v, kw, grad_out, o64, out, grad_lse=grad_lse)
        for name, got, r64, rlow, x in zip(("dq", "dk", "dv"), gr, g64, glow, (q, k, v)):
            assert got.shape == x.shape and got.dtype == x.dtype, name
            assert not torch.isnan(got).any(), f"{name} has NaN"
            assert_gradient_close(name, got, r64, rlow, model)
    return out, lse


DTYPES = [torch.bfloat16, torch.float16, torch.float32]
_DT = {torch.bfloat16: "bf16", torch.float16: "f16", torch.float32: "f32", torch.float64: "f64"}

# ---------------------------------------------------------------------------------------------
# Head-dim buckets and their edges (64 / 128 / 256 with zero-padded loads), D != Dv


HEAD_DIM_CASES = [
    (1, 1),
    (8, 8),
    (16, 40),
    (59, 59),
    (63, 64),
    (64, 64),
    (65, 65),
    (96, 32),
    (111, 111),
    (127, 128),
    (128, 128),
    (129, 129),
    (40, 200),
    (192, 192),
    (255, 256),
    (256, 256),
    (256, 1),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=[_DT[t] for t in DTYPES])
@pytest.mark.parametrize("D,Dv", HEAD_DIM_CASES, ids=[f"D{d}-Dv{e}" for d, e in HEAD_DIM_CASES])
def test_head_dims(cuda, dtype, D, Dv):
    g = _gen(D * 1000 + Dv)
    q = _randn(g, 2, 2, 113, D, dtype=dtype, device=cuda)
    k = _randn(g, 2, 2, 203, D, dtype=dtype, device=cuda)
    v = _randn(g, 2, 2, 203, Dv, dtype=dtype, device=cuda)
    check_cuda(q, k, v, {"causal": "bottom_right"})


# ---------------------------------------------------------------------------------------------
# Every feature on every dtype, with odd lengths (several key and query tiles per block)


def _feature_kwargs(feature, g, B, Hq, Lq, Lk, dtype, device):
    kw: dict = {}
    if feature == "causal":
        kw["causal"] = True
    if feature in ("causal_br", "everything"):
        kw["causal"] = "bottom_right"
    if feature == "window":
        kw["window"] = (37, 11)
    if feature == "bool_mask":
        kw["attn_mask"] = (torch.rand(B, 1, Lq, Lk, generator=g) > 0.3).to(device)
    if feature in ("float_mask", "everything"):
        kw["attn_mask"] = torch.randn(1, Hq, Lq, Lk, generator=g).to(dtype).to(device)
    if feature == "float32_mask":
        kw["attn_mask"] = torch.randn(Lq, Lk, generator=g).to(device)
    if feature in ("padding", "everything"):
        kw["key_padding_mask"] = (torch.rand(B, Lk, generator=g) > 0.7).to(device)
    if feature in ("alibi", "everything"):
        kw["alibi_slopes"] = (torch.rand(B, Hq, generator=g) * 0.3).to(device)
    if feature == "alibi_heads":
        kw["alibi_slopes"] = (torch.rand(Hq, generator=g) * 0.3).to(device)
    if feature in ("softcap", "everything"):
        kw["softcap"] = 2.5
        kw["scale"] = 0.5
    if feature in ("dropout", "everything"):
        kw["dropout_p"] = 0.17
    if feature == "scale":
        kw["scale"] = 0.37
    return kw


FEATURES = [
    "plain",
    "causal",
    "causal_br",
    "window",
    "bool_mask",
    "float_mask",
    "float32_mask",
    "padding",
    "alibi",
    "alibi_heads",
    "softcap",
    "dropout",
    "scale",
    "everything",
]


@pytest.mark.parametrize("dtype", DTYPES, ids=[_DT[t] for t in DTYPES])
@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("D", [64, 111, 256])
def test_features(cuda, feature, dtype, D):
    g = _gen(hash((feature, D)) % (1 << 31))
    B, Hq, Hkv, Lq, Lk = 2, 4, 2, 203, 317
    Dv = D if feature != "everything" else 40
    q = _randn(g, B, Hq, Lq, D, dtype=dtype, device=cuda)
    k = _randn(g, B, Hkv, Lk, D, dtype=dtype, device=cuda)
    v = _randn(g, B, Hkv, Lk, Dv, dtype=dtype, device=cuda)
    kw = _feature_kwargs(feature, g, B, Hq, Lq, Lk, dtype, cuda)
    check_cuda(q, k, v, kw)


@pytest.mark.parametrize(
    "Lq,Lk",
    [(1, 1), (1, 128), (128, 1), (1023, 1025), (1025, 1023), (64, 64), (65, 63), (2048, 37)],
)
@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
def test_lengths(cuda, Lq, Lk, causal):
    g = _gen(Lq * 7 + Lk)
    q = _randn(g, 1, 2, Lq, 64, dtype=torch.bfloat16, device=cuda)
    k = _randn(g, 1, 2, Lk, 64, dtype=torch.bfloat16, device=cuda)
    v = _randn(g, 1, 2, Lk, 64, dtype=torch.bfloat16, device=cuda)
    check_cuda(q, k, v, {"causal": causal})


# ---------------------------------------------------------------------------------------------
# GQA / MQA, layouts and strides


@pytest.mark.parametrize("dtype", DTYPES, ids=[_DT[t] for t in DTYPES])
@pytest.mark.parametrize("Hq,Hkv", [(8, 2), (6, 1), (3, 3)])
def test_gqa_mqa(cuda, dtype, Hq, Hkv):
    g = _gen(Hq * 10 + Hkv)
    q = _randn(g, 2, Hq, 150, 80, dtype=dtype, device=cuda)
    k = _randn(g, 2, Hkv, 170, 80, dtype=dtype, device=cuda)
    v = _randn(g, 2, Hkv, 170, 72, dtype=dtype, device=cuda)
    check_cuda(q, k, v, {"causal": True})


@pytest.mark.parametrize("dtype", DTYPES, ids=[_DT[t] for t in DTYPES])
@pytest.mark.parametrize("layout", ["blhd", "padded", "padded8"])
def test_layouts(cuda, dtype, layout):
    g = _gen(len(layout))
    D = 59 if layout != "blhd" else 64
    q = _randn(g, 2, 4, 130, D, dtype=dtype, device=cuda, layout=layout)
    k = _randn(g, 2, 2, 140, D, dtype=dtype, device=cuda, layout=layout)
    v = _randn(g, 2, 2, 140, D, dtype=dtype, device=cuda, layout=layout)
    out, _ = check_cuda(q, k, v, {"window": (40, 40)})
    if layout == "blhd":  # out follows q's layout: (B, Lq, Hq, Dv) in memory
        assert out.transpose(1, 2).is_contiguous()


def test_expanded_grad_out_and_masks(cuda):
    """Stride-0 views: a broadcast bool mask, (Hq,) ALiBi slopes and a grad_out whose outer
    strides are 0 (as d(sum_i out_i . w) gives)."""
    g = _gen(3)
    q = _randn(g, 2, 2, 77, 64, dtype=torch.bfloat16, device=cuda)
    k = _randn(g, 2, 2, 91, 64, dtype=torch.bfloat16, device=cuda)
    v = _randn(g, 2, 2, 91, 64, dtype=torch.bfloat16, device=cuda)
    mask = (torch.rand(91, generator=g) > 0.2).to(cuda)
    slopes = (torch.rand(2, generator=g) * 0.3).to(cuda)
    w = torch.randn(64, generator=g).to(cuda)
    grads = {}
    for name, backend, cast in (
        ("cuda", "cuda", None),
        ("ref64", "reference", torch.float64),
        ("low", "reference", None),
    ):
        leaves = [t.detach().to(cast or t.dtype).requires_grad_() for t in (q, k, v)]
        out = fastattn.attention(*leaves, attn_mask=mask, alibi_slopes=slopes, backend=backend)
        grad_out = w.to(out.dtype).expand(out.shape)
        assert grad_out.stride()[:3] == (0, 0, 0)
        grads[name] = torch.autograd.grad(out, leaves, grad_out)
    for name, got, r64, rlow in zip(
        ("dq", "dk", "dv"), grads["cuda"], grads["ref64"], grads["low"]
    ):
        assert_grad_close(name, got, r64, rlow)


# ---------------------------------------------------------------------------------------------
# Fully masked rows, lse


@pytest.mark.parametrize(
    "dtype", DTYPES + [torch.float64], ids=[_DT[t] for t in DTYPES + [torch.float64]]
)
def test_fully_masked_rows(cuda, dtype):
    g = _gen(11)
    B, H, Lq, Lk = 2, 2, 70, 90
    q = _randn(g, B, H, Lq, 32, dtype=dtype, device=cuda)
    k = _randn(g, B, H, Lk, 32, dtype=dtype, device=cuda)
    v = _randn(g, B, H, Lk, 32, dtype=dtype, device=cuda)
    mask = torch.rand(B, H, Lq, Lk, generator=g) > 0.5
    mask[:, :, ::5] = False  # every fifth query sees nothing
    padding = torch.zeros(B, Lk, dtype=torch.bool)
    padding[1] = True  # batch 1: every key is padding
    kw = {"attn_mask": mask.to(cuda), "key_padding_mask": padding.to(cuda)}
    out, lse = check_cuda(q, k, v, kw, lse_grad=False)
    assert torch.all(out[1] == 0) and torch.all(torch.isneginf(lse[1]))
    assert torch.all(torch.isneginf(lse[0, :, ::5]))


def test_lse_matches_logsumexp(cuda):
    g = _gen(5)
    q = _randn(g, 1, 3, 257, 128, dtype=torch.float16, device=cuda)
    k = _randn(g, 1, 3, 300, 128, dtype=torch.float16, device=cuda)
    v = _randn(g, 1, 3, 300, 128, dtype=torch.float16, device=cuda)
    _, lse = fastattn.attention(q, k, v, scale=0.2, return_lse=True, backend="cuda")
    s = torch.matmul(q.double(), k.double().transpose(-1, -2)) * 0.2
    assert lse.dtype == torch.float32
    # float32 sums of fp16 products: ~1e-5 here; log2 instead of log would be off by ~40 %
    torch.testing.assert_close(lse.double(), torch.logsumexp(s, dim=-1), rtol=0, atol=1e-4)


# ---------------------------------------------------------------------------------------------
# Dropout: the same mask as the CPU kernels (and the reference) for one seed


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_dropout_mask_equals_cpu(cuda, dtype):
    """With v the identity (Lk = Dv), out[b, h, i, j] = P_ij * keep_ij / (1 - p): its zero
    pattern is the dropout mask. The native ops take the seed explicitly, so the CUDA and CPU
    kernels get the same (seed, stream)."""
    g = _gen(17)
    B, H, Lq, Lk, p = 2, 3, 45, 67, 0.3
    q = torch.randn(B, H, Lq, 16, generator=g).to(dtype)
    k = torch.randn(B, H, Lk, 16, generator=g).to(dtype)
    v = torch.eye(Lk).expand(B, H, Lk, Lk).to(dtype).contiguous()
    seed = torch.tensor([987654321, 12345], dtype=torch.int64)
    args = (None, None, None, 0.25, 0.0, -UNBOUNDED, UNBOUNDED, p)
    out_cpu, lse_cpu = torch.ops.fastattn.attention_forward(q, k, v, *args, seed)
    out_gpu, lse_gpu = torch.ops.fastattn.attention_forward(
        q.to(cuda), k.to(cuda), v.to(cuda), *args, seed.to(cuda)
    )
    keep_gpu = (out_gpu != 0).cpu()
    assert torch.equal(keep_gpu, out_cpu != 0), "cuda and cpu drop different elements"
    assert torch.equal(keep_gpu, dropout_keep_mask(seed, (B, H, Lq, Lk), p))
    torch.testing.assert_close(lse_gpu.cpu(), lse_cpu, rtol=0, atol=1e-4)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out_gpu.cpu().float(), out_cpu.float(), rtol=tol, atol=tol)


def test_dropout_reproducible_under_manual_seed(cuda):
    g = _gen(19)
    q, k, v = (_randn(g, 1, 2, 99, 64, dtype=torch.bfloat16, device=cuda) for _ in range(3))
    outs = []
    for _ in range(2):
        torch.manual_seed(2024)
        outs.append(fastattn.attention(q, k, v, dropout_p=0.25, backend="cuda"))
    assert torch.equal(outs[0], outs[1])


# ---------------------------------------------------------------------------------------------
# Smaller-tile variants for GPUs with less shared memory per block (99 KB on sm_86/89/120,
# 163 KB on sm_80): FASTATTN_CUDA_SMEM_LIMIT caps the device's limit, so a large GPU runs them.

SMEM_LIMITS = [101376, 166912]
# bf16/f16 backward at buckets 128 and 256 (dQ single-buffered, dK/dV with 16-query steps),
# the float32/float64 D-split backward, the float64 forward with 2 rows per warp.
SMALL_TILE_CASES = [
    (torch.bfloat16, 128, 128),
    (torch.float16, 128, 100),
    (torch.bfloat16, 256, 256),
    (torch.float16, 256, 200),
    (torch.float32, 256, 256),
    (torch.float32, 190, 180),
    (torch.float64, 256, 256),
    (torch.float64, 100, 250),
]


@pytest.mark.parametrize("limit", SMEM_LIMITS)
@pytest.mark.parametrize(
    "dtype,D,Dv", SMALL_TILE_CASES, ids=[f"{_DT[t]}-D{d}-Dv{e}" for t, d, e in SMALL_TILE_CASES]
)
def test_small_shared_memory_variants(cuda, monkeypatch, limit, dtype, D, Dv):
    """Every case runs under the smaller limits, correct by the same rule; the smaller tiles sum
    in the same order as the large ones, so the results are also bitwise those of the uncapped
    run."""
    g = _gen(D * 7 + Dv)
    q = _randn(g, 2, 4, 131, D, dtype=dtype, device=cuda)
    k = _randn(g, 2, 2, 150, D, dtype=dtype, device=cuda)
    v = _randn(g, 2, 2, 150, Dv, dtype=dtype, device=cuda)
    kw = {"causal": "bottom_right", "dropout_p": 0.1, "softcap": 3.0}
    monkeypatch.setenv("FASTATTN_CUDA_SMEM_LIMIT", str(limit))
    check_cuda(q, k, v, kw)
    grad_out = torch.randn(2, 4, 131, Dv, generator=g).to(dtype).to(cuda)
    capped = _run("cuda", q, k, v, kw, grad_out, seed=3)
    monkeypatch.delenv("FASTATTN_CUDA_SMEM_LIMIT")
    full = _run("cuda", q, k, v, kw, grad_out, seed=3)
    for name, a, b in zip(
        ("out", "lse", "dq", "dk", "dv"), capped[:2] + tuple(capped[2]), full[:2] + tuple(full[2])
    ):
        assert torch.equal(a, b), f"{name}: the {limit}-byte variant differs from the full one"


@pytest.mark.parametrize(
    "dtype,D,Dv",
    [(torch.bfloat16, 256, 200), (torch.float64, 256, 240)],
    ids=["bf16-D256-Dv200", "f64-D256-Dv240"],
)
def test_small_shared_memory_varlen_and_decode(cuda, monkeypatch, dtype, D, Dv):
    """varlen_attention and attention_with_kvcache share the launchers: 99 KB gives the results
    of the uncapped run, bitwise."""
    g = _gen(D + Dv)
    lens = [0, 5, 70, 33]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=cuda)
    q = torch.randn(sum(lens), 4, D, generator=g).to(dtype).to(cuda).requires_grad_()
    k = torch.randn(sum(lens), 2, D, generator=g).to(dtype).to(cuda).requires_grad_()
    v = torch.randn(sum(lens), 2, Dv, generator=g).to(dtype).to(cuda).requires_grad_()
    grad_out = torch.randn(sum(lens), 4, Dv, generator=g).to(dtype).to(cuda)
    k_cache = torch.randn(3, 2, 96, D, generator=g).to(dtype).to(cuda)
    v_cache = torch.randn(3, 2, 96, Dv, generator=g).to(dtype).to(cuda)
    q_dec = torch.randn(3, 4, 2, D, generator=g).to(dtype).to(cuda)
    seqlens = torch.tensor([0, 9, 90], dtype=torch.int32, device=cuda)

    def run():
        out = fastattn.varlen_attention(
            q, k, v, cu, cu, max(lens), max(lens), causal=True, backend="cuda"
        )
        grads = torch.autograd.grad(out, (q, k, v), grad_out)
        dec = fastattn.attention_with_kvcache(
            q_dec, k_cache, v_cache, cache_seqlens=seqlens, backend="cuda"
        )
        return (out, *grads, dec)

    monkeypatch.setenv("FASTATTN_CUDA_SMEM_LIMIT", "101376")
    capped = run()
    monkeypatch.delenv("FASTATTN_CUDA_SMEM_LIMIT")
    full = run()
    for name, a, b in zip(("out", "dq", "dk", "dv", "decode"), capped, full):
        assert torch.equal(a, b), f"{name}: the 99 KB variant differs from the full one"


def test_smem_limit_must_be_a_number(cuda, monkeypatch):
    q = torch.randn(1, 1, 4, 8, device=cuda)
    monkeypatch.setenv("FASTATTN_CUDA_SMEM_LIMIT", "99KB")
    with pytest.raises(RuntimeError, match="FASTATTN_CUDA_SMEM_LIMIT"):
        fastattn.attention(q, q, q, backend="cuda")


# ---------------------------------------------------------------------------------------------
# Determinism, memory


@pytest.mark.parametrize("dtype", DTYPES, ids=[_DT[t] for t in DTYPES])
def test_backward_is_deterministic(cuda, dtype):
    g = _gen(23)
    q = _randn(g, 2, 8, 333, 128, dtype=dtype, device=cuda)
    k = _randn(g, 2, 2, 444, 128, dtype=dtype, device=cuda)
    v = _randn(g, 2, 2, 444, 128, dtype=dtype, device=cuda)
    grad_out = torch.randn(2, 8, 333, 128, generator=g).to(dtype).to(cuda)
    kw = {"causal": "bottom_right", "dropout_p": 0.1, "deterministic": True}
    first = _run("cuda", q, k, v, kw, grad_out, seed=5)[2]
    second = _run("cuda", q, k, v, kw, grad_out, seed=5)[2]
    for name, a, b in zip(("dq", "dk", "dv"), first, second):
        assert torch.equal(a, b), f"{name} differs between two identical backward runs"


def test_no_quadratic_memory(cuda):
    """Forward and backward at Lq = Lk = 8192 allocate nothing of size Lq * Lk."""
    L, H, D = 8192, 2, 64
    g = _gen(29)
    q, k, v = (
        _randn(g, 1, H, L, D, dtype=torch.bfloat16, device=cuda).requires_grad_() for _ in range(3)
    )
    grad_out = torch.randn(1, H, L, D, generator=g).to(torch.bfloat16).to(cuda)
    torch.cuda.synchronize(cuda)
    torch.cuda.reset_peak_memory_stats(cuda)
    base = torch.cuda.memory_allocated(cuda)
    out = fastattn.attention(q, k, v, causal=True, backend="cuda")
    torch.autograd.grad(out, (q, k, v), grad_out)
    torch.cuda.synchronize(cuda)
    peak = torch.cuda.max_memory_allocated(cuda) - base
    one_score_matrix = L * L * 2  # a single bf16 (Lq, Lk) tensor of one head
    print(
        f"peak extra memory {peak / 2**20:.1f} MiB; "
        f"one score matrix {one_score_matrix / 2**20:.0f} MiB"
    )
    assert peak < one_score_matrix // 4


# ---------------------------------------------------------------------------------------------
# Streams, devices, float64 gradcheck, registration


def test_current_stream(cuda):
    g = _gen(31)
    q, k, v = (_randn(g, 2, 2, 200, 64, dtype=torch.float16, device=cuda) for _ in range(3))
    expected = fastattn.attention(q, k, v, causal=True, backend="cuda")
    stream = torch.cuda.Stream(device=cuda)
    stream.wait_stream(torch.cuda.current_stream(cuda))
    with torch.cuda.stream(stream):
        q2, k2, v2 = (t * 1 for t in (q, k, v))  # produced on `stream`
        got = fastattn.attention(q2, k2, v2, causal=True, backend="cuda")
    torch.cuda.current_stream(cuda).wait_stream(stream)
    assert torch.equal(got, expected)


def test_second_device(cuda):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    g = _gen(37)
    q, k, v = (_randn(g, 1, 2, 100, 64, dtype=torch.bfloat16, device="cuda:1") for _ in range(3))
    with torch.cuda.device(0):
        out = fastattn.attention(q, k, v, backend="cuda")
    assert out.device == torch.device("cuda:1")
    ref = fastattn.attention(q.double(), k.double(), v.double(), backend="reference")
    assert (out.double() - ref).abs().max() < 2e-2


def test_float64_gradcheck(cuda):
    g = _gen(41)
    q = torch.randn(1, 2, 5, 3, generator=g, dtype=torch.float64).to(cuda).requires_grad_()
    k = torch.randn(1, 1, 7, 3, generator=g, dtype=torch.float64).to(cuda).requires_grad_()
    v = torch.randn(1, 1, 7, 4, generator=g, dtype=torch.float64).to(cuda).requires_grad_()
    mask = torch.randn(5, 7, generator=g, dtype=torch.float64).to(cuda)
    slopes = torch.rand(2, generator=g).to(cuda)

    def f(q, k, v):
        out, lse = fastattn.attention(
            q,
            k,
            v,
            causal="bottom_right",
            attn_mask=mask,
            alibi_slopes=slopes,
            softcap=1.5,
            return_lse=True,
            backend="cuda",
        )
        return out, lse

    assert torch.autograd.gradcheck(f, (q, k, v), eps=1e-6, atol=1e-6, rtol=1e-4)


def test_opcheck(cuda):
    g = _gen(43)
    q = _randn(g, 1, 2, 33, 64, dtype=torch.bfloat16, device=cuda)
    k = _randn(g, 1, 1, 40, 64, dtype=torch.bfloat16, device=cuda)
    v = _randn(g, 1, 1, 40, 48, dtype=torch.bfloat16, device=cuda)
    args = (q, k, v, None, None, None, 0.125, 0.0, -UNBOUNDED, 7, 0.0, None)
    torch.library.opcheck(torch.ops.fastattn.attention_forward.default, args)
