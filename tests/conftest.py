"""Test configuration shared by every test file.

- Without a CUDA device the Triton backend runs under Triton's interpreter: TRITON_INTERPRET=1
  must be set before triton is imported, so it is set here, before fastattn is imported.
- Every test runs with output poisoning on (fastattn._debug): ops fill their outputs with NaN
  before their kernels run, so an unwritten element fails the comparison.
- `backend_device` maps each backend to the device its tests use; CUDA-only cases skip with a
  reason per test, never at import.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

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
