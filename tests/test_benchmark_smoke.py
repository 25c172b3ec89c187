"""A tiny smoke of benchmarks/miniature.py: one arm (HACPO), one seed, two steps, through the real
trainer; the report, cost profile, plot and run summaries are written."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.ray]

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_miniature_smoke(tmp_path):
    work, results = tmp_path / "work", tmp_path / "results"
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "benchmarks", "miniature.py"), "--smoke",
         "--work", str(work), "--results", str(results)],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    with open(results / "runs.json") as f:
        runs = json.load(f)
    assert len(runs) == 1
    run = runs[0]
    assert run["arm"] == "hacpo" and run["steps"] == 2
    for name in run["names"]:
        assert run["final_acc"][name] is not None and 0.0 <= run["final_acc"][name] <= 1.0
        assert run["rollout_tokens"][name] > 0
        assert len(run["train_reward"][name]) == 2
    assert {"gen", "update_actor", "step"} <= set(run["timing"])
    report = (results / "miniature.md").read_text()
    assert "HACPO (G each)" in report and "Command:" in report
    # the run records its machine; the report names it apart from the machine that wrote the report
    assert run["machine"] and f"Runs made on: {run['machine']} (1 runs). Report written on: " in report
    assert "Equal per-agent sampling" not in (results / "cost_profile.md").read_text()  # no GSPO run in the smoke
    assert (results / "learning_curve.png").stat().st_size > 1000
