# fastattn developer commands. `make bench` and `make test` work on a fresh machine: they
# create .venv (pinned torch/triton and tools) when absent, build and install the package
# (editable, CMake build cached under build/), then run the benchmarks or the tests.
PYTHON_BOOTSTRAP ?= $(shell command -v python3.11 || command -v python3)
VENV ?= .venv
PY := $(VENV)/bin/python
# CUDA archs: the visible GPU's alone (a fast build for the machine at hand), else setup.py's
# default for users (DEFAULT_CUDA_ARCHS), so that `make test` builds what `pip install .` builds
# and, in CI, reuses that build. The toolkit is found as setup.py finds it (tools/cuda_toolkit.py).
GPU_ARCH := $(shell nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1)
ifneq ($(GPU_ARCH),)
export TORCH_CUDA_ARCH_LIST ?= $(GPU_ARCH)
endif
export MAX_JOBS ?= $(shell nproc 2>/dev/null || echo 2)
PROFILE ?= quick
# A download that breaks off resumes instead of failing the install (the mirror's connection
# drops now and then).
export PIP_RESUME_RETRIES ?= 20
PYTEST_ARGS ?=

.PHONY: bench test test-extended build venv clean cpu-torch-check lint format wheel wheel-check fuzz sdist kernel-report

$(VENV)/.installed: requirements/dev.txt requirements/constraints.txt
	test -x $(PY) || $(PYTHON_BOOTSTRAP) -m venv $(VENV)
	$(PY) -m pip install --upgrade --quiet pip
	$(PY) -m pip install --quiet -r requirements/dev.txt
	touch $@

venv: $(VENV)/.installed

# The editable install re-runs the (incremental) CMake build. Builds on this machine take a
# lock so two of them (several checkouts, several sessions) never share its 2 cores.
BUILD_LOCK ?= /tmp/fastattn-build.lock
build: $(VENV)/.installed
	flock $(BUILD_LOCK) $(PY) -m pip install --quiet --no-build-isolation --no-deps -e .
	$(PY) -c "import fastattn, sys; info = fastattn.build_info(); print('fastattn build:', info); sys.exit('error' in info)"

test: build
	$(PY) -m fastattn
	$(PY) -m pytest tests $(PYTEST_ARGS)

# The checks `make test` leaves out (.ci/extended.sh: lower CPU ISA copies, the CUDA emulators,
# a sixteenth of the slow grids, the Triton sm_90 compile with the GPU machine's triton); CI runs
# one of them per commit, in turn. About half an hour on a 2-core machine.
test-extended: build
	bash .ci/extended.sh all

# Long differential fuzzing (tests/test_fuzz.py): 5000 examples per property with a random seed
# (CI runs 200, derandomized; FASTATTN_FUZZ_EXAMPLES=N sets another count). Failures are kept
# in .hypothesis/ and replayed first on the next run. Hours on a 2-core machine.
fuzz: build
	FASTATTN_FUZZ=long $(PY) -m pytest tests/test_fuzz.py -p no:cacheprovider -n $(MAX_JOBS) $(PYTEST_ARGS)

bench: build
	$(PY) -m fastattn
	$(PY) benchmarks/run.py --profile $(PROFILE)

# What the CUDA attention, recurrent and positional kernels compile to (registers, spills, shared memory, blocks per SM,
# the main loop's instruction mix), read from the build's SASS without a GPU, and checked against
# tools/kernel_report_baseline.json (tests/test_kernel_report.py runs the same check in CI).
# Needs a build with the CUDA kernels (FASTATTN_CUDA=1). Then the same for the Triton attention
# kernels compiled for sm_90 (tools/kernel_report_triton_baseline.json; needs only triton).
kernel-report: build
	$(PY) tools/kernel_report.py --check
	$(PY) tools/kernel_report.py --triton --check

# Lint and format: ruff (lint + format, 100 columns; pyproject.toml) for Python, clang-format
# (.clang-format) for csrc/ and tools/. `make lint` checks and changes nothing (CI runs it);
# `make format` rewrites. pre-commit runs the same tools (.pre-commit-config.yaml). `make lint`
# also type-checks fastattn/ with mypy (pyproject.toml's [tool.mypy]; the Triton kernel files
# are left out), against the venv's torch and triton.
CXX_SOURCES = $(shell git ls-files 'csrc/*.cpp' 'csrc/*.h' 'csrc/*.cu' 'csrc/*.cuh' 'tools/*.cpp' 'tools/*.h' 'tools/*.cu' 'tools/*.cuh')
lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/clang-format --dry-run --Werror $(CXX_SOURCES)
	$(VENV)/bin/mypy

format: $(VENV)/.installed
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .
	$(VENV)/bin/clang-format -i $(CXX_SOURCES)

# The documentation site (docs/: Sphinx with MyST pages and the API reference from the
# docstrings), built into build/docs with every warning an error (CI runs it, before any
# build: docs/conf.py imports the checkout's fastattn, whose Python parts import without the
# compiled extension). The docs tools (requirements/docs.txt) go into the same venv. The pages'
# Python examples run as tests (tests/test_docs.py), not here.
$(VENV)/.docs-installed: $(VENV)/.installed requirements/docs.txt
	$(PY) -m pip install --quiet -r requirements/docs.txt
	touch $@

.PHONY: docs
docs: $(VENV)/.docs-installed
	$(PY) -m sphinx -W --keep-going -q -b html docs build/docs

# Builds against the CPU-only torch 2.13.0 in a second venv and runs the CPU-side smoke tests.
cpu-torch-check:
	bash .ci/cpu_torch_check.sh

# One wheel for every torch (docs/design/stable_abi.md): the build of .venv (the same CMake folder as
# `make build`), compiled for the stable ABI of torch 2.11, packaged; then installed unchanged
# into a CPU-only torch 2.13.0 venv and a torch 2.14.1 venv and tested there.
wheel:
	bash .ci/build_wheel.sh

wheel-check:
	bash .ci/wheel_check.sh

# The source distribution (MANIFEST.in: csrc/, CMakeLists.txt, the build's tools), from which
# the README's source install builds; CI builds it so against the CPU-only torch 2.13.0
# (.ci/cpu_torch_check.sh).
sdist: $(VENV)/.installed
	$(PY) -m build --sdist --no-isolation --outdir dist .

clean:
	rm -rf build *.egg-info fastattn/_C*.so dist
