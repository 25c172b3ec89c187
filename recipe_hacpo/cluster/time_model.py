"""How long a lockstep HACPO step takes: an estimate per agent and phase from the model's size
and the GPU's datasheet, the lockstep rule that adds the phases into a step, its check against
a recorded run's metrics, and the best static split of the GPUs between the agents.

No GPU, no Ray: `python -m recipe_hacpo.main ... trainer.plan_only=true` prints the estimate
after the memory plan (recipe_hacpo/cluster/planner.py). The per-phase figures are estimates:
the GPU's datasheet (`GPU_KINDS`, `trainer.gpu_kind`) times efficiency constants that are
assumptions, not measurements (`TRAIN_MFU`, `FORWARD_MFU`, `DECODE_BANDWIDTH_FRACTION`, ...).
Only the lockstep rule is checked against a real run (`check_recorded_run`).

An agent with P parameters on W GPUs (its own pool, or the shared pool), vLLM tensor parallel T,
B prompts a step (data.train_batch_size), n responses per prompt (its rollout_n), R learner rows
per prompt (its own n plus, when the method shares, its peers'), a mean prompt of L_p tokens and
a mean response of L_r tokens (`trainer.time_model.prompt_fill` and `response_fill` of
data.max_prompt_length and data.max_response_length). F is the GPU's dense bf16 FLOP/s, M its
memory bandwidth in bytes/s.

    gen            prefill 2·P·B·n·L_p / (W·F·FORWARD_MFU) + decode, the larger of
                   memory: W/T replicas decode side by side, each its s = B·n·T/W sequences, at
                   most C at once (its KV cache, max_num_seqs): max(1, s/C)·L_r decode steps, each
                   reading the replica's weights 2·P/T on every GPU, and every sequence reading
                   its KV cache at its mean context L_p + L_r/2 at every step, both at
                   M·DECODE_BANDWIDTH_FRACTION; compute: 2·P·B·n·L_r / (W·F·FORWARD_MFU)
    old_log_prob   2·P·B·n·(L_p + L_r) / (W·F·FORWARD_MFU)   (the agent's own rows)
    ref            2·P·B·R·(L_p + L_r) / (W·F·FORWARD_MFU)   (only with a KL term)
    update_actor   k·P·B·R·(L_p + L_r)·ppo_epochs / (W·F·TRAIN_MFU), k = 6 (forward 2, backward 4),
                   8 with gradient checkpointing (the forward again); a LoRA agent skips the weight
                   gradients of the base: 4 (6). Offloaded FSDP state comes back from the host
                   and goes out again: + 2·offloaded bytes per GPU / HOST_COPY_BYTES_PER_S
    update_weights 2·P bytes (bf16) / WEIGHT_SYNC_BYTES_PER_S (an intra-node copy)

and the driver's phases, on its CPU: `reward` scores every response (SCORE_S_PER_RESPONSE each),
`exchange` waits for the peer rows re-tokenized for each learner (CONVERT_S_PER_ROW each), less
what ran in the background during the old-log-prob phase (trainer.exchange_workers > 0 or null).

The lockstep rule (`lockstep_step_time`): every phase is a barrier across agents, so a step is
Σ over phases of the slowest agent's time in it, plus the driver's phases, which no agent
overlaps. Agents of the shared pool take turns: a phase costs the sum over them instead.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import dataclass, field
from typing import Callable, Iterator

from recipe_hacpo.cluster.planner import BF16_BYTES, GIB, ModelShape, kv_bytes_per_token, plan_agent
from recipe_hacpo.hacpo_settings import ConfigError


@dataclass(frozen=True)
class GpuKind:
    """A GPU's datasheet figures the time model uses."""

    name: str
    flops: float  # dense bf16 FLOP/s (no structured sparsity)
    bandwidth: float  # HBM bytes/s


GPU_KINDS = {
    "h100": GpuKind("NVIDIA H100 SXM", 989e12, 3.35e12),
    "h200": GpuKind("NVIDIA H200 SXM", 989e12, 4.8e12),
    "a100": GpuKind("NVIDIA A100 80GB SXM", 312e12, 2.0e12),
}
"""`trainer.gpu_kind` -> its datasheet figures."""

# Efficiency constants. ASSUMPTIONS, not measured on a GPU by this recipe: typical fractions of the
# datasheet that FSDP training, forward-only passes and vLLM's decoding reach on models of 1-8 B.
TRAIN_MFU = 0.35  # model FLOPs utilization of an FSDP forward + backward (update_actor)
FORWARD_MFU = 0.45  # of a forward pass without backward (old and reference log-probs, prefill)
DECODE_BANDWIDTH_FRACTION = 0.6  # of the HBM bandwidth that vLLM's decode steps achieve
WEIGHT_SYNC_BYTES_PER_S = 50e9  # the actor's bf16 weights into its vLLM replica, within a node
HOST_COPY_BYTES_PER_S = 25e9  # offloaded FSDP state between host and GPU memory (PCIe)
# the driver's CPU work, per item (assumptions of the same kind)
SCORE_S_PER_RESPONSE = 2e-3  # one response decoded and scored (math-verify)
CONVERT_S_PER_ROW = 0.2e-3  # one peer row re-tokenized for a learner

TIME_MODEL_KEYS = ("prompt_fill", "response_fill")
"""The keys of `trainer.time_model` (defaults and meanings: configs/hacpo_base.yaml)."""


@dataclass(frozen=True)
class TimeSettings:
    """`trainer.gpu_kind` and `trainer.time_model`, typed and checked."""

    gpu_kind: str = "h100"
    prompt_fill: float = 0.3
    response_fill: float = 0.5

    @property
    def gpu(self) -> GpuKind:
        return GPU_KINDS[self.gpu_kind]

    @classmethod
    def from_config(cls, trainer) -> "TimeSettings":
        """From the `trainer` section; a one-line ConfigError (a ValueError) naming the key at fault."""
        kind = str(trainer.get("gpu_kind", cls.gpu_kind))
        if kind not in GPU_KINDS:
            raise ConfigError(f"trainer.gpu_kind={kind!r}: not a known GPU kind (known: {', '.join(GPU_KINDS)})")
        node = trainer.get("time_model") or {}
        unknown = [k for k in node.keys() if k not in TIME_MODEL_KEYS]
        if unknown:
            raise ConfigError(f"trainer.time_model.{unknown[0]}: not a key (known: {', '.join(TIME_MODEL_KEYS)})")
        fills = {}
        for key in TIME_MODEL_KEYS:
            value = node.get(key, getattr(cls, key))
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
                raise ConfigError(f"trainer.time_model.{key}={value!r}: a fraction of the maximum length, in (0, 1]")
            fills[key] = float(value)
        return cls(gpu_kind=kind, **fills)


# ---------------------------------------------------------------------------------- formulas
def prefill_s(params: int, sequences: int, prompt_tokens: float, gpus: int, gpu: GpuKind) -> float:
    """2·P·sequences·L_p / (W·F·FORWARD_MFU): every prompt of every sequence, compute-bound (what
    vLLM's prefix cache saves on the n responses of one prompt is not counted)."""
    return 2 * params * sequences * prompt_tokens / (gpus * gpu.flops * FORWARD_MFU)


def decode_s(params: int, kv_bytes: int, sequences: int, prompt_tokens: float, response_tokens: float,
             gpus: int, tp: int, gpu: GpuKind, concurrent: float = math.inf) -> float:
    """max(memory, compute) of decoding L_r tokens for each of `sequences` on W GPUs, W/T replicas.

    memory = (L_r · waves · 2·P/T + s · L_r · (L_p + L_r/2) · kv) / (M·DECODE_BANDWIDTH_FRACTION):
    each replica decodes its s = sequences·T/W sequences, at most `concurrent` at once (what its
    KV cache holds and max_num_seqs allows), in waves = max(1, s / concurrent) rounds of L_r steps;
    every step reads, on each GPU, its share of the weights once, and over the whole decode each
    sequence reads its KV cache (`kv`: bytes per token on one GPU at T) at its mean context.
    compute = 2·P·sequences·L_r / (W·F·FORWARD_MFU).
    """
    per_replica = sequences * tp / gpus
    waves = max(1.0, per_replica / concurrent)
    weight_bytes = response_tokens * waves * BF16_BYTES * params / tp
    kv_read = per_replica * response_tokens * (prompt_tokens + response_tokens / 2) * kv_bytes
    memory = (weight_bytes + kv_read) / (gpu.bandwidth * DECODE_BANDWIDTH_FRACTION)
    compute = 2 * params * sequences * response_tokens / (gpus * gpu.flops * FORWARD_MFU)
    return max(memory, compute)


def concurrent_sequences(kv_budget: int, kv_bytes: int, prompt_tokens: float, response_tokens: float,
                         max_num_seqs: int | None) -> float:
    """Sequences one replica decodes at once: min(max_num_seqs, KV budget per GPU / (kv·(L_p + L_r/2))),
    at least 1 (`kv_budget`: the memory plan's KV cache per GPU)."""
    held = max(0, kv_budget) / (kv_bytes * (prompt_tokens + response_tokens / 2))
    return max(1.0, min(float(max_num_seqs) if max_num_seqs else math.inf, held))


def forward_s(params: int, rows: int, row_tokens: float, gpus: int, gpu: GpuKind) -> float:
    """2·P·rows·tokens / (W·F·FORWARD_MFU): log-probs of `rows` rows (old or reference)."""
    return 2 * params * rows * row_tokens / (gpus * gpu.flops * FORWARD_MFU)


def update_flops_per_token(params: int, checkpointing: bool, lora: bool) -> float:
    """k·P: 6·P (forward 2, backward 4), +2·P with gradient checkpointing (the forward again);
    LoRA leaves out the base weights' gradients (2·P of the backward)."""
    k = 6 + (2 if checkpointing else 0) - (2 if lora else 0)
    return k * params


def update_s(params: int, rows: int, row_tokens: float, gpus: int, gpu: GpuKind, *, checkpointing: bool,
             lora: bool = False, epochs: int = 1, offloaded_bytes: int = 0) -> float:
    """k·P·rows·tokens·epochs / (W·F·TRAIN_MFU) + 2·offloaded bytes per GPU / HOST_COPY_BYTES_PER_S."""
    compute = update_flops_per_token(params, checkpointing, lora) * rows * row_tokens * epochs / (gpus * gpu.flops * TRAIN_MFU)
    return compute + 2 * offloaded_bytes / HOST_COPY_BYTES_PER_S


def weight_sync_s(params: int) -> float:
    """2·P bytes (bf16 weights) / WEIGHT_SYNC_BYTES_PER_S."""
    return BF16_BYTES * params / WEIGHT_SYNC_BYTES_PER_S


def scoring_s(responses: int) -> float:
    """responses · SCORE_S_PER_RESPONSE (the driver's `reward` phase)."""
    return responses * SCORE_S_PER_RESPONSE


def exchange_s(converted_rows: int, hidden_s: float = 0.0) -> float:
    """max(0, rows · CONVERT_S_PER_ROW − hidden_s): what the exchange phase still waits for when
    the conversions ran `hidden_s` seconds in the background before it."""
    return max(0.0, converted_rows * CONVERT_S_PER_ROW - hidden_s)


# ---------------------------------------------------------------------------------- the rule
def lockstep_step_time(agent_phases: dict[str, dict[str, float]], driver: dict[str, float],
                       shared: set[str] | frozenset[str] = frozenset()) -> float:
    """Σ over phases of max over own-pool agents (agents of the `shared` pool: the sum over them,
    they take turns; with both: the larger of the two) + Σ of the driver's phases."""
    return sum(_phase_cost(agent_phases, phase, shared) for phase in _phases(agent_phases)) + sum(driver.values())


def _phases(agent_phases: dict[str, dict[str, float]]) -> list[str]:
    return list(dict.fromkeys(p for phases in agent_phases.values() for p in phases))


def _phase_cost(agent_phases: dict[str, dict[str, float]], phase: str, shared) -> float:
    own = max((t.get(phase, 0.0) for a, t in agent_phases.items() if a not in shared), default=0.0)
    turns = sum(t.get(phase, 0.0) for a, t in agent_phases.items() if a in shared)
    return max(own, turns)


def barrier_s(agent_phases: dict[str, dict[str, float]], shared=frozenset()) -> float:
    """What the barriers cost: Σ over phases of the slowest agent − the busiest pool's own Σ over
    phases (a shared pool's is the sum over its agents). 0 when one pool is slowest in every phase."""
    barriered = sum(_phase_cost(agent_phases, p, shared) for p in _phases(agent_phases))
    pools = [sum(t.values()) for a, t in agent_phases.items() if a not in shared]
    pools.append(sum(sum(t.values()) for a, t in agent_phases.items() if a in shared))
    return barriered - max(pools)


@dataclass
class PhaseTimes:
    """Seconds per phase: each agent's ({agent: {phase: s}}) and the driver's ({phase: s})."""

    agents: dict[str, dict[str, float]]
    driver: dict[str, float]
    shared: frozenset[str] = frozenset()

    @property
    def step_s(self) -> float:
        return lockstep_step_time(self.agents, self.driver, self.shared)

    def busy_fraction(self) -> dict[str, float]:
        """Per pool (an own-pool agent's name, or "shared"): its Σ of phases / the step."""
        step = self.step_s
        busy = {a: sum(t.values()) for a, t in self.agents.items() if a not in self.shared}
        if self.shared:
            busy["shared"] = sum(sum(t.values()) for a, t in self.agents.items() if a in self.shared)
        return {pool: s / step for pool, s in busy.items()}


# ---------------------------------------------------------------------------------- from a config
@dataclass(frozen=True)
class AgentLoad:
    """What one agent does in a step, as the formulas take it."""

    name: str
    params: int  # P
    gpus: int  # W
    tp: int  # T
    kv_bytes: int  # KV cache bytes per token on one GPU at T
    responses: int  # B·n
    learner_rows: int  # B·R
    prompt_tokens: float  # L_p
    response_tokens: float  # L_r
    concurrent: float = math.inf  # sequences a replica decodes at once (`concurrent_sequences`)
    checkpointing: bool = False
    lora: bool = False
    epochs: int = 1
    uses_ref: bool = False
    offloaded_bytes: int = 0  # FSDP state per GPU that an update brings back from the host


def agent_phase_times(load: AgentLoad, gpu: GpuKind) -> dict[str, float]:
    """{phase: seconds} of one agent, in the trainer's phase names (see the module docstring)."""
    row_tokens = load.prompt_tokens + load.response_tokens
    phases = {
        "gen": prefill_s(load.params, load.responses, load.prompt_tokens, load.gpus, gpu)
        + decode_s(load.params, load.kv_bytes, load.responses, load.prompt_tokens, load.response_tokens,
                   load.gpus, load.tp, gpu, load.concurrent),
        "old_log_prob": forward_s(load.params, load.responses, row_tokens, load.gpus, gpu),
    }
    if load.uses_ref:
        phases["ref"] = forward_s(load.params, load.learner_rows, row_tokens, load.gpus, gpu)
    phases["update_actor"] = update_s(load.params, load.learner_rows, row_tokens, load.gpus, gpu,
                                      checkpointing=load.checkpointing, lora=load.lora, epochs=load.epochs,
                                      offloaded_bytes=load.offloaded_bytes)
    phases["update_weights"] = weight_sync_s(load.params)
    return phases


def agent_load(cfg, spec, shape: ModelShape, rows_per_prompt: int, gpus: int, settings: TimeSettings) -> AgentLoad:
    """One agent's load from the config (`spec` is a config.AgentSpec; only its attributes are used)."""
    actor, rollout, model = spec.section(cfg, "actor"), spec.section(cfg, "rollout"), spec.section(cfg, "model")
    batch = int(cfg.data.train_batch_size)
    tp = int(rollout.get("tensor_model_parallel_size") or 1)
    params = shape.num_params()
    kv_bytes = kv_bytes_per_token(shape, tp, str(rollout.get("dtype") or "bfloat16"))
    prompt_tokens = settings.prompt_fill * int(cfg.data.max_prompt_length)
    response_tokens = settings.response_fill * int(cfg.data.max_response_length)
    # the KV cache per GPU does not depend on the pool's size: the memory plan's, on one GPU
    kv_budget = plan_agent(cfg, spec, int(float(cfg.trainer.get("gpu_memory_gib", 80)) * GIB), shape).kv_budget
    lora = int(model.get("lora_rank") or 0) > 0
    fsdp = actor.get("fsdp_config") or {}
    offloaded = 0
    if bool(fsdp.get("param_offload", False)):
        offloaded += 4 * params // gpus  # fp32 weights
    if bool(fsdp.get("optimizer_offload", False)) and not lora:
        offloaded += 8 * params // gpus  # Adam moments
    return AgentLoad(
        name=spec.name,
        params=params,
        gpus=gpus,
        tp=tp,
        kv_bytes=kv_bytes,
        responses=batch * spec.rollout_n,
        learner_rows=batch * rows_per_prompt,
        prompt_tokens=prompt_tokens,
        response_tokens=response_tokens,
        concurrent=concurrent_sequences(kv_budget, kv_bytes, prompt_tokens, response_tokens, rollout.get("max_num_seqs")),
        checkpointing=bool(model.get("enable_gradient_checkpointing", False)),
        lora=lora,
        epochs=int(actor.get("ppo_epochs") or 1),
        uses_ref=bool(actor.get("use_kl_loss", False)) or bool(cfg.algorithm.get("use_kl_in_reward", False)),
        offloaded_bytes=offloaded,
    )


def pool_gpus(cfg, spec) -> int:
    """W of an agent: its own pool (n_gpus_per_node × nnodes) or the shared pool's."""
    if spec.uses_shared_pool:
        return int(cfg.trainer.n_gpus_per_node) * int(cfg.trainer.nnodes)
    return spec.n_gpus_per_node * spec.nnodes


def estimate(cfg, specs, shapes: dict[str, ModelShape], rows_per_prompt: dict[str, int],
             split: dict[str, int] | None = None) -> PhaseTimes:
    """Every agent's phase times and the driver's, for the config's GPUs or for `split`
    ({agent: GPUs of its own one-node pool}). `rows_per_prompt`: each learner's R, the method's
    (`Method.rows_per_prompt`)."""
    settings = TimeSettings.from_config(cfg.trainer)
    gpu = settings.gpu
    loads = [agent_load(cfg, s, shapes[s.name], rows_per_prompt[s.name],
                        split[s.name] if split is not None else pool_gpus(cfg, s), settings) for s in specs]
    agents = {load.name: agent_phase_times(load, gpu) for load in loads}
    shared = frozenset(s.name for s in specs if s.uses_shared_pool and (split is None or s.name not in split))
    batch = int(cfg.data.train_batch_size)
    converted = sum(batch * rows_per_prompt[s.name] - batch * s.rollout_n for s in specs)
    background = cfg.trainer.get("exchange_workers") != 0
    hidden = _phase_cost(agents, "old_log_prob", shared) if background else 0.0
    driver = {"reward": scoring_s(sum(load.responses for load in loads)), "exchange": exchange_s(converted, hidden)}
    return PhaseTimes(agents=agents, driver=driver, shared=shared)


# ---------------------------------------------------------------------------------- GPU split
@dataclass(frozen=True)
class SplitCandidate:
    """One static split of the GPUs: its lockstep step estimate and whether the config allows it."""

    split: dict[str, int]
    step_s: float
    relative: float  # step_s / the current split's
    refused: str | None = None  # the check's one-line reason; None: valid (or not checked)
    checked: bool = False
    asynchronous_s: float | None = None  # the asynchronous estimate, when one was supplied

    @property
    def valid(self) -> bool:
        return self.checked and self.refused is None


def compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Every way to write `total` as an ordered sum of `parts` positive integers."""
    if parts == 1:
        if total >= 1:
            yield (total,)
        return
    for first in range(1, total - parts + 2):
        for rest in compositions(total - first, parts - 1):
            yield (first, *rest)


def split_search_problem(specs) -> str | None:
    """Why the split of a config is not searched (None: it is)."""
    if any(s.uses_shared_pool for s in specs):
        return "one shared pool: agents take turns, a split does not apply"
    if len(specs) < 2:
        return "one agent: nothing to split"
    if any(s.nnodes != 1 for s in specs):
        return "an agent's pool spans several nodes (nnodes > 1): splits are searched for one-node pools only"
    return None


def rank_splits(current: dict[str, int], step_of: Callable[[dict[str, int]], float],
                check: Callable[[dict[str, int]], str | None] | None = None,
                asynchronous: Callable[[dict[str, int]], float] | None = None,
                top: int = 5) -> list[SplitCandidate]:
    """Every split of the current split's GPUs over its agents (compositions of the total), fastest
    lockstep step first (the current split first among equals).

    `check(split)` returns None for a split the config allows, else a one-line reason; it is
    asked, in rank order, of the `top` fastest, of every split up to the first valid one, and of
    the current split (the others are left unchecked). `asynchronous(split)`, if given, estimates
    a step of an asynchronous run on that split, for the same candidates.
    """
    names = list(current)
    base = step_of(current)
    ranked = []
    for parts in compositions(sum(current.values()), len(names)):
        split = dict(zip(names, parts))
        step = step_of(split)
        ranked.append((step, split != current, parts, split))
    ranked.sort(key=lambda r: r[:3])
    out, found_valid = [], False
    for i, (step, _, _, split) in enumerate(ranked):
        wanted = i < top or not found_valid or split == current
        refused = check(split) if wanted and check is not None else None
        found_valid = found_valid or (wanted and check is not None and refused is None)
        out.append(SplitCandidate(
            split=split, step_s=step, relative=step / base if base > 0 else math.nan, refused=refused,
            checked=wanted and check is not None,
            asynchronous_s=asynchronous(split) if wanted and asynchronous is not None else None,
        ))
    return out


# ---------------------------------------------------------------------------------- recorded runs
_AGENT_TIMING = re.compile(r"^agent/(?P<agent>[^/]+)/timing_s/(?P<phase>.+)$")
# inside the driver's `exchange` phase: background conversions and the wait for them
_NOT_DRIVER_PHASES = ("exchange_wait", "exchange_background", "step")


def recorded_phases(metrics: dict) -> tuple[dict[str, dict[str, float]], dict[str, float], float | None]:
    """(agent phases, driver phases, measured step) of one step's logged metrics.

    Agent phases: `agent/<k>/timing_s/<phase>` for every phase the step itself timed
    (`timing_s/<phase>` exists). An agent phase without one (GRAFT's graft_old_log_prob) ran
    inside a driver phase and is counted there. Driver phases: every `timing_s/<phase>` that is
    no agent phase, except exchange_wait and exchange_background (inside `exchange`) and step.
    """
    step_phases = {k[len("timing_s/"):] for k in metrics if k.startswith("timing_s/")}
    agents: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        m = _AGENT_TIMING.match(key)
        if m and m["phase"] in step_phases:
            agents.setdefault(m["agent"], {})[m["phase"]] = float(value)
    agent_phases = {p for t in agents.values() for p in t}
    driver = {p: float(metrics[f"timing_s/{p}"]) for p in sorted(step_phases)
              if p not in agent_phases and p not in _NOT_DRIVER_PHASES}
    measured = metrics.get("timing_s/step")
    return agents, driver, None if measured is None else float(measured)


@dataclass(frozen=True)
class RecordedStep:
    step: int
    predicted_s: float  # the lockstep rule on the step's recorded phases
    measured_s: float  # timing_s/step
    barrier_s: float  # `barrier_s` of the step's agent phases

    @property
    def error(self) -> float:
        """(predicted − measured) / measured."""
        return (self.predicted_s - self.measured_s) / self.measured_s


@dataclass
class RecordedCheck:
    """The lockstep rule against a run's measured steps."""

    path: str
    steps: list[RecordedStep] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)  # training steps left out (warm-up)

    @property
    def median_abs_error(self) -> float:
        return statistics.median(abs(s.error) for s in self.steps)

    @property
    def max_abs_error(self) -> float:
        return max(abs(s.error) for s in self.steps)

    @property
    def total_ratio(self) -> float:
        """Σ predicted / Σ measured over the steps."""
        return sum(s.predicted_s for s in self.steps) / sum(s.measured_s for s in self.steps)

    @property
    def median_barrier_s(self) -> float:
        return statistics.median(s.barrier_s for s in self.steps)

    @property
    def barrier_share(self) -> float:
        """Σ barrier cost / Σ measured step."""
        return sum(s.barrier_s for s in self.steps) / sum(s.measured_s for s in self.steps)


def check_recorded_run(path: str, skip_first: int = 1, shared: frozenset[str] = frozenset()) -> RecordedCheck:
    """The lockstep rule's prediction of every training step of a metrics.jsonl ({"step", "data"}
    a line) against its `timing_s/step`. Lines without timing_s/step (step 0's validation) are
    not steps; the first `skip_first` steps (warm-up) are left out. `timing_s/step` times
    train_step only (validation and checkpoints come after it), so no step is excluded for them.
    `shared`: the agents that shared a pool in that run."""
    report = RecordedCheck(path=path)
    steps = recorded_training_steps(path)
    report.skipped = [step for step, _ in steps[:skip_first]]
    for step, data in steps[skip_first:]:
        agents, driver, measured = recorded_phases(data)
        report.steps.append(RecordedStep(step=step, predicted_s=lockstep_step_time(agents, driver, shared),
                                         measured_s=measured, barrier_s=barrier_s(agents, shared)))
    if not report.steps:
        raise ValueError(f"{path}: no training step with timing_s/step after the first {skip_first}")
    return report


def recorded_training_steps(path: str) -> list[tuple[int, dict]]:
    """(step, metrics) of every training step of a metrics.jsonl ({"step", "data"} a line), in
    step order; lines without timing_s/step (step 0's validation) are not training steps."""
    with open(path, encoding="utf-8") as f:
        records = [json.loads(line) for line in f if line.strip()]
    return sorted(((int(r["step"]), r["data"]) for r in records if "timing_s/step" in r["data"]), key=lambda sd: sd[0])
