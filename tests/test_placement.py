"""Resource pools: what each agent asks of the Ray cluster, the one-line shortfall check that
runs before any pool is built, and a placement that gives up instead of waiting forever."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from recipe_hacpo.cluster import placement
from recipe_hacpo.config import agent_specs, agents_overrides
from helpers.compose import compose_config as _compose

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))




def _requests(overrides=(), device="cuda"):
    cfg = _compose("pair_qwen3-4b-base_qwen3-8b-base", overrides)
    return placement.pool_requests(cfg, agent_specs(cfg), device)


def test_pools_of_the_8_gpu_preset():
    reqs = _requests()
    assert [(r.name, r.process_on_nodes, r.cpus_per_bundle) for r in reqs] == [
        ("qwen3_4b_base", (4,), placement.OWN_POOL_COLOCATE),
        ("qwen3_8b_base", (4,), placement.OWN_POOL_COLOCATE),
    ]
    placement.check_cluster(reqs, {"GPU": 8, "CPU": 24}, "cuda", [{"GPU": 8, "CPU": 24}])


def test_shared_pool_and_cpu_bundles():
    shared = _requests(["agents.qwen3_4b_base.n_gpus_per_node=0", "agents.qwen3_8b_base.n_gpus_per_node=0", "trainer.nnodes=2"])
    [pool] = shared
    assert (pool.name, pool.agents, pool.process_on_nodes) == ("shared", ("qwen3_4b_base", "qwen3_8b_base"), (8, 8))
    assert pool.cpus_per_bundle == 2 + placement.SHARED_POOL_SPARE and pool.cpus == 16 * 3
    own_cpu = _requests(device="cpu")
    assert {r.cpus_per_bundle for r in own_cpu} == {placement.CPU_COLOCATE}


def test_missing_gpus_name_the_first_agent_that_does_not_fit():
    with pytest.raises(placement.PlacementError) as err:
        placement.check_cluster(_requests(), {"GPU": 6, "CPU": 64}, "cuda")
    msg = str(err.value)
    assert msg.startswith("agent qwen3_8b_base: needs 4 GPU") and "4 of them taken" in msg and "short of 2 GPU" in msg
    assert "\n" not in msg


def test_missing_cpus_are_a_shortfall_too():
    with pytest.raises(placement.PlacementError, match=r"agent qwen3_4b_base: needs 12 CPUs \(3 per GPU\) .* has 8: short of 4 CPUs"):
        placement.check_cluster(_requests(), {"GPU": 8, "CPU": 8}, "cuda")


def test_a_pool_wider_than_any_node_is_rejected():
    reqs = _requests(["agents.qwen3_4b_base.n_gpus_per_node=8", "agents.qwen3_8b_base.n_gpus_per_node=8"])
    nodes = [{"GPU": 4, "CPU": 32}] * 4
    with pytest.raises(placement.PlacementError, match=r"agent qwen3_4b_base: needs 8 GPU on one node but the largest node has 4"):
        placement.check_cluster(reqs, {"GPU": 16, "CPU": 128}, "cuda", nodes)


def test_shared_pool_shortfall_names_its_agents():
    reqs = _requests(["agents.qwen3_4b_base.n_gpus_per_node=0", "agents.qwen3_8b_base.n_gpus_per_node=0"])
    with pytest.raises(placement.PlacementError, match=r"shared pool of agents qwen3_4b_base, qwen3_8b_base: needs 8 GPU"):
        placement.check_cluster(reqs, {"GPU": 4, "CPU": 64}, "cuda")


def test_node_resource_pins_a_pool_to_the_nodes_that_offer_it():
    reqs = _requests(["++agents.qwen3_4b_base.node_resource=rack_a", "++agents.qwen3_8b_base.node_resource=rack_b"])
    assert [r.node_resource for r in reqs] == ["rack_a", "rack_b"]
    a = {"GPU": 4, "CPU": 32, "rack_a": 1}
    b = {"GPU": 4, "CPU": 32, "rack_b": 1}
    placement.check_cluster(reqs, {"GPU": 8, "CPU": 64}, "cuda", [a, b])
    # an 8-GPU node without rack_b does not help the agent that asks for rack_b
    with pytest.raises(placement.PlacementError) as err:
        placement.check_cluster(reqs, {"GPU": 12, "CPU": 96}, "cuda", [a, {"GPU": 2, "CPU": 32, "rack_b": 1}, {"GPU": 8, "CPU": 32}])
    assert str(err.value) == ("agent qwen3_8b_base: needs 4 GPU on one node but the largest node with rack_b has 2; "
                              "lower n_gpus_per_node and raise nnodes")
    with pytest.raises(placement.PlacementError, match=r"^agent qwen3_8b_base: node_resource=rack_b: no Ray node offers it "
                       r"\(custom resources: rack_a\); start its nodes with ray start --resources"):
        placement.check_cluster(reqs, {"GPU": 8, "CPU": 64}, "cuda", [a, {"GPU": 4, "CPU": 32, "node:10.0.0.2": 1}])
    two = _requests(["++agents.qwen3_4b_base.node_resource=rack_a", "agents.qwen3_4b_base.nnodes=2", "agents.qwen3_4b_base.n_gpus_per_node=2"])
    with pytest.raises(placement.PlacementError, match=r"^agent qwen3_4b_base: needs 2 nodes with node_resource=rack_a but 1"):
        placement.check_cluster(two, {"GPU": 8, "CPU": 64}, "cuda", [a, b])


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["++agents.qwen3_4b_base.node_resource=GPU"], r"^agents\.qwen3_4b_base\.node_resource='GPU': must be a custom Ray resource"),
        (["++agents.qwen3_8b_base.node_resource=a b"], r"^agents\.qwen3_8b_base\.node_resource='a b': must be a custom Ray resource"),
        (["++agents.qwen3_4b_base.node_resource=rack_a", "agents.qwen3_4b_base.n_gpus_per_node=0", "agents.qwen3_8b_base.n_gpus_per_node=0"],
         r"^agents\.qwen3_4b_base\.node_resource='rack_a': needs the agent's own pool"),
    ],
)
def test_node_resource_is_validated_with_one_line(overrides, message):
    from recipe_hacpo.config import ConfigError, validate

    cfg = _compose("pair_qwen3-4b-base_qwen3-8b-base", overrides)
    with pytest.raises(ConfigError, match=message) as err:
        validate(cfg, check_paths=False)
    assert "\n" not in str(err.value)


def test_placement_gives_up_after_the_timeout(monkeypatch):
    """TimedResourcePool with Ray's placement calls replaced: an unplaceable group times out."""
    import importlib

    import ray

    pg_mod = importlib.import_module("ray.util.placement_group")

    from recipe_hacpo.workers import verl_touchpoints

    verl_touchpoints._BUILT.pop("TimedResourcePool", None)
    created, removed, waited = [], [], []

    class FakePG:
        def __init__(self, bundles, strategy, name, lifetime):
            self.bundles, self.name = bundles, name
            created.append(self)

        def ready(self):
            return self

    monkeypatch.setattr(pg_mod, "placement_group", lambda **kw: FakePG(**kw))
    monkeypatch.setattr(pg_mod, "remove_placement_group", removed.append)

    def wait(refs, num_returns, timeout):
        waited.append(timeout)
        return refs[:1], refs[1:]  # the second node's group never places

    monkeypatch.setattr(ray, "wait", wait)
    monkeypatch.setattr(ray, "available_resources", lambda: {"GPU": 0.0})
    cfg = _compose("pair_qwen3-4b-base_qwen3-8b-base", ["agents.qwen3_4b_base.nnodes=2", "++trainer.placement_timeout_s=7"])
    spec = agent_specs(cfg)[0]
    pool = placement.make_pool(placement.request_for(cfg, [spec], spec.name, "cuda"), cfg, "cuda")
    try:
        with pytest.raises(RuntimeError, match=r"^qwen3_4b_base: 1 of 2 placement group\(s\) of 4\+4 bundles .* not placed after 7 s"):
            pool.get_placement_groups()
    finally:
        verl_touchpoints._BUILT.pop("TimedResourcePool", None)
    assert waited == [7.0] and removed == created and len(created) == 2
    assert all(len(pg.bundles) == 4 and pg.bundles[0]["CPU"] == placement.OWN_POOL_COLOCATE for pg in created)
    assert created[0].name.startswith("hacpo_qwen3_4b_base")


def test_node_resource_is_in_every_bundle(monkeypatch):
    import importlib

    import ray

    pg_mod = importlib.import_module("ray.util.placement_group")
    from recipe_hacpo.workers import verl_touchpoints

    verl_touchpoints._BUILT.pop("TimedResourcePool", None)
    bundles = []

    class FakePG:
        def __init__(self, bundles, strategy, name, lifetime):
            self.bundles = bundles

        def ready(self):
            return self

    monkeypatch.setattr(pg_mod, "placement_group", lambda **kw: bundles.extend(kw["bundles"]) or FakePG(**kw))
    monkeypatch.setattr(ray, "wait", lambda refs, num_returns, timeout: (refs, []))
    import verl.single_controller.ray.base as verl_ray

    # read when the pool class is built, below: the fake groups have no node to sort by
    monkeypatch.setattr(verl_ray, "sort_placement_group_by_node_ip", lambda pgs: pgs)
    cfg = _compose("pair_qwen3-4b-base_qwen3-8b-base", ["++agents.qwen3_4b_base.node_resource=rack_a"])
    spec = agent_specs(cfg)[0]
    try:
        pool = placement.make_pool(placement.request_for(cfg, [spec], spec.name, "cuda"), cfg, "cuda")
        pool.get_placement_groups()
    finally:
        verl_touchpoints._BUILT.pop("TimedResourcePool", None)
    assert len(bundles) == 4
    assert all(b == {"CPU": placement.OWN_POOL_COLOCATE, "GPU": 1, "rack_a": placement.NODE_RESOURCE_PER_BUNDLE} for b in bundles)


def test_master_port_ranges_are_disjoint_slices_below_the_ephemeral_range():
    import random

    cfg = _compose("pair_qwen3-4b-base_qwen3-8b-base")
    names = ["a", "b", "c"]
    for seed in range(50):
        ranges = placement.master_port_ranges(cfg.trainer.master_port_range, names, random.Random(seed))
        assert list(ranges) == names
        (a0, a1), (b0, b1), (c0, c1) = ranges.values()
        # slices of 4000 ports: [20000, 24000), [24000, 28000), [28000, 32000)
        assert (a1, b1, c1) == (24000, 28000, 32000)
        assert 20000 <= a0 < 22000 and 24000 <= b0 < 26000 and 28000 <= c0 < 30000
        assert c1 <= 32768  # Linux's ephemeral ports, where random binds land, start here
    firsts = {placement.master_port_ranges([20000, 32000], ["a"], random.Random(s))["a"][0] for s in range(20)}
    assert len(firsts) > 1  # two runs on one node start their scans at different ports


def test_master_port_ranges_reject_unusable_ranges():
    assert placement.master_port_ranges([20000, 20032], ["a", "b"]) is not None  # 16 each: the minimum
    for bad, message in [
        ([20000, 20031], r"31 ports for 2 agents; each agent needs at least 16"),
        ([20000], r"must be two port numbers"),
        ("20000", r"must be two port numbers"),
        ([30000, 20000], r"must satisfy 1024 <= first < end <= 65536"),
    ]:
        with pytest.raises(placement.ConfigError, match=message) as err:
            placement.master_port_ranges(bad, ["a", "b"])
        assert str(err.value).startswith("trainer.master_port_range=")


# --------------------------------------------------------------------------- two Ray nodes, one machine

PLACEMENT_PROBE = r"""
import json, os, sys, time, ray
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
nodes = {n["NodeID"]: sorted(k for k in n["Resources"] if k.startswith("node_")) for n in ray.nodes() if n["Alive"]}
seen = {}
while True:
    for pg in ray.util.placement_group_table().values():
        if pg["state"] == "CREATED" and pg["name"].startswith("hacpo_") and pg["name"] not in seen:
            seen[pg["name"]] = sorted({r for i in pg["bundles_to_node_id"].values() for r in nodes.get(i, ["?"])})
            with open(sys.argv[2] + ".tmp", "w") as f:
                json.dump(seen, f)
            os.replace(sys.argv[2] + ".tmp", sys.argv[2])
    time.sleep(0.5)
"""


@pytest.mark.e2e
@pytest.mark.ray
def test_two_ray_nodes_each_agent_on_the_node_of_its_node_resource(tmp_path, tiny_agent_paths):
    """Two Ray nodes on this machine (`ray start --head` + `ray start --address`, 3 logical GPUs
    each, custom resources node_a / node_b), in a PID namespace of the test's own, so that its
    end ends them and no other Ray on the machine is touched. Either node could hold both
    agents' GPUs: `agents.N.node_resource` alone puts each on its node. Then the placement
    check refuses an agent that asks for more GPUs on one node than any node has, in one line,
    before any worker starts."""
    import json
    import shlex
    import socket
    import subprocess
    import sys
    import tempfile

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    address = f"127.0.0.1:{port}"
    agents = agents_overrides([
        dict(name=name, model_path=tiny_agent_paths[kind], rollout_n=4, n_gpus_per_node=1, nnodes=1, node_resource=res)
        for kind, name, res in (("qwen2-char-small", "qwen_char", "node_a"), ("llama-pair-medium", "llama_pair", "node_b"))
    ])
    out = tmp_path / "run"
    common = [
        "-m", "recipe_hacpo.main", "--config-name", "hacpo_cpu_demo", f"++ray_kwargs.ray_init.address={address}",
        "ray_kwargs.ray_init.num_cpus=null", "ray_kwargs.ray_init.num_gpus=null", "trainer.nnodes=2",
        "trainer.n_gpus_per_node=2", "trainer.total_training_steps=1", "trainer.save_freq=-1", "trainer.test_freq=-1",
        "trainer.val_before_train=false", "trainer.progress_bar=false", "trainer.logger=[console,file]",
        f"trainer.default_local_dir={out}/ckpt", f"hydra.run.dir={out}/hydra",
    ]
    # 32 rows a mini-batch over 4 GPUs are 8 a GPU: micro-batches of 8, so the batch checks pass
    per_gpu_8 = [f"actor_rollout_ref.{k}_micro_batch_size_per_gpu=8" for k in ("actor.ppo", "rollout.log_prob", "ref.log_prob")]
    py = sys.executable
    ray = str(Path(py).with_name("ray"))
    probe = tmp_path / "probe.py"
    probe.write_text(PLACEMENT_PROBE)
    q = shlex.join
    script = "\n".join([
        "set -u",
        f"{ray} start --head --node-ip-address=127.0.0.1 --port={port} --num-cpus=4 --num-gpus=3 "
        """--resources='{"node_a": 1}' --include-dashboard=false --disable-usage-stats >ray-head.log 2>&1 || exit 10""",
        f"{ray} start --address={address} --node-ip-address=127.0.0.1 --num-cpus=4 --num-gpus=3 "
        """--resources='{"node_b": 1}' --disable-usage-stats >ray-worker.log 2>&1 || exit 11""",
        f"{py} {probe} {address} placement.json >probe.log 2>&1 &",
        f"{q([py, *common, *agents])} >train.log 2>&1; echo $? >train.rc",
        f"{q([py, *common, *agents, 'agents.qwen_char.n_gpus_per_node=4', '~agents.qwen_char.node_resource', *per_gpu_8])} "
        ">toowide.log 2>&1; echo $? >toowide.rc",
    ])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "VERL_"))}
    # one mode for the nodes and the trainer; a short temp dir keeps Ray's socket paths short
    ray_tmp = tempfile.mkdtemp(prefix="rt", dir="/tmp")
    # RAY_agent_register_timeout_ms: a raylet waits 15 s for its dashboard agent, too short on 2 loaded cores
    env.update(RAY_AUTH_MODE="disabled", RAY_TMPDIR=ray_tmp, RAY_agent_register_timeout_ms="120000",
               VERL_FILE_LOGGER_PATH=str(out / "metrics.jsonl"),
               HACPO_DATA_DIR=os.path.join(REPO, "data"))
    try:
        # the namespace's first process is this bash: when it exits, the kernel ends every Ray process in it
        proc = subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "bash", "-c", script], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=900)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    logs = {p.name: p.read_text()[-3000:] for p in tmp_path.glob("*.log")}
    assert proc.returncode == 0, (proc.returncode, proc.stderr, logs)
    assert (tmp_path / "train.rc").read_text().strip() == "0", logs["train.log"]
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert [r["step"] for r in records if "training/global_step" in r["data"]] == [1]
    seen = json.loads((tmp_path / "placement.json").read_text())
    pools = {a: {tuple(v) for k, v in seen.items() if k.startswith(f"hacpo_{a}verl_group")} for a in ("qwen_char", "llama_pair")}
    assert pools == {"qwen_char": {("node_a",)}, "llama_pair": {("node_b",)}}, seen

    # 4 GPUs (and the peer's 1) fit the cluster's 6 in total but no node of 3 (and 32 rows split
    # over 4 GPUs, so no batch check comes first): one line, before any worker
    assert (tmp_path / "toowide.rc").read_text().strip() != "0"
    wide = logs["toowide.log"]
    line = "agent qwen_char: needs 4 GPU on one node but the largest node has 3; lower n_gpus_per_node and raise nnodes"
    assert sum(line in row for row in wide.splitlines()) == 1, wide
    assert "HacpoActorRolloutRefWorker" not in wide
