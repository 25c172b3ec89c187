"""Every model-pair preset composes and validates against 8 GPUs without any GPU: the
paper's setup (docs/REPRODUCE.md) with its per-pair α / lower bound / δ_step, agents, resource
pools against the GPUs, and batch divisibility; the one-GPU presets too (their memory plans:
tests/test_planner.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from recipe_hacpo.config import ConfigError, agent_verl_config, validate
from recipe_hacpo.methods import method_for
from helpers.compose import compose_config as _compose

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"

# pair -> (α, lower bound 1 − δ, δ_step, agent A hub id, agent B hub id), docs/REPRODUCE.md
PAPER = {
    "qwen3-4b_qwen3-4b-instruct": (3.0, 0.8, 0.01, "Qwen/Qwen3-4B", "Qwen/Qwen3-4B-Instruct-2507"),
    "qwen3-1p7b-base_qwen3-4b-base": (1.0, 0.8, 0.025, "Qwen/Qwen3-1.7B-Base", "Qwen/Qwen3-4B-Base"),
    "qwen3-4b-base_qwen3-8b-base": (3.0, 0.8, 0.025, "Qwen/Qwen3-4B-Base", "Qwen/Qwen3-8B-Base"),
    "llama3p2-1b-instruct_llama3p2-3b-instruct": (
        1.0, 0.9, 0.01, "meta-llama/Llama-3.2-1B-Instruct", "meta-llama/Llama-3.2-3B-Instruct",
    ),
    "qwen3-1p7b-base_llama3p2-1b-instruct": (1.0, 0.8, 0.025, "Qwen/Qwen3-1.7B-Base", "meta-llama/Llama-3.2-1B-Instruct"),
    "qwen3-4b-base_llama3p2-3b-instruct": (1.0, 0.8, 0.025, "Qwen/Qwen3-4B-Base", "meta-llama/Llama-3.2-3B-Instruct"),
}
# the one-GPU debug pair: not a paper pair, the paper's defaults
DEBUG = {
    "qwen3-0p6b-base_llama3p2-1b-instruct": (1.0, 0.8, 0.025, "Qwen/Qwen3-0.6B-Base", "meta-llama/Llama-3.2-1B-Instruct"),
}
PAIRS = PAPER | DEBUG
PRESETS = sorted(p.stem for p in CONFIGS.glob("pair_*.yaml"))
GPUS_8 = ["++ray_kwargs.ray_init.num_gpus=8"]
# what run_scripts/_run_pair.sh adds for PLACEMENT=shared
SHARED = [
    "agents.qwen3_4b_base.n_gpus_per_node=0",
    "agents.qwen3_8b_base.n_gpus_per_node=0",
    "actor_rollout_ref.actor.fsdp_config.param_offload=true",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.35",
]


def _pair(preset: str) -> str:
    return preset.removeprefix("pair_").removesuffix("_4gpu").removesuffix("_1gpu").removesuffix("_lora")




@pytest.fixture(autouse=True)
def _no_path_env(monkeypatch):
    for var in ("HACPO_MODEL_A", "HACPO_MODEL_B", "HACPO_DATA_DIR", "HACPO_OUTPUT_DIR"):
        monkeypatch.delenv(var, raising=False)


def test_every_paper_pair_has_a_preset():
    assert set(PAIRS) == {_pair(p) for p in PRESETS}
    assert {f"pair_{pair}" for pair in PAPER} <= set(PRESETS)
    # a smaller-footprint variant for every pair but the largest
    assert {p for p in PRESETS if p.endswith("_4gpu")} == {
        f"pair_{pair}_4gpu" for pair in PAPER if pair != "qwen3-4b-base_qwen3-8b-base"
    }
    # one GPU: the debug pair (24 GiB), one paper pair (80 GiB), and the largest pair with LoRA agents
    assert {p for p in PRESETS if p.endswith("_1gpu")} == {
        "pair_qwen3-0p6b-base_llama3p2-1b-instruct_1gpu", "pair_qwen3-1p7b-base_llama3p2-1b-instruct_1gpu",
        "pair_qwen3-4b-base_qwen3-8b-base_lora_1gpu"}
    for preset in PRESETS:
        text = (CONFIGS / f"{preset}.yaml").read_text()
        # primary configs: Hydra reads the search path from the primary config only
        assert "pkg://verl.trainer.config" in text and "- hacpo_base\n  - _self_" in text


@pytest.mark.parametrize("preset", PRESETS)
def test_preset_composes_and_validates_on_8_gpus(preset):
    alpha, lower, delta_step, model_a, model_b = PAIRS[_pair(preset)]
    cfg = _compose(preset, GPUS_8)
    specs, hacpo = validate(cfg, check_paths=False)

    assert [s.model_path for s in specs] == [model_a, model_b]
    assert [s.rollout_n for s in specs] == [8, 8]
    assert (hacpo.mode, hacpo.cross_clip, hacpo.window) == ("hacpo", "stepwise", 5)
    assert hacpo.alpha == alpha and hacpo.delta_step == delta_step
    assert 1 - hacpo.delta == pytest.approx(lower)

    # the paper's setup
    lengths = (512, 1024) if _pair(preset) in DEBUG else (1024, 4096)  # the debug pair's short responses
    assert (cfg.data.train_batch_size, cfg.data.max_prompt_length, cfg.data.max_response_length) == (128, *lengths)
    assert cfg.data.train_files == "data/paper/math_train.parquet"
    actor = cfg.actor_rollout_ref.actor
    # a LoRA preset's adapters take a larger step than the paper's full fine-tuning
    assert actor.ppo_mini_batch_size == 32 and actor.optim.lr == (1e-5 if "_lora" in preset else 1e-6)
    assert cfg.actor_rollout_ref.model.lora_rank == (64 if "_lora" in preset else 0)
    assert (actor.policy_loss.loss_mode, actor.loss_agg_mode) == ("gspo", "seq-mean-token-mean")
    assert (actor.clip_ratio_low, actor.clip_ratio_high) == (3e-4, 4e-4)
    rollout = cfg.actor_rollout_ref.rollout
    assert rollout.name == "vllm" and rollout.temperature == 1.0
    # vLLM's context is the prompt plus the response, not the model's maximum
    assert rollout.max_model_len == cfg.data.max_prompt_length + cfg.data.max_response_length
    assert cfg.trainer.total_epochs == 1 and cfg.trainer.nnodes == 1

    # placement: one pool of 4 GPUs per agent on 8 GPUs, or one shared pool of 4 GPUs or of 1
    if preset.endswith(("_4gpu", "_1gpu")):
        gpus = int(preset[-4])
        assert [s.n_gpus_per_node for s in specs] == [0, 0] and cfg.trainer.n_gpus_per_node == gpus
        assert actor.fsdp_config.param_offload and actor.fsdp_config.optimizer_offload
        # every replica reserves its share at start-up: the sum stays within the shared-pool bound
        assert 2 * rollout.gpu_memory_utilization <= 0.8
    else:
        assert [s.n_gpus_per_node for s in specs] == [4, 4] and cfg.trainer.n_gpus_per_node == 8
    # the GPU the plan is judged against: the debug pair's 24 GiB, else 80 GiB
    assert cfg.trainer.gpu_memory_gib == (24 if _pair(preset) in DEBUG else 80)

    for spec in specs:
        agent = agent_verl_config(cfg, spec)
        assert agent.actor_rollout_ref.model.path == spec.model_path
        assert agent.actor_rollout_ref.rollout.n == 8
        assert agent.trainer.n_gpus_per_node == (spec.n_gpus_per_node or cfg.trainer.n_gpus_per_node)


def test_paths_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("HACPO_MODEL_A", "/models/a")
    monkeypatch.setenv("HACPO_MODEL_B", "/models/b")
    monkeypatch.setenv("HACPO_DATA_DIR", "/data/hacpo")
    monkeypatch.setenv("HACPO_OUTPUT_DIR", "/runs")
    cfg = _compose("pair_qwen3-4b-base_llama3p2-3b-instruct", GPUS_8)
    specs, _ = validate(cfg, check_paths=False)
    assert [s.model_path for s in specs] == ["/models/a", "/models/b"]
    assert cfg.data.train_files == "/data/hacpo/math_train.parquet"
    assert cfg.data.val_files == "/data/hacpo/math500_test.parquet"
    assert cfg.trainer.default_local_dir == "/runs/qwen3-4b-base_llama3p2-3b-instruct_hacpo/checkpoints"


@pytest.mark.parametrize(
    "overrides, gpus",
    [
        # run_scripts/pair_*.sh PLACEMENT=shared: both agents on one pool of 8, actors offloaded
        # and vLLM at 0.35 (both replicas reserve their share at start-up, before their first sleep)
        (SHARED, 8),
        # the SLURM script on 2 nodes x 8 GPUs: one node per agent
        (["trainer.nnodes=2", "agents.qwen3_4b_base.n_gpus_per_node=8", "agents.qwen3_8b_base.n_gpus_per_node=8"], 16),
        # the SLURM script with PLACEMENT=shared on 2 nodes x 8 GPUs
        (["trainer.nnodes=2"] + SHARED, 16),
    ],
)
def test_placement_variants_validate(overrides, gpus):
    cfg = _compose("pair_qwen3-4b-base_qwen3-8b-base", overrides + [f"++ray_kwargs.ray_init.num_gpus={gpus}"])
    validate(cfg, check_paths=False)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["++ray_kwargs.ray_init.num_gpus=4"], r"pools need 8 GPUs .* but the cluster has 4"),
        (GPUS_8 + ["actor_rollout_ref.actor.ppo_mini_batch_size=48"], r"data\.train_batch_size=128 is not divisible by .*ppo_mini_batch_size=48"),
        (GPUS_8 + ["agents.qwen3_4b_instruct.n_gpus_per_node=3"], r"agents\.qwen3_4b_instruct: a mini-batch of 512 rows .* does not split over its 3 GPUs"),
        (GPUS_8 + ["agents.qwen3_4b_instruct.model_path="], r"agents\.qwen3_4b_instruct\.model_path: missing"),
    ],
)
def test_bad_preset_overrides_are_rejected(overrides, message):
    cfg = _compose("pair_qwen3-4b_qwen3-4b-instruct", overrides)
    with pytest.raises(ConfigError, match=message) as err:
        validate(cfg, check_paths=False)
    assert "\n" not in str(err.value)


def test_cfg_job_through_the_entry_point():
    env = {k: v for k, v in os.environ.items() if not k.startswith("HACPO_")}
    env["HACPO_MODEL_B"] = "/models/llama-3b"
    proc = subprocess.run(
        [sys.executable, "-m", "recipe_hacpo.main", "--config-name", "pair_qwen3-4b-base_llama3p2-3b-instruct",
         "--cfg", "job", "--resolve"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert "model_path: Qwen/Qwen3-4B-Base" in out and "model_path: /models/llama-3b" in out
    assert "train_files: data/paper/math_train.parquet" in out
    assert "loss_mode: gspo" in out and "delta_step: 0.025" in out


# method -> (mode, loss_mode, clip low/high, samples per prompt and agent, rollouts per update,
# updates per 128-prompt step), docs/ALGORITHM.md §5 and its baselines: every method trains on 512 rollouts an update
METHODS = {
    None: ("hacpo", "gspo", (3e-4, 4e-4), 8, 512, 4),  # the preset as it is
    "hacpo": ("hacpo", "gspo", (3e-4, 4e-4), 8, 512, 4),
    "naive": ("naive", "gspo", (3e-4, 4e-4), 8, 512, 4),
    "gspo": ("isolated", "gspo", (3e-4, 4e-4), 8, 512, 2),
    "gspo2x": ("isolated", "gspo", (3e-4, 4e-4), 16, 512, 4),
    "gspo4x": ("isolated", "gspo", (3e-4, 4e-4), 32, 512, 8),
    "grpo": ("isolated", "vanilla", (0.2, 0.28), 8, 512, 2),
    "grpo2x": ("isolated", "vanilla", (0.2, 0.28), 16, 512, 4),
    # GRAFT's paper: GRPO n = 32 in the same 32-prompt mini-batches as n = 8 and 16
    "grpo4x": ("isolated", "vanilla", (0.2, 0.28), 32, 1024, 4),
    # GRAFT's own loss replaces verl's (loss_mode not read); the paper's 32-prompt updates, each
    # prompt one agent's group of 8
    "graft": ("graft", None, (0.2, 0.28), 8, 256, 4),
    # SGT: GRPO's 32-prompt updates, each prompt group n own rows plus its one imitation slot
    "sgt": ("sgt", None, (0.2, 0.28), 8, 288, 4),
}


@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("preset", PRESETS)
def test_every_method_makes_the_papers_updates(preset, method):
    mode, loss_mode, clip, n, rows_per_update, updates = METHODS[method]
    cfg = _compose(preset, GPUS_8 + ([f"+baseline={method}"] if method else []))
    specs, hacpo = validate(cfg, check_paths=False)
    assert hacpo.mode == mode
    # the per-pair α / δ / δ_step of the preset survive the method switch
    alpha, lower, delta_step, *_ = PAIRS[_pair(preset)]
    assert (hacpo.alpha, hacpo.delta_step) == (alpha, delta_step) and 1 - hacpo.delta == pytest.approx(lower)
    for spec in specs:
        actor = agent_verl_config(cfg, spec).actor_rollout_ref.actor
        assert loss_mode is None or actor.policy_loss.loss_mode == loss_mode
        assert (actor.clip_ratio_low, actor.clip_ratio_high) == clip
        assert spec.rollout_n == n
        if mode == "sgt":
            rows_per_prompt = spec.rollout_n + 1
        elif method_for(hacpo.mode).shares and mode != "graft":
            rows_per_prompt = sum(s.rollout_n for s in specs)
        else:
            rows_per_prompt = spec.rollout_n
        assert actor.ppo_mini_batch_size * rows_per_prompt == rows_per_update
        assert cfg.data.train_batch_size // actor.ppo_mini_batch_size * actor.ppo_epochs == updates


def test_baseline_group_ships_with_the_package():
    text = (REPO / "pyproject.toml").read_text()
    assert '"baseline/*.yaml"' in text
    shipped = {p.stem for p in (CONFIGS / "baseline").glob("*.yaml")}
    assert shipped == {m for m in METHODS if m}
