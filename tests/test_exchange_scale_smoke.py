"""A tiny smoke of benchmarks/exchange_scale.py (quick tier): two and three agents on the real
tokenizers, a few short rows; the table has a row per N, the learner batches of the background
jobs equal the serial ones, and the numbers are numbers."""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_exchange_scale_smoke(capsys):
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    try:
        import exchange_scale
    finally:
        sys.path.pop(0)
    exchange_scale.main(["--agents", "2", "3", "--prompts", "2", "--n", "2", "--prompt-tokens", "16",
                         "--response-tokens", "24", "--window-s", "0", "0.05"])
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| 2 |") or line.startswith("| 3 |")]
    assert len(rows) == 2, out
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[-1] == "yes"  # overlapped learner batches identical to the serial ones
        assert all(float(c.split(" ")[0]) >= 0 for c in cells[2:-1])  # tokens, seconds and rates
    assert rows[0].split("|")[2].strip() == "2 / 0" and rows[1].split("|")[2].strip() == "4 / 2"  # shared pairs: fast path
    assert "TOKENIZERS_PARALLELISM=" in out and "load " in out
