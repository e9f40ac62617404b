"""The speed table: for a class of device, which implementation of an op was measured faster
for a call's key, fastattn's kernel or torch's own (the "torch" backend), and by how much.

The automatic backend choice (fastattn/_backend.py: select_backend) asks `faster` with the
call's key; it takes torch's kernel only where a measurement says torch's is faster. Tables
live in fastattn/speed_tables/ (one module per measured device class, `TABLE`, written by
`benchmarks/run.py --write-speed-table` from a benchmark run) and are read once, at the first
lookup.

A device class:
- CPU: {"kind": "cpu", "vendor": "AuthenticAMD" | "GenuineIntel" | ..., "isa": the CPU kernels'
  ISA copy that runs (fastattn.build_info()["cpu_isa"]: base, avx2, avx512, avx512bf16),
  "threads": a class of torch.get_num_threads() ("1", "2-4", "5-16", "17+")}.
- CUDA: {"kind": "cuda", "capability": "9.0", "name": "NVIDIA H100 80GB HBM3"}.
The table for a device is its exact class's; else the nearest measured class of the same kind
(CPU: the same ISA copy, preferring the same vendor, then the nearest thread class; CUDA: the
same compute capability, else the same major version); else none, and fastattn's kernels run.

A key (`key`): the op, the dtype, a head-dim (or hidden-size) class and a length class
(classes of the largest dimension, so that a lookup depends on no exact size), the feature set
(op-specific words, in a fixed order, e.g. "causal+padding"), and whether a gradient is needed
("fwd" or "fwd+bwd"). An entry matches a key field by field. Keys are computed from static
properties (shapes, dtypes, flags), never tensor values: the lookup costs no host
synchronization, and under torch.compile it is evaluated while tracing (sizes become guards
on their class).
"""

from __future__ import annotations

import importlib
import pkgutil
import platform

import torch

# Head dims (attention) or hidden sizes (recurrent layers): <=64, <=128, ..., <=1024, >1024.
HEAD_DIM_CLASSES = (64, 128, 256, 512, 1024)
LENGTH_CLASSES = (256, 1024, 4096)  # <=256, <=1024, <=4096, >4096
THREAD_CLASSES = ((1, "1"), (4, "2-4"), (16, "5-16"))  # else "17+"
KEY_FIELDS = ("op", "dtype", "head_dim", "length", "features", "pass")


def head_dim_class(d: int) -> str:
    for bound in HEAD_DIM_CLASSES:
        if d <= bound:
            return f"<={bound}"
    return f">{HEAD_DIM_CLASSES[-1]}"


def length_class(n: int) -> str:
    for bound in LENGTH_CLASSES:
        if n <= bound:
            return f"<={bound}"
    return f">{LENGTH_CLASSES[-1]}"


def thread_class(threads: int) -> str:
    for bound, name in THREAD_CLASSES:
        if threads <= bound:
            return name
    return "17+"


def key(
    op: str,
    dtype: torch.dtype,
    *,
    length: int,
    head_dim: int | None = None,
    features: tuple[str, ...] = (),
    grad: bool = False,
) -> tuple[tuple[str, str], ...]:
    """A call's key: op, dtype name, head-dim class ("-" for ops without heads), length class
    (of the longest sequence dimension), features joined with "+" in sorted order ("plain"
    when none) and the pass ("fwd" or "fwd+bwd"). A tuple of (field, value) pairs, hashable
    and constant under torch.compile."""
    return (
        ("op", op),
        ("dtype", str(dtype).removeprefix("torch.")),
        ("head_dim", "-" if head_dim is None else head_dim_class(head_dim)),
        ("length", length_class(length)),
        ("features", "+".join(sorted(features)) or "plain"),
        ("pass", "fwd+bwd" if grad else "fwd"),
    )


# ---------------------------------------------------------------------------------------------
# Device classes


def cpuinfo_field(name: str) -> str | None:
    """The first `name` field of /proc/cpuinfo ("vendor_id", "model name"), or None."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":", 1)[0].strip() == name:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def _cpu_vendor() -> str:
    return cpuinfo_field("vendor_id") or platform.processor() or platform.machine() or "unknown"


def device_class(device: torch.device) -> dict[str, str]:
    """The class of `device` the tables are keyed by (see the module docstring)."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        major, minor = torch.cuda.get_device_capability(index)
        return {
            "kind": "cuda",
            "capability": f"{major}.{minor}",
            "name": torch.cuda.get_device_name(index),
        }
    from . import _native

    isa = "none"
    if _native.C is not None:
        isa = str(_native.C.build_info().get("cpu_isa", "none"))
    return {
        "kind": "cpu",
        "vendor": _cpu_vendor(),
        "isa": isa,
        "threads": thread_class(torch.get_num_threads()),
    }


# ---------------------------------------------------------------------------------------------
# Tables

_tables: list[dict] | None = None


def tables() -> list[dict]:
    """Every shipped table (fastattn/speed_tables/*.py, TABLE), read once."""
    global _tables
    if _tables is None:
        from . import speed_tables

        found = []
        for info in sorted(pkgutil.iter_modules(speed_tables.__path__), key=lambda m: m.name):
            module = importlib.import_module(f"{speed_tables.__name__}.{info.name}")
            table = getattr(module, "TABLE", None)
            if table is not None:
                found.append(dict(table, module=info.name))
        _tables = found
    return _tables


def _thread_distance(a: str, b: str) -> int:
    order = [name for _, name in THREAD_CLASSES] + ["17+"]
    return abs(order.index(a) - order.index(b)) if a in order and b in order else len(order)


def table_for(cls: dict[str, str]) -> tuple[dict | None, str]:
    """(the table for device class `cls`, how it was found: "exact", "nearest" or "none")."""
    same_kind = [t for t in tables() if t["device_class"].get("kind") == cls["kind"]]
    for table in same_kind:
        if table["device_class"] == cls:
            return table, "exact"
    if cls["kind"] == "cpu":
        candidates = [t for t in same_kind if t["device_class"].get("isa") == cls["isa"]]
        candidates.sort(
            key=lambda t: (
                t["device_class"].get("vendor") != cls["vendor"],
                _thread_distance(t["device_class"].get("threads", ""), cls["threads"]),
                t["module"],
            )
        )
    else:
        capability = cls["capability"]
        major = capability.split(".")[0]
        caps = [t["device_class"].get("capability", "") for t in same_kind]
        candidates = [t for t, c in zip(same_kind, caps) if c == capability]
        candidates += [
            t for t, c in zip(same_kind, caps) if c != capability and c.split(".")[0] == major
        ]
    if candidates:
        return candidates[0], "nearest"
    return None, "none"


def _entry_key(entry: dict) -> tuple[tuple[str, str], ...]:
    return tuple((field, str(entry[field])) for field in KEY_FIELDS)


_verdicts: dict[tuple, str] = {}


# Evaluated eagerly while torch.compile traces (the device query and the table modules are not
# traceable); its arguments are constants (strings, the device index), so is its result.
@torch.compiler.assume_constant_result
def _verdict(device_type: str, device_index: int, call_key: tuple, kernel: str) -> str:
    cache_key = (device_type, device_index, call_key, kernel)
    if cache_key not in _verdicts:
        if device_index >= 0:
            device = torch.device(device_type, device_index)
        else:
            device = torch.device(device_type)
        table, _ = table_for(device_class(device))
        verdict = kernel
        if table is not None:
            for entry in table["entries"]:
                if _entry_key(entry) == call_key and entry.get("kernel", kernel) == kernel:
                    verdict = "torch" if entry["faster"] == "torch" else kernel
                    break
        _verdicts[cache_key] = verdict
    return _verdicts[cache_key]


def faster(device: torch.device, call_key: tuple, kernel: str) -> str:
    """ "torch" when the table for `device`'s class measured torch's kernel faster than
    fastattn's `kernel` backend for `call_key` (from `key`, which names the op), else
    `kernel`."""
    index = -1 if device.index is None else int(device.index)
    return _verdict(device.type, index, call_key, kernel)


def reset() -> None:
    """Forget the tables and verdicts read so far (tests install synthetic tables)."""
    from . import _backend

    global _tables
    _tables = None
    _verdicts.clear()
    _backend.forget_automatic_choices()


def describe(device: torch.device) -> str:
    """One line for `python -m fastattn`: which table applies to `device` and where it came
    from."""
    from . import _backend

    if _backend.AUTO_MODE == "kernels":
        return "off (FASTATTN_AUTO=kernels): fastattn's kernels always"
    cls = device_class(device)
    table, how = table_for(cls)
    shown = ", ".join(f"{k}={v}" for k, v in cls.items() if k != "kind")
    if table is None:
        return f"none for {cls['kind']} ({shown}): fastattn's kernels"
    torch_wins = sum(1 for e in table["entries"] if e["faster"] == "torch")
    return (
        f"{table['module']} ({how} match for {shown}; {len(table['entries'])} keys, torch "
        f"faster in {torch_wins}; measured {table.get('measured', '?')}, from "
        f"{table.get('source', '?')})"
    )
