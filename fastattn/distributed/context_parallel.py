"""context_parallel: fastattn.nn.MultiheadAttention on sequence shards.

Inside `with context_parallel(group, method=..., layout=...)`, fastattn.nn.MultiheadAttention
(and so every model fastattn.swap_modules converted) takes query, key and value as this rank's
shards of the sequence and computes self-attention over the whole sequence with
ring_attention or ulysses_attention. The module asks `current_context()`; this file knows
nothing of the module (modules call the distributed layer, not the reverse).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass

import torch

from ._group import check_layout, group_info
from .ring_attention import ring_attention
from .ulysses_attention import ulysses_attention

METHODS = ("ring", "ulysses")
_state = threading.local()


@dataclass(frozen=True)
class ContextParallel:
    """The active context: the group, the method ("ring" or "ulysses") and the layout."""

    group: object
    method: str
    layout: str

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        causal=False,
        key_padding_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
    ) -> torch.Tensor:
        """Self-attention of the shards q (B, H, L_local, D), k, v (B, H, L_local, Dv) over
        the whole sequence; key_padding_mask (B, L) bool on the full sequence ("ulysses"
        only). Returns (B, H, L_local, Dv)."""
        if self.method == "ring":
            if key_padding_mask is not None:
                raise ValueError(
                    "context_parallel(method='ring'): key_padding_mask is not "
                    "supported by the ring; use method='ulysses' (a full-sequence "
                    "(B, L) key_padding_mask)"
                )
            return ring_attention(
                q, k, v, group=self.group, layout=self.layout, causal=causal, dropout_p=dropout_p
            )
        return ulysses_attention(
            q,
            k,
            v,
            group=self.group,
            layout=self.layout,
            causal=causal,
            key_padding_mask=key_padding_mask,
            dropout_p=dropout_p,
        )


def current_context() -> ContextParallel | None:
    """The innermost active `context_parallel` on this thread.

    Returns:
        Its settings, or None outside any.
    """
    stack = getattr(_state, "stack", None)
    return stack[-1] if stack else None


@contextlib.contextmanager
def context_parallel(group=None, *, method: str = "ring", layout: str = "zigzag"):
    """A context in which `fastattn.nn.MultiheadAttention` attends over the group's whole sequence.

    Inside it, the module treats query, key and value as this rank's sequence shards
    (self-attention; `shard_sequence` with the same layout). `is_causal=True` means causal over
    global positions (torch asks for a causal attn_mask beside that hint; one of the full
    sequence's shape (L, L) is accepted as such, and its values are not read); need_weights must
    be False. Parameter gradients are per-rank partial sums: DDP's all-reduce (or FSDP's
    reduce-scatter) over the context ranks completes them.

    Args:
        group: The process group; default: the default group (its size is W).
        method: "ring" (`ring_attention`: any number of heads; no mask but causal; dropout with
            the one-process mask, on the reference math) or "ulysses" (`ulysses_attention`: heads
            divisible by the world size; a full-sequence (B, L) key_padding_mask works).
        layout: "zigzag" or "contiguous", as the shards were made.

    Yields:
        The context's settings, a `ContextParallel` (also `current_context()` inside it).

    Raises:
        ValueError: An unknown method or layout. Inside, the module raises on an attn_mask other
            than the causal one, on need_weights, and on bias_k or add_zero_attn.
    """
    op = "context_parallel"
    group_info(op, group)
    check_layout(op, layout)
    if method not in METHODS:
        raise ValueError(f"{op}: method must be 'ring' or 'ulysses', got {method!r}")
    stack = getattr(_state, "stack", None)
    if stack is None:
        stack = _state.stack = []
    stack.append(ContextParallel(group, method, layout))
    try:
        yield stack[-1]
    finally:
        stack.pop()
