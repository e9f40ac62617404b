"""The ring-attention scaling model of docs/design/context_parallel.md, as arithmetic.

    python benchmarks/cp_scaling_model.py          # prints the notes' tables

A ring step of context parallelism overlaps one block's attention with one block's transfer,
so its time is max(compute, transfer) plus what cannot overlap (the lse merge's memory
traffic, a launch/latency term). Everything here is published hardware numbers and stated
efficiencies; nothing is measured. See the notes for the derivation and the comparisons.
"""

from __future__ import annotations

from dataclasses import dataclass

# Published H100 SXM numbers (NVIDIA datasheet) and link speeds.
PEAK_BF16 = 989e12  # dense BF16 tensor-core FLOP/s
HBM = 3.35e12  # bytes/s
NVLINK_H100 = 450e9  # NVLink 4: 900 GB/s bidirectional aggregate, 450 GB/s each way
NVLINK_H800 = 200e9  # H800: 400 GB/s aggregate
IB_NDR = 50e9  # one 400 Gb/s NDR NIC per GPU, each way
LINK_EFFICIENCY = 0.8  # achieved / nominal for large point-to-point transfers (NCCL)
LATENCY = 15e-6  # per ring step: launch + handshake, seconds

# Stated efficiencies of the kernels (FlashAttention-2 class on H100, bf16, head dim 128).
ATTN_FWD = 325e12  # FLOP/s; ring-flash-attention's own flash_attn figure on H800
ATTN_BWD = 290e12  # FLOP/s (its fwd+bwd figure, 298 TFLOP/s averaged)
GEMM = 0.45 * PEAK_BF16  # linear layers, bf16 (torchtitan's 8B: 33-39% whole-model MFU)
FLOAT8_GEMM_SPEEDUP = 1.28  # torchtitan Table 1: 6,667 -> 8,532 TPS from Float8


@dataclass
class Layer:
    """A Llama-3-8B-like decoder layer."""

    d_model: int = 4096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    ffn: int = 14336

    @property
    def matmul_params(self) -> float:
        qo = 2 * self.d_model * self.heads * self.head_dim
        kv = 2 * self.d_model * self.kv_heads * self.head_dim
        return qo + kv + 3 * self.d_model * self.ffn


def ring_attention_time(
    layer: Layer,
    T: int,
    N: int,
    link: float,
    *,
    backward: bool,
    fwd_rate: float = ATTN_FWD,
    bwd_rate: float = ATTN_BWD,
    recompute: bool = False,
) -> dict:
    """Seconds of one layer's causal ring attention (zigzag: every step's work equal) for T
    tokens per GPU on N GPUs, and the fraction of the transfers hidden."""
    hd = layer.heads * layer.head_dim
    kv_bytes = 2 * T * layer.kv_heads * layer.head_dim * 2  # K and V, bf16
    step_flops = 2 * T * T * hd  # causal zigzag step
    merge_bytes = 3 * T * hd * 4  # fp32 out accumulator read + written, block out read
    bw = link * LINK_EFFICIENCY

    def steps(flops_rate, flops_mult, bytes_, merge):
        compute = flops_mult * step_flops / flops_rate
        transfer = bytes_ / bw
        step = max(compute, transfer) + merge / (0.8 * HBM) + LATENCY
        hidden = min(1.0, compute / transfer) if transfer else 1.0
        return N * step, (N - 1) * transfer, hidden, compute, transfer

    fwd = steps(fwd_rate, 1.0, kv_bytes, merge_bytes)
    total, hidden = fwd[0], fwd[2]
    result = {"fwd_step_compute": fwd[3], "fwd_step_transfer": fwd[4]}
    if recompute:
        total += fwd[0]
    if backward:
        # K, V (bf16) and the travelling dK, dV accumulators (fp32, as fastattn keeps them).
        bwd_bytes = kv_bytes + 2 * T * layer.kv_heads * layer.head_dim * 4
        bwd = steps(bwd_rate, 2.5, bwd_bytes, 0)
        total += bwd[0]
        hidden = min(hidden, bwd[2])
        result.update(bwd_step_compute=bwd[3], bwd_step_transfer=bwd[4])
    result.update(seconds=total, hidden=hidden)
    return result


def layer_tokens_per_second(layer: Layer, L: int, N: int, *, per_node: int = 8) -> dict:
    """Training (fwd + bwd) tokens/s per GPU of one layer, sequence L over N GPUs (pure CP,
    batch 1), bf16, no activation checkpointing."""
    T = L // N
    link = NVLINK_H100 if N <= per_node else IB_NDR
    attn = ring_attention_time(layer, T, N, link, backward=True)
    linear = 6 * layer.matmul_params * T / GEMM
    seconds = attn["seconds"] + linear
    return {
        "T": T,
        "tokens_per_s": T / seconds,
        "attn_share": attn["seconds"] / seconds,
        "hidden": attn["hidden"],
        "link": "NVLink" if N <= per_node else "IB",
    }


def torchtitan_point(L: int, cp: int, layers: int = 32, vocab: int = 128256) -> float:
    """torchtitan docs/performance.md Table 2 setting: Llama 3.1 8B on 8 H100s, FSDP x CP,
    Float8 linears, full activation checkpointing (the forward runs twice), T = 32k tokens
    per GPU. Predicted tokens/s per GPU."""
    layer = Layer()
    T = L // cp
    matmul = layers * layer.matmul_params + vocab * layer.d_model
    linear = 8 * matmul * T / (GEMM * FLOAT8_GEMM_SPEEDUP)  # 2 fwd + bwd (2x fwd)
    if cp == 1:
        hd = layer.heads * layer.head_dim
        attn = layers * (2 * 2 * T * T * hd / ATTN_FWD + 2.5 * 2 * T * T * hd / ATTN_BWD)
    else:
        attn = (
            layers
            * ring_attention_time(layer, T, cp, NVLINK_H100, backward=True, recompute=True)[
                "seconds"
            ]
        )
    return T / (linear + attn)


def ring_flash_attention_point(*, backward: bool) -> float:
    """ring-flash-attention's README setting: 8 x H800, zigzag ring, batch 1, 8k tokens per
    GPU (64k in all), 32 heads, 8 KV heads, head dim 128, bf16, causal. Predicted iter/s."""
    r = ring_attention_time(Layer(), 8192, 8, NVLINK_H800, backward=backward)
    return 1.0 / r["seconds"]


def main() -> None:
    layer = Layer()
    print("Per-layer training throughput, Llama-3-8B-like layer, bf16, pure CP (batch 1)\n")
    gpus = (8, 16, 32, 64)
    print("| L \\ GPUs | " + " | ".join(str(n) for n in gpus) + " |")
    print("|---|" + "---|" * len(gpus))
    for L in (32768, 131072, 262144, 524288, 1048576):
        cells = []
        for n in gpus:
            r = layer_tokens_per_second(layer, L, n)
            cells.append(
                f"{r['tokens_per_s']:,.0f} tok/s ({r['hidden']:.0%} hidden, "
                f"attn {r['attn_share']:.0%}, T={r['T']:,} {r['link']})"
            )
        print(f"| {L // 1024}k | " + " | ".join(cells) + " |")
    print("\ntorchtitan Table 2 (Llama 3.1 8B, 8 H100, FSDP x CP, Float8, full AC), tokens/s/GPU")
    print("| setting | L | published | model | published / model |")
    print("|---|---|---|---|---|")
    for cp, L, published in (
        (1, 32768, 3890),
        (2, 65536, 2540),
        (4, 131072, 1071),
        (8, 262144, 548),
    ):
        model = torchtitan_point(L, cp)
        print(
            f"| FSDP {8 // cp}, CP {cp} | {L:,} | {published:,} | {model:,.0f} | "
            f"{published / model:.2f} |"
        )
    print("\nring-flash-attention README (8 x H800, 64k tokens, zigzag), iterations/s")
    print(
        "| pass | published zigzag_ring | published flash_attn x 1/8 | model | published / model |"
    )
    print("|---|---|---|---|---|")
    for backward, published, ideal in ((False, 63.0, 73.9), (True, 17.4, 19.3)):
        model = ring_flash_attention_point(backward=backward)
        print(
            f"| {'fwd+bwd' if backward else 'fwd'} | {published} | {ideal} | {model:.1f} | "
            f"{published / model:.2f} |"
        )
    for n, link, name in ((8, NVLINK_H100, "NVLink"), (64, IB_NDR, "IB")):
        # Smallest T per GPU at which the forward's transfer hides (compute >= transfer).
        T = 1
        while True:
            r = ring_attention_time(layer, T, n, link, backward=True)
            if r["hidden"] >= 1.0:
                break
            T *= 2
        print(
            f"\nsmallest power-of-two tokens per GPU with every transfer hidden over {name}: {T:,}"
        )


if __name__ == "__main__":
    main()
