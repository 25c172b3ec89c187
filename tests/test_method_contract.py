"""The methods' contract (recipe_hacpo/methods/): every mode has its method, the trainer's step,
config.py and the worker ask the table and hold no branch on the mode, and a method defined in
this file alone — no line of the package edited — trains end to end through
`python -m recipe_hacpo.main` as `algorithm.hacpo.mode=test_method_contract:ToyReinforce`."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
import torch
from helpers.e2e import REPO, agent_overrides, assert_weights_changed, run_main, train_steps

from recipe_hacpo import batch_keys as K
from recipe_hacpo.hacpo_settings import MODES, ConfigError, HacpoSettings
from recipe_hacpo.methods import METHODS, Method, method_for
from recipe_hacpo.methods.rows import concat_rows, tag_rows
from recipe_hacpo.methods.objective import Objective, PolicyTerm

TOY = "test_method_contract:ToyReinforce"


# ------------------------------------------------------------------ a method of this file alone
def _centred(rewards: torch.Tensor, uid) -> torch.Tensor:
    """Each row's reward minus its group's mean, float [B]."""
    rewards = rewards.float()
    out = torch.zeros_like(rewards)
    for u in set(uid.tolist()):
        rows = torch.as_tensor(uid == u)
        out[rows] = rewards[rows] - rewards[rows].mean()
    return out


def _toy_fields(hacpo) -> list[str]:
    return ["response_mask", "advantages", K.IS_CROSS]


def _toy_term(mb) -> PolicyTerm:
    """REINFORCE with the group-mean baseline: −A·log π, token-mean over the mini-batch."""
    from verl.trainer.ppo.core_algos import agg_loss
    from verl.utils.metric import AggregationType, Metric

    loss_mat = -mb.padded["advantages"] * mb.log_prob
    pg_loss = agg_loss(loss_mat, mb.response_mask, "token-mean", **mb.batch_info)
    metrics = {"toy/tokens": Metric(value=float(mb.response_mask.sum()), aggregation=AggregationType.SUM)}
    return PolicyTerm(pg_loss=pg_loss, total=pg_loss, agg_mode="token-mean", metrics=metrics,
                      own_rows=int(mb.log_prob.shape[0]), cross_rows=0)


class ToyReinforce(Method):
    """Each agent alone, on its own rows, with REINFORCE and its group's mean reward as baseline."""

    metric_groups = ("toy/",)
    objective = Objective(fields=_toy_fields, term=_toy_term)

    def peer_learners(self, specs, settings, source):
        return []

    def exchange(self, trainer, rollouts, metrics):
        batches = {}
        for spec in trainer.specs:
            batches[spec.name] = concat_rows([tag_rows(rollouts[spec.name], source=spec.index, cross=False, omega=1.0)])
            metrics[f"agent/{spec.name}/toy/rows"] = float(len(batches[spec.name]))
        return batches

    def advantages(self, trainer, batches, metrics):
        for batch in batches.values():
            centred = _centred(batch.batch[K.REWARD], batch.non_tensor_batch["uid"])
            batch.batch["advantages"] = centred.float().unsqueeze(-1) * batch.batch["response_mask"]
            batch.batch["returns"] = batch.batch["advantages"]


class HalfMethod(Method):
    """A method that forgot its advantages: refused by name, before anything runs."""

    def exchange(self, trainer, rollouts, metrics):
        return {}


# ------------------------------------------------------------------ the table
def test_every_mode_has_its_method_and_the_table_is_closed():
    assert set(METHODS) == set(MODES)
    for mode in MODES:
        method = method_for(mode)
        assert isinstance(method, Method)
        assert (method.objective is None) == (mode == "isolated")  # isolated keeps verl's loss


def test_a_method_outside_the_package_is_named_by_import_path():
    assert HacpoSettings.from_dict({"mode": TOY}).mode == TOY
    assert isinstance(method_for(TOY), ToyReinforce)
    with pytest.raises(ConfigError, match=r"algorithm\.hacpo\.mode='no_such_module:Toy': cannot import it"):
        method_for("no_such_module:Toy")
    with pytest.raises(ConfigError, match=r"test_method_contract:REPO': REPO is not a recipe_hacpo\.methods\.Method"):
        method_for("test_method_contract:REPO")
    with pytest.raises(ConfigError, match=r"test_method_contract:HalfMethod': Can't instantiate abstract class HalfMethod with abstract method advantages"):
        method_for("test_method_contract:HalfMethod")
    with pytest.raises(ConfigError, match=r"algorithm\.hacpo\.mode='graft2': must be one of hacpo, naive, isolated, graft, sgt"):
        HacpoSettings.from_dict({"mode": "graft2"})


def test_the_step_config_and_worker_hold_no_branch_on_the_mode():
    """No comparison with `.mode` in the trainer, config.py, the worker or its loss frame: the
    method decides (the settings module, which defines the modes, is the one place that may)."""
    for rel in ("recipe_hacpo/trainer.py", "recipe_hacpo/config.py", "workers/hacpo_worker.py", "recipe_hacpo/methods/objective.py"):
        tree = ast.parse(Path(REPO, rel).read_text())
        compared = [
            node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Compare)
            and any(isinstance(side, ast.Attribute) and side.attr == "mode" for side in [node.left, *node.comparators])
        ]
        assert not compared, f"{rel}: compares .mode at lines {compared}"


# ------------------------------------------------------------------ end to end
@pytest.mark.e2e
@pytest.mark.ray
def test_a_toy_method_of_this_file_trains_end_to_end(tmp_path, warm_agent_paths):
    kinds = ["qwen2-char-small", "llama-pair-medium"]
    names = ["qwen_char", "llama_pair"]
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join(p for p in (tests_dir, os.environ.get("PYTHONPATH")) if p)
    steps = train_steps(run_main(
        str(tmp_path),
        agent_overrides(warm_agent_paths, kinds)
        + [f"algorithm.hacpo.mode={TOY}", "trainer.total_training_steps=2", "trainer.save_freq=2",
           "trainer.test_freq=-1", "trainer.val_before_train=false", f"trainer.learner_batch_dir={tmp_path}/batches"],
        env={"PYTHONPATH": path},
    ))
    assert sorted(steps) == [1, 2]
    from verl import DataProto

    for name, kind in zip(names, kinds):
        for step in (1, 2):
            m = steps[step]
            # its exchange (own rows only), its objective in the workers (its metric, summed over
            # micro-batches), the frame's loss and the trainer's grouping of its metric family
            assert m[f"agent/{name}/toy/rows"] == 32.0
            assert m[f"agent/{name}/toy/tokens"] > 0
            assert torch.isfinite(torch.tensor(m[f"agent/{name}/actor/pg_loss"]))
            batch = DataProto.load_from_disk(os.path.join(tmp_path, "batches", f"step_{step}", f"{name}.pkl"))
            assert not bool(batch.batch[K.IS_CROSS].any())
            # its advantages: each row's reward minus its group's mean
            centred = _centred(batch.batch[K.REWARD], batch.non_tensor_batch["uid"])
            mask = batch.batch["response_mask"].float()
            got = (batch.batch["advantages"] * mask).sum(-1) / mask.sum(-1).clamp(min=1)
            assert torch.allclose(got, centred * (mask.sum(-1) > 0), atol=1e-6)
        assert_weights_changed(warm_agent_paths[kind], os.path.join(tmp_path, "ckpt", "global_step_2", name))
