"""Where a command's CPU time goes, process by process (Ray's actors by their class name).

    python benchmarks/cpu_by_process.py [--interval 0.5] [--top 20] -- \
        .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_e2e.py -k isolated_mode_shares_nothing

Follows the command's process tree every `--interval` seconds (a process that leaves the tree,
as Ray's daemons do when their driver exits, is still followed) and keeps each process's CPU time
(user + system) as last seen. Processes are grouped by role: a Ray worker by the name Ray gives
its process (`ray::HFRolloutServer`, `ray::IDLE` for a prestarted worker that never held an
actor), any other process by its program and first argument. Prints, per role, the processes and
their CPU seconds, then the total against the wall time and the machine's cores.

A process that ends between two samples loses at most one interval of CPU time; a command whose
processes live shorter than an interval is undercounted, so the total is a lower bound.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections import defaultdict
from dataclasses import dataclass

import psutil


@dataclass
class Seen:
    process: psutil.Process
    cpu_s: float = 0.0
    role: str = ""


def role_of(cmdline: list[str]) -> str:
    """A process's role: Ray's process title (`ray::Name`), else program and first argument."""
    if not cmdline:
        return ""
    if cmdline[0].startswith("ray::"):
        # `ray::Class.method` while a method runs, `ray::Class` between calls
        return cmdline[0].split()[0].split(".")[0]
    program = os.path.basename(cmdline[0])
    if len(cmdline) > 2 and cmdline[1] == "-m":
        return f"{program} -m {cmdline[2]}"
    if len(cmdline) > 1 and cmdline[1] == "-c":
        return f"{program} -c"
    first = next((w for w in cmdline[1:] if not w.startswith("-")), "")
    return f"{program} {os.path.basename(first)}".strip()


def better_role(old: str, new: str) -> str:
    """Keep the most telling name a process had: an actor's name over `ray::IDLE`, any Ray
    name over the worker script Ray started it with."""
    if not new:
        return old
    if new.startswith("ray::") and new != "ray::IDLE":
        return new
    if old.startswith("ray::") and old != "ray::IDLE":
        return old
    if new == "ray::IDLE" or not old:
        return new
    return old


def sample(root: psutil.Process, seen: dict[tuple[int, float], Seen]) -> None:
    try:
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:
        tree = []
    for proc in tree:
        try:
            seen.setdefault((proc.pid, proc.create_time()), Seen(proc))
        except psutil.Error:
            pass
    for entry in seen.values():
        try:
            with entry.process.oneshot():
                times = entry.process.cpu_times()
                cmdline = entry.process.cmdline()
        except psutil.Error:
            continue
        entry.cpu_s = times.user + times.system
        entry.role = better_role(entry.role, role_of(cmdline))


def by_role(seen: dict[tuple[int, float], Seen]) -> list[tuple[str, int, float]]:
    """(role, processes, CPU seconds), largest CPU first."""
    count: dict[str, int] = defaultdict(int)
    cpu: dict[str, float] = defaultdict(float)
    for entry in seen.values():
        role = entry.role or "(unnamed)"
        count[role] += 1
        cpu[role] += entry.cpu_s
    return sorted(((r, count[r], cpu[r]) for r in cpu), key=lambda row: -row[2])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between samples")
    parser.add_argument("--top", type=int, default=20, help="roles to print")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (put it after --)")

    seen: dict[tuple[int, float], Seen] = {}
    start = time.monotonic()
    proc = subprocess.Popen(command)
    root = psutil.Process(proc.pid)
    while proc.poll() is None:
        sample(root, seen)
        time.sleep(args.interval)
    sample(root, seen)
    wall = time.monotonic() - start

    rows = by_role(seen)
    total = sum(cpu for _, _, cpu in rows)
    cores = os.cpu_count() or 1
    print(f"{'CPU s':>8} {'procs':>5}  role")
    for role, count, cpu in rows[: args.top]:
        print(f"{cpu:8.1f} {count:5d}  {role}")
    if len(rows) > args.top:
        rest = rows[args.top:]
        print(f"{sum(c for _, _, c in rest):8.1f} {sum(n for _, n, _ in rest):5d}  ({len(rest)} more roles)")
    print(f"total {total:.1f} CPU s in {wall:.1f} s wall on {cores} cores "
          f"({100 * total / (wall * cores):.0f} % of the machine); exit status {proc.returncode}")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
