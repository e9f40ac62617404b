"""One plain forward of the CUDA tensor-core attention kernel, for a profiler's capture
(benchmarks/gpu_suite.sh's ncu stage: it skips the first launch and captures the second).

    python benchmarks/gpu_one_forward.py [--batch 4 --seqlen 4096 --heads 16 --head-dim 128]

The shape is the first GPU run's representative row (docs/design/attention_cuda.md): bf16,
b * s = 16k tokens, h * d = 2048, not causal. Prints which backend ran.
"""

from __future__ import annotations

import argparse

import torch

import fastattn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seqlen", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    args = ap.parse_args()
    shape = (args.batch, args.heads, args.seqlen, args.head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    with torch.no_grad():
        for _ in range(2):  # the first launch warms up; the profiler captures the second
            fastattn.attention(q, k, v, causal=args.causal, backend="cuda")
    torch.cuda.synchronize()
    print(f"attention {shape} bf16 causal={args.causal}: {fastattn.last_backend('attention')}")


if __name__ == "__main__":
    main()
