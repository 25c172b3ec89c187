"""The contract between the trainer and a HACRL method (one module per method, this package).

The trainer runs the same step for every method (spec §7: generate, score, old log-probs,
capabilities, exchange, advantages, update, sync); a method supplies only the parts in which
methods differ, as the methods of one `Method` object:

    validate(specs, settings, gpus)      its keys and the agents it can train, before Ray starts
    rows_per_prompt(specs, learner, s)   rows of one prompt group in a learner batch (mini-batch layout)
    peer_learners(specs, s, source)      learners that take `source`'s rows re-tokenized this step
                                         (the background conversions start as its rollouts return)
    exchange(ctx, rollouts)              the learner batches from the step's rollouts, and metrics
    advantages(ctx, batches)             every learner row's advantage; returns metrics
    peer_order(s)                        the mini-batch order key of `AgentRuntime.update` (None: own order)
    step_metrics(update_metrics)         step figures derived from the loss's summed counts
    objective                            the policy term of its loss (workers/hacpo_loss.py's frame
                                         adds entropy and KL and runs it per micro-batch); None:
                                         verl's own loss stays installed

`ctx` is the step's `StepContext` (methods/context.py): the agents, the settings, the step, the
capabilities and the few operations a method needs. A method never sees the trainer. Metrics
come back per agent, named below `agent/<name>/` (`AgentMetrics`); the trainer adds the prefix.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

from recipe_hacpo.methods.context import AgentMetrics, StepContext

if TYPE_CHECKING:
    from verl import DataProto

    from recipe_hacpo.agent_spec import AgentSpec
    from recipe_hacpo.hacpo_settings import HacpoSettings
    from recipe_hacpo.workers.hacpo_loss import Objective


class Method(ABC):
    """The contract; `exchange` and `advantages` every method defines, the rest has defaults:
    no extra checks, the learner's own group size, every peer as a learner when sharing, own
    mini-batch order, no derived step metrics, verl's loss (no objective)."""

    # step-metric groups its loss reports besides actor/ (kept under agent/<name>/<group>/...)
    metric_groups: tuple[str, ...] = ()
    objective: "Objective | None" = None

    def validate(self, specs: list["AgentSpec"], settings: "HacpoSettings", gpus: dict[str, int]) -> None:
        """Raise `ConfigError` (one line naming the key and agent) for what this method cannot train.
        `gpus`: each agent's data-parallel world size."""

    def rows_per_prompt(self, specs: list["AgentSpec"], learner: "AgentSpec", settings: "HacpoSettings") -> int:
        return learner.rollout_n

    def peer_learners(self, specs: list["AgentSpec"], settings: "HacpoSettings", source: str) -> list[str]:
        if not settings.shares or settings.replay_peer is not None:
            return []
        return [s.name for s in specs if s.name != source]

    @abstractmethod
    def exchange(self, ctx: StepContext, rollouts: dict[str, "DataProto"]) -> tuple[dict[str, "DataProto"], AgentMetrics]:
        """The learner batches ({agent name: DataProto}) from the step's scored rollouts, and metrics."""

    @abstractmethod
    def advantages(self, ctx: StepContext, batches: dict[str, "DataProto"]) -> AgentMetrics:
        """Set `advantages` and `returns` ([B, T], 0 outside the response mask) on every batch."""

    def peer_order(self, settings: "HacpoSettings") -> str | None:
        return None

    def step_metrics(self, update_metrics: dict[str, float]) -> dict[str, float]:
        return {}
