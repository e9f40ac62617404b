"""The accuracy checks have teeth: a wrong gradient fails them, on every kernel backend.

tests/test_attention.py's check (out, lse, dq, dk, dv) and tests/test_attention_bias_grad.py's
(out, dq, dk, dv, d bias) run a real kernel and the references once per case; then each
gradient of the kernel's result is scaled before the same assertions: by 0 and by 1.25 in
float16 and bfloat16, by 0 and by 1 + 1e-3 in float32. Every scaled gradient must fail the
check, and the unscaled result must pass it (so the failure is the scaling's). A floor that
grew to hide such an error, in the rule, the extra terms or the baseline, makes this fail.
"""

from __future__ import annotations

import pytest
import torch
from test_attention import (
    assert_matches_reference,
    attention_device,
    compare_with_reference,
    make_case,
)
from test_attention_bias_grad import (
    CASES,
    assert_bias_gradients_match,
    compare_bias_gradients,
)

KERNELS = ("cpu", "triton", "cuda")
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_DT = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


def wrong_factors(dtype: torch.dtype) -> tuple[float, ...]:
    """Scalings of a gradient every check must catch in `dtype`."""
    return (0.0, 1.0 + 1e-3) if dtype == torch.float32 else (0.0, 1.25)


def assert_each_scaling_fails(check, results, names, dtype) -> None:
    check(results)  # the unscaled kernel result passes
    for name in names:
        for factor in wrong_factors(dtype):
            with pytest.raises(AssertionError, match=name):
                check(results, tamper={name: factor})


@pytest.mark.parametrize("dtype", DTYPES, ids=[_DT[t] for t in DTYPES])
@pytest.mark.parametrize("backend", KERNELS)
def test_attention_check_catches_scaled_gradients(backend, dtype):
    device = attention_device(backend)
    # GQA and a causal band, lengths past one 64-row CPU tile (smaller under the interpreter).
    lengths = (37, 53) if device.type == "cpu" and backend == "triton" else (113, 203)
    q, k, v, kw = make_case("gqa", 64, *lengths, dtype, device)
    kw["causal"] = "bottom_right"
    results = compare_with_reference(backend, q, k, v, kw)
    assert_each_scaling_fails(assert_matches_reference, results, ("dq", "dk", "dv"), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=[_DT[t] for t in DTYPES])
@pytest.mark.parametrize("backend", KERNELS)
def test_bias_check_catches_scaled_gradients(backend, dtype):
    results = compare_bias_gradients(backend, CASES[0], dtype)  # (1, H, Lq, Lk), GQA-free
    names = ("dq", "dk", "dv", "dbias")
    assert_each_scaling_fails(assert_bias_gradients_match, results, names, dtype)
