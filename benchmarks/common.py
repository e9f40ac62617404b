"""Shared benchmark machinery: timing, correctness checks, table printing and CSV rows.

Each bench_<op>.py defines `cases(profile, device)` returning a list of `Case`s. A Case holds
providers (name -> zero-argument callable), the one to check against (`reference`), the
PyTorch providers to compare with (`baselines`), which providers write their result into an
input (`inplace`), and the work it does (bytes or FLOPs), from which throughput is reported.
A row's speedup is over the fastest baseline of its own kind: an in-place provider's over the
in-place baselines, any other's over the out-of-place ones (an in-place call allocates no
output, so comparing it with an out-of-place one measures the allocation, not the kernel); a
provider with no timed baseline of its kind has no speedup. The row names that baseline
("against") and its kind ("inplace"). Providers' outputs are compared with the reference before they
are timed; a provider whose check fails is reported and never timed. The providers of a case
are timed in interleaved rounds (measure_interleaved), so that the machine's drift does not
bias their ratios. On a CPU the times are read from a clock (`clock`, time.perf_counter unless
a caller passes its own: the harness's tests pass a fake one that each provider advances by a
known cost, so their speedups are exact and no test depends on the machine's speed).

Which providers a check judges: fastattn's (`judged`, by default the providers whose name
starts with "fastattn"). A baseline (a PyTorch provider) whose own error exceeds the tolerance
is still timed; its error is shown in the row's note and is no failure of fastattn's.

Two kinds of check:
- against the reference provider: a judged provider passes when check(out, ref) <= tolerance;
- against a ground truth (Case.ground_truth, the computation in float64 or float32), with
  FlashAttention's rule: per output tensor k, a judged provider passes when
  error_k(provider) <= factor * error_k(reference provider) + tolerance, errors measured
  against the ground truth. This is the sound check where the reference provider runs in a
  low precision (bfloat16 over many layers and steps): its own error is the scale.
"""

from __future__ import annotations

import contextlib
import csv
import datetime as _dt
import math
import os
import platform
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"


@dataclass
class Case:
    op: str
    name: str  # shape / setting, e.g. "B=32 L=512 D=512 p=0.1"
    providers: dict[str, Callable[[], object]]
    reference: str  # provider whose output defines correct
    baselines: tuple[str, ...]  # PyTorch providers to compare fastattn with
    bytes: float = 0.0  # memory traffic of one call (GB/s)
    flops: float = 0.0  # floating-point work of one call (TFLOP/s)
    check: Callable[[object, object], float] | None = None  # (out, ref) -> error; None: skip
    # Providers whose outputs are compared instead of `providers` (e.g. the same computation
    # without dropout, whose masks legitimately differ between implementations).
    check_providers: dict[str, Callable[[], object]] | None = None
    tolerance: float = 1e-3
    dtype: str = "float32"
    notes: dict[str, str] = field(default_factory=dict)
    # Providers the check judges (None: those named "fastattn..."); the others' errors are
    # shown in the row's note, never reported as failures.
    judged: tuple[str, ...] | None = None
    # The same computation in a higher precision (zero-argument callable returning what the
    # checked providers return). When set, errors are measured against it and a judged
    # provider passes by FlashAttention's rule: error <= factor * the reference provider's
    # error + tolerance, per output tensor (see the module docstring).
    ground_truth: Callable[[], object] | None = None
    factor: float = 2.0
    # Providers (fastattn's and baselines alike) that write their result into an input: their
    # speedups are over the in-place baselines, the others' over the out-of-place ones.
    inplace: tuple[str, ...] = ()
    # The call's key in fastattn's speed table (fastattn/speed_table.py) and the kernel backend
    # the automatic choice uses without a table: with a "fastattn:torch" provider, the case
    # measures an entry (benchmarks/speed_table_writer.py).
    speed_key: tuple | None = None
    kernel: str | None = None
    # The provider that runs fastattn's kernel as the automatic choice would (default
    # "fastattn:<kernel>"): the auto row is judged against it and the torch-backend row.
    kernel_row: str | None = None

    def __post_init__(self):
        unknown = [name for name in self.inplace if name not in self.providers]
        if unknown:
            raise ValueError(
                f"Case {self.op} {self.name}: inplace names {unknown}, which are not among "
                f"its providers {list(self.providers)}"
            )

    def is_inplace(self, provider: str) -> bool:
        return provider in self.inplace

    def is_judged(self, provider: str) -> bool:
        if self.judged is not None:
            return provider in self.judged
        return provider.startswith("fastattn")


def op_family(row: dict) -> str:
    """The family a result row is summarized in: "<op> (<dtype>)", or "<op> in-place (<dtype>)"
    for an in-place provider's row, so that a summary compares like with like. Takes run_case's
    rows and the CSV's (where "inplace" is the text "True")."""
    inplace = row.get("inplace") in (True, "True")
    return f"{row['op']}{' in-place' if inplace else ''} ({row['dtype']})"


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


def _as_tensors(out) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


def flash_rule(
    check: Callable[[object, object], float], out, baseline, truth, *, factor: float, floor: float
) -> tuple[bool, float, float, int]:
    """FlashAttention's rule per output tensor: check(out_k, truth_k) <= factor *
    check(baseline_k, truth_k) + floor for every k. Returns (passed, the largest error of out,
    the largest error of baseline, the index of the tensor nearest to or furthest over its
    bound)."""
    outs, bases, truths = _as_tensors(out), _as_tensors(baseline), _as_tensors(truth)
    if not len(outs) == len(bases) == len(truths):
        raise ValueError(
            f"flash_rule: {len(outs)} outputs, {len(bases)} baseline outputs and "
            f"{len(truths)} ground-truth outputs"
        )
    errors = [check(o, t) for o, t in zip(outs, truths)]
    base_errors = [check(b, t) for b, t in zip(bases, truths)]
    # how far each tensor uses its allowance (NaN counts as over it)
    usage = [e / (factor * b + floor) if e == e else math.inf for e, b in zip(errors, base_errors)]
    worst = max(range(len(usage)), key=lambda k: usage[k])
    return usage[worst] <= 1.0, max(errors), max(base_errors), worst


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


Clock = Callable[[], float]  # seconds, monotonic (time.perf_counter)


def measure(
    fn: Callable[[], object],
    device: torch.device,
    *,
    min_time: float,
    max_reps: int = 1000,
    warmup: int = 2,
    clock: Clock = time.perf_counter,
) -> list[float]:
    """Per-call times in seconds: warm up, then repeat until min_time has passed on `clock`."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times: list[float] = []
    start_all = clock()
    while len(times) < max_reps and (len(times) < 5 or clock() - start_all < min_time):
        times.append(_timed_call(fn, device, clock))
    return times


def summarize(times: list[float]) -> tuple[float, float]:
    """(median seconds, spread = (p90 - p10) / median)."""
    ordered = sorted(times)
    median = statistics.median(ordered)
    p10 = ordered[int(0.1 * (len(ordered) - 1))]
    p90 = ordered[int(math.ceil(0.9 * (len(ordered) - 1)))]
    return median, (p90 - p10) / median if median > 0 else 0.0


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo), else the platform's machine name."""
    from fastattn import speed_table

    return speed_table.cpuinfo_field("model name") or platform.processor() or platform.machine()


def cpu_kernel_isa() -> str:
    """The x86 copy of fastattn's CPU kernels that runs here (build_info's cpu_isa), with
    "+amx" where bfloat16 attention runs its tile products on AMX (build_info's cpu_amx)."""
    import fastattn

    info = fastattn.build_info()
    return str(info.get("cpu_isa", "not built")) + ("+amx" if info.get("cpu_amx") else "")


def device_name(device: torch.device) -> str:
    """The device column: the GPU's name, or the CPU's model, kernel ISA copy and threads
    ("cpu: AMD EPYC, avx2, 2 threads")."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu: {cpu_model()}, {cpu_kernel_isa()}, {torch.get_num_threads()} threads"


def copy_bandwidth(device: torch.device, nbytes: int = 1 << 28) -> float:
    """Measured device-to-device copy bandwidth in bytes/s (bytes read + bytes written)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    times = measure(lambda: dst.copy_(src), device, min_time=0.5, max_reps=50)
    return 2 * nbytes / summarize(times)[0]


def matmul_throughput(device: torch.device, dtype: torch.dtype, n: int = 2048) -> float:
    """Measured FLOP/s of an (n, n) @ (n, n) matrix product: the machine's compute ceiling for
    the plots."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    times = measure(lambda: a @ b, device, min_time=0.3, max_reps=50)
    return 2 * n**3 / summarize(times)[0]


def machine_ceilings(device: torch.device) -> dict[str, float]:
    """The measured ceilings of the plots: "copy_GB/s" and "<dtype>_TFLOP/s" (float32 on a
    CPU; float32, bfloat16 and float16 on a GPU)."""
    dtypes = [torch.float32] + ([torch.bfloat16, torch.float16] if device.type == "cuda" else [])
    out = {"copy_GB/s": copy_bandwidth(device, 1 << 26) / 1e9}
    for dtype in dtypes:
        out[f"{str(dtype)[6:]}_TFLOP/s"] = matmul_throughput(device, dtype) / 1e12
    if device.type == "cpu":
        out["fma_peak_TFLOP/s"] = cpu_fma_peak() / 1e3
    return out


def cpu_fma_peak(repeats: int = 5) -> float:
    """The CPU's measured float32 multiply-add peak in GFLOP/s on torch's threads (fastattn's
    own measurement, csrc/common/fma_peak_cpu_kernel.cpp: independent FMA chains in the
    registers of the kernel copy that runs), or nan without the extension."""
    from fastattn import _native

    if _native.C is None:
        return float("nan")
    return float(_native.C.cpu_fma_peak(repeats))


def _error_status(exc: Exception) -> str:
    """A provider's status when it raised: the exception's type and first line."""
    lines = str(exc).splitlines() or [""]
    return f"ERROR {type(exc).__name__}: {lines[0][:120]}"


def _timed_call(fn: Callable[[], object], device: torch.device, clock: Clock) -> float:
    """Seconds of one call: CUDA events on a GPU (the kernels' time), else `clock`."""
    if device.type == "cuda":
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3
    t0 = clock()
    fn()
    return clock() - t0


def measure_interleaved(
    fns: dict[str, Callable[[], object]],
    device: torch.device,
    *,
    min_time: float,
    min_rounds: int = 3,
    max_rounds: int = 200,
    warmup: int = 2,
    block: int = 2,
    clock: Clock = time.perf_counter,
) -> tuple[dict, dict]:
    """Per-call times (seconds) of several providers, measured in rounds: a round runs every
    provider block + 1 times in a row, the first call untimed (it pays for taking over the
    caches from the provider before), and the order rotates from round to round, every other
    cycle of rotations backwards: a provider then runs after each of its two neighbours in the
    rotation equally often (with three, after each other provider), where plain rotations put
    one provider after a slow, cache-sweeping one twice as often as the next. A drift of
    the machine's speed while a case is measured (clock changes, other tenants: this CPU's
    timings wander by 10-20% over minutes) then reaches every provider alike; timing all of one
    provider and then all of the next turned such drift into ratios. Rounds repeat until
    min_time per provider has passed on `clock` (at least min_rounds).

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
    start = clock()
    rounds = 0
    while rounds < max_rounds and (rounds < min_rounds or clock() - start < min_time * len(fns)):
        live = [name for name in fns if name not in errors]
        if not live:
            break
        shift = rounds % len(live)
        order = live[shift:] + live[:shift]
        if (rounds // len(live)) % 2:
            order.reverse()
        for name in order:
            fn = fns[name]

            def one_block(fn=fn):
                fn()
                synchronize(device)
                return [_timed_call(fn, device, clock) for _ in range(block)]

            got = guarded(name, one_block)
            if got is not None:
                times[name] += got
        rounds += 1
    return times, errors


def paired_ratios(times_a: list[float], times_b: list[float], block: int = 2) -> list[float]:
    """Per round of measure_interleaved (`block` timed calls of each provider), a's fastest call
    over b's. Both lists hold the same rounds in order."""
    rounds = min(len(times_a), len(times_b)) // block
    return [
        min(times_a[r * block : (r + 1) * block]) / min(times_b[r * block : (r + 1) * block])
        for r in range(rounds)
    ]


def auto_ratio(auto: list[float], kernel: list[float], torch_kernel: list[float]) -> float:
    """The automatic choice's speed against the faster of fastattn's kernel and torch's: the
    median over rounds of (the faster's time / auto's time), the faster being the one whose
    median paired ratio to the other is below 1. Pairs from one round share the machine's
    state, so drift and bursts of other tenants cancel; on the 2026-11-29 Zen 4 guest, four
    runs of a rotary case gave 0.99-1.01 this way and 0.92-1.23 as a ratio of best-of times."""
    kernel_faster = statistics.median(paired_ratios(kernel, torch_kernel)) <= 1.0
    faster = kernel if kernel_faster else torch_kernel
    return statistics.median(paired_ratios(faster, auto))


def backends_run(fn: Callable[[], object]) -> str:
    """Calls fn once and names the fastattn backends its public ops ran (last_backend), joined
    by "+" when there were several; "" when no fastattn op ran or the call raised (the timing
    loop calls it again and reports the error)."""
    from fastattn import _backend

    before = dict(_backend._state.last)
    _backend._state.last.clear()
    try:
        fn()
        return "+".join(sorted(set(_backend._state.last.values())))
    except Exception:
        return ""
    finally:
        _backend._state.last.update({**before, **_backend._state.last})


def run_case(
    case: Case, device: torch.device, *, min_time: float, clock: Clock = time.perf_counter
) -> list[dict]:
    """Check every provider of a case, then time those that passed, interleaved
    (measure_interleaved); one result row per provider. A judged provider (case.is_judged)
    that fails its check is not timed; a baseline over the tolerance is timed, with a note."""
    rows: dict[str, dict] = {}
    checked = case.check_providers or case.providers
    ref_out = truth = out = None
    if case.check:
        truth = case.ground_truth() if case.ground_truth else None
        ref_out = checked[case.reference]()
    to_time: dict[str, Callable[[], object]] = {}
    for name, fn in case.providers.items():
        row = {
            "op": case.op,
            "case": case.name,
            "provider": name,
            "dtype": case.dtype,
            "judged": case.is_judged(name),
            "inplace": case.is_inplace(name),
            "speed_key": case.speed_key,
            "kernel": case.kernel,
        }
        rows[name] = row
        try:
            if case.check and truth is not None:
                out = ref_out if name == case.reference else checked[name]()
                passed, err, ref_err, worst = flash_rule(
                    case.check, out, ref_out, truth, factor=case.factor, floor=case.tolerance
                )
                row["error"] = err
                if name == case.reference:
                    row["note"] = f"own error {err:.1e} against the ground truth"
                elif not passed:
                    verdict = (
                        f"error {err:.2e} (output {worst}) > {case.factor:g} x "
                        f"{case.reference}'s {ref_err:.2e} + {case.tolerance:.0e}"
                    )
                    if case.is_judged(name):
                        row["status"] = f"FAIL ({verdict})"
                        continue
                    row["note"] = f"baseline, not judged: {verdict}"
                else:
                    row["note"] = f"{case.reference}'s error {ref_err:.1e}"
            elif case.check and name != case.reference:
                err = case.check(checked[name](), ref_out)
                row["error"] = err
                if not err <= case.tolerance:
                    verdict = f"error {err:.2e} > {case.tolerance:.1e}"
                    if case.is_judged(name):
                        row["status"] = f"FAIL ({verdict})"
                        continue
                    row["note"] = f"baseline, not judged: {verdict}"
        except Exception as exc:  # report and go on: one broken provider must not hide the rest
            row["status"] = _error_status(exc)
            continue
        to_time[name] = fn
    del ref_out, truth, out  # the checks' outputs can be large (GPU memory)
    if AUTO in to_time:
        rows[AUTO]["ran"] = backends_run(to_time[AUTO])
    all_times, errors = measure_interleaved(to_time, device, min_time=min_time, clock=clock)
    trio = [AUTO, case.kernel_row or f"fastattn:{case.kernel}", TORCH_BACKEND]
    if all(all_times.get(name) and name not in errors for name in trio):
        # The automatic row is judged against the faster of the other two by paired ratios
        # (auto_ratio): more calls of just those three, interleaved, at least 6 rounds, so that
        # a case whose slow baselines left them a few rounds still has enough pairs (with 3
        # rounds in all, one 92 ms case read 0.95, and 1.00 in each of three reruns).
        extra, extra_errors = measure_interleaved(
            {name: to_time[name] for name in trio},
            device,
            min_time=min_time,
            min_rounds=6,
            clock=clock,
        )
        if not extra_errors:
            pooled = {name: all_times[name] + extra[name] for name in trio}
            rows[AUTO]["auto_ratio"] = auto_ratio(pooled[AUTO], pooled[trio[1]], pooled[trio[2]])
    timed: dict[str, float] = {}
    for name in to_time:
        row = rows[name]
        if name in errors or not all_times[name]:
            row["status"] = errors.get(name, "ERROR: never timed")
            continue
        median, spread = summarize(all_times[name])
        timed[name] = median
        row.update(status="ok", median_ms=median * 1e3, spread=spread, reps=len(all_times[name]))
        if case.bytes:
            row["GB/s"] = case.bytes / median / 1e9
            if "copy_GB/s" in case.notes:
                row["of_copy_bw"] = row["GB/s"] / float(case.notes["copy_GB/s"])
        if case.flops:
            row["TFLOP/s"] = case.flops / median / 1e12
    # like with like: the fastest timed baseline of each kind (in-place or not)
    best_baseline: dict[bool, str] = {}
    for b in case.baselines:
        kind = case.is_inplace(b)
        if b in timed and (kind not in best_baseline or timed[b] < timed[best_baseline[kind]]):
            best_baseline[kind] = b
    for name, row in rows.items():
        against = best_baseline.get(case.is_inplace(name))
        if against is not None and row.get("status") == "ok":
            row["speedup"] = timed[against] / timed[name]
            row["against"] = against
    return list(rows.values())


def format_table(rows: list[dict]) -> str:
    """Plain-text table of result rows."""
    headers = [
        "op",
        "case",
        "dtype",
        "provider",
        "median_ms",
        "spread",
        "GB/s",
        "of_copy_bw",
        "TFLOP/s",
        "speedup",
        "against",
        "status",
        "note",
    ]
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
    return {
        "time": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "device": device_name(device),
        "torch": torch.__version__,
        "triton": triton_version,
        "fastattn": fastattn.__version__,
        "host": platform.node(),
    }


CSV_FIELDS = [
    "time",
    "device",
    "torch",
    "triton",
    "fastattn",
    "host",
    "op",
    "case",
    "dtype",
    "provider",
    "median_ms",
    "spread",
    "reps",
    "ran",
    "auto_ratio",
    "GB/s",
    "of_copy_bw",
    "TFLOP/s",
    "speedup",
    "against",
    "inplace",
    "error",
    "status",
    "note",
    "ceiling_GB/s",
    "ceiling_TFLOP/s",
]


def append_csv(path: Path, rows: list[dict], env: dict[str, str]) -> None:
    """Append rows; a file written with an older column list is rewritten with the current
    one first (old rows keep their values, new columns empty)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    if not new:
        with path.open(newline="") as f:
            header = next(csv.reader(f), [])
        if header != CSV_FIELDS:
            with path.open(newline="") as f:
                old_rows = list(csv.DictReader(f))
            with path.open("w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
                writer.writeheader()
                writer.writerows(old_rows)
    with path.open("a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, extrasaction="ignore")
        if new:
            writer.writeheader()
        for row in rows:
            writer.writerow({**env, **row})


def default_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


AUTO = "fastattn (auto)"  # the automatic choice, speed table included
TORCH_BACKEND = "fastattn:torch"  # torch's kernel through fastattn's torch backend


def own_kernel(provider: str) -> bool:
    """Whether `provider` is one of fastattn's own kernels (not its torch backend, not the
    automatic choice): the rows the kernels' targets are judged on."""
    return provider.startswith("fastattn:") and provider != TORCH_BACKEND


def automatic_kernel(op: str, device: torch.device) -> str | None:
    """The kernel backend fastattn's automatic choice runs for `op` on `device` without a
    speed table (the first of _backend.automatic_order that is available), or None."""
    from fastattn import _backend

    status = _backend.available_backends()
    for backend in _backend.automatic_order(op, device.type):
        if backend != "reference" and status.get(backend) == "available":
            return backend
    return None


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


# Log lines of the profiler's native library (kineto), written straight to file descriptor 2:
# "USDT:2026-11-26 13:47:23 22126:22126 SyncActivityProfilerHandler.cpp:39] profiler_start".
_NATIVE_PROFILER_LOG = re.compile(
    r"^(USDT|INFO|WARNING|ERROR):\d{4}-\d\d-\d\d "
    r"\d\d:\d\d:\d\d \d+:\d+ \w+\.cpp:\d+\] "
)


@contextlib.contextmanager
def without_profiler_logs():
    """Inside, whatever is written to stderr (file descriptor 2: Python and native code alike)
    is held back and written out afterwards, less the profiler library's own log lines
    (_NATIVE_PROFILER_LOG). Everything else (warnings, errors) still reaches stderr."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            kept = [
                line
                for line in held.read().decode(errors="replace").splitlines(True)
                if not _NATIVE_PROFILER_LOG.match(line)
            ]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()
