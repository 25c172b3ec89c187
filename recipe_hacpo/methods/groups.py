"""What several methods compute on the step's prompt groups (one group: every answer of one
agent to one prompt, verl's `uid`), before or after the exchange.

    grpo_advantage(rewards, uid)           GRPO's advantage of one agent's rows on its own groups
    with_group_advantages(rollouts)        that advantage on every agent's rows, as GROUP_ADVANTAGE,
                                           before anything is exchanged (it travels with the row)
    advantages_from_groups(batches)        each learner row's advantage = its GROUP_ADVANTAGE
    correct_counts(rollouts, names)        k_M(q): correct answers of each agent to each prompt

GRAFT and SGT train on GRPO's advantage of the generating agent's own group; GRAFT's selection
and HACPO's complementary selection read k_M(q). Pure torch/numpy, no verl import.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np
import torch

from recipe_hacpo import batch_keys as K
from recipe_hacpo.methods.core_algos import compute_hacpo_advantage

if TYPE_CHECKING:
    from verl import DataProto


def grpo_advantage(rewards: torch.Tensor, index: np.ndarray | Sequence, epsilon: float = 1e-6) -> torch.Tensor:
    """GRPO's outcome advantage Â_i = (R_i − mean_g R) / (std_g R + ε) of one agent's rows, [B].

    Computed on an agent's full group before anything is exchanged or dropped: the receiver's
    own rows keep theirs, a grafted group carries its source's, held fixed (GRAFT's G2). A group
    of one row gets μ = 0, σ = 1, a uniform group 0, as in verl's `compute_grpo_outcome_advantage`.

    Args:
        rewards: R_i, float [B].  index: group id per row (verl's `uid`), [B].
    """
    rewards = torch.as_tensor(rewards)
    one_agent = torch.zeros(rewards.shape[0], dtype=torch.long)
    return compute_hacpo_advantage(rewards, index, one_agent, 0, [1.0], epsilon=epsilon)


def with_group_advantages(rollouts: dict[str, "DataProto"]) -> None:
    """Every agent's GRPO advantage on its full groups, before anything is exchanged or dropped
    (`GROUP_ADVANTAGE` then travels with each row)."""
    for batch in rollouts.values():
        batch.batch[K.GROUP_ADVANTAGE] = grpo_advantage(batch.batch[K.REWARD], batch.non_tensor_batch["uid"]).float()


def advantages_from_groups(batches: dict[str, "DataProto"]) -> dict[str, dict[str, float]]:
    """Every learner row's advantage is its generating agent's GRPO advantage on its own group
    (`GROUP_ADVANTAGE`), 0 outside the response mask; returns advantage/mean and abs_mean per learner."""
    metrics = {}
    for name, batch in batches.items():
        adv = batch.batch[K.GROUP_ADVANTAGE]
        mask = batch.batch["response_mask"]
        batch.batch["advantages"] = adv.float().unsqueeze(-1) * mask
        batch.batch["returns"] = batch.batch["advantages"]
        metrics[name] = {"advantage/mean": float(adv.mean()), "advantage/abs_mean": float(adv.abs().mean())}
    return metrics


def correct_counts(rollouts: dict[str, "DataProto"], names: list[str]) -> tuple[list[str], torch.Tensor]:
    """The step's prompts (uids in batch order) and k_M(q) of every agent, long [N, Q].

    A response counts as correct when its reward is positive (the verifier's rewards are 0/1).
    """
    uids = list(dict.fromkeys(rollouts[names[0]].non_tensor_batch["uid"].tolist()))
    where = {u: i for i, u in enumerate(uids)}
    correct = torch.zeros(len(names), len(uids), dtype=torch.long)
    for a, name in enumerate(names):
        batch = rollouts[name]
        q = torch.as_tensor([where[u] for u in batch.non_tensor_batch["uid"].tolist()], dtype=torch.long)
        correct[a].index_add_(0, q, (batch.batch[K.REWARD] > 0).long())
    return uids, correct
