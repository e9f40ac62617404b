"""Positional-encoding benchmarks: fused add_sinusoidal / embed_with_positions / apply_rotary
against the ways PyTorch users write them and torch.compile of the best of those.

Run through the CLI (`python benchmarks/run.py --ops positional`) or with pytest-benchmark
(`pytest benchmarks/bench_positional.py`). Throughput is memory traffic (each input read
once, each output written once) per second, also as a fraction of the machine's measured
copy bandwidth (common.copy_bandwidth). Every sinusoid/embedding case has an inference row
(p=0) and a training row (p>0). An out-of-place row's speedup is over the fastest out-of-place
PyTorch formulation models use (the one-pass cached-table add, the two-pass form, and
torch.compile of the one-pass form). The in-place rows (fastattn's inplace=True and PyTorch's
one-pass add written into x, marked in Case.inplace) do the same work without allocating an
output, so fastattn's in-place row is compared with PyTorch's in-place row only (common.py),
and run.py's summary shows them as their own family ("add_sinusoidal in-place").

Beside fastattn's kernels, each case times the out-of-place call through fastattn's torch
backend (fastattn:torch; left out where that backend refuses the call: dropout_p > 0, whose
mask is fastattn's Philox stream) and the automatic choice (fastattn (auto), speed table
included), and carries that call's speed key, so `--write-speed-table` records which of
fastattn's kernel and torch's was faster (the in-place rows' key, with "inplace", is not
measured: they share a case with the out-of-place call).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from common import (
    AUTO,
    TORCH_BACKEND,
    Case,
    automatic_kernel,
    copy_bandwidth,
    fastattn_backends,
    relative_error,
)

import fastattn
from fastattn.ops.positional import (
    add_sinusoidal_speed_key,
    apply_rotary_speed_key,
    embed_with_positions_speed_key,
)

# ---------------------------------------------------------------------------------------------
# The PyTorch implementations users write today


def eager_sinusoid_table(max_len: int, d: int, device, dtype) -> torch.Tensor:
    """The PyTorch-tutorial PositionalEncoding buffer (max_len, d)."""
    position = torch.arange(max_len, device=device).unsqueeze(1).float()
    div_term = torch.exp(torch.arange(0, d, 2, device=device).float() * (-math.log(10000.0) / d))
    pe = torch.zeros(max_len, d, device=device)
    pe[:, 0::2] = torch.sin(position * div_term)
    pe[:, 1::2] = torch.cos(position * div_term[: d // 2])
    return pe.to(dtype)


def _dropout(y, p, inplace=False):
    return F.dropout(y, p, training=True, inplace=inplace) if p > 0 else y


def two_pass_add_sinusoidal(x, pe, scale, p):
    """The tutorial form: x * scale, then + pe (two passes, two outputs)."""
    return _dropout(x * scale + pe[: x.shape[1]], p)


def one_pass_add_sinusoidal(x, pe, scale, p):
    """The best eager form: one pass over x against the cached table."""
    return _dropout(torch.add(pe[: x.shape[1]], x, alpha=scale), p)


def one_pass_add_sinusoidal_(x, pe, scale, p):
    """The one-pass form written into x (no output allocated)."""
    return _dropout(torch.add(pe[: x.shape[1]], x, alpha=scale, out=x), p, inplace=True)


def two_pass_embed(tokens, weight, pe, scale, p):
    return _dropout(F.embedding(tokens, weight) * scale + pe[: tokens.shape[1]], p)


def one_pass_embed(tokens, weight, pe, scale, p):
    """Lookup, then one pass adding the (cached or learned) table."""
    return _dropout(torch.add(pe[: tokens.shape[1]], F.embedding(tokens, weight), alpha=scale), p)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def eager_rotary(x, cos, sin):
    """Hugging Face's apply_rotary_pos_emb for one tensor; cos/sin (L, D) (halves repeated)."""
    return x * cos + rotate_half(x) * sin


@functools.cache
def compiled(fn):
    return torch.compile(fn, dynamic=False)


# ---------------------------------------------------------------------------------------------
# Cases

BASELINES = ("torch one-pass table", "torch two-pass", "torch.compile one-pass")
INPLACE_BASELINE = "torch one-pass table inplace"


def _element_size(dtype):
    return torch.tensor([], dtype=dtype).element_size()


def _notes(copy_gbs):
    return {"copy_GB/s": f"{copy_gbs:.1f}"} if copy_gbs else {}


def add_sinusoidal_case(B, L, D, dtype, p, device, backward=False, copy_gbs=None) -> Case:
    x = torch.randn(B, L, D, device=device, dtype=dtype, requires_grad=backward)
    # The in-place providers overwrite their own copy on every call; the values drift (to inf
    # after a few dozen calls), which does not change the time of these kernels.
    x_inplace = x.detach().clone()
    grad = torch.randn(B, L, D, device=device, dtype=dtype)
    pe = eager_sinusoid_table(L, D, device, dtype)
    scale = math.sqrt(D)

    def make(p_, check):
        def wrap(fwd):
            if not backward:
                return lambda: fwd()
            return lambda: torch.autograd.grad(fwd(), x, grad)[0]

        # Checked in-place providers write a fresh copy of x (its values stay comparable).
        buf = (lambda: x.detach().clone()) if check else (lambda: x_inplace)
        providers = {}
        for b in fastattn_backends(device):
            providers[f"fastattn:{b}"] = wrap(
                lambda b=b: fastattn.add_sinusoidal(x, scale=scale, dropout_p=p_, backend=b)
            )
            if not backward:
                providers[f"fastattn:{b} inplace"] = lambda b=b: fastattn.add_sinusoidal(
                    buf(), scale=scale, dropout_p=p_, inplace=True, backend=b
                )
        if p == 0:  # the torch backend refuses dropout (the timed call's p)
            providers[TORCH_BACKEND] = wrap(
                lambda: fastattn.add_sinusoidal(x, scale=scale, dropout_p=p_, backend="torch")
            )
        providers[AUTO] = wrap(lambda: fastattn.add_sinusoidal(x, scale=scale, dropout_p=p_))
        providers["torch one-pass table"] = wrap(lambda: one_pass_add_sinusoidal(x, pe, scale, p_))
        providers["torch two-pass"] = wrap(lambda: two_pass_add_sinusoidal(x, pe, scale, p_))
        providers["torch.compile one-pass"] = wrap(
            lambda: compiled(one_pass_add_sinusoidal)(x, pe, scale, p_)
        )
        if not backward:
            providers[INPLACE_BASELINE] = lambda: one_pass_add_sinusoidal_(buf(), pe, scale, p_)
        return providers

    inplace = [f"fastattn:{b} inplace" for b in fastattn_backends(device)] + [INPLACE_BASELINE]
    nbytes = 2 * B * L * D * _element_size(dtype) * (2 if backward else 1)
    return Case(
        op="add_sinusoidal" + (" fwd+bwd" if backward else ""),
        name=f"B={B} L={L} D={D} p={p}",
        providers=make(p, False),
        check_providers=make(0.0, True),
        reference="torch one-pass table",
        baselines=BASELINES + (() if backward else (INPLACE_BASELINE,)),
        inplace=() if backward else tuple(inplace),
        bytes=nbytes,
        check=relative_error,
        tolerance=1e-5 if dtype == torch.float32 else 2e-2,
        dtype=str(dtype)[6:],
        notes=_notes(copy_gbs),
        # the out-of-place call's key (x is already the op's canonical (N, L, D))
        speed_key=add_sinusoidal_speed_key(x, None, False, p),
        kernel=automatic_kernel("add_sinusoidal", device),
    )


def embed_case(B, L, D, V, dtype, p, device, learned=False, backward=False, copy_gbs=None) -> Case:
    tokens = torch.randint(0, V, (B, L), device=device)
    weight = torch.randn(V, D, device=device, dtype=dtype, requires_grad=backward)
    grad = torch.randn(B, L, D, device=device, dtype=dtype)
    if learned:
        pe = (0.02 * torch.randn(L, D, device=device, dtype=dtype)).requires_grad_(backward)
    else:
        pe = eager_sinusoid_table(L, D, device, dtype)
    scale = math.sqrt(D)

    def make(p_):
        def wrap(fwd):
            if not backward:
                return lambda: fwd()
            return lambda: torch.autograd.grad(fwd(), weight, grad)[0]

        positions = pe if learned else "sinusoidal"
        providers = {
            f"fastattn:{b}": wrap(
                lambda b=b: fastattn.embed_with_positions(
                    tokens, weight, positions=positions, scale=scale, dropout_p=p_, backend=b
                )
            )
            for b in fastattn_backends(device)
        }
        if p == 0:  # the torch backend refuses dropout (the timed call's p)
            providers[TORCH_BACKEND] = wrap(
                lambda: fastattn.embed_with_positions(
                    tokens, weight, positions=positions, scale=scale, dropout_p=p_, backend="torch"
                )
            )
        providers[AUTO] = wrap(
            lambda: fastattn.embed_with_positions(
                tokens, weight, positions=positions, scale=scale, dropout_p=p_
            )
        )
        providers["torch one-pass table"] = wrap(
            lambda: one_pass_embed(tokens, weight, pe, scale, p_)
        )
        providers["torch two-pass"] = wrap(lambda: two_pass_embed(tokens, weight, pe, scale, p_))
        providers["torch.compile one-pass"] = wrap(
            lambda: compiled(one_pass_embed)(tokens, weight, pe, scale, p_)
        )
        return providers

    # Rows gathered + output written (+ the gradient read and the weight gradient written).
    nbytes = 2 * B * L * D * _element_size(dtype)
    if backward:
        nbytes += B * L * D * _element_size(dtype) + V * D * _element_size(dtype)
    return Case(
        op="embed_with_positions" + (" fwd+bwd" if backward else ""),
        name=f"B={B} L={L} D={D} V={V} {'learned' if learned else 'sinusoid'} p={p}",
        providers=make(p),
        check_providers=make(0.0),
        reference="torch one-pass table",
        baselines=BASELINES,
        bytes=nbytes,
        check=relative_error,
        tolerance=1e-5 if dtype == torch.float32 else 2e-2,
        dtype=str(dtype)[6:],
        notes=_notes(copy_gbs),
        speed_key=embed_with_positions_speed_key(tokens, weight, pe if learned else None, None, p),
        kernel=automatic_kernel("embed_with_positions", device),
    )


def rotary_case(B, H, L, D, dtype, device, copy_gbs=None) -> Case:
    x = torch.randn(B, H, L, D, device=device, dtype=dtype)
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, device=device).float() / D))
    freqs = torch.arange(L, device=device).float()[:, None] * inv
    cos_half, sin_half = freqs.cos(), freqs.sin()
    cos_full = torch.cat((cos_half, cos_half), -1).to(dtype)
    sin_full = torch.cat((sin_half, sin_half), -1).to(dtype)
    providers = {
        f"fastattn:{b}": (
            lambda b=b: fastattn.apply_rotary(x, cos=cos_half, sin=sin_half, backend=b)
        )
        for b in fastattn_backends(device)
    }
    providers[TORCH_BACKEND] = lambda: fastattn.apply_rotary(
        x, cos=cos_half, sin=sin_half, backend="torch"
    )
    providers[AUTO] = lambda: fastattn.apply_rotary(x, cos=cos_half, sin=sin_half)
    providers["torch eager (HF rotate_half)"] = lambda: eager_rotary(x, cos_full, sin_full)
    providers["torch.compile"] = lambda: compiled(eager_rotary)(x, cos_full, sin_full)
    return Case(
        op="apply_rotary",
        name=f"B={B} H={H} L={L} D={D}",
        providers=providers,
        reference="torch eager (HF rotate_half)",
        baselines=("torch eager (HF rotate_half)", "torch.compile"),
        bytes=2 * x.numel() * _element_size(dtype),
        check=relative_error,
        tolerance=1e-5 if dtype == torch.float32 else 2e-2,
        dtype=str(dtype)[6:],
        notes=_notes(copy_gbs),
        # cos/sin tables given, rotary_dim = D (2 * cos_half.shape[1]), NeoX layout
        speed_key=apply_rotary_speed_key(x, cos_half, None, None, D, False, False),
        kernel=automatic_kernel("apply_rotary", device),
    )


def cases(profile: str, device: torch.device) -> list[Case]:
    # The ceiling: a copy between preallocated buffers of one case's size (on CPU 32 MiB, which
    # stays in this machine's large L3 as the cases do; on GPU 256 MiB).
    copy_gbs = copy_bandwidth(device, 1 << 28 if device.type == "cuda" else 1 << 25) / 1e9
    f32, bf16 = torch.float32, torch.bfloat16
    if device.type == "cuda":
        out = []
        for p in (0.0, 0.1):
            out += [
                add_sinusoidal_case(64, 2048, 1024, f32, p, device, copy_gbs=copy_gbs),
                add_sinusoidal_case(64, 2048, 1024, bf16, p, device, copy_gbs=copy_gbs),
                embed_case(64, 2048, 1024, 32000, bf16, p, device, copy_gbs=copy_gbs),
                embed_case(64, 2048, 1024, 32000, bf16, p, device, learned=True, copy_gbs=copy_gbs),
            ]
        out.append(rotary_case(16, 32, 2048, 128, bf16, device, copy_gbs=copy_gbs))
        if profile == "full":
            out += [
                add_sinusoidal_case(
                    64, 2048, 1024, bf16, 0.1, device, backward=True, copy_gbs=copy_gbs
                ),
                embed_case(64, 2048, 1024, 32000, bf16, 0.1, device, backward=True),
                rotary_case(16, 32, 2048, 64, f32, device, copy_gbs=copy_gbs),
            ]
        return out
    # CPU: the target case (B=32, L=512, D=512, fp32), inference (p=0) and training (p=0.1).
    out = []
    for p in (0.0, 0.1):
        out += [
            add_sinusoidal_case(32, 512, 512, f32, p, device, copy_gbs=copy_gbs),
            embed_case(32, 512, 512, 32000, f32, p, device, copy_gbs=copy_gbs),
            embed_case(32, 512, 512, 32000, f32, p, device, learned=True, copy_gbs=copy_gbs),
        ]
    out.append(rotary_case(8, 16, 512, 128, f32, device, copy_gbs=copy_gbs))
    if profile == "full":
        out += [
            add_sinusoidal_case(32, 512, 512, bf16, 0.1, device, copy_gbs=copy_gbs),
            add_sinusoidal_case(32, 512, 512, f32, 0.1, device, backward=True, copy_gbs=copy_gbs),
            embed_case(32, 512, 512, 32000, f32, 0.1, device, backward=True, copy_gbs=copy_gbs),
            rotary_case(8, 16, 512, 128, bf16, device, copy_gbs=copy_gbs),
        ]
    return out


# ---------------------------------------------------------------------------------------------
# pytest-benchmark entry points: pytest benchmarks/bench_positional.py


def _bench_case(benchmark, case: Case, provider: str):
    fn = case.providers[provider]
    if case.check and provider != case.reference:
        checked = case.check_providers or case.providers
        err = case.check(checked[provider](), checked[case.reference]())
        assert err <= case.tolerance, f"{provider}: error {err:.2e}"
    benchmark(fn)


def test_add_sinusoidal_fastattn(benchmark):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    case = add_sinusoidal_case(32, 512, 512, torch.float32, 0.1, device)
    backend = fastattn_backends(device)[0]
    _bench_case(benchmark, case, f"fastattn:{backend}")


def test_add_sinusoidal_eager(benchmark):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    _bench_case(
        benchmark,
        add_sinusoidal_case(32, 512, 512, torch.float32, 0.1, device),
        "torch one-pass table",
    )


def test_apply_rotary_fastattn(benchmark):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    case = rotary_case(8, 16, 512, 128, torch.float32, device)
    _bench_case(benchmark, case, f"fastattn:{fastattn_backends(device)[0]}")


def test_apply_rotary_eager(benchmark):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    _bench_case(
        benchmark,
        rotary_case(8, 16, 512, 128, torch.float32, device),
        "torch eager (HF rotate_half)",
    )
