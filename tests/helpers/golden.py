"""Golden training metrics: what fixed-seed runs of every method logged, kept in tests/golden/.

The end-to-end tests that run a method through `python -m recipe_hacpo.main` hand their per-step
records to `check_golden`, which compares every training metric (the machine's timings and
throughput excluded) with the file recorded for that run: a change of the code's shape must leave
what a run trains on and reports untouched. A deliberate change of behaviour re-records them:
`HACPO_RECORD_GOLDEN=1 pytest <the test>`, and the diff of tests/golden/ shows what moved.

Exactly, on a machine like the one that recorded the file (its `_machine` entry: the CPU's vector
instruction sets, torch's kernel level and version): the same kernels give the same bits. On any
other machine a float may move within `REL_TOL` / `ABS_TOL`: other vector kernels add in another
order. Measured between two x86 machines with AVX-512 (one with AMX), on the tiny Qwen2/Llama
agents: grad_norm 6e-5 apart relative, losses 2e-5, ppo_kl (a small difference of log-probs) up
to 9e-6 absolute, the engine/trainer differences (noise near 1e-8) up to 5e-7; rewards, lengths
and sampled tokens equal. Rewards and counts move by whole samples, far past the tolerance;
everything that is not a float is compared exactly everywhere. Agents with the real 150k-id
vocabularies sampled other tokens on the other machine: their files must be recorded on a
machine of the kind that compares them.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "golden"
RECORD_ENV = "HACPO_RECORD_GOLDEN"
MACHINE_KEY = "_machine"
REL_TOL, ABS_TOL = 1e-3, 1e-5

# what the machine measures, not what the run trained: timings and throughput
MACHINE_METRICS = ("timing_s/", "/timing_s/", "perf/", "/perf/")


def training_metrics(step: dict) -> dict:
    """One step's record without the machine's figures."""
    return {k: v for k, v in step.items() if not any(m in k for m in MACHINE_METRICS)}


def machine_signature() -> str:
    """What decides which CPU kernels a run gets: architecture, torch version and its kernel level,
    the CPU's vector instruction sets."""
    import platform

    import torch

    flags: list[str] = []
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
        flags = sorted(x for x in line.partition(":")[2].split() if x.startswith(("avx", "amx", "fma", "sse", "f16c")))
    except OSError:
        pass
    return " ".join([platform.machine(), f"torch-{torch.__version__}", torch.backends.cpu.get_cpu_capability(), *flags])


def same_value(want, got, *, exact: bool) -> bool:
    if want == got:
        return True
    if isinstance(want, float) and isinstance(got, float):
        if math.isnan(want) or math.isnan(got):
            return math.isnan(want) and math.isnan(got)
        return not exact and math.isclose(want, got, rel_tol=REL_TOL, abs_tol=ABS_TOL)
    return False


def check_golden(name: str, steps: dict[int, dict], golden_dir: Path = GOLDEN_DIR) -> None:
    """Compare (or, with HACPO_RECORD_GOLDEN=1, record) the training metrics of `steps`
    ({step: verl's logged data}) against tests/golden/<name>.json."""
    got = {str(step): training_metrics(data) for step, data in sorted(steps.items())}
    path = golden_dir / f"{name}.json"
    if os.environ.get(RECORD_ENV):
        golden_dir.mkdir(exist_ok=True)
        path.write_text(json.dumps({MACHINE_KEY: machine_signature(), **got}, indent=1, sort_keys=True) + "\n")
        return
    assert path.exists(), f"{path} missing: record it with {RECORD_ENV}=1"
    want = json.loads(path.read_text())
    exact = want.pop(MACHINE_KEY, None) == machine_signature()
    how = "exactly (the recording machine's kernels)" if exact else f"within rel {REL_TOL:g} / abs {ABS_TOL:g}"
    assert sorted(got) == sorted(want), (name, sorted(got), sorted(want))
    for step, metrics in want.items():
        missing = sorted(set(metrics) ^ set(got[step]))
        assert not missing, f"{name} step {step}: metrics only on one side: {missing}"
        moved = [(k, v, got[step][k]) for k, v in metrics.items() if not same_value(v, got[step][k], exact=exact)]
        assert not moved, f"{name} step {step}: {len(moved)} metrics moved (compared {how}), first {moved[:5]}"
