# Two entry points on a fresh clone: `make quickstart` (set up, then a short training) and `make test`.
PYTHON ?= python3
VENV ?= .venv
# The version the project is tested with: a CPU wheel on this project's machines, where pip looks in a local wheel
# folder first. Elsewhere PyPI's Linux wheel is the CUDA build; TORCH_INDEX=https://download.pytorch.org/whl/cpu
# takes the CPU build from PyTorch's own index, and TORCH=torch pip's newest.
TORCH ?= torch==2.13.0
TORCH_INDEX ?=
BIN := $(VENV)/bin

.PHONY: setup quickstart test lint

setup: $(BIN)/.installed

# Install torch before the package, so that pip does not resolve `torch` to a multi-GB CUDA build.
$(BIN)/.torch:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)" $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)")
	touch $@

# What the quick start runs, and no more: the package, its video extra (moviepy, pygame) and matplotlib for the
# run's curves.png.
$(BIN)/.installed-run: pyproject.toml $(BIN)/.torch
	$(BIN)/python -m pip install -q -e ".[video,plot]"
	touch $@

# Everything: the test tools and every extra (Atari, Box2D, EnvPool, optuna, numba, rl_zoo3, notebooks).
$(BIN)/.installed: pyproject.toml $(BIN)/.torch
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

quickstart: $(BIN)/.installed-run
	$(BIN)/python -m sb3_gpu.train ppo --env CartPole-v1 --device auto
	$(BIN)/python -m sb3_gpu.evaluate "$$(ls -td runs/ppo-CartPole-v1-* | head -n 1)" --video

lint: setup
	$(BIN)/ruff check sb3_gpu tests tools
	$(BIN)/ruff format --check sb3_gpu tests tools
	$(BIN)/mypy sb3_gpu

# Every test: -m "" takes back the default's leaving out of the slow and heavy ones (pyproject.toml), on TEST_WORKERS
# processes (pytest-xdist): most of the suite's time is one core compiling or training, so two workers on two cores
# take about half the time of one.
TEST_WORKERS ?= 2
test: lint
	$(BIN)/python -m pytest -m "" -n $(TEST_WORKERS)
