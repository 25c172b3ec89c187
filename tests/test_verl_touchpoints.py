"""Contract tests for every reach into verl internals listed in `workers/verl_touchpoints.py`.

Each test reads the installed verl (signatures, attributes, source of the function that
holds the contract) and fails with the touchpoint's number and name when an upgrade changes
what the package relies on. vLLM is not installed on CPU machines, so the vLLM touchpoints
are checked on verl's source files with `ast` instead of by import.
"""

from __future__ import annotations

import ast
import inspect
import os

import pytest

import verl

VERL_DIR = os.path.dirname(verl.__file__)


def _contract(touchpoint: str, ok: bool, what: str) -> None:
    if not ok:
        pytest.fail(f"verl touchpoint {touchpoint} changed: {what}; re-read workers/verl_touchpoints.py", pytrace=False)


def _params(fn) -> list[str]:
    return list(inspect.signature(fn).parameters)


def _source(fn) -> str:
    return inspect.getsource(fn)


def _class_methods(relpath: str, cls: str) -> dict[str, ast.FunctionDef]:
    """Methods of class `cls` in verl's file `relpath`, without importing it."""
    with open(os.path.join(VERL_DIR, relpath)) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == cls:
            return {n.name: n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    pytest.fail(f"verl touchpoint 8 changed: no class {cls} in verl/{relpath}", pytrace=False)


def test_1_rollout_adapter_registry_is_a_dict_read_by_get_rollout_class():
    from verl.workers.rollout import base

    _contract("1 (_ROLLOUT_REGISTRY)", isinstance(getattr(base, "_ROLLOUT_REGISTRY", None), dict),
              "verl.workers.rollout.base._ROLLOUT_REGISTRY is no longer a module-level dict")
    _contract("1 (_ROLLOUT_REGISTRY)", "_ROLLOUT_REGISTRY[" in _source(base.get_rollout_class),
              "get_rollout_class no longer resolves adapters from _ROLLOUT_REGISTRY")
    _contract("1 (_ROLLOUT_REGISTRY)", (("vllm", "async") in base._ROLLOUT_REGISTRY),
              "verl no longer keys the registry by (name, mode) with ('vllm', 'async')")
    from verl.workers import engine_workers

    _contract("1 (_ROLLOUT_REGISTRY)", "get_rollout_class(" in inspect.getsource(engine_workers.ActorRolloutRefWorker),
              "ActorRolloutRefWorker no longer builds its rollout adapter through get_rollout_class")


def test_2_adapter_call_contract():
    from verl.workers.rollout.base import BaseRollout

    params = _params(BaseRollout.__init__)
    _contract("2 (adapter __init__)", params[1:4] == ["config", "model_config", "device_mesh"],
              f"BaseRollout.__init__ takes {params}")
    _contract("2 (adapter resume)", _params(BaseRollout.resume) == ["self", "tags"],
              f"BaseRollout.resume takes {_params(BaseRollout.resume)}")
    _contract("2 (adapter update_weights)", _params(BaseRollout.update_weights)[:2] == ["self", "weights"],
              f"BaseRollout.update_weights takes {_params(BaseRollout.update_weights)}")
    _contract("2 (adapter release)", _params(BaseRollout.release) == ["self"], "BaseRollout.release signature")
    from verl.workers.engine_workers import ActorRolloutRefWorker

    src = _source(ActorRolloutRefWorker.update_weights)
    for call in ("resume(tags=", "update_weights("):
        _contract("2 (adapter calls)", call in src, f"ActorRolloutRefWorker.update_weights no longer calls `{call}`")
    from verl.checkpoint_engine.base import CheckpointEngineWorker

    src = inspect.getsource(CheckpointEngineWorker)
    for kw in ("get_rollout_class(", "config=", "model_config=", "device_mesh="):
        _contract("2 (CheckpointEngineWorker builds the adapter)", kw in src,
                  f"CheckpointEngineWorker no longer builds the adapter with `{kw}`")


def test_3_server_call_surface():
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.replica import RolloutReplica, TokenOutput

    params = _params(LLMServerClient.generate)
    for name in ("request_id", "prompt_ids", "sampling_params", "image_data", "video_data"):
        _contract("3 (LLMServerClient.generate)", name in params, f"generate no longer takes {name!r} ({params})")
    _contract("3 (TokenOutput)", {"token_ids", "log_probs"} <= set(TokenOutput.model_fields),
              f"TokenOutput fields are {sorted(TokenOutput.model_fields)}")
    for method in ("wake_up", "sleep", "clear_kv_cache", "release_kv_cache", "resume_kv_cache",
                   "abort_all_requests", "resume_generation", "start_profile", "stop_profile"):
        _contract("3 (RolloutReplica surface)", callable(getattr(RolloutReplica, method, None)),
                  f"RolloutReplica.{method} is gone")


def test_4_and_8_vllm_server_naming_hooks():
    replica = _class_methods("workers/rollout/vllm_rollout/vllm_async_server.py", "vLLMReplica")
    _contract("8 (vLLMReplica._get_server_name_prefix)", "_get_server_name_prefix" in replica,
              "vLLMReplica._get_server_name_prefix is gone")
    init_src = ast.unparse(replica["__init__"])
    _contract("8 (vLLMReplica.server_class)", "self.server_class" in init_src,
              "vLLMReplica.__init__ no longer sets server_class")
    launch = ast.unparse(replica["launch_servers"])
    _contract("4 (server actor name)", "_get_server_name_prefix()" in launch and "server_" in launch,
              "vLLMReplica.launch_servers no longer names actors {prefix}server_{replica}_{node}")
    server = _class_methods("workers/rollout/vllm_rollout/vllm_async_server.py", "vLLMHttpServer")
    _contract("8 (VERL_RAY_JOB_ID)", "VERL_RAY_JOB_ID" in ast.unparse(server["__init__"]),
              "vLLMHttpServer.__init__ no longer exports VERL_RAY_JOB_ID")
    ext = _class_methods("workers/rollout/vllm_rollout/utils.py", "vLLMColocateWorkerExtension")
    _contract("8 (zmq socket format)", "_get_zmq_handle" in ext and "rl-colocate-zmq-" in ast.unparse(ext["_get_zmq_handle"]),
              "vLLMColocateWorkerExtension._get_zmq_handle socket format changed")
    adapter = _class_methods("workers/rollout/vllm_rollout/vllm_rollout.py", "ServerAdapter")
    _contract("8 (ServerAdapter._get_server_name_prefix)", "_get_server_name_prefix" in adapter,
              "ServerAdapter._get_server_name_prefix is gone")
    adapter_init = ast.unparse(adapter["__init__"])
    for attr in ("self.zmq_handle", "self.replica_rank", "self.rollout_rank"):
        _contract(f"8 (ServerAdapter{attr[4:]})", attr in adapter_init, f"ServerAdapter.__init__ no longer sets {attr}")


def test_5_process_group_backend_string():
    from verl.utils import distributed

    _contract("5 (backend string)", 'f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}"'
              in _source(distributed.initialize_global_process_group_ray),
              "initialize_global_process_group_ray builds another backend string; dedup may be unneeded or wrong")


def test_replica_registry_register_signature():
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    _contract("1/8 (RolloutReplicaRegistry.register)", _params(RolloutReplicaRegistry.register) == ["name", "loader"],
              f"RolloutReplicaRegistry.register takes {_params(RolloutReplicaRegistry.register)}")


def test_9_resource_pool_placement_groups():
    from verl.single_controller.ray.base import RayResourcePool, sort_placement_group_by_node_ip

    _contract("9 (get_placement_groups)", _params(RayResourcePool.get_placement_groups) == ["self", "strategy", "name", "device_name"],
              f"get_placement_groups takes {_params(RayResourcePool.get_placement_groups)}")
    pool = RayResourcePool([2, 1], use_gpu=False, max_colocate_count=3)
    for attr in ("_store", "max_colocate_count", "use_gpu", "accelerator_type", "detached", "pgs", "name_prefix"):
        _contract(f"9 (RayResourcePool.{attr})", hasattr(pool, attr), f"RayResourcePool has no attribute {attr}")
    _contract("9 (RayResourcePool._store)", pool._store == [2, 1], f"_store holds {pool._store!r}, not the per-node counts")
    src = _source(RayResourcePool.get_placement_groups)
    for piece in ("verl_group_", "STRICT_PACK", "sort_placement_group_by_node_ip", "max_colocate_count"):
        _contract("9 (placement groups built)", piece in src, f"get_placement_groups no longer uses {piece}")
    _contract("9 (sort_placement_group_by_node_ip)", callable(sort_placement_group_by_node_ip), "sort helper gone")


def test_engine_registry_register_signature():
    from verl.workers.engine.base import EngineRegistry

    params = _params(EngineRegistry.register)
    _contract("registration (EngineRegistry.register)", params[:3] == ["model_type", "backend", "device"],
              f"EngineRegistry.register takes {params}")
    # register_cpu_engines reads the registry's table to register only what is missing
    engines = getattr(EngineRegistry, "_engines", None)
    _contract("registration (EngineRegistry._engines)",
              isinstance(engines, dict) and isinstance(engines.get("language_model", {}).get("fsdp2"), dict),
              "EngineRegistry._engines is no longer {model_type: {backend: {device: engine}}}")


def test_10_update_index_hook_one_train_batch_per_mini_batch():
    from verl.workers.engine_workers import TrainingWorker

    src = _source(TrainingWorker.train_mini_batch)
    _contract("10 (train_mini_batch -> train_batch)", src.count("self.train_batch(") == 1 and "for " in src,
              "TrainingWorker.train_mini_batch no longer calls self.train_batch once per mini-batch in a loop")
    _contract("10 (train_batch)", _params(TrainingWorker.train_batch) == ["self", "data"],
              f"TrainingWorker.train_batch takes {_params(TrainingWorker.train_batch)}")


def test_11_loss_global_batch_info_keys():
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    src = _source(FSDPEngine.forward_backward_batch)
    for key in ("batch_num_tokens=", "dp_size="):
        _contract(f"11 (loss reads {key[:-1]})", key in src,
                  f"FSDPEngine.forward_backward_batch no longer attaches {key[:-1]} to the micro-batch")
    from verl.workers.utils import losses

    ppo = _source(losses.ppo_loss)
    for key in ("dp_size", "batch_num_tokens", "global_batch_size"):
        _contract(f"11 (loss reads {key})", f'data["{key}"]' in ppo,
                  f"verl's own ppo_loss no longer reads data[{key!r}]; the HACPO loss reads the same key")


def test_12_checkpoint_layout_read_by_evaluate():
    from recipe_hacpo.workers import verl_touchpoints as tp
    from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

    save = _source(FSDPCheckpointManager.save_checkpoint)
    _contract("12 (FSDP shard file name)", 'f"model_world_size_{self.world_size}_rank_{self.rank}.pt"' in save,
              "FSDPCheckpointManager saves model shards under another file name")
    _contract("12 (FSDP shard file name)", tp.fsdp_shard_name(4, 1) == "model_world_size_4_rank_1.pt",
              "fsdp_shard_name disagrees with verl's scheme")
    _contract("12 (huggingface/ folder)", f'"{tp.CHECKPOINT_HF_SUBDIR}"' in save,
              f"FSDPCheckpointManager no longer writes config/tokenizer to {tp.CHECKPOINT_HF_SUBDIR}/")


def test_13_replica_server_handle_and_address_attributes():
    from verl.workers.rollout.replica import RolloutReplica

    for prop, attr in (("server_handle", "_server_handle"), ("server_address", "_server_address")):
        getter = getattr(RolloutReplica, prop, None)
        _contract(f"13 (RolloutReplica.{prop})", isinstance(getter, property) and f"self.{attr}" in _source(getter.fget),
                  f"RolloutReplica.{prop} no longer returns self.{attr}, which HFReplica sets")


def test_10_update_index_reaches_every_mini_batch_through_verls_train_mini_batch(monkeypatch):
    """verl's own `TrainingWorker.train_mini_batch` (only the engine and the per-mini-batch
    `train_batch` underneath are stand-ins): HacpoTrainingWorker numbers every mini-batch of
    every epoch, m = 0 .. N·epochs − 1, in the order verl runs them."""
    from tensordict import TensorDict
    from training_worker import run_train_mini_batch
    from verl.utils import tensordict_utils as tu

    from recipe_hacpo import batch_keys as K

    seen: list[int] = []

    def engine_step(self, data):  # what verl's train_batch would hand to the engine and loss
        seen.append(tu.get_non_tensor_data(data=data, key=K.UPDATE_INDEX, default=None))
        return TensorDict({}, batch_size=[])

    worker, _ = run_train_mini_batch(monkeypatch, engine_step, rows=8, mini_batch_size=2, epochs=2, outputs=False)
    _contract("10 (train_mini_batch -> train_batch)", seen == list(range(8)),
              f"the loss saw update indices {seen} for 4 mini-batches x 2 epochs, expected 0..7")
    assert [r["update_index"] for r in worker.update_record] == list(range(8))


def test_15_step_metrics_reduce_what_train_mini_batch_returns():
    from verl.utils.metric import AggregationType, Metric, reduce_metrics
    from verl.workers.engine_workers import TrainingWorker

    src = _source(TrainingWorker.train_mini_batch)
    _contract("15 (train_mini_batch metrics)", "Metric.aggregate_dp(val)" in src and "append_to_dict(metrics, output)" in src,
              "TrainingWorker.train_mini_batch no longer reduces each mini-batch's per-rank Metric lists with "
              "Metric.aggregate_dp into one value per mini-batch")

    def _filled(aggregation, values):
        m = Metric(aggregation)
        m.extend(values)
        return m

    def ranks(aggregation, *per_rank):
        return [_filled(aggregation, values) for values in per_rank]

    # 2 ranks x 2 micro-batches
    got = {
        "min": Metric.aggregate_dp(ranks(AggregationType.MIN, [0.9, 0.7], [0.8, 0.95])),
        "max": Metric.aggregate_dp(ranks(AggregationType.MAX, [1.1, 1.0], [1.3, 1.2])),
        "sum": Metric.aggregate_dp(ranks(AggregationType.SUM, [0.1, 0.2], [0.3, 0.4])),
        "mean": Metric.aggregate_dp(ranks(AggregationType.MEAN, [0.0, 0.5], [0.25, 0.25])),
    }
    want = {"min": 0.7, "max": 1.3, "sum": 0.2 + 0.3, "mean": (0.125 + 0.375) / 2}
    for kind, value in want.items():
        _contract(f"15 (Metric.aggregate_dp {kind})", abs(float(got[kind]) - value) < 1e-12,
                  f"Metric.aggregate_dp of a {kind} metric gives {float(got[kind])}, expected {value}")
    # a Metric's aggregation wins over its key's name (verl's own rule for plain lists is by name)
    reduced = reduce_metrics({"hacpo/cross_ratio_max": _filled(AggregationType.MIN, [3.0, 1.0, 2.0])})
    _contract("15 (reduce_metrics of a Metric)", float(reduced["hacpo/cross_ratio_max"]) == 1.0,
              "reduce_metrics no longer reduces a Metric by its own aggregation")


def test_16_worker_group_master_port_range():
    import socket

    from verl.single_controller.ray.base import RayWorkerGroup, get_master_addr_port

    init = _source(RayWorkerGroup.__init__)
    _contract("16 (RayWorkerGroup master_port_range)", 'kwargs.pop("master_port_range"' in init,
              "RayWorkerGroup no longer takes master_port_range")
    pick = _source(RayWorkerGroup._get_master_addr_port)
    _contract("16 (get_master_addr_port)", "master_port_range=master_port_range" in pick,
              "the worker group no longer passes its range to get_master_addr_port")
    # verl's port pick itself: the first port of the range not in use, never one outside it
    with socket.socket() as held:
        held.bind(("", 0))
        port = held.getsockname()[1]
        _, got = get_master_addr_port._function(master_port_range=[port, port + 50])
    _contract("16 (get_master_addr_port)", port < int(got) < port + 50, f"picked {got} for range [{port}, {port + 50})")


def test_18_lora_reference_in_actor_and_merged_sync():
    from verl.workers import engine_workers

    infer = _source(engine_workers.TrainingWorker.infer_batch)
    _contract("18 (no_lora_adapter)", 'key="no_lora_adapter"' in infer and "disable_adapter()" in infer,
              "TrainingWorker.infer_batch no longer switches the adapter off on no_lora_adapter")
    sync = _source(engine_workers.ActorRolloutRefWorker.update_weights)
    _contract("18 (lora.merge)", "self.peft_merge" in sync and "not self.peft_merge and peft_config is not None" in sync,
              "update_weights no longer sends merged weights (peft_config None) when model.lora.merge is set")
    init = _source(engine_workers.ActorRolloutRefWorker.init_model)
    _contract("18 (lora.merge)", 'model_config.lora.get("merge", False)' in init,
              "the merge switch is no longer read from model.lora.merge")


def test_19_a_methods_global_counts_are_summed_over_the_engines_data_parallel_group():
    from verl.workers.engine.base import BaseEngine
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    for name in ("get_data_parallel_size", "get_data_parallel_group"):
        _contract(f"19 ({name})", callable(getattr(BaseEngine, name, None)) and callable(getattr(FSDPEngine, name, None)),
                  f"verl's engine API no longer has {name}()")


def test_20_the_engines_model_and_tokenizer_and_the_vllm_servers_vocabulary_ban():
    import inspect

    from verl.workers.engine.fsdp import transformer_impl

    source = inspect.getsource(transformer_impl.FSDPEngine)
    _contract("20 (engine.module)", "self.module = module" in source, "FSDPEngine no longer keeps the model as self.module")
    _contract("20 (engine.model_config)", "self.model_config = model_config" in source,
              "FSDPEngine no longer keeps its HFModelConfig as self.model_config")
    from verl.workers.config import HFModelConfig

    _contract("20 (model_config.tokenizer)", "tokenizer" in HFModelConfig.__dataclass_fields__,
              "HFModelConfig has no tokenizer field")
    import os

    import verl

    # verl's vLLM package checks vLLM's version on import: its text is read instead
    with open(os.path.join(os.path.dirname(verl.__file__), "workers", "rollout", "vllm_rollout", "utils.py")) as f:
        utils_source = f.read()
    _contract("20 (engine ban)", 'logits[..., vocab_size:] = float("-inf")' in utils_source,
              "verl's vLLM server no longer bans the rows beyond len(tokenizer) as the recipe mirrors")


def test_21_merged_lora_weights_reach_the_engine_in_bf16():
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    merged = _source(FSDPEngine._merged_lora_per_tensor_param)
    _contract("21 (merged LoRA in bf16)", ".to(torch.bfloat16" in merged,
              "merged LoRA weights no longer go to the engine in bfloat16; rollout_check.agent_precision assumes they do")


def test_22_the_weight_bucket_module_the_preflight_loads_by_path():
    import os

    import verl

    path = os.path.join(os.path.dirname(verl.__file__), "workers", "rollout", "vllm_rollout", "bucketed_weight_transfer.py")
    _contract("22 (bucket module)", os.path.exists(path), f"{path} is gone")
    with open(path) as f:
        source = f.read()
    for name in ("class BucketedWeightSender", "class BucketedWeightReceiver"):
        _contract(f"22 ({name})", name in source, f"{path} no longer defines {name.split()[1]}")



def test_23_the_hf_server_manager_starts_no_router_until_a_per_row_batch_needs_one():
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.workers.rollout.llm_server import LLMServerClient, LLMServerManager
    from verl.workers.rollout.router import get_router_handle

    create = _source(LLMServerManager.create)
    _contract("23 (LLMServerManager.create)",
              "_initialize_llm_servers()" in create and "_init_global_load_balancer()" in create
              and create.index("_initialize_llm_servers()") < create.index("_init_global_load_balancer()"),
              "LLMServerManager.create no longer starts the servers, then the router through _init_global_load_balancer")
    servers = _source(LLMServerManager._initialize_llm_servers)
    _contract("23 (server_handles / server_addresses)",
              "self.server_handles = " in servers and "self.server_addresses = " in servers,
              "LLMServerManager no longer keeps server_handles and server_addresses, which routed_servers() pairs")
    _contract("23 (get_client)", "load_balancer_handle=self.global_load_balancer" in _source(LLMServerManager.get_client),
              "LLMServerManager.get_client no longer hands its global_load_balancer to the client")
    _contract("23 (LLMServerClient)", _params(LLMServerClient.__init__)[:3] == ["self", "config", "load_balancer_handle"],
              f"LLMServerClient takes {_params(LLMServerClient.__init__)}")
    _contract("23 (get_router_handle)", {"servers", "full_determinism"} <= set(_params(get_router_handle)),
              f"get_router_handle takes {_params(get_router_handle)}")
    from verl.experimental.agent_loop.agent_loop import AgentLoopManager

    _contract("23 (AgentLoopManager.create)", "_init_agent_loop_workers()" in _source(AgentLoopManager.create),
              "AgentLoopManager.create no longer builds its workers through _init_agent_loop_workers")
    generate = _source(AgentLoopManager.generate_sequences)
    _contract("23 (AgentLoopManager.generate_sequences)",
              "worker.generate_sequences.remote(chunk)" in generate and generate.count(".remote(") == 1,
              "AgentLoopManager.generate_sequences calls its workers other than by worker.generate_sequences.remote(chunk)")
    _contract("23 (per-row loop reads llm_client)", "server_manager=self.llm_client" in _source(AgentLoopWorker._run_agent_loop),
              "verl's per-row loop no longer reads the worker's llm_client for each row")
