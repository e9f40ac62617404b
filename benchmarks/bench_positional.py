"""Positional-encoding benchmarks: fused add_sinusoidal / embed_with_positions / apply_rotary
against the eager PyTorch way of writing them and torch.compile of that.

Run through the CLI (`python benchmarks/run.py --ops positional`) or with pytest-benchmark
(`pytest benchmarks/bench_positional.py`). Throughput is memory traffic (each input read
once, each output written once) per second; on GPU also as a fraction of the device's
measured copy bandwidth.
"""
from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

import fastattn
from common import Case, copy_bandwidth, fastattn_backends, relative_error

# ---------------------------------------------------------------------------------------------
# The eager PyTorch implementations users write today


def eager_sinusoid_table(max_len: int, d: int, device, dtype) -> torch.Tensor:
    """The PyTorch-tutorial PositionalEncoding buffer (max_len, d)."""
    position = torch.arange(max_len, device=device).unsqueeze(1).float()
    div_term = torch.exp(torch.arange(0, d, 2, device=device).float() * (-math.log(10000.0) / d))
    pe = torch.zeros(max_len, d, device=device)
    pe[:, 0::2] = torch.sin(position * div_term)
    pe[:, 1::2] = torch.cos(position * div_term[: d // 2])
    return pe.to(dtype)


def eager_add_sinusoidal(x, pe, scale, p):
    return F.dropout(x * scale + pe[: x.shape[1]], p, training=p > 0)


def eager_embed(tokens, weight, pe, scale, p):
    return F.dropout(F.embedding(tokens, weight) * scale + pe[: tokens.shape[1]], p, training=p > 0)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def eager_rotary(x, cos, sin):
    """Hugging Face's apply_rotary_pos_emb for one tensor; cos/sin (L, D) (halves repeated)."""
    return x * cos + rotate_half(x) * sin


@functools.lru_cache(maxsize=None)
def compiled(fn):
    return torch.compile(fn, dynamic=False)


# ---------------------------------------------------------------------------------------------
# Cases


def _element_size(dtype):
    return torch.tensor([], dtype=dtype).element_size()


def add_sinusoidal_case(B, L, D, dtype, p, device, backward=False, copy_gbs=None) -> Case:
    x = torch.randn(B, L, D, device=device, dtype=dtype, requires_grad=backward)
    grad = torch.randn(B, L, D, device=device, dtype=dtype)
    pe = eager_sinusoid_table(L, D, device, dtype)
    scale = math.sqrt(D)

    def make(p_):
        def wrap(fwd):
            if not backward:
                return lambda: fwd()
            return lambda: torch.autograd.grad(fwd(), x, grad)[0]
        providers = {f"fastattn:{b}": wrap(lambda b=b: fastattn.add_sinusoidal(
            x, scale=scale, dropout_p=p_, backend=b)) for b in fastattn_backends(device)}
        providers["torch eager"] = wrap(lambda: eager_add_sinusoidal(x, pe, scale, p_))
        providers["torch.compile"] = wrap(lambda: compiled(eager_add_sinusoidal)(x, pe, scale, p_))
        return providers

    nbytes = 2 * B * L * D * _element_size(dtype) * (2 if backward else 1)
    return Case(op="add_sinusoidal" + (" fwd+bwd" if backward else ""),
                name=f"B={B} L={L} D={D} p={p}", providers=make(p), check_providers=make(0.0),
                reference="torch eager", baselines=("torch eager", "torch.compile"),
                bytes=nbytes, check=relative_error,
                tolerance=1e-5 if dtype == torch.float32 else 2e-2, dtype=str(dtype)[6:],
                notes={"copy_GB/s": str(copy_gbs)} if copy_gbs else {})


def embed_case(B, L, D, V, dtype, p, device, backward=False, copy_gbs=None) -> Case:
    tokens = torch.randint(0, V, (B, L), device=device)
    weight = torch.randn(V, D, device=device, dtype=dtype, requires_grad=backward)
    grad = torch.randn(B, L, D, device=device, dtype=dtype)
    pe = eager_sinusoid_table(L, D, device, dtype)
    scale = math.sqrt(D)

    def make(p_):
        def wrap(fwd):
            if not backward:
                return lambda: fwd()
            return lambda: torch.autograd.grad(fwd(), weight, grad)[0]
        providers = {f"fastattn:{b}": wrap(lambda b=b: fastattn.embed_with_positions(
            tokens, weight, scale=scale, dropout_p=p_, backend=b)) for b in fastattn_backends(device)}
        providers["torch eager"] = wrap(lambda: eager_embed(tokens, weight, pe, scale, p_))
        providers["torch.compile"] = wrap(lambda: compiled(eager_embed)(tokens, weight, pe, scale, p_))
        return providers

    # Rows gathered + output written (+ the gradient read and the weight gradient written).
    nbytes = 2 * B * L * D * _element_size(dtype)
    if backward:
        nbytes += B * L * D * _element_size(dtype) + V * D * _element_size(dtype)
    return Case(op="embed_with_positions" + (" fwd+bwd" if backward else ""),
                name=f"B={B} L={L} D={D} V={V} p={p}", providers=make(p), check_providers=make(0.0),
                reference="torch eager", baselines=("torch eager", "torch.compile"),
                bytes=nbytes, check=relative_error,
                tolerance=1e-5 if dtype == torch.float32 else 2e-2, dtype=str(dtype)[6:],
                notes={"copy_GB/s": str(copy_gbs)} if copy_gbs else {})


def rotary_case(B, H, L, D, dtype, device, copy_gbs=None) -> Case:
    x = torch.randn(B, H, L, D, device=device, dtype=dtype)
    inv = 1.0 / (10000.0 ** (torch.arange(0, D, 2, device=device).float() / D))
    freqs = torch.arange(L, device=device).float()[:, None] * inv
    cos_half, sin_half = freqs.cos(), freqs.sin()
    cos_full = torch.cat((cos_half, cos_half), -1).to(dtype)
    sin_full = torch.cat((sin_half, sin_half), -1).to(dtype)
    providers = {f"fastattn:{b}": (lambda b=b: fastattn.apply_rotary(
        x, cos=cos_half, sin=sin_half, backend=b)) for b in fastattn_backends(device)}
    providers["torch eager (HF rotate_half)"] = lambda: eager_rotary(x, cos_full, sin_full)
    providers["torch.compile"] = lambda: compiled(eager_rotary)(x, cos_full, sin_full)
    return Case(op="apply_rotary", name=f"B={B} H={H} L={L} D={D}", providers=providers,
                reference="torch eager (HF rotate_half)",
                baselines=("torch eager (HF rotate_half)", "torch.compile"),
                bytes=2 * x.numel() * _element_size(dtype), check=relative_error,
                tolerance=1e-5 if dtype == torch.float32 else 2e-2, dtype=str(dtype)[6:],
                notes={"copy_GB/s": str(copy_gbs)} if copy_gbs else {})


def cases(profile: str, device: torch.device) -> list[Case]:
    copy_gbs = copy_bandwidth(device) / 1e9 if device.type == "cuda" else None
    f32, bf16 = torch.float32, torch.bfloat16
    if device.type == "cuda":
        out = [add_sinusoidal_case(64, 2048, 1024, f32, 0.1, device, copy_gbs=copy_gbs),
               add_sinusoidal_case(64, 2048, 1024, bf16, 0.1, device, copy_gbs=copy_gbs),
               add_sinusoidal_case(64, 2048, 1024, f32, 0.0, device, copy_gbs=copy_gbs),
               embed_case(64, 2048, 1024, 32000, bf16, 0.1, device, copy_gbs=copy_gbs),
               rotary_case(16, 32, 2048, 128, bf16, device, copy_gbs=copy_gbs)]
        if profile == "full":
            out += [add_sinusoidal_case(64, 2048, 1024, bf16, 0.1, device, backward=True,
                                        copy_gbs=copy_gbs),
                    embed_case(64, 2048, 1024, 32000, bf16, 0.1, device, backward=True),
                    rotary_case(16, 32, 2048, 64, f32, device, copy_gbs=copy_gbs)]
        return out
    # CPU: the target case first (B=32, L=512, D=512, fp32, dropout).
    out = [add_sinusoidal_case(32, 512, 512, f32, 0.1, device),
           add_sinusoidal_case(32, 512, 512, f32, 0.0, device),
           embed_case(32, 512, 512, 32000, f32, 0.1, device),
           rotary_case(8, 16, 512, 128, f32, device)]
    if profile == "full":
        out += [add_sinusoidal_case(32, 512, 512, bf16, 0.1, device),
                add_sinusoidal_case(32, 512, 512, f32, 0.1, device, backward=True),
                embed_case(32, 512, 512, 32000, f32, 0.1, device, backward=True),
                rotary_case(8, 16, 512, 128, bf16, device)]
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
    _bench_case(benchmark, add_sinusoidal_case(32, 512, 512, torch.float32, 0.1, device),
                "torch eager")


def test_apply_rotary_fastattn(benchmark):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    case = rotary_case(8, 16, 512, 128, torch.float32, device)
    _bench_case(benchmark, case, f"fastattn:{fastattn_backends(device)[0]}")


def test_apply_rotary_eager(benchmark):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    _bench_case(benchmark, rotary_case(8, 16, 512, 128, torch.float32, device),
                "torch eager (HF rotate_half)")
