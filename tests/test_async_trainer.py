"""Asynchronous agents (`trainer.async.enable=true`) through Ray on CPU, hf backend, the demo pair.

- Equal step costs on the virtual clock: the run equals the lockstep trainer metric for metric
  (conftest.py's `hacpo_pair_reference`, the same pair, data and seeds).
- A 1 : 3 cost pair on the virtual clock: the fast agent makes more steps, every take's lag is
  within K, groups of the slow agent's older rows are padded to the joint layout; a run stopped
  after its first joint checkpoint and resumed ends where the uninterrupted run ends.
- SIGUSR1 on the wall clock (isolated agents): a joint checkpoint at the agents' step boundaries, exit 75, resumed.
- SGT (joint takes only) at 1 : 2 trains (GRAFT at equal costs equals its lockstep run on the
  presets' pair: tests/test_graft_e2e.py).
What it cannot run is refused before Ray, in one line: tests/test_async_config.py.
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers.e2e import (HACPO_PAIR_KINDS, HACPO_PAIR_RUN, REPO, agent_overrides, assert_same_training_metrics, run_main,
                         train_steps)

from recipe_hacpo import batch_keys as K

pytestmark = [pytest.mark.e2e, pytest.mark.ray]

NAMES = ["qwen_char", "llama_pair"]
VIRTUAL = ["trainer.async.enable=true", "trainer.async.clock=virtual"]


def test_equal_costs_equal_the_lockstep_trainer_metric_for_metric(tmp_path, warm_agent_paths, hacpo_pair_reference):
    _, lockstep = hacpo_pair_reference
    records = run_main(str(tmp_path), agent_overrides(warm_agent_paths, HACPO_PAIR_KINDS) + HACPO_PAIR_RUN + VIRTUAL
                       + ["trainer.save_freq=2"])
    steps = train_steps(records)
    # rewards, capabilities, ω, advantages, losses, clip fractions, grad norms of both agents
    assert_same_training_metrics(steps, lockstep, at_least=60)
    for step in (1, 2, 3):
        for name in NAMES:
            # every take was the peer's rows of the same batch, sampled by the peer's current version
            assert steps[step][f"agent/{name}/async/joint_frac"] == 1.0
            assert steps[step][f"agent/{name}/async/cross_lag_max"] == 0.0
            assert steps[step][f"agent/{name}/async/filler_rows"] == 0.0
            assert steps[step][f"agent/{name}/async/version"] == step
    # the joint checkpoint of round 2 and the last one (round 3), each agent at its own version
    assert os.path.isdir(tmp_path / "ckpt" / "global_step_2" / "qwen_char")
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"


def _unequal_overrides(out, warm_agent_paths) -> list[str]:
    """The demo pair at a 1 : 3 step cost on the virtual clock, until the slow agent made 2 steps."""
    return (agent_overrides(warm_agent_paths, HACPO_PAIR_KINDS)
            + ["trainer.total_training_steps=2", "trainer.test_freq=-1", "trainer.val_before_train=false",
               "trainer.resume_mode=auto", *VIRTUAL, "+trainer.async.virtual_step_s.llama_pair=3.0",
               "trainer.async.stop=slowest", "trainer.async.max_source_lag=2", "trainer.save_freq=1",
               f"trainer.learner_batch_dir={out}/batches"])


def test_a_one_to_three_pair_trains_pads_and_resumes_where_it_would_have_ended(tmp_path, warm_agent_paths):
    from verl import DataProto

    full = run_main(str(tmp_path / "full"), _unequal_overrides(tmp_path / "full", warm_agent_paths))
    steps = train_steps(full)
    last = full[-1]["data"]
    fast, slow = last["agent/qwen_char/async/steps"], last["agent/llama_pair/async/steps"]
    # stop=slowest: the slow agent made 2 steps, the fast one about 3 per slow one meanwhile
    assert slow == 2 and fast >= 5, (fast, slow)
    assert last["agent/qwen_char/async/pool_busy_frac"] > last["agent/llama_pair/async/pool_busy_frac"] * 0.9
    lags = [d[f"agent/{n}/async/cross_lag_max"] for d in steps.values() for n in NAMES if f"agent/{n}/async/cross_lag_max" in d]
    assert lags and max(lags) <= 2
    for data in steps.values():
        for n in NAMES:
            if f"agent/{n}/actor/pg_loss" in data:
                assert math.isfinite(data[f"agent/{n}/actor/pg_loss"])
    # some learner batch of the fast agent held a group of the slow agent's rows only, padded with
    # rows of its own part that carry no token, no advantage and no place in the statistics
    padded = 0
    for step in range(1, int(fast) + 1):
        path = tmp_path / "full" / "batches" / f"step_{step}" / "qwen_char.pkl"
        batch = DataProto.load_from_disk(str(path))
        if K.SELECTED not in batch.batch.keys():
            continue
        filler = ~batch.batch[K.SELECTED]
        padded += int(filler.sum())
        assert not bool(batch.batch["response_mask"][filler].any())
        assert not bool(batch.batch["advantages"][filler].any())
        # every prompt group has the joint size (4 own + 4 cross rows)
        uids = batch.non_tensor_batch["uid"].tolist()
        assert {uids.count(u) for u in set(uids)} == {8}
    assert padded > 0

    # the same run SIGKILLed (its whole process group) a random moment into an update after its
    # first joint checkpoint, then resumed: it ends where the uninterrupted run ends, on the same metrics
    killed = tmp_path / "killed"
    killed.mkdir()
    latest = killed / "ckpt" / "latest_checkpointed_iteration.txt"
    progress = killed / "progress.json"
    log = open(killed / "log.txt", "w")
    env = dict(os.environ, VERL_FILE_LOGGER_PATH=str(killed / "metrics.jsonl"), HACPO_DATA_DIR=os.path.join(REPO, "data"))
    cmd = [sys.executable, "-m", "recipe_hacpo.main", "--config-name", "hacpo_cpu_demo", "trainer.logger=[console,file]",
           f"trainer.default_local_dir={killed}/ckpt", f"hydra.run.dir={killed}/hydra", "trainer.progress_bar=false",
           *_unequal_overrides(killed, warm_agent_paths), f"trainer.progress_file={progress}"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 900

    def phase():
        try:
            return json.loads(progress.read_text())
        except (OSError, ValueError):
            return {}

    try:
        while not (latest.exists() and latest.read_text().strip() == "1") and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert latest.exists(), open(killed / "log.txt").read()[-4000:]
        while phase().get("phase") != "update_actor" and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        at_kill = phase()
        time.sleep(random.uniform(0.0, 0.2))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        log.close()
    assert proc.returncode == -signal.SIGKILL, "the run ended before it was killed"
    assert at_kill["phase"] == "update_actor" and at_kill["step"] >= 2, at_kill
    resumed = run_main(str(killed), _unequal_overrides(killed, warm_agent_paths))
    end = resumed[-1]["data"]
    for key in ("agent/qwen_char/async/steps", "agent/llama_pair/async/steps", "async/end_s"):
        assert end[key] == last[key], (key, end[key], last[key])
    assert_same_training_metrics(train_steps(resumed), steps, at_least=1)


def test_a_signal_stops_every_agent_at_its_step_boundary_with_a_joint_checkpoint_then_resume_finishes(
        tmp_path, warm_agent_paths):
    """SIGUSR1 (Slurm's warning before preemption) on the wall clock, isolated agents: every agent finishes its step,
    one joint checkpoint holds each at its own version, exit status 75; the same command resumes
    and every step of every agent is logged once."""
    from recipe_hacpo.cluster.reliability import STATE_FILE

    out = tmp_path
    metrics = out / "metrics.jsonl"
    # isolated agents: the stop and the resume are the same in every mode, and this is isolated's run
    overrides = agent_overrides(warm_agent_paths, HACPO_PAIR_KINDS) + ["algorithm.hacpo.mode=isolated",
        "trainer.total_training_steps=5", "trainer.test_freq=-1", "trainer.val_before_train=false",
        "trainer.save_freq=-1", "trainer.resume_mode=auto", "trainer.async.enable=true", "trainer.async.clock=wall"]
    cmd = [sys.executable, "-m", "recipe_hacpo.main", "--config-name", "hacpo_cpu_demo", "trainer.logger=[console,file]",
           f"trainer.default_local_dir={out}/ckpt", f"hydra.run.dir={out}/hydra", "trainer.progress_bar=false", *overrides]
    env = dict(os.environ, VERL_FILE_LOGGER_PATH=str(metrics), HACPO_DATA_DIR=os.path.join(REPO, "data"))
    with open(out / "log.txt", "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            deadline = time.monotonic() + 600
            while proc.poll() is None and time.monotonic() < deadline:
                if metrics.exists() and "training/global_step" in metrics.read_text():
                    break
                time.sleep(0.05)
            os.kill(proc.pid, signal.SIGUSR1)
            rc = proc.wait(timeout=600)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=60)
    text = (out / "log.txt").read_text()
    assert rc == 75, text[-4000:]
    latest = (out / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip()
    state = torch.load(out / "ckpt" / f"global_step_{latest}" / STATE_FILE, weights_only=False)
    assert min(state["agent_steps"].values()) == int(latest) >= 1 and max(state["agent_steps"].values()) < 5, state["agent_steps"]
    run_main(str(out), overrides)
    versions = {n: [] for n in NAMES}
    for line in metrics.read_text().splitlines():
        data = json.loads(line)["data"]
        for n in NAMES:
            if f"agent/{n}/async/version" in data:
                versions[n].append(int(data[f"agent/{n}/async/version"]))
    assert versions == {n: [1, 2, 3, 4, 5] for n in NAMES}, versions
    takes = [json.loads(line)["data"].get(f"agent/{n}/async/peers_taken") for line in metrics.read_text().splitlines()
             for n in NAMES]
    assert {t for t in takes if t is not None} == {0.0}  # isolated agents take no peer rows


def test_sgt_at_one_to_two_takes_only_joint_rows_and_trains(tmp_path, warm_agent_paths):
    """SGT (as GRAFT) takes only peers' rows of its own batch; a fast agent's step whose batch the
    slow one has not answered trains on its own rows (each group's imitation slot carrying no
    token: tests/test_method_contract.py has that step for every method)."""
    records = run_main(str(tmp_path), agent_overrides(warm_agent_paths, HACPO_PAIR_KINDS) + [
        # SGT's groups hold one more row (the imitation slot): 5 rows a prompt
        "algorithm.hacpo.mode=sgt", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        # a third slow step, for a prompt to imitate
        "trainer.total_training_steps=3", "trainer.test_freq=-1",
        "trainer.val_before_train=false", "trainer.save_freq=-1", "trainer.resume_mode=disable", *VIRTUAL,
        "+trainer.async.virtual_step_s.llama_pair=2.0", "trainer.async.stop=slowest"])
    steps = train_steps(records)
    taken = [(d[f"agent/{n}/async/peers_taken"], d[f"agent/{n}/async/joint_frac"]) for d in steps.values()
             for n in NAMES if f"agent/{n}/async/peers_taken" in d]
    assert any(t > 0 for t, _ in taken) and all(j == 1.0 for t, j in taken if t > 0), taken
    assert any(t == 0 for t, _ in taken)  # the fast agent's steps whose batch the slow agent never answered
    for d in steps.values():
        for n in NAMES:
            if f"agent/{n}/actor/pg_loss" in d:
                assert math.isfinite(d[f"agent/{n}/actor/pg_loss"])
    assert records[-1]["data"]["agent/qwen_char/async/steps"] > records[-1]["data"]["agent/llama_pair/async/steps"] == 3
    # the slow agent's joint steps had a peer to imitate
    assert any(d.get("agent/llama_pair/sgt/prompts_imitated", 0) > 0 for d in steps.values())
