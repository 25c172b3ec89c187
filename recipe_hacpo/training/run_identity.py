"""What makes a run the run it is: recorded in every checkpoint, checked before a resume.

A checkpoint folder (`trainer.default_local_dir`) holds one run. A launch that would resume from
it with another method, other agents or models, another `rollout_n`, reward or training data, or
the other trainer would continue one run's weights under another run's name, into the same
metrics; that is refused before Ray starts, in one line naming every key that differs.

    run_identity(cfg, specs)     this launch's identity: {key: value}, keys as in IDENTITY_KEYS
    write_identity / read_identity   the `run_identity.json` of a checkpoint folder
    identity_differences         "key: checkpoint X, this run Y" for every key that differs
    check_resume_identity        the refusal (ConfigError), or the one warning for a checkpoint
                                 that records no identity
    describe_checkpoint          one line for the tools that read a checkpoint (evaluate, export)

Every key a run sets is either identity (IDENTITY_KEYS) or free to change across a resume
(RESUMABLE_KEYS lists the ones users change; docs/CONFIG.md shows both lists).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, Sequence

from omegaconf import DictConfig, OmegaConf

from recipe_hacpo.data.schema import file_list
from recipe_hacpo.hacpo_settings import ConfigError
from recipe_hacpo.methods import method_for

IDENTITY_FILE = "run_identity.json"
IDENTITY_VERSION = 1

# the identity's keys (`<name>` is each agent's), with what each records; every one of them
# differing between a checkpoint and this launch makes this launch another run
IDENTITY_KEYS = {
    "method": "the method's name: the baseline of `+baseline=NAME` (configs/baseline/), else algorithm.hacpo.mode",
    "algorithm.hacpo.*": "the method's settings, every key (docs/ALGORITHM.md): its module (`mode`), α, the bounds, "
                         "the selection of peer rows, ...",
    "agents": "the agents by name, in order (the agent index j)",
    "agents.<name>.model_path": "the model the agent started from",
    "agents.<name>.model_digest": "sha256 of that model's config and tokenizer files (a local folder, or the "
                                  "hub id's snapshot in the local cache; null where neither is readable)",
    "agents.<name>.rollout_n": "G_j, responses per prompt (after `agents_rollout_n`)",
    "agents.<name>.lora_rank": "0: full fine-tuning; > 0: a LoRA adapter of that rank (actor_rollout_ref.model.lora_rank)",
    "agents.<name>.policy_loss": "a method that trains with verl's own loss (`mode=isolated`): the agent's "
                                 "actor.policy_loss.loss_mode; null otherwise",
    "reward.custom_reward_function.path": "the reward function's file (`package` for the package's math reward)",
    "reward.custom_reward_function.name": "the reward function's name in that file",
    "data.train_files": "the training files, by file name and sha256 of their content",
    "trainer.async.enable": "lockstep (false) or asynchronous agents (true)",
}

# keys a resume may change (the run stays the same run): (key, why it is not the run's identity)
RESUMABLE_KEYS = {
    "trainer.total_training_steps, trainer.total_epochs": "how long the run goes on; a resume may extend it",
    "trainer.logger, trainer.metrics_dir, trainer.summary_every, trainer.progress_bar, trainer.verbose":
        "where and how the run reports",
    "trainer.save_freq, trainer.max_actor_ckpt_to_keep": "the checkpoint cadence and retention",
    "trainer.test_freq, trainer.val_before_train, data.val_files": "when and on what the agents are validated",
    "trainer.preemption.*": "the stop clock (signals, deadlines, grace periods)",
    "actor_rollout_ref.rollout.gpu_memory_utilization, actor_rollout_ref.actor.fsdp_config.*_offload, "
    "*.log_prob_micro_batch_size_per_gpu, actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu":
        "GPU memory settings: what fits, not what is trained",
    "trainer.default_local_dir, trainer.experiment_name, trainer.project_name": "the run's names and folder",
    "trainer.rollout_check.*, trainer.progress_file": "checks and announcements around the step, not the step",
}

_TOKENIZER_FILES = ("special_tokens_map.json", "vocab.json", "vocab.txt", "merges.txt", "added_tokens.json",
                    "chat_template.jinja", "chat_template.json")


def _sha256(paths: Sequence[str]) -> str:
    h = hashlib.sha256()
    for path in paths:
        h.update(os.path.basename(path).encode() + b"\0")
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


def _model_folder(path: str) -> str | None:
    """A local model folder, or a hub id's snapshot in the local cache (no download), or None."""
    if os.path.isdir(path):
        return path
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(path, local_files_only=True)
    except Exception:
        return None


def model_digest(path: str) -> str | None:
    """sha256 over a model's config.json and tokenizer files; None where the model is not readable here."""
    folder = _model_folder(path)
    if folder is None:
        return None
    names = sorted(n for n in os.listdir(folder)
                   if n == "config.json" or n.startswith("tokenizer") or n in _TOKENIZER_FILES)
    files = [os.path.join(folder, n) for n in names if os.path.isfile(os.path.join(folder, n))]
    return _sha256(files) if files else None


def _reward_path(cfg: DictConfig) -> str:
    import recipe_hacpo.reward.math_reward as math_reward

    path = OmegaConf.select(cfg, "reward.custom_reward_function.path", default=None)
    if not path or os.path.realpath(str(path)) == os.path.realpath(math_reward.__file__):
        return "package"  # wherever the package is installed, it is the same reward
    return str(path)


def run_identity(cfg: DictConfig, specs) -> dict[str, Any]:
    """This launch's identity, flat: {key: value} with the keys of IDENTITY_KEYS (per agent)."""
    settings = OmegaConf.select(cfg, "algorithm.hacpo", default=None)
    settings = OmegaConf.to_container(settings, resolve=True) if settings is not None else {}
    mode = str(settings.get("mode", "hacpo"))
    verl_loss = method_for(mode).objective is None  # the method trains with verl's own policy loss
    identity: dict[str, Any] = {"method": str(cfg.get("method") or mode), "algorithm.hacpo.mode": mode}
    identity.update({f"algorithm.hacpo.{k}": v for k, v in sorted(settings.items()) if k != "mode"})
    identity["agents"] = [s.name for s in specs]
    for s in specs:
        key = f"agents.{s.name}"
        identity[f"{key}.model_path"] = s.model_path
        identity[f"{key}.model_digest"] = model_digest(s.model_path)
        identity[f"{key}.rollout_n"] = int(s.rollout_n)
        identity[f"{key}.lora_rank"] = int(s.section(cfg, "model").get("lora_rank") or 0)
        identity[f"{key}.policy_loss"] = (
            str(OmegaConf.select(s.section(cfg, "actor"), "policy_loss.loss_mode", default="vanilla")) if verl_loss else None)
    identity["reward.custom_reward_function.path"] = _reward_path(cfg)
    identity["reward.custom_reward_function.name"] = str(
        OmegaConf.select(cfg, "reward.custom_reward_function.name", default=None) or "compute_score")
    identity["data.train_files"] = [f"{os.path.basename(p)} sha256:{_sha256([p])[:16]}"
                                    for p in file_list(OmegaConf.select(cfg, "data.train_files", default=None))]
    identity["trainer.async.enable"] = bool(OmegaConf.select(cfg, "trainer.async.enable", default=False))
    return identity


def write_identity(folder: str, identity: dict[str, Any]) -> None:
    with open(os.path.join(folder, IDENTITY_FILE), "w") as f:
        json.dump({"version": IDENTITY_VERSION, "identity": identity}, f, indent=1)


def read_identity(folder: str) -> dict[str, Any] | None:
    """A checkpoint's recorded identity; None for a checkpoint written before identities were recorded."""
    path = os.path.join(folder, IDENTITY_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            return dict(json.load(f)["identity"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path}: unreadable ({type(exc).__name__}: {exc}); the checkpoint's run cannot be told") from None


def identity_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """'key: checkpoint X, this run Y' for every identity key that differs. Compared: the keys
    both record (a setting a later version adds is not held against an older checkpoint), and
    per-agent keys for the agents both have (an added or dropped agent shows in `agents`)."""
    both = set(saved.get("agents") or []) & set(current.get("agents") or [])
    out = []
    for key in saved:
        if key not in current or (key.startswith("agents.") and key.split(".")[1] not in both):
            continue
        old, new = saved.get(key), current.get(key)
        if old != new:
            out.append(f"{key}: checkpoint {_shown(old)}, this run {_shown(new)}")
    return out


def _shown(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(str(v) for v in value) + "]"
    if isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value):
        return value[:16]  # a digest: its first 16 hex digits tell two apart
    return json.dumps(value) if not isinstance(value, str) else repr(value)


def check_resume_identity(checkpoint: str, current: dict[str, Any], resume_mode: str) -> str | None:
    """Refuse (ConfigError, one line) a resume from `checkpoint` by another run; returns the one
    warning line for a checkpoint that records no identity, else None."""
    saved = read_identity(checkpoint)
    if saved is None:
        return (f"WARN: {checkpoint} records no run identity (written before checkpoints recorded one): its method, "
                "agents, models, rollout_n, reward, training data and trainer could not be checked against this run's")
    differences = identity_differences(saved, current)
    if not differences:
        return None
    way_out = ("trainer.resume_from_path names another run's checkpoint; point it at this run's, or start fresh "
               "with trainer.resume_mode=disable" if resume_mode == "resume_path" else
               "start this run fresh in that folder with trainer.resume_mode=disable, or give it another "
               "trainer.default_local_dir")
    raise ConfigError(f"resume from {checkpoint}: written by another run ({'; '.join(differences)}); {way_out}")


def describe_checkpoint(step_dir: str) -> str:
    """One line naming what trained the checkpoint `step_dir`: method, agents (with their models), step."""
    step = os.path.basename(os.path.normpath(step_dir)).removeprefix("global_step_")
    try:
        saved = read_identity(step_dir)
    except ConfigError as exc:
        return f"checkpoint {step_dir}: step {step}; {exc}"
    if saved is None:
        return f"checkpoint {step_dir}: step {step}; no run identity recorded (written before checkpoints recorded one)"
    agents = ", ".join(f"{a} ({saved.get(f'agents.{a}.model_path')}, rollout_n {saved.get(f'agents.{a}.rollout_n')})"
                       for a in saved.get("agents") or [])
    trainer = "asynchronous" if saved.get("trainer.async.enable") else "lockstep"
    return (f"checkpoint {step_dir}: method {saved.get('method')} (mode {saved.get('algorithm.hacpo.mode')}, {trainer}), "
            f"step {step}, agents {agents}")
