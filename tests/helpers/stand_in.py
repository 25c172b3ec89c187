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

import torch
from omegaconf import OmegaConf

from recipe_hacpo.agent_spec import AgentSpec
from recipe_hacpo.hacpo_settings import HacpoSettings
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
    t.effective = t.hacpo.effective()
    t.tracker = CapabilityTracker(len(t.specs)) if t.specs else None  # a test may set only agents
    t.global_step, t.agent_timing, t._worker_processes = 1, {}, None
    t.config = OmegaConf.create({"trainer": dict(trainer_keys or {}), "data": {}})
    t.agents = {s.name: SimpleNamespace(spec=s) for s in t.specs}
    t._pool = cf.ThreadPoolExecutor(max(1, len(t.specs)))
    for key, value in attrs.items():
        setattr(t, key, value)
    return t


def stand_in_context(names: Sequence[str], converters: dict, *, settings: HacpoSettings | None = None, step: int = 1,
                     rollout_n: int = 2, seed: int = 42, capabilities: torch.Tensor | None = None) -> StepContext:
    """The StepContext of one step over `converters` ({(source, learner): RowConverter}),
    converting serially as `trainer.exchange_workers=0` does; no old log-probs, no recorded peer."""
    settings = settings or HacpoSettings()
    specs = specs_of(names, rollout_n)

    def convert(source, learner, batch, rows=None):
        return converters[(source, learner)].convert(batch if rows is None else batch.select_idxs(rows))

    def no_forward(requests, phase):
        raise AssertionError(f"a stand-in context runs no forward ({phase})")

    return StepContext(
        specs=tuple(specs), settings=settings, effective=settings.effective(), step=step,
        capabilities=capabilities if capabilities is not None else torch.full((len(specs),), 0.5),
        seed_of=lambda name: seed, convert=convert, old_log_probs_of_rows=no_forward,
    )
