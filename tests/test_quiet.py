"""Quiet by default: known third-party messages are dropped in every process that imports verl
(the plugin installs the filters), HACPO_VERBOSE=1 / trainer.verbose=true bring them back, and
the console shows one short line per agent instead of the full metrics line."""

from __future__ import annotations

import os
import subprocess
import sys

from omegaconf import OmegaConf

from recipe_hacpo.training.run_metrics import backends as logger_backends
from recipe_hacpo.training.trainer import summary_lines

# A fresh interpreter, as a Ray worker is: `import verl` loads the plugin, then the two verl
# code paths that emit the known messages run.
PROBE = r"""
import logging, sys
logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
import verl
import verl.workers.engine
from verl.utils.tokenizer.continuous_token_wiring import infer_continuous_token_model_family
for _ in range(3):
    infer_continuous_token_model_family(hf_model_type="tiny-unknown-type")
import warnings
warnings.warn("an unrelated warning stays visible")
from transformers.utils import logging as hf_logging
print("hf progress bars", hf_logging.is_progress_bar_enabled())
"""


def _probe(verbose: bool) -> str:
    # as a fresh shell would start it: nothing this test process's own filters exported
    env = {k: v for k, v in os.environ.items() if k not in ("HACPO_VERBOSE", "HF_HUB_DISABLE_PROGRESS_BARS")}
    if verbose:
        env["HACPO_VERBOSE"] = "1"
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout + r.stderr


def test_known_third_party_messages_are_silenced_in_a_fresh_process_and_back_when_verbose():
    quiet = _probe(verbose=False)
    assert "engine is not available" not in quiet
    assert "Continuous Token builder" not in quiet
    assert "an unrelated warning stays visible" in quiet
    assert "hf progress bars False" in quiet
    loud = _probe(verbose=True)
    assert loud.count("engine is not available") >= 1
    assert loud.count("No model-specific Continuous Token builder") == 3
    assert "hf progress bars True" in loud


def test_release_removes_the_filters_in_this_process(monkeypatch):
    import logging
    import warnings

    from recipe_hacpo import quiet

    monkeypatch.delenv(quiet.VERBOSE_ENV, raising=False)
    # pytest restores the warning filters after collection, where the plugin installed them
    quiet.release()
    os.environ.pop(quiet.VERBOSE_ENV)
    assert quiet.install()
    name, prefix = next(iter(quiet.KNOWN_LOG_RECORDS.items()))
    rec = logging.LogRecord(name, logging.WARNING, __file__, 1, prefix + " for x", None, None)
    assert not logging.getLogger(name).filter(rec)
    def ours() -> int:
        pats = {p for _, p in quiet.KNOWN_WARNINGS}
        return sum(1 for f in warnings.filters if f[0] == "ignore" and f[1] is not None and f[1].pattern in pats)

    assert ours() >= 1
    try:
        quiet.release()
        assert os.environ[quiet.VERBOSE_ENV] == "1"
        assert logging.getLogger(name).filter(rec)
        assert ours() == 0
    finally:
        os.environ.pop(quiet.VERBOSE_ENV, None)
        quiet.release()
        os.environ.pop(quiet.VERBOSE_ENV, None)


def test_summary_line_per_agent():
    metrics = {
        "agent/qwen/reward/mean": 0.4375, "agent/qwen/val/hacpo/arith/add3/mean@1": 0.625,
        "agent/qwen/omega/llama": 1.5, "agent/qwen/cross/rows": 64.0, "agent/qwen/actor/pg_loss": 0.1,
        "agent/llama/reward/mean": 0.25, "agent/llama/val/hacpo/arith/add3/mean@1": 0.375,
        "agent/llama/omega/qwen": 0.6667, "agent/llama/cross/rows": 64.0, "timing_s/step": 1.0,
    }
    lines = summary_lines(metrics, 10, 40).splitlines()
    assert lines == [
        "step 10/40 qwen: reward 0.438  val acc 62.5%  ω llama 1.50  cross rows 64",
        "step 10/40 llama: reward 0.250  val acc 37.5%  ω qwen 0.67  cross rows 64",
    ]
    # before training only validation is known
    assert summary_lines({"agent/a/val/x/mean@1": 0.5}, 0, 4) == "step 0/4 a: val acc 50.0%"


def test_console_logger_is_replaced_by_short_lines_only_when_quiet():
    cfg = OmegaConf.create({"trainer": {"logger": ["console"], "summary_every": 5}})
    # the run's metrics.jsonl and TensorBoard files are always written, whatever the list says
    assert logger_backends(cfg, verbose=False) == ["file", "tensorboard"]
    assert logger_backends(cfg, verbose=True) == ["console", "file", "tensorboard"]
    cfg.trainer.summary_every = 0  # no short lines: the console keeps verl's full line
    assert logger_backends(cfg, verbose=False) == ["console", "file", "tensorboard"]
    cfg.trainer.logger = ["wandb", "file"]
    assert logger_backends(cfg, verbose=False) == ["wandb", "file", "tensorboard"]
