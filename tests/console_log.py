"""Reads the metrics of verl's console logger (`step:N - key:value - ...`) from a run's output."""

from __future__ import annotations

import re

_STEP_LINE = re.compile(r"step:(\d+) - (.*)")
_METRIC = re.compile(r"([\w/@.\-]+):(?:np\.\w+\()?(-?(?:\d+\.?\d*(?:e[+-]?\d+)?|nan|inf))")


def parse_console_steps(log: str) -> dict[int, dict[str, float]]:
    """{step: {metric: value}} for every console metrics line of `log`."""
    steps: dict[int, dict[str, float]] = {}
    for line in log.splitlines():
        match = _STEP_LINE.search(line)
        if match:
            steps[int(match.group(1))] = {k: float(v) for k, v in _METRIC.findall(match.group(2))}
    return steps
