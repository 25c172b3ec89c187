"""GRAFT's and SGT's exchange and advantages inside the multi-agent trainer (`algorithm.hacpo.mode=graft|sgt`).

`HacpoTrainer.exchange` and `HacpoTrainer.advantages` hand over to these two functions in mode
graft; everything else of the step (generate, score, old log-probs, update, weight sync) is
the trainer's. docs/ALGORITHM.md, GRAFT:

    G1  k_M(q) from the verifier's rewards, `graft.graft_selection` → the source of every
        receiver's group (−1: its own)
    G2  every agent's GRPO advantage on its own full group, before anything is exchanged; a
        grafted row carries its source's (`batch_keys.GROUP_ADVANTAGE` travels with the row)
    G3  one more forward of the receiver over its grafted rows only: its old log-probs of
        their re-tokenized text (the ratio's denominator) and w against the source's own
    G4  the loss in the workers (`workers.hacpo_loss.graft_actor_loss`)
    G5  the mini-batch order in `AgentRuntime.update` (`graft.graft_mini_batch_order`)

G1 also serves HACPO and Naive as their share rule (`share_selection=complementary`,
docs/ALGORITHM.md §9; `complementary_sources`, `mark_selected`, called from `HacpoTrainer.exchange`),
and SGT (docs/ALGORITHM.md §9, SGT; `sgt_exchange`, `sgt_advantages`):

    every agent's GRPO advantage on its own groups (own rows only, as G2)
    `sgt.sgt_selection` per receiver → at most one imitated peer response per prompt, in one
        extra row per prompt group (the imitation slot), re-tokenized for the receiver
    the loss in the workers (`workers.hacpo_loss.sgt_actor_loss`); the mini-batch layout is
        HACPO's (`minibatch.mini_batch_order`: whole groups of n_R own rows + 1 slot)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, NamedTuple

import numpy as np
import torch

from recipe_hacpo import batch_keys as K
from recipe_hacpo.exchange import mean_log_prob_per_response
from recipe_hacpo.exchange_jobs import convert_peer_rows
from recipe_hacpo.graft import compatibility_weight, graft_selection, grpo_advantage
from recipe_hacpo.sgt import sgt_selection
from verl import DataProto

if TYPE_CHECKING:
    from recipe_hacpo.trainer import HacpoTrainer


def correct_counts(rollouts: dict[str, DataProto], names: list[str]) -> tuple[list[str], torch.Tensor]:
    """The step's prompts (uids in batch order) and k_M(q) of every agent, long [N, Q].

    A response counts as correct when its reward is positive (the verifier's rewards are 0/1).
    """
    uids = list(dict.fromkeys(rollouts[names[0]].non_tensor_batch["uid"].tolist()))
    where = {u: i for i, u in enumerate(uids)}
    correct = torch.zeros(len(names), len(uids), dtype=torch.long)
    for a, name in enumerate(names):
        batch = rollouts[name]
        q = torch.as_tensor([where[u] for u in batch.non_tensor_batch["uid"].tolist()], dtype=torch.long)
        correct[a].index_add_(0, q, (batch.batch[K.REWARD] > 0).long())
    return uids, correct


class ShareSelection(NamedTuple):
    """GRAFT's G1 selection of one step as a share rule: `source_of[R, q]` is the one peer whose
    rows learner R trains on for prompt q (−1: none), `prompt_of` a uid's q."""

    prompt_of: dict[str, int]
    source_of: torch.Tensor  # long [N_R, Q]


def complementary_sources(trainer: "HacpoTrainer", rollouts: dict[str, DataProto]) -> ShareSelection:
    """`share_selection=complementary` (mode hacpo / naive): GRAFT's G1, computed as mode graft does.

        C_{S→R} = { q : k_R(q) = 0  and  1 ≤ k_S(q) < n_S },  balanced per unordered pair
        (`graft_balance`), one source per (R, q) when N ≥ 3 (`graft.graft_selection`)

    Learner R keeps every own row and, of peer S's rows, those of the prompts with source_of[R, q] = S.
    """
    names = [s.name for s in trainer.specs]
    uids, correct = correct_counts(rollouts, names)
    sizes = torch.as_tensor([s.rollout_n for s in trainer.specs], dtype=torch.long)
    source_of = graft_selection(correct, sizes, balance=trainer.hacpo.graft_balance)
    return ShareSelection({u: i for i, u in enumerate(uids)}, source_of)


def mark_selected(part: DataProto, selection: ShareSelection, learner: int) -> DataProto:
    """Tag one part of learner R's batch with `SELECTED`; zero the response_mask of the others.

    The unselected peer rows stay (every prompt group keeps its size, as the mini-batch layout
    needs) but with no response token they are in neither the loss nor its token and row counts;
    the advantage leaves them out of the group statistics (`SELECTED` is its row validity).
    """
    q = torch.as_tensor([selection.prompt_of[u] for u in part.non_tensor_batch["uid"].tolist()], dtype=torch.long)
    chosen = selection.source_of[learner, q] if len(q) else q
    selected = ~part.batch[K.IS_CROSS] | (chosen == part.batch[K.SOURCE])
    part.batch[K.SELECTED] = selected
    if not bool(selected.all()):
        # a new tensor, never in place: an own part is the learner's rollout itself
        mask = part.batch["response_mask"]
        part.batch["response_mask"] = mask * selected.to(mask.dtype).unsqueeze(-1)
    return part


def selection_metrics(name: str, batch: DataProto, selection: ShareSelection, learner: int) -> dict[str, float]:
    """cross/rows_selected (peer rows in the loss) and cross/groups_selected (peer groups, one
    source's rows for one prompt, this learner trains on)."""
    peer_selected = batch.batch[K.SELECTED] & batch.batch[K.IS_CROSS]
    return {
        f"agent/{name}/cross/rows_selected": float(peer_selected.sum()),
        f"agent/{name}/cross/groups_selected": float((selection.source_of[learner] >= 0).sum()),
    }


def graft_exchange(trainer: "HacpoTrainer", rollouts: dict[str, DataProto], metrics: dict) -> dict[str, DataProto]:
    """Learner batches of mode graft: per prompt, the receiver's own group or one source's whole group."""
    specs = trainer.specs
    names = [s.name for s in specs]
    with_group_advantages(rollouts)
    uids, correct = correct_counts(rollouts, names)
    sizes = torch.as_tensor([s.rollout_n for s in specs], dtype=torch.long)
    source_of = graft_selection(correct, sizes, balance=trainer.hacpo.graft_balance)  # [N_R, Q]
    batches = graft_batches(rollouts, names, source_of, uids, {s.name: s.index for s in specs},
                            lambda source, learner, rows: convert_peer_rows(trainer, source, learner, rollouts[source], rows))
    for learner in specs:
        metrics[f"agent/{learner.name}/graft/groups_received"] = float((source_of[learner.index] >= 0).sum())
        metrics[f"agent/{learner.name}/graft/groups_given"] = float((source_of == learner.index).sum())
    weigh_grafted_rows(trainer, batches, metrics)
    for name, batch in batches.items():
        metrics[f"agent/{name}/cross/rows"] = float(batch.batch[K.IS_CROSS].sum())
    return batches


def with_group_advantages(rollouts: dict[str, DataProto]) -> None:
    """G2: every source's GRPO advantage on its full group, before anything is exchanged or dropped
    (`GROUP_ADVANTAGE` then travels with each row)."""
    for batch in rollouts.values():
        batch.batch[K.GROUP_ADVANTAGE] = grpo_advantage(batch.batch[K.REWARD], batch.non_tensor_batch["uid"]).float()


def graft_batches(
    rollouts: dict[str, DataProto],
    names: list[str],
    source_of: torch.Tensor,
    uids: list[str],
    learners: dict[str, int],
    convert: Callable[[str, str, torch.Tensor], DataProto],
) -> dict[str, DataProto]:
    """Each learner's batch: its own rows of the prompts it keeps, then each source's whole groups of
    the prompts `source_of` [N_R, Q] gives it from that source (index into `names`), re-tokenized by
    `convert(source name, learner name, row numbers of rollouts[source])`."""
    from recipe_hacpo.trainer import _concat_rows, _tag

    prompt_of = {u: i for i, u in enumerate(uids)}

    def rows_for(name: str, receiver: int, wanted: int) -> torch.Tensor:
        """Row numbers of `name`'s rollouts on the prompts whose group `receiver` takes from `wanted`."""
        q = [prompt_of[u] for u in rollouts[name].non_tensor_batch["uid"].tolist()]
        return torch.nonzero(source_of[receiver, q] == wanted).flatten()

    batches = {}
    for learner, receiver in learners.items():
        own = rows_for(learner, receiver, -1)
        parts = [_tag(rollouts[learner].select_idxs(own), source=names.index(learner), cross=False, omega=1.0)]
        for index, source in enumerate(names):
            rows = rows_for(source, receiver, index) if source != learner else own[:0]
            if len(rows):
                parts.append(_tag(convert(source, learner, rows), source=index, cross=True, omega=1.0))
        # a receiver may have no own group left, never no group at all (every prompt has one)
        batches[learner] = _concat_rows([p for p in parts if len(p)])
    return batches


def weigh_grafted_rows(trainer: "HacpoTrainer", batches: dict[str, DataProto], metrics: dict) -> None:
    """G3: the receiver's old log-probs of its grafted rows (one forward over them only), w and the gate.

    A grafted row the floor drops keeps its place in the batch (so every group keeps n rows and
    the mini-batches their size) with a zeroed response_mask: it is in neither the loss nor the
    token count. w is fixed for the whole update.
    """
    grafted_rows = {name: torch.nonzero(b.batch[K.IS_CROSS]).flatten() for name, b in batches.items()}
    old = trainer._each(
        lambda a: _old_log_prob_of_rows(a, batches[a.spec.name], grafted_rows[a.spec.name]),
        phase="graft_old_log_prob",
    )
    settings = trainer.hacpo
    for name, batch in batches.items():
        rows = grafted_rows[name]
        weight = torch.ones(len(batch), dtype=torch.float32)
        if len(rows):
            mask = batch.batch["response_mask"]
            lp = old[name]
            if not torch.isfinite(lp[mask[rows].bool()]).all():
                raise FloatingPointError(f"agent {name!r}: non-finite old log-probs of grafted rows; stopping before any update")
            batch.batch["old_log_probs"][rows] = lp
            w, admitted = compatibility_weight(
                mean_log_prob_per_response(lp, mask[rows]),
                batch.batch[K.SOURCE_LOG_PROB_MEAN][rows],
                torch.ones(len(rows), dtype=torch.bool),
                delta=settings.graft_floor,
                gate=settings.graft_weight,
            )
            weight[rows] = w
            dropped = rows[~admitted]
            mask[dropped] = 0
            metrics[f"agent/{name}/graft/admitted"] = float(admitted.sum())
            metrics[f"agent/{name}/graft/dropped"] = float((~admitted).sum())
            metrics[f"agent/{name}/graft/weight_mean"] = float(w[admitted].mean()) if admitted.any() else 0.0
        else:
            metrics[f"agent/{name}/graft/admitted"] = 0.0
            metrics[f"agent/{name}/graft/dropped"] = 0.0
        batch.batch[K.GRAFT_WEIGHT] = weight


def _old_log_prob_of_rows(agent, batch: DataProto, rows: torch.Tensor) -> torch.Tensor | None:
    """The receiver's old log-probs of `rows` of its batch, [len(rows), T] (None when there are none).

    verl's engine cuts a log-prob call into equal micro-batches of
    `rollout.log_prob_micro_batch_size_per_gpu` on each of its ranks and refuses a row count that
    does not divide; the number of grafted rows changes every step, so the call is padded by
    repeating the first grafted row, and the padding's outputs are discarded.
    """
    if not len(rows):
        return None
    rollout = agent.config.actor_rollout_ref.rollout
    micro = 1 if rollout.get("log_prob_use_dynamic_bsz", False) else int(rollout.log_prob_micro_batch_size_per_gpu or 1)
    unit = micro * agent.wg.world_size
    padded = torch.cat([rows, rows[:1].repeat((-len(rows)) % unit)])
    return agent.old_log_prob(batch.select_idxs(padded))[: len(rows)]


def graft_advantages(batches: dict[str, DataProto], metrics: dict) -> None:
    """G2: every row's advantage is its generating agent's GRPO advantage on its own full group."""
    for name, batch in batches.items():
        adv = batch.batch[K.GROUP_ADVANTAGE]
        mask = batch.batch["response_mask"]
        batch.batch["advantages"] = adv.float().unsqueeze(-1) * mask
        batch.batch["returns"] = batch.batch["advantages"]
        metrics[f"agent/{name}/advantage/mean"] = float(adv.mean())
        metrics[f"agent/{name}/advantage/abs_mean"] = float(adv.abs().mean())


def sgt_exchange(trainer: "HacpoTrainer", rollouts: dict[str, DataProto], metrics: dict) -> dict[str, DataProto]:
    """Learner batches of mode sgt: every own row, plus one imitation slot per prompt group.

    verl's mini-batches and `minibatch.mini_batch_order` need prompt groups of one size, so every
    group of the receiver gets exactly one extra row. Where the receiver imitates (`sgt_selection`)
    that row is the drawn peer response; elsewhere it is a placeholder (the first response of the
    lowest-index peer to that prompt). Either way the slot is re-tokenized for the receiver by
    the exchange, carries a zero response_mask and advantage (it is in neither GRPO's loss nor
    its token count) and `IMITATION_MASK` is its response mask when it is imitated, else 0.
    The draw is keyed on the receiver's `actor.data_loader_seed`, the step and the prompt uid.
    """
    from recipe_hacpo.trainer import _concat_rows, _tag

    specs = trainer.specs
    names = [s.name for s in specs]
    for name in names:  # GRPO on each agent's own groups, before anything is exchanged
        batch = rollouts[name]
        batch.batch[K.GROUP_ADVANTAGE] = grpo_advantage(batch.batch[K.REWARD], batch.non_tensor_batch["uid"]).float()
    # every agent's rows in agent-index order, then batch order: the pool order of the draw
    source = torch.cat([torch.full((len(rollouts[s.name]),), s.index, dtype=torch.long) for s in specs])
    row = torch.cat([torch.arange(len(rollouts[s.name])) for s in specs])
    correct = torch.cat([rollouts[s.name].batch[K.REWARD] > 0 for s in specs])
    uid = np.concatenate([rollouts[s.name].non_tensor_batch["uid"] for s in specs])

    batches = {}
    for learner in specs:
        seed = int(trainer.agents[learner.name].config.actor_rollout_ref.actor.data_loader_seed)
        uids, picks = sgt_selection(correct, uid, source, learner.index, seed=seed, step=trainer.global_step)
        placeholder = torch.as_tensor([_first_peer_row(uid, source, u, learner.index) for u in uids], dtype=torch.long)
        slot = torch.where(picks >= 0, picks, placeholder)  # one pooled row per prompt
        own = _tag(rollouts[learner.name], source=learner.index, cross=False, omega=1.0)
        own.batch[K.IMITATION_MASK] = torch.zeros_like(own.batch["response_mask"])
        parts = [own]
        for src in specs:
            here = torch.nonzero(source[slot] == src.index).flatten() if src.name != learner.name else slot[:0]
            if not len(here):
                continue
            converted = convert_peer_rows(trainer, src.name, learner.name, rollouts[src.name], row[slot[here]])
            parts.append(_imitation_slots(_tag(converted, source=src.index, cross=True, omega=1.0), picks[here] >= 0))
        batch = _concat_rows(parts)
        batches[learner.name] = batch
        imitated = int((picks >= 0).sum())
        metrics[f"agent/{learner.name}/sgt/prompts_imitated"] = float(imitated)
        metrics[f"agent/{learner.name}/sgt/imitation_tokens"] = float(batch.batch[K.IMITATION_MASK].sum())
        metrics[f"agent/{learner.name}/cross/rows"] = float(imitated)
    return batches


def _first_peer_row(uid: np.ndarray, source: torch.Tensor, prompt: str, receiver: int) -> int:
    """The pooled row number of the first response of the lowest-index peer to `prompt`."""
    rows = np.flatnonzero((uid == prompt) & (source.numpy() != receiver))
    return int(rows[0])


def _imitation_slots(slots: DataProto, imitated: torch.Tensor) -> DataProto:
    """Mask the slot rows out of GRPO's term; the imitated ones' response tokens become the NLL's."""
    mask = slots.batch["response_mask"]
    slots.batch[K.IMITATION_MASK] = mask * imitated.to(mask.dtype).unsqueeze(-1)
    slots.batch["response_mask"] = torch.zeros_like(mask)
    slots.batch[K.GROUP_ADVANTAGE] = torch.zeros(len(slots), dtype=torch.float32)
    return slots


def sgt_advantages(batches: dict[str, DataProto], metrics: dict) -> None:
    """GRPO's advantage of every own row (as `graft_advantages`); 0 on the imitation slots."""
    graft_advantages(batches, metrics)
    for name, batch in batches.items():
        own = batch.batch[K.GROUP_ADVANTAGE][~batch.batch[K.IS_CROSS]]
        metrics[f"agent/{name}/advantage/mean"] = float(own.mean())
        metrics[f"agent/{name}/advantage/abs_mean"] = float(own.abs().mean())


def imitation_nll(update_metrics: dict[str, float]) -> float | None:
    """sgt/nll of one agent's step from the loss's summed NLL and token count (None: nothing imitated)."""
    tokens = update_metrics.get("sgt/nll_tokens", 0.0)
    if not tokens:
        return None
    return float(update_metrics["sgt/nll_sum"] / tokens)


def peer_clip_fraction(update_metrics: dict[str, float]) -> float | None:
    """graft/peer_clipfrac of one agent's step from the loss's summed token counts (None: no grafted token)."""
    tokens = update_metrics.get("graft/peer_tokens", 0.0)
    if not tokens:
        return None
    return float(update_metrics["graft/peer_clipped_tokens"] / tokens)


__all__ = [
    "ShareSelection", "complementary_sources", "mark_selected", "selection_metrics",
    "correct_counts", "graft_exchange", "graft_advantages", "peer_clip_fraction",
    "sgt_exchange", "sgt_advantages", "imitation_nll",
]
