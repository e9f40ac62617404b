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

A kernel may also round P and dS to the input's 16-bit dtype before the products that read
them (dV = P^T dO, dK = dS^T Q, dQ = dS K), as FlashAttention's tensor-core kernels and the
AVX512-BF16 CPU kernel do: one rounding of relative size at most u (the dtype's unit roundoff,
2**-8 in bfloat16, 2**-11 in float16) per product term. The reference rounds neither, and a
gradient element that is a sum with cancellation (dk_j = scale * sum_i dS_ij q_i with one
visible key and an lse gradient: a few terms of either sign) can then miss the rule by the
rounding of its terms alone. That is the second derived term, a per-element slack
(`rounding_slack`): for a sum of terms x_i each rounded once,
    |error| <= min(u * sum_i |x_i|, LAMBDA * u * sqrt(sum_i x_i**2)),
the first bound deterministic, the second Higham and Mary's probabilistic bound (independent
mean-zero roundings; it fails with probability at most 2 exp(-LAMBDA**2 / 2), 3e-8 for
LAMBDA = 6), which keeps it near LAMBDA * u of the element when thousands of terms cancel.
|dS_ij| is |P_ij Z_ij dP_ij / (1 - p) - P_ij Delta_i| from the float64 reference's
probabilities and, with dropout, the mask Z of the kernel's call (the reference redraws it from
the same torch.manual_seed); a softcap's derivative, at most 1, only shrinks it. The kernel's
float32 dS differs from it by float32 roundoff, a relative 1e-6 of a slack that is itself a
bound. The
slack is taken off each element's error before the rule's bound applies.

Their sizes, by the float64 experiment `python tests/attention_floors.py` (the quick attention
cases and the bias cases on the cpu backend). The extra floor (AMD EPYC Zen 3, 2026-11-28): at
most 0.012% of the gradient's largest magnitude (dq in bfloat16; dk 0.009%, d bias 0.001%);
the checks assert it stays below 5% (`MAX_SHARE`; a gradient that is exactly 0 everywhere,
e.g. every row masked, is exempt: scaling it changes nothing). The slack at the gradient's
largest element (AMD EPYC Zen 4, 2026-11-29): at most 2.8% of it in bfloat16 (dq; dk 1.6%, dv
0.9%) and 0.23% in float16; the checks assert it stays below 10% there
(`ROUNDING_MAX_SHARE`). Neither can hide a gradient scaled by 0 or 1.25, which is 25% off at
that element (tests/test_check_teeth.py). A gradient of lse is part of each check: without it, a
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
ROUNDING_MAX_SHARE = 0.10
LAMBDA = 6.0
DROPOUT_SEED = 1234  # the torch.manual_seed of the tests' kernel calls (run_attention)


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


def delta_model(q, k, v, kw, grad_out, out64, out, attn_mask=None, grad_lse=None) -> dict:
    """{"dq", "dk", "dv", "dbias": (shift, extra, slack)} for a kernel's gradients (module
    docstring): the kernel should equal the float64 gradient + shift (float64 CPU tensor, or
    None) within the rule with `extra` added to its floor, each element's error first reduced
    by slack (float64 CPU tensor of the gradient's shape, or None: rounding_slack).

    q, k, v (and attn_mask) the inputs; grad_out (B, Hq, Lq, Dv) the output gradient and
    grad_lse (B, Hq, Lq) the lse's, if any; out64 the float64 reference's output and out the
    kernel's (its Delta reads it). dv has no shift or extra (dV = P^T dO does not read
    Delta)."""
    if q.numel() == 0 or k.numel() == 0:
        return {name: (None, 0.0, None) for name in ("dq", "dk", "dv", "dbias")}
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
    if attn_mask is not None:
        plain["attn_mask"] = attn_mask.detach().double().cpu()
    with torch.no_grad():
        _, probs = attention_with_weights(
            *(t.detach().double().cpu() for t in (q, k, v)), backend="reference", **plain
        )
    weighted = probs * eps.unsqueeze(-1)  # (B, Hq, Lq, Lk)
    B, Hkv, Lk = k.shape[0], k.shape[1], k.shape[2]
    per_key = weighted.sum(2).view(B, Hkv, -1, Lk).sum(2)
    dropout = {"dropout_p": kw["dropout_p"]} if kw.get("dropout_p", 0.0) > 0.0 else {}
    slack = rounding_slack(q, k, v, {**plain, **dropout}, grad_out, out, probs, grad_lse)
    model = {
        "dq": (shift[0], scale * float(k.abs().max()) * float(eps.max()), slack["dq"]),
        "dk": (shift[1], scale * float(q.abs().max()) * float(per_key.max()), slack["dk"]),
        "dv": (None, 0.0, slack["dv"]),
        "dbias": (None, 0.0, None),
    }
    if attn_mask is not None:
        per_bias = weighted.sum_to_size(attn_mask.shape)
        model["dbias"] = (shift[3], float(per_bias.max()), None)
    return model


def rounding_slack(q, k, v, kw, grad_out, out, probs, grad_lse=None, seed=DROPOUT_SEED) -> dict:
    """{"dq", "dk", "dv": float64 CPU tensor or None}: per element, the bound of the module
    docstring on what rounding P and dS to q's 16-bit dtype before the products can change
    (None for other dtypes). kw: the call's keywords (CPU tensors); probs (B, Hq, Lq, Lk) the
    float64 reference's undropped probabilities; grad_lse (B, Hq, Lq) or None; seed: the
    torch.manual_seed of the kernel's call, whose dropout mask the reference redraws."""
    if q.dtype not in SIXTEEN_BIT:
        return {"dq": None, "dk": None, "dv": None}
    u = torch.finfo(q.dtype).eps / 2
    scale = kw.get("scale") or 1.0 / math.sqrt(q.shape[-1])
    group = q.shape[1] // k.shape[1]
    qa, ka, va, do = (t.detach().double().cpu() for t in (q, k, v, grad_out))
    ka, va = (t.repeat_interleave(group, dim=1) for t in (ka, va))
    delta = (do * out.detach().double().cpu()).sum(-1)
    if grad_lse is not None:
        delta = delta - grad_lse.detach().double().cpu()
    probs = torch.nan_to_num(probs)  # rows without a visible key: P = 0
    kept = probs  # P_ij Z_ij / (1 - p): the dropped probabilities of the kernel's call
    if kw.get("dropout_p", 0.0) > 0.0:
        with torch.random.fork_rng(devices=[]), torch.no_grad():  # the callers' RNG untouched
            torch.manual_seed(seed)
            _, kept = attention_with_weights(
                *(t.detach().double().cpu() for t in (q, k, v)), backend="reference", **kw
            )
        kept = torch.nan_to_num(kept)
    # |dS| as the kernel rounds it: dP - Delta cancels before the rounding
    ds = scale * (kept * torch.matmul(do, va.transpose(-1, -2)) - probs * delta[..., None]).abs()

    def bound(terms: torch.Tensor, x: torch.Tensor, per_kv: bool) -> torch.Tensor:
        # sum_i |x_i| and sqrt(sum_i x_i^2) of the terms terms[.., i] * x[.., i, :]
        total = torch.matmul(terms, x.abs())
        squares = torch.matmul(terms.square(), x.square())
        if per_kv:
            B, H, n, d = total.shape
            total = total.view(B, H // group, group, n, d).sum(2)
            squares = squares.view(B, H // group, group, n, d).sum(2)
        return u * torch.minimum(total, LAMBDA * squares.sqrt())

    return {
        "dq": bound(ds, ka, per_kv=False),
        "dk": bound(ds.transpose(-1, -2), qa, per_kv=True),
        "dv": bound(kept.transpose(-1, -2), do, per_kv=True),  # dV's terms P_ij Z_ij dO_i / (1 - p)
    }


def assert_gradient_close(name, got, ref64, low, model, tamper=None) -> None:
    """FlashAttention's rule (3x the baseline `low`'s error, plus the rounding floor) for the
    kernel gradient `got` against ref64 + the model's shift, with the model's extra floor,
    which must be below MAX_SHARE of the gradient's largest magnitude (in 16-bit). tamper:
    {name: factor} scales `got` first (tests of the check: tests/test_check_teeth.py)."""
    shift, extra, slack = model[name]
    assert got.shape == ref64.shape and got.dtype == low.dtype, name
    target = ref64 if shift is None else ref64 + shift.to(ref64.device)
    assert_floor_is_small(name, extra, ref64, got.dtype)
    assert_slack_is_small(name, slack, target)
    floor = float32_floor(ref64, got.dtype, extra)
    if floor is None:  # 16-bit: the rule's rounding floor (float64: and 16 ulps, as float32)
        floor = rounding_floor(ref64, got.dtype) + extra
        if got.dtype == torch.float64 and ref64.numel():
            floor += 16 * 2.0**-52 * float(ref64.abs().max())
    grad = got * (tamper or {}).get(name, 1.0)
    assert_grad_close(name, grad, target, low, floor=floor, slack=slack)


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


def assert_slack_is_small(name: str, slack, target: torch.Tensor) -> None:
    """At the gradient's largest element the rounding slack stays below ROUNDING_MAX_SHARE of
    it, so that a gradient scaled by 0 or 1.25 still fails there."""
    if slack is None or target.numel() == 0:
        return
    target = target.detach().double().cpu()
    at = int(target.abs().argmax())
    largest, room = float(target.flatten()[at].abs()), float(slack.flatten()[at])
    if largest == 0.0:
        return
    assert room <= ROUNDING_MAX_SHARE * largest, (
        f"{name}: the rounding slack {room:.3e} is more than {ROUNDING_MAX_SHARE:.0%} of the "
        f"gradient's largest element {largest:.3e}: the case cannot tell a wrong gradient from "
        "rounding"
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
            ("dq", "dk", "dv"),
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
            ref = results["ref64"][index].double().cpu()
            largest = float(ref.abs().max())
            share = results["model"][name][1] / largest if largest else 0.0
            shares[dtype, name] = max(shares.get((dtype, name), 0.0), share)
            slack = results["model"][name][2]
            if slack is not None and largest:
                at = int(ref.abs().argmax())
                room = float(slack.flatten()[at]) / largest
                shares[dtype, name + " slack"] = max(shares.get((dtype, name + " slack"), 0), room)
    return shares


if __name__ == "__main__":
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent))
    import conftest  # noqa: F401  (TRITON_INTERPRET before triton loads)

    for (dtype, name), share in sorted(_largest_shares().items()):
        what = "rounding slack at" if name.endswith("slack") else "largest extra floor /"
        print(f"{dtype:9s} {name:12s} {what} largest |gradient| = {share:.4%}")
