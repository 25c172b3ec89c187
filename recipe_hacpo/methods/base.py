"""The contract between the trainer and a HACRL method (one module per method, this package).

The trainer runs the same step for every method (spec §7: generate, score, old log-probs,
capabilities, exchange, advantages, update, sync); a method supplies only the parts in which
methods differ, as the methods of one `Method` object:

    validate(specs, settings, gpus)      its keys and the agents it can train, before Ray starts
    rows_per_prompt(specs, learner, s)   rows of one prompt group in a learner batch (mini-batch layout)
    peer_learners(specs, s, source)      learners that take `source`'s rows re-tokenized this step
                                         (the background conversions start as its rollouts return)
    exchange(trainer, rollouts, metrics)     the learner batches from the step's rollouts
    advantages(trainer, batches, metrics)    every learner row's advantage
    peer_order(s)                        the mini-batch order key of `AgentRuntime.update` (None: own order)
    step_metrics(update_metrics)         step figures derived from the loss's summed counts
    objective                            the policy term of its loss (workers/hacpo_loss.py's frame
                                         adds entropy and KL and runs it per micro-batch); None:
                                         verl's own loss stays installed

`trainer` is the running `HacpoTrainer`; a method reads its public state: `specs`, `hacpo` (the
typed `algorithm.hacpo`), `effective`, `tracker`, `agents`, `global_step`, `exchange_jobs`,
`exchanges`, `verifier`, `replay_peer`, `replay_converter` and `for_each_agent`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

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
    def exchange(self, trainer: Any, rollouts: dict[str, "DataProto"], metrics: dict) -> dict[str, "DataProto"]:
        """The learner batches ({agent name: DataProto}) from the step's scored rollouts."""

    @abstractmethod
    def advantages(self, trainer: Any, batches: dict[str, "DataProto"], metrics: dict) -> None:
        """Set `advantages` and `returns` ([B, T], 0 outside the response mask) on every batch."""

    def peer_order(self, settings: "HacpoSettings") -> str | None:
        return None

    def step_metrics(self, update_metrics: dict[str, float]) -> dict[str, float]:
        return {}
