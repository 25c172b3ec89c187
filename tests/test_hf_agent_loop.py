"""Seeded `hf` rollouts sample the same tokens through the batched path as through verl's per-row path.

1. Golden set: `tests/fixtures/seeded_rollout_golden.json` holds the tokens and log-probs the hf
   server drew, before the batched path existed, for two tiny agents (two tokenizers), 16 rows,
   steps 0 and 5, under `rollout.full_determinism`. The server must still draw exactly these,
   one call per row and in one `generate_batch` call.
2. The batched agent-loop worker against verl's own per-row single-turn loop (real
   `AgentLoopWorker`, `SingleTurnAgentLoop`, `LLMServerClient`), on one in-process server: the
   two DataProtos must be equal field by field.

No Ray: the server and the worker run in this process; Ray actor handles are stood in for by
`_Actor` (`handle.method.remote(...)` returns an awaitable).
"""

from __future__ import annotations

import asyncio
import json
import os
import types

import numpy as np
import pytest
import torch

from recipe_hacpo import tiny_agents

GOLDEN = os.path.join(os.path.dirname(__file__), "fixtures", "seeded_rollout_golden.json")


class _Actor:
    """In-process stand-in for a Ray actor handle."""

    def __init__(self, obj):
        self._obj = obj
        self.calls: list[str] = []  # method names called through this handle

    def __getattr__(self, name):
        method = getattr(self._obj, name)

        def remote(*args, **kwargs):
            self.calls.append(name)
            return method(*args, **kwargs)

        return types.SimpleNamespace(remote=remote)


def _server(path: str, **rollout):
    from recipe_hacpo.workers.hf_cpu_rollout.hf_server import HFRolloutServer
    from verl.workers.config import HFModelConfig, RolloutConfig
    from verl.workers.rollout.replica import RolloutMode

    cfg = RolloutConfig(
        name="hf", tensor_model_parallel_size=1, dtype="float32", load_format="auto", calculate_log_probs=True,
        full_determinism=True, **rollout,
    )
    return HFRolloutServer(
        config=cfg, model_config=HFModelConfig(path=path), rollout_mode=RolloutMode.HYBRID, replica_rank=0, name="t"
    )


@pytest.fixture(scope="module")
def golden():
    with open(GOLDEN) as f:
        return json.load(f)


@pytest.mark.parametrize("kind", ["qwen2-char-small", "llama-pair-medium"])
def test_seeded_samples_equal_the_recorded_golden_set(tmp_path, golden, kind):
    path = tiny_agents.build_agent(str(tmp_path), kind)
    recorded = golden["agents"][kind]
    params = dict(temperature=1.0, top_p=1.0, top_k=-1, repetition_penalty=1.0, logprobs=True)

    async def run():
        server = _server(
            path, prompt_length=48, response_length=8, seed=golden["rollout_seed"], temperature=1.0, max_model_len=64
        )
        await server.launch_server()
        out = {}
        for step, rows in recorded.items():
            await server.set_global_steps(int(step))
            requests = [
                dict(prompt_ids=r["prompt_ids"], sampling_params=dict(params), request_id=r["request_id"]) for r in rows
            ]
            one_by_one = await asyncio.gather(*(server.generate(**r) for r in requests))
            batched = await server.generate_batch(requests)
            out[step] = (one_by_one, batched)
        return out

    for step, (one_by_one, batched) in asyncio.run(run()).items():
        rows = recorded[step]
        for path_name, outputs in (("per-request", one_by_one), ("generate_batch", batched)):
            assert [o.token_ids for o in outputs] == [r["token_ids"] for r in rows], (kind, step, path_name)
            for o, r in zip(outputs, rows):
                assert o.stop_reason == r["stop_reason"]
                torch.testing.assert_close(torch.tensor(o.log_probs), torch.tensor(r["log_probs"]), atol=1e-4, rtol=0)
    # the golden set is not degenerate: rows of one prompt differ, and the two steps differ
    rows0 = recorded["0"]
    assert len({tuple(r["token_ids"]) for r in rows0}) == len(rows0)
    assert [r["token_ids"] for r in rows0] != [r["token_ids"] for r in recorded["5"]]


# ---------------------------------------------------------------------------------------
# batched worker vs verl's per-row loop
# ---------------------------------------------------------------------------------------


class _OneServerBalancer:
    """What `LLMServerClient` asks of verl's load balancer, for a single server."""

    def __init__(self, server):
        self.server = server

    async def require_acquire_fields(self):
        return []

    async def require_release_fields(self):
        return []

    async def acquire_server(self, request_id, **fields):
        return "s0", self.server

    def release_server(self, **fields):
        return None


def _worker_config(model_path: str):
    from helpers.verl_cpu import CPU_OVERRIDES, compose_ppo_config

    return compose_ppo_config(
        [
            *CPU_OVERRIDES,
            f"actor_rollout_ref.model.path={model_path}",
            "data.max_prompt_length=48",
            "data.max_response_length=8",
            "actor_rollout_ref.rollout.temperature=1.0",
            "actor_rollout_ref.rollout.full_determinism=True",
            "actor_rollout_ref.rollout.seed=77",
            "actor_rollout_ref.rollout.prompt_length=48",
            "actor_rollout_ref.rollout.response_length=8",
        ]
    )


@pytest.mark.parametrize(
    "kind,validate", [("qwen2-char-small", False), ("llama-pair-medium", False), ("llama-pair-medium", True)]
)
def test_batched_worker_equals_verls_per_row_single_turn_loop(tmp_path, kind, validate):
    from recipe_hacpo.workers.hf_cpu_rollout.hf_agent_loop import BATCHED_AGENT_LOOP, HFBatchedAgentLoopWorker
    from verl.protocol import DataProto
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.rollout.llm_server import LLMServerClient

    path = tiny_agents.build_agent(str(tmp_path), kind)
    config = _worker_config(path)
    questions = ["12+34=", "7+8=", "905+17=", "1+0="]
    n = 4
    raw = np.empty(len(questions) * n, dtype=object)
    raw[:] = [[{"role": "user", "content": q}] for q in questions for _ in range(n)]

    def batch(agent_loop: str) -> DataProto:
        non_tensor = {
            "raw_prompt": raw.copy(),
            "agent_name": np.array([agent_loop] * len(raw), dtype=object),
            "priority": np.arange(len(raw), dtype=np.int64),  # what AgentLoopManager attaches
            "uid": np.array([f"p{i // n}" for i in range(len(raw))], dtype=object),
        }
        return DataProto.from_dict(non_tensors=non_tensor, meta_info={"validate": validate, "global_steps": 3})

    async def run():
        rollout = omega_conf_to_dataclass(config.actor_rollout_ref.rollout)
        server = _server(
            path, prompt_length=48, response_length=8, seed=rollout.seed, temperature=1.0, max_model_len=64
        )
        await server.launch_server()
        await server.set_global_steps(3)
        via_client, direct = _Actor(server), _Actor(server)
        client = LLMServerClient(config, load_balancer_handle=_Actor(_OneServerBalancer(via_client)))
        worker = HFBatchedAgentLoopWorker(config, client)
        worker.set_servers([direct])
        per_row = await worker.generate_sequences(batch("single_turn_agent"))
        batched = await worker.generate_sequences(batch(BATCHED_AGENT_LOOP))
        # verl's loop made one server call per row; the batched worker one for the whole batch
        assert via_client.calls == ["generate"] * len(raw) and direct.calls == ["generate_batch"]
        return per_row, batched

    per_row, batched = asyncio.run(run())
    assert set(per_row.batch.keys()) == set(batched.batch.keys())
    assert "rollout_log_probs" in batched.batch.keys()
    for key in per_row.batch.keys():
        a, b = per_row.batch[key], batched.batch[key]
        assert a.dtype == b.dtype and a.shape == b.shape, key
        if key == "rollout_log_probs":
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
        else:
            assert torch.equal(a, b), key
    assert set(per_row.non_tensor_batch) == set(batched.non_tensor_batch)
    for key, a in per_row.non_tensor_batch.items():
        b = batched.non_tensor_batch[key]
        if key == "agent_name":
            continue  # the one input field that differs by construction
        assert a.dtype == b.dtype, key
        assert [repr(x) for x in a] == [repr(x) for x in b], key
    responses = batched.batch["responses"]
    if validate:  # greedy: the n copies of a prompt agree
        assert torch.equal(responses[0], responses[1])
    else:  # sampled: the n copies of a prompt are distinct seeded draws
        assert len({tuple(r.tolist()) for r in responses[:n]}) > 1
    assert {m["num_preempted"] for m in batched.meta_info["metrics"]} == {
        m["num_preempted"] for m in per_row.meta_info["metrics"]
    }


def test_a_worker_without_a_router_starts_one_for_the_first_per_row_batch_only(tmp_path, monkeypatch):
    """The hf runtime starts no router (`HFLLMServerManager`); a batch that falls back to verl's
    per-row loop gets one, over the servers the manager named, once; batched rows never do."""
    from recipe_hacpo.workers.hf_cpu_rollout import hf_agent_loop
    from verl.protocol import DataProto
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.rollout.llm_server import LLMServerClient

    path = tiny_agents.build_agent(str(tmp_path), "qwen2-char-small")
    config = _worker_config(path)
    raw = np.empty(4, dtype=object)
    raw[:] = [[{"role": "user", "content": q}] for q in ("1+2=", "3+4=", "5+6=", "7+8=")]

    def batch(agent_loop: str) -> DataProto:
        non_tensor = {"raw_prompt": raw.copy(), "agent_name": np.array([agent_loop] * 4, dtype=object),
                      "priority": np.arange(4, dtype=np.int64)}
        return DataProto.from_dict(non_tensors=non_tensor, meta_info={"validate": False, "global_steps": 1})

    started = []

    async def run():
        rollout = omega_conf_to_dataclass(config.actor_rollout_ref.rollout)
        server = _server(path, prompt_length=48, response_length=8, seed=rollout.seed, temperature=1.0, max_model_len=64)
        await server.launch_server()
        via_router, direct = _Actor(server), _Actor(server)

        def router(servers, full_determinism):
            started.append((servers, full_determinism))
            return _Actor(_OneServerBalancer(via_router))

        monkeypatch.setattr(hf_agent_loop, "get_router_handle", router)
        worker = hf_agent_loop.HFBatchedAgentLoopWorker(config, LLMServerClient(config, load_balancer_handle=None))
        worker.set_servers([direct], route_over={"10.0.0.1:1": via_router})
        await worker.generate_sequences(batch(hf_agent_loop.BATCHED_AGENT_LOOP))
        assert started == [] and direct.calls == ["generate_batch"]
        for _ in range(2):
            await worker.generate_sequences(batch("single_turn_agent"))
        return via_router

    via_router = asyncio.run(run())
    assert started == [({"10.0.0.1:1": via_router}, True)]  # one router, full_determinism as configured
    assert via_router.calls == ["generate"] * 8



class _ThreadActor:
    """A stand-in Ray actor handle whose object lives on its own event loop in a thread, as an
    actor's does: callers on other (and successive) event loops await its methods."""

    def __init__(self, obj):
        import threading

        self._obj = obj
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=120)

    def __getattr__(self, name):
        method = getattr(self._obj, name)

        def remote(*args, **kwargs):
            out = method(*args, **kwargs)
            if asyncio.iscoroutine(out):
                return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(out, self.loop))
            return out  # a plain method (the balancer's release_server, which verl does not await)

        return types.SimpleNamespace(remote=remote)


def test_the_manager_runs_its_workers_in_this_process_and_returns_what_a_worker_returns(tmp_path, monkeypatch):
    """`HFAgentLoopManager` (what the hf runtime drives, one blocking call per rollout) with its
    workers in the driver's process: its batches equal a worker's own, call after call, and a
    batch that falls back to verl's per-row loop works in later blocking calls too."""
    from recipe_hacpo.workers.hf_cpu_rollout import hf_agent_loop
    from verl.protocol import DataProto
    from verl.utils.config import omega_conf_to_dataclass
    from verl.workers.rollout.llm_server import LLMServerClient

    path = tiny_agents.build_agent(str(tmp_path), "llama-pair-medium")
    config = _worker_config(path)
    raw = np.empty(8, dtype=object)
    raw[:] = [[{"role": "user", "content": q}] for q in ("1+2=", "3+4=", "5+6=", "7+8=") for _ in range(2)]

    def batch(agent_loop: str) -> DataProto:
        non_tensor = {"raw_prompt": raw.copy(), "agent_name": np.array([agent_loop] * 8, dtype=object)}
        return DataProto.from_dict(non_tensors=non_tensor, meta_info={"validate": False, "global_steps": 2})

    rollout = omega_conf_to_dataclass(config.actor_rollout_ref.rollout)
    server = _server(path, prompt_length=48, response_length=8, seed=rollout.seed, temperature=1.0, max_model_len=64)
    handle = _ThreadActor(server)
    handle.run(server.launch_server())
    handle.run(server.set_global_steps(2))
    balancer = _ThreadActor(_OneServerBalancer(handle))
    monkeypatch.setattr(hf_agent_loop, "get_router_handle", lambda servers, full_determinism: balancer)

    class Servers:  # the two things attach_servers reads of HFLLMServerManager
        def get_replicas(self):
            return [types.SimpleNamespace(servers=[handle])]

        def routed_servers(self):
            return {"10.0.0.1:1": handle}

    manager = hf_agent_loop.HFAgentLoopManager.create(config=config, llm_client=LLMServerClient(config, None))
    assert [type(w) for w in manager.agent_loop_workers] == [hf_agent_loop.InProcessWorker]
    manager.attach_servers(Servers())
    alone = hf_agent_loop.HFBatchedAgentLoopWorker(config, LLMServerClient(config, None))
    alone.set_servers([handle])
    for _ in range(2):  # a fresh event loop per blocking call, as in the driver
        got = manager.generate_sequences(batch(hf_agent_loop.BATCHED_AGENT_LOOP))
        want = asyncio.run(alone.generate_sequences(batch(hf_agent_loop.BATCHED_AGENT_LOOP)))
        for key in want.batch.keys():
            assert torch.equal(got.batch[key], want.batch[key]), key
        assert "agent_loop/generate_sequences/mean" in got.meta_info["timing"]
    for _ in range(2):
        per_row = manager.generate_sequences(batch("single_turn_agent"))
        assert torch.equal(per_row.batch["responses"], got.batch["responses"])  # the same seeded draws
