"""One run through the real trainer, its summary, and the cache that lets a benchmark resume."""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass

from mini.arms import ALL_ARMS, Arm
from recipe_hacpo.config import agents_overrides
from mini.common import DATA_DIR, REPO, TRAIN_FILE, VAL_FILE, VAL_SOURCE, log, machine

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
    val_file: str = VAL_FILE  # held-out prompts (held_out_file)
    lr_schedule: str = "constant"  # verl's actor optim.lr_scheduler_type: constant, or cosine decay to 0 over the steps


SHIPPED_VAL_ROWS = 1024  # rows of the shipped held-out file (recipe_hacpo.data.synthetic.SHIPPED)
# what a run summary recorded before a key existed was made with: one update per step, scored on the
# shipped held-out rows, at a constant learning rate
UNRECORDED = {"mini_batches": 1, "val_rows": SHIPPED_VAL_ROWS, "lr_schedule": "constant"}


def step_zero_accuracy(summaries: list[dict], run: dict, name: str) -> float | None:
    """Held-out accuracy before any RL step of `run`'s agent `name` (its trainer name).

    Only the first run of an invocation validates at step 0, and greedy validation before training
    depends on nothing but the agent's warm start and the held-out rows: any run of that warm start
    scored on as many held-out rows gives it, whatever its pair, arm or seed.
    """
    made = {**UNRECORDED, **run}
    agent, val_rows = made["agents"][made["names"].index(name)], made["val_rows"]
    for s in summaries:
        if {**UNRECORDED, **s}["val_rows"] == val_rows and agent in s["agents"]:
            at_zero = s["val"][s["names"][s["agents"].index(agent)]].get("0")
            if at_zero is not None:
                return at_zero
    return None


def held_out_file(work: str, rows: int) -> str:
    """The held-out add3 prompts for `rows` of evaluation: the shipped file up to its 1024 rows, else
    the first `rows` of the same draw (its first 1024 rows are the shipped ones), written once into
    <work>/data. More rows shrink the accuracy's sampling error (about 1.2 points at 20 % on 1024)."""
    if rows <= SHIPPED_VAL_ROWS:
        return VAL_FILE
    path = os.path.join(work, "data", f"arith_add3_test_{rows}.parquet")
    if not os.path.exists(path):
        from recipe_hacpo.data.schema import write_rows
        from recipe_hacpo.data.synthetic import SHIPPED, generate

        tmp = f"{path}.{os.getpid()}.tmp"
        write_rows(generate("add3", "test", rows, SHIPPED["add3"]["seed"]), tmp)
        os.replace(tmp, path)
    return path


MINI_BATCH_RULE = "equal_rows"  # recorded in every summary; runs made under another rule are not reused


def mini_batch_prompts(arm: Arm, setup: Setup, n_agents: int) -> int:
    """Prompts per optimizer update. Every arm's update holds the same number of rows, as in the paper
    (GSPO 64 × 8, GSPO×2 32 × 16, HACPO 32 × (8 own + 8 cross) = 512): `setup.mini_batches` is the
    sharing arms' update count, whose learner sees n_agents × G rows per prompt, so GSPO at G makes
    half as many updates (capped at one per step) and GSPO×2 as many."""
    rows_per_update = setup.prompts // setup.mini_batches * setup.group * n_agents
    return min(setup.prompts, rows_per_update // trained_rows_per_prompt(arm, setup, n_agents))


def trained_rows_per_prompt(arm: Arm, setup: Setup, n_agents: int) -> int:
    """Rows a learner trains on per prompt: its own group (isolated at its multiple of G; GRAFT, whose
    grafted group replaces the own one; SGT, whose imitated response is an extra NLL term, not a
    policy-gradient row), or every agent's group (HACPO, Naive)."""
    if arm.mode in ("graft", "sgt"):
        return setup.group
    return setup.group * (arm.group_mult if arm.mode == "isolated" else n_agents)


def batch_rows_per_prompt(arm: Arm, setup: Setup, n_agents: int) -> int:
    """Rows per prompt in the learner batch the trainer splits into micro-batches, as the arm's
    method lays it out (`Method.rows_per_prompt`: SGT adds one imitation slot to the own group)."""
    from recipe_hacpo.agent_spec import AgentSpec
    from recipe_hacpo.hacpo_settings import HacpoSettings
    from recipe_hacpo.methods import method_for

    g = setup.group * arm.group_mult
    specs = [AgentSpec(index=i, name=f"agent{i}", model_path="-", rollout_n=g, n_gpus_per_node=1, nnodes=1)
             for i in range(n_agents)]
    return method_for(arm.mode).rows_per_prompt(specs, specs[0], HacpoSettings.from_dict({"mode": arm.mode}))


def _agent_overrides(agent) -> dict:
    return {"actor": {"optim": {"lr": agent.lr}}} if agent.lr else {}


def run_overrides(arm: Arm, seed: int, agents: list[dict], setup: Setup, run_dir: str, first: bool) -> list[str]:
    g = setup.group * arm.group_mult
    mini_prompts = mini_batch_prompts(arm, setup, len(agents))
    # verl needs every batch it scores or trains on to split into whole micro-batches
    micro = math.gcd(setup.micro, mini_prompts * g, mini_prompts * batch_rows_per_prompt(arm, setup, len(agents)))
    spec = agents_overrides([
        dict(name=a["agent"].name, model_path=a["path"], rollout_n=g, n_gpus_per_node=1, nnodes=1,
             actor_rollout_ref=_agent_overrides(a["agent"]))
        for a in agents
    ])
    ov = [
        *spec,
        f"ray_kwargs.ray_init.num_gpus={len(agents)}",
        f"algorithm.hacpo.mode={arm.mode}",
        *[f"algorithm.hacpo.{k}={v}" for k, v in arm.hacpo.items()],
        *[f"{k}={v}" for k, v in arm.actor],
        f"data.train_files={TRAIN_FILE}",
        f"data.val_files={setup.val_file}",
        f"data.train_batch_size={setup.prompts}",
        f"data.val_batch_size={setup.val_rows}",
        f"data.val_max_samples={setup.val_rows}",
        f"data.seed={seed}",
        "data.max_prompt_length=48",
        "data.max_response_length=8",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={mini_prompts}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro}",
        f"actor_rollout_ref.actor.optim.lr={setup.lr}",
        f"actor_rollout_ref.actor.optim.lr_scheduler_type={setup.lr_schedule}",
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
        "agents": [a["agent"].run_id for a in agents],
        "steps": len(steps),
        "train_reward": curve,
        "val": {n: {str(k): v for k, v in val[n].items()} for n in names},
        "final_acc": final,
        "rollout_tokens": tokens,
        "timing": timing,
        "diagnostics": diagnostics(steps, names),
    }


# per-step metrics that explain what sharing did for an agent (docs/METRICS.md)
DIAGNOSTIC_PREFIXES = ("omega/", "hacpo/", "advantage/", "cross/", "capability", "actor/pg_clipfrac", "graft/", "sgt/")


def diagnostics(steps: dict[int, dict], names: list[str]) -> dict[str, dict[str, list[float]]]:
    """Per agent, per metric (without the `agent/<name>/` prefix), its value at every step (NaN where
    a step did not log it)."""
    out: dict[str, dict[str, list[float]]] = {}
    order = sorted(steps)
    for n in names:
        prefix = f"agent/{n}/"
        keys = sorted({k[len(prefix):] for s in order for k in steps[s]
                       if k.startswith(prefix) and k[len(prefix):].startswith(DIAGNOSTIC_PREFIXES)})
        out[n] = {k: [float(steps[s].get(prefix + k, float("nan"))) for s in order] for k in keys}
    return out


def run_name(pair: str, arm_key: str, seed: int, mini_batches: int) -> str:
    """The run's folder under <work>/runs; runs with several updates per step live apart."""
    return f"{pair}_{arm_key}_s{seed}" + (f"_mb{mini_batches}" if mini_batches != 1 else "")


def _stale(summary: dict, arm: Arm, setup: Setup, agents: list[str] | None = None) -> str:
    """What differs between a cached run and the requested settings ('' when it can be reused)."""
    wanted = {"steps": setup.steps, "group": setup.group * arm.group_mult, "prompts": setup.prompts,
              "lr": setup.lr, "temperature": setup.temperature, "mini_batches": setup.mini_batches,
              "mini_batch_rule": MINI_BATCH_RULE, "val_rows": setup.val_rows, "lr_schedule": setup.lr_schedule}
    made = {**UNRECORDED, **summary}
    if "agents" in summary and agents is not None and summary["agents"] != agents:
        return f"agents {summary['agents']} != {agents}"
    return ", ".join(f"{k} {made[k]} != {v}" for k, v in wanted.items() if k in made and made[k] != v)


def restore_cache(work: str, runs_json: str) -> int:
    """Put the summaries of a results folder's runs.json into <work>/runs/ where the work folder has none,
    so a benchmark resumes from committed results on a machine that lost its work folder; the usual
    checks then decide whether each is reused. Returns how many were restored."""
    if not os.path.isfile(runs_json):
        return 0
    with open(runs_json) as f:
        summaries = json.load(f)
    restored = 0
    for summary in summaries:
        name = run_name(summary["pair"], summary["arm"], summary["seed"], summary.get("mini_batches", 1))
        path = os.path.join(work, "runs", name, "summary.json")
        if not os.path.exists(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                json.dump(summary, f)
            restored += 1
    return restored


def cached_run(work: str, pair: str, arm_key: str, seed: int, setup: Setup,
               agents: list[str] | None = None) -> dict | None:
    """The summary of a finished run made with these settings, or None (none, or made with others)."""
    summary_file = os.path.join(work, "runs", run_name(pair, arm_key, seed, setup.mini_batches), "summary.json")
    if not os.path.isfile(summary_file):
        return None
    with open(summary_file) as f:
        summary = json.load(f)
    stale = _stale(summary, ALL_ARMS[arm_key], setup, agents)
    if stale:
        log(f"{pair}/{arm_key}/seed {seed}: cached run made with other settings ({stale}); not reused")
        return None
    return summary


def run_one(arm_key: str, seed: int, agents: list[dict], setup: Setup, work: str, pair: str, first: bool,
            timeout: int) -> dict:
    arm = ALL_ARMS[arm_key]
    summary = cached_run(work, pair, arm_key, seed, setup, [a["agent"].run_id for a in agents])
    if summary is not None:
        log(f"{pair}/{arm_key}/seed {seed}: cached")
        return summary
    run_dir = os.path.join(work, "runs", run_name(pair, arm_key, seed, setup.mini_batches))
    summary_file = os.path.join(run_dir, "summary.json")
    os.makedirs(run_dir, exist_ok=True)
    metrics_file = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(metrics_file):
        os.remove(metrics_file)
    overrides = run_overrides(arm, seed, agents, setup, run_dir, first)
    cmd = [sys.executable, "-m", "recipe_hacpo.main", "--config-name", "hacpo_cpu_demo", *overrides]
    env = dict(os.environ, VERL_FILE_LOGGER_PATH=metrics_file, HACPO_DATA_DIR=DATA_DIR)
    log(f"{pair}/{arm_key}/seed {seed}: start")
    made_at, load_at_start = time.strftime("%Y-%m-%d %H:%M:%S"), os.getloadavg()[0]
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
                    "mini_batches": setup.mini_batches, "mini_batch_rule": MINI_BATCH_RULE,
                    "val_rows": setup.val_rows, "lr_schedule": setup.lr_schedule, "mini_batch_prompts": mini_batch_prompts(arm, setup, len(agents)),
                    "train_s": sum(summary["timing"].get("step", [])), "machine": machine(load=False),
                    "made_at": made_at, "load_at_start": load_at_start})
    with open(summary_file, "w") as f:
        json.dump(summary, f)
    accs = ", ".join(f"{n} {v if v is None else round(v, 3)}" for n, v in summary["final_acc"].items())
    log(f"{pair}/{arm_key}/seed {seed}: done in {wall:.0f}s (train {summary['train_s']:.0f}s): {accs}")
    return summary
