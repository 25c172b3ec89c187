"""Run the agents' loops one event at a time in virtual time: deterministic, from set costs.

`cost(agent, phase)` gives each phase's duration in virtual seconds ("state" work takes none).
Events run in order of (virtual time, order of scheduling), so equal costs give the same
interleaving on every machine, and a run restarted from a joint checkpoint replays the rest of
the uninterrupted run exactly. "device" work holds the agent's pool: agents that share a pool
take turns on it, first come first served.

What the run returns: virtual wall time to the stop rule, each pool's busy time, each agent's
waits (for its pool, for joint checkpoints), and when each of its steps ended.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable, Iterator

from recipe_hacpo.asynchronous.loop import Park, Work


@dataclass
class Timeline:
    end: float = 0.0
    pool_busy: dict[str, float] = field(default_factory=dict)
    agent_busy: dict[str, float] = field(default_factory=dict)
    pool_wait: dict[str, float] = field(default_factory=dict)
    checkpoint_wait: dict[str, float] = field(default_factory=dict)
    step_ends: dict[str, list[float]] = field(default_factory=dict)  # virtual time each update ended
    checkpoints: list[tuple[int, float]] = field(default_factory=list)  # (round, virtual time)

    @classmethod
    def for_agents(cls, names: list[str], pools: dict[str, str]) -> "Timeline":
        return cls(pool_busy={p: 0.0 for p in set(pools.values())}, agent_busy={n: 0.0 for n in names},
                   pool_wait={n: 0.0 for n in names}, checkpoint_wait={n: 0.0 for n in names},
                   step_ends={n: [] for n in names})

    def device_work(self, agent: str, pool: str, phase: str, took: float, end: float) -> None:
        """`agent` held `pool` for `took` seconds in `phase`, until `end`."""
        self.pool_busy[pool] += took
        self.agent_busy[agent] += took
        if phase == "update_actor":
            self.step_ends[agent].append(end)

    def busy_fraction(self, pool: str) -> float:
        return self.pool_busy.get(pool, 0.0) / self.end if self.end > 0 else 0.0


class VirtualClock:
    def __init__(self, cost: Callable[[str, str], float], pools: dict[str, str],
                 on_checkpoint: Callable[[int, float], float] | None = None, start: float = 0.0) -> None:
        """`pools`: agent -> pool name (the same name for agents that share one);
        `on_checkpoint(round, time)`: writes the joint checkpoint, returns its virtual cost."""
        self.cost, self.pools, self.on_checkpoint, self.start = cost, dict(pools), on_checkpoint, float(start)

    def run(self, loops: dict[str, Iterator[Work | Park]]) -> Timeline:
        names = list(loops)
        tl = Timeline.for_agents(names, self.pools)
        pool_free = {p: self.start for p in tl.pool_busy}
        queue: list[tuple[float, int, str]] = []
        seq = 0
        pending: dict[str, Work | None] = {n: None for n in names}
        parked: dict[str, float] = {}  # agent -> virtual time it reached the checkpoint's step boundary
        parked_round = [0]
        finished: set[str] = set()
        result: dict[str, object] = {n: None for n in names}
        now = self.start

        def push(t: float, name: str) -> None:
            nonlocal seq
            heapq.heappush(queue, (t, seq, name))
            seq += 1

        def advance(name: str, t: float) -> None:
            """Hand the last result to `name`'s loop and schedule what it yields next at `t`."""
            try:
                nxt = loops[name].send(result[name])  # None first: a fresh generator takes only None
            except StopIteration:
                finished.add(name)
                pending[name] = None
                return
            if isinstance(nxt, Park):
                parked[name] = t
                parked_round[0] = nxt.round
                pending[name] = None
                return
            pending[name] = nxt
            push(t, name)

        for n in names:
            advance(n, self.start)
        while True:
            if not queue:
                if parked and len(parked) + len(finished) == len(names):
                    t = max(parked.values())
                    cost = self.on_checkpoint(parked_round[0], t) if self.on_checkpoint else 0.0
                    tl.checkpoints.append((parked_round[0], t))
                    for n, since in parked.items():
                        tl.checkpoint_wait[n] += t - since
                    resume = t + cost
                    waiting = [n for n in names if n in parked]
                    parked.clear()
                    for n in waiting:
                        result[n] = None
                        advance(n, resume)
                    now = max(now, resume)
                    continue
                if parked:
                    raise RuntimeError(f"deadlock: {sorted(parked)} wait for a checkpoint that "
                                       f"{sorted(set(names) - set(parked) - finished)} never join")
                break
            t, _, name = heapq.heappop(queue)
            work = pending[name]
            if work.kind == "device":
                pool = self.pools[name]
                if pool_free[pool] > t:  # another agent of the pool holds it
                    tl.pool_wait[name] += pool_free[pool] - t
                    push(pool_free[pool], name)
                    continue
            result[name] = work.run()
            duration = 0.0 if work.kind == "state" else float(self.cost(name, work.phase))
            if duration < 0:
                raise ValueError(f"agent {name!r}: phase {work.phase} has a negative cost {duration}")
            end = t + duration
            if work.kind == "device":
                pool_free[self.pools[name]] = end
                tl.device_work(name, self.pools[name], work.phase, duration, end)
            now = max(now, end)
            advance(name, end)
        tl.end = now
        return tl
