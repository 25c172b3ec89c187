"""verl's vLLM rollout (`rollout.name=vllm`) with every process-global name made per agent.

verl 0.9.1 derives two kinds of process-global names in its vLLM path from values that are
the same for every agent of one Ray job:

- Ray actor names of the rollout servers, `{prefix}server_{replica_rank}_{node_rank}`
  (`server_reward_` / `server_teacher_` for those roles), with `prefix = "vllm_"`. Replica
  ranks count from 0 in every worker group, so a second agent asks for `vllm_server_0_0`
  again and Ray refuses the duplicate name. Built by
  `vllm_async_server.py::vLLMReplica.launch_servers` from the hook
  `vLLMReplica._get_server_name_prefix`, and looked up by the worker-side adapter
  `vllm_rollout.py::ServerAdapter._ensure_server_handle` from
  `ServerAdapter._get_server_name_prefix`.
- The ZMQ socket that carries weights from the FSDP worker to the vLLM worker on the same
  GPU, `ipc:///tmp/rl-colocate-zmq-{job}-replica-{r}-rank-{l}.sock`. The sender builds it in
  `ServerAdapter.__init__` from `ray.get_runtime_context().get_job_id()`; the receiver
  (`utils.py::vLLMColocateWorkerExtension._get_zmq_handle`, inside vLLM's worker
  subprocess) reads `{job}` from the `VERL_RAY_JOB_ID` environment variable, which
  `vLLMHttpServer.__init__` sets in the server actor before vLLM spawns its workers. Two
  agents whose replicas share a node bind the same path: the second bind removes the
  first agent's socket file (`BucketedWeightSender` unlinks it before binding), so weights
  can reach the wrong model or the sync hangs.

Neither is reachable from config, so this module subclasses the three verl classes and
overrides only those hooks:

- `HacpoVLLMReplica`: server prefix `vllm_{agent}_`; launches `HacpoVLLMHttpServer`.
- `HacpoVLLMHttpServer`: after verl's `__init__`, re-exports `VERL_RAY_JOB_ID` as the
  per-agent tag `{job}-{agent}` (vLLM's worker subprocesses are spawned later, in
  `launch_server`, and inherit it).
- `HacpoVLLMServerAdapter`: looks servers up under `vllm_{agent}_` and sends on the socket
  named with the same `{job}-{agent}` tag.

Three more behaviours, not about names (touchpoint 17 in `verl_touchpoints.py`):

- Per-row sampling seeds (GPU and CPU). Under `rollout.full_determinism` verl's server gives
  every request the same seed (`replica_rank + rollout.seed`), so the G samples of a prompt
  are identical, every group has zero reward variance and every group advantage is 0.
  `HacpoVLLMHttpServer.generate` gives each request the seed the `hf` backend uses
  (`seeded_sampling.request_seed`: rollout seed, weights version, verl's `det-<row>` request
  id, prompt), unless the caller passed one: G distinct samples, and a resumed run draws what
  the uninterrupted one drew.
- CPU weight reload (CPU only). vLLM's CPU linear layers repack their weights for oneDNN after
  loading and leave an empty `weight` parameter, so verl's `model.load_weights` fails on the
  first sync. `HacpoVLLMWorkerExtension` (the vLLM worker extension this server names) loads
  each sync through vLLM's layer-wise reload, which restores the layer, loads, and repacks.
  CUDA keeps the parameters, and there verl's own path runs unchanged. After the reload every
  embedding and output layer is re-processed (`repack_vocab_layers`): the reload never reaches a
  tied output layer that is a module of its own (Llama's), whose CPU copy would otherwise stay the
  one packed at engine start.
- CPU engine settings (CPU only). vLLM refuses sleep mode on CPU, and its CPU generators
  cannot resume a seeded request whose prefill was split into chunks; on CPU the server turns
  sleep mode and cache freeing off, and chunked prefill off when requests are seeded. Every
  engine would also bind its OpenMP threads to core 0: the binding defaults to `nobind` there.

The agent is `rollout.custom.agent_name` (set per agent by
`recipe_hacpo/config.py::agent_verl_config`). Without it every name is verl's own
(`vllm_server_...`, `rl-colocate-zmq-{job}-...`), so a single-agent run is unchanged.

Everything that imports vLLM (or verl's vLLM modules) is built on first access of one of
the class attributes below (module `__getattr__`), so the naming functions, and the
registration in `verl_touchpoints.register_hacpo_vllm_rollout`, work on machines without
vLLM.

The classes are registered under verl's own name `vllm` (`verl_touchpoints.register_hacpo_vllm_rollout`),
so every check verl makes on `rollout.name == "vllm"` (pipeline-parallel guard, PD
disaggregation, `delta_sharded` weight sync, request priority, the LoRA-rank check) applies
as in verl. Limit: PD disaggregation builds verl's `vLLMPDReplica` directly, without
per-agent names, so it works for one agent per Ray job only.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
from typing import Any

from recipe_hacpo.workers.rollout_naming import agent_name_of
from recipe_hacpo.workers.seeded_sampling import request_seed

BACKEND_NAME = "vllm"
VERL_SERVER_PREFIX = "vllm_"
JOB_ID_ENV = "VERL_RAY_JOB_ID"

# Unix socket paths are limited to 107 bytes (sun_path). verl's path without the agent part
# is about 50 bytes for an 8-hex Ray job id and small ranks, so the agent part is capped.
UNIX_SOCKET_PATH_MAX = 107
_AGENT_TAG_MAX = 32
_UNSAFE_PATH_CHARS = re.compile(r"[^A-Za-z0-9_.-]")

# ---------------------------------------------------------------------------------------
# naming: pure functions of the rollout config
# ---------------------------------------------------------------------------------------


def server_name_prefix(config: Any) -> str:
    """Ray actor-name prefix of this rollout's vLLM servers: `vllm_` or `vllm_<agent>_`."""
    agent = agent_name_of(config)
    return f"{VERL_SERVER_PREFIX}{agent}_" if agent else VERL_SERVER_PREFIX


def server_actor_name(
    config: Any,
    replica_rank: int,
    node_rank: int = 0,
    role: str = "",
    name_suffix: str = "",
) -> str:
    """Full server actor name as verl's `vLLMReplica.launch_servers` composes it.

    `role` is "" for the policy, "reward_" / "teacher_" for those models; `name_suffix`
    is the replica's already-formatted suffix ("" or "_<suffix>").
    """
    return f"{server_name_prefix(config)}server_{role}{replica_rank}_{node_rank}{name_suffix}"


def agent_path_tag(agent: str) -> str:
    """`agent` as a short, filename-safe token; distinct agents give distinct tokens.

    Names that are already safe and short are kept as they are (readable socket paths);
    anything else is shortened and suffixed with a digest of the original name.
    """
    safe = _UNSAFE_PATH_CHARS.sub("_", agent)
    if safe == agent and len(agent) <= _AGENT_TAG_MAX:
        return agent
    digest = hashlib.sha1(agent.encode("utf-8")).hexdigest()[:8]
    return f"{safe[: _AGENT_TAG_MAX - len(digest) - 1]}_{digest}"


def zmq_job_tag(job_id: str, config: Any) -> str:
    """The `{job}` part of the weight-transfer socket: the Ray job id, plus the agent if any."""
    agent = agent_name_of(config)
    return f"{job_id}-{agent_path_tag(agent)}" if agent else str(job_id)


def zmq_handle(job_tag: str, replica_rank: int, local_rank: int) -> str:
    """Weight-transfer socket address, in the format both verl sides use."""
    return f"ipc:///tmp/rl-colocate-zmq-{job_tag}-replica-{replica_rank}-rank-{local_rank}.sock"


def _current_job_id() -> str:
    import ray

    return ray.get_runtime_context().get_job_id()


# ---------------------------------------------------------------------------------------
# verl subclasses, built on first use (they import vLLM)
# ---------------------------------------------------------------------------------------

_SERVER_CLASS_NAMES = ("HacpoVLLMHttpServer", "HacpoVLLMReplica", "HacpoVLLMServerAdapter")
_EXTENSION_CLASS_NAMES = ("HacpoVLLMWorkerExtension",)
WORKER_EXTENSION_FQN = f"{__name__}.HacpoVLLMWorkerExtension"
# vLLM's CPU worker binds OpenMP threads to cores from this variable; its default gives every
# engine core 0, so two agents' engines would share one core
CPU_THREAD_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def per_row_sampling(sampling_params: dict, config: Any, global_steps: int | None, request_id: str,
                     prompt_ids: list[int]) -> dict:
    """`sampling_params` with the request's own seed under `rollout.full_determinism`.

    A seed the caller set is kept; without full determinism nothing is added (vLLM then draws
    from its own unseeded generators, as verl intends).
    """
    if not config.full_determinism or sampling_params.get("seed") is not None:
        return sampling_params
    ids = [int(t) for t in prompt_ids]
    return {**sampling_params, "seed": request_seed(config.seed, global_steps, request_id, ids)}


def cpu_engine_settings(config: Any) -> dict[str, bool]:
    """The rollout keys the server overrides on a CPU platform, with the values it sets."""
    settings = {"enable_sleep_mode": False, "free_cache_engine": False}
    if config.full_determinism:
        settings["enable_chunked_prefill"] = False
    return settings


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _build_server_classes() -> dict[str, type]:
    import ray
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica
    from verl.workers.rollout.vllm_rollout.vllm_rollout import ServerAdapter

    class HacpoVLLMHttpServer(vLLMHttpServer):
        """verl's vLLM server actor: per-agent weight socket, per-row seeds, CPU settings."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            # verl set VERL_RAY_JOB_ID to the bare job id; vLLM's worker processes, spawned by
            # launch_server, inherit this process's environment and build the socket from it.
            os.environ[JOB_ID_ENV] = zmq_job_tag(_current_job_id(), self.config)
            if _on_cpu():
                from recipe_hacpo.workers.vllm_cpu import set_cpu_engine_env

                os.environ.setdefault(CPU_THREAD_BIND_ENV, "nobind")
                set_cpu_engine_env()

        def _init_config(self, config):
            config = super()._init_config(config)
            if _on_cpu():
                # verl's config dataclasses are frozen: a copy with the CPU settings
                config = dataclasses.replace(config, **cpu_engine_settings(config))
            return config

        def _get_worker_extension_cls(self) -> str:
            return WORKER_EXTENSION_FQN

        async def generate(self, prompt_ids, sampling_params, request_id, *args, **kwargs):
            sampling_params = per_row_sampling(sampling_params, self.config, self.global_steps, request_id, prompt_ids)
            return await super().generate(prompt_ids, sampling_params, request_id, *args, **kwargs)

    class HacpoVLLMReplica(vLLMReplica):
        """verl's vLLM replica with per-agent server actor names."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.server_class = ray.remote(HacpoVLLMHttpServer)

        def _get_server_name_prefix(self) -> str:
            return server_name_prefix(self.config)

    class HacpoVLLMServerAdapter(ServerAdapter):
        """verl's worker-side vLLM adapter, pointed at this agent's servers and socket."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            # same node-local rank verl uses for its own handle
            local_rank = self.rollout_rank % int(os.environ["RAY_LOCAL_WORLD_SIZE"])
            self.zmq_handle = zmq_handle(zmq_job_tag(_current_job_id(), self.config), self.replica_rank, local_rank)

        def _get_server_name_prefix(self) -> str:
            # verl's default is f"{rollout.name}_" = "vllm_", shared by every agent
            return server_name_prefix(self.config)

    classes = {
        "HacpoVLLMHttpServer": HacpoVLLMHttpServer,
        "HacpoVLLMReplica": HacpoVLLMReplica,
        "HacpoVLLMServerAdapter": HacpoVLLMServerAdapter,
    }
    return _importable(classes)


def _build_extension_classes() -> dict[str, type]:
    # Built apart from the server classes: vLLM's worker process resolves the extension by
    # name and needs none of verl's server modules.
    import torch
    from verl.workers.rollout.vllm_rollout.bucketed_weight_transfer import BucketedWeightReceiver
    from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension

    class HacpoVLLMWorkerExtension(vLLMColocateWorkerExtension):
        """verl's vLLM worker extension; on CPU each weight sync is a layer-wise reload."""

        def update_weights_from_ipc(self, peft_config: dict = None, base_sync_done=False, use_shm: bool = False):
            if peft_config or not _on_cpu():
                return super().update_weights_from_ipc(peft_config, base_sync_done, use_shm)
            from vllm.model_executor.model_loader.reload import (
                finalize_layerwise_reload,
                initialize_layerwise_reload,
            )

            if self.device is None:
                self.device = torch.device("cpu")
            models = list(self._iter_all_models_with_config())
            for model, _ in models:
                initialize_layerwise_reload(model)

            def on_bucket_received(weights, is_last):
                # a layer may span two buckets and the reload keeps a layer's tensors until the
                # layer is complete, while the receiver reuses its bucket buffer: copy them out
                weights = [(name, tensor.clone()) for name, tensor in weights]
                self._update_weights(weights, peft_config=None, base_sync_done=base_sync_done)

            receiver = BucketedWeightReceiver(zmq_handle=self._get_zmq_handle(), device=self.device, use_shm=use_shm)
            receiver.receive_weights(on_bucket_received=on_bucket_received)
            for model, model_config in models:
                finalize_layerwise_reload(model, model_config)
                repack_vocab_layers(model)

        def monkey_patch_model(self, vocab_size: int, banned_token_ids=None):
            # called once in every worker when the server starts, before the first request
            super().monkey_patch_model(vocab_size, banned_token_ids)
            if _on_cpu():
                accurate_cpu_logprobs()

    return _importable({"HacpoVLLMWorkerExtension": HacpoVLLMWorkerExtension})


def accurate_cpu_logprobs() -> bool:
    """Make vLLM's sampler report log-probs as `logits - logsumexp(logits)`, as verl's actor does.

    On CPU, torch's float32 `log_softmax` / `softmax` kernel loses the mass of the many tiny
    probabilities of a large, peaked vocabulary: their terms fall below the rounding step of
    running sums already near 1. Every log-prob of that position comes out too high by the same
    amount. For a warm-started tiny Qwen3 (151,936 rows) that is 2.0e-4 at the position before
    the answer; verl's actor on CPU (`logprobs_from_logits_v2`: gather - `torch.logsumexp`,
    whose sum is accurate) is within 1e-6 of float64. The engine/trainer check then sees the
    engine's rounding, not a policy mismatch.

    Raw log-probs (also prompt log-probs) are computed as `logits - logsumexp`; processed
    log-probs, which vLLM's top-k/top-p sampler computes inline with `log_softmax`, are
    renormalised with an accurate logsumexp (the kernel's error is one constant per row, to
    within rounding). Sampling is untouched (the same error scales every probability of a row
    alike). Idempotent; returns whether it patched now. Installed on CPU only.
    """
    import torch
    from vllm.v1.sample.sampler import Sampler

    if getattr(Sampler, "_hacpo_accurate_logprobs", False):
        return False
    sample = Sampler.sample

    def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
        logits = logits.to(torch.float32)
        return logits - torch.logsumexp(logits, dim=-1, keepdim=True)

    def accurate_sample(self, logits, sampling_metadata, logprobs_mode_override=None):
        sampled, processed = sample(self, logits, sampling_metadata, logprobs_mode_override)
        if processed is not None and (logprobs_mode_override or self.logprobs_mode) == "processed_logprobs":
            processed = processed - torch.logsumexp(processed, dim=-1, keepdim=True)
        return sampled, processed

    Sampler.compute_logprobs = staticmethod(compute_logprobs)
    Sampler.sample = accurate_sample
    Sampler._hacpo_accurate_logprobs = True
    return True


def repack_vocab_layers(model) -> int:
    """Rebuild the CPU copies of every embedding and output layer from its current weight.

    vLLM's CPU backend computes an output layer's logits from a copy of its weight packed when
    weights are processed, not from the parameter. A tied output layer that is a module of its
    own (Llama, Gemma, GPT-2: `ParallelLMHead.tie_weights` shares the embedding's parameter)
    receives no tensor of its own in a layer-wise reload, so the reload never re-processes it
    and the engine goes on sampling from the copy made at start-up (random under
    `load_format=dummy`). Re-processing each vocabulary layer after the reload rebuilds that
    copy from the weight the sync just wrote; for every other layer it repeats what the reload
    did. Returns how many layers were repacked.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )

    repacked = 0
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        weight = getattr(module, "weight", None)
        # a quantized method's processing need not be idempotent; only plain weights are repacked
        if not isinstance(module, VocabParallelEmbedding) or not isinstance(method, UnquantizedEmbeddingMethod):
            continue
        if weight is None:
            continue
        if weight.is_meta or weight.numel() == 0:
            continue
        method.process_weights_after_loading(module)
        repacked += 1
    return repacked


def _importable(classes: dict[str, type]) -> dict[str, type]:
    for name, cls in classes.items():
        # importable as recipe_hacpo.workers.vllm_rollout.<name>: Ray, cloudpickle and vLLM
        # find the class by reference, and `_ROLLOUT_REGISTRY` resolves it with getattr
        cls.__module__ = __name__
        cls.__qualname__ = name
    return classes


def __getattr__(name: str):
    for names, build in ((_SERVER_CLASS_NAMES, _build_server_classes), (_EXTENSION_CLASS_NAMES, _build_extension_classes)):
        if name in names:
            globals().update(build())
            return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
