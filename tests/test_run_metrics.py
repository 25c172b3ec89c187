"""Every run keeps its per-step metrics in its own folder (recipe_hacpo/training/run_metrics.py): the JSONL
file is appended across resumes and holds each step once; a user's own task and reward with a
paper preset's logger settings end to end, read back with TensorBoard's and wandb's own files."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from helpers.e2e import REPO, agent_overrides

from recipe_hacpo.training.run_metrics import JsonlMetrics


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


# a task of a user's own, not arithmetic: the last character of a short string (a digit, so that
# the warm agents, which answer with digits, score now and then), and its reward, as a user's file
LAST_CHAR_REWARD = """
def last_char_score(data_source, solution_str, ground_truth, extra_info=None):
    assert data_source == "user/last_char", data_source
    return 1.0 if solution_str.strip() == ground_truth else 0.0
"""


def last_char_task(folder) -> tuple[str, str, str]:
    """(train file, validation file, reward file) of the task above, in verl's parquet schema."""
    import random

    from recipe_hacpo.data.schema import make_row, write_rows

    rng = random.Random(0)
    files = []
    for split, count in (("train", 24), ("test", 8)):
        rows = []
        for i in range(count):
            text = "".join(rng.choice("abcxyz") for _ in range(3)) + str(rng.randrange(10))
            rows.append(make_row("user/last_char", f"last char of {text}", "text", text[-1], split, i))
        files.append(str(folder / f"last_char_{split}.parquet"))
        write_rows(rows, files[-1])
    reward = folder / "last_char_reward.py"
    reward.write_text(LAST_CHAR_REWARD)
    return files[0], files[1], str(reward)


@pytest.mark.e2e
@pytest.mark.ray
def test_your_own_task_trains_stops_resumes_and_evaluates_and_the_run_folder_keeps_it_all(tmp_path, warm_agent_paths):
    """A user's task and reward (verl's parquet schema, `reward.custom_reward_function`), the
    presets' console settings (`trainer.logger=[console,wandb]`, quiet) and wandb offline: a run
    stopped by SIGTERM (exit 75, a requeue's stop) and resumed leaves every step once in
    metrics.jsonl, TensorBoard's files and one wandb run; `trainer.rollout_data_dir` holds each
    learner's rows of every step, scored by the user's reward, with what the loss did to them;
    `recipe_hacpo.evaluate --reward` scores the trained agents with the same reward."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from recipe_hacpo.cluster.preemption import RESUMABLE_EXIT
    from recipe_hacpo.training.run_metrics import WANDB_ID_FILE

    train, val, reward = last_char_task(tmp_path)
    ckpt, rollouts = tmp_path / "ckpt", tmp_path / "rollouts"
    env = {k: v for k, v in os.environ.items() if k not in ("VERL_FILE_LOGGER_PATH", "TENSORBOARD_DIR", "WANDB_RUN_ID")}
    env.update(WANDB_MODE="offline", WANDB_DIR=str(tmp_path / "wb"))

    def command(steps: int) -> list[str]:
        return [sys.executable, "-m", "recipe_hacpo.main", "--config-name", "hacpo_cpu_demo",
                *agent_overrides(warm_agent_paths, ["qwen2-char-small", "llama-pair-medium"]),
                f"data.train_files={train}", f"data.val_files={val}",
                f"reward.custom_reward_function.path={reward}", "reward.custom_reward_function.name=last_char_score",
                "trainer.logger=[console,wandb]", "trainer.summary_every=5", f"trainer.default_local_dir={ckpt}",
                f"hydra.run.dir={tmp_path}/hydra", f"trainer.total_training_steps={steps}", "trainer.save_freq=1",
                "trainer.test_freq=-1", "trainer.val_before_train=false", "trainer.resume_mode=auto",
                f"trainer.rollout_data_dir={rollouts}"]

    # run 1: SIGTERM once step 1 is done; the trainer stops at a safe point with a checkpoint (a
    # run of 3 steps: a stop that lets step 2 finish still has step 3 left, so it always exits 75)
    with open(tmp_path / "run1.err", "w") as err:
        proc = subprocess.Popen(command(3), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        out1 = []
        for line in proc.stdout:
            out1.append(line)
            if line.startswith("hacpo: step 1/3 done in "):
                proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=900) == RESUMABLE_EXIT, "".join(out1)[-4000:] + (tmp_path / "run1.err").read_text()[-4000:]
    # run 2: resumes from the newest checkpoint and trains to step 3
    proc2 = subprocess.run(command(3), cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc2.returncode == 0, proc2.stdout[-4000:] + proc2.stderr[-4000:]
    for stdout in ("".join(out1), proc2.stdout):
        # no terminal: the progress bar's place is taken by plain lines (a log file can hold them)
        assert "\r" not in stdout
        assert "hacpo: starting the workers of 2 agents (qwen_char, llama_pair)" in stdout
    assert "hacpo: step 3/3 done in " in proc2.stdout

    records = _lines(ckpt / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    for r in records:
        assert {"agent/qwen_char/actor/pg_loss", "agent/llama_pair/omega/qwen_char", "timing_s/step"} <= set(r["data"])
    events = EventAccumulator(str(ckpt / "tensorboard"))
    events.Reload()
    pg_loss = events.Scalars("agent/qwen_char/actor/pg_loss")
    assert sorted(e.step for e in pg_loss) == [1, 2, 3]
    assert [e.value for e in sorted(pg_loss, key=lambda e: e.step)] == pytest.approx(
        [r["data"]["agent/qwen_char/actor/pg_loss"] for r in records], rel=1e-6)
    # one wandb run across the stop, its steps contiguous in wandb's own files
    run_id = (ckpt / WANDB_ID_FILE).read_text()
    runs = sorted((tmp_path / "wb" / "wandb").glob("offline-run-*"))
    # offline-run-<date>_<time>-<id>; wandb adds -1 when both processes started within one second
    assert len(runs) == 2 and all(re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{run_id}(-\d+)?", r.name) for r in runs), runs
    assert sorted(s for r in runs for s in _wandb_history_steps(r)) == [1, 2, 3]

    scored = []
    for record in records:
        scored += check_rollout_log(rollouts, record["step"], record["data"])
    # the user's reward scored every row (the prompts name the task; the answers are the agents')
    assert {r["gts"] for r in scored} <= set("0123456789") and all(r["input"].count("last char of") == 1 for r in scored)
    assert [r["score"] for r in scored] == [1.0 if r["output"].strip() == r["gts"] else 0.0 for r in scored]

    # the trained agents, scored by the same reward on the held-out prompts
    out = tmp_path / "eval"
    proc = subprocess.run([sys.executable, "-m", "recipe_hacpo.evaluate", "--backend", "hf", "--agents-from", str(ckpt),
                           "--bench", f"last_char={val}", "--reward", f"{reward}:last_char_score",
                           "--max-new-tokens", "8", "--max-prompt-length", "32", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert sorted(metrics) == ["llama_pair", "qwen_char"]
    for name in metrics:
        samples = _lines(out / "samples" / name / "last_char.jsonl")
        assert len(samples) == 8 and metrics[name]["last_char"]["prompts"] == 8
        assert metrics[name]["last_char"]["value"] == pytest.approx(
            sum(float(s["responses"][0].strip() == s["ground_truth"]) for s in samples) / 8)
    wrong = subprocess.run([sys.executable, "-m", "recipe_hacpo.evaluate", "--agents-from", str(ckpt), "--bench",
                            f"last_char={val}", "--reward", f"{reward}:no_such_fn", "--out", str(tmp_path / "x")],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert wrong.returncode == 2 and wrong.stderr.startswith(f"error: --reward {reward}:no_such_fn: reward.custom_reward_function")


def check_rollout_log(root, step: int, metrics: dict) -> list[dict]:
    """`trainer.rollout_data_dir` of one step against the step's metrics, read another way;
    returns every own row of the step."""
    from recipe_hacpo.hacpo_settings import DEFAULTS

    names, scored = ("qwen_char", "llama_pair"), []
    for name in names:
        peer = next(n for n in names if n != name)
        rows = _lines(root / name / f"{step}.jsonl")
        own = [r for r in rows if not r["cross"]]
        cross = [r for r in rows if r["cross"]]
        assert {r["source"] for r in own} == {name} and {r["source"] for r in cross} == {peer}
        assert len(cross) == metrics[f"agent/{name}/cross/rows"] and len(own) == len(cross)  # 4 + 4 a prompt
        assert all(r["agent"] == name and r["step"] == step and r["input"] and r["in_loss"] for r in rows)
        assert all(r["omega"] == pytest.approx(metrics[f"agent/{name}/omega/{peer}"], rel=1e-6) for r in cross)
        assert sum(r["score"] for r in own) / len(own) == pytest.approx(metrics[f"agent/{name}/reward/mean"], abs=1e-6)
        ratios = [u["ratio"] for r in cross for u in r["updates"]]
        assert len(ratios) == len(cross)  # one epoch: every row at one update
        assert min(ratios) == pytest.approx(metrics[f"agent/{name}/hacpo/cross_ratio_min"], rel=1e-6)
        assert max(ratios) == pytest.approx(metrics[f"agent/{name}/hacpo/cross_ratio_max"], rel=1e-6)
        low = [u["ratio"] < min(1.0, 1 - DEFAULTS.delta + u["m"] * DEFAULTS.delta_step) for r in cross for u in r["updates"]]
        high = [u["ratio"] > 1 for r in cross for u in r["updates"]]
        assert [u["clipped"] for r in cross for u in r["updates"]] == [a or b for a, b in zip(low, high)]
        scored += own
    return scored


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

    from recipe_hacpo.training.run_metrics import WANDB_ID_FILE, RunMetrics

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
    # offline-run-<date>_<time>-<id>; wandb adds -1 when both processes started within one second
    assert len(runs) == 2 and all(re.fullmatch(rf"offline-run-\d{{8}}_\d{{6}}-{run_id}(-\d+)?", r.name) for r in runs)
    # wandb's service process may still be writing the last run's file when finish() returns
    deadline = time.monotonic() + 60
    while (steps := [s for r in runs for s in _wandb_history_steps(r)]) != [1, 2, 3] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert steps == [1, 2, 3]
    assert [r["step"] for r in _lines(tmp_path / "ckpt" / "metrics.jsonl")] == [1, 2, 3]


def test_an_unknown_backend_is_one_line_before_anything_starts(tmp_path):
    from omegaconf import OmegaConf

    from recipe_hacpo.hacpo_settings import ConfigError
    from recipe_hacpo.training.run_metrics import RunMetrics

    cfg = OmegaConf.create({"trainer": {"logger": ["console", "wandbb"], "summary_every": 0, "metrics_dir": None,
                                        "default_local_dir": str(tmp_path), "project_name": "p", "experiment_name": "e"}})
    with pytest.raises(ConfigError, match=r"^trainer\.logger: unknown backend 'wandbb'; verl knows wandb, "):
        RunMetrics(cfg, verbose=True)
    assert not os.listdir(tmp_path)


def test_the_validation_samples_logged_are_the_ones_verls_trainer_picks():
    """`trainer.log_val_generations`: the same n samples verl's own trainer would log."""
    from types import SimpleNamespace

    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    from recipe_hacpo.training.run_metrics import chosen_samples

    rows = [(f"{a}+{b}=", str(a + b + (a % 3 == 0)), float(a % 3 != 0)) for a in range(9) for b in range(4)]
    picked = {}
    verl_side = SimpleNamespace(
        config=SimpleNamespace(trainer=SimpleNamespace(log_val_generations=5, logger=["console"])),
        global_steps=7,
        validation_generations_logger=SimpleNamespace(log=lambda loggers, samples, step: picked.update(samples=samples)),
    )
    RayPPOTrainer._maybe_log_val_generations(verl_side, *map(list, zip(*rows)))
    assert [tuple(s) for s in picked["samples"]] == chosen_samples(rows, 5)
    assert len(set(chosen_samples(rows, 5))) == 5
