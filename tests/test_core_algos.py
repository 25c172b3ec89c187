"""Formula-level tests of the HACPO core: hand-computed numbers, equivalence to verl's GRPO
and GSPO in the one-agent case, and property tests of the spec's invariants."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from recipe_hacpo.methods.core_algos import (
    capability_baseline,
    CapabilityTracker,
    capability_ratio,
    capability_ratios,
    compute_hacpo_advantage,
    compute_hacpo_policy_loss,
    cross_lower_bound,
    exponential_is_weight,
    hacpo_policy_loss_matrix,
    row_clipped,
)

F64 = torch.float64


# --------------------------------------------------------------------------- §1 tracker
def test_tracker_window_mean_and_floor_by_hand():
    t = CapabilityTracker(num_agents=2, window=3, floor=1e-3)
    assert torch.equal(t.capabilities(), torch.ones(2, dtype=torch.float64))
    for row in ([0.5, 0.0], [0.2, 0.0], [0.8, 0.0], [0.5, 0.3]):
        t.update(row)
    # window 3 keeps the last three steps: (0.2+0.8+0.5)/3, (0+0+0.3)/3
    assert t.capabilities().tolist() == pytest.approx([0.5, 0.1])
    t2 = CapabilityTracker(num_agents=2, window=5, floor=0.05)
    t2.update([0.0, 0.4])
    assert t2.capabilities().tolist() == pytest.approx([0.05, 0.4])  # floor ε_P


def test_tracker_omega_by_hand_and_clamp():
    t = CapabilityTracker(num_agents=3, window=5, floor=1e-3, omega_clip=(0.1, 10.0))
    t.update([0.6, 0.2, 0.0])
    assert t.omega(0, 1) == pytest.approx(3.0)
    assert t.omega(1, 0) == pytest.approx(1 / 3)
    assert t.omega(1, 1) == 1.0
    assert t.omega(0, 2) == pytest.approx(10.0)  # 0.6 / 1e-3 clamped
    assert t.omega(2, 0) == pytest.approx(0.1)


def test_tracker_state_dict_round_trip_and_errors():
    t = CapabilityTracker(num_agents=2, window=2)
    t.update([0.1, 0.2])
    t.update([0.3, 0.4])
    t.update([0.5, 0.6])
    u = CapabilityTracker(num_agents=2, window=2)
    u.load_state_dict(t.state_dict())
    assert torch.equal(u.capabilities(), t.capabilities())
    u.update([1.0, 1.0])
    t.update([1.0, 1.0])
    assert torch.equal(u.capabilities(), t.capabilities())
    with pytest.raises(ValueError, match="checkpoint has 2 agents, this run has 3"):
        CapabilityTracker(num_agents=3).load_state_dict(t.state_dict())
    with pytest.raises(ValueError, match="expected 2 mean rewards"):
        t.update([0.1])
    with pytest.raises(ValueError, match="non-finite"):
        t.update([float("nan"), 0.1])


# --------------------------------------------------------------------------- §2 advantage
def test_advantage_by_hand_two_agents():
    # one group: learner 0 (P̂ 0.8) has rewards [1, 0], agent 1 (P̂ 0.2) has [1, 1]
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0], dtype=F64)
    index = np.array(["q", "q", "q", "q"], dtype=object)
    source = torch.tensor([0, 0, 1, 1])
    cap = torch.tensor([0.8, 0.2], dtype=F64)
    # learner 0: ω^(0,1) = 4 → μ̂ = (1 + 0 + 4 + 4) / 4 = 2.25 (the paper's formula, no guard)
    std = float(torch.tensor([1.0, 0.0, 1.0, 1.0]).std())  # unbiased, 0.5
    a0 = compute_hacpo_advantage(rewards, index, source, 0, cap, baseline_cap=None)
    expected0 = [(r - 2.25) / (std + 1e-6) for r in (1.0, 0.0, 1.0, 1.0)]
    assert a0.tolist() == pytest.approx(expected0, rel=1e-9)
    # with the guard (default): 2.25 > 1 → learner 0's own mean, (1 + 0) / 2 = 0.5
    a0_guarded = compute_hacpo_advantage(rewards, index, source, 0, cap)
    assert a0_guarded.tolist() == pytest.approx([(r - 0.5) / (std + 1e-6) for r in (1.0, 0.0, 1.0, 1.0)], rel=1e-9)
    # learner 1: ω^(1,0) = 0.25 → μ̂ = (0.25 + 0 + 1 + 1) / 4 = 0.5625
    a1 = compute_hacpo_advantage(rewards, index, source, 1, cap)
    expected1 = [(r - 0.5625) / (std + 1e-6) for r in (1.0, 0.0, 1.0, 1.0)]
    assert a1.tolist() == pytest.approx(expected1, rel=1e-9)
    # ablation: plain mean 0.75
    a_plain = compute_hacpo_advantage(rewards, index, source, 0, cap, use_capability_baseline=False)
    assert a_plain.tolist() == pytest.approx([(r - 0.75) / (std + 1e-6) for r in (1.0, 0.0, 1.0, 1.0)])
    # Dr.GRPO: no division
    a_nostd = compute_hacpo_advantage(rewards, index, source, 0, cap, norm_by_std=False, baseline_cap=None)
    assert a_nostd.tolist() == pytest.approx([r - 2.25 for r in (1.0, 0.0, 1.0, 1.0)])


def test_advantage_omega_clip_applies():
    rewards = torch.tensor([1.0, 0.0, 1.0])
    index = ["g"] * 3
    source = [0, 0, 1]
    cap = torch.tensor([1.0, 1e-3])  # ratio 1000 → clamped to 10
    a = compute_hacpo_advantage(rewards, index, source, 0, cap, omega_clip=(0.1, 10.0), baseline_cap=None)
    mu = (1.0 + 0.0 + 10.0) / 3
    std = float(rewards.std())
    assert a.tolist() == pytest.approx([(r - mu) / (std + 1e-6) for r in rewards.tolist()])


def test_baseline_guard_hand_case():
    # spec §2: learner P̂ 0.6, peer P̂ 0.2 → ω^(k,peer) = 3; 7/8 own and 4/8 peer answers correct
    rewards = torch.tensor([1.0] * 7 + [0.0] + [1.0] * 4 + [0.0] * 4, dtype=F64)
    index = ["q"] * 16
    source = torch.tensor([0] * 8 + [1] * 8)
    cap = torch.tensor([0.6, 0.2], dtype=F64)
    std = float(rewards.std())  # 11 of 16 correct, unbiased: 0.4787
    assert std == pytest.approx(0.4787, abs=1e-4)
    # unguarded: μ̂ = (7 + 3·4) / 16 = 1.1875, every correct own answer gets A = −0.39
    mu, guarded = capability_baseline(rewards, index, source, 0, cap, baseline_cap=None)
    assert mu.tolist() == pytest.approx([19 / 16] * 16) and not guarded.any()
    paper = compute_hacpo_advantage(rewards, index, source, 0, cap, baseline_cap=None)
    assert float(paper[0]) == pytest.approx((1 - 19 / 16) / std, rel=1e-5)
    assert round(float(paper[0]), 2) == -0.39
    # guarded (default cap 1.0): μ̂ falls back to the learner's own mean 7/8, A(correct) = +0.26
    mu, guarded = capability_baseline(rewards, index, source, 0, cap)
    assert mu.tolist() == pytest.approx([7 / 8] * 16) and guarded.all()
    a = compute_hacpo_advantage(rewards, index, source, 0, cap)
    assert a.tolist() == pytest.approx([(r - 7 / 8) / (std + 1e-6) for r in rewards.tolist()], rel=1e-9)
    assert round(float(a[0]), 2) == 0.26
    # the weak peer as learner: ω^(1,0) = 1/3 → μ̂ = (7/3 + 4) / 16 ≈ 0.396, under the cap, untouched
    mu1, guarded1 = capability_baseline(rewards, index, source, 1, cap)
    assert mu1.tolist() == pytest.approx([(7 / 3 + 4) / 16] * 16) and not guarded1.any()
    # a cap above μ̂ leaves it alone; the plain-mean ablation is never guarded
    assert compute_hacpo_advantage(rewards, index, source, 0, cap, baseline_cap=1.2).tolist() == paper.tolist()
    _, plain_guarded = capability_baseline(rewards, index, source, 0, cap, use_capability_baseline=False)
    assert not plain_guarded.any()


def test_baseline_guard_acts_per_group():
    # group "a" trips the guard for learner 0, group "b" does not
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 0.0], dtype=F64)
    index = ["a", "a", "a", "a", "b", "b", "b", "b"]
    source = torch.tensor([0, 1, 0, 1, 0, 1, 0, 1])
    cap = torch.tensor([0.5, 0.1], dtype=F64)  # ω^(0,1) = 5
    mu, guarded = capability_baseline(rewards, index, source, 0, cap)
    # a: (1 + 5 + 1 + 0) / 4 = 1.75 > 1 → own mean (1 + 1) / 2 = 1; b: (0 + 5 + 0 + 0) / 4 = 1.25 > 1 → own 0
    assert guarded.tolist() == [True] * 8
    assert mu.tolist() == pytest.approx([1.0] * 4 + [0.0] * 4)
    cap = torch.tensor([0.5, 0.25], dtype=F64)  # ω = 2: a: (1 + 2 + 1) / 4 = 1.0 (not above), b: 0.5
    mu, guarded = capability_baseline(rewards, index, source, 0, cap)
    assert guarded.tolist() == [False] * 8
    assert mu.tolist() == pytest.approx([1.0] * 4 + [0.5] * 4)


def _verl_grpo(rewards: torch.Tensor, index: np.ndarray, norm: bool) -> torch.Tensor:
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    token_rewards = torch.zeros(len(rewards), 3, dtype=rewards.dtype)
    token_rewards[:, -1] = rewards
    mask = torch.ones(len(rewards), 3, dtype=rewards.dtype)
    adv, _ = compute_grpo_outcome_advantage(token_rewards, mask, index, norm_adv_by_std_in_grpo=norm)
    return adv[:, 0]


@settings(max_examples=40, deadline=None)
@given(
    rewards=st.lists(st.sampled_from([0.0, 1.0, 0.5, -1.0, 2.0]), min_size=1, max_size=24),
    groups=st.integers(min_value=1, max_value=6),
    norm=st.booleans(),
    cap=st.floats(min_value=1e-3, max_value=1.0),
)
def test_one_agent_advantage_equals_verl_grpo(rewards, groups, norm, cap):
    r = torch.tensor(rewards, dtype=torch.float32)
    index = np.array([f"u{i % groups}" for i in range(len(rewards))], dtype=object)
    source = torch.zeros(len(rewards), dtype=torch.long)
    ours = compute_hacpo_advantage(r, index, source, 0, torch.tensor([cap]), norm_by_std=norm)
    theirs = _verl_grpo(r, index, norm)
    # verl divides (0)/(0+ε) in uniform groups → 0, as ours does explicitly
    assert torch.allclose(ours, theirs, atol=1e-5), (ours, theirs)


@settings(max_examples=60, deadline=None)
@given(
    value=st.sampled_from([0.0, 1.0, 0.3]),
    size=st.integers(min_value=2, max_value=12),
    sources=st.lists(st.integers(0, 2), min_size=12, max_size=12),
    caps=st.lists(st.floats(min_value=1e-3, max_value=1.0), min_size=3, max_size=3),
    learner=st.integers(0, 2),
    baseline=st.booleans(),
    norm=st.booleans(),
)
def test_uniform_groups_get_zero_advantage(value, size, sources, caps, learner, baseline, norm):
    rewards = torch.full((size,), value)
    a = compute_hacpo_advantage(
        rewards, ["g"] * size, sources[:size], learner, torch.tensor(caps),
        use_capability_baseline=baseline, norm_by_std=norm,
    )
    assert torch.equal(a, torch.zeros(size))


# --------------------------------------------------------------------------- §2 with a row validity (§9)
def test_advantage_with_a_validity_mask_by_hand():
    # one group, learner 0 (P̂ 0.4) failed both; peer 1 (P̂ 0.1, ω^(0,1) = 4) rows [1, 0] selected,
    # peer 2 (P̂ 0.5) rows [1, 1] not selected: they must change neither μ̂ nor σ
    rewards = torch.tensor([0.0, 0.0, 1.0, 0.0, 1.0, 1.0], dtype=F64)
    index = ["q"] * 6
    source = torch.tensor([0, 0, 1, 1, 2, 2])
    cap = torch.tensor([0.4, 0.1, 0.5], dtype=F64)
    valid = torch.tensor([True, True, True, True, False, False])
    # V = own + peer 1: μ̂ = (0 + 0 + 4·1 + 4·0) / 4 = 1.0 (not above the cap 1.0);
    # σ = unbiased std of [0, 0, 1, 0] = 0.5
    mu, guarded = capability_baseline(rewards, index, source, 0, cap, valid=valid)
    assert mu.tolist() == pytest.approx([1.0] * 4 + [0.0] * 2) and not guarded.any()
    a = compute_hacpo_advantage(rewards, index, source, 0, cap, valid=valid)
    expected = [(r - 1.0) / (0.5 + 1e-6) for r in (0.0, 0.0, 1.0, 0.0)] + [0.0, 0.0]
    assert a.tolist() == pytest.approx(expected, rel=1e-12)
    # the same numbers as the batch without the excluded rows
    alone = compute_hacpo_advantage(rewards[:4], index[:4], source[:4], 0, cap)
    assert torch.equal(a[:4], alone)
    # whatever the excluded rows hold
    other = rewards.clone()
    other[4:] = torch.tensor([0.0, 7.0], dtype=F64)
    assert torch.equal(compute_hacpo_advantage(other, index, source, 0, cap, valid=valid), a)
    # plain mean (Naive) over V: 1/4, and the guard counts only valid groups
    plain = compute_hacpo_advantage(rewards, index, source, 0, cap, valid=valid, use_capability_baseline=False)
    assert plain.tolist() == pytest.approx([(r - 0.25) / (0.5 + 1e-6) for r in (0.0, 0.0, 1.0, 0.0)] + [0.0, 0.0])


def test_advantage_validity_mask_guard_and_rows_without_a_valid_peer():
    # group a: own [1, 1], peer (ω = 5) [1, 0] selected → μ̂ = (1 + 1 + 5) / 4 > 1 → own mean 1;
    # group b: own [0, 1], peer rows excluded → μ̂ over own rows only = 0.5, σ = std([0, 1])
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 1.0], dtype=F64)
    index = ["a"] * 4 + ["b"] * 4
    source = torch.tensor([0, 0, 1, 1] * 2)
    cap = torch.tensor([0.5, 0.1], dtype=F64)
    valid = torch.tensor([True] * 6 + [False] * 2)
    mu, guarded = capability_baseline(rewards, index, source, 0, cap, valid=valid)
    assert guarded.tolist() == [True] * 4 + [False] * 4
    assert mu.tolist() == pytest.approx([1.0] * 4 + [0.5] * 2 + [0.0] * 2)
    a = compute_hacpo_advantage(rewards, index, source, 0, cap, valid=valid)
    std_a, std_b = float(torch.tensor([1.0, 1, 1, 0], dtype=F64).std()), float(torch.tensor([0.0, 1], dtype=F64).std())
    expected = [(r - 1.0) / (std_a + 1e-6) for r in (1.0, 1.0, 1.0, 0.0)]
    expected += [(r - 0.5) / (std_b + 1e-6) for r in (0.0, 1.0)] + [0.0, 0.0]
    assert a.tolist() == pytest.approx(expected, rel=1e-12)
    with pytest.raises(ValueError, match="valid must be"):
        compute_hacpo_advantage(rewards, index, source, 0, cap, valid=valid[:5])


@settings(max_examples=60, deadline=None)
@given(
    rewards=st.lists(st.sampled_from([0.0, 1.0, 0.5]), min_size=1, max_size=18),
    groups=st.integers(min_value=1, max_value=4),
    sources=st.lists(st.integers(0, 2), min_size=18, max_size=18),
    caps=st.lists(st.floats(min_value=1e-3, max_value=1.0), min_size=3, max_size=3),
    keep=st.lists(st.booleans(), min_size=18, max_size=18),
    learner=st.integers(0, 2),
    baseline=st.booleans(),
    norm=st.booleans(),
    cap=st.sampled_from([None, 1.0]),
)
def test_validity_mask_is_the_batch_without_the_excluded_rows(
    rewards, groups, sources, caps, keep, learner, baseline, norm, cap
):
    b = len(rewards)
    r = torch.tensor(rewards, dtype=F64)
    index = np.array([f"u{i % groups}" for i in range(b)], dtype=object)
    source = torch.tensor(sources[:b])
    options = dict(use_capability_baseline=baseline, norm_by_std=norm, baseline_cap=cap)
    today = compute_hacpo_advantage(r, index, source, learner, torch.tensor(caps), **options)
    # every row valid: today's numbers exactly
    every = compute_hacpo_advantage(r, index, source, learner, torch.tensor(caps), valid=[True] * b, **options)
    assert torch.equal(every, today)
    # some rows excluded: 0 there, and elsewhere exactly the batch without them
    valid = torch.tensor(keep[:b])
    a = compute_hacpo_advantage(r, index, source, learner, torch.tensor(caps), valid=valid, **options)
    assert torch.equal(a[~valid], torch.zeros(int((~valid).sum()), dtype=F64))
    if valid.any():
        without = compute_hacpo_advantage(
            r[valid], index[valid.numpy()], source[valid], learner, torch.tensor(caps), **options
        )
        assert torch.equal(a[valid], without)


# --------------------------------------------------------------------------- §1 ω
@settings(max_examples=100, deadline=None)
@given(
    p=st.lists(st.floats(min_value=1e-3, max_value=1.0), min_size=2, max_size=4),
    k=st.integers(0, 3),
    j=st.integers(0, 3),
)
def test_omega_reciprocal_inside_clamp(p, k, j):
    k, j = k % len(p), j % len(p)
    cap = torch.tensor(p)
    w_kj, w_jk = capability_ratio(cap, k, j), capability_ratio(cap, j, k)
    raw = p[k] / p[j]
    if 0.1 <= raw <= 10.0:
        assert w_kj * w_jk == pytest.approx(1.0, rel=1e-9)
    assert 0.1 <= w_kj <= 10.0
    rows = capability_ratios(cap, torch.tensor([k, j]), torch.tensor([j, k]))
    assert rows.tolist() == pytest.approx([w_kj, w_jk])


@settings(max_examples=60, deadline=None)
@given(
    steps=st.lists(st.lists(st.floats(min_value=-1.0, max_value=1.0), min_size=2, max_size=2), min_size=1, max_size=12),
    window=st.integers(1, 6),
    floor=st.floats(min_value=1e-4, max_value=0.1),
)
def test_capability_is_floored_window_mean(steps, window, floor):
    t = CapabilityTracker(num_agents=2, window=window, floor=floor)
    for row in steps:
        t.update(row)
    tail = np.array(steps[-window:])
    expected = np.maximum(tail.mean(axis=0), floor)
    assert t.capabilities().numpy() == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert t.num_updates == min(window, len(steps))


# --------------------------------------------------------------------------- §5 bound
def test_lower_bound_values():
    assert cross_lower_bound(0) == pytest.approx(0.8)
    assert cross_lower_bound(1) == pytest.approx(0.825)
    assert cross_lower_bound(2, delta=0.1, delta_step=0.01) == pytest.approx(0.92)
    assert cross_lower_bound(100) == 1.0
    assert cross_lower_bound(7, cross_clip="fixed") == pytest.approx(0.8)
    with pytest.raises(ValueError, match="cross_clip"):
        cross_lower_bound(0, cross_clip="bogus")


@given(m=st.integers(0, 200), delta=st.floats(0.0, 0.9), step=st.floats(0.0, 0.1))
def test_lower_bound_rises_with_m(m, delta, step):
    assert cross_lower_bound(m + 1, delta, step) >= cross_lower_bound(m, delta, step)
    assert cross_lower_bound(m, delta, step) <= 1.0


# --------------------------------------------------------------------------- §4 weight
def test_exponential_weight_value_and_gradient():
    c = torch.tensor([0.9, 0.5], requires_grad=True)
    w = exponential_is_weight(c, alpha=2.0)
    assert w.tolist() == pytest.approx([0.9**3, 0.5**3])
    w.sum().backward()
    assert c.grad.tolist() == pytest.approx([0.9**2, 0.5**2])  # d/dc [c·sg(c)^α] = c^α
    assert exponential_is_weight(c, 0.0) is c


# --------------------------------------------------------------------------- §6 loss
def _batch(b=6, t=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    log_prob = (-torch.rand(b, t, generator=g, dtype=F64) * 2).requires_grad_(True)
    old = log_prob.detach() + 0.05 * torch.randn(b, t, generator=g, dtype=F64)
    adv = torch.randn(b, generator=g, dtype=F64).unsqueeze(-1).expand(b, t).clone()
    mask = torch.ones(b, t, dtype=F64)
    mask[1, 3:] = 0
    mask[4, 1:] = 0
    return log_prob, old, adv, mask


def _verl_gspo(log_prob, old, adv, mask, low, high):
    from verl.trainer.ppo.core_algos import compute_policy_loss_gspo
    from verl.workers.config import FSDPActorConfig

    cfg = FSDPActorConfig(
        strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1, rollout_n=1,
        clip_ratio_low=low, clip_ratio_high=high, loss_agg_mode="seq-mean-token-mean",
    )
    return compute_policy_loss_gspo(old, log_prob, adv, mask, "seq-mean-token-mean", cfg)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("clip", [(3e-4, 4e-4), (0.2, 0.28)])
def test_one_agent_loss_equals_verl_gspo_value_and_gradient(seed, clip):
    log_prob, old, adv, mask = _batch(seed=seed)
    b = log_prob.shape[0]
    ours, metrics = compute_hacpo_policy_loss(
        log_prob, old, adv, mask,
        is_cross=torch.zeros(b, dtype=torch.bool), omega=torch.ones(b),
        source_log_prob_mean=torch.zeros(b), update_index=0,
        clip_ratio_low=clip[0], clip_ratio_high=clip[1],
    )
    (g_ours,) = torch.autograd.grad(ours, log_prob)
    theirs, their_metrics = _verl_gspo(log_prob, old, adv, mask, *clip)
    (g_theirs,) = torch.autograd.grad(theirs, log_prob)
    assert torch.allclose(ours, theirs, atol=1e-10)
    assert torch.allclose(g_ours, g_theirs, atol=1e-10)
    assert metrics["actor/pg_clipfrac"] == pytest.approx(their_metrics["actor/pg_clipfrac"])
    assert metrics["hacpo/cross_frac"] == 0.0


@pytest.mark.parametrize("cross_clip", ["stepwise", "none", "gspo"])
def test_loss_ignores_rows_with_a_zeroed_response_mask(cross_clip):
    """share_selection=complementary: an unselected peer row (response_mask 0, advantage 0) is
    in neither the loss value, its gradient, its seq-mean row count nor the cross metrics."""
    log_prob, old, adv, mask = _batch(b=8, t=5, seed=4)
    is_cross = torch.tensor([False, False, True, True, True, True, False, True])
    excluded = torch.tensor([False, False, False, True, False, True, False, True])
    source_lp = (log_prob.detach() * mask).sum(-1) / mask.sum(-1) + 0.02 * torch.arange(8, dtype=F64)
    kwargs = dict(update_index=1, cross_clip=cross_clip, alpha=0.0 if cross_clip == "gspo" else 1.0)
    masked = mask * ~excluded.unsqueeze(-1)
    adv_masked = adv * ~excluded.unsqueeze(-1)
    ours, metrics = compute_hacpo_policy_loss(
        log_prob, old, adv_masked, masked, is_cross=is_cross, omega=torch.full((8,), 1.5),
        source_log_prob_mean=source_lp, **kwargs,
    )
    (g_ours,) = torch.autograd.grad(ours, log_prob)
    keep = ~excluded
    lp_kept = log_prob.detach()[keep].clone().requires_grad_(True)
    theirs, their_metrics = compute_hacpo_policy_loss(
        lp_kept, old[keep], adv[keep], mask[keep], is_cross=is_cross[keep], omega=torch.full((5,), 1.5),
        source_log_prob_mean=source_lp[keep], **kwargs,
    )
    (g_theirs,) = torch.autograd.grad(theirs, lp_kept)
    assert float(ours) == pytest.approx(float(theirs), abs=1e-14)
    assert torch.allclose(g_ours[keep], g_theirs, atol=1e-14)
    assert not g_ours[excluded].any()
    for key in ("hacpo/cross_frac", "hacpo/cross_ratio_mean", "hacpo/cross_ratio_min", "hacpo/cross_ratio_max",
                "hacpo/cross_clipfrac_low", "hacpo/cross_clipfrac_high", "actor/pg_clipfrac"):
        assert metrics[key] == pytest.approx(their_metrics[key]), key
    assert metrics["hacpo/cross_frac"] == pytest.approx(2 / 5)


def test_cross_row_value_and_gradient_by_hand():
    # two rows: row 0 own (A = 0 → no contribution), row 1 cross with 2 tokens
    log_prob = torch.tensor([[-1.0, -1.0], [-0.5, -0.7]], dtype=F64, requires_grad=True)
    old = torch.tensor([[-1.0, -1.0], [-9.0, -9.0]], dtype=F64)  # ignored on the cross row
    adv = torch.tensor([[0.0, 0.0], [1.5, 1.5]], dtype=F64)
    mask = torch.ones(2, 2, dtype=F64)
    src_mean = torch.tensor([0.0, -0.55], dtype=F64)
    # s_1 = exp(mean(-0.5, -0.7) - (-0.55)) = exp(-0.05) ≈ 0.9512, inside [0.8, 1]
    s = math.exp(-0.05)
    alpha, omega = 2.0, 3.0
    loss, m = compute_hacpo_policy_loss(
        log_prob, old, adv, mask,
        is_cross=torch.tensor([False, True]), omega=torch.tensor([1.0, omega]),
        source_log_prob_mean=src_mean, update_index=0, alpha=alpha,
    )
    # ℓ_1 = −c·c^α·ω·A, mean over 2 rows
    assert float(loss.detach()) == pytest.approx(-(s ** (1 + alpha)) * omega * 1.5 / 2, rel=1e-7)
    (g,) = torch.autograd.grad(loss, log_prob)
    # ∂ℓ_1/∂log π_t = −c^α·ω·A·s/|y| ; /2 rows
    expected = -(s**alpha) * omega * 1.5 * s / 2 / 2
    assert g[1].tolist() == pytest.approx([expected, expected], rel=1e-7)
    assert g[0].tolist() == [0.0, 0.0]
    assert m["hacpo/cross_ratio_mean"] == pytest.approx(s)
    assert m["hacpo/cross_frac"] == 0.5
    assert m["hacpo/lower_bound"] == pytest.approx(0.8)


def test_cross_ratio_length_each_and_source_by_hand():
    # one cross row, the same text tokenised twice: the learner's 3 tokens sum to −1.8
    # (mean −0.6); the source's 2 tokens had mean old log-prob −0.85 (sum −1.7)
    log_prob = torch.tensor([[-0.5, -0.6, -0.7]], dtype=F64, requires_grad=True)
    old = torch.zeros(1, 3, dtype=F64)  # ignored on cross rows
    adv = torch.full((1, 3), 1.0, dtype=F64)
    mask = torch.ones(1, 3, dtype=F64)
    common = dict(
        is_cross=torch.tensor([True]), omega=torch.tensor([1.0]), source_log_prob_mean=torch.tensor([-0.85]),
        source_response_length=torch.tensor([2.0]), update_index=0, alpha=0.0, cross_clip="none",
    )
    # each: log s = −0.6 − (−0.85) = 0.25; ℓ = −s; dℓ/dlog π_t = −s / |y_k| = −s / 3
    each, m_each = compute_hacpo_policy_loss(log_prob, old, adv, mask, cross_ratio_length="each", **common)
    (g_each,) = torch.autograd.grad(each, log_prob)
    assert m_each["hacpo/cross_ratio_mean"] == pytest.approx(math.exp(0.25))
    assert float(each) == pytest.approx(-math.exp(0.25))
    assert g_each[0].tolist() == pytest.approx([-math.exp(0.25) / 3] * 3)
    # source: log s = (−1.8 − (−1.7)) / 2 = −0.05; dℓ/dlog π_t = −s / |y_j| = −s / 2
    src, m_src = compute_hacpo_policy_loss(log_prob, old, adv, mask, cross_ratio_length="source", **common)
    (g_src,) = torch.autograd.grad(src, log_prob)
    assert m_src["hacpo/cross_ratio_mean"] == pytest.approx(math.exp(-0.05))
    assert float(src) == pytest.approx(-math.exp(-0.05))
    assert g_src[0].tolist() == pytest.approx([-math.exp(-0.05) / 2] * 3)
    # spec §4's example: the same text probability L = −150 over 300 vs 270 tokens
    lp = torch.full((1, 300), -0.5, dtype=F64)
    kw = dict(
        is_cross=torch.tensor([True]), omega=torch.tensor([1.0]), source_log_prob_mean=torch.tensor([-150 / 270], dtype=F64),
        source_response_length=torch.tensor([270.0]), update_index=0,
    )
    ones = torch.ones(1, 300, dtype=F64)
    _, m = compute_hacpo_policy_loss(lp, lp, ones, ones, cross_ratio_length="each", **kw)
    assert m["hacpo/cross_ratio_mean"] == pytest.approx(math.exp(-0.5 + 150 / 270))  # ≈ 1.057, clipped high
    assert m["hacpo/cross_clipfrac_high"] == 1.0
    _, m = compute_hacpo_policy_loss(lp, lp, ones, ones, cross_ratio_length="source", **kw)
    assert m["hacpo/cross_ratio_mean"] == pytest.approx(1.0, abs=1e-12)  # equal probability, s = 1


def test_cross_ratio_length_source_leaves_own_rows_and_needs_lengths():
    log_prob, old, adv, mask = _batch(seed=3)
    b = log_prob.shape[0]
    kw = dict(is_cross=torch.zeros(b, dtype=torch.bool), omega=torch.ones(b), source_log_prob_mean=torch.zeros(b), update_index=0)
    each, _ = compute_hacpo_policy_loss(log_prob, old, adv, mask, **kw)
    src, _ = compute_hacpo_policy_loss(
        log_prob, old, adv, mask, cross_ratio_length="source", source_response_length=torch.full((b,), 7.0), **kw
    )
    (g_each,) = torch.autograd.grad(each, log_prob)
    (g_src,) = torch.autograd.grad(src, log_prob)
    assert torch.equal(each, src) and torch.equal(g_each, g_src)
    with pytest.raises(ValueError, match="needs source_response_length"):
        compute_hacpo_policy_loss(log_prob, old, adv, mask, cross_ratio_length="source", **kw)
    with pytest.raises(ValueError, match="cross_ratio_length must be one of"):
        compute_hacpo_policy_loss(log_prob, old, adv, mask, cross_ratio_length="learner", **kw)


def test_cross_clipping_by_hand_low_high_and_stepwise():
    log_prob = torch.tensor([[-1.0], [-1.0], [-1.0]], dtype=F64, requires_grad=True)
    mask = torch.ones(3, 1, dtype=F64)
    adv = torch.ones(3, 1, dtype=F64)
    # ratios exp(-1 - src): 0.85, 1.2, 0.5
    src = torch.tensor([-1 - math.log(0.85), -1 - math.log(1.2), -1 - math.log(0.5)], dtype=F64)
    kw = dict(is_cross=torch.ones(3, dtype=torch.bool), omega=torch.ones(3), source_log_prob_mean=src, alpha=0.0)
    loss, m = compute_hacpo_policy_loss(log_prob, log_prob.detach(), adv, mask, update_index=0, **kw)
    assert float(loss.detach()) == pytest.approx(-(0.85 + 1.0 + 0.8) / 3)
    (g,) = torch.autograd.grad(loss, log_prob)
    assert g[:, 0].tolist() == pytest.approx([-0.85 / 3, 0.0, 0.0])
    assert m["hacpo/cross_clipfrac_low"] == pytest.approx(1 / 3)
    assert m["hacpo/cross_clipfrac_high"] == pytest.approx(1 / 3)
    # m = 3 → lower 0.875: the 0.85 row is now clipped too and carries no gradient
    loss3, m3 = compute_hacpo_policy_loss(log_prob, log_prob.detach(), adv, mask, update_index=3, **kw)
    (g3,) = torch.autograd.grad(loss3, log_prob)
    assert g3.abs().sum() == 0
    assert m3["hacpo/lower_bound"] == pytest.approx(0.875)
    # "none": no clip at all, every row carries gradient s/|y|
    loss_n, _ = compute_hacpo_policy_loss(
        log_prob, log_prob.detach(), adv, mask, update_index=0, cross_clip="none", **kw
    )
    (gn,) = torch.autograd.grad(loss_n, log_prob)
    assert gn[:, 0].tolist() == pytest.approx([-0.85 / 3, -1.2 / 3, -0.5 / 3])


def test_naive_gspo_mode_treats_cross_like_own_against_source():
    log_prob, old, adv, mask = _batch(seed=3)
    b = log_prob.shape[0]
    src_mean = (old * mask).sum(-1) / mask.sum(-1)
    own, _ = compute_hacpo_policy_loss(
        log_prob, old, adv, mask, is_cross=torch.zeros(b, dtype=torch.bool), omega=torch.ones(b),
        source_log_prob_mean=src_mean, update_index=0,
    )
    naive, _ = compute_hacpo_policy_loss(
        log_prob, torch.zeros_like(old), adv, mask, is_cross=torch.ones(b, dtype=torch.bool),
        omega=torch.full((b,), 5.0), source_log_prob_mean=src_mean, update_index=4, alpha=3.0,
        cross_clip="gspo",
    )
    assert torch.allclose(own, naive, atol=1e-12)


@settings(max_examples=60, deadline=None)
@given(
    log_ratios=st.lists(st.floats(min_value=-1.0, max_value=0.5), min_size=1, max_size=8),
    m=st.integers(0, 12),
    alpha=st.sampled_from([0.0, 1.0, 3.0]),
    mode=st.sampled_from(["stepwise", "fixed"]),
)
def test_no_gradient_from_cross_rows_outside_bounds(log_ratios, m, alpha, mode):
    b = len(log_ratios)
    log_prob = torch.full((b, 3), -1.0, dtype=F64, requires_grad=True)
    src = torch.tensor([-1.0 - r for r in log_ratios], dtype=F64)
    loss, _ = compute_hacpo_policy_loss(
        log_prob, log_prob.detach(), torch.ones(b, 3), torch.ones(b, 3),
        is_cross=torch.ones(b, dtype=torch.bool), omega=torch.ones(b), source_log_prob_mean=src,
        update_index=m, alpha=alpha, cross_clip=mode,
    )
    (g,) = torch.autograd.grad(loss, log_prob)
    lower = cross_lower_bound(m, cross_clip=mode)
    for i, r in enumerate(log_ratios):
        s = math.exp(r)
        # strictly outside (a hair of slack for the float boundary)
        if s < lower - 1e-9 or s > 1.0 + 1e-9:
            assert g[i].abs().sum() == 0, (i, s, lower)
        elif lower + 1e-9 < s < 1.0 - 1e-9:
            assert g[i].abs().sum() > 0


def test_loss_rejects_unknown_mode_and_bad_shapes():
    log_prob, old, adv, mask = _batch()
    b = log_prob.shape[0]
    kw = dict(is_cross=torch.zeros(b, dtype=torch.bool), omega=torch.ones(b), source_log_prob_mean=torch.zeros(b))
    with pytest.raises(ValueError, match="cross_clip"):
        compute_hacpo_policy_loss(log_prob, old, adv, mask, update_index=0, cross_clip="x", **kw)
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        compute_hacpo_policy_loss(log_prob, old[:, :2], adv, mask, update_index=0, **kw)


def test_row_clipped_names_the_rows_whose_gradient_the_clip_takes_away():
    """Hand numbers: GSPO's clip on own rows (by the advantage's sign), [lower_m, 1] on cross rows."""
    ratio = torch.tensor([1.5, 1.5, 0.5, 0.5, 0.85, 0.7, 1.2, 0.9])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 1.0, 1.0, -1.0, 1.0])
    cross = torch.tensor([False, False, False, False, True, True, True, True])
    kwargs = dict(lower=0.8, clip_ratio_low=0.2, clip_ratio_high=0.28)
    assert row_clipped(ratio, adv, cross, cross_clip="stepwise", **kwargs).tolist() == [
        True, False, False, True, False, True, True, False]
    assert row_clipped(ratio, adv, cross, cross_clip="none", **kwargs).tolist() == [
        True, False, False, True, False, False, False, False]
    # Naive: every row is a GSPO row
    assert row_clipped(ratio, adv, cross, cross_clip="gspo", **kwargs).tolist() == [
        True, False, False, True, False, False, False, False]


def test_the_per_row_ratios_are_the_ones_the_loss_metrics_summarise():
    log_prob = torch.tensor([[-1.0, -2.0], [-0.5, -0.5], [-3.0, -1.0]])
    old = torch.tensor([[-1.1, -2.1], [0.0, 0.0], [0.0, 0.0]])
    mask = torch.ones_like(log_prob)
    rows: dict = {}
    _, metrics = hacpo_policy_loss_matrix(
        log_prob, old, torch.tensor([1.0, 1.0, -1.0]), mask, is_cross=torch.tensor([False, True, True]),
        omega=torch.ones(3), source_log_prob_mean=torch.tensor([0.0, -0.4, -1.5]), update_index=0, rows=rows)
    expected = [math.exp(0.1), math.exp(-0.1), math.exp(-0.5)]
    assert rows["ratio"].tolist() == pytest.approx(expected, rel=1e-6)
    assert metrics["hacpo/cross_ratio_min"] == pytest.approx(min(expected[1:]), rel=1e-6)
    # own row: A > 0 and s = e^0.1 > 1 + 4e-4 (GSPO's tiny window); cross rows: 0.905 in [0.8, 1], 0.61 below
    assert rows["clipped"].tolist() == [True, False, True]
