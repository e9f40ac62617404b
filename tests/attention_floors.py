"""How the attention gradient checks treat the one thing kernels do differently: Delta.

Every kernel backward (cpu, triton, cuda) computes dS = P * (dP - Delta) with
Delta_i = rowsum(dO_i * O_i) - dlse_i read from the output O it returned (rounded to the
input's dtype), as FlashAttention does. The reference differentiates its float32 (float64)
graph instead, where that difference cancels to the working precision. So the kernel's Delta_i
is off by r_i + e_i:

- r_i = dO_i . (O_i - O64_i), known exactly: the kernel's own output (checked by the output
  test) against the float64 one, in 16-bit mostly its rounding. Its effect on the gradients
  is exactly the float64 reference's gradient of <lse, -r> (dS_ij = -P_ij r_i), so the
  gradient checks compare the kernel with the float64 gradient plus that term (`delta_model`):
  no floor, the kernel must compute FlashAttention's gradient of its own output. With one
  visible key a row's gradient is all lse gradient and this term, 7-10% of it in bfloat16:
  as a floor it would be too large to tell a gradient scaled by 1.25.
- |e_i| <= 2 * u32 * keep * max_j sum_d |dO_id v_jd|: dP and Delta are two float32 dot
  products of different orders (u32 = 2**-23, keep = 1 / (1 - dropout_p)). This one is a
  bound, the only extra floor: it reaches dq_i as at most scale * max|k| * e_i (P sums to at
  most 1 over a row), dk_j as scale * max|q| * sum_i P_ij e_i and a bias's gradient as the sum
  of P_ij e_i over its broadcast dims, those sums taken with the float64 reference's
  probabilities without dropout.

Its size, by the float64 experiment `python tests/attention_floors.py` (the quick attention
cases and the bias cases on the cpu backend, AMD EPYC Zen 3, 2026-11-28): at most 0.012% of
the gradient's largest magnitude (dq in bfloat16; dk 0.009%, d bias 0.001%). The checks
assert it stays below 5% (`MAX_SHARE`; a gradient that is exactly 0 everywhere, e.g. every
row masked, is exempt: scaling it changes nothing), so it cannot hide a gradient scaled by 0
or 1.25 (tests/test_check_teeth.py). A gradient of lse is part of each check: without it, a
bias broadcast over keys has a gradient of exactly 0 (softmax is shift invariant).
"""

from __future__ import annotations

import math

import torch
from tolerance import F32_ULP, assert_grad_close, float32_floor, rounding_floor

import fastattn
from fastattn.ops.attention import attention_with_weights

SIXTEEN_BIT = (torch.float16, torch.bfloat16)
MAX_SHARE = 0.05


def dot_product_residues(v: torch.Tensor, grad_out: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """(B, Hq, Lq) float64: the bound 2 * u * keep * max_j sum_d |dO_id v_jd| of the part of
    Delta's residue that comes from dP and Delta being two dot products in the compute type
    (u = 2**-23 for float32, float16 and bfloat16 inputs, 2**-52 for float64 ones)."""
    ulp = 2.0**-52 if v.dtype == torch.float64 else F32_ULP
    group = grad_out.shape[1] // v.shape[1]
    vv = v.detach().double().cpu().abs().repeat_interleave(group, dim=1)
    dp_abs = torch.matmul(grad_out.detach().double().cpu().abs(), vv.transpose(-1, -2))
    return 2 * ulp / (1.0 - dropout_p) * dp_abs.amax(dim=-1)


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


def delta_model(q, k, v, kw, grad_out, out64, out, attn_mask=None) -> dict:
    """{"dq", "dk", "dv", "dbias": (shift, extra)} for a kernel's gradients (module docstring):
    the kernel should equal the float64 gradient + shift (float64 CPU tensor, or None) within
    the rule with `extra` added to its floor.

    q, k, v (and attn_mask) the inputs; grad_out (B, Hq, Lq, Dv) the output gradient; out64
    the float64 reference's output and out the kernel's (its Delta reads it). dv has neither
    (dV = P^T dO does not read Delta)."""
    if q.numel() == 0 or k.numel() == 0:
        return {name: (None, 0.0) for name in ("dq", "dk", "dv", "dbias")}
    scale = kw.get("scale") or 1.0 / math.sqrt(q.shape[-1])
    do = grad_out.detach().double().cpu()
    zero = torch.zeros_like(do)
    residue = (do * (out.detach().double().cpu() - out64.detach().double().cpu())).sum(-1)
    shift = reference_gradients(q, k, v, kw, zero, -residue, attn_mask)
    # The float32 dot products' part, bounded by sums of P_ij e_i with the undropped P of the
    # float64 reference: over queries (and a GQA group) per key, over a bias's broadcast dims.
    eps = dot_product_residues(v, grad_out, kw.get("dropout_p", 0.0))
    plain = {
        name: value.cpu() if isinstance(value, torch.Tensor) else value
        for name, value in kw.items()
        if name != "dropout_p"
    }
    with torch.no_grad():
        _, probs = attention_with_weights(
            *(t.detach().double().cpu() for t in (q, k, v)), backend="reference", **plain
        )
    weighted = probs * eps.unsqueeze(-1)  # (B, Hq, Lq, Lk)
    B, Hkv, Lk = k.shape[0], k.shape[1], k.shape[2]
    per_key = weighted.sum(2).view(B, Hkv, -1, Lk).sum(2)
    model = {
        "dq": (shift[0], scale * float(k.abs().max()) * float(eps.max())),
        "dk": (shift[1], scale * float(q.abs().max()) * float(per_key.max())),
        "dv": (None, 0.0),
        "dbias": (None, 0.0),
    }
    if attn_mask is not None:
        per_bias = weighted.sum_to_size(attn_mask.shape)
        model["dbias"] = (shift[3], float(per_bias.max()))
    return model


def assert_gradient_close(name, got, ref64, low, model, tamper=None) -> None:
    """FlashAttention's rule (3x the baseline `low`'s error, plus the rounding floor) for the
    kernel gradient `got` against ref64 + the model's shift, with the model's extra floor,
    which must be below MAX_SHARE of the gradient's largest magnitude (in 16-bit). tamper:
    {name: factor} scales `got` first (tests of the check: tests/test_check_teeth.py)."""
    shift, extra = model[name]
    assert got.shape == ref64.shape and got.dtype == low.dtype, name
    target = ref64 if shift is None else ref64 + shift.to(ref64.device)
    assert_floor_is_small(name, extra, ref64, got.dtype)
    floor = float32_floor(ref64, got.dtype, extra)
    if floor is None:  # 16-bit: the rule's rounding floor (float64: and 16 ulps, as float32)
        floor = rounding_floor(ref64, got.dtype) + extra
        if got.dtype == torch.float64 and ref64.numel():
            floor += 16 * 2.0**-52 * float(ref64.abs().max())
    grad = got * (tamper or {}).get(name, 1.0)
    assert_grad_close(name, grad, target, low, floor=floor)


def assert_floor_is_small(name: str, extra: float, ref64: torch.Tensor, dtype) -> None:
    """The extra floor of a 16-bit gradient stays below MAX_SHARE of its largest magnitude, so
    that it cannot hide a gradient scaled by 0 or 1.25."""
    if dtype not in SIXTEEN_BIT or ref64.numel() == 0:
        return
    largest = float(ref64.abs().max())
    if largest == 0.0:
        return  # a gradient of exactly 0 (every row masked) is the same scaled by any factor
    assert extra <= MAX_SHARE * largest, (
        f"{name}: the extra floor {extra:.3e} is more than {MAX_SHARE:.0%} of the gradient's "
        f"largest magnitude {largest:.3e}: the case cannot tell a wrong gradient from rounding"
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
            share = results["model"][name][1] / largest if largest else 0.0
            shares[dtype, name] = max(shares.get((dtype, name), 0.0), share)
    return shares


if __name__ == "__main__":
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import conftest  # noqa: F401  (TRITON_INTERPRET before triton loads)

    for (dtype, name), share in sorted(_largest_shares().items()):
        print(f"{dtype:9s} {name:6s} largest extra floor / largest |gradient| = {share:.4%}")
