"""The loss contract of a method (`Objective`, `MicroBatch`, `PolicyTerm`) and the actor loss
verl's engine workers call (`set_loss_fn`): one frame for every method.

verl's policy-loss registry passes only (old_log_prob, log_prob, advantages, response_mask,
loss_agg_mode, config, rollout_is_weights), which cannot carry the methods' per-row fields, so
the loss is installed as the worker's whole loss function instead. `actor_loss` is the frame:
it pads the micro-batch, hands it to the method's `Objective` (recipe_hacpo/methods/), adds
verl's entropy and KL terms with the objective's aggregation, records what the micro-batch used
and refuses a non-finite loss. It reads from the micro-batch TensorDict:

    tensors      response_mask, [ref_log_prob], and the objective's fields (batch_keys)
    non-tensors  hacpo_update_index (set per mini-batch by `HacpoTrainingWorker`),
                 the method's global counts (`Method.global_counts`, the same: SGT's
                 imitated tokens, the complementary selection's rows),
                 dp_size, batch_num_tokens, global_batch_size (set by verl)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from tensordict import TensorDict

from recipe_hacpo import batch_keys as K
from recipe_hacpo.methods.core_algos import to_accumulation_dtype
from recipe_hacpo.hacpo_settings import HacpoSettings


@dataclass
class MicroBatch:
    """What a method's objective reads of one micro-batch, prepared by `actor_loss`."""

    actor_config: Any
    hacpo: HacpoSettings
    log_prob: torch.Tensor  # [B, T] the model's log-probs (float32 when the model ran in bf16/fp16)
    padded: TensorDict  # the objective's `fields`, padded to [B, T] / [B]
    response_mask: torch.Tensor  # bool [B, T]
    batch_info: dict  # verl's global batch info (dp_size, batch_num_tokens, global_batch_size, ...)
    aggregation: Any  # how the per-micro-batch losses combine (verl's AggregationType)
    update_index: int  # m, the optimizer update of this step (spec §5)
    data: TensorDict  # the whole micro-batch, for the non-tensors a method sets


@dataclass
class PolicyTerm:
    """An objective's result: its policy term and what the frame reports of it."""

    pg_loss: torch.Tensor  # the aggregated policy term (`actor/pg_loss`)
    total: torch.Tensor  # pg_loss plus the method's own terms, before entropy and KL
    agg_mode: str  # verl's aggregation of the entropy and KL terms
    metrics: dict  # the method's metrics (verl `Metric`s)
    own_rows: int
    cross_rows: int
    lower_bound: float | None = None  # HACPO's stepwise bound this micro-batch used; None: no bound
    rows: dict | None = None  # per row in the loss: {"row": K.ROW ids, "ratio": s_i, "clipped": bool}


@dataclass(frozen=True)
class Objective:
    """A method's contribution to the loss: the per-row fields it reads and its policy term."""

    fields: Callable[[HacpoSettings], list[str]]
    term: Callable[[MicroBatch], PolicyTerm]


def actor_loss(
    objective: Objective,
    actor_config,
    hacpo: HacpoSettings,
    model_output,
    data: TensorDict,
    dp_group=None,
    record: Callable[..., None] | None = None,
):
    """Loss of one micro-batch for verl's FSDP engine: the method's policy term (+ entropy, + KL).

    The objective aggregates its own term with verl's `agg_loss` and the global batch info verl
    attaches, so gradient accumulation over micro-batches and data-parallel ranks gives the
    mini-batch mean; the entropy and KL terms follow verl's actor loss with the objective's
    aggregation. `hacpo` is the run's effective `algorithm.hacpo` (`HacpoSettings.effective`).
    `record(update_index=, lower_bound=, own_rows=, cross_rows=, rows=)`, when given, receives what
    this micro-batch's loss used (the worker keeps it per mini-batch, see hacpo_worker); `rows`
    is the objective's per-row record when it keeps one (HACPO's ratio and clip), else None.
    """
    from verl.utils.metric import Metric

    log_prob, entropy, batch_info, aggregation, update_index = _micro_batch(actor_config, model_output, data)
    fields = list(objective.fields(hacpo))
    if actor_config.use_kl_loss:
        fields.append("ref_log_prob")
    padded = data.select(*fields).to_padded_tensor()
    response_mask = padded["response_mask"].to(bool)
    micro = MicroBatch(actor_config, hacpo, log_prob, padded, response_mask, batch_info, aggregation, update_index, data)
    term = objective.term(micro)
    if record is not None:
        record(update_index=update_index, lower_bound=term.lower_bound, own_rows=term.own_rows,
               cross_rows=term.cross_rows, rows=term.rows)
    metrics = term.metrics
    metrics["actor/pg_loss"] = Metric(value=term.pg_loss, aggregation=aggregation)
    total = _regularised(
        actor_config, term.total, log_prob, entropy, padded, response_mask, term.agg_mode, batch_info, aggregation, metrics
    )
    _check_finite(total, term.pg_loss, update_index)
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


def aggregation_of(key: str):
    """`*_min` / `*_max` metrics are a min / max over micro-batches and ranks (verl's `Metric`
    does both); everything else is a mean."""
    from verl.utils.metric import AggregationType

    if key.endswith("_min"):
        return AggregationType.MIN
    if key.endswith("_max"):
        return AggregationType.MAX
    return AggregationType.MEAN


def clip_ratio(actor_config, side: str) -> float:
    """The actor's clip ratio of one side (`low` / `high`), `clip_ratio` where it is unset."""
    value = getattr(actor_config, f"clip_ratio_{side}")
    return float(actor_config.clip_ratio if value is None else value)
