"""Each agent's capability series when agents step at their own pace.

P^(k)_v is agent k's mean reward on its own rollouts of its step v (its version when it
sampled); P̂^(k)_v is the mean over its last `window` steps up to v, floored at ε_P. A learner
weighs a peer's rows with ω from the peer's P̂ at the version that sampled them and its own P̂
now. When every agent steps together (lockstep, or equal speeds) this is the lockstep
capability tracker's number for every agent and step.
"""

from __future__ import annotations


class CapabilitySeries:
    def __init__(self, agents: tuple[str, ...], window: int, floor: float) -> None:
        if window < 1:
            raise ValueError(f"algorithm.hacpo.window must be >= 1, got {window}")
        self.window, self.floor = int(window), float(floor)
        self.rewards: dict[str, list[float]] = {a: [] for a in agents}  # index v-1: P at step v

    def record(self, agent: str, step: int, mean_reward: float) -> None:
        """P^(agent) of its step `step` (1-based: the step it is producing)."""
        series = self.rewards[agent]
        if step != len(series) + 1:
            raise ValueError(f"agent {agent!r}: reward of step {step} recorded after step {len(series)}")
        series.append(float(mean_reward))

    def capability(self, agent: str, step: int | None = None) -> float:
        """P̂^(agent) at its step `step` (default: its newest); 1 before any step, as in lockstep."""
        series = self.rewards[agent]
        upto = len(series) if step is None else step
        recent = series[max(0, upto - self.window):upto]
        if not recent:
            return 1.0
        return max(sum(recent) / len(recent), self.floor)

    def state_dict(self) -> dict:
        return {"window": self.window, "floor": self.floor, "rewards": {k: list(v) for k, v in self.rewards.items()}}

    @classmethod
    def from_state(cls, state: dict) -> "CapabilitySeries":
        out = cls(tuple(state["rewards"]), int(state["window"]), float(state["floor"]))
        out.rewards = {k: [float(x) for x in v] for k, v in state["rewards"].items()}
        return out
