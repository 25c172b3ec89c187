"""`python -m recipe_hacpo.main [--config-name NAME] key=value ...` — train several agents with HACPO.

Order of work: compose and validate the config (agents, pools, batch sizes, data files) —
all before Ray starts, so a mistake costs seconds — then start Ray, build every agent's
workers, and run the trainer.
"""

from __future__ import annotations

import os
import sys

import hydra
from omegaconf import DictConfig, OmegaConf

from recipe_hacpo.config import ConfigError, validate


def check_data(cfg: DictConfig) -> None:
    """Fail on a missing, empty or malformed parquet before any worker starts."""
    from recipe_hacpo.data.schema import file_list, validate_file

    files = file_list(cfg.data.train_files) + (file_list(cfg.data.val_files) if cfg.data.get("val_files") else [])
    for path in files:
        validate_file(path, prompt_key=str(cfg.data.get("prompt_key", "prompt")))


def prepare(cfg: DictConfig):
    """Everything that can be checked without Ray: returns (specs, hacpo settings)."""
    from recipe_hacpo.training.scoring import load_reward_fn

    from recipe_hacpo.training.async_trainer import validate_async

    specs, hacpo = validate(cfg)
    validate_async(cfg, specs, hacpo)
    check_data(cfg)
    load_reward_fn(cfg)  # a missing file or function fails here, not after the workers start
    check_resume_identity(cfg, specs)
    check_resume_layout(cfg, specs)
    return specs, hacpo


def _checkpoint_to_resume(cfg: DictConfig, agent_names) -> str | None:
    """The checkpoint the trainer will load, complete for `agent_names`, or None (a fresh start,
    or a problem the trainer names in its own one-line error)."""
    from recipe_hacpo.cluster.reliability import CheckpointError, checkpoint_to_resume

    try:
        return checkpoint_to_resume(cfg.trainer, agent_names).path
    except CheckpointError:
        return None


def check_resume_identity(cfg: DictConfig, specs) -> None:
    """A resume from another run's checkpoint (another method, agents, models, rollout_n, reward,
    data or trainer: recipe_hacpo/training/run_identity.py) is refused here, before anything is written."""
    from recipe_hacpo.training import run_identity

    # complete by its own agents (its state is written last): a run that adds an agent is named
    # here as another run, not as a folder of incomplete checkpoints
    path = _checkpoint_to_resume(cfg, [])
    if path is None:
        return
    warning = run_identity.check_resume_identity(path, run_identity.run_identity(cfg, specs), str(cfg.trainer.resume_mode))
    if warning:
        print(warning, flush=True)


def check_resume_layout(cfg: DictConfig, specs) -> None:
    """A resume onto another per-agent GPU count fails inside verl's workers, minutes in: name
    both layouts here instead. The checkpoint is the one the trainer will load (or none)."""
    from recipe_hacpo.config import data_parallel_world
    from recipe_hacpo.cluster.reliability import saved_world_size

    path = _checkpoint_to_resume(cfg, [s.name for s in specs])
    if path is None:
        return
    for s in specs:
        saved, world = saved_world_size(os.path.join(path, s.name, "actor")), data_parallel_world(cfg, s)
        if saved is not None and saved != world:
            raise ConfigError(
                f"resume from {path}: agent {s.name} was saved by {saved} GPU rank(s), this run gives it {world} "
                f"(agents.{s.name}.n_gpus_per_node x nnodes, or the shared pool's trainer.n_gpus_per_node x nnodes); "
                "resume with the layout it was saved with, or start over with trainer.resume_mode=disable"
            )


def platform_env(cfg: DictConfig) -> dict[str, str]:
    """The CPU platform of every Ray worker follows trainer.device, never the worker's view of
    the host: on (`HACPO_CPU_PLATFORM=1`) for a CPU run, off (`=0`) for any other, so a CPU-only
    actor on a GPU node cannot pick it (workers/cpu_platform.py)."""
    return {"HACPO_CPU_PLATFORM": "1" if str(cfg.trainer.get("device", "cuda")) == "cpu" else "0"}


# A local Ray started by this driver prestarts idle Python workers for it, three or four on the
# CPU demo. None of a run's actors ever takes one (each asks for an environment of its own), and
# each is a Python start of 1 to 2.5 CPU s.
NO_PRESTART_ENV = ("RAY_prestart_worker_first_driver", "0")


def start_ray(cfg: DictConfig) -> None:
    import ray
    from verl.trainer.constants_ppo import get_ppo_ray_runtime_env

    if ray.is_initialized():
        return
    runtime_env = OmegaConf.merge(get_ppo_ray_runtime_env(), cfg.ray_kwargs.ray_init.get("runtime_env", {}))
    env_vars = dict(runtime_env.get("env_vars", {}))
    if os.environ.get("HACPO_VERBOSE"):
        env_vars.setdefault("HACPO_VERBOSE", os.environ["HACPO_VERBOSE"])  # recipe_hacpo.quiet
    for key, value in platform_env(cfg).items():
        env_vars.setdefault(key, value)  # an explicit runtime_env value wins
    runtime_env["env_vars"] = {k: str(v) for k, v in env_vars.items()}
    init = OmegaConf.to_container(cfg.ray_kwargs.ray_init, resolve=True)
    init["runtime_env"] = OmegaConf.to_container(runtime_env, resolve=True)
    init = {k: v for k, v in init.items() if v is not None}
    if not init.get("address"):
        os.environ.setdefault(*NO_PRESTART_ENV)
    ray.init(**init)


def build_dataloaders(cfg: DictConfig, tokenizer):
    from torchdata.stateful_dataloader import StatefulDataLoader
    from verl.trainer.ppo.utils import create_rl_dataset, create_rl_sampler
    from verl.utils.dataset.rl_dataset import collate_fn

    train = create_rl_dataset(cfg.data.train_files, cfg.data, tokenizer, None, max_samples=cfg.data.get("train_max_samples", -1))
    loader = StatefulDataLoader(
        dataset=train,
        batch_size=int(cfg.data.train_batch_size),
        num_workers=0,
        drop_last=True,
        collate_fn=collate_fn,
        sampler=create_rl_sampler(cfg.data, train),
    )
    if len(loader) == 0:
        raise ConfigError(
            f"data.train_batch_size={cfg.data.train_batch_size}: larger than the {len(train)} training prompts"
        )
    val_loader = None
    if cfg.data.get("val_files"):
        val = create_rl_dataset(cfg.data.val_files, cfg.data, tokenizer, None, is_train=False, max_samples=cfg.data.get("val_max_samples", -1))
        val_loader = StatefulDataLoader(
            dataset=val,
            batch_size=int(cfg.data.val_batch_size or len(val)),
            num_workers=0,
            shuffle=False,
            drop_last=False,
            collate_fn=collate_fn,
        )
    steps = len(loader) * int(cfg.trainer.total_epochs)
    if cfg.trainer.get("total_training_steps"):
        steps = int(cfg.trainer.total_training_steps)
    return loader, val_loader, steps


def plan_only(cfg: DictConfig) -> int:
    """`trainer.plan_only=true`: print each agent's GPU memory plan, the time estimate of a step
    and the ranking of GPU splits (`time_plan`), the whole run's budget and the Slurm lines it
    implies (`budget_plan`), validate, start nothing.

    Returns the exit status: 0 when every agent fits (or could not be estimated: no local
    config.json), 1 when one does not fit; other configuration errors raise ConfigError.
    """
    from recipe_hacpo.cluster import planner
    from recipe_hacpo.config import agent_specs

    gib = float(cfg.trainer.get("gpu_memory_gib", 80))
    specs = agent_specs(cfg)
    plans = planner.plan(cfg, specs, gib)
    print(planner.format_plan(plans, gib, cfg.trainer.get("max_actor_ckpt_to_keep")))
    print(time_plan(cfg, specs, plans, asynchronous=True))
    budget = budget_plan(cfg, specs, plans)
    if budget:
        print(budget)
    bad = [p for p in plans if p.problems]
    if bad:
        print(f"error: agent {bad[0].name}: {bad[0].problems[0]}", file=sys.stderr)
        return 1
    # model dirs need not exist on the machine that plans
    validate(cfg, check_paths=False)
    return 0


def rows_per_prompt(cfg: DictConfig, specs) -> dict[str, int]:
    """Each learner's rows per prompt in its batch, as its method lays them out."""
    from recipe_hacpo.config import hacpo_settings
    from recipe_hacpo.methods import method_for

    hacpo = hacpo_settings(cfg)
    method = method_for(hacpo.mode)
    return {s.name: method.rows_per_prompt(specs, s, hacpo) for s in specs}


def split_check(cfg: DictConfig, shapes: dict, gib: float):
    """check(split) for the split search: None when the config with agents.<name>.n_gpus_per_node
    set to the split fits the memory plan and passes the checks that depend on GPU counts, else
    the first reason, in one line."""
    import copy

    from omegaconf import open_dict

    from recipe_hacpo.cluster import planner
    from recipe_hacpo.config import agent_specs, validate_gpu_counts

    def check(split: dict[str, int]) -> str | None:
        trial = copy.deepcopy(cfg)
        with open_dict(trial):
            trial.agents_n_gpus_per_node = None
            for name, gpus in split.items():
                trial.agents[name].n_gpus_per_node = gpus
        specs = agent_specs(trial)
        bad = [p for p in planner.plan(trial, specs, gib, shapes) if p.problems]
        if bad:
            return f"agents.{bad[0].name} on {bad[0].gpus} GPU(s) does not fit: {bad[0].problems[0]}"
        try:
            validate_gpu_counts(trial, specs)
        except ConfigError as err:
            return str(err)
        return None

    return check


def time_plan(cfg: DictConfig, specs, plans, asynchronous: bool = False, top: int = 5) -> str:
    """The time estimate `trainer.plan_only=true` prints after the memory plan
    (recipe_hacpo/cluster/time_model.py): each agent's seconds per phase, the driver's, the
    lockstep step, each pool's busy fraction, then the static GPU splits ranked by their lockstep
    step (the `top` fastest and the current one), each checked against the memory plan and the
    batch checks. With `asynchronous`, the asynchronous schedule's prediction for the current split
    and for each ranked one (recipe_hacpo/asynchronous/simulate.py) is printed beside lockstep's."""
    from recipe_hacpo.cluster import time_model as tm

    if str(cfg.trainer.get("device", "cuda")) == "cpu":
        return "time estimate: not made for trainer.device=cpu (it models GPUs, trainer.gpu_kind)"
    unknown = [p.name for p in plans if not p.known]
    if unknown:
        return f"time estimate: not made, no model shape for {', '.join(unknown)}"
    settings = tm.TimeSettings.from_config(cfg.trainer)
    gpu = settings.gpu
    shapes = {p.name: p.shape for p in plans}
    rows = rows_per_prompt(cfg, specs)
    times = tm.estimate(cfg, specs, shapes, rows)
    step = times.step_s
    lines = [
        f"HACPO time estimate of one lockstep step, {gpu.name} (trainer.gpu_kind={settings.gpu_kind}: "
        f"{gpu.flops / 1e12:g} TFLOP/s dense bf16, {gpu.bandwidth / 1e12:g} TB/s)",
        f"  estimates from each model's size and the GPU's datasheet, not measured: MFU {tm.TRAIN_MFU:g} in "
        f"updates, {tm.FORWARD_MFU:g} in forward passes, decoding at {tm.DECODE_BANDWIDTH_FRACTION:.0%} of the "
        "memory bandwidth;",
        f"  mean prompt {settings.prompt_fill * int(cfg.data.max_prompt_length):.0f} tokens, mean response "
        f"{settings.response_fill * int(cfg.data.max_response_length):.0f} tokens (trainer.time_model), "
        f"{int(cfg.data.train_batch_size)} prompts a step",
    ]
    gpus = {p.name: p.gpus for p in plans}
    for name, phases in times.agents.items():
        pool = "shared pool" if name in times.shared else "own pool"
        lines.append(f"- {name} ({gpus[name]} GPU(s), {pool}, {rows[name]} learner rows a prompt): "
                     + _phase_list(phases) + f"; busy {_secs(sum(phases.values()))}")
    lines.append("- driver (its CPU): " + _phase_list(times.driver))
    rule = "the sum over the shared pool's agents" if times.shared else "its slowest agent"
    lines.append(f"lockstep step: {_secs(step)} (each phase: {rule}; plus the driver's phases)")
    lines.append("busy in lockstep: " + ", ".join(
        f"{'shared pool' if pool == 'shared' else pool} {fraction:.0%}" for pool, fraction in times.busy_fraction().items())
        + " of the step")
    by_split = None
    if asynchronous:
        from recipe_hacpo.asynchronous.simulate import asynchronous_step_s

        def by_split(split=None):
            t = tm.estimate(cfg, specs, shapes, rows, split)
            return asynchronous_step_s(t.agents, t.driver, shared=t.shared)

        current_s = by_split()
        lines.append(f"asynchronous agents (each its own loop, no barrier; recipe_hacpo/asynchronous/): "
                     f"{_secs(current_s)} a step until both made 20 steps ({current_s / step:.2f}x lockstep), "
                     "predicted by the schedule's simulation, not measured; trainer.async.enable=true runs it "
                     "(docs/ASYNCHRONOUS.md)")
    lines += _split_lines(cfg, specs, shapes, rows, by_split, top)
    return "\n".join(lines)


def budget_plan(cfg: DictConfig, specs, plans) -> str:
    """The run's budget after the step estimate (recipe_hacpo/cluster/run_budget.py): its time,
    a node's host memory, the checkpoint disk and the `#SBATCH --time` / `--signal` lines; ""
    where the step is not estimated (trainer.device=cpu, a model without a shape)."""
    from recipe_hacpo.cluster import run_budget
    from recipe_hacpo.cluster import time_model as tm

    if str(cfg.trainer.get("device", "cuda")) == "cpu" or not all(p.known for p in plans):
        return ""
    rows = rows_per_prompt(cfg, specs)
    step = tm.estimate(cfg, specs, {p.name: p.shape for p in plans}, rows).step_s
    return "\n".join(run_budget.format_budget(run_budget.budget(cfg, specs, plans, step, rows)))


def _split_lines(cfg: DictConfig, specs, shapes: dict, rows: dict, asynchronous, top: int) -> list[str]:
    from recipe_hacpo.cluster import time_model as tm

    problem = tm.split_search_problem(specs)
    if problem:
        return [f"GPU split: not searched ({problem})"]
    current = {s.name: s.n_gpus_per_node for s in specs}
    check = split_check(cfg, shapes, float(cfg.trainer.get("gpu_memory_gib", 80)))
    ranked = tm.rank_splits(current, lambda split: tm.estimate(cfg, specs, shapes, rows, split).step_s,
                            check, asynchronous, top)
    names = "+".join(current)

    def shown(c: tm.SplitCandidate) -> str:
        return "+".join(str(n) for n in c.split.values())

    lines = [f"GPU splits of {sum(current.values())} GPUs ({names}), fastest lockstep step first "
             f"({len(ranked)} splits; refused: what the config's checks say of that split):"]
    for rank, c in enumerate(ranked, 1):
        if rank > top and c.split != current:
            continue
        verdict = "valid" if c.valid else f"refused: {c.refused}" if c.refused else "not checked"
        timing = f"{_secs(c.step_s):>8}  {c.relative:.2f}x"
        if asynchronous is not None and c.asynchronous_s is not None:
            timing += f"  asynchronous {_secs(c.asynchronous_s)}"
        lines.append(f"  {rank:>3}. {shown(c):<8}{timing}  {'(current) ' if c.split == current else ''}{verdict}")
    best = ranked[0]
    valid = next((c for c in ranked if c.valid), None)
    if valid is None:
        lines.append("best valid split: none of the checked splits is valid")
    else:
        lines.append(f"best valid split: {shown(valid)}"
                     + (" (the current one)" if valid.split == current else f", {valid.relative:.2f}x the current step"))
    if best is valid:
        lines.append("best split overall: the same")
    else:
        lines.append(f"best split overall: {shown(best)}, {best.relative:.2f}x the current step, "
                     + (f"refused: {best.refused}" if best.refused else "not checked"))
    return lines


def _phase_list(phases: dict[str, float]) -> str:
    return ", ".join(f"{phase} {_secs(s)}" for phase, s in phases.items())


def _secs(s: float) -> str:
    return f"{s:.0f} s" if s >= 100 else f"{s:.3g} s"


def run(cfg: DictConfig) -> dict:
    """Train; returns the last step's metrics. Raises ResumableStop when a signal or a deadline
    stopped the run with a complete checkpoint (recipe_hacpo/cluster/preemption.py)."""
    import time

    from recipe_hacpo.cluster.preemption import RESUMABLE_EXIT, PreemptionSettings, ResumableStop
    from recipe_hacpo.training.run_metrics import RunMetrics

    started = time.time()
    verbose = _apply_verbosity(cfg)
    specs, hacpo = prepare(cfg)
    preemption = PreemptionSettings.from_config(cfg.trainer)  # a bad key fails before Ray
    # every backend starts before Ray does: a wandb key or network problem is seconds in, not minutes
    metrics = RunMetrics(cfg, verbose)
    exit_code = 1
    try:
        last = _train(cfg, specs, hacpo, preemption, metrics, started)
        exit_code = 0
        return last
    except ResumableStop:
        exit_code = RESUMABLE_EXIT
        raise
    finally:
        metrics.finish(exit_code=exit_code)


def _train(cfg: DictConfig, specs, hacpo, preemption, metrics, started: float) -> dict:
    from verl.utils import hf_tokenizer

    from recipe_hacpo.cluster.preemption import StopSignals, shield_children
    from recipe_hacpo.training.async_trainer import AsyncHacpoTrainer, AsyncSettings
    from recipe_hacpo.training.trainer import HacpoTrainer

    # from here on SIGUSR1 / SIGTERM ask for a stop at the next safe point
    signals = StopSignals(request_file=preemption.request_file).install()
    # the dataset keeps raw chat messages; each agent renders them with its own template
    tokenizer = hf_tokenizer(specs[0].model_path)
    train_loader, val_loader, steps = build_dataloaders(cfg, tokenizer)
    # a local Ray's processes start with SIGUSR1 blocked, so only this process acts on it (a
    # SIGUSR1 meanwhile waits for the block to lift). ray.init installs Ray's own SIGTERM handler
    # in this process (it logs and aborts): ours go back on top of it
    with shield_children():
        start_ray(cfg)
        signals.install()
    settings = AsyncSettings.from_config(cfg.trainer)
    # agents that do not wait for each other (trainer.async.enable), or the lockstep step
    trainer = AsyncHacpoTrainer(cfg, specs, hacpo, settings) if settings.enable else HacpoTrainer(cfg, specs, hacpo)
    trainer.stop_signals = signals
    trainer.started_at = started
    print(f"hacpo: starting the workers of {len(specs)} agents ({', '.join(s.name for s in specs)})", flush=True)
    trainer.init_workers(train_loader, val_loader, steps)
    return trainer.fit(metrics, progress=bool(cfg.trainer.get("progress_bar", True)),
                       summary_every=int(cfg.trainer.get("summary_every", 0) or 0))


def _apply_verbosity(cfg: DictConfig) -> bool:
    """`trainer.verbose=true` or HACPO_VERBOSE=1: keep every third-party message, here and in
    every Ray worker (they inherit the environment variable)."""
    from recipe_hacpo import quiet

    if bool(cfg.trainer.get("verbose", False)) or quiet.is_verbose():
        quiet.release()
        return True
    quiet.install()
    return False


@hydra.main(config_path="pkg://recipe_hacpo.configs", config_name="hacpo_trainer", version_base=None)
def main(cfg: DictConfig) -> None:
    from recipe_hacpo.data.schema import DataFormatError
    from recipe_hacpo.cluster.preemption import RESUMABLE_EXIT, ResumableStop
    from recipe_hacpo.cluster.reliability import AgentError, CheckpointError

    try:
        if cfg.trainer.get("plan_only", False):
            sys.exit(plan_only(cfg))
        run(cfg)
    except ResumableStop as stop:
        # not a failure: a complete checkpoint is published; the same command resumes from it
        print(f"hacpo: {stop}; exit status {RESUMABLE_EXIT} (resume with trainer.resume_mode=auto)", flush=True)
        sys.exit(RESUMABLE_EXIT)
    except (ConfigError, DataFormatError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    except (AgentError, CheckpointError, FloatingPointError) as err:
        # a failure during training: one line naming the agent (the traceback is chained above it)
        import traceback

        traceback.print_exc()
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    from recipe_hacpo.agent_spec import refuse_list_form

    refused = refuse_list_form(sys.argv[1:])
    if refused:
        print(f"error: {refused}", file=sys.stderr)
        sys.exit(2)
    main()
