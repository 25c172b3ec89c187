"""`share_selection=complementary` (docs/ALGORITHM.md §9): HACPO's and Naive's update on GRAFT's
selected prompts. The trainer's own exchange and advantage phases on stand-in agents (2 and 3
agents, which peer rows are selected, counts, advantages by hand), the HACPO loss of verl's
worker ignoring the unselected rows (value, gradient and row count), and the worker's count of
the selected rows over a mini-batch."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from tensordict import TensorDict
from verl import DataProto
from verl.utils import tensordict_utils as tu
from verl.workers.engine_workers import TrainingWorker

from recipe_hacpo import batch_keys as K
from recipe_hacpo.methods.core_algos import compute_hacpo_advantage, compute_hacpo_policy_loss
from recipe_hacpo.exchange.retokenize import RowConverter, pack_rows
from recipe_hacpo.methods.graft_formulas import graft_selection
from recipe_hacpo.hacpo_settings import HacpoSettings
from recipe_hacpo.methods import method_for

F64 = torch.float64
G = 2


# --------------------------------------------------------------------------- the trainer's phases
def _rollout(tokenizer, source: int, rewards: list[float]) -> DataProto:
    """One agent's scored rollout: len(rewards) / G prompts × G responses, own old log-probs."""
    rows = len(rewards)
    prompts = [tokenizer.encode(f"q{i // G}", add_special_tokens=False) for i in range(rows)]
    responses = [tokenizer.encode(f"{source}{i}", add_special_tokens=False) for i in range(rows)]
    layout = pack_rows(prompts, responses, pad_id=tokenizer.pad_token_id, prompt_width=8, response_width=8)
    tensors = dict(layout)
    tensors.update({
        "old_log_probs": -torch.ones(rows, 8),
        K.REWARD: torch.tensor(rewards, dtype=torch.float32),
        K.SOURCE_LOG_PROB_MEAN: -torch.ones(rows),
        K.SOURCE_RESPONSE_LENGTH: layout["response_mask"].sum(-1).float(),
    })
    uid = np.array([f"step1-prompt{i // G}" for i in range(rows)], dtype=object)
    raw = np.empty(rows, dtype=object)
    for i in range(rows):
        raw[i] = [{"role": "user", "content": f"q{i // G}"}]
    return DataProto.from_dict(tensors=tensors, non_tensors={"uid": uid, "raw_prompt": raw})


def _trainer(names: list[str], tokenizer, settings: HacpoSettings):
    """A HacpoTrainer without workers: what exchange and advantages read."""
    from helpers.stand_in import stand_in_trainer

    return stand_in_trainer(names, settings=settings, rollout_n=G, converters={
        (s, k): RowConverter(tokenizer, tokenizer, max_prompt_length=8, max_response_length=8)
        for s in names for k in names
    })


def _step(names, rewards, tokenizer, settings):
    t = _trainer(names, tokenizer, settings)
    rollouts = {n: _rollout(tokenizer, i, [float(r) for r in rewards[n]]) for i, n in enumerate(names)}
    metrics: dict = {}
    t.update_capabilities(rollouts, metrics)
    batches = t.exchange(rollouts, metrics)
    t.advantages(batches, metrics)
    t._pool.shutdown()
    return batches, metrics


def _selected_peer_rows(batch: DataProto) -> set[tuple[int, int]]:
    """(source, prompt) of every selected peer row."""
    uid = batch.non_tensor_batch["uid"]
    rows = torch.nonzero(batch.batch[K.SELECTED] & batch.batch[K.IS_CROSS]).flatten().tolist()
    return {(int(batch.batch[K.SOURCE][i]), int(uid[i].rsplit("prompt", 1)[1])) for i in rows}


def _check_exclusion(batch: DataProto, own_rows: int) -> None:
    """Every row stays; own rows are selected; an unselected row has no token and advantage 0."""
    selected, cross = batch.batch[K.SELECTED], batch.batch[K.IS_CROSS]
    assert bool(selected[~cross].all()) and int((~cross).sum()) == own_rows
    tokens = batch.batch["response_mask"].sum(-1)
    assert bool((tokens[~selected] == 0).all()) and bool((tokens[selected] > 0).all())
    assert not batch.batch["advantages"][~selected].any()


# two agents, 5 prompts × G = 2:  k_a = [0, 0, 1, 2, 0],  k_b = [1, 2, 0, 0, 1]
#   C_{b→a} = {q0, q4} (q1: b's group not mixed),  C_{a→b} = {q2} (q3: a's group not mixed)
#   m = 1; b→a ranks q0 and q4 by k_b = 1, 1: q4 is tied with the 1st, so both are kept
TWO = {"a": [0, 0, 0, 0, 1, 0, 1, 1, 0, 0], "b": [1, 0, 1, 1, 0, 0, 0, 0, 0, 1]}


def test_two_agents_train_only_on_the_peer_rows_of_grafts_selection(char_tokenizer):
    settings = HacpoSettings(share_selection="complementary")
    batches, metrics = _step(["a", "b"], TWO, char_tokenizer, settings)
    assert _selected_peer_rows(batches["a"]) == {(1, 0), (1, 4)}
    assert _selected_peer_rows(batches["b"]) == {(0, 2)}
    for name, batch in batches.items():
        assert len(batch) == 20  # own 10 + every peer row (the mini-batch layout needs whole groups)
        _check_exclusion(batch, own_rows=10)
        assert metrics[f"agent/{name}/cross/rows"] == 10.0
    assert metrics["agent/a/cross/rows_selected"] == 4.0 and metrics["agent/a/cross/groups_selected"] == 2.0
    assert metrics["agent/b/cross/rows_selected"] == 2.0 and metrics["agent/b/cross/groups_selected"] == 1.0
    # the same selection as GRAFT's own
    correct = torch.tensor([[0, 0, 1, 2, 0], [1, 2, 0, 0, 1]])
    assert graft_selection(correct, torch.tensor([G, G])).tolist() == [[1, -1, -1, -1, 1], [-1, -1, 0, -1, -1]]
    # advantages by hand, learner a on q0: P̂_a = 3/10, P̂_b = 4/10, ω^(a,b) = 0.75;
    # group = own [0, 0] + b's [1, 0]: μ̂ = 0.75·1 / 4 = 0.1875, σ = std([0, 0, 1, 0]) = 0.5
    a = batches["a"]
    q0 = torch.as_tensor(a.non_tensor_batch["uid"] == "step1-prompt0") & a.batch[K.SELECTED]
    adv = a.batch["advantages"][q0][:, 0].tolist()
    assert adv == pytest.approx([(r - 0.1875) / (0.5 + 1e-6) for r in (0, 0, 1, 0)], rel=1e-6)
    # q1: no peer selected, the own group alone is uniform → 0
    q1 = torch.as_tensor(a.non_tensor_batch["uid"] == "step1-prompt1")
    assert not a.batch["advantages"][q1].any()
    # the advantage metrics are over the rows that train
    sel = a.batch[K.SELECTED]
    assert metrics["agent/a/advantage/abs_mean"] == pytest.approx(float(a.batch["advantages"][sel][:, 0].abs().mean()))


def test_console_summary_shows_the_selected_peer_rows(char_tokenizer):
    from recipe_hacpo.training.trainer import summary_lines

    _, metrics = _step(["a", "b"], TWO, char_tokenizer, HacpoSettings(share_selection="complementary"))
    assert "cross rows 10 (4 selected)" in summary_lines(metrics, 1, 2).splitlines()[0]
    _, metrics = _step(["a", "b"], TWO, char_tokenizer, HacpoSettings())
    assert summary_lines(metrics, 1, 2).splitlines()[0].endswith("cross rows 10")


def test_two_agents_naive_on_grafts_prompts_uses_the_plain_mean_of_the_selected_rows(char_tokenizer):
    settings = HacpoSettings(mode="naive", share_selection="complementary")
    batches, _ = _step(["a", "b"], TWO, char_tokenizer, settings)
    a = batches["a"]
    q0 = torch.as_tensor(a.non_tensor_batch["uid"] == "step1-prompt0") & a.batch[K.SELECTED]
    # plain mean of [0, 0, 1, 0] = 0.25, σ = 0.5; b's unselected rows of q0 do not exist for it
    adv = a.batch["advantages"][q0][:, 0].tolist()
    assert adv == pytest.approx([(r - 0.25) / (0.5 + 1e-6) for r in (0, 0, 1, 0)], rel=1e-6)
    assert (a.batch[K.OMEGA][a.batch[K.IS_CROSS]] == 1.0).all()  # Naive: no ω


def test_share_selection_all_leaves_todays_batches(char_tokenizer):
    batches, metrics = _step(["a", "b"], TWO, char_tokenizer, HacpoSettings())
    complementary, _ = _step(["a", "b"], TWO, char_tokenizer, HacpoSettings(share_selection="complementary"))
    for name, batch in batches.items():
        assert K.SELECTED not in batch.batch.keys()
        assert bool((batch.batch["response_mask"].sum(-1) > 0).all())
        assert f"agent/{name}/cross/rows_selected" not in metrics
        # the rows themselves are the same, only masked out
        assert torch.equal(batch.batch["responses"], complementary[name].batch["responses"])


# three agents, 3 prompts × G = 2:  k_x = [0, 1, 1],  k_y = [1, 0, 0],  k_z = [1, 0, 2]
#   {x, y}: C_{y→x} = {q0}, C_{x→y} = {q1, q2} → m = 1; x→y keeps q1 and its tie q2
#   {x, z}: C_{z→x} = {q0}, C_{x→z} = {q1} → m = 1 each;  {y, z}: nothing
#   x receives q0 from y and z, both with k = 1: the lower index (y) wins (this project's N ≥ 3 rule)
THREE = {"x": [0, 0, 1, 0, 1, 0], "y": [1, 0, 0, 0, 0, 0], "z": [0, 1, 0, 0, 1, 1]}


def test_three_agents_one_source_per_prompt_and_pair_balancing(char_tokenizer):
    batches, metrics = _step(["x", "y", "z"], THREE, char_tokenizer, HacpoSettings(share_selection="complementary"))
    assert _selected_peer_rows(batches["x"]) == {(1, 0)}  # not z's q0 rows
    assert _selected_peer_rows(batches["y"]) == {(0, 1), (0, 2)}
    assert _selected_peer_rows(batches["z"]) == {(0, 1)}
    for name, batch in batches.items():
        assert len(batch) == 18
        _check_exclusion(batch, own_rows=6)
        assert metrics[f"agent/{name}/cross/rows"] == 12.0
    assert [metrics[f"agent/{n}/cross/rows_selected"] for n in "xyz"] == [2.0, 4.0, 2.0]
    assert [metrics[f"agent/{n}/cross/groups_selected"] for n in "xyz"] == [1.0, 2.0, 1.0]
    correct = torch.tensor([[0, 1, 1], [1, 0, 0], [1, 0, 2]])
    assert graft_selection(correct, torch.tensor([G] * 3)).tolist() == [[1, -1, -1], [-1, 0, 0], [-1, 0, -1]]
    # learner x on q0: P̂_x = 2/6, P̂_y = 1/6 → ω^(x,y) = 2; own [0, 0] + y's [1, 0]:
    # μ̂ = 2·1 / 4 = 0.5, σ = 0.5; z's rows (rewards [0, 1]) are in neither
    x = batches["x"]
    q0 = torch.as_tensor(x.non_tensor_batch["uid"] == "step1-prompt0") & x.batch[K.SELECTED]
    assert x.batch["advantages"][q0][:, 0].tolist() == pytest.approx([-1.0, -1.0, 1.0, -1.0], rel=1e-5)


@pytest.mark.parametrize("balance, received", [(True, set()), (False, {(1, 0)})])
def test_graft_balance_applies_to_the_share_rule(char_tokenizer, balance, received):
    # C_{b→a} = {q0}, C_{a→b} = {} → m = 0: balanced, nothing is shared; unbalanced, q0 is
    one_way = {"a": [0, 0, 1, 1], "b": [1, 0, 1, 1]}
    settings = HacpoSettings(share_selection="complementary", graft_balance=balance)
    batches, metrics = _step(["a", "b"], one_way, char_tokenizer, settings)
    assert _selected_peer_rows(batches["a"]) == received and _selected_peer_rows(batches["b"]) == set()
    assert metrics["agent/a/cross/rows_selected"] == G * len(received)
    for batch in batches.values():
        _check_exclusion(batch, own_rows=4)


def test_selected_batches_keep_whole_groups_in_every_mini_batch(char_tokenizer):
    from recipe_hacpo.methods.minibatch import mini_batch_order

    batches, _ = _step(["a", "b"], TWO, char_tokenizer, HacpoSettings(share_selection="complementary"))
    b = batches["a"]
    order = torch.as_tensor(mini_batch_order(b.non_tensor_batch["uid"], b.batch[K.IS_CROSS].numpy(),
                                             mini_batch_prompts=1, dp_size=1, seed=0))
    laid = b.non_tensor_batch["uid"][order.numpy()].reshape(5, 2 * G)
    assert all(len(set(row)) == 1 for row in laid)  # one prompt group of 4 rows per mini-batch


# --------------------------------------------------------------------------- the worker loss
CONFIG = SimpleNamespace(clip_ratio=0.2, clip_ratio_low=3e-4, clip_ratio_high=4e-4, clip_ratio_c=3.0,
                         use_kl_loss=False, entropy_coeff=0.0, loss_scale_factor=None)


def _micro_batch(rows, excluded, g, **non_tensor):
    """One micro-batch as verl's engine hands it to the loss (no-padding layout, global counts)."""
    from recipe_hacpo.training.agent_runtime import worker_tensordict

    layout = pack_rows([p for p, _ in rows], [r for _, r in rows], pad_id=0, prompt_width=4, response_width=3)
    n = len(rows)
    cross = torch.tensor([i % 2 == 1 for i in range(n)])
    keep = ~excluded.unsqueeze(-1)
    mask = layout["response_mask"]
    tensors = dict(layout)
    tensors.update({
        "response_mask": mask * keep,
        "old_log_probs": -torch.rand(mask.shape, generator=g, dtype=F64),
        "advantages": torch.randn(n, 1, generator=g, dtype=F64) * mask * keep,
        K.IS_CROSS: cross,
        K.OMEGA: torch.full((n,), 1.5, dtype=F64),
        K.SOURCE_LOG_PROB_MEAN: -torch.rand(n, generator=g, dtype=F64) * 0.1 - 0.5,
        K.SELECTED: ~excluded,
    })
    td = worker_tensordict(DataProto.from_dict(tensors=tensors))
    tu.assign_non_tensor(td, dp_size=1, **{K.UPDATE_INDEX: 0}, **non_tensor)
    return td, tensors


@pytest.mark.parametrize("mode", ["hacpo", "naive"])
def test_worker_loss_leaves_out_unselected_rows_in_value_gradient_and_row_count(mode):
    from verl.workers.utils.padding import no_padding_2_padding

    from recipe_hacpo.methods.hacpo import hacpo_actor_loss

    rows = [([5, 6, 7][: 1 + i % 3], [8, 9, 10][: 1 + (i * 2) % 3]) for i in range(12)]
    excluded = torch.tensor([i % 4 == 3 for i in range(12)])  # every other peer row
    kept = int((~excluded).sum())
    tokens = sum(len(r) for (_, r), e in zip(rows, excluded.tolist()) if not e)
    counts = dict(batch_num_tokens=tokens, global_batch_size=12)
    hacpo = method_for(mode).effective(HacpoSettings(mode=mode, share_selection="complementary"))

    def run(**extra):
        gen = torch.Generator().manual_seed(7)
        micro = [_micro_batch(rows[h:h + 6], excluded[h:h + 6], gen, **counts, **extra) for h in (0, 6)]
        values = [(-torch.rand(int(td["input_ids"].offsets()[-1]), generator=gen, dtype=F64)).requires_grad_(True)
                  for td, _ in micro]
        total, metrics = 0.0, []
        for (td, _), v in zip(micro, values):
            loss, m = hacpo_actor_loss(CONFIG, hacpo, {"log_probs": v}, td)
            total, metrics = total + loss, metrics + [m]
        return micro, values, total, metrics

    micro, values, worker, metrics = run(**{K.LOSS_ROWS: kept})
    padded = torch.cat([no_padding_2_padding(v, td) for (td, _), v in zip(micro, values)])
    field = lambda key: torch.cat([t[key] for _, t in micro])  # noqa: E731
    keep = ~excluded
    core, _ = compute_hacpo_policy_loss(
        padded[keep], field("old_log_probs")[keep], field("advantages")[keep], field("response_mask")[keep],
        is_cross=field(K.IS_CROSS)[keep], omega=field(K.OMEGA)[keep],
        source_log_prob_mean=field(K.SOURCE_LOG_PROB_MEAN)[keep], update_index=0,
        alpha=hacpo.alpha, cross_clip=hacpo.cross_clip, clip_ratio_low=3e-4, clip_ratio_high=4e-4,
    )
    # (verl's seq-mean divides a row by its token count, the core by count + 1e-8: rel ~1e-8 apart)
    assert worker.item() == pytest.approx(core.item(), rel=1e-7)
    for a, b in zip(torch.autograd.grad(worker, values, retain_graph=True), torch.autograd.grad(core, values)):
        # the core loss reads the kept rows only (padded[keep]): nothing reaches an excluded row
        assert torch.allclose(a, b, rtol=1e-7, atol=1e-12)
    # the cross metrics see only the selected peer rows of each micro-batch
    # (rows 0-5: row 3 out, cross rows 1 and 5 in; rows 6-11: rows 7 and 11 out, cross row 9 in)
    assert [m["hacpo/cross_frac"].values[0] for m in metrics] == pytest.approx([2 / 5, 1 / 4])
    # without the selected-row count the seq-mean would divide by every row of the mini-batch
    _, _, unscaled, _ = run()
    assert unscaled.item() == pytest.approx(core.item() * kept / 12, rel=1e-7)



def _worker():
    from recipe_hacpo.workers.hacpo_worker import HacpoTrainingWorker

    from recipe_hacpo.methods import method_for

    w = object.__new__(HacpoTrainingWorker)
    w.engine = SimpleNamespace(get_data_parallel_size=lambda: 1)
    w.global_counts = dict(method_for("hacpo").global_counts)  # as the actor worker's init_model sets them
    return w


@pytest.mark.parametrize("selection", [True, False])
def test_worker_counts_the_selected_rows_of_each_mini_batch(monkeypatch, selection):
    seen = []

    def verl_mini_batches(self, data):
        for i in range(2):
            self.train_batch(data[4 * i : 4 * i + 4])

    monkeypatch.setattr(TrainingWorker, "train_mini_batch", verl_mini_batches)
    monkeypatch.setattr(TrainingWorker, "train_batch",
                        lambda self, data: seen.append(tu.get_non_tensor_data(data, K.LOSS_ROWS, None)))
    tensors = {K.IS_CROSS: torch.tensor([False, True] * 4)}
    if selection:
        tensors[K.SELECTED] = torch.tensor([True, False, True, True, True, False, True, False])
    td = TensorDict(tensors, batch_size=[8])
    tu.assign_non_tensor(td, mini_batch_size=4, epochs=1)
    _worker().train_mini_batch(td)
    assert seen == ([3, 2] if selection else [None, None])  # share_selection=all: verl's own count


def test_trainer_advantage_is_the_formula_with_the_selected_rows_as_validity(char_tokenizer):
    """`HacpoTrainer.advantages` passes `SELECTED` as the row validity V of §2."""
    batches, _ = _step(["a", "b"], TWO, char_tokenizer, HacpoSettings(share_selection="complementary"))
    b = batches["b"]
    caps = torch.tensor([3 / 10, 4 / 10])
    expected = compute_hacpo_advantage(b.batch[K.REWARD], b.non_tensor_batch["uid"], b.batch[K.SOURCE], 1, caps,
                                       valid=b.batch[K.SELECTED])
    assert torch.allclose(b.batch["advantages"][:, 0], expected.float() * (b.batch["response_mask"][:, 0] > 0))
