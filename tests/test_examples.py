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


def test_seq2seq_example_learns_to_reverse():
    """examples/seq2seq.py --check: the GRU encoder-decoder with Luong attention reaches 98%
    held-out exact match with beam search (and beam >= greedy), on fastattn's kernels. With
    the check's decaying learning rate, ten runs (seeds 0-3, rates 3e-3 +- 0.03%; torch's
    modules, fastattn's avx2 and base copies; AMD Zen 3, 2026-11-28) reached 99.6-100%; a
    model that does not learn the reversal stays far below."""
    import os

    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(REPO / "examples" / "seq2seq.py"), "--check", "--log-every", "100"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "check: passed" in proc.stdout
    assert "fastattn backends: gru=cpu, gru_cell=cpu, attention=cpu" in proc.stdout


def test_seq2seq_example_torch_modules_give_the_same_learning_curve(one_thread):
    """--torch builds the same model from torch's modules with the same initial weights: the
    first training steps' losses agree (float32 rounding apart)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "seq2seq_example", REPO / "examples" / "seq2seq.py"
    )
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    common = ["--steps", "15", "--log-every", "5", "--max-len", "8", "--eval-size", "8"]
    ours = example.train(example.parse_args(common))
    theirs = example.train(example.parse_args([*common, "--torch"]))
    steps = [s for s, _ in ours["curve"]]
    assert steps == [s for s, _ in theirs["curve"]] == [5, 10, 15]
    for (_, a), (_, b) in zip(ours["curve"], theirs["curve"]):
        assert abs(a - b) <= 1e-3 * max(1.0, abs(b)), (ours["curve"], theirs["curve"])
