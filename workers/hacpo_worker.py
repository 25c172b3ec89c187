"""HACPO's verl worker role: verl's engine `ActorRolloutRefWorker` trained with the HACPO loss.

Two differences from verl's worker, both by subclassing:
- the actor's loss function is `hacpo_actor_loss` (own GSPO rows + reweighted cross rows);
- the inner training worker numbers the optimizer updates of a training step, so the loss
  knows m of spec §5 (stepwise clipping) for every mini-batch, across ppo epochs.
Everything else (FSDP engine, old/ref log-probs, checkpoints, weight sync to the rollout
engine) is verl's own.
"""

from __future__ import annotations

from functools import partial

from omegaconf import DictConfig
from tensordict import TensorDict

from recipe_hacpo import batch_keys as K
from recipe_hacpo.workers.hacpo_loss import HacpoLossConfig, hacpo_actor_loss
from verl.single_controller.base.decorator import Dispatch, register
from verl.utils import tensordict_utils as tu
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker


class HacpoTrainingWorker(TrainingWorker):
    """verl's TrainingWorker that tags each mini-batch with its update index m."""

    _update_index = 0

    def train_mini_batch(self, data: TensorDict) -> TensorDict:
        self._update_index = 0  # m restarts with every training step
        return super().train_mini_batch(data)

    def train_batch(self, data: TensorDict) -> TensorDict:
        tu.assign_non_tensor(data, **{K.UPDATE_INDEX: self._update_index})
        output = super().train_batch(data)
        self._update_index += 1
        return output


class HacpoActorRolloutRefWorker(ActorRolloutRefWorker):
    """Per-agent actor/rollout(/ref) worker whose actor trains with the HACPO loss."""

    actor_worker_cls = HacpoTrainingWorker

    def __init__(self, config: DictConfig, role: str, hacpo_loss: dict | None = None, **kwargs):
        super().__init__(config, role, **kwargs)
        self.hacpo_loss = HacpoLossConfig(**(hacpo_loss or {}))

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        super().init_model()
        if self._is_actor:
            actor_config = omega_conf_to_dataclass(self.config.actor)
            self.loss_fn = partial(hacpo_actor_loss, actor_config, self.hacpo_loss)
            self.actor.set_loss_fn(self.loss_fn)
