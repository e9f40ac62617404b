"""Writes a device class's speed table (fastattn/speed_tables/<class>.py, read by
fastattn/speed_table.py) from benchmark rows: `benchmarks/run.py --write-speed-table`.

A case measures an entry when it has a speed key (Case.speed_key), a row of the kernel the
automatic choice runs there (Case.kernel, provider "fastattn:<kernel>") and a row of torch's
kernel through fastattn's torch backend ("fastattn:torch"), both timed and correct. Cases with
the same key (several batch sizes or lengths of one length class) are pooled: the entry's ratio
is the geometric mean of their time ratios (fastattn's kernel / torch's), rounded to three
decimals, and torch is named faster when that is above 1. Entries of the class's existing
table for keys this run did not measure are kept; measured keys are replaced.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import platform
import re
from pathlib import Path

import torch

from fastattn import speed_table

TABLES_DIR = Path(speed_table.__file__).resolve().parent / "speed_tables"


def entries_from_rows(rows: list[dict]) -> list[dict]:
    """The entries the rows measure (see the module docstring), sorted by key."""
    cases: dict[tuple, dict] = {}
    for row in rows:
        if row.get("speed_key") is None or row.get("status") != "ok" or "median_ms" not in row:
            continue
        case = cases.setdefault((row["op"], row["case"], row["dtype"]), {"row": row})
        case[row["provider"]] = row["median_ms"]
    pooled: dict[tuple, dict] = {}
    for case in cases.values():
        row = case["row"]
        kernel, torch_time = case.get(f"fastattn:{row['kernel']}"), case.get("fastattn:torch")
        if kernel is None or torch_time is None:
            continue
        entry = pooled.setdefault((row["speed_key"], row["kernel"]), {"logs": []})
        entry["logs"].append(math.log(kernel / torch_time))
    entries = []
    for (key, kernel), entry in sorted(pooled.items()):
        # decided on the ratio the table stores: 1.0004 is written as 1.0, a tie (the kernel)
        ratio = round(math.exp(sum(entry["logs"]) / len(entry["logs"])), 3)
        entries.append(
            dict(
                key,
                kernel=kernel,
                faster="torch" if ratio > 1.0 else "kernel",
                ratio=ratio,
                cases=len(entry["logs"]),
            )
        )
    return entries


def module_name(cls: dict[str, str]) -> str:
    """A Python module name for a device class, e.g. cpu_authenticamd_avx2_t2_4 or
    cuda_sm90_nvidia_h100_80gb_hbm3."""
    if cls["kind"] == "cuda":
        parts = ["cuda", "sm" + cls["capability"].replace(".", ""), cls["name"]]
    else:
        parts = ["cpu", cls["vendor"], cls["isa"], "t" + cls["threads"]]
    return re.sub(r"[^a-z0-9]+", "_", "_".join(parts).lower()).strip("_")


def render(table: dict) -> str:
    header = (
        f'"""Speed table for {module_name(table["device_class"])}: written by '
        "benchmarks/run.py --write-speed-table\n(benchmarks/speed_table_writer.py); rerun it "
        'to change this file, do not edit it by hand."""\n\n'
    )
    return header + "TABLE = " + json.dumps(table, indent=4) + "\n"


def write(
    device: torch.device | None,
    rows: list[dict],
    *,
    source: str,
    measured: str | None = None,
    cls: dict[str, str] | None = None,
) -> Path:
    """Write (or update) the table of `device`'s class (or of `cls`) from `rows`; returns its
    path."""
    cls = cls or speed_table.device_class(device)
    path = TABLES_DIR / f"{module_name(cls)}.py"
    old = existing_table(path)
    entries = {}
    for entry in old.get("entries", []):
        entry.setdefault("source", old.get("source", "unknown"))  # tables written before
        entries[speed_key(entry)] = entry
    for entry in entries_from_rows(rows):
        entries[speed_key(entry)] = {**entry, "source": source}
    if measured is None:
        today = _dt.date.today().isoformat()
        measured = f"{today}, {platform.node()} ({cls_summary(cls)})"
    table = {
        "device_class": cls,
        "measured": measured,
        # every run whose entries the table still holds (each entry names its own)
        "source": "; ".join(sorted({e["source"] for e in entries.values()})),
        "entries": [entries[k] for k in sorted(entries)],
    }
    path.write_text(render(table))
    speed_table.reset()
    return path


def speed_key(entry: dict) -> tuple:
    return tuple(str(entry[f]) for f in speed_table.KEY_FIELDS) + (entry["kernel"],)


def cls_summary(cls: dict[str, str]) -> str:
    return ", ".join(f"{k} {v}" for k, v in cls.items() if k != "kind")


def existing_table(path: Path) -> dict:
    if not path.exists():
        return {}
    scope: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), scope)
    return dict(scope.get("TABLE", {}))


def attention_rows_from_csv(path: Path, kernel: str, torch_providers: tuple[str, ...]) -> list:
    """Rows with speed keys from an attention benchmark CSV written before the torch backend
    existed (the first GPU run's): each case's key from its name ("b=.. s=.. h=.. d=..
    [causal]"), fastattn's `kernel` row, and as torch's time the slowest of `torch_providers`
    (SDPA picks one of them itself: the entry then holds whichever it picks)."""
    import csv

    from fastattn.ops.attention import attention_speed_key

    cases: dict[tuple, dict] = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if not row["op"].startswith("attention") or row["status"] != "ok":
                continue
            cases.setdefault((row["op"], row["case"], row["dtype"]), {})[row["provider"]] = float(
                row["median_ms"]
            )
    rows = []
    for (op, name, dtype), times in cases.items():
        if f"fastattn:{kernel}" not in times or not all(p in times for p in torch_providers):
            continue
        fields = dict(part.split("=") for part in name.split() if "=" in part)
        causal = name.endswith("causal")
        L, D = int(fields["s"]), int(fields["d"])
        grad = op.endswith("fwd+bwd")
        meta = [
            torch.empty(1, 1, L, D, dtype=getattr(torch, dtype), device="meta").requires_grad_(grad)
            for _ in range(3)
        ]
        key = attention_speed_key(*meta, None, None, -(2**30), 0 if causal else 2**30)
        base = {"op": op, "case": name, "dtype": dtype, "status": "ok", "speed_key": key}
        base["kernel"] = kernel
        rows.append(
            dict(base, provider=f"fastattn:{kernel}", median_ms=times[f"fastattn:{kernel}"])
        )
        slowest = max(times[p] for p in torch_providers)
        rows.append(dict(base, provider="fastattn:torch", median_ms=slowest))
    return rows
