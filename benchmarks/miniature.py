"""HACPO against its baselines in miniature, on CPU, through the real trainer.

    python benchmarks/miniature.py                 # main table (4 arms x 3 seeds), ablations, cost profile
    python benchmarks/miniature.py --smoke --work /tmp/smoke --results /tmp/smoke/results

Every run is `python -m recipe_hacpo.main --config-name hacpo_cpu_demo <overrides>` in its own
process (its own Ray session), so nothing of one run survives into the next. Agents are warm
started once (recipe_hacpo.warm_start) and reused by every arm and seed. Held-out accuracy is
the trainer's own validation: greedy decoding of the 1024 held-out add3 prompts, scored by the
trainer's verifier. A run whose summary exists in the work directory is not run again.

Writes into --results: miniature.md (tables, command, machine), cost_profile.md,
learning_curve.png, runs.json (every run's summary).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import json
import os
import shlex
import subprocess
import sys
import threading
import time

from mini.agents import AGENTS, PAIRS, warm_agents
from mini.arms import ABLATIONS, ALL_ARMS, ARMS, FAMILY_ARMS
from mini.common import REPO, log
from mini.plot import write_plot
from mini.report import write_cost_profile, write_report
from mini.runs import Setup, cached_run, held_out_file, restore_cache, run_one


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="/tmp/hacpo_bench", help="agents, run logs and checkpoints")
    p.add_argument("--results", default=os.path.join(REPO, "benchmarks", "results"))
    p.add_argument("--pair", default="model_m18b", choices=sorted(PAIRS))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--lr-schedule", choices=("constant", "cosine"), default="constant",
                   help="the actors' learning rate over the steps: constant, or cosine decay from --lr to 0")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--val-every", type=int, default=20)
    p.add_argument("--val-rows", type=int, default=1024)
    p.add_argument("--micro", type=int, default=512, help="micro-batch rows for log-probs and updates")
    p.add_argument("--mini-batches", type=int, default=1, help="optimizer updates per step (prompts split evenly)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--arms", default=",".join(ARMS),
                   help="comma list of main arms, or 'families': both families side by side (GSPO, GSPO×2, GSPO×4, "
                        "Naive, HACPO, HACPO on GRAFT's selection; GRPO, GRPO×2, GRPO×4, GRAFT, SGT)")
    p.add_argument("--ablations", default=",".join(ABLATIONS), help="comma list of ablation arms, or 'none'")
    p.add_argument("--ablation-seeds", type=int, nargs="+", default=[0])
    p.add_argument("--ablation-steps", type=int, default=0,
                   help="steps of the ablation runs (0: --steps); must be a multiple of --val-every")
    p.add_argument("--extra-pairs", default="none",
                   help="comma list of other pairs (kinds of heterogeneity: state,size); `pair:N` runs that pair "
                        "with seeds 0..N-1 instead of --extra-seeds")
    p.add_argument("--extra-arms", default="gspo,gspo2x,hacpo", help="comma list of arms run for the other pairs")
    p.add_argument("--extra-seeds", type=int, nargs="+", default=[0, 1, 2], help="seeds of the other pairs")
    p.add_argument("--reading", default="", help="a Markdown file: the plain reading of the results, put in the report")
    p.add_argument("--budget-min", type=float, default=0, help="stop starting new runs after this many minutes (0: no limit)")
    p.add_argument("--parallel", type=int, default=1, help="runs at once (each its own Ray session)")
    p.add_argument("--run-timeout", type=int, default=1800)
    p.add_argument("--note", action="append", default=[], help="a line for the results' notes")
    p.add_argument("--report-only", action="store_true", help="start no run; report the cached runs")
    p.add_argument("--made-by", default="", help="with --report-only: the command that made the cached runs")
    p.add_argument("--smoke", action="store_true", help="CI: 1 arm, 1 seed, 2 steps, tiny agents and eval")
    a = p.parse_args(argv)

    args = list(argv if argv is not None else sys.argv[1:])
    if "--made-by" in args:
        del args[args.index("--made-by"):args.index("--made-by") + 2]
    command = "python benchmarks/miniature.py " + shlex.join(args)
    if a.report_only and a.made_by:
        command = f"{a.made_by}`; tables rebuilt from its cached runs by `{command} --made-by ..."
    if a.smoke:
        a.steps, a.prompts, a.group, a.val_every, a.val_rows = 2, 4, 2, 2, 16
        a.seeds, a.arms, a.ablations, a.micro = [0], "hacpo", "none", 64
    started = time.time()
    os.makedirs(a.results, exist_ok=True)
    os.makedirs(a.work, exist_ok=True)
    if a.mini_batches < 1 or a.prompts % a.mini_batches:
        p.error(f"--prompts {a.prompts} must split into --mini-batches {a.mini_batches} equal parts")
    if a.reading and not os.path.isfile(a.reading):
        p.error(f"--reading {a.reading}: no such file")
    setup = Setup(a.steps, a.prompts, a.group, a.lr, a.temperature, a.val_every, a.val_rows, a.micro, a.mini_batches,
                  held_out_file(a.work, a.val_rows), a.lr_schedule)
    restored = restore_cache(a.work, os.path.join(a.results, "runs.json"))
    if restored:
        log(f"{restored} run summaries restored from {a.results}/runs.json into {a.work}/runs")
    extra_seeds = {}  # pair -> its seeds
    for item in ([] if a.extra_pairs == "none" else a.extra_pairs.split(",")):
        name, _, count = item.partition(":")
        if name not in PAIRS or (count and not count.isdigit()):
            p.error(f"--extra-pairs {item!r}: expected one of {sorted(PAIRS)}, optionally with :<number of seeds>")
        extra_seeds[name] = list(range(int(count))) if count else a.extra_seeds
    extra = list(extra_seeds)
    keys = sorted({k for pr in [a.pair, *extra] for k in PAIRS[pr]}, key=list(AGENTS).index)
    agents = warm_agents(keys, os.path.join(a.work, "agents"), a.smoke)

    plan = []  # (pair, arm, seed): main table seed-major, then ablations, then extra pairs
    main_arms = [] if a.arms == "none" else list(FAMILY_ARMS) if a.arms == "families" else [k for k in a.arms.split(",") if k]
    for seed in a.seeds:
        plan += [(a.pair, k, seed) for k in main_arms]
    abl = [] if a.ablations == "none" else [k for k in a.ablations.split(",") if k]
    for flag, keys in (("--arms", main_arms), ("--ablations", abl), ("--extra-arms", a.extra_arms.split(","))):
        unknown = [k for k in keys if k and k not in ALL_ARMS]
        if unknown:
            p.error(f"{flag}: unknown arm(s) {', '.join(unknown)}; known: {', '.join(ALL_ARMS)}")
    for seed in a.ablation_seeds:
        plan += [(a.pair, k, seed) for k in abl]
    for seed in sorted({s for seeds in extra_seeds.values() for s in seeds}):
        plan += [(pr, k, seed) for pr in extra if seed in extra_seeds[pr] for k in a.extra_arms.split(",") if k]

    notes = list(a.note)
    reading = ""
    if a.reading:
        with open(a.reading) as f:
            reading = f.read()
    summaries, skipped, failed = [], [], []
    lock = threading.Lock()

    def report() -> None:
        summaries.sort(key=lambda r: plan.index((r["pair"], r["arm"], r["seed"])))
        with open(os.path.join(a.results, "runs.json"), "w") as f:
            json.dump(summaries, f)
        extra_notes = [f"not run in this invocation (--report-only or time budget): {', '.join(skipped)}"] if skipped else []
        write_report(os.path.join(a.results, "miniature.md"), summaries, agents, setup, command, a.seeds,
                     notes + extra_notes, started, a.pair, reading, main_arms)
        write_cost_profile(os.path.join(a.results, "cost_profile.md"), summaries, setup, command, a.pair, a.parallel,
                           main_arms)
        for pr in sorted({s["pair"] for s in summaries}):
            name = "learning_curve.png" if pr == a.pair else f"learning_curve_{pr}.png"
            write_plot(os.path.join(a.results, name), summaries, agents, pr)

    def job(i: int) -> None:
        pr, arm, seed = plan[i]
        run_setup = setup
        if arm in ABLATIONS and a.ablation_steps and a.ablation_steps != setup.steps:
            run_setup = dataclasses.replace(setup, steps=a.ablation_steps, val_every=a.ablation_steps)
        cached = cached_run(a.work, pr, arm, seed, run_setup) is not None
        if not cached and (a.report_only or (a.budget_min and (time.time() - started) / 60 > a.budget_min)):
            with lock:
                skipped.append(f"{pr}/{arm}/seed {seed}")
            return
        pair_agents = [agents[k] for k in PAIRS[pr]]
        try:
            summary = run_one(arm, seed, pair_agents, run_setup, a.work, pr, first=(i == 0), timeout=a.run_timeout)
        except (RuntimeError, subprocess.TimeoutExpired) as err:
            log(f"FAILED: {err}")
            with lock:
                failed.append(i)
                notes.append(f"run {pr}/{arm}/seed {seed} failed: {err}")
            return
        with lock:
            summaries.append(summary)
            report()

    with cf.ThreadPoolExecutor(max_workers=max(1, a.parallel)) as pool:
        list(pool.map(job, range(len(plan))))
    with lock:
        report()
    log(f"done in {(time.time() - started) / 60:.1f} min; results in {a.results}")
    return 0 if summaries and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
