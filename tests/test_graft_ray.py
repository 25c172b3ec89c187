"""GRAFT's actor update through Ray on CPU: a learner batch with grafted groups, their weights
and the peer-last mini-batch order, as recorded by the worker and its loss (docs/ALGORITHM.md §9)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_update_record import CROSS, MINI, OWN, PROMPTS, _config, _learner_batch, _runtime, ray_cluster  # noqa: F401

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

    metrics = runtime.update(batch, rows_per_prompt=OWN, peer_order=order)

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
