"""Block until a Ray cluster reports the GPUs (and nodes) a job expects, or give up.

    python run_scripts/slurm/wait_for_ray.py --address HOST:PORT --gpus 16 --nodes 2 --timeout 600

Exit status 0 once the cluster has at least that many GPUs on at least that many live nodes,
1 on timeout (the last count is printed, so a missing node is easy to spot), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import os
import re
import socket
import subprocess
import sys
import time
from typing import Callable


_reported: set[str] = set()

# a line of Ray's C++ log: "[2026-01-01 10:00:00,000 W 187 187] gcs_client.cc:210: <what happened>"
_NATIVE_LOG = re.compile(r"^\[[^\]]* [WEF] [^\]]*\] \S+:\d+: (.*)$")


def _report(message: str) -> None:
    if message not in _reported:
        print(message, file=sys.stderr, flush=True)
        _reported.add(message)


def _port_open(address: str, timeout_s: float = 2.0) -> bool:
    """Whether HOST:PORT (or [IPv6]:PORT) accepts TCP connections; True for 'auto'."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return True
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except OSError:
        return False


def probe_cluster(address: str, timeout_s: float = 60.0) -> tuple[int, int]:
    """(GPUs, live nodes) the cluster at `address` reports now; (0, 0) while it is unreachable.

    The Ray client runs in a child process with a deadline: `ray.init` keeps retrying for a
    long time against a head that is not up.
    """
    if not _port_open(address):
        _report(f"{address}: not accepting connections yet")
        return 0, 0
    try:
        proc = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--probe", "--address", address],
            capture_output=True, text=True, timeout=timeout_s,
        )
    except subprocess.TimeoutExpired:
        _report(f"{address}: ray.init did not connect within {timeout_s:g} s")
        return 0, 0
    fields = proc.stdout.split()
    if proc.returncode != 0 or len(fields) < 2:
        _report(f"{address}: probe failed: {failure_reason(proc.stderr)}")
        return 0, 0
    return int(fields[-2]), int(fields[-1])


def failure_reason(stderr: str) -> str:
    """The probe's last line, with the reason Ray's C++ client logged when that line lacks it.

    A refused connection (a wrong or missing auth token, a version mismatch) is logged by the
    GCS client on every retry and then raised as a bare "ConnectionError: Failed to connect".
    """
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    if not lines:
        return "no output"
    native = [m.group(1) for m in map(_NATIVE_LOG.match, lines) if m]
    if native and native[-1] not in lines[-1]:
        return f"{lines[-1]} ({native[-1]})"
    return lines[-1]


def _probe_here(address: str) -> None:
    import ray

    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    try:
        gpus = int(ray.cluster_resources().get("GPU", 0))
        nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
    finally:
        ray.shutdown()
    print(gpus, nodes)


def wait_for(
    gpus: int,
    nodes: int,
    timeout_s: float,
    interval_s: float,
    probe: Callable[[], tuple[int, int]],
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    log: Callable[[str], None] = lambda line: print(line, flush=True),
) -> tuple[int, int]:
    """Poll `probe` until it reports >= `gpus` GPUs and >= `nodes` nodes; TimeoutError after `timeout_s`."""
    deadline = clock() + timeout_s
    last = None
    while True:
        have_gpus, have_nodes = probe()
        if have_gpus >= gpus and have_nodes >= nodes:
            log(f"ray cluster ready: {have_gpus} GPUs on {have_nodes} nodes")
            return have_gpus, have_nodes
        if (have_gpus, have_nodes) != last:
            log(f"waiting for ray: {have_gpus}/{gpus} GPUs on {have_nodes}/{nodes} nodes")
            last = (have_gpus, have_nodes)
        if clock() >= deadline:
            raise TimeoutError(
                f"ray cluster has {have_gpus}/{gpus} GPUs on {have_nodes}/{nodes} nodes after {timeout_s:g} s; "
                "check the ray start output of the missing nodes"
            )
        sleep(interval_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", required=True, help="head node HOST:PORT (or 'auto')")
    parser.add_argument("--gpus", type=int, help="GPUs the cluster must report")
    parser.add_argument("--nodes", type=int, default=1, help="live nodes the cluster must report")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before giving up")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between checks")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.probe:
        _probe_here(args.address)
        return 0
    if args.gpus is None or args.gpus < 0 or args.nodes < 1 or args.timeout < 0 or args.interval <= 0:
        parser.error("need --gpus >= 0, --nodes >= 1, --timeout >= 0 and --interval > 0")
    try:
        wait_for(args.gpus, args.nodes, args.timeout, args.interval, lambda: probe_cluster(args.address))
    except TimeoutError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
