"""Peak memory of a command and everything it starts (Ray's raylet, workers, vLLM engines).

    python benchmarks/peak_memory.py [--interval 0.5] -- make test-vllm

Samples, every `--interval` seconds until the command ends, two figures and prints their peaks:

- tree PSS: the proportional set size summed over the command's process tree (shared pages
  split between the processes that map them, so a page counts once in all);
- system used: MemTotal − MemAvailable of /proc/meminfo, less its value just before the start.
  It also counts what the tree leaves outside its processes (shared memory under /dev/shm,
  page cache it dirtied) and whatever else runs on the machine: on a quiet machine it is the
  upper figure.

Processes that leave the tree (Ray's daemons re-parent to init when their driver dies) are
still counted while they live: every process seen once is followed by pid and start time.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

import psutil

GIB = 1024**3


def system_used_bytes() -> int:
    fields = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":", 1)
            fields[key] = int(value.split()[0]) * 1024
    return fields["MemTotal"] - fields["MemAvailable"]


def tree_pss_bytes(root: psutil.Process, known: dict[tuple[int, float], psutil.Process]) -> tuple[int, int]:
    """(PSS summed over the tree and every process ever seen in it that still lives, their count)."""
    try:
        for proc in [root, *root.children(recursive=True)]:
            try:
                known.setdefault((proc.pid, proc.create_time()), proc)
            except psutil.Error:
                pass
    except psutil.Error:
        pass
    total, alive = 0, 0
    for key, proc in list(known.items()):
        try:
            total += proc.memory_full_info().pss
            alive += 1
        except psutil.Error:
            known.pop(key)
    return total, alive


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--interval", type=float, default=0.5, help="seconds between samples")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command given (put it after --)")

    baseline = system_used_bytes()
    start = time.monotonic()
    child = subprocess.Popen(command)
    root = psutil.Process(child.pid)
    known: dict[tuple[int, float], psutil.Process] = {}
    peak_pss = peak_system = peak_procs = 0
    peak_pss_at = peak_system_at = 0.0
    while child.poll() is None:
        pss, procs = tree_pss_bytes(root, known)
        system = system_used_bytes() - baseline
        now = time.monotonic() - start
        if pss > peak_pss:
            peak_pss, peak_pss_at = pss, now
        if system > peak_system:
            peak_system, peak_system_at = system, now
        peak_procs = max(peak_procs, procs)
        time.sleep(args.interval)
    wall = time.monotonic() - start
    print(f"command: {' '.join(command)}")
    print(f"exit code: {child.returncode}; wall {wall:.0f} s")
    print(f"peak tree PSS: {peak_pss / GIB:.2f} GiB at {peak_pss_at:.0f} s (up to {peak_procs} processes)")
    print(f"peak system used above the start: {peak_system / GIB:.2f} GiB at {peak_system_at:.0f} s "
          f"(baseline {baseline / GIB:.2f} GiB)")
    return child.returncode


if __name__ == "__main__":
    sys.exit(main())
