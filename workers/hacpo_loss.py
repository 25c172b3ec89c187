"""The HACPO loss as the loss function verl's engine workers call (`set_loss_fn`).

verl's policy-loss registry passes only (old_log_prob, log_prob, advantages, response_mask,
loss_agg_mode, config, rollout_is_weights), which cannot carry HACPO's per-row fields, so
the loss is installed as the worker's whole loss function instead. It reads from the
micro-batch TensorDict:

    tensors      old_log_probs, advantages, response_mask, [ref_log_prob],
                 hacpo_is_cross, hacpo_omega, hacpo_source_log_prob_mean,
                 hacpo_source_response_length                                (batch_keys)
    non-tensors  hacpo_update_index (set per mini-batch by `HacpoTrainingWorker`),
                 hacpo_imitation_tokens (mode=sgt, the same),
                 hacpo_loss_rows (share_selection=complementary, the same: the seq-mean's rows),
                 dp_size, batch_num_tokens, global_batch_size (set by verl)
"""

from __future__ import annotations

from typing import Callable

import torch
from tensordict import TensorDict

from recipe_hacpo import batch_keys as K
from recipe_hacpo.core_algos import hacpo_policy_loss_matrix, to_accumulation_dtype
from recipe_hacpo.hacpo_settings import HacpoSettings


def hacpo_actor_loss(
    actor_config,
    hacpo: HacpoSettings,
    model_output,
    data: TensorDict,
    dp_group=None,
    record: Callable[..., None] | None = None,
):
    """Loss of one micro-batch for verl's FSDP engine: HACPO policy term (+ entropy, + KL).

    Aggregated with verl's `agg_loss` and the global batch info verl attaches, so gradient
    accumulation over micro-batches and data-parallel ranks gives the mini-batch mean.
    `hacpo` is the run's effective `algorithm.hacpo` (`HacpoSettings.effective`); the loss
    reads alpha, delta, delta_step, cross_clip and cross_ratio_length.
    `record(update_index=, lower_bound=, own_rows=, cross_rows=)`, when given, receives what
    this micro-batch's loss used (the worker keeps it per mini-batch, see hacpo_worker).
    """
    from verl.trainer.ppo.core_algos import agg_loss
    from verl.utils.metric import AggregationType, Metric

    log_prob, entropy, batch_info, aggregation, update_index = _micro_batch(actor_config, model_output, data)
    padded = data.select(*loss_fields(hacpo, actor_config.use_kl_loss)).to_padded_tensor()
    response_mask = padded["response_mask"].to(bool)

    loss_mat, pg_metrics = hacpo_policy_loss_matrix(
        log_prob,
        padded["old_log_probs"],
        padded["advantages"],
        response_mask,
        is_cross=padded[K.IS_CROSS],
        omega=padded[K.OMEGA],
        source_log_prob_mean=padded[K.SOURCE_LOG_PROB_MEAN],
        update_index=update_index,
        alpha=hacpo.alpha,
        delta=hacpo.delta,
        delta_step=hacpo.delta_step,
        cross_clip=hacpo.cross_clip,
        clip_ratio_low=_clip(actor_config, "low"),
        clip_ratio_high=_clip(actor_config, "high"),
        cross_ratio_length=hacpo.cross_ratio_length,
        source_response_length=padded.get(K.SOURCE_RESPONSE_LENGTH, None),
    )
    if record is not None:
        is_cross = padded[K.IS_CROSS].bool()
        record(
            update_index=update_index,
            lower_bound=float(pg_metrics["hacpo/lower_bound"]),
            own_rows=int((~is_cross).sum()),
            cross_rows=int(is_cross.sum()),
        )
    # HACPO is defined with seq-mean-token-mean (spec §6) whatever actor.loss_agg_mode says.
    pg_loss = agg_loss(loss_mat, response_mask, "seq-mean-token-mean", **batch_info)
    metrics = {key: Metric(value=value, aggregation=aggregation_of(key)) for key, value in pg_metrics.items()}
    if not bool((padded[K.IS_CROSS].bool() & response_mask.any(-1)).any()):
        # no cross row in this micro-batch's loss (none at all, or none selected under
        # share_selection=complementary): neutral values, so min/max over the step stay honest
        metrics["hacpo/cross_ratio_min"] = Metric(value=float("inf"), aggregation=AggregationType.MIN)
        metrics["hacpo/cross_ratio_max"] = Metric(value=float("-inf"), aggregation=AggregationType.MAX)
    metrics["actor/pg_loss"] = Metric(value=pg_loss, aggregation=aggregation)
    total = _regularised(
        actor_config, pg_loss, log_prob, entropy, padded, response_mask, "seq-mean-token-mean",
        batch_info, aggregation, metrics,
    )
    _check_finite(total, pg_loss, update_index)
    return total, metrics


def _micro_batch(actor_config, model_output, data: TensorDict):
    """What every loss of this module reads first: the model's log-probs (and entropy, if
    computed) padded back to [B, T], verl's batch info with its aggregation, and the update m.

    Log-probs and entropy come back in float32 when the model hands them over in bf16/fp16
    (`core_algos.accumulation_dtype`), so every sum, count and ratio of the losses below (the
    NLL, entropy and KL terms included) is taken in float32; float32 input is left as it is."""
    from verl.workers.utils.padding import no_padding_2_padding

    log_prob = to_accumulation_dtype(no_padding_2_padding(model_output["log_probs"], data))
    entropy = model_output.get("entropy", None)
    if entropy is not None:
        entropy = to_accumulation_dtype(no_padding_2_padding(entropy, data))
    batch_info, aggregation = _batch_info(actor_config, data)
    return log_prob, entropy, batch_info, aggregation, _update_index(data)


def _batch_info(actor_config, data: TensorDict):
    """verl's global batch info of this micro-batch, and how its per-micro-batch losses combine."""
    from verl.utils import tensordict_utils as tu
    from verl.utils.metric import AggregationType

    batch_info = {
        "dp_size": data["dp_size"],
        "batch_num_tokens": data["batch_num_tokens"],
        "global_batch_size": data["global_batch_size"],
        "loss_scale_factor": actor_config.loss_scale_factor,
    }
    loss_rows = tu.get_non_tensor_data(data=data, key=K.LOSS_ROWS, default=None)
    if loss_rows is not None:
        # share_selection=complementary: the seq-mean runs over the selected rows of the
        # mini-batch, as verl's token count runs over the response tokens left in it
        batch_info["global_batch_size"] = max(1, int(loss_rows))  # own rows are always selected
    # partial micro-batch losses add up to the mini-batch mean, so their metric is a SUM
    summed = batch_info["dp_size"] > 1 or batch_info["global_batch_size"] is not None
    return batch_info, AggregationType.SUM if summed else AggregationType.MEAN


def _update_index(data: TensorDict) -> int:
    from verl.utils import tensordict_utils as tu

    update_index = tu.get_non_tensor_data(data=data, key=K.UPDATE_INDEX, default=None)
    if update_index is None:
        # without m the stepwise bound would silently stay at 1 − δ (spec §5)
        raise RuntimeError(
            f"HACPO loss: the micro-batch carries no {K.UPDATE_INDEX}; the actor must be HacpoTrainingWorker"
        )
    return int(update_index)


def _regularised(actor_config, pg_loss, log_prob, entropy, padded, response_mask, agg_mode, batch_info, aggregation, metrics):
    """pg_loss − entropy_coeff·entropy (+ kl_loss_coef·KL to the reference), as verl's actor loss."""
    from verl.trainer.ppo.core_algos import agg_loss, kl_penalty
    from verl.utils.metric import Metric

    total = pg_loss
    if entropy is not None:
        entropy_loss = agg_loss(entropy, response_mask, agg_mode, **batch_info)
        total = total - actor_config.entropy_coeff * entropy_loss
        metrics["actor/entropy_loss"] = Metric(value=entropy_loss, aggregation=aggregation)
    if actor_config.use_kl_loss:
        kld = kl_penalty(logprob=log_prob, ref_logprob=padded["ref_log_prob"], kl_penalty=actor_config.kl_loss_type)
        kl_loss = agg_loss(kld, response_mask, agg_mode, **batch_info)
        total = total + actor_config.kl_loss_coef * kl_loss
        metrics["actor/kl_loss"] = Metric(value=kl_loss, aggregation=aggregation)
        metrics["actor/kl_coef"] = actor_config.kl_loss_coef
    return total


def _check_finite(total, pg_loss, update_index: int) -> None:
    if not torch.isfinite(total):
        # A NaN loss would poison the optimizer state for every later step; fail loudly here.
        raise FloatingPointError(
            f"HACPO loss is not finite (pg_loss={float(pg_loss)}, update m={update_index}); "
            "check rewards and log-probs of this batch"
        )


def graft_actor_loss(
    actor_config,
    hacpo: HacpoSettings,
    model_output,
    data: TensorDict,
    dp_group=None,
    record: Callable[..., None] | None = None,
):
    """Loss of one micro-batch under `mode=graft` (docs/ALGORITHM.md, GRAFT G4), for verl's FSDP engine.

    verl's vanilla PPO-clip term (with its dual clip `actor.clip_ratio_c`) against the receiver's
    own old log-probs on every row, each row's term times its compatibility weight w
    (`GRAFT_WEIGHT`), token-mean over the mini-batch's tokens (grafted rows dropped by the floor
    carry a zero response_mask, so they are not counted). With no grafted row it is verl's GRPO
    loss. Entropy and KL terms as verl's, token-mean. Reads `hacpo.graft_ratio`.
    `record` as for `hacpo_actor_loss` (lower_bound None: GRAFT has no stepwise bound).
    """
    from verl.trainer.ppo.core_algos import agg_loss
    from verl.utils.metric import AggregationType, Metric

    from recipe_hacpo.graft import graft_policy_loss_matrix

    log_prob, entropy, batch_info, aggregation, update_index = _micro_batch(actor_config, model_output, data)
    fields = ["response_mask", "old_log_probs", "advantages", K.IS_CROSS, K.GRAFT_WEIGHT]
    if actor_config.use_kl_loss:
        fields.append("ref_log_prob")
    padded = data.select(*fields).to_padded_tensor()
    response_mask = padded["response_mask"].to(bool)
    grafted = padded[K.IS_CROSS].bool()
    loss_mat, pg_metrics = graft_policy_loss_matrix(
        log_prob,
        padded["old_log_probs"],
        padded["advantages"],
        response_mask,
        weight=padded[K.GRAFT_WEIGHT],
        is_grafted=grafted,
        clip_ratio_low=_clip(actor_config, "low"),
        clip_ratio_high=_clip(actor_config, "high"),
        clip_ratio_c=float(actor_config.clip_ratio_c),
        ratio_level=hacpo.graft_ratio,
    )
    if record is not None:
        record(update_index=update_index, lower_bound=None, own_rows=int((~grafted).sum()), cross_rows=int(grafted.sum()))
    # GRAFT is token-mean over the mini-batch (G4) whatever actor.loss_agg_mode says
    pg_loss = agg_loss(loss_mat, response_mask, "token-mean", **batch_info)
    metrics = {
        key: Metric(value=value, aggregation=AggregationType.MEAN)
        for key, value in pg_metrics.items()
        if not key.startswith("graft/peer_")
    }
    # the peer-token clip fraction of the step is clipped / all grafted tokens: both counts are
    # summed over micro-batches and ranks here, and the trainer divides their step means
    peer_tokens = float((response_mask & grafted.unsqueeze(-1)).sum())
    metrics["graft/peer_clipped_tokens"] = Metric(
        value=pg_metrics["graft/peer_clipfrac"] * peer_tokens, aggregation=AggregationType.SUM
    )
    metrics["graft/peer_tokens"] = Metric(value=peer_tokens, aggregation=AggregationType.SUM)
    metrics["actor/pg_loss"] = Metric(value=pg_loss, aggregation=aggregation)
    total = _regularised(
        actor_config, pg_loss, log_prob, entropy, padded, response_mask, "token-mean", batch_info, aggregation, metrics
    )
    _check_finite(total, pg_loss, update_index)
    return total, metrics


def sgt_actor_loss(
    actor_config,
    hacpo: HacpoSettings,
    model_output,
    data: TensorDict,
    dp_group=None,
    record: Callable[..., None] | None = None,
):
    """Loss of one micro-batch under `mode=sgt` (docs/ALGORITHM.md §9, SGT), for verl's FSDP engine.

        L = token-mean over own tokens of ℓ^GRPO  +  λ · token-mean over imitated tokens of (−log π_θR)

    The GRPO term is `graft_actor_loss`'s with w = 1 (verl's vanilla PPO-clip with its dual clip,
    token-mean over `response_mask`, which is 0 on every imitation-slot row, so verl's
    `batch_num_tokens` counts own tokens only). The NLL term runs over `IMITATION_MASK`,
    normalised by the mini-batch's imitated tokens on every rank (`IMITATION_TOKENS`, set by
    `HacpoTrainingWorker`) exactly as verl normalises a token-mean, so summed over micro-batches
    and averaged over ranks it is `sgt.compute_sgt_loss` of the whole mini-batch. λ is
    `hacpo.sgt_lambda`. Entropy and KL terms as verl's, token-mean over own tokens.
    `record` as for `hacpo_actor_loss` (lower_bound None; cross_rows: the imitation slots).
    """
    from verl.trainer.ppo.core_algos import agg_loss
    from verl.utils import tensordict_utils as tu
    from verl.utils.metric import AggregationType, Metric

    from recipe_hacpo.graft import graft_policy_loss_matrix

    log_prob, entropy, batch_info, aggregation, update_index = _micro_batch(actor_config, model_output, data)
    fields = ["response_mask", "old_log_probs", "advantages", K.IS_CROSS, K.IMITATION_MASK]
    if actor_config.use_kl_loss:
        fields.append("ref_log_prob")
    padded = data.select(*fields).to_padded_tensor()
    response_mask = padded["response_mask"].to(bool)
    imitated = padded[K.IMITATION_MASK].to(bool)
    rows = log_prob.shape[0]
    loss_mat, pg_metrics = graft_policy_loss_matrix(
        log_prob,
        padded["old_log_probs"],
        padded["advantages"],
        response_mask,
        weight=torch.ones(rows),
        is_grafted=torch.zeros(rows, dtype=torch.bool),
        clip_ratio_low=_clip(actor_config, "low"),
        clip_ratio_high=_clip(actor_config, "high"),
        clip_ratio_c=float(actor_config.clip_ratio_c),
    )
    if record is not None:
        slots = padded[K.IS_CROSS].bool()
        record(update_index=update_index, lower_bound=None, own_rows=int((~slots).sum()), cross_rows=int(slots.sum()))
    # SGT's GRPO term is token-mean over the mini-batch whatever actor.loss_agg_mode says
    pg_loss = agg_loss(loss_mat, response_mask, "token-mean", **batch_info)
    imitation_tokens = int(tu.get_non_tensor_data(data=data, key=K.IMITATION_TOKENS, default=-1))
    if imitation_tokens < 0:
        raise RuntimeError(
            f"SGT loss: the micro-batch carries no {K.IMITATION_TOKENS}; the actor must be HacpoTrainingWorker"
        )
    # −log π on imitated tokens only (a where, not a product: nothing outside them can leak in)
    nll_mat = torch.where(imitated, -log_prob, torch.zeros_like(log_prob))
    nll_sum = nll_mat.sum()
    if imitation_tokens:
        # verl's token-mean with the mini-batch's imitated tokens in place of batch_num_tokens
        nll = agg_loss(nll_mat, imitated, "token-mean", **{**batch_info, "batch_num_tokens": imitation_tokens})
    else:
        nll = nll_sum * 0.0  # nothing imitated in this mini-batch (keeps the graph)
    metrics = {
        key: Metric(value=value, aggregation=AggregationType.MEAN)
        for key, value in pg_metrics.items()
        if not key.startswith("graft/")
    }
    # the step's NLL is Σ NLL / imitated tokens: both summed over micro-batches and ranks here,
    # and the trainer divides their step means (as GRAFT's peer clip fraction)
    metrics["sgt/nll_sum"] = Metric(value=float(nll_sum.detach()), aggregation=AggregationType.SUM)
    metrics["sgt/nll_tokens"] = Metric(value=float(imitated.sum()), aggregation=AggregationType.SUM)
    metrics["actor/pg_loss"] = Metric(value=pg_loss, aggregation=aggregation)
    total = pg_loss + hacpo.sgt_lambda * nll
    total = _regularised(
        actor_config, total, log_prob, entropy, padded, response_mask, "token-mean", batch_info, aggregation, metrics
    )
    _check_finite(total, pg_loss, update_index)
    return total, metrics


def aggregation_of(key: str):
    """`*_min` / `*_max` metrics are a min / max over micro-batches and ranks (verl's `Metric`
    does both); everything else is a mean."""
    from verl.utils.metric import AggregationType

    if key.endswith("_min"):
        return AggregationType.MIN
    if key.endswith("_max"):
        return AggregationType.MAX
    return AggregationType.MEAN


def _clip(actor_config, side: str) -> float:
    value = getattr(actor_config, f"clip_ratio_{side}")
    return float(actor_config.clip_ratio if value is None else value)


def loss_fields(hacpo, use_kl_loss: bool) -> list[str]:
    """The per-row tensors of the micro-batch the HACPO loss reads (besides the model's inputs);
    `hacpo` is the loss's `algorithm.hacpo` settings, of which only `cross_ratio_length` matters here."""
    fields = ["response_mask", "old_log_probs", "advantages", K.IS_CROSS, K.OMEGA, K.SOURCE_LOG_PROB_MEAN]
    if hacpo.cross_ratio_length == "source":
        fields.append(K.SOURCE_RESPONSE_LENGTH)
    if use_kl_loss:
        fields.append("ref_log_prob")
    return fields
