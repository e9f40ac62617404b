"""FlashAttention's tolerance rule.

A kernel's result passes when its error against a float64 reference is at most `factor` times
the error of the same reference run in the input's precision, plus a rounding floor:
    |out - ref64|_max <= factor * |ref_lowp - ref64|_max + floor
with factor 2 for outputs and 3 for gradients. Both errors are printed before asserting, so a
failure (and a pass) shows the margin.
"""

from __future__ import annotations

import torch

# Comparisons that passed in this process so far (conftest.py attributes them to each test's
# backend and prints the count per backend at the end of the run).
passed_comparisons = 0


def rounding_floor(ref64: torch.Tensor, dtype: torch.dtype) -> float:
    """Twice the representation error of dtype at the reference's values shifted by 0.3 (the
    floor FlashAttention's tests add, so exact-zero baselines do not demand exact results)."""
    r = ref64.to(dtype)
    return 2.0 * float(((r + 0.3) - 0.3 - r).abs().max()) if r.numel() else 0.0


def max_error(a: torch.Tensor, b: torch.Tensor, slack: torch.Tensor | None = None) -> float:
    """max |a - b|, each element's difference first reduced by slack (never below 0)."""
    if a.numel() == 0:
        return 0.0
    diff = (a.detach().double().cpu() - b.detach().double().cpu()).abs()
    if torch.isnan(diff).any():
        return float("nan")
    if slack is not None:
        diff = (diff - slack.double().cpu()).clamp_min(0.0)
    return float(diff.max())


def assert_fa_close(
    name: str,
    out: torch.Tensor,
    ref64: torch.Tensor,
    ref_lowp: torch.Tensor,
    *,
    factor: float = 2.0,
    floor: float | None = None,
    slack: torch.Tensor | None = None,
) -> None:
    """Assert out is within FlashAttention's rule of ref64, using ref_lowp as the baseline.
    slack (ref64's shape, or None): a derived per-element allowance taken off each element's
    error first (tests/attention_floors.py: the rounding of P and dS)."""
    assert out.shape == ref64.shape, f"{name}: shape {tuple(out.shape)} != {tuple(ref64.shape)}"
    err = max_error(out, ref64, slack)
    base = max_error(ref_lowp, ref64)
    if floor is None:
        floor = rounding_floor(ref64, out.dtype)
    bound = factor * base + floor
    beyond = "" if slack is None else " beyond the rounding slack"
    print(
        f"{name}: max error{beyond} {err:.3e}, reference-in-{out.dtype} error {base:.3e}, "
        f"bound {bound:.3e}"
    )
    assert err == err, f"{name}: NaN in the output (an element was not written?)"
    assert err <= bound, f"{name}: max error {err:.3e} > bound {bound:.3e} (baseline {base:.3e})"
    global passed_comparisons
    passed_comparisons += 1


def assert_grad_close(
    name: str, out: torch.Tensor, ref64: torch.Tensor, ref_lowp: torch.Tensor, **kwargs
) -> None:
    assert_fa_close(name, out, ref64, ref_lowp, factor=kwargs.pop("factor", 3.0), **kwargs)


F32_ULP = 2.0**-23


def float32_floor(
    ref64: torch.Tensor, dtype: torch.dtype = torch.float32, extra: float = 0.0
) -> float | None:
    """The rule's rounding floor plus 16 float32 ulps of the largest reference magnitude (and
    `extra`) for float32 results; None (assert_fa_close's own floor) for other dtypes.

    The rule's floor (twice the representation error at |x| + 0.3) is made for 16-bit results.
    A float32 result is a float32 accumulation whose order differs between implementations, so
    a few ulps of its magnitude are noise whatever the baseline says, and the baseline is a
    maximum over few elements when a dimension is tiny. Errors of real bugs (a wrong mask,
    tile or dropout element) are orders of magnitude larger.
    """
    if dtype != torch.float32 or ref64.numel() == 0:
        return None
    return rounding_floor(ref64, dtype) + 16 * F32_ULP * float(ref64.abs().max()) + extra


def assert_lse_close(lse: torch.Tensor, lse64: torch.Tensor, lse_lowp: torch.Tensor) -> None:
    """lse (the log-sum-exp of attention rows) within the rule; rows without a visible key
    exactly -inf on both sides (and only those)."""
    empty = torch.isneginf(lse64)
    assert not torch.isnan(lse).any(), "lse has NaN"
    assert torch.equal(torch.isneginf(lse).cpu(), empty.cpu()), (
        "rows without a visible key must have lse -inf (and only those)"
    )

    def finite(t):
        return t.masked_fill(torch.isneginf(t), 0.0)

    assert_fa_close(
        "lse",
        finite(lse),
        finite(lse64),
        finite(lse_lowp),
        floor=float32_floor(finite(lse64), torch.float32),
    )
