"""One agent's loop when agents do not wait for each other (level A), written once for every executor.

Each agent runs its own steps: produce (generate → score → its own old log-probs → publish) then
consume (take peers' rows → update → weight sync), with no barrier between agents. The loop is a
generator that yields one `Work` per phase; an executor decides when each runs:
`VirtualClock` (virtual_clock.py) one event at a time in virtual time from configured costs —
deterministic, for tests and predictions — or `WallClock` (wall_clock.py), a thread per agent.

Shared state (the prompt schedule, the row buffer, the capability series, the checkpoint
coordinator) is touched only by `Work` of kind "state", which an executor runs one at a time.

Clock: v_k = agent k's optimizer steps; a round R = min_k v_k names joint checkpoints.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol

from recipe_hacpo.asynchronous.buffer import Entry, RowBuffer
from recipe_hacpo.asynchronous.capability import CapabilitySeries
from recipe_hacpo.asynchronous.schedule import PromptSchedule

# what a phase holds while it runs: "device" the agent's GPU pool (agents sharing a pool take
# turns), "driver" the driver's CPU only, "state" the shared state (no time of its own)
KINDS = ("device", "driver", "state")
STOP_RULES = ("each", "slowest")  # trainer.async.stop: each agent at its own step count / all until the slowest is done


@dataclass(frozen=True)
class Work:
    phase: str
    kind: str
    run: Callable[[], Any]


@dataclass(frozen=True)
class Park:
    """The agent is at a step boundary and waits for the joint checkpoint of `round`."""

    round: int


class Participant(Protocol):
    """What an agent does in its phases (a real agent's workers, or a synthetic one)."""

    name: str

    def generate(self, batch: int, version: int) -> Any: ...
    def score(self, rollouts: Any) -> float: ...  # mean reward of its own rollouts
    def old_log_probs(self, rollouts: Any) -> tuple[Any, int]: ...  # (payload to publish, its bytes)
    def update(self, rollouts: Any, peers: list[Entry], capabilities: dict[str, float]) -> dict[str, float]: ...
    def sync(self) -> None: ...


@dataclass
class Shared:
    """Everything the agents' loops share; all of it is joint-checkpoint state."""

    schedule: PromptSchedule
    buffer: RowBuffer
    capabilities: CapabilitySeries
    total_steps: int
    stop: str = "each"
    save_every: int = 0  # joint checkpoint every that many rounds (0: none but the last)
    saved_round: int = 0  # newest round with a joint checkpoint
    requested: int | None = None  # a joint checkpoint wanted at this round
    metrics: list[tuple[str, int, dict]] = field(default_factory=list)  # (agent, version, metrics)
    # not checkpointed, set by the run: the agents also meet at their next step boundaries once
    # `stop_wanted()` says so (a joint checkpoint before a stop to be resumed)
    stop_wanted: Callable[[], bool] | None = None

    def __post_init__(self) -> None:
        if self.stop not in STOP_RULES:
            raise ValueError(f"trainer.async.stop must be one of {STOP_RULES}, got {self.stop!r}")

    @classmethod
    def start(cls, agents: tuple[str, ...], total_steps: int, *, window: int = 4, max_source_lag: int = 4,
              capability_window: int = 4, capability_floor: float = 0.01, stop: str = "each",
              save_every: int = 0) -> "Shared":
        """The state of a run that has not stepped yet: nothing drawn, nothing published."""
        return cls(schedule=PromptSchedule(agents, window), buffer=RowBuffer(agents, max_source_lag),
                   capabilities=CapabilitySeries(agents, capability_window, capability_floor),
                   total_steps=total_steps, stop=stop, save_every=save_every)

    @property
    def round(self) -> int:
        return min(self.buffer.versions.values())

    def next_move(self, agent: str) -> str | Park:
        """At `agent`'s step boundary: "step", "stop", or Park for a joint checkpoint."""
        if self.requested is None:
            r = self.round
            if self.save_every > 0 and r > self.saved_round and r % self.save_every == 0 and r < self.total_steps:
                self.requested = r
            elif self.stop_wanted is not None and self.stop_wanted():
                self.requested = r
        if self.requested is not None:
            return Park(self.requested)
        v = self.buffer.versions[agent]
        if self.stop == "each":
            return "step" if v < self.total_steps else "stop"
        return "step" if self.round < self.total_steps else "stop"

    def checkpoint_done(self, round_: int) -> None:
        self.saved_round, self.requested = round_, None

    def state_dict(self) -> dict:
        return {"schedule": self.schedule.state_dict(), "buffer": self.buffer.state_dict(),
                "capabilities": self.capabilities.state_dict(), "total_steps": self.total_steps,
                "stop": self.stop, "save_every": self.save_every, "saved_round": self.saved_round,
                "metrics": [list(m) for m in self.metrics]}

    @classmethod
    def from_state(cls, state: dict) -> "Shared":
        return cls(schedule=PromptSchedule.from_state(state["schedule"]), buffer=RowBuffer.from_state(state["buffer"]),
                   capabilities=CapabilitySeries.from_state(state["capabilities"]),
                   total_steps=int(state["total_steps"]), stop=state["stop"], save_every=int(state["save_every"]),
                   saved_round=int(state["saved_round"]), metrics=[tuple(m) for m in state["metrics"]])


def agent_loop(agent: Participant, shared: Shared, peers: tuple[str, ...] | None = None,
               joint_only: bool = False) -> Iterator[Work | Park]:
    """Agent `agent.name`'s steps until the stop rule says so; yields each phase (see module doc).
    `peers`: whose rows it takes (None: every other agent); `joint_only`: only their rows of the
    batch it answered (`RowBuffer.take`)."""
    name = agent.name
    while True:
        move = yield Work("boundary", "state", lambda: shared.next_move(name))
        if isinstance(move, Park):
            yield move
            continue
        if move == "stop":
            return
        version = shared.buffer.versions[name]
        batch, _ = yield Work("schedule", "state", lambda: shared.schedule.next_batch(name))
        rollouts = yield Work("gen", "device", lambda: agent.generate(batch, version))
        reward = yield Work("reward", "driver", lambda: agent.score(rollouts))
        payload, nbytes = yield Work("old_log_prob", "device", lambda: agent.old_log_probs(rollouts))

        def publish():
            shared.capabilities.record(name, version + 1, reward)
            cap = shared.capabilities.capability(name)
            shared.buffer.publish(Entry(name, batch, version, cap, payload, nbytes))

        yield Work("publish", "state", publish)

        def take():
            entries = shared.buffer.take(name, batch, version, peers, joint_only=joint_only)
            caps = {name: shared.capabilities.capability(name)}
            caps.update({e.source: e.capability for e in entries})
            return entries, caps

        entries, caps = yield Work("take", "state", take)
        metrics = yield Work("update_actor", "device", lambda: agent.update(rollouts, entries, caps))

        def stepped():
            shared.buffer.set_version(name, version + 1)
            shared.metrics.append((name, version + 1, dict(metrics or {})))

        yield Work("stepped", "state", stepped)
        yield Work("update_weights", "device", agent.sync)
