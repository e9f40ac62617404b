"""What the CUDA kernels compile to, read offline from the build, and a ratchet on it.

GPU time is scarce; the SASS of the sm_80 and sm_90 builds predicts much of a kernel's speed and
can be read on any machine. For every attention, recurrent and positional kernel in
fastattn/_C_cuda.so (FAMILIES: attention kernels by their own names, the others prefixed with
"recurrent." or "positional.") this reports, per arch: registers, stack bytes and local-memory
instructions (spills), shared memory per block, blocks per SM (the least of the register,
shared-memory and thread limits) and, for its main loop (the backward branch's body with the
most tensor-core instructions), the counts of HMMA, HGMMA, LDSM, LDGSTS, TMA copies (UTMALDG,
UBLKCP), BAR, MUFU.EX2, out-of-line CALLs, local-memory instructions (LDL/STL) and
floating-point instructions, and floating-point instructions per score a thread computes in one
trip (attention tensor-core kernels).

    python tools/kernel_report.py                   # the table
    python tools/kernel_report.py --check           # and fail on a regression from the baseline
    python tools/kernel_report.py --write-baseline  # accept the build as the new baseline
    python tools/kernel_report.py --triton [--check | --write-baseline]

--triton reports the Triton attention kernels instead (TRITON_CALLS: every autotune config of
the forward, dQ and dK/dV kernels for bfloat16 at head dims 64 and 128), compiled for sm_90
without a GPU by tests/triton_aot.py, in the same rows plus whether Triton specialized warps;
whether a tl.dot lowered to wgmma is the HGMMA column, TMA loads the TMA column. Its baseline
(tools/kernel_report_triton_baseline.json) holds the Triton version that compiled it, and the
check runs only under that version (another compiler's code is not a regression).

The baseline (tools/kernel_report_baseline.json) is the build of the last commit that changed a
kernel on purpose; --check fails when a kernel gains spills, its main loop loses tensor-core
instructions or gains calls or local-memory instructions, its floating-point instructions per
score rise by more than 2%, its blocks per SM fall, or a kernel appears or disappears. A change
that makes a kernel better is reported, and its commit writes the new baseline.
tests/test_kernel_report.py runs the check on a CUDA build (`make kernel-report` runs it by
hand); docs/design/attention_cuda.md reads the numbers.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BASELINE = ROOT / "tools" / "kernel_report_baseline.json"
TRITON_BASELINE = ROOT / "tools" / "kernel_report_triton_baseline.json"
# tests/triton_aot.py's calls whose Triton attention variants --triton reports (their labels).
TRITON_CALLS = (
    "attention torch.bfloat16 D=64/64 plain det=False",
    "attention torch.bfloat16 D=128/128 plain det=False",
)

# Per SM: 32-bit registers, bytes of shared memory for blocks (1 KB of it reserved per block),
# threads, blocks (CUDA programming guide, compute capability tables).
SM_LIMITS = {
    "sm_80": {"regs": 65536, "smem": 167936, "threads": 2048, "blocks": 32},
    "sm_90": {"regs": 65536, "smem": 233472, "threads": 2048, "blocks": 32},
}
SMEM_RESERVED_PER_BLOCK = 1024
REG_ALLOCATION_UNIT = 256  # registers are given to a warp in units of 256

# Instruction classes counted in a loop, by the opcode's first dotted part.
TENSOR_CORE = ("HMMA", "HGMMA")
TMA = ("UTMALDG", "UBLKCP")
FLOATING_POINT = ("FFMA", "FMUL", "FADD", "FMNMX", "FSEL", "FSETP", "FSET", "F2FP", "F2F", "MUFU")
COUNTED = ("HMMA", "HGMMA", "LDSM", "LDGSTS", "BAR", "CALL")
LOCAL_MEMORY = ("LDL", "STL")
FP_PER_SCORE_SLACK = 1.02

_INSTRUCTION = re.compile(r"/\*([0-9a-f]+)\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
_FUNCTION = re.compile(r"Function : (\S+)")
_RESOURCES = re.compile(r"Function (\S+):\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")
_BRANCH_TARGET = re.compile(r"(?:^|\s)(0x[0-9a-f]+)")


@dataclass
class Instruction:
    address: int
    opcode: str  # e.g. "HMMA.16816.F32.BF16"
    operands: str

    @property
    def base(self) -> str:
        return self.opcode.split(".")[0]


@dataclass
class LoopCounts:
    instructions: int = 0
    counts: dict[str, int] = field(default_factory=dict)  # COUNTED, "TMA", "EX2", "FP"

    @property
    def tensor_core(self) -> int:
        return sum(self.counts.get(op, 0) for op in TENSOR_CORE)


def parse_sass(text: str) -> dict[str, list[Instruction]]:
    """`cuobjdump -sass` output -> {mangled function name: its instructions in address order}."""
    functions: dict[str, list[Instruction]] = {}
    current: list[Instruction] | None = None
    for line in text.splitlines():
        m = _FUNCTION.search(line)
        if m:
            current = functions.setdefault(m.group(1), [])
            continue
        m = _INSTRUCTION.search(line)
        if m and current is not None:
            current.append(Instruction(int(m.group(1), 16), m.group(3), m.group(4).strip()))
    return functions


def parse_resources(text: str) -> dict[str, dict[str, int]]:
    """`cuobjdump -res-usage` output -> {mangled name: {regs, stack, static_smem, local}}."""
    return {
        m.group(1): {
            "regs": int(m.group(2)),
            "stack": int(m.group(3)),
            "static_smem": int(m.group(4)),
            "local": int(m.group(5)),
        }
        for m in _RESOURCES.finditer(text)
    }


def loops(instructions: list[Instruction]) -> list[tuple[int, int]]:
    """The loops of a function as (first, last) instruction indices: each backward branch (a BRA
    to an earlier address) and its target. The BRA to itself after a function's EXIT is not a
    loop."""
    index = {ins.address: i for i, ins in enumerate(instructions)}
    found = []
    for i, ins in enumerate(instructions):
        if ins.base != "BRA":
            continue
        m = _BRANCH_TARGET.search(ins.operands)
        if m is None:
            continue
        target = int(m.group(1), 16)
        if target < ins.address and target in index:
            found.append((index[target], i))
    return found


def count(instructions: list[Instruction]) -> LoopCounts:
    """Counts of the reported instruction classes in a stretch of code."""
    counts = dict.fromkeys(COUNTED, 0) | {"TMA": 0, "EX2": 0, "FP": 0, "LDL/STL": 0}
    for ins in instructions:
        if ins.base in COUNTED:
            counts[ins.base] += 1
        if ins.base in LOCAL_MEMORY:
            counts["LDL/STL"] += 1
        if ins.base in TMA:
            counts["TMA"] += 1
        if ins.opcode.startswith("MUFU.EX2"):
            counts["EX2"] += 1
        if ins.base in FLOATING_POINT:
            counts["FP"] += 1
    return LoopCounts(len(instructions), counts)


def main_loop(
    instructions: list[Instruction], innermost: bool = False
) -> tuple[LoopCounts | None, int]:
    """The main loop's counts and the number of loops that hold tensor-core instructions. The
    main loop is the one with the most tensor-core instructions, the shortest of equals (an inner
    loop that holds all of them, not the loop around it); without tensor-core instructions, the
    one with the most floating-point instructions. innermost: only loops that hold no other
    loop compete (a Triton kernel walks its tiles in several loops of equal tensor-core work,
    one of them the interior's, inside an outer loop that holds them all)."""
    best: tuple[tuple[int, int, int], LoopCounts] | None = None
    with_tensor_core = 0
    found = loops(instructions)
    if innermost:
        found = [
            (f, l)
            for f, l in found
            if not any(f <= a and b <= l and (a, b) != (f, l) for a, b in found)
        ]
    for first, last in found:
        c = count(instructions[first : last + 1])
        with_tensor_core += c.tensor_core > 0
        key = (c.tensor_core, 0 if c.tensor_core else c.counts["FP"], -c.instructions)
        if best is None or key > best[0]:
            best = (key, c)
    return (best[1] if best else None), with_tensor_core


@dataclass
class KernelName:
    family: str  # attention, recurrent, positional
    kind: str  # fwd_mma, bwd_dkdv_mma, forward_persistent, add_sinusoidal, ...
    element: str  # bf16, f16, float, double
    literals: tuple[str, ...]  # the literal template arguments in order: ints, bools, enums

    @property
    def config(self) -> tuple[int, ...]:
        return tuple(int(v) for v in self.literals if v.lstrip("-").isdigit())

    def __str__(self) -> str:
        args = [self.element, *self.literals] if self.element != "-" else list(self.literals)
        body = f"{self.kind}<{','.join(args)}>" if args else self.kind
        return body if self.family == "attention" else f"{self.family}.{body}"


# The kernels reported, by the namespace under fastattn:: they live in.
FAMILIES = {
    ("cuda", "attn"): "attention",
    ("recurrent",): "recurrent",
    ("positional",): "positional",
}
# The translation units (cubins) that hold them.
CUBINS = ("attention_cuda", "recurrent_cuda", "positional_cuda")
_LITERAL = re.compile(r"L(N\w*?E|[a-z])(-?\d+)E")


def _nested_name(mangled: str) -> tuple[list[str], str] | None:
    """The source names of a mangled _ZN...E function and the rest of the string after them
    (its template arguments when it starts with I)."""
    if not mangled.startswith("_ZN"):
        return None
    names, i = [], 3
    while i < len(mangled) and mangled[i].isdigit():
        j = i
        while mangled[j].isdigit():
            j += 1
        length = int(mangled[i:j])
        names.append(mangled[j : j + length])
        i = j + length
    return names, mangled[i:]


def kernel_name(mangled: str) -> KernelName | None:
    """A kernel's readable name from its mangled one, for the kernels of FAMILIES
    (fastattn::cuda::attn::attention_<kind>_kernel<element, config...>,
    fastattn::recurrent::cuda_kernels::<kind>_kernel<element, cell>, ...), else None."""
    parsed = _nested_name(mangled)
    if parsed is None:
        return None
    names, rest = parsed
    if len(names) < 2 or names[0] != "fastattn" or not names[-1].endswith("_kernel"):
        return None
    family = next(
        (f for prefix, f in FAMILIES.items() if tuple(names[1 : 1 + len(prefix)]) == prefix), None
    )
    if family is None:
        return None
    kind = names[-1].removesuffix("_kernel")
    if family == "attention":
        kind = kind.removeprefix("attention_")
    args = rest[1:] if rest.startswith("I") else ""
    if args.startswith("f"):
        element = "float"
    elif args.startswith("d"):
        element = "double"
    elif args.startswith("i"):
        element = "int"
    elif args.startswith("l"):
        element = "long"
    elif "BF16" in args[:40] or "BFloat16" in args[:40]:
        element = "bf16"
    elif "F16" in args[:40] or "4Half" in args[:40]:
        element = "f16"
    else:
        element = "-"
    literals = []
    for kind_code, value in _LITERAL.findall(args):
        if kind_code == "b":
            literals.append("true" if value == "1" else "false")
        elif kind_code.startswith("N"):  # an enum: its type's last name, lower case, and value
            enum = re.search(r"\d+([A-Za-z]\w*)E$", kind_code)
            literals.append(f"{enum.group(1).lower() if enum else 'enum'}{value}")
        else:
            literals.append(value)
    return KernelName(family, kind, element, tuple(literals))


def launch_shape(name: KernelName) -> tuple[int | None, int | None, int | None]:
    """(threads per block, dynamic shared bytes per block, scores a thread computes per trip of
    the main loop) of a tensor-core kernel from its config, as the configs in
    csrc/attention/attention_cuda_fwd.cuh and attention_cuda_bwd.cuh define them (SmemTile's
    row stride is the head-dim bucket + 8 elements); None for the other kernels."""
    if name.kind == "fwd_mma":  # FwdConfig<kHD, kMT, kWarps, kBlockN>
        hd, mt, warps, block_n = name.config
        block_m, stride = 16 * mt * warps, hd + 8
        return 32 * warps, (block_m + 2 * block_n) * stride * 2, 16 * mt * block_n // 32
    if name.kind == "bwd_dkdv_mma":  # BwdKVConfig<kHD, kStages, kOut, kBlockM>, 4 warps
        hd, stages, _, block_m = name.config
        block_n, stride = 64, hd + 8
        smem = (2 * block_n * stride + stages * 2 * block_m * stride) * 2 + stages * 2 * block_m * 4
        return 128, smem, 16 * block_m // 32
    if name.kind == "bwd_dq_mma":  # BwdQConfig<kHD, kStages, kBlockN>, 4 warps
        hd, stages, block_n = name.config
        block_m, stride = 64, hd + 8
        return 128, (2 * block_m * stride + stages * 2 * block_n * stride) * 2, 16 * block_n // 32
    return None, None, None


def blocks_per_sm(arch: str, regs: int, threads: int, smem: int) -> int:
    """Resident blocks per SM: the least of the register, shared-memory, thread and block
    limits."""
    lim = SM_LIMITS[arch]
    warps = math.ceil(threads / 32)
    regs_per_warp = math.ceil(max(regs, 1) * 32 / REG_ALLOCATION_UNIT) * REG_ALLOCATION_UNIT
    by_regs = lim["regs"] // (regs_per_warp * warps)
    by_smem = lim["smem"] // (smem + SMEM_RESERVED_PER_BLOCK)
    return min(by_regs, by_smem, lim["threads"] // threads, lim["blocks"])


def report_function(
    arch: str, name: KernelName, instructions: list[Instruction], res: dict[str, int]
) -> dict:
    """One kernel's row of the report."""
    threads, dynamic_smem, scores = launch_shape(name)
    loop, loops_with_tc = main_loop(instructions)
    row: dict = {
        "regs": res["regs"],
        "stack": res["stack"],
        "spill_ops": sum(ins.base in LOCAL_MEMORY for ins in instructions),
        "smem": res["static_smem"] + (dynamic_smem or 0),
        "threads": threads,
        "blocks_per_sm": None,
        "loops_with_tensor_core": loops_with_tc,
        "loop": None,
    }
    if threads is not None:
        row["blocks_per_sm"] = blocks_per_sm(arch, res["regs"], threads, row["smem"])
    if loop is not None:
        row["loop"] = {"instructions": loop.instructions, **loop.counts}
        if scores:
            row["loop"]["fp_per_score"] = round(loop.counts["FP"] / scores, 3)
    return row


def find_cuobjdump() -> str | None:
    """cuobjdump: $CUOBJDUMP, PATH, the CUDA toolkit, else the copy bundled with triton."""
    if os.environ.get("CUOBJDUMP"):
        return os.environ["CUOBJDUMP"]
    found = shutil.which("cuobjdump")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), "/usr/local/cuda"):
        if home and (Path(home) / "bin" / "cuobjdump").exists():
            return str(Path(home) / "bin" / "cuobjdump")
    try:
        import triton
    except ImportError:
        return None
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return str(bundled) if bundled.exists() else None


def _run(cuobjdump: str, *args: str) -> str:
    return subprocess.run([cuobjdump, *args], capture_output=True, text=True, check=True).stdout


def report(lib: Path, cuobjdump: str, arches: list[str] | None = None) -> dict[str, dict]:
    """{arch: {kernel name: row}} for the attention kernels of the CUDA library `lib`, for each
    arch in `arches` (default: every arch of SM_LIMITS the library holds cubins for)."""
    listing = _run(cuobjdump, "-lelf", str(lib))
    files = "|".join(CUBINS)
    cubins = re.findall(rf"ELF file\s+\d+:\s+((?:{files})\S*\.(sm_\d+)\.cubin)", listing)
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for cubin, arch in cubins:
            if arch not in SM_LIMITS or (arches and arch not in arches):
                continue
            subprocess.run(
                [cuobjdump, "-xelf", cubin, str(lib)], cwd=tmp, capture_output=True, check=True
            )
            path = str(Path(tmp) / cubin)
            functions = parse_sass(_run(cuobjdump, "-sass", path))
            resources = parse_resources(_run(cuobjdump, "-res-usage", path))
            for mangled, instructions in functions.items():
                name = kernel_name(mangled)
                if name is None or mangled not in resources:
                    continue
                row = report_function(arch, name, instructions, resources[mangled])
                out.setdefault(arch, {})[str(name)] = row
    return {arch: dict(sorted(rows.items())) for arch, rows in sorted(out.items())}


def triton_report(jobs: int) -> tuple[str, dict[str, dict]]:
    """(triton version, {"sm_90": {variant: row}}) of the Triton attention variants of
    TRITON_CALLS, compiled for sm_90 by tests/triton_aot.py (about a second a variant)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        filters = [arg for call in TRITON_CALLS for arg in ("--filter", call)]
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
        proc = subprocess.run(
            [sys.executable, str(ROOT / "tests" / "triton_aot.py"), "--devices", "h100"]
            + ["--jobs", str(jobs), "--json", str(out), *filters],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
        )
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"tests/triton_aot.py failed:\n{proc.stdout[-4000:]}{proc.stderr}")
        data = json.loads(out.read_text())
    rows: dict[str, dict] = {}
    for row in data["rows"].values():
        name = row.pop("name")
        if name in rows:
            raise RuntimeError(f"two Triton variants named {name}: make the names tell them apart")
        rows[name] = row
    return data["triton"], {"sm_90": dict(sorted(rows.items()))}


def check(current: dict[str, dict], baseline: dict[str, dict]) -> tuple[list[str], list[str]]:
    """(regressions, improvements) of `current` against `baseline`, for the arches both have."""
    bad, better = [], []
    for arch in sorted(set(current) & set(baseline)):
        now, base = current[arch], baseline[arch]
        for name in sorted(set(base) - set(now)):
            bad.append(f"{arch} {name}: in the baseline, not in the build")
        for name in sorted(set(now) - set(base)):
            bad.append(f"{arch} {name}: new kernel, not in the baseline")
        for name in sorted(set(now) & set(base)):
            n, b = now[name], base[name]
            where = f"{arch} {name}"
            if n["stack"] > b["stack"] or n["spill_ops"] > b["spill_ops"]:
                bad.append(
                    f"{where}: spills: stack {b['stack']} -> {n['stack']} bytes, local-memory "
                    f"instructions {b['spill_ops']} -> {n['spill_ops']}"
                )
            elif n["stack"] < b["stack"] or n["spill_ops"] < b["spill_ops"]:
                better.append(f"{where}: fewer spills")
            if b.get("warp_specialized") and not n.get("warp_specialized"):
                bad.append(f"{where}: no longer warp-specialized")
            if (b["blocks_per_sm"] or 0) > (n["blocks_per_sm"] or 0):
                bad.append(f"{where}: blocks per SM {b['blocks_per_sm']} -> {n['blocks_per_sm']}")
            elif (n["blocks_per_sm"] or 0) > (b["blocks_per_sm"] or 0):
                better.append(f"{where}: more blocks per SM")
            nl, bl = n["loop"] or {}, b["loop"] or {}
            tc_now = sum(nl.get(op, 0) for op in TENSOR_CORE)
            tc_base = sum(bl.get(op, 0) for op in TENSOR_CORE)
            if tc_now < tc_base:
                bad.append(f"{where}: main loop's tensor-core instructions {tc_base} -> {tc_now}")
            for what in ("LDL/STL", "CALL"):
                if nl.get(what, 0) > bl.get(what, 0):
                    bad.append(f"{where}: main loop's {what} {bl.get(what, 0)} -> {nl[what]}")
            if "fp_per_score" in bl and "fp_per_score" in nl:
                if nl["fp_per_score"] > bl["fp_per_score"] * FP_PER_SCORE_SLACK:
                    bad.append(
                        f"{where}: floating-point instructions per score "
                        f"{bl['fp_per_score']} -> {nl['fp_per_score']}"
                    )
                elif nl["fp_per_score"] < bl["fp_per_score"] / FP_PER_SCORE_SLACK:
                    better.append(f"{where}: fewer floating-point instructions per score")
    return bad, better


def format_table(current: dict[str, dict]) -> str:
    """The report as a fixed-width table, one kernel per line."""
    width = max([34, *(len(name) for rows in current.values() for name in rows)])
    head = (
        f"{'arch':6} {'kernel':{width}} {'regs':>4} {'stack':>5} {'LDL/STL':>7} {'smem':>6} "
        f"{'blk/SM':>6} | {'instrs':>6} {'HMMA':>4} {'HGMMA':>5} {'LDSM':>4} {'LDGSTS':>6} "
        f"{'TMA':>3} {'BAR':>3} {'EX2':>3} {'CALL':>4} {'L/S':>3} {'FP':>4} {'FP/score':>8}"
    )
    lines = [head, "-" * len(head)]
    for arch, rows in current.items():
        for name, r in rows.items():
            lp = r["loop"] or {}
            blocks = "" if r["blocks_per_sm"] is None else r["blocks_per_sm"]
            fps = lp.get("fp_per_score", "")
            lines.append(
                f"{arch:6} {name:{width}} {r['regs']:>4} {r['stack']:>5} {r['spill_ops']:>7} "
                f"{r['smem']:>6} {blocks:>6} | {lp.get('instructions', ''):>6} "
                f"{lp.get('HMMA', ''):>4} {lp.get('HGMMA', ''):>5} {lp.get('LDSM', ''):>4} "
                f"{lp.get('LDGSTS', ''):>6} {lp.get('TMA', ''):>3} {lp.get('BAR', ''):>3} "
                f"{lp.get('EX2', ''):>3} {lp.get('CALL', ''):>4} {lp.get('LDL/STL', ''):>3} "
                f"{lp.get('FP', ''):>4} {fps:>8}"
            )
    return "\n".join(lines)


def baseline_text(current: dict[str, dict], version: str | None, key: str = "cuda_version") -> str:
    """The baseline file: the compiler that built the kernels (`key`: the CUDA toolkit, or
    triton), then a line per kernel (so that a commit's diff shows which kernels changed)."""
    lines = ["{", f' "{key}": {json.dumps(version)},', ' "kernels": {']
    for i, (arch, rows) in enumerate(current.items()):
        lines.append(f"  {json.dumps(arch)}: {{")
        for j, (name, row) in enumerate(rows.items()):
            comma = "," if j < len(rows) - 1 else ""
            lines.append(f"   {json.dumps(name)}: {json.dumps(row, sort_keys=True)}{comma}")
        lines.append("  }" + ("," if i < len(current) - 1 else ""))
    return "\n".join([*lines, " }", "}"]) + "\n"


def default_library() -> Path:
    return ROOT / "fastattn" / "_C_cuda.so"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib", type=Path, default=default_library(), help="the CUDA library")
    ap.add_argument("--arch", nargs="*", help="sm_80, sm_90 (default: every one in the library)")
    ap.add_argument("--check", action="store_true", help="fail on a regression from the baseline")
    ap.add_argument("--write-baseline", action="store_true", help="store this build as baseline")
    ap.add_argument("--json", type=Path, help="also write the report as JSON here")
    ap.add_argument("--triton", action="store_true", help="the Triton attention kernels instead")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="--triton: compiles")
    args = ap.parse_args(argv)
    if args.triton:
        return triton_main(args)
    cuobjdump = find_cuobjdump()
    if cuobjdump is None:
        print("kernel_report: no cuobjdump (set CUOBJDUMP, or install triton or the toolkit)")
        return 2
    if not args.lib.exists():
        print(f"kernel_report: {args.lib} does not exist (build with FASTATTN_CUDA=1)")
        return 2
    current = report(args.lib, cuobjdump, args.arch)
    print(format_table(current))
    if args.json:
        args.json.write_text(json.dumps(current, indent=1) + "\n")
    if args.write_baseline:
        from fastattn import build_info

        BASELINE.write_text(baseline_text(current, build_info().get("cuda_version")))
        print(f"baseline written: {BASELINE.relative_to(ROOT)}")
    if args.check:
        return _report_check(current, BASELINE)
    return 0


def _report_check(current: dict[str, dict], baseline_file: Path) -> int:
    """Prints what moved against the baseline file; 1 on a regression."""
    baseline = json.loads(baseline_file.read_text())["kernels"]
    bad, better = check(current, baseline)
    for line in better:
        print(f"better than the baseline (write it: --write-baseline): {line}")
    for line in bad:
        print(f"REGRESSION: {line}")
    if bad:
        return 1
    print(f"kernel report: no regression from {baseline_file.relative_to(ROOT)}")
    return 0


def triton_main(args) -> int:
    """--triton: the report of the Triton attention kernels, its baseline and check."""
    try:
        import triton
    except ImportError:
        print("kernel_report: --triton needs triton")
        return 2
    version, current = triton_report(args.jobs)
    print(f"triton {version}, sm_90")
    print(format_table(current))
    if args.json:
        args.json.write_text(json.dumps(current, indent=1) + "\n")
    if args.write_baseline:
        TRITON_BASELINE.write_text(baseline_text(current, version, "triton_version"))
        print(f"baseline written: {TRITON_BASELINE.relative_to(ROOT)}")
    if args.check:
        compiled_by = json.loads(TRITON_BASELINE.read_text())["triton_version"]
        if compiled_by != triton.__version__:
            print(f"kernel report: the baseline is triton {compiled_by}'s; not checked")
            return 0
        return _report_check(current, TRITON_BASELINE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
