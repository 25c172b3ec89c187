"""Exact-match reward for `hacpo/arith/*`, used by the benchmark only when the package's
`recipe_hacpo.reward.math_reward` is not importable: the last integer of the response must equal
the ground-truth string exactly (so `579` does not match `0579`)."""

from __future__ import annotations

import re

_INT = re.compile(r"-?\d+")


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    found = _INT.findall(solution_str or "")
    if not found:
        return 0.0
    return 1.0 if found[-1] == str(ground_truth).strip() else 0.0
