"""The Hydra composition of a shipped config (recipe_hacpo/configs), as the CLI composes it."""

from __future__ import annotations

from typing import Iterable


def compose_config(name: str = "hacpo_cpu_demo", overrides: Iterable[str] = ()):
    """The config `name` with Hydra `overrides`, unresolved and unvalidated."""
    from hydra import compose, initialize_config_module

    with initialize_config_module("recipe_hacpo.configs", version_base=None):
        return compose(name, overrides=list(overrides))


def first_agent_only(cfg):
    """`cfg` with its agents cut to the first agent (in place; returned)."""
    from omegaconf import open_dict

    with open_dict(cfg):
        for name in list(cfg.agents)[1:]:
            del cfg.agents[name]
    return cfg
