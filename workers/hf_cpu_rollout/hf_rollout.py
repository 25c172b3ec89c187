"""`hf` rollout backend: Hugging Face `generate` behind verl's server-mode rollout interface.

verl 0.9.1 only generates through rollout servers (vLLM / SGLang / TensorRT-LLM) driven by
the agent loop. This backend plugs into the same three extension points so that the trainer,
agent loop, reward streaming and weight sync run unchanged and only `rollout.name` differs:

- `HFRolloutServer`: one async Ray actor per replica that owns an HF causal LM and answers
  the calls verl's `LLMServerClient` and `RolloutReplica` make on vLLM's server
  (`generate` -> `TokenOutput`, wake_up / sleep / kv-cache / abort / global-steps calls);
- `HFReplica`: the `RolloutReplica` that launches those actors;
- `HFServerAdapter`: the worker-side `BaseRollout` that the FSDP actor worker uses to
  release / resume the server and to push its weights after each update
  (`checkpoint_engine.backend=naive`).

Several agents may run in one Ray job, each with its own replicas; server actors are named
per agent from `rollout.custom.agent_name` (see `server_name_prefix`).

The backend's other modules, one job each: `hf_sampling` (the sampling dict -> `Sampling`),
`seeded_sampling` (per-row seeds under `full_determinism`), `hf_engine` (the HF model:
batched generate, weight loading), `hf_server` (the server actor: request batching, abort
gates, memory phases), `hf_agent_loop` (verl's agent loop, batched for single-turn rollouts),
`rollout_naming` (server actor names, shared with the GPU backend).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

import ray
import torch
from recipe_hacpo.workers import rollout_naming
from recipe_hacpo.workers.hf_cpu_rollout.hf_engine import BACKEND_NAME
from recipe_hacpo.workers.hf_cpu_rollout.hf_sampling import HFRolloutUnsupported
from recipe_hacpo.workers.hf_cpu_rollout.hf_server import HFRolloutServer
from verl.workers.config import HFModelConfig, RolloutConfig
from verl.workers.rollout.base import BaseRollout
from verl.workers.rollout.replica import RolloutReplica
from verl.workers.rollout.utils import ensure_async_iterator

logger = logging.getLogger(__name__)
logger.setLevel(os.getenv("VERL_LOGGING_LEVEL", "WARN"))


def server_name_prefix(config: RolloutConfig | Any) -> str:
    """Ray actor-name prefix of this rollout's servers: `hf_` or `hf_<agent>_` (see `rollout_naming`)."""
    return rollout_naming.server_name_prefix(config, BACKEND_NAME)


def server_actor_name(
    config: RolloutConfig | Any,
    replica_rank: int,
    node_rank: int = 0,
    role: str = "",
    name_suffix: str = "",
) -> str:
    """Full actor name; `role` is "" for the policy, "reward_" / "teacher_" for those models."""
    return f"{server_name_prefix(config)}server_{role}{replica_rank}_{node_rank}{name_suffix}"



# ---------------------------------------------------------------------------------------
# the replica (driver side)
# ---------------------------------------------------------------------------------------


class HFReplica(RolloutReplica):
    """Launches one `HFRolloutServer` per replica, next to the replica's first worker."""

    async def launch_servers(self) -> None:
        if self.nnodes != 1:
            raise HFRolloutUnsupported("an hf replica runs in one process; keep tp*dp*pp within one node")
        if not self.workers:
            raise RuntimeError("hf replica has no workers to colocate with")
        node_id = await self.workers[0].__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())

        if self.is_reward_model:
            role = "reward_"
        elif self.is_teacher_model:
            role = "teacher_"
        else:
            role = ""
        name = server_actor_name(self.config, self.replica_rank, 0, role, self.name_suffix)
        server = (
            ray.remote(HFRolloutServer)
            .options(
                name=name,
                scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                    node_id=node_id, soft=False
                ),
                max_concurrency=self.max_concurrency,
            )
            .remote(
                config=self.config,
                model_config=self.model_config,
                rollout_mode=self.rollout_mode,
                replica_rank=self.replica_rank,
                node_rank=0,
                name=name,
            )
        )
        await server.launch_server.remote()
        self.servers = [server]
        self._server_handle = server
        # The load balancer keys servers by address; an hf server has no HTTP endpoint, so
        # its unique actor name stands in for one.
        self._server_address = name

    async def sleep(self) -> None:
        await asyncio.gather(*[s.wait_for_requests_to_drain.remote() for s in self.servers])
        await asyncio.gather(*[s.sleep.remote() for s in self.servers])


# ---------------------------------------------------------------------------------------
# the worker-side adapter (inside each FSDP actor rank)
# ---------------------------------------------------------------------------------------


class HFServerAdapter(BaseRollout):
    """`BaseRollout` in the actor worker: controls this rank's server and pushes weights.

    Ranks map to replicas as in vLLM's adapter (`rank // (tp*dp*pp)`); the replica's rank 0
    is its leader and the only one that talks to the server. Every rank still iterates the
    weight generator because the FSDP engine all-gathers each tensor collectively.
    """

    def __init__(self, config: RolloutConfig, model_config: HFModelConfig, device_mesh=None, replica_rank: int = -1):
        super().__init__(config, model_config, device_mesh)
        rollout_world_size = (
            self.config.tensor_model_parallel_size
            * self.config.data_parallel_size
            * self.config.pipeline_model_parallel_size
        )
        rank = int(os.environ.get("RANK", "0"))
        self.replica_rank = rank // rollout_world_size if replica_rank == -1 else replica_rank
        self.rollout_rank = rank % rollout_world_size
        self.server_handle: ray.actor.ActorHandle | None = None
        self._bucket_bytes = max(1, int(self.config.checkpoint_engine.update_weights_bucket_megabytes)) << 20

    @property
    def is_leader_rank(self) -> bool:
        return self.rollout_rank == 0

    def _server(self) -> ray.actor.ActorHandle | None:
        # Resolved lazily: the trainer builds worker groups before it launches the servers.
        if not self.is_leader_rank:
            return None
        if self.server_handle is None:
            self.server_handle = ray.get_actor(server_actor_name(self.config, self.replica_rank))
        return self.server_handle

    async def resume(self, tags: list[str]):
        if self.config.free_cache_engine and self._server() is not None:
            await self.server_handle.wake_up.remote(tags=tags)

    async def release(self):
        if self.config.free_cache_engine and self._server() is not None:
            await self.server_handle.sleep.remote()

    @torch.no_grad()
    async def update_weights(
        self,
        weights,
        global_steps: int | None = None,
        wire_format: str = "named_tensors",
        peft_config=None,
        **kwargs,
    ):
        if wire_format != "named_tensors":
            raise HFRolloutUnsupported(f"hf rollout takes full tensors only; got wire_format={wire_format!r}")
        if peft_config is not None:
            raise HFRolloutUnsupported(
                "hf rollout has no LoRA adapter path; set actor_rollout_ref.model.lora.merge=True"
            )
        server = self._server()
        start = time.time()
        if server is not None:
            await server.begin_weight_update.remote()
        bucket, size = [], 0
        async for name, tensor in ensure_async_iterator(weights):
            if server is None:
                continue  # non-leader: take part in the collective gather, ship nothing
            bucket.append((name, tensor.detach().cpu()))
            size += tensor.numel() * tensor.element_size()
            if size >= self._bucket_bytes:
                await server.load_weights.remote(bucket)
                bucket, size = [], 0
        if server is not None:
            if bucket:
                await server.load_weights.remote(bucket)
            await server.finish_weight_update.remote(global_steps)
            logger.info("hf update_weights replica %d: %.2fs", self.replica_rank, time.time() - start)

    def generate_sequences(self, prompts):
        raise HFRolloutUnsupported("hf rollout generates through its server (agent loop), not in the worker")
