"""Paired-by-seed comparisons: differences, the regime test and the recovered fraction.

Every comparison pairs runs of the same seed (same data order, same rollout sampling seed, same
warm start), so the seed-to-seed spread of the starting conditions cancels in the difference.

Recovered fraction of an arm X (per agent), over the seeds S that ran X, GSPO and GSPO×2:

    R(X) = mean_s (acc_X,s − acc_GSPO,s) / mean_s (acc_GSPO×2,s − acc_GSPO,s)

(a ratio of means: a per-seed ratio explodes when one seed's GSPO×2 gain is near zero).
R = 1: X buys what doubling the rollouts buys; R = 0: nothing over GSPO at G. Its 90 % interval
is the 5th–95th percentile of R over bootstrap resamples of the seeds (with replacement, paired:
a resampled seed brings its three runs along).
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass

BOOTSTRAP_SAMPLES = 10_000
BOOTSTRAP_SEED = 0  # fixed, so a report rebuilt from the same runs prints the same interval


@dataclass(frozen=True)
class Paired:
    """Paired differences (arm − reference) over seeds, in accuracy units (0..1)."""

    seeds: tuple[int, ...]
    diffs: tuple[float, ...]

    @property
    def mean(self) -> float:
        return statistics.fmean(self.diffs) if self.diffs else float("nan")

    @property
    def std(self) -> float:
        return statistics.stdev(self.diffs) if len(self.diffs) > 1 else float("nan")

    def standard_errors(self) -> float:
        """mean / (std / √n): how many standard errors of the mean difference it lies above 0."""
        s = self.sigmas()
        return s * len(self.diffs) ** 0.5 if s == s else s

    def sigmas(self) -> float:
        """mean / std of the paired difference (inf when every seed moved by the same amount)."""
        if len(self.diffs) < 2:
            return float("nan")
        if self.std == 0.0:
            return float("inf") if self.mean > 0 else float("-inf") if self.mean < 0 else float("nan")
        return self.mean / self.std


def paired(arm: dict[int, float], reference: dict[int, float]) -> Paired:
    """arm − reference for every seed present in both (dicts seed -> accuracy; None entries skipped)."""
    seeds = tuple(sorted(s for s in arm if s in reference and arm[s] is not None and reference[s] is not None))
    return Paired(seeds, tuple(arm[s] - reference[s] for s in seeds))


@dataclass(frozen=True)
class Recovered:
    value: float  # R over all seeds
    low: float  # 5th percentile of the bootstrap
    high: float  # 95th percentile
    seeds: tuple[int, ...]
    undefined: float  # share of resamples whose GSPO×2 − GSPO gain was ≤ 0 (R meaningless there)


def _ratio(num: list[float], den: list[float]) -> float | None:
    d = statistics.fmean(den)
    return None if d <= 0 else statistics.fmean(num) / d


def recovered_fraction(arm: dict[int, float], gspo: dict[int, float], gspo2x: dict[int, float],
                       samples: int = BOOTSTRAP_SAMPLES, seed: int = BOOTSTRAP_SEED) -> Recovered | None:
    """R(arm) with its bootstrap 90 % interval, or None when fewer than two seeds have all three runs
    or the GSPO×2 gain over the seeds is not positive."""
    seeds = tuple(sorted(s for s in arm if s in gspo and s in gspo2x
                         and None not in (arm[s], gspo[s], gspo2x[s])))
    if len(seeds) < 2:
        return None
    gain = [arm[s] - gspo[s] for s in seeds]
    doubled = [gspo2x[s] - gspo[s] for s in seeds]
    value = _ratio(gain, doubled)
    if value is None:
        return None
    rng = random.Random(seed)
    ratios, undefined = [], 0
    idx = range(len(seeds))
    for _ in range(samples):
        pick = [rng.choice(idx) for _ in idx]
        r = _ratio([gain[i] for i in pick], [doubled[i] for i in pick])
        if r is None:
            undefined += 1
        else:
            ratios.append(r)
    ratios.sort()
    if not ratios:
        return None
    low = ratios[int(0.05 * (len(ratios) - 1))]
    high = ratios[int(0.95 * (len(ratios) - 1))]
    return Recovered(value, low, high, seeds, undefined / samples)


def regime_holds(diff: Paired, sigmas: float = 3.0) -> bool:
    """The issue's test of a regime where rollouts matter: GSPO×2 − GSPO ≥ `sigmas` × its std over seeds."""
    return len(diff.diffs) >= 2 and diff.mean > 0 and diff.sigmas() >= sigmas
