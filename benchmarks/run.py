"""fastattn benchmark suite (the CLI behind `make bench`).

    python benchmarks/run.py [--ops positional,attention] [--profile quick|full]
                             [--device auto|cpu|cuda] [--csv PATH] [--min-time S] [--no-plots]

Runs each op's cases (benchmarks/bench_<op>.py), checks every provider's output against the
reference provider (or a higher-precision ground truth) before timing it, prints a table
(median, spread, throughput, speedup over the best PyTorch provider of the same kind: in-place
over in-place, out-of-place over out-of-place; see common.py) and appends the rows, with
device, versions and time, to a CSV (default benchmarks/results/<device kind>.csv). Shows
progress per case, ends with a summary of the headline speedups per op family against their
targets, and writes PNG plots of the run beside the CSV (benchmarks/plot.py). Exits non-zero
when a fastattn provider fails its correctness check or errors (a PyTorch baseline's own error
is shown in the table's note column and is not a failure).

Run from a source checkout built in place (`tools/build_inplace.sh`, `make build`), it imports
that checkout's fastattn when no installed one is importable.
"""

from __future__ import annotations

import argparse
import collections
import importlib
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
if importlib.util.find_spec("fastattn") is None:
    # `python benchmarks/run.py` from a checkout that is not pip-installed: sys.path[0] is
    # benchmarks/, not the repository root, so the checkout's package would not be found.
    sys.path.insert(1, str(HERE.parent))

import common  # noqa: E402

OPS = (
    "positional",
    "attention",
    "biased_attention",
    "lstm",
    "gru",
    "rnn",
    "models",
    "varlen",
    "decoding",
    "additive_attention",
    "sinks",
)


def available_ops() -> list[str]:
    return [op for op in OPS if (HERE / f"bench_{op}.py").exists()]


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(int(seconds), 60)
    return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


class Progress:
    """What is running, how many cases are left, elapsed time: a bar redrawn on one line where
    a terminal is attached (stderr), else one plain line per case (CI logs)."""

    def __init__(self, n_ops: int, stream=None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.n_ops = n_ops
        self.start = time.perf_counter()
        self.drawn = False

    def case(self, op_index: int, op: str, index: int, count: int, label: str) -> None:
        elapsed = _duration(time.perf_counter() - self.start)
        head = f"[op {op_index}/{self.n_ops} {op}] case {index}/{count}"
        if self.tty:
            width = 20
            filled = width * (index - 1) // max(count, 1)
            line = f"{head} [{'#' * filled}{'.' * (width - filled)}] {elapsed} {label}"
            self.stream.write("\r\033[K" + line[:160])
            self.drawn = True
        else:
            self.stream.write(
                f"{head}, {count - index + 1} left in this op, {elapsed} elapsed: {label}\n"
            )
        self.stream.flush()

    def clear(self) -> None:
        """Before printing results: remove the bar."""
        if self.tty and self.drawn:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self.drawn = False

    def elapsed(self) -> str:
        return _duration(time.perf_counter() - self.start)


def summary_table(results: list[tuple[object, list[dict]]]) -> str:
    """One line per op family (common.op_family: the row's op and dtype, in-place rows a family
    of their own): median and worst speedup of fastattn's best own kernel per case (its torch
    backend and automatic choice are not kernels of its own: auto_summary) over the best
    PyTorch provider of its kind (the rows' speedups: in-place over in-place, out-of-place over
    out-of-place), the family's target (the bench module's target(op), default 1.0: at least
    as fast as the best PyTorch provider) and whether every case meets it."""
    families: dict[str, dict] = {}
    for module, rows in results:
        by_case: dict[tuple, list[dict]] = {}
        for r in rows:
            if r.get("judged") and common.own_kernel(r["provider"]) and "speedup" in r:
                by_case.setdefault((common.op_family(r), r["op"], r["case"]), []).append(r)
        for (name, op, _), case_rows in by_case.items():
            best = max(case_rows, key=lambda r: r["speedup"])
            family = families.setdefault(
                name,
                {
                    "speedups": [],
                    "providers": set(),
                    "target": module.target(op) if hasattr(module, "target") else 1.0,
                },
            )
            family["speedups"].append(best["speedup"])
            family["providers"].add(best["provider"])
    if not families:
        return "no fastattn provider was timed"
    table = [["op family", "cases", "median", "worst", "target", "met", "best provider(s)"]]
    for name, f in families.items():
        speedups = f["speedups"]
        worst = min(speedups)
        table.append(
            [
                name,
                str(len(speedups)),
                f"{statistics.median(speedups):.2f}x",
                f"{worst:.2f}x",
                f">= {f['target']:.2f}x",
                "yes" if worst >= f["target"] else "no",
                ", ".join(sorted(f["providers"])),
            ]
        )
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in table]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


AUTO_TARGET = 0.97  # fastattn (auto) against the faster of fastattn's kernel and torch's


def auto_summary(results: list[tuple[object, list[dict]]]) -> str:
    """One line per op family with a `fastattn (auto)` row: the worst, over its cases, of the
    automatic choice's speed against the faster of fastattn's kernel (the one the automatic
    choice would run) and torch's kernel through fastattn's torch backend, against
    AUTO_TARGET, and which backend the automatic choice ran.

    The speed is the auto row's auto_ratio (common.auto_ratio: paired per-round ratios). The
    automatic row runs one of the other two rows' kernels plus a table lookup, so what it is
    judged on is the lookup's cost and the choice; a ratio of medians or of best-of times from
    one noisy run moves by more than the 3% the target allows."""
    families: dict[str, list[tuple[float, str]]] = {}
    for _, rows in results:
        for r in rows:
            if r["provider"] == common.AUTO and r.get("auto_ratio") is not None:
                family = families.setdefault(common.op_family(r), [])
                family.append((r["auto_ratio"], r.get("ran") or "?"))
    if not families:
        return "no fastattn (auto) row beside a kernel and a torch-backend row"
    lines = []
    for family, cases in families.items():
        ratios = [ratio for ratio, _ in cases]
        worst = min(ratios)
        counts = collections.Counter(ran for _, ran in cases)
        ran_text = ", ".join(f"{b} {n}" for b, n in sorted(counts.items()))
        lines.append(
            f"{family}: fastattn (auto) at {statistics.median(ratios):.2f}x (worst "
            f"{worst:.2f}x) the faster of fastattn's kernel and torch's (paired rounds) over "
            f"{len(ratios)} cases (it ran: {ran_text}); target >= {AUTO_TARGET:.2f}x: "
            f"{'met' if worst >= AUTO_TARGET else 'not met'}"
        )
    return "\n".join(lines)


def family_targets(results: list[tuple[object, list[dict]]]) -> dict[str, float]:
    """op family (common.op_family) -> target speedup (the bench module's target(op), else 1)."""
    return {
        common.op_family(r): module.target(r["op"]) if hasattr(module, "target") else 1.0
        for module, rows in results
        for r in rows
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--ops",
        default="all",
        help=f"comma-separated subset of {','.join(available_ops())} (default all)",
    )
    parser.add_argument("--profile", choices=("quick", "full"), default="quick")
    parser.add_argument("--device", default="auto", help="auto (cuda if present), cpu or cuda")
    parser.add_argument("--csv", type=Path, default=None)
    parser.add_argument(
        "--min-time",
        type=float,
        default=None,
        help="seconds of timing per provider (default 0.3 quick, 1.0 full)",
    )
    parser.add_argument(
        "--plots",
        type=Path,
        default=None,
        help="folder for the PNG plots (default: the CSV's folder, in a "
        "<device kind>_plots subfolder)",
    )
    parser.add_argument("--no-plots", action="store_true", help="write no plots")
    parser.add_argument(
        "--write-speed-table",
        action="store_true",
        help="write this device class's speed table (fastattn/speed_tables/) from the run's "
        "kernel and torch-backend rows",
    )
    parser.add_argument(
        "--triton-winners",
        type=Path,
        default=None,
        help="write the Triton attention autotuner's choices of this run here (JSON)",
    )
    args = parser.parse_args(argv)

    device = common.default_device() if args.device == "auto" else torch.device(args.device)
    ops = available_ops() if args.ops == "all" else args.ops.split(",")
    unknown = [op for op in ops if op not in available_ops()]
    if unknown:
        parser.error(f"unknown ops {unknown}; available: {available_ops()}")
    min_time = args.min_time or (0.3 if args.profile == "quick" else 1.0)
    csv_path = args.csv or common.RESULTS_DIR / f"{device.type}.csv"
    env = common.environment(device)
    import fastattn

    print(
        f"fastattn benchmarks: {env['device']}, torch {env['torch']}, triton {env['triton']}, "
        f"profile {args.profile}, fastattn from {Path(fastattn.__file__).parent}",
        flush=True,
    )
    ceilings = common.machine_ceilings(device)
    if device.type == "cpu":
        print(
            f"measured float32 FMA peak: {ceilings['fma_peak_TFLOP/s'] * 1e3:.1f} GFLOP/s "
            f"({torch.get_num_threads()} threads); matmul {ceilings['float32_TFLOP/s'] * 1e3:.1f}",
            flush=True,
        )
    progress = Progress(len(ops))
    failures: list[str] = []
    baseline_errors: list[str] = []
    results = []
    for op_index, op in enumerate(ops, 1):
        module = importlib.import_module(f"bench_{op}")
        cases = module.cases(args.profile, device)
        rows = []
        for index, case in enumerate(cases, 1):
            progress.case(op_index, op, index, len(cases), f"{case.op} {case.name}")
            rows += common.run_case(case, device, min_time=min_time)
        progress.clear()
        print()
        print(common.format_table(rows), flush=True)
        if hasattr(module, "summary"):
            for line in module.summary(rows):
                print(line)
        for r in rows:
            r["ceiling_GB/s"] = ceilings["copy_GB/s"]
            r["ceiling_TFLOP/s"] = ceilings.get(f"{r['dtype']}_TFLOP/s", "")
        common.append_csv(csv_path, rows, env)
        results.append((module, rows))
        for r in rows:
            if r.get("status", "").startswith(("FAIL", "ERROR")):
                entry = f"{r['op']} {r['case']} {r['dtype']} {r['provider']}: {r['status']}"
                (failures if r.get("judged") else baseline_errors).append(entry)
    print(
        f"\nsummary ({progress.elapsed()}): fastattn's best provider per case against the "
        "best PyTorch provider of its kind (in-place rows against in-place ones)"
    )
    print(summary_table(results))
    print("\nthe automatic choice (speed table included):")
    print(auto_summary(results))
    print(f"\nrows appended to {csv_path}")
    if args.triton_winners:
        from fastattn.triton import attention_tuning

        chosen = attention_tuning.winners()
        args.triton_winners.write_text(json.dumps(chosen, indent=1) + "\n")
        print(f"{len(chosen)} Triton autotuning choices written to {args.triton_winners}")
    if args.write_speed_table:
        import speed_table_writer

        path = speed_table_writer.write(
            device,
            [r for _, rows in results for r in rows],
            source=str(csv_path),
            measured=f"{time.strftime('%Y-%m-%d')}, {env['device']}, torch {env['torch']}",
        )
        print(f"speed table written: {path}")
    if not args.no_plots:
        import plot

        plot_dir = args.plots or csv_path.parent / f"{device.type}_plots"
        try:
            paths = plot.plot_run(csv_path, plot_dir, targets=family_targets(results))
        except ImportError as exc:
            print(f"no plots: {exc} (pip install matplotlib)", file=sys.stderr)
        else:
            print(f"plots ({len(paths)}) in {plot_dir}:")
            for path in paths:
                print(f"  {path}")
    if baseline_errors:
        print(
            f"{len(baseline_errors)} PyTorch baseline provider(s) errored (not counted as "
            "failures):\n  " + "\n  ".join(baseline_errors),
            file=sys.stderr,
        )
    if failures:
        print(
            f"{len(failures)} fastattn provider(s) failed their correctness check or "
            "errored:\n  " + "\n  ".join(failures),
            file=sys.stderr,
        )
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
