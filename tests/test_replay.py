"""GRAFT against a recorded peer (recipe_hacpo/methods/replay.py), without Ray: the one-direction selection by
hand, the prompt check, the recording's files, and the config checks before anything starts. The
run end to end is `test_graft_e2e.py::test_replay_of_a_recorded_peer_trains_one_agent_alone`."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from helpers.compose import compose_config as _compose
from helpers.compose import first_agent_only as _first_agent_only

from recipe_hacpo import batch_keys as K
from recipe_hacpo.config import ConfigError, validate
from recipe_hacpo.methods.graft_formulas import graft_selection
from recipe_hacpo.methods.replay import (
    MANIFEST,
    RecordedPeer,
    check_same_prompts,
    read_manifest,
    record_rollouts,
    replay_selection,
    step_file,
)
from verl import DataProto


def test_the_receiver_takes_the_recorded_group_where_it_failed_and_the_peer_is_mixed():
    #            q0  q1  q2  q3  q4
    k_r = [0, 0, 1, 0, 0]  # the receiver failed q0, q1, q3, q4
    k_s = [1, 4, 2, 0, 3]  # n_S = 4: q1 all correct, q3 all wrong
    taken = replay_selection(torch.tensor([k_r, k_s]), peer_n=4)
    assert taken.tolist() == [True, False, False, False, True]
    # one direction, unbalanced: what GRAFT's selection without balancing gives this receiver,
    # whatever the peer would have taken from it (q2: the peer failed nothing here, so nothing)
    unbalanced = graft_selection(torch.tensor([k_r, k_s]), torch.tensor([4, 4]), balance=False)
    assert torch.equal(unbalanced[0] == 1, taken)
    # balancing would have dropped both: the receiver gives the peer no group (k_S > 0 everywhere else)
    assert (graft_selection(torch.tensor([k_r, k_s]), torch.tensor([4, 4]))[0] == 1).sum() == 0


def _prompts(uids, texts) -> DataProto:
    raw = np.empty(len(uids), dtype=object)
    raw[:] = [[{"role": "user", "content": t}] for t in texts]
    return DataProto.from_dict(tensors={"x": torch.zeros(len(uids), 1)},
                               non_tensors={"uid": np.array(uids, dtype=object), "raw_prompt": raw})


def test_the_recording_must_hold_the_steps_prompts():
    live = _prompts(["step1-prompt0", "step1-prompt0", "step1-prompt1"], ["1+1=", "1+1=", "2+2="])
    # the same prompts in another row order pass
    check_same_prompts(_prompts(["step1-prompt1", "step1-prompt0"], ["2+2=", "1+1="]), live, "here")
    with pytest.raises(ValueError, match=r"^here: the recording holds another prompt under step1-prompt1 "
                                         r"\(0 prompts missing, 1 differing\); replay needs the recording run's data order"):
        check_same_prompts(_prompts(["step1-prompt0", "step1-prompt1"], ["1+1=", "3+3="]), live, "here")
    with pytest.raises(ValueError, match=r"has no rows of step1-prompt1 \(1 prompts missing"):
        check_same_prompts(_prompts(["step1-prompt0"], ["1+1="]), live, "here")


class _Spec:
    def __init__(self, name, n):
        self.name, self.model_path, self.rollout_n = name, f"/models/{name}", n


def test_recording_writes_each_agents_step_and_its_manifest(tmp_path):
    batch = _prompts(["step3-prompt0", "step3-prompt0"], ["1+1=", "1+1="])
    batch.batch[K.REWARD] = torch.tensor([1.0, 0.0])
    record_rollouts(str(tmp_path), 3, {"a": batch, "b": batch}, [_Spec("a", 2), _Spec("b", 2)])
    for name in ("a", "b"):
        assert read_manifest(str(tmp_path / name)) == {"name": name, "model_path": f"/models/{name}", "rollout_n": 2}
        back = DataProto.load_from_disk(step_file(str(tmp_path / name), 3))
        assert torch.equal(back.batch[K.REWARD], batch.batch[K.REWARD])
        assert back.non_tensor_batch["uid"].tolist() == ["step3-prompt0"] * 2
    assert sorted(os.listdir(tmp_path / "a")) == [MANIFEST, "step_3.pkl"]  # no temporary file left
    peer = RecordedPeer.__new__(RecordedPeer)  # a missing step names its file, before any update
    peer.dir = str(tmp_path / "a")
    with pytest.raises(FileNotFoundError, match=r"replay_peer: no recording of step 4 \(.*step_4.pkl\)"):
        peer.load(4, batch)


def test_replay_is_checked_before_anything_starts(tmp_path, demo_overrides):
    graft = ["algorithm.hacpo.mode=graft", f"algorithm.hacpo.replay_peer={tmp_path}/llama_pair"]
    with pytest.raises(ConfigError, match=r"replay_peer='.*/llama_pair': no such directory"):
        validate(_first_agent_only(_compose("hacpo_cpu_demo", demo_overrides + graft)))
    os.makedirs(tmp_path / "llama_pair")
    with pytest.raises(ConfigError, match=r"no manifest.json; record with trainer.record_rollouts_dir=DIR"):
        validate(_first_agent_only(_compose("hacpo_cpu_demo", demo_overrides + graft)))
    (tmp_path / "llama_pair" / MANIFEST).write_text(json.dumps({"name": "llama_pair", "model_path": "/m", "rollout_n": 8}))
    with pytest.raises(ConfigError, match=r"^agents\.qwen_char: rollout_n=4 but the recorded peer 'llama_pair' "
                                          r"sampled 8 per prompt"):
        validate(_first_agent_only(_compose("hacpo_cpu_demo", demo_overrides + graft)))
    with pytest.raises(ConfigError, match=r"trains one agent alone against the recording, got 2 agents"):
        validate(_compose("hacpo_cpu_demo", demo_overrides + graft))
    specs, hacpo = validate(_first_agent_only(_compose("hacpo_cpu_demo", demo_overrides + graft
                                                       + ["agents.qwen_char.rollout_n=8"])))
    assert [s.name for s in specs] == ["qwen_char"] and hacpo.replay_peer == f"{tmp_path}/llama_pair"
    with pytest.raises(ConfigError, match=r"replays a recorded peer for mode=graft"):
        validate(_first_agent_only(_compose("hacpo_cpu_demo", demo_overrides + [graft[1]])))

