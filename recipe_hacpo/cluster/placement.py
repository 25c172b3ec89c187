"""Where each agent's workers go: the Ray resource pools, and the check that the cluster has them.

Every agent with `n_gpus_per_node > 0` gets its own pool of `n_gpus_per_node × nnodes` GPUs;
agents with 0 share one pool of `trainer.n_gpus_per_node × trainer.nnodes` GPUs and take
turns on it. A pool is one Ray placement group per node, one bundle per GPU, each bundle
{GPU: 1, CPU: colocate} where `colocate` is how many processes may share that GPU.

An agent with `node_resource: R` (its own pool only) is pinned to the Ray nodes that offer the
custom resource R (`ray start --resources '{"R": 1}'`): every bundle of its pool also asks for
`NODE_RESOURCE_PER_BUNDLE` of R, so where it lands does not depend on which nodes happen to
have free GPUs. run_scripts/slurm/hacpo.slurm gives each half of a split allocation its own R.

Each agent's worker group takes its torch.distributed rendezvous port (verl's `MASTER_PORT`)
from its own slice of `trainer.master_port_range` (`master_port_ranges`).

`check_cluster` compares what every pool asks for with `ray.cluster_resources()` once, before
any pool is built, and fails with one line naming the agent and the shortfall. `make_pool`
builds a pool whose placement groups give up after `trainer.placement_timeout_s` instead of
waiting forever (verl's `RayResourcePool` blocks on `pg.ready()` without a timeout).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from recipe_hacpo.hacpo_settings import ConfigError

# CPUs reserved per GPU bundle = processes that may share the GPU:
# - own pool on GPU: verl's default for FSDP (actor/ref worker, rollout, reward model);
OWN_POOL_COLOCATE = 3
# - a shared pool: one slot per sharing agent plus one spare for verl's helpers;
SHARED_POOL_SPARE = 1
# - on CPU a bundle asks for 1 CPU: verl's default of 10 CPUs per bundle never places on a
#   small machine (2 cores), and the CPU backend runs one process per bundle.
CPU_COLOCATE = 1
# seconds a placement group may take to be placed (trainer.placement_timeout_s)
DEFAULT_PLACEMENT_TIMEOUT_S = 600.0
# how much of its node's custom resource (agents.<name>.node_resource) each bundle takes: a node
# started with {R: 1} holds up to 10000 such bundles, Ray's finest resource granularity
NODE_RESOURCE_PER_BUNDLE = 1e-4
# the narrowest slice an agent may get: verl skips the ports in use and fails past the slice
MIN_PORTS_PER_AGENT = 16


class PlacementError(RuntimeError):
    """The cluster cannot host a pool; the message is one line naming the agent."""


def master_port_ranges(port_range, names: list[str], rng: random.Random | None = None) -> dict[str, list[int]]:
    """Each agent's [first, end) of rendezvous ports: disjoint equal slices of `port_range`
    (`trainer.master_port_range`).

    Without a range verl picks any free port when a worker group is made and binds it only
    when its workers initialise; with agents starting at once, another agent's gloo, ZMQ or
    Ray sockets, which bind random ports of Linux's ephemeral range (32768-60999), can take it
    in between and the start fails with EADDRINUSE. The default range lies above Ray's worker
    ports (10002-19999) and below the ephemeral range, and each agent scans only its own
    slice. verl takes the first free port from `first`, drawn in the lower half of the slice,
    so two runs started together on one node seldom race for one port either.
    """
    key = "trainer.master_port_range"
    try:
        lo, hi = (int(p) for p in port_range)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}={port_range!r}: must be two port numbers [first, end)") from None
    if not 1024 <= lo < hi <= 65536:
        raise ConfigError(f"{key}=[{lo}, {hi}]: must satisfy 1024 <= first < end <= 65536")
    width = (hi - lo) // max(1, len(names))
    if width < MIN_PORTS_PER_AGENT:
        raise ConfigError(
            f"{key}=[{lo}, {hi}]: {hi - lo} ports for {len(names)} agents; each agent needs at least "
            f"{MIN_PORTS_PER_AGENT}, widen the range"
        )
    rng = rng or random.SystemRandom()
    return {
        name: [lo + i * width + rng.randrange(width // 2), lo + (i + 1) * width]
        for i, name in enumerate(names)
    }


@dataclass(frozen=True)
class PoolRequest:
    """What one pool asks of the cluster."""

    name: str  # agent name, or "shared"
    agents: tuple[str, ...]
    process_on_nodes: tuple[int, ...]  # GPUs per node
    cpus_per_bundle: int
    node_resource: str | None = None  # the Ray node resource its nodes must offer

    @property
    def gpus(self) -> int:
        return sum(self.process_on_nodes)

    @property
    def cpus(self) -> int:
        return self.gpus * self.cpus_per_bundle


def pool_requests(config, specs, device: str) -> list[PoolRequest]:
    """Every pool of the run, own pools first in agent order, then the shared pool."""
    requests = [
        PoolRequest(
            name=s.name,
            agents=(s.name,),
            process_on_nodes=(s.n_gpus_per_node,) * s.nnodes,
            cpus_per_bundle=CPU_COLOCATE if device == "cpu" else OWN_POOL_COLOCATE,
            node_resource=s.node_resource,
        )
        for s in specs
        if not s.uses_shared_pool
    ]
    sharing = tuple(s.name for s in specs if s.uses_shared_pool)
    if sharing:
        t = config.trainer
        requests.append(
            PoolRequest(
                name="shared",
                agents=sharing,
                process_on_nodes=(int(t.n_gpus_per_node),) * int(t.nnodes),
                cpus_per_bundle=len(sharing) + SHARED_POOL_SPARE,
            )
        )
    return requests


def resource_key(device: str) -> str:
    """The Ray resource a bundle asks for (the CPU backend reports its logical GPUs as "GPU")."""
    return "NPU" if device == "npu" else "GPU"


def check_cluster(requests: list[PoolRequest], cluster: dict, device: str, nodes: list[dict] | None = None) -> None:
    """Fail unless the cluster's totals (and, given `nodes`, one node per pool node) cover every pool.

    `cluster` is `ray.cluster_resources()`; `nodes` the alive nodes' resource dicts. Pools are
    charged in order, so the message names the first agent that does not fit.
    """
    key = resource_key(device)
    have_gpu, have_cpu = float(cluster.get(key, 0)), float(cluster.get("CPU", 0))
    used_gpu = used_cpu = 0.0
    for r in requests:
        who = f"agent {r.name}" if r.name != "shared" else f"shared pool of agents {', '.join(r.agents)}"
        if used_gpu + r.gpus > have_gpu:
            raise PlacementError(
                f"{who}: needs {r.gpus} {key} ({'+'.join(map(str, r.process_on_nodes))} per node) but the Ray cluster "
                f"has {have_gpu:g}" + (f", {used_gpu:g} of them taken by the pools before it" if used_gpu else "")
                + f": short of {used_gpu + r.gpus - have_gpu:g} {key}"
            )
        if used_cpu + r.cpus > have_cpu:
            raise PlacementError(
                f"{who}: needs {r.cpus} CPUs ({r.cpus_per_bundle} per {key}) but the Ray cluster has {have_cpu:g}"
                + (f", {used_cpu:g} of them taken by the pools before it" if used_cpu else "")
                + f": short of {used_cpu + r.cpus - have_cpu:g} CPUs; start Ray with more CPUs (ray start --num-cpus)"
            )
        used_gpu += r.gpus
        used_cpu += r.cpus
        if nodes is not None:
            _check_nodes(r, who, key, nodes)


def _check_nodes(r: PoolRequest, who: str, key: str, nodes: list[dict]) -> None:
    """One node per pool node, with enough GPUs (and the pool's node resource, if it has one)."""
    if r.node_resource is not None:
        eligible = [n for n in nodes if float(n.get(r.node_resource, 0)) > 0]
        if not eligible:
            custom = sorted({k for n in nodes for k in n if k not in _RAY_BUILTIN and not k.startswith("node:")})
            raise PlacementError(
                f"{who}: node_resource={r.node_resource}: no Ray node offers it (custom resources: "
                f"{', '.join(custom) or 'none'}); start its nodes with ray start --resources '{{\"{r.node_resource}\": 1}}'"
            )
        if len(eligible) < len(r.process_on_nodes):
            raise PlacementError(
                f"{who}: needs {len(r.process_on_nodes)} nodes with node_resource={r.node_resource} but "
                f"{len(eligible)} Ray node(s) offer it; lower nnodes or give more nodes the resource"
            )
        nodes = eligible
    biggest = max((float(n.get(key, 0)) for n in nodes), default=0.0)
    if max(r.process_on_nodes) > biggest:
        where = f"node with {r.node_resource}" if r.node_resource is not None else "node"
        raise PlacementError(
            f"{who}: needs {max(r.process_on_nodes)} {key} on one node but the largest {where} has {biggest:g}; "
            "lower n_gpus_per_node and raise nnodes"
        )


# resources every Ray node reports on its own
_RAY_BUILTIN = frozenset({"CPU", "GPU", "NPU", "memory", "object_store_memory"})


def check_ray_cluster(config, specs) -> None:
    """`check_cluster` against the running Ray cluster: call once, before any pool is built."""
    import ray

    device = str(config.trainer.device)
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    check_cluster(pool_requests(config, specs, device), ray.cluster_resources(), device, nodes)


def make_pool(request: PoolRequest, config, device: str):
    """The Ray resource pool of one request; its placement waits at most trainer.placement_timeout_s."""
    from recipe_hacpo.workers.verl_touchpoints import TimedResourcePool

    return TimedResourcePool(
        process_on_nodes=list(request.process_on_nodes),
        use_gpu=True,
        max_colocate_count=request.cpus_per_bundle,
        name_prefix=f"hacpo_{request.name}",
        timeout_s=float(config.trainer.get("placement_timeout_s", DEFAULT_PLACEMENT_TIMEOUT_S)),
        owner=request.name if request.name != "shared" else f"shared pool of {', '.join(request.agents)}",
        extra_resources={request.node_resource: NODE_RESOURCE_PER_BUNDLE} if request.node_resource else None,
    )


def request_for(config, specs, pool: str, device: str) -> PoolRequest:
    """The request named `pool` (an agent with its own pool, or "shared")."""
    return next(r for r in pool_requests(config, specs, device) if r.name == pool)
