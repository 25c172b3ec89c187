"""The config composes from the package, and one validation pass rejects configurations
that cannot work with one line naming the key — before anything starts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from recipe_hacpo.config import AGENTS_FORM, ConfigError, agent_specs, agent_verl_config, agents_overrides, validate
from helpers.compose import compose_config as _compose
from helpers.compose import first_agent_only as _first_agent_only






def test_demo_preset_validates_and_builds_agent_configs(demo_overrides):
    cfg = _compose("hacpo_cpu_demo", demo_overrides)
    specs, hacpo = validate(cfg)
    assert [s.name for s in specs] == ["qwen_char", "llama_pair"]
    assert hacpo.mode == "hacpo" and hacpo.alpha == 1.0
    agent = agent_verl_config(cfg, specs[1])
    assert agent.actor_rollout_ref.model.path == specs[1].model_path
    assert agent.actor_rollout_ref.rollout.n == specs[1].rollout_n
    assert agent.actor_rollout_ref.rollout.custom.agent_name == "llama_pair"
    assert "agents" not in agent


def test_sample_tape_folders_reach_each_agents_rollout_as_its_own(demo_overrides, tmp_path):
    for name in ("qwen_char", "llama_pair"):
        (tmp_path / "tapes" / name).mkdir(parents=True)
        (tmp_path / "tapes" / name / "tape.jsonl").write_text('{"seed": 1, "tokens": [2]}\n')
    cfg = _compose("hacpo_cpu_demo", demo_overrides + [f"trainer.replay_samples_dir={tmp_path}/tapes",
                                                       "trainer.record_samples_dir=rel/out"])
    specs, _ = validate(cfg)
    custom = agent_verl_config(cfg, specs[1]).actor_rollout_ref.rollout.custom
    assert custom.replay_samples == f"{tmp_path}/tapes/llama_pair"
    assert custom.record_samples == os.path.join(os.path.abspath("rel/out"), "llama_pair")
    assert "replay_samples" not in agent_verl_config(_compose("hacpo_cpu_demo", demo_overrides), specs[1]).actor_rollout_ref.rollout.custom


def test_agent_override_merges_into_template(demo_overrides):
    cfg = _compose("hacpo_cpu_demo", demo_overrides + ["+agents.llama_pair.actor_rollout_ref.actor.optim.lr=0.5"])
    specs, _ = validate(cfg)
    assert agent_verl_config(cfg, specs[1]).actor_rollout_ref.actor.optim.lr == 0.5
    assert agent_verl_config(cfg, specs[0]).actor_rollout_ref.actor.optim.lr == cfg.actor_rollout_ref.actor.optim.lr


def test_naive_settings_imply_plain_baseline():
    from recipe_hacpo.config import HacpoSettings
    from recipe_hacpo.methods import loss_settings, method_for

    naive = method_for("naive").effective(HacpoSettings(mode="naive", alpha=3.0))
    assert (naive.capability_baseline, naive.discrepancy_coefficient, naive.alpha, naive.cross_clip) == (
        False, False, 0.0, "gspo",
    )
    assert loss_settings(HacpoSettings(mode="hacpo", alpha=3.0))["alpha"] == 3.0
    assert loss_settings(HacpoSettings(mode="naive", alpha=3.0))["alpha"] == 0.0
    assert loss_settings(HacpoSettings(mode="isolated")) is None  # verl's own loss


@pytest.mark.parametrize(
    "extra, message",
    [
        (["+agents.llama_pair.name=qwen_char"], r"agents\.llama_pair\.name='qwen_char': an agent's name is its key"),
        (["+agents.llama_pair.temperature=1"], r"^agents\.llama_pair\.temperature: not an agent key \(an agent sets model_path, "),
        (["agents.llama_pair.model_path=/nonexistent/model"], r"agents\.llama_pair\.model_path='/nonexistent/model': not a local directory"),
        (["data.train_batch_size=6"], r"data\.train_batch_size=6 is not divisible by actor_rollout_ref\.actor\.ppo_mini_batch_size=4"),
        (["ray_kwargs.ray_init.num_gpus=1"], r"pools need 2 GPUs .* but the cluster has 1"),
        (["algorithm.hacpo.mode=shared"], r"algorithm\.hacpo\.mode='shared': must be one of hacpo, naive, isolated"),
        (["+algorithm.hacpo.alhpa=1"], r"algorithm\.hacpo\.alhpa: unknown key"),
        (["algorithm.hacpo.omega_clip=[2.0,10.0]"], r"algorithm\.hacpo\.omega_clip"),
        (["algorithm.hacpo.cross_clip=gspo"], r"algorithm\.hacpo\.cross_clip='gspo'.*mode=naive"),
        (["agents.qwen_char.rollout_n=0"], r"agents\.qwen_char\.rollout_n=0: must be >= 1"),
        (["trainer.reward_timeout_s=0"], r"trainer\.reward_timeout_s=0\.0: must be > 0"),
        (["trainer.master_port_range=[30000,30020]"], r"trainer\.master_port_range=\[30000, 30020\]: 20 ports for 2 agents"),
        (["trainer.master_port_range=[80,2000]"], r"trainer\.master_port_range=\[80, 2000\]: must satisfy 1024 <= first"),
        (["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=5"],
         r"actor_rollout_ref\.actor\.ppo_micro_batch_size_per_gpu=5 does not divide the 32 rows of one mini-batch per GPU"),
        (["actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=3"],
         r"log_prob_micro_batch_size_per_gpu=3 does not divide the 32 own responses per GPU"),
        (["trainer.max_actor_ckpt_to_keep=0"], r"trainer\.max_actor_ckpt_to_keep=0: the number of newest joint checkpoints kept, >= 1"),
        (["trainer.replay_samples_dir=/nonexistent/tapes"],
         r"trainer\.replay_samples_dir='/nonexistent/tapes' \(qwen_char\): no \.jsonl tape in /nonexistent/tapes/qwen_char"),
        (["trainer.record_samples_dir=/tmp/tapes", "actor_rollout_ref.rollout.full_determinism=false"],
         r"trainer\.record_samples_dir \(qwen_char\): sample tapes need .*full_determinism=true"),
    ],
)
def test_bad_configs_fail_with_one_line(demo_overrides, extra, message):
    cfg = _compose("hacpo_cpu_demo", demo_overrides + extra)
    with pytest.raises(ConfigError, match=message) as err:
        validate(cfg)
    assert "\n" not in str(err.value)




def test_agents_are_added_dropped_and_changed_by_name(demo_overrides, tiny_agent_paths):
    """The command line edits the preset's agents one at a time; their order is the preset's,
    then the additions' (the agent index j)."""
    third = f"+agents.qwen_mid={{model_path:'{tiny_agent_paths['qwen2-char-small']}',rollout_n:4,n_gpus_per_node:1}}"
    cfg = _compose("hacpo_cpu_demo", demo_overrides + [third, "+agents.llama_pair.actor_rollout_ref.actor.optim.lr=2e-5",
                                                       "ray_kwargs.ray_init.num_gpus=3"])
    specs = validate(cfg)[0]
    assert [(s.index, s.name, s.rollout_n) for s in specs] == [(0, "qwen_char", 4), (1, "llama_pair", 4), (2, "qwen_mid", 4)]
    assert specs[1].overrides == {"actor": {"optim": {"lr": 2e-5}}} and specs[0].overrides == {}
    dropped = agent_specs(_compose("hacpo_cpu_demo", demo_overrides + ["~agents.llama_pair"]))
    assert [s.name for s in dropped] == ["qwen_char"]
    # a whole set in one go (scripts and tests): the preset's agents are replaced, in this order
    replaced = agent_specs(_compose("hacpo_cpu_demo", agents_overrides(
        [dict(name="b", model_path="/m/b", rollout_n=2), dict(name="a", model_path="/m/a", n_gpus_per_node=0)])))
    assert [(s.name, s.model_path, s.rollout_n, s.n_gpus_per_node) for s in replaced] == [("b", "/m/b", 2, 0), ("a", "/m/a", 8, 0)]


def test_the_old_list_form_is_refused_in_one_line_naming_the_new_one():
    from omegaconf import OmegaConf

    from recipe_hacpo.agent_spec import refuse_list_form

    with pytest.raises(ConfigError, match=r"^agents: a list; agents are keyed by name: \+agents\.<name>="):
        agent_specs(OmegaConf.create({"agents": [{"name": "a", "model_path": "/m"}]}))
    assert refuse_list_form(["agents.1.model_path=/m"]) == f"agents.1.model_path=/m: {AGENTS_FORM}"
    assert refuse_list_form(["++agents.0.node_resource=r"]) is not None
    assert refuse_list_form(["agents.a1.rollout_n=2", "+agents.b={model_path:/m}", "agents_rollout_n=4"]) is None


def test_sharing_needs_two_agents(demo_overrides):
    cfg = _first_agent_only(_compose("hacpo_cpu_demo", demo_overrides))
    with pytest.raises(ConfigError, match=r"sharing needs at least 2 agents, got 1"):
        validate(cfg)
    cfg = _first_agent_only(_compose("hacpo_cpu_demo", demo_overrides + ["algorithm.hacpo.mode=isolated"]))
    specs, _ = validate(cfg)
    assert len(specs) == 1


def test_main_rejects_bad_config_before_ray(tmp_path, demo_overrides):
    """The CLI exits 2 with a one-line error and never starts Ray."""
    proc = subprocess.run(
        [sys.executable, "-m", "recipe_hacpo.main", "--config-name", "hacpo_cpu_demo", *demo_overrides,
         "agents=[{name:qwen_char,model_path:/m}]", f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    assert lines == [f"error: agents=[{{name:qwen_char,model_path:/m}}]: {AGENTS_FORM}"]
    assert "Started a local Ray instance" not in proc.stdout + proc.stderr


def test_main_rejects_bad_data_file(tmp_path, demo_overrides):
    import pandas as pd

    bad = tmp_path / "bad.parquet"
    pd.DataFrame({"data_source": ["x"], "prompt": [[{"role": "user", "content": "1+1="}]]}).to_parquet(bad)
    proc = subprocess.run(
        [sys.executable, "-m", "recipe_hacpo.main", "--config-name", "hacpo_cpu_demo", *demo_overrides,
         f"data.train_files={bad}", f"hydra.run.dir={tmp_path}"],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    # the first problem of the first row: this frame lacks `ability` (and `reward_model`)
    assert err == [f"error: {bad}: row 0: field 'ability' missing (expected a str, e.g. 'math')"], err


@pytest.mark.parametrize("address, prestart", [(None, "0"), ("10.0.0.1:6379", None)])
def test_a_local_ray_prestarts_no_idle_workers_and_a_joined_one_is_left_alone(monkeypatch, demo_overrides, address,
                                                                             prestart):
    import ray

    from recipe_hacpo import main

    key = main.NO_PRESTART_ENV[0]
    monkeypatch.setenv(key, "set")  # so that the value this test leaves is undone too
    monkeypatch.delenv(key)
    seen = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.update(kw, env=os.environ.get(key)))
    overrides = demo_overrides + ([f"++ray_kwargs.ray_init.address={address}", "ray_kwargs.ray_init.num_cpus=null",
                                   "ray_kwargs.ray_init.num_gpus=null"] if address else [])
    main.start_ray(_compose("hacpo_cpu_demo", overrides))
    assert seen.get("address") == address and seen["env"] == prestart
