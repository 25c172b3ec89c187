"""The names of the agents a config composes to, one per line, in agent order.

    python -m recipe_hacpo.agent_names --config-name pair_qwen3-4b-base_qwen3-8b-base [overrides ...]

For batch scripts that place the agents (run_scripts/slurm/hacpo.slurm splits a Slurm allocation
between however many agents the preset and the command line give): the same composition as
`python -m recipe_hacpo.main`, without Ray, model paths or data. A bad `agents` is one line on
stderr and exit status 2.
"""

from __future__ import annotations

import os
import sys
from typing import Sequence

from recipe_hacpo.agent_spec import AGENTS_FORM, refuse_list_form


def agent_names(config_name: str, overrides: Sequence[str]) -> list[str]:
    """The keys of the composed `agents` map (config.agent_specs checks the entries themselves).

    verl's configs are read from their folder (file://) rather than as the package the presets
    name (pkg://), which Hydra would import, and verl with it (torch, Ray): 2 s instead of 6."""
    import importlib.util

    from hydra import compose, initialize_config_module
    from omegaconf import DictConfig

    verl_dir = list(importlib.util.find_spec("verl").submodule_search_locations)[0]
    searchpath = f"hydra.searchpath=[file://{os.path.join(verl_dir, 'trainer', 'config')}]"
    with initialize_config_module("recipe_hacpo.configs", version_base=None):
        cfg = compose(config_name, overrides=[searchpath, *overrides])
    agents = cfg.get("agents")
    if not isinstance(agents, DictConfig) or len(agents) == 0:
        raise ValueError(f"agents: {'empty' if agents is not None and len(agents) == 0 else 'not a map'}; {AGENTS_FORM}")
    return [str(name) for name in agents]


def main(argv: Sequence[str]) -> int:
    from hydra.errors import HydraException

    args = list(argv)
    config_name = "hacpo_trainer"
    if "--config-name" in args:
        at = args.index("--config-name")
        config_name = args[at + 1]
        del args[at:at + 2]
    try:
        refused = refuse_list_form(args)
        if refused:
            raise ValueError(refused)
        names = agent_names(config_name, args)
    except (ValueError, HydraException) as exc:
        print(f"error: {str(exc).strip().splitlines()[0]}", file=sys.stderr)
        return 2
    print("\n".join(names))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
