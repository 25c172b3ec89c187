"""vLLM on CPU without vLLM: the environment and head-size checks, the per-row seeds and the CPU
engine settings of `workers/vllm_rollout.py` as pure functions, and the one-line refusal of a
`rollout.name=vllm` CPU run before Ray in an environment that cannot serve it (this one)."""

from __future__ import annotations

import importlib.util
import json
import os

import pytest
from omegaconf import OmegaConf

from recipe_hacpo import tiny_agents
from recipe_hacpo.workers import vllm_cpu
from recipe_hacpo.workers.seeded_sampling import request_seed
from recipe_hacpo.workers.vllm_rollout import cpu_engine_settings, per_row_sampling

needs_no_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")


def _cpuinfo(tmp_path, flags: str) -> str:
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    return str(path)


def test_cpu_flags_are_read_from_the_first_processor(tmp_path):
    assert vllm_cpu.cpu_flags(_cpuinfo(tmp_path, "fpu sse2 avx2 avx512f")) == {"fpu", "sse2", "avx2", "avx512f"}
    assert vllm_cpu.cpu_flags(str(tmp_path / "missing")) is None


@needs_no_vllm
def test_environment_without_vllm_is_named():
    assert vllm_cpu.environment_problem() == "no vLLM in this environment (`make venv-vllm` builds .venv-vllm with vllm-cpu; run from there)"


def test_environment_with_a_gpu_build_or_an_old_cpu_is_named(tmp_path, monkeypatch):
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.24.0")
    assert vllm_cpu.environment_problem().startswith("vllm 0.24.0 is not a CPU build")
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.24.0+cpu")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: object())
    assert vllm_cpu.environment_problem(_cpuinfo(tmp_path, "fpu sse2 avx2")) is None
    assert vllm_cpu.environment_problem(_cpuinfo(tmp_path, "fpu sse2 avx512f")) is None
    assert vllm_cpu.environment_problem(_cpuinfo(tmp_path, "fpu sse2 avx")) == (
        "this CPU has neither AVX512F nor AVX2, which vllm-cpu's kernels need"
    )
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert "its package is missing" in vllm_cpu.environment_problem()


def test_head_sizes_of_the_tiny_agents(tmp_path):
    sizes = {kind: tiny_agents.head_size(kind) for kind in tiny_agents.ALL_KINDS}
    # the vLLM tier's agents and the presets' architectures are the ones vLLM's CPU attention takes
    vllm_sized = set(tiny_agents.VLLM_CPU_KINDS) | set(tiny_agents.REAL_ARCH_KINDS)
    assert {k for k, s in sizes.items() if s in vllm_cpu.CPU_ATTENTION_HEAD_SIZES} == vllm_sized
    assert sizes["qwen3-tied"] == 32 != tiny_agents.ALL_KINDS["qwen3-tied"].hidden_size // 4
    small = tiny_agents.build_agent(str(tmp_path), "qwen2-char-small")
    ok = tiny_agents.build_agent(str(tmp_path), "qwen2-char-h32")
    assert vllm_cpu.head_size(small) == 16 and vllm_cpu.head_size(ok) == 32
    assert vllm_cpu.head_size_problem(ok) is None
    assert vllm_cpu.head_size_problem(small).startswith("head size 16 is not supported by vLLM's CPU attention")
    # an explicit head_dim wins over hidden / heads; no config.json: unknown, not refused
    (tmp_path / "explicit").mkdir()
    (tmp_path / "explicit" / "config.json").write_text(json.dumps({"hidden_size": 64, "num_attention_heads": 4, "head_dim": 128}))
    assert vllm_cpu.head_size(str(tmp_path / "explicit")) == 128
    assert vllm_cpu.head_size_problem(str(tmp_path / "nowhere")) is None


def _rollout(full_determinism=True, seed=0):
    return OmegaConf.create({"full_determinism": full_determinism, "seed": seed})


def test_per_row_seeds_are_the_hf_backends_and_distinct_per_row():
    config = _rollout(seed=7)
    prompt = [3, 1, 4, 1, 5]
    seeds = [per_row_sampling({"temperature": 1.0}, config, 2, f"det-{row}", prompt)["seed"] for row in range(8)]
    # G requests of one prompt: G different seeds (verl gives all of them `replica_rank + seed`)
    assert len(set(seeds)) == 8
    assert seeds[3] == request_seed(7, 2, "det-3", prompt)
    # the step (weights version) and the prompt enter the seed too
    assert per_row_sampling({}, config, 3, "det-3", prompt)["seed"] != seeds[3]
    assert per_row_sampling({}, config, 2, "det-3", prompt + [9])["seed"] != seeds[3]


def test_per_row_seeds_leave_a_callers_seed_and_nondeterministic_runs_alone():
    params = {"temperature": 1.0, "seed": 123}
    assert per_row_sampling(params, _rollout(), 0, "det-0", [1]) is params
    params = {"temperature": 1.0}
    assert per_row_sampling(params, _rollout(full_determinism=False), 0, "abc", [1]) is params
    # the caller's dict is not changed
    out = per_row_sampling(params, _rollout(), 0, "det-0", [1])
    assert "seed" in out and "seed" not in params


def test_cpu_engine_settings():
    assert cpu_engine_settings(_rollout(full_determinism=False)) == {"enable_sleep_mode": False, "free_cache_engine": False}
    assert cpu_engine_settings(_rollout()) == {
        "enable_sleep_mode": False, "free_cache_engine": False, "enable_chunked_prefill": False,
    }


def test_cpu_engine_env_is_set_for_spawned_engines_and_an_explicit_value_wins(monkeypatch):
    for key in vllm_cpu.CPU_ENGINE_ENV:
        monkeypatch.setenv(key, "set")  # so that the value this test leaves is undone too
        monkeypatch.delenv(key)
    vllm_cpu.set_cpu_engine_env()
    assert {k: os.environ[k] for k in vllm_cpu.CPU_ENGINE_ENV} == {"TORCH_COMPILE_DISABLE": "1"}
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "0")
    vllm_cpu.set_cpu_engine_env()
    assert os.environ["TORCH_COMPILE_DISABLE"] == "0"


@needs_no_vllm
def test_a_vllm_cpu_run_is_refused_before_ray_in_one_line(tmp_path):
    from hydra import compose, initialize_config_module

    from recipe_hacpo.config import ConfigError, validate

    paths = tiny_agents.build_default_agents(str(tmp_path), ("qwen2-char-h32", "llama-pair-h32"))
    with initialize_config_module("recipe_hacpo.configs", version_base=None):
        cfg = compose("hacpo_cpu_demo", overrides=[
            "+rollout=vllm_cpu", f"agents.qwen_char.model_path={paths['qwen2-char-h32']}",
            f"agents.llama_pair.model_path={paths['llama-pair-h32']}",
        ])
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert str(err.value) == (
        "actor_rollout_ref.rollout.name=vllm with trainer.device=cpu (qwen_char): no vLLM in this environment "
        "(`make venv-vllm` builds .venv-vllm with vllm-cpu; run from there)"
    )
    assert "\n" not in str(err.value)


# rollout keys on which a GPU preset may differ from the vLLM tier, and why; every other key of
# verl's rollout config is the same in both, so what the tier runs is what a GPU run runs
_TIER_ONLY = {
    # sizes of the tiny task and machine
    "n", "prompt_length", "response_length", "max_model_len", "max_num_seqs", "max_num_batched_tokens",
    "log_prob_micro_batch_size_per_gpu", "agent.num_workers", "n_gpus_per_node", "gpu_memory_utilization",
    # names of the agents and runs
    "custom.agent_name", "prometheus.served_model_name", "trace.project_name", "trace.experiment_name",
    # the CPU: fp32 (bf16 log-probs would not match to 1e-5), no CUDA graphs, a small KV cache
    "dtype", "enforce_eager", "engine_kwargs.vllm.kv_cache_memory_bytes",
    # identical reruns, for the resume test (works on GPU too since per-row seeds)
    "full_determinism",
}


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = None if value == {} else value  # an empty section is an unset one
    return out


def test_every_gpu_preset_shares_the_vllm_tiers_rollout_keys():
    from pathlib import Path

    from hydra import compose, initialize_config_module

    from recipe_hacpo.config import agent_specs, agent_verl_config

    def rollouts(name: str, overrides=()):
        with initialize_config_module("recipe_hacpo.configs", version_base=None):
            cfg = compose(name, overrides=list(overrides))
        return [_flat(OmegaConf.to_container(agent_verl_config(cfg, s).actor_rollout_ref.rollout, resolve=True))
                for s in agent_specs(cfg)]

    tier = rollouts("hacpo_cpu_demo", ["+rollout=vllm_cpu"])[0]
    presets = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "configs").glob("pair_*.yaml"))
    assert len(presets) >= 10
    for preset in presets:
        for rollout in rollouts(preset):
            differ = {k for k in set(tier) | set(rollout) if tier.get(k) != rollout.get(k)}
            assert differ <= _TIER_ONLY, (preset, {k: (tier.get(k), rollout.get(k)) for k in differ - _TIER_ONLY})
            assert rollout["name"] == tier["name"] == "vllm" and rollout["mode"] == "async"
