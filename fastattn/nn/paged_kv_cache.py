"""A paged KV cache for decoding: fixed-size blocks of a shared pool handed to sequences as they
grow (vLLM's PagedAttention layout), read and written by fastattn.attention_with_kvcache
through its block table.

    cache = PagedKVCache(num_layers=2, num_blocks=256, block_size=16, num_kv_heads=2,
                         head_dim=64, max_blocks_per_seq=64, dtype=torch.bfloat16)
    a, b = cache.allocate(), cache.allocate()    # two empty sequences
    cache.append(prompt_len)                     # room for the prompt (allocates blocks)
    for layer in range(2):
        out = cache.attention(layer, q, k_new, v_new, rotary_cos=cos, rotary_sin=sin)
    cache.advance(prompt_len)                    # the tokens are now in the cache
    ...
    cache.free(a)                                # its blocks return to the pool

The batch of `attention` is the active sequences in allocation order (`sequences`). Memory
is only the pool, num_layers x 2 x (num_blocks, num_kv_heads, block_size, head_dim): a sequence
holds ceil(length / block_size) blocks instead of a whole max-length row.
"""

from __future__ import annotations

import torch

from ..ops.attention_with_kvcache import attention_with_kvcache


class PagedKVCache:
    """Block allocator and pools of a paged KV cache, for `attention_with_kvcache(block_table=...)`.

    Not an nn.Module: it holds state, no parameters. Attributes: `k_pools[layer]` and
    `v_pools[layer]`, (num_blocks, num_kv_heads, block_size, head_dim) and (..., head_dim_v);
    `block_table`, int32 (max_sequences, max_blocks_per_seq), -1 where no block is assigned;
    `lengths`, int32 (max_sequences,), the tokens each row holds.

    Args:
        num_layers: Pools per layer (one (k, v) pair each), all sharing the block table.
        num_blocks: Blocks in each pool.
        block_size: Tokens a block holds, a multiple of 16.
        num_kv_heads: Key/value heads, Hkv.
        head_dim: The keys' head dim, D.
        max_blocks_per_seq: The block table's width: a sequence holds at most
            `max_blocks_per_seq * block_size` tokens.
        head_dim_v: The values' head dim, Dv; default head_dim.
        max_sequences: The block table's rows; default num_blocks.
        dtype: The pools' dtype.
        device: The pools' device.

    Raises:
        ValueError: A block size that is not a positive multiple of 16, or non-positive sizes.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        max_blocks_per_seq: int,
        head_dim_v: int | None = None,
        max_sequences: int | None = None,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        if block_size <= 0 or block_size % 16:
            raise ValueError(
                f"PagedKVCache: block_size must be a positive multiple of 16, got {block_size}"
            )
        for name, n in (
            ("num_layers", num_layers),
            ("num_blocks", num_blocks),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
            ("max_blocks_per_seq", max_blocks_per_seq),
        ):
            if not isinstance(n, int) or n <= 0:
                raise ValueError(f"PagedKVCache: {name} must be a positive int, got {n!r}")
        head_dim_v = head_dim if head_dim_v is None else head_dim_v
        max_sequences = num_blocks if max_sequences is None else max_sequences
        self.block_size = block_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.k_pools = [
            torch.zeros(num_blocks, num_kv_heads, block_size, head_dim, dtype=dtype, device=device)
            for _ in range(num_layers)
        ]
        self.v_pools = [
            torch.zeros(
                num_blocks, num_kv_heads, block_size, head_dim_v, dtype=dtype, device=device
            )
            for _ in range(num_layers)
        ]
        device = self.k_pools[0].device
        self.block_table = torch.full(
            (max_sequences, max_blocks_per_seq), -1, dtype=torch.int32, device=device
        )
        self.lengths = torch.zeros(max_sequences, dtype=torch.int32, device=device)
        # Host-side bookkeeping (no device reads): free blocks (a stack), rows in use, and each
        # row's blocks and length.
        self._free_blocks = list(range(num_blocks - 1, -1, -1))
        self._free_rows = list(range(max_sequences - 1, -1, -1))
        self._blocks: dict[int, list[int]] = {}
        self._length: dict[int, int] = {}
        self._order: list[int] = []  # active rows in allocation order

    # -----------------------------------------------------------------------------------------
    # Allocation

    @property
    def sequences(self) -> list[int]:
        """The active sequences (rows of `block_table`), in allocation order: the batch order of
        `attention`, `block_table_of` and `seqlens`.
        """
        return list(self._order)

    @property
    def free_blocks(self) -> int:
        """The blocks of the pool not held by any sequence."""
        return len(self._free_blocks)

    def allocate(self) -> int:
        """Start a new, empty sequence.

        Returns:
            Its id, its row of the block table.

        Raises:
            RuntimeError: Every row of the block table is in use.
        """
        if not self._free_rows:
            raise RuntimeError("PagedKVCache: every row of the block table is in use")
        row = self._free_rows.pop()
        self._blocks[row], self._length[row] = [], 0
        self._order.append(row)
        return row

    def free(self, seq: int) -> None:
        """Release a sequence: its blocks return to the pool, its row to the table.

        Args:
            seq: A sequence id from `allocate`.

        Raises:
            ValueError: The sequence is not allocated.
        """
        self._check_active(seq)
        self._free_blocks.extend(reversed(self._blocks.pop(seq)))
        del self._length[seq]
        self._order.remove(seq)
        self._free_rows.append(seq)
        self.block_table[seq] = -1
        self.lengths[seq] = 0

    def append(self, num_tokens: int, seqs: list[int] | None = None) -> None:
        """Make room for more tokens, taking blocks from the pool as needed.

        Call it before the attention calls that append those tokens, and `advance` after them.
        Nothing changes when it raises.

        Args:
            num_tokens: The tokens each sequence will append.
            seqs: Sequence ids; default: every active sequence.

        Raises:
            ValueError: A sequence would hold more than `max_blocks_per_seq * block_size` tokens, or
                is not allocated.
            RuntimeError: The pool is out of blocks.
        """
        seqs = self._order if seqs is None else seqs
        needs = []
        for seq in seqs:
            self._check_active(seq)
            need = -(-(self._length[seq] + num_tokens) // self.block_size)
            if need > self.max_blocks_per_seq:
                raise ValueError(
                    f"PagedKVCache: sequence {seq} would hold {self._length[seq] + num_tokens} "
                    f"tokens, more than max_blocks_per_seq * block_size = "
                    f"{self.max_blocks_per_seq * self.block_size}"
                )
            needs.append(max(0, need - len(self._blocks[seq])))
        if sum(needs) > len(self._free_blocks):  # checked first: nothing changes on failure
            raise RuntimeError(
                f"PagedKVCache: the pool is out of blocks ({sum(needs)} needed, "
                f"{len(self._free_blocks)} free): free a sequence or build the cache with more "
                "num_blocks"
            )
        for seq, n in zip(seqs, needs):
            blocks = self._blocks[seq]
            for _ in range(n):
                block = self._free_blocks.pop()
                self.block_table[seq, len(blocks)] = block
                blocks.append(block)

    def advance(self, num_tokens: int, seqs: list[int] | None = None) -> None:
        """Count tokens that `attention_with_kvcache` appended.

        Args:
            num_tokens: The tokens each sequence appended.
            seqs: Sequence ids; default: every active sequence.

        Raises:
            ValueError: More tokens than `append` made room for, or a sequence not allocated.
        """
        seqs = self._order if seqs is None else seqs
        for seq in seqs:
            self._check_active(seq)
            if self._length[seq] + num_tokens > len(self._blocks[seq]) * self.block_size:
                raise ValueError(
                    f"PagedKVCache: advance({num_tokens}) past sequence {seq}'s blocks: call "
                    "append first"
                )
            self._length[seq] += num_tokens
            self.lengths[seq] = self._length[seq]

    def copy_sequences(self, dst: list[int], src: list[int]) -> None:
        """Copy sequences onto others (beam search reordering its beams).

        Sequence `dst[i]` takes the contents (every layer's keys and values) and length of
        sequence `src[i]`; the sources are read before any destination is written. Blocks are
        copied, never shared.

        Args:
            dst: Destination sequence ids.
            src: Source sequence ids, as many.

        Raises:
            ValueError: A sequence that is not allocated.
        """
        for seq in (*dst, *src):
            self._check_active(seq)
        lengths = [self._length[s] for s in src]
        for d, n in zip(dst, lengths):
            self._length[d] = 0
            self.append(n, [d])
        for pools in (self.k_pools, self.v_pools):
            for pool in pools:
                saved = [pool[self._blocks[s][: -(-n // self.block_size)]].clone() for s, n in
                         zip(src, lengths)]  # fmt: skip
                for d, blocks in zip(dst, saved):
                    pool[self._blocks[d][: blocks.shape[0]]] = blocks
        for d, n in zip(dst, lengths):
            self._length[d] = n
            self.lengths[d] = n

    def _check_active(self, seq: int) -> None:
        if seq not in self._length:
            raise ValueError(f"PagedKVCache: sequence {seq} is not allocated")

    # -----------------------------------------------------------------------------------------
    # Attention

    def block_table_of(self, seqs: list[int] | None = None) -> torch.Tensor:
        """The block table rows of some sequences, the `block_table` argument of
        `attention_with_kvcache`.

        Args:
            seqs: Sequence ids; default: the active sequences.

        Returns:
            Int32 (len(seqs), max_blocks_per_seq).
        """
        return self.block_table[self._rows(seqs)]

    def seqlens(self, seqs: list[int] | None = None) -> torch.Tensor:
        """The tokens some sequences hold, the `cache_seqlens` argument of `attention_with_kvcache`.

        Args:
            seqs: Sequence ids; default: the active sequences.

        Returns:
            Int32 (len(seqs),).
        """
        return self.lengths[self._rows(seqs)]

    def _rows(self, seqs):
        seqs = self._order if seqs is None else seqs
        return torch.tensor(seqs, dtype=torch.long, device=self.block_table.device)

    def attention(
        self,
        layer: int,
        q: torch.Tensor,
        k_new: torch.Tensor | None = None,
        v_new: torch.Tensor | None = None,
        *,
        seqs: list[int] | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """`fastattn.attention_with_kvcache` over one layer's pools.

        Call `append(Lnew)` before and `advance(Lnew)` after the layers' calls of a step.

        Args:
            layer: The layer whose pools to use.
            q: (len(seqs), Hq, Lq, D).
            k_new: (len(seqs), Hkv, Lnew, D) or None.
            v_new: (len(seqs), Hkv, Lnew, Dv) or None.
            seqs: Sequence ids; default: every active one, in allocation order.
            **kwargs: As `attention_with_kvcache`'s (rotary tables, causal, window, softcap, scale,
                alibi_slopes, sinks, num_splits, backend).

        Returns:
            out, (len(seqs), Hq, Lq, Dv).
        """
        return attention_with_kvcache(
            q,
            self.k_pools[layer],
            self.v_pools[layer],
            cache_seqlens=self.seqlens(seqs),
            k_new=k_new,
            v_new=v_new,
            block_table=self.block_table_of(seqs),
            **kwargs,
        )
