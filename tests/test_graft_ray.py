"""GRAFT's actor update through Ray on CPU: a learner batch with grafted groups, their weights
and the peer-last mini-batch order, as recorded by the worker and its loss (docs/ALGORITHM.md §9);
and SGT's: whole groups with their imitation slot, the imitated tokens in the NLL term."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.update import CROSS, MINI, OWN, PROMPTS, learner_config as _config, learner_batch as _learner_batch, agent_runtime as _runtime, ray_cluster  # noqa: F401

from recipe_hacpo import batch_keys as K

pytestmark = [pytest.mark.ray]

GRAFTED = ("p1", "p4", "p6")  # three of the eight prompts arrive as a peer's whole group


def _graft_batch(tokenizer):
    """Eight groups of two rows: five own, three grafted; one grafted row dropped by the floor."""
    batch = _learner_batch(tokenizer)
    uid = batch.non_tensor_batch["uid"]
    # one group per prompt: keep the own rows of own prompts and the cross rows of grafted ones
    grafted = np.isin(uid, GRAFTED)
    keep = np.flatnonzero(grafted == batch.batch[K.IS_CROSS].numpy())
    batch = batch.select_idxs(torch.as_tensor(keep))
    cross = batch.batch[K.IS_CROSS]
    weight = torch.where(cross, 0.9, 1.0)
    dropped = int(torch.nonzero(cross)[0])
    weight[dropped] = 0.0
    batch.batch["response_mask"][dropped] = 0
    batch.batch["advantages"] = batch.batch["advantages"] * batch.batch["response_mask"]
    batch.batch[K.GRAFT_WEIGHT] = weight
    return batch, dropped


@pytest.mark.parametrize("order, cross_per_update", [("last", [0, 0, 2, 4]), ("first", [4, 2, 0, 0])])
def test_grafted_groups_train_last_with_their_weights(ray_cluster, tiny_agent_paths, order, cross_per_update):  # noqa: F811
    assert (PROMPTS, MINI, OWN, CROSS) == (8, 2, 2, 2)  # the expected layouts above assume these
    agent_cfg, spec, hacpo = _config(
        tiny_agent_paths["qwen2-char-small"], 1, "graft", (f"algorithm.hacpo.graft_order={order}",)
    )
    runtime = _runtime(agent_cfg, spec, hacpo)
    batch, dropped = _graft_batch(runtime.tokenizer)
    # the receiver's own old log-probs on every row, grafted ones included (GRAFT's extra forward)
    batch.batch["old_log_probs"] = runtime.old_log_prob(batch)

    from functools import partial

    from recipe_hacpo.methods import method_for

    metrics = runtime.update(batch, rows_per_prompt=OWN, order=partial(method_for("graft").mini_batch_order, hacpo))

    (rank,) = runtime.last_update_record
    assert [e["update_index"] for e in rank] == [0, 1, 2, 3]
    # 5 own + 3 grafted groups in mini-batches of 2: own-only updates first, then the grafted ones
    assert [e["cross_rows"] for e in rank] == cross_per_update
    assert all(e["own_rows"] + e["cross_rows"] == MINI * OWN for e in rank)
    assert all(e["lower_bound"] is None for e in rank)  # GRAFT's loss, not HACPO's
    # the loss saw the admitted grafted tokens only: the dropped row has none
    mask = batch.batch["response_mask"]
    grafted_tokens = float(mask[batch.batch[K.IS_CROSS]].sum())
    assert int(mask[dropped].sum()) == 0 and grafted_tokens > 0
    assert metrics["graft/peer_tokens"] == pytest.approx(grafted_tokens / len(rank))
    assert 0 <= metrics["graft/peer_clipped_tokens"] <= metrics["graft/peer_tokens"]
    assert np.isfinite(metrics["actor/pg_loss"])


IMITATED = ("p1", "p4", "p6")  # SGT: three of the eight prompts have an imitated peer response


def _sgt_batch(tokenizer):
    """Eight groups of OWN own rows + one imitation slot (a cross row with a zero response_mask),
    the slots of IMITATED carrying their response tokens in IMITATION_MASK."""
    batch = _learner_batch(tokenizer)
    uid, cross = batch.non_tensor_batch["uid"], batch.batch[K.IS_CROSS].numpy()
    first_cross = np.array([c and uid[i] not in uid[:i][cross[:i]] for i, c in enumerate(cross)])
    batch = batch.select_idxs(torch.as_tensor(np.flatnonzero(~cross | first_cross)))
    slot = batch.batch[K.IS_CROSS]
    mask = batch.batch["response_mask"]
    imitated = slot & torch.as_tensor(np.isin(batch.non_tensor_batch["uid"], IMITATED))
    batch.batch[K.IMITATION_MASK] = mask * imitated.unsqueeze(-1)
    batch.batch["response_mask"] = mask * ~slot.unsqueeze(-1)
    batch.batch["advantages"] = batch.batch["advantages"] * batch.batch["response_mask"]
    return batch


def test_sgt_update_trains_whole_groups_with_their_slot_and_the_imitated_tokens(ray_cluster, tiny_agent_paths):  # noqa: F811
    dp = 2  # the NLL's token count is summed over the data-parallel ranks
    agent_cfg, spec, hacpo = _config(
        tiny_agent_paths["qwen2-char-small"], dp, "sgt",
        # one row per micro-batch: a slot alone in its micro-batch; lr 0 keeps π_θ = π_old all step
        ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=1", "actor_rollout_ref.actor.optim.lr=0.0"),
    )
    runtime = _runtime(agent_cfg, spec, hacpo)
    batch = _sgt_batch(runtime.tokenizer)
    batch.batch["old_log_probs"] = runtime.old_log_prob(batch)
    imit = batch.batch[K.IMITATION_MASK].bool()
    assert len(batch) == PROMPTS * (OWN + 1) and int(imit.sum()) > 0

    metrics = runtime.update(batch, rows_per_prompt=OWN + 1)

    assert len(runtime.last_update_record) == dp
    for rank in runtime.last_update_record:
        assert [e["update_index"] for e in rank] == [0, 1, 2, 3]
        # whole groups: MINI/dp prompts of OWN own rows and their one slot, on every rank
        assert all((e["own_rows"], e["cross_rows"]) == (MINI // dp * OWN, MINI // dp) for e in rank)
        assert all(e["lower_bound"] is None and e["loss_rows"] == MINI // dp * (OWN + 1) for e in rank)
    # every imitated token reached the NLL once (per update: summed over micro-batches, mean over ranks)
    assert metrics["sgt/nll_tokens"] * 4 * dp == pytest.approx(float(imit.sum()))
    # ... with the receiver's log-probs of exactly those tokens
    nll = -float(batch.batch["old_log_probs"][imit].double().mean())
    assert metrics["sgt/nll_sum"] / metrics["sgt/nll_tokens"] == pytest.approx(nll, rel=1e-4)
    # the loss of each update is GRPO's + λ · the token-mean NLL over that whole mini-batch (both
    # ranks' imitated tokens in one denominator); its step value is the mean over the 4 updates
    from recipe_hacpo.methods.minibatch import mini_batch_order

    order = mini_batch_order(batch.non_tensor_batch["uid"], batch.batch[K.IS_CROSS].numpy(), mini_batch_prompts=MINI,
                             dp_size=dp, seed=int(agent_cfg.actor_rollout_ref.actor.data_loader_seed))
    minis = torch.as_tensor(order).view(dp, 4, -1).transpose(0, 1).reshape(4, -1)
    lp = -batch.batch["old_log_probs"].double()
    nll_per_update = [float(lp[rows][imit[rows]].mean()) if imit[rows].any() else 0.0 for rows in minis]
    assert sum(x > 0 for x in nll_per_update) >= 2  # the check below weighs several updates' NLL
    expected = metrics["actor/pg_loss"] + hacpo.sgt_lambda * float(np.mean(nll_per_update))
    assert metrics["loss"] == pytest.approx(expected, rel=1e-4)
