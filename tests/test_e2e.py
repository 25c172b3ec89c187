"""End to end: `python -m recipe_hacpo.main` through Ray on CPU with tiny heterogeneous agents
(different sizes, architectures and tokenizers) and the `hf` rollout backend: three agents with a
reference model on GRAFT's selected prompts, isolated mode, naive sharing with agents sharing
one pool. Two agents in HACPO mode run
through vLLM in tests/test_vllm_tier.py."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from recipe_hacpo import batch_keys as K
from recipe_hacpo.core_algos import compute_hacpo_advantage

pytestmark = [pytest.mark.e2e, pytest.mark.ray]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_main(out_dir: str, overrides: list[str], timeout: int = 900) -> list[dict]:
    """Run the CLI; return the per-step metric records of verl's file logger."""
    metrics_file = os.path.join(out_dir, "metrics.jsonl")
    env = dict(os.environ, VERL_FILE_LOGGER_PATH=metrics_file, HACPO_DATA_DIR=os.path.join(REPO, "data"))
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


def agent_overrides(paths: dict[str, str], kinds: list[str]) -> list[str]:
    names = {"qwen2-char-small": "qwen_char", "llama-pair-medium": "llama_pair", "qwen2-char-medium": "qwen_mid",
             "qwen3-tied": "qwen3", "llama3p2-tied": "llama3"}
    agents = ",".join(
        f"{{name:{names[k]},model_path:'{paths[k]}',rollout_n:4,n_gpus_per_node:1,nnodes:1,actor_rollout_ref:{{}}}}"
        for k in kinds
    )
    return [f"agents=[{agents}]", f"ray_kwargs.ray_init.num_gpus={len(kinds)}"]


def train_steps(records: list[dict]) -> dict[int, dict]:
    return {r["step"]: r["data"] for r in records if "training/global_step" in r["data"]}


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


# ----------------------------------------------------------------------------- HACPO, 2 agents
# Two agents in HACPO mode end to end (training, sharing, checkpoints, the learner batches) run
# through verl's vLLM servers in the vLLM tier (tests/test_vllm_tier.py), which checks its
# learner batches with `check_learner_batches`; resume after SIGKILL through the hf backend is in
# tests/test_reliability.py.
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



# ----------------------------------------------------------------------------- 3 agents, other modes
def test_three_agents_with_kl_to_reference_on_grafts_selected_prompts(tmp_path, warm_agent_paths, warm_real_agent_paths):
    """Three agents with three tokenizers, HACPO with a KL term to each agent's reference model,
    trained on GRAFT's selected prompts (`share_selection=complementary`; HACPO on every prompt,
    the default, runs with three agents in the vLLM tier): every peer row keeps its place in the
    learner batch, the unselected ones without a token, an advantage or a place in the group
    statistics. Two of the agents are the presets' pair in miniature (tied Qwen3 and tied
    Llama-3.2 with the real Qwen3 and Llama-3 tokenizers), beside a tiny Qwen2."""
    from verl import DataProto

    kinds = ["qwen2-char-small", "qwen3-tied", "llama3p2-tied"]
    warm = {**warm_agent_paths, **warm_real_agent_paths}
    records = run_main(
        str(tmp_path),
        agent_overrides(warm, kinds)
        + ["trainer.total_training_steps=2", "trainer.save_freq=2", "trainer.test_freq=-1", "trainer.val_before_train=false",
           "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.01",
           # without GRAFT's balancing, so that these tiny agents' two steps select some prompts
           "algorithm.hacpo.share_selection=complementary", "algorithm.hacpo.graft_balance=false",
           f"trainer.learner_batch_dir={tmp_path}/batches"],
    )
    steps = train_steps(records)
    names = ["qwen_char", "qwen3", "llama3"]
    assert_finite_losses(steps, names)
    for name in names:
        # every learner's batch (own and cross rows) was scored by its own reference model
        assert math.isfinite(steps[2][f"agent/{name}/actor/kl_loss"]) and steps[2][f"agent/{name}/actor/kl_loss"] >= 0
    assert steps[2]["timing_s/ref"] > 0
    for step in (1, 2):
        for name in names:
            # each learner's batch holds both peers' rows, 2 × 8 prompts × 4 responses, selected or not
            assert steps[step][f"agent/{name}/cross/rows"] == 64
            selected = steps[step][f"agent/{name}/cross/rows_selected"]
            # whole groups of one source per prompt: 4 rows a selected prompt
            assert selected == 4 * steps[step][f"agent/{name}/cross/groups_selected"] <= 32, (step, name, selected)
            batch = DataProto.load_from_disk(os.path.join(tmp_path, "batches", f"step_{step}", f"{name}.pkl"))
            chosen, cross = batch.batch[K.SELECTED], batch.batch[K.IS_CROSS]
            assert bool(chosen[~cross].all()) and int((chosen & cross).sum()) == selected
            # an unselected peer row: no token in the loss, no advantage
            assert not bool(batch.batch["response_mask"][~chosen].any())
            assert not bool(batch.batch["advantages"][~chosen].any())
    # not vacuous: some learner trained on a peer's selected rows
    assert sum(steps[s][f"agent/{n}/cross/rows_selected"] for s in (1, 2) for n in names) > 0
    for kind, name in zip(kinds, names):
        assert_weights_changed(warm[kind], os.path.join(tmp_path, "ckpt", "global_step_2", name))


def test_isolated_mode_shares_nothing(tmp_path, warm_agent_paths):
    kinds = ["qwen2-char-small", "llama-pair-medium"]
    records = run_main(
        str(tmp_path),
        agent_overrides(warm_agent_paths, kinds)
        + ["algorithm.hacpo.mode=isolated", "trainer.total_training_steps=2", "trainer.save_freq=2",
           "trainer.test_freq=-1", "trainer.val_before_train=false"],
    )
    steps = train_steps(records)
    names = ["qwen_char", "llama_pair"]
    assert_finite_losses(steps, names)
    for name in names:
        assert steps[2][f"agent/{name}/cross/rows"] == 0
    for kind, name in zip(kinds, names):
        assert_weights_changed(warm_agent_paths[kind], os.path.join(tmp_path, "ckpt", "global_step_2", name))


def test_naive_sharing_with_agents_sharing_one_pool_taking_turns(tmp_path, warm_agent_paths):
    """Naive sharing (no capability terms), with n_gpus_per_node=0: both agents' workers on
    trainer.n_gpus_per_node bundles, their phases in turn."""
    kinds = ["qwen2-char-small", "llama-pair-medium"]
    records = run_main(
        str(tmp_path),
        agent_overrides(warm_agent_paths, kinds)
        + ["algorithm.hacpo.mode=naive", "agents.0.n_gpus_per_node=0", "agents.1.n_gpus_per_node=0",
           "trainer.n_gpus_per_node=1", "ray_kwargs.ray_init.num_gpus=1", "trainer.total_training_steps=2",
           "trainer.save_freq=2", "trainer.test_freq=-1", "trainer.val_before_train=false"],
    )
    steps = train_steps(records)
    names = ["qwen_char", "llama_pair"]
    assert_finite_losses(steps, names)
    for kind, name in zip(kinds, names):
        assert steps[2][f"agent/{name}/cross/rows"] == 32
        # no capability terms: ω is 1 for every source
        peer = [n for n in names if n != name][0]
        assert steps[2][f"agent/{name}/omega/{peer}"] == 1.0
        assert_weights_changed(warm_agent_paths[kind], os.path.join(tmp_path, "ckpt", "global_step_2", name))
