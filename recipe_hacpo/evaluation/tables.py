"""Table 1 of the paper from the evaluation results: Markdown and CSV."""

from __future__ import annotations

import csv
import os
from typing import Sequence

from recipe_hacpo.evaluation.benchmarks import (
    BENCHMARKS,
    DEFAULT_METRIC,
    DEFAULT_METRICS,
    LABELS,
    Benchmark,
    column_order,
)


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


def paper_average(per_bench: dict) -> float | None:
    """The unweighted mean over the paper's seven benchmarks (BENCHMARKS) of one checkpoint's
    results, whatever else it was evaluated on; None when one of the seven is missing."""
    if any(key not in per_bench for key, _ in BENCHMARKS):
        return None
    return sum(per_bench[key]["value"] for key, _ in BENCHMARKS) / len(BENCHMARKS)


def paper_figure(value: float) -> str:
    """A fraction as the paper's averages are written: three decimals, no leading zero (.493)."""
    text = f"{value:.3f}"
    return text[1:] if text.startswith("0.") else text


def format_paper_average(results: dict) -> str:
    """Each checkpoint's average over the seven benchmarks, in the form of docs/REPRODUCE.md's
    table of the paper's figures ("Expected numbers"), so the two can be set side by side. A
    checkpoint without all seven gets no average (which are missing is said); a benchmark scored
    by another metric than the paper's is named beside the figure."""
    lines = [f"AVG over the paper's {len(BENCHMARKS)} benchmarks ({', '.join(label for _, label in BENCHMARKS)}), "
             "as in docs/REPRODUCE.md, Expected numbers:",
             "| checkpoint | AVG |", "| --- | ---: |"]
    for name, per_bench in results.items():
        average = paper_average(per_bench)
        if average is None:
            missing = [label for key, label in BENCHMARKS if key not in per_bench]
            lines.append(f"| {name} | not made: no {', '.join(missing)} |")
            continue
        other = [f"{LABELS[key]} {per_bench[key]['metric']}" for key, _ in BENCHMARKS
                 if per_bench[key].get("metric", DEFAULT_METRICS.get(key, DEFAULT_METRIC))
                 != DEFAULT_METRICS.get(key, DEFAULT_METRIC)]
        note = f" ({', '.join(other)}: not the paper's metric)" if other else ""
        lines.append(f"| {name} | {paper_figure(average)}{note} |")
    return "\n".join(lines) + "\n"
