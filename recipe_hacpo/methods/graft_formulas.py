"""GRAFT, a later cross-model exchange algorithm, at the formula level (SGT's formulas: `recipe_hacpo.methods.sgt_formulas`).

Pure torch/numpy (no Ray, no verl import), in the style of `core_algos`: one function per
mechanism, the formula with the paper's symbols in its docstring, the shape of every argument.
Sections refer to docs/ALGORITHM.md §9 ("GRAFT"):

    R        receiver (the learner);  S  source (the agent whose rollouts R receives)
    n_M      rollouts per prompt of agent M
    k_M(q)   correct responses in M's group for prompt q (0/1 rewards)
    s(o)     sequence-level compatibility of a grafted response o with the receiver     G3
    w(o)     compatibility weight 1[s > δ] · min(s, 1), fixed during the update          G3
    ρ_{j,t}  π_θR / π^R_old per token, against the receiver's own old policy             G4

Shapes: N agents, Q prompts of the step, B rows (responses), T receiver response tokens.

Each mechanism can be switched off for the paper's ablations: no balancing (G1), no gate or
no floor δ (G3), a sequence-level ratio (G4), peer-first or uniform mini-batch order (G5).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from recipe_hacpo.methods.core_algos import to_accumulation_dtype, token_loss_inputs
from recipe_hacpo.hacpo_settings import GRAFT_RATIO_LEVELS, PEER_ORDERS
from recipe_hacpo.methods.groups import grpo_advantage
from recipe_hacpo.methods.minibatch import check_split, prompt_groups, prompt_permutation, verl_layout

__all__ = [
    "GRAFT_RATIO_LEVELS",
    "PEER_ORDERS",
    "complementary_candidates",
    "balanced_selection",
    "assign_sources",
    "graft_selection",
    "grpo_advantage",
    "compatibility_weight",
    "token_mean",
    "graft_policy_loss_matrix",
    "compute_graft_policy_loss",
    "graft_mini_batch_order",
]

# verl's vanilla PPO loss clamps log ρ to [−20, 20] before exp; the same clamp keeps GRAFT with
# nothing exchanged equal to verl's GRPO loss for any ratio
_LOG_RATIO_CLAMP = 20.0


# ---------------------------------------------------------------------------------------
# G1 which groups are exchanged
# ---------------------------------------------------------------------------------------
def _check_counts(correct: torch.Tensor, group_size: torch.Tensor) -> None:
    if correct.dim() != 2:
        raise ValueError(f"correct counts must be [N, Q], got shape {tuple(correct.shape)}")
    if group_size.shape != (correct.shape[0],):
        raise ValueError(f"group sizes must be [N] = [{correct.shape[0]}], got shape {tuple(group_size.shape)}")
    if (correct < 0).any() or (correct > group_size.unsqueeze(1)).any():
        raise ValueError("a correct count k_M(q) is outside [0, n_M]")


def complementary_candidates(correct: torch.Tensor, group_size: torch.Tensor) -> torch.Tensor:
    """C_{S→R} of every ordered pair (§9 G1), bool [N_S, N_R, Q].

        C_{S→R} = { q : k_R(q) = 0  and  1 ≤ k_S(q) < n_S }

    The receiver's own group failed entirely; the source's group holds both a success and a
    failure (so its GRPO advantages are non-zero). The diagonal S = R is empty.

    Args:
        correct: k_M(q), int [N, Q].
        group_size: n_M, int [N].
    """
    correct = torch.as_tensor(correct, dtype=torch.long)
    group_size = torch.as_tensor(group_size, dtype=torch.long)
    _check_counts(correct, group_size)
    receiver_failed = correct == 0  # [N_R, Q]
    source_mixed = (correct >= 1) & (correct < group_size.unsqueeze(1))  # [N_S, Q]
    cand = source_mixed.unsqueeze(1) & receiver_failed.unsqueeze(0)
    eye = torch.eye(correct.shape[0], dtype=torch.bool).unsqueeze(-1)
    return cand & ~eye


def _keep_top(cand: torch.Tensor, score: torch.Tensor, m: int) -> torch.Tensor:
    """The first m candidates by `score` (descending) and every candidate tied with the m-th."""
    if m <= 0:
        return torch.zeros_like(cand)
    ranked = torch.sort(score[cand], descending=True).values
    threshold = ranked[m - 1]
    return cand & (score >= threshold)


def balanced_selection(
    candidates: torch.Tensor, correct: torch.Tensor, *, balance: bool = True
) -> torch.Tensor:
    """Kept prompts of every direction after balancing each unordered pair (§9 G1), bool [N_S, N_R, Q].

        m_{S,R} = min(|C_{S→R}|, |C_{R→S}|)
        keep(S→R) = the first m of C_{S→R} ranked by k_S(q) descending, plus every prompt
                    tied with the m-th (so a direction may keep more than m; m = 0 keeps none)

    `balance=False` (ablation) keeps every candidate.

    Args:
        candidates: C of `complementary_candidates`, bool [N, N, Q].
        correct: k_M(q), int [N, Q] (ranks S → R by the source's count k_S).
    """
    if not balance:
        return candidates.clone()
    correct = torch.as_tensor(correct, dtype=torch.long)
    n = candidates.shape[0]
    kept = torch.zeros_like(candidates)
    for s in range(n):
        for r in range(s + 1, n):
            m = int(min(candidates[s, r].sum(), candidates[r, s].sum()))
            kept[s, r] = _keep_top(candidates[s, r], correct[s], m)
            kept[r, s] = _keep_top(candidates[r, s], correct[r], m)
    return kept


def assign_sources(kept: torch.Tensor, correct: torch.Tensor) -> torch.Tensor:
    """The one source of each receiver's replaced group, long [N_R, Q]; −1 where R keeps its own.

    With N ≥ 3 several sources may keep the same prompt for one receiver (this project's rule,
    not the paper's): the source with the largest k_S(q) wins, ties go to the lower agent
    index. With N = 2 there is at most one source and this is the paper's selection.

    Args:
        kept: `balanced_selection`, bool [N_S, N_R, Q].
        correct: k_M(q), int [N, Q].
    """
    correct = torch.as_tensor(correct, dtype=torch.long)
    n, _, q = kept.shape
    # score k_S(q)·N + (N − 1 − S): larger k first, then the lower index; −1 where not kept
    tiebreak = (n - 1 - torch.arange(n)).view(n, 1, 1)
    score = torch.where(kept, correct.view(n, 1, q) * n + tiebreak, torch.full_like(correct.view(n, 1, q), -1))
    best_score, best = score.max(dim=0)  # [N_R, Q]
    return torch.where(best_score >= 0, best, torch.full_like(best, -1))


def graft_selection(
    correct: torch.Tensor, group_size: torch.Tensor, *, balance: bool = True
) -> torch.Tensor:
    """GRAFT's whole selection (§9 G1): the source of every receiver's group, long [N_R, Q] (−1: own).

    `complementary_candidates` → `balanced_selection` (per unordered pair) → `assign_sources`.
    """
    cand = complementary_candidates(correct, group_size)
    return assign_sources(balanced_selection(cand, correct, balance=balance), correct)


# ---------------------------------------------------------------------------------------
# G2 advantages
# ---------------------------------------------------------------------------------------
# grpo_advantage: recipe_hacpo/methods/groups.py (GRAFT's and SGT's shared group helper)


# ---------------------------------------------------------------------------------------
# G3 compatibility weight
# ---------------------------------------------------------------------------------------
def compatibility_weight(
    receiver_log_prob_mean: torch.Tensor,
    source_log_prob_mean: torch.Tensor,
    is_grafted: torch.Tensor,
    *,
    delta: float | None = 0.8,
    gate: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence-level weight w of every row and whether it is admitted (§9 G3).

        s(o) = exp( mean_t log π^R_old(o^R_t) − mean_t log π^S_old(o^S_t) )
        w(o) = 1[s(o) > δ] · min(s(o), 1)          grafted rows;   w = 1 on own rows

    A grafted row with s ≤ δ is dropped: it is in neither the loss nor its token count.
    Ablations: `delta=None` (no floor: w = min(s, 1), nothing dropped); `gate=False` (no
    compatibility weight: w = 1, nothing dropped).

    Args:
        receiver_log_prob_mean: mean over the receiver's tokens of log π^R_old, float [B].
        source_log_prob_mean: mean over the source's own tokens of log π^S_old, float [B].
        is_grafted: bool [B], True on rows that came from another agent.

    Returns:
        (w, float32 [B]; admitted, bool [B]: own rows and grafted rows kept by the floor).
    """
    lp_r = torch.as_tensor(receiver_log_prob_mean, dtype=torch.float64).reshape(-1)
    lp_s = torch.as_tensor(source_log_prob_mean, dtype=torch.float64).reshape(-1)
    grafted = torch.as_tensor(is_grafted, dtype=torch.bool).reshape(-1)
    if not (lp_r.shape == lp_s.shape == grafted.shape):
        raise ValueError(
            f"compatibility_weight: receiver {tuple(lp_r.shape)}, source {tuple(lp_s.shape)} and "
            f"is_grafted {tuple(grafted.shape)} must all be [B]"
        )
    if delta is not None and not 0 <= delta < 1:
        raise ValueError(f"compatibility_weight: δ must be in [0, 1) or None, got {delta}")
    ones = torch.ones_like(lp_r)
    if not gate:
        return ones.float(), torch.ones_like(grafted)
    s = torch.exp((lp_r - lp_s).clamp(max=_LOG_RATIO_CLAMP))
    passes = s > delta if delta is not None else torch.ones_like(grafted)
    w = torch.where(passes, s.clamp(max=1.0), torch.zeros_like(s))
    admitted = ~grafted | passes
    return torch.where(grafted, w, ones).float(), admitted


# ---------------------------------------------------------------------------------------
# G4 the loss
# ---------------------------------------------------------------------------------------
def token_mean(loss_mat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """verl's "token-mean": Σ over masked tokens / number of masked tokens (0 when none),
    summed and counted in float32 or wider (`core_algos.accumulation_dtype`)."""
    loss_mat = to_accumulation_dtype(loss_mat)
    mask = mask.to(loss_mat.dtype)
    return (loss_mat * mask).sum() / mask.sum().clamp(min=1)


def graft_policy_loss_matrix(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    weight: torch.Tensor,
    is_grafted: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.28,
    clip_ratio_c: float | None = None,
    ratio_level: str = "token",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token GRAFT loss ℓ_{j,t}, [B, T], and its metrics (§9 G4).

        ℓ_{j,t} = −w_j · min( ρ_{j,t} Â_j , clip(ρ_{j,t}, 1 − ε_low, 1 + ε_high) Â_j )
        ρ_{j,t} = π_θR(o_{j,t}) / π^R_old(o_{j,t})          own and grafted rows alike

    The ratio is against the receiver's own old policy on every row; the cross-model mismatch
    is carried by w alone. Aggregate with `token_mean` over the admitted rows' tokens (rows
    dropped by the gate have their mask zeroed by the caller). With w = 1 everywhere this is
    verl's vanilla PPO loss (GRPO); `clip_ratio_c` adds verl's dual clip (−Â·c caps the loss
    of negative-advantage tokens), so the receiver's own rows can match the GRPO baseline
    exactly. `ratio_level="sequence"` (ablation): one ρ_j = exp(mean_t log ρ_{j,t}) per row,
    with the gradient of each token's log π (as GSPO-token).

    Args:
        log_prob: log π_θR of the receiver's tokens, [B, T] (carries the gradient).
        old_log_prob: log π^R_old, [B, T] (for grafted rows: the receiver's extra forward).
        advantages: Â_j from G2, [B, T] constant along a row (or [B]).
        response_mask: [B, T], 1 on response tokens of admitted rows.
        weight: w_j from G3, [B] (1 on own rows).
        is_grafted: bool [B] (for the metrics).

    Computed in float32 for bf16/fp16 log-probs (`core_algos.accumulation_dtype`); the matrix
    comes back in that dtype.
    """
    if ratio_level not in GRAFT_RATIO_LEVELS:
        raise ValueError(f"ratio_level must be one of {GRAFT_RATIO_LEVELS}, got {ratio_level!r}")
    log_prob, old_log_prob, mask = token_loss_inputs(log_prob, old_log_prob, response_mask)
    advantages = advantages.to(torch.promote_types(advantages.dtype, log_prob.dtype))
    adv = advantages if advantages.dim() == 2 else advantages.unsqueeze(-1).expand_as(log_prob)
    w = torch.as_tensor(weight, device=log_prob.device).to(log_prob.dtype).reshape(-1, 1)
    grafted = torch.as_tensor(is_grafted, device=log_prob.device).to(torch.bool).reshape(-1)

    log_ratio = (log_prob - old_log_prob).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    if ratio_level == "sequence":
        seq = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1)).detach()
        log_ratio = log_prob - log_prob.detach() + seq.unsqueeze(-1)
    ratio = torch.exp(log_ratio)
    loss_1 = -adv * ratio
    loss_2 = -adv * ratio.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)
    clipped_loss = torch.maximum(loss_1, loss_2)
    if clip_ratio_c is not None:
        dual = torch.minimum(clipped_loss, -adv * clip_ratio_c)
        clipped_loss = torch.where(adv < 0, dual, clipped_loss)
    loss = w * clipped_loss

    with torch.no_grad():
        clipped = torch.gt(loss_2, loss_1).to(mask.dtype)
        own_mask = mask * (~grafted).unsqueeze(-1)
        peer_mask = mask * grafted.unsqueeze(-1)
        metrics = {
            "actor/pg_clipfrac": float((clipped * own_mask).sum() / own_mask.sum().clamp(min=1)),
            "actor/ppo_kl": float((-log_ratio.detach() * mask).sum() / mask.sum().clamp(min=1)),
            "graft/peer_clipfrac": float((clipped * peer_mask).sum() / peer_mask.sum().clamp(min=1)),
            "graft/peer_token_frac": float(peer_mask.sum() / mask.sum().clamp(min=1)),
        }
    return loss, metrics


def compute_graft_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    weight: torch.Tensor,
    is_grafted: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.28,
    clip_ratio_c: float | None = None,
    ratio_level: str = "token",
) -> tuple[torch.Tensor, dict[str, float]]:
    """J(θ_R) of §9 G4 on one mini-batch, as a loss to minimise:

        L = (1 / Σ_j |o_j|) · Σ_j Σ_t ℓ_{j,t}        (token-mean over admitted rows)

    Arguments as `graft_policy_loss_matrix`. Returns (scalar loss, metrics).
    """
    loss_mat, metrics = graft_policy_loss_matrix(
        log_prob, old_log_prob, advantages, response_mask,
        weight=weight, is_grafted=is_grafted, clip_ratio_low=clip_ratio_low,
        clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c, ratio_level=ratio_level,
    )
    loss = token_mean(loss_mat, response_mask)
    metrics["actor/pg_loss"] = float(loss.detach())
    return loss, metrics


# ---------------------------------------------------------------------------------------
# G5 peer-last mini-batches
# ---------------------------------------------------------------------------------------
def graft_mini_batch_order(
    uid: Sequence | np.ndarray,
    is_grafted: Sequence[bool] | np.ndarray,
    *,
    mini_batch_prompts: int,
    dp_size: int,
    seed: int,
    peer_order: str = "last",
) -> np.ndarray:
    """Permutation [B] of a receiver's batch so that grafted groups train last (§9 G5).

    Every group is either the receiver's own or one source's whole group. Own groups are
    shuffled among themselves and grafted ones among themselves (from `seed` and the group
    ids), then laid out own-first ("last", GRAFT), grafted-first ("first", ablation), or all
    shuffled together ("uniform", ablation). The prompt sequence is cut into mini-batches of
    `mini_batch_prompts`, each split over `dp_size` ranks in verl's layout (one contiguous
    chunk per rank, contiguous mini-batches inside it; see `recipe_hacpo.methods.minibatch`), so
    with "last" a mini-batch holding a grafted group never precedes an own-only one on any
    rank, in every epoch (verl replays the same order each epoch with `shuffle=false`).

    Args:
        uid: group id of every row, [B].  is_grafted: bool [B].
        mini_batch_prompts: prompts per optimizer update.  dp_size: data-parallel ranks.
    """
    if peer_order not in PEER_ORDERS:
        raise ValueError(f"peer_order must be one of {PEER_ORDERS}, got {peer_order!r}")
    grafted = np.asarray(is_grafted, dtype=bool).reshape(-1)
    groups, rows_of = prompt_groups(uid, grafted, "graft_mini_batch_order", "is_grafted")
    kind = {}
    for g, rows in rows_of.items():
        flags = set(grafted[rows].tolist())
        if len(flags) != 1:
            raise ValueError(f"graft_mini_batch_order: group {g!r} mixes own and grafted rows")
        kind[g] = flags.pop()
    check_split(len(groups), mini_batch_prompts, dp_size, "graft_mini_batch_order")
    perm = [groups[p] for p in prompt_permutation(groups, seed)]
    own = [g for g in perm if not kind[g]]
    peer = [g for g in perm if kind[g]]
    sequence = {"last": own + peer, "first": peer + own, "uniform": perm}[peer_order]
    return verl_layout(sequence, rows_of, mini_batch_prompts=mini_batch_prompts, dp_size=dp_size)
