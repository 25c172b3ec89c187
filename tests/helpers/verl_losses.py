"""verl's own policy losses, called as verl calls them, for equivalence tests."""

from __future__ import annotations


def verl_vanilla_loss(log_prob, old, adv, mask, low, high):
    from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla
    from verl.workers.config import FSDPActorConfig

    cfg = FSDPActorConfig(
        strategy="fsdp", ppo_mini_batch_size=4, ppo_micro_batch_size_per_gpu=1, rollout_n=1,
        clip_ratio_low=low, clip_ratio_high=high, loss_agg_mode="token-mean",
    )
    return compute_policy_loss_vanilla(old, log_prob, adv, mask, "token-mean", cfg), cfg.clip_ratio_c
