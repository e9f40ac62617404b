"""PNG plots of one benchmark run (run.py writes them after each run and prints their paths).

    python benchmarks/plot.py results/cpu.csv OUTDIR

Uses the newest run in the CSV (the rows sharing the newest time stamp and its device) and
writes, in OUTDIR:
- summary.png: per op family (in-place rows a family of their own), the median and worst
  speedup of fastattn's best provider per case over the best PyTorch provider of its kind,
  with the 1.0x line;
- <op family>.png: per case, the speedup of every fastattn provider (left) and the throughput
  (TFLOP/s or GB/s) of every provider against the machine's measured ceiling (right: the
  measured matmul TFLOP/s of the dtype, or the measured copy bandwidth; run.py measures both
  and stores them in the rows' ceiling_* columns).
"""

from __future__ import annotations

import csv
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def _float(row: dict, key: str) -> float | None:
    try:
        return float(row[key]) if row.get(key) not in (None, "") else None
    except ValueError:
        return None


def newest_run(csv_path: Path) -> list[dict]:
    with open(csv_path, newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        return []
    newest = max(r["time"] for r in rows)
    device = next(r["device"] for r in rows if r["time"] == newest)
    return [r for r in rows if r["time"] == newest and r["device"] == device]


def _is_fastattn(provider: str) -> bool:
    return provider.startswith("fastattn")


def _file_name(family: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", family.replace("+", "plus")).strip("_") + ".png"


def plot_run(csv_path: Path, out_dir: Path, targets: dict[str, float] | None = None) -> list[Path]:
    """Write the plots of the newest run in csv_path to out_dir; returns their paths.
    targets: op family ("<op> (<dtype>)") -> target speedup, drawn on the summary."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run = newest_run(Path(csv_path))
    ok = [r for r in run if r.get("status") == "ok"]
    if not ok:
        return []
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = ok[0]["device"]
    families: dict[str, list[dict]] = defaultdict(list)
    for r in ok:
        # common.op_family's key (in-place rows a family of their own, as run.py's summary)
        inplace = " in-place" if r.get("inplace") == "True" else ""
        families[f"{r['op']}{inplace} ({r['dtype']})"].append(r)
    paths = []

    headline = {}  # family -> (median, worst) of the best fastattn provider per case
    for family, rows in families.items():
        best: dict[str, float] = {}
        for r in rows:
            speedup = _float(r, "speedup")
            if _is_fastattn(r["provider"]) and speedup is not None:
                best[r["case"]] = max(best.get(r["case"], 0.0), speedup)
        if best:
            headline[family] = (statistics.median(best.values()), min(best.values()))

    if headline:
        names = list(headline)
        fig, ax = plt.subplots(figsize=(8, 0.45 * len(names) + 1.5))
        y = range(len(names))
        ax.barh([i + 0.2 for i in y], [headline[n][0] for n in names], 0.4, label="median")
        ax.barh([i - 0.2 for i in y], [headline[n][1] for n in names], 0.4, label="worst")
        for i, n in enumerate(names):
            if targets and n in targets:
                ax.plot(
                    [targets[n]] * 2,
                    [i - 0.45, i + 0.45],
                    color="red",
                    linewidth=2,
                    label="target"
                    if i == 0 or "target" not in ax.get_legend_handles_labels()[1]
                    else None,
                )
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_yticks(list(y))
        ax.set_yticklabels(names, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("speedup over the best PyTorch provider (fastattn's best provider per case)")
        ax.set_title(f"fastattn on {device}, {ok[0]['time'][:16]}", fontsize=9)
        ax.legend(fontsize=7, loc="lower right")
        fig.tight_layout()
        path = out_dir / "summary.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    for family, rows in families.items():
        cases = list(dict.fromkeys(r["case"] for r in rows))
        providers = list(dict.fromkeys(r["provider"] for r in rows))
        fast = [p for p in providers if _is_fastattn(p)]
        metric = (
            "TFLOP/s"
            if any(_float(r, "TFLOP/s") for r in rows)
            else "GB/s"
            if any(_float(r, "GB/s") for r in rows)
            else None
        )
        value = {(r["case"], r["provider"]): r for r in rows}
        height = max(3.0, 0.35 * len(cases) * max(len(providers), 1) / 2 + 1.5)
        fig, axes = plt.subplots(
            1, 2 if metric else 1, figsize=(13 if metric else 7, height), squeeze=False
        )
        labels = [c if len(c) <= 48 else c[:45] + "..." for c in cases]

        def bars(ax, names, key, cases=cases, value=value, labels=labels):
            width = 0.8 / max(len(names), 1)
            for k, provider in enumerate(names):
                values = [_float(value.get((c, provider), {}), key) or 0.0 for c in cases]
                ax.barh(
                    [i - 0.4 + (k + 0.5) * width for i in range(len(cases))],
                    values,
                    width,
                    label=provider,
                )
            ax.set_yticks(range(len(cases)))
            ax.set_yticklabels(labels, fontsize=6)
            ax.invert_yaxis()
            ax.legend(fontsize=6)

        bars(axes[0][0], fast, "speedup")
        axes[0][0].axvline(1.0, color="black", linewidth=0.8)
        axes[0][0].set_xlabel("speedup over the best PyTorch provider")
        if metric:
            ax = axes[0][1]
            bars(ax, providers, metric)
            ceiling = max((_float(r, f"ceiling_{metric}") or 0.0 for r in rows), default=0.0)
            if ceiling:
                what = "matmul" if metric == "TFLOP/s" else "copy"
                ax.axvline(ceiling, color="red", linewidth=1.2)
                ax.text(
                    ceiling,
                    len(cases) - 0.5,
                    f" measured {what}\n {ceiling:.3g} {metric}",
                    color="red",
                    fontsize=6,
                    va="bottom",
                )
            ax.set_xlabel(metric)
        fig.suptitle(f"{family} on {device}", fontsize=9)
        fig.tight_layout()
        path = out_dir / _file_name(family)
        fig.savefig(path, dpi=100)
        plt.close(fig)
        paths.append(path)
    return paths


def main(csv_path: str, out_dir: str) -> None:
    for path in plot_run(Path(csv_path), Path(out_dir)):
        print(path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
