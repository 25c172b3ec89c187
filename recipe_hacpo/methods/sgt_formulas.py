"""SGT (`algorithm.hacpo.mode=sgt`) at the formula level: which peer response a receiver imitates,
and its loss. docs/ALGORITHM.md §9, "SGT".

Pure torch/numpy (no Ray, no verl import), in the style of `graft`: one function per formula,
the formula with the paper's symbols in its docstring. Symbols as GRAFT's:

    R        receiver (the learner);  S  a peer (any other agent)
    k_M(q)   correct responses in M's group for prompt q (0/1 rewards)
    I_R      prompts R imitates on:  { q : k_R(q) = 0  and  Σ_{S≠R} k_S(q) ≥ 1 }
    o*_q     the one imitated response of q ∈ I_R: drawn uniformly from the correct peer responses
    λ        `sgt_lambda` (0.1)

Every agent trains with GRPO on its own rows (token-level PPO-clip, GRPO advantages on its own
groups, as `mode=graft` with nothing exchanged), plus λ times the token-mean NLL of the imitated
responses, re-tokenized for R. Both directions, no balancing, no weighting.

Shapes: B rows (responses), T receiver response tokens, Q prompts.
"""

from __future__ import annotations

import zlib
from typing import Sequence

import numpy as np
import torch

from recipe_hacpo.methods.graft_formulas import graft_policy_loss_matrix, token_mean
from recipe_hacpo.hacpo_settings import DEFAULTS

__all__ = ["sgt_draw", "sgt_selection", "imitation_nll", "compute_sgt_loss"]


# ---------------------------------------------------------------------------------------
# which response R imitates
# ---------------------------------------------------------------------------------------
def sgt_draw(pool_size: int, *, seed: int, step: int, uid: str, receiver: int) -> int:
    """Index in [0, pool_size) of the imitated response: uniform, a function of its arguments only.

        j ~ Uniform{0, …, pool_size − 1},   drawn from a generator seeded by (seed, step, uid, R)

    No global random state is read or advanced, so a resumed run, another process or another
    order of the receivers draws the same response; each receiver draws independently.

    Args:
        pool_size: number of correct peer responses to prompt `uid` (≥ 1).
        seed: the run's seed (the receiver's `actor.data_loader_seed`).  step: the training step.
        uid: the prompt's group id.  receiver: R's agent index.
    """
    if pool_size < 1:
        raise ValueError(f"sgt_draw: the pool of correct peer responses is empty for prompt {uid!r}")
    key = [int(seed) % 2**64, int(step) % 2**64, zlib.crc32(str(uid).encode()), int(receiver)]
    return int(np.random.default_rng(key).integers(pool_size))


def sgt_selection(
    correct: torch.Tensor | Sequence[bool],
    index: np.ndarray | Sequence,
    source: torch.Tensor | np.ndarray | Sequence[int],
    receiver: int,
    *,
    seed: int,
    step: int,
) -> tuple[list[str], torch.Tensor]:
    """The response R imitates for every prompt of the step (§9 SGT), as a row number or −1.

        I_R  = { q : k_R(q) = 0  and  Σ_{S≠R} k_S(q) ≥ 1 }
        o*_q = the `sgt_draw`-th of the correct peer responses to q, in row order     (q ∈ I_R)

    A prompt with a correct own response, or with no correct peer response, imitates nothing.
    With N ≥ 3 agents the correct responses of every peer to q are pooled and one is drawn
    uniformly (this project's rule; the paper has two agents). The pool is in row order, so
    callers pass the rows in a fixed order (agent index, then the agent's batch order).

    Args:
        correct: bool [B], the verifier accepted the row (reward > 0).
        index: group id per row (verl's `uid`), [B].
        source: agent that generated each row, int [B].  receiver: R.
        seed, step: as `sgt_draw`.

    Returns:
        (the prompts' uids in order of first appearance, long [Q]: the imitated row of each, −1: none).
    """
    ok = torch.as_tensor(correct, dtype=torch.bool).reshape(-1)
    src = torch.as_tensor(np.asarray(source), dtype=torch.long).reshape(-1)
    uid = np.asarray(index, dtype=object).astype(str)
    if not (len(ok) == len(src) == len(uid)):
        raise ValueError(f"sgt_selection: correct {len(ok)}, source {len(src)}, index {len(uid)} rows")
    uids = list(dict.fromkeys(uid.tolist()))
    picks = torch.full((len(uids),), -1, dtype=torch.long)
    for q, u in enumerate(uids):
        rows = torch.as_tensor(np.flatnonzero(uid == u), dtype=torch.long)
        own = rows[src[rows] == receiver]
        if ok[own].any():
            continue
        pool = rows[(src[rows] != receiver) & ok[rows]]
        if len(pool):
            picks[q] = pool[sgt_draw(len(pool), seed=seed, step=step, uid=u, receiver=receiver)]
    return uids, picks


# ---------------------------------------------------------------------------------------
# the loss
# ---------------------------------------------------------------------------------------
def imitation_nll(log_prob: torch.Tensor, imitation_mask: torch.Tensor) -> torch.Tensor:
    """The imitation term's NLL, token-mean over the imitated tokens (0 when there are none):

        NLL = (1 / Σ_{q∈I_R} |o*_q|) · Σ_{q∈I_R} Σ_t −log π_θR(o*_{q,t} | x_q, o*_{q,<t})

    Args:
        log_prob: log π_θR of the receiver's tokens, [B, T].
        imitation_mask: [B, T], 1 on the imitated responses' tokens.
    """
    return token_mean(-log_prob, imitation_mask)


def compute_sgt_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    imitation_mask: torch.Tensor,
    *,
    coef: float = DEFAULTS.sgt_lambda,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.28,
    clip_ratio_c: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """SGT's loss of one mini-batch (§9 SGT), to minimise: GRPO on own rows plus λ·NLL of the imitated ones.

        L(θ_R) = (1 / Σ_j |o_j|) · Σ_j Σ_t ℓ_{j,t}  +  λ · NLL                 (NLL: `imitation_nll`)
        ℓ_{j,t} = − min( ρ_{j,t} Â_j , clip(ρ_{j,t}, 1 − ε_low, 1 + ε_high) Â_j ),   ρ = π_θR / π^R_old

    j runs over R's own responses (`response_mask`), with GRPO's advantages of R's own groups;
    the imitated responses (`imitation_mask`) have no ratio, advantage or weight and are in the
    NLL's token count only. Both terms are token-means over the whole mini-batch, each over its
    own tokens. With no imitated token this is GRAFT's loss with nothing exchanged (w = 1),
    i.e. verl's GRPO loss (vanilla, token-mean; with `clip_ratio_c`, its dual clip), in value
    and gradient.

    Args:
        log_prob: log π_θR, [B, T] (carries the gradient).  old_log_prob: log π^R_old, [B, T].
        advantages: Â_j, [B, T] or [B] (any value on rows outside `response_mask`).
        response_mask: [B, T], 1 on own response tokens (0 on every imitation-slot row).
        imitation_mask: [B, T], 1 on imitated response tokens.
        coef: λ.
    """
    if coef < 0:
        raise ValueError(f"compute_sgt_loss: λ must be >= 0, got {coef}")
    if imitation_mask.shape != log_prob.shape:
        raise ValueError(f"imitation_mask {tuple(imitation_mask.shape)} must be [B, T] = {tuple(log_prob.shape)}")
    if bool((response_mask.bool() & imitation_mask.bool()).any()):
        raise ValueError("compute_sgt_loss: a token is in both response_mask and imitation_mask")
    rows = log_prob.shape[0]
    pg_mat, metrics = graft_policy_loss_matrix(
        log_prob, old_log_prob, advantages, response_mask,
        weight=torch.ones(rows), is_grafted=torch.zeros(rows, dtype=torch.bool),
        clip_ratio_low=clip_ratio_low, clip_ratio_high=clip_ratio_high, clip_ratio_c=clip_ratio_c,
    )
    pg_loss = token_mean(pg_mat, response_mask)
    nll = imitation_nll(log_prob, imitation_mask)
    loss = pg_loss + coef * nll
    metrics = {k: v for k, v in metrics.items() if not k.startswith("graft/")}
    metrics.update({"actor/pg_loss": float(pg_loss.detach()), "sgt/nll": float(nll.detach())})
    return loss, metrics
