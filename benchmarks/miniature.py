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
import dataclasses
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import threading
import time
import concurrent.futures as cf
from dataclasses import dataclass, field

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

DATA_DIR = os.path.join(REPO, "data")
TRAIN_FILE = os.path.join(DATA_DIR, "arith_add3_train.parquet")
VAL_FILE = os.path.join(DATA_DIR, "arith_add3_test.parquet")
VAL_SOURCE = "hacpo/arith/add3"


# ----------------------------------------------------------------------------- agents
@dataclass(frozen=True)
class Agent:
    name: str  # agent name in the trainer (metrics prefix)
    kind: str  # recipe_hacpo.tiny_agents kind
    steps: int  # supervised warm-start steps (on top of `init`'s, if any)
    seed: int
    dirname: str
    init: str = ""  # key of the agent this one continues from
    n_train: int = 50_000


AGENTS = {
    # A: Qwen2-style, hidden 64, 2 layers, character tokenizer, 1000 SFT steps. Its held-out
    # accuracy jumps between steps 950 (2.5 %) and 1000 (58 %); no step count lands in between.
    "A": Agent("qwen_small", "qwen2-char-small", 1000, 0, "A_qwen_char_small_1000"),
    # A0: the same run (seed, data order) stopped at 950 steps, so A0 is A's own earlier state
    # (state heterogeneity against A)
    "A0": Agent("qwen_small_early", "qwen2-char-small", 950, 0, "A_qwen_char_small_950"),
    # B0 -> B: Llama-style, hidden 96, 3 layers, digit-pair tokenizer, 1000 + 2000 SFT steps
    # (model + tokenizer + size against A)
    "B0": Agent("llama_pair_early", "llama-pair-medium", 1000, 0, "B_llama_pair_medium_1000"),
    "B": Agent("llama_pair", "llama-pair-medium", 2000, 0, "B_llama_pair_medium_3000", init="B0"),
    # C: Qwen2-style, hidden 96, 3 layers, character tokenizer (size against A)
    "C": Agent("qwen_medium", "qwen2-char-medium", 1000, 0, "C_qwen_char_medium_1000"),
}

PAIRS = {
    "model": ("A", "B"),  # different architecture, tokenizer and size: the main table
    "state": ("A", "A0"),
    "size": ("A", "C"),
}


# ----------------------------------------------------------------------------- arms
@dataclass(frozen=True)
class Arm:
    mode: str
    group_mult: int = 1
    hacpo: dict = field(default_factory=dict)
    label: str = ""


ARMS = {
    "gspo": Arm("isolated", 1, label="GSPO (G)"),
    "gspo2x": Arm("isolated", 2, label="GSPO×2 (2G)"),
    "naive": Arm("naive", 1, label="Naive sharing (G each)"),
    "hacpo": Arm("hacpo", 1, label="HACPO (G each)"),
}

ABLATIONS = {
    "abl_no_cap_baseline": Arm("hacpo", 1, {"capability_baseline": False}, "HACPO − capability baseline"),
    "abl_no_discrepancy": Arm("hacpo", 1, {"discrepancy_coefficient": False}, "HACPO − discrepancy coefficient"),
    "abl_alpha0": Arm("hacpo", 1, {"alpha": 0.0}, "HACPO, α = 0"),
    "abl_clip_fixed": Arm("hacpo", 1, {"cross_clip": "fixed"}, "HACPO, cross clip fixed"),
    "abl_clip_none": Arm("hacpo", 1, {"cross_clip": "none"}, "HACPO, no cross clip"),
}

ALL_ARMS = {**ARMS, **ABLATIONS}


# ----------------------------------------------------------------------------- helpers
def log(msg: str) -> None:
    print(f"[miniature {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def machine() -> str:
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            kb = int(f.readline().split()[1])
            mem = f", {kb / 2**20:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    load = ""
    try:
        load = ", load average now %.1f / %.1f / %.1f (1/5/15 min)" % os.getloadavg()
    except OSError:
        pass
    return (f"{os.cpu_count()} CPU cores ({cpu}){mem}, no GPU, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}{load}")


def mean_std(values: list[float]) -> tuple[float, float]:
    if not values:
        return float("nan"), float("nan")
    m = statistics.fmean(values)
    s = statistics.stdev(values) if len(values) > 1 else 0.0
    return m, s


def fmt_pm(values: list[float], scale: float = 100.0, digits: int = 1) -> str:
    if not values:
        return "—"
    m, s = mean_std(values)
    if len(values) == 1:
        return f"{m * scale:.{digits}f}"
    return f"{m * scale:.{digits}f} ± {s * scale:.{digits}f}"


# ----------------------------------------------------------------------------- warm start
def warm_agents(keys: list[str], agents_dir: str, smoke: bool) -> dict[str, dict]:
    from recipe_hacpo.warm_start import WarmStartArgs, warm_start

    out: dict[str, dict] = {}

    def warm(key: str) -> None:
        if key in out:
            return
        a = AGENTS[key]
        init = ""
        if a.init:
            warm(a.init)
            init = out[a.init]["path"]
        if smoke:
            args = WarmStartArgs(kind=a.kind, task="add3", steps=5, seed=a.seed, n_train=256, n_eval=64, init=init)
            path = os.path.join(agents_dir, a.dirname + "_smoke")
        else:
            args = WarmStartArgs(kind=a.kind, task="add3", steps=a.steps, seed=a.seed, n_train=a.n_train, init=init)
            path = os.path.join(agents_dir, a.dirname)
        t0 = time.perf_counter()
        rec = warm_start(args, path, verbose=False)
        log(f"agent {key} ({a.kind}, seed {a.seed}, {rec.get('total_steps', args.steps)} SFT steps): held-out "
            f"{rec['held_out_accuracy']:.3f} ({time.perf_counter() - t0:.0f}s, cached if ~0s) -> {path}")
        out[key] = {"path": path, "record": rec, "agent": a}

    for key in keys:
        warm(key)
    return {k: out[k] for k in keys}


# ----------------------------------------------------------------------------- one run
@dataclass
class Setup:
    steps: int
    prompts: int
    group: int
    lr: float
    temperature: float
    val_every: int
    val_rows: int
    micro: int
    mini_batches: int = 1  # optimizer updates per step (HACPO's update index m runs 0..mini_batches-1)


def run_overrides(arm: Arm, seed: int, agents: list[dict], setup: Setup, run_dir: str, first: bool) -> list[str]:
    g = setup.group * arm.group_mult
    # verl needs every batch it scores or trains on to split into whole micro-batches
    mini_prompts = setup.prompts // setup.mini_batches
    micro = math.gcd(setup.micro, mini_prompts * setup.group)
    spec = ",".join(
        f"{{name:{a['agent'].name},model_path:'{a['path']}',rollout_n:{g},n_gpus_per_node:1,nnodes:1,actor_rollout_ref:{{}}}}"
        for a in agents
    )
    ov = [
        f"agents=[{spec}]",
        f"ray_kwargs.ray_init.num_gpus={len(agents)}",
        f"algorithm.hacpo.mode={arm.mode}",
        *[f"algorithm.hacpo.{k}={v}" for k, v in arm.hacpo.items()],
        f"data.train_files={TRAIN_FILE}",
        f"data.val_files={VAL_FILE}",
        f"data.train_batch_size={setup.prompts}",
        f"data.val_batch_size={setup.val_rows}",
        f"data.val_max_samples={setup.val_rows}",
        f"data.seed={seed}",
        "data.max_prompt_length=48",
        "data.max_response_length=8",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini_prompts}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.actor.optim.lr={setup.lr}",
        f"actor_rollout_ref.rollout.temperature={setup.temperature}",
        f"actor_rollout_ref.rollout.seed={1000 + seed}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.rollout.max_num_seqs={max(256, setup.val_rows, setup.prompts * g)}",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={micro}",
        f"trainer.total_training_steps={setup.steps}",
        f"trainer.test_freq={setup.val_every}",
        "trainer.save_freq=-1",
        f"trainer.val_before_train={'true' if first else 'false'}",
        "trainer.logger=[console,file]",
        "trainer.progress_bar=false",
        "trainer.resume_mode=disable",
        f"trainer.default_local_dir={run_dir}/ckpt",
        f"trainer.experiment_name={os.path.basename(run_dir)}",
        f"hydra.run.dir={run_dir}/hydra",
    ]
    return ov


def summarize(records: list[dict], agents: list[dict], arm: Arm, setup: Setup) -> dict:
    steps = {r["step"]: r["data"] for r in records if "training/global_step" in r["data"]}
    names = [a["agent"].name for a in agents]
    g = setup.group * arm.group_mult
    curve = {n: [] for n in names}
    val = {n: {} for n in names}
    tokens = {n: 0.0 for n in names}
    for r in records:
        d = r["data"]
        for n in names:
            key = f"agent/{n}/val/{VAL_SOURCE}/mean@1"
            if key in d:
                val[n][int(r["step"])] = float(d[key])
    for s in sorted(steps):
        d = steps[s]
        for n in names:
            curve[n].append(float(d.get(f"agent/{n}/reward/mean", float("nan"))))
            tokens[n] += float(d.get(f"agent/{n}/response_length/mean", 0.0)) * setup.prompts * g
    timing = {}
    for s in sorted(steps):
        for k, v in steps[s].items():
            if k.startswith("timing_s/"):
                timing.setdefault(k[len("timing_s/"):], []).append(float(v))
    last = max(steps) if steps else 0
    final = {n: val[n].get(last) for n in names}
    return {
        "names": names,
        "steps": len(steps),
        "train_reward": curve,
        "val": {n: {str(k): v for k, v in val[n].items()} for n in names},
        "final_acc": final,
        "rollout_tokens": tokens,
        "timing": timing,
    }


def run_name(pair: str, arm_key: str, seed: int, setup: Setup) -> str:
    """The run's folder under <work>/runs; runs with several updates per step live apart."""
    return f"{pair}_{arm_key}_s{seed}" + (f"_mb{setup.mini_batches}" if setup.mini_batches != 1 else "")


def _stale(summary: dict, arm: Arm, setup: Setup) -> str:
    """What differs between a cached run and the requested settings ('' when it can be reused)."""
    wanted = {"steps": setup.steps, "group": setup.group * arm.group_mult, "prompts": setup.prompts,
              "lr": setup.lr, "temperature": setup.temperature, "mini_batches": setup.mini_batches}
    made = {"mini_batches": 1, **summary}  # runs cached before the key existed made one update per step
    return ", ".join(f"{k} {made[k]} != {v}" for k, v in wanted.items() if k in made and made[k] != v)


def cached_run(work: str, pair: str, arm_key: str, seed: int, setup: Setup) -> dict | None:
    """The summary of a finished run made with these settings, or None (none, or made with others)."""
    summary_file = os.path.join(work, "runs", run_name(pair, arm_key, seed, setup), "summary.json")
    if not os.path.isfile(summary_file):
        return None
    with open(summary_file) as f:
        summary = json.load(f)
    stale = _stale(summary, ALL_ARMS[arm_key], setup)
    if stale:
        log(f"{pair}/{arm_key}/seed {seed}: cached run made with other settings ({stale}); not reused")
        return None
    return summary


def run_one(arm_key: str, seed: int, agents: list[dict], setup: Setup, work: str, pair: str, first: bool,
            timeout: int) -> dict:
    arm = ALL_ARMS[arm_key]
    summary = cached_run(work, pair, arm_key, seed, setup)
    if summary is not None:
        log(f"{pair}/{arm_key}/seed {seed}: cached")
        return summary
    run_dir = os.path.join(work, "runs", run_name(pair, arm_key, seed, setup))
    summary_file = os.path.join(run_dir, "summary.json")
    os.makedirs(run_dir, exist_ok=True)
    metrics_file = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(metrics_file):
        os.remove(metrics_file)
    overrides = run_overrides(arm, seed, agents, setup, run_dir, first)
    cmd = [sys.executable, "-m", "recipe_hacpo.main", "--config-name", "hacpo_cpu_demo", *overrides]
    env = dict(os.environ, VERL_FILE_LOGGER_PATH=metrics_file, HACPO_DATA_DIR=DATA_DIR)
    log(f"{pair}/{arm_key}/seed {seed}: start")
    t0 = time.perf_counter()
    with open(os.path.join(run_dir, "log.txt"), "w") as logf:
        logf.write(shlex.join(cmd) + "\n\n")
        logf.flush()
        proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=logf, stderr=subprocess.STDOUT, timeout=timeout)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{pair}/{arm_key}/seed {seed} failed (rc {proc.returncode}); see {run_dir}/log.txt")
    with open(metrics_file) as f:
        records = [json.loads(line) for line in f if line.strip()]
    summary = summarize(records, agents, arm, setup)
    summary.update({"arm": arm_key, "seed": seed, "pair": pair, "wall_s": wall, "group": setup.group * arm.group_mult,
                    "prompts": setup.prompts, "lr": setup.lr, "temperature": setup.temperature,
                    "mini_batches": setup.mini_batches,
                    "train_s": sum(summary["timing"].get("step", []))})
    with open(summary_file, "w") as f:
        json.dump(summary, f)
    accs = ", ".join(f"{n} {v if v is None else round(v, 3)}" for n, v in summary["final_acc"].items())
    log(f"{pair}/{arm_key}/seed {seed}: done in {wall:.0f}s (train {summary['train_s']:.0f}s): {accs}")
    return summary


# ----------------------------------------------------------------------------- reports
def agent_table_header(names: list[str]) -> tuple[str, str]:
    cols = ["arm", "seeds"]
    for n in names:
        cols += [f"{n} acc %", f"{n} Δ vs GSPO×2"]
    cols += ["mean train reward %", "rollout tokens / run", "wall s / run"]
    return "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)


def acc_at(run: dict, name: str, at_step: int | None):
    """Held-out accuracy after the last step, or after step `at_step` (from the periodic validation)."""
    if at_step is None or at_step == run["steps"]:
        return run["final_acc"][name]
    return run["val"][name].get(str(at_step))


def arm_rows(summaries: list[dict], arm_keys: list[str], names: list[str], base: str = "gspo2x",
             at_step: int | None = None) -> list[str]:
    by = {}
    for s in summaries:
        by.setdefault(s["arm"], {})[s["seed"]] = s
    rows = []
    for key in arm_keys:
        runs = by.get(key, {})
        if not runs:
            continue
        seeds = sorted(runs)
        cells = [ALL_ARMS[key].label + (f" (step {at_step} of {runs[seeds[0]]['steps']})"
                                        if at_step and runs[seeds[0]]["steps"] != at_step else ""),
                 ",".join(map(str, seeds))]
        for n in names:
            accs = [acc_at(runs[s], n, at_step) for s in seeds if acc_at(runs[s], n, at_step) is not None]
            cells.append(fmt_pm(accs))
            paired = [acc_at(runs[s], n, at_step) - acc_at(by[base][s], n, at_step)
                      for s in seeds if key != base and s in by.get(base, {})
                      and acc_at(runs[s], n, at_step) is not None and acc_at(by[base][s], n, at_step) is not None]
            cells.append(("%+.1f ± %.1f" % (mean_std(paired)[0] * 100, mean_std(paired)[1] * 100) if len(paired) > 1
                          else ("%+.1f" % (paired[0] * 100) if paired else "—")) + (f" (n={len(paired)})" if paired else ""))
        upto = at_step or None
        auc = [statistics.fmean(statistics.fmean(runs[s]["train_reward"][n][:upto]) for n in names) for s in seeds]
        cells.append(fmt_pm(auc))
        if at_step and runs[seeds[0]]["steps"] != at_step:
            cells += ["—", "—"]
        else:
            toks = [sum(runs[s]["rollout_tokens"].values()) for s in seeds]
            cells.append(f"{statistics.fmean(toks):,.0f}")
            cells.append(f"{statistics.fmean([runs[s]['wall_s'] for s in seeds]):.0f}")
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def write_report(path: str, summaries: list[dict], agents: dict, setup: Setup, command: str, main_seeds: list[int],
                 notes: list[str], started: float, pair: str) -> None:
    names = [agents[k]["agent"].name for k in PAIRS[pair]]
    header, sep = agent_table_header(names)
    main = [s for s in summaries if s["pair"] == pair and s["arm"] in ARMS]
    abl = [s for s in summaries if s["pair"] == pair and s["arm"] in ABLATIONS]
    lines = [
        "# HACPO in miniature: held-out accuracy against the baselines (CPU, real trainer)",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {machine()}.",
        "",
        f"Written {time.strftime('%Y-%m-%d %H:%M:%S')}; this invocation took {(time.time() - started) / 60:.1f} min "
        "(runs cached from an earlier invocation are not re-timed here).",
        "",
        "## Setup",
        "",
        "Task: zero-padded 3-digit addition (`0123+0456=` → `0579`), `data/arith_add3_*.parquet`; reward 1 on exact "
        "match. Held-out accuracy: the trainer's validation — greedy decoding of "
        f"{setup.val_rows} held-out prompts — after the last step.",
        "",
        "Agents (supervised warm start by `recipe_hacpo.warm_start`, loss on answer + EOS after each agent's own chat "
        "template; trained once, the same start for every arm and seed):",
        "",
        "| key | trainer name | kind | params | warm-start steps | seed | held-out acc at start (warm_start, greedy) |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, a in agents.items():
        rec = a["record"]
        lines.append(f"| {key} | {a['agent'].name} | {a['agent'].kind} | {rec.get('params', '?'):,} | {rec.get('total_steps', rec['steps'])} | "
                     f"{rec['seed']} | {rec['held_out_accuracy'] * 100:.1f} % |")
    lines += [
        "",
        f"RL: `python -m recipe_hacpo.main --config-name hacpo_cpu_demo` per run (own Ray session), {setup.steps} steps, "
        f"{setup.prompts} prompts/step, G = {setup.group} per agent (GSPO×2: {2 * setup.group}), temperature "
        f"{setup.temperature}, Adam lr {setup.lr}, "
        + ("one optimizer update per step (mini-batch = whole batch)" if setup.mini_batches == 1 else
           f"{setup.mini_batches} optimizer updates per step (mini-batch = {setup.prompts // setup.mini_batches} prompts)")
        + ", GSPO clip "
        "3e-4/4e-4, HACPO α = 1, δ = 0.2, δ_step = 0.025, K = 5. Seeds vary the data order (`data.seed`) and the "
        "rollout sampling seed.",
        "",
        f"## Main table (pair `{pair}`: {' + '.join(names)}; seeds {main_seeds})",
        "",
        "acc % = held-out greedy accuracy after the last step, mean ± std over seeds. Δ vs GSPO×2 = paired-by-seed "
        "difference in points (mean ± std over seeds). Mean train reward % = on-policy reward over all steps, "
        "averaged over agents (area under the training curve). Rollout tokens = response tokens sampled by both agents "
        "in training (sum over steps of mean response length × rows).",
        "",
        header,
        sep,
        *arm_rows(main, list(ARMS), names),
        "",
    ]
    start_vals = [s["val"][n].get("0") for s in main for n in names if s["val"][n].get("0") is not None]
    if start_vals:
        zero = next(s for s in main if s["val"][names[0]].get("0") is not None)
        lines += ["Held-out accuracy at step 0 measured by the trainer's validation: "
                  + ", ".join(f"{n} {zero['val'][n]['0'] * 100:.1f} %" for n in names) + ".", ""]
    if abl:
        abl_steps = abl[0]["steps"]
        at = abl_steps if abl_steps != setup.steps else None
        lines += [
            "## Ablations (spec §8; HACPO with one mechanism switched off)",
            "",
            (f"The ablation runs ran {abl_steps} steps; they are compared with the main-table runs of the same seed "
             f"at step {abl_steps} (their periodic validation; same seed, data order and constant lr, so the first "
             f"{abl_steps} steps of a {setup.steps}-step run are a {abl_steps}-step run). " if at else "")
            + "Δ vs GSPO×2 is paired with the main table's GSPO×2 run of the same seed.",
            "",
            header,
            sep,
            # the reference rows over the ablations' seeds only, so that every row averages the same seeds
            *arm_rows([s for s in main if s["seed"] in {a["seed"] for a in abl}] + abl,
                      ["gspo2x", "hacpo", *ABLATIONS], names, at_step=at),
            "",
        ]
    other = sorted({s["pair"] for s in summaries} - {pair})
    for p in other:
        pn = [agents[k]["agent"].name for k in PAIRS[p]]
        h, sp = agent_table_header(pn)
        lines += [f"## Pair `{p}`: {' + '.join(pn)}", "", h, sp,
                  *arm_rows([s for s in summaries if s["pair"] == p], list(ALL_ARMS), pn), ""]
    lines += ["## Notes", "", *[f"- {n}" for n in notes], ""]
    with open(path, "w") as f:
        f.write("\n".join(lines))


PHASES = ["gen", "reward", "old_log_prob", "exchange", "adv", "update_actor", "update_weights", "step"]


def phase_medians(runs: list[dict]) -> dict[str, float]:
    """Median per phase over every step of every run, skipping each run's first step (warm-up)."""
    out = {}
    for ph in PHASES:
        vals = [v for r in runs for v in r["timing"].get(ph, [])[1:]]
        if vals:
            out[ph] = statistics.median(vals)
    return out


def write_cost_profile(path: str, summaries: list[dict], setup: Setup, command: str, pair: str, parallel: int = 1) -> None:
    arms = {k: [s for s in summaries if s["pair"] == pair and s["arm"] == k] for k in ("gspo", "gspo2x", "naive", "hacpo")}
    med = {k: phase_medians(v) for k, v in arms.items() if v}
    lines = [
        "# Cost profile: time per phase per step, HACPO against isolated GSPO (CPU, real trainer)",
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {machine()}.",
        "",
        f"From the `timing_s/*` metrics of the main-table runs (pair `{pair}`, {setup.prompts} prompts/step, "
        f"G = {setup.group}); median over steps 2..{setup.steps} of every seed. Both agents run each phase "
        "concurrently on their own worker groups, so a phase's time is the slower agent's."
        + (f" {parallel} runs ran at once on the 2 cores, so absolute times include contention between runs." if parallel > 1 else ""),
        "",
        "| phase (s/step) | " + " | ".join(ALL_ARMS[k].label for k in med) + " |",
        "|---|" + "---|" * len(med),
    ]
    what = {
        "gen": "generation",
        "reward": "reward (verifier)",
        "old_log_prob": "old log-probs (own rows)",
        "exchange": "exchange + re-tokenization",
        "adv": "advantages",
        "update_actor": "update (incl. learner log-probs of cross rows)",
        "update_weights": "weight sync",
        "step": "whole step",
    }
    for ph in PHASES:
        lines.append(f"| {what[ph]} | " + " | ".join(f"{med[k].get(ph, float('nan')):.3f}" for k in med) + " |")
    lines.append("")
    if "hacpo" in med:
        h = med["hacpo"]["step"]
        lines += ["## Ratios", ""]
        if "gspo2x" in med:
            lines.append(f"- Equal per-learner group size (HACPO, G = {setup.group} per agent → {2 * setup.group} rows per "
                         f"prompt per learner, vs isolated GSPO with 2G = {2 * setup.group}): HACPO step / GSPO×2 step = "
                         f"{h:.3f} / {med['gspo2x']['step']:.3f} = **{h / med['gspo2x']['step']:.2f}×**.")
        if "gspo" in med:
            lines.append(f"- Equal per-agent sampling (HACPO G = {setup.group} vs isolated G = {setup.group}): HACPO step / "
                         f"GSPO step = {h:.3f} / {med['gspo']['step']:.3f} = **{h / med['gspo']['step']:.2f}×**.")
        if "naive" in med:
            lines.append(f"- HACPO step / Naive-sharing step = {h / med['naive']['step']:.2f}× (same rows per learner).")
        for k, label in (("gspo2x", "GSPO×2"), ("gspo", "GSPO")):
            if k in med:
                lines.append(f"- Generation time HACPO / {label}: {med['hacpo']['gen'] / med[k]['gen']:.2f}×; update time "
                             f"HACPO / {label}: {med['hacpo']['update_actor'] / med[k]['update_actor']:.2f}×.")
        lines += [
            "",
            "The trainer computes the learner's log-probs of cross rows inside the update's forward pass (they are the "
            "π_θ of the HACPO loss), so 'cross log-probs' has no phase of its own: it is part of `update_actor`. "
            "Exchange = detokenize → re-tokenize with the learner's tokenizer → re-render the prompt with the learner's "
            "chat template, on the driver.",
            "",
        ]
    with open(path, "w") as f:
        f.write("\n".join(lines))


def write_plot(path: str, summaries: list[dict], agents: dict, pair: str, smooth: int = 10) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    names = [agents[k]["agent"].name for k in PAIRS[pair]]
    fig, axes = plt.subplots(2, len(names), figsize=(6 * len(names), 8), squeeze=False)
    keys = [k for k in ALL_ARMS if any(s["arm"] == k and s["pair"] == pair for s in summaries)]
    for col, n in enumerate(names):
        ax, axv = axes[0][col], axes[1][col]
        for k in keys:
            runs = [s for s in summaries if s["arm"] == k and s["pair"] == pair]
            style = "-" if k in ARMS else ":"
            curves = [np.asarray(r["train_reward"][n], dtype=float) for r in runs]
            length = min(len(c) for c in curves)
            if length == 0:
                continue
            m = np.mean([c[:length] for c in curves], axis=0)
            w = max(1, min(smooth, length))
            sm = np.convolve(m, np.ones(w) / w, mode="valid")
            ax.plot(np.arange(w, length + 1), sm * 100, style, label=f"{ALL_ARMS[k].label} (n={len(runs)})")
            pts = {}
            for r in runs:
                for st, v in r["val"][n].items():
                    pts.setdefault(int(st), []).append(v)
            zero = [s["val"][n].get("0") for s in summaries if s["pair"] == pair and s["val"][n].get("0") is not None]
            if zero and 0 not in pts:
                pts[0] = [zero[0]]
            xs = sorted(pts)
            axv.plot(xs, [np.mean(pts[x]) * 100 for x in xs], style, marker="o", label=ALL_ARMS[k].label)
        ax.set_title(f"{n}: on-policy train reward\n(T=1, moving avg {smooth} steps, mean over seeds)", fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("reward %")
        axv.set_title(f"{n}: held-out greedy accuracy (mean over seeds)", fontsize=10)
        axv.set_xlabel("step")
        axv.set_ylabel("accuracy %")
        ax.grid(alpha=0.3)
        axv.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    axes[1][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", default="/tmp/hacpo_bench", help="agents, run logs and checkpoints")
    p.add_argument("--results", default=os.path.join(REPO, "benchmarks", "results"))
    p.add_argument("--pair", default="model", choices=sorted(PAIRS))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--val-every", type=int, default=20)
    p.add_argument("--val-rows", type=int, default=1024)
    p.add_argument("--micro", type=int, default=512, help="micro-batch rows for log-probs and updates")
    p.add_argument("--mini-batches", type=int, default=1, help="optimizer updates per step (prompts split evenly)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--arms", default=",".join(ARMS), help="comma list of main arms")
    p.add_argument("--ablations", default=",".join(ABLATIONS), help="comma list of ablation arms, or 'none'")
    p.add_argument("--ablation-seeds", type=int, nargs="+", default=[0])
    p.add_argument("--ablation-steps", type=int, default=0,
                   help="steps of the ablation runs (0: --steps); must be a multiple of --val-every")
    p.add_argument("--extra-pairs", default="none", help="comma list of other pairs (state,size) run with gspo2x and hacpo, seed 0")
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
    setup = Setup(a.steps, a.prompts, a.group, a.lr, a.temperature, a.val_every, a.val_rows, a.micro, a.mini_batches)
    extra = [] if a.extra_pairs == "none" else a.extra_pairs.split(",")
    keys = sorted({k for pr in [a.pair, *extra] for k in PAIRS[pr]}, key=list(AGENTS).index)
    agents = warm_agents(keys, os.path.join(a.work, "agents"), a.smoke)

    plan = []  # (pair, arm, seed): main table seed-major, then ablations, then extra pairs
    main_arms = [] if a.arms == "none" else [k for k in a.arms.split(",") if k]
    for seed in a.seeds:
        plan += [(a.pair, k, seed) for k in main_arms]
    abl = [] if a.ablations == "none" else [k for k in a.ablations.split(",") if k]
    for seed in a.ablation_seeds:
        plan += [(a.pair, k, seed) for k in abl]
    for pr in extra:
        plan += [(pr, "gspo2x", 0), (pr, "hacpo", 0)]

    notes = list(a.note)
    summaries, skipped, failed = [], [], []
    lock = threading.Lock()

    def report() -> None:
        summaries.sort(key=lambda r: plan.index((r["pair"], r["arm"], r["seed"])))
        with open(os.path.join(a.results, "runs.json"), "w") as f:
            json.dump(summaries, f)
        extra_notes = [f"not run (time budget): {', '.join(skipped)}"] if skipped else []
        write_report(os.path.join(a.results, "miniature.md"), summaries, agents, setup, command, a.seeds,
                     notes + extra_notes, started, a.pair)
        write_cost_profile(os.path.join(a.results, "cost_profile.md"), summaries, setup, command, a.pair, a.parallel)
        if summaries:
            write_plot(os.path.join(a.results, "learning_curve.png"), summaries, agents, a.pair)

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
