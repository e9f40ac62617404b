"""benchmarks/gpu_suite.sh, rehearsed without a GPU: a test stage cut off by its time share
still reports every test that ended (passed and failed, by name), pytest's summary and its
junit XML, so a slow first GPU run does not lose the names of its failing tests."""

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

FAKE_TESTS = """
import time

def test_cuda_passes():
    pass

def test_cuda_fails():
    assert 1 == 2, "a failing GPU test"

def test_triton_hangs():
    time.sleep(600)
"""


def _run_script(script: str, out: Path, timeout: int, **env) -> subprocess.CompletedProcess:
    """benchmarks/<script> OUT with this Python and `env` added to the environment."""
    return subprocess.run(
        ["bash", str(ROOT / "benchmarks" / script), str(out)],
        env=dict(os.environ, PYTHON=sys.executable, **env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.mark.timeout(240)
def test_cut_off_stage_keeps_test_names(tmp_path):
    tests = tmp_path / "fake_tests"
    tests.mkdir()
    (tests / "test_fake.py").write_text(FAKE_TESTS)
    out = tmp_path / "out"
    proc = _run_script(
        "gpu_suite.sh",
        out,
        200,
        GPU_SUITE_STAGES="tests",
        GPU_SUITE_TESTS=str(tests),
        GPU_SUITE_WORKERS="2",
        GPU_SUITE_GRACE="20",
        GPU_SUITE_TEST_TIMEOUT="300",  # the stage's cut-off, not pytest-timeout, ends it
        # the test stage's share: all of it (no later stage selected keeps time)
        GPU_SUITE_SECONDS="50",
    )
    report = proc.stdout
    assert proc.returncode != 0, report
    assert "tests (GPU-specific): CUT OFF" in report, report
    assert "tests (GPU-specific): 1 passed, 1 failed" in report, report
    assert "FAILED" in report and "test_fake.py::test_cuda_fails" in report, report
    log = (out / "tests_gpu.log").read_text()
    assert "test_cuda_passes" in log and "PASSED" in log, log
    assert "1 failed, 1 passed" in log, log  # pytest's own summary, written after SIGINT
    junit = ET.parse(out / "tests_gpu.xml").getroot()
    cases = {case.get("name"): case for case in junit.iter("testcase")}
    assert cases["test_cuda_fails"].find("failure") is not None
    assert cases["test_cuda_passes"].find("failure") is None


@pytest.mark.timeout(120)
def test_tuning_run_records_the_commit_and_skips_a_missing_profiler(tmp_path):
    out = tmp_path / "out"
    proc = _run_script("gpu_tune.sh", out, 100, GPU_SUITE_STAGES="ncu", PATH="/usr/bin:/bin")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "ncu: not on this machine" in proc.stdout
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode == 0:  # a checkout (CI's clean clone is one)
        assert (out / "commit.txt").read_text().splitlines()[0] == head.stdout.strip()


def test_reserves_follow_the_selected_stages():
    script = (ROOT / "benchmarks" / "gpu_suite.sh").read_text()
    start = script.index("reserve_after() {")
    helper = script[start : script.index("\n}\n", start) + 3]
    for stages, stage, want in [
        ("build tests bench", "tests", 250),
        ("build tests report ncu bench", "tests", 380),
        ("build tests report ncu bench", "ncu", 250),
        ("build tests", "tests", 0),
    ]:
        got = subprocess.run(
            ["bash", "-c", f'STAGES="{stages}"\n{helper}\nreserve_after {stage}'],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        assert int(got) == want, (stages, stage, got)


def test_triton_winners_lists_the_autotuners_choices():
    triton = pytest.importorskip("triton")
    from fastattn.triton import attention, attention_tuning  # noqa: F401 (registers "fwd")

    autotuner = attention_tuning._TUNED["fwd"][(False, 128)]
    key = (128, 128, 4096, 4096, 0, False, False, "torch.bfloat16")
    config = triton.Config({"BLOCK_M": 128, "BLOCK_N": 64}, num_warps=8, num_stages=3)
    autotuner.cache[key] = config
    try:
        rows = [r for r in attention_tuning.winners() if r["kernel"] == "fwd"]
    finally:
        del autotuner.cache[key]
    assert rows == [
        {
            "kernel": "fwd",
            "float32": False,
            "head_class": 128,
            "key": {
                "BLOCK_D": "128", "BLOCK_DV": "128", "LQ_CLASS": "4096", "LK_CLASS": "4096",
                "MASK_KIND": "0", "HAS_DROPOUT": "False", "VARLEN": "False",
            },
            "key_rest": ["torch.bfloat16"],
            "config": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3},
        }
    ]  # fmt: skip
