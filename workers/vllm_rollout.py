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

import hashlib
import os
import re
from typing import Any

from recipe_hacpo.workers.rollout_naming import agent_name_of

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

_CLASS_NAMES = ("HacpoVLLMHttpServer", "HacpoVLLMReplica", "HacpoVLLMServerAdapter")


def _build_classes() -> dict[str, type]:
    import ray
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica
    from verl.workers.rollout.vllm_rollout.vllm_rollout import ServerAdapter

    class HacpoVLLMHttpServer(vLLMHttpServer):
        """verl's vLLM server actor; its vLLM workers receive weights on a per-agent socket."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            # verl set VERL_RAY_JOB_ID to the bare job id; vLLM's worker processes, spawned by
            # launch_server, inherit this process's environment and build the socket from it.
            os.environ[JOB_ID_ENV] = zmq_job_tag(_current_job_id(), self.config)

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
    for name, cls in classes.items():
        # importable as recipe_hacpo.workers.vllm_rollout.<name>: Ray and cloudpickle find
        # the class by reference, and `_ROLLOUT_REGISTRY` resolves it with getattr
        cls.__module__ = __name__
        cls.__qualname__ = name
    return classes


def __getattr__(name: str):
    if name in _CLASS_NAMES:
        globals().update(_build_classes())
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
