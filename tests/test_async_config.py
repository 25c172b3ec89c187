"""`trainer.async` and `trainer.device_pad_s` are checked before Ray starts: what asynchronous
agents cannot help with, or cannot run yet, is refused in one line naming the key."""

from __future__ import annotations

import pytest
from helpers.compose import compose_config

from recipe_hacpo.config import ConfigError, validate
from recipe_hacpo.training.async_trainer import AsyncSettings, validate_async

ASYNC = ["trainer.async.enable=true"]


def _check(demo_overrides, extra: list[str]) -> AsyncSettings:
    cfg = compose_config("hacpo_cpu_demo", demo_overrides + extra)
    specs, hacpo = validate(cfg)
    return validate_async(cfg, specs, hacpo)


def test_the_defaults_are_lockstep_and_an_enabled_run_reads_its_keys(demo_overrides):
    assert _check(demo_overrides, []) == AsyncSettings()
    s = _check(demo_overrides, ASYNC + ["trainer.async.clock=virtual", "+trainer.async.virtual_step_s.llama_pair=3",
                                        "trainer.async.stop=slowest", "trainer.async.max_source_lag=1"])
    assert (s.enable, s.clock, s.stop, s.max_source_lag) == (True, "virtual", "slowest", 1)
    assert s.virtual_cost("llama_pair", "update_actor") == pytest.approx(3 * s.virtual_cost("qwen_char", "update_actor"))


@pytest.mark.parametrize("overrides, message", [
    (["agents.qwen_char.n_gpus_per_node=0", "agents.llama_pair.n_gpus_per_node=0", "trainer.n_gpus_per_node=1"],
     "trainer.async.enable: every agent is on the shared pool"),
    (["agents.qwen_char.n_gpus_per_node=0", "trainer.n_gpus_per_node=1"],
     "trainer.async.enable: agent qwen_char is on the shared pool"),
    (["algorithm.hacpo.share_selection=complementary"], "share_selection=complementary does not run asynchronously yet"),
    (["trainer.rollout_data_dir=/tmp/rows"], "trainer.rollout_data_dir: not available with trainer.async.enable=true"),
    (["trainer.async.clock=sundial"], "trainer.async.clock: 'sundial' is not one of"),
    (["trainer.async.stop=never"], "trainer.async.stop: 'never' is not one of"),
    (["trainer.async.max_source_lag=-1"], "trainer.async.max_source_lag: must be >= 0"),
    (["trainer.async.prompt_window=0"], "trainer.async.prompt_window: must be >= 1"),
    (["+trainer.async.virtual_step_s.nobody=2"], "trainer.async.virtual_step_s.nobody: no such agent"),
    (["+trainer.async.virtual_step_s.qwen_char=0"], "trainer.async.virtual_step_s.qwen_char: must be a positive"),
    (["+trainer.async.speed=2"], "trainer.async.speed: unknown key"),
])
def test_what_it_cannot_run_is_refused_in_one_line(demo_overrides, overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(".", r"\.")) as err:
        _check(demo_overrides, ASYNC + overrides)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("overrides, message", [
    (["+trainer.device_pad_s.nobody.gen=1"], "trainer.device_pad_s.nobody: no such agent"),
    (["+trainer.device_pad_s.qwen_char.think=1"], "trainer.device_pad_s.qwen_char.think: not a device phase"),
    (["+trainer.device_pad_s.qwen_char.gen=-1"], "trainer.device_pad_s.qwen_char.gen: must be seconds >= 0"),
])
def test_device_pads_are_checked_in_either_trainer(demo_overrides, overrides, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        _check(demo_overrides, overrides)
