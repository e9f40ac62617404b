"""Running a function on W gloo processes for the distributed tests, bounded in time.

`run_group(fn, world, tmp_path, *args)` spawns W processes with torch.multiprocessing, each
with one thread, a gloo process group on a file rendezvous in tmp_path, and calls
fn(rank, world, *args). A worker's exception fails the test with its traceback; a group that
has not finished after `timeout` seconds is killed and fails the test (a hang never blocks).
"""
from __future__ import annotations

import datetime
import os
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _entry(rank: int, fn, world: int, rendezvous: str, args: tuple) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))
    try:
        fn(rank, world, *args)
    finally:
        dist.destroy_process_group()


def run_group(fn, world: int, tmp_path, *args, timeout: float = 90.0) -> None:
    rendezvous = str(tmp_path / f"rendezvous-{fn.__name__}-{world}")
    context = mp.start_processes(_entry, args=(fn, world, rendezvous, args), nprocs=world,
                                 join=False, start_method="spawn")
    deadline = time.monotonic() + timeout
    try:
        while not context.join(timeout=max(0.1, min(1.0, deadline - time.monotonic()))):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{fn.__name__} on {world} processes did not finish within "
                                   f"{timeout} s (a hang?)")
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
                process.join(5)
