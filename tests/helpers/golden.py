"""Golden training metrics: what fixed-seed runs of every method logged, kept in tests/golden/.

The end-to-end tests that run a method through `python -m recipe_hacpo.main` hand their per-step
records to `check_golden`, which compares every training metric (the machine's timings and
throughput excluded) with the file recorded for that run, exactly: a change of the code's shape
must leave what a run trains on and reports untouched. A deliberate change of behaviour re-records
them: `HACPO_RECORD_GOLDEN=1 pytest <the test>`, and the diff of tests/golden/ shows what moved.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "golden"
RECORD_ENV = "HACPO_RECORD_GOLDEN"

# what the machine measures, not what the run trained: timings and throughput
MACHINE_METRICS = ("timing_s/", "/timing_s/", "perf/", "/perf/")


def training_metrics(step: dict) -> dict:
    """One step's record without the machine's figures."""
    return {k: v for k, v in step.items() if not any(m in k for m in MACHINE_METRICS)}


def check_golden(name: str, steps: dict[int, dict]) -> None:
    """Compare (or, with HACPO_RECORD_GOLDEN=1, record) the training metrics of `steps`
    ({step: verl's logged data}) against tests/golden/<name>.json."""
    got = {str(step): training_metrics(data) for step, data in sorted(steps.items())}
    path = GOLDEN_DIR / f"{name}.json"
    if os.environ.get(RECORD_ENV):
        GOLDEN_DIR.mkdir(exist_ok=True)
        path.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        return
    assert path.exists(), f"{path} missing: record it with {RECORD_ENV}=1"
    want = json.loads(path.read_text())
    assert sorted(got) == sorted(want), (name, sorted(got), sorted(want))
    for step, metrics in want.items():
        missing = sorted(set(metrics) ^ set(got[step]))
        assert not missing, f"{name} step {step}: metrics only on one side: {missing}"
        moved = [(k, v, got[step][k]) for k, v in metrics.items()
                 if not (v == got[step][k] or (isinstance(v, float) and math.isnan(v) and math.isnan(got[step][k])))]
        assert not moved, f"{name} step {step}: {len(moved)} metrics moved, first {moved[:5]}"
