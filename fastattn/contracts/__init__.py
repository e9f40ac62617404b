"""Op contracts: for every torch op that fastattn registers (csrc/bindings.cpp declares the
native schemas; the Triton twins carry the same schemas, suffixed _triton), what a result looks
like (shapes, dtypes, memory layout: the fake implementations), the rules every backend shares
(length limits, the lse dtype), and the backward formula that autograd attaches.

One module per op, named as the op everywhere else. This is the lowest Python layer: it imports
torch only, so the op layer (fastattn/ops, which registers fakes and autograd from here for the
native and the Triton op sets), the Triton kernels (which allocate their outputs by these
rules) and the reference all read one definition.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def backward_through_reference(
    forward: Callable, inputs: tuple, needs_input_grad: tuple, grad_outputs: tuple
) -> tuple:
    """A differentiable backward: the gradients of `forward(*inputs)` (the op's plain-PyTorch
    reference composition) with respect to the inputs that need them, built with
    create_graph=True.

    The kernels' backward ops have no derivative of their own; an op's autograd backward calls
    this instead of its kernel when grad mode is on inside the backward (a backward taken with
    create_graph=True, as gradient penalties and MAML take it), so second-order gradients are
    those of the reference formula rather than silently missing. grad_outputs holds one
    gradient (or None) per output of `forward`; returns one gradient (or None) per input.
    """
    with torch.enable_grad():
        outputs = forward(*inputs)
    outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    pairs = [
        (o, g)
        for o, g in zip(outputs, grad_outputs)
        if g is not None and isinstance(o, torch.Tensor) and o.requires_grad
    ]
    wanted = [
        i
        for i, (t, need) in enumerate(zip(inputs, needs_input_grad))
        if need and isinstance(t, torch.Tensor) and t.requires_grad
    ]
    result: list[torch.Tensor | None] = [None] * len(inputs)
    if not pairs or not wanted:
        return tuple(result)
    grads = torch.autograd.grad(
        [o for o, _ in pairs],
        [inputs[i] for i in wanted],
        [g for _, g in pairs],
        create_graph=True,
        allow_unused=True,
    )
    for i, g in zip(wanted, grads):
        result[i] = g if g is not None else torch.zeros_like(inputs[i])
    return tuple(result)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The accumulation type of every backend: float64 for float64 storage, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """t, or a contiguous copy when its last dimension is not read with stride 1 (the kernels
    read rows with a unit stride; incoming gradients can be expanded with stride 0)."""
    if t.dim() == 0 or t.shape[-1] <= 1 or t.stride(-1) == 1:
        return t
    return t.contiguous()
