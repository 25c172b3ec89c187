"""One test per metric family of docs/METRICS.md, each against numbers computed by hand, so
that a family aggregated the wrong way (a count averaged, a mean over the wrong rows, a min
averaged, a per-agent time summed over agents) fails here. The trainer's own phase methods
run on stand-in agents; the update metrics go through verl's real `train_mini_batch`."""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from training_worker import run_train_mini_batch
from verl import DataProto
from verl.utils import tensordict_utils as tu
from verl.utils.metric import AggregationType, Metric

from recipe_hacpo import batch_keys as K
from recipe_hacpo.training.agent_runtime import _record_metrics, _step_metrics
from recipe_hacpo.methods.core_algos import CapabilityTracker
from recipe_hacpo.hacpo_settings import HacpoSettings
from recipe_hacpo.training.scoring import Verifier
from recipe_hacpo.training.trainer import HacpoTrainer


def _trainer(names: list[str], *, shared_pool: bool = False) -> HacpoTrainer:
    """A HacpoTrainer without workers: specs, settings and stand-in agents only."""
    from helpers.stand_in import stand_in_trainer

    return stand_in_trainer(names, shared_pool=shared_pool)


def _rollout(responses: list[list[int]], rewards: list[float] | None = None, uids: list[str] | None = None) -> DataProto:
    """One agent's rollout rows: right-padded response ids with their mask (plus rewards / uids)."""
    width = max(len(r) for r in responses)
    ids = torch.zeros(len(responses), width, dtype=torch.long)
    mask = torch.zeros(len(responses), width, dtype=torch.long)
    for i, r in enumerate(responses):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
    tensors = {"responses": ids, "response_mask": mask, "prompts": torch.ones(len(responses), 2, dtype=torch.long)}
    tensors.update({"input_ids": torch.cat([tensors["prompts"], ids], 1), "attention_mask": torch.cat([torch.ones_like(tensors["prompts"]), mask], 1)})
    tensors["position_ids"] = torch.arange(tensors["input_ids"].shape[1]).expand_as(tensors["input_ids"]).clone()
    tensors[K.REWARD] = torch.tensor(rewards if rewards is not None else [0.0] * len(responses))
    tensors["old_log_probs"] = torch.zeros(ids.shape)
    tensors[K.SOURCE_LOG_PROB_MEAN] = torch.zeros(len(responses))
    tensors[K.SOURCE_RESPONSE_LENGTH] = mask.sum(-1).float()
    uid = np.array(uids if uids is not None else [f"p{i}" for i in range(len(responses))], dtype=object)
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": uid})


# ---------------------------------------------------------------------------------- reward/*
class _Digits:
    """A tokenizer stand-in: id n decodes to the digit n."""

    def __len__(self) -> int:
        return 10

    def decode(self, ids, **_):
        return "".join(str(i) for i in ids)


def _reward(solution_str: str, **_):
    kind = solution_str[0]
    if kind == "2":
        raise ValueError("a reward bug")
    if kind == "4":
        time.sleep(30)  # abandoned by the verifier's deadline
    return {
        "1": 1.0, "9": 0.0, "3": float("nan"),
        "6": {"score": 0.0, "reason": "timeout"}, "7": {"score": 0.0, "reason": "error:ValueError"},
    }[kind]


def test_reward_family_counts_failures_and_averages_over_every_row():
    t = _trainer(["a"])
    t.agents["a"].tokenizer = _Digits()
    t.verifier = Verifier(_reward, timeout_s=3.0)
    # first id = what the reward function does; lengths 3, 1, 2, 4, 1, 2, 1, 3
    rows = [[1, 5, 5], [1], [9, 5], [2, 5, 5, 5], [3], [4, 5], [6], [7, 5, 5]]
    metrics: dict = {}
    t.score({"a": _rollout(rows)}, metrics)
    assert metrics["agent/a/reward/mean"] == pytest.approx(2 / 8)  # failures score 0 and stay in the mean
    assert metrics["agent/a/reward/errors"] == 2.0  # a raise and an "error:" reason: a count, not a rate
    assert metrics["agent/a/reward/timeouts"] == 2.0  # a deadline and a "timeout" reason
    assert metrics["agent/a/reward/nonfinite"] == 1.0
    assert metrics["agent/a/response_length/mean"] == pytest.approx(17 / 8)  # response tokens per row


# ------------------------------------------------------------------------------- advantage/*
def test_advantage_family_means_over_the_learner_batch_and_counts_guarded_groups():
    t = _trainer(["a", "b"])
    t.tracker = CapabilityTracker(2)
    t.tracker.update([0.8, 0.4])  # ω^(a,b) = 2
    # learner a: group g1 own (1, 0), cross (1, 1); group g2 own (0, 1), cross (0, 0)
    batch = _rollout([[1]] * 8, rewards=[1, 0, 1, 1, 0, 1, 0, 0], uids=["g1"] * 4 + ["g2"] * 4)
    batch.batch[K.SOURCE] = torch.tensor([0, 0, 1, 1, 0, 0, 1, 1])
    metrics: dict = {}
    peer = _rollout([[1]] * 2, uids=["g1", "g2"])
    peer.batch[K.SOURCE] = torch.tensor([1, 1])
    t.advantages({"a": batch, "b": peer}, metrics)
    # g1: μ̂ = (1 + 0 + 2 + 2) / 4 = 1.25 > 1 → guard: own mean 0.5; σ = 0.5 → A = 1, −1, 1, 1
    # g2: μ̂ = (0 + 1 + 0 + 0) / 4 = 0.25; σ = 0.5 → A = −0.5, 1.5, −0.5, −0.5
    assert metrics["agent/a/advantage/mean"] == pytest.approx(2 / 8, rel=1e-5)
    assert metrics["agent/a/advantage/abs_mean"] == pytest.approx(7 / 8, rel=1e-5)
    assert metrics["agent/a/advantage/guard_groups"] == 1.0  # one group (of 4 rows) was guarded


# --------------------------------------------------------------- capability, omega/*, cross/*
def test_capability_is_the_windowed_mean_and_cross_rows_a_count():
    t = _trainer(["a", "b", "c"])
    t.hacpo = HacpoSettings(window=2)
    t.effective = t.hacpo
    t.tracker = CapabilityTracker(3, window=2)
    metrics: dict = {}
    for a_rewards in ([1.0, 1.0], [1.0, 0.0], [0.0, 0.0]):  # step means 1.0, 0.5, 0.0
        rollouts = {"a": _rollout([[1]] * 2, rewards=a_rewards), "b": _rollout([[1]] * 3, rewards=[1.0, 0.0, 0.0]),
                    "c": _rollout([[1]], rewards=[0.0])}
        t.update_capabilities(rollouts, metrics)
    assert metrics["agent/a/capability"] == pytest.approx(0.25)  # mean of the last K = 2 steps, not of all 3
    assert metrics["agent/b/capability"] == pytest.approx(1 / 3)  # mean over the agent's rows of a step
    assert metrics["agent/c/capability"] == pytest.approx(1e-3)  # floored at ε_P

    t.converters = {(s, l): SimpleNamespace(convert=lambda b: b[list(range(len(b)))])
                   for s in "abc" for l in "abc" if s != l}
    batches = t.exchange(rollouts, metrics)
    assert metrics["agent/a/cross/rows"] == 4.0  # 3 rows of b + 1 of c: a count, not a fraction of 6
    assert len(batches["a"]) == 6
    assert metrics["agent/a/omega/b"] == pytest.approx((1 / 3) / 0.25)  # ω^(b,a) = P̂b / P̂a
    assert metrics["agent/c/omega/a"] == 10.0  # P̂a / P̂c = 250, clamped at ω_max


# --------------------------------------------------------------- actor/*, hacpo/* (the loss)
def _per_rank(aggregation: AggregationType, *micro_batches: float) -> Metric:
    m = Metric(aggregation)
    m.extend(list(micro_batches))
    return m


INF = math.inf
SUM, MEAN, MIN, MAX = AggregationType.SUM, AggregationType.MEAN, AggregationType.MIN, AggregationType.MAX
# per mini-batch: {key: (rank 0's micro-batch values, rank 1's)}; mini-batch 1 has no cross row
LOSS_METRICS = [
    {"actor/pg_loss": (SUM, [0.1, 0.2], [0.3, 0.4]),
     "actor/pg_clipfrac": (MEAN, [0.0, 0.5], [0.25, 0.25]),
     "hacpo/cross_ratio_min": (MIN, [0.9, INF], [0.8, 0.95]),
     "hacpo/cross_ratio_max": (MAX, [1.1, -INF], [1.3, 1.0])},
    {"actor/pg_loss": (SUM, [0.05, 0.15], [0.25, 0.35]),
     "actor/pg_clipfrac": (MEAN, [0.5, 0.5], [1.0, 0.0]),
     "hacpo/cross_ratio_min": (MIN, [INF, INF], [INF, INF]),
     "hacpo/cross_ratio_max": (MAX, [-INF, -INF], [-INF, -INF])},
]


def test_update_families_through_verls_train_mini_batch(monkeypatch):
    """verl's `TrainingWorker.train_mini_batch` reduces each mini-batch's micro-batches and
    ranks; `_step_metrics` then reduces the step's mini-batches."""
    def train_batch(self, data):  # what verl's train_batch returns with 2 data-parallel ranks
        m = len(seen)
        seen.append(m)
        metrics = {k: [_per_rank(agg, *r0), _per_rank(agg, *r1)] for k, (agg, r0, r1) in LOSS_METRICS[m].items()}
        metrics["grad_norm"] = [2.0, 4.0][m]  # one value per optimizer step, as verl reports it
        return tu.get_tensordict(tensor_dict={}, non_tensor_dict={"metrics": metrics})

    seen: list[int] = []
    _, output = run_train_mini_batch(monkeypatch, train_batch, rows=4, mini_batch_size=2, epochs=1, outputs=True)
    out = _step_metrics(tu.get(output, "metrics"))

    # pg_loss: per micro-batch the rank mean, summed over micro-batches (0.2 + 0.3, 0.15 + 0.25),
    # then the mean over the step's two updates
    assert out["actor/pg_loss"] == pytest.approx((0.5 + 0.4) / 2)
    # clipfrac: a mean at every level ((0.125 + 0.375) / 2 = 0.25, (0.75 + 0.25) / 2 = 0.5)
    assert out["actor/pg_clipfrac"] == pytest.approx(0.375)
    # min / max over every micro-batch, rank and mini-batch; no-cross placeholders left out
    assert out["hacpo/cross_ratio_min"] == 0.8
    assert out["hacpo/cross_ratio_max"] == 1.3
    assert out["grad_norm"] == pytest.approx(3.0)


# ------------------------------------------------------------- hacpo/* (the workers' record)
def test_record_family_counts_updates_once_and_takes_minima_over_ranks():
    bounds = [0.8, 0.825, 0.85, 0.875]
    record = [
        [{"update_index": m, "lower_bound": b, "own_rows": 8, "cross_rows": 8 - m} for m, b in enumerate(bounds)],
        [{"update_index": m, "lower_bound": b, "own_rows": 6 + m, "cross_rows": 8} for m, b in enumerate(bounds)],
    ]
    out = _record_metrics(record)
    assert out["hacpo/updates"] == 4.0  # optimizer updates of the step, not updates × ranks
    assert out["hacpo/min_own_rows"] == 6.0  # fewest of any rank in any mini-batch
    assert out["hacpo/min_cross_rows"] == 5.0
    assert out["hacpo/lower_bound"] == pytest.approx(0.8375)  # mean over the step's updates


# ----------------------------------------------------------------------------- timing_s/*
def test_timing_family_per_agent_own_time_and_phase_wall_time(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    t = _trainer(["a", "b"], shared_pool=True)  # the shared pool: agents take turns
    t.config = SimpleNamespace(trainer={})
    t._pool = None
    cost = {"a": 2.0, "b": 3.0}

    def work(agent):
        clock[0] += cost[agent.spec.name]

    timing: dict = {}
    with t._phase_timer(timing)("gen"):
        t.for_each_agent(work, phase="gen")
    assert t.agent_timing == {"agent/a/timing_s/gen": 2.0, "agent/b/timing_s/gen": 3.0}  # own time each
    assert timing == {"gen": 5.0}  # the phase's wall time over both agents


# ---------------------------------------------------------------------------- val/*/mean@k
def test_validation_family_is_a_mean_per_data_source():
    t = _trainer(["a"], shared_pool=True)
    t.agents["a"].tokenizer = _Digits()
    t.agents["a"].config = SimpleNamespace(actor_rollout_ref=SimpleNamespace(rollout=SimpleNamespace(val_kwargs=SimpleNamespace(n=2))))
    t.verifier = Verifier(_reward, timeout_s=30.0)
    t._pool = None
    # 3 prompts (2 of source s1, 1 of s2) x k = 2 samples; "1" scores 1, "9" scores 0
    samples = _rollout([[1], [9], [1], [1], [9], [1]])
    samples.non_tensor_batch["data_source"] = np.array(["s1"] * 4 + ["s2"] * 2, dtype=object)
    t.agents["a"].generate = lambda prompts, **_: samples
    t.val_dataloader = [{"raw_prompt_ids": np.array([[1], [2], [3]], dtype=object)}]
    metrics = t.validate()
    assert metrics == {"agent/a/val/s1/mean@2": pytest.approx(0.75), "agent/a/val/s2/mean@2": pytest.approx(0.5)}
