"""HACPO (`algorithm.hacpo.mode=hacpo`) and its two baselines from the same code: Naive sharing
(`mode=naive`) and the isolated agents (`mode=isolated`, GSPO / GRPO / GSPO×2).

    exchange     learner batch = own rows + every peer's rows re-tokenized for the learner (§7),
                 each peer part with ω⁽ʲ,ᵏ⁾ (§3); with `share_selection=complementary` only the
                 peer rows GRAFT's G1 selects enter the loss (docs/ALGORITHM.md §9)
    advantages   the capability-aware group advantage (§2, `core_algos.compute_hacpo_advantage`)
    objective    own rows as GSPO, cross rows reweighted by the exponential importance weight with
                 stepwise clipping (§4–§6, `core_algos.hacpo_policy_loss_matrix`), seq-mean-token-mean

Naive is HACPO with its capability terms off (`HacpoSettings.effective`); isolated shares
nothing and keeps verl's own loss (`actor.policy_loss.loss_mode`), so its objective is None.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, NamedTuple

import torch

from recipe_hacpo import batch_keys as K
from recipe_hacpo.hacpo_settings import NAIVE_CROSS_CLIP
from recipe_hacpo.methods.core_algos import capability_baseline, capability_ratio, compute_hacpo_advantage, hacpo_policy_loss_matrix
from recipe_hacpo.methods.graft_formulas import graft_selection
from recipe_hacpo.methods.base import Method
from recipe_hacpo.methods.context import AgentMetrics, StepContext
from recipe_hacpo.methods.groups import correct_counts
from recipe_hacpo.methods.rows import concat_rows, tag_rows
from recipe_hacpo.methods.objective import MicroBatch, Objective, PolicyTerm, actor_loss, aggregation_of, clip_ratio
from verl import DataProto

if TYPE_CHECKING:
    from recipe_hacpo.agent_spec import AgentSpec
    from recipe_hacpo.hacpo_settings import HacpoSettings


# ------------------------------------------------------------------ the loss's policy term
def hacpo_loss_fields(hacpo: "HacpoSettings") -> list[str]:
    """The per-row tensors the HACPO term reads (besides the model's inputs); of `hacpo` only
    `cross_ratio_length` matters here."""
    fields = ["response_mask", "old_log_probs", "advantages", K.IS_CROSS, K.OMEGA, K.SOURCE_LOG_PROB_MEAN]
    if hacpo.cross_ratio_length == "source":
        fields.append(K.SOURCE_RESPONSE_LENGTH)
    return fields


def hacpo_policy_term(mb: MicroBatch) -> PolicyTerm:
    """HACPO's policy term of one micro-batch (§3–§6): own GSPO rows + reweighted cross rows,
    seq-mean-token-mean whatever `actor.loss_agg_mode` says (spec §6). Reads alpha, delta,
    delta_step, cross_clip and cross_ratio_length of the effective `algorithm.hacpo`."""
    from verl.trainer.ppo.core_algos import agg_loss
    from verl.utils.metric import AggregationType, Metric

    padded, hacpo = mb.padded, mb.hacpo
    # each row's ratio and clip, kept when the rows carry their ids (recipe_hacpo/training/rollout_log.py)
    per_row = {} if K.ROW in mb.data.keys() else None
    loss_mat, pg_metrics = hacpo_policy_loss_matrix(
        mb.log_prob,
        padded["old_log_probs"],
        padded["advantages"],
        mb.response_mask,
        is_cross=padded[K.IS_CROSS],
        omega=padded[K.OMEGA],
        source_log_prob_mean=padded[K.SOURCE_LOG_PROB_MEAN],
        update_index=mb.update_index,
        alpha=hacpo.alpha,
        delta=hacpo.delta,
        delta_step=hacpo.delta_step,
        cross_clip=hacpo.cross_clip,
        clip_ratio_low=clip_ratio(mb.actor_config, "low"),
        clip_ratio_high=clip_ratio(mb.actor_config, "high"),
        cross_ratio_length=hacpo.cross_ratio_length,
        source_response_length=padded.get(K.SOURCE_RESPONSE_LENGTH, None),
        rows=per_row,
    )
    is_cross = padded[K.IS_CROSS].bool()
    pg_loss = agg_loss(loss_mat, mb.response_mask, "seq-mean-token-mean", **mb.batch_info)
    metrics = {key: Metric(value=value, aggregation=aggregation_of(key)) for key, value in pg_metrics.items()}
    if not bool((is_cross & mb.response_mask.any(-1)).any()):
        # no cross row in this micro-batch's loss (none at all, or none selected under
        # share_selection=complementary): neutral values, so min/max over the step stay honest
        metrics["hacpo/cross_ratio_min"] = Metric(value=float("inf"), aggregation=AggregationType.MIN)
        metrics["hacpo/cross_ratio_max"] = Metric(value=float("-inf"), aggregation=AggregationType.MAX)
    return PolicyTerm(
        pg_loss=pg_loss, total=pg_loss, agg_mode="seq-mean-token-mean", metrics=metrics,
        own_rows=int((~is_cross).sum()), cross_rows=int(is_cross.sum()),
        lower_bound=float(pg_metrics["hacpo/lower_bound"]),
        rows=None if per_row is None else row_record(mb.data[K.ROW], per_row, mb.response_mask),
    )


def row_record(row_ids: torch.Tensor, per_row: dict, response_mask: torch.Tensor) -> dict:
    """{"row", "ratio", "clipped"} lists over the micro-batch's rows in the loss (those with a
    response token)."""
    in_loss = response_mask.any(-1)
    return {
        "row": row_ids.reshape(-1)[in_loss].tolist(),
        "ratio": per_row["ratio"][in_loss].tolist(),
        "clipped": per_row["clipped"][in_loss].tolist(),
    }


HACPO_OBJECTIVE = Objective(fields=hacpo_loss_fields, term=hacpo_policy_term)
hacpo_actor_loss = partial(actor_loss, HACPO_OBJECTIVE)
"""The loss of one micro-batch, as verl's engine calls it: (actor_config, hacpo, model_output, data, ...)."""


# ------------------------------------------------------------------ share_selection=complementary
class ShareSelection(NamedTuple):
    """GRAFT's G1 selection of one step as a share rule: `source_of[R, q]` is the one peer whose
    rows learner R trains on for prompt q (−1: none), `prompt_of` a uid's q."""

    prompt_of: dict[str, int]
    source_of: torch.Tensor  # long [N_R, Q]


def complementary_sources(ctx: StepContext, rollouts: dict[str, DataProto]) -> ShareSelection:
    """`share_selection=complementary` (mode hacpo / naive): GRAFT's G1, computed as mode graft does.

        C_{S→R} = { q : k_R(q) = 0  and  1 ≤ k_S(q) < n_S },  balanced per unordered pair
        (`graft_balance`), one source per (R, q) when N ≥ 3 (`graft.graft_selection`)

    Learner R keeps every own row and, of peer S's rows, those of the prompts with source_of[R, q] = S.
    """
    uids, correct = correct_counts(rollouts, ctx.names)
    sizes = torch.as_tensor([s.rollout_n for s in ctx.specs], dtype=torch.long)
    source_of = graft_selection(correct, sizes, balance=ctx.settings.graft_balance)
    return ShareSelection({u: i for i, u in enumerate(uids)}, source_of)


def mark_selected(part: DataProto, selection: ShareSelection, learner: int) -> DataProto:
    """Tag one part of learner R's batch with `SELECTED`; zero the response_mask of the others.

    The unselected peer rows stay (every prompt group keeps its size, as the mini-batch layout
    needs) but with no response token they are in neither the loss nor its token and row counts;
    the advantage leaves them out of the group statistics (`SELECTED` is its row validity).
    """
    q = torch.as_tensor([selection.prompt_of[u] for u in part.non_tensor_batch["uid"].tolist()], dtype=torch.long)
    chosen = selection.source_of[learner, q] if len(q) else q
    selected = ~part.batch[K.IS_CROSS] | (chosen == part.batch[K.SOURCE])
    part.batch[K.SELECTED] = selected
    if not bool(selected.all()):
        # a new tensor, never in place: an own part is the learner's rollout itself
        mask = part.batch["response_mask"]
        part.batch["response_mask"] = mask * selected.to(mask.dtype).unsqueeze(-1)
    return part


def selection_metrics(batch: DataProto, selection: ShareSelection, learner: int) -> dict[str, float]:
    """cross/rows_selected (peer rows in the loss) and cross/groups_selected (peer groups, one
    source's rows for one prompt, this learner trains on)."""
    peer_selected = batch.batch[K.SELECTED] & batch.batch[K.IS_CROSS]
    return {
        "cross/rows_selected": float(peer_selected.sum()),
        "cross/groups_selected": float((selection.source_of[learner] >= 0).sum()),
    }


# ------------------------------------------------------------------ the method
NAIVE_IMPLIED = {"capability_baseline": False, "discrepancy_coefficient": False, "alpha": 0.0, "cross_clip": NAIVE_CROSS_CLIP}
"""What mode=naive sets whatever the config says (§8): HACPO with its capability terms off."""


class Hacpo(Method):
    """modes hacpo, naive (capability terms off) and isolated (nothing shared, verl's loss)."""

    # share_selection=complementary: which rows train (the advantage's row validity), and their
    # count over every rank of a mini-batch (the seq-mean's denominator, `hacpo_policy_term`)
    batch_fields = (K.SELECTED,)
    global_counts = {K.LOSS_ROWS: K.SELECTED}

    def __init__(self, shares: bool = True, naive: bool = False) -> None:
        self.shares = shares
        self.objective = HACPO_OBJECTIVE if shares else None
        # the joint group (spec §2) holds every agent's part; asynchronous fills a missing one
        self.joint_groups = shares
        # share_selection=complementary picks the peer rows of a sharing learner (§9)
        self.takes_share_selection = shares
        # the Naive baseline (§8): plain mean/std, no ω, α = 0, cross rows as GSPO rows
        self.implied = dict(NAIVE_IMPLIED) if naive else {}

    def selects_complementary(self, settings: "HacpoSettings") -> bool:
        return self.shares and settings.share_selection == "complementary"

    def rows_per_prompt(self, specs: list["AgentSpec"], learner: "AgentSpec", settings: "HacpoSettings") -> int:
        # every agent's group for the prompt when sharing (spec §2: the joint group)
        return sum(s.rollout_n for s in specs) if self.shares else learner.rollout_n

    def exchange(self, ctx: StepContext, rollouts: dict[str, DataProto]) -> tuple[dict[str, DataProto], AgentMetrics]:
        """Learner batches: own rows, then (when sharing) every peer's rows in its tokenization,
        with share_selection=complementary only GRAFT's selected peer rows in the loss."""
        settings, caps, metrics = ctx.settings, ctx.capabilities, ctx.metrics()
        # share_selection=complementary: GRAFT's G1 picks, per learner and prompt, the one peer
        # whose rows enter the loss (None: every peer row, the methods as published)
        selection = complementary_sources(ctx, rollouts) if self.selects_complementary(settings) else None
        batches = {}
        for learner in ctx.learner_specs:
            mine = metrics[learner.name]
            parts = [tag_rows(rollouts[learner.name], source=learner.index, cross=False, omega=1.0)]
            if self.shares:
                for src in ctx.specs:
                    if src.name == learner.name or src.name not in rollouts:  # asynchronous: a peer not taken
                        continue
                    converted = ctx.convert(src.name, learner.name, rollouts[src.name])
                    omega = capability_ratio(caps, src.index, learner.index, settings.omega_clip)
                    if not ctx.effective.discrepancy_coefficient:
                        omega = 1.0
                    parts.append(tag_rows(converted, source=src.index, cross=True, omega=omega))
                    mine[f"omega/{src.name}"] = omega
            if selection is not None:
                parts = [mark_selected(p, selection, learner.index) for p in parts]
            batch = concat_rows(parts, self.batch_fields)
            mine["cross/rows"] = float(batch.batch[K.IS_CROSS].sum())
            if selection is not None:
                mine.update(selection_metrics(batch, selection, learner.index))
            batches[learner.name] = batch
        return batches, metrics

    def advantages(self, ctx: StepContext, batches: dict[str, DataProto]) -> AgentMetrics:
        settings, caps, metrics = ctx.settings, ctx.capabilities, ctx.metrics()
        for learner in ctx.learner_specs:
            batch = batches[learner.name]
            group = (batch.batch[K.REWARD], batch.non_tensor_batch["uid"], batch.batch[K.SOURCE], learner.index, caps)
            # share_selection=complementary: the group statistics run over the selected rows only
            valid = batch.batch[K.SELECTED] if K.SELECTED in batch.batch.keys() else None
            options = dict(
                use_capability_baseline=ctx.effective.capability_baseline,
                omega_clip=settings.omega_clip,
                baseline_cap=settings.baseline_cap,
                valid=valid,
            )
            adv = compute_hacpo_advantage(*group, norm_by_std=settings.norm_by_std, **options)
            _, guarded = capability_baseline(*group, **options)
            mask = batch.batch["response_mask"]
            batch.batch["advantages"] = adv.float().unsqueeze(-1) * mask
            batch.batch["returns"] = batch.batch["advantages"]
            shown = adv if valid is None else adv[valid]  # over the rows that train
            # groups (prompts) of this step whose baseline the §2 guard replaced by the own mean
            guarded_uids = batch.non_tensor_batch["uid"][guarded.numpy()]
            metrics[learner.name].update({
                "advantage/mean": float(shown.mean()),
                "advantage/abs_mean": float(shown.abs().mean()),
                "advantage/guard_groups": float(len(set(guarded_uids.tolist()))),
            })
        return metrics
