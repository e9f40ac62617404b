"""fastattn.nn.MultiheadAttention: torch.nn.MultiheadAttention with its attention computed by
fastattn.attention (fused, no (L, S) scores unless weights are asked for)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import _backend
from ..distributed.context_parallel import current_context
from ..ops.attention import attention, attention_with_weights
from ..ops.varlen_attention import kernel_available, pack_padded, varlen_attention


def _disable_torch_fast_paths(module: nn.Module, *args) -> None:
    """A no-op forward pre-hook. Its presence is what torch's TransformerEncoderLayer checks
    ("forward pre-/hooks are attached") before taking its fused C++ fast path, which would
    bypass this module in eval mode: with it, every call runs fastattn."""
    return None


class MultiheadAttention(nn.MultiheadAttention):
    """Drop-in `torch.nn.MultiheadAttention`, computed by `fastattn.attention`.

    The same constructor, `forward(query, key, value, key_padding_mask=None, need_weights=True,
    attn_mask=None, average_attn_weights=True, is_causal=False)`, returns, parameter names and
    state_dict as torch's (see `torch.nn.MultiheadAttention`). Masks keep torch's meaning (a bool
    attn_mask or key_padding_mask is True where attention is NOT allowed; float masks are added).
    The attention weights, when `need_weights=True`, come from a second pass that recomputes the
    probabilities (with the same dropout mask) from the fused kernel's log-sum-exp; with
    `need_weights=False` (what `nn.Transformer` layers ask for) nothing of size (L, S) is
    allocated.

    Args:
        *args: `torch.nn.MultiheadAttention`'s arguments (embed_dim, num_heads, dropout, bias,
            add_bias_kv, add_zero_attn, kdim, vdim, batch_first, device, dtype).
        backend: The fastattn backend for this module's calls; None: the automatic choice.
        **kwargs: `torch.nn.MultiheadAttention`'s keyword arguments.
    """

    def __init__(self, *args, backend: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.fastattn_backend = backend
        self.register_forward_pre_hook(_disable_torch_fast_paths)

    @classmethod
    def from_torch(cls, module: nn.MultiheadAttention, backend: str | None = None):
        """Turn a torch.nn.MultiheadAttention into this class in place (same object, same
        Parameters); fastattn.swap_modules uses it."""
        module.__class__ = cls
        module.fastattn_backend = backend  # type: ignore[assignment]  # Module.__setattr__'s stub
        if not any(
            hook is _disable_torch_fast_paths for hook in module._forward_pre_hooks.values()
        ):
            module.register_forward_pre_hook(_disable_torch_fast_paths)
        return module

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        backend = getattr(self, "fastattn_backend", None)
        if backend is not None:
            with _backend.use_backend(backend):
                return self._forward(
                    query,
                    key,
                    value,
                    key_padding_mask,
                    need_weights,
                    attn_mask,
                    average_attn_weights,
                    is_causal,
                )
        return self._forward(
            query,
            key,
            value,
            key_padding_mask,
            need_weights,
            attn_mask,
            average_attn_weights,
            is_causal,
        )

    def _check_like_torch(
        self, query, key, value, key_padding_mask, attn_mask, need_weights, is_causal
    ) -> None:
        """torch.nn.MultiheadAttention's argument errors: the same exception types and
        messages, raised in the order torch's forward and F.multi_head_attention_forward
        raise them (torch's own helpers where they exist), for inputs seen as torch sees them
        (sequence-first, unbatched inputs with a batch of 1)."""

        # torch's dtype checks and mismatch warning, on empty masks of the same dtypes: torch
        # would also convert a bool mask to a float one, an allocation this module does not need.
        def empty_like(mask):
            return None if mask is None else mask.new_empty(0)

        F._canonical_mask(
            mask=empty_like(key_padding_mask),
            mask_name="key_padding_mask",
            other_type=F._none_or_dtype(attn_mask),
            other_name="attn_mask",
            target_type=query.dtype,
        )
        F._canonical_mask(
            mask=empty_like(attn_mask),
            mask_name="attn_mask",
            other_type=None,
            other_name="",
            target_type=query.dtype,
            check_other=False,
        )
        is_batched = query.dim() == 3
        if self.batch_first and is_batched:
            query, key, value = (x.transpose(1, 0) for x in (query, key, value))
        is_batched = F._mha_shape_check(  # type: ignore[attr-defined]  # private, not in stubs
            query, key, value, key_padding_mask, attn_mask, self.num_heads
        )
        if not is_batched:
            query, key, value = (x.unsqueeze(1) for x in (query, key, value))
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        tgt_len, bsz, embed_dim = query.shape
        src_len = key.shape[0]
        if is_causal and attn_mask is None:
            raise RuntimeError(
                "Need attn_mask if specifying the is_causal hint. You may use the "
                "Transformer module method `generate_square_subsequent_mask` to "
                "create this mask."
            )
        if embed_dim != self.embed_dim:
            raise AssertionError(
                f"was expecting embedding dimension of {self.embed_dim}, but got {embed_dim}"
            )
        if not self._qkv_same_embed_dim:
            if key.shape[:2] != value.shape[:2]:
                raise AssertionError(
                    f"key's sequence and batch dims {key.shape[:2]} do not "
                    f"match value's {value.shape[:2]}"
                )
            weights = (
                ("query", embed_dim, self.q_proj_weight),
                ("key", key.shape[-1], self.k_proj_weight),
                ("value", value.shape[-1], self.v_proj_weight),
            )
            for name, features, weight in weights:
                if weight.shape != (embed_dim, features):
                    raise AssertionError(
                        f"expecting {name} weights shape of "
                        f"{(embed_dim, features)}, but got {weight.shape}"
                    )
        elif key.shape != value.shape:
            raise AssertionError(f"key shape {key.shape} does not match value shape {value.shape}")
        elif key.shape[-1] != embed_dim:  # torch's F.linear of the key projection fails
            F.linear(key[:0], self.in_proj_weight[embed_dim : 2 * embed_dim])
        if attn_mask is not None and not (
            is_causal and key_padding_mask is None and not need_weights
        ):
            if attn_mask.dim() == 2 and attn_mask.shape != (tgt_len, src_len):
                raise RuntimeError(
                    f"The shape of the 2D attn_mask is {attn_mask.shape}, but "
                    f"should be {(tgt_len, src_len)}."
                )
            correct_3d = (bsz * self.num_heads, tgt_len, src_len)
            if attn_mask.dim() == 3 and attn_mask.shape != correct_3d:
                raise RuntimeError(
                    f"The shape of the 3D attn_mask is {attn_mask.shape}, but "
                    f"should be {correct_3d}."
                )
        extra = int(self.bias_k is not None and self.bias_v is not None)
        for x in (key, value) if extra else ():  # torch.cat([k, bias_k.repeat(1, N, 1)])
            if x.shape[1] != bsz:
                raise RuntimeError(
                    f"Sizes of tensors must match except in dimension 0. "
                    f"Expected size {x.shape[1]} but got size {bsz} for tensor "
                    f"number 1 in the list."
                )
        for x in (key, value):  # torch's k.view(S, N * H, head_dim) of the projected keys
            rows, batch = x.shape[0] + extra, x.shape[1]
            if batch != bsz:
                raise RuntimeError(
                    f"shape '[{rows}, {bsz * self.num_heads}, {self.head_dim}]' "
                    f"is invalid for input of size {rows * batch * embed_dim}"
                )
        if key_padding_mask is not None:  # after torch pads it for bias_k / add_zero_attn
            extra += int(self.add_zero_attn)
            for i, want in ((0, bsz), (1, src_len + extra)):
                got = key_padding_mask.shape[i] + (extra if i == 1 else 0)
                if got != want:
                    raise AssertionError(
                        f"Expected key_padded_mask.shape[{i}] to be {want}, but got {got}"
                    )

    def _in_projections(self, query, key, value, self_attention, *, convert_bias):
        """(q, k, v) = the in-projections of query (.., L, E), key (.., S, kdim) and value
        (.., S, vdim), in the inputs' layout.

        convert_bias: an in_proj_bias of another dtype than an input is converted to the
        input's, as torch does for a batched batch_first input: torch projects its transpose,
        and F.linear of a non-contiguous 3-D input adds the bias after the matmul, in the
        matmul's dtype. Elsewhere torch's F.linear runs addmm, which refuses such a bias with
        "self and mat2 must have the same dtype", and so does this module's."""

        def bias_for(bias, x):
            if bias is None or not convert_bias or bias.dtype == x.dtype:
                return bias
            return bias.to(x.dtype)

        if self_attention and self._qkv_same_embed_dim:
            bias = bias_for(self.in_proj_bias, query)
            return F.linear(query, self.in_proj_weight, bias).chunk(3, dim=-1)
        if self._qkv_same_embed_dim:
            w_q, w_k, w_v = self.in_proj_weight.chunk(3)
        else:
            w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        b_q = b_k = b_v = None
        if self.in_proj_bias is not None:
            b_q, b_k, b_v = self.in_proj_bias.chunk(3)
        return (
            F.linear(query, w_q, bias_for(b_q, query)),
            F.linear(key, w_k, bias_for(b_k, key)),
            F.linear(value, w_v, bias_for(b_v, value)),
        )

    def _forward(
        self,
        query,
        key,
        value,
        key_padding_mask,
        need_weights,
        attn_mask,
        average_attn_weights,
        is_causal,
    ):
        context = current_context()
        if context is not None:
            return self._forward_context_parallel(
                context, query, key, value, key_padding_mask, need_weights, attn_mask, is_causal
            )
        if query.is_nested:
            return self._forward_nested(
                query,
                key,
                value,
                key_padding_mask,
                need_weights,
                attn_mask,
                average_attn_weights,
                is_causal,
            )
        self._check_like_torch(
            query, key, value, key_padding_mask, attn_mask, need_weights, is_causal
        )
        is_batched = query.dim() == 3
        self_attention = query is key and key is value
        # Work batch-first when the input is (the projections then need no copies).
        batch_first = self.batch_first and is_batched
        if not is_batched:  # (L, E) -> (1, L, E)
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            batch_first = True
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        seq_dim, batch_dim = (1, 0) if batch_first else (0, 1)
        bsz, tgt_len, embed_dim = query.shape[batch_dim], query.shape[seq_dim], query.shape[2]
        src_len = key.shape[seq_dim]
        H, Dh = self.num_heads, self.head_dim

        # In-projections in the input's layout, then (N, H, L, Dh) views (no copies).
        q, k, v = self._in_projections(
            query, key, value, self_attention, convert_bias=self.batch_first and is_batched
        )

        # Masks in fastattn's terms: a bool attn_mask means "may attend" there.
        mask = self._canonical_attn_mask(attn_mask, bsz, tgt_len, src_len, query.dtype)
        padding, padding_bias = self._canonical_padding(key_padding_mask, bsz, src_len, query.dtype)
        extra_columns = 0
        if self.bias_k is not None and self.bias_v is not None:
            shape = (bsz, 1, embed_dim) if batch_first else (1, bsz, embed_dim)
            k = torch.cat([k, self.bias_k.reshape(1, 1, embed_dim).expand(shape)], dim=seq_dim)
            v = torch.cat([v, self.bias_v.reshape(1, 1, embed_dim).expand(shape)], dim=seq_dim)
            extra_columns += 1

        q, k, v = (self._split_heads(x, batch_first, bsz) for x in (q, k, v))
        if self.add_zero_attn:
            zeros = k.new_zeros(bsz, H, 1, Dh)
            k = torch.cat([k, zeros], dim=2)
            v = torch.cat([v, zeros], dim=2)
            extra_columns += 1
        if extra_columns:  # the appended keys are visible to every query
            mask = self._pad_columns(mask, extra_columns)
            padding = None if padding is None else F.pad(padding, (0, extra_columns))
            padding_bias = None if padding_bias is None else F.pad(padding_bias, (0, extra_columns))
        if padding_bias is not None:  # a float key_padding_mask is added like attn_mask
            bias = padding_bias.view(bsz, 1, 1, -1)
            mask = (
                bias
                if mask is None
                else (
                    mask + bias
                    if mask.dtype != torch.bool
                    else bias.masked_fill(~mask, float("-inf"))
                )
            )

        causal = False
        if is_causal and key_padding_mask is None and not need_weights:
            # torch's rule: the is_causal hint replaces the mask (the mask must be causal).
            causal, mask = True, None
        dropout_p = self.dropout if self.training else 0.0
        weights = None
        if (
            padding is not None
            and mask is None
            and not need_weights
            and self._heavy_padding(padding)
        ):
            out = self._varlen(q, k, v, padding, dropout_p)
        elif need_weights:
            out, weights = attention_with_weights(
                q,
                k,
                v,
                causal=causal,
                attn_mask=mask,
                key_padding_mask=padding,
                dropout_p=dropout_p,
            )
        else:
            out = attention(
                q,
                k,
                v,
                causal=causal,
                attn_mask=mask,
                key_padding_mask=padding,
                dropout_p=dropout_p,
            )
        # out is (N, L, H, Dh) in memory when q's heads are inner (always the case here).
        out = self._out_projection(out, batch_first)

        if weights is not None and average_attn_weights:
            weights = weights.mean(dim=1)
        if not is_batched:
            out = out.squeeze(0)
            if weights is not None:
                weights = weights.squeeze(0)
        return out, weights

    def _forward_context_parallel(
        self, context, query, key, value, key_padding_mask, need_weights, attn_mask, is_causal
    ):
        """Self-attention of sequence shards inside fastattn.distributed.context_parallel:
        query, key, value (N, L_local, E) (batch_first), (L_local, N, E) or (L_local, E) are
        this rank's shards; the attention spans the whole sequence of the group."""
        op = "fastattn.nn.MultiheadAttention under context_parallel"
        if query.is_nested:
            raise ValueError(f"{op}: NestedTensor inputs are not supported")
        if need_weights:
            raise ValueError(
                f"{op}: need_weights=True is not supported (the weights span "
                f"every rank's keys); pass need_weights=False"
            )
        if self.bias_k is not None or self.add_zero_attn:
            raise ValueError(
                f"{op}: bias_k/bias_v and add_zero_attn are not supported (they "
                f"append keys that no rank's shard holds)"
            )
        if not (query.shape == key.shape == value.shape) or query.dim() not in (2, 3):
            raise ValueError(
                f"{op}: query, key and value must be shards of one sequence "
                f"(self-attention) of the same shape, (N, L, E), (L, N, E) or "
                f"(L, E); got {tuple(query.shape)}, {tuple(key.shape)}, "
                f"{tuple(value.shape)}"
            )
        if query.shape[-1] != self.embed_dim:
            raise AssertionError(
                f"was expecting embedding dimension of {self.embed_dim}, but got {query.shape[-1]}"
            )
        is_batched = query.dim() == 3
        batch_first = self.batch_first and is_batched
        if not is_batched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            batch_first = True
            if key_padding_mask is not None and key_padding_mask.dim() == 1:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        seq_dim, batch_dim = (1, 0) if batch_first else (0, 1)
        bsz, local_len = query.shape[batch_dim], query.shape[seq_dim]
        world = torch.distributed.get_world_size(context.group)
        full_len = local_len * world
        causal = False
        if attn_mask is not None:
            if not (
                is_causal
                and attn_mask.dim() == 2
                and tuple(attn_mask.shape) == (full_len, full_len)
            ):
                raise ValueError(
                    f"{op}: attn_mask is only accepted as the causal mask beside "
                    f"is_causal=True, of the full sequence's shape (L, L) = "
                    f"({full_len}, {full_len}); got shape "
                    f"{tuple(attn_mask.shape)} with is_causal={is_causal}"
                )
        if is_causal:
            causal = True
        if key_padding_mask is not None:
            if key_padding_mask.dtype != torch.bool or tuple(key_padding_mask.shape) != (
                bsz,
                full_len,
            ):
                raise ValueError(
                    f"{op}: key_padding_mask must be a bool (N, L) = ({bsz}, "
                    f"{full_len}) mask of the full sequence, got "
                    f"{key_padding_mask.dtype} {tuple(key_padding_mask.shape)}"
                )
        self_attention = query is key and key is value
        q, k, v = self._in_projections(
            query, key, value, self_attention, convert_bias=self.batch_first and is_batched
        )

        dropout_p = self.dropout if self.training else 0.0
        out = context.attention(
            self._split_heads(q, batch_first, bsz),
            self._split_heads(k, batch_first, bsz),
            self._split_heads(v, batch_first, bsz),
            causal=causal,
            key_padding_mask=key_padding_mask,
            dropout_p=dropout_p,
        )
        out = self._out_projection(out, batch_first)
        if not is_batched:
            out = out.squeeze(0)
        return out, None

    def _split_heads(self, x: Tensor, batch_first: bool, bsz: int) -> Tensor:
        """An in-projection (N, L, E) (batch_first) or (L, N, E) -> (N, H, L, Dh), a view
        wherever the layout allows one (the in-projections' always does)."""
        H, Dh = self.num_heads, self.head_dim
        if batch_first:
            return x.reshape(bsz, x.shape[1], H, Dh).transpose(1, 2)
        return x.reshape(x.shape[0], bsz, H, Dh).permute(1, 2, 0, 3)

    def _out_projection(self, out: Tensor, batch_first: bool) -> Tensor:
        """The attention output (N, H, L, Dh) back to (N, L, E) (batch_first) or (L, N, E),
        through out_proj."""
        N, H, L, Dh = out.shape
        if batch_first:
            out = out.transpose(1, 2).reshape(N, L, H * Dh)
        else:
            out = out.permute(2, 0, 1, 3).reshape(L, N, H * Dh)
        return F.linear(out, self.out_proj.weight, self.out_proj.bias)

    def _forward_nested(
        self,
        query,
        key,
        value,
        key_padding_mask,
        need_weights,
        attn_mask,
        average_attn_weights,
        is_causal,
    ):
        """NestedTensor self-attention, as torch.nn.TransformerEncoder sends it in eval mode
        when it packs a padded batch (its "sparsity fast path", which it decides on from the
        encoder layer alone, so a fastattn module inside does not stop it; swap_modules turns
        it off, a model built with this class directly does not). The batch is padded back,
        its lengths become a key_padding_mask, and the output is packed again the same way."""
        if not (
            key is query
            and value is query
            and query.dim() == 3
            and self.batch_first
            and key_padding_mask is None
            and attn_mask is None
        ):
            raise AssertionError(
                "fastattn.nn.MultiheadAttention takes a NestedTensor only as "
                "batch-first self-attention (query is key is value) without "
                "masks, as torch.nn.TransformerEncoder passes it"
            )
        lengths = torch.tensor([t.shape[0] for t in query.unbind()], device=query.device)
        padded = query.to_padded_tensor(0.0)
        keep = torch.arange(padded.shape[1], device=query.device)[None, :] < lengths[:, None]
        out, weights = self._forward(
            padded, padded, padded, ~keep, need_weights, None, average_attn_weights, is_causal
        )
        return torch._nested_tensor_from_mask(out, keep, mask_check=False), weights

    # Fraction of padded keys from which a key_padding_mask batch runs through varlen_attention
    # (padded keys dropped, no work spent on them) instead of the padded kernel.
    varlen_min_padding = 0.5
    # The varlen route reads the mask on the host (the fraction, and pack_padded's data-dependent
    # sizes): a synchronisation per call, impossible inside a CUDA graph. So CPU batches only,
    # unless a model sets this (per instance or class) for CUDA batches.
    varlen_on_cuda = False

    def _heavy_padding(self, padding: Tensor) -> bool:
        if torch.compiler.is_compiling() or padding.numel() == 0:
            return False  # under torch.compile: the padded kernel (no data-dependent shapes)
        if padding.device.type != "cpu" and not self.varlen_on_cuda:
            return False
        if not kernel_available(padding.device):
            return False
        return float(padding.float().mean()) >= self.varlen_min_padding

    @staticmethod
    def _varlen(q, k, v, padding, dropout_p):
        """Attention with the padded keys removed: every query row (padded or not, as torch
        computes them) against its sequence's real keys. q, k, v (N, H, L, Dh) -> out
        (N, H, L, Dh) laid out (N, L, H, Dh) in memory, as the padded kernel's."""
        N, H, L, Dh = q.shape
        q_packed = q.transpose(1, 2).reshape(N * L, H, Dh)
        k_packed, cu_k, max_k, _ = pack_padded(k.transpose(1, 2), padding)
        v_packed, _, _, _ = pack_padded(v.transpose(1, 2), padding)
        cu_q = torch.arange(0, (N + 1) * L, L, dtype=torch.int32, device=q.device)
        out = varlen_attention(
            q_packed, k_packed, v_packed, cu_q, cu_k, L, max_k, dropout_p=dropout_p
        )
        return out.view(N, L, H, v.shape[-1]).transpose(1, 2)

    def _canonical_attn_mask(self, attn_mask, bsz, tgt_len, src_len, dtype):
        """attn_mask as (1 or N, H or 1, L, S), True / 0 = may attend (_check_like_torch has
        checked its dtype and shape)."""
        if attn_mask is None:
            return None
        if attn_mask.dim() == 2:
            mask = attn_mask.view(1, 1, tgt_len, src_len)
        else:
            mask = attn_mask.view(bsz, self.num_heads, tgt_len, src_len)
        if mask.dtype == torch.bool:
            return ~mask
        return mask.to(dtype) if mask.dtype != dtype else mask

    def _canonical_padding(self, key_padding_mask, bsz, src_len, dtype):
        """(bool ignore-mask or None, float additive (N, S) bias or None)."""
        if key_padding_mask is None:
            return None, None
        if key_padding_mask.dtype == torch.bool:  # (_check_like_torch checked dtype and shape)
            return key_padding_mask, None
        return None, key_padding_mask.to(dtype)

    @staticmethod
    def _pad_columns(mask, n):
        if mask is None:
            return None
        if mask.dtype == torch.bool:
            return F.pad(mask, (0, n), value=True)
        return F.pad(mask, (0, n), value=0.0)
