"""One entry of the `agents:` list, typed (built and checked by `config.agent_specs`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import DictConfig, OmegaConf


@dataclass(frozen=True)
class AgentSpec:
    """One entry of `agents:`."""

    index: int
    name: str
    model_path: str
    rollout_n: int
    n_gpus_per_node: int
    nnodes: int
    overrides: dict = field(default_factory=dict)
    # a Ray node resource: the agent's pool goes only to nodes that offer it (recipe_hacpo/placement.py)
    node_resource: str | None = None

    @property
    def uses_shared_pool(self) -> bool:
        return self.n_gpus_per_node == 0

    def section(self, cfg: DictConfig, name: str) -> DictConfig:
        """`actor_rollout_ref.<name>` (actor, rollout, ref) as this agent sees it: the template
        with the agent's own overrides merged in. Kept on the spec so that the planner, which
        config.validate calls, needs nothing from this module."""
        return OmegaConf.merge(cfg.actor_rollout_ref[name], self.overrides.get(name, {}))
