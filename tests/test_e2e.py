"""End to end: `python -m recipe_hacpo.main` through Ray on CPU with tiny heterogeneous agents
(different sizes, architectures and tokenizers) and the `hf` rollout backend: three agents with a
reference model on GRAFT's selected prompts, isolated mode, naive sharing with agents sharing
one pool. Two agents in HACPO mode run
through vLLM in tests/test_vllm_tier.py."""

from __future__ import annotations

import json
import math
import os

import pytest
from helpers.e2e import agent_overrides, assert_finite_losses, assert_weights_changed, run_main, train_steps
from helpers.golden import check_golden, golden_run_overrides

from recipe_hacpo import batch_keys as K

pytestmark = [pytest.mark.e2e, pytest.mark.ray]

# Two agents in HACPO mode end to end (training, sharing, checkpoints, the learner batches) run
# through verl's vLLM servers in the vLLM tier (tests/test_vllm_tier.py), which checks its
# learner batches with `helpers.e2e.check_learner_batches`; resume after SIGKILL through the hf
# backend is in tests/test_reliability.py.


# ----------------------------------------------------------------------------- 3 agents, other modes
def test_three_agents_with_kl_to_reference_on_grafts_selected_prompts(tmp_path, warm_agent_paths, warm_real_agent_paths):
    """Three agents with three tokenizers, HACPO with a KL term to each agent's reference model,
    trained on GRAFT's selected prompts (`share_selection=complementary`; HACPO on every prompt,
    the default, runs with three agents in the vLLM tier): every peer row keeps its place in the
    learner batch, the unselected ones without a token, an advantage or a place in the group
    statistics. Two of the agents are the presets' pair in miniature (tied Qwen3 and tied
    Llama-3.2 with the real Qwen3 and Llama-3 tokenizers), beside a tiny Qwen2."""
    from verl import DataProto

    warm = {**warm_agent_paths, **warm_real_agent_paths}
    # the third agent added from the command line by name, as the README shows
    third = f"+agents.llama3={{model_path:'{warm['llama3p2-tied']}',rollout_n:4,n_gpus_per_node:1,nnodes:1}}"
    records = run_main(
        str(tmp_path),
        agent_overrides(warm, ["qwen2-char-small", "qwen3-tied"]) + [third, "ray_kwargs.ray_init.num_gpus=3"]
        + ["trainer.total_training_steps=2", "trainer.save_freq=2", "trainer.test_freq=-1", "trainer.val_before_train=false",
           "actor_rollout_ref.actor.use_kl_loss=true", "actor_rollout_ref.actor.kl_loss_coef=0.01",
           # the first update starts at the reference, where the KL term's gradient is rounding
           # noise; Adam moves a weight by ±lr whatever its gradient's size once that size is over
           # its eps (1e-8), so the noise's sign, which other CPU kernels draw differently, would
           # steer it (the qwen3 agent's grad_norm 6 % apart under make test-other-kernels). At
           # eps 1e-6 such a weight moves by its gradient's size
           "+actor_rollout_ref.actor.optim.override_optimizer_config.eps=1e-6",
           # without GRAFT's balancing, so that these tiny agents' two steps select some prompts
           "algorithm.hacpo.share_selection=complementary", "algorithm.hacpo.graft_balance=false",
           f"trainer.learner_batch_dir={tmp_path}/batches"]
        + golden_run_overrides("hacpo_complementary_three_agents_kl", str(tmp_path)),
    )
    steps = train_steps(records)
    check_golden("hacpo_complementary_three_agents_kl", steps, tmp_path / "samples")
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
    for kind, name in zip(["qwen2-char-small", "qwen3-tied", "llama3p2-tied"], names):
        assert_weights_changed(warm[kind], os.path.join(tmp_path, "ckpt", "global_step_2", name))


def test_isolated_mode_shares_nothing(tmp_path, warm_agent_paths):
    kinds = ["qwen2-char-small", "llama-pair-medium"]
    records = run_main(
        str(tmp_path),
        agent_overrides(warm_agent_paths, kinds)
        + ["algorithm.hacpo.mode=isolated", "trainer.total_training_steps=2", "trainer.save_freq=2",
           "trainer.test_freq=-1", "trainer.val_before_train=false"]
        + golden_run_overrides("isolated", str(tmp_path)),
    )
    steps = train_steps(records)
    check_golden("isolated", steps, tmp_path / "samples")
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
        + ["algorithm.hacpo.mode=naive", "agents.qwen_char.n_gpus_per_node=0", "agents.llama_pair.n_gpus_per_node=0",
           "trainer.n_gpus_per_node=1", "ray_kwargs.ray_init.num_gpus=1", "trainer.total_training_steps=2",
           "trainer.save_freq=2", "trainer.test_freq=-1", "trainer.val_before_train=false"]
        + golden_run_overrides("naive_shared_pool", str(tmp_path)),
    )
    steps = train_steps(records)
    check_golden("naive_shared_pool", steps, tmp_path / "samples")
    names = ["qwen_char", "llama_pair"]
    assert_finite_losses(steps, names)
    for kind, name in zip(kinds, names):
        assert steps[2][f"agent/{name}/cross/rows"] == 32
        # no capability terms: ω is 1 for every source
        peer = [n for n in names if n != name][0]
        assert steps[2][f"agent/{name}/omega/{peer}"] == 1.0
        assert_weights_changed(warm_agent_paths[kind], os.path.join(tmp_path, "ckpt", "global_step_2", name))


def test_val_only_validates_the_agents_and_trains_nothing(tmp_path, warm_agent_paths):
    """verl's `trainer.val_only`: the held-out accuracy of each agent at step 0, then exit; no
    update, no checkpoint."""
    kinds = ["qwen2-char-small", "llama-pair-medium"]
    records = run_main(str(tmp_path), agent_overrides(warm_agent_paths, kinds)
                       + ["trainer.val_only=true", "trainer.log_val_generations=3"])
    assert [r["step"] for r in records] == [0]
    metrics = records[0]["data"]
    for name in ("qwen_char", "llama_pair"):
        accuracy = [v for k, v in metrics.items() if k.startswith(f"agent/{name}/val/")]
        assert len(accuracy) == 1 and 0 <= accuracy[0] <= 1
    assert not any("/actor/" in k for k in metrics)
    assert not os.path.exists(os.path.join(tmp_path, "ckpt", "global_step_1"))
    # trainer.log_val_generations=3: three samples of each agent (verl's choice: by input, seed 42),
    # in the run folder and in TensorBoard
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with open(os.path.join(tmp_path, "val_generations.jsonl")) as f:
        (logged,) = [json.loads(line) for line in f]
    assert logged["step"] == 0 and sorted(logged["data"]) == ["llama_pair", "qwen_char"]
    for name, samples in logged["data"].items():
        assert len(samples) == 3 and all(s["input"] and s["score"] in (0.0, 1.0) for s in samples), samples
        assert len({s["input"] for s in samples}) == 3 and all("+" in s["input"] for s in samples)
    events = EventAccumulator(os.path.join(tmp_path, "ckpt", "tensorboard"))
    events.Reload()
    assert {"agent/qwen_char/val/generations/text_summary", "agent/llama_pair/val/generations/text_summary"} <= set(
        events.Tags()["tensors"])
