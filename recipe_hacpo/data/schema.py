"""verl's RL parquet format: the Arrow schema every file here uses, a writer, a cheap validator.

One row is one prompt. verl 0.9.1's `RLHFDataset` reads the chat messages from the
`data.prompt_key` column (default `prompt`) and hands them on as `raw_prompt`; it takes
`extra_info.index` as the row's `index`; the reward function receives `data_source`,
`reward_model.ground_truth` and `extra_info`.

    data_source   str                  routes the reward (e.g. "openai/gsm8k", "hacpo/arith/add3")
    prompt        list[{role, content}] chat messages, non-empty, content a non-empty str
    ability       str                  task family ("math", "arith")
    reward_model  {style, ground_truth} style "rule"; ground_truth the reference answer as a str
    extra_info    {split, index}       split name and the row's index in its source

Every file written here has exactly this Arrow schema, so verl can concatenate any of them
(several validation files are one `datasets.concatenate_datasets` call).

`validate_rows` needs no tokenizer or model: the trainer runs it on every data file before
Ray starts and stops on the first bad row with one line naming file, row and field.
"""

from __future__ import annotations

import json
import math
import os
import sys
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.parquet as pq

ROLES = ("system", "user", "assistant", "tool")

ARROW_SCHEMA = pa.schema(
    [
        pa.field("data_source", pa.string()),
        pa.field(
            "prompt",
            pa.list_(pa.struct([pa.field("role", pa.string()), pa.field("content", pa.string())])),
        ),
        pa.field("ability", pa.string()),
        pa.field(
            "reward_model",
            pa.struct([pa.field("style", pa.string()), pa.field("ground_truth", pa.string())]),
        ),
        pa.field("extra_info", pa.struct([pa.field("split", pa.string()), pa.field("index", pa.int64())])),
    ]
)


class DataFormatError(ValueError):
    """A data file does not follow verl's RL format; the message is one line naming file, row, field."""


def make_row(data_source: str, content: str, ability: str, ground_truth: str, split: str, index: int) -> dict:
    """One row in the schema above, with the prompt a single user message."""
    return {
        "data_source": data_source,
        "prompt": [{"role": "user", "content": content}],
        "ability": ability,
        "reward_model": {"style": "rule", "ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index},
    }


def write_rows(rows: list[dict], path: str) -> None:
    """Validate `rows` and write them to `path` as parquet, byte-for-byte reproducibly.

    The table is built from the fixed Arrow schema (no pandas metadata), with fixed
    compression and statistics, so the same rows give the same bytes under one pyarrow version.
    """
    check_records(rows, path)
    table = pa.Table.from_pylist(rows, schema=ARROW_SCHEMA)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    pq.write_table(table, path, compression="zstd", compression_level=9, write_statistics=False)


def validate_rows(df, path: str, prompt_key: str = "prompt") -> None:
    """Raise `DataFormatError` for the first row of DataFrame `df` that verl cannot use.

    `path` only names the file in the message. Accepts what pandas gives for parquet
    (numpy arrays for list columns) as well as plain lists.
    """
    if len(df) == 0:
        raise DataFormatError(f"{path}: no rows (expected at least one row in verl's RL format)")
    for name in ("data_source", prompt_key, "ability", "reward_model", "extra_info"):
        if name not in df.columns:
            raise DataFormatError(f"{path}: row 0: field '{name}' missing ({_EXPECTED.get(name, _EXPECTED['prompt'])})")
    check_records(df.to_dict("records"), path, prompt_key)


def check_records(records: Iterable[dict], path: str, prompt_key: str = "prompt") -> None:
    """Same checks as `validate_rows`, on a sequence of row dicts."""
    count = 0
    for i, row in enumerate(records):
        problem = _row_problem(row, prompt_key)
        if problem is not None:
            field, what = problem
            expected = _EXPECTED.get(field.split(".")[0].split("[")[0], _EXPECTED["prompt"])
            raise DataFormatError(f"{path}: row {i}: field '{field}' {what} ({expected})")
        count += 1
    if count == 0:
        raise DataFormatError(f"{path}: no rows (expected at least one row in verl's RL format)")


def file_list(files) -> list[str]:
    """`data.train_files` / `data.val_files` as a list of paths: one path, a list of them, or none."""
    if files is None:
        return []
    return [str(files)] if isinstance(files, str) else [str(f) for f in files]


def validate_file(path: str, prompt_key: str = "prompt") -> int:
    """Read a parquet / json / jsonl data file and validate it; returns the number of rows."""
    if not os.path.isfile(path):
        raise DataFormatError(f"{path}: no such file (expected a parquet, json or jsonl data file)")
    if path.endswith(".parquet"):
        try:
            records = pq.read_table(path).to_pylist()
        except (pa.ArrowException, OSError, ValueError) as err:
            # truncated, corrupt, not parquet at all, or unreadable: one line, not a stack trace
            raise DataFormatError(f"{path}: not a readable parquet file ({_first_line(err)})") from None
    elif path.endswith(".jsonl") or path.endswith(".json"):
        try:
            records = _read_json_records(path)
        except OSError as err:
            raise DataFormatError(f"{path}: cannot be read ({_first_line(err)})") from None
        except UnicodeDecodeError:
            raise DataFormatError(f"{path}: not UTF-8 text (expected JSON or JSON lines)") from None
    else:
        raise DataFormatError(f"{path}: unsupported file type (expected .parquet, .json or .jsonl, as verl reads)")
    check_records(records, path, prompt_key)
    return len(records)


_EXPECTED = {
    "data_source": "expected a non-empty str naming the dataset, e.g. 'openai/gsm8k'",
    "prompt": "expected a non-empty list of {'role': str, 'content': non-empty str} messages",
    "ability": "expected a str, e.g. 'math'",
    "reward_model": "expected a dict {'style': 'rule', 'ground_truth': non-empty str}",
    "extra_info": "expected a dict {'split': str, 'index': int, ...}",
}


def _row_problem(row: dict, prompt_key: str) -> tuple[str, str] | None:
    """(field, problem) for the first bad field of `row`, or None when the row is fine."""
    for name, check in (
        ("data_source", _check_data_source),
        (prompt_key, _check_prompt),
        ("ability", _check_ability),
        ("reward_model", _check_reward_model),
        ("extra_info", _check_extra_info),
    ):
        value = row.get(name) if isinstance(row, dict) else None
        if _is_missing(value):
            return name, "missing"
        problem = check(value)
        if problem is not None:
            sub, what = problem
            return name + sub, what
    return None


def _check_data_source(value: Any):
    if not isinstance(value, str):
        return "", f"has type {type(value).__name__}"
    if not value.strip():
        return "", "is empty"
    return None


def _check_ability(value: Any):
    if not isinstance(value, str):
        return "", f"has type {type(value).__name__}"
    return None


def _check_prompt(value: Any):
    if isinstance(value, str):
        return "", "is a str, not a list of messages"
    if not _is_sequence(value):
        return "", f"has type {type(value).__name__}"
    if len(value) == 0:
        return "", "is an empty list"
    for j, message in enumerate(value):
        if not isinstance(message, dict):
            return f"[{j}]", f"has type {type(message).__name__}, not a message dict"
        role, content = message.get("role"), message.get("content")
        if _is_missing(role):
            return f"[{j}].role", "missing"
        if role not in ROLES:
            return f"[{j}].role", f"is {role!r}, not one of {', '.join(ROLES)}"
        problem = _text_problem(content, f"[{j}].content")
        if problem:
            return problem
    return None


def _check_reward_model(value: Any):
    if not isinstance(value, dict):
        return "", f"has type {type(value).__name__}"
    problem = _text_problem(value.get("ground_truth"), ".ground_truth")
    if problem:
        return problem
    style = value.get("style")
    if style != "rule":
        return ".style", "missing" if _is_missing(style) else f"is {style!r}"
    return None


def _check_extra_info(value: Any):
    if not isinstance(value, dict):
        return "", f"has type {type(value).__name__}"
    index = value.get("index")
    if _is_missing(index):
        return ".index", "missing"
    if isinstance(index, bool) or not _is_integer(index):
        return ".index", f"has type {type(index).__name__}"
    return _text_problem(value.get("split"), ".split", allow_empty=True)


def _text_problem(value: Any, where: str, allow_empty: bool = False):
    """(where, problem) when `value` is not a string (or is blank, unless `allow_empty`); else None."""
    if _is_missing(value):
        return where, "missing"
    if not isinstance(value, str):
        return where, f"has type {type(value).__name__}"
    if not allow_empty and not value.strip():
        return where, "is empty"
    return None


def _is_missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _is_sequence(value: Any) -> bool:
    return isinstance(value, (list, tuple)) or type(value).__name__ == "ndarray"


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) or (type(value).__module__ == "numpy" and "int" in type(value).__name__)


def _read_json_records(path: str) -> list:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        records = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise DataFormatError(f"{path}: line {n}: not valid JSON ({err.msg})") from None
        data = records
    rows = data if isinstance(data, list) else [data]
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise DataFormatError(f"{path}: row {i}: not an object (expected one JSON object per row)")
    return rows


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__


def main(argv: list[str] | None = None) -> int:
    """`python -m recipe_hacpo.data.schema FILE...`: validate data files, one line per file."""
    paths = sys.argv[1:] if argv is None else argv
    if not paths:
        print("usage: python -m recipe_hacpo.data.schema FILE [FILE ...]", file=sys.stderr)
        return 2
    status = 0
    for path in paths:
        try:
            print(f"{path}: ok, {validate_file(path)} rows")
        except DataFormatError as e:
            print(e, file=sys.stderr)
            status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
