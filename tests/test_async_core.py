"""Agents that do not wait for each other (recipe_hacpo/asynchronous/): the window rule, the row
buffer, the capability series, and the loop in virtual time — manifests, lags, resume, deadlocks."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from recipe_hacpo.asynchronous.buffer import Entry, RowBuffer
from recipe_hacpo.asynchronous.capability import CapabilitySeries
from recipe_hacpo.asynchronous.loop import Shared, agent_loop
from recipe_hacpo.asynchronous.schedule import PromptSchedule
from recipe_hacpo.asynchronous.simulate import SyntheticAgent, simulate
from recipe_hacpo.asynchronous.virtual_clock import VirtualClock
from recipe_hacpo.methods.core_algos import CapabilityTracker

EQUAL = {"gen": 1.0, "reward": 0.2, "old_log_prob": 0.5, "update_actor": 2.0, "update_weights": 0.1}


def scaled(factor: float) -> dict[str, float]:
    return {k: v * factor for k, v in EQUAL.items()}


# ---------------------------------------------------------------- the window rule
def test_equal_turns_answer_every_batch_in_order():
    s = PromptSchedule(("a", "b", "c"), window=4)
    for b in range(5):
        assert s.next_batch("a") == (b, True)
        assert s.next_batch("b") == (b, False)
        assert s.next_batch("c") == (b, False)


def test_a_late_agent_takes_the_newest_batch_it_has_not_answered():
    s = PromptSchedule(("fast", "slow"), window=4)
    assert s.next_batch("slow") == (0, True)
    assert s.next_batch("fast") == (0, False)
    for b in (1, 2, 3):
        assert s.next_batch("fast") == (b, True)
    assert s.next_batch("slow") == (3, False)  # newest, not the oldest (1)
    assert s.next_batch("slow") == (2, False)
    assert s.next_batch("slow") == (1, False)
    assert s.next_batch("slow") == (4, True)  # batch 0 it answered; nothing else in the window


def test_the_window_bounds_how_old_a_batch_an_agent_joins():
    s = PromptSchedule(("fast", "slow"), window=2)
    for _ in range(6):
        s.next_batch("fast")
    assert s.next_batch("slow") == (5, False)
    assert s.next_batch("slow") == (4, False)
    assert s.next_batch("slow") == (6, True)  # 3 is out of the last 2 draws
    with pytest.raises(ValueError, match="prompt_window"):
        PromptSchedule(("a",), window=0)


def test_schedule_state_round_trips():
    s = PromptSchedule(("a", "b"), window=3)
    for name in "aabab":
        s.next_batch(name)
    again = PromptSchedule.from_state(s.state_dict())
    assert [again.next_batch(n) for n in "babba"] == [s.next_batch(n) for n in "babba"]


# ---------------------------------------------------------------- the buffer
def test_take_prefers_the_peer_rows_of_the_learners_own_batch():
    buf = RowBuffer(("a", "b"), max_source_lag=4)
    buf.publish(Entry("b", 3, 0, 0.5))
    buf.set_version("b", 1)
    buf.publish(Entry("b", 4, 1, 0.6))
    with pytest.raises(ValueError, match="sampled by version 0 but it is at version 1"):
        buf.publish(Entry("b", 5, 0, 0.6))
    (got,) = buf.take("a", 3, learner_version=2)
    assert (got.batch, buf.manifest[-1].joint) == (3, True)
    (got,) = buf.take("a", 9, learner_version=3)
    assert (got.batch, buf.manifest[-1].joint, buf.manifest[-1].lag) == (4, False, 0)
    assert buf.take("a", 9, learner_version=4) == []  # each entry once per learner


def test_a_joint_only_take_leaves_the_peers_other_batches():
    """GRAFT and SGT compare answers to the same prompts: they take a peer's rows of their own batch only."""
    buf = RowBuffer(("a", "b"), max_source_lag=4)
    buf.publish(Entry("b", 4, 0, 0.5))
    assert buf.take("a", 9, learner_version=0, joint_only=True) == []
    (got,) = buf.take("a", 4, learner_version=1, joint_only=True)
    assert (got.batch, buf.manifest[-1].joint) == (4, True)


def test_entries_older_than_the_lag_bound_are_never_taken_and_are_counted():
    buf = RowBuffer(("a", "b"), max_source_lag=1)
    buf.publish(Entry("b", 0, 0, 0.5))
    buf.set_version("b", 1)
    assert len(buf.take("a", 7, 0)) == 1  # lag 1 <= K
    buf.publish(Entry("b", 1, 1, 0.5))
    buf.set_version("b", 3)  # lag 2 > K
    assert buf.take("a", 8, 1) == []
    assert buf.evicted_stale == 1 and buf.entries == []


def test_an_entry_leaves_once_every_peer_took_it():
    buf = RowBuffer(("a", "b", "c"), max_source_lag=4)
    buf.publish(Entry("a", 0, 0, 1.0, nbytes=100))
    assert buf.nbytes == 100
    buf.take("b", 0, 0)
    assert buf.nbytes == 100
    buf.take("c", 0, 0)
    assert buf.entries == [] and buf.evicted_stale == 0


def test_a_learners_newest_take_is_read_from_the_end_of_the_manifest():
    buf = RowBuffer(("a", "b", "c"), max_source_lag=4)
    buf.publish(Entry("b", 0, 0, 0.5))
    buf.publish(Entry("c", 0, 0, 0.5))
    buf.take("a", 0, learner_version=0)
    buf.publish(Entry("a", 0, 0, 0.5))
    buf.take("b", 0, learner_version=0)  # another learner's lines after a's
    assert [(t.learner, t.source) for t in buf.taken_at("a", 0)] == [("a", "b"), ("a", "c")]
    assert buf.take("a", 1, learner_version=1) == [] and buf.taken_at("a", 1) == []


def test_buffer_state_round_trips():
    buf = RowBuffer(("a", "b"), max_source_lag=2)
    buf.publish(Entry("b", 0, 0, 0.25, payload={"x": 1}, nbytes=8))
    buf.publish(Entry("a", 0, 0, 0.75))
    buf.take("a", 0, 0)
    again = RowBuffer.from_state(buf.state_dict())
    assert again.state_dict() == buf.state_dict()


# ---------------------------------------------------------------- capabilities
def test_aligned_series_equal_the_lockstep_tracker():
    # one formula (smoothed_capability) computes both: equal to the bit, the floor included
    rewards = [[0.1, 0.5], [0.3, 0.4], [0.0, 0.9], [0.2, 0.2], [0.7, 0.1], [0.0, 0.0], [0.0, 0.1], [0.0, 0.3]]
    tracker = CapabilityTracker(2, window=3, floor=0.05)
    series = CapabilitySeries(("a", "b"), window=3, floor=0.05)
    for step, (ra, rb) in enumerate(rewards, start=1):
        tracker.update([ra, rb])
        series.record("a", step, ra)
        series.record("b", step, rb)
        caps = tracker.capabilities()
        assert (series.capability("a"), series.capability("b")) == (float(caps[0]), float(caps[1]))
    assert series.capability("a") == float(tracker.capabilities()[0]) == 0.05  # three zero steps: the floor
    assert series.capability("a", 1) == pytest.approx(0.1) and series.capability("a", 0) == 1.0
    with pytest.raises(ValueError, match="step 10 recorded after step 8"):
        series.record("a", 10, 0.0)


# ---------------------------------------------------------------- the loop in virtual time
def test_equal_costs_consume_exactly_as_lockstep():
    p = simulate({"a": EQUAL, "b": EQUAL, "c": EQUAL}, steps=6)
    assert p.steps == {"a": 6, "b": 6, "c": 6}
    # every learner, every step: each peer's rows of the same batch, sampled by the same version
    assert len(p.manifest) == 6 * 3 * 2
    for t in p.manifest:
        assert (t.joint, t.lag, t.version, t.batch) == (True, 0, t.learner_version, t.learner_version)
    step = sum(EQUAL.values())
    assert p.timeline.end == pytest.approx(6 * step)


def test_a_one_to_three_pair_makes_three_fast_steps_per_slow_step():
    p = simulate({"fast": EQUAL, "slow": scaled(3.0)}, steps=5, max_source_lag=4)
    assert p.steps["slow"] == 5 and p.steps["fast"] == 15
    slow_takes = [t for t in p.manifest if t.learner == "slow"]
    fast_takes = [t for t in p.manifest if t.learner == "fast"]
    # the slow agent's groups are joint; the fast one meets the slow rows of older batches
    assert all(t.joint for t in slow_takes) and len(slow_takes) == 5
    assert len(fast_takes) == 5 and not any(t.joint for t in fast_takes[1:])
    # neither pool waits for the other: each is idle only while the driver scores its rows
    device_share = 1 - EQUAL["reward"] / sum(EQUAL.values())
    assert p.busy() == {"fast": pytest.approx(device_share), "slow": pytest.approx(device_share)}
    assert max(p.lags()) <= 4


def test_agents_of_one_pool_take_turns():
    p = simulate({"a": EQUAL, "b": EQUAL}, steps=3, pools={"a": "shared", "b": "shared"})
    device = EQUAL["gen"] + EQUAL["old_log_prob"] + EQUAL["update_actor"] + EQUAL["update_weights"]
    assert p.timeline.pool_busy["shared"] == pytest.approx(2 * 3 * device)
    assert p.timeline.end >= 2 * 3 * device


def test_stop_rules():
    each = simulate({"fast": EQUAL, "slow": scaled(2.0)}, steps=4, stop="each")
    assert each.steps == {"fast": 4, "slow": 4}
    slowest = simulate({"fast": EQUAL, "slow": scaled(2.0)}, steps=4, stop="slowest")
    assert slowest.steps["slow"] == 4 and slowest.steps["fast"] >= 8
    with pytest.raises(ValueError, match="trainer.async.stop"):
        simulate({"a": EQUAL}, steps=1, stop="never")


def _run(costs, steps, save_every, stop_at_checkpoint=None, state=None, start=0.0):
    """A virtual run with joint checkpoints every `save_every` rounds; with `stop_at_checkpoint`,
    it ends (like a kill after the save) once that round's checkpoint is written."""
    names = tuple(costs)
    shared = (Shared.from_state(state) if state is not None else
              Shared.start(names, steps, stop="slowest", save_every=save_every))
    saved = {}

    class Killed(Exception):
        pass

    def on_checkpoint(round_, t):
        shared.checkpoint_done(round_)
        saved[round_] = (shared.state_dict(), t)
        if round_ == stop_at_checkpoint:
            raise Killed
        return 0.5

    loops = {n: agent_loop(SyntheticAgent(n), shared) for n in names}
    clock = VirtualClock(lambda a, ph: costs[a].get(ph, 0.0), {n: n for n in names}, on_checkpoint, start=start)
    try:
        tl = clock.run(loops)
    except Killed:
        return shared, saved, None
    return shared, saved, tl


def test_a_resumed_virtual_run_reproduces_the_uninterrupted_one():
    costs = {"a": EQUAL, "b": scaled(2.5), "c": scaled(1.7)}
    full, saved, tl = _run(costs, steps=9, save_every=3)
    assert [r for r, _ in tl.checkpoints] == [3, 6]
    assert sum(tl.checkpoint_wait.values()) > 0
    killed, saved_k, _ = _run(costs, steps=9, save_every=3, stop_at_checkpoint=6)
    state, t = saved_k[6]
    resumed, _, tl2 = _run(costs, steps=9, save_every=3, state=state, start=t + 0.5)
    assert resumed.buffer.manifest == full.buffer.manifest
    assert resumed.metrics == full.metrics
    assert resumed.schedule.state_dict() == full.schedule.state_dict()
    assert tl2.end == pytest.approx(tl.end)


@settings(max_examples=60, deadline=None)
@given(
    factors=st.lists(st.floats(min_value=0.2, max_value=5.0), min_size=2, max_size=4),
    lag=st.integers(min_value=0, max_value=4),
    window=st.integers(min_value=1, max_value=5),
    shared_pool=st.booleans(),
    stop=st.sampled_from(["each", "slowest"]),
    save_every=st.integers(min_value=0, max_value=3),
)
def test_any_costs_keep_the_manifest_invariants(factors, lag, window, shared_pool, stop, save_every):
    names = tuple(f"agent{i}" for i in range(len(factors)))
    costs = {n: scaled(f) for n, f in zip(names, factors)}
    steps = 5
    shared = Shared.start(names, steps, window=window, max_source_lag=lag, stop=stop, save_every=save_every)
    agents = {n: SyntheticAgent(n) for n in names}
    pools = {n: ("one" if shared_pool else n) for n in names}

    def on_checkpoint(round_, t):
        shared.checkpoint_done(round_)
        return 0.1

    tl = VirtualClock(lambda a, ph: costs[a][ph], pools, on_checkpoint).run(
        {n: agent_loop(agents[n], shared) for n in names})  # returns: no deadlock
    versions = shared.buffer.versions
    if stop == "each":
        assert all(v == steps for v in versions.values())
    else:
        assert min(versions.values()) == steps
    seen = set()
    for t in shared.buffer.manifest:
        assert t.source != t.learner and 0 <= t.lag <= lag
        assert (t.learner, t.source, t.batch) not in seen  # at most once per learner
        seen.add((t.learner, t.source, t.batch))
    for name in names:  # each learner's last take, read from the end of the manifest
        mine = [t for t in shared.buffer.manifest if t.learner == name]
        if mine:
            newest = mine[-1].learner_version
            assert shared.buffer.taken_at(name, newest) == [t for t in mine if t.learner_version == newest]
    for name, agent in agents.items():
        for _, peers in agent.updates:
            assert len({src for src, _, _ in peers}) == len(peers) <= len(names) - 1
    assert len(tl.step_ends[names[0]]) == versions[names[0]]
    assert all(0.0 <= tl.busy_fraction(p) <= 1.0 + 1e-9 for p in set(pools.values()))


# ---------------------------------------------------------------- the same loop on the wall clock
def test_the_wall_clock_runs_the_same_loop_with_threads():
    from recipe_hacpo.asynchronous.simulate import SleepingAgent
    from recipe_hacpo.asynchronous.wall_clock import WallClock

    unit = {"gen": 0.01, "reward": 0.002, "old_log_prob": 0.005, "update_actor": 0.015, "update_weights": 0.002}
    costs = {"fast": unit, "slow": {k: 3 * v for k, v in unit.items()}}
    names = tuple(costs)
    shared = Shared.start(names, 4, max_source_lag=2, stop="slowest", save_every=2)
    written = []

    def on_checkpoint(round_, t):
        shared.checkpoint_done(round_)
        written.append((round_, dict(shared.buffer.versions)))
        return 0.0

    agents = {n: SleepingAgent(n, costs[n]) for n in names}
    tl = WallClock({n: n for n in names}, on_checkpoint).run({n: agent_loop(agents[n], shared) for n in names})
    versions = shared.buffer.versions
    assert versions["slow"] == 4 and versions["fast"] > versions["slow"]
    # one joint checkpoint at round 2, every agent at its own version, none below the round
    assert [r for r, _ in written] == [2] and min(written[0][1].values()) == 2
    assert all(0 <= t.lag <= 2 for t in shared.buffer.manifest)
    assert len({(t.learner, t.source, t.batch) for t in shared.buffer.manifest}) == len(shared.buffer.manifest)
    assert len(tl.step_ends["slow"]) == 4 and tl.end > 0


def test_a_failing_agent_stops_the_wall_clock_run_with_its_error():
    from recipe_hacpo.asynchronous.simulate import SleepingAgent
    from recipe_hacpo.asynchronous.wall_clock import WallClock

    class Broken(SleepingAgent):
        def update(self, rollouts, peers, capabilities):
            raise RuntimeError("agent b: worker died")

    names = ("a", "b")
    shared = Shared.start(names, 3, stop="slowest", save_every=1)
    agents = {"a": SleepingAgent("a", {"gen": 0.001}), "b": Broken("b", {"gen": 0.002})}
    with pytest.raises(RuntimeError, match="worker died"):
        WallClock({"a": "a", "b": "b"}, lambda r, t: shared.checkpoint_done(r) or 0.0).run(
            {n: agent_loop(agents[n], shared) for n in names})


def test_the_prediction_benchmark_runs_on_the_recorded_demo(capsys):
    import runpy
    import sys

    argv = sys.argv
    sys.argv = ["async_prediction.py", "--steps", "4", "--pad-scale", "0.01"]
    try:
        runpy.run_path(str(Path(__file__).resolve().parents[1] / "benchmarks" / "async_prediction.py"), run_name="__main__")
    finally:
        sys.argv = argv
    out = capsys.readouterr().out
    assert "the recorded pair: 4 steps" in out and "1:3 pair (llama_pair's phases x3)" in out
    assert "steps qwen_char" in out and "predicted by the virtual clock" in out
