"""`run_scripts/cpu_demo.sh` (what `make demo` runs) under a stand-in `python` that logs its
arguments: warm starts, then the trainer, then the closing report, in that order; the trainer's
overrides compose with `hacpo_cpu_demo` and pass the project's config validation (batch sizes,
agents, data files) without starting anything."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

from hydra import compose, initialize_config_module

from recipe_hacpo.config import validate

REPO = Path(__file__).resolve().parents[1]

STANDIN = """#!/usr/bin/env bash
printf '%s\\n' "$(printf '%q ' "$@")" >> "$STANDIN_LOG"
"""


def _run_script(tmp_path: Path, *extra: str, env: dict | None = None) -> list[list[str]]:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python").write_text(STANDIN)
    (bindir / "python").chmod(0o755)
    log = tmp_path / "calls.log"
    full_env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "STANDIN_LOG": str(log),
                "HACPO_OUTPUT_DIR": str(tmp_path / "out"), "HACPO_AGENTS_DIR": str(tmp_path / "agents"),
                **(env or {})}
    r = subprocess.run(["bash", str(REPO / "run_scripts" / "cpu_demo.sh"), *extra], env=full_env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return [shlex.split(line) for line in log.read_text().splitlines()]


def test_demo_script_order_and_a_valid_trainer_config(tmp_path):
    calls = _run_script(tmp_path, "trainer.total_training_steps=6", env={"HACPO_DEMO_SEED": "2"})
    modules = [c[1] for c in calls]
    assert modules == ["recipe_hacpo.warm_start", "recipe_hacpo.warm_start", "recipe_hacpo.main",
                       "recipe_hacpo.demo_report"]
    assert all("--task" in c and c[c.index("--task") + 1] == "add3" for c in calls[:2])
    main = calls[2]
    assert main[2:4] == ["--config-name", "hacpo_cpu_demo"]
    overrides = main[4:]
    assert overrides[-1] == "trainer.total_training_steps=6"  # the user's overrides come last
    assert "data.seed=2" in overrides
    report = calls[3]
    assert report[report.index("--out") + 1] == str(tmp_path / "out")

    with initialize_config_module("recipe_hacpo.configs", version_base=None):
        cfg = compose("hacpo_cpu_demo", overrides=[o for o in overrides if not o.startswith("hydra.")])
    specs, hacpo = validate(cfg, check_paths=False)
    assert [s.name for s in specs] == ["qwen_char", "llama_pair"]
    assert all(os.path.isabs(s.model_path) for s in specs)  # Ray workers may run elsewhere
    assert cfg.actor_rollout_ref.actor.optim.lr == 1e-4
    assert cfg.data.train_files.endswith("arith_add3_train.parquet")
    assert cfg.trainer.val_before_train and "file" in cfg.trainer.logger
    assert hacpo.mode == "hacpo"


def test_demo_starts_from_the_shipped_warm_starts_unless_asked_to_retrain(tmp_path):
    from recipe_hacpo.warm_start import WarmStartArgs, _record, load_record

    _run_script(tmp_path)
    agents = sorted(os.listdir(tmp_path / "agents"))
    assert agents == ["llama-pair-medium_add3_1200_s0", "qwen2-char-small_add3_1500_s0"]
    for name, kind, steps in (("qwen2-char-small_add3_1500_s0", "qwen2-char-small", 1500),
                              ("llama-pair-medium_add3_1200_s0", "llama-pair-medium", 1200)):
        shipped = load_record(str(REPO / "data" / "demo_agents" / name))
        # the shipped record matches what the script asks warm_start for, so it is reused as is
        wanted = _record(WarmStartArgs(kind=kind, task="add3", steps=steps))
        assert {k: shipped.get(k) for k in wanted} == wanted
        assert load_record(str(tmp_path / "agents" / name)) == shipped
        assert (tmp_path / "agents" / name / "model.safetensors").is_file()

    retrain = tmp_path / "retrain"
    retrain.mkdir()
    _run_script(retrain, env={"HACPO_DEMO_RETRAIN": "1"})
    assert not (retrain / "agents").exists()
