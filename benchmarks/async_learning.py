"""Does it still learn? Lockstep against asynchronous agents at a 1 : 3 step cost, in virtual time.

    python benchmarks/async_learning.py [--seeds 5 6 7] [--work /tmp/async_learning]
                                        [--results benchmarks/results/async_learning]

The families benchmark's pair and setting (benchmarks/README.md: pair `model_m18b`, 20 steps,
128 prompts, G = 2, four updates a step, lr 1e-4, 4,096 held-out prompts), HACPO and Naive
sharing, each run:
- lockstep: the families benchmark's own runs (benchmarks/results/families/runs.json, the same
  seeds and setting), reused, not rerun;
- asynchronous (`mini/arms.py::ASYNC_ARMS`): on the virtual clock, the llama agent takes 3 virtual
  seconds a step and the qwen agent 1, both step on until the llama agent made 20 steps
  (stop=slowest), K = 4, window 4. The qwen agent makes about 60 steps meanwhile.
Each agent is validated at its own steps 20, 40, 60 (held-out greedy accuracy, mean@1).

Two comparisons per agent, paired by seed:
- at equal per-agent steps: the agent's accuracy after its 20th step, lockstep against asynchronous;
- at equal virtual wall time: after 20 llama steps (60 virtual seconds; lockstep's 20 steps take as
  long, each step waiting for the llama agent), each agent's accuracy at the end of the run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from mini.agents import PAIRS, warm_agents  # noqa: E402
from mini.arms import ASYNC_ARMS  # noqa: E402
from mini.common import REPO, log  # noqa: E402
from mini.runs import Setup, held_out_file, run_one  # noqa: E402

PAIR = "model_m18b"
LOCKSTEP = {"hacpo_async3": "hacpo", "naive_async3": "naive"}


def last_val(val: dict[str, float]) -> tuple[int, float]:
    step = max(int(s) for s in val)
    return step, val[str(step)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[5, 6, 7])
    ap.add_argument("--work", default="/tmp/async_learning")
    ap.add_argument("--results", default=os.path.join(REPO, "benchmarks", "results", "async_learning"))
    ap.add_argument("--families", default=os.path.join(REPO, "benchmarks", "results", "families", "runs.json"))
    ap.add_argument("--run-timeout", type=int, default=3600)
    a = ap.parse_args()
    os.makedirs(a.results, exist_ok=True)
    # the families setting; validation every 20 steps (the asynchronous qwen agent makes ~60)
    setup = Setup(20, 128, 2, 1e-4, 1.0, 20, 4096, 512, 4, held_out_file(a.work, 4096), "constant")
    agents = warm_agents(list(PAIRS[PAIR]), os.path.join(a.work, "agents"), False)
    pair_agents = [agents[k] for k in PAIRS[PAIR]]
    with open(a.families) as f:
        lockstep = {(s["arm"], s["seed"]): s for s in json.load(f) if s["pair"] == PAIR}
    cache = os.path.join(a.results, "runs.json")
    done = {}
    if os.path.exists(cache):
        with open(cache) as f:
            done = {(s["arm"], s["seed"]): s for s in json.load(f)}
    for seed in a.seeds:
        for arm in ASYNC_ARMS:
            if (arm, seed) in done:
                log(f"{arm}/seed {seed}: cached in {cache}")
                continue
            done[(arm, seed)] = run_one(arm, seed, pair_agents, setup, a.work, PAIR, first=False, timeout=a.run_timeout)
            with open(cache, "w") as f:
                json.dump(list(done.values()), f)
    names = pair_agents[0]["agent"].name, pair_agents[1]["agent"].name
    lines = ["# Lockstep against asynchronous agents at a 1 : 3 step cost: held-out accuracy", "",
             "Command: `python benchmarks/async_learning.py --seeds " + " ".join(map(str, a.seeds)) + "`", "",
             f"Pair `{PAIR}` ({', '.join(names)}); the families setting (20 steps of the slow agent, 128 prompts, G = 2, "
             "4 updates a step, lr 1e-4, 4,096 held-out prompts, greedy mean@1). Lockstep runs: "
             "benchmarks/results/families/runs.json. Asynchronous: virtual clock, llama_pair 3 s a step, the other "
             "agent 1 s, stop=slowest, K = 4, prompt window 4. Accuracy in %; Δ = asynchronous − lockstep, paired "
             "by seed (mean ± std over seeds).", ""]
    for arm, lock_arm in LOCKSTEP.items():
        lines += [f"## {ASYNC_ARMS[arm].label} against lockstep", "",
                  "| agent | seed | lockstep @20 | async @20 (own steps) | async at the end (its steps) |",
                  "|---|---|---|---|---|"]
        deltas = {n: {"steps": [], "time": []} for n in names}
        for seed in a.seeds:
            if (arm, seed) not in done or (lock_arm, seed) not in lockstep:
                continue
            run, ref = done[(arm, seed)], lockstep[(lock_arm, seed)]
            for n in names:
                lock20 = ref["val"][n]["20"]
                at20 = run["val"][n].get("20")
                end_step, end = last_val(run["val"][n])
                lines.append(f"| {n} | {seed} | {100 * lock20:.1f} | "
                             + ("–" if at20 is None else f"{100 * at20:.1f}") + f" | {100 * end:.1f} ({end_step}) |")
                if at20 is not None:
                    deltas[n]["steps"].append(at20 - lock20)
                deltas[n]["time"].append(end - lock20)
        lines.append("")
        for n in names:
            for what, label in (("steps", "at equal per-agent steps (20)"), ("time", "at equal virtual wall time")):
                d = deltas[n][what]
                if d:
                    sd = statistics.stdev(d) if len(d) > 1 else 0.0
                    lines.append(f"- {n}, {label}: Δ {100 * statistics.mean(d):+.1f} ± {100 * sd:.1f} points "
                                 f"({sum(x > 0 for x in d)} of {len(d)} seeds higher)")
        lines.append("")
    for (arm, seed), run in sorted(done.items()):
        steps = {n: last_val(run["val"][n])[0] for n in names}
        lines.append(f"- {arm} seed {seed}: validated up to steps {steps}; wall {run['wall_s']:.0f} s on this machine")
    out = os.path.join(a.results, "async_learning.md")
    with open(out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
