"""The benchmark's statistics and report, on hand-made run summaries (no trainer run): paired
differences, the regime test, the recovered fraction with its bootstrap interval, and the
report's tables and per-step sharing diagnostics."""

from __future__ import annotations

import math
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "benchmarks"))

from mini import report  # noqa: E402
from mini.agents import AGENTS, PAIRS  # noqa: E402
from mini.runs import Setup, diagnostics  # noqa: E402
from mini.stats import paired, recovered_fraction, regime_holds  # noqa: E402


def test_paired_difference_uses_common_seeds_only():
    d = paired({0: 0.50, 1: 0.60, 2: 0.70, 3: None}, {0: 0.40, 1: 0.45, 3: 0.1})
    assert d.seeds == (0, 1)
    assert d.diffs == pytest.approx((0.10, 0.15))
    assert d.mean == pytest.approx(0.125)
    assert d.std == pytest.approx(math.sqrt(((0.025) ** 2 * 2) / 1))
    assert d.sigmas() == pytest.approx(0.125 / d.std)


def test_regime_needs_three_standard_deviations():
    # gains 4, 5, 6 points: mean 5, std 1 -> 5 sigma
    assert regime_holds(paired({0: 0.54, 1: 0.55, 2: 0.56}, {0: 0.5, 1: 0.5, 2: 0.5}))
    # gains 1, 5, 9 points: mean 5, std 4 -> 1.25 sigma
    assert not regime_holds(paired({0: 0.51, 1: 0.55, 2: 0.59}, {0: 0.5, 1: 0.5, 2: 0.5}))
    # a single seed has no spread to compare against
    assert not regime_holds(paired({0: 0.9}, {0: 0.5}))
    # a consistent loss is not a regime where doubling helps
    assert not regime_holds(paired({0: 0.44, 1: 0.45, 2: 0.46}, {0: 0.5, 1: 0.5, 2: 0.5}))


def test_recovered_fraction_is_a_ratio_of_seed_means():
    gspo = {0: 0.50, 1: 0.50, 2: 0.50}
    gspo2x = {0: 0.54, 1: 0.56, 2: 0.58}  # gains 4, 6, 8 -> mean 6
    arm = {0: 0.53, 1: 0.53, 2: 0.53}  # gains 3, 3, 3 -> mean 3
    r = recovered_fraction(arm, gspo, gspo2x, samples=2000)
    assert r.value == pytest.approx(0.5)
    assert r.seeds == (0, 1, 2)
    # the resampled ratios lie between 3/8 and 3/4 (one seed's gain repeated three times), and the
    # interval brackets the point estimate
    assert 3 / 8 - 1e-9 <= r.low <= r.value <= r.high <= 3 / 4 + 1e-9
    assert r.low < r.high
    assert r.undefined == 0.0
    # fixed bootstrap seed: the same runs give the same interval
    assert recovered_fraction(arm, gspo, gspo2x, samples=2000) == r


def test_recovered_fraction_undefined_without_a_gain_or_seeds():
    assert recovered_fraction({0: 0.6, 1: 0.6}, {0: 0.5, 1: 0.5}, {0: 0.5, 1: 0.49}) is None  # no gain to recover
    assert recovered_fraction({0: 0.6}, {0: 0.5}, {0: 0.55}) is None  # one seed
    # one seed where doubling lost: some resamples have no gain; their share is reported
    r = recovered_fraction({0: 0.55, 1: 0.55}, {0: 0.5, 1: 0.5}, {0: 0.6, 1: 0.48}, samples=4000)
    assert r.value == pytest.approx(0.05 / 0.04)
    assert 0.2 < r.undefined < 0.3  # both picks of seed 1: probability 1/4


def _run(arm: str, seed: int, acc: dict[str, float], diag: dict | None = None, steps: int = 4) -> dict:
    names = list(acc)
    return {
        "arm": arm, "seed": seed, "pair": "model", "names": names, "steps": steps,
        "train_reward": {n: [0.2] * steps for n in names},
        "val": {n: {str(steps): acc[n]} for n in names},
        "final_acc": acc, "rollout_tokens": {n: 100.0 for n in names}, "timing": {}, "wall_s": 10.0,
        "diagnostics": diag or {n: {} for n in names},
    }


def test_report_has_regime_recovered_fraction_and_diagnostics(tmp_path):
    names = [AGENTS[k].name for k in PAIRS["model"]]
    q, l = names
    steps = {1: {f"agent/{q}/omega/{l}": 0.5, f"agent/{q}/hacpo/cross_clipfrac_low": 0.6,
                 f"agent/{q}/hacpo/cross_clipfrac_high": 0.1, f"agent/{q}/reward/mean": 0.3,
                 f"agent/{l}/hacpo/cross_clipfrac_low": 0.2, f"agent/{l}/hacpo/cross_clipfrac_high": 0.2},
             2: {f"agent/{q}/omega/{l}": 0.7, f"agent/{q}/hacpo/cross_clipfrac_low": 0.4,
                 f"agent/{q}/hacpo/cross_clipfrac_high": 0.1,
                 f"agent/{l}/hacpo/cross_clipfrac_low": 0.2, f"agent/{l}/hacpo/cross_clipfrac_high": 0.2}}
    diag = diagnostics(steps, names)
    assert diag[q]["omega/" + l] == [0.5, 0.7]
    assert "reward/mean" not in diag[q]
    runs = []
    for seed, (g, g2, h) in enumerate([(0.50, 0.54, 0.53), (0.50, 0.56, 0.53), (0.50, 0.58, 0.53)]):
        runs += [_run("gspo", seed, {q: g, l: 0.2}), _run("gspo2x", seed, {q: g2, l: 0.2 + 0.01 * (seed + 1)}),
                 _run("hacpo", seed, {q: h, l: 0.2}, diag)]
    agents = {k: {"agent": AGENTS[k], "record": {"params": 1, "steps": 1, "seed": 0, "held_out_accuracy": 0.5}}
              for k in PAIRS["model"]}
    path = tmp_path / "report.md"
    report.write_report(str(path), runs, agents, Setup(4, 16, 2, 1e-4, 1.0, 4, 64, 64, 2), "cmd", [0, 1, 2],
                        [], 0.0, "model", reading="Sharing helped here.")
    text = path.read_text()
    # regime: qwen gains 4, 6, 8 (3 sigma), llama gains 1, 2, 3 (2 sigma)
    assert f"| {q} | 50.0 ± 0.0 | 56.0 ± 2.0 | +6.0 ± 2.0 (n=3) | s0 +4.0, s1 +6.0, s2 +8.0 | 3.0 | yes |" in text
    assert f"| {l} | 20.0 ± 0.0 | 22.0 ± 1.0 | +2.0 ± 1.0 (n=3) | s0 +1.0, s1 +2.0, s2 +3.0 | 2.0 | no |" in text
    assert "does **not** clear the bar" in text
    hacpo_row = next(line for line in text.splitlines() if line.startswith("| HACPO (G each) | 0,1,2 |"))
    assert "+3.0 ± 0.0 (n=3)" in hacpo_row and "0.50 [" in hacpo_row
    # diagnostics: ω mean 0.6; qwen's cross rows carried gradient 1 - 0.5 - 0.1 = 40 %, llama's 60 %
    assert f"| HACPO (G each) | {q} | — | 0.600 | — | 0.500 | 0.100 | — | — | 40% | 40% |" in text
    assert f"| HACPO (G each) | {l} | — | — | — | 0.200 | 0.200 | — | — | 60% | 60% |" in text
    assert "## Reading\n\nSharing helped here." in text


def test_every_arm_updates_on_the_same_number_of_rows():
    from mini.arms import ALL_ARMS
    from mini.runs import mini_batch_prompts

    setup = Setup(40, 32, 2, 1e-4, 1.0, 20, 64, 512, 4)
    prompts = {k: mini_batch_prompts(ALL_ARMS[k], setup, 2) for k in ("gspo", "gspo2x", "naive", "hacpo")}
    # 32 rows an update: GSPO 16 prompts × 2 (2 updates), GSPO×2 8 × 4, sharing 8 × (2 own + 2 cross) (4 updates)
    assert prompts == {"gspo": 16, "gspo2x": 8, "naive": 8, "hacpo": 8}
    one = Setup(40, 32, 2, 1e-4, 1.0, 20, 64, 512, 1)
    # one sharing update a step would need GSPO to update on two steps' prompts: capped at one update a step
    assert mini_batch_prompts(ALL_ARMS["gspo"], one, 2) == 32
