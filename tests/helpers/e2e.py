"""Running `python -m recipe_hacpo.main` from a test, and what the end-to-end tests check of a run:
its per-step metric records, the learner batches a HACPO step dumped, the weights it trained.
Shared by the end-to-end tests of every tier (a helpers module, not a test module)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import torch
from safetensors.torch import load_file

from helpers.golden import replay_overrides, training_metrics

from recipe_hacpo import batch_keys as K
from recipe_hacpo.config import agents_overrides
from recipe_hacpo.methods.core_algos import compute_hacpo_advantage

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run_main(out_dir: str, overrides: list[str], timeout: int = 900, env: dict | None = None) -> list[dict]:
    """Run the CLI; return the per-step metric records of verl's file logger. `env`: variables
    set for the run (and its Ray workers) on top of this process's."""
    metrics_file = os.path.join(out_dir, "metrics.jsonl")
    env = dict(os.environ, **(env or {}), VERL_FILE_LOGGER_PATH=metrics_file, HACPO_DATA_DIR=os.path.join(REPO, "data"))
    cmd = [
        sys.executable, "-m", "recipe_hacpo.main", "--config-name", "hacpo_cpu_demo",
        "trainer.logger=[console,file]", f"trainer.default_local_dir={out_dir}/ckpt",
        f"hydra.run.dir={out_dir}/hydra", "trainer.progress_bar=false", *overrides,
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    log = proc.stdout[-6000:] + proc.stderr[-6000:]
    assert proc.returncode == 0, log
    with open(metrics_file) as f:
        return [json.loads(line) for line in f]


# the CPU demo's pair and the settings of its uninterrupted 3-step run (conftest.py's
# `hacpo_pair_reference`), which the kill-and-resume tests reproduce piece by piece; on a machine of
# another kind than the one that recorded its golden metrics, every one of these runs replays the
# recorded samples (tests/helpers/golden.py)
HACPO_PAIR_KINDS = ["qwen2-char-small", "llama-pair-medium"]
HACPO_PAIR_RUN = ["trainer.total_training_steps=3", "trainer.test_freq=-1", "trainer.val_before_train=false",
                  "trainer.resume_mode=auto", *replay_overrides("hacpo_pair")]


def agent_overrides(paths: dict[str, str], kinds: list[str]) -> list[str]:
    names = {"qwen2-char-small": "qwen_char", "llama-pair-medium": "llama_pair", "qwen2-char-medium": "qwen_mid",
             "qwen3-tied": "qwen3", "llama3p2-tied": "llama3"}
    entries = [dict(name=names[k], model_path=paths[k], rollout_n=4, n_gpus_per_node=1, nnodes=1) for k in kinds]
    return [*agents_overrides(entries), f"ray_kwargs.ray_init.num_gpus={len(kinds)}"]


def train_steps(records: list[dict]) -> dict[int, dict]:
    return {r["step"]: r["data"] for r in records if "training/global_step" in r["data"]}


# what only an asynchronous run reports (its clock, its takes), and held-out results, which it
# computes at each agent's own steps
ASYNC_ONLY = ("/async/", "/val/")


def agent_training_metrics(metrics: dict) -> dict:
    """A step's per-agent training metrics (helpers/golden.py's `training_metrics` below agent/,
    without ASYNC_ONLY): what an asynchronous run at equal costs must equal."""
    return {k: v for k, v in training_metrics(metrics).items()
            if k.startswith("agent/") and not any(p in k for p in ASYNC_ONLY)}


def assert_same_training_metrics(got: dict[int, dict], want: dict[int, dict], at_least: int) -> None:
    """Every step's training metrics of `got` equal `want`'s (same keys, at least `at_least` of them)."""
    assert sorted(got) == sorted(want), (sorted(got), sorted(want))
    for step in sorted(want):
        g, w = agent_training_metrics(got[step]), agent_training_metrics(want[step])
        assert len(w) >= at_least and set(w) == set(g), (step, sorted(set(w) ^ set(g)))
        for key, value in w.items():
            assert math.isclose(g[key], value, rel_tol=1e-5, abs_tol=1e-7), (step, key, g[key], value)


def checkpoint_weights(path: str) -> dict[str, torch.Tensor]:
    state = torch.load(os.path.join(path, "actor", "model_world_size_1_rank_0.pt"), weights_only=False)
    return {k: (v.to_local() if hasattr(v, "to_local") else v).float() for k, v in state.items()}


def assert_weights_changed(model_dir: str, ckpt_agent_dir: str) -> None:
    initial = load_file(os.path.join(model_dir, "model.safetensors"))
    trained = checkpoint_weights(ckpt_agent_dir)
    common = [k for k in trained if k in initial]
    assert common, "checkpoint and initial model share no parameter names"
    changed = [k for k in common if not torch.equal(initial[k].float(), trained[k])]
    assert len(changed) >= len(common) // 2, f"only {len(changed)}/{len(common)} tensors changed"


def assert_finite_losses(steps: dict[int, dict], names: list[str]) -> None:
    for step, data in steps.items():
        for name in names:
            loss = data[f"agent/{name}/actor/pg_loss"]
            assert math.isfinite(loss), (step, name, loss)


def check_learner_batches(step_dir: str, model_dirs: dict[str, str], prompts: int = 8, g: int = 4) -> None:
    """The two-agent learner batches a HACPO step dumped (`trainer.learner_batch_dir`) hold each
    agent's own G·prompts rows and its peer's, re-tokenized for the learner, with spec §2's
    advantages and §3's ω for the tracker state of the step. `model_dirs`: {agent: model dir},
    in agent order. Used by the vLLM tier (tests/test_vllm_tier.py) on its reference run."""
    from transformers import AutoTokenizer
    from verl import DataProto

    tracker = torch.load(os.path.join(step_dir, "tracker.pt"))
    caps = torch.tensor(np.maximum(np.mean(tracker["history"], axis=0), tracker["floor"]))
    names = list(model_dirs)
    toks = {n: AutoTokenizer.from_pretrained(d) for n, d in model_dirs.items()}
    batches = {n: DataProto.load_from_disk(os.path.join(step_dir, f"{n}.pkl")) for n in names}
    for k, name in enumerate(names):
        b = batches[name]
        src = b.batch[K.SOURCE]
        cross = b.batch[K.IS_CROSS]
        # exactly its own G·prompts rows plus the peer's G·prompts rows
        assert int((src == k).sum()) == prompts * g and not bool(cross[src == k].any())
        assert int((src != k).sum()) == prompts * g and bool(cross[src != k].all())
        # every group (uid) has both agents' answers
        uids, counts = np.unique(b.non_tensor_batch["uid"], return_counts=True)
        assert len(uids) == prompts and set(counts) == {2 * g}
        # advantages are spec §2's, with the tracker state of this step
        expected = compute_hacpo_advantage(b.batch[K.REWARD], b.non_tensor_batch["uid"], src, k, caps)
        mask = b.batch["response_mask"].float()
        got = (b.batch["advantages"] * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        rows = mask.sum(-1) > 0
        assert torch.allclose(got[rows], expected.float()[rows], atol=1e-5)
        # peer rows are the source's text in the learner's tokenization: its encoding, cut at
        # the learner's response limit, plus the learner's EOS when the source had finished
        tok = toks[name]
        width = b.batch["responses"].shape[1]
        peer = torch.nonzero(cross).flatten()
        for i in peer.tolist():
            ids = b.batch["responses"][i][b.batch["response_mask"][i].bool()].tolist()
            cut = len(ids) == width  # the learner's limit was reached
            if ids and ids[-1] == tok.eos_token_id:
                ids = ids[:-1]
            full = tok.encode(b.non_tensor_batch[K.RESPONSE_TEXT][i], add_special_tokens=False)
            assert ids == (full[: len(ids)] if cut else full), i
        # ω on cross rows is ω^(src,k) = clamp(P̂_src / P̂_k) (spec §3) and 1 on own rows
        assert torch.all(b.batch[K.OMEGA][~cross] == 1.0)
        expected_omega = (caps[src[cross]] / caps[k]).clamp(*tracker["omega_clip"]).float()
        assert torch.allclose(b.batch[K.OMEGA][cross], expected_omega, rtol=1e-6)


def logged_steps(out_dir: str) -> dict[int, dict]:
    """{step: verl's logged data} of the run whose file logger wrote `out_dir`/metrics.jsonl
    ({} before its first step)."""
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return train_steps([json.loads(line) for line in f if line.strip()])
