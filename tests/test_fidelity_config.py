"""The `algorithm.hacpo` keys that make the recipe run HACPO as the paper's authors ran it
(docs/ALGORITHM.md §2 baseline guard, §4 cross-ratio length): defaults, null, and rejected values."""

from __future__ import annotations

import pytest

from recipe_hacpo.config import ConfigError, HacpoSettings, hacpo_settings, validate
from recipe_hacpo.methods import checked_settings, loss_settings, method_for
from helpers.compose import compose_config as _compose




GPUS_8 = ["++ray_kwargs.ray_init.num_gpus=8"]
PRESET = "pair_qwen3-1p7b-base_qwen3-4b-base"


def test_baseline_cap_default_null_and_value():
    assert HacpoSettings().baseline_cap == 1.0
    assert hacpo_settings(_compose(PRESET, GPUS_8)).baseline_cap == 1.0
    assert hacpo_settings(_compose(PRESET, GPUS_8 + ["algorithm.hacpo.baseline_cap=null"])).baseline_cap is None
    assert hacpo_settings(_compose(PRESET, GPUS_8 + ["algorithm.hacpo.baseline_cap=2"])).baseline_cap == 2.0
    # the Naive baseline keeps the key (it never trips: its baseline is the plain mean)
    assert method_for("naive").effective(HacpoSettings(mode="naive", baseline_cap=None)).baseline_cap is None


def test_cross_ratio_length_reaches_the_loss():
    assert HacpoSettings().cross_ratio_length == "each"
    cfg = _compose(PRESET, GPUS_8 + ["algorithm.hacpo.cross_ratio_length=source"])
    _, hacpo = validate(cfg, check_paths=False)
    assert hacpo.loss_kwargs()["cross_ratio_length"] == "source"
    # what an actor worker rebuilds from what the driver ships
    assert checked_settings(loss_settings(hacpo)).cross_ratio_length == "source"


@pytest.mark.parametrize(
    "extra, message",
    [
        (["algorithm.hacpo.baseline_cap=abc"], r"algorithm\.hacpo\.baseline_cap='abc': must be a number"),
        (["algorithm.hacpo.baseline_cap=inf"], r"algorithm\.hacpo\.baseline_cap=inf: must be a finite number"),
        (["algorithm.hacpo.cross_ratio_length=learner"], r"algorithm\.hacpo\.cross_ratio_length='learner': must be one of each, source"),
    ],
)
def test_bad_hacpo_keys_fail_with_one_line(extra, message):
    cfg = _compose(PRESET, GPUS_8 + extra)
    with pytest.raises(ConfigError, match=message) as err:
        validate(cfg, check_paths=False)
    assert "\n" not in str(err.value)
