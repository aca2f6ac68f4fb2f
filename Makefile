# The PipeDream toolchain: `make demo` and `make test` work on a fresh clone with nothing before them.
#
# TORCH pins the torch install of the dev/CI venv (the CPU build here); a GPU user overrides it:
#   make install TORCH='torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128'
PYTHON ?= python3
VENV   ?= .venv
TORCH  ?= torch==2.13.0
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
OUT    ?= demo-out

# One thread per process: with more threads than free cores torch's spinning threads crawl.
export OMP_NUM_THREADS := 1
export MKL_NUM_THREADS := 1
export PYTHONDONTWRITEBYTECODE := 1

.PHONY: install demo test lint bench gpu-check clean

install: $(STAMP)

$(STAMP): setup.cfg pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[dev]"
	# The bytecode a regular install writes: under PYTHONDONTWRITEBYTECODE (below) every command would
	# compile our sources again, 60 ms of pdplan's 0.45 s on AlexNet (a stale file is still recompiled).
	$(BIN)/python -m compileall -q pdprof pdplan pdrun shared bench
	touch $(STAMP)

demo: install
	$(BIN)/python -m bench.demo --out $(OUT)

# Tests run in parallel, one pytest worker per core (pytest-xdist); those marked `serial` time the
# machine and run alone after the rest. Both parts always run; make fails if either failed.
# --dist worksteal: a worker that runs out takes queued tests from the other; with xdist's default the
# first worker sat idle the last 400 of 900 s while the second worked through its queue (2026-12-03).
# One worker more than cores: with one per core the CPUs sat 36% idle (tests wait on processes they
# start, on sockets and on timeouts); with one more they were 99% busy and the parallel part took 12:05
# against 13:31 (2,883 tests, 2 cores, 2026-12-03).
TEST_WORKERS ?= $(shell $(PYTHON) -c 'import os; print(len(os.sched_getaffinity(0)) + 1)')
test: install
	rc=0; \
	$(BIN)/python -m pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist worksteal -m "not serial" --durations=25 || rc=1; \
	$(BIN)/python -m pytest -q -p no:cacheprovider -m serial --durations=5 || rc=1; \
	exit $$rc

lint: install
	$(BIN)/ruff check pdprof pdplan pdrun shared tests bench
	$(BIN)/ruff format --check pdprof pdplan pdrun shared tests bench
	$(BIN)/mypy

bench: install
	$(BIN)/python -m bench.run_all

# On a machine with a GPU: pdprof times a zoo model with CUDA events; pdrun runs a 1- and a 2-stage plan on
# CUDA and equals sequential training; the three command lines profile, plan and train two models there.
# GPU_PY: a Python whose own torch sees the GPU and holds our packages' needs (no venv, nothing downloaded:
# `make gpu-check GPU_PY=python3` on a GPU host without a registry); by default the venv's.
GPU_PY ?= $(BIN)/python
GPU_OUT ?= gpu-out
gpu-check: $(if $(filter $(BIN)/python,$(GPU_PY)),install)
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PY) -m bench.gpu_check
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PY) -m bench.gpu_run_check
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(GPU_PY) -m bench.gpu_pipeline_check --out $(GPU_OUT)

clean:
	rm -rf $(VENV) $(OUT) $(GPU_OUT) .mypy_cache .ruff_cache .pytest_cache *.egg-info
