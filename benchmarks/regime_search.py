"""Where do extra rollouts matter? GSPO (G) against GSPO×2 (2G) in every setting measured.

    python benchmarks/regime_search.py                                  # report the committed runs
    python benchmarks/regime_search.py --collect /tmp/hacpo_bench ...   # add the runs of work folders

The regime test of the main table (`mini.report.regime_table`) asks, per agent, whether GSPO×2
beats GSPO by at least 3 standard deviations of the paired-by-seed difference. This script
applies it to every setting that has both arms (pair, G, learning rate, steps, prompts, updates
per step), from `benchmarks/results/runs.json` (the main benchmark's runs) and
`benchmarks/results/regime_runs.json` (the GSPO / GSPO×2 runs of settings probed while looking
for a regime; `--collect` adds a work folder's runs to it), and writes regime_search.md.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
from collections import defaultdict

from mini.agents import AGENTS
from mini.common import REPO
from mini.arms import ALL_ARMS
from mini.report import regime_table
from mini.runs import SHIPPED_VAL_ROWS, UNRECORDED

RESULTS = os.path.join(REPO, "benchmarks", "results")
REGIME_ARMS = ("gspo", "gspo2x")
# a setting: what both arms share (the GSPO×2 run's group is twice --group)
SETTING_KEYS = ("agents", "steps", "prompts", "lr", "temperature", "mini_batches", "val_rows", "lr_schedule")


def _value(run: dict, key: str):
    return run.get(key, UNRECORDED.get(key))
AGENT_NAMES = {a.run_id: key for key, a in AGENTS.items()}


def load(paths: list[str]) -> list[dict]:
    """The GSPO / GSPO×2 runs of `paths`, each once (a main-table run may also sit in regime_runs.json)."""
    runs: dict[str, dict] = {}
    for path in paths:
        if os.path.exists(path):
            with open(path) as f:
                for r in json.load(f):
                    if r.get("arm") in REGIME_ARMS:
                        runs.setdefault(_identity(r), r)
    return list(runs.values())


def collect(work_dirs: list[str], into: str) -> int:
    """Add the GSPO / GSPO×2 summaries of `work_dirs` to `into` (a run already there is kept)."""
    kept = load([into])
    seen = {_identity(r) for r in kept}
    added = 0
    for work in work_dirs:
        for path in sorted(glob.glob(os.path.join(work, "runs", "*", "summary.json"))):
            with open(path) as f:
                run = json.load(f)
            if run.get("arm") in REGIME_ARMS and _identity(run) not in seen:
                # per-step timings and sharing diagnostics say nothing here (GSPO shares nothing)
                kept.append({k: v for k, v in run.items() if k not in ("timing", "diagnostics")})
                seen.add(_identity(run))
                added += 1
    with open(into, "w") as f:
        json.dump(kept, f, indent=1)
    return added


def _identity(run: dict) -> str:
    return json.dumps([run["arm"], run["seed"], run["group"], *(_value(run, k) for k in SETTING_KEYS)])


def settings(runs: list[dict]) -> dict[tuple, list[dict]]:
    """Runs grouped by setting; G is the GSPO run's group."""
    out: dict[tuple, list[dict]] = defaultdict(list)
    for r in runs:
        base_group = r["group"] // ALL_ARMS[r["arm"]].group_mult
        out[(tuple(r["agents"]), base_group, *(_value(r, k) for k in SETTING_KEYS[1:]))].append(r)
    return {k: v for k, v in out.items() if {r["arm"] for r in v} == set(REGIME_ARMS)}


def setting_title(key: tuple) -> str:
    agents, group, steps, prompts, lr, temperature, mini_batches, val_rows, lr_schedule = key
    who = " + ".join(AGENT_NAMES.get(a, a) for a in agents)
    held_out = "" if val_rows == SHIPPED_VAL_ROWS else f", scored on {val_rows} held-out prompts"
    decay = "" if lr_schedule == "constant" else f" ({lr_schedule} decay to 0)"
    return (f"{who}: G = {group} against 2G = {2 * group}, lr {lr:g}{decay}, {steps} steps, {prompts} prompts a step, "
            f"temperature {temperature:g}, `--mini-batches {mini_batches}`{held_out}")


def report(runs: list[dict]) -> str:
    found = settings(runs)
    keys = sorted(found, key=lambda k: (k[0], k[1], k[2], k[4]))
    sections, verdicts = [], []
    for key in keys:
        group = found[key]
        body, ok = regime_table(group, group[0]["names"])
        verdicts.append(f"| {setting_title(key)} | {len({r['seed'] for r in group})} | {'yes' if ok else 'no'} |")
        sections += [f"### {setting_title(key)}", "", *body, ""]
    used = sorted({a for k in keys for a in k[0]}, key=lambda d: list(AGENT_NAMES).index(d) if d in AGENT_NAMES else 99)
    return "\n".join([
        "# Regime search: does GSPO×2 (2G) beat GSPO (G)?", "",
        "Made by `python benchmarks/regime_search.py` from `runs.json` (the main benchmark's runs) and "
        "`regime_runs.json` (the GSPO and GSPO×2 runs of the other settings tried). Accuracy is the held-out "
        "accuracy after the last step (greedy, on 1024 held-out add3 prompts unless the setting says more); differences are paired by seed. The regime "
        "test asks for a mean gain of at least 3 standard deviations of the per-seed differences on every "
        "agent; `mean / s.e.` is the same mean in standard errors (std / √seeds), which says how sure its sign "
        "is, not how reliably each seed gains. Every arm updates on the same number of rows, so GSPO×2 makes "
        "twice GSPO's updates. GSPO trains each agent alone: an agent's rows repeat in every pair run with the "
        "same settings.", "",
        "Agents: " + "; ".join(f"{AGENT_NAMES[d]} = `{d}`" if d in AGENT_NAMES else f"`{d}`" for d in used)
        + " (see `benchmarks/mini/agents.py`).", "",
        "| setting | seeds | every agent ≥ 3 std? |", "|---|---|---|", *verdicts, "",
        *sections,
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", nargs="+", default=[os.path.join(RESULTS, "runs.json"), os.path.join(RESULTS, "regime_runs.json")])
    p.add_argument("--collect", nargs="*", default=[], help="work folders whose GSPO / GSPO×2 runs join regime_runs.json")
    p.add_argument("--into", default=os.path.join(RESULTS, "regime_runs.json"))
    p.add_argument("--out", default=os.path.join(RESULTS, "regime_search.md"))
    a = p.parse_args(argv)
    if a.collect:
        print(f"{collect(a.collect, a.into)} runs added to {a.into}")
    text = report(load(a.runs))
    with open(a.out, "w") as f:
        f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
