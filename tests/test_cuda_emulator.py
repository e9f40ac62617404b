"""The CUDA recurrent kernels (LSTM, GRU both forms, tanh / relu RNN on one engine), run on the
CPU under tools/cuda_emu (emu_lstm.h): every op body and kernel of csrc/lstm/lstm_cuda.cu, the
two cooperative persistent kernels (their split-K block product, multi-chunk and many-split
plans, 1 and 132 emulated SMs) and the per-step fallback, against the float64 reference and
against fastattn's CPU kernels. This is what stands between a change to those kernels and a GPU
run; it builds the emulator (about a minute) and runs every case (a few minutes). Also the
CUDA attention kernels on the attention emulator (tools/cuda_emu/run.py: every case, about
eight minutes on one core, in four tests)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(1500)
def test_lstm_cuda_kernels_on_the_emulator():
    if not (ROOT / "csrc" / "lstm" / "lstm_cuda.cu").exists():
        pytest.skip("the emulator compiles csrc/ from a source checkout; this run has tests/ only")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "cuda_emu" / "run_lstm.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=1400,
    )
    report = proc.stdout + proc.stderr[-4000:]
    assert proc.returncode == 0, report
    assert "all emulated LSTM cases passed" in proc.stdout, report
    # the GRU (both forms) and the RNN (tanh, relu) on the same engine, both paths
    assert "all emulated GRU/RNN cases passed" in proc.stdout, report
    for cell in ("gru", "gru_reset_before", "rnn_tanh", "rnn_relu"):
        assert f"ok  {cell} H=70 multi-chunk B=9 [persistent, 8 SM]" in proc.stdout, report
        assert f"ok  {cell} [per_step] = fastattn's CPU kernels" in proc.stdout, report
    # the persistent kernels really ran (the runner checks the cooperative launch count)
    assert "[persistent, 132 SM]" in proc.stdout and "multi-chunk" in proc.stdout, report


EMULATOR_SHARDS = 4


def emulator_case_names() -> list[str]:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "cuda_emu" / "run.py"), "--list"],
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return [line for line in proc.stdout.splitlines() if line and " " not in line]


@pytest.mark.timeout(1500)
@pytest.mark.parametrize("shard", range(EMULATOR_SHARDS))
def test_attention_cuda_kernels_on_the_emulator(shard):
    """Every case of tools/cuda_emu/run.py (a quarter per test, so that pytest -n spreads
    them): the CUDA attention forward and backward, varlen, paged and split-K decoding, the
    learned-bias gradient (every broadcast shape, deterministic and atomic sums), every
    feature, dtype, head-dim bucket and shared-memory variant the kernels branch on, against
    the float64 reference under FlashAttention's rule, plus the emulator's race and bounds
    checks."""
    if not (ROOT / "csrc" / "attention" / "attention_cuda_bwd.cuh").exists():
        pytest.skip("the emulator compiles csrc/ from a source checkout; this run has tests/ only")
    expected = emulator_case_names()[shard::EMULATOR_SHARDS]
    assert expected, "the emulator lists no case for this shard"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "cuda_emu" / "run.py"),
            "--shard",
            f"{shard}/{EMULATOR_SHARDS}",
        ],
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        capture_output=True,
        text=True,
        timeout=1400,
    )
    report = proc.stdout + proc.stderr[-4000:]
    assert proc.returncode == 0, report
    assert f"{len(expected)}/{len(expected)} cases passed" in proc.stdout, report
    for name in expected:  # each case ran and passed, by name
        assert f"ok   {name} " in proc.stdout, f"{name} did not pass:\n{report}"
