"""How well does the lockstep rule add a recorded run's phases up into its steps?

    python benchmarks/time_model_check.py METRICS.jsonl [METRICS.jsonl ...] [--skip-first 1] [--shared a,b]

For each metrics.jsonl a run wrote (one {"step", "data"} object a line), every training step but
the first `--skip-first` (warm-up) is predicted by the lockstep rule of
recipe_hacpo/cluster/time_model.py from the step's own recorded phases: Σ over the agent phases
(`agent/<k>/timing_s/<phase>`) of the slowest agent, plus the driver's phases (every other
`timing_s/<phase>` but exchange_wait, exchange_background and step), against the measured
`timing_s/step`. Prints per file: the steps used, the median and largest |relative error| per
step, the total predicted against the total measured, and the barrier cost: per step, Σ over
phases of the slowest agent minus the busiest agent's own Σ over phases (what lockstep's
barriers add to the busiest agent's work), its median and its share of the measured total.

`--shared a,b`: the agents that shared one pool in that run (they take turns: a phase costs
their sum). The per-phase GPU estimates of the time model are not checked here: they need a GPU run.
"""

from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from recipe_hacpo.cluster.time_model import check_recorded_run  # noqa: E402


def report(path: str, skip_first: int, shared: frozenset[str]) -> str:
    check = check_recorded_run(path, skip_first=skip_first, shared=shared)
    predicted = sum(s.predicted_s for s in check.steps)
    measured = sum(s.measured_s for s in check.steps)
    worst = max(check.steps, key=lambda s: abs(s.error))
    return "\n".join([
        f"{path}",
        f"  steps used: {len(check.steps)} ({check.steps[0].step}..{check.steps[-1].step}; "
        f"left out as warm-up: {', '.join(map(str, check.skipped)) or 'none'})",
        f"  lockstep rule per step: median |relative error| {check.median_abs_error:.2%}, "
        f"largest {check.max_abs_error:.2%} (step {worst.step}: predicted {worst.predicted_s:.3f} s, "
        f"measured {worst.measured_s:.3f} s)",
        f"  total: predicted {predicted:.3f} s, measured {measured:.3f} s, ratio {check.total_ratio:.4f}",
        f"  barrier cost: median {check.median_barrier_s * 1000:.1f} ms a step, "
        f"{check.barrier_share:.1%} of the measured total",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("metrics", nargs="+", help="metrics.jsonl files written by runs")
    parser.add_argument("--skip-first", type=int, default=1, help="training steps left out as warm-up (default 1)")
    parser.add_argument("--shared", default="", help="comma-separated agents that shared one pool in the run")
    args = parser.parse_args(argv)
    shared = frozenset(n for n in args.shared.split(",") if n)
    for path in args.metrics:
        print(report(path, args.skip_first, shared))
    return 0


if __name__ == "__main__":
    sys.exit(main())
