"""Every Triton kernel variant the launchers would launch on an H100 compiles for sm_90
(tests/triton_aot.py: the launchers run with their GPU choices on CPU tensors, launches are
recorded instead of run, each variant goes through Triton's whole pipeline to a cubin) and fits
the shared memory of every device it was planned for (an H100, an A100, a 99 KB sm_86/89/120
card).

Slow (about five minutes on two idle cores): runs with FASTATTN_SLOW=1 or -m slow. CI runs the
same script with the GPU machine's triton 3.6 for one commit in five (.ci/extended.sh
triton-aot)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_every_triton_kernel_variant_compiles_for_sm90():
    pytest.importorskip("triton")
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "triton_aot.py"), "--jobs", str(os.cpu_count() or 1)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    failures = [line for line in proc.stdout.splitlines() if "FAILED" in line]
    assert proc.returncode == 0, (
        "\n".join(failures[:20]) + proc.stdout[-3000:] + proc.stderr[-3000:]
    )
    assert ": 0 failures," in proc.stdout.splitlines()[-1]


def test_recorder_sees_every_op_without_compiling():
    """The recording half alone (seconds): every launcher runs its GPU branch on CPU tensors
    and hands each kernel variant to the recorder; a launcher error fails here."""
    pytest.importorskip("triton")
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run(
        [sys.executable, str(REPO / "tests" / "triton_aot.py"), "--list"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    kernels = {line.split()[0] for line in proc.stdout.splitlines() if line.startswith("  _")}
    for name in (
        "_fwd_kernel",
        "_bwd_dq_kernel",
        "_bwd_dkdv_kernel",
        "_decode_kernel",
        "_merge_kernel",
        "_append_kernel",
        "_rotary_kernel",
        "_add_sinusoidal_kernel",
        "_embed_kernel",
        "_scores_kernel",
        "_fwd_step_kernel",
        "_bwd_gates_kernel",
        "_bwd_reset_kernel",
        "_bwd_dh_kernel",
        "_cell_fwd_kernel",
    ):
        assert name in kernels, f"{name} was never launched by the recorded calls"
