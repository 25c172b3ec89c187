"""Synthetic verifiable arithmetic in verl's RL format, deterministic from (kind, split, n, seed).

Kinds (the prompt is one user message holding only the problem text):

    add1   single digits with a one-digit sum:  "3+5="       -> "8"
           55 distinct problems, so random guessing earns some reward (tiny-model smoke tests).
    add3   zero-padded 3-digit addition:        "0123+0456=" -> "0579"
           the task of the CPU benchmark (benchmarks/miniature.py); rows are distinct within a split.

Train and test are disjoint by construction: a problem belongs to the test split iff the
SHA-256 of its text falls in the first `TEST_PERMILLE` of 1000 buckets, whatever the seed.
Rows are drawn with `random.Random` seeded from a string, which is stable across Python
versions and independent of PYTHONHASHSEED.

    python -m recipe_hacpo.data.synthetic --kind add3 --out data --n-train 4096 --n-test 1024 --seed 0

writes `<out>/arith_<kind>_train.parquet` and `<out>/arith_<kind>_test.parquet`.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import random
import sys
from typing import Callable

from recipe_hacpo.data.schema import make_row, write_rows

DATA_SOURCE_PREFIX = "hacpo/arith/"
ABILITY = "arith"
TEST_PERMILLE = 200
SPLITS = ("train", "test")


@dataclasses.dataclass(frozen=True)
class Kind:
    """One synthetic task: how to draw operands, show the problem, and state the answer."""

    draw: Callable[[random.Random], tuple[int, int]]
    text: Callable[[int, int], str]
    answer: Callable[[int, int], str]
    distinct: bool  # rows within a split are distinct problems (needs a large problem pool)


_ADD1_PAIRS = [(a, b) for a in range(10) for b in range(10 - a)]

KINDS: dict[str, Kind] = {
    "add1": Kind(
        draw=lambda rng: rng.choice(_ADD1_PAIRS),
        text=lambda a, b: f"{a}+{b}=",
        answer=lambda a, b: str(a + b),
        distinct=False,
    ),
    "add3": Kind(
        draw=lambda rng: (rng.randrange(1000), rng.randrange(1000)),
        text=lambda a, b: f"{a:04d}+{b:04d}=",
        answer=lambda a, b: f"{a + b:04d}",
        distinct=True,
    ),
}

SHIPPED = {"add1": {"n_train": 256, "n_test": 64, "seed": 0}, "add3": {"n_train": 4096, "n_test": 1024, "seed": 0}}
"""The arguments that produced the files shipped in the repository's `data/` folder."""


def data_source(kind: str) -> str:
    return DATA_SOURCE_PREFIX + kind


def split_of(text: str) -> str:
    """The split a problem text belongs to, for every seed."""
    bucket = int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big") % 1000
    return "test" if bucket < TEST_PERMILLE else "train"


def generate(kind: str, split: str, n: int, seed: int) -> list[dict]:
    """`n` rows of `kind` from `split`, in verl's RL format; the same arguments give the same rows."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r} (expected one of {', '.join(KINDS)})")
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r} (expected one of {', '.join(SPLITS)})")
    if n < 1:
        raise ValueError(f"n must be >= 1 for split {split!r} (got {n})")
    spec = KINDS[kind]
    rng = random.Random(f"hacpo-arith:{kind}:{split}:{seed}")
    rows, seen = [], set()
    for _ in range(200 * n + 10_000):
        a, b = spec.draw(rng)
        text = spec.text(a, b)
        if split_of(text) != split or (spec.distinct and text in seen):
            continue
        seen.add(text)
        rows.append(make_row(data_source(kind), text, ABILITY, spec.answer(a, b), split, len(rows)))
        if len(rows) == n:
            return rows
    raise ValueError(f"kind {kind!r}: could not draw {n} problems for split {split!r} (pool too small)")


def output_path(out_dir: str, kind: str, split: str) -> str:
    return os.path.join(out_dir, f"arith_{kind}_{split}.parquet")


def write_kind(kind: str, out_dir: str, n_train: int, n_test: int, seed: int) -> list[str]:
    """Write the train and test files of `kind` into `out_dir`; returns their paths."""
    paths = []
    for split, n in (("train", n_train), ("test", n_test)):
        path = output_path(out_dir, kind, split)
        write_rows(generate(kind, split, n, seed), path)
        paths.append(path)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m recipe_hacpo.data.synthetic",
        description="Write a synthetic arithmetic task as verl RL parquet files (train and test).",
    )
    parser.add_argument("--kind", required=True, choices=sorted(KINDS))
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--n-train", type=int, help="train rows (default: the shipped size)")
    parser.add_argument("--n-test", type=int, help="test rows (default: the shipped size)")
    parser.add_argument("--seed", type=int, help="sampling seed (default: the shipped seed)")
    args = parser.parse_args(argv)
    shipped = SHIPPED[args.kind]
    n_train = shipped["n_train"] if args.n_train is None else args.n_train
    n_test = shipped["n_test"] if args.n_test is None else args.n_test
    seed = shipped["seed"] if args.seed is None else args.seed
    try:
        paths = write_kind(args.kind, args.out, n_train, n_test, seed)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for path, n in zip(paths, (n_train, n_test)):
        print(f"wrote {path} ({n} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
