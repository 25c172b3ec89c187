"""System-level equivalence: `python -m recipe_hacpo.main` in `mode=isolated` with one agent
and verl's own `python -m verl.trainer.main_ppo` (GSPO loss), on CPU with this package's
plugin (the `hf` rollout and the CPU platform), the same tiny model, data, seeds and batch
sizes: the first step's rollouts are the same texts and the update's pg_loss and grad_norm
agree.

Why they can agree: with `rollout.full_determinism` every sampled response is a function of
(rollout seed, step, row, prompt ids, weights) (`workers/hf_cpu_rollout/hf_rollout.request_seed`); both
trainers draw the prompts with verl's own dataset and sampler, score them with the same
reward function, compute GRPO advantages (one agent: the capability-aware advantage is
verl's GRPO, see test_core_algos) and train with verl's own gspo loss through the same FSDP2
engine. The tolerances cover float32 summation order only (rel 1e-4 on the loss, 1e-3 on the
gradient norm).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from console_log import parse_console_steps

pytestmark = [pytest.mark.ray, pytest.mark.e2e]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BATCH, N, PROMPT_LEN, RESPONSE_LEN = 4, 4, 32, 8

# a reward that varies within a group whatever the (random-init) model writes, so the
# advantages, the loss and the gradient are not all zero
REWARD_SOURCE = textwrap.dedent(
    """
    def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
        return float(len(solution_str) % 2)
    """
)

COMMON = [
    "actor_rollout_ref.actor.strategy=fsdp2",
    "actor_rollout_ref.actor.policy_loss.loss_mode=gspo",
    "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
    "actor_rollout_ref.actor.clip_ratio_low=0.0003",
    "actor_rollout_ref.actor.clip_ratio_high=0.0004",
    "actor_rollout_ref.actor.use_kl_loss=False",
    "actor_rollout_ref.actor.entropy_coeff=0.0",
    f"actor_rollout_ref.actor.ppo_mini_batch_size={BATCH}",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.actor.optim.lr=0.001",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.rollout.temperature=1.0",
    "actor_rollout_ref.rollout.full_determinism=True",
    f"data.train_batch_size={BATCH}",
    f"data.max_prompt_length={PROMPT_LEN}",
    f"data.max_response_length={RESPONSE_LEN}",
    "data.seed=7",
    "trainer.total_training_steps=1",
    "trainer.val_before_train=False",
    "trainer.test_freq=-1",
    "trainer.save_freq=-1",
]


def _run(cmd: list[str], cwd: str, extra_env: dict | None = None, timeout: int = 240) -> str:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "VERL_FILE_LOGGER_PATH")}
    env.update(extra_env or {})
    proc = subprocess.run(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-6000:]
    return proc.stdout


def test_isolated_recipe_equals_verl_main_ppo_first_step(tmp_path, tiny_agent_paths):
    from transformers import AutoTokenizer
    from verl import DataProto

    model = tiny_agent_paths["qwen2-char-small"]
    train = os.path.join(REPO, "data", "arith_add1_train.parquet")
    reward = tmp_path / "reward_fn.py"
    reward.write_text(REWARD_SOURCE)
    common = COMMON + [
        f"data.train_files={train}", f"data.val_files={train}",
        f"reward.custom_reward_function.path={reward}", "reward.custom_reward_function.name=compute_score",
    ]

    # verl's own trainer (the overrides that run it on CPU, from test_cpu_backend)
    from helpers.verl_cpu import CPU_OVERRIDES, ray_overrides

    verl_dir = tmp_path / "verl"
    verl_dir.mkdir()
    verl_log = _run(
        [sys.executable, "-m", "verl.trainer.main_ppo", *CPU_OVERRIDES, *ray_overrides(1), *common,
         f"actor_rollout_ref.model.path={model}", f"actor_rollout_ref.rollout.n={N}",
         "algorithm.adv_estimator=grpo", "trainer.logger=[console]", "trainer.total_epochs=1",
         f"trainer.rollout_data_dir={verl_dir}/rollouts", f"trainer.default_local_dir={verl_dir}/ckpt",
         f"hydra.run.dir={verl_dir}/hydra", "+ray_kwargs.ray_init.address=local"],
        cwd=str(verl_dir),
    )
    verl_step = parse_console_steps(verl_log)[1]

    # the recipe, one agent, no sharing
    ours_dir = tmp_path / "ours"
    ours_dir.mkdir()
    from recipe_hacpo.config import agents_overrides

    agent = agents_overrides([dict(name="solo", model_path=model, rollout_n=N, n_gpus_per_node=1, nnodes=1)])
    metrics_file = ours_dir / "metrics.jsonl"
    _run(
        [sys.executable, "-m", "recipe_hacpo.main", "--config-name", "hacpo_cpu_demo", *common,
         "trainer.logger=[console,file]", *agent, "ray_kwargs.ray_init.num_gpus=1",
         "algorithm.hacpo.mode=isolated", f"trainer.learner_batch_dir={ours_dir}/batches",
         f"trainer.default_local_dir={ours_dir}/ckpt", f"hydra.run.dir={ours_dir}/hydra", "trainer.progress_bar=false"],
        cwd=REPO, extra_env={"VERL_FILE_LOGGER_PATH": str(metrics_file)},
    )
    records = [json.loads(line) for line in metrics_file.read_text().splitlines()]
    ours_step = next(r["data"] for r in records if r["data"].get("training/global_step") == 1)

    # 1. the same rollouts: prompt and response texts, as multisets (verl may reorder rows)
    tok = AutoTokenizer.from_pretrained(model)
    batch = DataProto.load_from_disk(str(ours_dir / "batches" / "step_1" / "solo.pkl"))
    ours_rows = sorted(
        (tok.decode(p[m.bool()], skip_special_tokens=True), tok.decode(r[rm.bool()], skip_special_tokens=True))
        for p, m, r, rm in zip(
            batch.batch["prompts"], batch.batch["attention_mask"][:, : batch.batch["prompts"].shape[1]],
            batch.batch["responses"], batch.batch["response_mask"],
        )
    )
    with open(verl_dir / "rollouts" / "1.jsonl") as f:
        dumped = [json.loads(line) for line in f]
    verl_rows = sorted((d["input"], d["output"]) for d in dumped)
    assert len(ours_rows) == len(verl_rows) == BATCH * N
    assert ours_rows == verl_rows

    # 2. the same rewards and update
    assert ours_step["agent/solo/reward/mean"] == pytest.approx(verl_step["critic/score/mean"], abs=1e-6)
    assert ours_step["agent/solo/actor/pg_loss"] == pytest.approx(verl_step["actor/pg_loss"], rel=1e-4, abs=1e-7)
    assert ours_step["agent/solo/actor/grad_norm"] == pytest.approx(verl_step["actor/grad_norm"], rel=1e-3)
    assert verl_step["actor/grad_norm"] > 0  # not a vacuous comparison
