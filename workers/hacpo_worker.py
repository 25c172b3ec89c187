"""HACPO's verl worker role: verl's engine `ActorRolloutRefWorker` trained with the HACPO loss.

Two differences from verl's worker, both by subclassing:
- the actor's loss function is the frame `methods.objective.actor_loss` around the method's
  objective (`recipe_hacpo.methods`, chosen by `algorithm.hacpo.mode`); a method without an
  objective keeps verl's own loss, so `actor.policy_loss.loss_mode` selects verl's gspo or
  vanilla (GRPO) loss as in verl;
- the inner training worker numbers the optimizer updates of a training step, so the loss
  knows m of spec §5 (stepwise clipping) for every mini-batch, across ppo epochs, and keeps a
  record per mini-batch of m, the lower bound the loss used and its own / cross row counts; it
  also sums, over every rank of each mini-batch, the fields the method's loss needs counted
  globally (`Method.global_counts`: a token-mean's or seq-mean's denominator).
The actor's and the reference's output rows beyond the tokenizer's ids are banned as verl's vLLM
engine bans them (workers/vocab_tail.py). Everything else (FSDP engine, old/ref log-probs,
checkpoints, weight sync to the rollout engine) is verl's own.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from omegaconf import DictConfig
from tensordict import TensorDict

from recipe_hacpo import batch_keys as K
from recipe_hacpo.methods import checked_settings, method_for
from recipe_hacpo.methods.objective import actor_loss
from recipe_hacpo.workers.vocab_tail import ban_vocab_tail
from verl.single_controller.base.decorator import Dispatch, register
from verl.utils import tensordict_utils as tu
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.device import get_device_id
from verl.workers.engine_workers import ActorRolloutRefWorker, TrainingWorker


class HacpoTrainingWorker(TrainingWorker):
    """verl's TrainingWorker that tags each mini-batch with its update index m.

    verl 0.9.1 calls `train_batch` once per mini-batch from `train_mini_batch`; the count is
    checked after every step, so a verl that stops doing so fails loudly instead of leaving
    m at one value (stepwise clipping would silently become fixed).
    """

    _update_index = 0
    # {non-tensor key: field}: counts the method's loss needs over every data-parallel rank of a
    # mini-batch (`Method.global_counts`), set by the outer worker once the method is known
    global_counts: dict[str, str] = {}

    def train_mini_batch(self, data: TensorDict) -> TensorDict:
        expected = _expected_updates(data, self.engine.get_data_parallel_size())
        self._update_index = 0  # m restarts with every training step
        self.update_record: list[dict] = []
        output = super().train_mini_batch(data)
        if self._update_index != expected:
            raise RuntimeError(
                f"HACPO: verl ran train_batch {self._update_index} times for {expected} mini-batches; "
                "the update index m of spec §5 relies on one call per mini-batch (verl's TrainingWorker changed)"
            )
        return output

    def train_batch(self, data: TensorDict) -> TensorDict:
        tu.assign_non_tensor(data, **{K.UPDATE_INDEX: self._update_index})
        for key, counted in self.global_counts.items():
            if counted in data.keys():
                tu.assign_non_tensor(data, **{key: self._over_ranks(data[counted].sum())})
        self._micro_records: list[dict] = []
        output = super().train_batch(data)
        self.update_record.append(self._mini_batch_record(data))
        self._update_index += 1
        return output

    def _over_ranks(self, count: torch.Tensor) -> int:
        """This rank's count summed over the data-parallel ranks."""
        count = count.to(torch.long)
        if dist.is_initialized() and self.engine.get_data_parallel_size() > 1:
            count = count.to(get_device_id())
            dist.all_reduce(count, op=dist.ReduceOp.SUM, group=self.engine.get_data_parallel_group())
        return int(count.item())

    def record_micro_batch(self, **entry) -> None:
        """Called by the HACPO loss with what one micro-batch's loss used."""
        self._micro_records.append(entry)

    def _mini_batch_record(self, data: TensorDict) -> dict:
        """m, the loss's lower bound (None under verl's own loss) and this rank's row counts; with
        the rows' ids in the batch (`batch_keys.ROW`), HACPO's ratio and clip of each row."""
        cross = data[K.IS_CROSS].bool() if K.IS_CROSS in data.keys() else None
        record = {
            "update_index": self._update_index,
            "own_rows": int((~cross).sum()) if cross is not None else int(data.batch_size[0]),
            "cross_rows": int(cross.sum()) if cross is not None else 0,
            "lower_bound": None,
        }
        if self._micro_records:
            bounds = {r["lower_bound"] for r in self._micro_records}
            steps = {r["update_index"] for r in self._micro_records}
            if len(bounds) != 1 or steps != {self._update_index}:
                raise RuntimeError(f"HACPO: micro-batches of one mini-batch used bounds {bounds} at m {steps}")
            record["lower_bound"] = bounds.pop()
            record["loss_rows"] = sum(r["own_rows"] + r["cross_rows"] for r in self._micro_records)
            per_row = [r["rows"] for r in self._micro_records if r.get("rows") is not None]
            if per_row:  # the objective's per-row record (rows in the loss: ratio, clip)
                record["rows"] = {k: [v for r in per_row for v in r[k]] for k in per_row[0]}
        return record


def _expected_updates(data: TensorDict, dp_size: int) -> int:
    """Mini-batches × epochs verl's `train_mini_batch` will run on this rank's rows."""
    rows = data.shape[0]
    mini = tu.get_non_tensor_data(data=data, key="mini_batch_size", default=None)
    num_mini = tu.get_non_tensor_data(data=data, key="num_mini_batch", default=None)
    epochs = int(tu.get_non_tensor_data(data=data, key="epochs", default=1))
    per_rank = int(mini) // dp_size if mini is not None else rows // int(num_mini)
    return rows // per_rank * epochs


class HacpoActorRolloutRefWorker(ActorRolloutRefWorker):
    """Per-agent actor/rollout(/ref) worker; its actor trains with the HACPO loss when sharing."""

    actor_worker_cls = HacpoTrainingWorker

    def __init__(self, config: DictConfig, role: str, hacpo_loss: dict | None = None, **kwargs):
        super().__init__(config, role, **kwargs)
        # None: verl's own loss (actor.policy_loss.loss_mode) stays installed (mode isolated).
        # Otherwise the driver's `loss_settings` (the method's effective ones), checked again
        self.hacpo_loss = checked_settings(hacpo_loss) if hacpo_loss is not None else None

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def init_model(self):
        super().init_model()
        # the output rows beyond the tokenizer's ids, which verl's vLLM engine never samples,
        # are banned in the actor's and the reference's scoring too (workers/vocab_tail.py)
        for worker in (self.actor, self.ref):
            if worker is not None:
                ban_vocab_tail(worker.engine.module, worker.engine.model_config.tokenizer)
        method = method_for(self.hacpo_loss.mode) if self.hacpo_loss is not None else None
        objective = method.objective if method is not None else None
        if self._is_actor and objective is not None:
            self.actor.global_counts = dict(method.global_counts)
            actor_config = omega_conf_to_dataclass(self.config.actor)
            self.loss_fn = partial(actor_loss, objective, actor_config, self.hacpo_loss, record=self.actor.record_micro_batch)
            self.actor.set_loss_fn(self.loss_fn)

    @register(dispatch_mode=Dispatch.ONE_TO_ALL)
    def hacpo_update_record(self) -> list[dict]:
        """This rank's record of the last training step, one dict per mini-batch (see above)."""
        return list(getattr(self.actor, "update_record", []))
