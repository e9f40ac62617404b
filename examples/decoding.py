"""A small decoder-only language model built on fastattn, decoding with a KV cache.

    python examples/decoding.py [--check] [--paged] [--backend cpu|reference|cuda] [--beams 4]

The model uses rotary positions and fastattn.attention (causal) over whole sequences; decoding
keeps per-layer key/value caches and runs fastattn.attention_with_kvcache, which appends the
new token's (rotated) key and value in place and attends over the cache. Greedy decoding and
beam search (K beams, length-normalised scores) run both with the cache and by recomputing
the whole prefix every step; --check asserts they produce the same tokens. --paged decodes
once more with a paged cache (fastattn.PagedKVCache: blocks of a shared pool, read and written
through a block table inside the kernels) and asserts it gives the dense cache's tokens.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import fastattn


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, d_model // n_heads
        self.norm1 = nn.LayerNorm(d_model)
        self.q_proj = nn.Linear(d_model, n_heads * self.head_dim, bias=False)
        self.kv_proj = nn.Linear(d_model, 2 * n_kv_heads * self.head_dim, bias=False)
        self.out_proj = nn.Linear(n_heads * self.head_dim, d_model, bias=False)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def qkv(self, x):
        """x (B, L, E) -> q (B, H, L, Dh), k, v (B, Hkv, L, Dh) as views of the projections."""
        B, L, _ = x.shape
        h = self.norm1(x)
        q = self.q_proj(h).view(B, L, self.n_heads, self.head_dim).transpose(1, 2)
        k, v = self.kv_proj(h).view(B, L, 2, self.n_kv_heads, self.head_dim).unbind(2)
        return q, k.transpose(1, 2), v.transpose(1, 2)

    def finish(self, x, attn):
        B, H, L, Dh = attn.shape
        x = x + self.out_proj(attn.transpose(1, 2).reshape(B, L, H * Dh))
        return x + self.mlp(self.norm2(x))


class DecoderLM(nn.Module):
    def __init__(
        self,
        vocab: int,
        d_model: int = 64,
        n_heads: int = 4,
        n_kv_heads: int = 2,
        n_layers: int = 2,
        max_len: int = 128,
    ):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, n_kv_heads) for _ in range(n_layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)
        self.max_len = max_len
        head_dim = d_model // n_heads
        # Rotary tables indexed by absolute position (cos/sin of pos * 10000^(-2i/head_dim)).
        pe = fastattn.sinusoidal_table(max_len, head_dim)
        self.register_buffer("rotary_cos", pe[:, 1::2].contiguous(), persistent=False)
        self.register_buffer("rotary_sin", pe[:, 0::2].contiguous(), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits (B, L, vocab) of every position, recomputing the whole sequence."""
        x = self.embed(tokens)
        for block in self.blocks:
            q, k, v = block.qkv(x)
            q = fastattn.apply_rotary(q, cos=self.rotary_cos, sin=self.rotary_sin)
            k = fastattn.apply_rotary(k, cos=self.rotary_cos, sin=self.rotary_sin)
            x = block.finish(x, fastattn.attention(q, k, v, causal=True))
        return self.head(self.norm(x))

    def new_cache(self, batch: int):
        """Per layer (k_cache, v_cache) (B, Hkv, max_len, Dh), and the valid lengths (B,)."""
        b0 = self.blocks[0]
        shape = (batch, b0.n_kv_heads, self.max_len, b0.head_dim)
        param = self.head.weight
        caches = [(param.new_zeros(shape), param.new_zeros(shape)) for _ in self.blocks]
        return caches, torch.zeros(batch, dtype=torch.int32, device=param.device)

    def new_paged_cache(self, batch: int, block_size: int = 16) -> fastattn.PagedKVCache:
        """A paged cache for `batch` sequences of up to max_len tokens (one pool per layer)."""
        b0 = self.blocks[0]
        blocks_per_seq = -(-self.max_len // block_size)
        cache = fastattn.PagedKVCache(
            num_layers=len(self.blocks),
            num_blocks=batch * blocks_per_seq,
            block_size=block_size,
            num_kv_heads=b0.n_kv_heads,
            head_dim=b0.head_dim,
            max_blocks_per_seq=blocks_per_seq,
            dtype=self.head.weight.dtype,
            device=self.head.weight.device,
        )
        for _ in range(batch):
            cache.allocate()
        return cache

    def step_paged(self, tokens: torch.Tensor, cache: fastattn.PagedKVCache) -> torch.Tensor:
        """`step` over a paged cache: room for the new tokens, every layer, then advance."""
        x = self.embed(tokens)
        cache.append(tokens.shape[1])
        for layer, block in enumerate(self.blocks):
            q, k, v = block.qkv(x)
            attn = cache.attention(
                layer,
                q,
                k,
                v,
                rotary_cos=self.rotary_cos,
                rotary_sin=self.rotary_sin,
                causal=True,
            )
            x = block.finish(x, attn)
        cache.advance(tokens.shape[1])
        return self.head(self.norm(x))

    def step(self, tokens: torch.Tensor, caches, seqlens: torch.Tensor) -> torch.Tensor:
        """Logits of the new tokens (B, Lnew); appends their keys/values to the caches.
        The caller advances seqlens by Lnew."""
        x = self.embed(tokens)
        for block, (k_cache, v_cache) in zip(self.blocks, caches):
            q, k, v = block.qkv(x)
            attn = fastattn.attention_with_kvcache(
                q,
                k_cache,
                v_cache,
                cache_seqlens=seqlens,
                k_new=k,
                v_new=v,
                rotary_cos=self.rotary_cos,
                rotary_sin=self.rotary_sin,
                causal=True,
            )
            x = block.finish(x, attn)
        return self.head(self.norm(x))


@torch.no_grad()
def greedy(
    model: DecoderLM, prompt: torch.Tensor, steps: int, use_cache: bool, paged: bool = False
) -> torch.Tensor:
    tokens = prompt
    if paged:
        cache = model.new_paged_cache(prompt.shape[0])
        logits = model.step_paged(prompt, cache)
    elif use_cache:
        caches, seqlens = model.new_cache(prompt.shape[0])
        logits = model.step(prompt, caches, seqlens)
        seqlens += prompt.shape[1]
    else:
        logits = model(prompt)
    for _ in range(steps):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, nxt], dim=1)
        if paged:
            logits = model.step_paged(nxt, cache)
        elif use_cache:
            logits = model.step(nxt, caches, seqlens)
            seqlens += 1
        else:
            logits = model(tokens)
    return tokens


@torch.no_grad()
def beam_search(
    model: DecoderLM,
    prompt: torch.Tensor,
    steps: int,
    beams: int,
    use_cache: bool,
    alpha: float = 0.7,
    paged: bool = False,
) -> list[int]:
    """One prompt (1, L): keep the `beams` best continuations by summed log-probability; the
    final choice maximises score / length**alpha (length normalisation)."""
    tokens = prompt.expand(beams, -1).contiguous()
    scores = torch.full((beams,), float("-inf"), dtype=torch.float64, device=prompt.device)
    scores[0] = 0.0  # all beams start identical: keep one alive
    if paged:
        cache = model.new_paged_cache(beams)
        logits = model.step_paged(tokens, cache)
    elif use_cache:
        caches, seqlens = model.new_cache(beams)
        logits = model.step(tokens, caches, seqlens)
        seqlens += tokens.shape[1]
    else:
        logits = model(tokens)
    for _ in range(steps):
        logp = torch.log_softmax(logits[:, -1].double(), dim=-1)  # (K, V)
        cand = (scores.unsqueeze(1) + logp).reshape(-1)
        best = torch.topk(cand, beams).indices
        origin, token = best // logp.shape[1], best % logp.shape[1]
        scores = cand[best]
        tokens = torch.cat([tokens[origin], token.unsqueeze(1)], dim=1)
        if paged:  # the sequences follow their beams (their blocks' contents are copied)
            seqs = cache.sequences
            cache.copy_sequences(seqs, [seqs[int(o)] for o in origin])
            logits = model.step_paged(token.unsqueeze(1), cache)
        elif use_cache:  # the caches follow their beams
            for k_cache, v_cache in caches:
                k_cache.copy_(k_cache[origin])
                v_cache.copy_(v_cache[origin])
            logits = model.step(token.unsqueeze(1), caches, seqlens)
            seqlens += 1
        else:
            logits = model(tokens)
    generated = tokens.shape[1] - prompt.shape[1]
    final = scores / (generated**alpha)
    return tokens[int(final.argmax())].tolist()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--check",
        action="store_true",
        help="assert cached and uncached decoding give the same tokens",
    )
    parser.add_argument(
        "--paged",
        action="store_true",
        help="also decode with a paged KV cache and assert the dense cache's tokens",
    )
    parser.add_argument("--backend", default=None)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--beams", type=int, default=4)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    # float64 in --check mode: cached and recomputed logits then agree to ~1e-15, so no
    # near-tie can flip a choice.
    dtype = torch.float64 if args.check else torch.float32
    model = DecoderLM(vocab=97).to(device=args.device, dtype=dtype).eval()
    prompt = torch.randint(0, 97, (3, 5), device=args.device)
    with fastattn.use_backend(args.backend):
        cached = greedy(model, prompt, args.steps, use_cache=True)
        full = greedy(model, prompt, args.steps, use_cache=False)
        beam_cached = beam_search(model, prompt[:1], args.steps, args.beams, use_cache=True)
        beam_full = beam_search(model, prompt[:1], args.steps, args.beams, use_cache=False)
        if args.paged:
            paged = greedy(model, prompt, args.steps, use_cache=True, paged=True)
            beam_paged = beam_search(
                model, prompt[:1], args.steps, args.beams, use_cache=True, paged=True
            )
    print("greedy (KV cache):", cached[0].tolist())
    print("greedy (recompute):", full[0].tolist())
    print(f"beam search K={args.beams} (KV cache):", beam_cached)
    print(f"beam search K={args.beams} (recompute):", beam_full)
    if args.paged:
        print("greedy (paged KV cache):", paged[0].tolist())
        print(f"beam search K={args.beams} (paged KV cache):", beam_paged)
    print("attention_with_kvcache ran on:", fastattn.last_backend("attention_with_kvcache"))
    if args.paged:
        assert torch.equal(paged, cached), "greedy tokens differ between paged and dense caches"
        assert beam_paged == beam_cached, "beam search differs between paged and dense caches"
        print("paged check passed: the paged cache gives the dense cache's tokens")
    if args.check:
        assert torch.equal(cached, full), "greedy tokens differ between cached and recomputed"
        assert beam_cached == beam_full, "beam search differs between cached and recomputed"
        print("check passed: cached and recomputed decoding agree")


if __name__ == "__main__":
    main()
