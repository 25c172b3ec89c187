"""One agent's verl machinery, behind the few calls the HACPO step makes.

An `AgentRuntime` owns, for one agent: its Ray resource pool, its FSDP actor(/ref) worker
group (`HacpoActorRolloutRefWorker`), its rollout servers and agent loop (vLLM on GPU, HF on
CPU — the same verl code path), and its weight-sync manager. The trainer never touches
verl's worker API directly; every DataProto ↔ TensorDict conversion lives here.
"""

from __future__ import annotations

import math
import os
import socket
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import ray
import torch
from omegaconf import DictConfig
from tensordict import TensorDict

from recipe_hacpo import batch_keys as K
from recipe_hacpo.agent_spec import AgentSpec
from recipe_hacpo.hacpo_settings import HacpoSettings
from recipe_hacpo.exchange.retokenize import eos_token_ids
from recipe_hacpo.cluster.placement import make_pool, request_for
from recipe_hacpo.methods import loss_settings
from recipe_hacpo.methods.objective import aggregation_of
from verl import DataProto
from verl.single_controller.ray import RayClassWithInitArgs, RayResourcePool, RayWorkerGroup
from verl.utils import hf_tokenizer
from verl.utils import tensordict_utils as tu
from verl.utils.config import omega_conf_to_dataclass
from verl.utils.fs import copy_to_local
from verl.utils.metric import AggregationType, Metric, reduce_metrics
from verl.workers.utils.padding import left_right_2_no_padding, no_padding_2_padding


@dataclass
class AgentRuntime:
    spec: AgentSpec
    config: DictConfig  # the full verl config of this agent (recipe_hacpo.config.agent_verl_config)
    device_name: str
    # [first, end) of the worker group's rendezvous port (placement.master_port_ranges);
    # None: any free port, verl's default
    master_port_range: list[int] | None = None
    # the workers' record of the last update (`update`): one list per rank, one dict per mini-batch
    last_update_record: list = field(default_factory=list)

    @property
    def ref_in_actor(self) -> bool:
        """A LoRA agent's reference policy is its own actor with the adapter switched off, as in
        verl's trainer (`ref_in_actor`): no second copy of the base weights."""
        model = self.config.actor_rollout_ref.model
        return int(model.get("lora_rank") or 0) > 0 or model.get("lora_adapter_path") is not None

    # ------------------------------------------------------------------ set-up
    def build(self, hacpo: HacpoSettings, shared_pool: RayResourcePool | None) -> None:
        """Start the worker group, the rollout servers and the weight-sync manager."""
        from recipe_hacpo.workers.hacpo_worker import HacpoActorRolloutRefWorker

        arr = self.config.actor_rollout_ref
        local_path = copy_to_local(arr.model.path)
        self.tokenizer = hf_tokenizer(local_path, trust_remote_code=arr.model.get("trust_remote_code", False))
        self.eos_token_ids = eos_token_ids(local_path, self.tokenizer)
        self.use_ref = bool(arr.actor.use_kl_loss)
        role = "actor_rollout_ref" if self.use_ref and not self.ref_in_actor else "actor_rollout"
        self.pool = shared_pool or make_pool(
            request_for(self.config, [self.spec], self.spec.name, self.device_name), self.config, self.device_name
        )
        worker_cls = RayClassWithInitArgs(
            cls=ray.remote(HacpoActorRolloutRefWorker),
            config=arr,
            role=role,
            # isolated mode keeps verl's own loss (gspo / vanilla per actor.policy_loss)
            hacpo_loss=loss_settings(hacpo),
        )
        self.wg = RayWorkerGroup(
            resource_pool=self.pool,
            ray_cls_with_init=worker_cls,
            name_prefix=f"hacpo_{self.spec.name}",
            device_name=self.device_name,
            master_port_range=self.master_port_range,  # touchpoint 16
        )
        self.wg.init_model()
        self._build_rollout()

    def _build_rollout(self) -> None:
        from verl.checkpoint_engine import CheckpointEngineManager
        from verl.experimental.agent_loop import AgentLoopManager
        from verl.workers.rollout.llm_server import LLMServerManager

        # rewards are computed by the trainer with each agent's own tokenizer (scoring.py)
        if self.config.actor_rollout_ref.rollout.name == "hf":
            # batches a whole single-turn rollout per server call (`rollout.agent.default_agent_loop`)
            from recipe_hacpo.workers.hf_cpu_rollout.hf_agent_loop import HFAgentLoopManager, HFLLMServerManager

            self.llm_servers = HFLLMServerManager.create(
                config=self.config, worker_group=self.wg, rollout_resource_pool=self.pool
            )
            self.agent_loop = HFAgentLoopManager.create(
                config=self.config, llm_client=self.llm_servers.get_client(), reward_loop_worker_handles=None
            )
            self.agent_loop.attach_servers(self.llm_servers)
        else:
            self.llm_servers = LLMServerManager.create(
                config=self.config, worker_group=self.wg, rollout_resource_pool=self.pool
            )
            self.agent_loop = AgentLoopManager.create(
                config=self.config, llm_client=self.llm_servers.get_client(), reward_loop_worker_handles=None
            )
        self.checkpoint_manager = CheckpointEngineManager(
            config=omega_conf_to_dataclass(self.config.actor_rollout_ref.rollout.checkpoint_engine),
            actor_wg=self.wg,
            replicas=self.llm_servers.get_replicas(),
        )
        self.checkpoint_manager.sleep_replicas()
        self._rollout_awake = False
        # the trainer step that produced the actor's current weights (0: the initial model);
        # the rollout servers carry it as `global_steps`, and seeded sampling keys on it
        self.weights_version = 0

    # ------------------------------------------------------------------ step phases
    def generate(self, prompts: DataProto, *, validate: bool = False, step: int = 0) -> DataProto:
        """Sample `rollout.n` (or `val_kwargs.n`) responses per prompt row; rows stay interleaved."""
        rollout = self.config.actor_rollout_ref.rollout
        n = rollout.val_kwargs.n if validate else rollout.n
        batch = prompts.repeat(repeat_times=n, interleave=True)
        batch.meta_info.update(
            {
                "global_steps": step,
                "validate": validate,
                "do_sample": rollout.val_kwargs.do_sample if validate else True,
                "temperature": rollout.val_kwargs.temperature if validate else rollout.temperature,
                "recompute_log_prob": False,
            }
        )
        if not self._rollout_awake:
            # a sleeping replica has dropped its weights: waking it means syncing them again
            self.sync_weights(self.weights_version)
        out = self.agent_loop.generate_sequences(batch)
        # free the rollout's memory for the phases (and agents on a shared pool) that follow
        self.checkpoint_manager.sleep_replicas()
        self._rollout_awake = False
        timing = out.meta_info.pop("timing", {})
        out.meta_info["agent_loop_timing"] = timing
        # log-probs are computed at the sampling temperature (verl reads it from meta_info)
        out.meta_info["temperature"] = batch.meta_info["temperature"]
        if "response_mask" not in out.batch.keys():
            plen = out.batch["prompts"].shape[-1]
            out.batch["response_mask"] = out.batch["attention_mask"][:, plen:].clone()
        # the prompt-side fields the agent loop does not return (uid, ground truth, ...)
        for key, value in batch.non_tensor_batch.items():
            out.non_tensor_batch.setdefault(key, value)
        # verl's per-row bookkeeping that no HACPO phase reads: dropped so that it is not
        # serialised to the workers again with every later call on these rows
        for key in _AGENT_LOOP_BOOKKEEPING:
            out.non_tensor_batch.pop(key, None)
        return out

    def old_log_prob(self, batch: DataProto) -> torch.Tensor:
        """log π^(k)_old of every response token of `batch` (this agent's tokens), [B, T]."""
        td = worker_tensordict(batch)
        tu.assign_non_tensor(td, calculate_entropy=False, compute_loss=False)
        output = self.wg.compute_log_prob(td)
        return no_padding_2_padding(tu.get(output, "log_probs"), td).float()

    def old_log_prob_of_rows(self, batch: DataProto, rows: torch.Tensor) -> torch.Tensor | None:
        """log π^(k)_old of `rows` of `batch`, [len(rows), T] (None when there are none).

        verl's engine cuts a log-prob call into equal micro-batches of
        `rollout.log_prob_micro_batch_size_per_gpu` on each of its ranks and refuses a row count
        that does not divide; the number of rows asked for changes every step (GRAFT's grafted
        rows), so the call is padded by repeating the first row, and the padding's outputs are
        discarded.
        """
        if not len(rows):
            return None
        rollout = self.config.actor_rollout_ref.rollout
        micro = 1 if rollout.get("log_prob_use_dynamic_bsz", False) else int(rollout.log_prob_micro_batch_size_per_gpu or 1)
        unit = micro * self.wg.world_size
        padded = torch.cat([rows, rows[:1].repeat((-len(rows)) % unit)])
        return self.old_log_prob(batch.select_idxs(padded))[: len(rows)]

    def ref_log_prob(self, batch: DataProto) -> torch.Tensor:
        """log π^(k)_ref of every response token, [B, T] (for actor.use_kl_loss)."""
        td = worker_tensordict(batch)
        tu.assign_non_tensor(td, calculate_entropy=False, compute_loss=False)
        if self.ref_in_actor:
            tu.assign_non_tensor(td, no_lora_adapter=True)
            output = self.wg.compute_log_prob(td)
        else:
            output = self.wg.compute_ref_log_prob(td)
        return no_padding_2_padding(tu.get(output, "log_probs"), td).float()

    def update(self, batch: DataProto, rows_per_prompt: int, order: Callable[..., np.ndarray] | None = None) -> dict[str, float]:
        """Mini-batch updates on the learner batch; returns the actor's metrics (`_step_metrics`).

        `actor.ppo_mini_batch_size` keeps verl's meaning: prompts per optimizer update, each
        with all its rows (own and, when sharing, cross), so an update holds
        ppo_mini_batch_size × rows_per_prompt rows. A batch with cross rows is first put in
        update order (`minibatch.mini_batch_order`): every mini-batch on every data-parallel
        rank holds whole prompt groups with own and cross rows. The worker's per-mini-batch record of the step
        is kept in `last_update_record` (one list per rank) and summarised as
        hacpo/updates (optimizer updates this step), hacpo/lower_bound (mean over them of the
        bound the loss used), hacpo/min_own_rows and hacpo/min_cross_rows (fewest own / cross
        rows any rank had in any mini-batch).
        `order` is the method's rule (`Method.mini_batch_order`: GRAFT puts the grafted groups'
        mini-batches last, or first, or mixed); None: `minibatch.mini_batch_order`.
        """
        from recipe_hacpo.methods.minibatch import mini_batch_order

        actor = self.config.actor_rollout_ref.actor
        mini_prompts = int(actor.ppo_mini_batch_size)
        mini_rows = mini_prompts * rows_per_prompt
        seed = int(actor.data_loader_seed)  # verl's key (its default 42); 0 is a seed like any other
        # each row's position before the update order: the loss's per-row record names rows by it
        batch.batch[K.ROW] = torch.arange(len(batch), dtype=torch.long)
        if bool(batch.batch[K.IS_CROSS].any()):
            # isolated learners keep verl's row order (prompt groups are already contiguous)
            layout = dict(mini_batch_prompts=mini_prompts, dp_size=self.dp_size, seed=seed)
            uid, cross = batch.non_tensor_batch["uid"], batch.batch[K.IS_CROSS].numpy()
            rows = (order or mini_batch_order)(uid, cross, **layout)
            batch = batch.select_idxs(torch.as_tensor(rows))
        td = worker_tensordict(batch)
        tu.assign_non_tensor(
            td,
            calculate_entropy=bool(actor.entropy_coeff != 0.0 or actor.get("calculate_entropy", False)),
            global_batch_size=mini_rows,
            mini_batch_size=mini_rows,
            epochs=int(actor.ppo_epochs),
            seed=seed,
            dataloader_kwargs={"shuffle": bool(actor.shuffle)},
            compute_loss=True,
            distillation_use_topk=False,
            distillation_only=False,
        )
        output = self.wg.update_actor(td)
        metrics = _step_metrics(tu.get(output, "metrics"))
        self.last_update_record = self.wg.hacpo_update_record()
        metrics.update(_record_metrics(self.last_update_record))
        return metrics

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks of the actor (workers / Ulysses sequence-parallel size)."""
        sp = int(self.config.actor_rollout_ref.actor.get("ulysses_sequence_parallel_size", 1) or 1)
        return max(1, self.wg.world_size // sp)

    def sync_weights(self, step: int) -> None:
        """Push the weights trained up to `step` to this agent's rollout servers."""
        self.checkpoint_manager.update_weights(step)
        self.weights_version = step
        self._rollout_awake = True

    def defer_sync(self, step: int) -> None:
        """Record that the weights trained up to `step` are the ones to serve, and leave the
        replica asleep: `generate` syncs them right before this agent's own rollout.

        On a shared pool this keeps one replica awake at a time: a replica left awake after
        the step's sync would hold its vLLM share while the next agent syncs (for a LoRA agent
        verl stages the whole merged model on the GPU then), see recipe_hacpo/cluster/planner.py."""
        if self._rollout_awake:
            self.checkpoint_manager.sleep_replicas()
            self._rollout_awake = False
        self.weights_version = step

    def worker_processes(self) -> list[str]:
        """`host:pid` of each of this agent's FSDP worker processes (rank order).

        So that an operator (or a test) can find, profile or stop the processes of one agent.
        """

        def where(_worker) -> str:
            return f"{socket.gethostname()}:{os.getpid()}"

        return ray.get([w.__ray_call__.remote(where) for w in self.wg.workers])

    # ------------------------------------------------------------------ checkpoints
    def save(self, path: str, step: int) -> None:
        self.wg.save_checkpoint(os.path.join(path, "actor"), None, step, None)

    def load(self, path: str, step: int) -> None:
        self.wg.load_checkpoint(os.path.join(path, "actor"), None, False)
        self.weights_version = step


# per-row object fields verl's engine reads (vision inputs, `extract_multi_modal_inputs`); every
# other non-tensor field (prompt and response texts, ground truth, data source, uid) is read
# only on the driver
WORKER_NON_TENSOR_FIELDS = ("multi_modal_inputs",)


def worker_tensordict(batch: DataProto) -> TensorDict:
    """`batch` as a worker call ships it: its tensors, its meta_info scalars, and of its per-row
    object fields only `WORKER_NON_TENSOR_FIELDS`, in verl's no-padding layout.

    Each object field is pickled one Python object per row with every call, and neither verl's
    engine nor the HACPO loss reads the texts; the driver's `batch` keeps them for the trainer.
    """
    kept = {k: v for k, v in batch.non_tensor_batch.items() if k in WORKER_NON_TENSOR_FIELDS}
    shipped = DataProto(batch=batch.batch, non_tensor_batch=kept, meta_info=batch.meta_info)
    return left_right_2_no_padding(shipped.to_tensordict())


def _record_metrics(record: list[list[dict]]) -> dict[str, float]:
    """Step summary of the workers' per-mini-batch records (rank-major lists of dicts)."""
    entries = [e for rank in record for e in rank]
    if not entries:
        return {}
    out = {
        "hacpo/updates": float(len(record[0])),
        "hacpo/min_own_rows": float(min(e["own_rows"] for e in entries)),
        "hacpo/min_cross_rows": float(min(e["cross_rows"] for e in entries)),
    }
    bounds = [e["lower_bound"] for e in record[0] if e["lower_bound"] is not None]
    if bounds:
        out["hacpo/lower_bound"] = float(np.mean(bounds))
    return out


# non-tensor fields verl's agent loop adds per row (turns, request priority, tool and multi-modal
# fields, weight versions); `finish_reason` and the dataset's own fields are kept
_AGENT_LOOP_BOOKKEEPING = (
    "__num_turns__",
    "priority",
    "agent_name",
    "multi_modal_inputs",
    "turn_scores",
    "tool_rewards",
    "extras",
    "global_steps",
    "min_global_steps",
    "max_global_steps",
)


def _step_metrics(metrics: dict) -> dict[str, float]:
    """One value per key from the worker's per-mini-batch metrics ({key: [one value per
    mini-batch]}, verl's `train_mini_batch` output), reduced by verl's `reduce_metrics` with the
    aggregation the loss gives that key per micro-batch (`hacpo_loss.aggregation_of`): a mean
    over the step's updates, except `*_min` / `*_max`, which stay a min / max. An infinite
    min / max is the placeholder of a mini-batch without cross rows: it is left out, and a key
    with no finite value left is not reported."""
    reducible = {}
    for key, values in metrics.items():
        metric = Metric(aggregation_of(key))
        extremum = metric.aggregation in (AggregationType.MIN, AggregationType.MAX)
        for value in values if isinstance(values, list) else [values]:
            number = _as_number(value)
            if number is not None and not (extremum and not math.isfinite(number)):
                metric.append(number)
        if metric.values:
            reducible[key] = metric
    return {key: float(value) for key, value in reduce_metrics(reducible).items()}


def _as_number(value) -> float | None:
    """A reported metric value as a float (a tensor: its mean); None for non-numeric values."""
    if isinstance(value, torch.Tensor):
        return value.float().mean().item()
    try:
        return float(value)
    except (TypeError, ValueError):
        return None
