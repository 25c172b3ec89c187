"""The engine/trainer log-prob check (recipe_hacpo/rollout_check.py, `trainer.rollout_check`):
its statistics by hand, its limits per precision on healthy and faulty figures, its one-line
config errors, and the trainer's decision (stop before the update, warn, off) on stand-in rollouts.
The same check through verl's vLLM servers: tests/test_vllm_tier.py."""

from __future__ import annotations

import math

import pytest
import torch
from omegaconf import OmegaConf

from recipe_hacpo.config import ConfigError, validate
from recipe_hacpo.cluster.reliability import RolloutMismatchError
from recipe_hacpo.rollout_check import (
    ROLLOUT_CHECK_DEFAULTS,
    MismatchStats,
    RolloutCheck,
    agent_precision,
    mismatch_stats,
    precision_of,
    violations,
)
from recipe_hacpo.training.trainer import HacpoTrainer
from verl import DataProto
from helpers.compose import compose_config


def _compose(overrides: list[str]):
    return compose_config("hacpo_cpu_demo", overrides)


# ------------------------------------------------------------------ statistics by hand
def test_stats_by_hand_over_masked_tokens():
    engine = torch.tensor([[-1.0, -2.0, -3.0, 9.0], [-0.5, 7.0, 7.0, 7.0]], dtype=torch.float64)
    trainer = torch.tensor([[-1.1, -2.0, -2.7, 0.0], [-0.5, 0.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]])
    s = mismatch_stats(engine, trainer, mask)
    assert s.tokens == 4
    assert s.max_abs == pytest.approx(0.3)
    assert s.mean_abs == pytest.approx((0.1 + 0.0 + 0.3 + 0.0) / 4)
    # engine x = (-1, -2, -3, -0.5), trainer y = (-1.1, -2, -2.7, -0.5), by the textbook formula
    x, y = [-1.0, -2.0, -3.0, -0.5], [-1.1, -2.0, -2.7, -0.5]
    mx, my = sum(x) / 4, sum(y) / 4
    cov = sum((a - mx) * (b - my) for a, b in zip(x, y))
    r = cov / math.sqrt(sum((a - mx) ** 2 for a in x) * sum((b - my) ** 2 for b in y))
    assert s.pearson == pytest.approx(r, abs=1e-12)


def test_stats_of_nothing_and_of_a_constant_side():
    z = torch.zeros(2, 3)
    assert mismatch_stats(z, z, torch.zeros(2, 3)).tokens == 0
    s = mismatch_stats(torch.full((1, 3), -1.0), torch.tensor([[-1.0, -2.0, -3.0]]), torch.ones(1, 3))
    assert math.isnan(s.pearson) and s.max_abs == pytest.approx(2.0)


def test_stats_are_computed_in_float64_whatever_the_input_dtype():
    g = torch.Generator().manual_seed(0)
    trainer = -torch.rand(4, 64, generator=g) * 5
    engine = trainer + 1e-7
    mask = torch.ones(4, 64)
    s32 = mismatch_stats(engine.float(), trainer.float(), mask)
    s16 = mismatch_stats(engine.bfloat16(), trainer.bfloat16(), mask)
    assert s32.max_abs < 1e-5 and s16.pearson > 0.999


# ------------------------------------------------------------------ limits per precision
def _sample(n: int, noise: float, seed: int, outliers: int = 0, unrelated: bool = False):
    g = torch.Generator().manual_seed(seed)
    trainer = -torch.distributions.Exponential(1.0).sample((1, n)) * 2
    engine = trainer + noise * torch.randn(1, n, generator=g)
    if outliers:
        engine[0, :outliers] += 0.8  # rare tokens off by most of a nat, as in healthy bf16 runs
    if unrelated:  # an engine on another output layer: log-probs unrelated to the trainer's
        engine = -torch.distributions.Exponential(1.0).sample((1, n)) * 2
    return engine, trainer, torch.ones(1, n)


def test_healthy_runs_pass_and_faults_fire_at_each_precision():
    check = RolloutCheck.from_config(None)
    fp32, bf16 = check.limits("fp32"), check.limits("bf16")
    # fp32 healthy: ~1e-6 per token
    assert violations(mismatch_stats(*_sample(256, 1e-6, 0)), fp32, check.min_tokens) == []
    # fp32, a stale engine (one missed sync: ~0.06 per token) fires on mean and max
    stale = violations(mismatch_stats(*_sample(256, 0.06, 1)), fp32, check.min_tokens)
    assert any(v.startswith("max |Δ|") for v in stale) and any(v.startswith("mean |Δ|") for v in stale)
    # bf16 healthy: mean |Δ| near 0.05 and a few tokens near 0.8: no max limit, nothing fires
    healthy = mismatch_stats(*_sample(2048, 0.06, 2, outliers=4))
    assert healthy.max_abs > 0.7 and violations(healthy, bf16, check.min_tokens) == []
    # bf16, an engine sampling from a random output layer: the correlation collapses
    wrong = mismatch_stats(*_sample(2048, 0.0, 3, unrelated=True))
    assert wrong.pearson < 0.3
    assert any(v.startswith("pearson") for v in violations(wrong, bf16, check.min_tokens))


def test_correlation_is_not_judged_over_too_few_tokens():
    check = RolloutCheck.from_config({"bf16": {"mean_abs": None}})
    few = MismatchStats(tokens=5, max_abs=0.1, mean_abs=0.05, pearson=-0.5)
    assert violations(few, check.limits("bf16"), check.min_tokens) == []
    many = MismatchStats(tokens=500, max_abs=0.1, mean_abs=0.05, pearson=-0.5)
    assert violations(many, check.limits("bf16"), check.min_tokens) == ["pearson -0.500 < 0.9"]


def test_precision_is_fp32_only_when_both_sides_are():
    assert precision_of("fp32", "float32") == "fp32"
    assert precision_of("fp32", "bfloat16") == "bf16"
    assert precision_of("bf16", "float32") == "bf16"
    assert precision_of("fp16", "float16") == "bf16"
    demo = _compose([])
    assert agent_precision(demo) == "fp32"  # the CPU demo computes fp32 on both sides
    gpu = _compose(["actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype=bf16"])
    assert agent_precision(gpu) == "bf16"
    # verl sends a merged LoRA actor's weights to the engine in bfloat16, whatever the dtypes say
    merged = _compose(["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora.merge=true"])
    assert agent_precision(merged) == "bf16"
    unmerged = _compose(["actor_rollout_ref.model.lora_rank=8"])
    assert agent_precision(unmerged) == "fp32"


# ------------------------------------------------------------------ config
def test_defaults_are_declared_once_and_composed():
    node = OmegaConf.to_container(_compose([]).trainer.rollout_check)
    assert node == ROLLOUT_CHECK_DEFAULTS


@pytest.mark.parametrize(
    "node, message",
    [
        ({"action": "halt"}, "trainer.rollout_check.action='halt': must be one of stop, warn, off"),
        ({"fp32": {"mean_abs": -1}}, "trainer.rollout_check.fp32.mean_abs=-1: must be a number > 0 or null (null: no limit)"),
        ({"bf16": {"min_pearson": 2}}, "trainer.rollout_check.bf16.min_pearson=2: must be a number in [-1, 1] or null (null: no limit)"),
        ({"bf16": {"corr": 0.9}}, "trainer.rollout_check.bf16.corr: unknown key; known: max_abs, mean_abs, min_pearson"),
        ({"min_tokens": 1}, "trainer.rollout_check.min_tokens=1: must be an integer >= 2"),
        ({"limit": 1}, "trainer.rollout_check.limit: unknown key; known: ['action', 'bf16', 'fp32', 'min_tokens']"),
    ],
)
def test_bad_values_fail_in_one_line(node, message):
    with pytest.raises(ConfigError) as err:
        RolloutCheck.from_config(node)
    assert str(err.value) == message


def test_a_checking_action_needs_the_engines_log_probs(tiny_agent_paths):
    paths = [f"agents.qwen_char.model_path={tiny_agent_paths['qwen2-char-small']}",
             f"agents.llama_pair.model_path={tiny_agent_paths['llama-pair-medium']}"]
    off = "+agents.llama_pair.actor_rollout_ref.rollout.calculate_log_probs=false"
    with pytest.raises(ConfigError) as err:
        validate(_compose(paths + [off]))
    assert str(err.value).startswith("agents.llama_pair: actor_rollout_ref.rollout.calculate_log_probs=false")
    validate(_compose(paths + [off, "trainer.rollout_check.action=off"]))  # measuring nothing is allowed
    with pytest.raises(ConfigError, match=r"^trainer.rollout_check.action='nope'"):
        validate(_compose(paths + ["trainer.rollout_check.action=nope"]))


# ------------------------------------------------------------------ the trainer's decision
class _Agent:
    def __init__(self, config):
        self.config = config


def _trainer(action: str) -> HacpoTrainer:
    cfg = _compose([f"trainer.rollout_check.action={action}"])
    from helpers.stand_in import stand_in_trainer

    return stand_in_trainer(["good", "stale"], global_step=7, agents={"good": _Agent(cfg), "stale": _Agent(cfg)},
                            rollout_check=RolloutCheck.from_config(OmegaConf.to_container(cfg.trainer.rollout_check)))


def _rollouts(stale_noise: float) -> dict[str, DataProto]:
    out = {}
    for name, noise in (("good", 1e-7), ("stale", stale_noise)):
        engine, trainer, mask = _sample(96, noise, seed=len(name))
        out[name] = DataProto.from_dict(tensors={
            "rollout_log_probs": engine.repeat(2, 1), "old_log_probs": trainer.repeat(2, 1),
            "response_mask": mask.repeat(2, 1).long()})
    return out


def test_stop_names_the_agent_step_and_figures_before_the_update(capsys):
    metrics = {}
    with pytest.raises(RolloutMismatchError) as err:
        _trainer("stop").check_rollout_policy(_rollouts(0.05), metrics)
    line = str(err.value)
    assert "\n" not in line
    assert line.startswith("agent 'stale': step 7: the rollout engine's log-probs disagree with the trainer's over 192")
    assert "max |Δ|" in line and "fp32 limits of trainer.rollout_check" in line and "stopped before the update" in line
    assert err.value.agent == "stale"
    assert metrics["agent/good/rollout/policy_mismatch"] == 0.0
    assert metrics["agent/stale/rollout/policy_mismatch"] == 1.0
    assert metrics["agent/good/rollout/log_prob_diff_max"] < 1e-5 < metrics["agent/stale/rollout/log_prob_diff_max"]
    assert metrics["agent/good/rollout/log_prob_pearson"] > 0.999999


def test_warn_prints_one_line_and_trains_on(capsys):
    metrics = {}
    _trainer("warn").check_rollout_policy(_rollouts(0.05), metrics)
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("WARN: agent 'stale': step 7: ") and lines[0].endswith(
        "training on (trainer.rollout_check.action=warn)")
    assert metrics["agent/stale/rollout/policy_mismatch"] == 1.0


def test_off_measures_only_and_healthy_runs_never_fire(capsys):
    metrics = {}
    _trainer("off").check_rollout_policy(_rollouts(0.05), metrics)
    assert metrics["agent/stale/rollout/policy_mismatch"] == 1.0 and capsys.readouterr().err == ""
    metrics = {}
    _trainer("stop").check_rollout_policy(_rollouts(1e-7), metrics)
    assert metrics["agent/stale/rollout/policy_mismatch"] == 0.0 == metrics["agent/good/rollout/policy_mismatch"]


# ------------------------------------------------------------------ end to end (hf backend)
@pytest.mark.e2e
@pytest.mark.ray
def test_a_withheld_sync_stops_the_run_before_the_update_and_keeps_the_last_checkpoint(tmp_path, warm_agent_paths):
    """The negative control through `python -m recipe_hacpo.main`: one agent's engine keeps the
    weights of its first sync (tests/vllm_driver.py's freeze hook, backend-independent). Step 1
    samples from the synced start (warm-started agents: mixed rewards, so step 1's update moves
    the weights); at step 2 its engine is one update behind, the check stops
    the run before step 2's update, names the agent, the step and the figures, and step 1's
    checkpoint stays the latest and complete."""
    import json
    import os
    import subprocess
    import sys

    from recipe_hacpo.cluster.reliability import LATEST_FILE, checkpoint_problem

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = str(tmp_path)
    from helpers.e2e import HACPO_PAIR_KINDS, agent_overrides

    cmd = [sys.executable, os.path.join(repo, "tests", "vllm_driver.py"), "--config-name", "hacpo_cpu_demo",
           *agent_overrides(warm_agent_paths, HACPO_PAIR_KINDS), "trainer.logger=[console,file]",
           f"trainer.default_local_dir={out}/ckpt", f"hydra.run.dir={out}/hydra", "trainer.progress_bar=false",
           "trainer.total_training_steps=2", "trainer.save_freq=1", "trainer.test_freq=-1",
           "trainer.val_before_train=false", f"trainer.learner_batch_dir={out}/batches"]
    env = dict(os.environ, VERL_FILE_LOGGER_PATH=os.path.join(out, "metrics.jsonl"),
               HACPO_DATA_DIR=os.path.join(repo, "data"), HACPO_TEST_FREEZE_ROLLOUT="llama_pair")
    proc = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 1, proc.stdout[-4000:] + proc.stderr[-4000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-4000:]
    assert errors[0].startswith("error: agent 'llama_pair': step 2: the rollout engine's log-probs disagree"), errors
    assert "fp32 limits of trainer.rollout_check" in errors[0] and "stopped before the update" in errors[0]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        steps = {r["step"]: r["data"] for r in map(json.loads, f) if "training/global_step" in r["data"]}
    assert sorted(steps) == [1]
    assert steps[1]["agent/llama_pair/advantage/abs_mean"] > 0  # step 1's update changed its weights
    for name in ("qwen_char", "llama_pair"):
        assert steps[1][f"agent/{name}/rollout/policy_mismatch"] == 0.0
        assert steps[1][f"agent/{name}/rollout/log_prob_diff_max"] < 1e-5
    # nothing of step 2 was trained on or saved
    assert not os.path.exists(os.path.join(out, "batches", "step_2"))
    assert open(os.path.join(out, "ckpt", LATEST_FILE)).read().strip() == "1"
    assert sorted(os.listdir(os.path.join(out, "ckpt"))) == ["global_step_1", LATEST_FILE, "tensorboard"]
    assert checkpoint_problem(os.path.join(out, "ckpt", "global_step_1"), ["qwen_char", "llama_pair"]) is None
