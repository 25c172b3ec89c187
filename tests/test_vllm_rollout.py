"""The `vllm` rollout backend with per-agent names (`workers/vllm_rollout.py`) without vLLM installed.

Three layers:

1. pure naming functions, in-process;
2. registration laziness, in a fresh interpreter: `import verl` (which runs the plugin)
   must not import vLLM or verl's vLLM modules, yet resolving `vllm` must give our classes;
3. verl's real vLLM classes, imported in a fresh interpreter with an automatic stub
   `vllm` package (every `vllm.*` module exists and every attribute is a dummy class).
   There, verl's own code runs around the overridden hooks: `vLLMReplica.launch_servers`
   (with fake workers and a recording server class), `vLLMHttpServer.__init__` (real, on a
   tiny checkpoint), `ServerAdapter.__init__` / `_ensure_server_handle`, and the receiving
   side of the weight socket, `vLLMColocateWorkerExtension._get_zmq_handle`.

The stubs live only in those child interpreters: a stub `vllm` in this process would make
`importlib.util.find_spec("vllm")` true for every later test.

Run as a script (`python tests/test_vllm_rollout.py probe-lazy|probe-stub [model_dir]`) the
module prints the child's observations as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

JOB_ID = "01000000"  # shape of a Ray job id; the stub runtime context returns it
AGENTS = (None, "alice", "bob")
TINY_KIND = "qwen2-char-small"

# ---------------------------------------------------------------------------------------
# helpers shared by the tests and the child interpreters
# ---------------------------------------------------------------------------------------


def _rollout_config(agent: str | None, name: str = "vllm"):
    from verl.workers.config import RolloutConfig

    return RolloutConfig(
        name=name,
        tensor_model_parallel_size=1,
        prompt_length=64,
        response_length=24,
        dtype="float32",
        load_format="auto",
        custom={"agent_name": agent} if agent else None,
    )


def _install_vllm_stub() -> None:
    """Make `import vllm.anything` succeed with dummy modules, and report vLLM 0.18.0."""
    import importlib.abc
    import importlib.machinery
    import importlib.metadata
    import types

    class StubModule(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            value = type(name, (), {"__module__": self.__name__})
            setattr(self, name, value)
            return value

    class StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, fullname, path=None, target=None):
            if fullname == "vllm" or fullname.startswith("vllm."):
                return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
            return None

        def create_module(self, spec):
            module = StubModule(spec.name)
            module.__path__ = []
            return module

        def exec_module(self, module):
            if module.__name__ == "vllm":
                module.__version__ = "0.18.0"

    sys.meta_path.insert(0, StubFinder())
    real_version = importlib.metadata.version
    importlib.metadata.version = lambda pkg: "0.18.0" if pkg == "vllm" else real_version(pkg)


def _stub_ray_runtime() -> None:
    """Answer the runtime-context questions verl's vLLM code asks, without a Ray cluster."""
    import ray

    class Accelerators(dict):
        def __missing__(self, key):
            return ["0"]

    class Context:
        def get_job_id(self):
            return JOB_ID

        def get_node_id(self):
            return "0" * 56

        def get_accelerator_ids(self):
            return Accelerators()

    ray.get_runtime_context = Context


def _vllm_modules_loaded() -> list[str]:
    prefixes = ("vllm.", "verl.workers.rollout.vllm_rollout")
    return sorted(m for m in sys.modules if m == "vllm" or m.startswith(prefixes))


def _probe_lazy() -> dict:
    _install_vllm_stub()  # so an eager import would succeed and be visible in sys.modules
    import verl  # noqa: F401  (runs the recipe_hacpo plugin)
    from verl.workers.rollout import base as rollout_base
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    import recipe_hacpo.plugin  # noqa: F401
    import recipe_hacpo.workers.vllm_rollout  # noqa: F401

    loader = RolloutReplicaRegistry._registry.get("vllm")
    out = {
        "after_import": _vllm_modules_loaded(),
        "replica_loader": f"{loader.__module__}.{loader.__qualname__}" if loader else None,
        "adapter_fqn": rollout_base._ROLLOUT_REGISTRY.get(("vllm", "async")),
        "old_name_registered": "hacpo_vllm" in RolloutReplicaRegistry._registry
        or ("hacpo_vllm", "async") in rollout_base._ROLLOUT_REGISTRY,
        "other_backends_untouched": [
            rollout_base._ROLLOUT_REGISTRY.get(("sglang", "async")),
            RolloutReplicaRegistry._registry["sglang"].__module__,
        ],
    }
    replica_cls = RolloutReplicaRegistry.get("vllm")
    adapter_cls = rollout_base.get_rollout_class("vllm")
    out["resolved"] = [f"{c.__module__}.{c.__qualname__}" for c in (replica_cls, adapter_cls)]
    out["after_resolve"] = _vllm_modules_loaded()
    return out


def _probe_stub(model_dir: str) -> dict:
    import asyncio
    import pickle
    import types

    _install_vllm_stub()
    _stub_ray_runtime()
    import vllm.platforms

    # the stub stands for a GPU platform: the server's CPU-only settings stay off
    vllm.platforms.current_platform = types.SimpleNamespace(is_cpu=lambda: False)
    import cloudpickle
    import ray
    from verl.workers.config import HFModelConfig
    from verl.workers.rollout.base import get_rollout_class
    from verl.workers.rollout.replica import get_rollout_replica_class
    from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica
    from verl.workers.rollout.vllm_rollout.vllm_rollout import ServerAdapter

    from recipe_hacpo.workers import vllm_rollout as vr

    out: dict = {}
    classes = {"server": vr.HacpoVLLMHttpServer, "replica": vr.HacpoVLLMReplica, "adapter": vr.HacpoVLLMServerAdapter}
    bases = {"server": vLLMHttpServer, "replica": vLLMReplica, "adapter": ServerAdapter}
    out["subclass"] = {k: issubclass(cls, bases[k]) for k, cls in classes.items()}
    out["own_methods"] = {
        k: sorted(n for n, v in vars(cls).items() if callable(v) and (n == "__init__" or not n.startswith("__")))
        for k, cls in classes.items()
    }
    out["registry_is_ours"] = [
        get_rollout_replica_class("vllm") is vr.HacpoVLLMReplica,
        get_rollout_class("vllm") is vr.HacpoVLLMServerAdapter,
    ]
    out["pickled_by_reference"] = all(pickle.loads(cloudpickle.dumps(cls)) is cls for cls in classes.values())

    # --- replica: verl's launch_servers names the actors ------------------------------------
    class Call:
        def __init__(self, fn):
            self.fn = fn

        def remote(self, *args, **kwargs):
            async def run():
                return self.fn(*args, **kwargs)

            return run()

    class FakeWorker:
        def __init__(self):
            self.__ray_call__ = Call(lambda fn: fn(None))

    class FakeServer:
        get_master_address = Call(lambda: ("127.0.0.1", 1, 2))
        launch_server = Call(lambda **kwargs: None)
        get_server_address = Call(lambda: ("127.0.0.1", 3))

    class RecordingServerClass:
        def __init__(self):
            self.names = []

        def options(self, **kwargs):
            self.names.append(kwargs["name"])
            return self

        def remote(self, **kwargs):
            return FakeServer()

    def launched_names(replica_cls, agent, replica_rank, role=None, name="vllm"):
        flags = {"is_reward_model": role == "reward", "is_teacher_model": role == "teacher"}
        replica = replica_cls(
            replica_rank=replica_rank, config=_rollout_config(agent, name), model_config=None, gpus_per_node=1, **flags
        )
        server_cls = replica.server_class.__ray_actor_class__
        out.setdefault("replica_server_class", []).append(f"{server_cls.__module__}.{server_cls.__qualname__}")
        recorder = RecordingServerClass()
        replica.server_class = recorder
        replica.workers = [FakeWorker() for _ in range(replica.world_size)]
        asyncio.run(replica.launch_servers())
        return recorder.names

    out["replica_names"] = {
        str(agent): {str(r): launched_names(vr.HacpoVLLMReplica, agent, r) for r in (0, 1)} for agent in AGENTS
    }
    out["replica_role_names"] = {
        str(agent): [launched_names(vr.HacpoVLLMReplica, agent, 0, role) for role in ("reward", "teacher")]
        for agent in AGENTS
    }
    out["verl_replica_names"] = {str(r): launched_names(vLLMReplica, None, r, name="vllm") for r in (0, 1)}

    # --- adapter: the name it looks up and the socket it sends on ------------------------------
    ray.get_actor = lambda name: f"actor:{name}"
    os.environ["RAY_LOCAL_WORLD_SIZE"] = "1"

    def adapter_view(adapter_cls, agent, replica_rank, name="vllm"):
        os.environ["RANK"] = str(replica_rank)  # tp=1: one trainer rank per replica
        adapter = adapter_cls(config=_rollout_config(agent, name), model_config=None, device_mesh=None)
        adapter._ensure_server_handle()
        return {"handle": adapter.server_handle, "zmq": adapter.zmq_handle}

    out["adapter"] = {str(a): {str(r): adapter_view(vr.HacpoVLLMServerAdapter, a, r) for r in (0, 1)} for a in AGENTS}
    out["verl_adapter"] = {str(r): adapter_view(ServerAdapter, None, r, name="vllm") for r in (0, 1)}

    # --- server: the real __init__, then the receiver's socket from the environment it left ------
    model_config = HFModelConfig(path=model_dir)

    def receiver_view(server_cls, agent, replica_rank, name="vllm"):
        for key in ("VERL_RAY_JOB_ID", "VERL_REPLICA_RANK"):
            os.environ.pop(key, None)
        server_cls(
            config=_rollout_config(agent, name),
            model_config=model_config,
            rollout_mode=None,
            workers=[],
            replica_rank=replica_rank,
            node_rank=0,
            gpus_per_node=1,
            nnodes=1,
            cuda_visible_devices="0",
        )
        worker = types.SimpleNamespace(local_rank=0, model_runner=None)
        return vLLMColocateWorkerExtension._get_zmq_handle(worker)

    out["receiver"] = {str(a): {str(r): receiver_view(vr.HacpoVLLMHttpServer, a, r) for r in (0, 1)} for a in AGENTS}
    out["verl_receiver"] = {str(r): receiver_view(vLLMHttpServer, None, r, name="vllm") for r in (0, 1)}
    return out


def _run_probe(*args: str) -> dict:
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    last = [line for line in proc.stdout.splitlines() if line.startswith("PROBE ")]
    assert last, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(last[-1][len("PROBE ") :])


# ---------------------------------------------------------------------------------------
# 1. pure naming
# ---------------------------------------------------------------------------------------


def test_server_names_are_verls_without_agent_and_distinct_per_agent():
    from recipe_hacpo.workers.vllm_rollout import server_actor_name, server_name_prefix

    solo, alice, bob = (_rollout_config(a) for a in AGENTS)
    assert server_name_prefix(solo) == "vllm_"
    assert server_actor_name(solo, 0) == "vllm_server_0_0"
    assert server_actor_name(solo, 1, 0, "reward_", "_x") == "vllm_server_reward_1_0_x"
    assert server_actor_name(alice, 0) == "vllm_alice_server_0_0"
    grid = [(c, r, n, role) for c in (solo, alice, bob) for r in (0, 1) for n in (0, 1) for role in ("", "reward_")]
    names = {server_actor_name(*point) for point in grid}
    assert len(names) == 3 * 2 * 2 * 2


def test_zmq_tags_are_the_job_id_without_agent_and_distinct_per_agent():
    from recipe_hacpo.workers.vllm_rollout import zmq_handle, zmq_job_tag

    solo, alice, bob = (_rollout_config(a) for a in AGENTS)
    assert zmq_job_tag(JOB_ID, solo) == JOB_ID
    assert zmq_job_tag(JOB_ID, alice) == f"{JOB_ID}-alice"
    assert zmq_handle(JOB_ID, 2, 3) == f"ipc:///tmp/rl-colocate-zmq-{JOB_ID}-replica-2-rank-3.sock"
    handles = {zmq_handle(zmq_job_tag(JOB_ID, c), r, 0) for c in (solo, alice, bob) for r in (0, 1)}
    assert len(handles) == 6


def test_awkward_agent_names_give_short_distinct_socket_paths():
    from recipe_hacpo.workers.vllm_rollout import UNIX_SOCKET_PATH_MAX, agent_path_tag, zmq_handle, zmq_job_tag

    long_a, long_b = "a" * 200 + "x", "a" * 200 + "y"
    odd = ["team/one", "team_one", "team one", "ü", long_a, long_b, "x" * 32, "x" * 33]
    tags = [agent_path_tag(a) for a in odd]
    assert len(set(tags)) == len(odd)
    assert agent_path_tag("team_one") == "team_one" and agent_path_tag("x" * 32) == "x" * 32
    for agent in odd:
        tag = zmq_job_tag("ffffffffffffffff", _rollout_config(agent))
        path = zmq_handle(tag, 99999, 999)[len("ipc://") :]
        assert len(path.encode()) <= UNIX_SOCKET_PATH_MAX, path
        assert "/" not in path[len("/tmp/") :] and " " not in path


def test_verls_checks_on_the_name_vllm_still_apply():
    """verl compares rollout.name with the literal "vllm"; the per-agent config keeps that name."""
    from verl.workers.config import RolloutConfig

    for agent in AGENTS:
        custom = {"agent_name": agent} if agent else None
        # pipeline-parallel guard (verl/workers/config/rollout.py)
        with pytest.raises(NotImplementedError, match="pipeline_model_parallel_size > 1"):
            RolloutConfig(name="vllm", pipeline_model_parallel_size=2, custom=custom)
        # PD disaggregation is accepted for "vllm" only among these names
        cfg = RolloutConfig(name="vllm", custom=custom, disaggregation={"enabled": True})
        assert cfg.disaggregation.enabled
        with pytest.raises(ValueError, match="disaggregation"):
            RolloutConfig(name="hacpo_vllm", custom=custom, disaggregation={"enabled": True})


def test_every_preset_uses_verls_vllm_name_with_a_per_agent_custom_name():
    from hydra import compose, initialize_config_module

    from recipe_hacpo.config import agent_specs, agent_verl_config

    presets = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "configs").glob("pair_*.yaml"))
    assert presets
    for preset in presets:
        with initialize_config_module("recipe_hacpo.configs", version_base=None):
            cfg = compose(preset)
        agents = [agent_verl_config(cfg, s).actor_rollout_ref.rollout for s in agent_specs(cfg)]
        assert [r.name for r in agents] == ["vllm", "vllm"], preset
        names = [r.custom.agent_name for r in agents]
        assert len(set(names)) == 2 and all(names)


# ---------------------------------------------------------------------------------------
# 2. registration is lazy
# ---------------------------------------------------------------------------------------


def test_registration_is_lazy_and_resolves_to_our_classes():
    out = _run_probe("probe-lazy")
    assert out["after_import"] == [], out["after_import"]
    # verl's own name resolves to our classes; the old private name is gone
    assert out["replica_loader"] == "recipe_hacpo.workers.verl_touchpoints._load_vllm_replica"
    assert out["adapter_fqn"] == "recipe_hacpo.workers.vllm_rollout.HacpoVLLMServerAdapter"
    assert not out["old_name_registered"]
    assert out["other_backends_untouched"] == [
        "verl.workers.rollout.sglang_rollout.sglang_rollout.ServerAdapter",
        "verl.workers.rollout.replica",
    ]
    assert out["resolved"] == [
        "recipe_hacpo.workers.vllm_rollout.HacpoVLLMReplica",
        "recipe_hacpo.workers.vllm_rollout.HacpoVLLMServerAdapter",
    ]
    # the probe does see vLLM modules once they are imported
    assert "vllm" in out["after_resolve"]
    assert "verl.workers.rollout.vllm_rollout.vllm_async_server" in out["after_resolve"]


# ---------------------------------------------------------------------------------------
# 3. verl's vLLM classes (stub vllm) around the overridden hooks
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stub_probe(tmp_path_factory) -> dict:
    from recipe_hacpo import tiny_agents

    model_dir = tiny_agents.build_agent(str(tmp_path_factory.mktemp("vllm_stub_agents")), TINY_KIND)
    return _run_probe("probe-stub", model_dir)


def test_subclasses_override_only_their_hooks(stub_probe):
    assert stub_probe["subclass"] == {"server": True, "replica": True, "adapter": True}
    assert stub_probe["own_methods"] == {
        # naming (__init__), per-row seeds (generate), CPU settings and reload (the other two)
        "server": ["__init__", "_get_worker_extension_cls", "_init_config", "generate"],
        "replica": ["__init__", "_get_server_name_prefix"],
        "adapter": ["__init__", "_get_server_name_prefix"],
    }
    assert stub_probe["registry_is_ours"] == [True, True]
    assert stub_probe["pickled_by_reference"]
    assert set(stub_probe["replica_server_class"]) == {
        "recipe_hacpo.workers.vllm_rollout.HacpoVLLMHttpServer",
        "verl.workers.rollout.vllm_rollout.vllm_async_server.vLLMHttpServer",
    }


def test_replicas_launch_per_agent_server_names(stub_probe):
    names = stub_probe["replica_names"]
    assert names["None"] == stub_probe["verl_replica_names"] == {"0": ["vllm_server_0_0"], "1": ["vllm_server_1_0"]}
    assert names["alice"] == {"0": ["vllm_alice_server_0_0"], "1": ["vllm_alice_server_1_0"]}
    assert names["bob"]["0"] == ["vllm_bob_server_0_0"]
    assert stub_probe["replica_role_names"]["alice"] == [
        ["vllm_alice_server_reward_0_0"],
        ["vllm_alice_server_teacher_0_0"],
    ]
    assert stub_probe["replica_role_names"]["None"] == [["vllm_server_reward_0_0"], ["vllm_server_teacher_0_0"]]
    every = [n for per_agent in names.values() for per_rank in per_agent.values() for n in per_rank]
    assert len(every) == len(set(every)) == 6


def test_adapters_find_their_own_agents_servers(stub_probe):
    for agent, per_rank in stub_probe["replica_names"].items():
        for rank, launched in per_rank.items():
            assert stub_probe["adapter"][agent][rank]["handle"] == f"actor:{launched[0]}"
    assert stub_probe["adapter"]["None"] == stub_probe["verl_adapter"]


def test_weight_socket_agrees_between_sender_and_receiver_and_is_per_agent(stub_probe):
    sent = {(a, r): v["zmq"] for a, per_rank in stub_probe["adapter"].items() for r, v in per_rank.items()}
    received = {(a, r): h for a, per_rank in stub_probe["receiver"].items() for r, h in per_rank.items()}
    assert sent == received
    assert len(set(sent.values())) == len(sent) == 6
    # single agent: verl's own socket on both sides
    assert stub_probe["adapter"]["None"]["0"]["zmq"] == stub_probe["verl_adapter"]["0"]["zmq"]
    assert stub_probe["receiver"]["None"] == stub_probe["verl_receiver"]
    assert sent[("alice", "1")] == f"ipc:///tmp/rl-colocate-zmq-{JOB_ID}-alice-replica-1-rank-0.sock"


if __name__ == "__main__":
    mode = sys.argv[1]
    result = _probe_lazy() if mode == "probe-lazy" else _probe_stub(sys.argv[2])
    print("PROBE " + json.dumps(result), flush=True)
