"""Benchmarks of Table 1 (names, files, per-benchmark metric) and the metrics avg@k, best@k, pass@k."""

from __future__ import annotations

import dataclasses
import math
import os
import re
from typing import Sequence

from recipe_hacpo.evaluation import EvalError


BENCHMARKS: tuple[tuple[str, str], ...] = (
    ("math500", "MATH-500"),
    ("math", "MATH"),
    ("gsm8k", "GSM8K"),
    ("aime25", "AIME25"),
    ("amc23", "AMC23"),
    ("minerva", "Minerva"),
    ("olympiadbench", "OlympiadBench"),
)
"""(key, Table 1 column) in the paper's column order."""

LABELS = dict(BENCHMARKS)
ALIASES = {"aime2025": "aime25", "amc2023": "amc23", "minervamath": "minerva", "olympiad": "olympiadbench"}
DEFAULT_METRICS = {"aime25": "best@30"}

MAIN_TABLE_MAX_NEW_TOKENS = 8196
"""The paper evaluates its main tables with at most 8196 new tokens per response (training
uses 4096); the number is the paper's, kept as written."""
DEFAULT_METRIC = "avg@1"
CORRECT_THRESHOLD = 0.5



def bench_key(name: str) -> str:
    """The canonical key of a benchmark name ("MATH-500", "math_500" -> "math500"); other names as given."""
    norm = re.sub(r"[^a-z0-9]", "", name.lower())
    norm = ALIASES.get(norm, norm)
    return norm if norm in LABELS else name


@dataclasses.dataclass(frozen=True)
class Metric:
    kind: str  # avg | best | pass
    k: int

    @classmethod
    def parse(cls, spec: str) -> "Metric":
        match = re.fullmatch(r"\s*(avg|best|pass)@(\d+)\s*", spec)
        if not match or int(match.group(2)) < 1:
            raise EvalError(f"metric {spec!r}: expected avg@k, best@k or pass@k with k >= 1")
        return cls(match.group(1), int(match.group(2)))

    def __str__(self) -> str:
        return f"{self.kind}@{self.k}"

    def compute(self, scores: Sequence[Sequence[float]]) -> float:
        return {"avg": avg_at_k, "best": best_at_k, "pass": pass_at_k}[self.kind](scores, self.k)


@dataclasses.dataclass(frozen=True)
class Benchmark:
    key: str
    path: str
    metric: Metric
    n: int  # samples drawn per prompt (>= metric.k)

    @property
    def label(self) -> str:
        return LABELS.get(self.key, self.key)


def column_order(benchmarks: Sequence[Benchmark]) -> list[Benchmark]:
    """The paper's columns first, in its order, then any other benchmark in the order given."""
    rank = {key: i for i, (key, _) in enumerate(BENCHMARKS)}
    known = sorted((b for b in benchmarks if b.key in rank), key=lambda b: rank[b.key])
    return known + [b for b in benchmarks if b.key not in rank]


def load_benchmark(path: str, limit: int | None = None) -> list[dict]:
    """Rows of a verl RL parquet file: {messages, data_source, ground_truth, extra_info}."""
    import pyarrow.parquet as pq

    if not os.path.isfile(path):
        raise EvalError(f"{path}: no such benchmark file (expected a parquet file from recipe_hacpo.data.prepare)")
    table = pq.read_table(path)
    missing = [c for c in ("prompt", "data_source", "reward_model") if c not in table.column_names]
    if missing:
        raise EvalError(f"{path}: column {missing[0]!r} missing (expected verl RL parquet: prompt, data_source, reward_model)")
    rows = []
    for i, record in enumerate(table.to_pylist()[:limit] if limit else table.to_pylist()):
        messages = record["prompt"]
        truth = (record.get("reward_model") or {}).get("ground_truth")
        if not messages or truth is None:
            raise EvalError(f"{path}: row {i}: empty prompt or no reward_model.ground_truth")
        rows.append(
            {
                "messages": [{"role": m["role"], "content": m["content"]} for m in messages],
                "data_source": record["data_source"],
                "ground_truth": truth,
                "extra_info": record.get("extra_info"),
            }
        )
    if not rows:
        raise EvalError(f"{path}: no rows")
    return rows


def parse_pairs(values: Sequence[str] | None, flag: str) -> list[tuple[str, str]]:
    """`NAME=VALUE` command-line values as (name, value) pairs; `flag` names the option in errors."""
    out = []
    for value in values or []:
        name, sep, rest = value.partition("=")
        if not sep or not name.strip() or not rest.strip():
            raise EvalError(f"{flag} {value!r}: expected NAME=VALUE")
        out.append((name.strip(), rest.strip()))
    return out


def build_benchmarks(
    bench_args: Sequence[str] | None,
    bench_dir: str | None,
    metric_args: Sequence[str] | None,
    sample_args: Sequence[str] | None,
) -> list[Benchmark]:
    """The benchmarks to evaluate, in the table's column order, from the command-line options."""
    files: dict[str, str] = {}
    if bench_dir:
        if not os.path.isdir(bench_dir):
            raise EvalError(f"--bench-dir {bench_dir}: no such directory")
        for key, _ in BENCHMARKS:
            path = os.path.join(bench_dir, f"{key}_test.parquet")
            if os.path.isfile(path):
                files[key] = path
        if not files:
            raise EvalError(f"--bench-dir {bench_dir}: no <benchmark>_test.parquet files ({', '.join(k for k, _ in BENCHMARKS)})")
    for name, path in parse_pairs(bench_args, "--bench"):
        files[bench_key(name)] = path
    if not files:
        raise EvalError("no benchmarks: give --bench NAME=FILE or --bench-dir DIR")
    metrics = {bench_key(k): Metric.parse(v) for k, v in parse_pairs(metric_args, "--metric")}
    samples = {}
    for k, v in parse_pairs(sample_args, "--samples"):
        if not v.isdigit() or int(v) < 1:
            raise EvalError(f"--samples {k}={v}: expected a positive integer")
        samples[bench_key(k)] = int(v)
    for key in list(metrics) + list(samples):
        if key not in files:
            raise EvalError(f"{key}: a metric or sample count for a benchmark that is not evaluated ({', '.join(files)})")
    out = []
    for key, path in files.items():
        metric = metrics.get(key) or Metric.parse(DEFAULT_METRICS.get(key, DEFAULT_METRIC))
        n = samples.get(key, metric.k)
        if n < metric.k:
            raise EvalError(f"--samples {key}={n}: fewer than the k of {metric}")
        out.append(Benchmark(key, path, metric, n))
    return column_order(out)


# --------------------------------------------------------------------------- metrics


def _check(scores: Sequence[Sequence[float]], k: int, what: str) -> None:
    if not scores:
        raise EvalError(f"{what}: no prompts")
    short = min(len(s) for s in scores)
    if k < 1 or short < k:
        raise EvalError(f"{what}@{k}: needs k >= 1 and at least k samples per prompt, have {short}")


def avg_at_k(scores: Sequence[Sequence[float]], k: int) -> float:
    """Mean over prompts of the mean score of each prompt's first k samples."""
    _check(scores, k, "avg")
    return sum(sum(s[:k]) / k for s in scores) / len(scores)


def best_at_k(scores: Sequence[Sequence[float]], k: int) -> float:
    """Mean over prompts of the best score among each prompt's first k samples.

    The paper's AIME25 column is best@30: 30 samples per problem at temperature 1.0, a
    problem counts as solved when any of its 30 samples is correct, and the number reported
    is the share of problems solved (not the mean accuracy of the samples).
    """
    _check(scores, k, "best")
    return sum(max(s[:k]) for s in scores) / len(scores)


def pass_at_k_one(n: int, c: int, k: int) -> float:
    """1 - C(n - c, k) / C(n, k): the chance that k of n samples, c of them correct, hold one correct."""
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / j for j in range(n - c + 1, n + 1))


def pass_at_k(scores: Sequence[Sequence[float]], k: int) -> float:
    """Mean over prompts of the unbiased pass@k estimate from all of each prompt's samples."""
    _check(scores, k, "pass")
    return sum(pass_at_k_one(len(s), sum(v >= CORRECT_THRESHOLD for v in s), k) for s in scores) / len(scores)


def all_metrics(scores: Sequence[Sequence[float]], metric: Metric) -> dict[str, float]:
    """The table's metric plus avg@n, best@n and pass@1 / pass@k over all n samples."""
    n = min(len(s) for s in scores)
    out = {f"avg@{n}": avg_at_k(scores, n), f"best@{n}": best_at_k(scores, n)}
    for k in sorted({1, metric.k}):
        out[f"pass@{k}"] = pass_at_k(scores, k)
    out[str(metric)] = metric.compute(scores)
    return out
