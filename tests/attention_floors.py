"""The one extra floor the attention gradient checks add to FlashAttention's rule, derived.

Every kernel backward (cpu, triton, cuda) computes dS = P * (dP - Delta) with
Delta_i = rowsum(dO_i * O_i) - dlse_i read from the output O it returned (rounded to the
input's dtype), as FlashAttention does. The reference differentiates its float32 (float64)
graph instead, where that difference cancels to the working precision. So the kernel's Delta_i
is off by r_i + e_i:

- r_i = dO_i . (O_i - O64_i), exactly: the kernel's own output against the float64 one (in
  16-bit mostly the output's rounding, half an ulp of each |O_id|). Its effect on the
  gradients is exactly the float64 reference's gradient of <lse, -r> (dS_ij = -P_ij r_i), so
  the floor adds the largest magnitude of that gradient, computed, not bounded.
- |e_i| <= 2 * u32 * keep * max_j sum_d |dO_id v_jd|: dP and Delta are two float32 dot
  products of different orders (u32 = 2**-23, keep = 1 / (1 - dropout_p)). It reaches dq_i as
  at most scale * max|k| * e_i (P sums to at most 1 over a row), dk_j as scale * max|q| *
  sum_i P_ij e_i and a bias's gradient as the sum of P_ij e_i over its broadcast dims, those
  sums taken by the float64 reference with dropout off.

Its size, by the float64 experiment `python tests/attention_floors.py` (the quick attention
cases and the bias cases on the cpu backend, AMD EPYC Zen 3, 2026-11-28): the largest extra
floor is 0.32-0.36% of its gradient's largest magnitude in bfloat16 (dq, dk, d bias) and
0.05-0.06% in float16. The checks assert it stays below 5% (`MAX_SHARE`), so it cannot hide a
gradient scaled by 0 or 1.25 (tests/test_check_teeth.py). A gradient of lse is part of each
check: without it, a bias broadcast over keys has a gradient of exactly 0 (softmax is shift
invariant) and only the residue would be compared.
"""

from __future__ import annotations

import math

import torch
from tolerance import F32_ULP

import fastattn

UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
MAX_SHARE = 0.05


def float32_residues(v: torch.Tensor, grad_out: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """(B, Hq, Lq) float64: the bound 2 * u32 * keep * max_j sum_d |dO_id v_jd| of the part of
    Delta's residue that comes from dP and Delta being two float32 dot products."""
    group = grad_out.shape[1] // v.shape[1]
    vv = v.detach().double().cpu().abs().repeat_interleave(group, dim=1)
    dp_abs = torch.matmul(grad_out.detach().double().cpu().abs(), vv.transpose(-1, -2))
    return 2 * F32_ULP / (1.0 - dropout_p) * dp_abs.amax(dim=-1)


def reference_gradients(q, k, v, kw, grad_out, grad_lse, attn_mask=None):
    """(dq, dk, dv, d attn_mask or None) of <out, grad_out> + <lse, grad_lse> by the float64
    reference."""
    leaves = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
    if attn_mask is not None:
        leaves.append(attn_mask.detach().double().cpu().requires_grad_())
        kw = {**kw, "attn_mask": leaves[3]}
    kw = {
        name: value.cpu() if isinstance(value, torch.Tensor) else value
        for name, value in kw.items()
    }
    out, lse = fastattn.attention(*leaves[:3], backend="reference", return_lse=True, **kw)
    grad_lse = torch.where(torch.isneginf(lse), 0.0, grad_lse.double().cpu())
    grads = torch.autograd.grad([out, lse], leaves, [grad_out.double().cpu(), grad_lse])
    return (*grads, None)[:4]


def gradient_floors(q, k, v, kw, grad_out, out64, out, attn_mask=None) -> dict[str, float]:
    """Extra floors {"dq", "dk", "dv", "dbias"} of a kernel's gradients (module docstring).

    q, k, v (and attn_mask) the inputs; grad_out (B, Hq, Lq, Dv) the output gradient; out64
    the float64 reference's output and out the kernel's (its Delta reads it). dv gets none
    (dV = P^T dO does not read Delta)."""
    if q.numel() == 0 or k.numel() == 0:
        return {"dq": 0.0, "dk": 0.0, "dv": 0.0, "dbias": 0.0}
    scale = kw.get("scale") or 1.0 / math.sqrt(q.shape[-1])
    do = grad_out.detach().double().cpu()
    zero = torch.zeros_like(do)
    # The rounded output's residue, exactly: Delta_kernel - Delta_exact = dO . (out - out64),
    # whose effect on the gradients is the reference's gradient of <lse, -residue>.
    residue = (do * (out.detach().double().cpu() - out64.detach().double().cpu())).sum(-1)
    exact = reference_gradients(q, k, v, kw, zero, -residue, attn_mask)
    # The float32 dot products' part, bounded: sum_i P_ij eps_i from dV with dO_i = eps_i
    # (dropout off: the residue multiplies the undropped P) and from d mask with dlse = eps.
    eps = float32_residues(v, grad_out, kw.get("dropout_p", 0.0))
    plain = {name: value for name, value in kw.items() if name != "dropout_p"}
    per_key = reference_gradients(q, k, v, plain, eps.unsqueeze(-1).expand_as(do), 0 * eps)[2]
    per_bias = None
    if attn_mask is not None:
        per_bias = reference_gradients(q, k, v, plain, zero, eps, attn_mask)[3]
    return {
        "dq": float(exact[0].abs().max()) + scale * float(k.abs().max()) * float(eps.max()),
        "dk": float(exact[1].abs().max()) + scale * float(q.abs().max()) * float(per_key.max()),
        "dv": 0.0,
        "dbias": 0.0
        if attn_mask is None
        else float(exact[3].abs().max()) + float(per_bias.abs().max()),
    }


def assert_floor_is_small(name: str, extra: float, ref64: torch.Tensor, dtype) -> None:
    """The derived floor of a 16-bit gradient stays below MAX_SHARE of its largest magnitude,
    so that it cannot hide a gradient scaled by 0 or 1.25."""
    if dtype not in UNIT_ROUNDOFF or ref64.numel() == 0:
        return
    largest = float(ref64.abs().max())
    assert extra <= MAX_SHARE * largest, (
        f"{name}: the derived extra floor {extra:.3e} is more than {MAX_SHARE:.0%} of the "
        f"gradient's largest magnitude {largest:.3e}: the case cannot tell a wrong gradient "
        "from rounding (give it a gradient of lse, or larger gradients)"
    )


def _largest_shares(backend: str = "cpu") -> dict[tuple[str, str], float]:
    """{(dtype, gradient): largest extra floor / largest |gradient|} over the quick attention
    cases and the bias cases of `backend` (the float64 experiment of the module docstring)."""
    import test_attention as ta
    import test_attention_bias_grad as tb

    shares: dict[tuple[str, str], float] = {}
    runs = [
        (
            ta.compare_with_reference(
                backend, *ta.make_case(f, D, *lengths, t, torch.device("cpu"))
            ),
            ("dq", "dk"),
            2,
        )
        for f, D, lengths, t in ta.QUICK_CASES
        if t != torch.float32
    ]
    runs += [
        (tb.compare_bias_gradients(backend, case, t), ("dq", "dk", "dbias"), 1)
        for case in tb.CASES
        for t in (torch.float16, torch.bfloat16)
    ]
    for results, names, first in runs:
        dtype = str(results["inputs"][0].dtype).replace("torch.", "")
        for i, name in enumerate(names):
            index = first + i if name != "dbias" else 4
            largest = float(results["ref64"][index].abs().max())
            share = results["extras"][name] / largest if largest else float("inf")
            shares[dtype, name] = max(shares.get((dtype, name), 0.0), share)
    return shares


if __name__ == "__main__":
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import conftest  # noqa: F401  (TRITON_INTERPRET before triton loads)

    for (dtype, name), share in sorted(_largest_shares().items()):
        print(f"{dtype:9s} {name:6s} largest extra floor / largest |gradient| = {share:.2%}")
