"""The positional encodings on the torch backend (torch's elementwise kernels over a cached
table, fastattn/aten/positional.py) against the float64 reference, under FlashAttention's rule
(tests/tolerance.py): its error may be at most 2x (3x for gradients) that of the reference run
in the input's precision, plus a rounding floor. Every call it accepts, forward and backward,
every dtype; in-place calls; its refusal of dropout (and of deterministic=True on CUDA without
torch's deterministic algorithms), each naming the feature; and the backend choice: forced
calls run it, the automatic choice does not without a speed table that says so.
"""

from __future__ import annotations

import math

import pytest
import torch
from host_reads import assert_no_host_reads, fake_cuda
from tolerance import assert_fa_close, assert_grad_close

import fastattn
from fastattn import BackendError, _backend, speed_table
from fastattn.aten import positional as aten_positional

pytestmark = pytest.mark.usefixtures("one_thread")

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_DT = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64"}
# The comparisons count toward the torch backend in the run's oracle summary (conftest.py).
ON_TORCH = pytest.mark.parametrize("backend", ["torch"])


def randn(*shape, dtype=torch.float32, generator=None) -> torch.Tensor:
    """Standard normal values drawn in float64, rounded once to dtype."""
    return torch.randn(*shape, dtype=torch.float64, generator=generator).to(dtype)


def float64_floor(ref64: torch.Tensor, max_position: int) -> float:
    """The floor for float64 results, whose baseline (the reference itself) is 0: a few ulps of
    the result per unit of the largest angle (an ulp of inv_freq or of sin/cos moves the angle
    p * inv_freq by about p ulps)."""
    scale = 1.0 + (float(ref64.abs().max()) if ref64.numel() else 0.0)
    return 16 * torch.finfo(torch.float64).eps * scale * (1.0 + max_position)


def run_three(backend: str, op: str, fn, inputs: dict, grads: tuple = (), **fixed) -> dict:
    """fn(backend=..., **inputs, **fixed) on `backend`, on the reference with the inputs in
    float64, and on the reference in their own precision; the gradients of the inputs named in
    `grads` for one upstream gradient. Returns name ("out", "grad <input>") -> (result, ref64,
    ref_lowp)."""
    assert backend != "reference"
    gen = torch.Generator().manual_seed(1234)
    runs = {}
    for label, be, wide in (
        ("got", backend, False),
        ("ref64", "reference", True),
        ("lowp", "reference", False),
    ):
        args = {}
        for name, value in inputs.items():
            if value is not None:
                value = value.detach().double() if wide else value.detach().clone()
                value.requires_grad_(name in grads)
            args[name] = value
        out = fn(backend=be, **args, **fixed)
        assert fastattn.last_backend(op) == be
        runs[label] = (out, args)
    got, ref64, lowp = (runs[k][0] for k in ("got", "ref64", "lowp"))
    assert got.dtype == lowp.dtype and got.shape == ref64.shape
    results = {"out": (got.detach(), ref64.detach(), lowp.detach())}
    if grads:
        grad_out = randn(*got.shape, generator=gen)
        for out, _ in runs.values():
            out.backward(grad_out.to(out.dtype))
        for name in grads:
            results[f"grad {name}"] = tuple(runs[k][1][name].grad for k in ("got", "ref64", "lowp"))
    return results


def check(results: dict, max_position: int = 0, tamper: dict | None = None) -> None:
    """Every result within the rule; tamper: name -> factor to scale that result by first."""
    for name, (got, ref64, lowp) in results.items():
        assert got is not None, f"{name}: no gradient"
        if tamper and name in tamper:
            got = got * tamper[name]
        floor = float64_floor(ref64, max_position) if got.dtype == torch.float64 else None
        assert_close = assert_grad_close if name.startswith("grad") else assert_fa_close
        assert_close(name, got, ref64, lowp, floor=floor)


# ---------------------------------------------------------------------------------------------
# sinusoidal_table


@ON_TORCH
@pytest.mark.parametrize("dtype", DTYPES, ids=_DT.get)
@pytest.mark.parametrize(
    "num_positions,dim,offset",
    [
        pytest.param(1, 1, 0, id="P1-D1"),
        pytest.param(17, 7, 3, id="oddD7"),
        pytest.param(300, 64, 4000, id="cached-grown"),
        pytest.param(40, 64, 300_000, id="past-the-cache"),  # rows computed in the call
        pytest.param(0, 5, 0, id="empty"),
    ],
)
def test_sinusoidal_table(backend, dtype, num_positions, dim, offset):
    kw = dict(offset=offset, dtype=dtype)
    out = fastattn.sinusoidal_table(num_positions, dim, backend=backend, **kw)
    assert fastattn.last_backend("sinusoidal_table") == backend
    kw["dtype"] = torch.float64
    ref64 = fastattn.sinusoidal_table(num_positions, dim, backend="reference", **kw)
    lowp = fastattn.sinusoidal_table(
        num_positions, dim, backend="reference", **dict(kw, dtype=dtype)
    )
    assert out.shape == (num_positions, dim) and out.dtype == dtype
    check({"out": (out, ref64, lowp)}, max_position=offset + num_positions)


def test_sinusoidal_table_is_a_new_tensor_each_call():
    """Writing into a returned table leaves the cache (and so later calls) alone."""
    first = fastattn.sinusoidal_table(8, 6, backend="torch")
    first.fill_(7.0)
    again = fastattn.sinusoidal_table(8, 6, backend="torch")
    expected = fastattn.sinusoidal_table(8, 6, dtype=torch.float64, backend="reference")
    torch.testing.assert_close(again.double(), expected, rtol=0, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# add_sinusoidal

ADD_CASES = [
    # (shape, seq_dim, offset, scale, base)
    pytest.param((3, 17, 7), 1, 5, 2.0, 10000.0, id="oddD7-int-offset"),
    pytest.param((2, 40, 64), 1, "tensor", math.sqrt(64), 500.0, id="tensor-offsets-base500"),
    pytest.param((21, 3, 16), 0, "tensor", 1.0, 10000.0, id="seq-first-tensor-offsets"),
    pytest.param((17, 16), 0, 3, 0.5, 10000.0, id="unbatched-2d"),
    pytest.param((2, 3, 9, 8), 2, "tensor", 1.5, 10000.0, id="4d-seq_dim2"),
    pytest.param((2, 9, 3, 8), 1, 2, 1.0, 10000.0, id="4d-copy-layout"),
]


def _add_offset(kind, x: torch.Tensor, seq_dim: int):
    """The offset argument: an int, or one int64 start per sequence (up to 5000)."""
    if isinstance(kind, int):
        return kind, kind
    sequences = x.numel() // (x.shape[seq_dim] * x.shape[-1])
    offsets = torch.arange(sequences) * 997 % 5001
    return offsets, int(offsets.max())


@ON_TORCH
@pytest.mark.parametrize("dtype", DTYPES, ids=_DT.get)
@pytest.mark.parametrize("shape,seq_dim,offset,scale,base", ADD_CASES)
def test_add_sinusoidal(backend, dtype, shape, seq_dim, offset, scale, base):
    x = randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(0))
    off, max_offset = _add_offset(offset, x, seq_dim)

    def fn(x, backend):
        return fastattn.add_sinusoidal(
            x, offset=off, scale=scale, base=base, seq_dim=seq_dim, backend=backend
        )

    results = run_three(backend, "add_sinusoidal", fn, {"x": x}, grads=("x",))
    check(results, max_position=max_offset + shape[seq_dim])
    if len(shape) <= 3 or seq_dim == len(shape) - 2:  # (4-D: where (N, L, D) views x)
        assert results["out"][0].stride() == x.stride(), "the result is laid out like x"


@ON_TORCH
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=_DT.get)
@pytest.mark.parametrize("layout", ("batch-first", "seq-first", "4d-view", "4d-copy"))
def test_add_sinusoidal_in_place(backend, dtype, layout):
    """inplace=True writes x (same storage, returned) on every layout, without autograd and
    on a non-leaf that needs gradients (the leaf's gradient is checked)."""
    shape, seq_dim = {
        "batch-first": ((3, 7, 10), 1),
        "seq-first": ((7, 3, 10), 0),
        "4d-view": ((2, 3, 7, 10), 2),
        "4d-copy": ((2, 7, 3, 10), 1),
    }[layout]
    x = randn(*shape, dtype=dtype, generator=torch.Generator().manual_seed(1))
    off, max_offset = _add_offset("tensor", x, seq_dim)
    kw = dict(offset=off, scale=1.5, seq_dim=seq_dim)

    def fn(x, backend):
        target = x * 1.0  # a non-leaf: written in place, differentiable back to x
        y = fastattn.add_sinusoidal(target, inplace=True, backend=backend, **kw)
        assert y is target
        return y

    check(run_three(backend, "add_sinusoidal", fn, {"x": x}, grads=("x",)), max_offset + 7)
    y = x.clone()
    ptr = y.data_ptr()
    with torch.no_grad():
        assert fastattn.add_sinusoidal(y, inplace=True, backend=backend, **kw) is y
    assert y.data_ptr() == ptr
    ref64 = fastattn.add_sinusoidal(x.double(), backend="reference", **kw)
    lowp = fastattn.add_sinusoidal(x, backend="reference", **kw)
    check({"out": (y, ref64, lowp)})


def test_add_sinusoidal_in_place_on_a_leaf_that_needs_grad_raises():
    x = randn(1, 4, 4).requires_grad_()
    with pytest.raises(RuntimeError, match="leaf"):
        fastattn.add_sinusoidal(x, inplace=True, backend="torch")
    with torch.no_grad():  # fine when grad mode is off
        fastattn.add_sinusoidal(x, inplace=True, backend="torch")
    assert fastattn.last_backend("add_sinusoidal") == "torch"


def test_add_sinusoidal_under_inference_mode_then_with_grad():
    """A table first cached under inference_mode serves later calls that need gradients."""
    aten_positional.clear_cache()
    with torch.inference_mode():
        fastattn.add_sinusoidal(randn(2, 5, 12), backend="torch")
    x = randn(2, 5, 12).requires_grad_()
    fastattn.add_sinusoidal(x, scale=3.0, backend="torch").sum().backward()
    assert torch.equal(x.grad, torch.full_like(x, 3.0))


# ---------------------------------------------------------------------------------------------
# embed_with_positions

EMBED_CASES = [
    # (token shape, num_embeddings, dim, learned max_len, offset, padding_idx, scale)
    pytest.param((2, 1), 10, 8, None, 0, None, 1.0, id="L1-sinusoidal"),
    pytest.param((3, 17), 50, 7, 40, 3, 0, 2.0, id="learned-int-offset-pad0"),
    pytest.param((2, 33), 20, 33, None, "tensor", 5, math.sqrt(33), id="sin-tensor-offsets-pad"),
    pytest.param((2, 16), 30, 16, 64, "tensor", None, 1.7, id="learned-tensor-offsets"),
    pytest.param((19,), 12, 9, None, 2, None, 1.5, id="unbatched"),
]


@ON_TORCH
@pytest.mark.parametrize("dtype", DTYPES, ids=_DT.get)
@pytest.mark.parametrize("tok_shape,vocab,dim,max_len,offset,padding_idx,scale", EMBED_CASES)
def test_embed_with_positions(
    backend, dtype, tok_shape, vocab, dim, max_len, offset, padding_idx, scale
):
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, vocab, tok_shape, generator=gen)
    if padding_idx is not None:
        tokens.view(-1)[::3] = padding_idx  # the padding id occurs
    inputs = {"weight": randn(vocab, dim, dtype=dtype, generator=gen)}
    if max_len is not None:
        inputs["positions"] = randn(max_len, dim, dtype=dtype, generator=gen)
    batch, length = (tok_shape[0] if len(tok_shape) == 2 else 1), tok_shape[-1]
    off = offset
    if offset == "tensor":
        off = torch.randint(0, (max_len or 200) - length + 1, (batch,), generator=gen)

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

    results = run_three(backend, "embed_with_positions", fn, inputs, grads=tuple(inputs))
    max_position = (int(off.max()) if isinstance(off, torch.Tensor) else off) + length
    check(results, max_position=max_position)
    if padding_idx is not None:
        assert torch.all(results["grad weight"][0][padding_idx] == 0)


def test_embed_with_positions_out_of_range_ids_raise():
    """The torch backend's calls are checked in Python, as the reference's and Triton's."""
    weight = randn(5, 4)
    with pytest.raises(IndexError, match="token ids must be in"):
        fastattn.embed_with_positions(torch.tensor([[0, 5]]), weight, backend="torch")
    with pytest.raises(ValueError, match="positions"):
        fastattn.embed_with_positions(
            torch.tensor([[0, 1]]), weight, positions=randn(3, 4), offset=2, backend="torch"
        )


# ---------------------------------------------------------------------------------------------
# apply_rotary


def rotary_tables(rows: int, rotary_dim: int, dtype):
    """cos/sin (rows, rotary_dim / 2) of pos * 10000^(-2i/rotary_dim), in float64, rounded."""
    inv = 10000.0 ** (-torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim)
    angle = torch.arange(rows, dtype=torch.float64)[:, None] * inv
    return angle.cos().to(dtype), angle.sin().to(dtype)


ROTARY_CASES = [
    # (B, H, L, D), rotary_dim, interleaved, positions, tables
    pytest.param((1, 1, 1, 2), None, False, 0, False, id="L1-D2"),
    pytest.param((2, 3, 17, 8), None, True, 5, False, id="gptj-int-offset"),
    pytest.param((2, 2, 9, 7), 6, False, "tensor", False, id="oddD7-rd6-tensor-offsets"),
    pytest.param((2, 2, 12, 33), 16, True, "tensor", True, id="D33-rd16-gptj-tables"),
    pytest.param((2, 4, 16, 64), 32, False, "position_ids", True, id="neox-ids-tables"),
    pytest.param((3, 2, 11, 16), None, False, "position_ids", False, id="ids-computed"),
    pytest.param((1, 2, 300, 4), None, False, 3, True, id="L300-tables-int-offset"),
]


@ON_TORCH
@pytest.mark.parametrize("dtype", DTYPES, ids=_DT.get)
@pytest.mark.parametrize("shape,rotary_dim,interleaved,positions,tables", ROTARY_CASES)
def test_apply_rotary(backend, dtype, shape, rotary_dim, interleaved, positions, tables):
    gen = torch.Generator().manual_seed(3)
    B, H, L, D = shape
    x = randn(*shape, dtype=dtype, generator=gen)
    rd = rotary_dim or D
    rows = 2048
    inputs = {"x": x}
    if tables:
        inputs["cos"], inputs["sin"] = rotary_tables(rows, rd, dtype)
    fixed = dict(interleaved=interleaved, rotary_dim=rotary_dim)
    if positions == "position_ids":
        fixed["position_ids"] = torch.randint(0, rows, (B, L), generator=gen)
    elif positions == "tensor":
        fixed["offset"] = torch.randint(0, 100, (B,), generator=gen)
    else:
        fixed["offset"] = positions

    def fn(x, backend, cos=None, sin=None, **kw):
        return fastattn.apply_rotary(x, cos=cos, sin=sin, backend=backend, **kw)

    results = run_three(backend, "apply_rotary", fn, inputs, grads=("x",), **fixed)
    check(results, max_position=rows + L)
    if rd < D:  # the features past rotary_dim pass through bit for bit
        assert torch.equal(results["out"][0][..., rd:], x[..., rd:])


@ON_TORCH
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16), ids=_DT.get)
@pytest.mark.parametrize("interleaved", (False, True), ids=("neox", "gptj"))
def test_apply_rotary_in_place(backend, dtype, interleaved):
    """inplace=True writes x through its view ((B, L, H, D) storage passed transposed), with
    and without autograd."""
    gen = torch.Generator().manual_seed(4)
    blhd = randn(2, 7, 3, 16, dtype=dtype, generator=gen)
    kw = dict(offset=torch.tensor([3, 40]), rotary_dim=12, interleaved=interleaved)

    def fn(x, backend):
        target = x.transpose(1, 2) * 1.0  # a non-leaf, written in place
        y = fastattn.apply_rotary(target, inplace=True, backend=backend, **kw)
        assert y is target
        return y

    check(run_three(backend, "apply_rotary", fn, {"x": blhd}, grads=("x",)), max_position=47)
    storage = blhd.clone()
    with torch.no_grad():
        fastattn.apply_rotary(storage.transpose(1, 2), inplace=True, backend=backend, **kw)
    ref64 = fastattn.apply_rotary(blhd.double().transpose(1, 2), backend="reference", **kw)
    lowp = fastattn.apply_rotary(blhd.transpose(1, 2), backend="reference", **kw)
    check({"out": (storage.transpose(1, 2), ref64, lowp)})


def test_apply_rotary_in_place_on_a_leaf_that_needs_grad_raises():
    x = randn(1, 1, 4, 4).requires_grad_()
    with pytest.raises(RuntimeError, match="leaf"):
        fastattn.apply_rotary(x, inplace=True, backend="torch")


# ---------------------------------------------------------------------------------------------
# The checks have teeth: scaled results fail them


def _teeth_cases(dtype):
    gen = torch.Generator().manual_seed(5)
    x = randn(2, 24, 16, dtype=dtype, generator=gen)
    tokens = torch.randint(0, 30, (2, 24), generator=gen)
    weight = randn(30, 16, dtype=dtype, generator=gen)
    table = randn(40, 16, dtype=dtype, generator=gen)
    xr = randn(2, 3, 24, 16, dtype=dtype, generator=gen)
    offsets = torch.tensor([3, 11])
    return {
        "add_sinusoidal": run_three(
            "torch",
            "add_sinusoidal",
            lambda x, backend: fastattn.add_sinusoidal(
                x, offset=offsets, scale=4.0, backend=backend
            ),
            {"x": x},
            grads=("x",),
        ),
        "embed_with_positions": run_three(
            "torch",
            "embed_with_positions",
            lambda weight, positions, backend: fastattn.embed_with_positions(
                tokens, weight, positions=positions, offset=offsets, scale=2.0, backend=backend
            ),
            {"weight": weight, "positions": table},
            grads=("weight", "positions"),
        ),
        "apply_rotary": run_three(
            "torch",
            "apply_rotary",
            lambda x, backend: fastattn.apply_rotary(x, offset=offsets, backend=backend),
            {"x": xr},
            grads=("x",),
        ),
    }


@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16), ids=_DT.get)
def test_the_checks_have_teeth(dtype):
    """Each output and gradient, scaled by 0 and by 1.25 (16-bit) or 1 + 1e-3 (float32), fails
    the check that the unscaled result passes."""
    factors = (0.0, 1.0 + 1e-3) if dtype == torch.float32 else (0.0, 1.25)
    for results in _teeth_cases(dtype).values():
        check(results)
        for name in results:
            for factor in factors:
                with pytest.raises(AssertionError, match=name):
                    check(results, tamper={name: factor})


# ---------------------------------------------------------------------------------------------
# Refusals and the backend choice


@pytest.mark.parametrize("op", ("add_sinusoidal", "embed_with_positions"))
def test_dropout_is_refused(op):
    """torch's dropout draws another mask than fastattn's Philox stream."""
    x = randn(2, 3, 4)
    calls = {
        "add_sinusoidal": lambda: fastattn.add_sinusoidal(x, dropout_p=0.1, backend="torch"),
        "embed_with_positions": lambda: fastattn.embed_with_positions(
            torch.tensor([[0, 1]]), x[0], dropout_p=0.1, backend="torch"
        ),
    }
    with pytest.raises(BackendError, match=rf"{op}: backend 'torch' cannot run .*dropout_p > 0"):
        calls[op]()
    with fastattn.use_backend("torch"), pytest.raises(BackendError, match="Philox"):
        calls[op]()


def test_deterministic_embedding_backward_on_cuda_is_refused():
    """On CUDA, torch's embedding backward is deterministic only under
    torch.use_deterministic_algorithms(True) (checked on fake CUDA tensors)."""
    with fake_cuda():
        weight = torch.randn(5, 4, device="cuda", requires_grad=True)
        tokens = torch.tensor([[0, 1]], device="cuda")
        with pytest.raises(BackendError, match="deterministic=True on CUDA"):
            fastattn.embed_with_positions(tokens, weight, deterministic=True, backend="torch")


OPS = ("sinusoidal_table", "add_sinusoidal", "embed_with_positions", "apply_rotary")


def _call(op: str, backend=None):
    x = randn(2, 3, 4)
    return {
        "sinusoidal_table": lambda: fastattn.sinusoidal_table(3, 4, backend=backend),
        "add_sinusoidal": lambda: fastattn.add_sinusoidal(x, backend=backend),
        "embed_with_positions": lambda: fastattn.embed_with_positions(
            torch.tensor([[0, 1]]), x[0], backend=backend
        ),
        "apply_rotary": lambda: fastattn.apply_rotary(x.view(1, 2, 3, 4), backend=backend),
    }[op]()


@pytest.mark.parametrize("op", OPS)
def test_forced_calls_run_torch_and_the_default_runs_fastattns_kernel(op):
    _call(op, backend="torch")
    assert fastattn.last_backend(op) == "torch"
    _call(op)  # no speed table is shipped: fastattn's CPU kernel
    assert fastattn.last_backend(op) == "cpu"
    with fastattn.use_backend("torch"):
        _call(op)
    assert fastattn.last_backend(op) == "torch"


def test_a_speed_table_entry_sends_the_automatic_choice_to_torch(monkeypatch):
    """The speed key each op computes is the one a table entry matches: an entry marking
    torch faster for add_sinusoidal's key moves that call (and only calls with that key)."""
    monkeypatch.setattr(_backend, "AUTO_MODE", "table")  # conftest.py turns the table off
    cpu = torch.device("cpu")
    key = dict(speed_table.key("add_sinusoidal", torch.float32, length=3))
    entry = dict(key, kernel="cpu", faster="torch", ratio=2.0)
    table = {"device_class": speed_table.device_class(cpu), "entries": [entry], "module": "t"}
    speed_table.reset()
    monkeypatch.setattr(speed_table, "_tables", [table])
    try:
        fastattn.add_sinusoidal(randn(2, 3, 4))
        assert fastattn.last_backend("add_sinusoidal") == "torch"
        fastattn.add_sinusoidal(randn(2, 3, 4), offset=torch.tensor([0, 1]))  # another key
        assert fastattn.last_backend("add_sinusoidal") == "cpu"
        fastattn.add_sinusoidal(randn(2, 3, 4), dropout_p=0.5)  # refused: never torch
        assert fastattn.last_backend("add_sinusoidal") == "cpu"
    finally:
        monkeypatch.undo()
        speed_table.reset()


def test_no_host_reads_of_cuda_tensors():
    """On CUDA tensors (fake ones here) the torch backend reads no value on the host (no
    synchronisation): int and tensor offsets, position_ids, tables, in place; and the fake
    tensors stay out of the table cache."""
    aten_positional.clear_cache()
    with fake_cuda() as recorder:
        x = torch.randn(2, 5, 8, device="cuda")
        offsets = torch.tensor([1, 2], device="cuda")
        fastattn.add_sinusoidal(x, offset=3, backend="torch")
        fastattn.add_sinusoidal(x, offset=offsets, inplace=True, backend="torch")
        xr = torch.randn(2, 3, 5, 8, device="cuda")
        fastattn.apply_rotary(xr, offset=offsets, backend="torch")
        cos, sin = torch.randn(16, 4, device="cuda"), torch.randn(16, 4, device="cuda")
        ids = torch.randint(0, 16, (2, 5), device="cuda")
        fastattn.apply_rotary(xr, cos=cos, sin=sin, position_ids=ids, backend="torch")
        tokens = torch.randint(0, 4, (2, 5), device="cuda")
        weight = torch.randn(4, 8, device="cuda")
        fastattn.embed_with_positions(tokens, weight, offset=offsets, backend="torch")
        fastattn.embed_with_positions(
            tokens,
            weight,
            positions=torch.randn(9, 8, device="cuda"),
            offset=offsets,
            backend="torch",
        )
        assert fastattn.last_backend("embed_with_positions") == "torch"
    assert_no_host_reads(recorder)
    assert not aten_positional._tables
