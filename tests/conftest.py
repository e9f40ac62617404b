"""Test configuration shared by every test file.

- Without a CUDA device the Triton backend runs under Triton's interpreter: TRITON_INTERPRET=1
  must be set before triton is imported, so it is set here, before fastattn is imported.
- The automatic choice ignores the shipped speed tables (FASTATTN_AUTO=kernels, read at
  import): the tests of fastattn's kernels then run them whatever machine the suite runs on.
  The tests of the choice itself install synthetic tables and switch the table back on
  (tests/test_speed_table.py).
- Every test runs with output poisoning on (fastattn._debug): ops fill their outputs with NaN
  before their kernels run, so an unwritten element fails the comparison.
- `backend_device` maps each backend to the device its tests use; CUDA-only cases skip with a
  reason per test, never at import.
- The run ends with the number of passed tests per backend that made at least one passing
  comparison with an independent oracle (tolerance.assert_fa_close and the asserts built on
  it), and how many such comparisons they made; under pytest-xdist the workers send their
  counts to the controller in the reports' user_properties.
"""

import hashlib
import math
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("FASTATTN_AUTO", "kernels")

import pytest  # noqa: E402
import tolerance  # noqa: E402

import fastattn  # noqa: E402
from fastattn import _debug  # noqa: E402

ALL_BACKENDS = ("cpu", "cuda", "triton", "reference")


@pytest.fixture(autouse=True)
def _poison_outputs():
    with _debug.poison_outputs(True):
        yield


@pytest.fixture
def one_thread():
    """One intra-op thread for the test, restored after. Most test shapes are tiny, and with
    pytest -n 2 on a 2-core machine two OpenMP threads per worker spend more time waking each
    other than computing (50x slower per test when the machine is busy). A file opts in with
    pytestmark = pytest.mark.usefixtures("one_thread")."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _reset_backend():
    fastattn.set_backend(None)
    yield
    fastattn.set_backend(None)


def backend_device(backend: str) -> torch.device:
    """The device whose tensors `backend` runs in these tests (skips when unavailable)."""
    status = fastattn.available_backends()[backend]
    if status != "available":
        pytest.skip(f"backend {backend}: {status}")
    if backend == "cuda":
        return torch.device("cuda")
    if backend == "cpu":
        return torch.device("cpu")
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def require_kernel(kernel: str, backend: str) -> None:
    """For a test of `backend`'s kernel of the torch op fastattn::<kernel>: returns when this
    build has it, skips when the build legitimately has none, and fails when the build claims
    it but the op lacks it, so that a lost kernel registration turns its tests red, not into
    skips.

    What a build claims: CMakeLists.txt compiles every csrc/*/*_cpu.cpp into fastattn._C (no
    option leaves one out), and, when build_info()["cuda"], every csrc/*/*.cu into
    fastattn/_C_cuda.so; the op layer registers fastattn::<kernel>_triton for every op with
    Triton kernels once they import. So "cpu" is claimed once a fastattn._C was built (it must
    import); "cuda" once build_info()["cuda"] says so and torch has CUDA (the library must
    load); "triton" once the Triton kernels imported. The skips: no fastattn._C built, a build
    without CUDA or a torch without it, Triton kernels that cannot import here. Whether a
    device can run the backend stays backend_device's question."""
    from fastattn import _backend, _native

    if backend == "reference":
        return
    claim = None
    if backend in ("cpu", "cuda"):
        if _native.C is None:
            if not any(_native.CUDA_LIBRARY.parent.glob("_C*.so")):
                pytest.skip(f"backend {backend}: {_native.IMPORT_ERROR}")
            pytest.fail(
                f"backend {backend}: fastattn._C was built but does not import: "
                f"{_native.IMPORT_ERROR}"
            )
        claim = "fastattn._C was built from every csrc/*/*_cpu.cpp"
    if backend == "cuda":
        if not _native.C.build_info()["cuda"]:
            pytest.skip(f"backend cuda: {_native.CUDA_STATUS}")
        if torch.version.cuda is None:
            pytest.skip(f"backend cuda: {_native.CUDA_STATUS}")
        claim = "build_info()['cuda']: fastattn/_C_cuda.so was built from every csrc/*/*.cu"
        if _native.CUDA is None:
            pytest.fail(f"backend cuda: {claim}, but it is {_native.CUDA_STATUS}")
    if backend == "triton":
        if _backend.TRITON_IMPORT_ERROR is not None:
            pytest.skip(f"backend triton: {_backend.triton_status()}")
        claim = "the Triton kernels imported"
    why = _backend.missing_kernel(kernel, backend)
    if why:
        pytest.fail(f"backend {backend}: {claim}, but {why} (a lost kernel registration)")


@pytest.fixture(params=ALL_BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture
def device(backend) -> torch.device:
    return backend_device(backend)


def requires_cuda():
    return pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


# ---------------------------------------------------------------------------------------------
# Slow tests: one mechanism. A test marked @pytest.mark.slow runs when
# - FASTATTN_SLOW=1, or (FASTATTN_SLOW unset) the -m expression selects slow tests
#   (`pytest -m slow`): every one;
# - FASTATTN_SLOW=<fraction in (0, 1)>, e.g. 0.25 (with -m slow to run only those): a sample
#   of that share of each slow test function's cases (stratified by function, so every grid is
#   sampled), chosen by a hash of FASTATTN_SLOW_SEED (default 0) and the test's id: the same
#   seed runs the same cases;
# and is skipped with that reason otherwise.


def slow_share(config) -> float:
    """The share of slow cases to run: FASTATTN_SLOW when set (1 = all, or a fraction), else
    1.0 when the -m expression selects slow tests, else 0.0."""
    value = os.environ.get("FASTATTN_SLOW", "")
    if value in ("", "0"):
        markexpr = getattr(config.option, "markexpr", "") or ""
        return 1.0 if "slow" in markexpr and "not slow" not in markexpr else 0.0
    try:
        share = float(value)
    except ValueError:
        share = -1.0
    if not 0.0 < share <= 1.0:
        raise pytest.UsageError(f"FASTATTN_SLOW must be 1 or a fraction in (0, 1), got {value!r}")
    return share


@pytest.fixture
def run_all_slow(request) -> bool:
    """True when every slow case runs (FASTATTN_SLOW=1 or -m slow): tests whose long cases
    are decided at run time (the Triton interpreter's) run them only then."""
    return slow_share(request.config) >= 1.0


def _sample_rank(seed: str, nodeid: str) -> str:
    return hashlib.sha256(f"{seed}:{nodeid}".encode()).hexdigest()


def pytest_collection_modifyitems(config, items):
    share = slow_share(config)
    slow = [item for item in items if item.get_closest_marker("slow") is not None]
    if share >= 1.0 or not slow:
        return
    chosen: set[str] = set()
    if share > 0.0:
        seed = os.environ.get("FASTATTN_SLOW_SEED", "0")
        groups: dict[tuple[str, str], list] = {}
        for item in slow:
            groups.setdefault((str(item.path), item.originalname), []).append(item)
        for group in groups.values():
            ranked = sorted(group, key=lambda item: _sample_rank(seed, item.nodeid))
            chosen.update(item.nodeid for item in ranked[: math.ceil(share * len(ranked))])
    reason = (
        f"slow: not in this FASTATTN_SLOW={share} sample"
        if share > 0.0
        else "slow: run with FASTATTN_SLOW=1 or -m slow (FASTATTN_SLOW=0.25 for a quarter)"
    )
    for item in slow:
        if item.nodeid not in chosen:
            item.add_marker(pytest.mark.skip(reason=reason))


# ---------------------------------------------------------------------------------------------
# The oracle summary: passing tolerance.assert_fa_close comparisons per backend.

_ORACLE_PROPERTY = "oracle_comparisons"  # user_properties entry: (backend, comparisons)
# backend -> [passed tests, passed tests with an oracle comparison, comparisons]
_oracle_counts: dict[str, list[int]] = {}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    before = tolerance.passed_comparisons
    try:
        return (yield)
    finally:
        callspec = getattr(item, "callspec", None)
        backend = callspec.params.get("backend", "other") if callspec else "other"
        # user_properties travel with the call phase's report (xdist sends them to the
        # controller)
        item.user_properties.append(
            (_ORACLE_PROPERTY, (str(backend), tolerance.passed_comparisons - before))
        )


def pytest_runtest_logreport(report):
    if report.when != "call" or not report.passed:
        return
    for name, value in report.user_properties:
        if name == _ORACLE_PROPERTY:
            backend, comparisons = value
            counts = _oracle_counts.setdefault(backend, [0, 0, 0])
            counts[0] += 1
            counts[1] += comparisons > 0
            counts[2] += comparisons


def pytest_terminal_summary(terminalreporter, config):
    if hasattr(config, "workerinput") or not _oracle_counts:
        return  # an xdist worker: the controller prints the whole run's counts
    order = [b for b in ALL_BACKENDS if b in _oracle_counts]
    order += sorted(b for b in _oracle_counts if b not in ALL_BACKENDS)
    table = [("backend", "passed tests", "with an oracle comparison", "oracle comparisons")]
    table += [(b, *(str(n) for n in _oracle_counts[b])) for b in order]
    widths = [max(len(line[i]) for line in table) for i in range(len(table[0]))]
    terminalreporter.write_sep("-", "independent-oracle comparisons (tests/tolerance.py)")
    for line in table:
        terminalreporter.write_line("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip())
