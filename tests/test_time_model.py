"""The time model of a lockstep step (recipe_hacpo/cluster/time_model.py): each formula by hand,
the lockstep rule on hand-made phases and on a recorded CPU run, the GPU split search on a
preset, and the table `trainer.plan_only=true` prints. No Ray, no GPU."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from helpers.compose import compose_config as _compose
from recipe_hacpo import main
from recipe_hacpo.cluster import planner
from recipe_hacpo.cluster import time_model as tm
from recipe_hacpo.config import ConfigError, agent_specs

REPO = Path(__file__).resolve().parents[1]
RECORDED = REPO / "tests" / "fixtures" / "recorded_runs" / "cpu_demo_metrics.jsonl"
PAIR = "pair_qwen3-1p7b-base_qwen3-4b-base"
# round figures, so that every expected number below is plain arithmetic
GPU = tm.GpuKind("test", flops=1e15, bandwidth=1e12)


@pytest.fixture(autouse=True)
def _no_path_env(monkeypatch):
    for var in ("HACPO_MODEL_A", "HACPO_MODEL_B", "HACPO_DATA_DIR", "HACPO_OUTPUT_DIR"):
        monkeypatch.delenv(var, raising=False)


def test_the_constants_are_the_ones_the_hand_numbers_below_assume():
    assert (tm.TRAIN_MFU, tm.FORWARD_MFU, tm.DECODE_BANDWIDTH_FRACTION) == (0.35, 0.45, 0.6)
    assert (tm.WEIGHT_SYNC_BYTES_PER_S, tm.HOST_COPY_BYTES_PER_S) == (50e9, 25e9)
    assert (tm.SCORE_S_PER_RESPONSE, tm.CONVERT_S_PER_ROW) == (2e-3, 0.2e-3)
    assert {k: (g.flops, g.bandwidth) for k, g in tm.GPU_KINDS.items()} == {
        "h100": (989e12, 3.35e12), "h200": (989e12, 4.8e12), "a100": (312e12, 2.0e12)}


def test_prefill_and_forward_by_hand():
    # 2 · 1e9 · 100 sequences · 1000 tokens / (4 GPUs · 1e15 · 0.45) = 2e14 / 1.8e15
    assert tm.prefill_s(10**9, 100, 1000, 4, GPU) == pytest.approx(1 / 9)
    # old log-probs of 64 rows of 3000 tokens: 3.84e14 / 1.8e15
    assert tm.forward_s(10**9, 64, 3000, 4, GPU) == pytest.approx(0.213333, rel=1e-5)


def test_decode_is_memory_bound_with_the_kv_cache_and_compute_bound_without():
    # 64 sequences on 4 GPUs, TP 1: 4 replicas of 16. 2000 steps × 2e9 weight bytes = 4e12, KV:
    # 16 × 2000 steps × (1000 + 2000/2) mean context × 1e5 B = 6.4e12; at 0.6 × 1e12 B/s
    assert tm.decode_s(10**9, 100_000, 64, 1000, 2000, 4, 1, GPU) == pytest.approx(1.04e13 / 6e11)
    # TP 2: 2 replicas of 32, each GPU reads half the weights (2e12) and its half of the KV heads
    assert tm.decode_s(10**9, 50_000, 64, 1000, 2000, 4, 2, GPU) == pytest.approx(8.4e12 / 6e11)
    # 8 at once (the KV cache's limit): 2 waves, the weights read twice as often
    assert tm.decode_s(10**9, 100_000, 64, 1000, 2000, 4, 1, GPU, concurrent=8) == pytest.approx(1.44e13 / 6e11)
    # no KV traffic, many short sequences: compute 2e9 · 1e4 · 100 / (1e15 · 0.45) beats memory 1/3 s
    assert tm.decode_s(10**9, 0, 10_000, 10, 100, 1, 1, GPU) == pytest.approx(2e15 / 4.5e14)
    # what one replica holds at once: 1e9 B of KV cache / (1e5 B × 2000 tokens), capped by max_num_seqs
    assert tm.concurrent_sequences(10**9, 100_000, 1000, 2000, 256) == 5
    assert tm.concurrent_sequences(10**9, 100_000, 1000, 2000, 4) == 4
    assert tm.concurrent_sequences(-1, 100_000, 1000, 2000, None) == 1


def test_update_by_hand():
    # 6·P (forward + backward) · 128 rows · 3000 tokens / (4 · 1e15 · 0.35) = 2.304e15 / 1.4e15
    plain = tm.update_s(10**9, 128, 3000, 4, GPU, checkpointing=False)
    assert plain == pytest.approx(2.304e15 / 1.4e15)
    # gradient checkpointing runs the forward again: 8·P
    assert tm.update_s(10**9, 128, 3000, 4, GPU, checkpointing=True) == pytest.approx(plain * 8 / 6)
    # LoRA leaves out the base weights' gradients: 6·P with checkpointing; two epochs twice that
    assert tm.update_s(10**9, 128, 3000, 4, GPU, checkpointing=True, lora=True, epochs=2) == pytest.approx(2 * plain)
    # 3e9 offloaded bytes per GPU come back and go out again: 6e9 / 25e9
    assert tm.update_s(10**9, 128, 3000, 4, GPU, checkpointing=False, offloaded_bytes=3 * 10**9) == pytest.approx(plain + 0.24)


def test_sync_and_driver_by_hand():
    assert tm.weight_sync_s(10**9) == pytest.approx(2e9 / 50e9)
    assert tm.scoring_s(1000) == pytest.approx(2.0)
    assert tm.exchange_s(1000) == pytest.approx(0.2)
    assert tm.exchange_s(1000, hidden_s=0.15) == pytest.approx(0.05)
    assert tm.exchange_s(1000, hidden_s=5.0) == 0.0


A = {"gen": 10.0, "old_log_prob": 2.0, "update_actor": 20.0}
B = {"gen": 15.0, "old_log_prob": 1.0, "update_actor": 10.0}
C = {"gen": 5.0, "old_log_prob": 4.0, "ref": 1.0, "update_actor": 25.0}
DRIVER = {"reward": 3.0, "exchange": 1.0}


def test_lockstep_rule_two_and_three_agents_on_own_pools():
    # each phase waits for its slowest agent: 15 + 2 + 20, plus the driver's 4
    assert tm.lockstep_step_time({"a": A, "b": B}, DRIVER) == 41.0
    # a phase only one agent has (ref) costs that agent's time
    assert tm.lockstep_step_time({"a": A, "b": B, "c": C}, DRIVER) == 15 + 4 + 1 + 25 + 4
    # the barriers cost 37 − the busiest agent's own 32
    assert tm.barrier_s({"a": A, "b": B}) == 5.0


def test_lockstep_rule_on_a_shared_pool_sums_its_agents():
    # a and b take turns on one pool: every phase costs their sum
    assert tm.lockstep_step_time({"a": A, "b": B}, DRIVER, shared={"a", "b"}) == 25 + 3 + 30 + 4
    # mixed: the shared pool's sum against the own-pool agent's time, the larger of the two
    assert tm.lockstep_step_time({"a": A, "b": B, "c": C}, DRIVER, shared={"a", "b"}) == 25 + 4 + 1 + 30 + 4
    times = tm.PhaseTimes(agents={"a": A, "b": B, "c": C}, driver=DRIVER, shared=frozenset({"a", "b"}))
    assert times.step_s == 64.0
    assert times.busy_fraction() == pytest.approx({"c": 35 / 64, "shared": 58 / 64})


def test_recorded_phases_split_agent_and_driver_time():
    metrics = {
        "timing_s/gen": 1.1, "timing_s/reward": 0.3, "timing_s/old_log_prob": 0.5, "timing_s/exchange": 0.4,
        "timing_s/exchange_wait": 0.1, "timing_s/exchange_background": 0.7, "timing_s/adv": 0.2,
        "timing_s/update_actor": 2.0, "timing_s/update_weights": 0.2, "timing_s/step": 4.8,
        "agent/a/timing_s/gen": 1.0, "agent/b/timing_s/gen": 1.1,
        "agent/a/timing_s/old_log_prob": 0.5, "agent/b/timing_s/old_log_prob": 0.4,
        # timed inside the driver's exchange, with no phase of its own in the step
        "agent/a/timing_s/graft_old_log_prob": 0.3,
        "agent/a/timing_s/update_actor": 2.0, "agent/b/timing_s/update_actor": 1.5,
        "agent/a/timing_s/update_weights": 0.2, "agent/b/timing_s/update_weights": 0.1,
        "agent/a/reward/mean": 0.5,
    }
    agents, driver, measured = tm.recorded_phases(metrics)
    assert agents == {"a": {"gen": 1.0, "old_log_prob": 0.5, "update_actor": 2.0, "update_weights": 0.2},
                      "b": {"gen": 1.1, "old_log_prob": 0.4, "update_actor": 1.5, "update_weights": 0.1}}
    assert driver == {"adv": 0.2, "exchange": 0.4, "reward": 0.3}
    assert measured == 4.8
    assert tm.lockstep_step_time(agents, driver) == pytest.approx(1.1 + 0.5 + 2.0 + 0.2 + 0.9)


def test_lockstep_rule_predicts_every_step_of_a_recorded_cpu_run_within_5_percent():
    """`make demo` (two agents, each on its own pool, 20 steps on the 2-core CPU machine): every
    step but the first (warm-up) is the sum over its phases of the slower agent plus the driver's
    phases, within 5 %; what is left is the driver's untimed work between phases."""
    report = tm.check_recorded_run(str(RECORDED))
    assert report.skipped == [1]
    assert [s.step for s in report.steps] == list(range(2, 21))
    bad = [(s.step, round(s.error, 4)) for s in report.steps if abs(s.error) > 0.05]
    assert not bad, bad
    assert report.median_abs_error < 0.05 and 0.95 < report.total_ratio < 1.05
    # the rule leaves out only time: it never predicts more than was measured
    assert all(s.predicted_s <= s.measured_s for s in report.steps)
    assert 0 <= report.median_barrier_s < report.steps[0].measured_s


def test_check_recorded_run_skips_validation_lines_and_warm_up(tmp_path):
    def step(n: int, gen: float) -> dict:
        return {"step": n, "data": {"timing_s/gen": gen, "timing_s/reward": 0.5, "timing_s/step": gen + 0.5,
                                    "agent/a/timing_s/gen": gen, "agent/b/timing_s/gen": gen / 2}}

    lines = [{"step": 0, "data": {"agent/a/val/x/mean@1": 0.1}}, step(1, 9.0), step(2, 1.0), step(3, 2.0)]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    report = tm.check_recorded_run(str(path), skip_first=1)
    assert report.skipped == [1] and [s.step for s in report.steps] == [2, 3]
    assert report.median_abs_error == 0.0 and report.total_ratio == 1.0
    assert [s.barrier_s for s in report.steps] == [0.0, 0.0]
    with pytest.raises(ValueError, match="no training step"):
        tm.check_recorded_run(str(path), skip_first=3)


def test_compositions():
    assert list(tm.compositions(4, 2)) == [(1, 3), (2, 2), (3, 1)]
    assert len(list(tm.compositions(8, 3))) == 21  # C(7, 2)
    assert all(sum(c) == 8 and min(c) >= 1 for c in tm.compositions(8, 3))


def _search(preset: str, overrides=()):
    cfg = _compose(preset, list(overrides))
    specs = agent_specs(cfg)
    plans = planner.plan(cfg, specs, 80)
    shapes = {p.name: p.shape for p in plans}
    rows = main.rows_per_prompt(cfg, specs)
    current = {s.name: s.n_gpus_per_node for s in specs}
    ranked = tm.rank_splits(current, lambda split: tm.estimate(cfg, specs, shapes, rows, split).step_s,
                            main.split_check(cfg, shapes, 80.0), top=7)
    return cfg, specs, shapes, rows, ranked


def test_estimate_of_the_preset_is_the_formulas_on_its_figures():
    cfg, specs, shapes, rows, _ = _search(PAIR)
    times = tm.estimate(cfg, specs, shapes, rows)
    p4 = shapes["qwen3_4b_base"].num_params()
    # 128 prompts × (8 own + 8 peer) rows of 0.3·1024 + 0.5·4096 tokens, checkpointing on: 8·P, 4 H100s
    update = 8 * p4 * 128 * 16 * (0.3 * 1024 + 0.5 * 4096) / (4 * 989e12 * 0.35)
    assert times.agents["qwen3_4b_base"]["update_actor"] == pytest.approx(update)
    assert times.agents["qwen3_4b_base"]["old_log_prob"] == pytest.approx(
        2 * p4 * 128 * 8 * (0.3 * 1024 + 0.5 * 4096) / (4 * 989e12 * 0.45))
    assert times.agents["qwen3_4b_base"]["update_weights"] == pytest.approx(2 * p4 / 50e9)
    # 2 × 128 × 8 responses scored; the 2 × 1024 converted rows hide behind the old log-probs
    assert times.driver == {"reward": pytest.approx(2 * 1024 * 2e-3), "exchange": 0.0}
    assert times.shared == frozenset()
    assert times.step_s == pytest.approx(sum(max(t[p] for t in times.agents.values())
                                             for p in ("gen", "old_log_prob", "update_actor", "update_weights"))
                                         + times.driver["reward"])


def test_split_search_on_the_preset_refuses_what_the_batch_cannot_split():
    """128 prompts, mini-batches of 32 prompts × 16 rows = 512 rows: only 1, 2, 4 and 8 GPUs
    divide them, so 4+4 is the one valid split of 8; the fastest, 3+5, is refused for it."""
    _, _, _, _, ranked = _search(PAIR)
    assert len(ranked) == 7 and all(c.checked for c in ranked)
    assert [c.step_s for c in ranked] == sorted(c.step_s for c in ranked)
    by_split = {tuple(c.split.values()): c for c in ranked}
    assert [s for s, c in by_split.items() if c.valid] == [(4, 4)]
    assert by_split[(4, 4)].relative == 1.0
    best = ranked[0]
    assert tuple(best.split.values()) == (3, 5) and best.relative < 1
    assert best.refused == ("agents.qwen3_1p7b_base: a mini-batch of 512 rows (ppo_mini_batch_size 32 × responses "
                            "per prompt) does not split over its 3 GPUs; change ppo_mini_batch_size or rollout_n")
    for split in ((2, 6), (6, 2), (5, 3)):
        assert "a mini-batch of 512 rows" in by_split[split].refused
    # one GPU cannot hold the 4B model's actor beside its vLLM share: the memory plan refuses it first
    assert by_split[(7, 1)].refused.startswith("agents.qwen3_4b_base on 1 GPU(s) does not fit: rollout phase needs")


def test_split_search_finds_3_plus_5_when_the_batch_splits_over_3_and_5_gpus():
    """120 prompts, mini-batches of 15: 240 rows split over 3 and 5 GPUs, 15 prompts do not split
    into whole groups over 4 ranks; 3+5 is then the best valid split, 4+4 refused."""
    overrides = ["data.train_batch_size=120", "actor_rollout_ref.actor.ppo_mini_batch_size=15"]
    _, _, _, _, ranked = _search(PAIR, overrides)
    by_split = {tuple(c.split.values()): c for c in ranked}
    valid = [c for c in ranked if c.valid]
    assert tuple(valid[0].split.values()) == (3, 5) and valid[0].relative < 1
    assert "ppo_mini_batch_size=15 prompts do not split into whole prompt groups over its 4" in by_split[(4, 4)].refused


def test_rank_splits_checks_lazily_and_adds_the_asynchronous_estimate():
    current = {"a": 2, "b": 2}
    steps = {(1, 3): 3.0, (2, 2): 2.0, (3, 1): 1.0}
    asked = []

    def check(split):
        asked.append(tuple(split.values()))
        return None if split["a"] == 2 else "refused by hand"

    ranked = tm.rank_splits(current, lambda s: steps[tuple(s.values())], check,
                            asynchronous=lambda s: 0.5 * steps[tuple(s.values())], top=1)
    assert [tuple(c.split.values()) for c in ranked] == [(3, 1), (2, 2), (1, 3)]
    assert asked == [(3, 1), (2, 2)]  # the fastest, then up to the first valid (the current one)
    assert ranked[0].refused == "refused by hand" and ranked[1].valid and not ranked[2].checked
    assert [c.relative for c in ranked] == [0.5, 1.0, 1.5]
    assert [c.asynchronous_s for c in ranked] == [0.5, 1.0, None]


def test_split_search_applies_to_one_node_own_pools_only():
    cfg = _compose(PAIR)
    assert tm.split_search_problem(agent_specs(cfg)) is None
    shared = agent_specs(_compose(PAIR, ["agents_n_gpus_per_node=0"]))
    assert tm.split_search_problem(shared) == "one shared pool: agents take turns, a split does not apply"
    two_nodes = agent_specs(_compose(PAIR, ["agents.qwen3_4b_base.nnodes=2"]))
    assert "nnodes > 1" in tm.split_search_problem(two_nodes)


def test_settings_refuse_an_unknown_gpu_and_a_fill_outside_0_1():
    cfg = _compose(PAIR)
    assert tm.TimeSettings.from_config(cfg.trainer) == tm.TimeSettings("h100", 0.3, 0.5)
    assert tm.TimeSettings.from_config(_compose(PAIR, ["trainer.gpu_kind=h200"]).trainer).gpu.bandwidth == 4.8e12
    with pytest.raises(ValueError, match=r"^trainer.gpu_kind='b200': not a known GPU kind \(known: h100, h200, a100\)$"):
        tm.TimeSettings.from_config(_compose(PAIR, ["trainer.gpu_kind=b200"]).trainer)
    with pytest.raises(ConfigError, match=r"^trainer.time_model.response_fill=1.5: a fraction"):
        tm.TimeSettings.from_config(_compose(PAIR, ["trainer.time_model.response_fill=1.5"]).trainer)


def test_plan_only_prints_the_time_table_after_the_memory_plan(capsys):
    assert main.plan_only(_compose(PAIR)) == 0
    out = capsys.readouterr().out
    assert out.index("HACPO plan:") < out.index("HACPO time estimate of one lockstep step, NVIDIA H100 SXM")
    assert "not measured" in out
    for name in ("qwen3_1p7b_base", "qwen3_4b_base"):
        line = next(x for x in out.splitlines() if x.startswith(f"- {name} (4 GPU(s), own pool, 16 learner rows"))
        assert all(f"{phase} " in line for phase in ("gen", "old_log_prob", "update_actor", "update_weights"))
    assert "- driver (its CPU): reward 4.1 s, exchange 0 s" in out
    assert "lockstep step: " in out and "busy in lockstep: qwen3_1p7b_base " in out
    assert "GPU splits of 8 GPUs (qwen3_1p7b_base+qwen3_4b_base)" in out
    assert "(current) valid" in out
    assert "best valid split: 4+4 (the current one)" in out
    assert "best split overall: 3+5, 0.8" in out and "does not split over its 3 GPUs" in out
    # the asynchronous line names the trainer's asynchronous mode, which exists
    asynchronous = next(x for x in out.splitlines() if x.startswith("asynchronous agents"))
    assert "trainer.async.enable=true runs it" in asynchronous and "no asynchronous mode" not in out


def test_plan_only_on_a_shared_pool_sums_the_agents_and_searches_no_split(capsys):
    assert main.plan_only(_compose(PAIR + "_4gpu")) == 0
    out = capsys.readouterr().out
    assert "(4 GPU(s), shared pool" in out
    assert "each phase: the sum over the shared pool's agents" in out
    assert "GPU split: not searched (one shared pool: agents take turns, a split does not apply)" in out


def test_time_model_imports_neither_config_nor_training():
    tree = ast.parse((REPO / "recipe_hacpo" / "cluster" / "time_model.py").read_text())
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    ours = {m for m in imported if m and m.startswith("recipe_hacpo")}
    assert ours == {"recipe_hacpo.cluster.planner", "recipe_hacpo.hacpo_settings"}, ours
