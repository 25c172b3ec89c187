"""Predict an asynchronous run from per-agent phase costs: the real loop in virtual time with
synthetic agents (no model, no data), so what it reports is the schedule's own behaviour.
`trainer.plan_only=true` (per GPU split, from the time model's phases) and
benchmarks/async_prediction.py (from a recorded run's phases) print its predictions.

`simulate` returns the virtual wall time to the stop rule, each pool's busy fraction, steps per
agent, and the consumption manifest (lags, joint or cross-only groups).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

from recipe_hacpo.asynchronous.buffer import Entry, Taken
from recipe_hacpo.asynchronous.loop import Shared, agent_loop
from recipe_hacpo.asynchronous.virtual_clock import Timeline, VirtualClock


@dataclass
class SyntheticAgent:
    """An agent with set costs and no model: its reward on a batch is a fixed pseudo-random number."""

    name: str
    row_bytes: int = 1024
    updates: list[tuple[int, list[tuple[str, int, int]]]] = field(default_factory=list)  # (version, [(source, batch, version)])

    def generate(self, batch: int, version: int):
        return batch, version

    def score(self, rollouts) -> float:
        digest = hashlib.sha256(f"{self.name}/{rollouts[0]}".encode()).digest()
        return digest[0] / 255.0

    def old_log_probs(self, rollouts):
        return {"batch": rollouts[0]}, self.row_bytes

    def update(self, rollouts, peers: list[Entry], capabilities: dict[str, float]) -> dict[str, float]:
        self.updates.append((rollouts[1], [(e.source, e.batch, e.version) for e in peers]))
        return {"cross_entries": float(len(peers))}

    def sync(self) -> None:
        return None


class SleepingAgent(SyntheticAgent):
    """A synthetic agent whose phases take their set seconds on the wall clock (a sleep: the
    time a device would take, at no CPU cost), for runs of the wall-clock executor."""

    def __init__(self, name: str, costs: dict[str, float]) -> None:
        super().__init__(name)
        self.costs = costs

    def _pad(self, phase: str) -> None:
        time.sleep(self.costs.get(phase, 0.0))

    def generate(self, batch, version):
        self._pad("gen")
        return super().generate(batch, version)

    def score(self, rollouts):
        self._pad("reward")
        return super().score(rollouts)

    def old_log_probs(self, rollouts):
        self._pad("old_log_prob")
        return super().old_log_probs(rollouts)

    def update(self, rollouts, peers, capabilities):
        self._pad("update_actor")
        return super().update(rollouts, peers, capabilities)

    def sync(self):
        self._pad("update_weights")


@dataclass
class Prediction:
    timeline: Timeline
    steps: dict[str, int]
    manifest: list[Taken]
    evicted_stale: int
    pools: dict[str, str]

    def busy(self) -> dict[str, float]:
        return {p: self.timeline.busy_fraction(p) for p in sorted(set(self.pools.values()))}

    def lags(self) -> list[int]:
        return [t.lag for t in self.manifest]


def simulate(costs: dict[str, dict[str, float]], steps: int, *, pools: dict[str, str] | None = None,
             max_source_lag: int = 4, window: int = 4, stop: str = "slowest") -> Prediction:
    """The asynchronous run of agents with these phase costs (seconds) until the stop rule."""
    names = tuple(costs)
    pools = pools or {n: n for n in names}
    shared = Shared.start(names, steps, window=window, max_source_lag=max_source_lag, stop=stop)
    agents = {n: SyntheticAgent(n) for n in names}
    loops = {n: agent_loop(agents[n], shared) for n in names}
    clock = VirtualClock(lambda agent, phase: float(costs[agent].get(phase, 0.0)), pools)
    timeline = clock.run(loops)
    return Prediction(timeline, dict(shared.buffer.versions), list(shared.buffer.manifest),
                      shared.buffer.evicted_stale, pools)


def costs_with_driver(agent_phases: dict[str, dict[str, float]], driver: dict[str, float]) -> dict[str, dict[str, float]]:
    """Per-agent costs for `simulate` from a lockstep estimate: each agent's own phases, and an
    equal share of the driver's (scoring, conversion), which each agent's loop runs for itself."""
    share = sum(driver.values()) / max(1, len(agent_phases))
    return {name: {**phases, "reward": phases.get("reward", 0.0) + share} for name, phases in agent_phases.items()}


def asynchronous_step_s(agent_phases: dict[str, dict[str, float]], driver: dict[str, float], *, steps: int = 20,
                        shared: frozenset[str] = frozenset(), max_source_lag: int = 4, window: int = 4) -> float:
    """Virtual seconds per step until every agent made `steps` steps (stop rule "each"), from a
    lockstep estimate's phases; agents in `shared` take turns on one pool."""
    pools = {name: ("shared" if name in shared else name) for name in agent_phases}
    p = simulate(costs_with_driver(agent_phases, driver), steps, pools=pools, max_source_lag=max_source_lag,
                 window=window, stop="each")
    return p.timeline.end / steps
