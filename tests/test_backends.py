"""Tests of the backend API (fastattn/_backend.py, fastattn/__main__.py, build_info) and of the
per-ISA copies of the CPU kernels.

Behaviour that is fixed at import time (FASTATTN_BACKEND, FASTATTN_CPU_ISA, TRITON_INTERPRET)
is tested in subprocesses started with `sys.executable`, from the repository root so that they
import this checkout of fastattn.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

import fastattn

REPO = Path(__file__).resolve().parents[1]
BACKENDS = ("cuda", "triton", "cpu", "torch", "reference")


def python_env(set_vars: dict[str, str] | None = None, unset=()) -> dict[str, str]:
    env = dict(os.environ)
    for key in unset:
        env.pop(key, None)
    env.update(set_vars or {})
    return env


def run_python(
    code: str, *args: str, env: dict[str, str] | None = None, module: str | None = None
) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", module] if module else [sys.executable, "-c", code, *args]
    return subprocess.run(
        cmd, cwd=REPO, env=env or python_env(), capture_output=True, text=True, timeout=600
    )


def _add(backend=None) -> torch.Tensor:
    return fastattn.add_sinusoidal(torch.randn(2, 3, 4), backend=backend)


# ---------------------------------------------------------------------------------------------
# available_backends, build_info


def test_available_backends_keys_and_values():
    status = fastattn.available_backends()
    assert tuple(status) == BACKENDS
    for name, value in status.items():
        assert isinstance(value, str) and value, name
        if value != "available":  # a reason a person can act on
            # "not loaded": the CUDA kernels' library under a torch without CUDA
            assert value.startswith(("not available", "not built", "not loaded")), (name, value)
            assert len(value) > len("not available: "), (name, value)
    assert status["reference"] == "available"
    assert status["cpu"] == ("available" if fastattn._native.C is not None else status["cpu"])
    info = fastattn.build_info()
    cuda_ok = "error" not in info and info["cuda"] and torch.cuda.is_available()
    assert (status["cuda"] == "available") == bool(cuda_ok)
    if "error" not in info and not info["cuda"]:
        assert "not built" in status["cuda"]
    if "error" not in info and info["cuda"] and torch.version.cuda is None:
        # the CUDA kernels' library is not loaded into a torch without CUDA
        assert status["cuda"].startswith("not loaded: torch has no CUDA"), status["cuda"]
    elif "error" not in info and info["cuda"] and not torch.cuda.is_available():
        assert "no CUDA device" in status["cuda"]
    triton_expected = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
    assert (status["triton"] == "available") == triton_expected
    assert fastattn.available_backends() == status  # stable


def test_build_info():
    info = fastattn.build_info()
    assert "error" not in info, info
    for key in ("cuda", "cuda_archs", "cuda_version", "torch_version", "cpu_isa"):
        assert key in info, key
    assert isinstance(info["cuda"], bool)
    assert info["cpu_isa"] in ("base", "avx2", "avx512", "avx512bf16")
    assert isinstance(info["cpu_amx"], bool)
    assert not info["cpu_amx"] or info["cpu_isa"] == "avx512bf16"

    # Built on the stable ABI against torch torch_version, targeting torch_target: it runs under
    # any torch from the target on (docs/design/stable_abi.md), not only the one it was built with.
    def version(text):
        return tuple(int(part) for part in text.split("+")[0].split(".")[:2])

    assert info["abi"] == "stable"
    assert version(info["torch_target"]) <= version(info["torch_version"]), info
    assert version(info["torch_target"]) <= version(torch.__version__), (torch.__version__, info)
    if info["cuda"]:
        assert info["cuda_archs"] and info["cuda_version"]
        assert all(part.replace(".", "").isdigit() for part in info["cuda_version"].split("."))
    else:
        assert info["cuda_archs"] == "" and info["cuda_version"] is None
    assert fastattn.build_info() is not fastattn.build_info()  # a copy each call


# ---------------------------------------------------------------------------------------------
# use_backend, set_backend, last_backend


def test_use_backend_nests_and_restores():
    _add()
    assert fastattn.last_backend("add_sinusoidal") == "cpu"
    with fastattn.use_backend("reference"):
        _add()
        assert fastattn.last_backend("add_sinusoidal") == "reference"
        with fastattn.use_backend("cpu"):
            _add()
            assert fastattn.last_backend("add_sinusoidal") == "cpu"
            with fastattn.use_backend(None):  # automatic inside a forced context
                _add()
                assert fastattn.last_backend("add_sinusoidal") == "cpu"
        _add()
        assert fastattn.last_backend("add_sinusoidal") == "reference"
        _add(backend="cpu")  # the op's own argument wins over the context
        assert fastattn.last_backend("add_sinusoidal") == "cpu"
    _add()
    assert fastattn.last_backend("add_sinusoidal") == "cpu"


def test_use_backend_restores_after_an_exception():
    with pytest.raises(KeyError):
        with fastattn.use_backend("reference"):
            raise KeyError("boom")
    _add()
    assert fastattn.last_backend("add_sinusoidal") == "cpu"
    with pytest.raises(fastattn.BackendError):
        with fastattn.use_backend("cuda"):
            _add()  # no CUDA tensors here: cuda cannot run this call
    _add()
    assert fastattn.last_backend("add_sinusoidal") == "cpu"


def test_set_backend_and_none_restores_automatic_choice():
    fastattn.set_backend("reference")
    _add()
    assert fastattn.last_backend("add_sinusoidal") == "reference"
    with fastattn.use_backend("cpu"):  # the context wins over the process-wide choice
        _add()
        assert fastattn.last_backend("add_sinusoidal") == "cpu"
    _add()
    assert fastattn.last_backend("add_sinusoidal") == "reference"
    fastattn.set_backend(None)
    _add()
    assert fastattn.last_backend("add_sinusoidal") == "cpu"


@pytest.mark.parametrize("name", ("tpu", "CPU", "", 3, "cuda ", "triton_"))
def test_invalid_backend_names_raise_value_error(name):
    expected = "backend must be one of cuda, triton, cpu, torch, reference"
    with pytest.raises(ValueError, match=expected):
        fastattn.set_backend(name)
    with pytest.raises(ValueError, match="backend must be one of"):
        with fastattn.use_backend(name):
            pass
    with pytest.raises(ValueError, match="backend must be one of"):
        _add(backend=name)
    _add()  # the failed calls left the automatic choice in place
    assert fastattn.last_backend("add_sinusoidal") == "cpu"


def test_backend_error_is_a_runtime_error_with_a_reason():
    assert issubclass(fastattn.BackendError, RuntimeError)
    with pytest.raises(fastattn.BackendError, match=r"add_sinusoidal: backend 'cuda' cannot run"):
        _add(backend="cuda")


def test_last_backend_of_an_op_never_called_is_none():
    assert fastattn.last_backend("no_such_op") is None


def test_backend_state_is_per_thread():
    """use_backend and last_backend belong to the calling thread."""
    results = {}

    def worker():
        results["before"] = fastattn.last_backend("add_sinusoidal")
        _add()  # the main thread's use_backend("reference") does not apply here
        results["auto"] = fastattn.last_backend("add_sinusoidal")
        with fastattn.use_backend("reference"):
            _add()
        results["ctx"] = fastattn.last_backend("add_sinusoidal")

    with fastattn.use_backend("reference"):
        _add()
        thread = threading.Thread(target=worker)
        thread.start()
        thread.join()
        assert fastattn.last_backend("add_sinusoidal") == "reference"
    assert results == {"before": None, "auto": "cpu", "ctx": "reference"}
    _add(backend="cpu")
    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert fastattn.last_backend("add_sinusoidal") == "cpu"


# ---------------------------------------------------------------------------------------------
# Environment variables and `python -m fastattn` (subprocesses)


_ENV_SCRIPT = r"""
import json, torch, fastattn
x = torch.randn(2, 3, 4)
r = {"status": fastattn.available_backends()}
fastattn.add_sinusoidal(x)
r["env"] = fastattn.last_backend("add_sinusoidal")
fastattn.apply_rotary(torch.randn(1, 1, 2, 4))
r["rotary"] = fastattn.last_backend("apply_rotary")
with fastattn.use_backend("cpu"):
    fastattn.add_sinusoidal(x)
    r["context"] = fastattn.last_backend("add_sinusoidal")
fastattn.set_backend("cpu")
fastattn.add_sinusoidal(x)
r["set"] = fastattn.last_backend("add_sinusoidal")
fastattn.set_backend(None)
fastattn.add_sinusoidal(x)
r["after_set_none"] = fastattn.last_backend("add_sinusoidal")
try:
    fastattn.add_sinusoidal(x, backend="triton")
    r["triton_error"] = None
except fastattn.BackendError as exc:
    r["triton_error"] = str(exc)
print(json.dumps(r))
"""


def test_fastattn_backend_environment_variable():
    """FASTATTN_BACKEND=reference sets the default; use_backend and set_backend override it;
    set_backend(None) returns to it. Without TRITON_INTERPRET and a GPU the triton backend
    reports why it is unavailable and refuses CPU tensors."""
    env = python_env(
        {"FASTATTN_BACKEND": "reference", "CUDA_VISIBLE_DEVICES": ""}, unset=("TRITON_INTERPRET",)
    )
    proc = run_python(_ENV_SCRIPT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["env"] == "reference" and r["rotary"] == "reference"
    assert r["context"] == "cpu" and r["set"] == "cpu"
    assert r["after_set_none"] == "reference"
    assert "TRITON_INTERPRET" in r["status"]["triton"]
    assert r["status"]["triton"].startswith("not available")
    assert r["triton_error"] is not None and "TRITON_INTERPRET" in r["triton_error"]


def test_fastattn_backend_environment_variable_invalid():
    proc = run_python("import fastattn", env=python_env({"FASTATTN_BACKEND": "tpu"}))
    assert proc.returncode != 0
    assert "FASTATTN_BACKEND must be one of" in proc.stderr and "'tpu'" in proc.stderr


def test_python_m_fastattn_report():
    proc = run_python("", module="fastattn")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == f"fastattn {fastattn.__version__}"
    assert any(line.startswith("torch") and torch.__version__ in line for line in lines)
    build = [line for line in lines if line.startswith("build")]
    assert len(build) == 1, proc.stdout
    info = fastattn.build_info()
    assert f"CPU kernels: {info['cpu_isa']}" in build[0]
    assert ("CUDA not built" in build[0]) == (not info["cuda"])
    if info["cuda"]:
        assert info["cuda_archs"] in build[0] and info["cuda_version"] in build[0]
    assert "backends" in lines
    status = fastattn.available_backends()  # the subprocess inherits this environment
    for name in BACKENDS:
        assert f"  {name:<10} {status[name]}" in lines, (name, proc.stdout)
    assert any(line.startswith("device") for line in lines)


# ---------------------------------------------------------------------------------------------
# The per-ISA copies of the CPU kernels agree


_ISA_SCRIPT = r"""
import sys, torch, fastattn
out = {"isa": fastattn.build_info()["cpu_isa"]}
for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
    name = str(dtype).split(".")[-1]
    torch.manual_seed(0)
    # D = 67: full vectors of every width plus a tail
    x = torch.randn(3, 37, 67, dtype=torch.float64).to(dtype).requires_grad_()
    y = fastattn.add_sinusoidal(x, offset=torch.tensor([0, 5, 900]), scale=1.3, backend="cpu")
    y.backward(torch.randn(y.shape, dtype=torch.float64).to(dtype))
    out[f"add/{name}"], out[f"add.grad/{name}"] = y.detach(), x.grad
    torch.manual_seed(1)
    out[f"add.dropout/{name}"] = fastattn.add_sinusoidal(x.detach(), dropout_p=0.3,
                                                         backend="cpu")
    xr = torch.randn(2, 3, 19, 40, dtype=torch.float64).to(dtype).requires_grad_()
    for interleaved in (False, True):
        r = fastattn.apply_rotary(xr, rotary_dim=34, offset=7, interleaved=interleaved,
                                  backend="cpu")
        r.backward(torch.randn(r.shape, dtype=torch.float64).to(dtype))
        out[f"rotary{interleaved}/{name}"], out[f"rotary{interleaved}.grad/{name}"] = \
            r.detach(), xr.grad.clone()
        xr.grad = None
    cos = torch.randn(64, 17, dtype=torch.float64).to(dtype)
    sin = torch.randn(64, 17, dtype=torch.float64).to(dtype)
    out[f"rotary.tables/{name}"] = fastattn.apply_rotary(
        xr.detach(), cos=cos, sin=sin, position_ids=torch.randint(0, 64, (2, 19)), backend="cpu")
    tokens = torch.randint(0, 50, (3, 29))
    weight = torch.randn(50, 67, dtype=torch.float64).to(dtype).requires_grad_()
    table = torch.randn(40, 67, dtype=torch.float64).to(dtype).requires_grad_()
    for positions in ("sinusoidal", table):
        e = fastattn.embed_with_positions(tokens, weight, positions=positions, scale=2.0,
                                          offset=torch.tensor([0, 3, 11]), padding_idx=4,
                                          backend="cpu")
        e.backward(torch.randn(e.shape, dtype=torch.float64).to(dtype))
        kind = "sin" if isinstance(positions, str) else "learned"
        out[f"embed.{kind}/{name}"], out[f"embed.{kind}.grad/{name}"] = e.detach(), \
            weight.grad.clone()
        weight.grad = None
    out[f"embed.learned.table_grad/{name}"] = table.grad
    torch.manual_seed(2)
    out[f"embed.dropout/{name}"] = fastattn.embed_with_positions(
        tokens, weight.detach(), dropout_p=0.4, backend="cpu")
    out[f"table/{name}"] = fastattn.sinusoidal_table(300, 67, offset=9, dtype=dtype,
                                                     backend="cpu")
    # Attention: GQA, odd head dims and lengths (tails of every vector width), causal.
    torch.manual_seed(3)
    q = torch.randn(2, 4, 37, 19, dtype=torch.float64).to(dtype).requires_grad_()
    k = torch.randn(2, 2, 53, 19, dtype=torch.float64).to(dtype).requires_grad_()
    v = torch.randn(2, 2, 53, 23, dtype=torch.float64).to(dtype).requires_grad_()
    o = fastattn.attention(q, k, v, causal="bottom_right", backend="cpu")
    grads = torch.autograd.grad(o, (q, k, v), torch.randn(o.shape, dtype=torch.float64).to(dtype))
    out[f"attention/{name}"] = o.detach()
    for g_name, g in zip("qkv", grads):
        out[f"attention.d{g_name}/{name}"] = g
torch.save(out, sys.argv[1])
"""


def test_cpu_isa_copies_agree(tmp_path):
    """The base, avx2 and default (avx512 where the CPU has it) copies of the CPU kernels give
    the same results: to ~1e-6 relative (FMA contraction differs), one ulp after rounding to
    float16/bfloat16, and the same dropout masks."""
    runs = {}
    for isa in ("default", "base", "avx2", "avx512"):
        env = python_env(
            {"FASTATTN_CPU_ISA": isa} if isa != "default" else {}, unset=("FASTATTN_CPU_ISA",)
        )
        path = tmp_path / f"{isa}.pt"
        runs[isa] = (
            path,
            subprocess.Popen(
                [sys.executable, "-c", _ISA_SCRIPT, str(path)],
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            ),
        )
    results = {}
    for isa, (path, proc) in runs.items():
        _, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, (isa, stderr[-3000:])
        results[isa] = torch.load(path)
    default = results["default"]
    assert default["isa"] in ("base", "avx2", "avx512", "avx512bf16")
    assert results["base"]["isa"] == "base"
    assert results["avx2"]["isa"] == ("base" if default["isa"] == "base" else "avx2")
    assert results["avx512"]["isa"] == (
        "avx512" if default["isa"].startswith("avx512") else default["isa"]
    )
    keys = [k for k in default if k != "isa"]
    assert len(keys) > 40
    for isa in ("base", "avx2", "avx512"):
        for key in keys:
            a, b = results[isa][key], default[key]
            assert a.dtype == b.dtype and a.shape == b.shape, (isa, key)
            assert not torch.isnan(a).any(), (isa, key)
            if "dropout" in key:
                assert torch.equal(a == 0, b == 0), (isa, key)
            ulp = {torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}.get(a.dtype, 0.0)
            if key.startswith("attention") and a.dtype == torch.bfloat16:
                # avx512bf16 multiplies bfloat16 operands and rounds P and dS to bfloat16
                # (as the GPU kernels do); the other copies multiply in float32.
                ulp = 2.0**-4
            torch.testing.assert_close(
                a.double(),
                b.double(),
                rtol=max(1e-6, ulp),
                atol=max(1e-6, ulp),
                msg=lambda m, isa=isa, key=key: f"{isa} {key}: {m}",
            )


def test_automatic_order_on_cuda_follows_the_gpu_measurements():
    """On CUDA tensors attention and the LSTM layer try Triton first (measured 2-6x faster than
    the CUDA kernels on the first H100 run), and so do the GRU and the Elman RNN (layers and
    cells: the LSTM's Triton engine, no CUDA kernels); the other ops keep the CUDA kernels
    first; CPU tensors always get cpu, then reference."""
    from fastattn import _backend

    assert _backend.automatic_order("attention", "cuda") == ("triton", "cuda", "reference")
    for op in ("lstm", "gru", "gru_cell", "rnn", "rnn_cell"):
        assert _backend.automatic_order(op, "cuda") == ("triton", "cuda", "reference"), op
    for op in ("lstm_cell", "varlen_attention", "attention_with_kvcache", "add_sinusoidal"):
        assert _backend.automatic_order(op, "cuda") == ("cuda", "triton", "reference"), op
    for op in ("attention", "lstm", "lstm_cell", "gru", "rnn_cell"):
        assert _backend.automatic_order(op, "cpu") == ("cpu", "reference"), op


_AMX_SCRIPT = r"""
import sys, torch, fastattn
out = {"amx": fastattn.build_info()["cpu_amx"]}
torch.manual_seed(4)
# Head dims the AMX path takes (multiples of 32), lengths with tails of every block size (the
# plain forward's tiles are 128 keys), GQA, no score pipeline, causal, a window, a boolean mask
# and dropout (the score pipeline runs on the tile products' output).
for D, Lq, Lk in ((32, 37, 53), (64, 130, 97), (128, 64, 200), (64, 150, 301)):
    q = torch.randn(2, 4, Lq, D).bfloat16().requires_grad_()
    k = torch.randn(2, 2, Lk, D).bfloat16().requires_grad_()
    v = torch.randn(2, 2, Lk, D).bfloat16().requires_grad_()
    mask = torch.rand(Lq, Lk) > 0.2
    for name, kw in (("plain", {}), ("causal", dict(causal="bottom_right")),
                     ("window", dict(window=(70, 3))), ("mask", dict(attn_mask=mask)),
                     ("dropout", dict(dropout_p=0.3))):
        torch.manual_seed(5)
        o = fastattn.attention(q, k, v, backend="cpu", **kw)
        grads = torch.autograd.grad(o, (q, k, v), torch.ones_like(o))
        out[f"{name}/D{D}"] = o.detach()
        for g_name, g in zip("qkv", grads):
            out[f"{name}.d{g_name}/D{D}"] = g
torch.save(out, sys.argv[1])
"""


def test_cpu_bf16_attention_amx_agrees_with_avx512bf16(tmp_path):
    """Where the CPU and OS allow AMX, bfloat16 attention with head dims that are multiples of
    32 runs its tile products on AMX (build_info()['cpu_amx']); FASTATTN_CPU_ISA=avx512bf16
    turns that off. Both round the same operands to bfloat16 and accumulate in float32, so
    they differ only in summation order."""
    results = {}
    for mode, env in (
        ("default", python_env(unset=("FASTATTN_CPU_ISA",))),
        ("avx512bf16", python_env({"FASTATTN_CPU_ISA": "avx512bf16"})),
    ):
        path = tmp_path / f"{mode}.pt"
        proc = run_python(_AMX_SCRIPT, str(path), env=env)
        assert proc.returncode == 0, (mode, proc.stderr[-3000:])
        results[mode] = torch.load(path)
    assert results["avx512bf16"]["amx"] is False
    if not results["default"]["amx"]:
        pytest.skip("this CPU or OS does not offer AMX-BF16")
    for key, a in results["default"].items():
        if key == "amx":
            continue
        b = results["avx512bf16"][key]
        assert not torch.isnan(a).any(), key
        torch.testing.assert_close(
            a.double(), b.double(), rtol=2.0**-4, atol=2.0**-4, msg=lambda m, key=key: f"{key}: {m}"
        )
