"""The performance summary plot of the README and the docs (docs/_static/performance.png).

    python benchmarks/plot_summary.py [OUT_PNG]

Draws, from the committed benchmark results, one panel per machine: per op family, the
speedup of fastattn's own kernels over the fastest PyTorch provider of the same case (the
`speedup` column that benchmarks/run.py wrote), the median over the family's cases as a bar
and the slowest and fastest case as a line. Torch's kernels run through fastattn (the
`fastattn:torch` and `fastattn (auto)` rows) and in-place rows are left out: the plot shows how
fastattn's kernels compare, not what the automatic choice makes of them. Machines and runs:

- NVIDIA H100 80GB HBM3, 2026-11-26 (benchmarks/results/gpu-h100-2026-11-26/gpu.csv);
- AMD EPYC Zen 5 (AVX-512, AVX512-BF16), 2 threads, 2026-11-27 (benchmarks/results/cpu.csv,
  the rows of that day; per case its newest row);
- AMD EPYC Zen 3 (AVX2), 2 threads, 2026-12-07 (benchmarks/results/cpu-zen3-avx2-2026-12-07/,
  the whole quick profile with every float kernel on the vector type);
- AMD EPYC Zen 4 (AVX-512, AVX512-BF16), 2 threads, 2026-11-29
  (benchmarks/results/cpu-zen4-avx512bf16-2026-11-29-vec/: attention, the recurrent layers and
  the models, after the AVX-512 kernels moved onto the vector type).
"""

from __future__ import annotations

import csv
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
OUT = ROOT / "docs" / "_static" / "performance.png"

# (panel title, CSV files, the day whose rows count)
MACHINES = (
    (
        "NVIDIA H100 80GB HBM3, 2026-11-26",
        [RESULTS / "gpu-h100-2026-11-26" / "gpu.csv"],
        "2026-11-26",
    ),
    (
        "AMD EPYC Zen 5 (AVX-512), 2 threads, 2026-11-27",
        [RESULTS / "cpu.csv"],
        "2026-11-27",
    ),
    (
        "AMD EPYC Zen 3 (AVX2), 2 threads, 2026-12-07",
        [RESULTS / "cpu-zen3-avx2-2026-12-07" / "bench.csv"],
        "2026-12-07",
    ),
    (
        "AMD EPYC Zen 4 (AVX-512), 2 threads, 2026-11-29",
        [RESULTS / "cpu-zen4-avx512bf16-2026-11-29-vec" / "bench.csv"],
        "2026-11-29",
    ),
)

# op -> family shown on the plot (ops not listed are left out)
FAMILIES = {
    "attention fwd": "attention fwd",
    "attention fwd+bwd": "attention fwd+bwd",
    "varlen fwd": "attention fwd",
    "sinks fwd": "attention fwd",
    "sinks fwd+bwd": "attention fwd+bwd",
    "biased attention fwd+bwd": "attention fwd+bwd",
    "decoding": "decoding (KV cache)",
    "decoding paged": "decoding (KV cache)",
    "additive_attention": "additive attention",
    "additive_attention fwd+bwd": "additive attention",
    "lstm fwd": "LSTM fwd",
    "lstm fwd+bwd": "LSTM fwd+bwd",
    "gru fwd": "GRU fwd",
    "gru fwd+bwd": "GRU fwd+bwd",
    "rnn fwd": "RNN fwd",
    "rnn fwd+bwd": "RNN fwd+bwd",
    "add_sinusoidal": "positional encodings",
    "embed_with_positions": "positional encodings",
    "apply_rotary": "positional encodings",
    "model transformer train step": "models (swapped)",
    "model gpt train step": "models (swapped)",
    "model transformer eval fwd": "models (swapped)",
    "model tagger train step": "models (swapped)",
    "model seq2seq train step": "models (swapped)",
}
ORDER = list(dict.fromkeys(FAMILIES.values()))


def is_fastattn_kernel(row: dict) -> bool:
    """A row of fastattn's own kernels (not torch's run through fastattn, not in place)."""
    provider = row["provider"]
    if not provider.startswith("fastattn"):
        return False
    if provider in ("fastattn:torch", "fastattn (auto)") or "inplace" in provider:
        return False
    return row.get("inplace", "False") != "True" and row.get("status") == "ok"


def speedups(files: list[Path], day: str) -> dict[str, list[float]]:
    """Family -> the speedup of fastattn's best kernel per case (the newest row per case)."""
    newest: dict[tuple[str, str, str, str], dict] = {}
    for path in files:
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                if not row["time"].startswith(day) or row["op"] not in FAMILIES:
                    continue
                if not is_fastattn_kernel(row) or not row.get("speedup"):
                    continue
                key = (row["op"], row["case"], row["dtype"], row["provider"])
                if key not in newest or row["time"] > newest[key]["time"]:
                    newest[key] = row
    best: dict[tuple[str, str, str], float] = {}
    for (op, case, dtype, _), row in newest.items():
        value = float(row["speedup"])
        best[(op, case, dtype)] = max(best.get((op, case, dtype), 0.0), value)
    families: dict[str, list[float]] = {}
    for (op, _, _), value in best.items():
        families.setdefault(FAMILIES[op], []).append(value)
    return families


def plot(out: Path = OUT) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(title, speedups(files, day)) for title, files, day in MACHINES]
    fig, axes = plt.subplots(1, len(panels), figsize=(15, 4.6), sharey=True)
    y = list(range(len(ORDER)))
    for ax, (title, families) in zip(axes, panels):
        for i, family in enumerate(ORDER):
            values = families.get(family)
            if not values:
                ax.text(1.0, i, " not measured", va="center", fontsize=7, color="gray")
                continue
            median = statistics.median(values)
            ax.barh(i, median, 0.6, left=0, color="tab:green" if median >= 1 else "tab:red")
            ax.plot([min(values), max(values)], [i, i], color="black", linewidth=1.2)
            ax.text(max(values) * 1.08, i, f"{median:.2f}x", va="center", fontsize=7)
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.set_xscale("log")
        ax.set_xlim(0.02, 40)
        ticks = [0.03, 0.1, 0.3, 1, 3, 10, 30]
        ax.set_xticks(ticks)
        ax.set_xticklabels([f"{t:g}x" for t in ticks])
        ax.minorticks_off()
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("speedup over the fastest PyTorch provider (log)", fontsize=8)
        ax.tick_params(labelsize=8)
    axes[0].set_yticks(y)
    axes[0].set_yticklabels(ORDER)
    axes[0].invert_yaxis()
    fig.suptitle(
        "fastattn's kernels against PyTorch: bar = median case, line = slowest to fastest "
        "case; below 1 is slower than torch",
        fontsize=9,
    )
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


if __name__ == "__main__":
    print(plot(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT))
