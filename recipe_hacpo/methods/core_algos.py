"""HACPO's algorithm core: capability tracking, the capability-aware advantage and the loss.

Pure torch/numpy (no Ray, no GPU, no verl import), so it can be checked in isolation and
called from verl's worker processes. Every function names the section of docs/ALGORITHM.md it
implements and uses the paper's symbols:

    k        learner agent;  j = src(i) the agent that generated response i
    R_i      scalar verifier reward of response i
    P̂^(j)    agent j's smoothed capability (mean reward over the last K steps)     §1
    ω^(k,j)  P̂^(k) / P̂^(j), clamped                                               §1
    s_i      sequence-level, length-normalised importance ratio                    §4, §6
    c_i      s_i clipped to [lower_m, 1] (cross samples)                           §5
    m        optimizer updates the learner already made in this training step     §5

Shapes: B rows (responses), T learner response tokens, N agents.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Sequence

import numpy as np
import torch

from recipe_hacpo.asynchronous.capability import smoothed_capability

# the keys' defaults and the allowed values are declared once, in recipe_hacpo.hacpo_settings
from recipe_hacpo.hacpo_settings import CROSS_CLIP_MODES, CROSS_RATIO_LENGTHS, DEFAULTS

__all__ = [
    "CROSS_CLIP_MODES",
    "CROSS_RATIO_LENGTHS",
    "CapabilityTracker",
    "accumulation_dtype",
    "to_accumulation_dtype",
    "capability_ratio",
    "capability_ratios",
    "capability_baseline",
    "compute_hacpo_advantage",
    "cross_lower_bound",
    "exponential_is_weight",
    "hacpo_policy_loss_matrix",
    "row_clipped",
    "seq_mean_token_mean",
    "compute_hacpo_policy_loss",
]

# verl clamps the log of the GSPO ratio at 10 for numerical stability; the same bound is
# applied here so that one agent with no cross rows reproduces verl's `gspo` loss exactly.
_LOG_RATIO_MAX = 10.0


# ---------------------------------------------------------------------------------------
# §1 capability tracking
# ---------------------------------------------------------------------------------------
class CapabilityTracker:
    """Smoothed capability P̂^(j)_t of every agent (spec §1).

    P^(j)_t is agent j's mean reward on its own rollouts of step t; P̂^(j)_t is the mean of
    P^(j) over the last `window` (K) steps including t, floored at `floor` (ε_P) so that the
    ratios ω stay finite. Before the first `update` every agent has capability 1 (all ω = 1).

    The history is training state: `state_dict()` / `load_state_dict()` checkpoint it.
    """

    def __init__(
        self,
        num_agents: int,
        window: int = DEFAULTS.window,
        floor: float = DEFAULTS.capability_floor,
        omega_clip: tuple[float, float] = DEFAULTS.omega_clip,
    ) -> None:
        if num_agents < 1:
            raise ValueError(f"CapabilityTracker: num_agents must be >= 1, got {num_agents}")
        if window < 1:
            raise ValueError(f"CapabilityTracker: window (K) must be >= 1, got {window}")
        if not floor > 0:
            raise ValueError(f"CapabilityTracker: floor (ε_P) must be > 0, got {floor}")
        _check_omega_clip(omega_clip)
        self.num_agents = int(num_agents)
        self.window = int(window)
        self.floor = float(floor)
        self.omega_clip = (float(omega_clip[0]), float(omega_clip[1]))
        self._history: deque[list[float]] = deque(maxlen=self.window)

    def update(self, step_mean_rewards: Sequence[float]) -> None:
        """Record P^(j)_t for every agent j (one value per agent, once per training step)."""
        values = [float(v) for v in step_mean_rewards]
        if len(values) != self.num_agents:
            raise ValueError(
                f"CapabilityTracker.update: expected {self.num_agents} mean rewards (one per agent), "
                f"got {len(values)}"
            )
        if not all(np.isfinite(values)):
            raise ValueError(f"CapabilityTracker.update: non-finite mean reward in {values}")
        self._history.append(values)

    def capabilities(self) -> torch.Tensor:
        """P̂ per agent, float64 [N], floored at ε_P (ones before the first update); the formula
        is `smoothed_capability`, the same the asynchronous agents' series computes."""
        columns = list(zip(*self._history)) or [()] * self.num_agents
        return torch.tensor([smoothed_capability(c, self.floor) for c in columns], dtype=torch.float64)

    def omega(self, k: int, j: int) -> float:
        """ω^(k,j) = P̂^(k) / P̂^(j), clamped to `omega_clip`; ω^(k,k) = 1."""
        return capability_ratio(self.capabilities(), k, j, self.omega_clip)

    @property
    def num_updates(self) -> int:
        """Steps currently inside the window (≤ K)."""
        return len(self._history)

    def state_dict(self) -> dict[str, Any]:
        return {
            "num_agents": self.num_agents,
            "window": self.window,
            "floor": self.floor,
            "omega_clip": list(self.omega_clip),
            "history": [list(row) for row in self._history],
        }

    def load_state_dict(self, d: dict[str, Any]) -> None:
        if int(d["num_agents"]) != self.num_agents:
            raise ValueError(
                f"CapabilityTracker.load_state_dict: checkpoint has {d['num_agents']} agents, "
                f"this run has {self.num_agents}"
            )
        history = [list(map(float, row)) for row in d["history"]]
        if any(len(row) != self.num_agents for row in history):
            raise ValueError("CapabilityTracker.load_state_dict: a history row has the wrong number of agents")
        # The window of this run wins: a checkpoint taken with a larger K keeps its newest steps.
        self._history = deque(history, maxlen=self.window)


def _check_omega_clip(omega_clip: tuple[float, float]) -> None:
    lo, hi = omega_clip
    if not (0 < lo <= 1 <= hi):
        raise ValueError(f"omega_clip must satisfy 0 < ω_min <= 1 <= ω_max, got {tuple(omega_clip)}")


# ---------------------------------------------------------------------------------------
# §1 capability ratio ω
# ---------------------------------------------------------------------------------------
def capability_ratio(
    capability: torch.Tensor | Sequence[float],
    k: int,
    j: int,
    omega_clip: tuple[float, float] = DEFAULTS.omega_clip,
) -> float:
    """ω^(k,j) = clamp(P̂^(k) / P̂^(j), ω_min, ω_max); exactly 1 when k == j.

    Args:
        capability: P̂ per agent, [N] (already floored, e.g. `CapabilityTracker.capabilities()`).
        k, j: agent indices (numerator, denominator).
    """
    if k == j:
        return 1.0
    cap = torch.as_tensor(capability, dtype=torch.float64)
    lo, hi = omega_clip
    return float((cap[k] / cap[j]).clamp(lo, hi))


def capability_ratios(
    capability: torch.Tensor | Sequence[float],
    numerator: torch.Tensor | np.ndarray | int,
    denominator: torch.Tensor | np.ndarray | int,
    omega_clip: tuple[float, float] = DEFAULTS.omega_clip,
) -> torch.Tensor:
    """Row-wise ω^(a_i, b_i) = clamp(P̂^(a_i) / P̂^(b_i)), 1 where a_i == b_i; float64 [B].

    `numerator` / `denominator` are agent indices, [B] or scalars (broadcast). §2 uses
    ω^(k, src(i)) (learner on top), §3 uses ω^(src(i), k) (source on top).
    """
    cap = torch.as_tensor(capability, dtype=torch.float64)
    a = torch.as_tensor(numerator, dtype=torch.long)
    b = torch.as_tensor(denominator, dtype=torch.long)
    a, b = torch.broadcast_tensors(a, b)
    lo, hi = omega_clip
    ratio = (cap[a] / cap[b]).clamp(lo, hi)
    return torch.where(a == b, torch.ones_like(ratio), ratio)


# ---------------------------------------------------------------------------------------
# §2 capability-aware advantage
# ---------------------------------------------------------------------------------------
def _group_ids(index: np.ndarray | Sequence) -> torch.Tensor:
    """Dense group number per row, long [B], from verl's `uid` values."""
    _, group = np.unique(np.asarray(index, dtype=object).astype(str), return_inverse=True)
    return torch.as_tensor(group.reshape(-1), dtype=torch.long)


def _group_sum(values: torch.Tensor, group: torch.Tensor, num_groups: int) -> torch.Tensor:
    return torch.zeros(num_groups, dtype=values.dtype).index_add_(0, group, values)


def _row_validity(valid: torch.Tensor | np.ndarray | Sequence[bool] | None, rows: int) -> torch.Tensor | None:
    """V as bool [B] (None: every row valid), checked against the batch's row count."""
    if valid is None:
        return None
    valid = torch.as_tensor(np.asarray(valid, dtype=bool)).reshape(-1)
    if valid.shape[0] != rows:
        raise ValueError(f"valid must be [B] = [{rows}], got {valid.shape[0]} rows")
    return valid


def _valid_rows_only(valid: torch.Tensor, index, source) -> tuple[np.ndarray, torch.Tensor]:
    """index and source of the valid rows, in batch order."""
    keep = valid.numpy()
    return np.asarray(index, dtype=object).reshape(-1)[keep], torch.as_tensor(np.asarray(source))[valid]


def capability_baseline(
    rewards: torch.Tensor,
    index: np.ndarray | Sequence,
    source: torch.Tensor | np.ndarray | Sequence[int],
    learner: int,
    capability: torch.Tensor | Sequence[float],
    *,
    use_capability_baseline: bool = DEFAULTS.capability_baseline,
    omega_clip: tuple[float, float] = DEFAULTS.omega_clip,
    baseline_cap: float | None = DEFAULTS.baseline_cap,
    valid: torch.Tensor | np.ndarray | Sequence[bool] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The group baseline μ̂^(k)_g of spec §2, per row, and where the baseline guard caught it.

        μ̂^(k)_g = (1/|g|) Σ_{i∈g} ω^(k,src(i)) R_i                 (own rows weigh 1)
        guard:   μ̂^(k)_g > baseline_cap  →  μ̂^(k)_g = mean(R_i : i ∈ g, src(i) = k)

    The guard (both of the authors' implementations have it) keeps a strong learner's
    correct answers from getting a negative advantage because a much weaker peer also solved
    the prompt: with rewards in [0, 1] no achievable success rate exceeds 1. It applies to the
    capability-weighted baseline only; the plain mean (`use_capability_baseline=False`) is
    left as is. A group without any of the learner's rows keeps its weighted mean.

    Args:
        rewards: R_i, [B].  index: group id per row, [B].  source: src(i), int [B].
        learner: k.  capability: P̂ per agent, [N].
        baseline_cap: the ceiling; None turns the guard off (the paper's formula as written).
        valid: V, bool [B] (None: every row); g is read as g ∩ V, as in `compute_hacpo_advantage`.

    Returns:
        (μ̂ of each row's group, float64 [B], 0 on rows outside V; bool [B], True on (valid)
        rows of guarded groups).
    """
    r = torch.as_tensor(rewards).detach().to(torch.float64)
    keep = _row_validity(valid, r.shape[0])
    if keep is not None:
        # the same function on the valid rows alone: a row outside V cannot reach μ̂
        mean, guarded = torch.zeros_like(r), torch.zeros(r.shape[0], dtype=torch.bool)
        sub_index, sub_source = _valid_rows_only(keep, index, source)
        mean[keep], guarded[keep] = capability_baseline(
            r[keep], sub_index, sub_source, learner, capability,
            use_capability_baseline=use_capability_baseline, omega_clip=omega_clip, baseline_cap=baseline_cap,
        )
        return mean, guarded
    group = _group_ids(index)
    num_groups = int(group.max()) + 1 if len(group) else 0
    count = _group_sum(torch.ones_like(r), group, num_groups)
    guarded = torch.zeros(num_groups, dtype=torch.bool)
    if not use_capability_baseline:
        mean = _group_sum(r, group, num_groups) / count
        return mean[group], guarded[group]
    weight = capability_ratios(capability, learner, source, omega_clip)
    mean = _group_sum(weight * r, group, num_groups) / count
    if baseline_cap is not None:
        own = (torch.as_tensor(source, dtype=torch.long) == learner).to(torch.float64)
        own_count = _group_sum(own, group, num_groups)
        own_mean = _group_sum(own * r, group, num_groups) / own_count.clamp(min=1)
        guarded = (mean > baseline_cap) & (own_count > 0)
        mean = torch.where(guarded, own_mean, mean)
    return mean[group], guarded[group]


def compute_hacpo_advantage(
    rewards: torch.Tensor,
    index: np.ndarray | Sequence,
    source: torch.Tensor | np.ndarray | Sequence[int],
    learner: int,
    capability: torch.Tensor | Sequence[float],
    *,
    use_capability_baseline: bool = DEFAULTS.capability_baseline,
    norm_by_std: bool = DEFAULTS.norm_by_std,
    epsilon: float = 1e-6,
    omega_clip: tuple[float, float] = DEFAULTS.omega_clip,
    baseline_cap: float | None = DEFAULTS.baseline_cap,
    valid: torch.Tensor | np.ndarray | Sequence[bool] | None = None,
) -> torch.Tensor:
    """Capability-aware group advantage of learner k (spec §2).

        μ̂^(k)_g = (1/|g|) Σ_{i∈g} ω^(k,src(i)) R_i        (own rows weigh 1; see
                                                           `capability_baseline` for the guard)
        σ_g     = unbiased std of {R_i : i ∈ g}            (all agents' rewards)
        A^(k)_i = (R_i − μ̂^(k)_g) / (σ_g + ε)              for every i in g, own or cross

    A group whose rewards are all equal gets A = 0 (its ω-weighted mean differs from the
    common reward, so the formula alone would divide a non-zero numerator by ~ε). A group
    of one response follows verl's GRPO (μ = 0, σ = 1). With `use_capability_baseline=False`
    μ̂ is the plain group mean (ablation); with `norm_by_std=False` there is no division
    (Dr.GRPO). With one agent and no cross rows this is verl's GRPO outcome advantage.

    With a row validity V (`share_selection=complementary`, docs/ALGORITHM.md §9) every group
    is read as g ∩ V: μ̂ and σ are the formulas above over the valid rows only, and

        A^(k)_i = 0                                          for i ∉ V

    so a row outside V changes neither μ̂ nor σ. V = None (every row valid) is the formula
    above, number for number.

    Args:
        rewards: R_i, float [B].
        index: group id per row (verl's `uid`), [B].
        source: agent that generated each row, int [B].
        learner: k.
        capability: P̂ per agent, [N].
        baseline_cap: the baseline guard's ceiling (1.0 for rewards in [0, 1]); a group whose
            μ̂ exceeds it uses the learner's own-sample mean instead. None: no guard.
        valid: V, bool [B]: the rows of the group statistics (None: every row).

    Returns:
        A^(k), [B], dtype of `rewards` (0 outside V).
    """
    rewards = torch.as_tensor(rewards)
    if rewards.dim() != 1:
        raise ValueError(f"compute_hacpo_advantage: rewards must be [B], got shape {tuple(rewards.shape)}")
    batch = rewards.shape[0]
    if len(index) != batch or len(source) != batch:
        raise ValueError(
            f"compute_hacpo_advantage: rewards has {batch} rows, index {len(index)}, source {len(source)}"
        )
    _check_omega_clip(omega_clip)
    keep = _row_validity(valid, batch)
    if keep is not None:
        # the same function on the valid rows alone, scattered back; 0 elsewhere
        sub_index, sub_source = _valid_rows_only(keep, index, source)
        sub = compute_hacpo_advantage(
            rewards[keep], sub_index, sub_source, learner, capability,
            use_capability_baseline=use_capability_baseline, norm_by_std=norm_by_std, epsilon=epsilon,
            omega_clip=omega_clip, baseline_cap=baseline_cap,
        )
        adv = torch.zeros(batch, dtype=sub.dtype)
        adv[keep] = sub
        return adv
    if batch == 0:
        return rewards.clone()

    r = rewards.detach().to(torch.float64)
    group = _group_ids(index)
    num_groups = int(group.max()) + 1

    mean, _ = capability_baseline(
        r, index, source, learner, capability,
        use_capability_baseline=use_capability_baseline, omega_clip=omega_clip, baseline_cap=baseline_cap,
    )
    count = _group_sum(torch.ones_like(r), group, num_groups)
    plain_mean = _group_sum(r, group, num_groups) / count
    sq_dev = (r - plain_mean[group]) ** 2
    var = _group_sum(sq_dev, group, num_groups) / (count - 1).clamp(min=1)
    std = var.sqrt()
    gmax = torch.full((num_groups,), -torch.inf, dtype=torch.float64).scatter_reduce_(0, group, r, "amax")
    gmin = torch.full((num_groups,), torch.inf, dtype=torch.float64).scatter_reduce_(0, group, r, "amin")

    singleton = (count == 1)[group]
    mean = torch.where(singleton, torch.zeros_like(mean), mean)
    row_std = torch.where(singleton, torch.ones_like(r), std[group])

    centred = r - mean
    adv = centred / (row_std + epsilon) if norm_by_std else centred
    uniform = (gmax == gmin)[group] & ~singleton
    adv = torch.where(uniform, torch.zeros_like(adv), adv)
    return adv.to(rewards.dtype if rewards.is_floating_point() else torch.float32)


# ---------------------------------------------------------------------------------------
# §5 stepwise clipping bound
# ---------------------------------------------------------------------------------------
def cross_lower_bound(
    update_index: int,
    delta: float = DEFAULTS.delta,
    delta_step: float = DEFAULTS.delta_step,
    cross_clip: str = DEFAULTS.cross_clip,
) -> float:
    """lower_m of spec §5: the lower clip bound of cross ratios at update m.

        stepwise: lower_m = min(1, 1 − δ + m·δ_step)
        fixed:    1 − δ
        none / gspo: no cross clip to [lower, 1] (returns 0.0 for logging).
    """
    if cross_clip not in CROSS_CLIP_MODES:
        raise ValueError(f"cross_clip must be one of {CROSS_CLIP_MODES}, got {cross_clip!r}")
    if update_index < 0:
        raise ValueError(f"update_index (m) must be >= 0, got {update_index}")
    if cross_clip == "stepwise":
        return min(1.0, 1.0 - delta + update_index * delta_step)
    if cross_clip == "fixed":
        return 1.0 - delta
    return 0.0


# ---------------------------------------------------------------------------------------
# §4 exponential importance sampling
# ---------------------------------------------------------------------------------------
def exponential_is_weight(clipped_ratio: torch.Tensor, alpha: float = DEFAULTS.alpha) -> torch.Tensor:
    """c · sg(c)^α (spec §4): the gradient is c's, the value is damped by c^α.

    α = 0 gives c (mechanism off). Samples the learner finds unlikely (small c) are
    down-weighted sharply without changing the gradient's direction.
    """
    if alpha < 0:
        raise ValueError(f"alpha must be >= 0, got {alpha}")
    if alpha == 0:
        return clipped_ratio
    return clipped_ratio * clipped_ratio.detach().pow(alpha)


# ---------------------------------------------------------------------------------------
# §6 the loss
# ---------------------------------------------------------------------------------------
def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the losses compute in: float32 for bf16/fp16 inputs, the input's own otherwise.

    A bf16 mantissa has 8 bits: a row's token count above 256 is rounded (up to 8 off at 3,000
    tokens), and a mean of 3,000 log-probs summed in bf16 moves the sequence ratio s_i by ~0.2 %,
    a fifth of GSPO's clip window. verl hands the loss bf16 log-probs when the model computes
    in bf16, so every sum, count, ω and ratio is taken in float32 instead (float64 stays float64,
    and float32 input is left untouched, so the fp32 path is the same arithmetic as before).
    """
    return torch.promote_types(dtype, torch.float32) if dtype.is_floating_point else torch.float32


def to_accumulation_dtype(x: torch.Tensor) -> torch.Tensor:
    """x in `accumulation_dtype` (the same tensor when it already is; the cast keeps the gradient)."""
    return x.to(accumulation_dtype(x.dtype))


def token_loss_inputs(log_prob: torch.Tensor, old_log_prob: torch.Tensor,
                      response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log_prob, old_log_prob, mask) of a per-token loss, all [B, T] (checked) and in
    `accumulation_dtype(log_prob.dtype)`; old log-probs only ever promoted, the mask in log_prob's dtype."""
    if log_prob.shape != old_log_prob.shape or log_prob.shape != response_mask.shape:
        raise ValueError(
            f"log_prob {tuple(log_prob.shape)}, old_log_prob {tuple(old_log_prob.shape)} and "
            f"response_mask {tuple(response_mask.shape)} must all be [B, T]"
        )
    log_prob = to_accumulation_dtype(log_prob)
    old_log_prob = old_log_prob.to(torch.promote_types(old_log_prob.dtype, log_prob.dtype))
    return log_prob, old_log_prob, response_mask.to(log_prob.dtype)


def _masked_row_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x over each row's masked tokens, [B, T] → [B] (0 for an empty row)."""
    return (x * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1)


def seq_mean_token_mean(loss_mat: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """verl's "seq-mean-token-mean": mean over each row's tokens, then over non-empty rows
    (summed and counted in `accumulation_dtype`)."""
    loss_mat = to_accumulation_dtype(loss_mat)
    mask = response_mask.to(loss_mat.dtype)
    tokens = mask.sum(dim=-1)
    row_loss = (loss_mat * mask).sum(dim=-1) / (tokens + 1e-8)
    rows = (tokens > 0).to(loss_mat.dtype)
    return (row_loss * rows).sum() / rows.sum().clamp(min=1)


def hacpo_policy_loss_matrix(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    is_cross: torch.Tensor,
    omega: torch.Tensor,
    source_log_prob_mean: torch.Tensor,
    update_index: int,
    alpha: float = DEFAULTS.alpha,
    delta: float = DEFAULTS.delta,
    delta_step: float = DEFAULTS.delta_step,
    cross_clip: str = DEFAULTS.cross_clip,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
    cross_ratio_length: str = DEFAULTS.cross_ratio_length,
    source_response_length: torch.Tensor | None = None,
    rows: dict | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token HACPO loss ℓ_{i,t}, [B, T], and its metrics (spec §6).

    Own row (GSPO):  ℓ_i = max(−A_i s_i, −A_i clip(s_i, 1−ε_low, 1+ε_high)),
                     s_i = exp(mean_t(log π_θ − log π_old)) on the learner's own tokens.
    Cross row:       ℓ_i = −c_i · sg(c_i)^α · ω^(src,k) · A_i,  c_i = clip(s_i, lower_m, 1),
                     each:   s_i = exp(mean_t log π_θ − source_log_prob_mean)
                     source: s_i = exp((Σ_t log π_θ − source_log_prob_mean·|y^(j)|) / |y^(j)|)
                     (|y^(j)| = source_response_length, the source's token count).
    Naive (cross_clip="gspo"): cross rows take the own-row GSPO term with s_i against the
    source's log-probs, without ω or α.

    Each token carries s_{i,t} = sg(s_i)·π_t/sg(π_t), so averaging a row's tokens gives the
    sequence-level value and gradient. The caller aggregates (see `seq_mean_token_mean`,
    or verl's `agg_loss` with its global batch info inside a worker).

    Computed in `accumulation_dtype(log_prob.dtype)` (float32 for bf16 log-probs); the loss
    matrix comes back in that dtype and the gradient flows back to `log_prob` in its own.

    `rows`, when given, receives each row's sequence ratio s_i ("ratio", [B]) and whether the
    clip took its gradient away at this update ("clipped", bool [B], `row_clipped`).
    """
    if cross_clip not in CROSS_CLIP_MODES:
        raise ValueError(f"cross_clip must be one of {CROSS_CLIP_MODES}, got {cross_clip!r}")
    if cross_ratio_length not in CROSS_RATIO_LENGTHS:
        raise ValueError(f"cross_ratio_length must be one of {CROSS_RATIO_LENGTHS}, got {cross_ratio_length!r}")
    if cross_ratio_length == "source" and source_response_length is None:
        raise ValueError("cross_ratio_length='source' needs source_response_length (|y^(j)| per row)")
    log_prob, old_log_prob, mask = token_loss_inputs(log_prob, old_log_prob, response_mask)
    is_cross = torch.as_tensor(is_cross, device=log_prob.device).to(torch.bool).reshape(-1)
    omega = torch.as_tensor(omega, device=log_prob.device).to(log_prob.dtype).reshape(-1)
    source_lp = torch.as_tensor(source_log_prob_mean, device=log_prob.device).to(log_prob.dtype).reshape(-1)
    advantages = advantages.to(torch.promote_types(advantages.dtype, log_prob.dtype))
    adv = advantages if advantages.dim() == 2 else advantages.unsqueeze(-1).expand_as(log_prob)

    own_log_ratio = _masked_row_mean(log_prob - old_log_prob, mask)  # [B]
    token_grad = log_prob - log_prob.detach()  # value 0, gradient of log π_t
    if cross_ratio_length == "each":
        cross_log_ratio = _masked_row_mean(log_prob, mask) - source_lp  # [B]
    else:
        learner_len = mask.sum(dim=-1).clamp(min=1)
        source_len = torch.as_tensor(source_response_length, device=log_prob.device).to(log_prob.dtype).reshape(-1)
        source_len = source_len.clamp(min=1)
        # (Σ log π_θ − Σ log π_old^(j)) / |y^(j)|, with Σ log π_old^(j) = mean · |y^(j)|
        cross_log_ratio = (log_prob * mask).sum(dim=-1) / source_len - source_lp
        # the row's tokens are averaged over |y^(k)| below, so each token's gradient is
        # rescaled by |y^(k)| / |y^(j)| to give d log s_i / d log π_t = 1 / |y^(j)|
        scale = torch.where(is_cross, learner_len / source_len, torch.ones_like(learner_len))
        token_grad = token_grad * scale.unsqueeze(-1)
    seq_log_ratio = torch.where(is_cross, cross_log_ratio, own_log_ratio).detach()

    # s_{i,t}: value s_i, gradient of log π_t (the GSPO-token trick)
    log_s_tok = (token_grad + seq_log_ratio.unsqueeze(-1)).clamp(max=_LOG_RATIO_MAX)
    s_tok = torch.exp(log_s_tok)

    gspo_1 = -adv * s_tok
    gspo_2 = -adv * s_tok.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    gspo_loss = torch.maximum(gspo_1, gspo_2)

    lower = cross_lower_bound(update_index, delta, delta_step, cross_clip)
    if cross_clip == "gspo":
        loss = gspo_loss  # Naive: every row is a GSPO row
    else:
        c_tok = s_tok.clamp(lower, 1.0) if cross_clip in ("stepwise", "fixed") else s_tok
        cross_loss = -exponential_is_weight(c_tok, alpha) * omega.unsqueeze(-1) * adv
        loss = torch.where(is_cross.unsqueeze(-1), cross_loss, gspo_loss)

    metrics = _loss_metrics(
        gspo_1, gspo_2, mask, is_cross, seq_log_ratio, own_log_ratio, lower, cross_clip
    )
    if rows is not None:
        with torch.no_grad():
            ratio = seq_log_ratio.clamp(max=_LOG_RATIO_MAX).exp()
            row_adv = _masked_row_mean(adv.detach(), mask)
            rows["ratio"] = ratio
            rows["clipped"] = row_clipped(ratio, row_adv, is_cross, lower=lower, cross_clip=cross_clip,
                                          clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high)
    return loss, metrics


def row_clipped(
    ratio: torch.Tensor,
    advantage: torch.Tensor,
    is_cross: torch.Tensor,
    *,
    lower: float,
    cross_clip: str = DEFAULTS.cross_clip,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
) -> torch.Tensor:
    """bool [B]: the clip takes row i's gradient away at this update (spec §5–§6).

        own row (and every row under cross_clip="gspo"), GSPO's clip:
            A_i > 0 and s_i > 1 + ε_high,  or  A_i < 0 and s_i < 1 − ε_low
        cross row, stepwise / fixed:  s_i < lower_m  or  s_i > 1   (c_i = clip(s_i, lower_m, 1))
        cross row, none:              never
    """
    ratio, advantage = ratio.reshape(-1), advantage.reshape(-1)
    is_cross = torch.as_tensor(is_cross, device=ratio.device).to(torch.bool).reshape(-1)
    gspo = ((advantage > 0) & (ratio > 1 + clip_ratio_high)) | ((advantage < 0) & (ratio < 1 - clip_ratio_low))
    if cross_clip == "gspo":
        return gspo
    if cross_clip in ("stepwise", "fixed"):
        cross = (ratio < lower) | (ratio > 1.0)
    else:
        cross = torch.zeros_like(gspo)
    return torch.where(is_cross, cross, gspo)


def _loss_metrics(
    gspo_1: torch.Tensor,
    gspo_2: torch.Tensor,
    mask: torch.Tensor,
    is_cross: torch.Tensor,
    seq_log_ratio: torch.Tensor,
    own_log_ratio: torch.Tensor,
    lower: float,
    cross_clip: str,
) -> dict[str, float]:
    """Metrics of §6; cross statistics are 0.0 when the batch has no cross row."""
    with torch.no_grad():
        own_rows = (~is_cross) & (mask.sum(-1) > 0)
        cross_rows = is_cross & (mask.sum(-1) > 0)
        in_loss = own_rows | cross_rows
        clipped = torch.gt(gspo_2, gspo_1).to(mask.dtype)
        own_mask = mask * own_rows.unsqueeze(-1)
        own_tokens = own_mask.sum()
        own_clipfrac = float((clipped * own_mask).sum() / own_tokens) if own_tokens > 0 else 0.0
        own_kl = float((-own_log_ratio[own_rows]).mean()) if own_rows.any() else 0.0
        metrics = {
            "actor/pg_clipfrac": own_clipfrac,
            "actor/ppo_kl": own_kl,
            # over the rows in the loss: a row without response tokens (a peer row outside
            # share_selection=complementary's selection) is neither own nor cross here
            "hacpo/cross_frac": float(cross_rows.float().sum() / in_loss.float().sum()) if in_loss.any() else 0.0,
            "hacpo/lower_bound": float(lower),
        }
        s = seq_log_ratio[cross_rows].clamp(max=_LOG_RATIO_MAX).exp()
        has_cross = s.numel() > 0
        clips_cross = has_cross and cross_clip in ("stepwise", "fixed")
        metrics.update(
            {
                "hacpo/cross_ratio_mean": float(s.mean()) if has_cross else 0.0,
                "hacpo/cross_ratio_min": float(s.min()) if has_cross else 0.0,
                "hacpo/cross_ratio_max": float(s.max()) if has_cross else 0.0,
                "hacpo/cross_clipfrac_low": float((s < lower).float().mean()) if clips_cross else 0.0,
                "hacpo/cross_clipfrac_high": float((s > 1.0).float().mean()) if clips_cross else 0.0,
            }
        )
    return metrics


def compute_hacpo_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    is_cross: torch.Tensor,
    omega: torch.Tensor,
    source_log_prob_mean: torch.Tensor,
    update_index: int,
    alpha: float = DEFAULTS.alpha,
    delta: float = DEFAULTS.delta,
    delta_step: float = DEFAULTS.delta_step,
    cross_clip: str = DEFAULTS.cross_clip,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
    cross_ratio_length: str = DEFAULTS.cross_ratio_length,
    source_response_length: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The HACPO loss of learner k on one mini-batch (spec §6), mean over its sequences.

    Args:
        log_prob: log π^(k)_θ of the learner's tokens, [B, T] (carries the gradient).
        old_log_prob: log π^(k)_old, [B, T] (used on own rows).
        advantages: A^(k)_i from §2, [B, T] constant along a row (or [B]).
        response_mask: [B, T], 1 on response tokens.
        is_cross: bool [B], True for rows generated by another agent.
        omega: ω^(src(i),k), [B] (1 on own rows).
        source_log_prob_mean: mean log π^(src)_old of the response under its source's own
            tokenisation, [B] (read on cross rows only).
        update_index: m, optimizer updates already made in this training step.
        alpha: α of §4 (0 disables the exponential weighting).
        delta, delta_step: δ, δ_step of §5.
        cross_clip: "stepwise" | "fixed" | "none" | "gspo" (Naive baseline).
        clip_ratio_low, clip_ratio_high: GSPO's ε_low, ε_high for own rows.
        cross_ratio_length: "each" (default; every tokenisation normalised by its own length,
            as both of the authors' implementations do) | "source" (the paper's Eq. 11: one
            exponent 1/|y^(j)|, so equal text probabilities give s = 1 across tokenizers).
        source_response_length: |y^(j)|, the source's response token count, [B] (needed
            for "source"; read on cross rows only).

    Returns:
        (scalar loss, metrics). With no cross rows this equals verl's `gspo` policy loss with
        loss_agg_mode="seq-mean-token-mean", in value and gradient.
    """
    loss_mat, metrics = hacpo_policy_loss_matrix(
        log_prob,
        old_log_prob,
        advantages,
        response_mask,
        is_cross=is_cross,
        omega=omega,
        source_log_prob_mean=source_log_prob_mean,
        update_index=update_index,
        alpha=alpha,
        delta=delta,
        delta_step=delta_step,
        cross_clip=cross_clip,
        clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high,
        cross_ratio_length=cross_ratio_length,
        source_response_length=source_response_length,
    )
    loss = seq_mean_token_mean(loss_mat, response_mask)
    metrics["actor/pg_loss"] = float(loss.detach())
    return loss, metrics
