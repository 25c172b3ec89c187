"""Time a HACPO step of this checkout against an older commit, side by side, same seeds.

    python benchmarks/step_speed.py --baseline 8a0c8d0 --steps 14 --rounds 2 --work /tmp/step_speed

Runs the miniature benchmark's HACPO configuration (`mini.runs.run_overrides`: agents A + B,
16 prompts/step, G = 8, lr 1e-4, seed 0) for `--steps` steps, alternating baseline and
current (baseline, current, baseline, current, ...), one process and Ray session per run.
The baseline is the package exported from `--baseline` with `git archive` into
`<work>/baseline/` and imported from there (the editable install of this checkout is kept
out of that run's processes). Prints, per variant, the median and minimum over every step
but each run's first (warm-up) of each `timing_s/*` phase, the per-run medians, and whether
the two variants' per-step train rewards and response lengths are identical (same seeded
samples), then writes everything to `<work>/step_speed.json`.

Agents: `--agents smoke` uses the smoke-test warm starts (seconds to build);
`--agents full` the benchmark's (tens of minutes on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))
sys.path.insert(0, REPO)

from mini.agents import warm_agents  # noqa: E402
from mini.arms import ARMS  # noqa: E402
from mini.common import DATA_DIR, log, machine  # noqa: E402
from mini.report import PHASES  # noqa: E402
from mini.runs import Setup, run_overrides  # noqa: E402

# run in the baseline's processes only (Ray workers included, through PYTHONPATH): drop the
# editable-install finder so that `recipe_hacpo` resolves to the exported tree
_SITECUSTOMIZE = """import sys
sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")]
"""


def export_baseline(commit: str, dest: str) -> str:
    """`git archive` of `commit`, laid out as an importable `recipe_hacpo` package; returns its root."""
    src = os.path.join(dest, "src")
    pkg = os.path.join(dest, "pkg")
    shutil.rmtree(dest, ignore_errors=True)
    os.makedirs(src)
    archive = subprocess.run(["git", "-C", REPO, "archive", commit], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", src], input=archive, check=True)
    shutil.copytree(os.path.join(src, "recipe_hacpo"), os.path.join(pkg, "recipe_hacpo"))
    for sub in ("workers", "reward", "configs"):  # pyproject's package-dir mapping
        shutil.copytree(os.path.join(src, sub), os.path.join(pkg, "recipe_hacpo", sub))
    with open(os.path.join(pkg, "sitecustomize.py"), "w") as f:
        f.write(_SITECUSTOMIZE)
    return pkg


def run(name: str, cwd: str, extra_env: dict, agents: list[dict], setup: Setup, run_dir: str) -> dict:
    os.makedirs(run_dir, exist_ok=True)
    metrics_file = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(metrics_file):
        os.remove(metrics_file)
    overrides = run_overrides(ARMS["hacpo"], 0, agents, setup, run_dir, first=False)
    cmd = [sys.executable, "-m", "recipe_hacpo.main", "--config-name", "hacpo_cpu_demo", *overrides]
    env = dict(os.environ, VERL_FILE_LOGGER_PATH=metrics_file, HACPO_DATA_DIR=DATA_DIR, **extra_env)
    start = time.perf_counter()
    with open(os.path.join(run_dir, "log.txt"), "w") as log_file:
        rc = subprocess.run(cmd, cwd=cwd, env=env, stdout=log_file, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - start
    if rc != 0:
        raise RuntimeError(f"{name} run failed (rc {rc}); see {run_dir}/log.txt")
    with open(metrics_file) as f:
        steps = [r["data"] for r in map(json.loads, filter(str.strip, f)) if "training/global_step" in r["data"]]
    log(f"{name}: {len(steps)} steps, wall {wall:.0f}s, load average {os.getloadavg()}")
    return {"wall_s": wall, "steps": steps, "load_avg_after": os.getloadavg()}


def phase_table(runs: list[dict]) -> dict[str, dict]:
    out = {}
    for ph in PHASES:
        per_run = [[s[f"timing_s/{ph}"] for s in r["steps"][1:] if f"timing_s/{ph}" in s] for r in runs]
        values = [v for vals in per_run for v in vals]
        if values:
            out[ph] = {"median": statistics.median(values), "min": min(values),
                       "run_medians": [statistics.median(v) for v in per_run]}
    return out


def samples_signature(run: dict) -> list:
    """Per step, every agent's mean train reward and response length (equal iff the same rollouts, in practice)."""
    return [sorted((k, v) for k, v in s.items() if k.endswith(("/reward/mean", "/response_length/mean")))
            for s in run["steps"]]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", required=True, help="git commit to compare against")
    p.add_argument("--steps", type=int, default=14)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--agents", choices=["smoke", "full"], default="smoke")
    p.add_argument("--work", default="/tmp/step_speed")
    a = p.parse_args(argv)
    smoke = a.agents == "smoke"
    warm = warm_agents(["A", "B"], os.path.join(a.work, "agents" + ("_smoke" if smoke else "")), smoke)
    agents = [warm["A"], warm["B"]]
    setup = Setup(a.steps, 16, 8, 1e-4, 1.0, a.steps, 64, 512)
    pkg = export_baseline(a.baseline, os.path.join(a.work, "baseline"))
    variants = {"baseline": (pkg, {"PYTHONPATH": pkg}), "current": (REPO, {})}
    runs = {name: [] for name in variants}
    for r in range(a.rounds):
        for name, (cwd, env) in variants.items():
            runs[name].append(run(name, cwd, env, agents, setup, os.path.join(a.work, "runs", f"{name}_{r}")))
    result = {"machine": machine(), "baseline": a.baseline, "argv": sys.argv[1:],
              "phases": {name: phase_table(v) for name, v in runs.items()},
              "same_samples": [samples_signature(b) == samples_signature(c)
                               for b, c in zip(runs["baseline"], runs["current"])],
              "runs": runs}
    with open(os.path.join(a.work, "step_speed.json"), "w") as f:
        json.dump(result, f)
    for name, table in result["phases"].items():
        print(f"== {name}")
        for ph, t in table.items():
            per_run = [round(x, 3) for x in t["run_medians"]]
            print(f"  {ph:15s} median {t['median']:.3f}  min {t['min']:.3f}  per-run {per_run}")
    step = {name: t["step"]["median"] for name, t in result["phases"].items()}
    print(f"step current / baseline: {step['current'] / step['baseline']:.3f}")
    print(f"same per-step rewards and response lengths in every round: {all(result['same_samples'])}")
    print(f"machine: {result['machine']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
