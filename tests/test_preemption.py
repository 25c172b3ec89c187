"""Stopping to be resumed (recipe_hacpo/cluster/preemption.py): the finish-or-abandon and deadline rules,
the settings, Slurm's end time, the signal handlers and the shield that keeps a local Ray's
processes from dying of SIGUSR1; the trainer's loop with stand-in agents (no Ray); and one run
end to end: SIGUSR1 to its whole process group mid-step, a SIGTERM during the checkpoint write,
exit 75, and a resume whose metrics equal an uninterrupted run's."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers.e2e import HACPO_PAIR_KINDS, HACPO_PAIR_RUN, agent_overrides
from omegaconf import OmegaConf
from torchdata.stateful_dataloader import StatefulDataLoader

from recipe_hacpo.config import AgentSpec, ConfigError
from recipe_hacpo.methods.core_algos import CapabilityTracker
from recipe_hacpo.cluster.preemption import (
    RESUMABLE_EXIT,
    PreemptionSettings,
    ResumableStop,
    StopClock,
    StopSignals,
    parse_slurm_time,
    slurm_end_time,
)
from recipe_hacpo.cluster.reliability import LATEST_FILE, STATE_FILE, checkpoint_problem, find_resume_checkpoint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NAMES = ["qwen_char", "llama_pair"]


def settings(**overrides) -> PreemptionSettings:
    base = OmegaConf.load(os.path.join(REPO, "configs", "hacpo_base.yaml")).trainer
    base.preemption.update(overrides)
    return PreemptionSettings.from_config(base)


class Clock:
    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


# ============================================================================ the rules
def test_exit_status_is_ex_tempfail_and_clear_of_the_others():
    assert RESUMABLE_EXIT == 75
    assert RESUMABLE_EXIT not in (0, 1, 2, 124, 130, 137, 143)


def test_declared_defaults_and_bad_values_are_one_line():
    s = settings()
    assert (s.usr1_grace_s, s.term_grace_s, s.time_limit_s, s.slurm_end_time, s.margin_s, s.record_file,
            s.request_file) == (300.0, 30.0, None, True, 10.0, None, None)
    for key, value, message in [
        ("usr1_grace_s", -1, r"trainer\.preemption\.usr1_grace_s=-1: must be >= 0 seconds"),
        ("time_limit_s", 0, r"trainer\.preemption\.time_limit_s=0: must be > 0 seconds \(or null for none\)"),
        ("margin_s", "soon", r"trainer\.preemption\.margin_s='soon': not a number of seconds"),
        ("slurm_end_time", "yes", r"trainer\.preemption\.slurm_end_time='yes': must be true or false"),
    ]:
        with pytest.raises(ConfigError, match=message):
            settings(**{key: value})
    base = OmegaConf.load(os.path.join(REPO, "configs", "hacpo_base.yaml")).trainer
    base.preemption.grace = 5
    with pytest.raises(ConfigError, match=r"^trainer\.preemption\.grace: unknown key; known: usr1_grace_s, "):
        PreemptionSettings.from_config(base)


def test_stop_before_step_on_a_signal_or_a_deadline_within_a_step_and_a_checkpoint():
    clock = Clock()
    c = StopClock(settings(margin_s=10), end_time=None, clock=clock)
    assert c.stop_before_step(None) is None
    assert c.stop_before_step(("SIGUSR1", 990.0)) == "SIGUSR1 received"
    # a deadline: nothing is known before the first step; then step + checkpoint + margin must fit
    c = StopClock(settings(margin_s=10), end_time=1100.0, clock=clock)
    assert c.stop_before_step(None) is None
    c.note_step(40.0)
    c.note_step(30.0)  # the slowest one counts
    assert c.slowest_step_s == 40.0 and c.checkpoint_estimate() == 40.0  # no checkpoint timed yet
    assert c.stop_before_step(None) is None  # 100 s left >= 40 + 40 + 10
    c.note_checkpoint(20.0)
    clock.now = 1031.0  # 69 s left < 40 + 20 + 10
    assert c.stop_before_step(None).startswith("69 s left before the deadline, under the slowest step (40 s)")
    clock.now = 1030.0  # 70 s: just fits
    assert c.stop_before_step(None) is None


def test_finish_or_abandon():
    clock = Clock()
    c = StopClock(settings(usr1_grace_s=100, term_grace_s=30, margin_s=10), clock=clock)
    usr1 = ("SIGUSR1", 1000.0)
    # nothing asks for a stop: carry on
    assert c.finish_or_abandon(None, "reward", 5.0) is None
    # no finished step yet: nothing tells how long this one needs
    verdict, why = c.finish_or_abandon(usr1, "reward", 5.0)
    assert verdict == "abandon" and "no step of this run has finished yet" in why
    c.note_step(60.0)
    c.note_checkpoint(20.0)
    # 100 s left >= (60 - 5) + 20 + 10
    assert c.finish_or_abandon(usr1, "reward", 5.0)[0] == "finish"
    # SIGTERM's grace is 30 s: too short for the rest of the step and a checkpoint
    verdict, why = c.finish_or_abandon(("SIGTERM", 1000.0), "reward", 5.0)
    assert verdict == "abandon" and why.startswith("30 s left, short of the rest of the step (<= 55 s")
    # past the point of no return the step is finished whatever the time left
    for phase in ("update_actor", "update_weights"):
        verdict, why = c.finish_or_abandon(("SIGTERM", 900.0), phase, 5.0)
        assert verdict == "finish" and "update has begun" in why
    # a deadline alone: nothing until it is near
    c2 = StopClock(settings(margin_s=10), end_time=1200.0, clock=clock)
    c2.note_step(60.0)
    c2.note_checkpoint(20.0)
    assert c2.finish_or_abandon(None, "old_log_prob", 10.0) is None
    clock.now = 1150.0  # 50 s left < 50 + 20 + 10
    assert c2.finish_or_abandon(None, "old_log_prob", 10.0)[0] == "abandon"
    # the earlier of the two deadlines counts
    assert c2.deadline(("SIGUSR1", 1140.0)) == 1200.0 and c2.deadline(("SIGTERM", 1140.0)) == 1170.0


def test_slurm_end_time_from_the_environment_or_squeue():
    assert slurm_end_time({}) is None  # not a Slurm job
    assert slurm_end_time({"SLURM_JOB_ID": "7", "SLURM_JOB_END_TIME": "1796234567"}) == 1796234567.0
    asked = []

    def squeue(argv, **kw):
        asked.append(argv)
        return subprocess.CompletedProcess(argv, 0, stdout="2026-12-02T18:30:00\n", stderr="")

    end = slurm_end_time({"SLURM_JOB_ID": "7"}, run=squeue)
    assert asked == [["squeue", "-h", "-j", "7", "-o", "%e"]]
    assert end == time.mktime(time.strptime("2026-12-02T18:30:00", "%Y-%m-%dT%H:%M:%S"))
    for text in ("N/A", "Unknown", "NONE", ""):
        assert parse_slurm_time(text) is None
    failing = lambda argv, **kw: subprocess.CompletedProcess(argv, 1, stdout="", stderr="invalid job id")  # noqa: E731
    assert slurm_end_time({"SLURM_JOB_ID": "7"}, run=failing) is None


def test_signal_handlers_record_and_return():
    s = StopSignals().install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)  # the process lives on: the handler only records
        time.sleep(0.05)
    finally:
        s.restore()
    assert [name for name, _ in s.received] == ["SIGUSR1", "SIGTERM"]
    assert s.first[0] == "SIGUSR1"
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_a_stop_request_left_as_a_file_counts_as_a_sigusr1_once_the_handlers_are_in_place(tmp_path, capfd):
    """A launcher starts the trainer with SIGUSR1 ignored (run_scripts/slurm/hacpo.slurm): one
    sent before the handlers are in place is lost as a signal and taken up from the file."""
    request = tmp_path / "stop_request"
    none = StopSignals(request_file=str(request)).install()
    none.restore()
    assert none.received == []

    request.touch()
    os.utime(request, (1_000_000.0, 1_000_000.0))
    s = StopSignals(request_file=str(request)).install()
    try:
        s.install()  # re-installed after Ray's start: the same request is not counted twice
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
    finally:
        s.restore()
    # the file's time is the signal's: the grace period counts from it
    assert s.first == ("SIGUSR1", 1_000_000.0)
    assert [name for name, _ in s.received] == ["SIGUSR1", "SIGUSR1"]
    err = capfd.readouterr().err
    assert (f"hacpo: SIGUSR1 received (sent before the trainer could catch it: {request}): stopping to be "
            "resumed at the next safe point") in err
    assert "hacpo: SIGUSR1 received: a stop is already under way; ignored" in err


SHIELD_PROBE = """
import os, signal, subprocess, sys, time
sys.path.insert(0, sys.argv[1])
from recipe_hacpo.cluster.preemption import StopSignals, shield_children
signals = StopSignals().install()
with shield_children():
    shielded = subprocess.Popen(["sleep", "30"])
bare = subprocess.Popen(["sleep", "30"])
os.killpg(0, signal.SIGUSR1)
time.sleep(1.0)
print(shielded.poll(), bare.poll(), [n for n, _ in signals.received])
shielded.kill(); bare.kill()
"""


def test_children_started_under_the_shield_survive_sigusr1_to_the_process_group():
    proc = subprocess.run([sys.executable, "-c", SHIELD_PROBE, REPO], capture_output=True, text=True, timeout=60,
                          start_new_session=True)
    assert proc.returncode == 0, proc.stderr
    # the shielded child lives on, the bare one (the negative control) died of the default action
    assert proc.stdout.split("\n")[0] == f"None {-signal.SIGUSR1} ['SIGUSR1']", proc.stdout + proc.stderr


# ============================================================================ the loop, without Ray
class StubAgent:
    def __init__(self, name: str, index: int):
        self.spec = AgentSpec(index=index, name=name, model_path="-", rollout_n=2, n_gpus_per_node=1, nnodes=1)
        self.weight = torch.zeros(3)

    def save(self, path: str, step: int) -> None:
        os.makedirs(os.path.join(path, "actor"), exist_ok=True)
        torch.save(self.weight.clone(), os.path.join(path, "actor", "weights.pt"))

    def load(self, path: str, step: int) -> None:
        self.weight = torch.load(os.path.join(path, "actor", "weights.pt"))


PHASES = ("gen", "reward", "old_log_prob", "exchange", "adv", "update_actor", "update_weights")


class Logger:
    def __init__(self):
        self.steps: dict[int, dict] = {}

    def log(self, data, step):
        if "training/global_step" in data:
            self.steps[step] = data


def stub_trainer(root: str, on_phase=None, total_steps: int = 6, save_freq: int = 100, **preemption):
    """A HacpoTrainer whose step runs the phase boundaries only: the capability history is
    updated before `exchange` (as the real step does), the weights in `update_actor`."""
    from recipe_hacpo.training.trainer import HacpoTrainer

    class Stub(HacpoTrainer):
        def train_step(self, batch_dict):
            phase = self._phase_timer({})
            batch = batch_dict.tolist()
            for name in PHASES:
                with phase(name):
                    if on_phase is not None:
                        on_phase(self, name)
                    if name == "exchange":
                        self.tracker.update([sum(batch) / 10.0, 0.5])
                    if name == "update_actor":
                        for agent in self.agents.values():
                            agent.weight += torch.tensor(batch[:1] * 3, dtype=torch.float32)
            return {"batch": float(sum(batch)), "weight": float(self.agents["qwen_char"].weight[0])}

    from helpers.stand_in import stand_in_trainer

    base = OmegaConf.load(os.path.join(REPO, "configs", "hacpo_base.yaml")).trainer
    base.preemption.update({"slurm_end_time": False, "record_file": os.path.join(root, "stop.json"), **preemption})
    config = OmegaConf.create({"trainer": {
        "default_local_dir": os.path.join(root, "ckpt"), "resume_mode": "auto", "resume_from_path": None,
        "test_freq": -1, "save_freq": save_freq, "val_before_train": False, "preemption": base.preemption,
    }, "actor_rollout_ref": {"model": {}, "actor": {}}})  # what a checkpoint's run identity reads
    return stand_in_trainer(
        cls=Stub, specs=[StubAgent(n, i).spec for i, n in enumerate(NAMES)], config=config,
        agents={n: StubAgent(n, i) for i, n in enumerate(NAMES)},
        tracker=CapabilityTracker(len(NAMES), window=3),
        train_dataloader=StatefulDataLoader(list(range(20)), batch_size=2, shuffle=False),
        val_dataloader=None, total_steps=total_steps, global_step=0,
        verifier=type("V", (), {"close": lambda self: None})(),
        preemption=PreemptionSettings.from_config(config.trainer), stop_signals=StopSignals(),
        started_at=time.time(), _step_started=None, _step_decision=None, _worker_processes={},
    )


def signal_at(step: int, phase: str, signum=signal.SIGUSR1):
    def hook(trainer, name):
        if (trainer.global_step, name) == (step, phase):
            trainer.stop_signals._handle(signum, None)
    return hook


def reference_run(tmp_path) -> dict[int, dict]:
    logger = Logger()
    stub_trainer(str(tmp_path / "reference")).fit(logger, progress=False)
    return logger.steps


def resume_and_compare(root: str, reference: dict[int, dict], stopped: dict[int, dict]) -> None:
    logger = Logger()
    t = stub_trainer(root)
    t.fit(logger, progress=False)
    assert sorted(stopped) + sorted(logger.steps) == list(range(1, 7))
    for step, data in {**stopped, **logger.steps}.items():
        assert {k: v for k, v in data.items() if not k.startswith("timing_s/")} == {
            k: v for k, v in reference[step].items() if not k.startswith("timing_s/")}, step


def test_signal_before_the_update_with_time_left_finishes_the_step_and_saves_it(tmp_path, capsys):
    reference = reference_run(tmp_path)
    root = str(tmp_path / "run")
    logger = Logger()
    t = stub_trainer(root, on_phase=signal_at(3, "reward"))
    with pytest.raises(ResumableStop) as stop:
        t.fit(logger, progress=False)
    assert stop.value.step == 3 and sorted(logger.steps) == [1, 2, 3]
    out = capsys.readouterr().out
    assert "hacpo: step 3: finishing it before the checkpoint: " in out
    assert find_resume_checkpoint(os.path.join(root, "ckpt"), NAMES).path.endswith("global_step_3")
    record = json.load(open(os.path.join(root, "stop.json")))
    assert record == {"resumed_from": 0, "step": 3, "reason": "SIGUSR1 received", "signals": ["SIGUSR1"]}
    resume_and_compare(root, reference, logger.steps)


def test_signal_without_time_left_abandons_the_step_and_saves_the_one_before(tmp_path, capsys):
    reference = reference_run(tmp_path)
    root = str(tmp_path / "run")
    logger = Logger()
    # SIGTERM's grace of 0 s leaves no time for the rest of step 3: it is abandoned after its
    # capability update (before `adv`), which the checkpoint of step 2 must not contain
    t = stub_trainer(root, on_phase=signal_at(3, "exchange", signal.SIGTERM), term_grace_s=0)
    with pytest.raises(ResumableStop) as stop:
        t.fit(logger, progress=False)
    assert stop.value.step == 2 and sorted(logger.steps) == [1, 2]
    assert "hacpo: step 3: abandoning it before adv, nothing of it is saved: 0 s left, short of" in capsys.readouterr().out
    ckpt = os.path.join(root, "ckpt")
    assert sorted(os.listdir(ckpt)) == ["global_step_2", LATEST_FILE]  # save_freq=100: the stop wrote it
    state = torch.load(os.path.join(ckpt, "global_step_2", STATE_FILE), weights_only=False)
    assert state["global_step"] == 2 and len(state["tracker"]["history"]) == 2
    resume_and_compare(root, reference, logger.steps)


def test_signal_during_the_update_finishes_the_step(tmp_path, capsys):
    root = str(tmp_path / "run")
    t = stub_trainer(root, on_phase=signal_at(2, "update_actor", signal.SIGTERM), term_grace_s=0)
    with pytest.raises(ResumableStop) as stop:
        t.fit(Logger(), progress=False)
    assert stop.value.step == 2
    assert "hacpo: step 2: finishing it before the checkpoint: its update has begun" in capsys.readouterr().out


def test_second_signal_during_the_checkpoint_write_leaves_it_complete(tmp_path, capsys):
    reference = reference_run(tmp_path)
    root = str(tmp_path / "run")
    t = stub_trainer(root, on_phase=signal_at(2, "gen"))
    seen = []
    real_save = StubAgent.save

    def save_then_signal(agent, path, step):
        real_save(agent, path, step)
        if not seen:  # the first agent's part is written: a second signal arrives mid-write
            seen.append(path)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)

    for agent in t.agents.values():
        agent.save = save_then_signal.__get__(agent)
    t.stop_signals.install()
    logger = Logger()
    try:
        with pytest.raises(ResumableStop):
            t.fit(logger, progress=False)
    finally:
        t.stop_signals.restore()
    assert seen and seen[0].endswith(os.path.join("global_step_2.tmp", "qwen_char"))
    out = capsys.readouterr().out
    assert "hacpo: SIGTERM during the stop: ignored, the checkpoint of step 2 is complete" in out
    assert checkpoint_problem(os.path.join(root, "ckpt", "global_step_2"), NAMES) is None
    resume_and_compare(root, reference, logger.steps)


def test_deadline_stops_before_a_step_that_would_not_fit(tmp_path, capsys):
    clock = {"now": 0.0}

    def hook(trainer, name):
        # by this clock each step takes 300 s; the deadline is at 1000 s
        trainer.stop_clock.clock = lambda: clock["now"]
        trainer.stop_clock.end_time = 1000.0
        if name == "update_weights":
            clock["now"] += 300.0
            trainer.stop_clock.note_step(300.0)

    t = stub_trainer(str(tmp_path / "run"), on_phase=hook, margin_s=0)
    with pytest.raises(ResumableStop) as stop:
        t.fit(Logger(), progress=False)
    # after step 2 (600 s) 400 s are left: under a step (300 s) plus a checkpoint (no write timed
    # yet, so a step's time stands in for it)
    assert stop.value.step == 2
    assert stop.value.reason.startswith("400 s left before the deadline, under the slowest step (300 s)")
    assert "hacpo: stopping before step 3: 400 s left" in capsys.readouterr().out


def test_time_limit_already_spent_stops_before_the_first_step(tmp_path):
    t = stub_trainer(str(tmp_path / "run"), time_limit_s=60, margin_s=10)
    t.started_at = time.time() - 55  # 5 s left, under the margin
    with pytest.raises(ResumableStop) as stop:
        t.fit(Logger(), progress=False)
    assert stop.value.step == 0 and "before the deadline" in stop.value.reason
    assert not os.path.exists(os.path.join(str(tmp_path / "run"), "ckpt"))  # nothing to save at step 0


# ============================================================================ end to end (Ray on CPU)
def _cli(out_dir: str, overrides: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "recipe_hacpo.main", "--config-name", "hacpo_cpu_demo",
        "trainer.logger=[console,file]", f"hydra.run.dir={out_dir}/hydra", "trainer.progress_bar=false", *overrides,
    ]


def _env(out_dir: str) -> dict:
    return dict(os.environ, VERL_FILE_LOGGER_PATH=os.path.join(out_dir, "metrics.jsonl"),
                HACPO_DATA_DIR=os.path.join(REPO, "data"))


def _steps(out_dir: str) -> dict[int, dict]:
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return {r["step"]: r["data"] for r in records if "training/global_step" in r["data"]}


# a metric that measures the machine rather than the training (wall times, throughput)
_MACHINE_METRICS = ("timing_s/", "/timing_s/", "perf/", "/perf/")


def _training_metrics(step: dict) -> dict:
    return {k: v for k, v in step.items() if not any(m in k for m in _MACHINE_METRICS)}


def _session_processes(sid: int) -> list[str]:
    """Command lines of the processes in session `sid` (the trainer's own, and a local Ray's)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getsid(int(entry)) != sid:
                continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, ProcessLookupError):
            continue
        found.append(f"{entry}: {cmd}")
    return found


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def _other_workers_processes() -> set[int]:
    """The other pytest-xdist workers of this run (this worker's siblings) and every process they
    started: whose shared memory is theirs while their tests run. Empty without xdist."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return set()
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found = set()
    todo = [pid for pid in children.get(os.getppid(), []) if pid != os.getpid()]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo.extend(children.get(pid, []))
    return found


def _shm_held_by(pids: set[int]) -> set[str]:
    """Names under /dev/shm that one of `pids` has mapped or open."""
    used = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                used.update(line.split("/dev/shm/", 1)[1].split()[0] for line in f if "/dev/shm/" in line)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("/dev/shm/"):
                    used.add(target[len("/dev/shm/"):].split()[0])
        except OSError:
            continue
    return used


def _shm_left_behind(before: set[str]) -> set[str]:
    """Segments made since `before` that the test on the other xdist worker does not hold: what
    the ended run left behind. (Without xdist: every segment made since `before`. A segment the
    other worker made between the two reads below is given a second look.)"""
    left = _shm() - before - _shm_held_by(_other_workers_processes())
    if left:
        time.sleep(1)
        left &= _shm() - _shm_held_by(_other_workers_processes())
    return left


@pytest.mark.e2e
@pytest.mark.ray
def test_e2e_sigusr1_to_the_process_group_mid_step_then_sigterm_mid_checkpoint_exits_75_and_resumes(
    tmp_path, warm_agent_paths, hacpo_pair_reference
):
    """`kill -USR1 -<pgid>` (the trainer and the local Ray it started) in step 2's rollout, with
    no grace (usr1_grace_s=0): step 2 is abandoned and step 1, not yet saved (save_freq=2), is
    checkpointed from the state kept at its end; a SIGTERM arrives while that checkpoint is
    written. The run exits 75 with the checkpoint complete and nothing of it left running; the
    same command resumes and the steps logged equal an uninterrupted run's."""
    common = agent_overrides(warm_agent_paths, HACPO_PAIR_KINDS) + HACPO_PAIR_RUN

    # the same run uninterrupted (conftest.py: these agents and settings; its checkpoints change
    # nothing it trains)
    expected = {s: _training_metrics(d) for s, d in hacpo_pair_reference[1].items()}
    assert sorted(expected) == [1, 2, 3]
    assert len({expected[s]["agent/qwen_char/actor/pg_loss"] for s in expected}) == 3  # the comparison has teeth

    ckpt = str(tmp_path / "ckpt")
    run = common + [f"trainer.default_local_dir={ckpt}", "trainer.save_freq=2", "trainer.preemption.usr1_grace_s=0",
                    f"trainer.preemption.record_file={tmp_path}/stop.json"]
    out = str(tmp_path / "stopped")
    progress = os.path.join(out, "progress.json")
    os.makedirs(out)
    shm_before = _shm()
    with open(os.path.join(out, "log.txt"), "w") as log:
        proc = subprocess.Popen(_cli(out, run + [f"trainer.progress_file={progress}"]), cwd=REPO, env=_env(out),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    torn = os.path.join(ckpt, "global_step_1.tmp")
    saw_tmp = False
    try:
        deadline = time.monotonic() + 900
        seen = None
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                with open(progress) as f:
                    seen = json.load(f)
            except (OSError, ValueError):
                seen = None
            if seen and (seen["step"], seen["phase"]) == (2, "gen"):
                break
            time.sleep(0.005)
        assert seen and (seen["step"], seen["phase"]) == (2, "gen"), f"never reached step 2's rollout: {seen}"
        os.killpg(proc.pid, signal.SIGUSR1)  # the trainer and every process of its local Ray
        while proc.poll() is None and time.monotonic() < deadline:
            if os.path.isdir(torn):
                saw_tmp = True
                os.kill(proc.pid, signal.SIGTERM)  # the second signal, mid-write
                break
            time.sleep(0.002)
        rc = proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
    text = open(os.path.join(out, "log.txt")).read()
    assert rc == RESUMABLE_EXIT, text[-4000:]
    assert saw_tmp, "the stop's checkpoint write was never seen under way"
    assert "hacpo: step 2: abandoning it before reward, nothing of it is saved: 0 s left" in text, text[-4000:]
    assert "hacpo: SIGTERM during the stop: ignored, the checkpoint of step 1 is complete" in text, text[-4000:]
    assert "hacpo: stopped to be resumed at step 1: " in text
    # the checkpoint of step 1 is complete and latest; nothing of step 2 was saved or logged
    assert open(os.path.join(ckpt, LATEST_FILE)).read().strip() == "1"
    # beside the checkpoints: the run's TensorBoard files (recipe_hacpo/training/run_metrics.py)
    assert sorted(os.listdir(ckpt)) == ["global_step_1", LATEST_FILE, "tensorboard"]
    assert checkpoint_problem(os.path.join(ckpt, "global_step_1"), NAMES) is None
    assert sorted(_steps(out)) == [1]
    assert json.load(open(tmp_path / "stop.json"))["step"] == 1
    # nothing of the run is left: no process of its session (the driver's local Ray included),
    # no new shared-memory segment
    left = _session_processes(proc.pid)
    for _ in range(100):
        if not left:
            break
        time.sleep(0.2)
        left = _session_processes(proc.pid)
    assert not left, left
    leaked = _shm_left_behind(shm_before)
    assert not leaked, leaked

    resumed = str(tmp_path / "resumed")
    proc = subprocess.run(_cli(resumed, run), cwd=REPO, env=_env(resumed), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    logged = {s: _training_metrics(d) for s, d in {**_steps(out), **_steps(resumed)}.items()}
    assert sorted(_steps(resumed)) == [2, 3] and sorted(logged) == [1, 2, 3]
    for step in (1, 2, 3):
        assert logged[step].keys() == expected[step].keys()
        for key, value in expected[step].items():
            assert math.isclose(logged[step][key], value, rel_tol=1e-6, abs_tol=1e-9), (step, key, value, logged[step][key])
