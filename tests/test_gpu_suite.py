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


@pytest.mark.timeout(240)
def test_cut_off_stage_keeps_test_names(tmp_path):
    tests = tmp_path / "fake_tests"
    tests.mkdir()
    (tests / "test_fake.py").write_text(FAKE_TESTS)
    out = tmp_path / "out"
    env = dict(
        os.environ,
        PYTHON=sys.executable,
        GPU_SUITE_STAGES="tests",
        GPU_SUITE_TESTS=str(tests),
        GPU_SUITE_WORKERS="2",
        GPU_SUITE_GRACE="20",
        GPU_SUITE_TEST_TIMEOUT="300",  # the stage's cut-off, not pytest-timeout, ends it
        # the test stage's share: 300 s less the 250 s kept for the bench
        GPU_SUITE_SECONDS="300",
    )
    proc = subprocess.run(
        ["bash", str(ROOT / "benchmarks" / "gpu_suite.sh"), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=200,
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
