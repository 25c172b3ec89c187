"""Which prompts an agent answers next when agents do not wait for each other (window rule).

Batches of prompts are drawn from the training data in one shared order; batch `b` is the b-th
draw. When agent k starts a step it takes the **newest** batch drawn within the last `window`
draws that it has not answered yet; if there is none, it draws the next batch itself.

- Equal speeds: whoever starts first draws, every other agent takes that same batch, so every
  agent answers every batch in the order of the data, exactly as a lockstep run does.
- Speed ratio r: the fast agent draws nearly every batch; the slow agent, whenever it starts,
  takes the newest of them, which the fast agent has just answered. The slow agent's groups are
  joint (its rows and fresh peer rows of one prompt); the fast agent meets the slow agent's rows
  of a batch it answered about r steps before (groups of cross rows only).
- Newest rather than oldest: an agent that fell behind never works through a backlog of stale
  batches whose peer rows are already out of the buffer's lag bound; the batches it skips were
  answered by the agents that drew them.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class PromptSchedule:
    """The shared draw order and who answered which batch. Its state is checkpointed."""

    agents: tuple[str, ...]
    window: int = 4  # trainer.async.prompt_window: how many recent draws an agent may join
    drawn: int = 0  # batches drawn so far; batch ids are 0 .. drawn - 1
    answered: dict[str, list[int]] = field(default_factory=dict)  # agent -> batch ids, in order

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"trainer.async.prompt_window must be >= 1, got {self.window}")
        for name in self.agents:
            self.answered.setdefault(name, [])

    def next_batch(self, agent: str) -> tuple[int, bool]:
        """(batch id, whether this call drew it) for `agent`'s next step."""
        mine = set(self.answered[agent])
        for batch in range(self.drawn - 1, max(-1, self.drawn - 1 - self.window), -1):
            if batch not in mine:
                self.answered[agent].append(batch)
                return batch, False
        batch = self.drawn
        self.drawn += 1
        self.answered[agent].append(batch)
        return batch, True

    def state_dict(self) -> dict:
        return {"agents": list(self.agents), "window": self.window, "drawn": self.drawn,
                "answered": {k: list(v) for k, v in self.answered.items()}}

    @classmethod
    def from_state(cls, state: dict) -> "PromptSchedule":
        return cls(agents=tuple(state["agents"]), window=int(state["window"]), drawn=int(state["drawn"]),
                   answered={k: list(v) for k, v in state["answered"].items()})
