"""Formula-level tests of GRAFT (recipe_hacpo.methods.graft_formulas; SGT's are in test_sgt.py): hand-computed selection (balancing,
ties, N = 3), advantages, weights, loss values and gradients; equivalence to verl's GRPO when
nothing is exchanged; and the HACPO advantage of a group with no row of the learner."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recipe_hacpo.methods.core_algos import capability_baseline, compute_hacpo_advantage
from recipe_hacpo.methods.graft_formulas import (
    assign_sources,
    balanced_selection,
    compatibility_weight,
    complementary_candidates,
    compute_graft_policy_loss,
    graft_mini_batch_order,
    graft_selection,
    grpo_advantage,
)
from helpers.verl_losses import verl_vanilla_loss as _verl_vanilla

F64 = torch.float64


# --------------------------------------------------------------------------- G1 selection
def test_selection_two_agents_balancing_by_hand():
    # n = 4 each; agent 0 = A, agent 1 = B
    correct = torch.tensor([[0, 0, 0, 2, 3, 1], [1, 3, 3, 0, 0, 4]])
    n = torch.tensor([4, 4])
    cand = complementary_candidates(correct, n)
    # B → A: A failed and B mixed on q0, q1, q2; A → B: q3, q4; q5 has B all correct
    assert cand[1, 0].tolist() == [True, True, True, False, False, False]
    assert cand[0, 1].tolist() == [False, False, False, True, True, False]
    assert not cand[0, 0].any() and not cand[1, 1].any()
    # m = min(3, 2) = 2: B → A keeps q1, q2 (k_B = 3, 3) and drops q0 (k_B = 1); A → B keeps both
    source = graft_selection(correct, n)
    assert source.tolist() == [[-1, 1, 1, -1, -1, -1], [-1, -1, -1, 0, 0, -1]]
    # no balancing (ablation): every candidate is kept
    unbalanced = graft_selection(correct, n, balance=False)
    assert unbalanced.tolist() == [[1, 1, 1, -1, -1, -1], [-1, -1, -1, 0, 0, -1]]


def test_selection_keeps_every_prompt_tied_with_the_mth():
    correct = torch.tensor([[0, 0, 0, 2], [2, 2, 2, 0]])
    # m = min(3, 1) = 1, but all three B → A candidates tie at k_B = 2: all are kept
    assert graft_selection(correct, torch.tensor([4, 4])).tolist() == [[1, 1, 1, -1], [-1, -1, -1, 0]]


def test_selection_m_zero_keeps_none():
    correct = torch.tensor([[0, 4], [2, 4]])
    n = torch.tensor([4, 4])
    assert complementary_candidates(correct, n)[1, 0].tolist() == [True, False]
    assert graft_selection(correct, n).tolist() == [[-1, -1], [-1, -1]]  # C_{A→B} empty → m = 0
    assert graft_selection(correct, n, balance=False).tolist() == [[1, -1], [-1, -1]]


def test_selection_source_group_must_be_mixed_for_its_own_size():
    # B has 2 rollouts: k_B = 2 is all-correct for B (not a candidate), k_B = 1 is mixed
    correct = torch.tensor([[0, 0, 1], [2, 1, 0]])
    cand = complementary_candidates(correct, torch.tensor([4, 2]))
    assert cand[1, 0].tolist() == [False, True, False]
    assert cand[0, 1].tolist() == [False, False, True]


def test_selection_three_agents_by_hand():
    # A, B, C with n = 4. q0: only C's group wins for A (B's is dropped by balancing {A, B});
    # q1: A gives to B and to C; q2: B and C both keep it for A with k = 3, tie → B (lower index)
    correct = torch.tensor([[0, 1, 0], [2, 0, 3], [3, 0, 3]])
    n = torch.tensor([4, 4, 4])
    cand = complementary_candidates(correct, n)
    kept = balanced_selection(cand, correct)
    # pair {A, B}: C_{B→A} = {q0 (2), q2 (3)}, C_{A→B} = {q1} → m = 1 keeps q2 only
    assert kept[1, 0].tolist() == [False, False, True]
    # pair {A, C}: C_{C→A} = {q0 (3), q2 (3)} tied at the first → both kept
    assert kept[2, 0].tolist() == [True, False, True]
    assert kept[0, 1].tolist() == [False, True, False] and kept[0, 2].tolist() == [False, True, False]
    # pair {B, C}: no candidates either way
    assert not kept[1, 2].any() and not kept[2, 1].any()
    source = assign_sources(kept, correct)
    assert source.tolist() == [[2, -1, 1], [-1, 0, -1], [-1, 0, -1]]


def test_selection_larger_source_count_wins_for_one_receiver():
    kept = torch.zeros(3, 3, 1, dtype=torch.bool)
    kept[1, 0, 0] = kept[2, 0, 0] = True
    assert assign_sources(kept, torch.tensor([[0], [1], [2]])).tolist() == [[2], [-1], [-1]]
    assert assign_sources(kept, torch.tensor([[0], [3], [2]])).tolist() == [[1], [-1], [-1]]


def test_selection_rejects_counts_outside_the_group():
    with pytest.raises(ValueError, match="outside"):
        complementary_candidates(torch.tensor([[5], [0]]), torch.tensor([4, 4]))
    with pytest.raises(ValueError, match=r"\[N\]"):
        complementary_candidates(torch.tensor([[1], [0]]), torch.tensor([4]))


@settings(max_examples=60, deadline=None)
@given(
    n_agents=st.integers(2, 4),
    q=st.integers(1, 10),
    n=st.integers(1, 5),
    data=st.data(),
)
def test_selection_invariants(n_agents, q, n, data):
    correct = torch.tensor(
        data.draw(st.lists(st.lists(st.integers(0, n), min_size=q, max_size=q), min_size=n_agents, max_size=n_agents))
    )
    size = torch.full((n_agents,), n)
    cand = complementary_candidates(correct, size)
    kept = balanced_selection(cand, correct)
    source = assign_sources(kept, correct)
    assert (kept <= cand).all()
    for s in range(n_agents):
        for r in range(n_agents):
            if s == r:
                continue
            m = int(min(cand[s, r].sum(), cand[r, s].sum()))
            # at least m kept when m > 0 (ties add), none when m = 0; every kept k_S ≥ every dropped one
            assert (kept[s, r].sum() >= m) if m else not kept[s, r].any()
            if kept[s, r].any() and (cand[s, r] & ~kept[s, r]).any():
                assert correct[s][kept[s, r]].min() > correct[s][cand[s, r] & ~kept[s, r]].max()
    for r in range(n_agents):
        for p in range(q):
            s = int(source[r, p])
            if s < 0:
                assert not kept[:, r, p].any()
                continue
            # the receiver failed, the source is mixed, and no other kept source has more correct
            assert correct[r, p] == 0 and 1 <= correct[s, p] < n and kept[s, r, p]
            others = [t for t in range(n_agents) if kept[t, r, p]]
            assert correct[s, p] == max(int(correct[t, p]) for t in others)
            assert s == min(t for t in others if correct[t, p] == correct[s, p])
    if n_agents == 2:  # balance is symmetric up to ties: both directions keep something or neither
        assert bool(kept[0, 1].any()) == bool(kept[1, 0].any())


# --------------------------------------------------------------------------- G2 advantages
def test_grpo_advantage_by_hand():
    adv = grpo_advantage(torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 1.0]), np.array(["a"] * 4 + ["b"] * 2))
    std = math.sqrt(1 / 3)
    a = 0.5 / (std + 1e-6)
    assert adv.tolist() == pytest.approx([a, -a, -a, a, 0.0, 0.0], rel=1e-6)


@settings(max_examples=30, deadline=None)
@given(
    rewards=st.lists(st.sampled_from([0.0, 1.0]), min_size=1, max_size=24),
    groups=st.integers(1, 6),
)
def test_grpo_advantage_equals_verl(rewards, groups):
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    r = torch.tensor(rewards, dtype=torch.float32)
    index = np.array([f"u{i % groups}" for i in range(len(rewards))], dtype=object)
    token_rewards = torch.zeros(len(r), 3)
    token_rewards[:, -1] = r
    theirs, _ = compute_grpo_outcome_advantage(token_rewards, torch.ones(len(r), 3), index)
    assert torch.allclose(grpo_advantage(r, index), theirs[:, 0], atol=1e-5)


def test_hacpo_advantage_of_a_group_without_learner_rows_keeps_its_weighted_mean():
    # GRAFT's selection can give a learner a group made only of a peer's rows. The baseline guard
    # falls back to the learner's own mean, which such a group does not have: it keeps μ̂.
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0], dtype=F64)
    index = np.array(["peer_only", "peer_only", "mixed", "mixed"])
    source = torch.tensor([1, 1, 0, 1])
    cap = torch.tensor([1.0, 0.1])  # ω^(0,1) = 10
    mu, guarded = capability_baseline(rewards, index, source, 0, cap)
    # peer_only: μ̂ = (10 + 0) / 2 = 5 > 1, no own row → not guarded;
    # mixed: μ̂ = (1 + 0) / 2 = 0.5 ≤ 1 → not guarded either
    assert mu.tolist() == pytest.approx([5.0, 5.0, 0.5, 0.5]) and not guarded.any()
    adv = compute_hacpo_advantage(rewards, index, source, 0, cap)
    std = math.sqrt(0.5)
    assert adv.tolist() == pytest.approx([(r - m) / (std + 1e-6) for r, m in zip([1, 0, 1, 0], [5, 5, 0.5, 0.5])])
    # one learner row in the group lets the guard act: μ̂ = (10·1 + 0) / 2 = 5 → own mean 0
    mu2, guarded2 = capability_baseline(rewards, index, torch.tensor([1, 0, 0, 1]), 0, cap)
    assert mu2[:2].tolist() == pytest.approx([0.0, 0.0]) and guarded2[:2].all()


# --------------------------------------------------------------------------- G3 weight
def test_compatibility_weight_by_hand():
    lp_s = torch.zeros(5, dtype=F64)
    lp_r = torch.log(torch.tensor([0.9, 0.5, 1.5, 0.8, 0.1], dtype=F64))
    grafted = torch.tensor([True, True, True, True, False])
    w, admitted = compatibility_weight(lp_r, lp_s, grafted)
    # s = 0.9 → 0.9; 0.5 ≤ δ → dropped; 1.5 → min(s, 1) = 1; s = δ exactly → dropped (strict);
    # own row → 1 whatever its s
    assert w.tolist() == pytest.approx([0.9, 0.0, 1.0, 0.0, 1.0])
    assert admitted.tolist() == [True, False, True, False, True]
    w, admitted = compatibility_weight(lp_r, lp_s, grafted, delta=None)  # no floor
    assert w.tolist() == pytest.approx([0.9, 0.5, 1.0, 0.8, 1.0]) and admitted.all()
    w, admitted = compatibility_weight(lp_r, lp_s, grafted, gate=False)  # no weight at all
    assert w.tolist() == [1.0] * 5 and admitted.all()
    with pytest.raises(ValueError, match="δ"):
        compatibility_weight(lp_r, lp_s, grafted, delta=1.0)


def test_compatibility_weight_compares_mean_log_probs():
    # receiver mean −1.2 vs source mean −1.0 → s = e^−0.2 = 0.8187 > 0.8
    w, admitted = compatibility_weight(torch.tensor([-1.2]), torch.tensor([-1.0]), torch.tensor([True]))
    assert w.item() == pytest.approx(math.exp(-0.2), rel=1e-6) and admitted.item()


# --------------------------------------------------------------------------- G4 loss
def _hand_batch():
    # row 0 own (Â = +1, ρ = 1.1, 1.5); row 1 grafted (Â = −0.5, w = 0.9, ρ = 0.7, 1.0);
    # row 2 grafted and dropped by the gate (mask 0): in neither the loss nor the token count
    old = torch.zeros(3, 2, dtype=F64)
    log_prob = torch.log(torch.tensor([[1.1, 1.5], [0.7, 1.0], [5.0, 0.01]], dtype=F64)).requires_grad_(True)
    adv = torch.tensor([1.0, -0.5, 3.0], dtype=F64)
    mask = torch.tensor([[1, 1], [1, 1], [0, 0]])
    weight = torch.tensor([1.0, 0.9, 0.0], dtype=F64)
    grafted = torch.tensor([False, True, True])
    return log_prob, old, adv, mask, weight, grafted


def test_graft_loss_value_and_gradient_by_hand():
    log_prob, old, adv, mask, weight, grafted = _hand_batch()
    loss, metrics = compute_graft_policy_loss(log_prob, old, adv, mask, weight=weight, is_grafted=grafted)
    # own: −min(1.1, 1.1) = −1.1, −min(1.5, 1.28) = −1.28 (clipped, no gradient)
    # grafted: 0.9·max(0.35, 0.4) = 0.36 (clipped at 0.8), 0.9·0.5 = 0.45; four tokens
    assert loss.item() == pytest.approx((-1.1 - 1.28 + 0.36 + 0.45) / 4)
    (grad,) = torch.autograd.grad(loss, log_prob)
    assert grad.flatten().tolist() == pytest.approx(sum([[-1.1 / 4, 0.0], [0.0, 0.9 * 0.5 / 4], [0.0, 0.0]], []))
    assert metrics["actor/pg_clipfrac"] == pytest.approx(0.5)
    assert metrics["graft/peer_clipfrac"] == pytest.approx(0.5)
    assert metrics["graft/peer_token_frac"] == pytest.approx(0.5)


def test_graft_loss_sequence_ratio_ablation_by_hand():
    log_prob, old, adv, mask, weight, grafted = _hand_batch()
    loss, _ = compute_graft_policy_loss(
        log_prob, old, adv, mask, weight=weight, is_grafted=grafted, ratio_level="sequence"
    )
    # own: ρ = √(1.1·1.5) = 1.2845 > 1.28 → clipped on both tokens; grafted: ρ = √0.7, inside
    rho = math.sqrt(0.7)
    assert loss.item() == pytest.approx((-1.28 * 2 + 2 * 0.9 * 0.5 * rho) / 4)
    (grad,) = torch.autograd.grad(loss, log_prob)
    assert grad.flatten().tolist() == pytest.approx(sum([[0.0, 0.0], [0.9 * 0.5 * rho / 4] * 2, [0.0, 0.0]], []))


def test_graft_loss_ratio_is_against_the_receivers_old_policy():
    # the same grafted row, with the receiver's old log-probs equal to the current ones, is
    # unclipped at ρ = 1 whatever the source thought of it: the source enters through w only
    log_prob = torch.tensor([[-0.3, -2.0]], dtype=F64, requires_grad=True)
    loss, _ = compute_graft_policy_loss(
        log_prob, log_prob.detach().clone(), torch.tensor([2.0], dtype=F64), torch.ones(1, 2),
        weight=torch.tensor([0.85]), is_grafted=torch.tensor([True]),
    )
    assert loss.item() == pytest.approx(-0.85 * 2.0)
    (grad,) = torch.autograd.grad(loss, log_prob)
    assert grad.flatten().tolist() == pytest.approx(sum([[-0.85 * 2.0 / 2] * 2], []))


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("scale", [0.05, 2.0])  # ratios near 1, and ratios far outside [1 − ε, 1 + ε] and 3
def test_graft_without_exchange_equals_verl_grpo_loss(seed, scale):
    g = torch.Generator().manual_seed(seed)
    b, t = 6, 5
    old = -torch.rand(b, t, generator=g, dtype=F64) * 3
    log_prob = (old + scale * torch.randn(b, t, generator=g, dtype=F64)).requires_grad_(True)
    adv = torch.randn(b, generator=g, dtype=F64).unsqueeze(-1).expand(b, t)
    mask = (torch.rand(b, t, generator=g) > 0.3).long()
    mask[:, 0] = 1
    (theirs, their_metrics), dual = _verl_vanilla(log_prob, old, adv, mask, 0.2, 0.28)
    ours, metrics = compute_graft_policy_loss(
        log_prob, old, adv, mask, weight=torch.ones(b), is_grafted=torch.zeros(b, dtype=torch.bool), clip_ratio_c=dual
    )
    (g_ours,) = torch.autograd.grad(ours, log_prob, retain_graph=True)
    (g_theirs,) = torch.autograd.grad(theirs, log_prob)
    assert torch.allclose(ours, theirs, atol=1e-12)
    assert torch.allclose(g_ours, g_theirs, atol=1e-12)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(their_metrics["actor/pg_clipfrac"])
    assert metrics["actor/ppo_kl"] == pytest.approx(their_metrics["actor/ppo_kl"])


def test_graft_loss_rejects_unknown_ratio_level():
    log_prob, old, adv, mask, weight, grafted = _hand_batch()
    with pytest.raises(ValueError, match="ratio_level"):
        compute_graft_policy_loss(log_prob, old, adv, mask, weight=weight, is_grafted=grafted, ratio_level="seq")


# --------------------------------------------------------------------------- G5 order
def _kinds(uid, order):
    return [u for u in np.asarray(uid)[order]]


def test_peer_last_order_one_and_two_ranks():
    # 4 prompts × 2 rows; p1 and p3 are grafted groups
    uid = np.repeat(["p0", "p1", "p2", "p3"], 2)
    grafted = np.isin(uid, ["p1", "p3"])
    order = graft_mini_batch_order(uid, grafted, mini_batch_prompts=2, dp_size=1, seed=0)
    assert sorted(order.tolist()) == list(range(8))
    rows = grafted[order]
    assert rows.tolist() == [False] * 4 + [True] * 4  # update 0 own-only, update 1 grafted
    first = graft_mini_batch_order(uid, grafted, mini_batch_prompts=2, dp_size=1, seed=0, peer_order="first")
    assert grafted[first].tolist() == [True] * 4 + [False] * 4
    # two ranks, one prompt per rank per update: each rank's chunk is [update 0, update 1]
    order2 = graft_mini_batch_order(uid, grafted, mini_batch_prompts=2, dp_size=2, seed=0)
    per_rank = grafted[order2].reshape(2, 2, 2)  # rank, update, row
    assert per_rank[:, 0].sum() == 0 and per_rank[:, 1].all()
    # groups stay whole and contiguous
    assert all(len(set(_kinds(uid, order2)[i : i + 2])) == 1 for i in range(0, 8, 2))


def test_peer_order_is_seeded_and_rejects_mixed_groups():
    uid = np.repeat([f"p{i}" for i in range(8)], 2)
    grafted = np.isin(uid, ["p2", "p5"])
    a = graft_mini_batch_order(uid, grafted, mini_batch_prompts=2, dp_size=1, seed=3, peer_order="uniform")
    b = graft_mini_batch_order(uid, grafted, mini_batch_prompts=2, dp_size=1, seed=3, peer_order="uniform")
    assert a.tolist() == b.tolist() and sorted(a.tolist()) == list(range(16))
    mixed = grafted.copy()
    mixed[0] = True
    with pytest.raises(ValueError, match="mixes own and grafted"):
        graft_mini_batch_order(uid, mixed, mini_batch_prompts=2, dp_size=1, seed=0)
    with pytest.raises(ValueError, match="do not split"):
        graft_mini_batch_order(uid, grafted, mini_batch_prompts=3, dp_size=1, seed=0)


@settings(max_examples=40, deadline=None)
@given(
    num_mini=st.integers(1, 4), per_slot=st.integers(1, 3), dp=st.integers(1, 3), seed=st.integers(0, 99), data=st.data()
)
def test_peer_last_never_puts_a_grafted_update_before_an_own_only_one(num_mini, per_slot, dp, seed, data):
    prompts = num_mini * per_slot * dp
    flags = data.draw(st.lists(st.booleans(), min_size=prompts, max_size=prompts))
    uid = np.repeat([f"p{i}" for i in range(prompts)], 2)
    grafted = np.repeat(flags, 2)
    order = graft_mini_batch_order(uid, grafted, mini_batch_prompts=per_slot * dp, dp_size=dp, seed=seed)
    laid = grafted[order].reshape(dp, num_mini, per_slot * 2)  # verl: rank chunk, then its updates
    has_peer = laid.any(axis=(0, 2))  # per update, over all ranks
    if has_peer.any():
        assert not has_peer[: int(np.argmax(has_peer))].any()
        assert has_peer[int(np.argmax(has_peer)) :].all() or not laid[:, has_peer.argmax() + 1 :].any()
        # an own-only update never follows one holding a grafted group
        assert all(has_peer[i] <= has_peer[i + 1] for i in range(num_mini - 1))
