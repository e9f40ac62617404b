"""Runs the CUDA attention kernels on the CPU emulator (cuda_emu.h) and checks them against the
float64 reference under FlashAttention's tolerance rule (tests/tolerance.py).

    PYTHONPATH=. /work/main/.venv/bin/python tools/cuda_emu/run.py [--only SUBSTRING] [--list]

The emulator compiles csrc/attention's host bodies, launchers and kernels unchanged for the CPU
(FASTATTN_CUDA_EMULATION), runs each CUDA thread as a fiber and checks shared-memory races,
uninitialised reads, cp.async ordering, global bounds and double writes (see cuda_emu.h). It is
slow (seconds per case), so the cases are small but cover every feature, dtype, head-dim bucket
and layout the kernels branch on.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
import zlib
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from tolerance import max_error, rounding_floor  # noqa: E402

from fastattn.reference import attention as ref  # noqa: E402
from fastattn.reference import attention_with_kvcache as kv_ref  # noqa: E402
from fastattn.reference import varlen_attention as varlen_ref  # noqa: E402

H100_SMEM = 227 * 1024  # opt-in shared memory per block: sm_90, sm_100
A100_SMEM = 163 * 1024  # sm_80
SMALL_SMEM = 101376  # 99 KB: sm_86, sm_89, sm_120
UNBOUNDED = 1 << 30


EMU_LIBRARY = "fastattn_emu_attention"  # emu_attention.cpp's ops: the native schemas


def emulated(ext, op: str, *args, smem: int, sm_count: int = 132):
    """torch.ops.fastattn_emu_attention.<op>(*args): the native op `op`'s CUDA body run by the
    emulator on CPU tensors, for a device with `smem` bytes of opt-in shared memory a block
    and `sm_count` multiprocessors."""
    ext.set_device(smem, sm_count)
    return getattr(getattr(torch.ops, EMU_LIBRARY), op)(*args)


def build():
    here = Path(__file__).resolve().parent
    build_dir = Path(os.environ.get("CUDA_EMU_BUILD", "/tmp/fastattn_cuda_emu"))
    build_dir.mkdir(parents=True, exist_ok=True)
    return load(
        name="fastattn_cuda_emu",
        sources=[str(here / "emu_attention.cpp"), str(here / "emu_runtime.cpp")],
        extra_include_paths=[str(ROOT / "csrc"), str(here)],
        extra_cflags=["-O1", "-std=c++20", "-fno-strict-aliasing", "-w"],
        build_directory=str(build_dir),
        verbose=False,
    )


class Case:
    def __init__(
        self,
        name,
        dtype=torch.bfloat16,
        B=1,
        Hq=2,
        Hkv=2,
        Lq=40,
        Lk=70,
        D=64,
        Dv=None,
        causal=None,
        window=None,
        mask=None,
        padding=False,
        alibi=False,
        softcap=0.0,
        dropout=0.0,
        scale=None,
        layout="bhld",
        backward=True,
        grad_lse=False,
        empty_rows=False,
        alibi_heads_only=False,
        grad_out_expanded=False,
        smem=H100_SMEM,
        expect=(),
        expect_error=None,
        mask_grad=False,
        deterministic=True,
        mask_dtype=None,
    ):
        # smem: the emulated device's shared memory per block; expect: launches the case must
        # make, each "part&part..." matched by one launcher signature (see reached());
        # expect_error: the text of the error the op must raise instead (smem below the range);
        # mask_grad: the backward also returns d attn_mask (a learned bias's gradient), checked
        # against the reference's; deterministic: the backward's flag (how d attn_mask of a
        # mask broadcast over batches / kv heads is summed); mask_dtype: a bias_* mask's dtype
        # (default the inputs').
        self.__dict__.update(locals())
        self.Dv = D if Dv is None else Dv


def canonical(c: Case, g: torch.Generator):
    """Inputs and canonical keyword arguments of the ops (as fastattn.ops.attention builds them)."""
    B, Hq, Hkv, Lq, Lk, D, Dv = c.B, c.Hq, c.Hkv, c.Lq, c.Lk, c.D, c.Dv

    def make(H, L, d):
        if c.layout == "blhd":  # a (B, L, H, D) tensor seen as (B, H, L, D)
            return torch.randn(B, L, H, d, generator=g).transpose(1, 2)
        if c.layout == "padded":  # rows of a wider buffer (row stride not a multiple of 8)
            return torch.randn(B, H, L, d + 3, generator=g)[..., :d]
        if c.layout == "padded8":  # 16-byte aligned rows, d not a multiple of 8 (partial chunks)
            return torch.randn(B, H, L, (d + 7) // 8 * 8 + 8, generator=g)[..., :d]
        return torch.randn(B, H, L, d, generator=g)

    q, k, v = make(Hq, Lq, D), make(Hkv, Lk, D), make(Hkv, Lk, Dv)
    q, k, v = (t.to(c.dtype) for t in (q, k, v))
    mask = None
    if c.mask == "bool":
        mask = (torch.rand(B, 1, Lq, Lk, generator=g) > 0.3).expand(B, Hq, Lq, Lk)
    elif c.mask == "bool_rows":  # some rows fully masked
        m = torch.rand(1, Hq, Lq, Lk, generator=g) > 0.3
        m[:, :, ::3] = False
        mask = m.expand(B, Hq, Lq, Lk)
    elif c.mask in ("float", "float32"):
        mdt = torch.float32 if c.mask == "float32" else c.dtype
        mask = torch.randn(1, Hq, Lq, Lk, generator=g).to(mdt).expand(B, Hq, Lq, Lk)
    elif c.mask == "float_shared":  # 4-D, not expanded: (1, Hq, Lq, Lk), as the ops pass it
        mask = torch.randn(1, Hq, Lq, Lk, generator=g)
    elif c.mask == "float_key":  # (B, 1, 1, Lk): broadcast over heads and queries
        mask = torch.randn(B, 1, 1, Lk, generator=g)
    elif c.mask == "float_transposed":  # strides (0, Lq, 1, Lq*Hq) style
        m = torch.randn(Lk, Hq, Lq, generator=g).permute(1, 2, 0).unsqueeze(0)
        mask = m.to(torch.float32).expand(B, Hq, Lq, Lk)
    elif c.mask is not None and c.mask.startswith("bias_"):  # learned biases, 4-D as ops pass
        shape = {
            "bias_LL": (1, 1, Lq, Lk),  # a plain (L, L) bias
            "bias_1HLL": (1, Hq, Lq, Lk),  # shared by the batch (T5, Swin)
            "bias_B1LL": (B, 1, Lq, Lk),  # shared by the heads (AlphaFold's pair bias)
            "bias_BHLL": (B, Hq, Lq, Lk),
            "bias_key": (B, 1, 1, Lk),  # broadcast over heads and queries
            "bias_query": (1, Hq, Lq, 1),  # broadcast over keys (softmax-invariant)
            "bias_expanded": (1, Hq, Lq, Lk),  # expanded: stride 0, gradient (B, Hq, Lq, Lk)
        }[c.mask]
        mask = torch.randn(shape, generator=g).to(c.mask_dtype or c.dtype)
        if c.mask == "bias_expanded":
            mask = mask.expand(B, Hq, Lq, Lk)
    padding = (torch.rand(B, Lk, generator=g) > 0.7) if c.padding else None
    if c.empty_rows and padding is not None:
        padding[0] = True  # batch 0: every key is padding
    alibi = (torch.rand(B, Hq, generator=g) * 0.3) if c.alibi else None
    if c.alibi_heads_only:  # (Hq,) slopes expanded: batch stride 0
        alibi = (torch.rand(Hq, generator=g) * 0.3).expand(B, Hq)
    lo, hi = -UNBOUNDED, UNBOUNDED
    shift = Lk - Lq
    if c.window is not None:
        left, right = c.window
        if left >= 0:
            lo = shift - left
        if right >= 0:
            hi = shift + right
    if c.causal:
        hi = min(hi, shift if c.causal == "bottom_right" else 0)
    scale = 1.0 / math.sqrt(D) if c.scale is None else c.scale
    seed = torch.tensor([1234567, 89], dtype=torch.int64) if c.dropout > 0 else None
    return (
        q,
        k,
        v,
        dict(
            attn_mask=mask,
            key_padding_mask=padding,
            alibi_slopes=alibi,
            scale=scale,
            softcap=c.softcap,
            window_lo=lo,
            window_hi=hi,
            dropout_p=c.dropout,
            seed=seed,
        ),
    )


def ref_run(q, k, v, kw, dtype, grad_out=None, grad_lse=None, mask_grad=False):
    """The reference's (out, lse, grads) in `dtype`; grads: (dq, dk, dv), and d attn_mask with
    mask_grad (the mask in float64 for the float64 run, else in its own dtype)."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    mask = kw["attn_mask"]
    if mask_grad:
        mask = mask.detach().to(torch.float64 if dtype == torch.float64 else mask.dtype)
        leaves.append(mask.requires_grad_())
    out, lse = ref.attention(
        *leaves[:3],
        mask,
        kw["key_padding_mask"],
        kw["alibi_slopes"],
        kw["scale"],
        kw["softcap"],
        kw["window_lo"],
        kw["window_hi"],
        kw["dropout_p"],
        kw["seed"],
    )
    if grad_out is None:
        return out.detach(), lse.detach(), None
    outs, grads = [out], [grad_out.to(out.dtype)]
    if grad_lse is not None:
        finite = torch.isfinite(lse)
        outs.append(torch.where(finite, lse, torch.zeros_like(lse)))
        grads.append(grad_lse.to(lse.dtype))
    return out.detach(), lse.detach(), torch.autograd.grad(outs, leaves, grads)


def cancellation_floors(q, k, v, kw, grad_out):
    """Floors of dq and dk for the cancellation in dS = P (dP - Delta): dP and Delta are two
    float32 dot products rounded differently, so rows that see a single key (P = 1), where the
    exact dS is 0, keep a residue of a few float32 ulps of |dP| (tests/attention_floors.py
    derives the same bound)."""
    if q.numel() == 0 or k.numel() == 0:
        return 0.0, 0.0
    group = q.shape[1] // k.shape[1]
    eps = torch.finfo(torch.float64 if q.dtype == torch.float64 else torch.float32).eps
    vv = v.double().repeat_interleave(group, dim=1)
    dp = torch.matmul(grad_out.double(), vv.transpose(-1, -2))
    residue = 4 * eps * kw["scale"] / (1 - kw["dropout_p"]) * float(dp.abs().max())
    return (
        residue * float(k.double().abs().max()),
        residue * float(q.double().abs().max()) * math.sqrt(q.shape[2] * group),
    )


def check(name, got, ref64, reflow, factor, results, dtype=None, extra=0.0, target=None):
    """FlashAttention's rule: |got - target| <= factor * |reflow - ref64| + floor, where target
    is ref64 unless given (the float64 gradient the kernels' Delta implies)."""
    err = max_error(got, ref64 if target is None else target)
    base = max_error(reflow, ref64)
    dtype = got.dtype if dtype is None else dtype
    if dtype in (torch.float32, torch.float64):
        floor = 8 * torch.finfo(dtype).eps * float(ref64.abs().max()) if ref64.numel() else 0
        floor += rounding_floor(ref64, dtype)
    else:
        floor = rounding_floor(ref64, dtype)
    floor += extra
    bound = factor * base + floor
    ok = err == err and err <= bound
    results.append((name, ok, err, bound))
    return ok


def reached(ext, expect, results):
    """Checks that the launches since the last call include each expected tile variant."""
    launches = ext.take_launches()
    for e in expect:
        parts = e.split("&")
        ok = any(all(x in line for x in parts) for line in launches)
        results.append((f"reached {e}", ok, 0.0, 0.0))
        if not ok:
            print(f"  {e} not among:\n    " + "\n    ".join(sorted(set(launches))))


def same_as_h100(name, got, ref, results):
    """The smaller-tile variants sum in the same order as the H100 ones: bitwise equal."""
    ok = all(torch.equal(a, b) for a, b in zip(got, ref) if a is not None)
    results.append((name, ok, 0.0, 0.0))


def run_case(ext, c: Case, verbose: bool):
    g = torch.Generator().manual_seed(zlib.crc32(c.name.encode()))  # same data every run
    q, k, v, kw = canonical(c, g)
    args = (
        kw["attn_mask"],
        kw["key_padding_mask"],
        kw["alibi_slopes"],
        kw["scale"],
        kw["softcap"],
        kw["window_lo"],
        kw["window_hi"],
        kw["dropout_p"],
        kw["seed"],
    )
    ext.set_poison(True)
    ext.take_launches()
    if c.expect_error is not None:
        try:
            out, lse = emulated(ext, "attention_forward", q, k, v, *args, smem=c.smem)
            emulated(
                ext,
                "attention_backward",
                torch.randn(out.shape, generator=g).to(c.dtype),
                None,
                q,
                k,
                v,
                out,
                lse,
                *args,
                True,
                c.mask_grad,
                smem=c.smem,
            )
        except RuntimeError as exc:
            if c.expect_error not in str(exc):
                print(f"  raised: {exc}")
            return [(f"raises '{c.expect_error}'", c.expect_error in str(exc), 0.0, 0.0)]
        return [(f"raises '{c.expect_error}'", False, 0.0, 0.0)]
    out, lse = emulated(ext, "attention_forward", q, k, v, *args, smem=c.smem)
    grad_out = torch.randn(out.shape, generator=g).to(c.dtype) if c.backward else None
    if c.backward and c.grad_out_expanded:  # d(out.sum()): every outer stride 0
        grad_out = torch.randn(out.shape[-1], generator=g).to(c.dtype).expand(out.shape)
    grad_lse = torch.randn(lse.shape, generator=g) if (c.backward and c.grad_lse) else None
    mg = c.mask_grad and c.backward
    o64, l64, g64 = ref_run(q, k, v, kw, torch.float64, grad_out, grad_lse, mg)
    # The reference in the input's dtype (it computes in float32 for 16-bit inputs and rounds).
    olow, llow, glow = ref_run(q, k, v, kw, c.dtype, grad_out, grad_lse, mg)
    results = []
    assert out.shape == o64.shape and out.dtype == c.dtype, (out.shape, out.dtype)
    assert out.stride(-1) == 1
    check("out", out, o64, olow, 2.0, results)
    fin = torch.isfinite(l64)
    assert torch.equal(torch.isfinite(lse), fin) or not fin.all(), "lse -inf pattern"
    assert torch.equal(torch.isneginf(lse), torch.isneginf(l64.to(lse.dtype))), (
        "lse -inf rows differ"
    )
    lse_f = torch.where(fin, lse.double(), torch.zeros_like(l64))
    check(
        "lse",
        lse_f,
        torch.where(fin, l64, torch.zeros_like(l64)),
        torch.where(fin, llow.double(), torch.zeros_like(l64)),
        2.0,
        results,
        dtype=lse.dtype,
    )
    bwd_args = (grad_out, grad_lse, q, k, v, out, lse, *args, c.deterministic, mg)
    if c.backward:
        dq, dk, dv, dmask = emulated(ext, "attention_backward", *bwd_args, smem=c.smem)
        floors = cancellation_floors(q, k, v, kw, grad_out) + (0.0,)
        # The kernels' Delta reads their rounded output: the float64 gradient it implies is the
        # reference's with grad_lse + rowsum(dO (O64 - O)) (tests/attention_floors.py).
        adj = (grad_out.double() * (o64 - out.double())).sum(-1)
        if grad_lse is not None:
            adj = adj + grad_lse.double()
        implied = ref_run(q, k, v, kw, torch.float64, grad_out, adj)[2]
        for nm, got, r64, rlow, extra, want in zip(
            ("dq", "dk", "dv"), (dq, dk, dv), g64, glow, floors, implied
        ):
            assert got.is_contiguous()
            check(nm, got, r64, rlow, 3.0, results, extra=extra, target=want)
        if mg:
            m = kw["attn_mask"]
            assert dmask.shape == m.shape and dmask.dtype == m.dtype, (dmask.shape, dmask.dtype)
            check(
                "dmask",
                dmask,
                g64[3],
                glow[3],
                3.0,
                results,
                extra=mask_grad_floor(c, q, v, kw, grad_out),
            )
            sharp_mask_grad_check(c, q, k, v, kw, out, grad_out, grad_lse, o64, dmask, results)
        else:
            assert dmask.numel() == 0
        # determinism: a second run is bitwise equal
    reached(ext, c.expect, results)
    if c.backward:
        dq2, dk2, dv2, dmask2 = emulated(ext, "attention_backward", *bwd_args, smem=c.smem)
        same = torch.equal(dq, dq2) and torch.equal(dk, dk2) and torch.equal(dv, dv2)
        if mg and c.deterministic:
            same = same and torch.equal(dmask, dmask2)
        results.append(("determinism", bool(same), 0.0, 0.0))
    if c.smem != H100_SMEM:
        o_h, l_h = emulated(ext, "attention_forward", q, k, v, *args, smem=H100_SMEM)
        same_as_h100("fwd same as 227 KB", (out, lse), (o_h, l_h), results)
        if c.backward:
            g_h = emulated(
                ext,
                "attention_backward",
                grad_out,
                grad_lse,
                q,
                k,
                v,
                out,
                lse,
                *args,
                True,
                smem=H100_SMEM,
            )
            same_as_h100("bwd same as 227 KB", (dq, dk, dv), g_h[:3], results)
    if mg and c.mask is not None:
        # The one-pass atomic and the deterministic sums of d attn_mask agree (to rounding).
        other = emulated(
            ext, "attention_backward", *bwd_args[:-2], not c.deterministic, True, smem=c.smem
        )[3]
        check(
            "dmask det/atomic",
            other,
            g64[3],
            glow[3],
            3.0,
            results,
            extra=mask_grad_floor(c, q, v, kw, grad_out),
        )
    return results


def sharp_mask_grad_check(c, q, k, v, kw, out, grad_out, grad_lse, o64, dmask, results):
    """d attn_mask against the float64 reference given the kernels' Delta: their rowsum(dO * O)
    reads the rounded output O (16-bit), which the reference's exact O does not, and the
    FlashAttention rule's floor for that (mask_grad_floor) is too loose to catch a missing or
    doubled contribution. Delta_kernel = rowsum(dO O_exact) - grad_lse' with grad_lse' =
    grad_lse + rowsum(dO (O_exact - O)), so the float64 reference run with grad_lse' gives the
    kernels' d attn_mask up to float32 rounding."""
    go = grad_out.double()
    adj = (go * (o64 - out.double())).sum(-1)
    if grad_lse is not None:
        adj = adj + grad_lse.double()
    want = ref_run(q, k, v, kw, torch.float64, grad_out, adj, mask_grad=True)[2][3]
    eps = torch.finfo(torch.float64 if c.dtype == torch.float64 else torch.float32).eps
    terms = c.B * c.Hq * c.Lq * c.Lk // kw["attn_mask"].numel()
    vv = v.double().abs().repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    dp_abs = float(torch.matmul(go.abs(), vv.transpose(-1, -2)).max()) if vv.numel() else 0.0
    # one ulp of the mask's dtype at the largest value (the kernels round their float sums once)
    ulp = torch.finfo(dmask.dtype).eps * float(want.abs().max()) if want.numel() else 0.0
    bound = ulp + rounding_floor(want, dmask.dtype)
    bound += 16 * eps * (dp_abs + 1) * terms / (1 - c.dropout)
    err = max_error(dmask, want)
    results.append(("dmask~kernel Delta", err == err and err <= bound, err, bound))


def mask_grad_floor(c: Case, q, v, kw, grad_out) -> float:
    """Floor of d attn_mask (tests/test_attention_bias_grad.py's bias_floor): dS = P (dP - Delta)
    keeps a residue of a few ulps of the compute type of sum_d |dO_d v_d| (dP and Delta are
    separate dot products), 16-bit inputs add Delta's reading of the rounded O, and each
    element of the mask sums B Hq Lq Lk / numel such terms."""
    group = q.shape[1] // v.shape[1]
    keep = 1.0 / (1.0 - c.dropout)
    eps = torch.finfo(torch.float64 if q.dtype == torch.float64 else torch.float32).eps
    vv = v.double().abs().repeat_interleave(group, dim=1)
    dp_abs = torch.matmul(grad_out.double().abs(), vv.transpose(-1, -2))
    residue = 4 * eps * keep * float(dp_abs.max())
    half_ulp = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}.get(q.dtype, 0.0)
    if half_ulp:
        v_max = vv.amax(dim=2, keepdim=True)
        residue += half_ulp * keep * float((grad_out.double().abs() * v_max).sum(-1).max())
    return residue * (c.B * c.Hq * c.Lq * c.Lk // kw["attn_mask"].numel())


def cases():
    out = []
    for dt, tag in ((torch.bfloat16, "bf16"), (torch.float16, "f16")):
        out += [
            Case(f"{tag}_plain_d64", dt),
            Case(f"{tag}_causal_d64", dt, causal=True, Lq=70, Lk=70),
            Case(f"{tag}_causal_br_d128", dt, causal="bottom_right", D=128, Lq=33, Lk=100),
            Case(f"{tag}_d256", dt, D=256, Lq=20, Lk=45),
        ]
    bf = torch.bfloat16
    out += [
        Case("bf16_window_gqa", bf, Hq=4, Hkv=2, window=(20, 5), Lq=80, Lk=90),
        Case("bf16_mqa_dv", bf, Hq=3, Hkv=1, D=40, Dv=72),
        Case("bf16_dv_small_d_large", bf, D=150, Dv=24, Lq=20, Lk=33),
        Case("bf16_bool_mask_pad", bf, mask="bool", padding=True),
        Case("bf16_empty_rows", bf, mask="bool_rows", padding=True, empty_rows=True, B=2),
        Case("bf16_float_mask", bf, mask="float"),
        Case("bf16_float32_mask_transposed", bf, mask="float_transposed"),
        Case("bf16_float32_mask_shared_unexpanded", bf, mask="float_shared", B=2),
        Case("f32_float32_key_bias_gqa", torch.float32, mask="float_key", B=2, Hq=4, Hkv=2),
        Case("bf16_alibi_softcap", bf, alibi=True, softcap=2.5, scale=0.5),
        Case("bf16_dropout", bf, dropout=0.17, Lq=40, Lk=70),
        Case("bf16_dropout_odd", bf, dropout=0.3, Lq=13, Lk=31, D=32),
        Case("bf16_blhd_layout", bf, layout="blhd", Lq=50, Lk=50),
        Case("bf16_unaligned_d59", bf, D=59, layout="padded", Lq=30, Lk=40),
        Case("bf16_d1", bf, D=1, Dv=1, Lq=9, Lk=17),
        Case("bf16_grad_lse", bf, grad_lse=True),
        Case(
            "bf16_everything",
            bf,
            Hq=4,
            Hkv=2,
            D=40,
            Dv=57,
            causal="bottom_right",
            mask="float",
            padding=True,
            alibi=True,
            softcap=2.5,
            dropout=0.17,
            grad_lse=True,
            Lq=45,
            Lk=77,
        ),
        Case("bf16_lk_lt_lq_causal", bf, causal=True, Lq=90, Lk=20),
        # several query/key tiles and heads per block in every bucket (pipelines, stage reuse)
        Case("bf16_d64_multi", bf, Hq=4, Hkv=2, D=64, Lq=150, Lk=140, causal="bottom_right"),
        Case("bf16_d128_multi", bf, Hq=4, Hkv=2, D=128, Lq=150, Lk=130),
        Case(
            "f16_d256_multi",
            torch.float16,
            Hq=2,
            Hkv=1,
            D=256,
            Dv=160,
            Lq=140,
            Lk=70,
            window=(50, 3),
        ),
        Case("bf16_d59_partial_chunks", bf, D=59, Dv=61, layout="padded8", Lq=30, Lk=40),
        Case("bf16_lk0", bf, Lq=9, Lk=0),
        Case("bf16_lq1", bf, Lq=1, Lk=77, D=128),
        Case("bf16_lk1", bf, Lq=33, Lk=1, causal="bottom_right"),
        Case("bf16_br_lq_gt_lk", bf, causal="bottom_right", Lq=50, Lk=20),
        Case("bf16_window_left_only", bf, window=(5, -1), Lq=60, Lk=60),
        Case("bf16_many_heads", bf, B=3, Hq=6, Hkv=3, Lq=5, Lk=7, D=16),
        Case("f16_float16_mask", torch.float16, mask="float"),
        Case(
            "bf16_alibi_heads_grad_out_expanded",
            bf,
            alibi=True,
            alibi_heads_only=True,
            B=2,
            grad_out_expanded=True,
        ),
        Case(
            "f16_d256_everything",
            torch.float16,
            D=256,
            Dv=200,
            mask="bool",
            dropout=0.1,
            softcap=3.0,
            Lq=17,
            Lk=40,
        ),
    ]
    for dt, tag in ((torch.float32, "f32"), (torch.float64, "f64")):
        out += [
            Case(f"{tag}_plain", dt, Lq=33, Lk=45, D=24),
            Case(
                f"{tag}_everything",
                dt,
                Hq=4,
                Hkv=2,
                D=20,
                Dv=35,
                causal="bottom_right",
                mask="float32",
                padding=True,
                alibi=True,
                softcap=2.5,
                dropout=0.17,
                grad_lse=True,
                Lq=37,
                Lk=50,
            ),
            Case(f"{tag}_empty_rows_blhd", dt, mask="bool_rows", layout="blhd", D=16, Lq=20, Lk=30),
        ]
    out.append(Case("f32_d256", torch.float32, D=256, Dv=256, Lq=9, Lk=40))
    out.append(Case("f32_d256_dv1", torch.float32, D=256, Dv=1, Lq=20, Lk=35, causal=True))
    out.append(
        Case(
            "f64_float64_mask_dropout",
            torch.float64,
            mask="float",
            dropout=0.2,
            D=8,
            Lq=21,
            Lk=19,
            grad_out_expanded=True,
        )
    )
    out.append(Case("f32_lk0", torch.float32, Lq=5, Lk=0))
    out += smem_cases()
    out += dbias_cases()
    return out


def dbias_cases():
    """d attn_mask (mask_grad: a learned bias's gradient, summed over the mask's broadcast
    dims by the dK/dV kernels): every broadcast shape, deterministic (blocks walk the batches /
    kv heads, no atomics) and not (atomic adds), causal, odd lengths, GQA/MQA, softcap,
    dropout, every dtype and kernel family (tensor-core buckets, SIMT full and D-split). Each
    case also checks the other deterministic setting against the reference."""
    bf, f16, f32, f64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
    d = dict(mask_grad=True)
    return [
        Case("dbias_bf16_1HLL_t5", bf, B=3, mask="bias_1HLL", **d),
        Case("dbias_bf16_1HLL_atomic", bf, B=3, mask="bias_1HLL", deterministic=False, **d),
        Case(
            "dbias_f16_B1LL_pair_gqa_causal",
            f16,
            B=2,
            Hq=4,
            Hkv=2,
            causal=True,
            Lq=70,
            Lk=70,
            mask="bias_B1LL",
            **d,
        ),
        Case(
            "dbias_f16_B1LL_pair_atomic",
            f16,
            B=2,
            Hq=4,
            Hkv=2,
            mask="bias_B1LL",
            deterministic=False,
            **d,
        ),
        Case(
            "dbias_bf16_LL_mqa_causal_br",
            bf,
            B=2,
            Hq=3,
            Hkv=1,
            causal="bottom_right",
            Lq=45,
            Lk=77,
            mask="bias_LL",
            mask_dtype=f32,
            **d,
        ),
        Case(
            "dbias_bf16_LL_gqa_atomic",
            bf,
            B=2,
            Hq=4,
            Hkv=2,
            Lq=45,
            Lk=77,
            mask="bias_LL",
            deterministic=False,
            **d,
        ),
        Case("dbias_bf16_BHLL_store", bf, B=2, Hq=4, Hkv=2, Lq=33, Lk=50, mask="bias_BHLL", **d),
        Case("dbias_bf16_expanded", bf, B=2, mask="bias_expanded", Lq=20, Lk=30, **d),
        Case("dbias_bf16_key", bf, B=2, Hq=4, Hkv=2, mask="bias_key", Lq=70, Lk=50, **d),
        Case("dbias_bf16_query_sum_k", bf, B=2, mask="bias_query", Lq=30, Lk=45, **d),
        Case(
            "dbias_bf16_softcap_dropout",
            bf,
            B=2,
            Hq=4,
            Hkv=2,
            softcap=2.5,
            dropout=0.17,
            padding=True,
            mask="bias_1HLL",
            mask_dtype=f32,
            grad_lse=True,
            **d,
        ),
        Case(
            "dbias_bf16_d128_window",
            bf,
            B=2,
            D=128,
            Lq=100,
            Lk=90,
            window=(30, 10),
            mask="bias_1HLL",
            **d,
        ),
        Case(
            "dbias_f16_d256_dv160",
            f16,
            B=2,
            Hq=2,
            Hkv=1,
            D=256,
            Dv=160,
            Lq=40,
            Lk=70,
            mask="bias_1HLL",
            causal=True,
            **d,
        ),
        Case(
            "dbias_smem99_f16_d256",
            f16,
            B=2,
            D=256,
            Lq=37,
            Lk=40,
            mask="bias_B1LL",
            smem=SMALL_SMEM,
            expect=KV256_SMALL,
            **d,
        ),
        Case(
            "dbias_f32_1HLL_softcap_dropout_gqa",
            f32,
            B=2,
            Hq=4,
            Hkv=2,
            D=20,
            Dv=35,
            softcap=2.5,
            dropout=0.17,
            causal="bottom_right",
            Lq=37,
            Lk=50,
            mask="bias_1HLL",
            **d,
        ),
        Case(
            "dbias_f32_B1LL_atomic",
            f32,
            B=2,
            Hq=4,
            Hkv=2,
            D=24,
            Lq=33,
            Lk=45,
            mask="bias_B1LL",
            deterministic=False,
            **d,
        ),
        Case("dbias_f32_key", f32, B=2, Hq=2, D=16, Lq=40, Lk=45, mask="bias_key", **d),
        Case(
            "dbias_smem99_f32_d256_split",
            f32,
            B=2,
            D=256,
            Lq=20,
            Lk=45,
            causal=True,
            mask="bias_1HLL",
            smem=SMALL_SMEM,
            expect=(DKDV_SPLIT,),
            **d,
        ),
        Case(
            "dbias_f64_LL_dropout",
            f64,
            B=2,
            Hq=2,
            D=8,
            Lq=21,
            Lk=19,
            dropout=0.2,
            mask="bias_LL",
            **d,
        ),
        Case(
            "dbias_f64_BHLL_gqa",
            f64,
            B=2,
            Hq=4,
            Hkv=2,
            D=8,
            Lq=21,
            Lk=35,
            mask="bias_BHLL",
            causal=True,
            **d,
        ),
    ]


# Launcher signatures of the smaller-tile variants (attention_cuda_launch.cuh).
KV256_SMALL = (
    "run_bwd_dkdv_mma&BwdKVConfig<256, 1, 1, 16>",
    "run_bwd_dkdv_mma&BwdKVConfig<256, 1, 2, 16>",
)
KV256_LARGE = (
    "run_bwd_dkdv_mma&BwdKVConfig<256, 1, 1>",  # default 64 queries per step
    "run_bwd_dkdv_mma&BwdKVConfig<256, 1, 2>",
)
Q128_SMALL = "run_bwd_dq_mma&BwdQConfig<128, 1, 64>"
Q128_LARGE = "run_bwd_dq_mma&BwdQConfig<128, 2, 64>"
DKDV_SPLIT = "run_bwd_dkdv_simt&kChunked = true"
DKDV_FULL = "run_bwd_dkdv_simt&kChunked = false"
DQ_SPLIT, DQ_FULL = "run_bwd_dq_simt&kChunked = true", "run_bwd_dq_simt&kChunked = false"
FWD64_SMALL = "run_fwd_simt_tile&T = double; int kR = 2"
FWD64_LARGE = "run_fwd_simt_tile&T = double; int kR = 4"


def smem_cases():
    """Devices with 99 KB (sm_86/89/120) and 163 KB (sm_80) of shared memory per block: every
    smaller-tile variant, each also compared bitwise with the 227 KB (H100) variant."""
    bf, f16, f32, f64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
    S, A = SMALL_SMEM, A100_SMEM
    return [
        Case(
            "smem99_bf16_d128_multi",
            bf,
            Hq=4,
            Hkv=2,
            D=128,
            Lq=100,
            Lk=90,
            smem=S,
            expect=(Q128_SMALL,),
        ),
        Case(
            "smem99_f16_d128_causal_dropout",
            f16,
            D=128,
            Dv=100,
            causal="bottom_right",
            dropout=0.17,
            Lq=70,
            Lk=110,
            smem=S,
            expect=(Q128_SMALL,),
        ),
        Case("smem163_bf16_d128", bf, D=128, Lq=40, Lk=70, smem=A, expect=(Q128_LARGE,)),
        Case(
            "smem99_bf16_d256_gqa_window",
            bf,
            Hq=2,
            Hkv=1,
            D=256,
            Lq=70,
            Lk=75,
            window=(40, 3),
            smem=S,
            expect=KV256_SMALL + ("run_bwd_dq_mma&BwdQConfig<256, 1, 32>",),
        ),
        Case(
            "smem99_f16_d256_everything",
            f16,
            D=256,
            Dv=200,
            mask="bool",
            dropout=0.1,
            softcap=3.0,
            grad_lse=True,
            Lq=37,
            Lk=40,
            smem=S,
            expect=KV256_SMALL,
        ),
        Case("smem163_f16_d256", f16, D=256, Dv=160, Lq=20, Lk=45, smem=A, expect=KV256_LARGE),
        Case(
            "smem99_f32_d256_causal",
            f32,
            D=256,
            Lq=40,
            Lk=45,
            causal=True,
            smem=S,
            expect=(DKDV_SPLIT, DQ_SPLIT, "run_fwd_simt_tile&T = float; int kR = 8"),
        ),
        Case(
            "smem99_f32_d190_dv180_gqa",
            f32,
            Hq=4,
            Hkv=2,
            D=190,
            Dv=180,
            Lq=20,
            Lk=40,
            dropout=0.2,
            smem=S,
            expect=(DKDV_SPLIT, DQ_FULL),
        ),
        Case("smem163_f32_d256", f32, D=256, Lq=9, Lk=40, smem=A, expect=(DKDV_FULL, DQ_FULL)),
        Case(
            "smem99_f64_d256",
            f64,
            D=256,
            Lq=20,
            Lk=35,
            alibi=True,
            smem=S,
            expect=(FWD64_SMALL, DKDV_SPLIT, DQ_SPLIT),
        ),
        Case(
            "smem99_f64_d100_dv250_softcap_mask",
            f64,
            D=100,
            Dv=250,
            softcap=2.5,
            mask="bool_rows",
            Lq=20,
            Lk=30,
            smem=S,
            expect=(FWD64_LARGE, DKDV_SPLIT, DQ_SPLIT),
        ),
        Case(
            "smem163_f64_d256_dv170_causal",
            f64,
            D=256,
            Dv=170,
            causal="bottom_right",
            Lq=20,
            Lk=40,
            smem=A,
            expect=(FWD64_LARGE, DKDV_SPLIT, DQ_SPLIT),
        ),
        Case("smem163_f64_d200", f64, D=200, Lq=10, Lk=20, smem=A, expect=(DKDV_FULL, DQ_FULL)),
        # below every supported device (80 KB): check_smem still refuses with a clear error
        Case(
            "smem80_bf16_d256_refused",
            bf,
            D=256,
            Lq=8,
            Lk=8,
            smem=80 * 1024,
            expect_error="attention_bwd_dkdv_mma needs 84608 bytes of shared memory per block, "
            "the device allows 81920",
        ),
    ]


# ---------------------------------------------------------------------------------------------
# varlen_attention (packed sequences, cu_seqlens read on the device) and attention_decode (KV
# cache, split-K) through the same kernels.


class VarlenCase:
    def __init__(
        self,
        name,
        dtype=torch.bfloat16,
        q_lens=(0, 1, 5, 17, 64, 70),
        k_lens=None,
        Hq=2,
        Hkv=2,
        D=64,
        Dv=None,
        causal_mode=0,
        window=(-1, -1),
        alibi=False,
        softcap=0.0,
        dropout=0.0,
        grad_lse=False,
        layout="packed",
        smem=H100_SMEM,
        expect=(),
    ):
        self.__dict__.update(locals())
        self.Dv = D if Dv is None else Dv
        self.k_lens = q_lens if k_lens is None else k_lens


def run_varlen_case(ext, c: VarlenCase, verbose: bool):
    g = torch.Generator().manual_seed(zlib.crc32(c.name.encode()))  # same data every run
    B = len(c.q_lens)
    cu_q = torch.tensor([0] + list(torch.tensor(c.q_lens).cumsum(0).tolist()), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(torch.tensor(c.k_lens).cumsum(0).tolist()), dtype=torch.int32)
    tq, tk = int(cu_q[-1]), int(cu_k[-1])
    max_q, max_k = max(c.q_lens), max(c.k_lens)

    def make(total, H, d):
        if c.layout == "strided":  # rows of a wider buffer (row stride H*(d+3))
            return torch.randn(total, H, d + 3, generator=g)[..., :d].to(c.dtype)
        return torch.randn(total, H, d, generator=g).to(c.dtype)

    q, k, v = make(tq, c.Hq, c.D), make(tk, c.Hkv, c.D), make(tk, c.Hkv, c.Dv)
    alibi = (torch.rand(B, c.Hq, generator=g) * 0.3) if c.alibi else None
    scale = 1.0 / math.sqrt(c.D)
    seed = torch.tensor([1234567, 89], dtype=torch.int64) if c.dropout > 0 else None
    args = (
        cu_q,
        cu_k,
        max_q,
        max_k,
        alibi,
        scale,
        c.softcap,
        c.causal_mode,
        c.window[0],
        c.window[1],
        c.dropout,
        seed,
    )
    ext.set_poison(True)
    ext.take_launches()
    out, lse = emulated(ext, "varlen_attention_forward", q, k, v, *args, smem=c.smem)
    grad_out = torch.randn(out.shape, generator=g).to(c.dtype)
    grad_lse = torch.randn(lse.shape, generator=g) if c.grad_lse else None

    def reference(dtype):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        o, l = varlen_ref.varlen_attention(*leaves, *args)
        outs, grads = [o], [grad_out.to(o.dtype)]
        if grad_lse is not None:
            fin = torch.isfinite(l)
            outs.append(torch.where(fin, l, torch.zeros_like(l)))
            grads.append(grad_lse.to(l.dtype))
        return o.detach(), l.detach(), torch.autograd.grad(outs, leaves, grads, allow_unused=True)

    o64, l64, g64 = reference(torch.float64)
    olow, llow, glow = reference(c.dtype)
    results = []
    assert out.shape == o64.shape and out.dtype == c.dtype, (out.shape, out.dtype)
    check("out", out, o64, olow, 2.0, results)
    fin = torch.isfinite(l64)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(l64.to(lse.dtype))), (
        "lse -inf rows differ"
    )
    z = torch.zeros_like(l64)
    check(
        "lse",
        torch.where(fin, lse.double(), z),
        torch.where(fin, l64, z),
        torch.where(fin, llow.double(), z),
        2.0,
        results,
        dtype=lse.dtype,
    )
    dq, dk, dv = emulated(
        ext,
        "varlen_attention_backward",
        grad_out,
        grad_lse,
        q,
        k,
        v,
        out,
        lse,
        *args,
        True,
        smem=c.smem,
    )
    reached(ext, c.expect, results)
    for nm, got, r64, rlow in zip(("dq", "dk", "dv"), (dq, dk, dv), g64, glow):
        r64 = torch.zeros_like(got, dtype=torch.float64) if r64 is None else r64
        rlow = torch.zeros_like(got) if rlow is None else rlow
        # the cancellation residue of dS = P (dP - Delta) (see cancellation_floors), bounded
        # from the packed tensors
        eps = torch.finfo(torch.float64 if c.dtype == torch.float64 else torch.float32).eps
        extra = 0.0
        if q.numel() and k.numel():
            dp = float(grad_out.double().abs().sum(-1).max() * v.double().abs().max())
            res = 4 * eps * scale / (1 - c.dropout) * dp
            other = (k if nm == "dq" else q).double().abs().max()
            extra = res * float(other) * (math.sqrt(c.D * (c.Hq // c.Hkv)) if nm == "dk" else 1)
        check(nm, got, r64, rlow, 3.0, results, extra=extra)
    dq2, dk2, dv2 = emulated(
        ext,
        "varlen_attention_backward",
        grad_out,
        grad_lse,
        q,
        k,
        v,
        out,
        lse,
        *args,
        True,
        smem=c.smem,
    )
    results.append(
        (
            "determinism",
            bool(torch.equal(dq, dq2) and torch.equal(dk, dk2) and torch.equal(dv, dv2)),
            0.0,
            0.0,
        )
    )
    if c.smem != H100_SMEM:
        o_h, l_h = emulated(ext, "varlen_attention_forward", q, k, v, *args, smem=H100_SMEM)
        same_as_h100("fwd same as 227 KB", (out, lse), (o_h, l_h), results)
        g_h = emulated(
            ext,
            "varlen_attention_backward",
            grad_out,
            grad_lse,
            q,
            k,
            v,
            out,
            lse,
            *args,
            True,
            smem=H100_SMEM,
        )
        same_as_h100("bwd same as 227 KB", (dq, dk, dv), g_h, results)
    return results


class DecodeCase:
    def __init__(
        self,
        name,
        dtype=torch.bfloat16,
        cache_seqlens=(0, 3, 76, 299),
        Lq=1,
        Lmax=320,
        Hq=8,
        Hkv=2,
        D=64,
        Dv=None,
        causal_mode=2,
        window=(-1, -1),
        alibi=False,
        softcap=0.0,
        num_splits=0,
        new_tokens=True,
        smem=H100_SMEM,
        expect=(),
        block_size=0,
    ):
        self.__dict__.update(locals())
        self.Dv = D if Dv is None else Dv


def paged(cache: torch.Tensor, block_size: int, perm: torch.Tensor):
    """The dense cache (B, H, Lmax, W) as a pool (B * nb, H, block_size, W) whose blocks are
    scattered by `perm`, and the block table (B, nb) that reads it back (rows past Lmax zero)."""
    B, H, Lmax, W = cache.shape
    nb = -(-Lmax // block_size)
    full = torch.zeros(B, H, nb * block_size, W, dtype=cache.dtype)
    full[:, :, :Lmax] = cache
    table = perm.view(B, nb).to(torch.int32)
    pool = torch.empty(B * nb, H, block_size, W, dtype=cache.dtype)
    pool[table.reshape(-1).long()] = (
        full.view(B, H, nb, block_size, W).permute(0, 2, 1, 3, 4).reshape(B * nb, H, block_size, W)
    )
    return pool, table


def run_decode_case(ext, c: DecodeCase, verbose: bool):
    g = torch.Generator().manual_seed(zlib.crc32(c.name.encode()))  # same data every run
    B = len(c.cache_seqlens)
    q = torch.randn(B, c.Hq, c.Lq, c.D, generator=g).to(c.dtype)
    k_cache = torch.randn(B, c.Hkv, c.Lmax, c.D, generator=g).to(c.dtype)
    v_cache = torch.randn(B, c.Hkv, c.Lmax, c.Dv, generator=g).to(c.dtype)
    pos = torch.tensor(c.cache_seqlens, dtype=torch.int32)
    k_lengths = (pos + (c.Lq if c.new_tokens else 0)).to(torch.int32)
    alibi = (torch.rand(B, c.Hq, generator=g) * 0.3) if c.alibi else None
    scale = 1.0 / math.sqrt(c.D)
    args = (k_lengths, pos, alibi, scale, c.softcap, c.causal_mode, c.window[0], c.window[1])
    ext.set_poison(True)
    ext.take_launches()
    kv = (k_cache, v_cache)
    if c.block_size:  # the same rows in paged pools, read through a random block table
        nb = -(-c.Lmax // c.block_size)
        perm = torch.randperm(B * nb, generator=g)
        (k_pool, table), (v_pool, _) = (paged(t, c.block_size, perm) for t in kv)
        kv = (k_pool, v_pool)
    out, lse = emulated(
        ext,
        "attention_decode",
        q,
        *kv,
        *args,
        c.num_splits,
        table if c.block_size else None,
        smem=c.smem,
    )
    o64, l64 = kv_ref.attention_decode(q.double(), k_cache.double(), v_cache.double(), *args)
    olow, llow = kv_ref.attention_decode(q, k_cache, v_cache, *args)
    results = []
    assert out.shape == o64.shape and out.dtype == c.dtype, (out.shape, out.dtype)
    check("out", out, o64, olow, 2.0, results)
    fin = torch.isfinite(l64)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(l64.to(lse.dtype))), (
        "lse -inf rows differ"
    )
    z = torch.zeros_like(l64)
    check(
        "lse",
        torch.where(fin, lse.double(), z),
        torch.where(fin, l64, z),
        torch.where(fin, llow.double(), z),
        2.0,
        results,
        dtype=lse.dtype,
    )
    reached(ext, c.expect, results)
    if c.smem != H100_SMEM:
        o_h, l_h = emulated(
            ext,
            "attention_decode",
            q,
            *kv,
            *args,
            c.num_splits,
            table if c.block_size else None,
            smem=H100_SMEM,
        )
        same_as_h100("same as 227 KB", (out, lse), (o_h, l_h), results)
    return results


def varlen_cases():
    bf, f16 = torch.bfloat16, torch.float16
    shuffled = (5, 0, 17, 1, 70, 64)
    return [
        VarlenCase("varlen_bf16_self_causal_br_gqa", bf, Hq=4, Hkv=2, causal_mode=2),
        VarlenCase(
            "varlen_f16_cross_causal_br_d128",
            f16,
            k_lens=shuffled,
            Hq=2,
            Hkv=1,
            D=128,
            causal_mode=2,
        ),
        VarlenCase(
            "varlen_bf16_cross_top_left_dropout",
            bf,
            k_lens=shuffled,
            D=40,
            Dv=57,
            causal_mode=1,
            dropout=0.17,
        ),
        VarlenCase("varlen_bf16_plain_strided", bf, k_lens=shuffled, layout="strided", D=59),
        VarlenCase(
            "varlen_bf16_window_alibi_softcap_lse",
            bf,
            Hq=4,
            Hkv=1,
            window=(20, 5),
            alibi=True,
            softcap=2.5,
            grad_lse=True,
        ),
        VarlenCase(
            "varlen_f16_d256",
            f16,
            q_lens=(0, 1, 5, 17, 33),
            k_lens=(3, 1, 0, 40, 33),
            D=256,
            Dv=200,
            causal_mode=2,
            dropout=0.1,
        ),
        VarlenCase(
            "varlen_f32_everything",
            torch.float32,
            k_lens=shuffled,
            Hq=4,
            Hkv=2,
            D=20,
            Dv=35,
            causal_mode=2,
            window=(30, -1),
            alibi=True,
            softcap=2.5,
            dropout=0.17,
            grad_lse=True,
        ),
        VarlenCase("varlen_f64_causal", torch.float64, D=8, causal_mode=1, dropout=0.2),
        VarlenCase(
            "varlen_smem99_f16_d256",
            f16,
            q_lens=(0, 1, 5, 17, 33),
            k_lens=(3, 1, 0, 40, 33),
            D=256,
            Dv=200,
            causal_mode=2,
            dropout=0.1,
            smem=SMALL_SMEM,
            expect=KV256_SMALL,
        ),
        VarlenCase(
            "varlen_smem99_bf16_d128",
            bf,
            k_lens=shuffled,
            D=128,
            causal_mode=1,
            smem=SMALL_SMEM,
            expect=(Q128_SMALL,),
        ),
        VarlenCase(
            "varlen_smem99_f64_d256",
            torch.float64,
            q_lens=(0, 3, 17),
            k_lens=(5, 0, 20),
            D=256,
            Dv=240,
            causal_mode=2,
            smem=SMALL_SMEM,
            expect=(FWD64_SMALL, DKDV_SPLIT, DQ_SPLIT),
        ),
    ]


def decode_cases():
    bf, f16 = torch.bfloat16, torch.float16
    return [
        DecodeCase("decode_bf16_gqa_auto_splits", bf),
        # Paged caches: the tensor-core kernel (its key tiles straddle 16- and 48-row blocks)
        # and the SIMT kernel, split-K, through random block tables.
        DecodeCase("decode_paged16_bf16_gqa_splits", bf, num_splits=3, block_size=16),
        DecodeCase(
            "decode_paged48_f16_spec3_window", f16, Lq=3, window=(70, 0), block_size=48, D=128
        ),
        DecodeCase("decode_paged32_f32", torch.float32, Lq=2, D=24, Dv=33, block_size=32),
        DecodeCase(
            "decode_f16_spec5_window_alibi_softcap",
            f16,
            Lq=5,
            window=(64, 0),
            alibi=True,
            softcap=3.0,
            num_splits=3,
            D=128,
        ),
        DecodeCase(
            "decode_bf16_no_new_tokens_empty_cache",
            bf,
            cache_seqlens=(0, 50, 129),
            Lq=2,
            Lmax=160,
            new_tokens=False,
            num_splits=4,
            Hq=4,
            Hkv=4,
            D=40,
            Dv=24,
        ),
        DecodeCase(
            "decode_bf16_non_causal_one_split", bf, causal_mode=0, num_splits=1, Hq=2, Hkv=1, D=256
        ),
        DecodeCase("decode_f32_splits", torch.float32, num_splits=3, D=24, Dv=33, Lq=3),
        DecodeCase("decode_f64", torch.float64, Lq=2, D=16, alibi=True),
        DecodeCase(
            "decode_smem99_f64_d256",
            torch.float64,
            cache_seqlens=(0, 3, 40),
            Lmax=48,
            Lq=2,
            Hq=4,
            D=256,
            smem=SMALL_SMEM,
            expect=(FWD64_SMALL,),
        ),
        DecodeCase(
            "decode_smem99_bf16_d256_splits",
            bf,
            cache_seqlens=(0, 7, 90),
            Lmax=96,
            Hq=4,
            D=256,
            num_splits=2,
            smem=SMALL_SMEM,
        ),
    ]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("-v", action="store_true")
    a = ap.parse_args()
    todo = [c for c in cases() + varlen_cases() + decode_cases() if a.only in c.name]
    if a.list:
        print("\n".join(c.name for c in todo))
        return 0
    t0 = time.time()
    ext = build()
    print(f"built in {time.time() - t0:.0f} s")
    failures = 0
    for c in todo:
        t = time.time()
        try:
            runner = (
                run_varlen_case
                if isinstance(c, VarlenCase)
                else run_decode_case
                if isinstance(c, DecodeCase)
                else run_case
            )
            res = runner(ext, c, a.v)
        except Exception as exc:  # an emulator check or an assertion
            failures += 1
            print(f"FAIL {c.name}: {type(exc).__name__}: {exc}")
            continue
        bad = [r for r in res if not r[1]]
        failures += bool(bad)
        # pass/fail entries without an error value
        flags = ("reached", "fwd same", "bwd same", "same as", "raises")
        detail = ", ".join(
            f"{n} {e:.2e}/{b:.2e}"
            for n, ok, e, b in res
            if n != "determinism" and not n.startswith(flags)
        )
        detail += "".join(
            f", {n}" if ok else f", FAILED {n}" for n, ok, e, b in res if n.startswith(flags)
        )
        detail = detail.lstrip(", ")
        det = [ok for n, ok, _, _ in res if n == "determinism"]
        print(
            f"{'ok  ' if not bad else 'FAIL'} {c.name} ({time.time() - t:.1f} s): {detail}"
            f"{'' if not det else ', deterministic' if det[0] else ', NOT DETERMINISTIC'}"
        )
    print(f"{len(todo) - failures}/{len(todo)} cases passed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
