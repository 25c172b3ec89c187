"""End to end: `python -m recipe_hacpo.main` with `algorithm.hacpo.mode=graft` through Ray on CPU,
tiny agents with different tokenizers, 2 agents with checkpoint, resume and evaluation of the
checkpoint, and 3 agents; and `mode=sgt` (`+baseline=sgt`) with 2 agents.

The two-agent runs train the presets' pair in miniature: a tied Qwen3 and a tied Llama-3.2 with
the real Qwen3 and Llama-3 tokenizers (`tiny_agents.REAL_ARCH_KINDS`)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import REAL_PAIR
from helpers.golden import check_golden, golden_run_overrides, replay_overrides
from helpers.e2e import (REPO, agent_overrides, assert_finite_losses, assert_same_training_metrics, assert_weights_changed,
                         run_main, train_steps)

from recipe_hacpo import batch_keys as K
from recipe_hacpo.methods.graft_formulas import grpo_advantage
from recipe_hacpo.methods.sgt_formulas import sgt_selection

pytestmark = [pytest.mark.e2e, pytest.mark.ray]

GRAFT = ["algorithm.hacpo.mode=graft", "actor_rollout_ref.actor.clip_ratio_low=0.2",
         "actor_rollout_ref.actor.clip_ratio_high=0.28"]
G, PROMPTS = 4, 8  # hacpo_cpu_demo: rollout_n 4, 8 prompts a step
PAIR, PAIR_NAMES = list(REAL_PAIR), ["qwen3", "llama3"]  # Qwen3 + Llama-3.2, real tokenizers


@pytest.fixture(scope="module")
def graft_run(tmp_path_factory, warm_real_agent_paths):
    out = str(tmp_path_factory.mktemp("graft2"))
    kinds = PAIR
    # without balancing a graft needs one direction only, so the tiny agents graft in most steps
    records = run_main(
        out,
        agent_overrides(warm_real_agent_paths, kinds) + GRAFT
        + ["algorithm.hacpo.graft_balance=false", "trainer.total_training_steps=2", "trainer.save_freq=1",
           "trainer.test_freq=-1", "trainer.val_before_train=false", f"trainer.learner_batch_dir={out}/batches",
           f"trainer.record_rollouts_dir={out}/recorded"]
        + golden_run_overrides("graft_pair", out),
    )
    check_golden("graft_pair", train_steps(records), f"{out}/samples")
    return out, records, kinds


def test_asynchronous_graft_at_equal_costs_equals_the_lockstep_run(graft_run, warm_real_agent_paths, tmp_path):
    """Asynchronous agents (`trainer.async`, virtual clock, equal costs) on the presets' pair:
    GRAFT's selection compares the agents' answers to the same prompts, so an asynchronous learner
    takes only its peers' rows of its own batch (joint_only) and selects among those peers; at
    equal costs every take is joint and the run equals the lockstep run metric for metric, the
    rows of the two real tokenizers converted in the learner's own update phase."""
    out = str(tmp_path)
    _, lockstep, kinds = graft_run
    records = run_main(out, agent_overrides(warm_real_agent_paths, kinds) + GRAFT + [
        "algorithm.hacpo.graft_balance=false", "trainer.total_training_steps=2", "trainer.save_freq=-1",
        "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.resume_mode=disable",
        "trainer.async.enable=true", "trainer.async.clock=virtual", *replay_overrides("graft_pair")])
    steps = train_steps(records)
    assert_same_training_metrics(steps, train_steps(lockstep), at_least=40)
    for step in (1, 2):
        for name in PAIR_NAMES:
            assert steps[step][f"agent/{name}/async/joint_frac"] == 1.0
    # not vacuous: groups were grafted
    assert sum(steps[s][f"agent/{n}/graft/groups_received"] for s in (1, 2) for n in PAIR_NAMES) > 0


def _groups(batch):
    uid = batch.non_tensor_batch["uid"]
    return {u: np.flatnonzero(uid == u) for u in dict.fromkeys(uid.tolist())}


def test_graft_two_agents_learner_batches(graft_run, warm_real_agent_paths):
    from verl import DataProto

    out, records, kinds = graft_run
    steps = train_steps(records)
    names = PAIR_NAMES
    assert sorted(steps) == [1, 2]
    assert_finite_losses(steps, names)
    grafted_somewhere = 0
    for step in (1, 2):
        batches = {n: DataProto.load_from_disk(os.path.join(out, "batches", f"step_{step}", f"{n}.pkl")) for n in names}
        given = {n: 0 for n in names}
        for k, name in enumerate(names):
            b, m = batches[name], steps[step]
            groups = _groups(b)
            # every prompt once, each a whole group of one agent: the receiver's own or one source's
            assert len(groups) == PROMPTS and all(len(rows) == G for rows in groups.values())
            src, cross = b.batch[K.SOURCE], b.batch[K.IS_CROSS]
            mask = b.batch["response_mask"]
            received = 0
            for u, rows in groups.items():
                rows_t = torch.as_tensor(rows)
                assert len(set(src[rows_t].tolist())) == 1
                if not cross[rows_t].any():
                    continue
                received += 1
                s = int(src[rows_t[0]])
                given[names[s]] += 1
                # the source's group has a success and a failure; its own GRPO advantages, fixed
                rewards = b.batch[K.REWARD][rows_t]
                assert 0 < int((rewards > 0).sum()) < G
                expected = grpo_advantage(rewards, np.array([u] * G))
                assert torch.allclose(b.batch[K.GROUP_ADVANTAGE][rows_t], expected.float(), atol=1e-6)
                # the source's own group of that prompt is in the source's batch, mixed as well
                peer = batches[names[s]]
                peer_rows = torch.as_tensor(_groups(peer)[u])
                assert not peer.batch[K.IS_CROSS][peer_rows].any()
                assert torch.equal(peer.batch[K.REWARD][peer_rows], rewards)
            assert m[f"agent/{name}/graft/groups_received"] == received
            assert m[f"agent/{name}/cross/rows"] == received * G
            # w: 1 on own rows; on grafted rows in (δ, 1] or 0 with the row's tokens masked out
            w = b.batch[K.GRAFT_WEIGHT]
            assert torch.all(w[~cross] == 1.0)
            dropped = cross & (w == 0)
            admitted = cross & (w > 0)
            assert torch.all((w[admitted] > 0.8) & (w[admitted] <= 1.0))
            assert int(mask[dropped].sum()) == 0 and torch.all(mask[admitted].sum(-1) > 0)
            assert m[f"agent/{name}/graft/admitted"] == int(admitted.sum())
            assert m[f"agent/{name}/graft/dropped"] == int(dropped.sum())
            if admitted.any():
                assert m[f"agent/{name}/graft/weight_mean"] == pytest.approx(float(w[admitted].mean()), rel=1e-5)
                # the receiver's own old log-probs of the grafted text (its extra forward), not zeros
                lp = b.batch["old_log_probs"][admitted][mask[admitted].bool()]
                assert torch.isfinite(lp).all() and bool((lp < 0).all())
                assert 0 <= m[f"agent/{name}/graft/peer_clipfrac"] <= 1
            # the advantage the loss reads is the fixed one, on admitted tokens only
            assert torch.allclose(b.batch["advantages"], b.batch[K.GROUP_ADVANTAGE].unsqueeze(-1) * mask)
            grafted_somewhere += received
        for name in names:
            assert steps[step][f"agent/{name}/graft/groups_given"] == given[name]
    assert grafted_somewhere > 0, "no group was grafted in two steps; the test checked nothing"
    for kind, name in zip(kinds, names):
        assert_weights_changed(warm_real_agent_paths[kind], os.path.join(out, "ckpt", "global_step_2", name))


def test_graft_resume_continues_from_checkpoint_and_evaluates_it(graft_run, warm_real_agent_paths, tmp_path):
    import json

    from helpers.evaluation import write_bench as _bench

    from recipe_hacpo.training.run_identity import read_identity

    out, first, kinds = graft_run
    records = run_main(
        out,
        agent_overrides(warm_real_agent_paths, kinds) + GRAFT
        + ["algorithm.hacpo.graft_balance=false", "trainer.total_training_steps=3", "trainer.save_freq=1",
           "trainer.test_freq=-1", "trainer.resume_mode=auto",
           # another logger and more steps: the same run (its identity, tests/test_run_identity.py), resumed
           "trainer.logger=[console]"],
    )
    steps = train_steps(records)
    # the run's metrics file keeps the steps the checkpoint holds and adds the resumed one
    assert sorted(steps) == [1, 2, 3], steps.keys()
    assert {s: steps[s] for s in (1, 2)} == train_steps(first)
    assert_finite_losses(steps, PAIR_NAMES)
    ckpt = os.path.join(out, "ckpt")
    assert open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")).read().strip() == "3"
    assert read_identity(os.path.join(ckpt, "global_step_3")) == read_identity(os.path.join(ckpt, "global_step_2"))

    # the resumed run's checkpoint evaluates: both tied agents' shards merged into HF models
    bench, ev_out = _bench(tmp_path, "gsm8k"), tmp_path / "eval"
    proc = subprocess.run(
        [sys.executable, "-m", "recipe_hacpo.evaluate", "--agents-from", f"graft={ckpt}", "--bench", f"GSM8K={bench}",
         "--backend", "hf", "--device", "cpu", "--max-new-tokens", "4", "--out", str(ev_out)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert set(json.loads((ev_out / "metrics.json").read_text())) == {f"graft/{n}" for n in PAIR_NAMES}


def test_export_gives_each_agent_a_hugging_face_folder_with_the_trainers_log_probs(graft_run, tmp_path):
    """`python -m recipe_hacpo.export` of step 1: one folder per agent that transformers loads, whose
    fp32 log-probs of step 2's own responses are the old log-probs the trainer computed with the
    same weights (before step 2's update): within 1e-5 (+1e-6 relative; measured 8e-6 at most)."""
    from transformers import AutoModelForCausalLM
    from verl import DataProto
    from verl.utils.torch_functional import logprobs_from_logits

    out, _, _ = graft_run
    exported = tmp_path / "hf"
    proc = subprocess.run([sys.executable, "-m", "recipe_hacpo.export", f"{out}/ckpt", "--step", "1", "--out", str(exported)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(os.listdir(exported)) == sorted(PAIR_NAMES)
    for name in PAIR_NAMES:
        folder = exported / name
        assert {"model.safetensors", "config.json", "tokenizer.json", "generation_config.json", "chat_template.jinja"} <= set(os.listdir(folder))
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        batch = DataProto.load_from_disk(os.path.join(out, "batches", "step_2", f"{name}.pkl"))
        T = batch.batch["responses"].shape[1]
        mask = batch.batch["response_mask"].bool()
        own = torch.nonzero(~batch.batch[K.IS_CROSS]).flatten()  # grafted groups replaced some of them
        assert len(own) >= G
        with torch.no_grad():
            logits = model(input_ids=batch.batch["input_ids"][own], attention_mask=batch.batch["attention_mask"][own],
                           position_ids=batch.batch["position_ids"][own]).logits[:, -T - 1:-1].float()
        got = logprobs_from_logits(logits, batch.batch["responses"][own])[mask[own]]
        want = batch.batch["old_log_probs"][own][mask[own]]
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-6)
    # a bf16 export says so in its config, for from_pretrained(dtype="auto") and vLLM
    proc = subprocess.run([sys.executable, "-m", "recipe_hacpo.export", f"{out}/ckpt/global_step_1", "--agents", "qwen3",
                           "--dtype", "bfloat16", "--out", str(tmp_path / "bf16")], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert os.listdir(tmp_path / "bf16") == ["qwen3"]
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "bf16" / "qwen3", dtype="auto").dtype == torch.bfloat16
    proc = subprocess.run([sys.executable, "-m", "recipe_hacpo.export", f"{out}/ckpt", "--agents", "gemma", "--out", str(tmp_path / "x")],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "no agent 'gemma' (it holds llama3, qwen3)" in proc.stderr and not os.path.exists(tmp_path / "x")


def test_replay_of_a_recorded_peer_trains_one_agent_alone(graft_run, tmp_path, warm_real_agent_paths):
    """The two-agent GRAFT run recorded both agents; the agent that received more groups there now
    trains alone against the other's recording (GRAFT's replay): per step, the grafted prompts are
    exactly those it failed where the recorded group is mixed (one direction, no balancing), and the
    grafted rows are the recorded responses with the recorded source's advantages and log-probs."""
    from verl import DataProto

    from recipe_hacpo.methods.replay import replay_selection, step_file

    recorded_run, records, kinds = graft_run
    names = PAIR_NAMES
    first = train_steps(records)[1]
    receiver = max((0, 1), key=lambda k: first[f"agent/{names[k]}/graft/groups_received"])
    peer = 1 - receiver
    peer_dir = os.path.join(recorded_run, "recorded", names[peer])
    out = str(tmp_path)
    steps = train_steps(run_main(out, [
        *agent_overrides(warm_real_agent_paths, [kinds[receiver]]), *GRAFT, f"algorithm.hacpo.replay_peer={peer_dir}",
        "trainer.total_training_steps=2", "trainer.save_freq=2", "trainer.test_freq=-1",
        "trainer.val_before_train=false", f"trainer.learner_batch_dir={out}/batches",
        f"trainer.record_rollouts_dir={out}/own", *golden_run_overrides("graft_replay", out)]))
    name = names[receiver]
    assert sorted(steps) == [1, 2]
    assert_finite_losses(steps, [name])
    check_golden("graft_replay", steps, f"{out}/samples")
    grafted = 0
    for step in (1, 2):
        m = steps[step]
        batch = DataProto.load_from_disk(os.path.join(out, "batches", f"step_{step}", f"{name}.pkl"))
        mine = DataProto.load_from_disk(step_file(os.path.join(out, "own", name), step))
        theirs = DataProto.load_from_disk(step_file(peer_dir, step))
        uids = list(dict.fromkeys(mine.non_tensor_batch["uid"].tolist()))

        def correct(b):
            return [int((b.batch[K.REWARD][b.non_tensor_batch["uid"] == u] > 0).sum()) for u in uids]

        taken = replay_selection(torch.tensor([correct(mine), correct(theirs)]), peer_n=G)
        expected = {u for u, t in zip(uids, taken.tolist()) if t}
        groups = _groups(batch)
        cross = batch.batch[K.IS_CROSS]
        got = {u for u, rows in groups.items() if cross[torch.as_tensor(rows)].all()}
        assert got == expected and len(groups) == PROMPTS and all(len(r) == G for r in groups.values())
        assert m[f"agent/{name}/graft/groups_received"] == len(expected)
        assert m[f"agent/{name}/cross/rows"] == len(expected) * G
        for u in expected:
            rows, src_rows = torch.as_tensor(groups[u]), np.flatnonzero(theirs.non_tensor_batch["uid"] == u)
            # the recorded responses (as text), their re-verified rewards, the recorded source's
            # GRPO advantages and mean log-probs
            assert sorted(batch.non_tensor_batch[K.RESPONSE_TEXT][rows.numpy()].tolist()) == \
                sorted(theirs.non_tensor_batch[K.RESPONSE_TEXT][src_rows].tolist())
            rewards = theirs.batch[K.REWARD][src_rows]
            assert sorted(batch.batch[K.REWARD][rows].tolist()) == sorted(rewards.tolist())
            assert sorted(batch.batch[K.GROUP_ADVANTAGE][rows].tolist()) == pytest.approx(
                sorted(grpo_advantage(rewards, np.array([u] * G)).tolist()), abs=1e-6)
            assert sorted(batch.batch[K.SOURCE_LOG_PROB_MEAN][rows].tolist()) == pytest.approx(
                sorted(theirs.batch[K.SOURCE_LOG_PROB_MEAN][src_rows].tolist()), abs=1e-6)
        w = batch.batch[K.GRAFT_WEIGHT]
        assert torch.all(w[~cross] == 1.0) and torch.all((w[cross] == 0) | ((w[cross] > 0.8) & (w[cross] <= 1)))
        assert m[f"agent/{name}/graft/admitted"] + m[f"agent/{name}/graft/dropped"] == len(expected) * G
        grafted += len(expected)
    assert grafted > 0, "no recorded group was grafted in two steps; the test checked nothing"
    assert_weights_changed(warm_real_agent_paths[kinds[receiver]], os.path.join(out, "ckpt", "global_step_2", name))


def test_graft_three_agents(tmp_path, warm_agent_paths):
    kinds = ["qwen2-char-small", "qwen2-char-medium", "llama-pair-medium"]
    records = run_main(
        str(tmp_path),
        agent_overrides(warm_agent_paths, kinds) + GRAFT
        + ["trainer.total_training_steps=2", "trainer.save_freq=2", "trainer.test_freq=-1",
           "trainer.val_before_train=false"]
        + golden_run_overrides("graft_three_agents", str(tmp_path)),
    )
    steps = train_steps(records)
    names = ["qwen_char", "qwen_mid", "llama_pair"]
    assert_finite_losses(steps, names)
    check_golden("graft_three_agents", steps, tmp_path / "samples")
    for step, m in steps.items():
        received = sum(m[f"agent/{n}/graft/groups_received"] for n in names)
        # with balancing and one source per receiver and prompt, every group given is received once
        assert received == sum(m[f"agent/{n}/graft/groups_given"] for n in names)
        for n in names:
            assert m[f"agent/{n}/cross/rows"] == m[f"agent/{n}/graft/groups_received"] * G
            assert m[f"agent/{n}/graft/admitted"] + m[f"agent/{n}/graft/dropped"] == m[f"agent/{n}/cross/rows"]
    for kind, name in zip(kinds, names):
        assert_weights_changed(warm_agent_paths[kind], os.path.join(tmp_path, "ckpt", "global_step_2", name))


def test_sgt_two_agents_imitate_the_drawn_correct_peer_response(tmp_path, warm_real_agent_paths):
    from verl import DataProto

    kinds, names = PAIR, PAIR_NAMES
    seed = 7
    out = str(tmp_path)
    records = run_main(
        out,
        agent_overrides(warm_real_agent_paths, kinds)
        # hacpo_cpu_demo's update: 4 prompts × (4 own rows + 1 imitation slot) = 20 rows, 2 micro-batches
        + ["+baseline=sgt", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
           "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=10",
           f"actor_rollout_ref.actor.data_loader_seed={seed}",
           "trainer.total_training_steps=2", "trainer.save_freq=2", "trainer.test_freq=-1",
           "trainer.val_before_train=false", f"trainer.learner_batch_dir={out}/batches"]
        + golden_run_overrides("sgt_pair", out),
    )
    steps = train_steps(records)
    check_golden("sgt_pair", steps, f"{out}/samples")
    assert sorted(steps) == [1, 2]
    assert_finite_losses(steps, names)
    imitated_somewhere = 0
    for step in (1, 2):
        batches = {n: DataProto.load_from_disk(os.path.join(out, "batches", f"step_{step}", f"{n}.pkl")) for n in names}
        # the pooled rows of the step (each agent's own rows, agent order): what the draw sees
        own = [b.select_idxs(torch.nonzero(~b.batch[K.IS_CROSS]).flatten()) for b in batches.values()]
        correct = torch.cat([o.batch[K.REWARD] > 0 for o in own])
        uid = np.concatenate([o.non_tensor_batch["uid"] for o in own])
        source = torch.cat([torch.full((len(o),), k) for k, o in enumerate(own)])
        text = np.concatenate([o.non_tensor_batch[K.RESPONSE_TEXT] for o in own])
        for k, name in enumerate(names):
            b, m = batches[name], steps[step]
            uids, picks = sgt_selection(correct, uid, source, k, seed=seed, step=step)
            cross, mask, imit = b.batch[K.IS_CROSS], b.batch["response_mask"], b.batch[K.IMITATION_MASK]
            assert len(b) == PROMPTS * (G + 1)
            for q, u in enumerate(uids):
                rows = np.flatnonzero(b.non_tensor_batch["uid"] == u)
                (slot,) = rows[cross[rows].numpy()]
                assert len(rows) == G + 1 and int(mask[slot].sum()) == 0
                if picks[q] >= 0:
                    # a correct peer response, the one the run's seed, step and uid draw: a resumed
                    # run, which recomputes it from these alone, imitates the same response
                    assert b.non_tensor_batch[K.RESPONSE_TEXT][slot] == text[picks[q]]
                    assert float(b.batch[K.REWARD][slot]) > 0 and int(b.batch[K.SOURCE][slot]) != k
                    assert int(imit[slot].sum()) > 0
                else:
                    assert int(imit[slot].sum()) == 0
            imitated = int((picks >= 0).sum())
            assert m[f"agent/{name}/sgt/prompts_imitated"] == imitated
            assert m[f"agent/{name}/sgt/imitation_tokens"] == int(imit.sum())
            # GRPO on own rows: the advantage the loss reads is the agent's own group advantage
            own_rows = ~cross
            expected = grpo_advantage(b.batch[K.REWARD][own_rows], b.non_tensor_batch["uid"][own_rows.numpy()])
            assert torch.allclose(b.batch["advantages"][own_rows],
                                  expected.float().unsqueeze(-1) * mask[own_rows], atol=1e-6)
            assert not b.batch["advantages"][cross].any()
            if imitated:
                assert 0 < m[f"agent/{name}/sgt/nll"] < 50
            else:
                assert f"agent/{name}/sgt/nll" not in m
            imitated_somewhere += imitated
    assert imitated_somewhere > 0, "no prompt was imitated in two steps; the test checked nothing"
    for kind, name in zip(kinds, names):
        assert_weights_changed(warm_real_agent_paths[kind], os.path.join(out, "ckpt", "global_step_2", name))
