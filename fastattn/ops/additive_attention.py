"""Additive (Bahdanau) attention: score_ij = v . tanh(W_q q_i + W_k k_j + bias), context_i =
sum_j softmax_j(score_ij) values_j.

The projections W_q q and W_k k + bias are (B, L, A) matrix products; the fused op
`additive_scores` (cpu/cuda: torch.ops.fastattn.additive_scores, triton: ..._triton, reference:
fastattn/reference/additive_attention.py) reduces tanh(qp_i + kp_j) against v without forming
the (B, Lq, Lk, A) tensor the straightforward implementation builds. The masked softmax and the
weighted sum of values that follow are one more fused op on the cpu backend
(`additive_context`); the other backends run them as plain torch ops on the (B, Lq, Lk)
scores (fastattn/reference/additive_attention.py: additive_context).
"""

from __future__ import annotations

import torch

from .. import _backend
from ..contracts import additive_attention as contract
from ..reference import additive_attention as ref
from ._common import (
    check_same_device,
    check_tensor,
    kernel_op,
    register_autograd,
    register_forward_backward,
    register_native_fakes,
)


def additive_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor | None = None,
    *,
    w_query: torch.Tensor,
    w_keys: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    return_weights: bool = False,
    projected_keys: torch.Tensor | None = None,
    backend: str | None = None,
):
    """Bahdanau (additive) attention, fused: no (B, Lq, Lk, A) tensor is allocated.

    `score(q_i, k_j) = v . tanh(W_q q_i + W_k k_j + bias)`, then a softmax over the keys and the
    weighted sum of the values. Queries whose keys are all masked get a zero context and zero
    weights.

    Args:
        query: (B, Lq, Dq), or (B, Dq) for one decoder step.
        keys: (B, Lk, Dk).
        values: (B, Lk, Dv); default: keys.
        w_query: (A, Dq), the query projection.
        w_keys: (A, Dk), the key projection.
        v: (A,), the scoring vector.
        bias: (A,) or None.
        key_padding_mask: Bool (B, Lk), True = ignore that key.
        return_weights: Also return the attention weights.
        projected_keys: (B, Lk, A) = `keys W_k^T + bias`, computed once per source sequence and
            reused at every decoder step (then `w_keys` and `bias` are not applied again).
        backend: The backend for this call; None chooses automatically.

    Returns:
        The context, (B, Lq, Dv) (or (B, Dv) for a one-step query); with `return_weights`, the
        pair (context, weights), weights (B, Lq, Lk) (or (B, Lk)) in the compute type (float32;
        float64 for float64 inputs).

    Raises:
        ValueError: Shapes, dtypes or devices that do not fit together.
        BackendError: The backend asked for cannot run this call.
    """
    op = "additive_attention"
    check_tensor(op, "query", query, dims=(2, 3), float_dtype=True)
    check_tensor(op, "keys", keys, dims=3, float_dtype=True)
    values = keys if values is None else values
    check_tensor(op, "values", values, dims=3, float_dtype=True)
    check_tensor(op, "w_query", w_query, dims=2, float_dtype=True)
    check_tensor(op, "w_keys", w_keys, dims=2, float_dtype=True)
    check_tensor(op, "v", v, dims=1, float_dtype=True)
    check_same_device(
        op,
        "query",
        query,
        keys=keys,
        values=values,
        w_query=w_query,
        w_keys=w_keys,
        v=v,
        bias=bias,
        key_padding_mask=key_padding_mask,
    )
    single_step = query.dim() == 2
    q = query.unsqueeze(1) if single_step else query
    B, Lq, Dq = q.shape
    Lk, Dk = keys.shape[1], keys.shape[2]
    A = v.shape[0]
    dtypes = {t.dtype for t in (q, keys, values, w_query, w_keys, v)}
    if len(dtypes) != 1:
        raise TypeError(
            f"{op}: query, keys, values and the weights must share one dtype, got "
            f"{sorted(str(d) for d in dtypes)}"
        )
    if keys.shape[0] != B or values.shape[0] != B or values.shape[1] != Lk:
        raise ValueError(
            f"{op}: query {tuple(query.shape)}, keys {tuple(keys.shape)} and values "
            f"{tuple(values.shape)} must agree in batch and key length"
        )
    if tuple(w_query.shape) != (A, Dq):
        raise ValueError(f"{op}: w_query must be (A, Dq) = ({A}, {Dq}), got {tuple(w_query.shape)}")
    if tuple(w_keys.shape) != (A, Dk):
        raise ValueError(f"{op}: w_keys must be (A, Dk) = ({A}, {Dk}), got {tuple(w_keys.shape)}")
    if bias is not None:
        check_tensor(op, "bias", bias, dims=1, float_dtype=True)
        if bias.shape[0] != A:
            raise ValueError(f"{op}: bias must be (A,) = ({A},), got {tuple(bias.shape)}")
    if key_padding_mask is not None:
        check_tensor(op, "key_padding_mask", key_padding_mask, dims=2)
        if key_padding_mask.dtype != torch.bool or tuple(key_padding_mask.shape) != (B, Lk):
            raise ValueError(
                f"{op}: key_padding_mask must be bool (B, Lk) = ({B}, {Lk}), got "
                f"{key_padding_mask.dtype} {tuple(key_padding_mask.shape)}"
            )

    chosen = _backend.select_backend(op, q.device, backend, kernel="additive_scores", dtype=q.dtype)
    qp = torch.nn.functional.linear(q, w_query)
    if projected_keys is not None:
        check_tensor(op, "projected_keys", projected_keys, dims=3, float_dtype=True)
        if tuple(projected_keys.shape) != (B, Lk, A) or projected_keys.dtype != q.dtype:
            raise ValueError(
                f"{op}: projected_keys must be (B, Lk, A) = ({B}, {Lk}, {A}) of "
                f"{q.dtype}, got {tuple(projected_keys.shape)} {projected_keys.dtype}"
            )
        kp = projected_keys
    else:
        kp = torch.nn.functional.linear(keys, w_keys, bias)
    if chosen == "reference":
        scores = ref.additive_scores(qp, kp, v)
    else:
        name = "additive_scores_triton" if chosen == "triton" else "additive_scores"
        scores = kernel_op(name)(qp, kp, v)
    _backend.record_backend(op, chosen)
    if chosen == "cpu":
        # The cpu kernels fuse the masked softmax and the weighted sum too (a decoder step's
        # dozen small torch ops and their autograd nodes become one op each way).
        context, weights = kernel_op("additive_context")(scores, values, key_padding_mask)
    else:
        context, weights = ref.additive_context(scores, values, key_padding_mask)
    if single_step:
        context, weights = context.squeeze(1), weights.squeeze(1)
    return (context, weights) if return_weights else context


def _register() -> None:
    """Fakes and autograd of the native ops and of their Triton twins, from the contract
    (fastattn/contracts/additive_attention.py)."""
    register_forward_backward(
        "additive_scores",
        "additive_scores_backward",
        contract.scores_fake,
        contract.scores_backward_fake,
        contract.autograd_formula,
        ref.additive_scores,
        "additive_attention",
    )
    register_native_fakes(
        {
            "additive_context": contract.context_fake,
            "additive_context_backward": contract.context_backward_fake,
        }
    )
    if _backend.has_op("additive_context"):
        register_autograd(
            "additive_context",
            contract.context_autograd_formula(
                torch.ops.fastattn.additive_context_backward, ref.additive_context
            ),
        )


_register()
