"""A whole run's budget, printed by `trainer.plan_only=true` after the estimate of one step
(recipe_hacpo/cluster/time_model.py): its time, the host memory of a node, the checkpoint disk,
and the `#SBATCH --time` and `--signal` lines that follow from them.

No GPU, no Ray, no download. Every figure is built from the step estimate and the memory plan
(recipe_hacpo/cluster/planner.py), so it is an estimate of the same kind, not a measurement.

Time of the run (`run_seconds`): N steps × the lockstep step + V validations × one validation +
C checkpoint writes × one write.

- N: trainer.total_training_steps, else ⌊training prompts / data.train_batch_size⌋ ×
  trainer.total_epochs (the loader drops the last partial batch). The prompts are
  `trainer.plan.train_prompts`, else the rows of data.train_files when they are on this machine
  (at most data.train_max_samples); data.filter_overlong_prompts can only lower the count.
- V (`validations`): one before training with trainer.val_before_train, then one at every
  trainer.test_freq-th step and at the last (the trainer's schedule); none when test_freq <= 0.
- C (`checkpoint_writes`): one at every trainer.save_freq-th step and at the last.
- One validation (`validation_s`): each agent generates val_kwargs.n responses to every
  validation prompt (`trainer.plan.val_prompts`, else the rows of data.val_files), by the
  step's generation formulas; agents side by side as in a step (the lockstep rule), and the
  driver scores every response.
- One checkpoint write: the joint checkpoint (every agent's fp32 weights and Adam state, the
  memory plan's figure) at `trainer.plan.checkpoint_write_gib_s` GiB/s, the speed at which the
  job's nodes together write to the checkpoint folder's file system.

The Slurm lines (`slurm_lines`):

- `--signal=B:USR1@<lead>`: after SIGUSR1 the trainer finishes the step in flight and writes a
  checkpoint (recipe_hacpo/cluster/preemption.py); the lead covers (step + one write) ×
  (1 + LEAD_MARGIN) + trainer.preemption.margin_s, rounded up to a whole minute. The same
  number goes to trainer.preemption.usr1_grace_s, which the trainer takes as the time left.
- `--time`: (STARTUP_S + the run) × (1 + TIME_MARGIN) + the lead (training stops when the
  signal comes), rounded up to a quarter hour. A shorter limit is no loss: the job checkpoints
  at the signal, requeues itself and resumes (run_scripts/slurm/hacpo.slurm).

Host memory of a node (`host_bytes_per_gpu`, `node_host_bytes`), the model: per GPU of an agent
(one FSDP rank), PROCESSES_PER_AGENT processes (the FSDP worker and vLLM's engine) of
PROCESS_HOST_GIB each; the FSDP state that offload keeps on the host (param_offload: fp32
weights 4·P/W; optimizer_offload: Adam moments 8·P_t/W; offload_policy: weights, gradients and
Adam, 4·P/W + 12·P_t/W; P_t the trained parameters); and the rank's share of a checkpoint staged
on the host while it is written (verl copies each rank's model and optimizer shards to CPU
before saving them: checkpoint/W). A GPU of the shared pool holds a rank of every agent of
it. A node is its trainer.n_gpus_per_node GPUs holding the largest of these figures, plus
RAY_HOST_GIB for Ray's own processes, the driver and the object store's traffic. The transient
peak of loading each model at start-up, before FSDP shards it, is not counted.

Checkpoint disk (`disk_bytes`): trainer.max_actor_ckpt_to_keep joint checkpoints are kept; a
new one is written in full before the oldest is removed, so the peak is one more (null keeps
every checkpoint the run writes).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

from recipe_hacpo.cluster import time_model as tm
from recipe_hacpo.cluster.planner import GIB, PROCESSES_PER_AGENT, AgentPlan
from recipe_hacpo.hacpo_settings import ConfigError

# ASSUMPTIONS, not measured on a GPU by this recipe
STARTUP_S = 600.0  # Ray, every agent's FSDP workers and vLLM engines up, the checkpoint loaded
TIME_MARGIN = 0.25  # on the run's estimate, for the --time line
LEAD_MARGIN = 0.5  # on a step plus a checkpoint write, for the --signal lead
PROCESS_HOST_GIB = 5.0  # host memory of one GPU process (torch, CUDA, NCCL, verl or vLLM)
RAY_HOST_GIB = 16.0  # Ray's processes, the driver (tokenizers, the step's batches), object store traffic

PLAN_KEYS = ("checkpoint_write_gib_s", "train_prompts", "val_prompts")
"""The keys of `trainer.plan` (defaults and meanings: configs/hacpo_base.yaml)."""


@dataclass(frozen=True)
class BudgetSettings:
    """`trainer.plan`, typed and checked."""

    checkpoint_write_gib_s: float = 1.0
    train_prompts: int | None = None
    val_prompts: int | None = None

    @classmethod
    def from_config(cls, trainer) -> "BudgetSettings":
        """From the `trainer` section; a one-line ConfigError naming the key at fault."""
        node = trainer.get("plan") or {}
        unknown = [k for k in node.keys() if k not in PLAN_KEYS]
        if unknown:
            raise ConfigError(f"trainer.plan.{unknown[0]}: not a key (known: {', '.join(PLAN_KEYS)})")
        speed = node.get("checkpoint_write_gib_s", cls.checkpoint_write_gib_s)
        if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not 0 < speed < math.inf:
            raise ConfigError(f"trainer.plan.checkpoint_write_gib_s={speed!r}: a speed in GiB/s, > 0")
        counts = {}
        for key in ("train_prompts", "val_prompts"):
            value = node.get(key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ConfigError(f"trainer.plan.{key}={value!r}: a number of prompts (>= 0), or null to count data files")
            counts[key] = value
        return cls(checkpoint_write_gib_s=float(speed), **counts)


# ---------------------------------------------------------------------------------- arithmetic
def scheduled(total_steps: int, every: int) -> int:
    """How many of steps 1..N the trainer's `step % every == 0 or last` schedule hits (0 if every <= 0)."""
    if every <= 0 or total_steps <= 0:
        return 0
    return total_steps // every + (1 if total_steps % every else 0)


def validations(total_steps: int, test_freq: int, before_train: bool) -> int:
    """V: the validation before training (val_before_train) and those of the schedule."""
    return (1 if before_train else 0) + scheduled(total_steps, test_freq)


def checkpoint_writes(total_steps: int, save_freq: int) -> int:
    """C: the checkpoints of the save_freq schedule."""
    return scheduled(total_steps, save_freq)


def checkpoint_write_s(joint_bytes: int, gib_per_s: float) -> float:
    """One joint checkpoint at the file system's write speed."""
    return joint_bytes / GIB / gib_per_s


def run_seconds(steps: int, step_s: float, n_validations: int, validation_s: float,
                n_checkpoints: int, write_s: float) -> float:
    """N·step + V·validation + C·write."""
    return steps * step_s + n_validations * validation_s + n_checkpoints * write_s


def signal_lead_s(step_s: float, write_s: float, margin_s: float) -> int:
    """(step + write)·(1 + LEAD_MARGIN) + margin_s, rounded up to a whole minute."""
    return 60 * math.ceil(((step_s + write_s) * (1 + LEAD_MARGIN) + margin_s) / 60)


def time_limit_s(run_s: float, lead_s: int) -> int:
    """(STARTUP_S + run)·(1 + TIME_MARGIN) + lead, rounded up to a quarter hour."""
    return 900 * math.ceil(((STARTUP_S + run_s) * (1 + TIME_MARGIN) + lead_s) / 900)


def hms(seconds: int) -> str:
    """HH:MM:SS as sbatch's --time reads it (hours may exceed 24)."""
    return f"{seconds // 3600:02d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


def slurm_lines(limit_s: int, lead_s: int) -> list[str]:
    return [f"#SBATCH --time={hms(limit_s)}", f"#SBATCH --signal=B:USR1@{lead_s}"]


def host_bytes_per_gpu(plan: AgentPlan) -> int:
    """One rank of an agent on the host: its processes, the FSDP state offload keeps there, and
    its share of a checkpoint being written (see the module docstring)."""
    world = max(1, plan.gpus)
    trained = plan.lora_params if plan.lora_rank > 0 else plan.params
    weights = 4 * (plan.params + plan.lora_params)
    if plan.offload_policy:
        offloaded = weights + 12 * trained
    else:
        offloaded = (weights if plan.param_offload else 0) + (8 * trained if plan.optimizer_offload else 0)
    processes = int(PROCESSES_PER_AGENT * PROCESS_HOST_GIB * GIB)
    return processes + (offloaded + plan.checkpoint) // world


def node_host_bytes(plans: list[AgentPlan], gpus_per_node: int) -> int:
    """The node whose trainer.n_gpus_per_node GPUs hold the largest per-GPU figures, plus RAY_HOST_GIB."""
    per_gpu = [host_bytes_per_gpu(p) for p in plans for _ in range(p.gpus) if p.pool != "shared"]
    shared = [p for p in plans if p.pool == "shared"]
    if shared:
        per_gpu += [sum(host_bytes_per_gpu(p) for p in shared)] * shared[0].gpus
    return sum(sorted(per_gpu, reverse=True)[:gpus_per_node]) + int(RAY_HOST_GIB * GIB)


def disk_bytes(joint_bytes: int, keep: int | None, n_checkpoints: int) -> tuple[int, int]:
    """(kept, peak while the next one is written) under trainer.max_actor_ckpt_to_keep."""
    if not keep:
        return n_checkpoints * joint_bytes, n_checkpoints * joint_bytes
    kept = min(keep, n_checkpoints) * joint_bytes
    return kept, kept + (joint_bytes if n_checkpoints > keep else 0)


# ---------------------------------------------------------------------------------- from a config
def parquet_rows(files) -> int | None:
    """Rows of the parquet files (from their footers), None when one is not on this machine."""
    import pyarrow.parquet as pq

    paths = [files] if isinstance(files, str) else [str(f) for f in files or []]
    if not paths or not all(os.path.isfile(p) for p in paths):
        return None
    return sum(pq.ParquetFile(p).metadata.num_rows for p in paths)


def prompts(cfg, given: int | None, which: str) -> tuple[int | None, str]:
    """(prompts, where the count came from) of `which` (train or val): trainer.plan.<which>_prompts,
    else the rows of data.<which>_files at most data.<which>_max_samples; (None, why) without either."""
    if given is not None:
        return given, f"trainer.plan.{which}_prompts"
    files = cfg.data.get(f"{which}_files")
    rows = parquet_rows(files) if files else None
    if rows is None:
        return None, f"data.{which}_files not on this machine: set trainer.plan.{which}_prompts"
    cap = int(cfg.data.get(f"{which}_max_samples", -1) or -1)
    return (min(rows, cap) if cap > 0 else rows), f"rows of data.{which}_files"


def total_steps(cfg, train_prompts: int | None) -> int | None:
    """N: trainer.total_training_steps, else ⌊prompts / batch⌋ × epochs; None when neither is known."""
    if cfg.trainer.get("total_training_steps"):
        return int(cfg.trainer.total_training_steps)
    if train_prompts is None:
        return None
    return train_prompts // int(cfg.data.train_batch_size) * int(cfg.trainer.total_epochs)


def validation_s(cfg, specs, shapes: dict, rows_per_prompt: dict[str, int], val_prompts: int) -> float:
    """One validation: each agent generates val_kwargs.n responses to every prompt (prefill and
    decode of the step's formulas), agents side by side by the lockstep rule, then the driver
    scores every response."""
    settings = tm.TimeSettings.from_config(cfg.trainer)
    gens, responses = {}, 0
    for s in specs:
        n = int((s.section(cfg, "rollout").get("val_kwargs") or {}).get("n", 1) or 1)
        load = replace(tm.agent_load(cfg, s, shapes[s.name], rows_per_prompt[s.name], tm.pool_gpus(cfg, s), settings),
                       responses=val_prompts * n)
        gens[s.name] = {"gen": tm.prefill_s(load.params, load.responses, load.prompt_tokens, load.gpus, settings.gpu)
                        + tm.decode_s(load.params, load.kv_bytes, load.responses, load.prompt_tokens,
                                      load.response_tokens, load.gpus, load.tp, settings.gpu, load.concurrent)}
        responses += load.responses
    shared = frozenset(s.name for s in specs if s.uses_shared_pool)
    return tm.lockstep_step_time(gens, {"reward": tm.scoring_s(responses)}, shared)


@dataclass(frozen=True)
class RunBudget:
    """What `budget` found; None where a count was not known."""

    steps: int | None
    step_s: float
    n_validations: int | None
    validation_s: float | None
    n_checkpoints: int | None
    write_s: float
    write_gib_s: float
    joint_bytes: int
    keep: int | None
    host_node_bytes: int
    gpus_per_node: int
    lead_s: int
    limit_s: int | None
    notes: tuple[str, ...] = ()

    @property
    def run_s(self) -> float | None:
        if self.steps is None or self.validation_s is None:
            return None
        return run_seconds(self.steps, self.step_s, self.n_validations, self.validation_s, self.n_checkpoints,
                           self.write_s)


def budget(cfg, specs, plans: list[AgentPlan], step_s: float, rows_per_prompt: dict[str, int]) -> RunBudget:
    """The run's budget from the config, its memory plan and the lockstep step estimate."""
    from recipe_hacpo.cluster.preemption import PreemptionSettings

    settings = BudgetSettings.from_config(cfg.trainer)
    t = cfg.trainer
    train, train_from = prompts(cfg, settings.train_prompts, "train")
    steps = total_steps(cfg, train)
    notes = [f"steps: {'trainer.total_training_steps' if t.get('total_training_steps') else train_from}"]
    joint = sum(p.checkpoint for p in plans)
    write = checkpoint_write_s(joint, settings.checkpoint_write_gib_s)
    test_freq = int(t.get("test_freq", -1) or -1)
    before = bool(t.get("val_before_train", True))
    val_s = 0.0
    if cfg.data.get("val_files") and (before or test_freq > 0):
        val, val_from = prompts(cfg, settings.val_prompts, "val")
        notes.append(f"validation prompts: {val_from}")
        shapes = {p.name: p.shape for p in plans}
        val_s = None if val is None else validation_s(cfg, specs, shapes, rows_per_prompt, val)
    n_val = None if steps is None else (validations(steps, test_freq, before) if cfg.data.get("val_files") else 0)
    n_ckpt = None if steps is None else checkpoint_writes(steps, int(t.get("save_freq", -1) or -1))
    margin = PreemptionSettings.from_config(t).margin_s
    lead = signal_lead_s(step_s, write, margin)
    partial = RunBudget(
        steps=steps, step_s=step_s, n_validations=n_val, validation_s=val_s, n_checkpoints=n_ckpt, write_s=write,
        write_gib_s=settings.checkpoint_write_gib_s, joint_bytes=joint, keep=t.get("max_actor_ckpt_to_keep"),
        host_node_bytes=node_host_bytes(plans, int(t.n_gpus_per_node)), gpus_per_node=int(t.n_gpus_per_node),
        lead_s=lead, limit_s=None, notes=tuple(notes),
    )
    run = partial.run_s
    return replace(partial, limit_s=None if run is None else time_limit_s(run, lead))


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s} s ({s // 3600} h {s % 3600 // 60:02d} min)"


def format_budget(b: RunBudget) -> list[str]:
    """The lines `trainer.plan_only=true` prints after the step estimate."""
    gib = lambda n: f"{n / GIB:.1f} GiB"  # noqa: E731
    lines = ["HACPO run budget (from the step estimate and the memory plan; not measured)"]
    if b.run_s is None:
        lines.append("  run time: not estimated (" + "; ".join(n for n in b.notes if "set trainer.plan" in n) + ")")
    else:
        lines.append(
            f"  run time: {_duration(b.run_s)} = {b.steps} steps × {b.step_s:.0f} s + {b.n_validations} validations × "
            f"{b.validation_s:.0f} s + {b.n_checkpoints} checkpoint writes × {b.write_s:.0f} s ({'; '.join(b.notes)})")
    lines.append(f"  checkpoint write: {gib(b.joint_bytes)} at trainer.plan.checkpoint_write_gib_s="
                 f"{b.write_gib_s:g} GiB/s: {b.write_s:.0f} s")
    lines.append(f"  host memory per node: {gib(b.host_node_bytes)} (its {b.gpus_per_node} GPUs' processes at "
                 f"{PROCESS_HOST_GIB:g} GiB each, offloaded FSDP state, checkpoint staging; Ray and the driver "
                 f"{RAY_HOST_GIB:g} GiB)")
    if b.n_checkpoints is None:
        lines.append("  checkpoint disk: not estimated (the number of steps is not known)")
    else:
        kept, peak = disk_bytes(b.joint_bytes, b.keep, b.n_checkpoints)
        rule = f"trainer.max_actor_ckpt_to_keep={b.keep}" if b.keep else "trainer.max_actor_ckpt_to_keep=null: every one"
        lines.append(f"  checkpoint disk: {gib(kept)} kept ({rule}, {b.n_checkpoints} written), "
                     f"{gib(peak)} while the next is written")
    lines.append(f"  Slurm (run_scripts/slurm/hacpo.slurm), ready to paste; pass trainer.preemption.usr1_grace_s={b.lead_s} "
                 f"with it (the lead covers a step and a checkpoint write, ×{1 + LEAD_MARGIN:g}, plus margin_s):")
    if b.limit_s is None:
        lines.append("    #SBATCH --time: not estimated (the run time is not known)")
        lines.append(f"    #SBATCH --signal=B:USR1@{b.lead_s}")
    else:
        lines += [f"    {line}" for line in slurm_lines(b.limit_s, b.lead_s)]
    return lines
