"""What a method sees of one training step: `StepContext`, read-only data and a few operations.

A method never receives the trainer. The trainer builds one context per step after the
capability update (`HacpoTrainer.step_context`) and hands it to `Method.exchange` and
`Method.advantages`; they return their learner batches and per-agent metrics, keyed by agent
name and then by the metric's name below `agent/<name>/` (the trainer adds that prefix).

    specs                  the agents, in index order (agent j is specs[j])
    settings               `algorithm.hacpo`, typed (hacpo_settings.HacpoSettings)
    effective              the same with the mechanisms a mode turns off turned off (Naive)
    step                   the global step being trained (1-based)
    capabilities           P̂_j of every agent after this step's update, float [N]
    seed_of(name)          an agent's `actor.data_loader_seed` (SGT's draw is keyed on it)
    convert(source, learner, batch, rows=None)
                           `source`'s rows (all, or `rows`) in `learner`'s tokenization
    old_log_probs_of_rows({learner: (batch, rows)}, phase)
                           each learner's old log-probs of `rows` of its batch, [len(rows), T]
                           (None where it asked for none); timed as `timing_s/<phase>`
    recorded_peer(live)    the recorded peer of a replay for this step and prompts
                           (`RecordedRows`, rewards attached); None when nothing is replayed
    learners               the agents whose learner batches to build (None: every agent); an
                           asynchronous run builds one learner's at a time, from its own rows and
                           the peer rows it took (a peer may be missing, or answer another batch)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Mapping

if TYPE_CHECKING:
    import torch
    from verl import DataProto

    from recipe_hacpo.agent_spec import AgentSpec
    from recipe_hacpo.hacpo_settings import HacpoSettings

AgentMetrics = dict[str, dict[str, float]]
"""{agent name: {metric name below agent/<name>/: value}}"""


@dataclass(frozen=True)
class RecordedRows:
    """A recorded peer's rows for one step: its name in the learner batches (`key`), its group
    size, and its batch with the verifier's rewards attached."""

    key: str
    rollout_n: int
    batch: "DataProto"


@dataclass(frozen=True)
class StepContext:
    specs: tuple["AgentSpec", ...]
    settings: "HacpoSettings"
    effective: "HacpoSettings"
    step: int
    capabilities: "torch.Tensor"
    seed_of: Callable[[str], int]
    convert: Callable[..., "DataProto"]
    old_log_probs_of_rows: Callable[..., dict]
    recorded_peer: Callable[["DataProto"], RecordedRows] | None = None
    learners: tuple[str, ...] | None = None

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.specs]

    @property
    def learner_specs(self) -> tuple["AgentSpec", ...]:
        """The agents whose learner batches this step builds."""
        return self.specs if self.learners is None else tuple(s for s in self.specs if s.name in self.learners)

    def metrics(self) -> AgentMetrics:
        """An empty per-agent metrics map, one entry per agent."""
        return {s.name: {} for s in self.specs}


AGENT_PREFIX = "agent/"
"""Every per-agent metric is named `agent/<name>/<key>`, in the logs and in metrics.jsonl."""


def agent_key(name: str, key: str) -> str:
    """`agent/<name>/<key>`: the one place the prefix is written, so a reader of the logs
    (`agent_of`) and every writer agree on it."""
    return f"{AGENT_PREFIX}{name}/{key}"


def agent_of(key: str) -> tuple[str, str] | None:
    """(name, key) of a metric named `agent/<name>/<key>`; None for a metric of no agent."""
    parts = key.split("/", 2)
    if len(parts) == 3 and parts[0] == AGENT_PREFIX[:-1]:
        return parts[1], parts[2]
    return None


def prefixed(agent_metrics: Mapping[str, Mapping[str, float]]) -> dict[str, float]:
    """`agent/<name>/<key>` for every per-agent metric ({name: {key: value}})."""
    return {agent_key(name, key): value for name, keys in agent_metrics.items() for key, value in keys.items()}


def unprefixed(metrics: Mapping[str, float], name: str) -> dict[str, float]:
    """Agent `name`'s metrics of `metrics`, named below its prefix (the inverse of `prefixed`)."""
    out = {}
    for key, value in metrics.items():
        split = agent_of(key)
        if split is not None and split[0] == name:
            out[split[1]] = value
    return out


__all__ = ["AGENT_PREFIX", "AgentMetrics", "RecordedRows", "StepContext", "agent_key", "agent_of", "prefixed", "unprefixed"]
