"""The run's budget `trainer.plan_only=true` prints after the step estimate
(recipe_hacpo/cluster/run_budget.py): its arithmetic by hand, the printed lines on the largest
preset, and run_scripts/slurm/hacpo.slurm's #SBATCH lines held to that preset's plan. No Ray, no GPU."""

from __future__ import annotations

import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from helpers.compose import compose_config as _compose
from recipe_hacpo import main
from recipe_hacpo.cluster import planner
from recipe_hacpo.cluster import run_budget as rb
from recipe_hacpo.config import ConfigError, agent_specs

REPO = Path(__file__).resolve().parents[1]
SLURM = REPO / "run_scripts" / "slurm" / "hacpo.slurm"
LARGEST = "pair_qwen3-4b-base_qwen3-8b-base"
# MATH train and MATH-500, the preset's data (docs/REPRODUCE.md, section 1)
DATA_COUNTS = ["trainer.plan.train_prompts=7500", "trainer.plan.val_prompts=500"]
GIB = 1024**3


@pytest.fixture(autouse=True)
def _no_path_env(monkeypatch):
    for var in ("HACPO_MODEL_A", "HACPO_MODEL_B", "HACPO_DATA_DIR", "HACPO_OUTPUT_DIR"):
        monkeypatch.delenv(var, raising=False)


def test_the_constants_are_the_ones_the_hand_numbers_below_assume():
    assert (rb.STARTUP_S, rb.TIME_MARGIN, rb.LEAD_MARGIN) == (600.0, 0.25, 0.5)
    assert (rb.PROCESS_HOST_GIB, rb.RAY_HOST_GIB, planner.PROCESSES_PER_AGENT) == (5.0, 16.0, 2)


def test_schedules_count_the_last_step_once():
    # 58 steps, validation every 10: steps 10..50 and 58, and one before training
    assert rb.validations(58, 10, True) == 7
    assert rb.validations(58, 10, False) == 6
    assert rb.validations(60, 10, False) == 6  # the last is also a 10th
    assert rb.validations(58, -1, True) == 1
    # checkpoints every 20: 20, 40 and the last
    assert rb.checkpoint_writes(58, 20) == 3
    assert rb.checkpoint_writes(40, 20) == 2
    assert rb.checkpoint_writes(58, 0) == 0


def test_run_time_lead_and_limit_by_hand():
    write = rb.checkpoint_write_s(100 * GIB, 2.0)
    assert write == 50.0
    # 10 steps of 300 s, 3 validations of 40 s, 2 writes of 50 s
    assert rb.run_seconds(10, 300.0, 3, 40.0, 2, write) == 3000 + 120 + 100
    # (300 + 50) · 1.5 + 10 = 535 -> 540 (whole minutes)
    assert rb.signal_lead_s(300.0, 50.0, 10.0) == 540
    assert rb.signal_lead_s(300.0, 50.0, 45.0) == 600  # 525 + 45 = 570 -> 600
    assert rb.signal_lead_s(20.0, 20.0, 0.0) == 60  # exactly 60 stays 60
    # (600 + 3220) · 1.25 + 540 = 5315 -> 5400 s (quarter hours): 1 h 30 min
    assert rb.time_limit_s(3220.0, 540) == 5400
    assert rb.hms(5400) == "01:30:00" and rb.hms(27900) == "07:45:00" and rb.hms(90061) == "25:01:01"
    assert rb.slurm_lines(5400, 540) == ["#SBATCH --time=01:30:00", "#SBATCH --signal=B:USR1@540"]


def test_disk_keeps_the_newest_and_one_more_while_writing():
    # 3 written, 2 kept: 200 GiB kept, 300 GiB at the third write
    assert rb.disk_bytes(100, 2, 3) == (200, 300)
    assert rb.disk_bytes(100, 2, 2) == (200, 200)  # never more than written
    assert rb.disk_bytes(100, None, 3) == (300, 300)


def _plan(name, gpus, params, **kw) -> planner.AgentPlan:
    p = planner.AgentPlan(name=name, pool=kw.pop("pool", "own"), gpus=gpus, nodes=1, tp=1, utilization=0.5,
                          max_model_len=None, param_offload=kw.pop("param_offload", False),
                          optimizer_offload=kw.pop("optimizer_offload", False), params=params, **kw)
    p.checkpoint = 12 * params
    return p


def test_host_memory_by_hand():
    procs = 10 * GIB  # two processes of 5 GiB a GPU
    # no offload: processes + a quarter of the 12·P checkpoint staged on each of 4 ranks
    a = _plan("a", 4, GIB)
    assert rb.host_bytes_per_gpu(a) == procs + 3 * GIB
    # param and optimizer offload: + 4·P/4 + 8·P/4
    b = _plan("b", 4, GIB, param_offload=True, optimizer_offload=True)
    assert rb.host_bytes_per_gpu(b) == procs + 3 * GIB + 3 * GIB
    # offload_policy: weights, gradients and Adam on the host, 16·P/4
    c = _plan("c", 4, GIB, offload_policy=True)
    assert rb.host_bytes_per_gpu(c) == procs + 3 * GIB + 4 * GIB
    # a node of 8 GPUs holding a's 4 and b's 4 ranks, plus 16 GiB
    assert rb.node_host_bytes([a, b], 8) == 4 * 13 * GIB + 4 * 16 * GIB + 16 * GIB
    # of 4 GPUs: the node with b's 4 ranks is the larger
    assert rb.node_host_bytes([a, b], 4) == 4 * 16 * GIB + 16 * GIB
    # a shared pool of 4 GPUs: each holds a rank of both agents
    sa, sb = _plan("sa", 4, GIB, pool="shared"), _plan("sb", 4, GIB, pool="shared")
    assert rb.node_host_bytes([sa, sb], 4) == 4 * 26 * GIB + 16 * GIB


def test_steps_from_the_data_files_or_the_key(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"x": list(range(300))}), path)
    cfg = _compose(LARGEST, [f"data.train_files={path}"])
    assert rb.prompts(cfg, None, "train") == (300, "rows of data.train_files")
    assert rb.total_steps(cfg, 300) == 2  # 300 // 128, one epoch
    capped = _compose(LARGEST, [f"data.train_files={path}", "data.train_max_samples=200"])
    assert rb.prompts(capped, None, "train")[0] == 200
    missing = _compose(LARGEST, [f"data.train_files={tmp_path / 'none.parquet'}"])
    assert rb.prompts(missing, None, "train") == (
        None, "data.train_files not on this machine: set trainer.plan.train_prompts")
    assert rb.prompts(missing, 7500, "train") == (7500, "trainer.plan.train_prompts")
    fixed = _compose(LARGEST, ["trainer.total_training_steps=5", "trainer.total_epochs=3"])
    assert rb.total_steps(fixed, 7500) == 5
    assert rb.total_steps(_compose(LARGEST, ["trainer.total_epochs=2"]), 7500) == 116


@pytest.mark.parametrize("override, message", [
    ("trainer.plan.checkpoint_write_gib_s=0", r"^trainer.plan.checkpoint_write_gib_s=0: a speed in GiB/s, > 0$"),
    ("trainer.plan.train_prompts=-3", r"^trainer.plan.train_prompts=-3: a number of prompts"),
    ("+trainer.plan.speed=1", r"^trainer.plan.speed: not a key \(known: checkpoint_write_gib_s, train_prompts, val_prompts\)$"),
])
def test_settings_refuse_bad_values_naming_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        rb.BudgetSettings.from_config(_compose(LARGEST, [override]).trainer)


def _budget(overrides=()) -> rb.RunBudget:
    cfg = _compose(LARGEST, [*DATA_COUNTS, *overrides])
    specs = agent_specs(cfg)
    plans = planner.plan(cfg, specs)
    rows = main.rows_per_prompt(cfg, specs)
    from recipe_hacpo.cluster import time_model as tm

    step = tm.estimate(cfg, specs, {p.name: p.shape for p in plans}, rows).step_s
    return rb.budget(cfg, specs, plans, step, rows)


def test_budget_of_the_largest_preset_is_the_arithmetic_on_its_plan():
    b = _budget()
    # 7500 // 128 = 58 steps; validations before training, at 10..50 and 58; checkpoints at 20, 40, 58
    assert (b.steps, b.n_validations, b.n_checkpoints) == (58, 7, 3)
    assert b.joint_bytes / GIB == pytest.approx(136.5, abs=0.05) and b.write_s == pytest.approx(b.joint_bytes / GIB)
    assert b.step_s == pytest.approx(343, abs=0.5)
    assert b.run_s == pytest.approx(58 * b.step_s + 7 * b.validation_s + 3 * b.write_s)
    # a validation of 500 greedy responses is cheaper than a step's 1024 sampled ones
    assert 0 < b.validation_s < b.step_s
    # (343 + 136.5) · 1.5 + 10 = 729 -> 780
    assert b.lead_s == 780
    # node: 4 ranks of 4B (10 + 45.0/4 GiB) and 4 of 8B (10 + 91.5/4 GiB) + 16 GiB
    assert b.host_node_bytes / GIB == pytest.approx(4 * (10 + 45.0 / 4) + 4 * (10 + 91.5 / 4) + 16, abs=0.1)
    assert b.limit_s == rb.time_limit_s(b.run_s, 780) == 27900
    # a slower file system: every write and the lead grow
    slow = _budget(["trainer.plan.checkpoint_write_gib_s=0.25"])
    assert slow.write_s == pytest.approx(4 * b.write_s) and slow.lead_s > b.lead_s


def test_plan_only_prints_the_budget_and_the_slurm_lines(capsys):
    assert main.plan_only(_compose(LARGEST, DATA_COUNTS)) == 0
    out = capsys.readouterr().out
    assert out.index("lockstep step: 343 s") < out.index("HACPO run budget")
    lines = out[out.index("HACPO run budget"):].splitlines()
    assert re.match(r"  run time: \d+ s \(5 h \d\d min\) = 58 steps × 343 s \+ 7 validations × \d+ s \+ "
                    r"3 checkpoint writes × 136 s", lines[1]), lines[1]
    assert lines[2] == "  checkpoint write: 136.5 GiB at trainer.plan.checkpoint_write_gib_s=1 GiB/s: 136 s"
    assert lines[3].startswith("  host memory per node: 232.5 GiB (its 8 GPUs' processes")
    assert lines[4] == ("  checkpoint disk: 273.0 GiB kept (trainer.max_actor_ckpt_to_keep=2, 3 written), "
                        "409.5 GiB while the next is written")
    assert "trainer.preemption.usr1_grace_s=780" in lines[5]
    assert lines[6:8] == ["    #SBATCH --time=07:45:00", "    #SBATCH --signal=B:USR1@780"]


def test_plan_only_without_the_data_says_which_key_to_set(capsys):
    assert main.plan_only(_compose(LARGEST)) == 0
    out = capsys.readouterr().out
    assert "run time: not estimated (steps: data.train_files not on this machine: set trainer.plan.train_prompts" in out
    assert "    #SBATCH --time: not estimated (the run time is not known)" in out
    assert "    #SBATCH --signal=B:USR1@780" in out


def test_hacpo_slurm_defaults_are_the_largest_presets_plan():
    """The batch script's time limit, signal lead and the grace it hands the trainer are what
    plan_only prints for the largest preset (the slowest step and the largest checkpoint)."""
    b = _budget()
    text = SLURM.read_text()
    sbatch = re.findall(r"^#SBATCH (--time=\S+|--signal=\S+)$", text, re.M)
    assert ["#SBATCH " + s for s in sbatch] == rb.slurm_lines(b.limit_s, b.lead_s)
    assert f'++trainer.preemption.usr1_grace_s=${{USR1_GRACE_S:-{b.lead_s}}}' in text
    # the lead covers the slowest preset's step and checkpoint write
    assert b.lead_s >= b.step_s + b.write_s
