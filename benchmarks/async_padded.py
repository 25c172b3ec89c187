"""Lockstep against asynchronous agents, real trainer and agents, device time padded.

    python benchmarks/async_padded.py [--steps 20] [--scale 3] [--work /tmp/async_padded]
                                      [--results benchmarks/results/async_padded.md]

The CPU demo's pair (data/demo_agents/, 3-digit addition, 16 prompts x 8 samples a step) runs
through `python -m recipe_hacpo.main`, Ray, FSDP and the hf rollout backend, with every device
phase of every agent slept out to a set duration (`trainer.device_pad_s`): `--scale` x the
recorded demo's median of that agent's phase (tests/fixtures/recorded_runs/cpu_demo_metrics.jsonl),
so that waiting, not the two CPU cores the agents share, sets the step. Two pairs:
1. the demo pair with those pads, and
2. a 1 : 3 pair: the same, the second agent's pads tripled.
Each runs lockstep (`trainer.total_training_steps=--steps`) and asynchronously on the wall clock
(`trainer.async.enable=true`, stop=slowest: until the slow agent made --steps steps). Printed per
run: wall time to the stop rule (the trainer's own: Σ timing_s/step, or async/end_s), each
pool's busy fraction, steps per agent, cross lags; beside them what the time model predicts for
the same pads (its lockstep rule, and the virtual clock of recipe_hacpo/asynchronous/ with the
pads as costs and the recorded driver phases).

What the padding leaves out: the driver's scoring and re-tokenization are real CPU work, not padded.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from async_prediction import median_costs  # noqa: E402

from recipe_hacpo.asynchronous.simulate import costs_with_driver, simulate  # noqa: E402
from recipe_hacpo.cluster.time_model import lockstep_step_time  # noqa: E402

AGENTS = {"qwen_char": "data/demo_agents/qwen2-char-small_add3_1500_s0",
          "llama_pair": "data/demo_agents/llama-pair-medium_add3_1200_s0"}
PADDED = ("gen", "old_log_prob", "update_actor", "update_weights")


def overrides(pads: dict[str, dict[str, float]], steps: int, out: str, asynchronous: bool) -> list[str]:
    args = ["--config-name", "hacpo_cpu_demo", "trainer.logger=[console,file]", f"trainer.default_local_dir={out}/ckpt",
            f"hydra.run.dir={out}/hydra", "trainer.progress_bar=false", "trainer.resume_mode=disable",
            "data.train_files=data/arith_add3_train.parquet", "data.val_files=data/arith_add3_test.parquet",
            "data.train_batch_size=16", "data.max_prompt_length=48", "data.max_response_length=8",
            "actor_rollout_ref.actor.ppo_mini_batch_size=16", "actor_rollout_ref.actor.optim.lr=1e-4",
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=128",
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=128", "actor_rollout_ref.rollout.max_num_seqs=512",
            "actor_rollout_ref.rollout.temperature=1.0", f"trainer.total_training_steps={steps}",
            "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.save_freq=-1"]
    for name, path in AGENTS.items():
        args += [f"agents.{name}.model_path={os.path.join(REPO, path)}", f"agents.{name}.rollout_n=8"]
        args += [f"+trainer.device_pad_s.{name}.{p}={s:.4f}" for p, s in pads[name].items()]
    if asynchronous:
        args += ["trainer.async.enable=true", "trainer.async.clock=wall", "trainer.async.stop=slowest"]
    return args


def run(pads, steps: int, out: str, asynchronous: bool) -> list[dict]:
    os.makedirs(out, exist_ok=True)
    metrics = os.path.join(out, "metrics.jsonl")
    if os.path.exists(metrics):
        os.remove(metrics)
    env = dict(os.environ, VERL_FILE_LOGGER_PATH=metrics, HACPO_DATA_DIR=os.path.join(REPO, "data"))
    with open(os.path.join(out, "log.txt"), "w") as log:
        proc = subprocess.run([sys.executable, "-m", "recipe_hacpo.main", *overrides(pads, steps, out, asynchronous)],
                              cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({proc.returncode}): {out}/log.txt")
    with open(metrics) as f:
        return [json.loads(line) for line in f]


def lockstep_figures(records: list[dict], names: list[str]) -> dict:
    steps = [r["data"] for r in records if "training/global_step" in r["data"]]
    total = sum(d["timing_s/step"] for d in steps)
    busy = {n: sum(v for d in steps for k, v in d.items() if k.startswith(f"agent/{n}/timing_s/")) / total for n in names}
    return {"wall_s": total, "busy": busy, "steps": {n: len(steps) for n in names}, "lags": []}


def async_figures(records: list[dict], names: list[str]) -> dict:
    end = next(r["data"] for r in reversed(records) if "async/end_s" in r["data"])
    lags = [r["data"][f"agent/{n}/async/cross_lag_max"] for r in records for n in names
            if r["data"].get(f"agent/{n}/async/peers_taken", 0) > 0]
    joint = [r["data"][f"agent/{n}/async/joint_frac"] for r in records for n in names
             if r["data"].get(f"agent/{n}/async/peers_taken", 0) > 0]
    return {"wall_s": end["async/end_s"], "busy": {n: end[f"agent/{n}/async/pool_busy_frac"] for n in names},
            "steps": {n: int(end[f"agent/{n}/async/steps"]) for n in names}, "lags": lags,
            "joint": statistics.mean(joint) if joint else 0.0}


def predicted(pads, driver: dict[str, float], steps: int) -> tuple[dict, dict]:
    step = lockstep_step_time(pads, driver)
    lock = {"wall_s": steps * step, "busy": {n: sum(p.values()) / step for n, p in pads.items()},
            "steps": {n: steps for n in pads}}
    sim = simulate(costs_with_driver(pads, driver), steps, stop="slowest")
    lags = sim.lags()
    return lock, {"wall_s": sim.timeline.end, "busy": sim.busy(), "steps": dict(sim.steps),
                  "lags": lags}


def row(label: str, f: dict, names: list[str]) -> str:
    lags = f.get("lags") or []
    lag = f"{statistics.mean(lags):.2f} / {max(lags):.0f}" if lags else "–"
    return (f"| {label} | {f['wall_s']:.1f} | " + " | ".join(f"{100 * f['busy'][n]:.0f} %" for n in names)
            + " | " + " | ".join(str(f["steps"][n]) for n in names) + f" | {lag} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--scale", type=float, default=3.0)
    ap.add_argument("--work", default="/tmp/async_padded")
    ap.add_argument("--results", default=os.path.join(REPO, "benchmarks", "results", "async_padded.md"))
    ap.add_argument("--metrics", default=os.path.join(REPO, "tests/fixtures/recorded_runs/cpu_demo_metrics.jsonl"))
    args = ap.parse_args()
    recorded, driver = median_costs(args.metrics)
    base = {n: {p: args.scale * s for p, s in recorded[n].items() if p in PADDED} for n in AGENTS}
    first, second = list(AGENTS)
    pairs = {"demo pair": base,
             "1 : 3 pair": {first: base[first], second: {p: 3 * s for p, s in base[second].items()}}}
    names = list(AGENTS)
    lines = [
        "# Lockstep against asynchronous agents, real trainer, device time padded",
        "",
        f"Command: `python benchmarks/async_padded.py --steps {args.steps} --scale {args.scale:g}`",
        "",
        f"Machine: {os.cpu_count()} CPU cores, {platform.platform()}, Python {platform.python_version()}; "
        f"made on {time.strftime('%Y-%m-%d %H:%M')}.",
        "",
        "Wall time is the trainer's own (Σ timing_s/step, or async/end_s), from the first step to the stop rule "
        "(the slow agent's last step); busy = a pool's padded device phases / wall time. Predictions: the time "
        "model's lockstep rule and the virtual clock of recipe_hacpo/asynchronous/ fed with the same pads and the "
        "recorded driver phases (" + ", ".join(f"{p} {s:.3f} s" for p, s in driver.items()) + ").",
    ]
    for label, pads in pairs.items():
        lines += ["", f"## {label}", "", "Pads (s): " + "; ".join(
            f"{n}: " + ", ".join(f"{p} {s:.2f}" for p, s in ph.items()) for n, ph in pads.items()), "",
            "| run | wall s | " + " | ".join(f"busy {n}" for n in names) + " | " + " | ".join(f"steps {n}" for n in names)
            + " | cross lag mean / max |",
            "|---|---|" + "---|" * (2 * len(names)) + "---|"]
        slug = label.replace(" ", "_").replace(":", "")
        lock = lockstep_figures(run(pads, args.steps, os.path.join(args.work, slug, "lockstep"), False), names)
        asy = async_figures(run(pads, args.steps, os.path.join(args.work, slug, "async"), True), names)
        p_lock, p_async = predicted(pads, driver, args.steps)
        lines += [row("lockstep, measured", lock, names), row("lockstep, predicted", p_lock, names),
                  row("asynchronous, measured", asy, names), row("asynchronous, predicted", p_async, names)]
        lines += ["", f"Asynchronous / lockstep wall time: measured {asy['wall_s'] / lock['wall_s']:.2f}x, "
                  f"predicted {p_async['wall_s'] / p_lock['wall_s']:.2f}x; measured against predicted: lockstep "
                  f"{lock['wall_s'] / p_lock['wall_s'] - 1:+.1%}, asynchronous {asy['wall_s'] / p_async['wall_s'] - 1:+.1%}. "
                  f"Joint groups among the peer entries taken: {100 * asy['joint']:.0f} %."]
        print("\n".join(lines[-8:]), flush=True)
    os.makedirs(os.path.dirname(args.results), exist_ok=True)
    with open(args.results, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"written: {args.results}")


if __name__ == "__main__":
    main()
