"""Process groups for the distributed tests, bounded in time.

`WorkerGroup(world, tmp_dir)` spawns W processes (torch.multiprocessing's spawn context), each
with one thread and a gloo process group on a file rendezvous in tmp_dir, and keeps them for
many tests: process start-up and `import fastattn` cost seconds on a busy 2-core machine,
more than most tests. `group.run(fn, *args, timeout=...)` calls fn(rank, world, *args) on
every rank and returns once all have finished; a worker's exception fails the caller with its
traceback; ranks that have not all answered within `timeout` seconds are killed and the
caller fails (a hang never blocks the suite; the next test gets a fresh group).
"""

from __future__ import annotations

import datetime
import os
import queue
import time
import traceback

import torch
import torch.multiprocessing as mp


def _worker(rank: int, world: int, rendezvous: str, tasks, results) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch.distributed as dist

    dist.init_process_group(
        "gloo",
        init_method=f"file://{rendezvous}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    results.put((rank, "ready", None))
    while True:
        item = tasks.get()
        if item is None:
            break
        fn, args = item
        try:
            value = fn(rank, world, *args)
            results.put((rank, "ok", value))
        except BaseException:  # noqa: BLE001 (reported to the test, which fails)
            results.put((rank, "error", traceback.format_exc()))
    # Leave without tearing the group down: a destroy waits for the peers, which are leaving
    # too; the process's exit releases everything.
    results.close()
    results.join_thread()
    os._exit(0)


class WorkerGroup:
    def __init__(self, world: int, tmp_dir, *, start_timeout: float = 120.0):
        self.world = world
        ctx = mp.get_context("spawn")
        rendezvous = os.path.join(str(tmp_dir), f"rendezvous-{world}-{time.monotonic_ns()}")
        self.tasks = [ctx.Queue() for _ in range(world)]
        self.results = ctx.Queue()
        self.processes = [
            ctx.Process(
                target=_worker,
                daemon=True,
                args=(r, world, rendezvous, self.tasks[r], self.results),
            )
            for r in range(world)
        ]
        for p in self.processes:
            p.start()
        self._collect("start-up", start_timeout, want="ready")

    @property
    def alive(self) -> bool:
        return all(p.is_alive() for p in self.processes)

    def _collect(self, what: str, timeout: float, want: str = "ok") -> list:
        deadline = time.monotonic() + timeout
        values: list = [None] * self.world
        errors = []
        pending = set(range(self.world))
        while pending:
            left = deadline - time.monotonic()
            if left <= 0 or not self.alive:
                self.close()
                state = (
                    f"did not finish within {timeout:.0f} s (a hang?)"
                    if left <= 0
                    else "lost a process"
                )
                raise TimeoutError(
                    f"{what} on {self.world} processes {state}; ranks still "
                    f"running: {sorted(pending)}" + "".join(errors)
                )
            try:
                rank, status, value = self.results.get(timeout=min(left, 0.5))
            except queue.Empty:
                continue
            pending.discard(rank)
            if status == "error":
                errors.append(f"\n--- rank {rank} ---\n{value}")
            else:
                values[rank] = value
        if errors:
            raise AssertionError(
                f"{what} failed on {len(errors)} of {self.world} ranks:" + "".join(errors)
            )
        return values

    def run(self, fn, *args, timeout: float = 60.0) -> list:
        """fn(rank, world, *args) on every rank; returns the ranks' return values."""
        for q in self.tasks:
            q.put((fn, args))
        return self._collect(fn.__name__, timeout)

    def close(self) -> None:
        for q in self.tasks:
            try:
                q.put(None)
            except (ValueError, OSError):
                pass
        deadline = time.monotonic() + 10
        for p in self.processes:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.processes:
            if p.is_alive():
                p.kill()
                p.join(5)
