"""SGT (`algorithm.hacpo.mode=sgt`, docs/ALGORITHM.md §9, SGT) as a method of the trainer's step:

    every agent's GRPO advantage on its own groups (own rows only, as GRAFT's G2)
    `sgt.sgt_selection` per receiver → at most one imitated peer response per prompt, in one
        extra row per prompt group (the imitation slot), re-tokenized for the receiver
    the objective: GRPO on own tokens + λ·NLL of the imitated tokens; the mini-batch layout is
        HACPO's (`minibatch.mini_batch_order`: whole groups of n_R own rows + 1 slot)

The formulas are recipe_hacpo/methods/sgt_formulas.py's pure functions; this module wires them into the step.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch

from recipe_hacpo import batch_keys as K
from recipe_hacpo.methods.graft_formulas import graft_policy_loss_matrix
from recipe_hacpo.methods.groups import advantages_from_groups, with_group_advantages
from recipe_hacpo.methods.base import Method
from recipe_hacpo.methods.context import AgentMetrics, StepContext
from recipe_hacpo.methods.rows import concat_rows, tag_rows
from recipe_hacpo.methods.sgt_formulas import sgt_selection
from recipe_hacpo.methods.objective import MicroBatch, Objective, PolicyTerm, actor_loss, clip_ratio
from verl import DataProto

if TYPE_CHECKING:
    from recipe_hacpo.agent_spec import AgentSpec
    from recipe_hacpo.hacpo_settings import HacpoSettings


# own rows' GRPO advantage (0 on the slots); each slot's imitated tokens
SGT_FIELDS = (K.GROUP_ADVANTAGE, K.IMITATION_MASK)


def sgt_exchange(ctx: StepContext, rollouts: dict[str, DataProto]) -> tuple[dict[str, DataProto], AgentMetrics]:
    """Learner batches of mode sgt: every own row, plus one imitation slot per prompt group.

    verl's mini-batches and `minibatch.mini_batch_order` need prompt groups of one size, so every
    group of the receiver gets exactly one extra row. Where the receiver imitates (`sgt_selection`)
    that row is the drawn peer response; elsewhere it is a placeholder (the first response of the
    lowest-index peer to that prompt). Either way the slot is re-tokenized for the receiver by
    the exchange, carries a zero response_mask and advantage (it is in neither GRPO's loss nor
    its token count) and `IMITATION_MASK` is its response mask when it is imitated, else 0.
    The draw is keyed on the receiver's `actor.data_loader_seed`, the step and the prompt uid.
    """
    specs, metrics = ctx.specs, ctx.metrics()
    with_group_advantages(rollouts)  # GRPO on each agent's own groups, before anything is exchanged
    # every agent's rows in agent-index order, then batch order: the pool order of the draw
    source = torch.cat([torch.full((len(rollouts[s.name]),), s.index, dtype=torch.long) for s in specs])
    row = torch.cat([torch.arange(len(rollouts[s.name])) for s in specs])
    correct = torch.cat([rollouts[s.name].batch[K.REWARD] > 0 for s in specs])
    uid = np.concatenate([rollouts[s.name].non_tensor_batch["uid"] for s in specs])

    batches = {}
    for learner in ctx.learner_specs:
        uids, picks = sgt_selection(correct, uid, source, learner.index, seed=ctx.seed_of(learner.name), step=ctx.step)
        placeholder = torch.as_tensor([_first_peer_row(uid, source, u, learner.index) for u in uids], dtype=torch.long)
        slot = torch.where(picks >= 0, picks, placeholder)  # one pooled row per prompt
        own = tag_rows(rollouts[learner.name], source=learner.index, cross=False, omega=1.0)
        own.batch[K.IMITATION_MASK] = torch.zeros_like(own.batch["response_mask"])
        parts = [own]
        for src in specs:
            # the receiver's own row stands in as a placeholder only where no peer answered the
            # prompt (an asynchronous learner whose peers have not answered its batch)
            here = torch.nonzero(source[slot] == src.index).flatten()
            if not len(here):
                continue
            rows = row[slot[here]]
            slots = (ctx.convert(src.name, learner.name, rollouts[src.name], rows) if src.name != learner.name
                     else rollouts[learner.name].select_idxs(rows))
            parts.append(_imitation_slots(tag_rows(slots, source=src.index, cross=True, omega=1.0), picks[here] >= 0))
        batch = concat_rows(parts, SGT_FIELDS)
        batches[learner.name] = batch
        imitated = int((picks >= 0).sum())
        metrics[learner.name].update({
            "sgt/prompts_imitated": float(imitated),
            "sgt/imitation_tokens": float(batch.batch[K.IMITATION_MASK].sum()),
            "cross/rows": float(imitated),
        })
    return batches, metrics


def _first_peer_row(uid: np.ndarray, source: torch.Tensor, prompt: str, receiver: int) -> int:
    """The pooled row number of the first response of the lowest-index peer to `prompt` (the
    receiver's own first response where no peer answered it)."""
    rows = np.flatnonzero((uid == prompt) & (source.numpy() != receiver))
    if not len(rows):
        rows = np.flatnonzero(uid == prompt)
    return int(rows[0])


def _imitation_slots(slots: DataProto, imitated: torch.Tensor) -> DataProto:
    """Mask the slot rows out of GRPO's term; the imitated ones' response tokens become the NLL's."""
    mask = slots.batch["response_mask"]
    slots.batch[K.IMITATION_MASK] = mask * imitated.to(mask.dtype).unsqueeze(-1)
    slots.batch["response_mask"] = torch.zeros_like(mask)
    slots.batch[K.GROUP_ADVANTAGE] = torch.zeros(len(slots), dtype=torch.float32)
    return slots


def sgt_advantages(batches: dict[str, DataProto]) -> AgentMetrics:
    """GRPO's advantage of every own row (as GRAFT's G2); 0 on the imitation slots."""
    metrics = advantages_from_groups(batches)
    for name, batch in batches.items():
        own = batch.batch[K.GROUP_ADVANTAGE][~batch.batch[K.IS_CROSS]]
        metrics[name].update({"advantage/mean": float(own.mean()), "advantage/abs_mean": float(own.abs().mean())})
    return metrics


def imitation_nll(update_metrics: dict[str, float]) -> float | None:
    """sgt/nll of one agent's step from the loss's summed NLL and token count (None: nothing imitated)."""
    tokens = update_metrics.get("sgt/nll_tokens", 0.0)
    if not tokens:
        return None
    return float(update_metrics["sgt/nll_sum"] / tokens)


# ------------------------------------------------------------------ the loss's policy term
def sgt_loss_fields(hacpo: "HacpoSettings") -> list[str]:
    return ["response_mask", "old_log_probs", "advantages", K.IS_CROSS, K.IMITATION_MASK]


def sgt_policy_term(mb: MicroBatch) -> PolicyTerm:
    """SGT's objective of one micro-batch:

        L = token-mean over own tokens of ℓ^GRPO  +  λ · token-mean over imitated tokens of (−log π_θR)

    The GRPO term is GRAFT's with w = 1 (verl's vanilla PPO-clip with its dual clip, token-mean
    over `response_mask`, which is 0 on every imitation-slot row, so verl's `batch_num_tokens`
    counts own tokens only). The NLL term runs over `IMITATION_MASK`, normalised by the
    mini-batch's imitated tokens on every rank (`IMITATION_TOKENS`, set by `HacpoTrainingWorker`)
    exactly as verl normalises a token-mean, so summed over micro-batches and averaged over ranks
    it is `sgt.compute_sgt_loss` of the whole mini-batch. λ is `hacpo.sgt_lambda`. cross_rows:
    the imitation slots."""
    from verl.trainer.ppo.core_algos import agg_loss
    from verl.utils import tensordict_utils as tu
    from verl.utils.metric import AggregationType, Metric

    padded, log_prob = mb.padded, mb.log_prob
    imitated = padded[K.IMITATION_MASK].to(bool)
    rows = log_prob.shape[0]
    loss_mat, pg_metrics = graft_policy_loss_matrix(
        log_prob,
        padded["old_log_probs"],
        padded["advantages"],
        mb.response_mask,
        weight=torch.ones(rows),
        is_grafted=torch.zeros(rows, dtype=torch.bool),
        clip_ratio_low=clip_ratio(mb.actor_config, "low"),
        clip_ratio_high=clip_ratio(mb.actor_config, "high"),
        clip_ratio_c=float(mb.actor_config.clip_ratio_c),
    )
    # SGT's GRPO term is token-mean over the mini-batch whatever actor.loss_agg_mode says
    pg_loss = agg_loss(loss_mat, mb.response_mask, "token-mean", **mb.batch_info)
    imitation_tokens = int(tu.get_non_tensor_data(data=mb.data, key=K.IMITATION_TOKENS, default=-1))
    if imitation_tokens < 0:
        raise RuntimeError(
            f"SGT loss: the micro-batch carries no {K.IMITATION_TOKENS}; the actor must be HacpoTrainingWorker"
        )
    # −log π on imitated tokens only (a where, not a product: nothing outside them can leak in)
    nll_mat = torch.where(imitated, -log_prob, torch.zeros_like(log_prob))
    nll_sum = nll_mat.sum()
    if imitation_tokens:
        # verl's token-mean with the mini-batch's imitated tokens in place of batch_num_tokens
        nll = agg_loss(nll_mat, imitated, "token-mean", **{**mb.batch_info, "batch_num_tokens": imitation_tokens})
    else:
        nll = nll_sum * 0.0  # nothing imitated in this mini-batch (keeps the graph)
    metrics = {
        key: Metric(value=value, aggregation=AggregationType.MEAN)
        for key, value in pg_metrics.items()
        if not key.startswith("graft/")
    }
    # the step's NLL is Σ NLL / imitated tokens: both summed over micro-batches and ranks here,
    # and `step_metrics` divides their step means (as GRAFT's peer clip fraction)
    metrics["sgt/nll_sum"] = Metric(value=float(nll_sum.detach()), aggregation=AggregationType.SUM)
    metrics["sgt/nll_tokens"] = Metric(value=float(imitated.sum()), aggregation=AggregationType.SUM)
    slots = padded[K.IS_CROSS].bool()
    return PolicyTerm(pg_loss=pg_loss, total=pg_loss + mb.hacpo.sgt_lambda * nll, agg_mode="token-mean",
                      metrics=metrics, own_rows=int((~slots).sum()), cross_rows=int(slots.sum()))


SGT_OBJECTIVE = Objective(fields=sgt_loss_fields, term=sgt_policy_term)
sgt_actor_loss = partial(actor_loss, SGT_OBJECTIVE)
"""The loss of one micro-batch, as verl's engine calls it: (actor_config, hacpo, model_output, data, ...)."""


# ------------------------------------------------------------------ the method
class Sgt(Method):
    """mode sgt: own rows plus one imitation slot per prompt group."""

    metric_groups = ("sgt/",)
    objective = SGT_OBJECTIVE
    # own rows' GRPO advantage; the imitated tokens of each slot, and their count over every rank
    # of a mini-batch (the NLL's token-mean denominator, `sgt_policy_term`)
    batch_fields = SGT_FIELDS
    global_counts = {K.IMITATION_TOKENS: K.IMITATION_MASK}
    # the receiver imitates a peer's answer to the same prompt (asynchronous: takes of its own batch only)
    joint_only = True

    def rows_per_prompt(self, specs: list["AgentSpec"], learner: "AgentSpec", settings: "HacpoSettings") -> int:
        return learner.rollout_n + 1  # the learner's own group and its imitation slot

    def exchange(self, ctx: StepContext, rollouts: dict[str, DataProto]) -> tuple[dict[str, DataProto], AgentMetrics]:
        return sgt_exchange(ctx, rollouts)

    def advantages(self, ctx: StepContext, batches: dict[str, DataProto]) -> AgentMetrics:
        return sgt_advantages(batches)

    def step_metrics(self, update_metrics: dict[str, float]) -> dict[str, float]:
        nll = imitation_nll(update_metrics)
        return {} if nll is None else {"sgt/nll": nll}
