"""Ray actor names of rollout servers, shared by the CPU (`hf`) and GPU (`hacpo_vllm`) backends.

Several agents may run in one Ray job, each with its own replicas; verl names servers
`{prefix}server_{replica}_{node}` with replica ranks counted from 0 in every worker group, so
two agents would both ask for the same name. The agent's name, from
`rollout.custom.agent_name`, goes into the prefix.
"""

from __future__ import annotations

from typing import Any


def agent_name_of(config: Any) -> str | None:
    """The agent this rollout belongs to, from `rollout.custom.agent_name` (None: single agent)."""
    custom = getattr(config, "custom", None)
    if custom is None and hasattr(config, "get"):
        custom = config.get("custom", None)
    if not custom:
        return None
    name = custom.get("agent_name", None)
    return str(name) if name not in (None, "") else None



def server_name_prefix(config: Any, backend: str) -> str:
    """Ray actor-name prefix of this rollout's servers: `<backend>_` or `<backend>_<agent>_`."""
    agent = agent_name_of(config)
    return f"{backend}_{agent}_" if agent else f"{backend}_"
