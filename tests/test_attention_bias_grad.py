"""Learned biases through the fused kernels: a float attn_mask that requires grad receives dS
(the gradient of the biased scores) summed over the mask's broadcast dims, from the cpu,
triton and cuda kernels (the automatic order on CUDA devices tries triton first;
backend="cuda" runs the CUDA dK/dV kernels, which add dS to the bias-shaped buffer). The cuda
cases skip without a GPU; tools/cuda_emu/run.py --only dbias runs the same kernels on the CPU
emulator (tests/test_cuda_emulator.py).

Every case is checked against the reference backend run in float64 under FlashAttention's rule
(tests/tolerance.py), with the reference in the input's dtype as the baseline, and asserts
that the kernel backend ran (`fastattn.last_backend`). Outputs are poisoned (conftest).
"""

from __future__ import annotations

import math

import pytest
import torch
from attention_floors import assert_gradient_close, delta_model
from conftest import backend_device, require_kernel
from tolerance import assert_fa_close, float32_floor

import fastattn

KERNELS = ("cpu", "triton", "cuda")


def kernel_device(backend: str) -> torch.device:
    require_kernel("attention_forward", backend)  # fails if the build lost it
    return backend_device(backend)


# (name, mask shape given (B, Hq, Lq, Lk) -> shape, attention keywords, B, Hq, Hkv, Lq, Lk)
CASES = [
    ("t5_shared_by_batch", lambda B, H, Q, K: (1, H, Q, K), {}, 3, 4, 4, 37, 53),
    ("pair_bias", lambda B, H, Q, K: (B, 1, Q, K), {}, 2, 4, 4, 37, 53),
    ("plain_LxL", lambda B, H, Q, K: (Q, K), {}, 2, 2, 2, 37, 53),
    ("full", lambda B, H, Q, K: (B, H, Q, K), {}, 2, 2, 2, 37, 53),
    ("gqa_t5", lambda B, H, Q, K: (1, H, Q, K), {}, 2, 4, 2, 37, 53),
    ("gqa_pair", lambda B, H, Q, K: (B, 1, Q, K), {}, 2, 6, 2, 37, 53),
    ("causal", lambda B, H, Q, K: (1, H, Q, K), {"causal": True}, 2, 2, 2, 53, 53),
    ("softcap", lambda B, H, Q, K: (1, H, Q, K), {"softcap": 2.0, "scale": 0.6}, 2, 2, 2, 37, 53),
    ("dropout", lambda B, H, Q, K: (1, H, Q, K), {"dropout_p": 0.2}, 2, 2, 2, 37, 53),
    ("key_bias", lambda B, H, Q, K: (B, 1, 1, K), {}, 2, 2, 2, 37, 53),
    ("query_bias", lambda B, H, Q, K: (B, H, Q, 1), {}, 2, 2, 2, 37, 53),
    ("multi_tile", lambda B, H, Q, K: (1, H, Q, K), {"causal": "bottom_right"}, 2, 2, 1, 150, 131),
    (
        "everything",
        lambda B, H, Q, K: (H, Q, K),
        {"causal": True, "softcap": 3.0, "dropout_p": 0.1, "window": (40, -1)},
        2,
        4,
        2,
        70,
        70,
    ),
]
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def make(case, dtype, device, D=32, seed=0):
    name, shape_of, kw, B, Hq, Hkv, Lq, Lk = case
    g = torch.Generator().manual_seed(seed + Lq * 31 + Lk + len(name))
    q = torch.randn(B, Hq, Lq, D, generator=g)
    k = torch.randn(B, Hkv, Lk, D, generator=g)
    v = torch.randn(B, Hkv, Lk, D, generator=g)
    mask_dtype = torch.float32 if dtype == torch.float32 else dtype
    bias = torch.randn(shape_of(B, Hq, Lq, Lk), generator=g)
    q, k, v = (t.to(dtype=dtype, device=device) for t in (q, k, v))
    return q, k, v, bias.to(dtype=mask_dtype, device=device), dict(kw)


def run(backend, q, k, v, bias, kw, grad_out, grad_lse=None, cast=None, seed=1234):
    """(out, dq, dk, dv, dbias) of `backend` on leaf copies (cast to `cast` if given):
    gradients of <out, grad_out> (+ <lse, grad_lse> when given)."""
    leaves = [t.detach().to(cast or t.dtype).requires_grad_() for t in (q, k, v, bias)]
    torch.manual_seed(seed)
    out, lse = fastattn.attention(
        *leaves[:3], attn_mask=leaves[3], backend=backend, return_lse=True, **kw
    )
    assert fastattn.last_backend("attention") == backend
    outputs, grads = [out], [grad_out.to(out.dtype)]
    if grad_lse is not None:
        outputs.append(lse)
        grads.append(grad_lse.to(lse.dtype))
    return (out.detach(), *torch.autograd.grad(outputs, leaves, grads))


def compare_bias_gradients(backend, case, dtype) -> dict:
    """Run `backend`, the float64 reference and the reference in the input's dtype (the
    rule's baseline) on `case` with gradients of out and lse (without the lse gradient, a bias
    broadcast over keys has a gradient of exactly 0 and only rounding would be compared).
    Returns {"got", "ref64", "low"} as (out, dq, dk, dv, dbias), the inputs and the extra
    floors of tests/attention_floors.py."""
    device = kernel_device(backend)
    q, k, v, bias, kw = make(case, dtype, device)
    g = torch.Generator().manual_seed(5)
    grad_out = torch.randn(q.shape[:3] + (v.shape[3],), generator=g).to(dtype).to(device)
    grad_lse = (0.5 * torch.randn(q.shape[:3], generator=g)).to(device)
    got = run(backend, q, k, v, bias, kw, grad_out, grad_lse)
    ref64 = run(
        "reference", q, k, v, bias, kw, grad_out.double(), grad_lse.double(), cast=torch.float64
    )
    low = run("reference", q, k, v, bias, kw, grad_out, grad_lse)
    model = delta_model(q, k, v, kw, grad_out, ref64[0], got[0], attn_mask=bias, grad_lse=grad_lse)
    return {"got": got, "ref64": ref64, "low": low, "inputs": (q, k, v, bias), "model": model}


def assert_bias_gradients_match(results: dict, tamper: dict | None = None) -> None:
    """FlashAttention's rule on compare_bias_gradients' results: out (2x), dq, dk, dv, d bias
    (3x), with the rule's floor plus the derived Delta residue (below 5% of each gradient's
    largest magnitude in 16-bit). tamper: {"dbias": factor, ...} scales the backend's
    gradients first (tests of this check: tests/test_check_teeth.py)."""
    got, ref64, low = results["got"], results["ref64"], results["low"]
    q, k, v, bias = results["inputs"]
    assert_fa_close("out", got[0], ref64[0], low[0], floor=float32_floor(ref64[0], q.dtype))
    for name, i, x in (("dq", 1, q), ("dk", 2, k), ("dv", 3, v), ("dbias", 4, bias)):
        assert got[i].dtype == x.dtype, name
        assert_gradient_close(name, got[i], ref64[i], low[i], results["model"], tamper)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("backend", KERNELS)
def test_bias_gradient_matches_reference(backend, case, dtype):
    if backend == "triton" and dtype != torch.float32 and case[0] not in ("t5_shared_by_batch",):
        pytest.skip("interpreter time: 16-bit triton runs the T5 case only")
    assert_bias_gradients_match(compare_bias_gradients(backend, case, dtype))


@pytest.mark.parametrize("backend", ("cpu", "cuda", "reference"))
def test_bias_gradcheck_float64(backend):
    """gradcheck in float64 of q, k, v and a (1, H, Lq, Lk) bias, with GQA, causal,
    softcap and dropout (the seed is fixed inside the function, so every call draws the same
    mask). cuda: the float64 SIMT kernels (GPU only)."""
    device = kernel_device(backend) if backend != "reference" else torch.device("cpu")
    g = torch.Generator().manual_seed(3)
    B, Hq, Hkv, Lq, Lk, D = 2, 4, 2, 5, 7, 4
    q = torch.randn(B, Hq, Lq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, Lk, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, Lk, D, generator=g, dtype=torch.float64)
    for bias_shape in ((1, Hq, Lq, Lk), (B, 1, Lq, Lk), (Lq, Lk)):
        bias = torch.randn(bias_shape, generator=g, dtype=torch.float64)
        leaves = [t.to(device).requires_grad_() for t in (q, k, v, bias)]

        def f(q, k, v, bias):
            torch.manual_seed(7)
            return fastattn.attention(
                q,
                k,
                v,
                attn_mask=bias,
                causal="bottom_right",
                softcap=2.0,
                dropout_p=0.2,
                backend=backend,
            )

        assert torch.autograd.gradcheck(f, leaves, eps=1e-6, atol=1e-8, rtol=1e-6)
        assert fastattn.last_backend("attention") == backend


@pytest.mark.parametrize("backend", KERNELS)
def test_bias_gradient_is_bitwise_reproducible(backend):
    device = kernel_device(backend)
    case = CASES[0]  # (1, H, Lq, Lk) shared by the batch: summed over B
    q, k, v, bias, kw = make(case, torch.float32, device)
    grad_out = torch.randn(q.shape[:3] + (v.shape[3],)).to(device)
    first = run(backend, q, k, v, bias, {**kw, "deterministic": True}, grad_out)
    again = run(backend, q, k, v, bias, {**kw, "deterministic": True}, grad_out)
    for a, b in zip(first, again):
        assert torch.equal(a, b)


def test_triton_atomic_bias_gradient_matches_the_deterministic_one():
    """The triton backward op with deterministic=False adds a batch-shared bias's gradient
    atomically from every (batch, head) program; it equals the deterministic sum up to the
    order of the float additions."""
    device = kernel_device("triton")
    q, k, v, bias, kw = make(CASES[5], torch.float32, device)  # (B, 1, L, L), GQA
    mask = bias[:, None] if bias.dim() == 3 else bias
    scale = 1.0 / math.sqrt(q.shape[-1])
    out, lse = torch.ops.fastattn.attention_forward_triton(
        q, k, v, mask, None, None, scale, 0.0, -(1 << 30), 1 << 30, 0.0, None
    )
    grad_out = torch.randn_like(out)
    common = (grad_out, None, q, k, v, out, lse, mask, None, None, scale, 0.0)
    band = (-(1 << 30), 1 << 30, 0.0, None)
    det = torch.ops.fastattn.attention_backward_triton(*common, *band, True, True)
    atomic = torch.ops.fastattn.attention_backward_triton(*common, *band, False, True)
    assert det[3].shape == mask.shape
    for a, b in zip(det, atomic):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("shape_case", (0, 1, 2, 5, 9), ids=lambda i: CASES[i][0])
def test_cuda_atomic_bias_gradient_matches_the_deterministic_one(shape_case):
    """The cuda backward op with deterministic=False adds a bias broadcast over batches or kv
    heads atomically from every block; deterministic=True walks them in one block per key tile
    (bitwise reproducible). Both equal up to the order of the float additions (GPU only)."""
    device = kernel_device("cuda")
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v, bias, kw = make(CASES[shape_case], dtype, device)
        mask = bias[(None,) * (4 - bias.dim())]
        scale = 1.0 / math.sqrt(q.shape[-1])
        fwd_args = (q, k, v, mask, None, None, scale, 0.0, -(1 << 30), 1 << 30, 0.0, None)
        out, lse = torch.ops.fastattn.attention_forward(*fwd_args)
        grad_out = torch.randn_like(out)
        common = (grad_out, None, q, k, v, out, lse, mask, None, None, scale, 0.0)
        band = (-(1 << 30), 1 << 30, 0.0, None)
        det = torch.ops.fastattn.attention_backward(*common, *band, True, True)
        again = torch.ops.fastattn.attention_backward(*common, *band, True, True)
        atomic = torch.ops.fastattn.attention_backward(*common, *band, False, True)
        assert det[3].shape == mask.shape and det[3].dtype == mask.dtype
        assert all(torch.equal(a, b) for a, b in zip(det, again))
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        for a, b in zip(det, atomic):
            torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


def test_bias_gradient_on_the_cuda_backend_and_the_automatic_order():
    """backend="cuda" runs a learned bias's gradient on the CUDA kernels (GPU); the automatic
    order keeps trying triton first on CUDA tensors and picks cpu on CPU tensors."""
    device = kernel_device("cpu")
    q, k, v, bias, kw = make(CASES[0], torch.float32, device)
    if fastattn.available_backends()["cuda"] == "available":
        q, k, v, bias = (t.cuda() for t in (q, k, v, bias))
    bias.requires_grad_()
    if q.is_cuda:
        out = fastattn.attention(q, k, v, attn_mask=bias, backend="cuda")
        assert fastattn.last_backend("attention") == "cuda"
        (grad,) = torch.autograd.grad(out.sum(), bias)
        assert grad.shape == bias.shape
    # automatic choice: a kernel backend, not the reference
    fastattn.attention(q, k, v, attn_mask=bias)
    want = "cpu"
    if q.is_cuda:
        want = "triton" if fastattn.available_backends()["triton"] == "available" else "cuda"
    assert fastattn.last_backend("attention") == want


def test_alibi_slopes_gradient_stays_on_the_reference_backend():
    device = kernel_device("cpu")
    q, k, v, bias, kw = make(CASES[0], torch.float32, device)
    slopes = torch.rand(q.shape[1], requires_grad=True)
    with pytest.raises(RuntimeError, match="alibi_slopes"):
        fastattn.attention(q, k, v, alibi_slopes=slopes, backend="cpu")
    fastattn.attention(q, k, v, alibi_slopes=slopes)
    assert fastattn.last_backend("attention") == "reference"


def test_bias_without_grad_and_bool_masks_are_unchanged():
    """A 2-D float mask without grad and a bool mask broadcast from (B, 1, 1, Lk) give the
    reference's results on the kernel backend (the mask now reaches the kernels unexpanded)."""
    device = kernel_device("cpu")
    q, k, v, bias, kw = make(CASES[2], torch.float32, device)
    keep = torch.rand(q.shape[0], 1, 1, k.shape[2]) > 0.3
    for mask in (bias, keep):
        out = fastattn.attention(q, k, v, attn_mask=mask, backend="cpu")
        ref = fastattn.attention(q, k, v, attn_mask=mask, backend="reference")
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", KERNELS)
def test_opcheck_forward_and_backward_with_a_bias_gradient(backend):
    """The ops with a 4-D unexpanded float mask that requires grad: fakes, autograd
    registration and the backward's fourth output (mask_grad=True) agree with the kernels."""
    device = kernel_device(backend)
    suffix = "_triton" if backend == "triton" else ""
    fwd = getattr(torch.ops.fastattn, "attention_forward" + suffix)
    bwd = getattr(torch.ops.fastattn, "attention_backward" + suffix)
    q, k, v, bias, _ = make(CASES[4], torch.float32, device)  # GQA, (1, H, L, L)
    args = [q, k, v, bias, None, None, 0.3, 0.0, -(1 << 30), 1 << 30, 0.0, None]
    for t in (q, k, v, bias):
        t.requires_grad_()
    torch.library.opcheck(fwd.default, args)
    out, lse = fwd(*args)
    grad_out = torch.randn_like(out)
    detached = [t.detach() if isinstance(t, torch.Tensor) else t for t in args]
    full = [grad_out, None, *detached[:3], out.detach(), lse.detach(), *detached[3:], True, True]
    torch.library.opcheck(bwd.default, full)
    dq, dk, dv, dbias = bwd(*full)
    assert dbias.shape == bias.shape and dbias.dtype == bias.dtype
    without = bwd(*full[:-1], False)
    assert without[3].numel() == 0
