"""Hugging Face transformers integration: attn_implementation="fastattn".

    import fastattn.integrations.transformers as fa_hf
    fa_hf.register()
    model = AutoModelForCausalLM.from_config(config, attn_implementation="fastattn")

register() adds "fastattn" to transformers' AttentionInterface (the attention computation of
every model that uses the interface: BERT, GPT-2, Llama, Mistral, ...) and to its
AttentionMaskInterface with the "sdpa" mask format (boolean, True = may attend, or no mask when
the attention is plainly causal). The function mirrors transformers' sdpa integration —
causal hint, masks, GQA (handled natively, keys are never repeated), dropout, scaling, softcap
— with fastattn.attention doing the work.
"""

from __future__ import annotations

import torch

from ..ops.attention import attention

_NAME = "fastattn"


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
    """transformers attention function: query (B, H, Lq, D), key/value (B, Hkv, Lk, D) ->
    (attn_output (B, Lq, H, Dv), None). Attention weights are not returned (as with "sdpa")."""
    if kwargs.get("position_bias") is not None:
        raise ValueError(
            "fastattn: position_bias (T5-style relative bias) is not supported; "
            "use attn_implementation='eager' or 'sdpa' for such models"
        )
    q_length, kv_length = query.shape[2], key.shape[2]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # transformers' rule: the causal flag stands in for a mask only when no mask was built.
    is_causal = bool(q_length > 1 and attention_mask is None and is_causal)
    if is_causal and kv_length > q_length:
        # Prefill into an empty static cache: the slots past q_length are empty.
        key, value = key[:, :, :q_length], value[:, :, :q_length]
    softcap = kwargs.get("softcap") or 0.0
    # GPT-OSS passes its attention sinks (one logit per head, (Hq,)) as s_aux.
    sinks = kwargs.get("s_aux")
    out = attention(
        query,
        key,
        value,
        causal=is_causal,
        attn_mask=attention_mask,
        dropout_p=dropout if module.training else 0.0,
        scale=scaling,
        softcap=softcap,
        sinks=sinks,
    )
    # out is (B, Lq, H, Dv) in memory when query is a transposed (B, L, H, D) projection.
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register "fastattn" with transformers (idempotent)."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError as exc:  # optional dependency
        raise ImportError(
            "fastattn.integrations.transformers needs Hugging Face transformers "
            "(pip install transformers)"
        ) from exc
    AttentionInterface.register(_NAME, fastattn_attention_forward)
    AttentionMaskInterface.register(_NAME, sdpa_mask)
