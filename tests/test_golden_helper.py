"""tests/helpers/golden.py: exact on the recording machine's kernels, within a tolerance elsewhere
that other kernels' summation order stays inside and a changed sample, reward or count does not."""

from __future__ import annotations

import json

import pytest

from helpers import golden

RECORDED = {"1": {"agent/a/actor/grad_norm": 1.4253851175308228, "agent/a/reward/mean": 0.25,
                  "agent/a/rollout/log_prob_diff_max": 9.5367431640625e-07, "agent/a/cross_rows": 16,
                  "agent/a/actor/pg_clipfrac": float("nan")}}


def _write(tmp_path, machine):
    record = {**({golden.MACHINE_KEY: machine} if machine else {}), **RECORDED}
    (tmp_path / "run.json").write_text(json.dumps(record))


def _steps(**changes):
    return {1: {**RECORDED["1"], **changes, "timing_s/step": 3.0}}


def test_on_another_machine_kernel_noise_passes_and_a_changed_run_does_not(tmp_path):
    _write(tmp_path, "another machine")
    # the moves seen between two AVX-512 machines
    golden.check_golden("run", _steps(**{"agent/a/actor/grad_norm": 1.4252984523773193,
                                         "agent/a/rollout/log_prob_diff_max": 4.76837158203125e-07}), golden_dir=tmp_path)
    for changed in ({"agent/a/actor/grad_norm": 1.43}, {"agent/a/reward/mean": 0.3125},
                    {"agent/a/cross_rows": 17}, {"agent/a/actor/pg_clipfrac": 0.0}):
        with pytest.raises(AssertionError, match="compared within rel"):
            golden.check_golden("run", _steps(**changed), golden_dir=tmp_path)


def test_on_the_recording_machine_every_bit_counts(tmp_path):
    _write(tmp_path, golden.machine_signature())
    golden.check_golden("run", _steps(), golden_dir=tmp_path)
    with pytest.raises(AssertionError, match="compared exactly"):
        golden.check_golden("run", _steps(**{"agent/a/actor/grad_norm": 1.4253851175308226}), golden_dir=tmp_path)


def test_a_file_without_its_machine_is_compared_within_the_tolerance(tmp_path):
    _write(tmp_path, None)
    golden.check_golden("run", _steps(**{"agent/a/actor/grad_norm": 1.4252984523773193}), golden_dir=tmp_path)


def test_recording_keeps_the_machine_and_drops_the_timings(tmp_path, monkeypatch):
    monkeypatch.setenv(golden.RECORD_ENV, "1")
    golden.check_golden("run", _steps(), golden_dir=tmp_path)
    record = json.loads((tmp_path / "run.json").read_text())
    assert record[golden.MACHINE_KEY] == golden.machine_signature()
    assert "timing_s/step" not in record["1"] and record["1"]["agent/a/reward/mean"] == 0.25
    monkeypatch.delenv(golden.RECORD_ENV)
    golden.check_golden("run", _steps(), golden_dir=tmp_path)


def test_a_missing_or_extra_metric_fails_everywhere(tmp_path):
    _write(tmp_path, "another machine")
    with pytest.raises(AssertionError, match="only on one side"):
        golden.check_golden("run", _steps(**{"agent/a/new": 1.0}), golden_dir=tmp_path)


def _tape(root, tokens_by_agent):
    from recipe_hacpo.workers.sample_tape import write_tape

    for agent, tape in tokens_by_agent.items():
        write_tape(tape, root / agent / "tape.jsonl")
    return root


TAPE = {"a": {11: [5, 6, 2], 12: [7, 2]}, "b": {11: [9, 2]}}


def test_another_machine_replays_the_recorded_tape_and_the_recording_machine_samples_itself(tmp_path, monkeypatch):
    _write(tmp_path, "another machine")
    assert golden.golden_run_overrides("run", "/out", tmp_path) == [
        "trainer.record_samples_dir=/out/samples", f"trainer.replay_samples_dir={tmp_path / 'samples' / 'run'}"]
    _write(tmp_path, golden.machine_signature())
    assert golden.golden_run_overrides("run", "/out", tmp_path) == ["trainer.record_samples_dir=/out/samples"]
    _write(tmp_path, "another machine")
    monkeypatch.setenv(golden.RECORD_ENV, "1")  # recording samples for itself
    assert golden.replay_overrides("run", tmp_path) == []


def test_recording_keeps_the_run_tape_sorted_by_agent_and_seed(tmp_path, monkeypatch):
    from recipe_hacpo.workers.sample_tape import TapeRecorder

    run = tmp_path / "out"
    for agent, tape in TAPE.items():  # two processes of agent a
        for i, (seed, tokens) in enumerate(sorted(tape.items(), reverse=True)):
            recorder = TapeRecorder(run / agent)
            recorder.path = recorder.path.with_name(f"p{i}.jsonl")
            recorder.append([seed], [tokens])
    monkeypatch.setenv(golden.RECORD_ENV, "1")
    golden.check_golden("run", _steps(), run, golden_dir=tmp_path)
    assert golden.run_tape(tmp_path / "samples" / "run") == TAPE
    assert (tmp_path / "samples" / "run" / "a" / "tape.jsonl").read_text().splitlines()[0].startswith('{"seed":11,')


@pytest.mark.parametrize("machine", ["here", "another machine"])
def test_a_run_whose_samples_differ_from_the_tape_fails_on_every_machine(tmp_path, machine):
    _write(tmp_path, golden.machine_signature() if machine == "here" else machine)
    _tape(tmp_path / "samples" / "run", TAPE)
    golden.check_golden("run", _steps(), _tape(tmp_path / "same", TAPE), golden_dir=tmp_path)
    other_token = {**TAPE, "a": {11: [5, 6, 2], 12: [8, 2]}}
    with pytest.raises(AssertionError, match=r"run \(a\): .* drew other tokens in 1 of 2 requests \(first seed 12\)"):
        golden.check_golden("run", _steps(), _tape(tmp_path / "token", other_token), golden_dir=tmp_path)
    other_seed = {**TAPE, "b": {13: [9, 2]}}
    with pytest.raises(AssertionError, match=r"run \(b\): .* other seeds"):
        golden.check_golden("run", _steps(), _tape(tmp_path / "seed", other_seed), golden_dir=tmp_path)
    with pytest.raises(AssertionError, match="tapes of agents"):
        golden.check_golden("run", _steps(), _tape(tmp_path / "agents", {"a": TAPE["a"]}), golden_dir=tmp_path)


def test_a_difference_of_log_probs_has_the_noise_floor_of_a_large_vocabulary_log_softmax(tmp_path):
    """ppo_kl and the engine/trainer differences may move 5e-5 on another machine (a 152k-id
    fp32 log-softmax is exact to ~1e-5); any other small value keeps the 1e-5 floor."""
    (tmp_path / "run.json").write_text(json.dumps({golden.MACHINE_KEY: "another machine", "1": {
        "agent/a/actor/ppo_kl": 0.007472, "agent/a/rollout/log_prob_diff_max": 1e-6, "agent/a/actor/pg_loss": 0.00054}}))
    golden.check_golden("run", {1: {"agent/a/actor/ppo_kl": 0.007457, "agent/a/rollout/log_prob_diff_max": 4e-5,
                                    "agent/a/actor/pg_loss": 0.00054}}, golden_dir=tmp_path)
    with pytest.raises(AssertionError, match="pg_loss"):
        golden.check_golden("run", {1: {"agent/a/actor/ppo_kl": 0.007472, "agent/a/rollout/log_prob_diff_max": 1e-6,
                                        "agent/a/actor/pg_loss": 0.00052}}, golden_dir=tmp_path)
    with pytest.raises(AssertionError, match="ppo_kl"):
        golden.check_golden("run", {1: {"agent/a/actor/ppo_kl": 0.0074, "agent/a/rollout/log_prob_diff_max": 1e-6,
                                        "agent/a/actor/pg_loss": 0.00054}}, golden_dir=tmp_path)
