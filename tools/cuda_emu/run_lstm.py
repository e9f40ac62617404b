"""Runs the CUDA recurrent op bodies and kernels (csrc/recurrent/recurrent_cuda.cu and
csrc/{lstm,gru,rnn}/*_cuda.cu) on the CPU (tools/cuda_emu/emu_lstm.h) and compares them with
the float64 PyTorch reference (fastattn/reference/lstm.py).

    flock /tmp/fastattn-build.lock /work/main/.venv/bin/python tools/cuda_emu/run_lstm.py --build
    PYTHONPATH=. /work/main/.venv/bin/python tools/cuda_emu/run_lstm.py [--only SUBSTRING]

The GRU (both reset placements) and the Elman RNN (tanh, relu) run on the same engine
(gru_layer / rnn_layer, the cell a template parameter of the kernels): gated_case below, the
same paths and devices, and against fastattn's CPU kernels.

Each case runs lstm_layer forward + backward (all four outputs and all seven gradients) on the
emulated device under a given recurrent path (persistent: the cooperative kernel, checked to
have been launched; per_step: FASTATTN_LSTM_CUDA_PATH=per_step), and lstm_cell forward +
backward on the fused (B <= 8) and GEMM paths. The emulated device can be shrunk (fewer SMs, less
shared memory) to force larger unit blocks U or the per-step fallback.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from fastattn.reference import gru as ref_gru  # noqa: E402
from fastattn.reference import lstm as ref  # noqa: E402
from fastattn.reference import rnn as ref_rnn  # noqa: E402

BUILD = os.environ.get("CUDA_EMU_BUILD", "/tmp/fastattn_cuda_emu_lstm")


def build():
    here = Path(__file__).resolve().parent
    os.makedirs(BUILD, exist_ok=True)
    return load(
        name="fastattn_emu_lstm",
        sources=[str(here / "emu_lstm.cpp")],
        extra_include_paths=[str(ROOT / "csrc"), str(here)],
        extra_cflags=["-O2", "-std=c++20", "-w", "-DFASTATTN_DEBUG_CHECKS=1"],
        extra_ldflags=["-lpthread"],
        build_directory=BUILD,
        verbose=False,
    )


def rel_err(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-6)) if b.numel() else 0.0


def layer_case(emu, name, T, B, I, H, D, proj, lengths, p, dtype, path, tol):
    torch.manual_seed(hash(name) % 2**31)
    P = proj or H
    mk = lambda *s: torch.randn(*s, dtype=torch.float64) * 0.5  # noqa: E731
    x, h0, c0 = mk(T, B, I), mk(D, B, P), mk(D, B, H)
    w_ih, w_hh, b_ih, b_hh = mk(D, 4 * H, I), mk(D, 4 * H, P), mk(D, 4 * H), mk(D, 4 * H)
    w_hr = mk(D, P, H) if proj else None
    lens = torch.tensor(lengths, dtype=torch.int64) if lengths is not None else None
    seed = torch.tensor([1234, 5], dtype=torch.int64) if p > 0 else None
    args = [x, h0, c0, w_ih, w_hh, b_ih, b_hh, w_hr]
    # float64 reference on the values rounded to dtype
    ref_in = [
        t.to(dtype).double().clone().requires_grad_() if t is not None else None for t in args
    ]
    out_r, hn_r, cn_r = ref.lstm_layer(*ref_in, lens, p, seed)
    g_out, g_hn, g_cn = torch.randn_like(out_r), torch.randn_like(hn_r), torch.randn_like(cn_r)
    torch.autograd.backward([out_r, hn_r, cn_r], [g_out, g_hn, g_cn])
    if path == "per_step":
        os.environ["FASTATTN_LSTM_CUDA_PATH"] = "per_step"
    else:
        os.environ.pop("FASTATTN_LSTM_CUDA_PATH", None)
    lo = [t.to(dtype) if t is not None else None for t in args]
    # launch_fallback: the query predicts persistent, the cooperative launch fails on the device
    # (fewer SMs usable than reported), the op warns and runs per step
    want = 0 if path in ("persistent", "launch_fallback") else 1
    launches = {"persistent": (1, 2), "launch_fallback": (0, 0)}.get(path, (0, 0))
    got_path = torch.ops.fastattn_emu.lstm_cuda_path(lo[0], lo[4], lo[7])
    assert got_path == want, f"{name}: lstm_cuda_path {got_path}, expected {want}"
    got_bwd = torch.ops.fastattn_emu.lstm_cuda_path(lo[0], lo[4], lo[7], True)
    assert got_bwd == want, f"{name}: lstm_cuda_path(backward) {got_bwd}, expected {want}"
    coop0 = emu.cooperative_launches()
    out, hn, cn, ws = torch.ops.fastattn_emu.lstm_layer(*lo, lens, p, seed, True)
    assert emu.cooperative_launches() - coop0 == launches[0], f"{name}: wrong path ran"
    grads = torch.ops.fastattn_emu.lstm_layer_backward(
        g_out.to(dtype),
        g_hn.to(dtype),
        g_cn.to(dtype),
        lo[0],
        lo[1],
        lo[2],
        lo[3],
        lo[4],
        lo[7],
        lens,
        ws,
        p,
        seed,
        True,
        True,
        True,
    )
    assert emu.cooperative_launches() - coop0 == launches[1], f"{name}: wrong backward path ran"
    gi, gh0, gc0, gwih, gwhh, gb, gwhr = grads
    checks = [
        ("output", out, out_r),
        ("h_n", hn, hn_r),
        ("c_n", cn, cn_r),
        ("grad_input", gi, ref_in[0].grad),
        ("grad_h0", gh0, ref_in[1].grad),
        ("grad_c0", gc0, ref_in[2].grad),
        ("grad_w_ih", gwih, ref_in[3].grad),
        ("grad_w_hh", gwhh, ref_in[4].grad),
        ("grad_bias", gb, ref_in[5].grad),
    ]
    if proj:
        checks.append(("grad_w_hr", gwhr, ref_in[7].grad))
    worst = 0.0
    for label, got, exp in checks:
        assert got.shape == exp.shape, (
            f"{name}: {label} shape {tuple(got.shape)} != {tuple(exp.shape)}"
        )
        assert not torch.isnan(got).any(), f"{name}: {label} has NaN (an unwritten element)"
        e = rel_err(got, exp)
        worst = max(worst, e)
        assert e <= tol, f"{name}: {label} relative error {e:.3g} > {tol}"
    return worst


# family, variant, gate count, workspace extra columns, recurrent_cuda_path's cell name
GATED = {
    "gru": ("gru", True, 3, "gru"),
    "gru_reset_before": ("gru", False, 3, "gru_reset_before"),
    "rnn_tanh": ("rnn", "tanh", 1, "rnn_tanh"),
    "rnn_relu": ("rnn", "relu", 1, "rnn_relu"),
}


def gated_case(emu, name, cell, T, B, I, H, D, lengths, p, dtype, path, tol, bias=True):
    """gru_layer / rnn_layer forward + backward on the emulated device against the float64
    reference: output, h_n and every gradient (both bias gradients apart)."""
    family, variant, G, path_cell = GATED[cell]
    torch.manual_seed(hash(name) % 2**31)
    mk = lambda *s: torch.randn(*s, dtype=torch.float64) * 0.5  # noqa: E731
    x, h0 = mk(T, B, I), mk(D, B, H)
    w_ih, w_hh = mk(D, G * H, I), mk(D, G * H, H)
    b_ih, b_hh = (mk(D, G * H), mk(D, G * H)) if bias else (None, None)
    if cell == "rnn_relu":  # keep the relu's kinks away from the rounding of the inputs
        x = x.abs() + 0.1
    lens = torch.tensor(lengths, dtype=torch.int64) if lengths is not None else None
    seed = torch.tensor([1234, 5], dtype=torch.int64) if p > 0 else None
    args = [x, h0, w_ih, w_hh, b_ih, b_hh]
    ref_in = [
        t.to(dtype).double().clone().requires_grad_() if t is not None else None for t in args
    ]
    reference = ref_gru.gru_layer if family == "gru" else ref_rnn.rnn_layer
    out_r, hn_r = reference(*ref_in, lens, p, seed, variant)
    g_out, g_hn = torch.randn_like(out_r), torch.randn_like(hn_r)
    torch.autograd.backward([out_r, hn_r], [g_out, g_hn])
    if path == "per_step":
        os.environ["FASTATTN_LSTM_CUDA_PATH"] = "per_step"
    else:
        os.environ.pop("FASTATTN_LSTM_CUDA_PATH", None)
    lo = [t.to(dtype) if t is not None else None for t in args]
    want = 0 if path == "persistent" else 1
    for backward in (False, True):
        got = torch.ops.fastattn_emu.recurrent_cuda_path(lo[0], lo[3], path_cell, backward)
        assert got == want, f"{name}: recurrent_cuda_path({backward=}) {got}, expected {want}"
    launches = (1, 2) if path == "persistent" else (0, 0)
    ops = torch.ops.fastattn_emu
    layer = getattr(ops, f"{family}_layer")
    layer_backward = getattr(ops, f"{family}_layer_backward")
    coop0 = emu.cooperative_launches()
    out, hn, ws = layer(*lo, lens, p, seed, variant, True)
    assert emu.cooperative_launches() - coop0 == launches[0], f"{name}: wrong path ran"
    grads = layer_backward(
        g_out.to(dtype), g_hn.to(dtype), *lo[:4], lens, ws, p, seed, variant, bias, True, True
    )
    assert emu.cooperative_launches() - coop0 == launches[1], f"{name}: wrong backward path ran"
    gi, gh0, gwih, gwhh, gbih, gbhh = grads
    checks = [
        ("output", out, out_r),
        ("h_n", hn, hn_r),
        ("grad_input", gi, ref_in[0].grad),
        ("grad_h0", gh0, ref_in[1].grad),
        ("grad_w_ih", gwih, ref_in[2].grad),
        ("grad_w_hh", gwhh, ref_in[3].grad),
    ]
    if bias:
        checks += [("grad_b_ih", gbih, ref_in[4].grad), ("grad_b_hh", gbhh, ref_in[5].grad)]
    worst = 0.0
    for label, got, exp in checks:
        assert got.shape == exp.shape, (
            f"{name}: {label} shape {tuple(got.shape)} != {tuple(exp.shape)}"
        )
        assert not torch.isnan(got).any(), f"{name}: {label} has NaN (an unwritten element)"
        e = rel_err(got, exp)
        worst = max(worst, e)
        assert e <= tol, f"{name}: {label} relative error {e:.3g} > {tol}"
    return worst


def gated_cases(emu, only, TOL):
    """The GRU and RNN cells on the engine: every cell x both paths x 132 / 1 / 8 SMs (U = 1,
    grown U, multi-chunk), lengths with 0 and T, dropout, bias on/off, every dtype."""
    base = dict(T=5, B=3, I=4, H=8, D=2, p=0.0, dtype=torch.float64)
    cases = [
        ("bidir lengths", dict(base, lengths=[5, 0, 2])),
        ("bidir dropout", dict(base, lengths=None, p=0.3)),
        ("H=7 B=5 lengths", dict(base, H=7, B=5, lengths=[5, 3, 1, 0, 4])),
        ("no bias", dict(base, D=1, lengths=[2, 5, 4], bias=False)),
        ("T=1", dict(base, T=1, lengths=None)),
        (
            "H=70 multi-chunk B=9",
            dict(
                base,
                T=3,
                B=9,
                H=70,
                lengths=[3, 1, 0, 2, 3, 3, 1, 2, 3],
                p=0.1,
                sms=(8,),
                smem=91700,
            ),
        ),
        ("B=1 many splits", dict(base, T=4, B=1, H=40, lengths=None)),
        # more rows than kPersistMaxOut per thread: fewer K splits, several rows per thread
        ("B=40 few splits", dict(base, T=3, B=40, H=24, D=1, lengths=None)),
    ]
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        cases.append((f"{dt}", dict(base, lengths=[5, 4, 2], p=0.2, dtype=dt)))
    for cell in GATED:
        for name, kw in cases:
            label0 = f"{cell} {name}"
            if only and only not in label0:
                continue
            kw = dict(kw)
            dtype = kw["dtype"]
            sms_list = kw.pop("sms", (132, 1))
            smem = kw.pop("smem", 227 * 1024)
            for path in ("persistent", "per_step"):
                for sms in sms_list if path == "persistent" else sms_list[:1]:
                    emu.set_device(sms, smem, 1)
                    label = f"{label0} [{path}, {sms} SM]"
                    t0 = time.time()
                    err = gated_case(emu, label, cell, path=path, tol=TOL[dtype], **kw)
                    took = time.time() - t0
                    print(f"ok  {label}: max rel err {err:.2e} ({took:.1f}s)", flush=True)
    emu.set_device(132, 227 * 1024, 1)
    os.environ.pop("FASTATTN_LSTM_CUDA_PATH", None)


def cell_case(emu, name, B, I, H, dtype, bias, tol):
    torch.manual_seed(hash(name) % 2**31)
    mk = lambda *s: torch.randn(*s, dtype=torch.float64) * 0.5  # noqa: E731
    args = [mk(B, I), mk(B, H), mk(B, H), mk(4 * H, I), mk(4 * H, H)]
    args += [mk(4 * H), mk(4 * H)] if bias else [None, None]
    ref_in = [
        t.to(dtype).double().clone().requires_grad_() if t is not None else None for t in args
    ]
    hy_r, cy_r = ref.lstm_cell(*ref_in)
    ghy, gcy = torch.randn_like(hy_r), torch.randn_like(cy_r)
    torch.autograd.backward([hy_r, cy_r], [ghy, gcy])
    lo = [t.to(dtype) if t is not None else None for t in args]
    hy, cy, ws = torch.ops.fastattn_emu.lstm_cell(*lo)
    g = torch.ops.fastattn_emu.lstm_cell_backward(ghy.to(dtype), gcy.to(dtype), *lo[:5], ws, bias)
    checks = [
        ("hy", hy, hy_r),
        ("cy", cy, cy_r),
        ("grad_input", g[0], ref_in[0].grad),
        ("grad_hx", g[1], ref_in[1].grad),
        ("grad_cx", g[2], ref_in[2].grad),
        ("grad_w_ih", g[3], ref_in[3].grad),
        ("grad_w_hh", g[4], ref_in[4].grad),
    ]
    if bias:
        checks.append(("grad_bias", g[5], ref_in[5].grad))
    worst = 0.0
    for label, got, exp in checks:
        assert not torch.isnan(got).any(), f"{name}: {label} has NaN"
        e = rel_err(got, exp)
        worst = max(worst, e)
        assert e <= tol, f"{name}: {label} relative error {e:.3g} > {tol}"
    return worst


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--build", action="store_true", help="only build the extension")
    ap.add_argument("--only", default="")
    a = ap.parse_args()
    emu = build()
    if a.build:
        return
    TOL = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 5e-3}
    if a.only == "cpu":
        against_cpu_kernels()
        return
    if a.only.startswith(("gru", "rnn")):
        gated_cases(emu, a.only, TOL)
        gated_against_cpu_kernels()
        print("all emulated GRU/RNN cases passed")
        return
    cases = []
    for dt in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        cases.append(
            (
                f"fwd-only-shape D1 {dt}",
                dict(T=5, B=3, I=4, H=8, D=1, proj=0, lengths=None, p=0.0, dtype=dt),
            )
        )
    base = dict(T=6, B=3, I=5, H=8, D=2, proj=0, p=0.0, dtype=torch.float64)
    cases += [
        ("bidir", dict(base, lengths=None)),
        ("bidir lengths", dict(base, lengths=[6, 0, 3])),
        ("bidir lengths dropout", dict(base, lengths=[2, 6, 1], p=0.3)),
        ("H not a multiple of U, B=5", dict(base, H=7, B=5, lengths=[7 - 1, 3, 6, 0, 2])),
        (
            "float32 bidir lengths dropout",
            dict(base, lengths=[6, 4, 5], p=0.25, dtype=torch.float32),
        ),
        ("T=1", dict(base, T=1, lengths=None)),
        # 8 SMs: U = 32 (128 gate columns), two K splits in the forward, eight in the backward,
        # rows j > 0 per thread; 91700 bytes of shared memory leave room for chunks of 20
        # columns of h (4 chunks) and 16 of the dgates (18 chunks)
        (
            "H=70 multi-chunk B=9",
            dict(
                base,
                T=4,
                B=9,
                H=70,
                lengths=[4, 1, 0, 3, 4, 2, 4, 4, 1],
                p=0.1,
                sms=(8,),
                smem=91700,
            ),
        ),
        # B=1 on 132 SMs: the most K splits (a thread group per few columns of K)
        ("B=1 many splits", dict(base, T=5, B=1, H=40, lengths=None)),
        (
            "float32 H=70 multi-chunk B=9",
            dict(base, T=3, B=9, H=70, lengths=None, dtype=torch.float32, sms=(8,)),
        ),
    ]
    results = []
    for name, kw in cases:
        if a.only and a.only not in name:
            continue
        kw = dict(kw)
        dtype = kw["dtype"]
        sms_list = kw.pop("sms", (132, 1))
        smem = kw.pop("smem", 227 * 1024)
        for path in ("persistent", "per_step"):
            for sms in sms_list:
                # 1 SM: U grows until the whole grid fits in the SM's blocks
                emu.set_device(sms, smem, 1)
                label = f"{name} [{path}, {sms} SM]"
                t0 = time.time()
                err = layer_case(emu, label, path=path, tol=TOL[dtype], **kw)
                results.append((label, err, time.time() - t0))
                print(f"ok  {label}: max rel err {err:.2e} ({time.time() - t0:.1f}s)", flush=True)
    # projection: always per step (path query must say so)
    emu.set_device(132, 227 * 1024, 1)
    for dt in (torch.float64, torch.float32):
        if a.only and a.only not in "proj":
            continue
        label = f"proj bidir lengths dropout {dt}"
        err = layer_case(
            emu,
            label,
            T=5,
            B=4,
            I=3,
            H=6,
            D=2,
            proj=4,
            lengths=[5, 2, 0, 4],
            p=0.2,
            dtype=dt,
            path="per_step_auto",
            tol=TOL[dt],
        )
        print(f"ok  {label}: {err:.2e}", flush=True)
    # no cooperative launch support / shared memory too small: per-step fallback chosen
    emu.set_device(132, 227 * 1024, 0)
    err = layer_case(
        emu,
        "no cooperative launch",
        T=3,
        B=2,
        I=3,
        H=8,
        D=1,
        proj=0,
        lengths=None,
        p=0.0,
        dtype=torch.float64,
        path="per_step_auto",
        tol=1e-10,
    )
    print(f"ok  no cooperative launch -> per step: {err:.2e}")
    emu.set_device(132, 1024, 1)
    err = layer_case(
        emu,
        "tiny shared memory",
        T=3,
        B=2,
        I=3,
        H=64,
        D=1,
        proj=0,
        lengths=None,
        p=0.0,
        dtype=torch.float64,
        path="per_step_auto",
        tol=1e-10,
    )
    print(f"ok  1 KB shared memory -> per step: {err:.2e}")
    emu.set_device(132, 227 * 1024, 1, 1)
    # (the TORCH_WARN_ONCE goes to stderr: torch.ops calls do not turn it into a Python warning)
    err = layer_case(
        emu,
        "launch fallback",
        T=4,
        B=3,
        I=3,
        H=40,
        D=2,
        proj=0,
        lengths=[4, 0, 2],
        p=0.0,
        dtype=torch.float64,
        path="launch_fallback",
        tol=1e-10,
    )
    print(f"ok  cooperative launch too large at run time -> warning + per step: {err:.2e}")
    emu.set_device(132, 227 * 1024, 1)
    for B in (1, 3, 8, 9, 20):
        for dt in (torch.float64, torch.float32, torch.bfloat16):
            for bias in (True, False):
                label = f"cell B={B} {dt} bias={bias}"
                err = cell_case(emu, label, B, 5, 9, dt, bias, TOL[dt])
        print(f"ok  cell B={B} ({'fused' if B <= 8 else 'GEMM'}): all dtypes", flush=True)
    against_cpu_kernels()
    print("all emulated LSTM cases passed")
    gated_cases(emu, a.only, TOL)
    gated_against_cpu_kernels()
    print("all emulated GRU/RNN cases passed")


def against_cpu_kernels():
    """The emulated CUDA ops against fastattn's CPU ops (when this checkout's fastattn._C is
    built): float64, lengths with 0 and T, both directions, dropout, with and without a
    projection, both paths: every output and gradient to rounding (the same Philox mask)."""
    try:
        import fastattn  # noqa: F401

        _ = torch.ops.fastattn.lstm_layer
    except (ImportError, AttributeError, RuntimeError) as e:
        print(f"skip against the CPU kernels: {e}")
        return
    g = torch.Generator().manual_seed(3)
    T, B, I, H, D = 7, 6, 4, 12, 2
    lens = torch.tensor([7, 0, 3, 7, 1, 5])
    seed = torch.tensor([123, 4])
    for proj in (0, 5):
        P = proj or H
        r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64) * 0.5  # noqa: E731
        args = [
            r(T, B, I),
            r(D, B, P),
            r(D, B, H),
            r(D, 4 * H, I),
            r(D, 4 * H, P),
            r(D, 4 * H),
            r(D, 4 * H),
            r(D, P, H) if proj else None,
        ]
        gouts = [r(T, B, D * P), r(D, B, P), r(D, B, H)]
        for path in ("persistent", "per_step"):
            if path == "per_step":
                os.environ["FASTATTN_LSTM_CUDA_PATH"] = "per_step"
            else:
                os.environ.pop("FASTATTN_LSTM_CUDA_PATH", None)
            res = []
            for ops in (torch.ops.fastattn_emu, torch.ops.fastattn):
                out = ops.lstm_layer(*args, lens, 0.4, seed, True)
                grads = ops.lstm_layer_backward(
                    *gouts, *args[:5], args[7], lens, out[3], 0.4, seed, True, True, True
                )
                res.append(list(out[:3]) + list(grads))
            for i, (a, b) in enumerate(zip(*res)):
                torch.testing.assert_close(
                    a, b, rtol=1e-9, atol=1e-10, msg=lambda m: f"proj={proj} {path} output {i}: {m}"
                )
            print(f"ok  proj={proj} [{path}] = fastattn's CPU kernels (float64, dropout, lengths)")
    os.environ.pop("FASTATTN_LSTM_CUDA_PATH", None)


def gated_against_cpu_kernels():
    """The emulated CUDA gru_layer / rnn_layer against fastattn's CPU ops (float64, lengths
    with 0 and T, both directions, dropout, both paths): outputs and gradients to rounding."""
    try:
        import fastattn  # noqa: F401

        _ = torch.ops.fastattn.gru_layer
    except (ImportError, AttributeError, RuntimeError) as e:
        print(f"skip against the CPU kernels: {e}")
        return
    g = torch.Generator().manual_seed(5)
    T, B, I, H, D = 7, 6, 4, 12, 2
    lens = torch.tensor([7, 0, 3, 7, 1, 5])
    seed = torch.tensor([123, 4])
    for cell, (family, variant, G, _) in GATED.items():
        r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64) * 0.5  # noqa: E731
        args = [r(T, B, I), r(D, B, H), r(D, G * H, I), r(D, G * H, H), r(D, G * H), r(D, G * H)]
        gouts = [r(T, B, D * H), r(D, B, H)]
        for path in ("persistent", "per_step"):
            if path == "per_step":
                os.environ["FASTATTN_LSTM_CUDA_PATH"] = "per_step"
            else:
                os.environ.pop("FASTATTN_LSTM_CUDA_PATH", None)
            res = []
            for ops in (torch.ops.fastattn_emu, torch.ops.fastattn):
                layer = getattr(ops, f"{family}_layer")
                backward = getattr(ops, f"{family}_layer_backward")
                out = layer(*args, lens, 0.4, seed, variant, True)
                grads = backward(
                    *gouts, *args[:4], lens, out[2], 0.4, seed, variant, True, True, True
                )
                res.append(list(out[:2]) + list(grads))
            for i, (a, b) in enumerate(zip(*res)):
                torch.testing.assert_close(
                    a, b, rtol=1e-9, atol=1e-10, msg=lambda m: f"{cell} {path} output {i}: {m}"
                )
            print(f"ok  {cell} [{path}] = fastattn's CPU kernels (float64, dropout, lengths)")
    os.environ.pop("FASTATTN_LSTM_CUDA_PATH", None)


if __name__ == "__main__":
    main()
