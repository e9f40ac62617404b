"""Hugging Face transformers integration: attn_implementation="fastattn".

Usage::

    import fastattn.integrations.transformers as fa_hf
    fa_hf.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="fastattn")

`register()` adds "fastattn" to transformers' AttentionInterface (the attention computation
of every model that uses the interface: BERT, GPT-2, Llama, Mistral, T5, ...) and to its
AttentionMaskInterface with the "sdpa" mask format (boolean, True = may attend, or no mask
when the attention is plainly causal). The function mirrors transformers' sdpa integration
(causal hint, masks, GQA handled natively without repeating keys, dropout, scaling) with
`fastattn.attention` doing the work, and goes beyond it where sdpa cannot:

- `softcap` (Gemma 2) is applied in the kernels;
- `position_bias` (T5's relative position bias, or any additive bias a model passes) joins
  the float mask, and its gradient flows back to the bias parameters;
- `s_aux` / `sinks` (GPT-OSS's attention sinks) go to fastattn's `sinks`;
- `indices` (DeepSeek-V3.2's top-k key selection, (B, Lq, topk)) is folded into the boolean
  mask: each query sees only its selected keys (and what the mask allows);
- `sliding_window` is already part of the sdpa-format mask transformers builds (as for sdpa).

Any other keyword that could change the result and that fastattn does not understand raises
a ValueError naming it, instead of being dropped. Models whose attention layers do not call
transformers' interface never reach fastattn: `register()` makes building one with
attn_implementation="fastattn" warn once per architecture.
"""

from __future__ import annotations

import inspect
import re
import sys
import warnings

import torch

from ..ops.attention import attention

_NAME = "fastattn"

# Keywords transformers passes through to attention functions that do not change the
# attention's result here: bookkeeping of the model's forward, or inputs that the sdpa-format
# mask already encodes (packed sequences through position_ids and cu_seq_lens, sliding windows).
_IGNORED_KEYWORDS = frozenset(
    {
        "output_attentions",
        "output_hidden_states",
        "output_router_logits",
        "return_dict",
        "use_cache",
        "cache_position",
        "past_key_values",
        "past_key_value",
        "position_ids",
        "position_embeddings",
        "num_items_in_batch",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "seq_idx",
        "sliding_window",
        "layer_idx",
    }
)
_UNDERSTOOD_KEYWORDS = frozenset(
    {"position_bias", "softcap", "s_aux", "sinks", "indices", "deterministic"}
)


def _refuse_unknown(kwargs: dict) -> None:
    for name, value in kwargs.items():
        if name in _IGNORED_KEYWORDS or name in _UNDERSTOOD_KEYWORDS:
            continue
        if value is None or value is False:
            continue
        raise ValueError(
            f"fastattn: transformers passed the attention keyword {name!r} "
            f"({type(value).__name__}), which fastattn does not understand and which could "
            "change the result; use attn_implementation='eager' for this model, or report it"
        )


def _selected_keys(indices: torch.Tensor, batch: int, q_length: int, kv_length: int):
    """indices (B, Lq, topk) of the keys each query keeps -> bool (B, 1, Lq, Lk), True =
    selected."""
    if indices.dim() != 3 or indices.shape[0] != batch or indices.shape[1] != q_length:
        raise ValueError(
            f"fastattn: indices must be (B, Lq, topk) = ({batch}, {q_length}, topk), "
            f"got shape {tuple(indices.shape)}"
        )
    if indices.dtype.is_floating_point or indices.dtype == torch.bool:
        raise ValueError(f"fastattn: indices must be an integer tensor, got {indices.dtype}")
    selected = torch.zeros(batch, q_length, kv_length, dtype=torch.bool, device=indices.device)
    return selected.scatter(-1, indices.long(), True).unsqueeze(1)


def _combined_mask(attention_mask, position_bias, indices, batch, q_length, kv_length):
    """One attn_mask for fastattn.attention from transformers' mask (bool, True = may attend,
    or float, added), an additive position_bias (float, broadcastable to (B, H, Lq, Lk); it
    keeps its gradient) and top-k `indices`. None when there is nothing to apply."""
    mask = attention_mask
    if position_bias is not None:
        if not isinstance(position_bias, torch.Tensor) or not position_bias.is_floating_point():
            raise ValueError("fastattn: position_bias must be a floating-point tensor")
        bias = position_bias[..., :kv_length]
        if mask is None:
            mask = bias
        elif mask.dtype == torch.bool:
            mask = torch.where(mask, bias, float("-inf"))
        else:
            mask = bias + mask
    if indices is not None:
        selected = _selected_keys(indices, batch, q_length, kv_length)
        if mask is None:
            mask = selected
        elif mask.dtype == torch.bool:
            mask = mask & selected
        else:
            mask = mask.masked_fill(~selected, float("-inf"))
    return mask


def fastattn_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
):
    """The attention function transformers calls for attn_implementation="fastattn".

    Args:
        module: The model's attention module (its `is_causal`, when the call gives none, and
            `training`, for dropout, are read).
        query: (B, H, Lq, D).
        key: (B, Hkv, Lk, D).
        value: (B, Hkv, Lk, Dv).
        attention_mask: The sdpa-format mask (bool, True = may attend, or float), or None.
        dropout: Dropout on the probabilities.
        scaling: The score scale; default `1 / sqrt(D)`.
        is_causal: The causal hint; None reads the module's. As in transformers, it stands
            in for a mask only when no mask was built and there is more than one query.
        **kwargs: `softcap`, `position_bias`, `s_aux` / `sinks`, `indices` (the module
            docstring), `deterministic`, and the keywords transformers passes that do not
            change the result.

    Returns:
        (attn_output (B, Lq, H, Dv), None): attention weights are not returned (as with "sdpa").

    Raises:
        ValueError: A keyword that could change the result and that fastattn does not
            understand, naming it.
    """
    _refuse_unknown(kwargs)
    batch, q_length, kv_length = query.shape[0], query.shape[2], key.shape[2]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # transformers' rule: the causal flag stands in for a mask only when no mask was built.
    is_causal = bool(q_length > 1 and attention_mask is None and is_causal)
    if is_causal and kv_length > q_length:
        # Prefill into an empty static cache: the slots past q_length are empty.
        key, value = key[:, :, :q_length], value[:, :, :q_length]
        kv_length = q_length
    mask = _combined_mask(
        attention_mask,
        kwargs.get("position_bias"),
        kwargs.get("indices"),
        batch,
        q_length,
        kv_length,
    )
    # GPT-OSS passes its attention sinks (one logit per head, (Hq,)) as s_aux.
    sinks = kwargs.get("s_aux")
    if sinks is None:
        sinks = kwargs.get("sinks")
    out = attention(
        query,
        key,
        value,
        causal=is_causal,
        attn_mask=mask,
        dropout_p=dropout if module.training else 0.0,
        scale=scaling,
        softcap=kwargs.get("softcap") or 0.0,
        deterministic=bool(kwargs.get("deterministic") or False),
        sinks=sinks,
    )
    # out is (B, Lq, H, Dv) in memory when query is a transposed (B, L, H, D) projection.
    return out.transpose(1, 2).contiguous(), None


# ---------------------------------------------------------------------------------------------
# Models that never call the interface

_warned_classes: set[str] = set()


def routes_attention_through_interface(model_class: type) -> bool:
    """Whether a model class's attention layers call transformers' AttentionInterface.

    The same source heuristic transformers uses for set_attn_implementation: a module with
    `*Attention*(nn.Module)` classes must look the interface up (ALL_ATTENTION_FUNCTIONS); one
    without attention classes (a wrapper of other models) counts as routing.

    Args:
        model_class: A transformers model class.

    Returns:
        True when attn_implementation="fastattn" reaches fastattn in that model.
    """
    module = sys.modules.get(model_class.__module__)
    if module is None:
        return True
    try:
        source = inspect.getsource(module)
    except (OSError, TypeError):
        return True

    if not re.search(r"^class \w*Attention\w*\(nn\.Module\):", source, re.MULTILINE):
        return True
    return "ALL_ATTENTION_FUNCTIONS" in source


def _warn_if_not_routed(model) -> None:
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) != _NAME:
        return
    cls = type(model)
    name = cls.__module__  # once per architecture (its base model and heads share a module)
    if name in _warned_classes or routes_attention_through_interface(cls):
        return
    _warned_classes.add(name)
    warnings.warn(
        f"fastattn: {cls.__name__} computes attention in its own layers and never calls "
        "transformers' attention interface: attn_implementation='fastattn' has no effect on "
        "it (its own attention runs)",
        UserWarning,
        stacklevel=3,
    )


def _install_build_warning(pretrained_model_class) -> None:
    """Wraps PreTrainedModel.post_init (which every model's __init__ calls last) to warn
    about models that fastattn cannot reach. Idempotent."""
    original = pretrained_model_class.post_init
    if getattr(original, "_fastattn_wrapped", False):
        return

    def post_init(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        _warn_if_not_routed(self)
        return result

    post_init._fastattn_wrapped = True  # type: ignore[attr-defined]  # a marker on the function
    post_init.__wrapped__ = original  # type: ignore[attr-defined]  # as functools.wraps sets it
    pretrained_model_class.post_init = post_init


def register() -> None:
    """Register "fastattn" with transformers' attention and mask interfaces (idempotent).

    After it, `attn_implementation="fastattn"` selects `fastattn_attention_forward`.
    """
    try:
        from transformers import AttentionInterface, PreTrainedModel
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as exc:  # optional dependency
        raise ImportError(
            "fastattn.integrations.transformers needs Hugging Face transformers "
            "(pip install transformers)"
        ) from exc
    AttentionInterface.register(_NAME, fastattn_attention_forward)
    AttentionMaskInterface.register(_NAME, sdpa_mask)
    _install_build_warning(PreTrainedModel)
