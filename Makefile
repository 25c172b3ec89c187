# The two commands of the README. Each creates the project's environment (.venv) when it is
# missing and reuses it when present; it is rebuilt when pyproject.toml changes.
#
#   make demo         the CPU demo (two tiny agents learn 3-digit addition together)
#   make test         every test, as CI runs them (.ci/run calls this target)
#   make test-quick   the tests that start no Ray cluster (675 tests; about 6 min on a
#                     2-core machine)
#   make venv         only create / refresh the environment
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
PYTEST_FLAGS ?= -q -p no:cacheprovider

.PHONY: demo test test-quick venv clean-venv

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

demo: $(STAMP)
	PATH="$(abspath $(VENV))/bin:$$PATH" bash run_scripts/cpu_demo.sh

test: $(STAMP)
	$(VPY) -m pytest $(PYTEST_FLAGS)

test-quick: $(STAMP)
	$(VPY) -m pytest $(PYTEST_FLAGS) -m "not ray and not e2e"

clean-venv:
	rm -rf $(VENV)
