"""Convert the paper's math datasets, from local files in their published formats, to verl parquet.

    python -m recipe_hacpo.data.prepare --source gsm8k --input gsm8k_test.jsonl --out gsm8k_test.parquet
    python -m recipe_hacpo.data.prepare --all-from raw/ --out data/paper/
    python -m recipe_hacpo.data.prepare --source math500 --from-hub HuggingFaceH4/MATH-500 --out math500.parquet

Sources, the fields read (first present wins) and the `data_source` written, which the
reward routes on:

    math           problem; answer, else last \\boxed{} of solution    lighteval/MATH
    math500        problem; answer, else last \\boxed{} of solution    HuggingFaceH4/MATH-500
    gsm8k          question; answer after "#### " (commas dropped)    openai/gsm8k
    aime25         problem | question; answer                         aime25
    amc23          question | problem; answer                         amc23
    minerva        problem | question; answer, else \\boxed{} of solution  minerva
    olympiadbench  [context +] question; final_answer (list) | answer olympiadbench

Field names match ignoring case ("Problem", "Answer" as in some AIME releases).
Input files: .parquet, .jsonl, or .json (a list of records, a dict of equal-length columns,
or JSON lines saved under a .json name, as `datasets.Dataset.to_json` does). Numeric answers
become strings (27.0 -> "27"); surrounding `$` is stripped; multiple final answers are
joined with ", ". The prompt is one user message: the problem, a space, the instruction.
`--all-from DIR` converts each file named `<name>[_train|_test].<ext>` (name: a source or an
alias such as math_500, aime2025, minerva_math) to `<out>/<source>_<split>.parquet`.
`--from-hub` is the only path that touches the network, and only when given.

The Hub's own file layouts are read as they are downloaded (`huggingface-cli download
--repo-type dataset ...`), no renaming:

- `--input` takes several files, directories (every data file below them) and globs, read in
  sorted order and concatenated: `--input 'hendrycks_math/*/train-*.parquet'` (the 7 subject
  configs of MATH), `--input aime2025-I.jsonl aime2025-II.jsonl` (AIME 2025 I and II).
- `--all-from DIR` also takes a sub-folder named like a source (`math500/`, `hendrycks_math/`,
  `aime2025/`, ...): every data file below it is one part of that source; a part's split is
  read from its shard name (`test-00000-of-00001.parquet`), a `_train` / `_test` suffix, or a
  `train` / `test` folder on its path, else the source's default; benchmarks (math500,
  aime25, amc23, minerva, olympiadbench) are always written as test, whatever the Hub calls
  their one split; `validation` shards are skipped, and so is a config that is not the
  benchmark (`gsm8k/socratic/`: GSM8K is `main`). Top-level files named
  `aime2025-I` / `aime2025-II` are the two parts of AIME 2025. Parts of one source and split
  are concatenated into one output; two whole files for one output are still an error.
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import math
import os
import re
import sys

import pyarrow.parquet as pq

from recipe_hacpo.data.schema import DataFormatError, make_row, write_rows
from recipe_hacpo.reward.answer_extraction import last_boxed as _reward_last_boxed

INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
ABILITY = "math"
INPUT_EXTENSIONS = (".parquet", ".jsonl", ".json")


@dataclasses.dataclass(frozen=True)
class Source:
    """Where one dataset keeps its problem and answer, and what `data_source` it gets."""

    data_source: str
    split: str  # default split written to extra_info.split
    question_fields: tuple[str, ...]
    # (field, rule) tried in order; rule: "value" (str/number/list), "boxed", "gsm8k"
    answer_rules: tuple[tuple[str, str], ...]
    context_field: str | None = None  # prepended to the question when non-empty


SOURCES: dict[str, Source] = {
    "math": Source("lighteval/MATH", "train", ("problem",), (("answer", "value"), ("solution", "boxed"))),
    "math500": Source("HuggingFaceH4/MATH-500", "test", ("problem",), (("answer", "value"), ("solution", "boxed"))),
    "gsm8k": Source("openai/gsm8k", "test", ("question",), (("answer", "gsm8k"),)),
    "aime25": Source("aime25", "test", ("problem", "question"), (("answer", "value"),)),
    "amc23": Source("amc23", "test", ("question", "problem"), (("answer", "value"),)),
    "minerva": Source("minerva", "test", ("problem", "question"), (("answer", "value"), ("solution", "boxed"))),
    "olympiadbench": Source(
        "olympiadbench",
        "test",
        ("question", "problem"),
        (("final_answer", "value"), ("answer", "value")),
        context_field="context",
    ),
}

# File stems `--all-from` recognises (lower case, "-" read as "_"), after an optional
# "_train" / "_test" suffix that sets the split.
STEM_ALIASES = {
    "math": "math",
    "math500": "math500",
    "math_500": "math500",
    "gsm8k": "gsm8k",
    "aime25": "aime25",
    "aime2025": "aime25",
    "aime_2025": "aime25",
    "amc23": "amc23",
    "amc2023": "amc23",
    "minerva": "minerva",
    "minerva_math": "minerva",
    "olympiadbench": "olympiadbench",
    # Hub repository names
    "hendrycks_math": "math",
    "competition_math": "math",
    "minervamath": "minerva",
}
# file stems that are one part of a source split over several files (AIME 2025 I and II)
PART_STEMS = {
    "aime2025_i": "aime25", "aime2025_ii": "aime25", "aime25_i": "aime25", "aime25_ii": "aime25",
}
SPLITS = ("train", "test")
# Hub configs of a source that are not the benchmark, skipped in its folder: openai/gsm8k's
# `socratic` asks the `main` problems again with sub-questions in the answers; GSM8K is `main`
OTHER_CONFIGS = {"gsm8k": ("socratic",)}
# benchmarks with one published split; some Hub repos call it "train" (Hothan/OlympiadBench)
EVAL_ONLY = ("math500", "aime25", "amc23", "minerva", "olympiadbench")
_SHARD = re.compile(r"^(train|test|validation)-\d+-of-\d+$")


# ------------------------------------------------------------------ answer extraction


def last_boxed(text: str) -> str | None:
    """The last `\\boxed{}` answer, read by the reward's own parser (an empty box is none)."""
    return _reward_last_boxed(text) or None


def gsm8k_answer(text: str) -> str | None:
    """The number after the last `####` of a GSM8K solution, thousands separators dropped."""
    if "####" not in text:
        return None
    answer = text.rsplit("####", 1)[1].strip().replace(",", "")
    return answer or None


def answer_text(value) -> str | None:
    """A published answer value (str, int, float, or list of those) as one stripped string."""
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, (list, tuple)):
        parts = [answer_text(v) for v in value]
        parts = [p for p in parts if p]
        return ", ".join(parts) or None
    if isinstance(value, float):
        if math.isnan(value):
            return None
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return value.strip().strip("$").strip() or None
    return None


_RULES = {
    "value": answer_text,
    "boxed": lambda v: last_boxed(v) if isinstance(v, str) else None,
    "gsm8k": lambda v: gsm8k_answer(v) if isinstance(v, str) else None,
}
_RULE_WANTS = {"value": "an answer value", "boxed": "a \\boxed{} answer", "gsm8k": "a '#### <answer>' line"}


# ------------------------------------------------------------------ reading


def read_records(path: str) -> list[dict]:
    """Rows of a .parquet / .jsonl / .json file as dicts."""
    if not os.path.isfile(path):
        raise DataFormatError(f"{path}: no such file (expected a .parquet, .jsonl or .json dataset file)")
    if path.endswith(".parquet"):
        return pq.read_table(path).to_pylist()
    if not path.endswith((".jsonl", ".json")):
        raise DataFormatError(f"{path}: unsupported file type (expected .parquet, .jsonl or .json)")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".json"):
        try:
            return _json_rows(json.loads(text), path)
        except json.JSONDecodeError:
            pass  # JSON lines saved under a .json name
    rows = []
    for k, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise DataFormatError(f"{path}: line {k}: invalid JSON ({e.msg}) (expected one JSON object per line)")
    return rows


def expand_inputs(inputs: list[str]) -> list[str]:
    """Data files named by `inputs`: files as given, directories (every data file below them)
    and globs (`**` spans folders), each group in sorted order. An input that names nothing fails."""
    paths: list[str] = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(
                os.path.join(root, name)
                for root, _, names in os.walk(item)
                for name in names
                if name.endswith(INPUT_EXTENSIONS)
            )
        elif glob.has_magic(item):
            found = sorted(p for p in glob.glob(item, recursive=True) if os.path.isfile(p))
        else:
            found = [item]
        if not found:
            raise DataFormatError(f"{item}: matches no .parquet, .jsonl or .json file")
        paths.extend(p for p in found if p not in paths)
    return paths


def convert_files(paths: list[str], source: str, split: str | None, limit: int | None, instruction: str,
                  skip_unanswerable: bool) -> list[dict]:
    """`convert` each file and concatenate; `extra_info.index` counts on across the files."""
    rows: list[dict] = []
    for path in paths:
        left = None if limit is None else limit - len(rows)
        if left == 0:
            break
        rows.extend(convert(source, read_records(path), path, split, left, instruction, skip_unanswerable,
                            start=len(rows)))
    return rows


def _json_rows(data, path: str) -> list[dict]:
    if isinstance(data, list):
        return data
    if isinstance(data, dict):
        values = list(data.values())
        if values and all(isinstance(v, list) for v in values) and len({len(v) for v in values}) == 1:
            return [dict(zip(data, row)) for row in zip(*values)]  # columns
        lists = [v for v in values if isinstance(v, list) and v and all(isinstance(r, dict) for r in v)]
        if len(lists) == 1:
            return lists[0]  # e.g. {"data": [...]}
    raise DataFormatError(f"{path}: top-level JSON is not a list of records (expected [{{...}}, ...] or JSON lines)")


def read_hub(name: str, config: str | None, split: str) -> list[dict]:
    """Rows of a Hugging Face hub dataset; only called when `--from-hub` is given."""
    try:
        import datasets

        return datasets.load_dataset(name, config, split=split).to_list()
    except Exception as e:  # any failure here is the hub's or the name's; report it in one line
        first = (str(e).strip().splitlines() or [""])[0]
        raise DataFormatError(
            f"hub:{name}: cannot load split {split!r} ({type(e).__name__}: {first}); "
            "download the files elsewhere and pass --input"
        ) from None


# ------------------------------------------------------------------ conversion


def convert(
    source: str,
    records: list[dict],
    path: str,
    split: str | None = None,
    limit: int | None = None,
    instruction: str = INSTRUCTION,
    skip_unanswerable: bool = False,
    start: int = 0,
) -> list[dict]:
    """verl rows for `records` of dataset `source`; `path` names the input in error messages.

    `start` offsets `extra_info.index` (one file of several)."""
    if source not in SOURCES:
        raise DataFormatError(f"{path}: unknown source {source!r} (expected one of {', '.join(SOURCES)})")
    spec = SOURCES[source]
    split = split or spec.split
    rows = []
    for i, record in enumerate(records[:limit] if limit is not None else records):
        if not isinstance(record, dict):
            raise DataFormatError(f"{path}: row {i}: is {type(record).__name__} (expected a JSON object / record)")
        question = _question(spec, record, path, i)
        answer = _answer(spec, record)
        if answer is None:
            if skip_unanswerable:
                continue
            fields = " or ".join(f"'{f}' with {_RULE_WANTS[r]}" for f, r in spec.answer_rules)
            present = [f for f, _ in spec.answer_rules if _field(record, f) is not None]
            field = present[0] if present else spec.answer_rules[0][0]
            what = "has no answer" if present else "missing"
            raise DataFormatError(f"{path}: row {i}: field '{field}' {what} (expected {fields})")
        content = f"{question} {instruction}" if instruction else question
        rows.append(make_row(spec.data_source, content, ABILITY, answer, split, start + i))
    if not rows:
        raise DataFormatError(f"{path}: no rows to convert (expected at least one {source} record)")
    return rows


def _field(record: dict, name: str):
    """`record[name]`, else the value of a key equal to `name` ignoring case ("Problem", "Answer")."""
    if name in record:
        return record[name]
    return next((v for k, v in record.items() if isinstance(k, str) and k.lower() == name), None)


def _question(spec: Source, record: dict, path: str, i: int) -> str:
    for field in spec.question_fields:
        value = _field(record, field)
        if isinstance(value, str) and value.strip():
            text = value.strip()
            context = _field(record, spec.context_field) if spec.context_field else None
            if isinstance(context, str) and context.strip():
                text = f"{context.strip()}\n\n{text}"
            return text
        if value is not None:
            what = "is empty" if isinstance(value, str) else f"has type {type(value).__name__}"
            raise DataFormatError(f"{path}: row {i}: field '{field}' {what} (expected the problem text as a str)")
    names = " or ".join(f"'{f}'" for f in spec.question_fields)
    first = spec.question_fields[0]
    raise DataFormatError(f"{path}: row {i}: field '{first}' missing (expected {names} with the problem text)")


def _answer(spec: Source, record: dict) -> str | None:
    for field, rule in spec.answer_rules:
        answer = _RULES[rule](_field(record, field))
        if answer:
            return answer
    return None


# ------------------------------------------------------------------ command line


def _normalize(stem: str) -> str:
    return stem.lower().replace("-", "_")


def source_of_file(name: str) -> tuple[str, str | None] | None:
    """(source, split or None) for a file name `--all-from` recognises, else None."""
    stem, ext = os.path.splitext(name)
    if ext not in INPUT_EXTENSIONS:
        return None
    stem = _normalize(stem)
    split = None
    for suffix in ("_train", "_test"):
        if stem.endswith(suffix):
            stem, split = stem[: -len(suffix)], suffix[1:]
            break
    source = STEM_ALIASES.get(stem) or PART_STEMS.get(stem)
    return (source, split) if source else None


def split_of_part(path: str) -> str | None:
    """The split of one file of a multi-file source: shard name, `_train`/`_test` suffix, or a
    `train`/`test` folder on its path; None when nothing says."""
    stem = _normalize(os.path.splitext(os.path.basename(path))[0])
    shard = _SHARD.match(stem.replace("_", "-"))
    if shard:
        return shard.group(1) if shard.group(1) in SPLITS else "validation"
    if stem in SPLITS:
        return stem  # HuggingFaceH4/MATH-500's test.jsonl
    for suffix in ("_train", "_test"):
        if stem.endswith(suffix):
            return suffix[1:]
    for part in reversed(os.path.normpath(os.path.dirname(path)).split(os.sep)):
        if _normalize(part) in SPLITS:
            return _normalize(part)
    return None


def _other_config(source: str, rel: str) -> bool:
    """Whether a file of a source's folder lies under one of its other Hub configs (OTHER_CONFIGS)."""
    folders = os.path.normpath(os.path.dirname(rel)).split(os.sep)
    return any(_normalize(f) in OTHER_CONFIGS.get(source, ()) for f in folders)


def convert_dir(
    in_dir: str, out_dir: str, split: str | None, limit: int | None, instruction: str, skip_unanswerable: bool
) -> list[str]:
    """Convert every recognised file and source folder of `in_dir` to `<out_dir>/<source>_<split>.parquet`."""
    if not os.path.isdir(in_dir):
        raise DataFormatError(f"{in_dir}: no such directory (expected a folder of dataset files for --all-from)")
    # out path -> (what it came from, source, split, [files], whole file?)
    jobs: dict[str, tuple[str, str, str, list[str], bool]] = {}
    skipped = []

    def add(out_split: str, source: str, label: str, path: str, whole: bool) -> None:
        out = os.path.join(out_dir, f"{source}_{out_split}.parquet")
        if out in jobs:
            first, _, _, files, first_whole = jobs[out]
            if whole or first_whole:
                raise DataFormatError(f"{in_dir}: {first} and {label} both map to {out} (expected one file each)")
            files.append(path)
            return
        jobs[out] = (label, source, out_split, [path], whole)

    for name in sorted(os.listdir(in_dir)):
        path = os.path.join(in_dir, name)
        if os.path.isdir(path):
            source = STEM_ALIASES.get(_normalize(name))
            if source is None:
                skipped.append(name + "/")
                continue
            parts = expand_inputs([path]) if any(
                f.endswith(INPUT_EXTENSIONS) for _, _, fs in os.walk(path) for f in fs) else []
            if not parts:
                skipped.append(name + "/")
            for part in parts:
                if _other_config(source, os.path.relpath(part, path)):
                    skipped.append(os.path.relpath(part, in_dir))
                    continue
                part_split = split_of_part(os.path.relpath(part, in_dir))
                if part_split not in (None, *SPLITS):
                    skipped.append(os.path.relpath(part, in_dir))
                    continue
                if source in EVAL_ONLY:
                    part_split = "test"
                add(part_split or split or SOURCES[source].split, source, f"{name}/", part, whole=False)
            continue
        found = source_of_file(name)
        if found is None:
            skipped.append(name)
            continue
        source, file_split = found
        whole = _normalize(os.path.splitext(name)[0]).removesuffix(f"_{file_split}") not in PART_STEMS
        add(file_split or split or SOURCES[source].split, source, name, path, whole)
    if not jobs:
        names = ", ".join(sorted(set(STEM_ALIASES)))
        raise DataFormatError(
            f"{in_dir}: no recognised dataset files (expected <name>[_train|_test].parquet|jsonl|json or a "
            f"folder <name>/ of Hub shards, name one of {names})"
        )
    for name in skipped:
        print(f"skipped {os.path.join(in_dir, name)} (not a recognised dataset file)", file=sys.stderr)
    for out, (label, source, out_split, files, _) in jobs.items():
        if len(files) > 1:
            print(f"{out}: {len(files)} parts of {label}", file=sys.stderr)
        write_rows(convert_files(files, source, out_split, limit, instruction, skip_unanswerable), out)
    return list(jobs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m recipe_hacpo.data.prepare",
        description="Convert a math dataset (local json/jsonl/parquet, or the hub when asked) to verl RL parquet.",
    )
    parser.add_argument("--source", choices=sorted(SOURCES), help="which dataset the input is")
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument(
        "--input", nargs="+",
        help="local .parquet, .jsonl or .json files, directories or globs, concatenated in order "
        "(e.g. 'hendrycks_math/*/train-*.parquet', or aime2025-I.jsonl aime2025-II.jsonl)",
    )
    where.add_argument("--all-from", metavar="DIR", help="convert every recognised file in DIR; --out is a folder")
    where.add_argument("--from-hub", metavar="NAME", help="load NAME with datasets.load_dataset (needs network)")
    parser.add_argument("--out", required=True, help="output .parquet file (a folder with --all-from)")
    parser.add_argument("--split", help="split name written to extra_info.split (default: train for math, else test)")
    parser.add_argument("--limit", type=int, help="convert only the first N rows")
    parser.add_argument("--instruction", default=INSTRUCTION, help="appended to each problem; '' for none")
    parser.add_argument("--hub-config", help="dataset config for --from-hub (e.g. 'main' for openai/gsm8k)")
    parser.add_argument("--hub-split", help="hub split for --from-hub (default: the --split or the source's)")
    parser.add_argument(
        "--skip-unanswerable", action="store_true", help="drop rows without an answer instead of failing"
    )
    args = parser.parse_args(argv)
    if args.limit is not None and args.limit < 1:
        parser.error("--limit must be >= 1")
    if args.all_from is None and args.source is None:
        parser.error("--source is required with --input or --from-hub")
    if args.all_from is not None and (args.source or args.hub_config or args.hub_split):
        parser.error("--all-from picks each source from its file name; drop --source / --hub-config / --hub-split")
    if args.from_hub is None and (args.hub_config or args.hub_split):
        parser.error("--hub-config / --hub-split only apply with --from-hub")
    try:
        if args.all_from is not None:
            outs = convert_dir(
                args.all_from, args.out, args.split, args.limit, args.instruction, args.skip_unanswerable
            )
        else:
            split = args.split or SOURCES[args.source].split
            if args.input is not None:
                rows = convert_files(expand_inputs(args.input), args.source, split, args.limit, args.instruction,
                                     args.skip_unanswerable)
            else:
                records = read_hub(args.from_hub, args.hub_config, args.hub_split or split)
                label = f"hub:{args.from_hub}"
                rows = convert(args.source, records, label, split, args.limit, args.instruction, args.skip_unanswerable)
            write_rows(rows, args.out)
            outs = [args.out]
    except DataFormatError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for out in outs:
        print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
