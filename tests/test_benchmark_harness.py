"""The benchmark harness (benchmarks/common.py) on toy providers: checks before timing, wrong
and raising providers reported without hiding the others, interleaved rounds, speedups (in-place
over in-place only). Timings come from a fake clock that each provider advances by a known cost,
so speedups are exact and nothing depends on the machine's speed or load."""

import sys
import types
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import common  # noqa: E402

CPU = torch.device("cpu")


class FakeClock:
    """Seconds that pass only when a provider made by `provider` runs: each call advances the
    clock by that provider's cost. Costs in whole or binary-fraction seconds keep every
    difference, median and ratio exact in floating point."""

    def __init__(self):
        self.now = 0.0
        self.calls: list[str] = []

    def __call__(self) -> float:
        return self.now

    def provider(self, name: str, cost: float, value: float = 1.0):
        def fn():
            self.calls.append(name)
            self.now += cost
            return torch.tensor([value])

        return fn


def test_run_case_checks_times_and_ranks():
    clock = FakeClock()
    case = common.Case(
        op="toy",
        name="n=1",
        providers={
            "fast": clock.provider("fast", 1.0),
            "slow": clock.provider("slow", 4.0),
            "wrong": clock.provider("wrong", 0.5, value=2.0),
            "broken": lambda: (_ for _ in ()).throw(RuntimeError("no kernel\nmore")),
        },
        reference="slow",
        baselines=("slow",),
        check=common.relative_error,
        flops=1e6,
        judged=("fast", "wrong", "broken"),
    )
    rows = {r["provider"]: r for r in common.run_case(case, CPU, min_time=50.0, clock=clock)}
    assert list(rows) == ["fast", "slow", "wrong", "broken"]  # the providers' order
    assert rows["wrong"]["status"].startswith("FAIL")
    assert "median_ms" not in rows["wrong"]
    assert clock.calls.count("wrong") == 1  # checked, never timed
    assert rows["broken"]["status"] == "ERROR RuntimeError: no kernel"
    assert rows["fast"]["status"] == rows["slow"]["status"] == "ok"
    assert rows["fast"]["median_ms"] == 1000.0 and rows["slow"]["median_ms"] == 4000.0
    assert rows["fast"]["spread"] == 0.0
    assert rows["slow"]["speedup"] == 1.0 and rows["slow"]["against"] == "slow"
    assert rows["fast"]["speedup"] == 4.0 and rows["fast"]["against"] == "slow"
    assert rows["fast"]["TFLOP/s"] == 1e6 / 1.0 / 1e12
    # rounds go on until min_time per provider has passed on the clock: a round (3 calls each)
    # costs 3 + 12 = 15 s, the two timed providers need 2 x 50 s, so 7 rounds of 2 timed calls
    assert rows["fast"]["reps"] == rows["slow"]["reps"] == 14
    # timed in interleaved blocks: the timed calls of "fast" are not all before "slow"'s
    timed = [c for c in clock.calls if c in ("fast", "slow")]
    first_slow = timed.index("slow")
    assert "fast" in timed[first_slow:]


def test_measure_interleaved_rotates_and_drops_a_provider_that_raises():
    clock = FakeClock()
    state = {"n": 0}

    def flaky():
        state["n"] += 1
        if state["n"] > 4:
            raise ValueError("gave up")
        clock.calls.append("flaky")

    fns = {"a": clock.provider("a", 1.0), "b": clock.provider("b", 2.0), "flaky": flaky}
    times, errors = common.measure_interleaved(
        fns, CPU, min_time=0.0, min_rounds=4, warmup=1, clock=clock
    )
    assert errors == {"flaky": "ERROR ValueError: gave up"}
    assert times["a"] == [1.0] * 8 and times["b"] == [2.0] * 8  # 4 rounds x 2 timed calls
    # the order rotates: "b" runs first in some round
    calls = clock.calls
    blocks = [calls[i] for i in range(len(calls)) if i == 0 or calls[i] != calls[i - 1]]
    assert any(blocks[i] == "b" and blocks[i + 1] == "a" for i in range(len(blocks) - 1))


def _inplace_case(clock, costs: dict[str, float], inplace: tuple[str, ...]):
    return common.Case(
        op="toy",
        name="n=1",
        providers={name: clock.provider(name, cost) for name, cost in costs.items()},
        reference="torch",
        baselines=tuple(name for name in costs if name.startswith("torch")),
        inplace=inplace,
        check=common.relative_error,
    )


def test_in_place_rows_are_compared_with_in_place_baselines_only():
    """fastattn's in-place row is the fastest of all (1 s) but is timed against PyTorch's
    in-place row (1.5 s), not its out-of-place one (8 s); the out-of-place fastattn row (2 s)
    against the out-of-place baseline. Pairing across kinds would read 8x. (The rows are named
    as the bench modules name fastattn's own kernels, which the summary judges: own_kernel.)"""
    import run

    clock = FakeClock()
    costs = {"fastattn:cpu": 2.0, "fastattn:cpu inplace": 1.0, "torch": 8.0, "torch inplace": 1.5}
    case = _inplace_case(clock, costs, inplace=("fastattn:cpu inplace", "torch inplace"))
    rows = common.run_case(case, CPU, min_time=0.0, clock=clock)
    got = {r["provider"]: (r["inplace"], r["speedup"], r["against"]) for r in rows}
    assert got == {
        "fastattn:cpu": (False, 4.0, "torch"),
        "fastattn:cpu inplace": (True, 1.5, "torch inplace"),
        "torch": (False, 1.0, "torch"),
        "torch inplace": (True, 1.0, "torch inplace"),
    }
    assert "against" in common.format_table(rows)
    # the summary: in-place rows are a family of their own, each with its own pairing
    lines = run.summary_table([(types.SimpleNamespace(), rows)]).splitlines()
    assert [line.split()[:5] for line in lines[2:]] == [
        ["toy", "(float32)", "1", "4.00x", "4.00x"],
        ["toy", "in-place", "(float32)", "1", "1.50x"],
    ]
    assert "8.00x" not in "\n".join(lines)


def test_an_in_place_row_without_an_in_place_baseline_has_no_speedup():
    clock = FakeClock()
    case = _inplace_case(clock, {"fastattn inplace": 1.0, "torch": 8.0}, ("fastattn inplace",))
    rows = {r["provider"]: r for r in common.run_case(case, CPU, min_time=0.0, clock=clock)}
    assert rows["fastattn inplace"]["status"] == "ok"
    assert "speedup" not in rows["fastattn inplace"] and "against" not in rows["fastattn inplace"]
    assert rows["torch"]["speedup"] == 1.0


def test_a_case_naming_an_unknown_in_place_provider_is_refused():
    with pytest.raises(ValueError, match=r"inplace names \['torch inplace'\]"):
        _inplace_case(FakeClock(), {"fastattn": 1.0, "torch": 2.0}, ("torch inplace",))


def test_a_baseline_over_the_tolerance_is_timed_with_a_note_not_failed():
    """The accuracy rule judges fastattn's providers; a PyTorch baseline's own error is shown."""
    case = common.Case(
        op="toy",
        name="n=1",
        providers={
            "fastattn:cpu": lambda: torch.tensor([1.0]),
            "reference": lambda: torch.tensor([1.0]),
            "eager": lambda: torch.tensor([1.5]),
        },
        reference="reference",
        baselines=("reference", "eager"),
        check=common.relative_error,
        tolerance=1e-3,
    )
    rows = {r["provider"]: r for r in common.run_case(case, CPU, min_time=0.0)}
    assert rows["eager"]["status"] == "ok" and "median_ms" in rows["eager"]
    assert rows["eager"]["note"].startswith("baseline, not judged: error 5.00e-01 > 1.0e-03")
    assert rows["eager"]["judged"] is False and rows["fastattn:cpu"]["judged"] is True
    assert "note" not in rows["fastattn:cpu"]


def test_ground_truth_checks_follow_flashattentions_rule():
    """With a ground truth, a judged provider may be `factor` times as far from it as the
    reference provider (per output tensor), plus the tolerance as a floor."""
    truth = (torch.tensor([1.0]), torch.tensor([10.0]))

    def case(fast_outputs):
        return common.Case(
            op="toy",
            name="n=1",
            providers={
                "fastattn": lambda: fast_outputs,
                "torch": lambda: (torch.tensor([1.1]), torch.tensor([10.0])),
            },
            reference="torch",
            baselines=("torch",),
            check=common.relative_error,
            ground_truth=lambda: truth,
            factor=2.0,
            tolerance=1e-6,
        )

    within = (torch.tensor([1.15]), torch.tensor([10.0]))  # 0.15 <= 2 x 0.1
    rows = {r["provider"]: r for r in common.run_case(case(within), CPU, min_time=0.0)}
    assert rows["fastattn"]["status"] == "ok"
    assert rows["fastattn"]["error"] == pytest.approx(0.15)
    assert rows["torch"]["note"].startswith("own error 1.0e-01")
    # the second tensor: torch is exact there, so fastattn may be off by the floor only
    over = (torch.tensor([1.0]), torch.tensor([10.001]))
    rows = {r["provider"]: r for r in common.run_case(case(over), CPU, min_time=0.0)}
    assert rows["fastattn"]["status"].startswith("FAIL (error 1.00e-04 (output 1) > 2 x torch")
    assert "median_ms" not in rows["fastattn"]


def test_csv_with_an_older_header_is_rewritten_with_the_current_columns(tmp_path):
    path = tmp_path / "cpu.csv"
    path.write_text("time,op,provider,status\n2026-01-01T00:00:00,toy,a,ok\n")
    common.append_csv(
        path,
        [{"op": "toy", "provider": "b", "status": "ok", "note": "n"}],
        {"time": "2026-01-02T00:00:00"},
    )
    import csv

    rows = list(csv.DictReader(path.open()))
    assert list(rows[0]) == common.CSV_FIELDS
    assert [(r["time"][:10], r["provider"], r["note"]) for r in rows] == [
        ("2026-01-01", "a", ""),
        ("2026-01-02", "b", "n"),
    ]


def test_profiler_log_lines_are_dropped_and_other_stderr_output_kept(capfd):
    import os

    with common.without_profiler_logs():
        os.write(
            2,
            b"USDT:2026-11-26 13:47:23 22126:22126 SyncActivityProfilerHandler.cpp:39]"
            b" profiler_start\n",
        )
        os.write(
            2,
            b"ERROR:2026-11-26 13:47:23 22126:22126 DeviceProperties.cpp:56] "
            b"gpuGetDeviceCount failed with code 35\n",
        )
        os.write(2, b"a warning of our own\n")
    assert capfd.readouterr().err == "a warning of our own\n"


def test_run_finds_the_checkout_and_prints_progress_summary_and_plots(tmp_path):
    """`python benchmarks/run.py` from a source checkout that is not installed (here: the
    editable install's import hook removed, run from another directory, no PYTHONPATH) imports
    the checkout's fastattn, shows progress per case, a summary per op family, and writes plots
    whose paths it prints."""
    import os
    import subprocess

    root = Path(__file__).resolve().parents[1]
    if not (root / "fastattn" / "__init__.py").is_file():
        # tests/ and benchmarks/ copied beside an installed package (.ci/gpu_machine_check.sh):
        # there is no source checkout here for the run to find.
        pytest.skip("no fastattn source tree beside tests/ (an installed package is tested)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    script = (
        "import runpy, sys\n"
        "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f)]\n"
        "sys.path[:] = [p for p in sys.path if p not in ('', '.')]\n"
        f"sys.argv = ['run.py', '--ops', 'decoding', '--device', 'cpu', '--min-time', '0.01',"
        f" '--csv', {str(tmp_path / 'cpu.csv')!r}]\n"
        f"runpy.run_path({str(root / 'benchmarks' / 'run.py')!r}, run_name='__main__')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"fastattn from {root / 'fastattn'}" in out.stdout.splitlines()[0]
    assert "[op 1/1 decoding] case 1/" in out.stderr  # plain progress lines (no terminal)
    assert "summary (" in out.stdout and "op family" in out.stdout
    plots = [line.strip() for line in out.stdout.splitlines() if line.strip().endswith(".png")]
    assert plots and all(Path(p).exists() for p in plots)


def test_progress_draws_a_bar_on_a_terminal_and_plain_lines_otherwise():
    import io

    import run

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    progress = run.Progress(2, stream=terminal)
    progress.case(1, "attention", 3, 4, "attention fwd b=8")
    progress.clear()
    text = terminal.getvalue()
    assert text.startswith("\r\033[K[op 1/2 attention] case 3/4 [##########..........]")
    assert text.endswith("\r\033[K")
    log = io.StringIO()
    run.Progress(2, stream=log).case(2, "lstm", 1, 5, "lstm fwd T=100")
    assert log.getvalue().startswith("[op 2/2 lstm] case 1/5, 5 left in this op, 0s elapsed:")
    assert log.getvalue().count("\n") == 1


def test_a_case_with_a_speed_key_measures_an_entry_and_feeds_the_auto_summary():
    """A case with a speed key, fastattn's kernel row (Case.kernel), a torch-backend row and an
    automatic-choice row (bench_lstm.py and the others): the writer turns the kernel's and
    torch's times into an entry, the kernels' summary judges the kernel row only (torch's row,
    2x faster than the kernel, does not stand in for it) and the auto summary compares the
    auto row with the faster of the two. A case whose torch backend refused the call (no
    torch row, e.g. dropout) measures no entry."""
    import run
    import speed_table_writer

    from fastattn import speed_table

    clock = FakeClock()
    rows = []
    for name, features, costs in (
        ("n=1", (), {"fastattn:cpu": 2.0, "fastattn:torch": 1.0, "fastattn (auto)": 1.0}),
        ("n=1 p=0.1", ("dropout",), {"fastattn:cpu": 2.0, "fastattn (auto)": 2.0}),
    ):
        costs = {**costs, "torch": 4.0}
        case = common.Case(
            op="toy",
            name=name,
            providers={p: clock.provider(p, cost) for p, cost in costs.items()},
            reference="torch",
            baselines=("torch",),
            check=common.relative_error,
            speed_key=speed_table.key(
                "lstm", torch.float32, length=100, head_dim=512, features=features
            ),
            kernel="cpu",
        )
        rows += common.run_case(case, CPU, min_time=0.0, clock=clock)
    assert all(r["status"] == "ok" for r in rows)
    entries = speed_table_writer.entries_from_rows(rows)
    assert entries == [
        dict(
            op="lstm",
            dtype="float32",
            head_dim="<=512",
            length="<=256",
            features="plain",
            **{"pass": "fwd"},
            kernel="cpu",
            faster="torch",
            ratio=2.0,
            cases=1,
        )
    ]
    results = [(types.SimpleNamespace(), rows)]
    summary = run.summary_table(results).splitlines()[2].split()
    assert summary[:5] == ["toy", "(float32)", "2", "2.00x", "2.00x"]
    assert summary[-1] == "fastattn:cpu"
    auto = run.auto_summary(results)
    assert auto.startswith("toy (float32): fastattn (auto) at 1.00x (worst 1.00x)")
    assert "over 1 cases" in auto and auto.endswith("target >= 0.97x: met")


def _auto_case(clock, auto_costs, kernel_cost=2.0, torch_backend_cost=3.0, kernel_row=None):
    """A toy case with a speed key whose automatic-choice row runs fastattn's reference
    positional op (so last_backend names it) and costs auto_costs[i] on its i-th call."""
    import fastattn
    from fastattn import speed_table

    costs = iter(auto_costs)

    def auto():
        fastattn.add_sinusoidal(torch.zeros(1, 2, 4), backend="reference")
        clock.now += next(costs)
        return torch.tensor([1.0])

    row = kernel_row or "fastattn:cpu"
    providers = {
        row: clock.provider(row, kernel_cost),
        "fastattn:torch": clock.provider("fastattn:torch", torch_backend_cost),
        "fastattn (auto)": auto,
        "torch": clock.provider("torch", 4.0),
    }
    return common.Case(
        op="toy",
        name="n=1",
        providers=providers,
        reference="torch",
        baselines=("torch",),
        check=common.relative_error,
        speed_key=speed_table.key("lstm", torch.float32, length=100, head_dim=512),
        kernel="cpu",
        kernel_row=kernel_row,
    )


def test_the_auto_summary_judges_best_of_times_and_names_what_ran():
    """The automatic row runs another row's kernel: it is judged on paired per-round ratios
    (each round's fastest call), which additive noise (every other call 4x slower here, so
    its median is 2.5x the kernel's) leaves alone, and the summary says which backend it ran
    (last_backend, recorded once outside the timing). Those three rows get extra interleaved
    calls. A lookup that costs more than 3% of the call, and a wrong choice, are caught."""
    import run

    clock = FakeClock()
    noisy = _auto_case(clock, [2.0, 8.0] * 1000)
    rows = {r["provider"]: r for r in common.run_case(noisy, CPU, min_time=0.0, clock=clock)}
    auto = rows["fastattn (auto)"]
    assert auto["ran"] == "reference" and auto["auto_ratio"] == 1.0
    # the three rows the judgment reads get calls of their own after the common rounds
    assert clock.calls.count("fastattn:cpu") > clock.calls.count("torch") + 1
    assert auto["median_ms"] > 1.2 * rows["fastattn:cpu"]["median_ms"]
    summary = run.auto_summary([(None, list(rows.values()))])
    assert "at 1.00x (worst 1.00x)" in summary
    assert "(it ran: reference 1)" in summary and summary.endswith(": met")

    clock = FakeClock()
    slow_lookup = _auto_case(clock, [2.0 * 1.04] * 1000)
    rows = common.run_case(slow_lookup, CPU, min_time=0.0, clock=clock)
    assert run.auto_summary([(None, rows)]).endswith("target >= 0.97x: not met")

    clock = FakeClock()  # a wrong choice: auto runs as slowly as torch's 3 s, the kernel takes 2
    wrong_choice = _auto_case(clock, [3.0] * 1000)
    rows = {r["provider"]: r for r in common.run_case(wrong_choice, CPU, min_time=0.0, clock=clock)}
    assert rows["fastattn (auto)"]["auto_ratio"] == 2.0 / 3.0

    clock = FakeClock()  # the kernel's row under another name (bench_decoding's paged cases)
    paged = _auto_case(clock, [3.0] * 1000, kernel_row="fastattn:cpu paged")
    rows = {r["provider"]: r for r in common.run_case(paged, CPU, min_time=0.0, clock=clock)}
    assert rows["fastattn (auto)"]["auto_ratio"] == 2.0 / 3.0


def test_the_cpu_device_column_names_the_model_the_kernel_copy_and_the_threads():
    import fastattn

    name = common.device_name(torch.device("cpu"))
    info = fastattn.build_info()
    # "+amx" where bfloat16 attention runs its tile products on AMX
    isa = info["cpu_isa"] + ("+amx" if info["cpu_amx"] else "")
    assert name == f"cpu: {common.cpu_model()}, {isa}, {torch.get_num_threads()} threads"
    assert common.cpu_model()  # never empty: /proc/cpuinfo's model name or the platform's


def test_the_fma_peak_is_a_positive_rate_of_the_copy_that_runs():
    # A measured rate: only its being a finite positive number is checked (no wall-clock
    # comparison: the suite runs under load).
    import math

    peak = common.cpu_fma_peak(repeats=1)
    assert math.isfinite(peak) and peak > 0
