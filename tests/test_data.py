"""Data for the recipe: schema validation, synthetic arithmetic, dataset conversion, verl loading."""

from __future__ import annotations

import json
import os
import re
import string

import pandas as pd
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

from recipe_hacpo.data import prepare, synthetic
from recipe_hacpo.data.schema import DataFormatError, make_row, validate_file, validate_rows, write_rows

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIXTURES = os.path.join(REPO, "tests", "fixtures", "data")
RAW = os.path.join(FIXTURES, "raw")
VARIANTS = os.path.join(FIXTURES, "variants")
SHIPPED_DIR = os.path.join(REPO, "data")
INSTR = " " + prepare.INSTRUCTION


def read(path: str) -> list[dict]:
    return pq.read_table(path).to_pylist()


def good_row(**changes) -> dict:
    row = make_row("openai/gsm8k", "What is 1+1?", "math", "2", "test", 0)
    row.update(changes)
    return row


# ------------------------------------------------------------------ schema validation


def test_valid_rows_pass_as_dataframe_from_parquet(tmp_path):
    path = str(tmp_path / "ok.parquet")
    write_rows([good_row(), good_row(extra_info={"split": "test", "index": 1})], path)
    validate_rows(pd.read_parquet(path), path)  # numpy arrays for list columns
    assert validate_file(path) == 2


BAD_ROWS = [
    ({"data_source": None}, "data_source", "missing"),
    ({"data_source": 3}, "data_source", "has type int"),
    ({"prompt": []}, "prompt", "is an empty list"),
    ({"prompt": "What is 1+1?"}, "prompt", "is a str, not a list of messages"),
    ({"prompt": [{"content": "hi"}]}, "prompt[0].role", "missing"),
    ({"prompt": [{"role": "user"}]}, "prompt[0].content", "missing"),
    ({"prompt": [{"role": "user", "content": "  "}]}, "prompt[0].content", "is empty"),
    ({"prompt": [{"role": "bot", "content": "hi"}]}, "prompt[0].role",
     "is 'bot', not one of system, user, assistant, tool"),
    ({"ability": 1.5}, "ability", "has type float"),
    ({"reward_model": {"style": "rule"}}, "reward_model.ground_truth", "missing"),
    ({"reward_model": {"style": "rule", "ground_truth": 2}}, "reward_model.ground_truth", "has type int"),
    ({"reward_model": {"style": "model", "ground_truth": "2"}}, "reward_model.style", "is 'model'"),
    ({"reward_model": "2"}, "reward_model", "has type str"),
    ({"extra_info": {"split": "test"}}, "extra_info.index", "missing"),
    ({"extra_info": {"split": "test", "index": "0"}}, "extra_info.index", "has type str"),
    ({"extra_info": {"index": 0}}, "extra_info.split", "missing"),
]


@pytest.mark.parametrize("change, field, problem", BAD_ROWS)
def test_first_bad_row_is_named_in_one_line(change, field, problem):
    df = pd.DataFrame([good_row(), good_row(), good_row(**change)])
    with pytest.raises(DataFormatError) as err:
        validate_rows(df, "x.parquet")
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"x.parquet: row 2: field '{field}' {problem} (expected ")
    assert message.endswith(")")


def test_missing_column_and_empty_dataset():
    df = pd.DataFrame([good_row()]).drop(columns=["reward_model"])
    with pytest.raises(DataFormatError, match=r"^d\.parquet: row 0: field 'reward_model' missing \(expected a dict"):
        validate_rows(df, "d.parquet")
    with pytest.raises(DataFormatError, match=r"^e\.parquet: no rows \(expected at least one row"):
        validate_rows(pd.DataFrame(columns=list(good_row())), "e.parquet")


def test_custom_prompt_key_and_json_files(tmp_path):
    row = good_row()
    row["messages"] = row.pop("prompt")
    validate_rows(pd.DataFrame([row]), "m.parquet", prompt_key="messages")
    with pytest.raises(DataFormatError, match=r"row 0: field 'prompt' missing"):
        validate_rows(pd.DataFrame([row]), "m.parquet")
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps(good_row(reward_model={"style": "rule", "ground_truth": ""})) + "\n")
    pattern = rf"^{re.escape(str(path))}: row 0: field 'reward_model.ground_truth' is empty"
    with pytest.raises(DataFormatError, match=pattern):
        validate_file(str(path))


def test_writer_refuses_bad_rows(tmp_path):
    with pytest.raises(DataFormatError, match=r"out\.parquet: row 1: field 'prompt' is an empty list"):
        write_rows([good_row(), good_row(prompt=[])], str(tmp_path / "out.parquet"))
    assert not (tmp_path / "out.parquet").exists()


# ------------------------------------------------------------------ synthetic arithmetic


def _parse_sum(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"(\d+)\+(\d+)=", text)
    assert match, text
    return int(match.group(1)), int(match.group(2))


@pytest.mark.parametrize("kind, width, answer_width", [("add1", 1, 1), ("add3", 4, 4)])
def test_synthetic_answers_are_correct(kind, width, answer_width):
    for split in synthetic.SPLITS:
        rows = synthetic.generate(kind, split, 300, seed=3)
        for i, row in enumerate(rows):
            assert row["data_source"] == f"hacpo/arith/{kind}"
            assert row["extra_info"] == {"split": split, "index": i}
            (message,) = row["prompt"]
            assert message["role"] == "user"
            a, b = _parse_sum(message["content"])
            assert message["content"] == f"{a:0{width}d}+{b:0{width}d}="
            assert row["reward_model"] == {"style": "rule", "ground_truth": f"{a + b:0{answer_width}d}"}
            if kind == "add1":
                assert a + b < 10
            else:
                assert a < 1000 and b < 1000
        check_unique = synthetic.KINDS[kind].distinct
        texts = [r["prompt"][0]["content"] for r in rows]
        assert not check_unique or len(set(texts)) == len(texts)


def test_synthetic_is_deterministic_and_seeded():
    assert synthetic.generate("add3", "train", 200, 7) == synthetic.generate("add3", "train", 200, 7)
    assert synthetic.generate("add3", "train", 200, 7) != synthetic.generate("add3", "train", 200, 8)


@pytest.mark.parametrize("kind", sorted(synthetic.KINDS))
def test_synthetic_splits_are_disjoint_across_seeds(kind):
    def problems(split):
        return {r["prompt"][0]["content"] for seed in range(3) for r in synthetic.generate(kind, split, 500, seed)}

    train, test = problems("train"), problems("test")
    assert train and test and not train & test
    assert all(synthetic.split_of(t) == "test" for t in test)


def test_add1_covers_its_small_pool():
    texts = {r["prompt"][0]["content"] for r in synthetic.generate("add1", "train", 256, 0)}
    texts |= {r["prompt"][0]["content"] for r in synthetic.generate("add1", "test", 64, 0)}
    assert len(texts) == 55  # every pair a+b<10 shows up in one split or the other


def test_synthetic_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unknown kind 'add9'"):
        synthetic.generate("add9", "train", 1, 0)
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        synthetic.generate("add1", "dev", 1, 0)


@pytest.mark.parametrize("kind", sorted(synthetic.SHIPPED))
def test_shipped_files_equal_regenerated_ones(kind, tmp_path):
    args = synthetic.SHIPPED[kind]
    argv = ["--kind", kind, "--out", str(tmp_path), "--n-train", str(args["n_train"]),
            "--n-test", str(args["n_test"]), "--seed", str(args["seed"])]
    assert synthetic.main(argv) == 0
    for split in synthetic.SPLITS:
        shipped = synthetic.output_path(SHIPPED_DIR, kind, split)
        fresh = synthetic.output_path(str(tmp_path), kind, split)
        assert os.path.getsize(shipped) < 200_000
        assert read(shipped) == read(fresh)
        with open(shipped, "rb") as a, open(fresh, "rb") as b:
            same = a.read() == b.read()
        writer = pq.ParquetFile(shipped).metadata.created_by
        assert same, f"{shipped} (written by {writer}) differs byte-wise from a fresh run: regenerate it with the CLI"
        assert len(read(shipped)) == args[f"n_{split}"]


# ------------------------------------------------------------------ conversion of the paper's datasets


def _prompt(question: str) -> list[dict]:
    return [{"role": "user", "content": question + INSTR}]


EXPECTED_ANSWERS = {
    "math_train.jsonl": ("math", "lighteval/MATH", "train", ["5", "\\frac{1}{2}", "\\{1,2\\}", "6"]),
    "math500_test.json": ("math500", "HuggingFaceH4/MATH-500", "test",
                          ["\\left( 3, \\frac{\\pi}{2} \\right)", "12", "5"]),
    "gsm8k_test.jsonl": ("gsm8k", "openai/gsm8k", "test", ["72", "3600", "-2", "2.5"]),
    "aime25.parquet": ("aime25", "aime25", "test", ["70", "117", "002"]),
    "amc23.parquet": ("amc23", "amc23", "test", ["27", "1.5", "9"]),
    "minerva.jsonl": ("minerva", "minerva", "test", ["66", "500", "1"]),
    "olympiadbench.parquet": ("olympiadbench", "olympiadbench", "test", ["1", "2, -2", "5"]),
}


@pytest.mark.parametrize("name", sorted(EXPECTED_ANSWERS))
def test_convert_each_source_field_by_field(name, tmp_path):
    source, data_source, split, answers = EXPECTED_ANSWERS[name]
    path = os.path.join(RAW, name)
    records = prepare.read_records(path)
    out = str(tmp_path / "out.parquet")
    assert prepare.main(["--source", source, "--input", path, "--out", out]) == 0
    rows = read(out)
    assert len(rows) == len(records) == len(answers)
    question_field = next(f for f in prepare.SOURCES[source].question_fields if f in records[0])
    for i, (row, record, answer) in enumerate(zip(rows, records, answers)):
        question = record[question_field].strip()
        if record.get("context"):
            question = record["context"] + "\n\n" + question
        assert row == {
            "data_source": data_source,
            "prompt": _prompt(question),
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": split, "index": i},
        }


VARIANT_ANSWERS = {
    "math.parquet": ("math", ["42", "4", "3"]),
    "math500.parquet": ("math500", ["\\left( 3, \\frac{\\pi}{2} \\right)", "12"]),
    "gsm8k_columns.json": ("gsm8k", ["72", "3600", "-2"]),
    "gsm8k_lines.json": ("gsm8k", ["72", "3600", "-2"]),
    "aime25_question.json": ("aime25", ["70", "117", "002"]),
    "aime25_capitalized.jsonl": ("aime25", ["70", "117"]),
    "amc23_problem.jsonl": ("amc23", ["27", "1.5", "9"]),
    "minerva_answer.parquet": ("minerva", ["66", "500", "1"]),
    "olympiadbench.json": ("olympiadbench", ["1", "2, -2", "5"]),
}


@pytest.mark.parametrize("name", sorted(VARIANT_ANSWERS))
def test_convert_published_variants(name):
    source, answers = VARIANT_ANSWERS[name]
    path = os.path.join(VARIANTS, name)
    rows = prepare.convert(source, prepare.read_records(path), path)
    assert [r["reward_model"]["ground_truth"] for r in rows] == answers
    assert all(r["data_source"] == prepare.SOURCES[source].data_source for r in rows)
    assert all(r["prompt"][0]["content"].endswith(INSTR) and len(r["prompt"][0]["content"]) > len(INSTR) for r in rows)


def test_same_rows_from_json_jsonl_and_parquet():
    jsonl = prepare.convert("gsm8k", prepare.read_records(os.path.join(RAW, "gsm8k_test.jsonl")), "a")[:3]
    for name in ("gsm8k_columns.json", "gsm8k_lines.json"):
        assert prepare.convert("gsm8k", prepare.read_records(os.path.join(VARIANTS, name)), "b") == jsonl
    oly = [os.path.join(RAW, "olympiadbench.parquet"), os.path.join(VARIANTS, "olympiadbench.json")]
    oly_parquet, oly_json = (prepare.convert("olympiadbench", prepare.read_records(p), p) for p in oly)
    assert oly_parquet == oly_json


def test_split_limit_and_instruction_options(tmp_path):
    out = str(tmp_path / "m.parquet")
    argv = ["--source", "math", "--input", os.path.join(RAW, "math_train.jsonl"), "--out", out,
            "--split", "test", "--limit", "2", "--instruction", "Answer in \\boxed{}."]
    assert prepare.main(argv) == 0
    rows = read(out)
    assert [r["extra_info"] for r in rows] == [{"split": "test", "index": 0}, {"split": "test", "index": 1}]
    assert rows[0]["prompt"][0]["content"] == "What is $2+3$? Answer in \\boxed{}."
    assert prepare.main(argv[:-2] + ["--instruction", ""]) == 0
    assert read(out)[0]["prompt"][0]["content"] == "What is $2+3$?"


def test_all_from_converts_every_recognised_file(tmp_path, capsys):
    src = tmp_path / "raw"
    src.mkdir()
    for name in os.listdir(RAW):
        (src / name).write_bytes(open(os.path.join(RAW, name), "rb").read())
    (src / "notes.txt").write_text("not data")
    out = tmp_path / "out"
    assert prepare.main(["--all-from", str(src), "--out", str(out)]) == 0
    assert sorted(os.listdir(out)) == [
        "aime25_test.parquet", "amc23_test.parquet", "gsm8k_test.parquet", "math500_test.parquet",
        "math_train.parquet", "minerva_test.parquet", "olympiadbench_test.parquet",
    ]
    assert "skipped" in capsys.readouterr().err
    for name in os.listdir(out):
        validate_file(str(out / name))


@pytest.mark.parametrize("name, source", [
    ("MATH-500.jsonl", ("math500", None)), ("gsm8k_train.parquet", ("gsm8k", "train")),
    ("AIME_2025.json", ("aime25", None)), ("math_test.jsonl", ("math", "test")), ("readme.md", None),
    ("math_validation.jsonl", None),
])
def test_file_names_all_from_recognises(name, source):
    assert prepare.source_of_file(name) == source


CONVERT_ERRORS = [
    ("math", [{"problem": "p", "level": "Level 1"}],
     r"^f\.jsonl: row 0: field 'answer' missing "
     r"\(expected 'answer' with an answer value or 'solution' with a \\boxed\{\} answer\)$"),
    ("math", [{"problem": "p", "solution": "no box here"}],
     r"^f\.jsonl: row 0: field 'solution' has no answer \(expected"),
    ("math", [{"problem": "p", "solution": "ok \\boxed{1}"}, {"problem": "q", "solution": "\\boxed{2"}],
     r"^f\.jsonl: row 1: field 'solution' has no answer \(expected"),
    ("gsm8k", [{"question": "q", "answer": "12"}],
     r"^f\.jsonl: row 0: field 'answer' has no answer \(expected 'answer' with a '#### <answer>' line\)$"),
    ("gsm8k", [{"question": "", "answer": "#### 1"}], r"^f\.jsonl: row 0: field 'question' is empty \(expected"),
    ("aime25", [{"answer": "1"}], r"^f\.jsonl: row 0: field 'problem' missing \(expected 'problem' or 'question'"),
    ("amc23", [{"question": 5, "answer": "1"}], r"^f\.jsonl: row 0: field 'question' has type int"),
    ("olympiadbench", [{"question": "q", "final_answer": []}], r"^f\.jsonl: row 0: field 'final_answer' has no answer"),
    ("minerva", ["not a record"], r"^f\.jsonl: row 0: is str \(expected a JSON object"),
    ("minerva", [], r"^f\.jsonl: no rows to convert"),
]


@pytest.mark.parametrize("source, records, pattern", CONVERT_ERRORS)
def test_conversion_errors_name_file_row_and_field(source, records, pattern):
    with pytest.raises(DataFormatError, match=pattern) as err:
        prepare.convert(source, records, "f.jsonl")
    assert "\n" not in str(err.value)


def test_skip_unanswerable_drops_rows_and_keeps_source_index():
    records = [{"problem": "p", "solution": "none"}, {"problem": "q", "solution": "\\boxed{2}"}]
    rows = prepare.convert("math", records, "f", skip_unanswerable=True)
    assert [(r["extra_info"]["index"], r["reward_model"]["ground_truth"]) for r in rows] == [(1, "2")]


def test_bad_input_files_fail_in_one_line(tmp_path, capsys):
    bad = tmp_path / "b.jsonl"
    bad.write_text('{"question": "q", "answer": "#### 1"}\n{oops\n')
    assert prepare.main(["--source", "gsm8k", "--input", str(bad), "--out", str(tmp_path / "o.parquet")]) == 1
    err = capsys.readouterr().err.strip()
    pattern = rf"error: {re.escape(str(bad))}: line 2: invalid JSON \(.*\) \(expected one JSON object per line\)"
    assert re.fullmatch(pattern, err)
    scalar = tmp_path / "s.json"
    scalar.write_text('"just a string"')
    with pytest.raises(DataFormatError, match="top-level JSON is not a list of records"):
        prepare.read_records(str(scalar))


def test_hub_failure_is_one_clear_line(monkeypatch, tmp_path, capsys):
    import datasets

    def unreachable(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)\nmore detail")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    out = str(tmp_path / "g.parquet")
    argv = ["--source", "gsm8k", "--from-hub", "openai/gsm8k", "--hub-config", "main", "--out", out]
    assert prepare.main(argv) == 1
    err = capsys.readouterr().err.strip()
    assert err == ("error: hub:openai/gsm8k: cannot load split 'test' (ConnectionError: Couldn't reach 'openai/gsm8k' "
                   "on the Hub (LocalEntryNotFoundError)); download the files elsewhere and pass --input")


def test_hub_rows_are_converted(monkeypatch, tmp_path):
    import datasets

    calls = []

    class FakeDataset:
        def to_list(self):
            return [{"question": "Two plus two?", "answer": "2+2=4\n#### 4"}]

    def fake_load(name, config, split):
        calls.append((name, config, split))
        return FakeDataset()

    monkeypatch.setattr(datasets, "load_dataset", fake_load)
    out = str(tmp_path / "g.parquet")
    assert prepare.main(["--source", "gsm8k", "--from-hub", "openai/gsm8k", "--hub-config", "main", "--out", out]) == 0
    assert calls == [("openai/gsm8k", "main", "test")]
    assert read(out)[0]["reward_model"]["ground_truth"] == "4"


@pytest.mark.parametrize("text, boxed", [
    ("$\\boxed{5}$", "5"),
    ("\\boxed{\\frac{1}{\\sqrt{2}}}", "\\frac{1}{\\sqrt{2}}"),
    ("first \\boxed{1} then \\boxed{2}", "2"),
    ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),
    ("\\boxed{a\\}b}", "a\\}b"),
    ("\\boxed 42$", "42"),
    ("\\boxed {7}", "7"),
    ("\\fbox{3}", "3"),
    ("\\boxed{1", None),
    ("no answer", None),
    ("\\boxed{}", None),
])
def test_last_boxed(text, boxed):
    assert prepare.last_boxed(text) == boxed


def _balanced(depth: int = 0):
    atom = st.text(alphabet="ab12+-\\^_ ", max_size=4).filter(lambda t: not t.endswith("\\"))
    if depth >= 3:
        return atom
    group = _balanced(depth + 1).map(lambda t: "{" + t + "}")
    return st.lists(st.one_of(atom, group), max_size=4).map("".join)


@given(inner=_balanced().filter(lambda t: t.strip()), before=st.sampled_from(["", "so $", "\\boxed{0} then "]))
def test_last_boxed_returns_any_balanced_content(inner, before):
    assert prepare.last_boxed(f"{before}\\boxed{{{inner}}}$.") == inner.strip()


# ------------------------------------------------------------------ verl loads what we write


def _char_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<pad>", "<eos>", "<|user|>", "<|assistant|>", "<|system|>"]
    chars = list(dict.fromkeys(string.printable))
    vocab = {t: i for i, t in enumerate(specials + chars)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)
    template = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<eos>{% endfor %}"
                "{% if add_generation_prompt %}<|assistant|>{% endif %}")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>",
                                   eos_token="<eos>", chat_template=template)


def _tokenizers():
    yield pytest.param(_char_tokenizer, id="in-test-char")
    try:
        from recipe_hacpo.tiny_agents import build_pair_tokenizer
    except ImportError:
        return
    yield pytest.param(build_pair_tokenizer, id="tiny-agents-pair")


@pytest.mark.parametrize("make_tokenizer", list(_tokenizers()))
def test_verl_rlhf_dataset_loads_our_files(make_tokenizer, tmp_path):
    from omegaconf import OmegaConf
    from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn

    math_out = str(tmp_path / "math500.parquet")
    write_rows(prepare.convert("math500", prepare.read_records(os.path.join(RAW, "math500_test.json")), "m"), math_out)
    arith = synthetic.output_path(SHIPPED_DIR, "add1", "test")
    config = OmegaConf.create({
        "prompt_key": "prompt", "max_prompt_length": 64, "filter_overlong_prompts": True,
        "filter_overlong_prompts_workers": 1, "truncation": "error", "cache_dir": str(tmp_path / "cache"),
    })
    dataset = RLHFDataset([arith, math_out], make_tokenizer(), config)
    assert len(dataset) == 64  # the three MATH-500 prompts are longer than 64 tokens and are filtered out
    item = dataset[5]
    expected = read(arith)[5]
    assert item["raw_prompt"] == expected["prompt"]
    assert item["data_source"] == "hacpo/arith/add1"
    assert item["reward_model"] == expected["reward_model"]
    assert item["index"] == 5 and item["extra_info"] == {"split": "test", "index": 5}
    batch = collate_fn([dataset[i] for i in range(4)])
    assert list(batch["data_source"]) == ["hacpo/arith/add1"] * 4

    config.max_prompt_length = 4096
    both = RLHFDataset([arith, math_out], make_tokenizer(), config)
    assert len(both) == 64 + 3
    assert both[64]["data_source"] == "HuggingFaceH4/MATH-500"
    assert both[64]["reward_model"]["ground_truth"] == "\\left( 3, \\frac{\\pi}{2} \\right)"


# ------------------------------------------------------------------ the Hub's file layouts


def _parquet(path, records):
    import pyarrow as pa

    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(pa.Table.from_pylist(records), path)


def _jsonl(path, records):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)


def _math(n, subject):
    return [{"problem": f"{subject} {i}", "solution": f"so \\boxed{{{i}}}", "type": subject} for i in range(n)]


def _read(path):
    return pq.read_table(path).to_pylist()


def test_input_directory_of_shards_is_concatenated_in_order(tmp_path, capsys):
    shards = tmp_path / "MATH-500" / "data"
    _parquet(str(shards / "test-00001-of-00002.parquet"), [{"problem": "b", "answer": "2"}])
    _parquet(str(shards / "test-00000-of-00002.parquet"), [{"problem": "a", "answer": "1"}, {"problem": "c", "answer": "3"}])
    out = tmp_path / "m.parquet"
    assert prepare.main(["--source", "math500", "--input", str(tmp_path / "MATH-500"), "--out", str(out)]) == 0
    rows = _read(out)
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["1", "3", "2"]
    assert [r["extra_info"]["index"] for r in rows] == [0, 1, 2]


def test_input_glob_over_the_seven_subject_configs(tmp_path):
    subjects = ["algebra", "counting_and_probability", "geometry", "intermediate_algebra", "number_theory",
                "prealgebra", "precalculus"]
    root = tmp_path / "hendrycks_math"
    for k, subject in enumerate(subjects):
        _parquet(str(root / subject / "train-00000-of-00001.parquet"), _math(k + 1, subject))
        _parquet(str(root / subject / "test-00000-of-00001.parquet"), _math(1, subject))
    out = tmp_path / "math_train.parquet"
    assert prepare.main(["--source", "math", "--input", str(root / "*" / "train-*.parquet"), "--out", str(out)]) == 0
    rows = _read(out)
    assert len(rows) == sum(range(1, 8)) and {r["extra_info"]["split"] for r in rows} == {"train"}
    assert rows[0]["prompt"][0]["content"].startswith("algebra 0") and rows[-1]["prompt"][0]["content"].startswith("precalculus 6")
    # --limit counts over all the files
    assert prepare.main(["--source", "math", "--input", str(root / "*" / "train-*.parquet"), "--out", str(out), "--limit", "4"]) == 0
    assert len(_read(out)) == 4


def test_input_aime_2025_parts_one_and_two(tmp_path):
    one = [{"question": f"I.{i}", "answer": str(i)} for i in range(15)]
    two = [{"question": f"II.{i}", "answer": str(100 + i)} for i in range(15)]
    _jsonl(str(tmp_path / "aime2025-I.jsonl"), one)
    _jsonl(str(tmp_path / "aime2025-II.jsonl"), two)
    out = tmp_path / "aime.parquet"
    argv = ["--source", "aime25", "--input", str(tmp_path / "aime2025-I.jsonl"), str(tmp_path / "aime2025-II.jsonl")]
    assert prepare.main(argv + ["--out", str(out)]) == 0
    rows = _read(out)
    assert len(rows) == 30 and rows[15]["reward_model"]["ground_truth"] == "100"
    assert {r["data_source"] for r in rows} == {"aime25"}


def test_input_that_matches_nothing_fails_in_one_line(tmp_path, capsys):
    assert prepare.main(["--source", "math", "--input", str(tmp_path / "*.parquet"), "--out", str(tmp_path / "o.parquet")]) == 1
    err = capsys.readouterr().err
    assert "matches no .parquet, .jsonl or .json file" in err and err.count("\n") == 1


def test_all_from_reads_hub_folders_and_aime_parts(tmp_path, capsys):
    raw = tmp_path / "raw"
    for subject in ("algebra", "geometry"):
        _parquet(str(raw / "hendrycks_math" / subject / "train-00000-of-00001.parquet"), _math(2, subject))
        _parquet(str(raw / "hendrycks_math" / subject / "test-00000-of-00001.parquet"), _math(1, subject))
    _parquet(str(raw / "MATH-500" / "test-00000-of-00001.parquet"), [{"problem": "p", "answer": "7"}])
    _parquet(str(raw / "gsm8k" / "main" / "test-00000-of-00001.parquet"), [{"question": "q", "answer": "x #### 1,000"}])
    _parquet(str(raw / "gsm8k" / "main" / "train-00000-of-00001.parquet"), [{"question": "q", "answer": "x #### 2"}])
    _jsonl(str(raw / "aime2025-I.jsonl"), [{"question": "a", "answer": "1"}])
    _jsonl(str(raw / "aime2025-II.jsonl"), [{"question": "b", "answer": "2"}, {"question": "c", "answer": "3"}])
    _jsonl(str(raw / "minerva" / "validation-00000-of-00001.jsonl"), [{"problem": "v", "answer": "0"}])
    # Hothan/OlympiadBench calls its one split "train": a benchmark is written as test
    _parquet(str(raw / "OlympiadBench" / "OE_TO_maths_en_COMP" / "train-00000-of-00001.parquet"),
             [{"question": "o", "final_answer": ["5"]}])
    out = tmp_path / "out"
    assert prepare.main(["--all-from", str(raw), "--out", str(out)]) == 0
    assert sorted(os.listdir(out)) == [
        "aime25_test.parquet", "gsm8k_test.parquet", "gsm8k_train.parquet", "math500_test.parquet",
        "math_test.parquet", "math_train.parquet", "olympiadbench_test.parquet",
    ]
    assert len(_read(out / "math_train.parquet")) == 4 and len(_read(out / "math_test.parquet")) == 2
    assert [r["reward_model"]["ground_truth"] for r in _read(out / "aime25_test.parquet")] == ["1", "2", "3"]
    assert _read(out / "gsm8k_test.parquet")[0]["reward_model"]["ground_truth"] == "1000"
    err = capsys.readouterr().err
    assert "validation-00000-of-00001.jsonl (not a recognised dataset file)" in err
    for name in os.listdir(out):
        validate_file(str(out / name))


def test_all_from_keeps_gsm8ks_main_config_of_a_hub_download(tmp_path, capsys):
    """openai/gsm8k as the hub downloads it: `main/` and `socratic/` (the same problems, answers with
    sub-questions); GSM8K is `main` alone, socratic's shards are named as skipped."""
    raw = tmp_path / "raw"
    for config, answer in (("main", "x #### 3"), ("socratic", "How many? ** x #### 3")):
        _parquet(str(raw / "gsm8k" / config / "test-00000-of-00001.parquet"),
                 [{"question": f"{config} {i}", "answer": answer} for i in range(2)])
        _parquet(str(raw / "gsm8k" / config / "train-00000-of-00001.parquet"), [{"question": config, "answer": answer}])
    out = tmp_path / "out"
    assert prepare.main(["--all-from", str(raw), "--out", str(out)]) == 0
    test, train = _read(out / "gsm8k_test.parquet"), _read(out / "gsm8k_train.parquet")
    assert [r["prompt"][0]["content"].split(" Let's")[0] for r in test] == ["main 0", "main 1"]
    assert len(train) == 1 and train[0]["prompt"][0]["content"].startswith("main")
    err = capsys.readouterr().err
    assert os.path.join("gsm8k", "socratic", "test-00000-of-00001.parquet") + " (not a recognised dataset file)" in err


def test_all_from_still_refuses_two_whole_files_for_one_output(tmp_path, capsys):
    raw = tmp_path / "raw"
    _jsonl(str(raw / "math_train.jsonl"), _math(1, "x"))
    _parquet(str(raw / "hendrycks_math" / "algebra" / "train-00000-of-00001.parquet"), _math(1, "algebra"))
    assert prepare.main(["--all-from", str(raw), "--out", str(tmp_path / "out")]) == 1
    assert "both map to" in capsys.readouterr().err


@pytest.mark.parametrize("path, split", [
    ("math500/test-00000-of-00001.parquet", "test"),
    ("hendrycks_math/algebra/train-00000-of-00001.parquet", "train"),
    ("gsm8k/main/test-00003-of-00010.parquet", "test"),
    ("x/validation-00000-of-00001.parquet", "validation"),
    ("amc23/amc23_test.jsonl", "test"),
    ("olympiadbench/test/OE_TO_maths_en_COMP.parquet", "test"),
    ("aime2025/aime2025-I.jsonl", None),
    ("MATH-500/test.jsonl", "test"),
])
def test_split_of_a_part(path, split):
    assert prepare.split_of_part(path) == split


# --------------------------------------------------------------------------- unreadable files
def _good_parquet(tmp_path) -> str:
    path = str(tmp_path / "good.parquet")
    write_rows([make_row("d", "What is 1+1?", "math", "2", "train", 0)], path)
    return path


def _corrupt_files(tmp_path) -> dict[str, str]:
    good = open(_good_parquet(tmp_path), "rb").read()
    files = {
        "truncated.parquet": good[: len(good) // 2],
        "random.parquet": bytes(range(256)) * 4,
        "empty.parquet": b"",
        "text.parquet": b"data_source,prompt\nx,y\n",
        "badline.jsonl": json.dumps(make_row("d", "q", "math", "1", "train", 0)).encode() + b"\n{not json\n",
        "notobjects.json": b"[1, 2, 3]",
        "latin1.jsonl": "caf\xe9".encode("latin-1"),
    }
    out = {}
    for name, data in files.items():
        p = tmp_path / name
        p.write_bytes(data)
        out[name] = str(p)
    return out


def test_every_unreadable_or_corrupt_file_is_one_line_naming_it(tmp_path):
    for name, path in _corrupt_files(tmp_path).items():
        with pytest.raises(DataFormatError) as info:
            validate_file(path)
        msg = str(info.value)
        assert msg.startswith(path + ": ") and "\n" not in msg, (name, msg)
    with pytest.raises(DataFormatError, match=r"badline.jsonl: line 2: not valid JSON"):
        validate_file(str(tmp_path / "badline.jsonl"))
    with pytest.raises(DataFormatError, match=r"truncated.parquet: not a readable parquet file"):
        validate_file(str(tmp_path / "truncated.parquet"))


def test_corrupt_parquet_stops_the_cli_with_one_line_before_ray(tmp_path, tiny_agent_paths):
    import subprocess
    import sys

    bad = _corrupt_files(tmp_path)["truncated.parquet"]
    r = subprocess.run([sys.executable, "-m", "recipe_hacpo.main", "--config-name", "hacpo_cpu_demo",
                        f"agents.qwen_char.model_path={tiny_agent_paths['qwen2-char-small']}",
                        f"agents.llama_pair.model_path={tiny_agent_paths['llama-pair-medium']}",
                        f"data.train_files={bad}", f"hydra.run.dir={tmp_path}/hydra"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().splitlines()[-1].startswith(f"error: {bad}: not a readable parquet file (")
    assert "Traceback" not in r.stderr
    assert "Ray" not in r.stdout + r.stderr
