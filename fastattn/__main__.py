"""python -m fastattn: the environment report (versions, build, backends, devices)."""

from __future__ import annotations

import platform
import re
import sys


def arch_coverage(archs: str, major: int, minor: int) -> str:
    """How a build for `archs` (TORCH_CUDA_ARCH_LIST syntax, e.g. "8.0;9.0+PTX") runs on a
    device of compute capability major.minor: native code (an sm_XY build runs on the same
    major version, minor >= Y; "9.0a" only on 9.0), PTX the driver compiles (compute_XY runs on
    any device >= X.Y), or not at all."""
    device = (major, minor)
    native, ptx = [], []
    for entry in re.split(r"[;,\s]+", archs.strip()):
        match = re.fullmatch(r"(\d+)\.(\d+)([af]?)(\+PTX)?", entry)
        if match is None:
            continue
        arch = (int(match[1]), int(match[2]))
        if match[3] == "a":
            runs = arch == device
        else:
            runs = arch[0] == major and minor >= arch[1]
        if runs:
            native.append(arch)
        if match[4] and device >= arch:
            ptx.append(arch)
    if native:
        best = max(native)
        return f"native code for sm_{best[0]}{best[1]}"
    if ptx:
        best = max(ptx)
        return f"runs compute_{best[0]}{best[1]} PTX, compiled by the driver on first use (cached)"
    return (
        f"NOT COVERED by the archs {archs}: the CUDA kernels cannot run; rebuild with "
        f"TORCH_CUDA_ARCH_LIST={major}.{minor}"
    )


def _abi(info: dict) -> str:
    """'stable ABI, built against torch X (target Y)': the native ops use libtorch's stable ABI
    only, so they run under torch Y and every later one (docs/design/stable_abi.md)."""
    if info.get("abi") != "stable":
        return f"built against torch {info['torch_version']}"
    return (
        f"stable ABI, built against torch {info['torch_version']} "
        f"(target {info['torch_target']}: runs under torch >= {info['torch_target']})"
        + (f", Python {info['python_abi']}" if info.get("python_abi") else "")
    )


def report() -> str:
    import torch

    import fastattn

    lines = [
        f"fastattn {fastattn.__version__}",
        f"python   {platform.python_version()} ({sys.executable})",
        f"torch    {torch.__version__} (CUDA {torch.version.cuda or 'none'})",
    ]
    try:
        import triton

        lines.append(f"triton   {triton.__version__}")
    except Exception as exc:  # pragma: no cover - depends on the environment
        lines.append(f"triton   not importable ({type(exc).__name__})")
    info = fastattn.build_info()
    if "error" in info:
        lines.append(f"build    fastattn._C did not import: {info['error']}")
    else:
        cuda = (
            f"CUDA {info['cuda_version']} (toolkit {info['cuda_home']}), archs {info['cuda_archs']}"
            if info["cuda"]
            else "CUDA not built"
        )
        if info["cuda"] and info.get("cuda_library", "loaded") != "loaded":
            cuda += f" ({info['cuda_library']})"
        lines.append(
            f"build    {cuda}; {_abi(info)}; "
            f"CPU kernels: {info['cpu_isa']}"
            f"{' + AMX (bfloat16 attention)' if info.get('cpu_amx') else ''}; debug checks "
            f"{'on' if info['debug_checks'] else 'off'}"
        )
    lines.append("backends")
    for name, status in fastattn.available_backends().items():
        lines.append(f"  {name:<10} {status}")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            coverage = ""
            if info.get("cuda"):
                coverage = ": " + arch_coverage(info["cuda_archs"], props.major, props.minor)
            lines.append(
                f"device   cuda:{i} {props.name} (sm_{props.major}{props.minor}, "
                f"{props.total_memory / 2**30:.0f} GiB){coverage}"
            )
    else:
        lines.append(
            f"device   cpu: {platform.processor() or platform.machine()}, "
            f"{torch.get_num_threads()} threads (no CUDA device)"
        )
    from ._backend import requested_backend

    lines.append(f"default  {requested_backend() or 'automatic per device'}")
    from . import speed_table

    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices += [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    for device in devices:
        lines.append(f"speed table ({device}): {speed_table.describe(device)}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())
