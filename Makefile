# Two commands do all set-up on a fresh machine:
#   make run    start the service (built-in demo model when MODEL is unset; CPU when there is no GPU)
#   make test   run the test suite (GPU tests are skipped where there is no GPU)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# torch is installed first and pinned: an unpinned install would pull a multi-GB CUDA build.
TORCH_SPEC ?= torch==2.13.0
MODEL ?=
PORT ?= 8000
ARGS ?=
PYTEST_ARGS ?=

.PHONY: run test setup lint clean bench-kernel bench-engine

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e ".[test]"
	touch $@

setup: $(VENV)/.installed

run: setup
	$(PY) -m teacher_server serve --port $(PORT) $(if $(MODEL),--model $(MODEL)) $(ARGS)

test: setup
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench-kernel: setup
	$(PY) bench/bench_kernel.py

bench-engine: setup
	$(PY) bench/bench_engine.py

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
