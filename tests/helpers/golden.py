"""Golden training metrics: what fixed-seed runs of every method logged, kept in tests/golden/.

The end-to-end tests that run a method through `python -m recipe_hacpo.main` hand their per-step
records to `check_golden`, which compares every training metric (the machine's timings and
throughput excluded) with the file recorded for that run: a change of the code's shape must leave
what a run trains on and reports untouched. A deliberate change of behaviour re-records them:
`HACPO_RECORD_GOLDEN=1 pytest <the test>`, and the diff of tests/golden/ shows what moved.

What a run samples is fixed by a tape, not by the machine. Each golden run records the tokens of
every sampled request (`trainer.record_samples_dir`, workers/sample_tape.py); the recording kept
its tape beside the metrics, in tests/golden/samples/<run>/<agent>/tape.jsonl. Why: other CPU
kinds (AMX or not, AVX-512 or AVX2) run other matmul and softmax kernels whose logits differ in
the last bits, and a Gumbel-max draw whose two best candidates are that close picks another
token. Agents with the real 128k-152k-id vocabularies hit such a draw within two steps (measured
between an Intel AVX-512+AMX and an AMD AVX-512 machine); from then on the runs score other
rewards, share other groups and no tolerance can compare them.

So, where each comparison is exact and why:
- On a machine like the one that recorded the file (its `_machine` entry: the CPU's vector
  instruction sets, torch's kernel level and version) the run samples for itself, and both its
  tape and every metric must equal the recording bit for bit: the same kernels give the same
  bits, so this also holds the sampling path (seeds, warpers, Gumbel noise) to the recording.
- On any other machine the run replays the recorded tape (`golden_run_overrides` adds
  `trainer.replay_samples_dir`): the responses are the recorded ones token for token, and so are
  everything decided by them: rewards, correct counts, capabilities, the exchange's selections
  and row counts, lengths. Those, and every value that is not a float, are compared exactly.
  Floats are computed here from the same tokens by other kernels and may move within `REL_TOL` /
  `ABS_TOL`, or `LOGPROB_ABS_TOL` for a difference of two log-prob computations (ppo_kl, the
  engine/trainer differences). Measured between two x86 machines with AVX-512 (one with AMX), on
  the tiny Qwen2/Llama agents: grad_norm 6e-5 apart relative, losses 2e-5, ppo_kl up to 9e-6
  absolute, the engine/trainer differences (noise near 1e-8) up to 5e-7; on the real-tokenizer
  agents under `make test-other-kernels`, ppo_kl up to 1.9e-5 absolute.
- The agents start from the same bits everywhere (tests/conftest.py's kept warm-start states).
A changed formula, exchange or selection moves a loss, a count or a reward past the tolerance on
every machine; a changed sampler fails the tape comparison on the recording kind.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

GOLDEN_DIR = Path(__file__).resolve().parents[1] / "golden"
TAPES = "samples"  # tests/golden/samples/<run>/<agent>/tape.jsonl
RECORD_ENV = "HACPO_RECORD_GOLDEN"
MACHINE_KEY = "_machine"
REL_TOL, ABS_TOL = 1e-3, 1e-5
# differences of two log-prob computations: a log-softmax over a 128k-152k-id vocabulary in fp32
# is exact to about 1e-5, so their noise floor is that, not the values' size (measured under
# `make test-other-kernels`: a real-tokenizer agent's ppo_kl 1.5e-5 and 1.9e-5 apart)
LOGPROB_DIFFERENCES, LOGPROB_ABS_TOL = ("/actor/ppo_kl", "/rollout/log_prob_diff_"), 5e-5

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


def recorded_here(name: str, golden_dir: Path = GOLDEN_DIR) -> bool:
    """Whether this machine's kernels are the recording's (a missing file: nothing to replay)."""
    path = golden_dir / f"{name}.json"
    return not path.exists() or json.loads(path.read_text()).get(MACHINE_KEY) == machine_signature()


def tape_dir(name: str, golden_dir: Path = GOLDEN_DIR) -> Path:
    return golden_dir / TAPES / name


def replay_overrides(name: str, golden_dir: Path = GOLDEN_DIR) -> list[str]:
    """On a machine of another kind than the recording's: replay the recorded tape."""
    if os.environ.get(RECORD_ENV) or recorded_here(name, golden_dir):
        return []
    return [f"trainer.replay_samples_dir={tape_dir(name, golden_dir)}"]


def golden_run_overrides(name: str, out_dir: str, golden_dir: Path = GOLDEN_DIR) -> list[str]:
    """The overrides of a golden run: record its tape under <out_dir>/samples (for `check_golden`),
    replaying the recorded one on a machine of another kind."""
    return [f"trainer.record_samples_dir={out_dir}/samples", *replay_overrides(name, golden_dir)]


def run_tape(samples_dir: str | os.PathLike) -> dict[str, dict[int, list[int]]]:
    """{agent: {seed: tokens}} of the tape a run recorded (one folder an agent)."""
    from recipe_hacpo.workers.sample_tape import read_tape

    return {p.name: read_tape(p) for p in sorted(Path(samples_dir).iterdir()) if p.is_dir()}


def _check_tape(name: str, samples_dir, golden_dir: Path, exact: bool) -> None:
    want_dir = tape_dir(name, golden_dir)
    assert want_dir.is_dir(), f"{want_dir} missing: record it with {RECORD_ENV}=1"
    got, want = run_tape(samples_dir), run_tape(want_dir)
    assert sorted(got) == sorted(want), f"{name}: tapes of agents {sorted(got)}, recorded {sorted(want)}"
    how = "sampled for itself on the recording machine's kernels" if exact else "replayed the recorded tape"
    for agent in want:
        assert sorted(got[agent]) == sorted(want[agent]), (
            f"{name} ({agent}): the run {how} but asked for {len(got[agent])} samples with other seeds than "
            f"the {len(want[agent])} recorded"
        )
        other = [seed for seed in want[agent] if got[agent][seed] != want[agent][seed]]
        assert not other, (
            f"{name} ({agent}): the run {how} and drew other tokens in {len(other)} of {len(want[agent])} "
            f"requests (first seed {other[0]})"
        )


def same_value(want, got, *, exact: bool, abs_tol: float = ABS_TOL) -> bool:
    if want == got:
        return True
    if isinstance(want, float) and isinstance(got, float):
        if math.isnan(want) or math.isnan(got):
            return math.isnan(want) and math.isnan(got)
        return not exact and math.isclose(want, got, rel_tol=REL_TOL, abs_tol=abs_tol)
    return False


def abs_tol_of(metric: str) -> float:
    return LOGPROB_ABS_TOL if any(m in metric for m in LOGPROB_DIFFERENCES) else ABS_TOL


def check_golden(name: str, steps: dict[int, dict], samples_dir: str | os.PathLike | None = None, *,
                 golden_dir: Path = GOLDEN_DIR) -> None:
    """Compare (or, with HACPO_RECORD_GOLDEN=1, record) the training metrics of `steps`
    ({step: verl's logged data}) against tests/golden/<name>.json, and the tape the run recorded
    in `samples_dir` (a run made with `golden_run_overrides`) against the recorded tape."""
    got = {str(step): training_metrics(data) for step, data in sorted(steps.items())}
    path = golden_dir / f"{name}.json"
    if os.environ.get(RECORD_ENV):
        golden_dir.mkdir(exist_ok=True)
        path.write_text(json.dumps({MACHINE_KEY: machine_signature(), **got}, indent=1, sort_keys=True) + "\n")
        if samples_dir is not None:
            from recipe_hacpo.workers.sample_tape import write_tape

            shutil.rmtree(tape_dir(name, golden_dir), ignore_errors=True)
            for agent, tape in run_tape(samples_dir).items():
                write_tape(tape, tape_dir(name, golden_dir) / agent / "tape.jsonl")
        return
    assert path.exists(), f"{path} missing: record it with {RECORD_ENV}=1"
    want = json.loads(path.read_text())
    exact = want.pop(MACHINE_KEY, None) == machine_signature()
    if samples_dir is not None:
        _check_tape(name, samples_dir, golden_dir, exact)
    how = "exactly (the recording machine's kernels)" if exact else f"within rel {REL_TOL:g} / abs {ABS_TOL:g}"
    assert sorted(got) == sorted(want), (name, sorted(got), sorted(want))
    for step, metrics in want.items():
        missing = sorted(set(metrics) ^ set(got[step]))
        assert not missing, f"{name} step {step}: metrics only on one side: {missing}"
        moved = [(k, v, got[step][k]) for k, v in metrics.items()
                 if not same_value(v, got[step][k], exact=exact, abs_tol=abs_tol_of(k))]
        assert not moved, f"{name} step {step}: {len(moved)} metrics moved (compared {how}), first {moved[:5]}"
