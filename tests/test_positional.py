"""Tests of the positional-encoding ops (fastattn/ops/positional.py) and their modules.

Every kernel backend (cpu, cuda, triton) is compared with the plain-PyTorch reference run in
float64, under FlashAttention's rule (tests/tolerance.py): the error of a backend may be at
most 2x (3x for gradients) the error of the reference run in the input's precision, plus a
rounding floor. The reference is never compared with itself: independent "textbook" checks
(math.sin, Hugging Face's rotate_half, the RoPE relative-position property, the sinusoid shift
matrices, x + PE with a float64 table), run on every backend the reference included, make sure
it computes what the literature defines (the Philox stream of the dropout: test_philox.py).
CUDA cases skip per test when no GPU is present; the triton backend runs CPU tensors under
Triton's interpreter (slow, so its shapes are small and float64, which it refuses, is
skipped).
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from conftest import backend_device
from host_reads import (
    ValueReadError,
    assert_no_device_sync,
    assert_no_host_reads,
    device_checks,
    fake_cuda,
    force_device_checks,
    run_failing_cuda_script,
)
from tolerance import assert_fa_close, assert_grad_close

import fastattn
from fastattn import _backend
from fastattn.nn import (
    LearnedPositionalEmbedding,
    PositionalEmbedding,
    RotaryEmbedding,
    SinusoidalPositionalEncoding,
)
from fastattn.reference import positional as positional_ref
from fastattn.reference import random as philox_ref

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
DTYPE_IDS = ("fp32", "fp16", "bf16", "fp64")
NATIVE_GRAD_BACKENDS = ("cpu", "cuda", "reference")  # the backends that take float64
# The backends compared with the reference (the reference itself: section 4's textbook checks)
KERNEL_BACKENDS = ("cpu", "cuda", "triton")
OPS = ("add_sinusoidal", "embed_with_positions", "apply_rotary")


def skip_triton_float64(backend: str, dtype: torch.dtype) -> None:
    if backend == "triton" and dtype == torch.float64:
        pytest.skip("the triton backend refuses float64 (test_triton_refuses_float64)")


def randn(*shape, dtype=torch.float32, device="cpu") -> torch.Tensor:
    """Standard normal values drawn in float64 on the CPU (same numbers on every device),
    rounded once to dtype."""
    return torch.randn(*shape, dtype=torch.float64).to(device=device, dtype=dtype)


def float64_floor(ref64: torch.Tensor, max_position: int = 0, factor: float = 16.0) -> float:
    """For float64 inputs the reference "in the input's precision" is ref64 itself, so the
    baseline is 0. Allow a few ulps of the result (sin/cos and exp2 implementations differ by
    an ulp, as do summation orders), scaled by the largest angle: a one-ulp difference in
    inv_freq = base^(-2i/d) (std::exp2 vs torch.exp2) moves the angle p * inv_freq, and so
    sin and cos, by about p ulps."""
    scale = 1.0 + float(ref64.abs().max()) if ref64.numel() else 1.0
    return factor * torch.finfo(torch.float64).eps * scale * (1.0 + max_position)


def compare_with_reference(
    name: str, fn, backend: str, inputs: dict, grads=(), *, max_position: int = 0, **fixed
):
    """Run fn(backend=..., **inputs, **fixed) on the kernel backend `backend`, and on the
    reference backend with the same inputs in float64 (ref64) and in their own precision
    (ref_lowp); compare the output and the gradients of the inputs named in `grads` under
    FlashAttention's rule.

    inputs: name -> floating tensor (or None); fixed: every other argument (ints, integer
    tensors, flags), passed unchanged. max_position: the largest position (float64 floor).
    Returns the backend's output.
    """
    assert backend != "reference", "the reference compared with itself proves nothing"
    runs = {}
    for label, be, wide in (
        ("out", backend, False),
        ("ref64", "reference", True),
        ("ref_lowp", "reference", False),
    ):
        args = {}
        for key, value in inputs.items():
            if value is not None:
                value = value.detach().to(torch.float64) if wide else value.detach().clone()
                value.requires_grad_(key in grads)
            args[key] = value
        runs[label] = (fn(backend=be, **args, **fixed), args)
        assert fastattn.last_backend(name) == be  # proves which kernel produced the result
    out, ref64, ref_lowp = (runs[k][0].detach() for k in ("out", "ref64", "ref_lowp"))
    assert out.dtype == ref_lowp.dtype and out.device == ref_lowp.device
    floor = float64_floor(ref64, max_position) if out.dtype == torch.float64 else None
    assert_fa_close(f"{name} [{backend}] output", out, ref64, ref_lowp, floor=floor)
    if grads:
        grad_out = randn(*out.shape, dtype=out.dtype, device=out.device)
        for y, _ in runs.values():
            y.backward(grad_out.to(y.dtype))
        for key in grads:
            g, g64, g_lowp = (runs[k][1][key].grad for k in ("out", "ref64", "ref_lowp"))
            assert g is not None, f"{name}: no gradient reached {key}"
            floor = float64_floor(g64, max_position) if g.dtype == torch.float64 else None
            assert_grad_close(f"{name} [{backend}] grad {key}", g, g64, g_lowp, floor=floor)
    return out


# ---------------------------------------------------------------------------------------------
# 1. Every backend against the float64 reference


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    "num_positions,dim,offset",
    [
        pytest.param(1, 1, 0, id="P1-D1"),
        pytest.param(5, 1, 3, id="D1-offset3"),
        pytest.param(17, 7, 0, id="oddD7"),
        pytest.param(64, 33, 5, id="D33-offset5"),
        pytest.param(1023, 8, 0, id="P1023"),
        pytest.param(50, 64, 4000, id="large-positions"),
    ],
)
def test_sinusoidal_table_matches_reference(backend, device, dtype, num_positions, dim, offset):
    skip_triton_float64(backend, dtype)
    kw = dict(offset=offset, device=device)
    out = fastattn.sinusoidal_table(num_positions, dim, dtype=dtype, backend=backend, **kw)
    assert fastattn.last_backend("sinusoidal_table") == backend
    ref64 = fastattn.sinusoidal_table(
        num_positions, dim, dtype=torch.float64, backend="reference", **kw
    )
    ref_lowp = fastattn.sinusoidal_table(num_positions, dim, dtype=dtype, backend="reference", **kw)
    assert out.shape == (num_positions, dim) and out.dtype == dtype
    floor = float64_floor(ref64, offset + num_positions) if dtype == torch.float64 else None
    assert_fa_close(f"sinusoidal_table [{backend}]", out, ref64, ref_lowp, floor=floor)


def test_sinusoidal_table_defaults_to_float32():
    table = fastattn.sinusoidal_table(4, 6)
    assert table.dtype == torch.float32 and table.device.type == "cpu"
    assert fastattn.sinusoidal_table(0, 6).shape == (0, 6)


def _offset_arg(kind, batch: int, device, high: int = 100):
    if isinstance(kind, int):
        return kind
    if kind == "tensor":
        return torch.randint(0, high, (batch,), device=device)
    if kind == "tensor-large":
        return torch.tensor([7, 5000], device=device)[:batch]
    raise AssertionError(kind)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    "shape,offset,scale,base",
    [
        pytest.param((2, 1, 8), 0, 1.0, 10000.0, id="L1"),
        pytest.param((3, 17, 7), 5, 2.0, 10000.0, id="oddD7-int-offset"),
        pytest.param((2, 64, 33), "tensor", math.sqrt(33), 10000.0, id="D33-tensor-offset"),
        pytest.param((1, 1023, 6), 0, 1.0, 10000.0, id="L1023"),
        pytest.param((2, 40, 64), "tensor-large", 1.0, 500.0, id="large-offsets-base500"),
        pytest.param((17, 16), 3, 0.5, 10000.0, id="unbatched-2d-seq_dim0"),
    ],
)
def test_add_sinusoidal_matches_reference(backend, device, dtype, shape, offset, scale, base):
    skip_triton_float64(backend, dtype)
    torch.manual_seed(0)
    x = randn(*shape, dtype=dtype, device=device)
    off = _offset_arg(offset, shape[0], device)
    seq_dim = 0 if len(shape) == 2 else 1  # an unbatched (L, D) x names its sequence dim

    def fn(x, backend):
        return fastattn.add_sinusoidal(
            x, offset=off, scale=scale, base=base, seq_dim=seq_dim, backend=backend
        )

    max_position = int(off.max()) if isinstance(off, torch.Tensor) else off
    out = compare_with_reference(
        "add_sinusoidal", fn, backend, {"x": x}, grads=("x",), max_position=max_position + shape[-2]
    )
    assert out.shape == x.shape


def _tokens(shape, num_embeddings, device, padding_idx=None):
    tokens = torch.randint(0, num_embeddings, shape, device=device)
    if padding_idx is not None:  # make sure the padding id occurs
        tokens.view(-1)[::3] = padding_idx
    return tokens


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    "tok_shape,num_embeddings,dim,max_len,offset,padding_idx,scale",
    [
        pytest.param((2, 1), 10, 8, None, 0, None, 1.0, id="L1-sinusoidal"),
        pytest.param((3, 17), 50, 7, 40, 3, 0, 2.0, id="oddD7-learned-pad0"),
        pytest.param(
            (2, 33), 20, 33, None, "tensor", 5, math.sqrt(33), id="D33-sin-tensor-off-pad"
        ),
        pytest.param((2, 16), 30, 16, 64, "tensor", None, 1.0, id="learned-tensor-offset"),
        pytest.param((19,), 12, 9, None, 2, None, 1.0, id="unbatched"),
        pytest.param((1, 1023), 64, 4, 1100, 5, None, 1.0, id="L1023-learned"),
    ],
)
def test_embed_with_positions_matches_reference(
    backend, device, dtype, tok_shape, num_embeddings, dim, max_len, offset, padding_idx, scale
):
    skip_triton_float64(backend, dtype)
    torch.manual_seed(0)
    tokens = _tokens(tok_shape, num_embeddings, device, padding_idx)
    weight = randn(num_embeddings, dim, dtype=dtype, device=device)
    batch = tok_shape[0] if len(tok_shape) == 2 else 1
    length = tok_shape[-1]
    inputs = {"weight": weight}
    if max_len is not None:
        inputs["positions"] = randn(max_len, dim, dtype=dtype, device=device)
    off = _offset_arg(offset, batch, device, high=(max_len or 200) - length + 1)

    def fn(weight, backend, positions="sinusoidal"):
        return fastattn.embed_with_positions(
            tokens,
            weight,
            positions=positions,
            scale=scale,
            offset=off,
            padding_idx=padding_idx,
            backend=backend,
        )

    max_position = (int(off.max()) if isinstance(off, torch.Tensor) else off) + length
    out = compare_with_reference(
        "embed_with_positions", fn, backend, inputs, grads=tuple(inputs), max_position=max_position
    )
    assert out.shape == (*tok_shape, dim)


def _rotary_tables(rows: int, rotary_dim: int, dtype, device, base=10000.0):
    """cos/sin (rows, rotary_dim/2) of pos * base^(-2i/rotary_dim), in float64, rounded."""
    inv = base ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angle = torch.arange(rows, dtype=torch.float64)[:, None] * inv
    return angle.cos().to(device, dtype), angle.sin().to(device, dtype)


ROTARY_CASES = [
    # (B, H, L, D), rotary_dim, interleaved, positions, tables
    pytest.param((1, 1, 1, 2), None, False, 0, False, id="L1-D2"),
    pytest.param((2, 3, 17, 8), None, True, 5, False, id="gptj-int-offset"),
    pytest.param((2, 2, 9, 7), 6, False, "tensor", False, id="oddD7-rd6-tensor-offset"),
    pytest.param((2, 2, 12, 33), 16, True, "tensor", True, id="D33-rd16-gptj-tables"),
    pytest.param((2, 4, 16, 64), 32, False, "position_ids", True, id="neox-position-ids-tables"),
    pytest.param((3, 2, 11, 16), None, False, "position_ids", False, id="position-ids-computed"),
    pytest.param((1, 2, 1023, 4), None, False, 3, False, id="L1023"),
]


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape,rotary_dim,interleaved,positions,tables", ROTARY_CASES)
def test_apply_rotary_matches_reference(
    backend, device, dtype, shape, rotary_dim, interleaved, positions, tables
):
    skip_triton_float64(backend, dtype)
    if backend == "triton" and shape[2] > 64:
        pytest.skip("one interpreted Triton program per (b, l): L=1023 is too slow on CPU")
    torch.manual_seed(0)
    B, H, L, D = shape
    x = randn(*shape, dtype=dtype, device=device)
    rd = rotary_dim or D
    rows = 2048
    inputs = {"x": x}
    if tables:
        inputs["cos"], inputs["sin"] = _rotary_tables(rows, rd, dtype, device)
    fixed = dict(interleaved=interleaved, rotary_dim=rotary_dim)
    if positions == "position_ids":
        fixed["position_ids"] = torch.randint(0, rows, (B, L), device=device)
    elif positions == "tensor":
        fixed["offset"] = torch.randint(0, 100, (B,), device=device)
    else:
        fixed["offset"] = positions

    def fn(x, backend, cos=None, sin=None, **kw):
        return fastattn.apply_rotary(x, cos=cos, sin=sin, backend=backend, **kw)

    out = compare_with_reference(
        "apply_rotary", fn, backend, inputs, grads=("x",), max_position=rows + L, **fixed
    )
    assert out.shape == x.shape
    if rd < D:  # the features past rotary_dim pass through bit for bit
        assert torch.equal(out[..., rd:], x[..., rd:])


@pytest.mark.parametrize("op", ("sinusoidal_table",) + OPS)
def test_triton_refuses_float64(op):
    device = backend_device("triton")  # skips when triton is unavailable
    x = randn(1, 2, 3, 4, dtype=torch.float64, device=device)
    calls = {
        "sinusoidal_table": lambda: fastattn.sinusoidal_table(
            3, 4, dtype=torch.float64, device=device, backend="triton"
        ),
        "add_sinusoidal": lambda: fastattn.add_sinusoidal(x[0], backend="triton"),
        "embed_with_positions": lambda: fastattn.embed_with_positions(
            torch.tensor([[0, 1]], device=device), x[0, 0], backend="triton"
        ),
        "apply_rotary": lambda: fastattn.apply_rotary(x, backend="triton"),
    }
    with pytest.raises(fastattn.BackendError, match="float64"):
        calls[op]()
    with fastattn.use_backend("triton"):
        with pytest.raises(fastattn.BackendError, match="triton"):
            calls[op]()


def test_float64_automatic_choice_on_cpu_is_cpu():
    out = fastattn.add_sinusoidal(randn(2, 3, 4, dtype=torch.float64))
    assert out.dtype == torch.float64
    assert fastattn.last_backend("add_sinusoidal") == "cpu"


# ---------------------------------------------------------------------------------------------
# 2. float64 gradcheck


@pytest.mark.parametrize("backend", NATIVE_GRAD_BACKENDS)
@pytest.mark.parametrize(
    "offset,scale,dropout_p",
    [
        pytest.param(0, 1.0, 0.0, id="plain"),
        pytest.param("tensor", 1.5, 0.0, id="tensor-offset-scale"),
        pytest.param(3, 2.0, 0.4, id="dropout"),
    ],
)
def test_add_sinusoidal_gradcheck(backend, device, offset, scale, dropout_p):
    torch.manual_seed(0)
    x = randn(2, 5, 7, dtype=torch.float64, device=device).requires_grad_()
    off = _offset_arg(offset, 2, device)

    def fn(x):
        torch.manual_seed(1234)  # the same dropout mask in every evaluation
        return fastattn.add_sinusoidal(
            x, offset=off, scale=scale, dropout_p=dropout_p, backend=backend
        )

    assert torch.autograd.gradcheck(fn, (x,))
    assert torch.autograd.gradgradcheck(fn, (x,))


@pytest.mark.parametrize("backend", NATIVE_GRAD_BACKENDS)
@pytest.mark.parametrize("learned", (False, True), ids=("sinusoidal", "learned"))
@pytest.mark.parametrize("offset", (2, "tensor"))
def test_embed_with_positions_gradcheck(backend, device, learned, offset):
    torch.manual_seed(0)
    # duplicates; no padding_idx here: its row's analytical gradient is zero by design (as in
    # F.embedding) while the numerical one is not (test_embed_padding_idx covers it)
    tokens = torch.tensor([[1, 3, 3, 0], [3, 6, 1, 1]], device=device)
    weight = randn(7, 5, dtype=torch.float64, device=device).requires_grad_()
    table = randn(12, 5, dtype=torch.float64, device=device).requires_grad_()
    off = _offset_arg(offset, 2, device, high=8)

    def fn(weight, table):
        return fastattn.embed_with_positions(
            tokens,
            weight,
            positions=table if learned else "sinusoidal",
            scale=1.7,
            offset=off,
            backend=backend,
        )

    assert torch.autograd.gradcheck(fn, (weight, table if learned else table.detach()))


@pytest.mark.parametrize("backend", NATIVE_GRAD_BACKENDS)
@pytest.mark.parametrize("interleaved", (False, True), ids=("neox", "gptj"))
@pytest.mark.parametrize(
    "variant", ("plain", "rotary_dim", "tables", "position_ids", "tensor-offset", "inplace")
)
def test_apply_rotary_gradcheck(backend, device, interleaved, variant):
    torch.manual_seed(0)
    B, H, L, D = 2, 2, 5, 8
    x = randn(B, H, L, D, dtype=torch.float64, device=device).requires_grad_()
    kw = dict(interleaved=interleaved, offset=3)
    if variant == "rotary_dim":
        kw["rotary_dim"] = 4
    elif variant == "tables":
        kw["cos"], kw["sin"] = _rotary_tables(16, 6, torch.float64, device)  # rotary_dim 6
    elif variant == "position_ids":
        kw["position_ids"] = torch.randint(0, 50, (B, L), device=device)
    elif variant == "tensor-offset":
        kw["offset"] = torch.tensor([4, 0], device=device)

    def fn(x):
        if variant == "inplace":
            return fastattn.apply_rotary(x.clone(), inplace=True, backend=backend, **kw)
        return fastattn.apply_rotary(x, backend=backend, **kw)

    assert torch.autograd.gradcheck(fn, (x,))
    assert torch.autograd.gradgradcheck(fn, (x,))


# ---------------------------------------------------------------------------------------------
# 3. Layouts, in-place, unbatched, padding, duplicates, determinism


def test_add_sinusoidal_seq_first(backend, device):
    """An (L, B, D) tensor with seq_dim=0 equals the batch-first result, transposed, keeps its
    layout, and back-propagates."""
    torch.manual_seed(0)
    L, B, D = 13, 3, 10
    x = randn(L, B, D, device=device).requires_grad_()
    out = fastattn.add_sinusoidal(x, seq_dim=0, scale=1.5, offset=2, backend=backend)
    assert out.shape == (L, B, D) and out.stride() == x.stride()
    table = fastattn.sinusoidal_table(L, D, offset=2, dtype=torch.float64)
    expected = x.detach().double().cpu() * 1.5 + table[:, None, :]
    torch.testing.assert_close(out.detach().double().cpu(), expected, rtol=0, atol=1e-5)
    batch_first = fastattn.add_sinusoidal(
        x.detach().transpose(0, 1), scale=1.5, offset=2, backend=backend
    )
    torch.testing.assert_close(out.detach(), batch_first.transpose(0, 1), rtol=0, atol=0)
    g = randn(L, B, D, device=device)
    out.backward(g)
    torch.testing.assert_close(x.grad, 1.5 * g, rtol=1e-6, atol=0)
    # per-sequence offsets index the batch dimension (dim 1 here)
    offs = torch.tensor([0, 7, 3], device=device)
    out = fastattn.add_sinusoidal(x.detach(), seq_dim=0, offset=offs, backend=backend)
    for b in range(B):
        pe = fastattn.sinusoidal_table(L, D, offset=int(offs[b]), dtype=torch.float64)
        torch.testing.assert_close(
            out[:, b].double().cpu(), x[:, b].detach().double().cpu() + pe, rtol=0, atol=1e-5
        )


@pytest.mark.parametrize("seq_dim", (2, -2))
def test_add_sinusoidal_4d_seq_dim(backend, device, seq_dim):
    """A (B, H, L, D) input with seq_dim=2: every (b, h) gets PE[offset + l]."""
    torch.manual_seed(0)
    B, H, L, D = 2, 3, 9, 8
    x = randn(B, H, L, D, device=device).requires_grad_()
    out = fastattn.add_sinusoidal(x, seq_dim=seq_dim, offset=4, backend=backend)
    table = fastattn.sinusoidal_table(L, D, offset=4, dtype=torch.float64)
    expected = x.detach().double().cpu() + table
    torch.testing.assert_close(out.detach().double().cpu(), expected, rtol=0, atol=1e-5)
    out.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))
    # seq_dim=1 of the same tensor: PE indexed by h instead
    out1 = fastattn.add_sinusoidal(x.detach(), seq_dim=1, backend=backend)
    pe_h = fastattn.sinusoidal_table(H, D, dtype=torch.float64)[None, :, None, :]
    torch.testing.assert_close(
        out1.double().cpu(), x.detach().double().cpu() + pe_h, rtol=0, atol=2e-6
    )
    # a tensor offset has one entry per (b, h) sequence
    offs = torch.arange(B * H, device=device) * 10
    out2 = fastattn.add_sinusoidal(x.detach(), seq_dim=seq_dim, offset=offs, backend=backend)
    for i in range(B * H):
        b, h = divmod(i, H)
        pe = fastattn.sinusoidal_table(L, D, offset=10 * i, dtype=torch.float64)
        torch.testing.assert_close(
            out2[b, h].double().cpu(), x[b, h].detach().double().cpu() + pe, rtol=0, atol=1e-5
        )


def test_add_sinusoidal_strided_rows(backend, device):
    """Rows with a gap between them (a slice of a wider tensor) are read through strides: x + PE
    with a float64 table (the formula, test_sinusoidal_table_formula), rounded to float32."""
    torch.manual_seed(0)
    wide = randn(3, 11, 20, device=device)
    x = wide[:, 1:, 3:15]
    assert not x.is_contiguous() and x.stride(-1) == 1
    out = fastattn.add_sinusoidal(x, backend=backend)
    table = fastattn.sinusoidal_table(10, 12, dtype=torch.float64, backend="cpu")
    expected = x.double().cpu() + table
    torch.testing.assert_close(out.double().cpu(), expected, rtol=0, atol=1e-6)


def test_apply_rotary_transposed_input(backend, device):
    """(B, L, H, D) storage passed as x.transpose(1, 2): same values and gradients as a
    contiguous (B, H, L, D) copy; in place rotation writes through the view."""
    torch.manual_seed(0)
    B, L, H, D = 2, 7, 3, 16
    blhd = randn(B, L, H, D, device=device)
    x = blhd.transpose(1, 2).requires_grad_()
    assert x.stride(-1) == 1 and not x.is_contiguous()
    xc = x.detach().contiguous().requires_grad_()
    kw = dict(offset=torch.tensor([3, 0], device=device), rotary_dim=12, backend=backend)
    out, outc = fastattn.apply_rotary(x, **kw), fastattn.apply_rotary(xc, **kw)
    torch.testing.assert_close(out, outc, rtol=0, atol=0)
    g = randn(B, H, L, D, device=device)
    out.backward(g)
    outc.backward(g)
    torch.testing.assert_close(x.grad, xc.grad, rtol=0, atol=0)
    storage = blhd.clone()
    view = storage.transpose(1, 2)
    result = fastattn.apply_rotary(view, inplace=True, **kw)
    assert result.data_ptr() == storage.data_ptr()
    torch.testing.assert_close(storage.transpose(1, 2), outc.detach(), rtol=0, atol=0)


@pytest.mark.parametrize("interleaved", (False, True), ids=("neox", "gptj"))
def test_apply_rotary_inplace_without_grad(backend, device, interleaved):
    torch.manual_seed(0)
    x = randn(2, 3, 8, 10, device=device)
    kw = dict(interleaved=interleaved, rotary_dim=6, offset=5, backend=backend)
    expected = fastattn.apply_rotary(x, **kw)
    y = x.clone()
    ptr = y.data_ptr()
    result = fastattn.apply_rotary(y, inplace=True, **kw)
    assert result is y and y.data_ptr() == ptr
    torch.testing.assert_close(y, expected, rtol=0, atol=0)
    with torch.no_grad():  # also fine on a leaf that requires grad when grad mode is off
        leaf = x.clone().requires_grad_()
        fastattn.apply_rotary(leaf, inplace=True, **kw)
    torch.testing.assert_close(leaf.detach(), expected, rtol=0, atol=0)


@pytest.mark.parametrize("interleaved", (False, True), ids=("neox", "gptj"))
def test_apply_rotary_inplace_with_grad(backend, device, interleaved):
    """inplace=True on a non-leaf that needs gradients: the gradient of the leaf equals the
    out-of-place gradient (the backward rotates the incoming gradient back)."""
    torch.manual_seed(0)
    kw = dict(interleaved=interleaved, offset=torch.tensor([1, 9], device=device), backend=backend)
    leaf = randn(2, 2, 6, 8, device=device).requires_grad_()
    ref_leaf = leaf.detach().clone().requires_grad_()
    x = leaf * 2.0
    y = fastattn.apply_rotary(x, inplace=True, **kw)
    assert y is x
    y_ref = fastattn.apply_rotary(ref_leaf * 2.0, **kw)
    torch.testing.assert_close(y.detach(), y_ref.detach(), rtol=0, atol=0)
    g = randn(*y.shape, device=device)
    (y * g).sum().backward()
    (y_ref * g).sum().backward()
    torch.testing.assert_close(leaf.grad, ref_leaf.grad, rtol=1e-6, atol=1e-6)
    assert leaf.grad.abs().sum() > 0


def test_apply_rotary_inplace_on_leaf_requiring_grad_raises(backend, device):
    x = randn(1, 1, 4, 4, device=device).requires_grad_()
    with pytest.raises(RuntimeError, match="leaf"):
        fastattn.apply_rotary(x, inplace=True, backend=backend)


@pytest.mark.parametrize("layout", ("batch_first", "seq_first", "4d_view", "4d_copy"))
@pytest.mark.parametrize("dropout_p", (0.0, 0.3))
def test_add_sinusoidal_inplace_matches_out_of_place(backend, device, layout, dropout_p):
    """inplace=True writes the out-of-place result (same dropout mask under the same seed) into
    x and returns x, for every layout: a (B, L, D) tensor, a sequence-first (L, B, D) one (a
    transposed view), a 4-D x whose sequence dim moves to a view, and a 4-D x whose (N, L, D)
    form is a copy (the result is copied back)."""
    shapes = {
        "batch_first": ((3, 7, 10), 1),
        "seq_first": ((7, 3, 10), 0),
        "4d_view": ((2, 3, 7, 10), 2),
        "4d_copy": ((2, 7, 3, 10), 1),
    }
    shape, seq_dim = shapes[layout]
    x = randn(*shape, device=device)
    batch = 3 if layout in ("batch_first", "seq_first") else 6
    kw = dict(
        scale=1.5,
        seq_dim=seq_dim,
        dropout_p=dropout_p,
        backend=backend,
        offset=torch.arange(batch, device=device) * 5,
    )
    torch.manual_seed(7)
    expected = fastattn.add_sinusoidal(x, **kw)
    y = x.clone()
    ptr = y.data_ptr()
    torch.manual_seed(7)
    result = fastattn.add_sinusoidal(y, inplace=True, **kw)
    assert result is y and y.data_ptr() == ptr
    torch.testing.assert_close(y, expected, rtol=0, atol=0)


@pytest.mark.parametrize("dropout_p", (0.0, 0.3))
def test_add_sinusoidal_inplace_with_grad(backend, device, dropout_p):
    """inplace=True on a non-leaf that needs gradients: output and the leaf's gradient equal
    the out-of-place ones (the backward scales and applies the forward's mask)."""
    leaf = randn(2, 6, 8, device=device).requires_grad_()
    ref_leaf = leaf.detach().clone().requires_grad_()
    kw = dict(scale=0.5, offset=3, dropout_p=dropout_p, backend=backend)
    x = leaf * 2.0
    torch.manual_seed(11)
    y = fastattn.add_sinusoidal(x, inplace=True, **kw)
    assert y is x
    torch.manual_seed(11)
    y_ref = fastattn.add_sinusoidal(ref_leaf * 2.0, **kw)
    torch.testing.assert_close(y.detach(), y_ref.detach(), rtol=0, atol=0)
    g = randn(*y.shape, device=device)
    (y * g).sum().backward()
    (y_ref * g).sum().backward()
    torch.testing.assert_close(leaf.grad, ref_leaf.grad, rtol=1e-6, atol=1e-6)
    assert leaf.grad.abs().sum() > 0


def test_add_sinusoidal_inplace_on_expanded_x_raises(backend, device):
    x = randn(1, 4, 6, device=device).expand(3, 4, 6)
    with pytest.raises(ValueError, match="add_sinusoidal: inplace=True needs an x whose"):
        fastattn.add_sinusoidal(x, inplace=True, backend=backend)


def test_add_sinusoidal_inplace_on_leaf_requiring_grad_raises(backend, device):
    x = randn(1, 4, 4, device=device).requires_grad_()
    with pytest.raises(RuntimeError, match="leaf"):
        fastattn.add_sinusoidal(x, inplace=True, backend=backend)
    with torch.no_grad():  # fine when grad mode is off
        fastattn.add_sinusoidal(x, inplace=True, backend=backend)


@pytest.mark.parametrize("offset", (0, 98_000, 900_000))
def test_sinusoid_long_positions(backend, device, offset):
    """Positions up to ~1e5 (and beyond the CPU's vectorised range reduction, 8e5 radians,
    where it falls back to std::sin/std::cos): every backend evaluates sin/cos of the same
    float32 angle p * inv_freq, so it matches that definition, evaluated in float64 and rounded
    once, within an ulp of the result (no drift with the position), and (kernel backends) the
    float64 reference under the FlashAttention rule."""
    dim, rows = 66, 3000
    t = fastattn.sinusoidal_table(rows, dim, offset=offset, device=device, backend=backend)
    positions = torch.arange(offset, offset + rows)
    inv = positional_ref.inverse_frequencies(dim, 10000.0, torch.float32, "cpu")
    angle = (positions.to(torch.float32)[:, None] * inv).double()
    exact = torch.stack((angle.sin(), angle.cos()), dim=-1).flatten(-2)
    err = float((t.double().cpu() - exact).abs().max())
    print(f"max error against sin/cos of the float32 angle: {err:.3e}")
    # The CPU kernel rounds a float64 evaluation once (at most an ulp, 2^-24 below 1); float32
    # sin/cos implementations (torch's, libdevice's) are within two.
    assert err <= (2**-24 if backend == "cpu" else 2**-23)
    if backend == "reference":
        return  # the reference is checked against the definition above, not against itself
    ref64 = fastattn.sinusoidal_table(
        rows, dim, offset=offset, dtype=torch.float64, backend="reference"
    )
    ref32 = fastattn.sinusoidal_table(rows, dim, offset=offset, backend="reference")
    assert_fa_close("sinusoidal_table", t.cpu(), ref64, ref32)


def test_add_sinusoidal_shared_rows_equal_rows_computed_per_sequence():
    """The CPU kernel computes the sinusoid rows once per call when several sequences share
    them, and row by row otherwise (one sequence, or offsets far apart): both give the same
    bits, with and without per-sequence offsets."""
    x = randn(4, 37, 30)
    for offset in (5, torch.tensor([0, 3, 3, 8]), torch.tensor([0, 40_000, 80_000, 120_000])):
        together = fastattn.add_sinusoidal(x, offset=offset, scale=1.3, backend="cpu")
        for n in range(4):
            off = offset if isinstance(offset, int) else offset[n : n + 1]
            alone = fastattn.add_sinusoidal(x[n : n + 1], offset=off, scale=1.3, backend="cpu")
            torch.testing.assert_close(together[n : n + 1], alone, rtol=0, atol=0)
    tokens = torch.randint(0, 20, (4, 37))
    weight = randn(20, 30)
    together = fastattn.embed_with_positions(tokens, weight, offset=9, backend="cpu")
    for n in range(4):
        alone = fastattn.embed_with_positions(tokens[n : n + 1], weight, offset=9, backend="cpu")
        torch.testing.assert_close(together[n : n + 1], alone, rtol=0, atol=0)


def test_apply_rotary_tables_match_computed(backend, device):
    """Passing cos/sin tables built from the definition gives the angles computed from base."""
    torch.manual_seed(0)
    x = randn(2, 2, 10, 12, device=device)
    for interleaved in (False, True):
        for base in (10000.0, 500.0):
            cos, sin = _rotary_tables(64, 8, torch.float32, device, base=base)
            kw = dict(interleaved=interleaved, rotary_dim=8, offset=7, backend=backend)
            with_tables = fastattn.apply_rotary(x, cos=cos, sin=sin, **kw)
            computed = fastattn.apply_rotary(x, base=base, **kw)
            torch.testing.assert_close(with_tables, computed, rtol=2e-5, atol=2e-5)
    # rotary_dim defaults to 2 * cos.shape[1]
    cos, sin = _rotary_tables(64, 4, torch.float32, device)
    out = fastattn.apply_rotary(x, cos=cos, sin=sin, backend=backend)
    torch.testing.assert_close(
        out, fastattn.apply_rotary(x, rotary_dim=4, backend=backend), rtol=2e-5, atol=2e-5
    )
    assert torch.equal(out[..., 4:], x[..., 4:])


def test_apply_rotary_position_ids_forms(backend, device):
    """position_ids (B, L) and (L,) and the equivalent offsets give the same result."""
    torch.manual_seed(0)
    B, H, L, D = 2, 2, 6, 8
    x = randn(B, H, L, D, device=device)
    offs = torch.tensor([3, 11], device=device)
    ids = offs[:, None] + torch.arange(L, device=device)
    by_ids = fastattn.apply_rotary(x, position_ids=ids, backend=backend)
    by_offs = fastattn.apply_rotary(x, offset=offs, backend=backend)
    torch.testing.assert_close(by_ids, by_offs, rtol=0, atol=0)
    shared = torch.arange(L, device=device) + 4
    torch.testing.assert_close(
        fastattn.apply_rotary(x, position_ids=shared, backend=backend),
        fastattn.apply_rotary(x, offset=4, backend=backend),
        rtol=0,
        atol=0,
    )
    # position_ids override offset; int32 ids work
    torch.testing.assert_close(
        fastattn.apply_rotary(x, position_ids=ids.to(torch.int32), offset=99, backend=backend),
        by_ids,
        rtol=0,
        atol=0,
    )


def test_embed_unbatched_tokens(backend, device):
    torch.manual_seed(0)
    tokens = torch.randint(0, 12, (9,), device=device)
    weight = randn(12, 6, device=device).requires_grad_()
    out = fastattn.embed_with_positions(tokens, weight, offset=3, scale=2.0, backend=backend)
    assert out.shape == (9, 6)
    batched = fastattn.embed_with_positions(
        tokens[None], weight, offset=3, scale=2.0, backend=backend
    )
    torch.testing.assert_close(out, batched[0], rtol=0, atol=0)
    expected = weight.detach().double().cpu()[tokens.cpu()] * 2.0 + fastattn.sinusoidal_table(
        9, 6, offset=3, dtype=torch.float64
    )
    torch.testing.assert_close(out.detach().double().cpu(), expected, rtol=0, atol=1e-5)
    out.sum().backward()
    counts = torch.bincount(tokens.cpu(), minlength=12).to(torch.float32)
    torch.testing.assert_close(weight.grad.cpu(), 2.0 * counts[:, None].expand(12, 6))


@pytest.mark.parametrize("learned", (False, True), ids=("sinusoidal", "learned"))
@pytest.mark.parametrize("padding_idx", (2, -1))
def test_embed_padding_idx(backend, device, learned, padding_idx):
    """No gradient reaches the padding row; positions are still added at padding tokens."""
    torch.manual_seed(0)
    V, D = 8, 6
    pad = padding_idx % V
    tokens = torch.tensor([[pad, 1, pad, 3], [4, pad, pad, 1]], device=device)
    weight = randn(V, D, device=device).requires_grad_()  # the padding row is not zero here
    table = randn(10, D, device=device).requires_grad_() if learned else "sinusoidal"
    out = fastattn.embed_with_positions(
        tokens,
        weight,
        positions=table,
        offset=1,
        scale=1.5,
        padding_idx=padding_idx,
        backend=backend,
    )
    pe = (
        table.detach()[1:5].double().cpu()
        if learned
        else fastattn.sinusoidal_table(4, D, offset=1, dtype=torch.float64)
    )
    expected = weight.detach().double().cpu()[tokens.cpu()] * 1.5 + pe
    torch.testing.assert_close(out.detach().double().cpu(), expected, rtol=0, atol=1e-5)
    g = randn(2, 4, D, device=device)
    out.backward(g)
    assert torch.equal(weight.grad[pad], torch.zeros(D, device=device))
    assert torch.equal(weight.grad[0], torch.zeros(D, device=device))  # never used
    torch.testing.assert_close(weight.grad[1], 1.5 * (g[0, 1] + g[1, 3]), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(weight.grad[3], 1.5 * g[0, 3], rtol=1e-6, atol=1e-6)
    if learned:  # padding positions still receive their position gradient
        torch.testing.assert_close(table.grad[1:5], g.sum(0), rtol=1e-6, atol=1e-6)
        assert torch.equal(table.grad[0], torch.zeros(D, device=device))
        assert torch.equal(table.grad[5:], torch.zeros(5, D, device=device))


@pytest.mark.parametrize("deterministic", (False, True))
def test_embed_duplicate_tokens_gradient_sums(backend, device, deterministic):
    torch.manual_seed(0)
    V, D = 6, 5
    tokens = torch.tensor([[3, 3, 3, 1, 3], [3, 5, 3, 3, 1]], device=device)
    weight = randn(V, D, device=device).requires_grad_()
    table = randn(20, D, device=device).requires_grad_()
    offs = torch.tensor([2, 2], device=device)  # both sequences hit the same positions
    out = fastattn.embed_with_positions(
        tokens,
        weight,
        positions=table,
        offset=offs,
        scale=0.5,
        deterministic=deterministic,
        backend=backend,
    )
    g = randn(2, 5, D, device=device)
    out.backward(g)
    g64 = g.double().cpu()
    expected_w = (
        torch.zeros(V, D, dtype=torch.float64).index_add_(
            0, tokens.cpu().reshape(-1), g64.reshape(-1, D)
        )
        * 0.5
    )
    torch.testing.assert_close(weight.grad.double().cpu(), expected_w, rtol=1e-6, atol=1e-6)
    expected_t = torch.zeros(20, D, dtype=torch.float64)
    expected_t[2:7] = g64.sum(0)
    torch.testing.assert_close(table.grad.double().cpu(), expected_t, rtol=1e-6, atol=1e-6)


def _embed_grads(backend, device, deterministic, dtype=torch.float32):
    torch.manual_seed(0)
    tokens = torch.randint(0, 7, (4, 48), device=device)  # many duplicates
    weight = randn(7, 24, dtype=dtype, device=device).requires_grad_()
    table = randn(64, 24, dtype=dtype, device=device).requires_grad_()
    out = fastattn.embed_with_positions(
        tokens,
        weight,
        positions=table,
        scale=3.0,
        offset=torch.tensor([0, 5, 9, 16], device=device),
        padding_idx=2,
        deterministic=deterministic,
        backend=backend,
    )
    out.backward(randn(*out.shape, dtype=dtype, device=device))
    return weight.grad, table.grad


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("fp32", "bf16"))
def test_embed_deterministic_flag_same_gradient(backend, device, dtype):
    """deterministic=True and False give the same weight gradient: bitwise on the CPU backend
    (always summed in a fixed order), to rounding elsewhere; deterministic=True is bitwise
    reproducible on every backend."""
    gw_det, gt_det = _embed_grads(backend, device, True, dtype)
    gw_det2, gt_det2 = _embed_grads(backend, device, True, dtype)
    gw_fast, gt_fast = _embed_grads(backend, device, False, dtype)
    assert torch.equal(gw_det, gw_det2) and torch.equal(gt_det, gt_det2)
    if backend == "cpu":
        assert torch.equal(gw_det, gw_fast) and torch.equal(gt_det, gt_fast)
    else:
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(gw_fast, gw_det, rtol=tol, atol=tol)
        torch.testing.assert_close(gt_fast, gt_det, rtol=tol, atol=tol)


# ---------------------------------------------------------------------------------------------
# 4. Textbook checks, independent of the reference backend


def _textbook_dtype(backend: str) -> torch.dtype:
    return torch.float32 if backend == "triton" else torch.float64


def test_sinusoidal_table_textbook_values(backend, device):
    dtype = _textbook_dtype(backend)
    tol = 1e-6 if dtype == torch.float32 else 1e-14
    pe = fastattn.sinusoidal_table(4, 4, dtype=dtype, device=device, backend=backend).cpu()
    assert abs(float(pe[1, 0]) - 0.8414709848078965) < tol  # sin(1)
    assert abs(float(pe[1, 1]) - 0.5403023058681398) < tol  # cos(1)
    assert abs(float(pe[1, 0]) - math.sin(1.0)) < tol
    assert abs(float(pe[1, 2]) - math.sin(1 / 100)) < tol  # 10000^(2/4) = 100
    assert abs(float(pe[1, 3]) - math.cos(1 / 100)) < tol
    assert abs(float(pe[3, 2]) - math.sin(0.03)) < tol
    assert abs(float(pe[2, 1]) - math.cos(2.0)) < tol
    assert torch.equal(pe[0], torch.tensor([0.0, 1.0, 0.0, 1.0], dtype=dtype))
    # odd dim: the last column is a sine; base changes the frequencies
    pe = fastattn.sinusoidal_table(
        3, 5, base=16.0, dtype=dtype, device=device, backend=backend
    ).cpu()
    assert abs(float(pe[2, 4]) - math.sin(2 / 16 ** (4 / 5))) < tol
    assert abs(float(pe[2, 3]) - math.cos(2 / 16 ** (2 / 5))) < tol


@pytest.mark.parametrize("dim,base,offset", [(10, 10000.0, 0), (33, 10000.0, 7), (16, 500.0, 100)])
def test_sinusoidal_table_formula(backend, device, dim, base, offset):
    """PE[p, 2i] = sin(p / base^(2i/d)), PE[p, 2i+1] = cos(p / base^(2i/d)), computed with math
    in Python (float64). float32 tables are within the rounding of the float32 angle."""
    P = 60
    dtype = _textbook_dtype(backend)
    pe = (
        fastattn.sinusoidal_table(
            P, dim, base=base, offset=offset, dtype=dtype, device=device, backend=backend
        )
        .double()
        .cpu()
    )
    expected = torch.empty(P, dim, dtype=torch.float64)
    for r in range(P):
        p = offset + r
        for c in range(dim):
            angle = p / base ** (2 * (c // 2) / dim)
            expected[r, c] = math.sin(angle) if c % 2 == 0 else math.cos(angle)
    if dtype == torch.float64:
        torch.testing.assert_close(pe, expected, rtol=0, atol=1e-12)
    else:  # the float32 angle p * inv_freq carries a relative error of about 2 ulps
        p = torch.arange(offset, offset + P, dtype=torch.float64)[:, None]
        bound = 3 * 2.0**-24 * (p + 1) + 2e-7
        assert ((pe - expected).abs() <= bound).all()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Hugging Face's (GPT-NeoX / Llama) rotate_half."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def hf_apply_rotary(x, position_ids, rotary_dim, base):
    """transformers' Llama rotary in float64: emb = cat(freqs, freqs),
    x * cos + rotate_half(x) * sin on the first rotary_dim features (partial rotary as in
    GPT-NeoX)."""
    inv_freq = 1.0 / (
        base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).double() / rotary_dim)
    )
    freqs = position_ids.double()[..., None] * inv_freq  # (B, L, rotary_dim/2)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((rot * cos + rotate_half(rot) * sin, rest), dim=-1)


def rotate_every_two(x: torch.Tensor) -> torch.Tensor:
    """GPT-J's pairwise rotation: (x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...)."""
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def gptj_apply_rotary(x, position_ids, rotary_dim, base):
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2).double() / rotary_dim))
    angle = position_ids.double()[..., None] * inv_freq
    sin = angle.sin().repeat_interleave(2, dim=-1)[:, None]
    cos = angle.cos().repeat_interleave(2, dim=-1)[:, None]
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((rot * cos + rotate_every_two(rot) * sin, rest), dim=-1)


@pytest.mark.parametrize("interleaved", (False, True), ids=("neox-rotate_half", "gptj-pairs"))
@pytest.mark.parametrize(
    "rotary_dim,base,positions",
    [(None, 10000.0, "offset"), (8, 10000.0, "position_ids"), (12, 1000.0, "tensor-offset")],
)
def test_apply_rotary_textbook(backend, device, interleaved, rotary_dim, base, positions):
    torch.manual_seed(0)
    B, H, L, D = 2, 3, 9, 16
    dtype = _textbook_dtype(backend)
    x = randn(B, H, L, D, dtype=dtype, device=device)
    rd = rotary_dim or D
    kw = dict(interleaved=interleaved, rotary_dim=rotary_dim, base=base, backend=backend)
    if positions == "offset":
        ids = torch.arange(L).expand(B, L) + 6
        out = fastattn.apply_rotary(x, offset=6, **kw)
    elif positions == "position_ids":
        ids = torch.randint(0, 300, (B, L))
        out = fastattn.apply_rotary(x, position_ids=ids.to(device), **kw)
    else:
        offs = torch.tensor([2, 40])
        ids = offs[:, None] + torch.arange(L)
        out = fastattn.apply_rotary(x, offset=offs.to(device), **kw)
    textbook = gptj_apply_rotary if interleaved else hf_apply_rotary
    expected = textbook(x.double().cpu(), ids, rd, base)
    # float32: the angle p * inv_freq is rounded twice (relative error <= 2^-23)
    tol = (
        1e-12
        if dtype == torch.float64
        else 4 * 2.0**-24 * (int(ids.max()) + 1) * float(x.abs().max()) + 1e-6
    )
    torch.testing.assert_close(out.double().cpu(), expected, rtol=0, atol=tol)
    # and the layouts really differ (the test could tell them apart)
    other = (hf_apply_rotary if interleaved else gptj_apply_rotary)(x.double().cpu(), ids, rd, base)
    assert (other - expected).abs().max() > 1e-2


@pytest.mark.parametrize("interleaved", (False, True), ids=("neox", "gptj"))
def test_rope_relative_position_property(backend, device, interleaved):
    """q_rot(m) . k_rot(n) depends on m - n only."""
    torch.manual_seed(0)
    D = 16
    dtype = _textbook_dtype(backend)
    q = randn(1, 1, 1, D, dtype=dtype, device=device)
    k = randn(1, 1, 1, D, dtype=dtype, device=device)
    qk = float((q.abs() * k.abs()).sum())
    # float32: each angle carries a relative error of about 2^-23 (positions reach 1050)
    tol = 1e-10 if dtype == torch.float64 else 4 * 2.0**-24 * 1051 * qk + 1e-5

    def rot(v, pos):
        return (
            fastattn.apply_rotary(v, offset=pos, interleaved=interleaved, backend=backend)
            .double()
            .cpu()
            .reshape(-1)
        )

    def score(m, n):
        return float(rot(q, m) @ rot(k, n))

    for m, n, shift in ((0, 0, 5), (3, 7, 11), (10, 2, 100), (50, 49, 1000)):
        assert abs(score(m, n) - score(m + shift, n + shift)) < tol, (m, n, shift)
    # the score does change with the relative position (rotation is not the identity)
    assert abs(score(3, 7) - score(3, 8)) > 1e-3
    plain = float(q.double().cpu().reshape(-1) @ k.double().cpu().reshape(-1))
    assert abs(score(0, 0) - plain) < tol  # position 0 is no rotation


@pytest.mark.parametrize("delta", (1, 5, 37))
def test_sinusoid_shift_is_linear(backend, device, delta):
    """PE[p + delta] = M_delta PE[p] with M_delta block diagonal: for each frequency w the
    2x2 block [[cos dw, sin dw], [-sin dw, cos dw]] acting on (sin pw, cos pw)."""
    D, P = 16, 64
    dtype = _textbook_dtype(backend)
    tol = 1e-12 if dtype == torch.float64 else 3e-5
    pe = (
        fastattn.sinusoidal_table(P + delta, D, dtype=dtype, device=device, backend=backend)
        .double()
        .cpu()
    )
    w = 10000.0 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    M = torch.zeros(D, D, dtype=torch.float64)
    for i, wi in enumerate(w.tolist()):
        c, s = math.cos(delta * wi), math.sin(delta * wi)
        M[2 * i : 2 * i + 2, 2 * i : 2 * i + 2] = torch.tensor(
            [[c, s], [-s, c]], dtype=torch.float64
        )
    shifted = pe[:P] @ M.T  # row p: M_delta PE[p], the same M for every p
    torch.testing.assert_close(shifted, pe[delta : delta + P], rtol=0, atol=tol)


# ---------------------------------------------------------------------------------------------
# 5. Dropout


def _dropout_call(op: str, backend: str, device, dtype=torch.float32, shape=(2, 50, 40)):
    """fn(p) -> output of op with dropout p, on fixed random inputs of `shape` (N, L, D)."""
    torch.manual_seed(0)
    N, L, D = shape
    if op == "add_sinusoidal":
        x = randn(N, L, D, dtype=dtype, device=device)
        return lambda p: fastattn.add_sinusoidal(
            x, dropout_p=p, scale=1.7, offset=3, backend=backend
        )
    tokens = torch.randint(0, 500, (N, L), device=device)
    weight = randn(500, D, dtype=dtype, device=device)
    return lambda p: fastattn.embed_with_positions(
        tokens, weight, dropout_p=p, scale=1.7, offset=3, backend=backend
    )


@pytest.mark.parametrize("op", ("add_sinusoidal", "embed_with_positions"))
@pytest.mark.parametrize("p", (0.1, 0.6))
def test_dropout_keep_rate_and_scale(backend, device, op, p):
    fn = _dropout_call(op, backend, device, shape=(4, 250, 100))  # 1e5 elements
    full = fn(0.0)
    torch.manual_seed(7)
    out = fn(p)
    kept = out != 0
    n = out.numel()
    assert n >= 100_000 and (full != 0).all()
    rate = kept.double().mean().item()
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(rate - (1 - p)) < 5 * sigma, f"keep rate {rate}, expected {1 - p} +- {sigma}"
    # kept values are the no-dropout values times exactly 1/(1-p) (float32 keep_scale)
    keep_scale = torch.tensor(1.0 / (1.0 - p), dtype=torch.float32, device=device)
    assert torch.equal(out[kept], (full * keep_scale)[kept])


@pytest.mark.parametrize("op", ("add_sinusoidal", "embed_with_positions"))
def test_dropout_backward_uses_forward_mask(backend, device, op):
    p, scale = 0.3, 1.7
    torch.manual_seed(0)
    keep_scale = torch.tensor(1.0 / (1.0 - p), dtype=torch.float32, device=device)
    if op == "add_sinusoidal":
        x = randn(3, 40, 50, device=device).requires_grad_()
        torch.manual_seed(11)
        out = fastattn.add_sinusoidal(x, dropout_p=p, scale=scale, backend=backend)
        g = randn(*out.shape, device=device)
        out.backward(g)
        kept = out.detach() != 0
        assert 0.6 < kept.double().mean().item() < 0.8
        assert torch.equal(x.grad[~kept], torch.zeros_like(x.grad[~kept]))
        torch.testing.assert_close(
            x.grad[kept], ((g * scale) * keep_scale)[kept], rtol=1e-6, atol=0
        )
    else:  # one sequence of distinct tokens: each weight row and table row gets one row of g
        L, D = 60, 40
        tokens = torch.randperm(100, device=device)[:L][None]
        weight = randn(100, D, device=device).requires_grad_()
        table = randn(L + 5, D, device=device).requires_grad_()
        torch.manual_seed(11)
        out = fastattn.embed_with_positions(
            tokens, weight, positions=table, offset=2, dropout_p=p, scale=scale, backend=backend
        )
        g = randn(*out.shape, device=device)
        out.backward(g)
        kept = (out.detach() != 0)[0]
        assert 0.6 < kept.double().mean().item() < 0.8
        expected_rows = torch.where(kept, g[0] * keep_scale, torch.zeros_like(g[0]))
        torch.testing.assert_close(table.grad[2 : 2 + L], expected_rows, rtol=1e-6, atol=0)
        torch.testing.assert_close(
            weight.grad[tokens[0]], expected_rows * scale, rtol=1e-6, atol=1e-7
        )
        assert torch.equal(weight.grad[tokens[0]][~kept], torch.zeros_like(g[0][~kept]))


@pytest.mark.parametrize("op", ("add_sinusoidal", "embed_with_positions"))
def test_dropout_reproducible_under_manual_seed(backend, device, op):
    fn = _dropout_call(op, backend, device)
    torch.manual_seed(123)
    a = fn(0.5)
    torch.manual_seed(123)
    b = fn(0.5)
    torch.manual_seed(124)
    c = fn(0.5)
    d = fn(0.5)  # the next call draws a fresh seed
    assert torch.equal(a, b)
    assert not torch.equal(a == 0, c == 0)
    assert not torch.equal(c == 0, d == 0)


@pytest.mark.parametrize("op", ("add_sinusoidal", "embed_with_positions"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=("fp32", "bf16"))
def test_dropout_same_mask_on_every_cpu_backend(op, dtype):
    """cpu, triton and reference draw the seed from the same generator and the same Philox
    stream: zeros in exactly the same places, values equal to rounding."""
    outs = {}
    for backend in ("cpu", "triton", "reference"):
        if fastattn.available_backends()[backend] != "available":
            continue
        if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
            continue  # triton runs CUDA tensors (another generator): see the next test
        fn = _dropout_call(op, backend, "cpu", dtype=dtype, shape=(3, 64, 100))
        torch.manual_seed(99)
        outs[backend] = fn(0.4)
    assert "cpu" in outs and "reference" in outs
    ref = outs["reference"]
    for backend, out in outs.items():
        if backend == "reference":
            continue
        assert torch.equal(out == 0, ref == 0), backend
        tol = 1e-5 if dtype == torch.float32 else 1.6e-2  # one bfloat16 ulp at a tie
        torch.testing.assert_close(out, ref, rtol=tol, atol=1e-5)


def test_dropout_mask_is_the_philox_stream(backend, device):
    """Each kernel, called through its registered op with an explicit seed tensor, drops
    exactly the elements fastattn.reference.random says (also checks CUDA's own generator-free
    path when a GPU is present)."""
    torch.manual_seed(0)
    N, L, D, p = 3, 37, 29, 0.35
    seed = torch.tensor([2**62 - 12345, 2**33 + 17], device=device)
    x = randn(N, L, D, device=device)
    tokens = torch.randint(0, 50, (N, L), device=device)
    weight = randn(50, D, device=device)
    if backend == "reference":
        from fastattn.reference import positional as ref

        out = ref.add_sinusoidal(x, 0, None, 1.0, 10000.0, p, seed)
        emb = ref.embed_with_positions(tokens, weight, None, 0, None, 1.0, 10000.0, p, seed)
    else:
        suffix = "_triton" if backend == "triton" else ""
        ops = torch.ops.fastattn
        out = getattr(ops, "add_sinusoidal" + suffix)(x, 0, None, 1.0, 10000.0, p, seed)
        emb = getattr(ops, "embed_with_positions" + suffix)(
            tokens, weight, None, 0, None, 1.0, 10000.0, p, seed, -1, False
        )
    keep = philox_ref.dropout_keep_mask(seed.cpu(), (N, L, D), p)
    assert 0.55 < keep.double().mean().item() < 0.75
    assert torch.equal((out != 0).cpu(), keep)
    assert torch.equal((emb != 0).cpu(), keep)


# ---------------------------------------------------------------------------------------------
# 6. torch.library.opcheck


def _opcheck_cases(device):
    """(op name, args) for every positional op, small CPU/CUDA tensors, dropout off except the
    cases named *-seed."""
    torch.manual_seed(0)
    x = randn(2, 5, 8, device=device).requires_grad_()
    w = randn(11, 8, device=device).requires_grad_()
    table = randn(9, 8, device=device).requires_grad_()
    tokens = torch.randint(0, 11, (2, 5), device=device)
    xr = randn(2, 3, 5, 8, device=device).requires_grad_()
    cos, sin = _rotary_tables(16, 6, torch.float32, device)
    offsets = torch.tensor([1, 3], device=device)
    ids = torch.randint(0, 16, (2, 5), device=device)
    seed = torch.tensor([123, 456], device=device)
    return {
        "sinusoidal_table": (
            "sinusoidal_table",
            (torch.arange(3, 9, device=device), 7, 10000.0, torch.float32),
        ),
        "add_sinusoidal": ("add_sinusoidal", (x, 2, offsets, 1.5, 10000.0, 0.0, None)),
        "add_sinusoidal-seed": ("add_sinusoidal", (x, 0, None, 1.0, 10000.0, 0.25, seed)),
        "add_sinusoidal_": (
            "add_sinusoidal_",
            (x.detach().clone(), 1, offsets, 1.5, 10000.0, 0.0, None),
        ),
        "add_sinusoidal_-seed": (
            "add_sinusoidal_",
            (x.detach().clone(), 0, None, 1.0, 10000.0, 0.25, seed),
        ),
        "add_sinusoidal_backward": (
            "add_sinusoidal_backward",
            (x.detach().requires_grad_(), 2.0, 0.0, None),
        ),
        "embed_with_positions": (
            "embed_with_positions",
            (tokens, w, table, 1, offsets, 2.0, 10000.0, 0.0, None, 3, False),
        ),
        "embed_with_positions-sinusoidal": (
            "embed_with_positions",
            (tokens, w, None, 0, None, 1.0, 10000.0, 0.0, None, -1, True),
        ),
        "embed_with_positions_backward": (
            "embed_with_positions_backward",
            (randn(2, 5, 8, device=device), tokens, 11, 3, 9, 1, offsets, 2.0, 0.0, None, False),
        ),
        "apply_rotary": (
            "apply_rotary",
            (xr, None, None, 2, offsets, None, 8, 10000.0, False, False),
        ),
        "apply_rotary-tables": (
            "apply_rotary",
            (xr, cos, sin, 0, None, ids, 6, 10000.0, True, True),
        ),
        "apply_rotary_": (
            "apply_rotary_",
            (xr.detach().clone(), None, None, 1, None, None, 4, 10000.0, True, False),
        ),
    }


OPCHECK_CASES = list(_opcheck_cases("cpu"))


@pytest.mark.parametrize("case", OPCHECK_CASES)
@pytest.mark.parametrize("backend", ("cpu", "cuda"))
def test_opcheck_native(backend, device, case):
    name, args = _opcheck_cases(device)[case]
    torch.library.opcheck(getattr(torch.ops.fastattn, name), args)


@pytest.mark.parametrize("case", OPCHECK_CASES)
def test_opcheck_triton(case):
    device = backend_device("triton")  # CUDA when present, else CPU under the interpreter
    name, args = _opcheck_cases(device)[case]
    name = name[:-1] + "_triton_" if name.endswith("_") else name + "_triton"
    if device.type == "cpu":
        # Under TRITON_INTERPRET=1, triton.jit returns an InterpretedFunction and
        # torch.library.wrap_triton hands it back unwrapped, so the fake (meta) pass that
        # triton_op derives from the Python body launches the interpreter on FakeTensors
        # ("Attempted to set the storage of a tensor on device meta to a storage on ...
        # cpu"): test_faketensor and test_aot_dispatch_* cannot run under the interpreter.
        # The schema and the autograd registration are still checked; on a GPU all run.
        torch.library.opcheck(
            getattr(torch.ops.fastattn, name),
            args,
            test_utils=("test_schema", "test_autograd_registration"),
        )
    else:
        torch.library.opcheck(getattr(torch.ops.fastattn, name), args)


# ---------------------------------------------------------------------------------------------
# 7. torch.compile(fullgraph=True)


class _PositionalModel(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = PositionalEmbedding(
            50, 16, positions="learned", max_len=32, padding_idx=0, scale=4.0
        )
        self.sinusoid = SinusoidalPositionalEncoding(16, scale=0.5)
        self.rotary = RotaryEmbedding(6, interleaved=True)

    def forward(self, tokens, offset):
        h = self.embed(tokens, offset=offset)
        h = self.sinusoid(h, offset=offset)
        q = h.view(h.shape[0], h.shape[1], 2, 8).transpose(1, 2)  # (B, H, L, 8), strided
        q, k = self.rotary(q, q * 2.0, offset=offset)
        return (q * k).sum(-1)


def test_compile_fullgraph_modules(monkeypatch):
    """The three ops inside nn.Modules compile without graph breaks; output and gradients
    equal eager. The backend-availability cache is cleared first, as in a fresh process where
    the compiled call is the first fastattn call."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = _PositionalModel()
    tokens = torch.randint(0, 50, (2, 9))
    offset = torch.tensor([0, 3])
    compiled = torch.compile(model, fullgraph=True)
    fastattn.apply_rotary(randn(1, 1, 1, 2), backend="reference")  # to be overwritten
    monkeypatch.setattr(_backend, "_availability_cache", None)  # no eager call after this
    out = compiled(tokens, offset)
    assert _backend._availability_cache is not None
    assert fastattn.last_backend("apply_rotary") == "cpu"
    eager = model(tokens, offset)
    torch.testing.assert_close(out, eager, rtol=1e-6, atol=1e-6)
    grads = torch.autograd.grad(out.square().sum(), list(model.parameters()))
    eager_grads = torch.autograd.grad(eager.square().sum(), list(model.parameters()))
    for g, e in zip(grads, eager_grads):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-5)


def test_compile_fullgraph_functional_seq_first():
    """Sequence-first add_sinusoidal (in place, from an eval module), sinusoidal embedding with
    an int offset, and in-place rotary (no grad) in one compiled function."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    weight = randn(30, 8)
    pe_module = SinusoidalPositionalEncoding(8, batch_first=False, inplace=True).eval()

    def f(tokens, x):
        e = fastattn.embed_with_positions(tokens, weight, offset=5, scale=2.0, padding_idx=1)
        y = pe_module(x + e.transpose(0, 1), offset=2)  # (L, B, D)
        r = y.transpose(0, 1).unsqueeze(1).clone()  # (B, 1, L, D)
        fastattn.apply_rotary(r, inplace=True, rotary_dim=4)
        return r

    tokens = torch.randint(0, 30, (3, 7))
    x = randn(7, 3, 8)
    compiled = torch.compile(f, fullgraph=True)
    torch.testing.assert_close(compiled(tokens, x), f(tokens, x), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# 8. last_backend


def _run_op(op: str, device, backend=None):
    x = randn(2, 2, 3, 4, device=device)
    if op == "sinusoidal_table":
        return fastattn.sinusoidal_table(3, 4, device=device, backend=backend)
    if op == "add_sinusoidal":
        return fastattn.add_sinusoidal(x[0], backend=backend)
    if op == "embed_with_positions":
        return fastattn.embed_with_positions(
            torch.tensor([[0, 1]], device=device), x[0, 0], backend=backend
        )
    return fastattn.apply_rotary(x, backend=backend)


@pytest.mark.parametrize("op", ("sinusoidal_table",) + OPS)
def test_last_backend_names_the_backend_that_ran(backend, device, op):
    other = "cpu" if backend == "reference" else "reference"
    _run_op(op, torch.device("cpu"), other)
    assert fastattn.last_backend(op) == other
    with fastattn.use_backend(backend):
        _run_op(op, device)
    assert fastattn.last_backend(op) == backend
    _run_op(op, torch.device("cpu"), other)
    _run_op(op, device, backend)
    assert fastattn.last_backend(op) == backend


@pytest.mark.parametrize("op", ("sinusoidal_table",) + OPS)
def test_default_backend_on_cpu_is_cpu(op):
    with fastattn.use_backend("reference"):
        _run_op(op, "cpu")
        assert fastattn.last_backend(op) == "reference"
    _run_op(op, "cpu")
    assert fastattn.last_backend(op) == "cpu"


def test_modules_report_the_op_they_call():
    torch.manual_seed(0)
    x = randn(2, 5, 8)
    tokens = torch.randint(0, 10, (2, 5))
    q = randn(2, 2, 5, 8)
    calls = [
        ("add_sinusoidal", lambda: SinusoidalPositionalEncoding(8)(x)),
        ("embed_with_positions", lambda: PositionalEmbedding(10, 8)(tokens)),
        (
            "embed_with_positions",
            lambda: PositionalEmbedding(10, 8, positions="learned", max_len=8)(tokens),
        ),
        ("apply_rotary", lambda: RotaryEmbedding(8)(q, q)),
    ]
    for op, call in calls:
        _run_op(op, "cpu", "cpu")
        with fastattn.use_backend("reference"):
            call()
        assert fastattn.last_backend(op) == "reference", op
        call()
        assert fastattn.last_backend(op) == "cpu", op


# ---------------------------------------------------------------------------------------------
# 9. Bad input raises a clear error naming the argument


def _x3():
    return randn(2, 3, 4)


def _xr():
    return randn(2, 1, 3, 8)


_TOK = torch.tensor([[0, 1, 2]])
_W = torch.randn(5, 4)

ERROR_CASES = [
    # add_sinusoidal
    (
        "x-int",
        lambda: fastattn.add_sinusoidal(torch.ones(2, 3, 4, dtype=torch.int64)),
        TypeError,
        "x must be float32, float16, bfloat16 or float64",
    ),
    ("x-not-tensor", lambda: fastattn.add_sinusoidal([[1.0]]), TypeError, "x must be a torch"),
    ("x-1d", lambda: fastattn.add_sinusoidal(randn(5)), ValueError, "x must have at least 2"),
    (
        "offset-shape",
        lambda: fastattn.add_sinusoidal(_x3(), offset=torch.tensor([1, 2, 3])),
        ValueError,
        r"offset must have shape \(2,\)",
    ),
    (
        "offset-2d",
        lambda: fastattn.add_sinusoidal(_x3(), offset=torch.zeros(2, 1, dtype=torch.long)),
        ValueError,
        "offset must be 0-D or 1-D",
    ),
    (
        "offset-float-tensor",
        lambda: fastattn.add_sinusoidal(_x3(), offset=torch.tensor([1.0, 2.0])),
        TypeError,
        "offset must be an integer tensor",
    ),
    (
        "offset-float",
        lambda: fastattn.add_sinusoidal(_x3(), offset=1.5),
        TypeError,
        "offset must be an int",
    ),
    (
        "offset-bool",
        lambda: fastattn.add_sinusoidal(_x3(), offset=True),
        TypeError,
        "offset must be an int",
    ),
    (
        "offset-negative",
        lambda: fastattn.add_sinusoidal(_x3(), offset=-1),
        ValueError,
        "offset must be >= 0",
    ),
    (
        "dropout-negative",
        lambda: fastattn.add_sinusoidal(_x3(), dropout_p=-0.1),
        ValueError,
        r"dropout_p must be a float in \[0, 1\)",
    ),
    ("dropout-one", lambda: fastattn.add_sinusoidal(_x3(), dropout_p=1.0), ValueError, "dropout_p"),
    ("dropout-big", lambda: fastattn.add_sinusoidal(_x3(), dropout_p=1.5), ValueError, "dropout_p"),
    (
        "dropout-str",
        lambda: fastattn.add_sinusoidal(_x3(), dropout_p="0.1"),
        ValueError,
        "dropout_p",
    ),
    ("seq_dim-last", lambda: fastattn.add_sinusoidal(_x3(), seq_dim=2), ValueError, "seq_dim"),
    ("seq_dim-minus-1", lambda: fastattn.add_sinusoidal(_x3(), seq_dim=-1), ValueError, "seq_dim"),
    (
        "seq_dim-4d-last",
        lambda: fastattn.add_sinusoidal(randn(2, 3, 4, 5), seq_dim=3),
        ValueError,
        "seq_dim",
    ),
    (
        "seq_dim-out-of-range",
        lambda: fastattn.add_sinusoidal(_x3(), seq_dim=3),
        ValueError,
        "seq_dim",
    ),
    ("base-zero", lambda: fastattn.add_sinusoidal(_x3(), base=0.0), ValueError, "base must be > 0"),
    (
        "x-stride",
        lambda: fastattn.add_sinusoidal(randn(2, 4, 3).transpose(1, 2)),
        ValueError,
        "x must have a unit stride in its last dimension",
    ),
    (
        "offset-meta",
        lambda: fastattn.add_sinusoidal(
            _x3(), offset=torch.zeros(2, dtype=torch.long, device="meta")
        ),
        ValueError,
        "offset must be on the input's device",
    ),
    (
        "backend-name",
        lambda: fastattn.add_sinusoidal(_x3(), backend="tpu"),
        ValueError,
        "backend must be one of",
    ),
    # sinusoidal_table
    ("table-dim-0", lambda: fastattn.sinusoidal_table(4, 0), ValueError, "dim >= 1"),
    (
        "table-negative-positions",
        lambda: fastattn.sinusoidal_table(-1, 4),
        ValueError,
        "num_positions must be >= 0",
    ),
    (
        "table-offset",
        lambda: fastattn.sinusoidal_table(4, 4, offset=-2),
        ValueError,
        "offset must be >= 0",
    ),
    (
        "table-dtype",
        lambda: fastattn.sinusoidal_table(4, 4, dtype=torch.int32),
        TypeError,
        "dtype must be a floating dtype",
    ),
    (
        "table-base",
        lambda: fastattn.sinusoidal_table(4, 4, base=-1.0),
        ValueError,
        "base must be > 0",
    ),
    # embed_with_positions
    (
        "tokens-float",
        lambda: fastattn.embed_with_positions(torch.rand(1, 3), _W),
        TypeError,
        "tokens must be an integer tensor",
    ),
    (
        "tokens-bool",
        lambda: fastattn.embed_with_positions(torch.ones(1, 3, dtype=torch.bool), _W),
        TypeError,
        "tokens must be an integer tensor",
    ),
    (
        "tokens-3d",
        lambda: fastattn.embed_with_positions(_TOK[None], _W),
        ValueError,
        "tokens must be 1-D or 2-D",
    ),
    (
        "weight-int",
        lambda: fastattn.embed_with_positions(_TOK, torch.ones(5, 4, dtype=torch.long)),
        TypeError,
        "weight must be float32",
    ),
    (
        "weight-1d",
        lambda: fastattn.embed_with_positions(_TOK, torch.randn(5)),
        ValueError,
        "weight must be 2-D",
    ),
    (
        "weight-stride",
        lambda: fastattn.embed_with_positions(_TOK, torch.randn(4, 5).t()),
        ValueError,
        "weight must have a unit stride",
    ),
    (
        "table-width",
        lambda: fastattn.embed_with_positions(_TOK, _W, positions=torch.randn(8, 5)),
        ValueError,
        r"positions table must be \(max_len, 4\)",
    ),
    (
        "table-dtype",
        lambda: fastattn.embed_with_positions(
            _TOK, _W, positions=torch.randn(8, 4, dtype=torch.float64)
        ),
        ValueError,
        "positions table must be .* with weight's dtype",
    ),
    (
        "table-1d",
        lambda: fastattn.embed_with_positions(_TOK, _W, positions=torch.randn(8)),
        ValueError,
        "positions must be 2-D",
    ),
    (
        "table-int",
        lambda: fastattn.embed_with_positions(
            _TOK, _W, positions=torch.ones(8, 4, dtype=torch.long)
        ),
        TypeError,
        "positions must be float32",
    ),
    (
        "table-stride",
        lambda: fastattn.embed_with_positions(_TOK, _W, positions=torch.randn(4, 8).t()),
        ValueError,
        "positions must have a unit stride",
    ),
    (
        "positions-string",
        lambda: fastattn.embed_with_positions(_TOK, _W, positions="rotary"),
        ValueError,
        "positions must be 'sinusoidal' or a",
    ),
    (
        "padding_idx-range",
        lambda: fastattn.embed_with_positions(_TOK, _W, padding_idx=5),
        ValueError,
        r"padding_idx must be in \[-5, 5\)",
    ),
    (
        "embed-dropout",
        lambda: fastattn.embed_with_positions(_TOK, _W, dropout_p=1.0),
        ValueError,
        "dropout_p",
    ),
    (
        "embed-offset-shape",
        lambda: fastattn.embed_with_positions(_TOK, _W, offset=torch.tensor([1, 2])),
        ValueError,
        r"offset must have shape \(1,\)",
    ),
    (
        "embed-offset-float",
        lambda: fastattn.embed_with_positions(_TOK, _W, offset=torch.tensor([1.0])),
        TypeError,
        "offset must be an integer tensor",
    ),
    (
        "embed-base",
        lambda: fastattn.embed_with_positions(_TOK, _W, base=0.0),
        ValueError,
        "base must be > 0",
    ),
    (
        "weight-meta",
        lambda: fastattn.embed_with_positions(_TOK, torch.empty(5, 4, device="meta")),
        ValueError,
        "tokens must be on the same device as weight",
    ),
    (
        "table-meta",
        lambda: fastattn.embed_with_positions(_TOK, _W, positions=torch.empty(8, 4, device="meta")),
        ValueError,
        "positions must be on the same device as weight",
    ),
    (
        "embed-offset-meta",
        lambda: fastattn.embed_with_positions(
            _TOK, _W, offset=torch.zeros(1, dtype=torch.long, device="meta")
        ),
        ValueError,
        "offset must be on the input's device",
    ),
    # apply_rotary
    (
        "rotary-x-int",
        lambda: fastattn.apply_rotary(torch.ones(1, 1, 2, 4, dtype=torch.int32)),
        TypeError,
        "x must be float32",
    ),
    ("rotary-x-3d", lambda: fastattn.apply_rotary(randn(2, 3, 4)), ValueError, "x must be 4-D"),
    (
        "rotary-x-stride",
        lambda: fastattn.apply_rotary(randn(1, 1, 8, 3).transpose(2, 3)),
        ValueError,
        "x must have a unit stride",
    ),
    (
        "rotary_dim-odd",
        lambda: fastattn.apply_rotary(_xr(), rotary_dim=5),
        ValueError,
        r"rotary_dim must be even and in \[2, 8\]",
    ),
    (
        "rotary_dim-too-big",
        lambda: fastattn.apply_rotary(_xr(), rotary_dim=10),
        ValueError,
        r"rotary_dim must be even and in \[2, 8\] \(head dim\), got 10",
    ),
    (
        "rotary_dim-zero",
        lambda: fastattn.apply_rotary(_xr(), rotary_dim=0),
        ValueError,
        "rotary_dim",
    ),
    (
        "rotary-odd-D",
        lambda: fastattn.apply_rotary(randn(1, 1, 3, 7)),
        ValueError,
        "rotary_dim must be even",
    ),
    (
        "cos-without-sin",
        lambda: fastattn.apply_rotary(_xr(), cos=torch.randn(8, 4)),
        ValueError,
        "cos and sin must be given together",
    ),
    (
        "sin-without-cos",
        lambda: fastattn.apply_rotary(_xr(), sin=torch.randn(8, 4)),
        ValueError,
        "cos and sin must be given together",
    ),
    (
        "cos-width",
        lambda: fastattn.apply_rotary(
            _xr(), cos=torch.randn(8, 3), sin=torch.randn(8, 3), rotary_dim=8
        ),
        ValueError,
        r"cos must be \(max_position, rotary_dim / 2 = 4\)",
    ),
    (
        "cos-1d",
        lambda: fastattn.apply_rotary(_xr(), cos=torch.randn(8), sin=torch.randn(8)),
        ValueError,
        "cos must be 2-D",
    ),
    (
        "sin-width",
        lambda: fastattn.apply_rotary(_xr(), cos=torch.randn(8, 4), sin=torch.randn(8, 3)),
        ValueError,
        r"sin must be \(max_position, rotary_dim / 2 = 4\)",
    ),
    (
        "cos-sin-rows",
        lambda: fastattn.apply_rotary(_xr(), cos=torch.randn(8, 4), sin=torch.randn(9, 4)),
        ValueError,
        "cos and sin must have the same shape",
    ),
    (
        "cos-int",
        lambda: fastattn.apply_rotary(
            _xr(), cos=torch.ones(8, 4, dtype=torch.long), sin=torch.ones(8, 4, dtype=torch.long)
        ),
        TypeError,
        "cos must be float32",
    ),
    (
        "cos-requires-grad",
        lambda: fastattn.apply_rotary(
            _xr(), cos=torch.randn(8, 4, requires_grad=True), sin=torch.randn(8, 4)
        ),
        ValueError,
        "no gradient flows to cos",
    ),
    (
        "cos-meta",
        lambda: fastattn.apply_rotary(
            _xr(), cos=torch.empty(8, 4, device="meta"), sin=torch.empty(8, 4, device="meta")
        ),
        ValueError,
        "cos must be on the same device as x",
    ),
    (
        "position_ids-shape",
        lambda: fastattn.apply_rotary(_xr(), position_ids=torch.zeros(2, 5, dtype=torch.long)),
        ValueError,
        r"position_ids must be \(B, L\) = \(2, 3\)",
    ),
    (
        "position_ids-batch",
        lambda: fastattn.apply_rotary(_xr(), position_ids=torch.zeros(3, 3, dtype=torch.long)),
        ValueError,
        "position_ids must be",
    ),
    (
        "position_ids-3d",
        lambda: fastattn.apply_rotary(_xr(), position_ids=torch.zeros(2, 3, 1, dtype=torch.long)),
        ValueError,
        "position_ids must be 1-D or 2-D",
    ),
    (
        "position_ids-float",
        lambda: fastattn.apply_rotary(_xr(), position_ids=torch.zeros(2, 3)),
        TypeError,
        "position_ids must be an integer tensor",
    ),
    (
        "position_ids-meta",
        lambda: fastattn.apply_rotary(
            _xr(), position_ids=torch.zeros(2, 3, dtype=torch.long, device="meta")
        ),
        ValueError,
        "position_ids must be on the same device as x",
    ),
    (
        "rotary-offset-shape",
        lambda: fastattn.apply_rotary(_xr(), offset=torch.tensor([1, 2, 3])),
        ValueError,
        r"offset must have shape \(2,\)",
    ),
    (
        "rotary-offset-float",
        lambda: fastattn.apply_rotary(_xr(), offset=torch.tensor([1.0, 2.0])),
        TypeError,
        "offset must be an integer tensor",
    ),
    (
        "rotary-offset-meta",
        lambda: fastattn.apply_rotary(
            _xr(), offset=torch.zeros(2, dtype=torch.long, device="meta")
        ),
        ValueError,
        "offset must be on the input's device",
    ),
    (
        "rotary-offset-negative",
        lambda: fastattn.apply_rotary(_xr(), offset=-3),
        ValueError,
        "offset must be >= 0",
    ),
    ("rotary-base", lambda: fastattn.apply_rotary(_xr(), base=0.0), ValueError, "base must be > 0"),
    # explicitly requested backends that cannot run the call
    (
        "cuda-on-cpu-tensors",
        lambda: fastattn.add_sinusoidal(_x3(), backend="cuda"),
        fastattn.BackendError,
        "backend 'cuda' cannot run this call",
    ),
    (
        "cuda-on-cpu-rotary",
        lambda: fastattn.apply_rotary(_xr(), backend="cuda"),
        fastattn.BackendError,
        "cuda",
    ),
    (
        "cuda-on-cpu-embed",
        lambda: fastattn.embed_with_positions(_TOK, _W, backend="cuda"),
        fastattn.BackendError,
        "cuda",
    ),
    (
        "cuda-on-cpu-table",
        lambda: fastattn.sinusoidal_table(3, 4, backend="cuda"),
        fastattn.BackendError,
        "cuda",
    ),
]


@pytest.mark.parametrize(
    "call,exc,match", [pytest.param(c, e, m, id=i) for i, c, e, m in ERROR_CASES]
)
def test_bad_input_raises_clear_error(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_unavailable_backend_context_raises():
    status = fastattn.available_backends()["cuda"]
    with fastattn.use_backend("cuda"):
        with pytest.raises(fastattn.BackendError, match="cuda") as info:
            fastattn.add_sinusoidal(_x3())
    if status != "available":  # the reason says why (not built / no device)
        assert status.split(":")[0] in str(info.value) or "CUDA" in str(info.value)


# The native kernels raise RuntimeError (TORCH_CHECK); the Python checks in front of the
# triton and reference backends raise IndexError/ValueError with the same text.
_RANGE_ERRORS = (RuntimeError, IndexError, ValueError)


def host_checks_for(device: torch.device, monkeypatch) -> None:
    """CUDA values are checked on the device (a failure is a device-side assert, which would
    end this process's CUDA context): the eager-error tests run CUDA tensors with
    FASTATTN_HOST_CHECKS=1; test_cuda_device_checks_fire checks the asserts in a subprocess."""
    if device.type != "cpu":
        monkeypatch.setenv("FASTATTN_HOST_CHECKS", "1")


@pytest.mark.parametrize("bad", (-1, 5, 1000))
def test_token_out_of_range_every_backend(backend, device, bad, monkeypatch):
    host_checks_for(device, monkeypatch)
    tokens = torch.tensor([[0, 1], [bad, 2]], device=device)
    weight = randn(5, 4, device=device)
    with pytest.raises(_RANGE_ERRORS, match=r"token ids must be in \[0, 5\)"):
        fastattn.embed_with_positions(tokens, weight, backend=backend)
    with pytest.raises(_RANGE_ERRORS, match=r"token ids must be in \[0, 5\)"):
        fastattn.embed_with_positions(
            tokens[1], weight, positions=randn(8, 4, device=device), backend=backend
        )


def test_positions_table_too_short_every_backend(backend, device, monkeypatch):
    host_checks_for(device, monkeypatch)
    tokens = torch.tensor([[0, 1, 2], [3, 4, 0]], device=device)
    weight = randn(5, 4, device=device)
    table = randn(6, 4, device=device)
    fastattn.embed_with_positions(tokens, weight, positions=table, offset=3, backend=backend)
    with pytest.raises(_RANGE_ERRORS, match="positions reach 6 but the positions table has 6"):
        fastattn.embed_with_positions(tokens, weight, positions=table, offset=4, backend=backend)
    with pytest.raises(_RANGE_ERRORS, match="positions table has 6 rows"):
        fastattn.embed_with_positions(
            tokens,
            weight,
            positions=table,
            backend=backend,
            offset=torch.tensor([0, 5], device=device),
        )
    with pytest.raises(_RANGE_ERRORS, match="positions must be >= 0"):
        fastattn.embed_with_positions(
            tokens,
            weight,
            positions=table,
            backend=backend,
            offset=torch.tensor([0, -1], device=device),
        )


def test_negative_tensor_offset_every_backend(backend, device, monkeypatch):
    """A per-sequence start below 0 is rejected by every backend (not silently computed)."""
    host_checks_for(device, monkeypatch)
    offs = torch.tensor([2, -3], device=device)
    with pytest.raises(_RANGE_ERRORS, match="positions must be >= 0"):
        fastattn.add_sinusoidal(randn(2, 3, 4, device=device), offset=offs, backend=backend)
    with pytest.raises(_RANGE_ERRORS, match="positions must be >= 0"):
        fastattn.embed_with_positions(
            torch.zeros(2, 3, dtype=torch.long, device=device),
            randn(5, 4, device=device),
            offset=offs,
            backend=backend,
        )
    with pytest.raises(_RANGE_ERRORS, match="positions must be >= 0"):
        fastattn.apply_rotary(randn(2, 1, 3, 4, device=device), offset=offs, backend=backend)


def test_rotary_positions_beyond_tables_every_backend(backend, device, monkeypatch):
    host_checks_for(device, monkeypatch)
    x = randn(2, 1, 3, 8, device=device)
    cos, sin = _rotary_tables(6, 8, torch.float32, device)
    fastattn.apply_rotary(x, cos=cos, sin=sin, offset=3, backend=backend)
    with pytest.raises(_RANGE_ERRORS, match="positions reach 6 but cos/sin"):
        fastattn.apply_rotary(x, cos=cos, sin=sin, offset=4, backend=backend)
    ids = torch.tensor([[0, 1, 2], [3, 6, 5]], device=device)
    with pytest.raises(_RANGE_ERRORS, match="position_ids"):
        fastattn.apply_rotary(x, cos=cos, sin=sin, position_ids=ids, backend=backend)
    with pytest.raises(_RANGE_ERRORS, match="position_ids must be"):
        fastattn.apply_rotary(x, position_ids=ids - 1, backend=backend)


def _positional_inputs(device) -> dict:
    """Inputs of _positional_calls on `device`, made beforehand (creating them copies from
    the CPU, a synchronising copy on CUDA)."""
    learned = LearnedPositionalEmbedding(16, 8)
    learned.weight = torch.nn.Parameter(randn(16, 8, device=device))  # (.to() fails on fakes)
    return dict(
        x=randn(2, 5, 8, device=device),
        offs=torch.tensor([0, 7], device=device),
        tokens=torch.tensor([[1, 2, 3, 4, 0], [4, 3, 2, 1, 0]], device=device),
        weight=randn(5, 8, device=device),
        table=randn(16, 8, device=device),
        q=randn(2, 3, 5, 8, device=device),
        tables=_rotary_tables(16, 8, torch.float32, device),
        ids=torch.tensor([[0, 1, 2, 3, 4], [9, 10, 11, 12, 13]], device=device),
        learned=learned,
        rotary=RotaryEmbedding(8).to(device),
    )


def _positional_calls(backend: str, t: dict) -> None:
    """Every positional op with per-call position values: tensor offsets, token ids, a learned
    table, position ids; and the modules that take tensor offsets."""
    x, offs, q, ids = t["x"], t["offs"], t["q"], t["ids"]
    cos, sin = t["tables"]
    fastattn.add_sinusoidal(x, offset=offs, backend=backend)
    fastattn.embed_with_positions(t["tokens"], t["weight"], offset=offs, backend=backend)
    fastattn.embed_with_positions(
        t["tokens"], t["weight"], positions=t["table"], offset=offs, backend=backend
    )
    fastattn.apply_rotary(q, cos=cos, sin=sin, offset=offs, backend=backend)
    fastattn.apply_rotary(q, offset=offs, backend=backend)
    fastattn.apply_rotary(q, cos=cos, sin=sin, position_ids=ids, backend=backend)
    fastattn.apply_rotary(
        q.clone(), cos=cos, sin=sin, position_ids=ids, inplace=True, backend=backend
    )
    with fastattn.use_backend(backend):
        t["learned"](x, offset=offs)
        t["rotary"](q, q, offset=offs)


@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_no_host_reads_for_cuda_tensors(backend, monkeypatch):
    """On CUDA tensors (fake ones: no GPU needed) no positional op reads a value on the host
    (.item()/.tolist()/nonzero/copy to the CPU: a synchronisation, and no CUDA-graph capture).
    The values are still checked, asynchronously on the device: by torch._assert_async here,
    by the native ops' check kernels for the cuda backend (csrc/common/device_checks.h)."""
    from fastattn.ops import positional as positional_ops

    # The Triton launchers enter the tensor's CUDA device even for fake tensors (no driver
    # here): the native ops' fake implementations (same schemas) stand in for the kernels,
    # after the Python layer made the triton backend's checks.
    monkeypatch.setattr(
        positional_ops, "_native_op", lambda name, chosen: getattr(torch.ops.fastattn, name)
    )
    monkeypatch.setattr(
        positional_ops, "_inplace_rotary_op", lambda chosen: torch.ops.fastattn.apply_rotary_
    )
    with fake_cuda(backend) as recorder:
        _positional_calls(backend, _positional_inputs("cuda"))
    assert_no_host_reads(recorder)
    # triton: offsets (x7, one per call with tensor offsets), token ids (x2), position ids
    # (x2) and the module's offsets; cuda: add_sinusoidal's offsets and the module's.
    assert device_checks(recorder) >= (10 if backend == "triton" else 2)


def test_host_checks_switch(monkeypatch):
    """FASTATTN_HOST_CHECKS=1 restores the eager host checks (clear Python errors) for CUDA
    tensors: a fake tensor has no value to read, so the read raises here."""
    from fastattn.ops._common import device_checks_enabled, host_checks_enabled

    with fake_cuda():
        t = torch.zeros(3, dtype=torch.long, device="cuda")
        assert not host_checks_enabled(t) and device_checks_enabled(t)
        monkeypatch.setenv("FASTATTN_HOST_CHECKS", "1")
        assert host_checks_enabled(t) and not device_checks_enabled(t)
    assert host_checks_enabled(torch.zeros(3)) and not device_checks_enabled(torch.zeros(3))
    with pytest.raises(ValueReadError), fake_cuda() as rec:
        fastattn.apply_rotary(
            randn(2, 1, 3, 4, device="cuda"),
            backend="cuda",
            offset=torch.tensor([0, 1], device="cuda"),
        )
    assert any("_local_scalar_dense" in r for r in rec.reads)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_device_checks_catch_bad_values(monkeypatch, backend):
    """The rules checked on the device for CUDA tensors, run here on CPU tensors through the
    same code (torch._assert_async raises at once on the CPU)."""
    if backend_device(backend).type != "cpu":
        pytest.skip("the device-side rules are run on CPU tensors here")
    force_device_checks(monkeypatch)
    x, weight, table = randn(2, 3, 4), randn(5, 4), randn(6, 4)
    tokens = torch.tensor([[0, 1, 2], [3, 4, 0]])
    cos, sin = _rotary_tables(6, 4, torch.float32, "cpu")
    q = randn(2, 1, 3, 4)
    cases = [
        (
            r"offsets\[b\] \+ l \(l < 3\) must be >= 0",
            lambda: fastattn.add_sinusoidal(x, offset=torch.tensor([2, -3]), backend=backend),
        ),
        (
            r"token ids must be in \[0, 5\)",
            lambda: fastattn.embed_with_positions(
                torch.tensor([[0, 5, 1]]), weight, backend=backend
            ),
        ),
        (
            r"token ids must be in \[0, 5\)",
            lambda: fastattn.embed_with_positions(
                torch.tensor([[0, -1, 1]]), weight, backend=backend
            ),
        ),
        (
            r"must be in \[0, 6\) \(the positions table rows\)",
            lambda: fastattn.embed_with_positions(
                tokens, weight, positions=table, backend=backend, offset=torch.tensor([0, 4])
            ),
        ),
        (
            r"must be in \[0, 6\) \(cos/sin rows\)",
            lambda: fastattn.apply_rotary(
                q, cos=cos, sin=sin, offset=torch.tensor([3, 4]), backend=backend
            ),
        ),
        (
            r"position_ids must be in \[0, 6\)",
            lambda: fastattn.apply_rotary(
                q,
                cos=cos,
                sin=sin,
                position_ids=torch.tensor([[0, 6, 1], [0, 1, 2]]),
                backend=backend,
            ),
        ),
        (
            r"position_ids must be >= 0",
            lambda: fastattn.apply_rotary(
                q, position_ids=torch.tensor([[0, -1, 1], [0, 1, 2]]), backend=backend
            ),
        ),
        (
            r"positions offset \+ l must be in \[0, 16\)",
            lambda: LearnedPositionalEmbedding(16, 4)(x, offset=torch.tensor([0, 14])),
        ),
    ]
    for match, call in cases:
        with pytest.raises(RuntimeError, match=match):
            call()
    # Valid values pass the same checks.
    fastattn.apply_rotary(q, cos=cos, sin=sin, offset=torch.tensor([3, 0]), backend=backend)
    fastattn.embed_with_positions(
        tokens, weight, positions=table, backend=backend, offset=torch.tensor([0, 3])
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_cuda_no_synchronisation(backend):
    """torch.cuda.set_sync_debug_mode("error") raises on any synchronising call (C++ .item()
    included): the positional ops on CUDA tensors make none."""
    backend_device(backend)
    inputs = _positional_inputs("cuda")
    assert_no_device_sync(lambda: _positional_calls(backend, inputs))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_cuda_device_checks_fire(backend):
    """Without host checks a bad token id on CUDA fails as a device-side assert (run in a
    subprocess: the assert ends its CUDA context); fastattn's check kernel prints the rule."""
    backend_device(backend)
    output = run_failing_cuda_script(f"""
        import torch, fastattn
        weight = torch.randn(5, 4, device="cuda")
        tokens = torch.tensor([[0, 1], [7, 2]], device="cuda")
        fastattn.embed_with_positions(tokens, weight, backend={backend!r})
        torch.cuda.synchronize()
    """)
    if backend == "cuda":
        assert "token ids must be in [0, 5); tokens; got 7 at index 2" in output, output


def test_native_ops_check_their_arguments():
    """Direct calls of the registered ops (bypassing the Python checks) fail cleanly."""
    ops = torch.ops.fastattn
    w = randn(5, 4)
    with pytest.raises(RuntimeError, match="token ids must be in"):
        ops.embed_with_positions(
            torch.tensor([[7]]), w, None, 0, None, 1.0, 1e4, 0.0, None, -1, False
        )
    with pytest.raises(RuntimeError, match="a seed tensor is required"):
        ops.add_sinusoidal(randn(1, 2, 4), 0, None, 1.0, 1e4, 0.5, None)
    with pytest.raises(RuntimeError, match="seed must be a contiguous int64 tensor"):
        ops.add_sinusoidal(randn(1, 2, 4), 0, None, 1.0, 1e4, 0.5, torch.tensor([1, 2, 3]))
    with pytest.raises(RuntimeError, match="offsets must be int64"):
        ops.add_sinusoidal(
            randn(2, 2, 4), 0, torch.tensor([1, 2], dtype=torch.int32), 1.0, 1e4, 0.0, None
        )
    with pytest.raises(RuntimeError, match="rotary_dim must be even"):
        ops.apply_rotary(randn(1, 1, 2, 4), None, None, 0, None, None, 3, 1e4, False, False)
    with pytest.raises(RuntimeError, match="cos/sin must be"):
        ops.apply_rotary(
            randn(1, 1, 2, 4),
            torch.randn(4, 2, dtype=torch.float64),
            torch.randn(4, 2, dtype=torch.float64),
            0,
            None,
            None,
            4,
            1e4,
            False,
            False,
        )
    with pytest.raises(RuntimeError, match="x must be 3-D"):
        ops.add_sinusoidal(randn(2, 4), 0, None, 1.0, 1e4, 0.0, None)


# ---------------------------------------------------------------------------------------------
# 10. Modules


@pytest.mark.parametrize("batch_first", (True, False))
def test_sinusoidal_module(batch_first):
    torch.manual_seed(0)
    B, L, D = 3, 11, 12
    module = SinusoidalPositionalEncoding(D, dropout=0.5, scale=2.0, batch_first=batch_first)
    x = randn(B, L, D) if batch_first else randn(L, B, D)
    pe = fastattn.sinusoidal_table(L, D, offset=4, dtype=torch.float64)
    pe = pe[None] if batch_first else pe[:, None]
    expected = x.double() * 2.0 + pe
    module.eval()
    out = module(x, offset=4)
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-5)
    assert torch.equal(module(x, offset=4), out)  # no dropout in eval mode
    module.train()
    torch.manual_seed(3)
    dropped = module(x, offset=4)
    zeros = dropped == 0
    assert 0.35 < zeros.double().mean().item() < 0.65
    torch.testing.assert_close(dropped[~zeros], (out * 2.0)[~zeros], rtol=1e-6, atol=0)
    # tensor offsets per sequence
    module.eval()
    offs = torch.tensor([0, 5, 9])
    out = module(x, offset=offs)
    for b in range(B):
        pe = fastattn.sinusoidal_table(L, D, offset=int(offs[b]), dtype=torch.float64)
        xb = x[b] if batch_first else x[:, b]
        ob = out[b] if batch_first else out[:, b]
        torch.testing.assert_close(ob.double(), xb.double() * 2.0 + pe, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="expected x with 12 features"):
        module(randn(2, 3, 10))
    with pytest.raises(ValueError, match="dropout must be in"):
        SinusoidalPositionalEncoding(8, dropout=1.0)


def test_learned_positional_embedding_module():
    torch.manual_seed(0)
    module = LearnedPositionalEmbedding(16, 6)
    assert module.weight.shape == (16, 6)
    assert 0.005 < module.weight.std().item() < 0.05  # N(0, 0.02)
    x = randn(2, 5, 6)
    out = module(x, offset=3)
    torch.testing.assert_close(out, x + module.weight[3:8], rtol=0, atol=0)
    offs = torch.tensor([0, 11])
    out = module(x, offset=offs)
    torch.testing.assert_close(out[0], x[0] + module.weight[0:5], rtol=0, atol=0)
    torch.testing.assert_close(out[1], x[1] + module.weight[11:16], rtol=0, atol=0)
    out.sum().backward()
    expected = torch.zeros(16, 6)
    expected[0:5] += 1
    expected[11:16] += 1
    torch.testing.assert_close(module.weight.grad, expected)
    with pytest.raises(ValueError, match="exceed max_len 16"):
        module(x, offset=12)
    with pytest.raises(ValueError, match=r"positions must be in \[0, 16\)"):
        module(x, offset=torch.tensor([0, 12]))
    with pytest.raises(ValueError, match=r"positions must be in \[0, 16\)"):
        module(x, offset=torch.tensor([-1, 0]))
    with pytest.raises(ValueError, match="expected x"):
        module(randn(2, 5, 7))
    assert set(module.state_dict()) == {"weight"}
    # dropout applies in training mode only
    module = LearnedPositionalEmbedding(16, 6, dropout=0.5)
    module.eval()
    torch.testing.assert_close(module(x), x + module.weight[:5], rtol=0, atol=0)
    module.train()
    assert (module(x) == 0).any()


@pytest.mark.parametrize("positions", ("sinusoidal", "learned"))
def test_positional_embedding_module(positions):
    torch.manual_seed(0)
    kw = dict(max_len=20) if positions == "learned" else {}
    module = PositionalEmbedding(
        30, 8, positions=positions, scale=math.sqrt(8), padding_idx=4, **kw
    )
    expected_keys = {"weight"} | ({"position_weight"} if positions == "learned" else set())
    assert set(module.state_dict()) == expected_keys
    assert torch.equal(module.weight[4], torch.zeros(8))
    assert module.weight[5].abs().sum() > 0
    tokens = torch.tensor([[4, 1, 7, 4], [2, 2, 29, 0]])
    out = module(tokens, offset=2)
    table = module.position_weight if positions == "learned" else "sinusoidal"
    expected = fastattn.embed_with_positions(
        tokens,
        module.weight,
        positions=table,
        scale=math.sqrt(8),
        offset=2,
        padding_idx=4,
        backend="reference",
    )
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    assert out.shape == (2, 4, 8)
    assert module(tokens[0]).shape == (4, 8)
    out.sum().backward()
    assert torch.equal(module.weight.grad[4], torch.zeros(8))
    if positions == "learned":
        assert module.position_weight.grad[2:6].abs().sum() > 0
        with pytest.raises(_RANGE_ERRORS, match="positions table"):
            module(tokens, offset=17)
    # state_dict moves both ways
    clone = PositionalEmbedding(30, 8, positions=positions, scale=math.sqrt(8), padding_idx=4, **kw)
    clone.load_state_dict(module.state_dict())
    torch.testing.assert_close(clone(tokens, offset=2), out.detach(), rtol=0, atol=0)
    # dropout in training mode only
    module = PositionalEmbedding(30, 8, positions=positions, dropout=0.5, **kw)
    module.eval()
    a = module(tokens)
    assert torch.equal(a, module(tokens)) and (a != 0).all()
    module.train()
    assert (module(tokens) == 0).any()


def test_positional_embedding_module_errors():
    with pytest.raises(ValueError, match="positions must be 'sinusoidal' or 'learned'"):
        PositionalEmbedding(10, 4, positions="rotary")
    with pytest.raises(ValueError, match="max_len"):
        PositionalEmbedding(10, 4, positions="learned")
    with pytest.raises(ValueError, match="dim must be even"):
        RotaryEmbedding(7)


@pytest.mark.parametrize("interleaved", (False, True), ids=("neox", "gptj"))
def test_rotary_embedding_module(interleaved):
    torch.manual_seed(0)
    module = RotaryEmbedding(8, base=500.0, interleaved=interleaved)
    assert set(module.state_dict()) == set()
    q = randn(2, 4, 6, 12).requires_grad_()
    k = randn(2, 1, 6, 12)
    offs = torch.tensor([3, 0])
    q_rot, k_rot = module(q, k, offset=offs)
    kw = dict(rotary_dim=8, base=500.0, interleaved=interleaved, offset=offs)
    torch.testing.assert_close(q_rot, fastattn.apply_rotary(q, **kw), rtol=0, atol=0)
    torch.testing.assert_close(k_rot, fastattn.apply_rotary(k, **kw), rtol=0, atol=0)
    assert torch.equal(q_rot[..., 8:], q[..., 8:])
    expected = (gptj_apply_rotary if interleaved else hf_apply_rotary)(
        q.detach().double(), offs[:, None] + torch.arange(6), 8, 500.0
    )
    torch.testing.assert_close(q_rot.detach().double(), expected, rtol=0, atol=5e-6)
    q_rot.sum().backward()
    assert q.grad is not None and q.grad.shape == q.shape
