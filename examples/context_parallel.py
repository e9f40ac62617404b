"""Context parallelism: a small GPT trained on sequences sharded over the ranks.

    torchrun --standalone --nproc-per-node 2 examples/context_parallel.py --check
    torchrun --standalone --nproc-per-node 4 examples/context_parallel.py --check --dp 2

The world is a 2-D device mesh (data x context): --dp data-parallel replicas, each with
world/dp context-parallel ranks. Every sequence is split over the context ranks in the zigzag
layout (fastattn.distributed.shard_sequence); rotary positions come from shard_positions, so
each token is rotated by its global position; attention is ring_attention (or
ulysses_attention, --method ulysses) over the context group, causal on global positions.
Parameter gradients are per-rank partial sums: DistributedDataParallel over the whole world
sums them (it averages, so each rank's loss is its share of the global mean times the world
size).

--check also runs the same model, from the same initial weights, on one process over the
whole batch and whole sequences with fastattn.attention, and compares the loss and every
parameter gradient at every step (the two then take the same optimizer step); it exits with
status 1 on a mismatch. gloo on CPU, NCCL when CUDA is available.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn.parallel import DistributedDataParallel

import fastattn
import fastattn.distributed as fd


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int):
        super().__init__()
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads
        self.head_dim = d_model // n_heads
        self.norm1 = nn.LayerNorm(d_model)
        self.q_proj = nn.Linear(d_model, n_heads * self.head_dim, bias=False)
        self.kv_proj = nn.Linear(d_model, 2 * n_kv_heads * self.head_dim, bias=False)
        self.out_proj = nn.Linear(n_heads * self.head_dim, d_model, bias=False)
        self.norm2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model)
        )

    def forward(self, x, positions, attend):
        """x (B, L, E) (whole sequences or this rank's shard); positions (L,) global."""
        B, L, _ = x.shape
        h = self.norm1(x)
        q = self.q_proj(h).view(B, L, self.n_heads, self.head_dim).transpose(1, 2)
        k, v = self.kv_proj(h).view(B, L, 2, self.n_kv_heads, self.head_dim).unbind(2)
        k, v = k.transpose(1, 2), v.transpose(1, 2)
        ids = positions.expand(B, L)
        q = fastattn.apply_rotary(q, position_ids=ids)
        k = fastattn.apply_rotary(k, position_ids=ids)
        out = attend(q, k, v)  # (B, H, L, Dh)
        x = x + self.out_proj(out.transpose(1, 2).reshape(B, L, -1))
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int, d_model: int, n_heads: int, n_kv_heads: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, d_model)
        self.blocks = nn.ModuleList(Block(d_model, n_heads, n_kv_heads) for _ in range(layers))
        self.norm = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, tokens, positions, attend):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, positions, attend)
        return self.head(self.norm(x))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=4, help="global batch (sequences)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--d-model", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--vocab", type=int, default=97)
    p.add_argument("--dp", type=int, default=1, help="data-parallel size (world = dp x cp)")
    p.add_argument("--method", choices=("ring", "ulysses"), default="ring")
    p.add_argument("--layout", choices=("zigzag", "contiguous"), default="zigzag")
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument(
        "--check",
        action="store_true",
        help="compare loss and gradients with one-process training; exit 1 if not equal",
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if use_cuda:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dtype = getattr(torch, args.dtype)
    if world % args.dp:
        raise SystemExit(f"--dp ({args.dp}) must divide the world size ({world})")
    cp = world // args.dp
    mesh = init_device_mesh(device.type, (args.dp, cp), mesh_dim_names=("dp", "cp"))
    cp_group, dp_rank = mesh["cp"].get_group(), mesh["dp"].get_local_rank()
    if args.batch % args.dp:
        raise SystemExit(f"--batch ({args.batch}) must be divisible by --dp ({args.dp})")

    torch.manual_seed(0)
    model = GPT(args.vocab, args.d_model, args.heads, args.kv_heads, args.layers).to(device, dtype)
    reference = copy.deepcopy(model) if args.check else None
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3) if args.check else None

    positions = fd.shard_positions(args.seq_len, group=cp_group, layout=args.layout, device=device)
    full_positions = torch.arange(args.seq_len, device=device)
    if args.method == "ring":

        def attend(q, k, v):
            return fd.ring_attention(q, k, v, group=cp_group, layout=args.layout, causal=True)
    else:

        def attend(q, k, v):
            return fd.ulysses_attention(q, k, v, group=cp_group, layout=args.layout, causal=True)

    def attend_one_process(q, k, v):
        return fastattn.attention(q, k, v, causal=True)

    rows = slice(dp_rank * args.batch // args.dp, (dp_rank + 1) * args.batch // args.dp)
    tolerance = 1e-9 if dtype == torch.float64 else 2e-4
    generator = torch.Generator().manual_seed(1234)
    failures = 0
    for step in range(args.steps):
        data = torch.randint(0, args.vocab, (args.batch, args.seq_len + 1), generator=generator)
        data = data.to(device)
        inputs, targets = data[:, :-1], data[:, 1:]  # next-token targets on whole sequences
        local_in = fd.shard_sequence(inputs[rows], dim=1, group=cp_group, layout=args.layout)
        local_tg = fd.shard_sequence(targets[rows], dim=1, group=cp_group, layout=args.layout)
        logits = ddp(local_in, positions, attend)
        token_losses = F.cross_entropy(logits.flatten(0, 1), local_tg.flatten(), reduction="sum")
        # This rank's share of the global mean, times the world size (DDP averages).
        loss = token_losses * world / targets.numel()
        opt.zero_grad()
        loss.backward()
        global_loss = (token_losses / targets.numel()).detach()
        dist.all_reduce(global_loss)

        if args.check:
            ref_logits = reference(inputs, full_positions, attend_one_process)
            ref_loss = F.cross_entropy(ref_logits.flatten(0, 1), targets.flatten())
            ref_opt.zero_grad()
            ref_loss.backward()
            worst = abs(float(global_loss) - ref_loss.item()) / max(1.0, abs(ref_loss.item()))
            worst_name = "loss"
            for (name, p), ref_p in zip(model.named_parameters(), reference.parameters()):
                err = float((p.grad - ref_p.grad).abs().max()) / max(
                    1e-3, float(ref_p.grad.abs().max())
                )
                if err > worst:
                    worst, worst_name = err, f"grad {name}"
            ok = worst <= tolerance
            failures += not ok
            if rank == 0:
                print(
                    f"step {step}: loss {float(global_loss):.6f} (one process "
                    f"{ref_loss.item():.6f}); worst relative difference {worst:.2e} "
                    f"({worst_name}) {'ok' if ok else 'MISMATCH'}",
                    flush=True,
                )
            ref_opt.step()
        elif rank == 0:
            print(f"step {step}: loss {float(global_loss):.6f}", flush=True)
        opt.step()

    if rank == 0:
        print(
            f"world {world} = dp {args.dp} x cp {cp}, {args.method} attention, "
            f"{args.layout} layout, {args.seq_len} tokens per sequence "
            f"({args.seq_len // cp} per rank), attention ran on: "
            f"{fastattn.last_backend('attention')}"
        )
        if args.check:
            print("check passed" if failures == 0 else f"check FAILED ({failures} steps)")
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
