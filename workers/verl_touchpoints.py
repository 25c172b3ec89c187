"""The one place recipe_hacpo reaches into verl internals or version-specific behaviour.

Pinned to verl 0.9.1. Each entry names the verl file it relies on, so an upgrade is a matter
of re-reading those files. Everything else in the package uses verl's public extension
points (registries, config fields, subclassing).

Touchpoints (private or unversioned contracts):

1. `verl/workers/rollout/base.py::_ROLLOUT_REGISTRY` - private dict {(name, mode): "module.Class"}
   read by `get_rollout_class` when `ActorRolloutRefWorker.init_model`
   (`verl/workers/engine_workers.py`) and `CheckpointEngineWorker`
   (`verl/checkpoint_engine/base.py`) build the worker-side rollout adapter. There is no
   public register function in 0.9.1, so the hf adapter is entered here.
2. Adapter call contract used by `ActorRolloutRefWorker.update_weights`
   (`verl/workers/engine_workers.py`, naive checkpoint backend): the adapter is built as
   `cls(config=, model_config=, device_mesh=)` (plus `replica_rank=` from
   `CheckpointEngineWorker`), and called as `resume(tags=["weights"|"kv_cache"])`,
   `update_weights(per_tensor_param, peft_config=, base_sync_done=, global_steps=)`;
   `release()` is abstract in `BaseRollout` but not called by verl 0.9.1. Ranks are read from the `RANK` env var set by verl's `Worker`.
3. Server call surface expected from a rollout server actor by
   `verl/workers/rollout/llm_server.py::LLMServerClient.generate` (`generate(request_id=,
   prompt_ids=, sampling_params=, image_data=, video_data=, ...) -> TokenOutput`) and by
   `verl/workers/rollout/replica.py::RolloutReplica` (wake_up, sleep, clear_kv_cache,
   release_kv_cache, resume_kv_cache, abort_all_requests, resume_generation, start_profile,
   stop_profile); sampling dict keys as built in
   `verl/experimental/agent_loop/agent_loop.py::AgentLoopWorker.generate_sequences`.
4. Ray actor naming `{prefix}server_{replica_rank}_{node_rank}` shared by a replica and its
   adapter (`verl/workers/rollout/vllm_rollout/{vllm_async_server,vllm_rollout}.py` use the
   same scheme). Replica ranks restart at 0 per worker group, hence the per-agent prefix
   in `hf_rollout.server_name_prefix`.

5. `verl/utils/distributed.py::initialize_global_process_group_ray` builds the backend string
   `f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}"`. With the CPU platform that is
   "cpu:gloo,cpu:gloo", which torch (>= 2.x, `distributed_c10d.BackendConfig`) rejects as a
   duplicate device. `install_backend_string_dedup` wraps `torch.distributed.init_process_group`
   so that repeated *identical* `device:backend` pairs collapse to one; any other string is
   passed through untouched. Installed only when the CPU platform is registered. A trainer
   that owns its worker class can avoid it by calling
   `torch.distributed.init_process_group("cpu:gloo", ...)` before verl's worker `__init__`
   (verl skips initialisation when a default group exists).
Numbers 6 and 7 are retired (a diagnostic read of `RolloutReplicaRegistry._registry` and a
per-agent `RewardLoopManager`, neither used: the trainer scores rewards itself, `scoring.py`);
the other numbers stay as they are cited elsewhere.
8. vLLM naming hooks (`rollout.name=vllm`, registered over verl's own entries; `workers/vllm_rollout.py`):
   `verl/workers/rollout/vllm_rollout/vllm_async_server.py::vLLMReplica._get_server_name_prefix`
   (read by `launch_servers`) and `vLLMReplica.server_class` (set in `__init__`);
   `vLLMHttpServer.__init__` exporting `VERL_RAY_JOB_ID`, which
   `verl/workers/rollout/vllm_rollout/utils.py::vLLMColocateWorkerExtension._get_zmq_handle`
   reads in vLLM's worker subprocess; `verl/workers/rollout/vllm_rollout/vllm_rollout.py::
   ServerAdapter._get_server_name_prefix`, `.zmq_handle` (built in `__init__` from the Ray
   job id) and `.rollout_rank` / `.replica_rank`. The socket format
   `ipc:///tmp/rl-colocate-zmq-{job}-replica-{r}-rank-{l}.sock` is duplicated in
   `vllm_rollout.zmq_handle`. verl compares `rollout.name` with the literal "vllm" in
   `verl/workers/config/rollout.py`, `verl/checkpoint_engine/base.py`,
   `verl/workers/rollout/llm_server.py` and `verl/utils/config.py`: keeping the name "vllm"
   keeps those checks. PD disaggregation (`get_rollout_replica_class(..., disaggregation_enabled=True)`
   in `verl/workers/rollout/replica.py`) bypasses the registry and gets verl's
   `vLLMPDReplica`, without per-agent names.

9. `verl/single_controller/ray/base.py::RayResourcePool.get_placement_groups` waits on
   `pg.ready()` forever. `TimedResourcePool` overrides it with the same groups (one per node,
   bundles {CPU: max_colocate_count, <ray_resource_name>: 1}, STRICT_PACK, names
   `{name_prefix}verl_group_{counts}:{i}`), reading the pool's `_store`, `max_colocate_count`,
   `use_gpu`, `accelerator_type`, `detached` and `pgs`, waits with a timeout, and sorts them
   with verl's `sort_placement_group_by_node_ip`. Its own `extra_resources` (an agent's
   `node_resource`) are added to every bundle.

17. vLLM server behaviour (`workers/vllm_rollout.py`; numbered after the table below; contract test
   `tests/test_vllm_tier.py::test_the_verl_and_vllm_hooks_the_server_relies_on`, in .venv-vllm):
   - per-row seeds, GPU and CPU: `vLLMHttpServer.generate(prompt_ids, sampling_params, request_id,
     ...)` sets `sampling_params.setdefault("seed", replica_rank + config.seed)` under
     `full_determinism`, so a seed already in `sampling_params` is kept; `global_steps` is the
     weights version the adapter sets (`set_global_steps`);
   - CPU settings: `vLLMHttpServer._init_config(config)` returns the frozen `RolloutConfig`
     dataclass every later read uses (`enable_sleep_mode`, `free_cache_engine`,
     `enable_chunked_prefill` in `launch_server` / `sleep`);
   - CPU weight reload: `vLLMHttpServer._get_worker_extension_cls()` names the class vLLM mixes
     into its worker; `verl/workers/rollout/vllm_rollout/utils.py::vLLMColocateWorkerExtension`
     with `update_weights_from_ipc(peft_config, base_sync_done, use_shm)`, `_update_weights`,
     `_get_zmq_handle`, `_iter_all_models_with_config`, `device`; `bucketed_weight_transfer.py::
     BucketedWeightReceiver(zmq_handle=, device=, use_shm=).receive_weights(on_bucket_received=)`;
     vLLM 0.24.0's `vllm/model_executor/model_loader/reload` (`initialize_layerwise_reload(model)`,
     `finalize_layerwise_reload(model, model_config)`) and `vllm.platforms.current_platform.is_cpu()`;
   - vLLM 0.24.0's CPU attention head sizes (`vllm/v1/attention/backends/cpu_attn.py::
     CPUAttentionBackend.get_supported_head_sizes`), copied in `workers/vllm_cpu.py`;
   - CPU log-probs (`accurate_cpu_logprobs`, installed from the extension's override of
     `vLLMColocateWorkerExtension.monkey_patch_model(vocab_size, banned_token_ids)`): vLLM
     0.24.0's `vllm/v1/sample/sampler.py::Sampler`, its static `compute_logprobs(logits)` and
     `sample(logits, sampling_metadata, logprobs_mode_override)`, which reads `self.logprobs_mode`.

Couplings that live outside this module, because they are the subclass or the data they
concern (each with a contract test in tests/test_verl_touchpoints.py):

| # | where | relies on (verl 0.9.1) |
|---|-------|------------------------|
| 10 | `workers/hacpo_worker.py::HacpoTrainingWorker` | `verl/workers/engine_workers.py::TrainingWorker.train_mini_batch` calls `self.train_batch(data)` once per mini-batch (the update index m of stepwise clipping); checked at run time as well |
| 11 | `recipe_hacpo/methods/hacpo.py::hacpo_policy_term` (in the frame `recipe_hacpo/methods/objective.py::actor_loss`) | micro-batch non-tensor keys `dp_size`, `batch_num_tokens` (set in `verl/workers/engine/fsdp/transformer_impl.py::FSDPEngine.forward_backward_batch`) and `global_batch_size`, read as verl's own `verl/workers/utils/losses.py::ppo_loss` reads them |
| 11 | `recipe_hacpo/training/agent_runtime.py` (update_actor) | the non-tensor keys of a training batch (`calculate_entropy`, `global_batch_size`, `mini_batch_size`, `epochs`, `seed`, `dataloader_kwargs`, `compute_loss`, `distillation_*`) as `verl/trainer/ppo/ray_trainer.py` sets them |
| 12 | `recipe_hacpo/evaluation/checkpoints.py`, `recipe_hacpo/cluster/reliability.py::saved_world_size` | `verl/utils/checkpoint/fsdp_checkpoint_manager.py::FSDPCheckpointManager.save_checkpoint` layout: `model_world_size_{W}_rank_{R}.pt` (and `fsdp_config.json`'s `world_size`) and `huggingface/`; the names live here (`FSDP_SHARD_GLOB`, `FSDP_SHARD_RE`, `fsdp_shard_name`, `CHECKPOINT_HF_SUBDIR`) |
| 13 | `workers/hf_cpu_rollout/hf_rollout.py::HFReplica.launch_servers` | `verl/workers/rollout/replica.py::RolloutReplica.server_handle` / `server_address` return the private `_server_handle` / `_server_address`, which a replica subclass must set (verl's own replicas do the same) |
| 14 | `recipe_hacpo/exchange/retokenize.py` | the batch layout `verl/experimental/agent_loop/agent_loop.py::AgentLoopWorker._postprocess` produces (documented there) |
| 15 | `recipe_hacpo/training/agent_runtime.py::_step_metrics` | `verl/workers/engine_workers.py::TrainingWorker.train_mini_batch` returns `metrics` as {key: [one value per mini-batch]}, a list of per-rank `Metric`s reduced per mini-batch by `Metric.aggregate_dp` (min / max over every rank's micro-batch values; mean / sum: the rank mean per micro-batch, then the aggregation over micro-batches); `verl/utils/metric/utils.py::reduce_metrics` reduces a `Metric` by its own aggregation, whatever its key says |
| 16 | `recipe_hacpo/training/agent_runtime.py::AgentRuntime.build` | `verl/single_controller/ray/base.py::RayWorkerGroup` takes a `master_port_range` keyword and hands it to `get_master_addr_port`, which binds the first free port of [first, end) and fails past it; the agents' slices come from `recipe_hacpo/cluster/placement.py::master_port_ranges` |
| 18 | `recipe_hacpo/training/agent_runtime.py::AgentRuntime.ref_log_prob`, `workers/hf_cpu_rollout/hf_rollout.py` | LoRA agents: `verl/workers/engine_workers.py::TrainingWorker.infer_batch` pops the non-tensor key `no_lora_adapter` and runs under `engine.disable_adapter()` (the reference policy of a LoRA actor, as verl's trainer computes it with `ref_in_actor`); `ActorRolloutRefWorker.update_weights` sends full merged weights with `peft_config=None` when `model.lora.merge` is true, the only LoRA sync the hf rollout accepts |
| 19 | `workers/hacpo_worker.py::HacpoTrainingWorker._over_ranks` | a method's global counts (`Method.global_counts`, e.g. SGT's imitated tokens) of a mini-batch are summed over `engine.get_data_parallel_group()` when `engine.get_data_parallel_size() > 1` (`verl/workers/engine/base.py::BaseEngine`, implemented by `verl/workers/engine/fsdp/transformer_impl.py::FSDPEngine`), as verl's engine sums its own `batch_num_tokens` |
| 20 | `workers/hacpo_worker.py::HacpoActorRolloutRefWorker.init_model`, `workers/vocab_tail.py` | the output rows beyond `len(tokenizer)`: `verl/workers/rollout/vllm_rollout/utils.py::monkey_patch_compute_logits` bans them in the engine (vLLM servers call it with `len(model_config.tokenizer)`); the actor's and the reference's `TrainingWorker.engine` hold the HF model as `engine.module` and the tokenizer as `engine.model_config.tokenizer` (`verl/workers/engine/fsdp/transformer_impl.py::FSDPEngine`), whose output layer the recipe bans alike |
| 21 | `recipe_hacpo/rollout_check.py::agent_precision` | a LoRA actor with `model.lora.merge=true` reaches its rollout engine in bfloat16: `verl/workers/engine/fsdp/transformer_impl.py::FSDPEngine._merged_lora_per_tensor_param` casts every merged tensor `.to(torch.bfloat16)`, so the engine/trainer check judges such an agent by its bf16 limits |
| 22 | `recipe_hacpo/preflight.py::_bucket_transfer_module` | `verl/workers/rollout/vllm_rollout/bucketed_weight_transfer.py` (`BucketedWeightSender`, `BucketedWeightReceiver`), the weight sync of `rollout.name=vllm`, loaded by file path (its package's `__init__` needs vLLM) for the preflight's weight-bucket phase |
| 23 | `workers/hf_cpu_rollout/hf_agent_loop.py::HFLLMServerManager`, `HFBatchedAgentLoopWorker._route_per_row_requests`, `HFAgentLoopManager._init_agent_loop_workers` | the hf backend runs its agent-loop workers in the driver: `verl/experimental/agent_loop/agent_loop.py::AgentLoopManager.create` calls `_init_agent_loop_workers()`, which fills `agent_loop_workers`, and `AgentLoopManager.generate_sequences` only calls `worker.generate_sequences.remote(chunk)` on them and awaits the results together; the hf backend starts no request router: `verl/workers/rollout/llm_server.py::LLMServerManager.create` runs `_initialize_llm_servers()` (which sets `server_handles` and `server_addresses`) and then `_init_global_load_balancer()`, which the subclass overrides to leave `global_load_balancer` None, and `get_client()` hands that to `LLMServerClient(config, load_balancer_handle=)`; a batch that falls back to verl's per-row loop gets a client over `verl/workers/rollout/router.py::get_router_handle(servers=, full_determinism=)`, read per row as `server_manager=self.llm_client` in `verl/experimental/agent_loop/agent_loop.py::AgentLoopWorker._run_agent_loop` |

Public registrations done from here as well, to keep all of verl's registries in one file:
`verl/workers/rollout/replica.py::RolloutReplicaRegistry.register` (public classmethod) and
`verl/workers/engine/base.py::EngineRegistry.register`: verl registers its FSDP engines
(`verl/workers/engine/fsdp/transformer_impl.py::FSDPEngineWithLMHead`, `FSDPEngineWithValueHead`)
for devices "cuda" and "npu" only; `register_cpu_engines` adds "cpu" for the same classes.
"""

from __future__ import annotations

import functools
import re

# Touchpoint 12: verl's FSDP checkpoint layout, read by `recipe_hacpo.evaluation.checkpoints`.
CHECKPOINT_HF_SUBDIR = "huggingface"
FSDP_SHARD_GLOB = "model_world_size_*_rank_*.pt"
FSDP_SHARD_RE = re.compile(r"model_world_size_(\d+)_rank_(\d+)\.pt$")


def fsdp_shard_name(world_size: int, rank: int) -> str:
    """File name of one rank's model shard, as `FSDPCheckpointManager.save_checkpoint` writes it."""
    return f"model_world_size_{world_size}_rank_{rank}.pt"


HF_BACKEND = "hf"
HF_ADAPTER_FQN = "recipe_hacpo.workers.hf_cpu_rollout.hf_rollout.HFServerAdapter"


def _load_hf_replica():
    # Deferred: the replica module imports ray / transformers pieces that `import verl`
    # should not pay for in every process.
    from recipe_hacpo.workers.hf_cpu_rollout.hf_rollout import HFReplica

    return HFReplica


def register_hf_rollout() -> None:
    """Make `actor_rollout_ref.rollout.name=hf` resolvable on both sides of verl's rollout."""
    from verl.workers.rollout import base as rollout_base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    RolloutReplicaRegistry.register(HF_BACKEND, _load_hf_replica)
    # Touchpoint 1 (private): no public registration API for adapters in verl 0.9.1.
    rollout_base._ROLLOUT_REGISTRY[(HF_BACKEND, "async")] = HF_ADAPTER_FQN


VLLM_BACKEND = "vllm"
VLLM_ADAPTER_FQN = "recipe_hacpo.workers.vllm_rollout.HacpoVLLMServerAdapter"


def _load_vllm_replica():
    # Deferred: resolving the class imports vLLM and verl's vLLM modules, which only exist
    # where `rollout.name=vllm` is actually used (GPU machines).
    from recipe_hacpo.workers.vllm_rollout import HacpoVLLMReplica

    return HacpoVLLMReplica


def register_hacpo_vllm_rollout() -> None:
    """Resolve verl's own rollout name `vllm` to verl's vLLM classes with per-agent names.

    Touchpoints 1 and 8. The name stays "vllm", so every check verl makes on
    `rollout.name == "vllm"` still applies; with no `rollout.custom.agent_name` the
    subclasses name everything exactly as verl does. Registration imports nothing from
    vLLM: the replica is a loader and the adapter a dotted path, both resolved only when a
    rollout of that name is built. `RolloutReplicaRegistry.register` replaces verl's loader
    (a plain dict assignment in 0.9.1).
    """
    from verl.workers.rollout import base as rollout_base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    RolloutReplicaRegistry.register(VLLM_BACKEND, _load_vllm_replica)
    rollout_base._ROLLOUT_REGISTRY[(VLLM_BACKEND, "async")] = VLLM_ADAPTER_FQN


def dedupe_backend_string(backend):
    """Collapse repeated identical `device:backend` pairs ("cpu:gloo,cpu:gloo" -> "cpu:gloo").

    Anything else (a plain backend name, conflicting pairs, non-strings) is returned as is,
    so torch still reports genuinely invalid strings.
    """
    if not isinstance(backend, str) or ":" not in backend or "," not in backend:
        return backend
    pairs: dict[str, str] = {}
    for item in backend.split(","):
        device, sep, name = item.partition(":")
        if not sep:
            return backend
        if pairs.setdefault(device, name) != name:
            return backend
    return ",".join(f"{device}:{name}" for device, name in pairs.items())


def install_backend_string_dedup() -> None:
    """Touchpoint 5: wrap `torch.distributed.init_process_group` once per process."""
    import torch.distributed as dist

    original = dist.init_process_group
    if getattr(original, "_hacpo_dedupe_backend", False):
        return

    @functools.wraps(original)
    def init_process_group(*args, **kwargs):
        if "backend" in kwargs:
            kwargs["backend"] = dedupe_backend_string(kwargs["backend"])
        elif args:
            args = (dedupe_backend_string(args[0]), *args[1:])
        return original(*args, **kwargs)

    init_process_group._hacpo_dedupe_backend = True
    dist.init_process_group = init_process_group


def register_cpu_engines() -> None:
    """Let `EngineRegistry` resolve fsdp/fsdp2 engines when the platform's device is "cpu".

    Imports verl's engine package (heavy), so it runs only when the CPU platform is active.
    """
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead, FSDPEngineWithValueHead

    for model_type, engine_cls in (("language_model", FSDPEngineWithLMHead), ("value_model", FSDPEngineWithValueHead)):
        # verl asserts on a second registration of a key; register only what this process lacks
        # (an explicit check: an `assert` would vanish under `python -O`)
        registered = EngineRegistry._engines.get(model_type, {})
        missing = [b for b in ("fsdp", "fsdp2") if "cpu" not in registered.get(b, {})]
        if missing:
            EngineRegistry.register(model_type=model_type, backend=missing, device="cpu")(engine_cls)


def _timed_resource_pool_cls():
    """Build `TimedResourcePool` on first use (touchpoint 9)."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group
    from verl.plugin.platform import get_platform
    from verl.single_controller.ray.base import RayResourcePool, sort_placement_group_by_node_ip

    class TimedResourcePool(RayResourcePool):
        """verl's RayResourcePool whose placement gives up after `timeout_s` (touchpoint 9).

        verl's `get_placement_groups` waits on `pg.ready()` with no timeout, so a request the
        cluster cannot meet hangs the run. The groups here are the ones verl builds — one per
        node, one bundle {CPU: max_colocate_count, <device>: 1} per GPU, STRICT_PACK — and are
        returned sorted by node IP as verl stores them.
        """

        def __init__(self, *args, timeout_s: float, owner: str, extra_resources: dict | None = None, **kwargs):
            super().__init__(*args, **kwargs)
            self.timeout_s = timeout_s
            self.owner = owner
            # added to every bundle: the custom node resource that pins a pool to its nodes
            self.extra_resources = dict(extra_resources or {})

        def get_placement_groups(self, strategy="STRICT_PACK", name=None, device_name="cuda"):
            if self.pgs is not None:
                return self.pgs
            prefix = name or f"{self.name_prefix}verl_group_{'_'.join(str(c) for c in self._store)}:"
            bundle = {"CPU": self.max_colocate_count}
            if self.use_gpu:
                bundle[get_platform().ray_resource_name()] = 1
                if self.accelerator_type is not None:
                    bundle[self.accelerator_type] = 1e-4
            bundle.update(self.extra_resources)
            pgs = [
                placement_group(
                    bundles=[dict(bundle) for _ in range(count)], strategy=strategy, name=f"{prefix}{i}",
                    lifetime="detached" if self.detached else None,
                )
                for i, count in enumerate(self._store)
            ]
            ready, _ = ray.wait([pg.ready() for pg in pgs], num_returns=len(pgs), timeout=self.timeout_s)
            if len(ready) < len(pgs):
                for pg in pgs:
                    remove_placement_group(pg)
                raise RuntimeError(
                    f"{self.owner}: {len(pgs) - len(ready)} of {len(pgs)} placement group(s) of "
                    f"{'+'.join(map(str, self._store))} bundles {bundle} not placed after {self.timeout_s:g} s "
                    f"(available: {ray.available_resources()}); free the resources or lower the request "
                    "(trainer.placement_timeout_s sets the wait)"
                )
            self.pgs = sort_placement_group_by_node_ip(pgs)
            return self.pgs

    return TimedResourcePool


_LAZY = {"TimedResourcePool": _timed_resource_pool_cls}
_BUILT: dict = {}


def __getattr__(name: str):
    # Lazy module attribute: importing this module (done by the plugin on `import verl`)
    # must not import Ray's placement API.
    if name in _LAZY:
        if name not in _BUILT:
            _BUILT[name] = _LAZY[name]()
        return _BUILT[name]
    raise AttributeError(name)
