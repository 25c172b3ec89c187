"""A small benchmark file for the evaluation tests."""

from __future__ import annotations

import os
from recipe_hacpo.data.schema import make_row, write_rows


SOURCES = {
    "math500": "HuggingFaceH4/MATH-500",
    "math": "lighteval/MATH",
    "gsm8k": "openai/gsm8k",
    "aime25": "aime25",
    "amc23": "amc23",
    "minerva": "minerva",
    "olympiadbench": "olympiadbench",
}

QUESTIONS = [("What is 2 + 3?", "5"), ("What is 4 + 4?", "8")]


def write_bench(path, key: str, questions=QUESTIONS) -> str:
    rows = [
        make_row(SOURCES[key], f"{q} Let's think step by step and output the final answer within \\boxed{{}}.", "math", a, "test", i)
        for i, (q, a) in enumerate(questions)
    ]
    out = os.path.join(str(path), f"{key}_test.parquet")
    write_rows(rows, out)
    return out
