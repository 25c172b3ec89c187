"""Table 1 of the paper from the evaluation results: Markdown and CSV."""

from __future__ import annotations

import csv
import os
from typing import Sequence

from recipe_hacpo.evaluation.benchmarks import Benchmark, column_order



def table_rows(results: dict, benchmarks: Sequence[Benchmark]) -> tuple[list[str], list[list]]:
    """Header and rows of Table 1: one row per checkpoint, benchmark columns, then AVG."""
    cols = column_order(benchmarks)
    header = ["Method"] + [b.label for b in cols] + ["AVG"]
    rows = []
    for name, per_bench in results.items():
        values = [per_bench[b.key]["value"] for b in cols]
        rows.append([name] + values + [sum(values) / len(values)])
    return header, rows


def format_markdown(results: dict, benchmarks: Sequence[Benchmark], percent: bool = False) -> str:
    header, rows = table_rows(results, benchmarks)
    fmt = (lambda v: f"{100 * v:.1f}") if percent else (lambda v: f"{v:.3f}")
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join([" --- "] + [" ---: "] * (len(header) - 1)) + "|",
    ]
    lines += ["| " + " | ".join([r[0]] + [fmt(v) for v in r[1:]]) + " |" for r in rows]
    cols = column_order(benchmarks)
    note = ", ".join(f"{b.label} {b.metric}" for b in cols)
    lines += ["", f"Metrics: {note}. AVG: unweighted mean over the {len(cols)} benchmarks."]
    return "\n".join(lines) + "\n"


def write_tables(results: dict, benchmarks: Sequence[Benchmark], out_dir: str, percent: bool = False) -> tuple[str, str]:
    md_path, csv_path = os.path.join(out_dir, "table.md"), os.path.join(out_dir, "table.csv")
    with open(md_path, "w") as f:
        f.write(format_markdown(results, benchmarks, percent))
    header, rows = table_rows(results, benchmarks)
    with open(csv_path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(header)
        for r in rows:
            writer.writerow([r[0]] + [f"{v:.6f}" for v in r[1:]])
    return md_path, csv_path
