"""Context-parallel attention on CPU processes (gloo): ring and Ulysses against all-gathering
K/V, and how much of the ring's communication hides behind its attention.

    python benchmarks/bench_distributed.py [--worlds 2 4] [--seq-len 2048] [--heads 8]
        [--head-dim 64] [--min-time 2] [--csv benchmarks/results/distributed_cpu.csv]
    torchrun --standalone --nproc-per-node 8 benchmarks/bench_distributed.py --device cuda \
        --seq-len 65536 --heads 32 --kv-heads 8 --head-dim 128 --dtype bfloat16

Without torchrun it spawns the processes itself (CPU, gloo); under torchrun (WORLD_SIZE set)
each launched process is one rank (--device cuda: NCCL, one GPU per rank, CUDA-synchronised
timing), which is the GPU check of docs/design/context_parallel.md's model.

For each world size W, W processes (one thread each, gloo, file rendezvous) hold zigzag
shards of one causal self-attention problem of seq-len tokens and time, in interleaved
rounds (a barrier before every call; a call's time is the slowest rank's):
  ring            fastattn.distributed.ring_attention (forward; and forward+backward)
  ulysses         fastattn.distributed.ulysses_attention
  allgather_kv    all-gather K and V (gather_sequence), then each local query chunk attends to
                  its causal key prefix with fastattn.attention(causal="bottom_right")
  ring_compute    the ring's block attentions alone (K/V of every step already present)
  ring_transfers  the ring's W-1 K/V transfers alone (batch_isend_irecv, no attention)
hidden = 1 - (ring - ring_compute) / ring_transfers, clipped to [0, 1]: the fraction of the
transfers' time that did not add to the ring's time. The forward ring is measured this way;
the backward adds the travelling dK/dV accumulators (reported as times only).

This machine shows no scale: W processes share its 2 cores (4 processes oversubscribe them),
and gloo's transfers are memory copies through loopback that also need those cores. It is
shared with other work and noisy. docs/design/context_parallel.md models the GPU case.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RESULTS = Path(__file__).resolve().parent / "results"
FIELDS = [
    "time",
    "host",
    "torch",
    "device",
    "world",
    "seq_len",
    "heads",
    "kv_heads",
    "head_dim",
    "dtype",
    "provider",
    "median_ms",
    "spread",
    "reps",
    "hidden",
]


def _problem(args, rank, world):
    import fastattn.distributed as fd

    g = torch.Generator().manual_seed(0)
    L, H, Hkv, D = args.seq_len, args.heads, args.kv_heads or args.heads, args.head_dim
    dtype = getattr(torch, args.dtype)
    device = _device(args)
    full = [torch.randn(1, h, L, D, generator=g).to(device, dtype) for h in (H, Hkv, Hkv)]
    q, k, v = (fd.shard_sequence(t, dim=2).contiguous() for t in full)
    return q, k, v


def _device(args) -> torch.device:
    if args.device == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _providers(args, rank, world, q, k, v):
    import fastattn
    import fastattn.distributed as fd

    ring_module = sys.modules["fastattn.distributed.ring_attention"]
    c = q.shape[2] // 2
    chunks = [rank, 2 * world - 1 - rank]

    def attend(method, qq, kk, vv):
        if method == "ring":
            return fd.ring_attention(qq, kk, vv, causal=True)
        if method == "ulysses":
            return fd.ulysses_attention(qq, kk, vv, causal=True)
        kf, vf = fd.gather_sequence(kk, dim=2), fd.gather_sequence(vv, dim=2)
        return torch.cat(
            [
                fastattn.attention(
                    qq.narrow(2, s * c, c),
                    kf[:, :, : (i + 1) * c],
                    vf[:, :, : (i + 1) * c],
                    causal="bottom_right",
                )
                for s, i in enumerate(chunks)
            ],
            dim=2,
        )

    def forward(method):
        return lambda: attend(method, q, k, v)

    def forward_backward(method):
        def run():
            leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
            attend(method, *leaves).sum().backward()

        return run

    # Every step's K/V shard, present before timing: the ring's attention work alone.
    kv_all = [(fd.gather_sequence(k, dim=2), fd.gather_sequence(v, dim=2))]
    kf, vf = kv_all[0]
    shards = {}
    for s in range(world):
        idx = [s, 2 * world - 1 - s]
        shards[s] = (
            torch.cat([kf[:, :, i * c : (i + 1) * c] for i in idx], dim=2),
            torch.cat([vf[:, :, i * c : (i + 1) * c] for i in idx], dim=2),
        )
    plan = ring_module._Plan(
        None,
        rank,
        world,
        "zigzag",
        c,
        -(1 << 30),
        0,
        1.0 / args.head_dim**0.5,
        0.0,
        None,
        None,
        torch.float32,
    )
    plan.chosen = None

    def ring_compute():
        for step in range(world):
            source = (rank - step) % world
            ks, vs = shards[source]
            for slot, qi in enumerate(chunks):
                for kslot, ki in enumerate(plan.chunks(source)):
                    ring_module._block_forward(
                        plan,
                        q.narrow(2, slot * c, c),
                        ks.narrow(2, kslot * c, c),
                        vs.narrow(2, kslot * c, c),
                        qi,
                        ki,
                    )

    def ring_transfers():
        kv = [k, v]
        for _ in range(world - 1):
            kv, requests = ring_module._exchange(plan, kv, tag=1)
            ring_module._wait(requests)

    providers = {
        "ring": forward("ring"),
        "ring_compute": ring_compute,
        "ring_transfers": ring_transfers,
    }
    for method in ("ulysses", "allgather_kv"):
        providers[method] = forward(method)
    for method in ("ring", "ulysses", "allgather_kv"):
        providers[f"{method} fwd+bwd"] = forward_backward(method)
    return providers


def _timed(fn, device) -> float:
    """One call, started together on every rank; the slowest rank's time."""
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def _worker(rank, world, rendezvous, args, out_path):
    device = _device(args)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl")
    else:
        torch.set_num_threads(1)
        if rendezvous is None:
            dist.init_process_group("gloo")
        else:
            dist.init_process_group(
                "gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world
            )
    q, k, v = _problem(args, rank, world)
    providers = _providers(args, rank, world, q, k, v)
    names = list(providers)
    for name in names:  # warm-up
        providers[name]()
    times = {n: [] for n in names}
    start = time.perf_counter()
    rounds = 0
    # Interleaved rounds, rotating the order, until min_time has passed (the same decision on
    # every rank: rank 0's clock is broadcast).
    while True:
        order = names[rounds % len(names) :] + names[: rounds % len(names)]
        for name in order:
            times[name].append(_timed(providers[name], device))
        rounds += 1
        done = torch.tensor(
            [rounds >= 3 and time.perf_counter() - start > args.min_time], device=device
        )
        dist.broadcast(done, 0)
        if bool(done):
            break
    if rank == 0:
        rows = []
        med = {n: statistics.median(t) for n, t in times.items()}
        exposed = med["ring"] - med["ring_compute"]
        hidden = (
            max(0.0, min(1.0, 1.0 - exposed / med["ring_transfers"]))
            if med["ring_transfers"] > 0
            else float("nan")
        )
        for n in names:
            t = sorted(times[n])
            spread = (t[int(0.9 * (len(t) - 1) + 0.999)] - t[int(0.1 * (len(t) - 1))]) / med[n]
            rows.append(
                {
                    "provider": n,
                    "median_ms": round(med[n] * 1e3, 3),
                    "spread": round(spread, 3),
                    "reps": len(t),
                    "hidden": round(hidden, 3) if n == "ring" else "",
                }
            )
        torch.save(rows, out_path)
    dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None, help="default: --heads")
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--min-time", type=float, default=2.0)
    p.add_argument(
        "--csv",
        default=str(RESULTS / "distributed_cpu.csv"),
        help="CSV to append rows to ('' for none)",
    )
    args = p.parse_args(argv)
    stamp = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    all_rows = []
    launched = "WORLD_SIZE" in os.environ  # under torchrun: this process is one rank
    worlds = [int(os.environ["WORLD_SIZE"])] if launched else args.worlds
    for world in worlds:
        with tempfile.TemporaryDirectory() as tmp:
            out_path = os.path.join(tmp, "rows.pt")
            if launched:
                rank = int(os.environ["RANK"])
                _worker(rank, world, None, args, out_path)
                if rank != 0:
                    return 0
            else:
                mp.start_processes(
                    _worker,
                    args=(world, os.path.join(tmp, "rdv"), args, out_path),
                    nprocs=world,
                    start_method="spawn",
                )
            rows = torch.load(out_path)
        where = (
            f"{world} GPUs"
            if args.device == "cuda"
            else f"{world} processes x 1 thread on {os.cpu_count()} cores"
        )
        print(
            f"\nW={world}: causal self-attention, L={args.seq_len} (zigzag, "
            f"{args.seq_len // world} tokens per rank), H={args.heads}, "
            f"Hkv={args.kv_heads or args.heads}, D={args.head_dim}, {args.dtype}, {where}"
        )
        ring = next(r for r in rows if r["provider"] == "ring")
        for r in rows:
            extra = f"  hidden {r['hidden']:.0%}" if r["hidden"] != "" else ""
            ratio = r["median_ms"] / ring["median_ms"]
            print(
                f"  {r['provider']:<22} {r['median_ms']:9.2f} ms  spread {r['spread']:.2f}  "
                f"reps {r['reps']:3d}  ({ratio:.2f}x ring){extra}"
            )
        for r in rows:
            all_rows.append(
                {
                    "time": stamp,
                    "host": platform.node(),
                    "torch": torch.__version__,
                    "device": args.device,
                    "world": world,
                    "seq_len": args.seq_len,
                    "heads": args.heads,
                    "kv_heads": args.kv_heads or args.heads,
                    "head_dim": args.head_dim,
                    "dtype": args.dtype,
                    **r,
                }
            )
    if args.csv:
        path = Path(args.csv)
        path.parent.mkdir(parents=True, exist_ok=True)
        new = not path.exists()
        if not new:
            with path.open() as f:
                header = f.readline().strip().split(",")
            if header != FIELDS:
                raise SystemExit(
                    f"{path} has the columns {header}, not this version's {FIELDS}; "
                    f"pass another --csv"
                )
        with path.open("a", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=FIELDS)
            if new:
                writer.writeheader()
            writer.writerows(all_rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
