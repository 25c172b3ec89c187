"""Paths of the task's data, logging, the machine line and mean ± std formatting."""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections import Counter

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA_DIR = os.path.join(REPO, "data")
TRAIN_FILE = os.path.join(DATA_DIR, "arith_add3_train.parquet")
VAL_FILE = os.path.join(DATA_DIR, "arith_add3_test.parquet")
VAL_SOURCE = "hacpo/arith/add3"


def log(msg: str) -> None:
    print(f"[miniature {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def machine(load: bool = True) -> str:
    """This machine in one line; with `load`, its load average now."""
    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = ""
    try:
        with open("/proc/meminfo") as f:
            kb = int(f.readline().split()[1])
            mem = f", {kb / 2**20:.0f} GiB RAM"
    except (OSError, ValueError, IndexError):
        pass
    load_now = ""
    try:
        load_now = ", load average now %.1f / %.1f / %.1f (1/5/15 min)" % os.getloadavg() if load else ""
    except OSError:
        pass
    return (f"{os.cpu_count()} CPU cores ({cpu}){mem}, no GPU, {platform.system()} {platform.release()}, "
            f"Python {platform.python_version()}{load_now}")


def mean_std(values: list[float]) -> tuple[float, float]:
    if not values:
        return float("nan"), float("nan")
    m = statistics.fmean(values)
    s = statistics.stdev(values) if len(values) > 1 else 0.0
    return m, s


def fmt_pm(values: list[float], scale: float = 100.0, digits: int = 1) -> str:
    if not values:
        return "—"
    m, s = mean_std(values)
    if len(values) == 1:
        return f"{m * scale:.{digits}f}"
    return f"{m * scale:.{digits}f} ± {s * scale:.{digits}f}"


def machines_line(summaries: list[dict]) -> str:
    """Where the reported runs were made (each summary records its machine) and where the report is
    written: a report rebuilt from cached runs elsewhere must not pass this machine off as theirs."""
    made = Counter(s.get("machine", "") for s in summaries)
    parts = [f"{m} ({n} runs)" for m, n in sorted(made.items()) if m]
    if made.get(""):
        parts.append(f"not recorded for {made['']} runs (made before summaries recorded it)")
    return f"Runs made on: {'; '.join(parts) or 'no runs'}. Report written on: {machine()}."
