"""Block until a Ray cluster reports the GPUs (and nodes) a job expects, or give up.

    python run_scripts/slurm/wait_for_ray.py --address HOST:PORT --gpus 16 --nodes 2 --timeout 600

Exit status 0 once the cluster has at least that many GPUs on at least that many live nodes,
1 on timeout (the last count is printed, so a missing node is easy to spot), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Callable


def probe_cluster(address: str) -> tuple[int, int]:
    """(GPUs, live nodes) the cluster at `address` reports now; (0, 0) while it is unreachable."""
    import ray

    try:
        ray.init(address=address, logging_level="ERROR", log_to_driver=False, include_dashboard=False)
    except Exception:
        return 0, 0
    try:
        gpus = int(ray.cluster_resources().get("GPU", 0))
        nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
        return gpus, nodes
    finally:
        ray.shutdown()


def wait_for(
    gpus: int,
    nodes: int,
    timeout_s: float,
    interval_s: float,
    probe: Callable[[], tuple[int, int]],
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    log: Callable[[str], None] = print,
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
    parser.add_argument("--gpus", type=int, required=True, help="GPUs the cluster must report")
    parser.add_argument("--nodes", type=int, default=1, help="live nodes the cluster must report")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds before giving up")
    parser.add_argument("--interval", type=float, default=5.0, help="seconds between checks")
    args = parser.parse_args(argv)
    if args.gpus < 0 or args.nodes < 1 or args.timeout < 0 or args.interval <= 0:
        parser.error("need --gpus >= 0, --nodes >= 1, --timeout >= 0 and --interval > 0")
    try:
        wait_for(args.gpus, args.nodes, args.timeout, args.interval, lambda: probe_cluster(args.address))
    except TimeoutError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
