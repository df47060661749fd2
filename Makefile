# Two commands do all set-up on a fresh machine:
#   make run    start the service (built-in demo model when MODEL is unset; CPU when there is no GPU)
#   make test   run the test suite (GPU tests are skipped where there is no GPU)
# `make run` installs the server only; `make test` adds the test tools.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is installed first and pinned: an unpinned install would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
MODEL ?=
PORT ?= 8000
ARGS ?=
PYTEST_ARGS ?=

.PHONY: run test setup setup-run setup-test lint clean bench-kernel bench-engine

# Stamps: the venv with torch; the server installed; the test tools added. `make run` stops at
# the second, so serving never installs pytest, transformers or the deployment checkers.
$(VENV)/.torch:
	$(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	touch $@

$(VENV)/.server: pyproject.toml $(VENV)/.torch
	$(PY) -m pip install -q -e ".[server]"
	touch $@

# requirements-swift.txt: ms-swift's GKD teacher client for tests/test_trainer_clients.py, without
# its dependencies (they cannot be resolved beside the test extra's TRL; the file says why).
# Triton where torch brought none (the CPU wheel): our kernels then run in its interpreter and
# compile for Hopper in the tests (tests/test_triton_sm90.py). A CUDA torch keeps the Triton it
# pins. 3.8.0: 3.6's interpreter fails on numpy >= 2.3 scalars, and 3.9 has no Python 3.10 wheel.
TRITON_SPEC ?= triton==3.8.0
$(VENV)/.test: pyproject.toml requirements-swift.txt $(VENV)/.server
	$(PY) -m pip install -q -e ".[server,test]"
	$(PY) -m pip install -q --no-deps -r requirements-swift.txt
	$(PY) -c "import triton" 2>/dev/null || $(PY) -m pip install -q "$(TRITON_SPEC)" \
	  || echo "no $(TRITON_SPEC) for this platform: the Triton kernels' CPU tests are skipped"
	touch $@

setup-run: $(VENV)/.server

setup-test: $(VENV)/.test

setup: setup-test

run: setup-run
	$(PY) -m teacher_server serve --port $(PORT) $(if $(MODEL),--model $(MODEL)) $(ARGS)

test: setup-test
	$(PY) -m pytest -q $(PYTEST_ARGS)

# ruff, configured in pyproject.toml ([tool.ruff]); CI runs it before the tests.
lint: setup-test
	$(PY) -m ruff check teacher_server tests bench examples

# The benchmarks' baseline runs transformers, which comes with the test tools.
bench-kernel: setup-test
	$(PY) bench/bench_kernel.py

bench-engine: setup-test
	$(PY) bench/bench_engine.py $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
