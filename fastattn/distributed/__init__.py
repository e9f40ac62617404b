"""fastattn.distributed: context parallelism on torch.distributed.

Each rank of a process group holds a shard of the sequence. Works with any torch.distributed
backend that has point-to-point (ring) or all-to-all (Ulysses): gloo on CPU, NCCL on GPU,
launched the usual way (torchrun).

- `shard_sequence`, `gather_sequence` (differentiable), `shard_positions` (sequence.py);
- `ring_attention`: K/V blocks travel around the ring, merged by their log-sum-exp
  (ring_attention.py);
- `ulysses_attention`: all-to-all from sequence shards to head shards and back
  (ulysses_attention.py);
- `context_parallel`: `fastattn.nn.MultiheadAttention` on sequence shards
  (context_parallel.py).

Layouts: "zigzag" splits the sequence into 2W chunks and gives rank r chunks r and 2W-1-r
(equal causal work per rank); "contiguous" gives rank r chunk r of W.
"""

from __future__ import annotations

from .context_parallel import context_parallel, current_context
from .ring_attention import ring_attention
from .sequence import gather_sequence, shard_positions, shard_sequence
from .ulysses_attention import ulysses_attention

__all__ = [
    "shard_sequence",
    "gather_sequence",
    "shard_positions",
    "ring_attention",
    "ulysses_attention",
    "context_parallel",
    "current_context",
]
