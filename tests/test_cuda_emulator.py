"""The CUDA recurrent kernels (LSTM, GRU both forms, tanh / relu RNN on one engine), run on the
CPU under tools/cuda_emu (emu_lstm.h): every op body and kernel of the engine
(csrc/recurrent/recurrent_cuda.cu) and the cells (csrc/{lstm,gru,rnn}/*_cuda.cu), the two
cooperative persistent kernels (their split-K block product, multi-chunk and many-split plans,
1 and 132 emulated SMs) and the per-step fallback, against the float64 reference and
against fastattn's CPU kernels. This is what stands between a change to those kernels and a GPU
run; it builds the emulator (about a minute) and runs every case (about five minutes). Also the
CUDA attention backward's learned-bias gradient (d attn_mask) on the attention emulator
(tools/cuda_emu/run.py --only dbias, about three minutes). Both are slow tests: `make
test-extended` runs them (.ci/extended.sh emulator-recurrent, also CI's part for one commit in
five), with every attention emulator case (emulator-attention) in a process of its own."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_lstm_cuda_kernels_on_the_emulator():
    if not (ROOT / "csrc" / "recurrent" / "recurrent_cuda.cu").exists():
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


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_attention_bias_gradient_cuda_kernels_on_the_emulator():
    """d attn_mask (a learned bias's gradient) of the CUDA attention backward, run on the CPU
    emulator (tools/cuda_emu/run.py --only dbias): every bias broadcast shape ((L, L),
    (1, H, L, L), (B, 1, L, L), (B, H, L, L), over keys, over queries, an expanded view),
    deterministic and atomic sums, causal / window, odd lengths, GQA/MQA, softcap, dropout,
    fp16/bf16 tensor-core buckets 64/128/256 (99 KB variants included) and the float32/float64
    SIMT kernels (D-split included), against the float64 reference (FlashAttention's rule and a
    sharper check given the kernels' Delta), plus the emulator's race and bounds checks."""
    if not (ROOT / "csrc" / "attention" / "attention_cuda_bwd.cuh").exists():
        pytest.skip("the emulator compiles csrc/ from a source checkout; this run has tests/ only")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "cuda_emu" / "run.py"), "--only", "dbias"],
        env=env,
        capture_output=True,
        text=True,
        timeout=850,
    )
    report = proc.stdout + proc.stderr[-4000:]
    assert proc.returncode == 0, report
    assert "20/20 cases passed" in proc.stdout, report
    for name in ("dbias_bf16_1HLL_t5", "dbias_f16_B1LL_pair_atomic", "dbias_f64_LL_dropout"):
        assert f"ok   {name} " in proc.stdout, report
