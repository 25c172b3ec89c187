"""A batched single-turn agent loop for the `hf` backend.

verl's agent loop handles a batch one row at a time: per row it instantiates an agent-loop
object through Hydra (which builds a chat-template token builder), tokenizes in a thread
pool, asks the load balancer for a server, makes one Ray call to the server, and pads the
result with the tokenizer. On CPU, with responses of a few tokens, that per-row machinery
costs far more than the model's decoding.

`HFBatchedAgentLoopWorker` does the same single-turn rollout for a whole chunk at once:
each distinct prompt is rendered once, every row goes to the server in one `generate_batch`
call, and the padded tensors are built for the whole batch. Rows keep verl's request ids
(`det-<row>` under `rollout.full_determinism`), so the server draws the same seeded samples
as through verl's per-row loop; the output DataProto has the same fields and values.

Selected with `actor_rollout_ref.rollout.agent.default_agent_loop=hf_batched_single_turn`.
Batches it cannot serve (multi-modal prompts, other agent loops, streaming reward or
distillation, rollout tracing, per-row `__do_sample__` overrides) go through verl's per-row
path unchanged; under that name the per-row loop is verl's `single_turn_agent`.

What this relies on in verl 0.9.1 (`verl/experimental/agent_loop/agent_loop.py`):
`AgentLoopManager.__init__` keeps a subclass's `agent_loop_workers_class`; the attributes
`AgentLoopWorker.__init__` sets (rollout_config, tokenizer, processor, hf_model_type,
reward_loop_worker_handles, distillation_enabled, config); the sampling dict and the
DataProto layout of `AgentLoopWorker.generate_sequences` / `_agent_loop_postprocess` /
`_postprocess`, and `SingleTurnAgentLoop.run`. `tests/test_hf_agent_loop.py` compares the two
paths field by field, so an upgrade that changes any of these fails there.

The batched path sends to the hf servers directly, so verl's request router
(`GlobalRequestLoadBalancer`, one Ray actor per agent: a process that imports verl) would sit
idle. `HFLLMServerManager` starts none; a worker starts one the first time a batch needs verl's
per-row loop (`_route_per_row_requests`). For the same reason the agent-loop workers run in
the driver's process (`HFAgentLoopManager._init_agent_loop_workers`): a worker of the batched
path only renders prompts, waits on its servers and pads tensors, and a Ray actor of its own
costs a process that imports verl, per agent and run. A run with rollout tracing keeps verl's
worker actors (the trace settings are per process). Touchpoint 23 in `workers/verl_touchpoints.py`.
"""

from __future__ import annotations

import asyncio
import json
import time
import types
from uuid import uuid4

import numpy as np
import ray
import torch
from tensordict import TensorDict
from verl.experimental.agent_loop.agent_loop import AgentLoopManager, AgentLoopWorker, register
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop
from verl.protocol import DataProto
from verl.utils.model import compute_position_id_with_mask
from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder
from verl.workers.rollout.llm_server import LLMServerClient, LLMServerManager
from verl.workers.rollout.router import get_router_handle

BATCHED_AGENT_LOOP = "hf_batched_single_turn"

# keys verl's per-row path always puts in non_tensor_batch, whether or not a row set them
_DEFAULT_EXTRA_KEYS = ("turn_scores", "tool_rewards", "min_global_steps", "max_global_steps", "extras")


@register(BATCHED_AGENT_LOOP)
class HFBatchedSingleTurnAgentLoop(SingleTurnAgentLoop):
    """The per-row loop under the batched name: verl's single-turn loop, for batches that fall back."""


class HFBatchedAgentLoopWorker(AgentLoopWorker):
    """verl's agent-loop worker with a batched path for single-turn, text-only rollouts."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._servers: list[ray.actor.ActorHandle] = []
        self._route_over: dict[str, ray.actor.ActorHandle] | None = None
        self._builder = None
        self._prompt_cache: dict[str, list[int]] = {}

    def set_servers(self, handles: list[ray.actor.ActorHandle],
                    route_over: dict[str, ray.actor.ActorHandle] | None = None) -> None:
        """The hf servers this worker sends batches to (its chunk is split evenly over them).
        `route_over` ({address: handle}): the client this worker was built with has no router,
        and verl's per-row loop gets one over these servers the first time it runs."""
        self._servers = list(handles)
        self._route_over = dict(route_over) if route_over is not None else None

    def _route_per_row_requests(self) -> None:
        """Give verl's per-row loop, which reads `self.llm_client` per row, a client with a router."""
        if self._route_over is None:
            return
        router = get_router_handle(servers=self._route_over,
                                   full_determinism=bool(getattr(self.rollout_config, "full_determinism", False)))
        client = LLMServerClient(config=self.config, load_balancer_handle=router)
        if hasattr(self.llm_client, "tokenizer"):  # set by verl for `trace.token2text`
            client.tokenizer = self.llm_client.tokenizer
        self.llm_client, self._route_over = client, None

    def _batchable(self, batch: DataProto) -> bool:
        names = batch.non_tensor_batch.get("agent_name")
        if names is None:
            names = [self.rollout_config.agent.default_agent_loop]
        trace = self.rollout_config.trace
        return (
            bool(self._servers)
            and all(name == BATCHED_AGENT_LOOP for name in names)
            and "raw_prompt" in batch.non_tensor_batch
            and "__do_sample__" not in batch.non_tensor_batch
            and self.processor is None
            and self.reward_loop_worker_handles is None
            and not self.distillation_enabled
            and not trace.get("backend")
        )

    async def generate_sequences(self, batch: DataProto) -> DataProto:
        if not self._batchable(batch):
            self._route_per_row_requests()
            return await super().generate_sequences(batch)
        config = self.rollout_config
        validate = batch.meta_info.get("validate", False)
        # the sampling dict verl's per-row path sends (AgentLoopWorker.generate_sequences)
        sampling_params = dict(
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=config.top_k,
            repetition_penalty=1.0,
            logprobs=config.calculate_log_probs,
        )
        if validate:
            sampling_params.update(
                top_p=config.val_kwargs.top_p, top_k=config.val_kwargs.top_k, temperature=config.val_kwargs.temperature
            )
        n = len(batch)
        raw_prompts = batch.non_tensor_batch["raw_prompt"]
        priorities = batch.non_tensor_batch.get("priority", np.arange(n))
        prompt_ids = [self._prompt_ids(raw_prompts[i]) for i in range(n)]
        deterministic = bool(getattr(config, "full_determinism", False))
        request_ids = [f"det-{int(p)}" if deterministic else uuid4().hex for p in priorities]

        start = time.perf_counter()
        outputs = await self._generate(prompt_ids, request_ids, sampling_params)
        elapsed = time.perf_counter() - start
        return self._to_dataproto(batch, prompt_ids, outputs, elapsed)

    def _prompt_ids(self, messages) -> list[int]:
        """The chat-templated prompt of one row, as verl's single-turn loop renders it (cached per prompt)."""
        messages = list(messages)
        key = json.dumps(messages, sort_keys=True, default=str)
        ids = self._prompt_cache.get(key)
        if ids is None:
            if self._builder is None:
                self._builder = create_continuous_token_builder(
                    self.tokenizer,
                    hf_model_type=self.hf_model_type,
                    chat_template_kwargs=self.config.data.get("apply_chat_template_kwargs", {}),
                    mm_processor_kwargs=self.config.data.get("mm_processor_kwargs", {}),
                    processor=self.processor,
                )
            ids = list(self._builder.build_initial_tokens(messages, mm_inputs_out={}))
            # verl left-truncates a text prompt longer than rollout.prompt_length
            ids = ids[-self.rollout_config.prompt_length :]
            self._prompt_cache[key] = ids
        return ids

    async def _generate(self, prompt_ids, request_ids, sampling_params) -> list:
        """One `generate_batch` call per server, on contiguous slices of the rows."""
        k = len(self._servers)
        bounds = np.linspace(0, len(prompt_ids), k + 1).astype(int)
        calls = []
        for server, lo, hi in zip(self._servers, bounds[:-1], bounds[1:]):
            if hi > lo:
                requests = [
                    dict(prompt_ids=prompt_ids[i], sampling_params=dict(sampling_params), request_id=request_ids[i])
                    for i in range(lo, hi)
                ]
                calls.append(server.generate_batch.remote(requests))
        return [out for part in await asyncio.gather(*calls) for out in part]

    def _to_dataproto(self, batch: DataProto, prompt_ids, outputs, elapsed: float) -> DataProto:
        """The DataProto verl's per-row path builds (`_agent_loop_postprocess` + `_postprocess`)."""
        config = self.rollout_config
        plen, rlen = config.prompt_length, config.response_length
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        n = len(outputs)
        prompts = torch.full((n, plen), pad, dtype=torch.long)
        prompt_mask = torch.zeros((n, plen), dtype=torch.long)
        responses = torch.full((n, rlen), pad, dtype=torch.long)
        response_attn = torch.zeros((n, rlen), dtype=torch.long)
        response_mask = torch.zeros((n, rlen), dtype=torch.long)
        with_logprobs = bool(outputs[0].log_probs)
        logprobs = torch.zeros((n, rlen), dtype=torch.float32) if with_logprobs else None
        extra_rows = []
        for i, (ids, out) in enumerate(zip(prompt_ids, outputs, strict=True)):
            merged = self._builder.merge_assistant_tokens(ids, out.token_ids)
            mask, lps = self._builder.align_response_metadata(
                merged, [], [] if out.log_probs else None, assistant_logprobs=out.log_probs or None
            )
            resp = merged.token_ids[-len(mask) :] if mask else []
            prompt = merged.token_ids[: len(merged.token_ids) - len(mask)]
            resp, mask = resp[:rlen], mask[:rlen]
            prompts[i, plen - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            prompt_mask[i, plen - len(prompt) :] = 1
            if resp:
                responses[i, : len(resp)] = torch.tensor(resp, dtype=torch.long)
                response_attn[i, : len(resp)] = 1
                response_mask[i, : len(mask)] = torch.tensor(mask, dtype=torch.long)
            if logprobs is not None and lps:
                lps = lps[:rlen]
                logprobs[i, : len(lps)] = torch.tensor(lps, dtype=torch.float32)
            extra = dict(out.extra_fields)
            # what LLMServerClient.generate, the single-turn loop and the postprocess add per row
            extra.setdefault("min_global_steps", extra.get("global_steps"))
            extra.setdefault("max_global_steps", extra.get("global_steps"))
            extra.update(turn_scores=[], tool_rewards=[], raw_prompt=batch.non_tensor_batch["raw_prompt"][i])
            extra_rows.append(extra)

        attention_mask = torch.cat([prompt_mask, response_attn], dim=1)
        tensors = {
            "prompts": prompts,
            "responses": responses,
            "response_mask": response_mask * response_attn,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": compute_position_id_with_mask(attention_mask),
        }
        if logprobs is not None:
            tensors["rollout_log_probs"] = logprobs
        non_tensor = {"__num_turns__": np.full(n, 2, dtype=np.int32), **batch.non_tensor_batch}
        # verl keeps a (here empty) multi-modal inputs dict per row even for text prompts
        non_tensor["multi_modal_inputs"] = np.empty(n, dtype=object)
        non_tensor["multi_modal_inputs"][:] = [{} for _ in range(n)]
        for key in set(_DEFAULT_EXTRA_KEYS).union(*(e.keys() for e in extra_rows)):
            column = np.empty(n, dtype=object)
            column[:] = [e.get(key) for e in extra_rows]
            non_tensor[key] = column
        metrics = [
            {
                "generate_sequences": elapsed,
                "tool_calls": 0.0,
                "compute_score": 0.0,
                "num_preempted": out.num_preempted if out.num_preempted is not None else -1,
            }
            for out in outputs
        ]
        return DataProto(
            batch=TensorDict(tensors, batch_size=n), non_tensor_batch=non_tensor, meta_info={"metrics": metrics}
        )


class HFLLMServerManager(LLMServerManager):
    """verl's server manager for the hf backend, without a request router until one is needed."""

    async def _init_global_load_balancer(self) -> None:
        # the clients it hands out hold no router; `HFBatchedAgentLoopWorker._route_per_row_requests`
        # starts one over `routed_servers()` if a batch falls back to verl's per-row loop
        self.global_load_balancer = None

    def routed_servers(self) -> dict[str, ray.actor.ActorHandle]:
        """{address: handle}: what verl's manager would give its router."""
        return dict(zip(self.server_addresses, self.server_handles, strict=True))


class InProcessWorker:
    """An agent-loop worker in this process, called as `AgentLoopManager.generate_sequences`
    calls its workers' actor handles: `worker.generate_sequences.remote(chunk)`, awaited."""

    def __init__(self, worker: HFBatchedAgentLoopWorker):
        self.worker = worker
        self.generate_sequences = types.SimpleNamespace(remote=worker.generate_sequences)


class HFAgentLoopManager(AgentLoopManager):
    """verl's agent-loop manager with `HFBatchedAgentLoopWorker` workers, in the driver's process."""

    agent_loop_workers_class = ray.remote(HFBatchedAgentLoopWorker)

    async def _init_agent_loop_workers(self):
        if (self.rollout_config.get("trace") or {}).get("backend"):
            return await super()._init_agent_loop_workers()
        self.agent_loop_workers = [
            InProcessWorker(HFBatchedAgentLoopWorker(self.config, self.llm_client, self.teacher_client,
                                                     self.reward_loop_worker_handles))
            for _ in range(self.rollout_config.agent.num_workers)
        ]

    def attach_servers(self, servers: HFLLMServerManager) -> None:
        """Give every worker the hf server actors (call once, after `create`)."""
        handles = [s for replica in servers.get_replicas() for s in replica.servers]
        route_over = servers.routed_servers()
        remote = []
        for worker in self.agent_loop_workers:
            if isinstance(worker, InProcessWorker):
                worker.worker.set_servers(handles, route_over)
            else:
                remote.append(worker.set_servers.remote(handles, route_over))
        if remote:
            ray.get(remote)
