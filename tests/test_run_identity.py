"""A run is one run: every checkpoint records what trained it (recipe_hacpo/training/run_identity.py), a
resume by another run is refused before Ray in one line, and every method has its own default
folder.

Quick tier: every identity key's refusal, every listed change a resume may make, the checkpoints
without an identity, the default folders of every preset, the line evaluate and export print.
End to end (Ray): a baseline launched into HACPO's folder is refused and writes nothing; with the
default folders it starts fresh in its own; a resume with more steps and another logger goes on.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys

import pytest
from helpers.compose import compose_config

from recipe_hacpo.training import run_identity as ri
from recipe_hacpo.config import ConfigError, agent_specs
from recipe_hacpo.training.scoring import resolve_reward_path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATA = os.path.join(REPO, "data")


def _identity(overrides: list[str]) -> dict:
    """This launch's identity as `python -m recipe_hacpo.main` computes it (reward path resolved)."""
    cfg = compose_config("hacpo_cpu_demo", overrides)
    resolve_reward_path(cfg)
    return ri.run_identity(cfg, agent_specs(cfg))


@pytest.fixture
def saved(tmp_path, demo_overrides, monkeypatch):
    """A checkpoint folder whose identity is the demo pair's HACPO run; returns (folder, base overrides)."""
    monkeypatch.setenv("HACPO_DATA_DIR", DATA)
    folder = tmp_path / "ckpt" / "global_step_2"
    folder.mkdir(parents=True)
    ri.write_identity(str(folder), _identity(demo_overrides))
    return str(folder), list(demo_overrides)


def _refusal(folder: str, overrides: list[str], resume_mode: str = "auto") -> str:
    with pytest.raises(ConfigError) as err:
        ri.check_resume_identity(folder, _identity(overrides), resume_mode)
    message = str(err.value)
    assert "\n" not in message
    return message


def _reward_file(tmp_path, name: str = "compute_score") -> str:
    path = tmp_path / "my_reward.py"
    path.write_text(f"def {name}(data_source, solution_str, ground_truth, extra_info=None):\n    return 0.0\n")
    return str(path)


# (identity keys the case changes, extra overrides: a function of (tmp_path, paths), the parts
# the refusal must name, key by key, with both values)
def _cases(tmp_path, paths):
    other_data = tmp_path / "other_train.parquet"
    other_data.write_bytes(open(os.path.join(DATA, "arith_add3_train.parquet"), "rb").read())
    copied_model = tmp_path / "qwen_copy"
    shutil.copytree(paths["qwen2-char-small"], copied_model)
    with open(copied_model / "tokenizer_config.json", "a") as f:
        f.write("\n")  # the same path's tokenizer changed under it
    return {
        "method": (["+baseline=gspo"], ["method: checkpoint 'hacpo', this run 'gspo'",
                                        "algorithm.hacpo.mode: checkpoint 'hacpo', this run 'isolated'",
                                        "agents.qwen_char.policy_loss: checkpoint null, this run 'gspo'"]),
        "algorithm.hacpo.*": (["algorithm.hacpo.mode=naive", "algorithm.hacpo.share_selection=complementary",
                               "algorithm.hacpo.alpha=1.5"],
                              ["algorithm.hacpo.mode: checkpoint 'hacpo', this run 'naive'",
                               "algorithm.hacpo.share_selection: checkpoint 'all', this run 'complementary'",
                               "algorithm.hacpo.alpha: checkpoint 1.0, this run 1.5"]),
        "agents (added)": ([f"+agents.third={{model_path:{paths['qwen2-char-medium']},rollout_n:4}}"],
                           ["agents: checkpoint [qwen_char, llama_pair], this run [qwen_char, llama_pair, third]"]),
        "agents (dropped)": (["~agents.llama_pair"], ["agents: checkpoint [qwen_char, llama_pair], this run [qwen_char]"]),
        "agents.<name>.model_path": ([f"agents.llama_pair.model_path={paths['qwen2-char-medium']}"],
                                     [f"agents.llama_pair.model_path: checkpoint '{paths['llama-pair-medium']}', "
                                      f"this run '{paths['qwen2-char-medium']}'", "agents.llama_pair.model_digest: checkpoint "]),
        "agents.<name>.model_digest": ([f"agents.qwen_char.model_path={copied_model}"], ["agents.qwen_char.model_digest: checkpoint "]),
        "agents.<name>.rollout_n": (["agents.qwen_char.rollout_n=8"], ["agents.qwen_char.rollout_n: checkpoint 4, this run 8"]),
        "agents.<name>.lora_rank": (["+agents.llama_pair.actor_rollout_ref={model:{lora_rank:8,lora_alpha:16}}"],
                                    ["agents.llama_pair.lora_rank: checkpoint 0, this run 8"]),
        "reward.custom_reward_function.path": ([f"reward.custom_reward_function.path={_reward_file(tmp_path)}"],
                                               ["reward.custom_reward_function.path: checkpoint 'package', this run '"]),
        "reward.custom_reward_function.name": (["reward.custom_reward_function.name=compute_score_strict"],
                                               ["reward.custom_reward_function.name: checkpoint 'compute_score', "
                                                "this run 'compute_score_strict'"]),
        "data.train_files": ([f"data.train_files={other_data}"],
                             ["data.train_files: checkpoint [arith_add1_train.parquet sha256:", "this run [other_train.parquet sha256:"]),
        "trainer.async.enable": (["trainer.async.enable=true"], ["trainer.async.enable: checkpoint false, this run true"]),
    }


def test_every_identity_key_changed_is_refused_naming_it_with_both_values(saved, tmp_path, tiny_agent_paths):
    folder, base = saved
    cases = _cases(tmp_path, tiny_agent_paths)
    # every key of the identity has a case (the per-agent ones by their <name> form)
    assert {k.split(" (")[0] for k in cases} == set(ri.IDENTITY_KEYS) - {"agents.<name>.policy_loss"} | {"agents"}
    for name, (extra, parts) in cases.items():
        message = _refusal(folder, base + extra)
        assert message.startswith(f"resume from {folder}: written by another run ("), (name, message)
        assert message.endswith("start this run fresh in that folder with trainer.resume_mode=disable, "
                                "or give it another trainer.default_local_dir"), (name, message)
        for part in parts:
            assert part in message, (name, part, message)


def test_an_isolated_agents_loss_is_identity(tmp_path, demo_overrides, monkeypatch):
    """GSPO and GRPO baselines both run mode=isolated: the loss tells them apart."""
    monkeypatch.setenv("HACPO_DATA_DIR", DATA)
    folder = tmp_path / "global_step_1"
    folder.mkdir()
    ri.write_identity(str(folder), _identity(demo_overrides + ["+baseline=gspo"]))
    message = _refusal(str(folder), demo_overrides + ["+baseline=gspo", "actor_rollout_ref.actor.policy_loss.loss_mode=vanilla"])
    assert re.search(r"\(agents\.qwen_char\.policy_loss: checkpoint 'gspo', this run 'vanilla'; "
                     r"agents\.llama_pair\.policy_loss: checkpoint 'gspo', this run 'vanilla'\)", message), message


# what a resume may change (docs/CONFIG.md, run_identity.RESUMABLE_KEYS): one override each
ALLOWED = [
    "trainer.total_training_steps=40", "trainer.total_epochs=3", "trainer.logger=[console,wandb]",
    "trainer.metrics_dir=/tmp/elsewhere", "trainer.summary_every=5", "trainer.progress_bar=false", "trainer.verbose=true",
    "trainer.save_freq=7", "trainer.max_actor_ckpt_to_keep=1", "trainer.test_freq=3", "trainer.val_before_train=false",
    "data.val_files=/data/other_test.parquet", "trainer.preemption.usr1_grace_s=900", "trainer.preemption.time_limit_s=3600",
    "actor_rollout_ref.rollout.gpu_memory_utilization=0.3", "actor_rollout_ref.actor.fsdp_config.param_offload=true",
    "actor_rollout_ref.actor.fsdp_config.optimizer_offload=true", "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2",
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "trainer.default_local_dir=/runs/x",
    "trainer.experiment_name=renamed", "trainer.project_name=p2", "trainer.rollout_check.action=warn",
    "trainer.progress_file=/tmp/progress.json",
]


def test_every_listed_change_resumes_the_same_run(saved, tmp_path):
    folder, base = saved
    # every key RESUMABLE_KEYS names has an override here
    listed = [k for keys in ri.RESUMABLE_KEYS for k in keys.split(", ")]
    for key in listed:
        pattern = re.escape(key).replace(r"\*", r"[\w.]*")
        assert any(re.match(rf"^{pattern}=", o) for o in ALLOWED), key
    # all at once: had any of them been identity, its key would differ
    changed = _identity(base + ALLOWED)
    assert ri.identity_differences(ri.read_identity(folder), changed) == []
    assert ri.check_resume_identity(folder, changed, "auto") is None
    # the same training data in another folder is the same data
    moved = tmp_path / "moved"
    moved.mkdir()
    shutil.copy(os.path.join(DATA, "arith_add1_train.parquet"), moved)
    assert ri.check_resume_identity(folder, _identity(base + [f"data.train_files={moved}/arith_add1_train.parquet"]), "auto") is None


def test_a_setting_the_checkpoint_did_not_record_is_not_held_against_it(saved):
    """A later version's new identity key (here: a method setting) leaves older checkpoints resumable."""
    folder, base = saved
    older = ri.read_identity(folder)
    del older["algorithm.hacpo.alpha"]
    ri.write_identity(folder, older)
    assert ri.check_resume_identity(folder, _identity(base + ["algorithm.hacpo.alpha=1.5"]), "auto") is None
    assert "algorithm.hacpo.mode: checkpoint 'hacpo'" in _refusal(folder, base + ["algorithm.hacpo.mode=naive"])


def test_resume_from_path_names_its_own_way_out(saved):
    folder, base = saved
    message = _refusal(folder, base + ["+baseline=naive"], resume_mode="resume_path")
    assert message.endswith("trainer.resume_from_path names another run's checkpoint; point it at this run's, "
                            "or start fresh with trainer.resume_mode=disable"), message


def test_a_checkpoint_without_identity_resumes_with_one_warning(tmp_path, demo_overrides, monkeypatch):
    monkeypatch.setenv("HACPO_DATA_DIR", DATA)
    old = tmp_path / "global_step_3"
    old.mkdir()
    warning = ri.check_resume_identity(str(old), _identity(demo_overrides + ["+baseline=gspo"]), "auto")
    assert warning.startswith(f"WARN: {old} records no run identity") and "\n" not in warning
    assert "could not be checked" in warning
    (old / ri.IDENTITY_FILE).write_text("{not json")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(old / ri.IDENTITY_FILE))}: unreadable \(JSONDecodeError"):
        ri.check_resume_identity(str(old), {}, "auto")


def test_the_main_check_reads_the_checkpoint_the_trainer_would_resume(tmp_path, demo_overrides, monkeypatch):
    """`main.prepare`'s check takes the newest complete checkpoint, none with resume_mode=disable."""
    from recipe_hacpo.cluster.reliability import LATEST_FILE, STATE_FILE
    from recipe_hacpo.main import check_resume_identity

    monkeypatch.setenv("HACPO_DATA_DIR", DATA)
    root = tmp_path / "ckpt"
    step = root / "global_step_2"
    for agent in ("qwen_char", "llama_pair"):
        (step / agent / "actor").mkdir(parents=True)
        (step / agent / "actor" / "model_world_size_1_rank_0.pt").write_bytes(b"x")
    (step / STATE_FILE).write_bytes(b"x")
    (root / LATEST_FILE).write_text("2")
    ri.write_identity(str(step), _identity(demo_overrides))

    def check(*extra):
        cfg = compose_config("hacpo_cpu_demo", [*demo_overrides, f"trainer.default_local_dir={root}", *extra])
        resolve_reward_path(cfg)
        check_resume_identity(cfg, agent_specs(cfg))

    check("trainer.total_training_steps=9")
    with pytest.raises(ConfigError, match=r"^resume from \S+global_step_2: written by another run \(method: checkpoint 'hacpo', this run 'sgt'"):
        check("+baseline=sgt")
    check("+baseline=sgt", "trainer.resume_mode=disable")


def _presets() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(os.path.join(REPO, "configs")) if f.startswith("pair_") and f.endswith(".yaml"))


BASELINES = sorted(f[:-5] for f in os.listdir(os.path.join(REPO, "configs", "baseline")))


def test_every_method_of_every_preset_has_its_own_default_folder_and_run_name(monkeypatch):
    from hydra import compose, initialize_config_module

    for var in ("HACPO_MODEL_A", "HACPO_MODEL_B", "HACPO_DATA_DIR", "HACPO_OUTPUT_DIR"):
        monkeypatch.delenv(var, raising=False)
    assert len(BASELINES) == 10
    presets = _presets()
    with initialize_config_module("recipe_hacpo.configs", version_base=None):
        def folder(preset: str, baseline: str | None, *extra: str) -> tuple[str, str]:
            cfg = compose(preset, overrides=[*([f"+baseline={baseline}"] if baseline else []), *extra])
            assert cfg.method == (baseline or "hacpo") or extra, (preset, baseline)
            return cfg.trainer.default_local_dir, cfg.trainer.experiment_name

        # every preset's HACPO run; one preset: every method apart (the same interpolation serves all)
        runs = [(p, None) for p in presets] + [(presets[0], b) for b in BASELINES]
        for preset, baseline in runs:
            pair, method = preset.removeprefix("pair_"), baseline or "hacpo"
            assert folder(preset, baseline) == (f"outputs/{pair}_{method}/checkpoints", f"{pair}_{method}"), (preset, baseline)
        pair = presets[0].removeprefix("pair_")
        assert folder(presets[0], None) == folder(presets[0], "hacpo")
        assert len({folder(presets[0], b)[0] for b in BASELINES}) == len(BASELINES)
        # an explicit folder is honoured; a mode set by hand names the run after the mode
        assert folder(presets[0], "gspo", "trainer.default_local_dir=/scratch/mine") == ("/scratch/mine", f"{pair}_gspo")
        assert folder(presets[0], None, "algorithm.hacpo.mode=naive")[0] == f"outputs/{pair}_naive/checkpoints"
        monkeypatch.setenv("HACPO_OUTPUT_DIR", "/runs")
        assert folder(presets[0], "grpo")[0] == f"/runs/{pair}_grpo/checkpoints"


def test_the_per_agent_run_name_follows_the_method(demo_overrides, monkeypatch):
    from recipe_hacpo.config import agent_verl_config

    monkeypatch.setenv("HACPO_DATA_DIR", DATA)
    cfg = compose_config("hacpo_cpu_demo", demo_overrides + ["+baseline=graft"])
    spec = agent_specs(cfg)[0]
    assert agent_verl_config(cfg, spec).trainer.experiment_name == "demo_graft/qwen_char"


def _tree(root: str) -> dict[str, str]:
    """{relative path: sha256} of every file under root."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            path = os.path.join(dirpath, f)
            out[os.path.relpath(path, root)] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    return out


def test_evaluate_and_export_name_the_checkpoints_run_in_their_first_line(saved, tmp_path):
    from recipe_hacpo.cluster.reliability import STATE_FILE

    folder, _ = saved
    for agent in ("qwen_char", "llama_pair"):
        os.makedirs(os.path.join(folder, agent, "actor"))
        open(os.path.join(folder, agent, "actor", "x.pt"), "w").write("x")
    open(os.path.join(folder, STATE_FILE), "w").write("x")
    line = ri.describe_checkpoint(folder)
    assert re.fullmatch(rf"checkpoint {re.escape(folder)}: method hacpo \(mode hacpo, lockstep\), step 2, agents "
                        r"qwen_char \(\S+qwen2-char-small, rollout_n 4\), llama_pair \(\S+llama-pair-medium, rollout_n 4\)", line), line
    proc = subprocess.run([sys.executable, "-m", "recipe_hacpo.export", folder, "--agents", "gemma", "--out", str(tmp_path / "x")],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and proc.stdout.splitlines()[0] == line, proc.stdout + proc.stderr
    bench = tmp_path / "missing.parquet"
    proc = subprocess.run([sys.executable, "-m", "recipe_hacpo.evaluate", "--agents-from", os.path.dirname(folder) + "/global_step_2",
                           "--bench", f"b={bench}", "--out", str(tmp_path / "ev")], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "error:" in proc.stderr and proc.stdout.splitlines()[0] == line, proc.stdout + proc.stderr
    # an old checkpoint: said so, in the same first line
    os.remove(os.path.join(folder, ri.IDENTITY_FILE))
    assert ri.describe_checkpoint(folder).endswith("step 2; no run identity recorded (written before checkpoints recorded one)")


# ----------------------------------------------------------------------------------- end to end


def _main(overrides: list[str], env: dict, timeout: int = 900) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "recipe_hacpo.main", "--config-name", "hacpo_cpu_demo", "trainer.progress_bar=false",
           *overrides]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.e2e
@pytest.mark.ray
def test_e2e_a_baseline_in_hacpos_folder_is_refused_and_with_default_folders_starts_fresh_in_its_own(
    tmp_path, warm_agent_paths, hacpo_pair_reference, monkeypatch
):
    """The documented comparison, as a user runs it: HACPO trained (conftest's 3-step run, every step
    checkpointed), then the GSPO baseline of the same pair.

    - into HACPO's folder: refused before Ray, one line naming the method's keys, nothing written
      (checkpoints, metrics.jsonl, TensorBoard files byte for byte); so are another model for one
      agent, an added agent and another reward function;
    - with the default folders: a fresh GSPO run in outputs/gspo, HACPO's folder untouched.

    A resume with more steps and another logger (the same run) is tests/test_graft_e2e.py's resume."""
    from helpers.e2e import HACPO_PAIR_KINDS, agent_overrides, logged_steps

    reference, _ = hacpo_pair_reference
    outputs = tmp_path / "outputs"
    hacpo_dir = outputs / "hacpo" / "checkpoints"  # where hacpo_cpu_demo's HACPO run writes by default
    shutil.copytree(os.path.join(reference, "ckpt"), hacpo_dir)
    # its metrics file where a run writes it without VERL_FILE_LOGGER_PATH: beside the checkpoints
    shutil.copy(os.path.join(reference, "metrics.jsonl"), hacpo_dir / "metrics.jsonl")
    env = dict(os.environ, HACPO_DATA_DIR=DATA, HACPO_OUTPUT_DIR=str(outputs))
    env.pop("VERL_FILE_LOGGER_PATH", None)
    common = agent_overrides(warm_agent_paths, HACPO_PAIR_KINDS) + [
        "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.resume_mode=auto", "trainer.save_freq=1",
        f"hydra.run.dir={tmp_path}/hydra"]
    before = _tree(str(hacpo_dir))
    assert {"metrics.jsonl", "global_step_3/run_identity.json"} <= set(before) and any(k.startswith("tensorboard/") for k in before)

    # the docs' baseline command, pointed at HACPO's folder
    # (the demo's batch of 8 prompts takes mini-batches of 4, not GSPO's 64)
    gspo = ["+baseline=gspo", "actor_rollout_ref.actor.ppo_mini_batch_size=4"]
    proc = _main(common + gspo + ["trainer.total_training_steps=4", f"trainer.default_local_dir={hacpo_dir}"], env)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    error = proc.stderr.strip().splitlines()[-1]
    assert error.startswith(f"error: resume from {hacpo_dir}/global_step_3: written by another run (method: checkpoint "
                            "'hacpo', this run 'gspo'; algorithm.hacpo.mode: checkpoint 'hacpo', this run 'isolated'"), error
    assert error.endswith("trainer.resume_mode=disable, or give it another trainer.default_local_dir"), error
    assert "starting the workers" not in proc.stdout
    assert _tree(str(hacpo_dir)) == before

    # another model for one agent, an added agent, another reward function: refused the same way, by
    # the same checks the command above ran (main.prepare, in this process: no launch each)
    from recipe_hacpo.main import prepare

    monkeypatch.setenv("HACPO_DATA_DIR", DATA)
    monkeypatch.setenv("HACPO_OUTPUT_DIR", str(outputs))
    reward = tmp_path / "my_reward.py"
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    return 1.0\n")
    for extra, named in [
        ([f"agents.llama_pair.model_path={warm_agent_paths['qwen2-char-medium']}"], "agents.llama_pair.model_path: checkpoint"),
        ([f"+agents.third={{model_path:{warm_agent_paths['qwen2-char-medium']},rollout_n:4,n_gpus_per_node:1,nnodes:1}}",
          "ray_kwargs.ray_init.num_gpus=3"], "agents: checkpoint [qwen_char, llama_pair], this run [qwen_char, llama_pair, third]"),
        ([f"reward.custom_reward_function.path={reward}"], f"reward.custom_reward_function.path: checkpoint 'package', this run '{reward}'"),
    ]:
        with pytest.raises(ConfigError) as refused:
            prepare(compose_config("hacpo_cpu_demo", common + ["trainer.total_training_steps=4", *extra]))
        assert str(refused.value).startswith(f"resume from {hacpo_dir}/global_step_3: written by another run (")
        assert named in str(refused.value), (extra, str(refused.value))
    assert _tree(str(hacpo_dir)) == before

    # the same baseline command with the default folders: a fresh run of its own
    proc = _main(common + gspo + ["trainer.total_training_steps=1"], env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    gspo_dir = outputs / "gspo" / "checkpoints"
    assert os.path.isfile(gspo_dir / "global_step_1" / ri.IDENTITY_FILE)
    assert ri.read_identity(str(gspo_dir / "global_step_1"))["method"] == "gspo"
    assert "WARN" not in proc.stdout and _tree(str(hacpo_dir)) == before
    assert sorted(logged_steps(str(gspo_dir))) == [1]
