"""Does each agent's rollout engine sample from the policy the trainer trains?

Every step, before any update, the log-probs the rollout engine reported for the tokens it
sampled are held against the actor's old log-probs of the same tokens (the agent's own
response tokens). Apart from numerics the two differ only when the engine runs other weights
than the actor: a weight sync that did not arrive, a parameter the engine's loader skipped
(a tied output layer, say), an architecture the engine implements differently. Training on
such samples trains on another policy's data without a word; `trainer.rollout_check` turns
the measurement into a decision: stop the run before the update (default), warn, or nothing.

What healthy looks like depends on the precision of the two sides:

- fp32 on both (actor `fsdp_config.mixed_precision.param_dtype` and `rollout.dtype`): the
  two agree to about 1e-6 per token, so any token off by 1e-3 is a fault;
- bf16 (or fp16) on either side: a few rare tokens differ by 0.5-1 nat in healthy runs, so the
  max says nothing; the mean |Δ| (healthy runs report about 0.06) and the token-level Pearson
  correlation of the two log-prob vectors (about 0.998 healthy; an engine on a random output
  layer measured -0.1 to 0.3) separate health from fault.

The keys, their defaults and their meaning are declared once, in `ROLLOUT_CHECK_DEFAULTS`
below; `recipe_hacpo/configs/__init__.py` registers them as the `trainer.rollout_check` node
that `hacpo_base.yaml` lists in its defaults.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from recipe_hacpo.hacpo_settings import ConfigError

if TYPE_CHECKING:  # the module is imported while Hydra composes the config: no torch import
    import torch

PATH = "trainer.rollout_check"
ACTIONS = ("stop", "warn", "off")
PRECISIONS = ("fp32", "bf16")
_LIMIT_KEYS = ("max_abs", "mean_abs", "min_pearson")
_FP32_NAMES = {"fp32", "float32", "float", "torch.float32"}

ROLLOUT_CHECK_DEFAULTS: dict[str, Any] = {
    # stop: fail the step before any update, one line naming the agent, the step and the figures
    # | warn: print that line and train on | off: measure only (the rollout/* metrics)
    "action": "stop",
    # both sides fp32: healthy runs agree to ~1e-6 per token, a tiny Qwen3 with its 152k-id output
    # layer on vLLM's CPU kernels included (3e-6 at most: workers/vllm_rollout.py::accurate_cpu_logprobs)
    "fp32": {"max_abs": 1.0e-3, "mean_abs": 1.0e-4, "min_pearson": 0.999},
    # bf16 or fp16 on either side: no max (rare tokens reach 0.5-1 nat when healthy); healthy
    # runs report a mean |Δ| near 0.06 and a correlation near 0.998
    "bf16": {"max_abs": None, "mean_abs": 0.15, "min_pearson": 0.9},
    # the correlation is judged over at least this many tokens of the agent's step
    "min_tokens": 32,
}
"""`trainer.rollout_check`, every key with its default (null: that limit off)."""


def defaults_node() -> dict[str, Any]:
    """The `trainer.rollout_check` node Hydra composes (a deep copy of the defaults)."""
    return {k: dict(v) if isinstance(v, dict) else v for k, v in ROLLOUT_CHECK_DEFAULTS.items()}


@dataclass(frozen=True)
class MismatchLimits:
    """Limits for one precision; None switches that statistic's limit off."""

    max_abs: float | None
    mean_abs: float | None
    min_pearson: float | None


@dataclass(frozen=True)
class RolloutCheck:
    """Typed `trainer.rollout_check`."""

    action: str
    fp32: MismatchLimits
    bf16: MismatchLimits
    min_tokens: int

    @classmethod
    def from_config(cls, node: Mapping[str, Any] | None) -> "RolloutCheck":
        node = dict(node or {})
        unknown = set(node) - set(ROLLOUT_CHECK_DEFAULTS)
        if unknown:
            raise ConfigError(f"{PATH}.{sorted(unknown)[0]}: unknown key; known: {sorted(ROLLOUT_CHECK_DEFAULTS)}")
        action = str(node.get("action", ROLLOUT_CHECK_DEFAULTS["action"]))
        if action not in ACTIONS:
            raise ConfigError(f"{PATH}.action={action!r}: must be one of {', '.join(ACTIONS)}")
        min_tokens = node.get("min_tokens", ROLLOUT_CHECK_DEFAULTS["min_tokens"])
        if not isinstance(min_tokens, int) or isinstance(min_tokens, bool) or min_tokens < 2:
            raise ConfigError(f"{PATH}.min_tokens={min_tokens!r}: must be an integer >= 2")
        limits = {p: _limits(p, node.get(p)) for p in PRECISIONS}
        return cls(action=action, fp32=limits["fp32"], bf16=limits["bf16"], min_tokens=min_tokens)

    def limits(self, precision: str) -> MismatchLimits:
        return self.fp32 if precision == "fp32" else self.bf16


def _limits(precision: str, node: Mapping[str, Any] | None) -> MismatchLimits:
    merged = dict(ROLLOUT_CHECK_DEFAULTS[precision])
    node = dict(node or {})
    unknown = set(node) - set(_LIMIT_KEYS)
    if unknown:
        raise ConfigError(f"{PATH}.{precision}.{sorted(unknown)[0]}: unknown key; known: {', '.join(_LIMIT_KEYS)}")
    merged.update(node)
    for key in _LIMIT_KEYS:
        value = merged[key]
        if value is None:
            continue
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if key == "min_pearson":
            ok = ok and -1.0 <= value <= 1.0
            rule = "a number in [-1, 1] or null"
        else:
            ok = ok and value > 0
            rule = "a number > 0 or null"
        if not ok:
            raise ConfigError(f"{PATH}.{precision}.{key}={value!r}: must be {rule} (null: no limit)")
        merged[key] = float(value)
    return MismatchLimits(**merged)


def precision_of(actor_param_dtype: Any, rollout_dtype: Any) -> str:
    """"fp32" when the actor computes in fp32 and the engine runs fp32; "bf16" otherwise."""
    both = (str(actor_param_dtype).lower(), str(rollout_dtype).lower())
    return "fp32" if all(d in _FP32_NAMES for d in both) else "bf16"


def agent_precision(agent_config: Any) -> str:
    """The precision of one agent's two sides, read from its verl config (`actor_rollout_ref`).

    verl computes the actor in `fsdp_config.mixed_precision.param_dtype` (bf16 when unset) and
    runs the engine in `rollout.dtype`. A LoRA actor synced with `model.lora.merge=true` is bf16
    on the engine side whatever both dtypes say: verl's FSDP engine sends the merged weights
    rounded to bfloat16 (`FSDPEngine._merged_lora_per_tensor_param`), measured on a tiny fp32
    Qwen2 as max |Δ| 4e-3, mean 6e-4 per token against ~1e-6 unmerged.
    """
    arr = agent_config.actor_rollout_ref
    model = arr.get("model") or {}
    if (model.get("lora_rank") or 0) > 0 and bool((model.get("lora") or {}).get("merge", False)):
        return "bf16"
    mixed = (arr.actor.get("fsdp_config") or {}).get("mixed_precision") or {}
    return precision_of(mixed.get("param_dtype", "bf16"), arr.rollout.get("dtype", "bfloat16"))


@dataclass(frozen=True)
class MismatchStats:
    """Engine vs trainer log-probs over one agent's own response tokens of one step."""

    tokens: int
    max_abs: float
    mean_abs: float
    # NaN when undefined (fewer than 2 tokens, or one side constant)
    pearson: float


def mismatch_stats(engine_log_probs: torch.Tensor, trainer_log_probs: torch.Tensor, mask: torch.Tensor) -> MismatchStats:
    """Statistics of |engine − trainer| log-prob per sampled token, in float64.

    Args:
        engine_log_probs: [B, R] the rollout engine's log-probs of the tokens it sampled.
        trainer_log_probs: [B, R] the actor's old log-probs of the same tokens.
        mask: [B, R] 1 on the response tokens the model generated.
    """
    keep = mask.bool()
    engine = engine_log_probs.double()[keep]
    trainer = trainer_log_probs.double()[keep]
    n = int(engine.numel())
    if n == 0:
        return MismatchStats(0, 0.0, 0.0, math.nan)
    diff = (engine - trainer).abs()
    return MismatchStats(n, float(diff.max()), float(diff.mean()), _pearson(engine, trainer))


def _pearson(x: torch.Tensor, y: torch.Tensor) -> float:
    if x.numel() < 2:
        return math.nan
    xc, yc = x - x.mean(), y - y.mean()
    denom = math.sqrt(float((xc * xc).sum()) * float((yc * yc).sum()))
    if denom == 0.0:
        return math.nan
    return float((xc * yc).sum()) / denom


def violations(stats: MismatchStats, limits: MismatchLimits, min_tokens: int) -> list[str]:
    """What is out of limits, each as `<statistic> <value> <op> <limit>`; empty when healthy."""
    out = []
    if stats.tokens == 0:
        return out
    if limits.max_abs is not None and stats.max_abs > limits.max_abs:
        out.append(f"max |Δ| {stats.max_abs:.3g} > {limits.max_abs:g}")
    if limits.mean_abs is not None and stats.mean_abs > limits.mean_abs:
        out.append(f"mean |Δ| {stats.mean_abs:.3g} > {limits.mean_abs:g}")
    judged = stats.tokens >= min_tokens and not math.isnan(stats.pearson)
    if limits.min_pearson is not None and judged and stats.pearson < limits.min_pearson:
        out.append(f"pearson {stats.pearson:.3f} < {limits.min_pearson:g}")
    return out


def mismatch_message(step: int, precision: str, stats: MismatchStats, violated: list[str]) -> str:
    """What a fired check says about one agent (the trainer adds the agent and what it does)."""
    return (
        f"step {step}: the rollout engine's log-probs disagree with the trainer's over {stats.tokens} sampled "
        f"tokens ({', '.join(violated)}; {precision} limits of {PATH}): the engine is not sampling from the "
        "policy being trained (a weight sync that did not arrive, a parameter the engine never loaded)"
    )
