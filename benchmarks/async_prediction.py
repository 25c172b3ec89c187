"""Lockstep against asynchronous agents (level A) for set phase costs: what the schedule itself gives.

    python benchmarks/async_prediction.py [--metrics tests/fixtures/recorded_runs/cpu_demo_metrics.jsonl]
                                          [--steps 20] [--pad-scale 0.2]

Costs per agent and phase are the medians of a recorded run's `agent/<k>/timing_s/*` (the
driver's phases shared out equally, each agent's loop scores and converts for itself), for
1. the recorded pair as it ran, and
2. a 1 : 3 pair: the same pair with the second agent's phases tripled.
For each: lockstep (every phase a barrier: Σ over phases of the slowest agent + the driver's
phases) against the asynchronous loop of recipe_hacpo/asynchronous/ in virtual time, both until
the slowest agent made `--steps` steps: wall time, each pool's busy fraction, steps per agent,
cross lags and joint groups. Then the same asynchronous run on the wall clock (a thread per
agent) with synthetic agents whose phases sleep for `--pad-scale` × the costs, against the
virtual clock's prediction for those pads: a check of the executor, not of a real agent.

What this is not: the agents here are synthetic (no model, no learning); a real asynchronous run
of the trainer does not exist yet.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from recipe_hacpo.asynchronous.loop import Shared, agent_loop  # noqa: E402
from recipe_hacpo.asynchronous.simulate import SleepingAgent, costs_with_driver, simulate  # noqa: E402
from recipe_hacpo.asynchronous.wall_clock import WallClock  # noqa: E402
from recipe_hacpo.cluster.time_model import lockstep_step_time, recorded_phases, recorded_training_steps  # noqa: E402


def median_costs(path: str, skip_first: int = 1) -> tuple[dict[str, dict[str, float]], dict[str, float]]:
    """Median seconds per agent phase and per driver phase over a run's training steps."""
    agents: dict[str, dict[str, list[float]]] = {}
    driver: dict[str, list[float]] = {}
    for _, data in recorded_training_steps(path)[skip_first:]:
        a, d, _ = recorded_phases(data)
        for name, phases in a.items():
            for phase, s in phases.items():
                agents.setdefault(name, {}).setdefault(phase, []).append(s)
        for phase, s in d.items():
            driver.setdefault(phase, []).append(s)
    med = statistics.median
    return ({n: {p: med(v) for p, v in ph.items()} for n, ph in agents.items()}, {p: med(v) for p, v in driver.items()})


def compare(label: str, agents: dict[str, dict[str, float]], driver: dict[str, float], steps: int) -> None:
    step = lockstep_step_time(agents, driver)
    lock_busy = {n: sum(p.values()) / step for n, p in agents.items()}
    costs = costs_with_driver(agents, driver)
    each = simulate(costs, steps, stop="each")
    slowest = simulate(costs, steps, stop="slowest")
    lags = slowest.lags()
    print(f"\n{label}: {steps} steps of the slowest agent")
    print(f"  lockstep: {steps * step:.2f} s ({step:.3f} s a step); pools busy "
          + ", ".join(f"{n} {b:.0%}" for n, b in lock_busy.items()))
    print(f"  asynchronous, stop when each made {steps}: {each.timeline.end:.2f} s "
          f"({each.timeline.end / (steps * step):.2f}x lockstep)")
    print(f"  asynchronous, stop when the slowest made {steps}: {slowest.timeline.end:.2f} s; steps "
          + ", ".join(f"{n} {v}" for n, v in slowest.steps.items()) + "; pools busy "
          + ", ".join(f"{n} {b:.0%}" for n, b in slowest.busy().items()))
    if lags:
        joint = sum(t.joint for t in slowest.manifest) / len(lags)
        print(f"  cross entries taken {len(lags)}: lag mean {statistics.mean(lags):.2f}, max {max(lags)}; "
              f"joint groups {joint:.0%}; entries never taken (stale) {slowest.evicted_stale}")


def wall_clock_check(agents: dict[str, dict[str, float]], driver: dict[str, float], steps: int, scale: float) -> None:
    costs = {n: {p: s * scale for p, s in c.items()} for n, c in costs_with_driver(agents, driver).items()}
    predicted = simulate(costs, steps, stop="slowest")
    names = tuple(costs)
    shared = Shared.start(names, steps, stop="slowest")
    start = time.perf_counter()
    tl = WallClock({n: n for n in names}).run({n: agent_loop(SleepingAgent(n, costs[n]), shared) for n in names})
    took = time.perf_counter() - start
    print(f"\nwall clock, phases padded to {scale:g} x the 1:3 costs (synthetic agents, a thread each): "
          f"{took:.2f} s measured, {predicted.timeline.end:.2f} s predicted by the virtual clock "
          f"({took / predicted.timeline.end - 1:+.1%}); steps "
          + ", ".join(f"{n} {shared.buffer.versions[n]} (predicted {predicted.steps[n]})" for n in names)
          + "; pools busy " + ", ".join(f"{n} {tl.busy_fraction(n):.0%}" for n in names))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--metrics", default=os.path.join(REPO, "tests/fixtures/recorded_runs/cpu_demo_metrics.jsonl"))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--pad-scale", type=float, default=0.2)
    args = ap.parse_args()
    agents, driver = median_costs(args.metrics)
    print(f"costs: medians of {os.path.relpath(args.metrics, REPO)} (seconds)")
    for name, phases in agents.items():
        print(f"  {name}: " + ", ".join(f"{p} {s:.3f}" for p, s in phases.items()))
    print("  driver: " + ", ".join(f"{p} {s:.3f}" for p, s in driver.items()))
    compare("the recorded pair", agents, driver, args.steps)
    first, second = list(agents)[:2]
    tripled = {first: agents[first], second: {p: 3 * s for p, s in agents[second].items()}}
    compare(f"1:3 pair ({second}'s phases x3)", tripled, driver, args.steps)
    wall_clock_check(tripled, driver, args.steps, args.pad_scale)


if __name__ == "__main__":
    main()
