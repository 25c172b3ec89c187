"""GRAFT (`algorithm.hacpo.mode=graft`, docs/ALGORITHM.md §9) and its replay of a recorded peer
(`algorithm.hacpo.replay_peer`, recipe_hacpo/methods/replay.py), as a method of the trainer's step:

    G1  k_M(q) from the verifier's rewards, `graft.graft_selection` → the source of every
        receiver's group (−1: its own)
    G2  every agent's GRPO advantage on its own full group, before anything is exchanged; a
        grafted row carries its source's (`batch_keys.GROUP_ADVANTAGE` travels with the row)
    G3  one more forward of the receiver over its grafted rows only: its old log-probs of
        their re-tokenized text (the ratio's denominator) and w against the source's own
    G4  the objective: verl's PPO-clip against the receiver's old policy, × w, token-mean
    G5  the mini-batch order (`Graft.mini_batch_order`: `graft_formulas.graft_mini_batch_order`)

The formulas are recipe_hacpo/methods/graft_formulas.py's pure functions; this module wires them into the step.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Callable

import numpy as np
import torch

from recipe_hacpo import batch_keys as K
from recipe_hacpo.exchange.retokenize import mean_log_prob_per_response
from recipe_hacpo.methods.graft_formulas import (
    compatibility_weight,
    graft_mini_batch_order,
    graft_policy_loss_matrix,
    graft_selection,
)
from recipe_hacpo.methods.groups import advantages_from_groups, correct_counts, with_group_advantages
from recipe_hacpo.hacpo_settings import ConfigError
from recipe_hacpo.methods.base import Method
from recipe_hacpo.methods.context import AgentMetrics, StepContext
from recipe_hacpo.methods.rows import concat_rows, tag_rows
from recipe_hacpo.methods.replay import read_manifest, replay_selection
from recipe_hacpo.methods.objective import MicroBatch, Objective, PolicyTerm, actor_loss, clip_ratio
from verl import DataProto

if TYPE_CHECKING:
    from recipe_hacpo.agent_spec import AgentSpec
    from recipe_hacpo.hacpo_settings import HacpoSettings


# the GRPO advantage of each row's own group, which travels with a grafted row (G2)
GRAFT_FIELDS = (K.GROUP_ADVANTAGE,)


def graft_exchange(ctx: StepContext, rollouts: dict[str, DataProto]) -> tuple[dict[str, DataProto], AgentMetrics]:
    """Learner batches of mode graft: per prompt, the receiver's own group or one source's whole group."""
    names, metrics = ctx.names, ctx.metrics()
    with_group_advantages(rollouts)
    uids, correct = correct_counts(rollouts, names)
    sizes = torch.as_tensor([s.rollout_n for s in ctx.specs], dtype=torch.long)
    source_of = graft_selection(correct, sizes, balance=ctx.settings.graft_balance)  # [N_R, Q]
    # rows of source_of are positions in ctx.specs (the agent index, but for an asynchronous
    # learner's context: it and the peers that answered its batch)
    position = {s.name: i for i, s in enumerate(ctx.specs)}
    learners = {s.name: position[s.name] for s in ctx.learner_specs}
    batches = graft_batches(rollouts, names, source_of, uids, learners, ctx.convert,
                            index_of={s.name: s.index for s in ctx.specs})
    for name, at in learners.items():
        metrics[name]["graft/groups_received"] = float((source_of[at] >= 0).sum())
        metrics[name]["graft/groups_given"] = float((source_of == at).sum())
    weigh_grafted_rows(ctx, batches, metrics)
    for name, batch in batches.items():
        metrics[name]["cross/rows"] = float(batch.batch[K.IS_CROSS].sum())
    return batches, metrics


def graft_batches(
    rollouts: dict[str, DataProto],
    names: list[str],
    source_of: torch.Tensor,
    uids: list[str],
    learners: dict[str, int],
    convert: Callable[..., DataProto],
    index_of: dict[str, int] | None = None,
) -> dict[str, DataProto]:
    """Each learner's batch: its own rows of the prompts it keeps, then each source's whole groups of
    the prompts `source_of` [N_R, Q] gives it from that source (index into `names`), re-tokenized by
    `convert(source name, learner name, rollouts[source], row numbers)` (`StepContext.convert`).
    `learners`: {name: its row of source_of}; rows are tagged with `index_of[source]` (default:
    the source's place in `names`)."""
    index_of = index_of or {n: i for i, n in enumerate(names)}
    prompt_of = {u: i for i, u in enumerate(uids)}

    def rows_for(name: str, receiver: int, wanted: int) -> torch.Tensor:
        """Row numbers of `name`'s rollouts on the prompts whose group `receiver` takes from `wanted`."""
        q = [prompt_of[u] for u in rollouts[name].non_tensor_batch["uid"].tolist()]
        return torch.nonzero(source_of[receiver, q] == wanted).flatten()

    batches = {}
    for learner, receiver in learners.items():
        own = rows_for(learner, receiver, -1)
        parts = [tag_rows(rollouts[learner].select_idxs(own), source=index_of[learner], cross=False, omega=1.0)]
        for index, source in enumerate(names):
            rows = rows_for(source, receiver, index) if source != learner else own[:0]
            if len(rows):
                parts.append(tag_rows(convert(source, learner, rollouts[source], rows), source=index_of[source],
                                      cross=True, omega=1.0))
        # a receiver may have no own group left, never no group at all (every prompt has one)
        batches[learner] = concat_rows([p for p in parts if len(p)], GRAFT_FIELDS)
    return batches


def weigh_grafted_rows(ctx: StepContext, batches: dict[str, DataProto], metrics: AgentMetrics) -> None:
    """G3: the receiver's old log-probs of its grafted rows (one forward over them only), w and the gate.

    A grafted row the floor drops keeps its place in the batch (so every group keeps n rows and
    the mini-batches their size) with a zeroed response_mask: it is in neither the loss nor the
    token count. w is fixed for the whole update.
    """
    grafted_rows = {name: torch.nonzero(b.batch[K.IS_CROSS]).flatten() for name, b in batches.items()}
    old = ctx.old_log_probs_of_rows({name: (batches[name], rows) for name, rows in grafted_rows.items()},
                                    phase="graft_old_log_prob")
    settings = ctx.settings
    for name, batch in batches.items():
        rows = grafted_rows[name]
        weight = torch.ones(len(batch), dtype=torch.float32)
        if len(rows):
            mask = batch.batch["response_mask"]
            lp = old[name]
            if not torch.isfinite(lp[mask[rows].bool()]).all():
                raise FloatingPointError(f"agent {name!r}: non-finite old log-probs of grafted rows; stopping before any update")
            batch.batch["old_log_probs"][rows] = lp
            w, admitted = compatibility_weight(
                mean_log_prob_per_response(lp, mask[rows]),
                batch.batch[K.SOURCE_LOG_PROB_MEAN][rows],
                torch.ones(len(rows), dtype=torch.bool),
                delta=settings.graft_floor,
                gate=settings.graft_weight,
            )
            weight[rows] = w
            dropped = rows[~admitted]
            mask[dropped] = 0
            metrics[name]["graft/admitted"] = float(admitted.sum())
            metrics[name]["graft/dropped"] = float((~admitted).sum())
            metrics[name]["graft/weight_mean"] = float(w[admitted].mean()) if admitted.any() else 0.0
        else:
            metrics[name]["graft/admitted"] = 0.0
            metrics[name]["graft/dropped"] = 0.0
        batch.batch[K.GRAFT_WEIGHT] = weight


def replay_exchange(ctx: StepContext, rollouts: dict[str, DataProto]) -> tuple[dict[str, DataProto], AgentMetrics]:
    """The receiver's learner batch against the recorded peer: per prompt its own group or the
    recorded whole group (R3), then GRAFT's w and gate (R4)."""
    (learner,) = ctx.specs
    metrics = ctx.metrics()
    peer = ctx.recorded_peer(rollouts[learner.name])
    sources = {learner.name: rollouts[learner.name], peer.key: peer.batch}
    with_group_advantages(sources)
    uids, correct = correct_counts(sources, [learner.name, peer.key])
    taken = replay_selection(correct, peer.rollout_n)
    source_of = torch.where(taken, 1, -1).unsqueeze(0)  # [N_R = 1, Q]: 1 = the recorded peer
    batches = graft_batches(sources, [learner.name, peer.key], source_of, uids, {learner.name: 0}, ctx.convert)
    metrics[learner.name]["graft/groups_received"] = float(taken.sum())
    metrics[learner.name]["replay/reward_mean"] = float(peer.batch.batch[K.REWARD].mean())
    weigh_grafted_rows(ctx, batches, metrics)
    metrics[learner.name]["cross/rows"] = float(batches[learner.name].batch[K.IS_CROSS].sum())
    return batches, metrics


def peer_clip_fraction(update_metrics: dict[str, float]) -> float | None:
    """graft/peer_clipfrac of one agent's step from the loss's summed token counts (None: no grafted token)."""
    tokens = update_metrics.get("graft/peer_tokens", 0.0)
    if not tokens:
        return None
    return float(update_metrics["graft/peer_clipped_tokens"] / tokens)


# ------------------------------------------------------------------ the loss's policy term
def graft_loss_fields(hacpo: "HacpoSettings") -> list[str]:
    return ["response_mask", "old_log_probs", "advantages", K.IS_CROSS, K.GRAFT_WEIGHT]


def graft_policy_term(mb: MicroBatch) -> PolicyTerm:
    """GRAFT's policy term of one micro-batch (G4): verl's vanilla PPO-clip term (with its dual
    clip `actor.clip_ratio_c`) against the receiver's own old log-probs on every row, each row's
    term times its compatibility weight w (`GRAFT_WEIGHT`), token-mean over the mini-batch's
    tokens whatever `actor.loss_agg_mode` says (grafted rows dropped by the floor carry a zero
    response_mask, so they are not counted). With no grafted row it is verl's GRPO loss. Reads
    `hacpo.graft_ratio`; no stepwise bound."""
    from verl.trainer.ppo.core_algos import agg_loss
    from verl.utils.metric import AggregationType, Metric

    padded = mb.padded
    grafted = padded[K.IS_CROSS].bool()
    loss_mat, pg_metrics = graft_policy_loss_matrix(
        mb.log_prob,
        padded["old_log_probs"],
        padded["advantages"],
        mb.response_mask,
        weight=padded[K.GRAFT_WEIGHT],
        is_grafted=grafted,
        clip_ratio_low=clip_ratio(mb.actor_config, "low"),
        clip_ratio_high=clip_ratio(mb.actor_config, "high"),
        clip_ratio_c=float(mb.actor_config.clip_ratio_c),
        ratio_level=mb.hacpo.graft_ratio,
    )
    pg_loss = agg_loss(loss_mat, mb.response_mask, "token-mean", **mb.batch_info)
    metrics = {
        key: Metric(value=value, aggregation=AggregationType.MEAN)
        for key, value in pg_metrics.items()
        if not key.startswith("graft/peer_")
    }
    # the peer-token clip fraction of the step is clipped / all grafted tokens: both counts are
    # summed over micro-batches and ranks here, and `step_metrics` divides their step means
    peer_tokens = float((mb.response_mask & grafted.unsqueeze(-1)).sum())
    metrics["graft/peer_clipped_tokens"] = Metric(
        value=pg_metrics["graft/peer_clipfrac"] * peer_tokens, aggregation=AggregationType.SUM
    )
    metrics["graft/peer_tokens"] = Metric(value=peer_tokens, aggregation=AggregationType.SUM)
    return PolicyTerm(pg_loss=pg_loss, total=pg_loss, agg_mode="token-mean", metrics=metrics,
                      own_rows=int((~grafted).sum()), cross_rows=int(grafted.sum()))


GRAFT_OBJECTIVE = Objective(fields=graft_loss_fields, term=graft_policy_term)
graft_actor_loss = partial(actor_loss, GRAFT_OBJECTIVE)
"""The loss of one micro-batch, as verl's engine calls it: (actor_config, hacpo, model_output, data, ...)."""


# ------------------------------------------------------------------ the method
class Graft(Method):
    """mode graft: per prompt the receiver's own group or one peer's whole group (G1–G5)."""

    metric_groups = ("graft/",)
    objective = GRAFT_OBJECTIVE
    batch_fields = GRAFT_FIELDS
    # a receiver compares its answers with a peer's to the same prompts (asynchronous: takes of its
    # own batch only); its groups stay its own size whatever it took
    joint_only = True
    # always selects complementarily (G1), so share_selection=complementary is allowed, a no-op
    takes_share_selection = True
    replays = True

    def validate(self, specs: list["AgentSpec"], settings: "HacpoSettings", gpus: dict[str, int]) -> None:
        """Every group must have the same size n (a grafted group replaces a whole group, and the
        mini-batches keep theirs), the receiver's extra old-log-prob pass over grafted groups must
        split evenly over its GPUs, and a replay trains one agent against a recording of its n."""
        sizes = {s.rollout_n for s in specs}
        if len(sizes) > 1:
            listed = ", ".join(f"{s.name} {s.rollout_n}" for s in specs)
            raise ConfigError(
                f"algorithm.hacpo.mode=graft: every agent needs the same rollout_n (a grafted group replaces a whole "
                f"group), got {listed}; set agents_rollout_n"
            )
        for s in specs:
            world = gpus[s.name]
            if s.rollout_n % world != 0:
                raise ConfigError(
                    f"agents.{s.name}: rollout_n={s.rollout_n} does not split over its {world} GPUs; "
                    "mode=graft scores grafted groups on the receiver's GPUs, so pick a multiple of the GPU count"
                )
        if settings.replay_peer is not None:
            _validate_replay(settings.replay_peer, specs)

    def exchange(self, ctx: StepContext, rollouts: dict[str, DataProto]) -> tuple[dict[str, DataProto], AgentMetrics]:
        if ctx.settings.replay_peer is not None:
            return replay_exchange(ctx, rollouts)
        return graft_exchange(ctx, rollouts)

    def advantages(self, ctx: StepContext, batches: dict[str, DataProto]) -> AgentMetrics:
        return advantages_from_groups(batches)

    def mini_batch_order(self, settings: "HacpoSettings", uid: np.ndarray, is_cross: np.ndarray, *,
                         mini_batch_prompts: int, dp_size: int, seed: int) -> np.ndarray:
        """G5: every group is own or one source's whole group; the grafted groups' mini-batches train
        last (or first, or mixed: `graft_order`)."""
        return graft_mini_batch_order(uid, is_cross, peer_order=settings.graft_order,
                                      mini_batch_prompts=mini_batch_prompts, dp_size=dp_size, seed=seed)

    def replay_source(self, settings: "HacpoSettings") -> str | None:
        return settings.replay_peer

    def step_metrics(self, update_metrics: dict[str, float]) -> dict[str, float]:
        fraction = peer_clip_fraction(update_metrics)
        return {} if fraction is None else {"graft/peer_clipfrac": fraction}


def _validate_replay(agent_dir: str, specs: list["AgentSpec"]) -> None:
    """GRAFT's replay trains one agent alone against a recorded peer of the same group size."""
    if len(specs) != 1:
        raise ConfigError(
            f"algorithm.hacpo.replay_peer: trains one agent alone against the recording, got {len(specs)} agents "
            f"({', '.join(s.name for s in specs)})"
        )
    manifest = read_manifest(agent_dir)
    if int(manifest["rollout_n"]) != specs[0].rollout_n:
        raise ConfigError(
            f"agents.{specs[0].name}: rollout_n={specs[0].rollout_n} but the recorded peer "
            f"{manifest['name']!r} sampled {manifest['rollout_n']} per prompt; a grafted group replaces a whole group, "
            "so set them equal"
        )
