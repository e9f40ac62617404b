"""The examples run as written (CI runs them on CPU)."""

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_decoding_example_cached_matches_recomputed():
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "examples" / "decoding.py"),
            "--check",
            "--steps",
            "12",
            "--beams",
            "3",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "check passed" in proc.stdout
    assert "attention_with_kvcache ran on: cpu" in proc.stdout


def test_decoding_example_paged_matches_dense():
    """examples/decoding.py --paged: greedy and beam search through fastattn.PagedKVCache give
    the dense cache's tokens (and those of recomputing the prefix)."""
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "examples" / "decoding.py"),
            "--check",
            "--paged",
            "--steps",
            "12",
            "--beams",
            "3",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "paged check passed" in proc.stdout and "check passed" in proc.stdout
    assert "attention_with_kvcache ran on: cpu" in proc.stdout


def test_context_parallel_example_matches_one_process():
    """examples/context_parallel.py under torchrun with 2 processes (gloo): loss and gradients
    equal one-process training (--check), bounded in time."""
    import os

    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(REPO / "examples" / "context_parallel.py"),
            "--check",
            "--dtype",
            "float64",
            "--steps",
            "2",
            "--seq-len",
            "32",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "check passed" in proc.stdout
    assert "ring attention, zigzag layout" in proc.stdout
