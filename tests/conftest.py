"""Test configuration shared by every test file.

- Without a CUDA device the Triton backend runs under Triton's interpreter: TRITON_INTERPRET=1
  must be set before triton is imported, so it is set here, before fastattn is imported.
- Every test runs with output poisoning on (fastattn._debug): ops fill their outputs with NaN
  before their kernels run, so an unwritten element fails the comparison.
- `backend_device` maps each backend to the device its tests use; CUDA-only cases skip with a
  reason per test, never at import.
- The run ends with the number of passed tests per backend that made at least one passing
  comparison with an independent oracle (tolerance.assert_fa_close and the asserts built on
  it), and how many such comparisons they made; under pytest-xdist the workers send their
  counts to the controller in the reports' user_properties.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

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


@pytest.fixture(params=ALL_BACKENDS)
def backend(request) -> str:
    return request.param


@pytest.fixture
def device(backend) -> torch.device:
    return backend_device(backend)


def requires_cuda():
    return pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


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
