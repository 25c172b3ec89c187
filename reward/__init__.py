"""Verifiable math reward in verl custom-reward-function form."""

from recipe_hacpo.reward.math_reward import compute_score

__all__ = ["compute_score"]
