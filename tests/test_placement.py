"""Resource pools: what each agent asks of the Ray cluster, the one-line shortfall check that
runs before any pool is built, and a placement that gives up instead of waiting forever."""

from __future__ import annotations

import pytest
from hydra import compose, initialize_config_module

from recipe_hacpo import placement
from recipe_hacpo.config import agent_specs


def _compose(name: str, overrides=()):
    with initialize_config_module("recipe_hacpo.configs", version_base=None):
        return compose(name, overrides=list(overrides))


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
    shared = _requests(["agents.0.n_gpus_per_node=0", "agents.1.n_gpus_per_node=0", "trainer.nnodes=2"])
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
    reqs = _requests(["agents.0.n_gpus_per_node=8", "agents.1.n_gpus_per_node=8"])
    nodes = [{"GPU": 4, "CPU": 32}] * 4
    with pytest.raises(placement.PlacementError, match=r"agent qwen3_4b_base: needs 8 GPU on one node but the largest node has 4"):
        placement.check_cluster(reqs, {"GPU": 16, "CPU": 128}, "cuda", nodes)


def test_shared_pool_shortfall_names_its_agents():
    reqs = _requests(["agents.0.n_gpus_per_node=0", "agents.1.n_gpus_per_node=0"])
    with pytest.raises(placement.PlacementError, match=r"shared pool of agents qwen3_4b_base, qwen3_8b_base: needs 8 GPU"):
        placement.check_cluster(reqs, {"GPU": 4, "CPU": 64}, "cuda")


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
    cfg = _compose("pair_qwen3-4b-base_qwen3-8b-base", ["agents.0.nnodes=2", "++trainer.placement_timeout_s=7"])
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
