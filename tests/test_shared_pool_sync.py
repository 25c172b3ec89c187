"""On a shared pool one replica is awake at a time: the step's sync leaves a shared-pool agent's
replica asleep and `generate` syncs it right before its own rollout; an agent of its own pool is
synced at once, as before. The planner's sync phase by hand numbers (the LoRA one-GPU preset's
8B agent). No Ray: fake weight-sync managers count the replicas awake."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch
from hydra import compose, initialize_config_module
from verl import DataProto

from recipe_hacpo.cluster import planner
from recipe_hacpo.training.agent_runtime import AgentRuntime
from recipe_hacpo.config import agent_specs
from recipe_hacpo.cluster.planner import GIB
from recipe_hacpo.training.trainer import HacpoTrainer


class _Pool:
    """The GPU of a shared pool: which replicas are awake, and the most at once."""

    def __init__(self):
        self.awake: set[str] = set()
        self.most = 0
        self.events: list[str] = []


class _SyncManager:
    def __init__(self, name: str, pool: _Pool):
        self.name, self.pool = name, pool

    def update_weights(self, step: int) -> None:  # wakes the replica and sends the weights
        self.pool.awake.add(self.name)
        self.pool.most = max(self.pool.most, len(self.pool.awake))
        self.pool.events.append(f"sync {self.name} {step}")

    def sleep_replicas(self) -> None:
        self.pool.awake.discard(self.name)
        self.pool.events.append(f"sleep {self.name}")


class _AgentLoop:
    def __init__(self, name: str, pool: _Pool):
        self.name, self.pool = name, pool

    def generate_sequences(self, batch: DataProto) -> DataProto:
        assert self.name in self.pool.awake, f"{self.name} generates on a sleeping replica"
        self.pool.events.append(f"generate {self.name} awake={sorted(self.pool.awake)}")
        rows = len(batch)
        out = DataProto.from_dict(tensors={"prompts": torch.zeros(rows, 2, dtype=torch.long),
                                           "responses": torch.zeros(rows, 2, dtype=torch.long),
                                           "attention_mask": torch.ones(rows, 4, dtype=torch.long)})
        out.meta_info["timing"] = {}
        return out


def _runtime(name: str, shared: bool, pool: _Pool) -> AgentRuntime:
    rt = object.__new__(AgentRuntime)
    rt.spec = SimpleNamespace(name=name, uses_shared_pool=shared)
    rt.config = SimpleNamespace(actor_rollout_ref=SimpleNamespace(rollout=SimpleNamespace(
        n=1, temperature=1.0, val_kwargs=SimpleNamespace(n=1, do_sample=False, temperature=0.0))))
    rt.checkpoint_manager = _SyncManager(name, pool)
    rt.agent_loop = _AgentLoop(name, pool)
    rt._rollout_awake = False
    rt.weights_version = 0
    return rt


def _trainer(agents: dict[str, AgentRuntime], step: int) -> HacpoTrainer:
    from helpers.stand_in import stand_in_trainer

    return stand_in_trainer(agents=agents, global_step=step)


def _prompts() -> DataProto:
    return DataProto.from_dict(tensors={"input_ids": torch.zeros(2, 2, dtype=torch.long)},
                               non_tensors={"uid": np.array(["a", "b"], dtype=object)})


def test_shared_pool_syncs_each_agent_right_before_its_own_rollout():
    pool = _Pool()
    agents = {n: _runtime(n, shared=True, pool=pool) for n in ("small", "large")}
    tr = _trainer(agents, step=3)
    for a in agents.values():  # as after a step's rollout: replicas asleep
        a._rollout_awake = False
    tr.sync_weights()  # end of step 3
    assert pool.events == [] and pool.awake == set()
    assert {a.weights_version for a in agents.values()} == {3}
    for a in agents.values():  # step 4's rollout, in turn on the shared pool
        a.generate(_prompts(), step=4)
    assert pool.most == 1
    assert pool.events == ["sync small 3", "generate small awake=['small']", "sleep small",
                           "sync large 3", "generate large awake=['large']", "sleep large"]


def test_own_pool_agent_is_synced_at_the_end_of_the_step():
    pool = _Pool()
    own = _runtime("own", shared=False, pool=pool)
    tr = _trainer({"own": own}, step=5)
    tr.sync_weights()
    assert pool.events == ["sync own 5"] and own._rollout_awake
    own.generate(_prompts(), step=6)
    assert pool.events == ["sync own 5", "generate own awake=['own']", "sleep own"]  # no second sync


def test_defer_sync_puts_an_awake_replica_to_sleep():
    pool = _Pool()
    rt = _runtime("a", shared=True, pool=pool)
    rt.sync_weights(1)
    rt.defer_sync(2)
    assert pool.awake == set() and rt.weights_version == 2 and not rt._rollout_awake


def test_negative_control_syncing_every_agent_wakes_both():
    """What the step's sync did before: both replicas awake together on the shared pool."""
    pool = _Pool()
    agents = {n: _runtime(n, shared=True, pool=pool) for n in ("small", "large")}
    for a in agents.values():
        a.sync_weights(3)
    assert pool.most == 2


# ---------------------------------------------------------------------------- the planner's sync phase
def test_lora_preset_sync_phase_by_hand():
    with initialize_config_module("recipe_hacpo.configs", version_base=None):
        cfg = compose("pair_qwen3-4b-base_qwen3-8b-base_lora_1gpu")
    plans = {p.name: p for p in planner.plan(cfg, agent_specs(cfg), 80)}
    big, small = plans["qwen3_8b_base"], plans["qwen3_4b_base"]
    bucket = 2048 * 2**20
    # verl merges the adapter into a whole fp32 copy of the model before sending it
    assert big.sync_staging == 4 * (big.params + big.lora_params) + bucket
    assert big.vllm_weights == 2 * big.params  # the replica's bf16 weights, woken first
    # params and optimizer offloaded: nothing resident; the 4B replica asleep during the 8B's sync
    assert big.resident == small.resident == 0
    assert big.sync_need == 4 * GIB + big.vllm_weights + big.sync_staging
    assert round(big.sync_need / GIB, 1) == 52.4
    # one replica awake at a time in the rollout phase: 4 processes + one 28 GiB share
    assert big.rollout_need == small.rollout_need == 4 * GIB + int(0.35 * 80 * GIB)
    assert big.fits and small.fits
    text = planner.format_plan(list(plans.values()), 80)
    assert "sync phase 52.4 GiB" in text


def test_sync_phase_that_does_not_fit_is_reported():
    with initialize_config_module("recipe_hacpo.configs", version_base=None):
        cfg = compose("pair_qwen3-4b-base_qwen3-8b-base_lora_1gpu",
                      overrides=["++actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=40960"])
    big = {p.name: p for p in planner.plan(cfg, agent_specs(cfg), 80)}["qwen3_8b_base"]
    assert not big.fits
    assert any(m.startswith("sync phase with the other agents of its shared pool needs 90.4 GiB per GPU") and "LoRA: the whole merged model" in m
               for m in big.problems), big.problems
