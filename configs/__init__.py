"""Hydra configs of the recipe (`pkg://recipe_hacpo.configs`).

Importing this package (Hydra does, to read any of its YAML files) registers the
`algorithm.hacpo` node, `hacpo_settings`, built from `recipe_hacpo.hacpo_settings`, the one
declaration of those keys and their defaults; `hacpo_base.yaml` lists it in its defaults.
"""

from hydra.core.config_store import ConfigStore

from recipe_hacpo.hacpo_settings import defaults_node
from recipe_hacpo.rollout_check import defaults_node as rollout_check_defaults

# a plain node (not the typed dataclass), so that a bad value reaches HacpoSettings.from_dict
# and fails with its one-line message instead of an OmegaConf type error
ConfigStore.instance().store(name="hacpo_settings", node=defaults_node())

# `trainer.rollout_check`: the engine/trainer log-prob check (recipe_hacpo/rollout_check.py)
ConfigStore.instance().store(name="rollout_check", node=rollout_check_defaults())
