"""The HACPO actor update through Ray on CPU (1 and 2 data-parallel ranks): what every
mini-batch of a training step trained on, as recorded by the worker and its loss.

With δ = 0.2, δ_step = 0.025 and 4 updates a step the loss must use the lower bounds 0.8,
0.825, 0.85, 0.875 (m = 0..3, spec §5), every mini-batch on every rank must hold own and
cross rows, and `hacpo/lower_bound` must be the mean over the step's updates. A worker whose
update index never advanced (stepwise clipping silently fixed) fails here.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from recipe_hacpo import batch_keys as K
from helpers.update import CROSS, MINI, OWN, PROMPTS, learner_config as _config, learner_batch as _learner_batch, agent_runtime as _runtime, ray_cluster

pytestmark = [pytest.mark.ray]


@pytest.mark.parametrize("dp", [1, 2])
def test_every_mini_batch_mixes_own_and_cross_rows_and_m_advances(ray_cluster, tiny_agent_paths, dp):
    agent_cfg, spec, hacpo = _config(tiny_agent_paths["qwen2-char-small"], dp, "hacpo")
    runtime = _runtime(agent_cfg, spec, hacpo)
    batch = _learner_batch(runtime.tokenizer)
    own_lp = runtime.old_log_prob(batch)
    batch.batch["old_log_probs"] = torch.where(batch.batch[K.IS_CROSS].unsqueeze(-1), 0.0, own_lp)

    metrics = runtime.update(batch, rows_per_prompt=OWN + CROSS)

    record = runtime.last_update_record
    assert len(record) == dp  # one list per data-parallel rank
    for rank in record:
        assert [e["update_index"] for e in rank] == [0, 1, 2, 3]
        assert [e["lower_bound"] for e in rank] == pytest.approx([0.8, 0.825, 0.85, 0.875])
        for e in rank:
            # whole prompt groups: MINI/dp prompts × (OWN own + CROSS cross) rows on every rank
            assert (e["own_rows"], e["cross_rows"]) == (MINI // dp * OWN, MINI // dp * CROSS)
            assert e["loss_rows"] == e["own_rows"] + e["cross_rows"]  # what the loss saw
    assert metrics["hacpo/updates"] == 4.0
    assert metrics["hacpo/lower_bound"] == pytest.approx(np.mean([0.8, 0.825, 0.85, 0.875]))
    assert metrics["hacpo/min_cross_rows"] > 0 and metrics["hacpo/min_own_rows"] > 0
    assert np.isfinite(metrics["actor/pg_loss"])

    # the loss's per-row record (trainer.rollout_data_dir): every row once, at its own update,
    # named by its position in the batch the trainer built (before the update order)
    from recipe_hacpo.training.rollout_log import row_updates

    updates = row_updates(record)
    assert sorted(updates) == list(range(len(batch)))
    assert all(len(u) == 1 for u in updates.values())  # one epoch: one update per row
    cross = batch.batch[K.IS_CROSS]
    first = [u for i, (u,) in updates.items() if u["m"] == 0 and not cross[i]]
    assert first and all(u["ratio"] == pytest.approx(1.0, abs=1e-5) for u in first)  # on-policy at m = 0
    cross_ratios = [u["ratio"] for i, (u,) in updates.items() if cross[i]]
    # the same ratios the loss summarised in its metrics, read through another path
    assert min(cross_ratios) == pytest.approx(metrics["hacpo/cross_ratio_min"], rel=1e-6)
    assert max(cross_ratios) == pytest.approx(metrics["hacpo/cross_ratio_max"], rel=1e-6)
    bounds = [0.8, 0.825, 0.85, 0.875]
    for i, (u,) in updates.items():
        if cross[i]:
            assert u["clipped"] == (u["ratio"] < bounds[u["m"]] or u["ratio"] > 1.0)


def _verl_reference(model_path: str, batch, loss_mode: str, agg: str, clip: tuple[float, float]):
    """verl's own policy loss and its gradient norm on `batch`, computed here without Ray."""
    from transformers import AutoModelForCausalLM
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.workers.config import FSDPActorConfig

    model = AutoModelForCausalLM.from_pretrained(model_path, torch_dtype=torch.float32, attn_implementation="sdpa")
    b = batch.batch
    plen = b["prompts"].shape[1]
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]).logits
    log_probs = torch.log_softmax(logits[:, plen - 1 : -1].float(), dim=-1)
    log_prob = log_probs.gather(-1, b["responses"].unsqueeze(-1)).squeeze(-1)
    cfg = FSDPActorConfig(
        strategy="fsdp", ppo_mini_batch_size=PROMPTS, ppo_micro_batch_size_per_gpu=1, rollout_n=OWN,
        clip_ratio_low=clip[0], clip_ratio_high=clip[1], loss_agg_mode=agg,
    )
    mask = b["response_mask"].bool()
    loss, _ = get_policy_loss_fn(loss_mode)(b["old_log_probs"], log_prob, b["advantages"], mask, agg, cfg)
    loss.backward()
    grad_norm = torch.sqrt(sum((p.grad.float() ** 2).sum() for p in model.parameters() if p.grad is not None))
    return float(loss), float(grad_norm)


@pytest.mark.parametrize(
    "loss_mode, agg, clip",
    [("vanilla", "token-mean", (0.2, 0.28)), ("gspo", "seq-mean-token-mean", (3e-4, 4e-4))],
)
def test_isolated_mode_trains_with_verls_own_loss(ray_cluster, tiny_agent_paths, loss_mode, agg, clip):
    """GRPO (vanilla) and GSPO baselines: the worker's loss and gradient are verl's, not HACPO's."""
    path = tiny_agent_paths["qwen2-char-small"]
    extra = (
        f"actor_rollout_ref.actor.policy_loss.loss_mode={loss_mode}",
        f"actor_rollout_ref.actor.loss_agg_mode={agg}",
        f"actor_rollout_ref.actor.clip_ratio_low={clip[0]}",
        f"actor_rollout_ref.actor.clip_ratio_high={clip[1]}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={PROMPTS}",  # one update: the loss at the initial weights
    )
    agent_cfg, spec, hacpo = _config(path, 1, "isolated", extra)
    runtime = _runtime(agent_cfg, spec, hacpo)
    batch = _learner_batch(runtime.tokenizer)
    batch = batch.select_idxs(~batch.batch[K.IS_CROSS])
    batch.batch["old_log_probs"] = runtime.old_log_prob(batch)
    # perturb old log-probs so the ratios are not all 1 (the clip then matters)
    g = torch.Generator().manual_seed(1)
    batch.batch["old_log_probs"] += 0.3 * torch.randn(batch.batch["old_log_probs"].shape, generator=g)
    batch.batch["old_log_probs"] *= batch.batch["response_mask"]
    expected_loss, expected_grad_norm = _verl_reference(path, batch, loss_mode, agg, clip)

    metrics = runtime.update(batch, rows_per_prompt=OWN)

    record = runtime.last_update_record[0]
    assert [e["update_index"] for e in record] == [0]
    assert record[0]["lower_bound"] is None  # the HACPO loss was never called
    assert "hacpo/cross_frac" not in metrics and "hacpo/lower_bound" not in metrics
    assert metrics["actor/pg_loss"] == pytest.approx(expected_loss, rel=1e-4, abs=1e-6)
    assert metrics["grad_norm"] == pytest.approx(expected_grad_norm, rel=1e-3)
