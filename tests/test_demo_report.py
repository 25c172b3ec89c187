"""The demo's closing report: summary.json in the documented shape, the table, the plot, and a
one-line error when the metrics lack a validation before or after training."""

from __future__ import annotations

import json

import pytest

from recipe_hacpo import demo_report


def _write(path, records):
    path.write_text("".join(json.dumps({"step": s, "data": d}) + "\n" for s, d in records))
    return path


def _run(n_steps=4):
    recs = [(0, {"agent/a/val/x/mean@1": 0.25, "agent/b/val/x/mean@1": 0.5})]
    for s in range(1, n_steps + 1):
        d = {"agent/a/reward/mean": 0.1 * s, "agent/b/reward/mean": 0.2, "agent/a/omega/b": 2.0,
             "agent/b/omega/a": 0.5, "agent/a/cross/rows": 32.0, "agent/b/cross/rows": 16.0}
        if s == n_steps:
            d.update({"agent/a/val/x/mean@1": 0.375, "agent/b/val/x/mean@1": 0.625})
        recs.append((s, d))
    return recs


def test_summary_table_and_plot(tmp_path, capsys):
    metrics = _write(tmp_path / "metrics.jsonl", _run())
    assert demo_report.main(["--metrics", str(metrics), "--out", str(tmp_path), "--seconds", "12.34"]) == 0
    s = json.loads((tmp_path / "summary.json").read_text())
    assert s["steps"] == 4 and s["seconds"] == 12.3
    assert s["agents"]["a"]["val_before"] == 0.25 and s["agents"]["a"]["val_after"] == 0.375
    assert s["agents"]["b"]["val_before"] == 0.5 and s["agents"]["b"]["val_after"] == 0.625
    assert s["agents"]["a"]["omega_mean"] == {"b": 2.0} and s["agents"]["b"]["cross_rows_per_step"] == 16.0
    assert s["agents"]["a"]["reward_first"] == pytest.approx(0.25)  # mean of 0.1..0.4
    assert (tmp_path / "learning_curve.png").stat().st_size > 1000
    out = capsys.readouterr().out
    assert "| a | 25.0 % | 37.5 % | 0.250 → 0.250 | 2.00 (b) | 32 |" in out


def test_missing_validation_is_one_line(tmp_path, capsys):
    recs = [r for r in _run() if r[0] != 0]
    metrics = _write(tmp_path / "metrics.jsonl", recs)
    assert demo_report.main(["--metrics", str(metrics), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "metrics.jsonl" in err and "agent 'a'" in err


def test_corrupt_metrics_line_is_named(tmp_path, capsys):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 0, "data": {}}\nnot json\n')
    assert demo_report.main(["--metrics", str(metrics), "--out", str(tmp_path)]) == 2
    assert "metrics.jsonl:2" in capsys.readouterr().err
