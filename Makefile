# Two entry points on a fresh machine with only Python: `make demo` and `make test`.
# torch==2.13.0 is installed first, on its own: that resolves to the local CPU build, and the
# package's `torch` range is then already satisfied (no CUDA wheels are pulled).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
EXTRAS := jax,torch,hf,peft,transformers,trl,accelerate,lightning,keras,grain,compat,notebooks,test,lint
# What `make lint` checks with ruff; mypy checks the packages named in pyproject.toml.
LINT_PATHS := jaxckpt torch_bridge tests benchmarks

.PHONY: demo test lint wheels install clean gpu-check

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[$(EXTRAS)]'
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(BIN)/jaxckpt demo

# Lint and types first: a finding fails the run before the (long) suite starts.
lint: $(VENV)/.installed
	$(BIN)/ruff check $(LINT_PATHS)
	$(BIN)/mypy

# Two workers, whole files each (--dist loadfile: a file's module fixtures, such as its S3
# or GCS server, start once): most of the suite waits on child processes and disks, so two
# workers on two cores take about two thirds of the serial time.
test: lint
	$(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=25

# The wheel installed alone per extra set (base, jax, torch, hf) in fresh venvs, each running
# a save/restore smoke program: minutes of installs, so CI runs it beside `make test`.
wheels: $(VENV)/.installed
	JAXCKPT_WHEELS=1 $(BIN)/python -m pytest -q -m wheels tests/system/test_wheel_extras.py

# The CUDA paths on this machine's GPUs (sharded jax.Arrays, async staging, kill/resume,
# DCP with pinned memory and NCCL): under 8 minutes on one GPU; a results table in
# gpu-check-results.md. Without a GPU it says so and exits 0. GPU_CHECK_ARGS: e.g. --cpu.
# The venv is used as it is, never reinstalled: GPU machines may have no network (and a CUDA
# jax or torch installed by hand that a reinstall could replace).
gpu-check:
	@test -x $(BIN)/python || { echo "gpu-check: no $(BIN)/python: run make install" >&2; exit 2; }
	$(BIN)/python -m jaxckpt.tools.gpu_check $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache .mypy_cache .ruff_cache
