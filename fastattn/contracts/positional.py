"""Contract of the positional-encoding ops (csrc/bindings.cpp declares the schemas; the Triton
twins carry them suffixed _triton, the in-place ones as <name>_triton_):

    sinusoidal_table(positions int64 (...), dim, base, dtype) -> (..., dim)
    add_sinusoidal(x (N, L, D), offset, offsets? (N,), scale, base, dropout_p, seed?)
        -> laid out like x;  add_sinusoidal_(x!, ...) writes x
    add_sinusoidal_backward(grad, scale, dropout_p, seed?) -> laid out like grad
    embed_with_positions(tokens int64 (N, L), weight (V, D), table? (rows, D), offset,
        offsets?, scale, base, dropout_p, seed?, padding_idx, deterministic) -> (N, L, D)
    embed_with_positions_backward(grad, tokens, num_weights, padding_idx, table_rows, offset,
        offsets?, scale, dropout_p, seed?, deterministic)
        -> (grad_weight (V, D), grad_table (max(table_rows, 0), D))
    apply_rotary(x (B, H, L, D), cos?, sin?, offset, offsets?, position_ids?, rotary_dim, base,
        interleaved, conjugate) -> laid out like x;  apply_rotary_(x!, ...) writes x

Every backend computes angles pos * base^(-2i/dim) (inverse frequencies from float64, rounded
once), arithmetic in float32 (float64 for float64 inputs), and dropout from fastattn's Philox
stream.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import backward_through_reference, unit_last_stride


def sinusoidal_table_fake(positions, dim, base, dtype):
    return positions.new_empty((*positions.shape, dim), dtype=dtype)


def add_sinusoidal_fake(x, offset, offsets, scale, base, dropout_p, seed):
    return torch.empty_like(x)


def add_sinusoidal_inplace_fake(x, offset, offsets, scale, base, dropout_p, seed):
    return None


def add_sinusoidal_backward_fake(grad, scale, dropout_p, seed):
    return torch.empty_like(grad)


def embed_with_positions_fake(
    tokens, weight, table, offset, offsets, scale, base, dropout_p, seed, padding_idx, deterministic
):
    return weight.new_empty((tokens.shape[0], tokens.shape[1], weight.shape[1]))


def embed_with_positions_backward_fake(
    grad,
    tokens,
    num_weights,
    padding_idx,
    table_rows,
    offset,
    offsets,
    scale,
    dropout_p,
    seed,
    deterministic,
):
    D = grad.shape[2]
    return grad.new_empty((num_weights, D)), grad.new_empty((max(table_rows, 0), D))


def apply_rotary_fake(
    x, cos, sin, offset, offsets, position_ids, rotary_dim, base, interleaved, conjugate
):
    return torch.empty_like(x)


def apply_rotary_inplace_fake(
    x, cos, sin, offset, offsets, position_ids, rotary_dim, base, interleaved, conjugate
):
    return None


# Op name (native spelling; in-place ops end in "_") -> fake implementation
FAKES: dict[str, Callable] = {
    "sinusoidal_table": sinusoidal_table_fake,
    "add_sinusoidal": add_sinusoidal_fake,
    "add_sinusoidal_": add_sinusoidal_inplace_fake,
    "add_sinusoidal_backward": add_sinusoidal_backward_fake,
    "embed_with_positions": embed_with_positions_fake,
    "embed_with_positions_backward": embed_with_positions_backward_fake,
    "apply_rotary": apply_rotary_fake,
    "apply_rotary_": apply_rotary_inplace_fake,
}


def autograd_formulas(
    op: Callable[[str], Callable], embed_reference: Callable
) -> dict[str, tuple[Callable, Callable]]:
    """Op name -> (backward, setup_context) of one backend's op set; op(name) is that
    backend's op for a native op name ("add_sinusoidal_backward" -> its kernel). A
    create_graph=True backward of embed_with_positions differentiates `embed_reference`
    (fastattn.reference.positional.embed_with_positions); the other backwards are linear in
    the gradient and differentiable as they are."""

    def add_sinusoidal_setup(ctx, inputs, output):
        x, offset, offsets, scale, base, dropout_p, seed = inputs
        ctx.scale, ctx.dropout_p = scale, dropout_p
        ctx.save_for_backward(seed)

    def add_sinusoidal_backward(ctx, grad):
        (seed,) = ctx.saved_tensors
        grad_x = op("add_sinusoidal_backward")(
            unit_last_stride(grad), ctx.scale, ctx.dropout_p, seed
        )
        return grad_x, None, None, None, None, None, None

    def add_sinusoidal_backward_setup(ctx, inputs, output):
        grad, scale, dropout_p, seed = inputs
        ctx.scale, ctx.dropout_p = scale, dropout_p
        ctx.save_for_backward(seed)

    def add_sinusoidal_double_backward(ctx, grad):
        # The backward is linear in grad: its own backward is the same operation.
        (seed,) = ctx.saved_tensors
        out = op("add_sinusoidal_backward")(unit_last_stride(grad), ctx.scale, ctx.dropout_p, seed)
        return out, None, None, None

    def embed_setup(ctx, inputs, output):
        (
            tokens,
            weight,
            table,
            offset,
            offsets,
            scale,
            base,
            dropout_p,
            seed,
            padding_idx,
            deterministic,
        ) = inputs
        ctx.meta = (
            weight.shape[0],
            -1 if table is None else table.shape[0],
            offset,
            scale,
            base,
            dropout_p,
            padding_idx,
            deterministic,
        )
        ctx.save_for_backward(tokens, offsets, seed)
        # Only a create_graph backward reads these (to differentiate the reference); held
        # without save_for_backward's version check, which would fail ordinary backwards of
        # models that update the weight in place between forward and backward.
        ctx.weight, ctx.table = weight, table

    def embed_backward(ctx, grad):
        (num_weights, table_rows, offset, scale, base, dropout_p, padding_idx, deterministic) = (
            ctx.meta
        )
        tokens, offsets, seed = ctx.saved_tensors
        if torch.is_grad_enabled():  # create_graph=True: a backward that is differentiable
            args = (
                tokens,
                ctx.weight,
                ctx.table,
                offset,
                offsets,
                scale,
                base,
                dropout_p,
                seed,
                padding_idx,
                deterministic,
            )
            return backward_through_reference(embed_reference, args, ctx.needs_input_grad, (grad,))
        grad_weight = grad_table = None
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            grad_weight, grad_table = op("embed_with_positions_backward")(
                grad,
                tokens,
                num_weights,
                padding_idx,
                table_rows,
                offset,
                offsets,
                scale,
                dropout_p,
                seed,
                deterministic,
            )
            if table_rows < 0:
                grad_table = None
        return (None, grad_weight, grad_table, None, None, None, None, None, None, None, None)

    def rotary_setup(ctx, inputs, output):
        (x, cos, sin, offset, offsets, position_ids, rotary_dim, base, interleaved, conjugate) = (
            inputs
        )
        ctx.meta = (offset, rotary_dim, base, interleaved, conjugate)
        ctx.save_for_backward(cos, sin, offsets, position_ids)

    def rotary_backward(ctx, grad):
        offset, rotary_dim, base, interleaved, conjugate = ctx.meta
        cos, sin, offsets, position_ids = ctx.saved_tensors
        # A rotation's transpose is the rotation by the opposite angle.
        grad_x = op("apply_rotary")(
            unit_last_stride(grad),
            cos,
            sin,
            offset,
            offsets,
            position_ids,
            rotary_dim,
            base,
            interleaved,
            not conjugate,
        )
        return grad_x, None, None, None, None, None, None, None, None, None

    return {
        "add_sinusoidal": (add_sinusoidal_backward, add_sinusoidal_setup),
        "add_sinusoidal_backward": (add_sinusoidal_double_backward, add_sinusoidal_backward_setup),
        "embed_with_positions": (embed_backward, embed_setup),
        "apply_rotary": (rotary_backward, rotary_setup),
    }
