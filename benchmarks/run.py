"""fastattn benchmark suite (the CLI behind `make bench`).

    python benchmarks/run.py [--ops positional,attention] [--profile quick|full]
                             [--device auto|cpu|cuda] [--csv PATH] [--min-time S]

Runs each op's cases (benchmarks/bench_<op>.py), checks every provider's output against the
reference provider before timing it, prints a table (median, spread, throughput, speedup over
the best PyTorch provider) and appends the rows, with device, versions and time, to a CSV
(default benchmarks/results/<device kind>.csv). Exits non-zero when a correctness check fails.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402

OPS = ("positional", "attention", "lstm", "models", "varlen", "decoding", "additive_attention")


def available_ops() -> list[str]:
    here = Path(__file__).resolve().parent
    return [op for op in OPS if (here / f"bench_{op}.py").exists()]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", default="all",
                        help=f"comma-separated subset of {','.join(available_ops())} (default all)")
    parser.add_argument("--profile", choices=("quick", "full"), default="quick")
    parser.add_argument("--device", default="auto", help="auto (cuda if present), cpu or cuda")
    parser.add_argument("--csv", type=Path, default=None)
    parser.add_argument("--min-time", type=float, default=None,
                        help="seconds of timing per provider (default 0.3 quick, 1.0 full)")
    args = parser.parse_args(argv)

    device = common.default_device() if args.device == "auto" else torch.device(args.device)
    ops = available_ops() if args.ops == "all" else args.ops.split(",")
    unknown = [op for op in ops if op not in available_ops()]
    if unknown:
        parser.error(f"unknown ops {unknown}; available: {available_ops()}")
    min_time = args.min_time or (0.3 if args.profile == "quick" else 1.0)
    csv_path = args.csv or common.RESULTS_DIR / f"{device.type}.csv"
    env = common.environment(device)
    print(f"fastattn benchmarks: {env['device']}, torch {env['torch']}, triton {env['triton']}, "
          f"profile {args.profile}")
    failures = 0
    for op in ops:
        module = importlib.import_module(f"bench_{op}")
        rows = []
        for case in module.cases(args.profile, device):
            rows += common.run_case(case, device, min_time=min_time)
        print()
        print(common.format_table(rows), flush=True)
        if hasattr(module, "summary"):
            for line in module.summary(rows):
                print(line)
        common.append_csv(csv_path, rows, env)
        failures += sum(1 for r in rows if r.get("status", "").startswith(("FAIL", "ERROR")))
    print(f"\nrows appended to {csv_path}")
    if failures:
        print(f"{failures} provider(s) failed their correctness check or errored", file=sys.stderr)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
