"""Every run keeps its per-step metrics in its own folder (recipe_hacpo/run_metrics.py): the JSONL
file is appended across resumes and holds each step once; a paper preset's logger settings end to
end, read back with TensorBoard's own event reader."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers.e2e import REPO, agent_overrides

from recipe_hacpo.run_metrics import JsonlMetrics


def _lines(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_a_resumed_run_keeps_the_steps_before_its_checkpoint_and_logs_the_rest_once(tmp_path):
    path = str(tmp_path / "m" / "metrics.jsonl")
    first = JsonlMetrics(path)
    for step in (0, 1, 2, 3):  # validation at 0, steps 1-3; the checkpoint of step 2 is the last one
        first.log({"x": float(step)}, step)
    with open(path, "a") as f:
        f.write('{"step": 4, "da')  # killed mid-line
    resumed = JsonlMetrics(path)  # resumes from step 2: logs 3 again, then 4
    resumed.log({"x": 30.0}, 3)
    resumed.log({"x": 4.0}, 4)
    assert [(r["step"], r["data"]["x"]) for r in _lines(path)] == [(0, 0.0), (1, 1.0), (2, 2.0), (3, 30.0), (4, 4.0)]
    # a new run in the same folder (resume disabled) starts the file over
    JsonlMetrics(path).log({"x": 0.5}, 0)
    assert [r["step"] for r in _lines(path)] == [0]


@pytest.mark.e2e
@pytest.mark.ray
def test_a_paper_presets_logger_settings_leave_every_metric_in_the_run_folder_across_a_resume(tmp_path, warm_agent_paths):
    """`trainer.logger=[console]` and a quiet console (the presets' settings): the run still writes
    metrics.jsonl and TensorBoard files beside its checkpoints; a resumed run adds to both."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    ckpt = tmp_path / "ckpt"
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_FILE_LOGGER_PATH", "TENSORBOARD_DIR")}
    env["HACPO_DATA_DIR"] = os.path.join(REPO, "data")

    def run(steps: int) -> None:
        cmd = [sys.executable, "-m", "recipe_hacpo.main", "--config-name", "hacpo_cpu_demo",
               *agent_overrides(warm_agent_paths, ["qwen2-char-small", "llama-pair-medium"]),
               "trainer.logger=[console]", "trainer.summary_every=5", f"trainer.default_local_dir={ckpt}",
               f"hydra.run.dir={tmp_path}/hydra", "trainer.progress_bar=false", f"trainer.total_training_steps={steps}",
               "trainer.save_freq=1", "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.resume_mode=auto"]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]

    run(1)
    run(2)  # resumes from step 1's checkpoint
    records = _lines(ckpt / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert {"agent/qwen_char/actor/pg_loss", "agent/llama_pair/omega/qwen_char", "timing_s/step"} <= set(r["data"])
    events = EventAccumulator(str(ckpt / "tensorboard"))
    events.Reload()
    pg_loss = events.Scalars("agent/qwen_char/actor/pg_loss")
    assert sorted(e.step for e in pg_loss) == [1, 2]
    assert [e.value for e in sorted(pg_loss, key=lambda e: e.step)] == pytest.approx(
        [r["data"]["agent/qwen_char/actor/pg_loss"] for r in records], rel=1e-6)
