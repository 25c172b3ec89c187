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
                                         "agent/a/rollout/log_prob_diff_max": 4.76837158203125e-07}), tmp_path)
    for changed in ({"agent/a/actor/grad_norm": 1.43}, {"agent/a/reward/mean": 0.3125},
                    {"agent/a/cross_rows": 17}, {"agent/a/actor/pg_clipfrac": 0.0}):
        with pytest.raises(AssertionError, match="compared within rel"):
            golden.check_golden("run", _steps(**changed), tmp_path)


def test_on_the_recording_machine_every_bit_counts(tmp_path):
    _write(tmp_path, golden.machine_signature())
    golden.check_golden("run", _steps(), tmp_path)
    with pytest.raises(AssertionError, match="compared exactly"):
        golden.check_golden("run", _steps(**{"agent/a/actor/grad_norm": 1.4253851175308226}), tmp_path)


def test_a_file_without_its_machine_is_compared_within_the_tolerance(tmp_path):
    _write(tmp_path, None)
    golden.check_golden("run", _steps(**{"agent/a/actor/grad_norm": 1.4252984523773193}), tmp_path)


def test_recording_keeps_the_machine_and_drops_the_timings(tmp_path, monkeypatch):
    monkeypatch.setenv(golden.RECORD_ENV, "1")
    golden.check_golden("run", _steps(), tmp_path)
    record = json.loads((tmp_path / "run.json").read_text())
    assert record[golden.MACHINE_KEY] == golden.machine_signature()
    assert "timing_s/step" not in record["1"] and record["1"]["agent/a/reward/mean"] == 0.25
    monkeypatch.delenv(golden.RECORD_ENV)
    golden.check_golden("run", _steps(), tmp_path)


def test_a_missing_or_extra_metric_fails_everywhere(tmp_path):
    _write(tmp_path, "another machine")
    with pytest.raises(AssertionError, match="only on one side"):
        golden.check_golden("run", _steps(**{"agent/a/new": 1.0}), tmp_path)
