"""The methods' contract (recipe_hacpo/methods/): every mode has its method, the trainer's step,
config.py and the worker ask the table and hold no branch on the mode, every shipped method keeps
the contract on a stand-in step, and a method defined in this file alone — no line of the package
edited — brings its own setting, its own batch field, its own mini-batch order and a count its
loss needs over all ranks, and trains end to end through `python -m recipe_hacpo.main` as
`algorithm.hacpo.mode=test_method_contract:ToyShare`."""

from __future__ import annotations

import ast
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.e2e import REPO, agent_overrides, assert_weights_changed, run_main, train_steps

from recipe_hacpo import batch_keys as K
from recipe_hacpo.hacpo_settings import MODES, ConfigError, HacpoSettings
from recipe_hacpo.methods import METHODS, Method, method_for
from recipe_hacpo.methods.context import prefixed
from recipe_hacpo.methods.objective import Objective, PolicyTerm
from recipe_hacpo.methods.rows import LEARNER_TENSORS, concat_rows, tag_rows
from recipe_hacpo.methods.minibatch import prompt_groups, verl_layout

TOY = "test_method_contract:ToyShare"


# ------------------------------------------------------------------ a method of this file alone
TOY_WEIGHT = "toy_weight"
"""Its own per-row field: 2 on a learner's own rows, 1 on a peer's."""
TOY_WEIGHT_SUM = "toy_weight_sum"
"""The count its loss needs over all ranks: Σ toy_weight of the mini-batch (the loss's denominator)."""


@dataclass(frozen=True)
class ToyOptions:
    """Its own setting, `algorithm.hacpo.method_options.scale`: the advantage's scale."""

    scale: float = 1.0


def _centred(rewards: torch.Tensor, uid) -> torch.Tensor:
    """Each row's reward minus its group's mean, float [B]."""
    rewards = rewards.float()
    out = torch.zeros_like(rewards)
    for u in set(uid.tolist()):
        rows = torch.as_tensor(uid == u)
        out[rows] = rewards[rows] - rewards[rows].mean()
    return out


def _toy_fields(hacpo) -> list[str]:
    return ["response_mask", "advantages", K.IS_CROSS, TOY_WEIGHT]


def _toy_term(mb) -> PolicyTerm:
    """Weighted REINFORCE: −Σ_i w_i·A_i·mean_t log π / Σ w over the mini-batch on every rank."""
    from verl.utils import tensordict_utils as tu
    from verl.utils.metric import AggregationType, Metric

    weight_sum = tu.get_non_tensor_data(data=mb.data, key=TOY_WEIGHT_SUM, default=None)
    if weight_sum is None:
        raise RuntimeError(f"toy loss: the worker set no {TOY_WEIGHT_SUM}")
    mask = mb.response_mask.float()
    tokens = mask.sum(-1).clamp(min=1)
    seq_log_prob = (mb.log_prob * mask).sum(-1) / tokens
    advantage = (mb.padded["advantages"] * mask).sum(-1) / tokens
    pg_loss = -(mb.padded[TOY_WEIGHT] * advantage * seq_log_prob).sum() * mb.batch_info["dp_size"] / weight_sum
    in_loss = mb.response_mask.any(-1)
    metrics = {"toy/tokens": Metric(value=float(mask.sum()), aggregation=AggregationType.SUM),
               "toy/weight_sum": Metric(value=float(weight_sum), aggregation=AggregationType.MEAN)}
    rows = {"row": mb.data[K.ROW].reshape(-1)[in_loss].tolist(), "ratio": [1.0] * int(in_loss.sum()),
            "clipped": [False] * int(in_loss.sum())}
    cross = mb.padded[K.IS_CROSS].bool()
    return PolicyTerm(pg_loss=pg_loss, total=pg_loss, agg_mode="token-mean", metrics=metrics,
                      own_rows=int((~cross).sum()), cross_rows=int(cross.sum()), rows=rows)


class ToyShare(Method):
    """Every learner trains on its own rows (weight 2) and every peer's (weight 1) with weighted
    REINFORCE, advantage = `scale` × (reward − the learner's group mean), prompt groups updated
    from the highest prompt index down."""

    metric_groups = ("toy/",)
    objective = Objective(fields=_toy_fields, term=_toy_term)
    options_type = ToyOptions
    batch_fields = (TOY_WEIGHT,)
    global_counts = {TOY_WEIGHT_SUM: TOY_WEIGHT}

    def rows_per_prompt(self, specs, learner, settings):
        return sum(s.rollout_n for s in specs)

    def exchange(self, ctx, rollouts):
        batches, metrics = {}, ctx.metrics()
        for learner in ctx.specs:
            parts = []
            for src in ctx.specs:
                own = src.name == learner.name
                rows = rollouts[src.name] if own else ctx.convert(src.name, learner.name, rollouts[src.name])
                part = tag_rows(rows, source=src.index, cross=not own, omega=1.0)
                part.batch[TOY_WEIGHT] = torch.full((len(part),), 2.0 if own else 1.0)
                parts.append(part)
            batches[learner.name] = concat_rows(parts, self.batch_fields)
            metrics[learner.name]["toy/rows"] = float(len(batches[learner.name]))
        return batches, metrics

    def advantages(self, ctx, batches):
        scale = self.options(ctx.settings).scale
        for batch in batches.values():
            centred = _centred(batch.batch[K.REWARD], batch.non_tensor_batch["uid"]) * scale
            batch.batch["advantages"] = centred.float().unsqueeze(-1) * batch.batch["response_mask"]
            batch.batch["returns"] = batch.batch["advantages"]
        return {name: {"toy/scale": scale} for name in batches}

    def mini_batch_order(self, settings, uid, is_cross, *, mini_batch_prompts, dp_size, seed):
        groups, rows_of = prompt_groups(uid, np.asarray(is_cross), "toy order", "is_cross")
        descending = sorted(groups, key=lambda g: -int(g.rsplit("prompt", 1)[1]))
        return verl_layout(descending, rows_of, mini_batch_prompts=mini_batch_prompts, dp_size=dp_size)


class HalfMethod(Method):
    """A method that forgot its advantages: refused by name, before anything runs."""

    def exchange(self, ctx, rollouts):
        return {}, {}


# ------------------------------------------------------------------ the table
def test_every_mode_has_its_method_and_the_table_is_closed():
    assert set(METHODS) == set(MODES)
    for mode in MODES:
        method = method_for(mode)
        assert isinstance(method, Method)
        assert (method.objective is None) == (mode == "isolated")  # isolated keeps verl's loss


def test_a_method_outside_the_package_is_named_by_import_path():
    assert HacpoSettings.from_dict({"mode": TOY}).mode == TOY
    assert isinstance(method_for(TOY), ToyShare)
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
    for rel in ("recipe_hacpo/training/trainer.py", "recipe_hacpo/config.py", "workers/hacpo_worker.py", "recipe_hacpo/methods/objective.py"):
        tree = ast.parse(Path(REPO, rel).read_text())
        compared = [
            node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Compare)
            and any(isinstance(side, ast.Attribute) and side.attr == "mode" for side in [node.left, *node.comparators])
        ]
        assert not compared, f"{rel}: compares .mode at lines {compared}"


def _identifiers(path: Path) -> set[str]:
    """Every name, attribute and imported module a module's code uses (its docstrings aside)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.ImportFrom):
            found.add(node.module or "")
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return found


def test_the_runtime_worker_and_config_name_no_method_and_no_method_knows_the_trainer():
    """What a method needs (its mini-batch order, its fields, its counts, its replay source, its
    options) the runtime, the worker and the config ask it for; methods/ never imports the
    trainer, the runtime or workers/."""
    method_words = ("graft", "sgt", "imitation", "selected", "loss_rows", "group_advantage")
    for rel in ("recipe_hacpo/training/trainer.py", "recipe_hacpo/training/agent_runtime.py", "recipe_hacpo/config.py",
                *(f"workers/{p.name}" for p in Path(REPO, "workers").glob("*.py"))):
        named = {i for i in _identifiers(Path(REPO, rel)) if any(w in i.lower() for w in method_words)}
        assert not named, f"{rel} names a method's own parts: {sorted(named)}"
    for path in Path(REPO, "recipe_hacpo", "methods").glob("*.py"):
        used = _identifiers(path)
        assert not {m for m in used if m.startswith(("recipe_hacpo.training.trainer", "recipe_hacpo.training.agent_runtime",
                                                      "recipe_hacpo.workers", "recipe_hacpo.exchange.jobs"))}, path.name
        assert "trainer" not in {i.lower() for i in used}, f"{path.name} refers to a trainer"


def test_a_methods_own_options_are_typed_and_an_unknown_one_is_refused_in_one_line():
    toy = method_for(TOY)
    assert toy.options(HacpoSettings.from_dict({"mode": TOY})) == ToyOptions()
    assert toy.options(HacpoSettings.from_dict({"mode": TOY, "method_options": {"scale": 2.0}})).scale == 2.0
    with pytest.raises(ConfigError) as err:
        toy.options(HacpoSettings.from_dict({"mode": TOY, "method_options": {"scael": 2.0}}))
    assert str(err.value) == (f"algorithm.hacpo.method_options.scael: not an option of mode={TOY} (its options: scale)")
    with pytest.raises(ConfigError, match=r"^algorithm\.hacpo\.method_options\.scale: mode=graft takes no method options$"):
        method_for("graft").options(HacpoSettings.from_dict({"mode": "graft", "method_options": {"scale": 2.0}}))


# ------------------------------------------------------------------ every method on one stand-in step
G = 2


def _scored_rollouts(tokenizer, names: list[str]) -> dict:
    """Two prompts, G answers per agent, scored; agent 0 fails prompt 0 which agent 1 half solves
    (so GRAFT grafts, SGT imitates and the complementary selection selects)."""
    from verl import DataProto

    from recipe_hacpo.exchange.retokenize import pack_rows

    rewards = {0: [0.0, 0.0, 1.0, 0.0], 1: [1.0, 0.0, 0.0, 0.0]}
    out = {}
    for a, name in enumerate(names):
        prompts = [tokenizer.encode(f"q{p}", add_special_tokens=False) for p in range(2) for _ in range(G)]
        responses = [tokenizer.encode(f"{a}{i}", add_special_tokens=False) for i in range(2 * G)]
        layout = pack_rows(prompts, responses, pad_id=tokenizer.pad_token_id, prompt_width=8, response_width=8)
        tensors = dict(layout)
        tensors.update({
            "old_log_probs": -torch.ones(2 * G, 8),
            K.REWARD: torch.tensor(rewards[a % 2]),
            K.SOURCE_LOG_PROB_MEAN: -torch.ones(2 * G),
            K.SOURCE_RESPONSE_LENGTH: layout["response_mask"].sum(-1).float(),
        })
        uid = np.array([f"step1-prompt{p}" for p in range(2) for _ in range(G)], dtype=object)
        raw = np.empty(2 * G, dtype=object)
        for i in range(2 * G):
            raw[i] = [{"role": "user", "content": f"q{i // G}"}]
        out[name] = DataProto.from_dict(tensors=tensors, non_tensors={"uid": uid, "raw_prompt": raw})
    return out


@pytest.mark.parametrize("mode", [*MODES, "hacpo+complementary", TOY])
def test_every_method_keeps_the_contract_on_a_stand_in_step(mode, char_tokenizer):
    """exchange and advantages on a StepContext: a learner batch per agent with the learner
    fields, the method's own fields and what its objective reads; metrics per agent, unprefixed."""
    import dataclasses

    from helpers.stand_in import stand_in_context

    from recipe_hacpo.exchange.retokenize import RowConverter

    names = ["a", "b"]
    raw = {"mode": mode.split("+")[0]}
    if mode.endswith("complementary"):
        raw["share_selection"] = "complementary"
    settings = HacpoSettings.from_dict(raw)
    converters = {(s, l): RowConverter(char_tokenizer, char_tokenizer, max_prompt_length=8, max_response_length=8)
                  for s in names for l in names}
    ctx = stand_in_context(names, converters, settings=settings, rollout_n=G)
    # GRAFT's extra forward over the grafted rows: the receiver's old log-probs, here −1
    ctx = dataclasses.replace(ctx, old_log_probs_of_rows=lambda requests, phase: {
        n: (-torch.ones(len(rows), 8) if len(rows) else None) for n, (_, rows) in requests.items()})
    method = method_for(settings.mode)
    batches, exchanged = method.exchange(ctx, _scored_rollouts(char_tokenizer, names))
    advantaged = method.advantages(ctx, batches)
    assert set(batches) == set(names)
    for metrics in (exchanged, advantaged):
        assert set(metrics) <= set(names) and not any(k.startswith("agent/") for m in metrics.values() for k in m)
    assert "agent/a/cross/rows" in prefixed(exchanged) or not method_for(settings.mode).shares or mode == TOY
    for name, batch in batches.items():
        keys = set(batch.batch.keys())
        assert set(LEARNER_TENSORS) <= keys and {"advantages", "returns"} <= keys, name
        if method.objective is not None:
            assert set(method.objective.fields(settings)) <= keys, (name, set(method.objective.fields(settings)) - keys)
        for counted in method.global_counts.values():
            assert counted in method.batch_fields
        extra = keys - set(LEARNER_TENSORS) - {"advantages", "returns", K.GRAFT_WEIGHT}
        assert extra <= set(method.batch_fields), (name, extra)
    if mode in ("sgt", TOY):  # the counted field is in every batch (the selection: with complementary only)
        assert all(set(method.global_counts.values()) <= set(b.batch.keys()) for b in batches.values())


@pytest.mark.parametrize("mode", ["hacpo", "naive", "graft", "sgt", "isolated"])
def test_a_learner_whose_batch_no_peer_answered_trains_on_its_own_rows(mode, char_tokenizer):
    """An asynchronous step (StepContext.learners) of a learner that took no peer's rows: a fast
    agent ahead of its peers. GRAFT and SGT see the learner alone (their takes are joint only:
    AsyncHacpoTrainer.learner_batch); HACPO and Naive every agent, with no peer rows present. The
    learner batch holds the learner's own rows, each once, with advantages; nothing is grafted,
    imitated or received (SGT's slot of each group is a row that carries no token)."""
    import dataclasses

    from helpers.stand_in import stand_in_context

    from recipe_hacpo.exchange.retokenize import RowConverter

    names = ["a", "b"]
    settings = HacpoSettings.from_dict({"mode": mode})
    converters = {(s, l): RowConverter(char_tokenizer, char_tokenizer, max_prompt_length=8, max_response_length=8)
                  for s in names for l in names}
    ctx = stand_in_context(names, converters, settings=settings, rollout_n=G)
    joint_only = mode in ("graft", "sgt")

    def no_forward(requests, phase):  # GRAFT's forward over grafted rows: here there are none
        assert all(len(rows) == 0 for _, rows in requests.values()), requests
        return {n: None for n in requests}

    ctx = dataclasses.replace(ctx, learners=("a",), specs=ctx.specs[:1] if joint_only else ctx.specs,
                              old_log_probs_of_rows=no_forward)
    own = _scored_rollouts(char_tokenizer, names)["a"]
    method = method_for(settings.mode)
    batches, exchanged = method.exchange(ctx, {"a": own})
    advantaged = method.advantages(ctx, batches)
    assert set(batches) == {"a"}
    batch = batches["a"]
    cross = batch.batch[K.IS_CROSS]
    assert not bool(batch.batch["response_mask"][cross].any())  # SGT's slots: in no loss term
    if K.IMITATION_MASK in batch.batch.keys():
        assert not bool(batch.batch[K.IMITATION_MASK].any())
    assert sorted(batch.batch["responses"][~cross].tolist()) == sorted(own.batch["responses"].tolist())
    assert int((~cross).sum()) == len(own) and int(cross.sum()) == (2 if mode == "sgt" else 0)
    assert {"advantages", "returns"} <= set(batch.batch.keys())
    assert torch.isfinite(batch.batch["advantages"]).all()
    received = {k: v for m in (exchanged, advantaged) for k, v in m.get("a", {}).items()
                if k.endswith(("groups_received", "prompts_imitated", "cross/rows"))}
    assert all(v == 0 for v in received.values()), received


# ------------------------------------------------------------------ end to end
@pytest.mark.e2e
@pytest.mark.ray
def test_a_method_of_this_file_with_its_own_setting_field_order_and_count_trains_end_to_end(tmp_path, warm_agent_paths):
    kinds = ["qwen2-char-small", "llama-pair-medium"]
    names = ["qwen_char", "llama_pair"]
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join(p for p in (tests_dir, os.environ.get("PYTHONPATH")) if p)
    steps = train_steps(run_main(
        str(tmp_path),
        agent_overrides(warm_agent_paths, kinds)
        + [f"algorithm.hacpo.mode={TOY}", "+algorithm.hacpo.method_options.scale=2.0",
           "trainer.total_training_steps=2", "trainer.save_freq=2", "trainer.test_freq=-1",
           "trainer.val_before_train=false", f"trainer.learner_batch_dir={tmp_path}/batches",
           f"trainer.rollout_data_dir={tmp_path}/rows"],
        env={"PYTHONPATH": path},
    ))
    assert sorted(steps) == [1, 2]
    from verl import DataProto

    # the demo's layout: 8 prompts a step, 4 per update, 4 answers per agent to each prompt
    prompts, per_update, n = 8, 4, 4
    for name, kind in zip(names, kinds):
        for step in (1, 2):
            m = steps[step]
            # its exchange (own and peer rows), its setting, its objective in the workers
            assert m[f"agent/{name}/toy/rows"] == prompts * 2 * n
            assert m[f"agent/{name}/toy/scale"] == 2.0
            assert m[f"agent/{name}/toy/tokens"] > 0 and torch.isfinite(torch.tensor(m[f"agent/{name}/actor/pg_loss"]))
            # its global count: Σ toy_weight of a mini-batch (2 per own row, 1 per peer row) over every rank
            assert m[f"agent/{name}/toy/weight_sum"] == per_update * (2 * n + n)
            batch = DataProto.load_from_disk(os.path.join(tmp_path, "batches", f"step_{step}", f"{name}.pkl"))
            # its own field travelled in the learner batch
            own = ~batch.batch[K.IS_CROSS]
            assert torch.equal(batch.batch[TOY_WEIGHT], torch.where(own, 2.0, 1.0))
            # its advantages: scale × (reward − the group's mean)
            centred = 2.0 * _centred(batch.batch[K.REWARD], batch.non_tensor_batch["uid"])
            mask = batch.batch["response_mask"].float()
            got = (batch.batch["advantages"] * mask).sum(-1) / mask.sum(-1).clamp(min=1)
            assert torch.allclose(got, centred * (mask.sum(-1) > 0), atol=1e-6)
            # its mini-batch order: the prompts 7..4 in the first update, 3..0 in the second
            with open(os.path.join(tmp_path, "rows", name, f"{step}.jsonl")) as f:
                rows = [json.loads(line) for line in f]
            assert len(rows) == prompts * 2 * n
            for row in rows:
                if row["in_loss"]:
                    prompt = int(row["uid"].rsplit("prompt", 1)[1])
                    assert [u["m"] for u in row["updates"]] == [0 if prompt >= per_update else 1], row
        assert_weights_changed(warm_agent_paths[kind], os.path.join(tmp_path, "ckpt", "global_step_2", name))
