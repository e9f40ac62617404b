"""python -m fastattn: the environment report (versions, build, backends, devices)."""
from __future__ import annotations

import platform
import sys


def report() -> str:
    import torch

    import fastattn

    lines = [f"fastattn {fastattn.__version__}",
             f"python   {platform.python_version()} ({sys.executable})",
             f"torch    {torch.__version__} (CUDA {torch.version.cuda or 'none'})"]
    try:
        import triton
        lines.append(f"triton   {triton.__version__}")
    except Exception as exc:  # pragma: no cover - depends on the environment
        lines.append(f"triton   not importable ({type(exc).__name__})")
    info = fastattn.build_info()
    if "error" in info:
        lines.append(f"build    fastattn._C did not import: {info['error']}")
    else:
        cuda = (f"CUDA {info['cuda_version']}, archs {info['cuda_archs']}" if info["cuda"]
                else "CUDA not built")
        lines.append(f"build    {cuda}; built against torch {info['torch_version']}; "
                     f"CPU kernels: {info['cpu_isa']}; debug checks "
                     f"{'on' if info['debug_checks'] else 'off'}")
    lines.append("backends")
    for name, status in fastattn.available_backends().items():
        lines.append(f"  {name:<10} {status}")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            lines.append(f"device   cuda:{i} {props.name} (sm_{props.major}{props.minor}, "
                         f"{props.total_memory / 2**30:.0f} GiB)")
    else:
        lines.append(f"device   cpu: {platform.processor() or platform.machine()}, "
                     f"{torch.get_num_threads()} threads (no CUDA device)")
    from ._backend import requested_backend
    lines.append(f"default  {requested_backend() or 'automatic per device'}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())
