"""run_scripts/slurm/evaluate_export.slurm: its body run under a stand-in `python` that records
what it was asked to run, then each recorded command line handed to the real
`recipe_hacpo.evaluate` / `recipe_hacpo.export` entry points (their generation and merge
replaced by recorders), so the script's variables and commands are what the two modules accept."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from recipe_hacpo import evaluate as ev
from recipe_hacpo import export as ex
from helpers.evaluation import SOURCES, write_bench

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "run_scripts" / "slurm" / "evaluate_export.slurm"
AGENTS = ("qwen3_4b_base", "qwen3_8b_base")

# appends its argv as one JSON line to $STANDIN_LOG
STANDIN = """#!/usr/bin/env python3
import json, os, sys
with open(os.environ["STANDIN_LOG"], "a") as f:
    f.write(json.dumps(sys.argv[1:]) + "\\n")
"""


def _run_folder(root: Path, steps=(20, 40), latest: int | None = 40) -> Path:
    """outputs/<pair>_hacpo/checkpoints (where a preset's HACPO run writes) with complete-looking
    global_step_N folders of two agents."""
    ckpt = root / "outputs" / "pair_hacpo" / "checkpoints"
    for step in steps:
        folder = ckpt / f"global_step_{step}"
        for agent in AGENTS:
            (folder / agent / "actor").mkdir(parents=True)
            (folder / agent / "actor" / "model_world_size_1_rank_0.pt").write_bytes(b"x")
        (folder / "hacpo_state.pt").write_bytes(b"x")
    if latest is not None:
        (ckpt / "latest_checkpointed_iteration.txt").write_text(str(latest))  # no newline, as the trainer writes it
    return ckpt


@pytest.fixture
def script(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(STANDIN)
    (bin_dir / "python").chmod(0o755)
    bench = tmp_path / "bench"
    for key in SOURCES:
        write_bench(bench, key)
    log = tmp_path / "calls.jsonl"
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "HACPO_", "RUN", "PAIR", "METHOD", "STEP", "LABEL", "BASE_MODELS", "BENCH_DIR",
                                "EVAL_OUT", "EXPORT_OUT", "TP", "DTYPE", "VIRTUAL_ENV"))}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", STANDIN_LOG=str(log), SLURM_SUBMIT_DIR=str(REPO),
               HACPO_DATA_DIR=str(bench), CUDA_VISIBLE_DEVICES="0,1", ROCR_VISIBLE_DEVICES="0,1")

    def run(args=(), **extra):
        log.write_text("")
        proc = subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, env={**env, **extra},
                              capture_output=True, text=True, timeout=60)
        calls = [json.loads(line) for line in log.read_text().splitlines()]
        return proc, calls

    return run


def _evaluate_accepts(argv: list[str], monkeypatch) -> dict:
    """Run the real evaluate.main on `argv` with evaluate() recording its arguments."""
    seen = {}

    def record(checkpoints, benchmarks, out_dir, opts, **kw):
        seen.update(checkpoints=checkpoints, benchmarks=[b.key for b in benchmarks], out=out_dir, opts=opts, **kw)
        os.makedirs(out_dir, exist_ok=True)
        return {}

    monkeypatch.setattr(ev, "evaluate", record)
    assert ev.main(argv) == 0
    return seen


def _export_accepts(argv: list[str], monkeypatch) -> list[tuple[str, str, str | None]]:
    """Run the real export.main on `argv` with the FSDP merge recording what it would merge."""
    merged = []
    monkeypatch.setattr(ex, "merge_fsdp_checkpoint", lambda actor, target, dtype: merged.append((actor, target, dtype)))
    assert ex.main(argv) == 0
    return merged


def test_pair_run_evaluates_and_exports_the_newest_checkpoint(script, tmp_path, monkeypatch):
    ckpt = _run_folder(tmp_path)
    proc, calls = script(["--limit", "8"], PAIR="pair", HACPO_OUTPUT_DIR=str(tmp_path / "outputs"),
                         BASE_MODELS="base-4b=/models/Qwen3-4B-Base base-8b=/models/Qwen3-8B-Base", DTYPE="bfloat16")
    assert proc.returncode == 0, proc.stderr
    [evaluate, export] = calls
    step = ckpt / "global_step_40"
    parent = tmp_path / "outputs" / "pair_hacpo"
    assert evaluate[:2] == ["-m", "recipe_hacpo.evaluate"] and export[:2] == ["-m", "recipe_hacpo.export"]

    seen = _evaluate_accepts(evaluate[2:], monkeypatch)
    # the base models (evaluate puts --checkpoint rows first), then one row per agent of step 40,
    # named after the run's folder
    assert seen["checkpoints"] == [("base-4b", "/models/Qwen3-4B-Base"), ("base-8b", "/models/Qwen3-8B-Base")] + [
        (f"pair_hacpo/{a}", str(step / a)) for a in AGENTS]
    assert seen["benchmarks"] == list(SOURCES) and seen["out"] == str(parent / "eval" / "global_step_40")
    assert seen["opts"].tensor_parallel_size == 1 and seen["limit"] == 8  # the options after the script name

    merged = _export_accepts(export[2:], monkeypatch)
    assert merged == [(str(step / a / "actor"), str(parent / "exported" / "global_step_40" / a), "bfloat16") for a in AGENTS]
    assert "hacpo: done:" in proc.stdout


def test_run_and_step_pick_the_checkpoint_and_the_outputs_are_settable(script, tmp_path, monkeypatch):
    ckpt = _run_folder(tmp_path)
    proc, calls = script(RUN=str(ckpt), STEP="20", LABEL="hacpo", TP="2", EVAL_OUT=str(tmp_path / "e"),
                         EXPORT_OUT=str(tmp_path / "x"))
    assert proc.returncode == 0, proc.stderr
    evaluate, export = calls
    seen = _evaluate_accepts(evaluate[2:], monkeypatch)
    assert [n for n, _ in seen["checkpoints"]] == [f"hacpo/{a}" for a in AGENTS]
    assert all(p.startswith(str(ckpt / "global_step_20")) for _, p in seen["checkpoints"])
    assert seen["out"] == str(tmp_path / "e") and seen["opts"].tensor_parallel_size == 2
    merged = _export_accepts(export[2:], monkeypatch)
    assert [t for _, t, _ in merged] == [str(tmp_path / "x" / a) for a in AGENTS]
    assert {d for _, _, d in merged} == {None}  # no DTYPE: the config's
    # a global_step_N folder as RUN is that checkpoint
    proc, calls = script(RUN=str(ckpt / "global_step_20"))
    assert proc.returncode == 0, proc.stderr
    assert calls[1][2] == str(ckpt / "global_step_20")


@pytest.mark.parametrize("env, message", [
    ({}, "error: neither RUN nor PAIR is set"),
    ({"RUN": "/nowhere"}, "error: RUN=/nowhere: no such folder"),
    ({"STEP": "60"}, "global_step_60: no such checkpoint"),
    ({"STEP": "last"}, "error: STEP=last: not a step number"),
    ({"BENCH_DIR": "/nowhere"}, "error: BENCH_DIR=/nowhere: no such folder"),
    ({"BASE_MODELS": "/models/Qwen3-4B-Base"}, "error: BASE_MODELS: '/models/Qwen3-4B-Base' is not NAME=PATH"),
    ({"GPU_VENDOR": "intel"}, "error: GPU_VENDOR=intel: expected nvidia or amd"),
])
def test_bad_settings_are_one_line_before_any_command(script, tmp_path, env, message):
    ckpt = _run_folder(tmp_path)
    if env and "RUN" not in env:
        env = {"RUN": str(ckpt), **env}
    proc, calls = script(**env)
    assert proc.returncode == 2 and calls == []
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and message in proc.stderr


def test_a_run_without_a_complete_checkpoint_asks_for_step(script, tmp_path):
    ckpt = _run_folder(tmp_path, latest=None)
    proc, calls = script(RUN=str(ckpt))
    assert proc.returncode == 2 and calls == []
    assert "no latest_checkpointed_iteration.txt (no complete checkpoint); set STEP" in proc.stderr


def test_the_other_vendors_gpu_variables_are_cleared(script, tmp_path, monkeypatch):
    """verl refuses CUDA_ and ROCR_VISIBLE_DEVICES together (Slurm sets both without a vendor in gres.conf)."""
    bin_dir = tmp_path / "bin"
    (bin_dir / "python").write_text(STANDIN.replace("sys.argv[1:]", "[os.environ.get('CUDA_VISIBLE_DEVICES'), "
                                                    "os.environ.get('ROCR_VISIBLE_DEVICES')]"))
    proc, calls = script(RUN=str(_run_folder(tmp_path)), GPU_VENDOR="nvidia")
    assert proc.returncode == 0, proc.stderr
    assert calls == [["0,1", None], ["0,1", None]]


def test_method_picks_a_baselines_run_of_the_pair(script, tmp_path):
    """PAIR with METHOD=gspo: outputs/<pair>_gspo, the folder `+baseline=gspo` writes by default."""
    hacpo = _run_folder(tmp_path)
    gspo = hacpo.parent.parent / "pair_gspo" / "checkpoints"
    shutil.copytree(hacpo, gspo)
    proc, calls = script(PAIR="pair", METHOD="gspo", HACPO_OUTPUT_DIR=str(tmp_path / "outputs"))
    assert proc.returncode == 0, proc.stderr
    assert calls[1][2] == str(gspo / "global_step_40")
