"""The `hf` backend's server: one async Ray actor per replica, verl's vLLM server call surface.

It answers the calls verl's `LLMServerClient` and `RolloutReplica` make on vLLM's server
(`generate` -> `TokenOutput`, wake_up / sleep / kv-cache / abort / global-steps calls) and the
weight-sync calls of `HFServerAdapter`, and micro-batches concurrent requests onto one `HFEngine`.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import deque
from typing import Any

import torch
from recipe_hacpo.workers.hf_cpu_rollout.hf_engine import Generated, HFEngine, engine_kwargs
from recipe_hacpo.workers.hf_cpu_rollout.hf_sampling import HFRolloutUnsupported, Sampling, parse_sampling
from recipe_hacpo.workers.seeded_sampling import request_seed
from verl.utils.config import omega_conf_to_dataclass
from verl.workers.config import HFModelConfig, RolloutConfig
from verl.workers.rollout.replica import RolloutMode, TokenOutput
from verl.workers.rollout.utils import get_max_position_embeddings


@dataclasses.dataclass
class _Request:
    prompt_ids: list[int]
    sampling: Sampling  # without its seed: requests that differ only in seed share a batch
    seed: int | None
    future: asyncio.Future


class HFRolloutServer:
    """Async Ray actor serving one replica; verl's vLLM server call surface, HF underneath.

    Concurrent `generate` calls are micro-batched: requests that arrive within
    `engine_kwargs.hf.batch_wait_ms` and share a `Sampling` record decode together (left
    padded), up to `max_batch_size` (default `rollout.max_num_seqs`). The model runs in a
    worker thread so control calls stay responsive.

    With `rollout.full_determinism`, each sampled request gets a seed from `request_seed`
    (rollout seed, global step, verl's `det-<row>` request id, prompt) and is sampled from its
    own generator, so a run resumed from a checkpoint draws the same responses as the run it
    continues, however the requests happen to be batched.
    """

    def __init__(
        self,
        config: RolloutConfig,
        model_config: HFModelConfig,
        rollout_mode: RolloutMode,
        replica_rank: int,
        node_rank: int = 0,
        name: str = "",
    ):
        self.config: RolloutConfig = omega_conf_to_dataclass(config)
        self.model_config: HFModelConfig = omega_conf_to_dataclass(model_config, dataclass_type=HFModelConfig)
        if self.config.max_model_len is None:
            self.config.max_model_len = get_max_position_embeddings(self.model_config.hf_config)
        self.rollout_mode = rollout_mode
        self.replica_rank = replica_rank
        self.node_rank = node_rank
        self.name = name
        options = engine_kwargs(self.config)
        self._batch_wait_s = float(options.get("batch_wait_ms", 2.0)) / 1000.0
        self._max_batch = int(options.get("max_batch_size", self.config.max_num_seqs))
        if options.get("num_threads"):
            torch.set_num_threads(int(options["num_threads"]))

        self.engine: HFEngine | None = None
        self.global_steps: int | None = None
        # Resident state: verl's naive sync resumes "weights" then "kv_cache"; a request
        # arriving while either is released means the trainer got the phase order wrong.
        self._resident = {"weights": True, "kv_cache": True}

        self._queue: deque[_Request] = deque()
        self._work = asyncio.Event()  # queue non-empty (or being drained)
        self._idle = asyncio.Event()  # nothing queued and no batch running
        self._idle.set()
        self._no_batch = asyncio.Event()  # no batch running (queued requests may wait)
        self._no_batch.set()
        self._weights_consistent = asyncio.Event()  # cleared during a weight update
        self._weights_consistent.set()
        self._gate_open = asyncio.Event()
        self._gate_open.set()
        self._rejecting = False
        self._scheduler: asyncio.Task | None = None

    # -- lifecycle -----------------------------------------------------------------------

    async def launch_server(self) -> None:
        """Build the model (off the event loop: loading can take a while)."""
        seed = self.config.seed + self.replica_rank
        self.engine = await asyncio.to_thread(HFEngine, self.config, self.model_config, seed)
        self._scheduler = asyncio.get_running_loop().create_task(self._schedule())

    def get_server_address(self) -> str:
        return self.name

    def get_rollout_config(self):
        return self.config

    async def ready(self) -> bool:
        return self.engine is not None

    # -- generation --------------------------------------------------------------------

    async def generate(
        self,
        prompt_ids: list[int],
        sampling_params: dict[str, Any],
        request_id: str,
        image_data: list[Any] | None = None,
        video_data: list[Any] | None = None,
        audio_data: list[Any] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
        priority: int = 0,
        **kwargs,
    ) -> TokenOutput:
        if image_data or video_data or audio_data:
            raise HFRolloutUnsupported("hf rollout is text-only")
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids:
            raise ValueError("empty prompt")
        sampling = parse_sampling(sampling_params, self.config, len(prompt_ids))
        seed = sampling.seed
        if seed is None and sampling.do_sample and self.config.full_determinism:
            # the replica rank is left out on purpose: a request samples the same tokens
            # whichever replica the router sends it to
            seed = request_seed(self.config.seed, self.global_steps, request_id, prompt_ids)
        sampling = dataclasses.replace(sampling, seed=None)

        while not self._gate_open.is_set():
            if self._rejecting:
                return self._aborted()
            await self._gate_open.wait()
        released = [tag for tag, resident in self._resident.items() if not resident]
        if released:
            raise RuntimeError(
                f"{self.name}: generate() while {released} released (sleep); wake the replica or sync weights first"
            )

        future = asyncio.get_running_loop().create_future()
        self._queue.append(_Request(prompt_ids, sampling, seed, future))
        self._idle.clear()
        self._work.set()
        result: Generated | None = await future
        if result is None:
            return self._aborted()
        return TokenOutput(
            token_ids=result.token_ids,
            log_probs=result.log_probs,
            # vLLM's server says "completed" for both EOS and length; here the two are told
            # apart ("length" is what verl's own resume client reports on a spent budget), and
            # `finish_reason` rides along in extra_fields into the DataProto's non_tensor_batch.
            stop_reason="completed" if result.finished else "length",
            num_preempted=0,
            extra_fields={"global_steps": self.global_steps, "finish_reason": "stop" if result.finished else "length"},
        )

    async def generate_batch(self, requests: list[dict[str, Any]]) -> list[TokenOutput]:
        """Many `generate` calls in one Ray call (each dict: prompt_ids, sampling_params, request_id).

        The requests join the queue together and are served exactly as if they had arrived as
        separate calls at once (same seeds, same batching), without one actor call per row;
        the batched agent loop (`hf_agent_loop`) sends a whole chunk of rows this way.
        """
        return list(await asyncio.gather(*(self.generate(**request) for request in requests)))

    def _aborted(self) -> TokenOutput:
        return TokenOutput(
            token_ids=[], log_probs=None, stop_reason="aborted", extra_fields={"global_steps": self.global_steps}
        )

    async def _schedule(self) -> None:
        """Forever: wait for requests, gather a short window, run one same-`Sampling` batch."""
        while True:
            await self._work.wait()
            await asyncio.sleep(self._batch_wait_s)
            await self._weights_consistent.wait()
            if self._queue:
                await self._run_batch(self._take_batch())
            if not self._queue:
                self._work.clear()
                self._idle.set()

    async def _run_batch(self, batch: list[_Request]) -> None:
        self._no_batch.clear()
        try:
            results = await asyncio.to_thread(
                self.engine.generate, [r.prompt_ids for r in batch], batch[0].sampling, [r.seed for r in batch]
            )
        except Exception as exc:  # every waiting caller gets the error, the server lives on
            for request in batch:
                if not request.future.done():
                    request.future.set_exception(exc)
        else:
            for request, result in zip(batch, results, strict=True):
                if not request.future.done():
                    request.future.set_result(result)
        finally:
            self._no_batch.set()

    def _take_batch(self) -> list[_Request]:
        """The oldest request and every queued request with the same sampling, FIFO, capped."""
        head = self._queue[0].sampling
        batch, rest = [], deque()
        while self._queue:
            request = self._queue.popleft()
            if request.sampling == head and len(batch) < self._max_batch:
                batch.append(request)
            else:
                rest.append(request)
        self._queue = rest
        return batch

    async def wait_for_requests_to_drain(self) -> None:
        await self._idle.wait()

    # -- memory phases (CPU: bookkeeping only; nothing to free) ---------------------------

    async def wake_up(self, tags: list[str] | None = None) -> None:
        for tag in tags or list(self._resident):
            self._resident[tag] = True

    async def sleep(self) -> None:
        if not self.config.free_cache_engine:
            return
        await self._idle.wait()
        for tag in self._resident:
            self._resident[tag] = False

    async def clear_kv_cache(self) -> None:
        return None

    async def release_kv_cache(self) -> None:
        await self._idle.wait()

    async def resume_kv_cache(self) -> None:
        return None

    async def set_global_steps(self, global_steps: int) -> None:
        self.global_steps = global_steps

    # -- abort / resume (partial rollout, weight sync under async training) ---------------

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict:
        """Close the gate, fail queued requests as aborted, wait for the running batch."""
        self._gate_open.clear()
        self._rejecting = reject_request
        aborted = 0
        while self._queue:
            request = self._queue.popleft()
            if not request.future.done():
                request.future.set_result(None)
                aborted += 1
        await self._no_batch.wait()
        return {"aborted_count": aborted, "request_ids": []}

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict:
        # Requests are anonymous once queued (verl sends a fresh id per turn); nothing to match.
        return {"aborted": False, "request_id": request_id}

    async def resume_generation(self) -> None:
        self._rejecting = False
        self._gate_open.set()

    async def start_profile(self, **kwargs) -> None:
        return None

    async def stop_profile(self) -> None:
        return None

    # -- weights -----------------------------------------------------------------------

    async def begin_weight_update(self) -> None:
        # Queued requests wait (the scheduler blocks on `_weights_consistent`); only the
        # batch already running must finish before weights change under it.
        self._weights_consistent.clear()
        await self._no_batch.wait()
        self.engine.begin_weight_update()

    async def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        await asyncio.to_thread(self.engine.load_weights, named_tensors)

    async def finish_weight_update(self, global_steps: int | None = None) -> None:
        try:
            self.engine.finish_weight_update()
        finally:
            self._weights_consistent.set()
        if global_steps is not None:
            self.global_steps = global_steps

    async def parameter_checksum(self) -> float:
        return await asyncio.to_thread(self.engine.parameter_checksum)

