"""Shared benchmark machinery: timing, correctness checks, table printing and CSV rows.

Each bench_<op>.py defines `cases(profile, device)` returning a list of `Case`s. A Case holds
providers (name -> zero-argument callable), the one to check against (`reference`), the
PyTorch providers to compare with (`baselines`), and the work it does (bytes or FLOPs), from
which throughput is reported. Providers' outputs are compared with the reference before they
are timed; a provider whose check fails is reported and never timed. The providers of a case
are timed in interleaved rounds (measure_interleaved), so that the machine's drift does not
bias their ratios.
"""
from __future__ import annotations

import csv
import datetime as _dt
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass
class Case:
    op: str
    name: str                                  # shape / setting, e.g. "B=32 L=512 D=512 p=0.1"
    providers: dict[str, Callable[[], object]]
    reference: str                             # provider whose output defines correct
    baselines: tuple[str, ...]                 # PyTorch providers to compare fastattn with
    bytes: float = 0.0                         # memory traffic of one call (GB/s)
    flops: float = 0.0                         # floating-point work of one call (TFLOP/s)
    check: Callable[[object, object], float] | None = None  # (out, ref) -> error; None: skip
    # Providers whose outputs are compared instead of `providers` (e.g. the same computation
    # without dropout, whose masks legitimately differ between implementations).
    check_providers: dict[str, Callable[[], object]] | None = None
    tolerance: float = 1e-3
    dtype: str = "float32"
    notes: dict[str, str] = field(default_factory=dict)


def max_abs_error(out, ref) -> float:
    """Largest |out - ref| over a tensor or a tuple of tensors (NaN if any is NaN)."""
    if isinstance(out, (tuple, list)):
        return max((max_abs_error(o, r) for o, r in zip(out, ref)), default=0.0)
    diff = (out.detach().double() - ref.detach().double()).abs()
    if diff.numel() == 0:
        return 0.0
    return float("nan") if torch.isnan(diff).any() else float(diff.max())


def relative_error(out, ref) -> float:
    """max |out - ref| / max |ref| (over tuples: the worst member)."""
    if isinstance(out, (tuple, list)):
        return max((relative_error(o, r) for o, r in zip(out, ref)), default=0.0)
    scale = float(ref.detach().double().abs().max()) if ref.numel() else 1.0
    return max_abs_error(out, ref) / max(scale, 1e-30)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(fn: Callable[[], object], device: torch.device, *, min_time: float,
            max_reps: int = 1000, warmup: int = 2) -> list[float]:
    """Per-call times in seconds: warm up, then repeat until min_time has passed."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times: list[float] = []
    start_all = time.perf_counter()
    while len(times) < max_reps and (len(times) < 5 or time.perf_counter() - start_all < min_time):
        times.append(_timed_call(fn, device))
    return times


def summarize(times: list[float]) -> tuple[float, float]:
    """(median seconds, spread = (p90 - p10) / median)."""
    ordered = sorted(times)
    median = statistics.median(ordered)
    p10 = ordered[int(0.1 * (len(ordered) - 1))]
    p90 = ordered[int(math.ceil(0.9 * (len(ordered) - 1)))]
    return median, (p90 - p10) / median if median > 0 else 0.0


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.machine()}, {torch.get_num_threads()} threads)"


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 28) -> float:
    """Measured device-to-device copy bandwidth in bytes/s (bytes read + bytes written)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    times = measure(lambda: dst.copy_(src), device, min_time=0.5, max_reps=50)
    return 2 * nbytes / summarize(times)[0]


def _error_status(exc: Exception) -> str:
    """A provider's status when it raised: the exception's type and first line."""
    lines = str(exc).splitlines() or [""]
    return f"ERROR {type(exc).__name__}: {lines[0][:120]}"


def _timed_call(fn: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure_interleaved(fns: dict[str, Callable[[], object]], device: torch.device, *,
                        min_time: float, min_rounds: int = 3, max_rounds: int = 200,
                        warmup: int = 2, block: int = 2) -> tuple[dict, dict]:
    """Per-call times (seconds) of several providers, measured in rounds: a round runs every
    provider block + 1 times in a row, the first call untimed (it pays for taking over the
    caches from the provider before), and the order rotates from round to round. A drift of
    the machine's speed while a case is measured (clock changes, other tenants: this CPU's
    timings wander by 10-20% over minutes) then reaches every provider alike; timing all of one
    provider and then all of the next turned such drift into ratios. Rounds repeat until
    min_time per provider has passed (at least min_rounds).

    Returns (times per provider, error message per provider that raised; it leaves the
    rotation)."""
    errors: dict[str, str] = {}
    times: dict[str, list[float]] = {name: [] for name in fns}

    def guarded(name, action):
        try:
            return action()
        except Exception as exc:  # report and go on: one broken provider must not hide the rest
            errors[name] = _error_status(exc)
            return None

    for name, fn in fns.items():
        guarded(name, lambda fn=fn: [fn() for _ in range(warmup)])
    synchronize(device)
    start = time.perf_counter()
    rounds = 0
    while rounds < max_rounds and (rounds < min_rounds or
                                   time.perf_counter() - start < min_time * len(fns)):
        live = [name for name in fns if name not in errors]
        if not live:
            break
        shift = rounds % len(live)
        for name in live[shift:] + live[:shift]:
            fn = fns[name]

            def one_block(fn=fn):
                fn()
                synchronize(device)
                return [_timed_call(fn, device) for _ in range(block)]
            got = guarded(name, one_block)
            if got is not None:
                times[name] += got
        rounds += 1
    return times, errors


def run_case(case: Case, device: torch.device, *, min_time: float) -> list[dict]:
    """Check every provider of a case, then time those that passed, interleaved
    (measure_interleaved); one result row per provider."""
    rows: dict[str, dict] = {}
    checked = case.check_providers or case.providers
    ref_out = checked[case.reference]() if case.check else None
    to_time: dict[str, Callable[[], object]] = {}
    for name, fn in case.providers.items():
        row = {"op": case.op, "case": case.name, "provider": name, "dtype": case.dtype}
        rows[name] = row
        try:
            if case.check and name != case.reference:
                err = case.check(checked[name](), ref_out)
                row["error"] = err
                if not err <= case.tolerance:
                    row["status"] = f"FAIL (error {err:.2e} > {case.tolerance:.1e})"
                    continue
        except Exception as exc:  # report and go on: one broken provider must not hide the rest
            row["status"] = _error_status(exc)
            continue
        to_time[name] = fn
    all_times, errors = measure_interleaved(to_time, device, min_time=min_time)
    timed: dict[str, float] = {}
    for name in to_time:
        row = rows[name]
        if name in errors or not all_times[name]:
            row["status"] = errors.get(name, "ERROR: never timed")
            continue
        median, spread = summarize(all_times[name])
        timed[name] = median
        row.update(status="ok", median_ms=median * 1e3, spread=spread,
                   reps=len(all_times[name]))
        if case.bytes:
            row["GB/s"] = case.bytes / median / 1e9
            if "copy_GB/s" in case.notes:
                row["of_copy_bw"] = row["GB/s"] / float(case.notes["copy_GB/s"])
        if case.flops:
            row["TFLOP/s"] = case.flops / median / 1e12
    best_baseline = min((timed[b] for b in case.baselines if b in timed), default=None)
    for row in rows.values():
        if best_baseline and row.get("status") == "ok":
            row["speedup"] = best_baseline / (row["median_ms"] / 1e3)
    return list(rows.values())


def format_table(rows: list[dict]) -> str:
    """Plain-text table of result rows."""
    headers = ["op", "case", "dtype", "provider", "median_ms", "spread", "GB/s", "of_copy_bw",
               "TFLOP/s", "speedup", "status"]
    present = [h for h in headers if any(h in r for r in rows)]

    def cell(row, h):
        v = row.get(h, "")
        if isinstance(v, float):
            if h in ("spread", "of_copy_bw"):
                return f"{100 * v:.0f}%"
            if h == "speedup":
                return f"{v:.2f}x"
            return f"{v:.3g}" if v < 100 else f"{v:.0f}"
        return str(v)

    table = [present] + [[cell(r, h) for h in present] for r in rows]
    widths = [max(len(line[i]) for line in table) for i in range(len(present))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)) for line in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def environment(device: torch.device) -> dict[str, str]:
    import fastattn
    try:
        import triton
        triton_version = triton.__version__
    except Exception:
        triton_version = "none"
    return {"time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
            "device": device_name(device), "torch": torch.__version__, "triton": triton_version,
            "fastattn": fastattn.__version__, "host": platform.node()}


CSV_FIELDS = ["time", "device", "torch", "triton", "fastattn", "host", "op", "case", "dtype",
              "provider", "median_ms", "spread", "reps", "GB/s", "of_copy_bw", "TFLOP/s",
              "speedup", "error", "status"]


def append_csv(path: Path, rows: list[dict], env: dict[str, str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        if new:
            writer.writeheader()
        for row in rows:
            writer.writerow({**env, **row})


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def fastattn_backends(device: torch.device) -> list[str]:
    """fastattn backends that run on `device` here (triton on CPU only when interpreting,
    which is far too slow to time, so it is left out of CPU benchmarks)."""
    import fastattn
    status = fastattn.available_backends()
    if device.type == "cuda":
        return [b for b in ("cuda", "triton") if status[b] == "available"]
    return ["cpu"] if status["cpu"] == "available" else []


def env_flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")
