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
    mini_batch_order(s, uid, is_cross, ...)  the update order of a learner batch with cross rows
                                         (default: whole prompt groups, own and cross rows in every
                                         mini-batch on every rank, `minibatch.mini_batch_order`)
    replay_source(s)                     a recorded agent to replay as a peer (replay.py); None: live peers
    check_settings(s)                    the rules between its mode and the other algorithm.hacpo keys
    effective(s)                         the settings its loss and advantages run with (Naive's implied ones)
    selects_complementary(s)             whether a learner trains only on GRAFT's selected peer rows (§9)
    options(s)                           its own settings: `algorithm.hacpo.method_options` typed by
                                         `options_type` (a dataclass), checked before Ray starts
    step_metrics(update_metrics)         step figures derived from the loss's summed counts
    batch_fields                         the per-row tensors its exchange adds that every learner
                                         batch keeps (`rows.concat_rows`) and the worker receives
    global_counts                        {non-tensor key: per-row/token field}: that field summed
                                         over every data-parallel rank of each mini-batch, set by
                                         the worker where the loss reads it
    objective                            the policy term of its loss (methods/objective.py's frame
                                         adds entropy and KL and runs it per micro-batch); None:
                                         verl's own loss stays installed
    shares                               whether learners see each other's rollouts
    joint_groups                         whether a learner's prompt group holds every agent's part
                                         (asynchronous: a missing part is filled, `pad_groups`)
    joint_only                           whether a learner takes only peers' rows of its own batch
                                         (asynchronous: the method compares answers to one prompt)
    implied                              settings the mode sets whatever the config says (Naive)
    takes_share_selection                whether `share_selection` switches anything for it
    replays                              whether it may replay a recorded peer (`replay_peer`)

`ctx` is the step's `StepContext` (methods/context.py): the agents, the settings, the step, the
capabilities and the few operations a method needs. A method never sees the trainer. Metrics
come back per agent, named below `agent/<name>/` (`AgentMetrics`); the trainer adds the prefix
(`context.prefixed`: every `agent/<name>/<key>` is written by `context.agent_key`, read by `agent_of`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import fields, is_dataclass, replace
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from recipe_hacpo.methods.context import AgentMetrics, StepContext

if TYPE_CHECKING:
    from verl import DataProto

    from recipe_hacpo.agent_spec import AgentSpec
    from recipe_hacpo.hacpo_settings import HacpoSettings
    from recipe_hacpo.methods.objective import Objective


class Method(ABC):
    """The contract; `exchange` and `advantages` every method defines, the rest has defaults:
    shared rollouts in groups of the learner's own, no implied settings and no use for
    share_selection or replay_peer, no extra checks, the learner's own group size, every peer as a learner when sharing, whole
    prompt groups in every mini-batch, live peers, no options, no derived step metrics, no fields
    or counts of its own, verl's loss (no objective)."""

    # step-metric groups its loss reports besides actor/ (kept under agent/<name>/<group>/...)
    metric_groups: tuple[str, ...] = ()
    objective: "Objective | None" = None
    batch_fields: tuple[str, ...] = ()
    global_counts: Mapping[str, str] = {}
    options_type: type | None = None
    shares: bool = True
    joint_groups: bool = False
    joint_only: bool = False
    implied: Mapping[str, Any] = {}
    takes_share_selection: bool = False
    replays: bool = False

    def validate(self, specs: list["AgentSpec"], settings: "HacpoSettings", gpus: dict[str, int]) -> None:
        """Raise `ConfigError` (one line naming the key and agent) for what this method cannot train.
        `gpus`: each agent's data-parallel world size."""

    def rows_per_prompt(self, specs: list["AgentSpec"], learner: "AgentSpec", settings: "HacpoSettings") -> int:
        return learner.rollout_n

    def peer_learners(self, specs: list["AgentSpec"], settings: "HacpoSettings", source: str) -> list[str]:
        if not self.shares or self.replay_source(settings) is not None:
            return []
        return [s.name for s in specs if s.name != source]

    @abstractmethod
    def exchange(self, ctx: StepContext, rollouts: dict[str, "DataProto"]) -> tuple[dict[str, "DataProto"], AgentMetrics]:
        """The learner batches ({agent name: DataProto}) from the step's scored rollouts, and metrics."""

    @abstractmethod
    def advantages(self, ctx: StepContext, batches: dict[str, "DataProto"]) -> AgentMetrics:
        """Set `advantages` and `returns` ([B, T], 0 outside the response mask) on every batch."""

    def mini_batch_order(self, settings: "HacpoSettings", uid: np.ndarray, is_cross: np.ndarray, *,
                         mini_batch_prompts: int, dp_size: int, seed: int) -> np.ndarray:
        """Permutation [B] that puts a learner batch with cross rows in update order."""
        from recipe_hacpo.methods.minibatch import mini_batch_order

        return mini_batch_order(uid, is_cross, mini_batch_prompts=mini_batch_prompts, dp_size=dp_size, seed=seed)

    def replay_source(self, settings: "HacpoSettings") -> str | None:
        return None

    def check_settings(self, settings: "HacpoSettings") -> None:
        """The rules between `mode` and the other keys (each key's own rule is `from_dict`'s): a
        key this method has no use for set away from its neutral value is refused in one line, so
        a run never silently ignores it."""
        from recipe_hacpo.hacpo_settings import NAIVE_CROSS_CLIP, PATH, USER_CROSS_CLIPS, ConfigError, key_at

        if settings.cross_clip == NAIVE_CROSS_CLIP and self.implied.get("cross_clip") != NAIVE_CROSS_CLIP:
            raise ConfigError(
                f"{key_at('cross_clip', settings.cross_clip)}: must be {', '.join(USER_CROSS_CLIPS[:-1])} or "
                f"{USER_CROSS_CLIPS[-1]} (the Naive baseline is {PATH}.mode=naive)"
            )
        if settings.share_selection != "all" and not self.takes_share_selection:
            why = "has its own selection (I_R)" if self.shares else "shares nothing"
            raise ConfigError(
                f"{key_at('share_selection', settings.share_selection)}: must be all with {PATH}.mode={settings.mode}, "
                f"which {why}; complementary selects the peer rows of mode=hacpo or naive"
            )
        if settings.replay_peer is not None and not self.replays:
            raise ConfigError(
                f"{key_at('replay_peer', settings.replay_peer)}: replays a recorded peer for mode=graft; set "
                f"{PATH}.mode=graft or replay_peer=null"
            )

    def effective(self, settings: "HacpoSettings") -> "HacpoSettings":
        """The settings the loss and the advantages run with: `settings` with what the method
        implies (`implied`, the Naive baseline's plain terms, §8) put over them."""
        return replace(settings, **self.implied) if self.implied else settings

    def selects_complementary(self, settings: "HacpoSettings") -> bool:
        """Whether a sharing learner trains only on the peer rows of GRAFT's selection (§9);
        GRAFT itself always selects by its own G1 and needs no switch."""
        return False

    def options(self, settings: "HacpoSettings") -> Any:
        """`algorithm.hacpo.method_options` as `options_type` (None when the method takes none);
        a `ConfigError` naming the key when one is unknown or of the wrong kind."""
        from recipe_hacpo.hacpo_settings import PATH, ConfigError

        raw = dict(settings.method_options)
        where = f"{PATH}.method_options"
        if self.options_type is None:
            if raw:
                raise ConfigError(f"{where}.{sorted(raw)[0]}: mode={settings.mode} takes no method options")
            return None
        assert is_dataclass(self.options_type), "options_type must be a dataclass"
        known = {f.name: f for f in fields(self.options_type)}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ConfigError(f"{where}.{unknown[0]}: not an option of mode={settings.mode} (its options: {', '.join(known)})")
        try:
            return self.options_type(**raw)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{where}: {exc}") from exc

    def step_metrics(self, update_metrics: dict[str, float]) -> dict[str, float]:
        return {}
