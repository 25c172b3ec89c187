"""Progress a log file can hold (recipe_hacpo/training/progress.py): a long phase says so once it has run
`after_s` and then every `every_s`; each finished step is one line with elapsed time and ETA."""

from __future__ import annotations

import re
import time

from recipe_hacpo.training.progress import ProgressLines


def test_long_phases_and_finished_steps_are_plain_lines():
    lines: list[str] = []
    progress = ProgressLines(total_steps=4, first_step=1, after_s=0.2, every_s=0.5, write=lines.append)
    try:
        progress.phase(2, "gen")
        time.sleep(0.1)
        assert lines == []  # a short phase says nothing
        time.sleep(1.0)
        said = [line for line in lines if line.startswith("hacpo: step 2: gen running for ")]
        assert 1 <= len(said) <= 3, lines  # at 0.2 s, then every 0.5 s (a loaded machine may say less)
        progress.step_done(2, 1.25)
        progress.phase(3, "update_actor")
        time.sleep(0.05)
        progress.step_done(3, 0.1)
        time.sleep(0.5)
    finally:
        progress.close()
    steps = [line for line in lines if " done in " in line]
    # one step took the run's ~1.1 s so far: two more take about twice that
    assert re.fullmatch(r"hacpo: step 2/4 done in 1\.2 s; elapsed 0:00:0[1-3], ETA 0:00:0[2-7]", steps[0]), steps[0]
    assert steps[1].startswith("hacpo: step 3/4 done in 0.1 s")
    assert not any("update_actor" in line for line in lines)  # finished before after_s
    assert all("\r" not in line and "\n" not in line for line in lines)
