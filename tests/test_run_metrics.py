"""Every run keeps its per-step metrics in its own folder (recipe_hacpo/run_metrics.py): the JSONL
file is appended across resumes and holds each step once; a paper preset's logger settings end to
end, read back with TensorBoard's own event reader."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

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
               f"hydra.run.dir={tmp_path}/hydra", f"trainer.total_training_steps={steps}",
               "trainer.save_freq=1", "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.resume_mode=auto"]
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
        # no terminal: the progress bar's place is taken by plain lines (a log file can hold them)
        assert "\r" not in proc.stdout + proc.stderr
        assert "hacpo: starting the workers of 2 agents (qwen_char, llama_pair)" in proc.stdout
        assert f"hacpo: step {steps}/{steps} done in " in proc.stdout

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


def _wandb_history_steps(run_dir) -> list[int]:
    """The history steps in wandb's own offline file of one run: a ":W&B" header, then
    LevelDB-log records (32 KiB blocks; checksum, length, type; full / first / middle / last
    chunks) of wandb's `Record` protobuf messages."""
    from wandb.proto import wandb_internal_pb2

    (path,) = run_dir.glob("*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending, steps = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 2):
            pending = chunk
        elif kind in (3, 4):
            pending += chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            if record.WhichOneof("record_type") == "history":
                steps += [int(json.loads(i.value_json)) for i in record.history.item
                          if (i.key or "/".join(i.nested_key)) == "_step"]
    return steps


def test_wandb_offline_continues_one_run_across_a_requeue(tmp_path, monkeypatch):
    """The real wandb package, offline: the second process (a requeue) finds the run id in the
    metrics folder and logs into the same run."""
    from omegaconf import OmegaConf

    from recipe_hacpo.run_metrics import WANDB_ID_FILE, RunMetrics

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wb"))
    monkeypatch.setenv("TENSORBOARD_DIR", str(tmp_path / "tb"))
    cfg = OmegaConf.create({"trainer": {"logger": ["wandb"], "summary_every": 0, "metrics_dir": None,
                                        "default_local_dir": str(tmp_path / "ckpt"), "project_name": "p",
                                        "experiment_name": "e"}})
    for steps in ((1, 2), (3,)):
        for var in ("WANDB_RUN_ID", "WANDB_RESUME"):  # a new process: only the folder remembers
            monkeypatch.delenv(var, raising=False)
        metrics = RunMetrics(cfg, verbose=True)
        for step in steps:
            metrics.log({"agent/a/reward/mean": 0.1 * step}, step)
        metrics.finish()
    run_id = (tmp_path / "ckpt" / WANDB_ID_FILE).read_text()
    runs = sorted((tmp_path / "wb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(r.name.endswith(f"-{run_id}") for r in runs)
    # wandb's service process may still be writing the last run's file when finish() returns
    deadline = time.monotonic() + 60
    while (steps := [s for r in runs for s in _wandb_history_steps(r)]) != [1, 2, 3] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert steps == [1, 2, 3]
    assert [r["step"] for r in _lines(tmp_path / "ckpt" / "metrics.jsonl")] == [1, 2, 3]


def test_an_unknown_backend_is_one_line_before_anything_starts(tmp_path):
    from omegaconf import OmegaConf

    from recipe_hacpo.hacpo_settings import ConfigError
    from recipe_hacpo.run_metrics import RunMetrics

    cfg = OmegaConf.create({"trainer": {"logger": ["console", "wandbb"], "summary_every": 0, "metrics_dir": None,
                                        "default_local_dir": str(tmp_path), "project_name": "p", "experiment_name": "e"}})
    with pytest.raises(ConfigError, match=r"^trainer\.logger: unknown backend 'wandbb'; verl knows wandb, "):
        RunMetrics(cfg, verbose=True)
    assert not os.listdir(tmp_path)
