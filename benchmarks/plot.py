"""Plot benchmark CSV rows: one bar chart per op, throughput per provider and case.

    python benchmarks/plot.py results/cpu.csv OUTDIR
Uses the newest run (rows with the newest time stamp of each device) in the CSV.
"""
from __future__ import annotations

import csv
import sys
from collections import defaultdict
from pathlib import Path


def main(csv_path: str, out_dir: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(csv.DictReader(open(csv_path)))
    if not rows:
        return
    newest = max(r["time"] for r in rows)
    # A run spans a few minutes of time stamps: keep rows of the newest run's date and device.
    device = next(r["device"] for r in rows if r["time"] == newest)
    run = [r for r in rows if r["device"] == device and r["time"][:13] == newest[:13]]
    by_op: dict[str, list[dict]] = defaultdict(list)
    for r in run:
        if r.get("status") == "ok":
            by_op[r["op"]].append(r)
    for op, op_rows in by_op.items():
        metric = "TFLOP/s" if any(r.get("TFLOP/s") for r in op_rows) else "GB/s"
        cases = sorted({(r["case"], r["dtype"]) for r in op_rows})
        providers = sorted({r["provider"] for r in op_rows})
        fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(cases) * len(providers) / 2), 4))
        width = 0.8 / max(len(providers), 1)
        for k, provider in enumerate(providers):
            values = []
            for case in cases:
                match = [r for r in op_rows if (r["case"], r["dtype"]) == case and r["provider"] == provider]
                values.append(float(match[-1][metric]) if match and match[-1].get(metric) else 0.0)
            ax.bar([i + k * width for i in range(len(cases))], values, width, label=provider)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cases))])
        ax.set_xticklabels([f"{c}\n{d}" for c, d in cases], fontsize=7)
        ax.set_ylabel(metric)
        ax.set_title(f"{op} on {device}")
        ax.legend(fontsize=7)
        fig.tight_layout()
        name = op.replace(" ", "_").replace("+", "plus").replace("/", "_")
        fig.savefig(Path(out_dir) / f"{name}.png", dpi=110)
        plt.close(fig)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
