"""Device functions shared by the Triton kernels of every op (defined once here; the host-side
helpers shared by the launchers are in fastattn/triton/__init__.py, Philox dropout in
fastattn/triton/random.py).

ACCURATE (constexpr) selects libdevice's functions, which exist on a GPU only: launchers pass
`not interpreting(device)`, or a narrower condition where the hardware approximation is
accurate enough (16-bit attention inputs).
"""

import triton
import triton.language as tl
from triton import knobs
from triton.language.extra import libdevice

# Whether the kernels compile for a GPU (False under the CPU interpreter, which triton.jit
# chooses from the same setting when a kernel module is imported).
_COMPILED = tl.constexpr(not knobs.runtime.interpret)

LOG2_E = tl.constexpr(1.4426950408889634)  # log2(e): exp(x) = exp2(x * LOG2_E)


@triton.jit
def exp(x, ACCURATE: tl.constexpr):
    """exp(x). tl.exp is the hardware exp2 of x * log2(e) on a GPU (about 2 ulp, far below the
    rounding of 16-bit inputs); ACCURATE uses libdevice's exp, accurate to the last bits as
    torch's own exp. Under the interpreter tl.exp is numpy's."""
    if ACCURATE:
        return libdevice.exp(x)
    else:
        return tl.exp(x)


@triton.jit
def exp2_flushed(x):
    """2**x in float32 with results below 2**-126 flushed to zero: one MUFU.EX2 on a GPU
    (ex2.approx.ftz, about 2 ulp). tl.exp2 lowers to the non-flushing ex2.approx, which wraps
    every call in a range test and two predicated multiplies to keep subnormal results; the
    softmax sums that this feeds start at 1, so a term below 2**-126 is lost either way.
    Under the interpreter, numpy's exp2."""
    if _COMPILED:
        return tl.inline_asm_elementwise(
            "ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1
        )
    else:
        return tl.exp2(x)


@triton.jit
def sigmoid(x, ACCURATE: tl.constexpr):
    """1 / (1 + exp(-x)); exp(-x) overflows to inf for very negative x, giving exactly 0."""
    return 1.0 / (1.0 + exp(-x, ACCURATE))


@triton.jit
def tanh(x, ACCURATE: tl.constexpr):
    """tanh to about 2 ulp in float32 (torch's is within 1.4), for every |x| without overflow
    and under the interpreter too (tl has no tanh on every Triton version, libdevice is
    GPU-only).

    (1 - e) / (1 + e) with e = exp(-2|x|) never overflows but cancels for small |x| (relative
    error unbounded as x -> 0, a few ulp at |x| ~ 0.1); below 0.625 an odd polynomial x P(x^2)
    is used instead (least-squares fit on Chebyshev nodes of [0, 0.625^2], 1.2 ulp there).
    """
    ax = tl.abs(x)
    u = x * x
    p = 0.0021303086
    p = p * u - 0.008161231
    p = p * u + 0.021692755
    p = p * u - 0.053944888
    p = p * u + 0.13333185
    p = p * u - 0.3333333
    p = p * u + 1.0
    e = exp(-2.0 * ax, ACCURATE)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(ax < 0.625, x * p, tl.where(x >= 0, t, -t))


@triton.jit
def round_to_bfloat16(x):
    """float32 x rounded to the nearest bfloat16 (ties to even), kept in float32. The
    interpreter's own float32 -> bfloat16 conversion truncates; kernels that run bfloat16 in
    float32 there round with this where a GPU would convert, so a CPU run rounds exactly
    where a GPU does."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)
