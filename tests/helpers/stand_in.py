"""A trainer, or a method's step context, for unit tests: no Ray, no workers, no models.

    stand_in_trainer(["a", "b"])         a HacpoTrainer with specs, settings, a tracker, step 1
    stand_in_context(["a", "b"], ...)    the StepContext a method receives, over given converters

Every test that needs a trainer's step logic without its workers builds it here, so a new
attribute of the trainer is added in one place.
"""

from __future__ import annotations

import concurrent.futures as cf
from types import SimpleNamespace
from typing import Sequence

from omegaconf import OmegaConf

from recipe_hacpo.agent_spec import AgentSpec
from recipe_hacpo.hacpo_settings import HacpoSettings
from recipe_hacpo.methods import method_for
from recipe_hacpo.methods.context import StepContext


def specs_of(names: Sequence[str], rollout_n: int = 2, shared_pool: bool = False) -> list[AgentSpec]:
    return [AgentSpec(index=i, name=n, model_path="-", rollout_n=rollout_n, n_gpus_per_node=0 if shared_pool else 1, nnodes=1)
            for i, n in enumerate(names)]


def stand_in_trainer(names: Sequence[str] = (), *, specs: list | None = None, settings: HacpoSettings | None = None,
                     rollout_n: int = 2, shared_pool: bool = False, cls=None, trainer_keys: dict | None = None, **attrs):
    """A HacpoTrainer (or `cls`, a subclass) assembled without __init__: its specs (from `names`),
    `algorithm.hacpo` and its effective form, a capability tracker, step 1, a thread pool per
    agent, stand-in agents that hold only their spec; `attrs` are set on top."""
    from recipe_hacpo.methods.core_algos import CapabilityTracker
    from recipe_hacpo.training.trainer import HacpoTrainer

    t = object.__new__(cls or HacpoTrainer)
    t.specs = specs if specs is not None else specs_of(names, rollout_n, shared_pool)
    t.hacpo = settings or HacpoSettings()
    t.effective = method_for(t.hacpo.mode).effective(t.hacpo)
    t.tracker = CapabilityTracker(len(t.specs)) if t.specs else None  # a test may set only agents
    t.global_step, t.agent_timing, t._worker_processes = 1, {}, None
    # the sections a checkpoint's run identity reads (recipe_hacpo/training/run_identity.py)
    t.config = OmegaConf.create({"trainer": dict(trainer_keys or {}), "data": {},
                                 "actor_rollout_ref": {"model": {}, "actor": {}}})
    t.agents = {s.name: SimpleNamespace(spec=s) for s in t.specs}
    t._pool = cf.ThreadPoolExecutor(max(1, len(t.specs)))
    for key, value in attrs.items():
        setattr(t, key, value)
    return t


def stand_in_context(names: Sequence[str], converters: dict, *, settings: HacpoSettings | None = None, step: int = 1,
                     rollout_n: int = 2, seed: int = 42) -> StepContext:
    """The StepContext a stand-in trainer hands its method at `step` (`HacpoTrainer.step_context`):
    rows converted serially by `converters` ({(source, learner): RowConverter}), as
    `trainer.exchange_workers=0` does, every agent's `actor.data_loader_seed` `seed`, the
    capabilities before any update; it runs no forward, and replays no recorded peer."""
    t = stand_in_trainer(names, settings=settings, rollout_n=rollout_n, global_step=step, converters=converters)
    agent_config = OmegaConf.create({"actor_rollout_ref": {"actor": {"data_loader_seed": seed}}})
    t.agents = {s.name: SimpleNamespace(spec=s, config=agent_config) for s in t.specs}
    return t.step_context()
