"""The benchmark harness (benchmarks/common.py) on toy providers: checks before timing, wrong
and raising providers reported without hiding the others, interleaved rounds, speedups."""
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import common  # noqa: E402

CPU = torch.device("cpu")


def _sleeper(seconds, calls, name, value):
    def fn():
        calls.append(name)
        time.sleep(seconds)
        return torch.tensor([value])
    return fn


def test_run_case_checks_times_and_ranks():
    calls = []
    case = common.Case(
        op="toy", name="n=1",
        providers={"fast": _sleeper(0.002, calls, "fast", 1.0),
                   "slow": _sleeper(0.008, calls, "slow", 1.0),
                   "wrong": _sleeper(0.001, calls, "wrong", 2.0),
                   "broken": lambda: (_ for _ in ()).throw(RuntimeError("no kernel\nmore"))},
        reference="slow", baselines=("slow",), check=common.relative_error, flops=1e6)
    rows = {r["provider"]: r for r in common.run_case(case, CPU, min_time=0.05)}
    assert list(rows) == ["fast", "slow", "wrong", "broken"]  # the providers' order
    assert rows["wrong"]["status"].startswith("FAIL")
    assert "median_ms" not in rows["wrong"]
    assert rows["broken"]["status"] == "ERROR RuntimeError: no kernel"
    assert rows["fast"]["status"] == rows["slow"]["status"] == "ok"
    assert rows["slow"]["speedup"] == pytest.approx(1.0)
    assert 2.0 < rows["fast"]["speedup"] < 6.0
    assert rows["fast"]["reps"] >= 6 and rows["fast"]["TFLOP/s"] > 0
    # timed in interleaved blocks: the timed calls of "fast" are not all before "slow"'s
    timed = [c for c in calls if c in ("fast", "slow")]
    first_slow = timed.index("slow")
    assert "fast" in timed[first_slow:]


def test_measure_interleaved_rotates_and_drops_a_provider_that_raises():
    calls = []
    state = {"n": 0}

    def flaky():
        state["n"] += 1
        if state["n"] > 4:
            raise ValueError("gave up")
        calls.append("flaky")

    fns = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b"), "flaky": flaky}
    times, errors = common.measure_interleaved(fns, CPU, min_time=0.0, min_rounds=4, warmup=1)
    assert errors == {"flaky": "ERROR ValueError: gave up"}
    assert len(times["a"]) == len(times["b"]) == 8  # 4 rounds x 2 timed calls
    # the order rotates: "b" runs first in some round
    blocks = [calls[i] for i in range(len(calls)) if i == 0 or calls[i] != calls[i - 1]]
    assert any(blocks[i] == "b" and blocks[i + 1] == "a" for i in range(len(blocks) - 1))
