"""One entry of the `agents:` map, typed (built and checked by `config.agent_specs`), and the form
of that map."""

from __future__ import annotations

from dataclasses import dataclass, field

from omegaconf import DictConfig, OmegaConf


AGENTS_FORM = ("agents are keyed by name: +agents.<name>={model_path: ..., rollout_n: 8} adds one, ~agents.<name> "
               "drops one, agents.<name>.rollout_n=16 changes one, '~agents' '+agents={a: {...}, b: {...}}' replaces them all")


def refuse_list_form(argv: list[str]) -> str | None:
    """The one-line error for a command line in the old list form of `agents` (`agents=[...]`,
    `agents.0.model_path=...`), which Hydra would refuse with a merge error of its own."""
    import re

    for arg in argv:
        if re.match(r"^[+~]*agents(=\s*\[|\.\d+(\.|=|$))", arg):
            return f"{arg}: {AGENTS_FORM}"
    return None


@dataclass(frozen=True)
class AgentSpec:
    """One entry of `agents:` (its key is `name`)."""

    index: int
    name: str
    model_path: str
    rollout_n: int
    n_gpus_per_node: int
    nnodes: int
    overrides: dict = field(default_factory=dict)
    # a Ray node resource: the agent's pool goes only to nodes that offer it (recipe_hacpo/cluster/placement.py)
    node_resource: str | None = None

    @property
    def uses_shared_pool(self) -> bool:
        return self.n_gpus_per_node == 0

    def section(self, cfg: DictConfig, name: str) -> DictConfig:
        """`actor_rollout_ref.<name>` (actor, rollout, ref) as this agent sees it: the template
        with the agent's own overrides merged in. Kept on the spec so that the planner, which
        config.validate calls, needs nothing from this module."""
        return OmegaConf.merge(cfg.actor_rollout_ref[name], self.overrides.get(name, {}))
